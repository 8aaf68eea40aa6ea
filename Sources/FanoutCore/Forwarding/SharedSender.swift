// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import Logging
import SystemCalls
import CSystemShim
import ReusePortLB
import Synchronization

/// The way out of one forwarding thread's `output: socket` datagrams: one unconnected UDP socket
/// per address family, and one sendmmsg per batch whatever the number of downstreams, a
/// destination per message (what a connected socket per downstream cannot do: a batch spread
/// over 300 downstreams would be 300 system calls).
///
/// Each ``DownstreamOutbox`` stages its datagrams here (``DownstreamOutbox/stage()``), GSO runs as it built them
/// for its own socket, or the forwarding thread stages them from the downstream's record in its
/// table (``DestinationRecord``); ``send()`` sends everything staged and gives each message's
/// outcome back to its ``Owner``.
///
/// ICMP errors: the sockets have IP_RECVERR (IPV6_RECVERR), so an ICMP error about a datagram is
/// queued with the destination it was about (``takeErrors()``: the forwarder reports a port
/// unreachable to passive health and moves that downstream to its own connected socket for a
/// while, where the kernel's per-downstream semantics apply). The kernel also keeps the error as
/// the socket's pending error, which fails the next send whatever its destination: a message
/// that fails while the error queue held entries is sent again (up to ``maximumRetries`` times,
/// each time only if the queue held more, or the error was ECONNREFUSED, which an
/// unconnected socket only gets from its pending error), so a healthy downstream does not pay for another's
/// ICMP unless errors keep arriving faster than that. Datagrams arriving at the sockets (replies
/// to a one-way forwarder) are dropped by a socket filter before any queue.
final class SharedSender {
    /// Whose a staged message is: the outbox that answers for it, and when the forwarding thread
    /// staged it itself, the downstream's record in the thread's table, where a delivery is
    /// counted without touching the outbox (``DestinationRecord``). A failure is always the
    /// outbox's to count (and the record says so: ``DestinationRecord/Flags/outboxHolds``).
    struct Owner {
        let outbox: Unmanaged<DownstreamOutbox>
        let record: UnsafeMutablePointer<DestinationRecord>?

        init(_ outbox: DownstreamOutbox) {
            self.outbox = .passUnretained(outbox)
            record = nil
        }

        init(_ record: UnsafeMutablePointer<DestinationRecord>) {
            outbox = record.pointee.outbox
            self.record = record
        }

        /// The shared sender sent `message`: a message the thread staged from a record is counted
        /// there and in `total` (the thread's batch), others by their outbox.
        @inline(__always)
        func delivered(_ message: msghdr, _ total: inout (sent: UInt64, bytes: UInt64)) {
            guard let record else {
                outbox._withUnsafeGuaranteedRef { $0.delivered(message) }
                return
            }
            var bytes = 0
            for index in 0..<message.msg_iovlen { bytes += message.msg_iov[index].iov_len }
            record.pointee.sent += UInt64(message.msg_iovlen)
            record.pointee.bytes += UInt64(bytes)
            total.sent += UInt64(message.msg_iovlen)
            total.bytes += UInt64(bytes)
        }

        /// The shared sender could not send `message` (`error`).
        func failed(_ message: msghdr, _ error: Int32) {
            outbox._withUnsafeGuaranteedRef { $0.failed(message, error) }
            record?.pointee.flags |= DestinationRecord.Flags.outboxHolds
        }
    }

    /// One family's socket and staged messages.
    private struct Lane {
        var socket: Int32 = -1
        /// errno of the socket's creation (0: made, or not tried yet); not tried again.
        var failure: Int32 = 0
        var headers: UnsafeMutablePointer<shim_mmsghdr>
        var controls: UnsafeMutableRawPointer
        var owners: UnsafeMutablePointer<Owner>
        var count = 0
        /// The listener's own datagrams among the staged messages (not pool or template copies),
        /// noted handed in the thread's crash ledger slot just before the first send call.
        var carried = 0
        var ledger: CrashLedger.Slot?
    }

    /// Messages staged per family before a send is forced.
    let capacity: Int
    private let controlSpace = Int(shim_udp_segment_space())
    @exclusivity(unchecked) private var lanes: [Lane]
    /// ICMP errors read from the error queues since the last ``takeErrors()``: the destination
    /// and the errno (ECONNREFUSED: port unreachable).
    @exclusivity(unchecked) private var errors: [(SocketAddress, Int32)] = []
    /// The destinations in ``errors`` (one entry each).
    @exclusivity(unchecked) private var erred = Set<SocketAddress>()
    /// Destinations reported to passive health since the last ``send()`` (at most once a batch).
    @exclusivity(unchecked) private var reported = Set<SocketAddress>()
    /// Datagrams and bytes delivered of the messages staged from records (``Owner/record``) since
    /// the forwarder last took them (``takeDeliveredFromTable()``).
    @exclusivity(unchecked) private var deliveredFromTable: (sent: UInt64, bytes: UInt64) = (0, 0)
    /// sendmmsg calls made (tests check that a batch costs one).
    @exclusivity(unchecked) private(set) var sendCalls = 0
    /// Messages sent (tests check that a GSO run is one).
    @exclusivity(unchecked) private(set) var messagesSent = 0
    /// Sends that found the send buffer full and failed the rest of their lane (tests).
    @exclusivity(unchecked) private(set) var sendBufferFullCalls = 0
    /// Scratch headers for a GSO message resent one datagram per message, and their owner.
    private let single: UnsafeMutablePointer<shim_mmsghdr>
    private let singleOwners: UnsafeMutablePointer<Owner>

    private let logger: Logger
    /// The thread's raw sockets for `output: preserve_source` downstreams and pool members, sent
    /// with the rest by ``send()``.
    let raw: SharedRawSender

    /// - Parameter logger: where a socket that cannot be made is reported (once per family).
    /// The sockets' send buffer (SO_SNDBUFFORCE where allowed, else SO_SNDBUF up to wmem_max).
    private let sendBuffer: Int32

    /// - Parameters:
    ///   - sendBuffer: the sockets' send buffer in bytes: one socket carries every downstream of
    ///     the thread, so it is large by default (tests make it small to fill it).
    ///   - transparent: preserve_source copies of clients whose address is not the host's go
    ///     through UDP sockets bound to them (``TransparentSockets``); false: all through the raw socket.
    ///   - counters: the listener's, whose gauge counts those sockets (nil: none).
    init(capacity: Int, logger: Logger = Logger(label: "udp-fanout.shared-sender"), sendBuffer: Int32 = 16 << 20, transparent: Bool = true,
         counters: ListenerCounters? = nil) {
        self.logger = logger
        self.sendBuffer = sendBuffer
        self.capacity = max(capacity, DownstreamOutbox.maximumSegments)
        raw = SharedRawSender(sendBuffer: sendBuffer, logger: logger, transparent: transparent, counters: counters)
        let space = controlSpace
        lanes = (0..<2).map { _ in
            let lane = Lane(headers: .allocate(capacity: max(capacity, DownstreamOutbox.maximumSegments)),
                            controls: .allocate(byteCount: max(capacity, DownstreamOutbox.maximumSegments) * space, alignment: 16),
                            owners: .allocate(capacity: max(capacity, DownstreamOutbox.maximumSegments)))
            for index in 0..<max(capacity, DownstreamOutbox.maximumSegments) { lane.headers[index] = shim_mmsghdr() }
            return lane
        }
        single = .allocate(capacity: DownstreamOutbox.maximumSegments)
        singleOwners = .allocate(capacity: DownstreamOutbox.maximumSegments)
        for index in 0..<DownstreamOutbox.maximumSegments { single[index] = shim_mmsghdr() }
    }

    deinit {
        for lane in lanes {
            if lane.socket >= 0 { close(lane.socket) }
            lane.headers.deallocate()
            lane.controls.deallocate()
            lane.owners.deallocate()
        }
        single.deallocate()
        singleOwners.deallocate()
    }

    private static func lane(_ family: Int32) -> Int { family == AF_INET6 ? 1 : 0 }

    /// The family's socket, made on first use: -1 if it cannot be made (then every outbox of the
    /// family sends through its own connected socket).
    private func socket(_ lane: Int, family: Int32) -> Int32 {
        if lanes[lane].socket >= 0 || lanes[lane].failure != 0 { return lanes[lane].socket }
        var made: Int32 = -1
        do throws(SystemCallError) {
            let fd = try Syscall.socket(family, Socket.datagram | Socket.nonBlocking | Socket.closeOnExec)
            made = fd
            if (try? Syscall.setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, sendBuffer)) == nil {
                try? Syscall.setsockopt(fd, SOL_SOCKET, SO_SNDBUF, sendBuffer)
            }
            // The error queue is charged to the receive buffer (no datagram is queued there):
            // room for thousands of ICMP errors, so each is named, not only the socket's error.
            if (try? Syscall.setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, Self.errorQueueBuffer)) == nil {
                try? Syscall.setsockopt(fd, SOL_SOCKET, SO_RCVBUF, Self.errorQueueBuffer)
            }
            // The kernel reports twice what it was asked for; without CAP_NET_ADMIN it caps the
            // request at net.core.wmem_max, for every downstream of the thread together.
            if let granted = try? Syscall.getsockopt(fd, SOL_SOCKET, SO_SNDBUF, initial: Int32(0)), granted / 2 < min(sendBuffer, Self.smallSendBuffer),
               !Self.smallSendBufferSaid.exchange(true, ordering: .relaxed) {
                logger.notice("the shared send socket's buffer is \(granted / 2) bytes, not the \(sendBuffer) asked for (net.core.wmem_max caps it without CAP_NET_ADMIN): a burst to the worker's downstreams beyond it is dropped and counted send_buffer_full; raise net.core.wmem_max (sysctl -w net.core.wmem_max=16777216) or grant CAP_NET_ADMIN",
                              metadata: ["family": "\(family == AF_INET6 ? "ipv6" : "ipv4")"])
            }
            // The error queue names the destination of each ICMP error (IP_RECVERR also on the
            // IPv6 socket: IPv4-mapped downstreams draw ICMPv4). Without the input filter, replies
            // would fill the receive buffer the error queue shares, and errors would go unnamed.
            var error = shim_enable_error_queue(fd, family)
            if family == AF_INET6 { _ = shim_enable_error_queue(fd, AF_INET) }  // best effort: mapped downstreams only
            if error == 0 { error = shim_drop_all_input(fd) }
            if error != 0 { throw SystemCallError(call: "setsockopt (IP_RECVERR, SO_ATTACH_FILTER)", errno: -error) }
            lanes[lane].socket = fd
        } catch {
            if made >= 0 { Syscall.close(made) }
            lanes[lane].failure = error.errno
            logger.warning("the shared send socket could not be made (\(error)): each downstream of the family sends through its own connected socket, one sendmmsg per downstream",
                           metadata: ["family": "\(family == AF_INET6 ? "ipv6" : "ipv4")"])
        }
        return lanes[lane].socket
    }

    /// Room for `messages` more messages of `family` (sends what is staged when there is not);
    /// false if the family's socket cannot be made (the caller sends its own way).
    func reserve(_ messages: Int, family: Int32) -> Bool {
        let lane = Self.lane(family)
        guard messages <= capacity, socket(lane, family: family) >= 0 else { return false }
        if lanes[lane].count + messages > capacity { send(lane) }
        return true
    }

    /// The next free message of `family` and its control space, owned by `owner` once
    /// ``commit(family:owner:ledger:)`` is called. Only after ``reserve(_:family:)`` said there is room.
    @inline(__always)
    func next(family: Int32) -> (header: UnsafeMutablePointer<shim_mmsghdr>, control: UnsafeMutableRawPointer) {
        let lane = Self.lane(family)
        let index = lanes[lane].count
        return (lanes[lane].headers + index, lanes[lane].controls + index * controlSpace)
    }

    /// `ledger`: the crash ledger slot of the thread whose listener's own datagrams the message
    /// carries (nil for copies: pools, templates).
    @inline(__always)
    func commit(family: Int32, owner: Owner, ledger: CrashLedger.Slot?) {
        let lane = Self.lane(family)
        let index = lanes[lane].count
        lanes[lane].owners[index] = owner
        lanes[lane].count = index + 1
        if let ledger {
            lanes[lane].ledger = ledger
            lanes[lane].carried += lanes[lane].headers[index].msg_hdr.msg_iovlen
        }
    }

    /// Sends everything staged (the raw sockets' too); each message's owner is told what became of it.
    func send() {
        if !reported.isEmpty { reported.removeAll(keepingCapacity: true) }
        send(0)
        send(1)
        raw.send()
    }

    /// What was delivered of the messages staged from records since the last call.
    @inline(__always)
    func takeDeliveredFromTable() -> (sent: UInt64, bytes: UInt64) {
        defer { deliveredFromTable = (0, 0) }
        return deliveredFromTable
    }

    /// Reads and drops what the error queues hold now, which also clears the sockets' pending
    /// error: at a plan change, so that errors about sends of the plan going are not met by the
    /// next plan's first send (a downstream that was dead and is back would be reported refused
    /// for them).
    func discardErrors() {
        for lane in lanes where lane.socket >= 0 { drain(lane.socket) }
        errors.removeAll(keepingCapacity: true)
        erred.removeAll(keepingCapacity: true)
    }

    /// What the error queues held since the last call: one error per destination, the first.
    func takeErrors() -> [(SocketAddress, Int32)] {
        guard !errors.isEmpty else { return [] }
        defer {
            errors.removeAll(keepingCapacity: true)
            erred.removeAll(keepingCapacity: true)
        }
        return errors
    }

    /// True the first time in this batch: a port unreachable of `address` (from the error queue or
    /// a connected socket's ECONNREFUSED) is reported to passive health at most once per batch.
    func firstReport(of address: SocketAddress) -> Bool { reported.insert(address).inserted }

    private func send(_ lane: Int) {
        let count = lanes[lane].count
        guard count > 0 else { return }
        defer { lanes[lane].count = 0 }
        // The crash ledger: the listener's own datagrams of the lane are noted handed just
        // before the first call that carries them.
        if lanes[lane].carried > 0 {
            lanes[lane].ledger?.handing(lanes[lane].carried)
            lanes[lane].carried = 0
        }
        transmit(lanes[lane].socket, lanes[lane].headers, lanes[lane].owners, count)
    }

    /// The shared sockets' receive buffer, which holds only their error queue (SO_RCVBUFFORCE
    /// where allowed, else up to rmem_max).
    static let errorQueueBuffer: Int32 = 1 << 20
    /// A granted send buffer under this (or under what was asked, if less) is logged when the
    /// socket is made, once per process.
    static let smallSendBuffer: Int32 = 1 << 20
    private static let smallSendBufferSaid = Atomic<Bool>(false)

    /// A message failed while ICMP errors were pending on the socket: it goes again, at most this
    /// many times (each time only if the error queue held something or the error was
    /// ECONNREFUSED, i.e. the error may not be its own).
    static let maximumRetries = 4
    /// Messages of a lane the egress queue drops in a row (ENOBUFS) before the rest of the lane
    /// fails at once, as with a full send buffer.
    static let maximumEgressDrops = 8

    /// Sends messages `0..<count` of `headers` (each owned by `owners[i]`) on `fd`, telling each
    /// owner what became of its messages (the caller noted them in the crash ledger).
    private func transmit(_ fd: Int32, _ headers: UnsafeMutablePointer<shim_mmsghdr>,
                          _ owners: UnsafeMutablePointer<Owner>, _ count: Int) {
        var message = 0
        var retries = 0
        var egressDrops = 0
        while message < count {
            let error: Int32
            do throws(SystemCallError) {
                sendCalls += 1
                if case .processed(let sent) = try Syscall.sendmmsg(fd, headers + message, count - message, Socket.dontWait), sent > 0 {
                    for index in message..<(message + sent) { owners[index].delivered(headers[index].msg_hdr, &deliveredFromTable) }
                    messagesSent += sent
                    message += sent
                    retries = 0
                    egressDrops = 0
                    // A short count: the next message failed and sendmmsg dropped its error. Over
                    // loopback that is typically the ICMP error of a message of this very call,
                    // taken as the socket's error by the next one: read the queue, then go on from
                    // the message that failed (sent again, or failing again with its own error).
                    if message < count { drain(fd) }
                    continue
                }
                error = EAGAIN
            } catch let failure {
                error = failure.errno
            }
            // A pending ICMP error fails whichever message comes next: read the queue; if it held
            // anything, the error may be another destination's, and this message goes again.
            // ECONNREFUSED on an unconnected socket is never the message's own: it is the
            // socket's pending error, set even when the error queue had no room for its entry
            // (then nothing names the downstream it was about).
            // (ENOBUFS is an egress queue's drop of this message, no ICMP error: nothing to read.)
            let pending = error == ENOBUFS ? 0 : drain(fd)
            if (pending > 0 || error == ECONNREFUSED) && retries < Self.maximumRetries {
                retries += 1
                continue
            }
            retries = 0
            if error == ENOBUFS { egressDrops += 1 }
            if pending == 0 && (error == EAGAIN || egressDrops >= Self.maximumEgressDrops) {
                // The socket's send buffer is full, or the egress queue dropped this many messages
                // in a row: the rest of the lane would meet the same within this batch, at a system
                // call or two each. They fail now, each counted by its own downstream
                // (send_buffer_full). (A single ENOBUFS is one device's: that message fails alone, below.)
                for index in message..<count { owners[index].failed(headers[index].msg_hdr, error) }
                sendBufferFullCalls += 1
                return
            }
            let failed = headers[message].msg_hdr
            let owner = owners[message]
            if error == ECONNREFUSED && pending == 0 {
                // Still the socket's pending error after every retry: another destination's
                // (this message's own would come back later, in the error queue), so not counted
                // unreachable here.
                owner.failed(failed, EIO)
                message += 1
                continue
            }
            if pending == 0 && failed.msg_controllen > 0 && (error == EINVAL || error == EIO || error == EMSGSIZE) {
                // The kernel refuses GSO here (no ICMP error was pending: the refusal is this
                // message's): this outbox sends one datagram per message from now on, and this
                // message's datagrams go so now.
                owner.outbox._withUnsafeGuaranteedRef { $0.gsoRefused() }
                sendSingly(fd, failed, owner)
            } else {
                owner.failed(failed, error)
            }
            message += 1
        }
    }

    /// Sends the datagrams of GSO message `message` one per message (the same destination).
    private func sendSingly(_ fd: Int32, _ message: msghdr, _ owner: Owner) {
        let count = message.msg_iovlen
        for index in 0..<count {
            single[index].msg_hdr = msghdr(msg_name: message.msg_name, msg_namelen: message.msg_namelen, msg_iov: message.msg_iov + index,
                                           msg_iovlen: 1, msg_control: nil, msg_controllen: 0, msg_flags: 0)
            singleOwners[index] = owner
        }
        transmit(fd, single, singleOwners, count)
    }

    /// Reads `fd`'s error queue into ``errors``; returns how many entries it held.
    @discardableResult
    private func drain(_ fd: Int32) -> Int {
        var read = 0
        var destination = sockaddr_storage()
        var error: Int32 = 0
        while read < 4096, shim_read_error_queue(fd, &destination, &error) == 1 {
            read += 1
            if let address = withUnsafePointer(to: &destination, { SocketAddress(storage: UnsafeRawPointer($0)) }),
               erred.insert(address).inserted {
                errors.append((address, error))
            }
        }
        return read
    }
}
