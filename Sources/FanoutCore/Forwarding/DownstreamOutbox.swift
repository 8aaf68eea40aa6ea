// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import SystemCalls
import CSystemShim
import ReusePortLB

/// One downstream as a forwarding thread sees it (`output: socket`): the datagrams of the batch
/// for it, pointing into the receiver's buffers (no copy), sent through the thread's
/// ``SharedSender`` (one unconnected socket, one sendmmsg for every downstream of the batch) or,
/// for a second after the downstream drew an ICMP error, through its own connected socket: the
/// next ICMP port unreachable its datagrams draw comes back as ECONNREFUSED on its following
/// send, which is counted `unreachable` and reported to passive health, as it always was.
/// The connected socket is also what says the downstream has a route (connect fails without one).
///
/// UDP GSO: a run of consecutive datagrams of one size (the last may be shorter), up to 64 and
/// 64 KB, goes out as one message with a UDP_SEGMENT control message whose iovecs are the
/// datagrams themselves; the kernel sends them as separate datagrams, byte for byte, but walks
/// the send path once per run. If the kernel refuses a GSO message (EMSGSIZE/EINVAL: a segment above
/// the path MTU, or no GSO), GSO is turned off for this downstream and the run is resent one
/// datagram per message. A run that fails otherwise is dropped whole, with its reason.
final class DownstreamOutbox: Outbox {
    // What a batch reads and writes comes first, in the order the flush touches it, so that it
    // shares as few cache lines as it can (at 3,000 downstreams each outbox a batch touches is
    // cold: perf); the rest after.

    /// The connected socket, or -1 while connecting fails (no route yet, no such address):
    /// retried at most once a second while datagrams come, so a downstream unreachable at start
    /// is served once its route appears, without a reload.
    @exclusivity(unchecked) private(set) var socket: Int32 = -1 {
        didSet { describeState() }
    }
    @exclusivity(unchecked) private(set) var count = 0
    /// The batch's datagrams: ``iovecs``, or the forwarding thread's run of them for this
    /// downstream (``adopt(_:count:)``) until the flush.
    @exclusivity(unchecked) private var datagrams: UnsafeMutablePointer<iovec>
    @exclusivity(unchecked) private(set) var gsoEnabled = true {
        didSet { describeState() }
    }
    /// This batch went to the shared sender; its outcome is in `pending` until the flush.
    @exclusivity(unchecked) private var staged = false
    /// The last flush got ECONNREFUSED: the downstream answered ICMP port unreachable (passive health).
    @exclusivity(unchecked) private(set) var refused = false
    /// The thread's shared way out (nil: always the connected socket).
    private let shared: SharedSender?
    /// The downstream as msg_name, for the shared socket.
    private let destination: UnsafeMutablePointer<sockaddr_storage>
    private let destinationLength: socklen_t
    /// ``directUntil`` is set: a flag the batch path reads instead of the optional instant (whose
    /// type is resilient: reading it costs metadata calls).
    @exclusivity(unchecked) private var direct = false {
        didSet { describeState() }
    }
    @exclusivity(unchecked) var ledger: CrashLedger.Slot?
    @exclusivity(unchecked) private var pending: FlushResult = (0, 0, DropTally())
    /// This downstream's record in its forwarding thread's table (nil: none, as for pool members
    /// and tests' outboxes): the outbox writes its address there when given one, and keeps its
    /// ``DestinationRecord/Flags/sendsShared`` and ``DestinationRecord/Flags/gso`` bits current.
    var slot: UnsafeMutablePointer<DestinationRecord>? {
        didSet {
            guard let slot else { return }
            withUnsafeMutableBytes(of: &slot.pointee.name) { name in
                name.copyMemory(from: UnsafeRawBufferPointer(start: destination, count: min(Int(destinationLength), name.count)))
            }
            slot.pointee.nameLength = destinationLength
            describeState()
        }
    }

    private(set) var connectError: Int32 = 0
    private let address: SocketAddress
    private var nextConnect = ContinuousClock.now
    static let reconnectInterval = Duration.seconds(1)
    private let capacity: Int
    private let headers: UnsafeMutablePointer<shim_mmsghdr>
    /// This outbox's own datagram slots (``append(_:source:hopLimit:)``).
    private let iovecs: UnsafeMutablePointer<iovec>
    private let controls: UnsafeMutableRawPointer
    private let controlSpace: Int
    static let directInterval = Duration.seconds(1)
    /// Until when the connected socket sends (the downstream drew an ICMP error); nil: the shared
    /// one. Set and cleared with ``direct``.
    private var directUntil: ContinuousClock.Instant? {
        didSet { direct = directUntil != nil }
    }

    static let maximumSegments = 64
    static let maximumGSOBytes = 65000

    /// - Parameter shared: the forwarding thread's sender (nil: the connected socket always).
    init(address: SocketAddress, capacity: Int, shared: SharedSender? = nil) {
        self.capacity = capacity
        self.shared = shared
        destination = .allocate(capacity: 1)
        destination.initialize(to: sockaddr_storage())
        destinationLength = address.write(to: &destination.pointee)
        headers = .allocate(capacity: capacity)
        iovecs = .allocate(capacity: capacity)
        datagrams = iovecs
        controlSpace = Int(shim_udp_segment_space())
        controls = .allocate(byteCount: capacity * controlSpace, alignment: 16)
        for index in 0..<capacity { headers[index] = shim_mmsghdr() }
        self.address = address
        connect()
    }

    /// Makes the connected socket; on failure keeps the error and when to try again.
    private func connect() {
        var fd: Int32 = -1
        var error: Int32 = 0
        do throws(SystemCallError) {
            fd = try Syscall.socket(address.ip.family, Socket.datagram | Socket.nonBlocking | Socket.closeOnExec)
            let size: Int32 = 4 << 20
            if (try? Syscall.setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, size)) == nil {
                try? Syscall.setsockopt(fd, SOL_SOCKET, SO_SNDBUF, size)
            }
            try Syscall.connect(fd, address)
        } catch let failure {
            error = failure.errno
        }
        socket = error == 0 ? fd : -1
        if error != 0 && fd >= 0 { Syscall.close(fd) }
        connectError = error
        nextConnect = ContinuousClock.now + Self.reconnectInterval
    }

    /// Writes what the thread's batch path reads of this outbox into its record (``slot``).
    private func describeState() {
        guard let slot else { return }
        var flags = slot.pointee.flags & ~(DestinationRecord.Flags.sendsShared | DestinationRecord.Flags.gso | DestinationRecord.Flags.ipv6)
        if socket >= 0 && !direct && shared != nil { flags |= DestinationRecord.Flags.sendsShared }
        if gsoEnabled { flags |= DestinationRecord.Flags.gso }
        if address.ip.family == AF_INET6 { flags |= DestinationRecord.Flags.ipv6 }
        slot.pointee.flags = flags
    }

    /// True when this call connected a socket that could not be connected before.
    func reconnectIfDue() -> Bool {
        guard socket < 0, ContinuousClock.now >= nextConnect else { return false }
        connect()
        return socket >= 0
    }

    deinit {
        // A table record names this outbox unretained: the table must let go first.
        precondition(slot == nil, "DownstreamOutbox: released while a forwarding thread's table still names it")
        if socket >= 0 { close(socket) }
        headers.deallocate()
        iovecs.deallocate()
        controls.deallocate()
        destination.deallocate()
    }

    /// The payload alone goes out; the source is this host's (the socket's).
    func append(_ payload: UnsafeRawBufferPointer, source: UnsafePointer<sockaddr_storage>, hopLimit: UInt8) {
        iovecs[count] = iovec(iov_base: UnsafeMutableRawPointer(mutating: payload.baseAddress), iov_len: payload.count)
        count += 1
    }

    /// Takes the batch's datagrams for this downstream as `count` iovecs at `batch`, kept where
    /// they are (the forwarding thread's, valid until this outbox's flush), and stages them at
    /// once (``stage()``), while the outbox is in the cache. The thread gathers a batch in arrival
    /// order in storage of its own and hands each downstream its run, so the per-datagram path
    /// touches no outbox (at 3,000 downstreams each outbox is a cache miss: perf). Only on an
    /// empty outbox (between flushes), at most its capacity.
    @inline(__always)
    func adopt(_ batch: UnsafeMutablePointer<iovec>, count: Int) {
        precondition(self.count == 0 && count <= capacity, "DownstreamOutbox: adopted \(count) datagrams with \(self.count) queued, room for \(capacity)")
        datagrams = batch
        self.count = count
        stage()
    }

    var unavailable: String? { socket < 0 ? "socket could not connect (errno \(connectError): \(String(cString: strerror(connectError))))" : nil }

    /// Sends the batch. A message that fails is dropped (its datagrams counted with the reason);
    /// the rest go on.
    func flush(_ result: inout FlushResult) {
        defer {
            count = 0
            datagrams = iovecs
        }
        refused = false
        if staged {
            staged = false
            collectPending(&result)
            return
        }
        guard socket >= 0 else {
            ledger?.handing(count)
            result.dropped[Self.reason(connectError), default: 0] += UInt64(count)
            return
        }
        // The first call carries every datagram (the later ones, after a failure, the rest).
        ledger?.handing(count)
        var first = 0
        while first < count {
            let messages = build(from: first)
            var message = 0
            while message < messages {
                let error: Int32
                do throws(SystemCallError) {
                    if case .processed(let sent) = try Syscall.sendmmsg(socket, headers + message, messages - message, Socket.dontWait), sent > 0 {
                        for index in message..<(message + sent) { account(headers[index].msg_hdr, &result) }
                        message += sent
                        continue
                    }
                    error = EAGAIN
                } catch let failure {
                    error = failure.errno
                }
                let failed = headers[message].msg_hdr
                if failed.msg_controllen > 0 && (error == EINVAL || error == EIO || error == EMSGSIZE) {
                    // The kernel refuses GSO here (a segment above the path MTU: EMSGSIZE/EINVAL; no GSO:
                    // EIO): resend from this message's first datagram, one per message.
                    gsoEnabled = false
                    break
                }
                if error == ECONNREFUSED { refused = true }
                if Self.isICMPError(error) { directUntil = ContinuousClock.now + Self.directInterval }
                result.dropped[Self.reason(error), default: 0] += UInt64(failed.msg_iovlen)
                message += 1
            }
            first = message < messages ? datagramIndex(of: message) : count
        }
    }

    /// Adds what the shared sender reported for this outbox's messages since the last flush to
    /// `result`, and forgets it: field by field, so that the drops (a DropTally, 136 bytes) are
    /// touched only when there are some, not copied whole per downstream per batch.
    func collectPending(_ result: inout FlushResult) {
        result.sent += pending.sent
        result.bytes += pending.bytes
        if !pending.dropped.isEmpty {
            for (reason, dropped) in pending.dropped { result.dropped[reason, default: 0] += dropped }
            pending.dropped = DropTally()
        }
        pending.sent = 0
        pending.bytes = 0
    }

    /// Fills `headers` with messages for the datagrams from `first` on; returns how many.
    private func build(from first: Int) -> Int {
        var messages = 0
        var index = first
        while index < count {
            let end = Self.runEnd(datagrams, index, count, gso: gsoEnabled)
            Self.fill(&headers[messages].msg_hdr, control: controls + messages * controlSpace, datagrams, from: index, to: end)
            messages += 1
            index = end
        }
        return messages
    }

    /// The end of the GSO run starting at datagram `index` of the `count` at `datagrams` (index + 1
    /// without GSO): a run of one size, the last may be shorter, up to ``maximumSegments`` and
    /// ``maximumGSOBytes``.
    @inline(__always)
    static func runEnd(_ datagrams: UnsafeMutablePointer<iovec>, _ index: Int, _ count: Int, gso: Bool) -> Int {
        let size = datagrams[index].iov_len
        var end = index + 1
        // Empty datagrams are not a run: UDP_SEGMENT 0 would send them as one datagram.
        if gso && size > 0 {
            while end < count && end - index < Self.maximumSegments && (end - index + 1) * size <= Self.maximumGSOBytes {
                let length = datagrams[end].iov_len
                // An empty one is not a shorter last segment: the kernel would send no datagram for it.
                if length == 0 || length > size { break }
                end += 1
                if length < size { break }  // a shorter datagram ends the run
            }
        }
        return end
    }

    /// One message of datagrams `index..<end` at `datagrams` (a GSO run when more than one).
    @inline(__always)
    static func fill(_ header: inout msghdr, control: UnsafeMutableRawPointer, _ datagrams: UnsafeMutablePointer<iovec>, from index: Int, to end: Int) {
        header.msg_iov = datagrams + index
        header.msg_iovlen = end - index
        shim_set_udp_segment(&header, control, end - index > 1 ? UInt16(datagrams[index].iov_len) : 0)
    }

    // MARK: The shared sender

    /// Puts this batch's messages into the thread's ``SharedSender`` (unless the downstream sends
    /// through its connected socket now: no route, or an ICMP error in the last second); the
    /// outcome is what the next ``flush(_:)`` returns.
    func stage() {
        guard count > 0, socket >= 0, let shared else { return }
        if direct, !directPeriodEnded() { return }
        let family = address.ip.family
        guard shared.reserve(count, family: family) else { return }
        var index = 0
        while index < count {
            let end = Self.runEnd(datagrams, index, count, gso: gsoEnabled)
            let next = shared.next(family: family)
            next.header.pointee.msg_hdr.msg_name = UnsafeMutableRawPointer(destination)
            next.header.pointee.msg_hdr.msg_namelen = destinationLength
            Self.fill(&next.header.pointee.msg_hdr, control: next.control, datagrams, from: index, to: end)
            shared.commit(family: family, owner: SharedSender.Owner(self), ledger: ledger)
            index = end
        }
        staged = true
    }

    /// Whether the direct period is over (then it ends): out of the batch path, which only reads ``direct``.
    @inline(never)
    private func directPeriodEnded() -> Bool {
        if let until = directUntil, ContinuousClock.now < until { return false }
        directUntil = nil
        return true
    }

    /// The shared sender sent `message` (one of this outbox's).
    @inline(__always)
    func delivered(_ message: msghdr) { account(message, &pending) }

    /// The shared sender could not send `message`: its datagrams are dropped with the reason.
    func failed(_ message: msghdr, _ error: Int32) {
        pending.dropped[Self.reason(error), default: 0] += UInt64(message.msg_iovlen)
    }

    /// The kernel refused a GSO message of this outbox: one datagram per message from now on.
    func gsoRefused() { gsoEnabled = false }

    /// An ICMP error came back to the shared socket about a datagram sent to `address`: if that is
    /// this downstream, its connected socket sends for the next second, where the next ICMP error
    /// about it fails its following send (counted and, for port unreachable, reported).
    /// An error the connected socket still holds from an earlier direct period (an ICMP error that
    /// arrived after its last send then) is cleared first (SO_ERROR): it is not about this one.
    func drewError(at address: SocketAddress) {
        guard address == self.address else { return }
        let now = ContinuousClock.now
        if directUntil.map({ now >= $0 }) ?? true, socket >= 0 { _ = try? Syscall.getsockopt(socket, SOL_SOCKET, SO_ERROR, initial: Int32(0)) }
        directUntil = now + Self.directInterval
    }

    /// Ends a direct period and clears what the connected socket holds (SO_ERROR): kept across a
    /// plan change, a downstream that was dead and is back must not fail its next send for an
    /// ICMP error about a datagram of before.
    func forgetErrors() {
        directUntil = nil
        if socket >= 0 { _ = try? Syscall.getsockopt(socket, SOL_SOCKET, SO_ERROR, initial: Int32(0)) }
    }

    /// Errors that an ICMP message sets on a socket (as opposed to local ones such as a full buffer).
    static func isICMPError(_ error: Int32) -> Bool {
        switch error {
        case ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, EHOSTDOWN, EPROTO, EMSGSIZE: return true
        default: return false
        }
    }

    /// The index of the first datagram of message `message` (messages are built in order).
    private func datagramIndex(of message: Int) -> Int {
        headers[message].msg_hdr.msg_iov - datagrams
    }

    private func account(_ message: msghdr, _ result: inout FlushResult) {
        for index in 0..<message.msg_iovlen { result.bytes += UInt64(message.msg_iov[index].iov_len) }
        result.sent += UInt64(message.msg_iovlen)
    }

    static func reason(_ error: Int32) -> DropReason {
        switch error {
        case EAGAIN, ENOBUFS: return .sendBufferFull
        // EACCES: a prohibit route (connect and send fail with it), a way the network has no
        // route for the downstream, as the no-route counts of the other kinds say (also a
        // broadcast address without SO_BROADCAST: the connect log line names the errno).
        case ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, EHOSTDOWN, EACCES: return .unreachable
        default: return .sendError
        }
    }
}
