// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import Logging
import SystemCalls
import CSystemShim
import Synchronization

/// The raw IP sockets of one forwarding thread for `output: preserve_source`: one per family,
/// shared by every preserve_source downstream and pool member of the thread, and one sendmmsg per
/// batch for all of them (each message names its downstream in msg_name; a raw socket routes by
/// the address of each message, connected or not), up to ``maximumMessages`` copies per family.
/// Part of the thread's ``SharedSender``, whose ``SharedSender/send()`` sends it.
///
/// So a thread holds two raw sockets whatever the number of downstreams, and a batch's copies
/// cost one system call per family. The CPU per copy is mostly the raw send path itself, which
/// has neither GSO nor a cached route (docs/benchmarks.md, Replication): before the raw socket,
/// ``TransparentSockets`` sends the copies of clients whose address is not the host's through a
/// UDP socket per client endpoint (IP_TRANSPARENT), with GSO; the raw socket sends the rest.
///
/// ``SourcePreservingOutbox`` builds its messages and stages them here
/// (``SourcePreservingOutbox/stage()``); ``send()`` tells each outbox what became of each of its
/// messages (``SourcePreservingOutbox/delivered(_:)``, ``SourcePreservingOutbox/failed(_:_:)``).
/// A batch holding a datagram to fragment is not staged: its outbox sends it itself, in order, on
/// the same socket.
///
/// The send buffer is one for every preserve_source downstream of the thread: a granted size
/// below what was asked (net.core.wmem_max without CAP_NET_ADMIN) is logged once per process,
/// and a full buffer drops the rest of the call's messages, each counted `send_buffer_full` by
/// its own downstream.
///
/// Raw IPPROTO_RAW sockets get no ICMP errors (the kernel matches an error's inner protocol, UDP,
/// to raw sockets of that protocol only): nothing is pending on them, so a failed message is its own.
final class SharedRawSender {
    /// A family's socket and staged messages; the message room is allocated with the socket, so
    /// a thread without preserve_source downstreams holds none.
    private struct Lane {
        var socket: Int32 = -1
        var headers: UnsafeMutablePointer<shim_mmsghdr>?
        var owners: UnsafeMutablePointer<Unmanaged<SourcePreservingOutbox>>?
        var count = 0
    }

    /// Messages staged per family before a send is forced: a listener's batch and every pool
    /// member's copy of it, up to what one sendmmsg takes (UIO_MAXIOV).
    let capacity: Int
    static let maximumMessages = 1024
    private let sendBuffer: Int32
    private let logger: Logger
    private static let smallSendBufferSaid = Atomic<Bool>(false)
    @exclusivity(unchecked) private var lanes: [Lane]
    /// sendmmsg calls made on the raw sockets (tests check that a batch costs one).
    @exclusivity(unchecked) private(set) var sendCalls = 0
    /// The UDP sockets bound to clients' endpoints, made with the first raw socket (so a thread
    /// without preserve_source downstreams holds none of its room); nil: every copy the raw way.
    @exclusivity(unchecked) private(set) var transparent: TransparentSockets?
    private let transparentWanted: Bool
    private let counters: ListenerCounters?

    /// - Parameters:
    ///   - capacity: messages staged per family before they are sent.
    ///   - sendBuffer: each socket's send buffer: one socket carries every preserve_source
    ///     downstream of the thread (SO_SNDBUFFORCE where allowed, else SO_SNDBUF up to wmem_max).
    ///   - logger: where a send buffer smaller than asked is reported (once per process).
    ///   - transparent: copies of clients whose address is not the host's go through UDP sockets
    ///     bound to them (``TransparentSockets``, each with `sendBuffer` bytes of send buffer
    ///     capped at 4 MiB); false: every copy through the raw socket.
    ///   - counters: the listener's, whose gauge counts those sockets.
    init(capacity: Int = SharedRawSender.maximumMessages, sendBuffer: Int32 = 16 << 20,
         logger: Logger = Logger(label: "udp-fanout.shared-raw-sender"), transparent: Bool = true, counters: ListenerCounters? = nil) {
        self.capacity = min(max(capacity, 1), Self.maximumMessages)
        self.sendBuffer = sendBuffer
        self.logger = logger
        lanes = [Lane(), Lane()]
        transparentWanted = transparent
        self.counters = counters
    }

    deinit {
        for lane in lanes {
            if lane.socket >= 0 { close(lane.socket) }
            lane.headers?.deallocate()
            lane.owners?.deallocate()
        }
    }

    private static func lane(_ family: Int32) -> Int { family == AF_INET6 ? 1 : 0 }

    /// The family's raw socket, made on first use in the calling thread's network namespace (an
    /// outbox asks when it is made). A socket that cannot be made is tried again on the next call
    /// (the next plan's outboxes, each of which logs why it has none).
    /// - Throws: the failing call's error (EPERM without CAP_NET_RAW).
    func socket(family: Int32) throws(SystemCallError) -> Int32 {
        let lane = Self.lane(family)
        if lanes[lane].socket >= 0 { return lanes[lane].socket }
        let fd = try SourcePreservingOutbox.openRawSocket(family: family, sendBuffer: sendBuffer)
        lanes[lane].socket = fd
        let headers = UnsafeMutablePointer<shim_mmsghdr>.allocate(capacity: capacity)
        headers.initialize(repeating: shim_mmsghdr(), count: capacity)
        lanes[lane].headers = headers
        lanes[lane].owners = .allocate(capacity: capacity)
        if transparentWanted && transparent == nil {
            transparent = TransparentSockets(capacity: capacity, sendBuffer: min(sendBuffer, 4 << 20), logger: logger, counters: counters)
        }
        // The kernel reports twice what it granted; without CAP_NET_ADMIN it caps the request at
        // net.core.wmem_max, for every preserve_source downstream of the thread together.
        if let granted = try? Syscall.getsockopt(fd, SOL_SOCKET, SO_SNDBUF, initial: Int32(0)),
           granted / 2 < min(sendBuffer, SharedSender.smallSendBuffer), !Self.smallSendBufferSaid.exchange(true, ordering: .relaxed) {
            logger.notice("the shared raw socket's send buffer is \(granted / 2) bytes, not the \(sendBuffer) asked for (net.core.wmem_max caps it without CAP_NET_ADMIN): copies of a batch to the worker's preserve_source downstreams beyond it are dropped and counted send_buffer_full; raise net.core.wmem_max (sysctl -w net.core.wmem_max=16777216) or grant CAP_NET_ADMIN",
                          metadata: ["family": "\(family == AF_INET6 ? "ipv6" : "ipv4")"])
        }
        return fd
    }

    /// Room for `messages` more messages of `family` (sends what is staged when there is not);
    /// false when they cannot fit in one send (the caller sends its own way) or there is no socket.
    func reserve(_ messages: Int, family: Int32) -> Bool {
        let lane = Self.lane(family)
        guard messages <= capacity, lanes[lane].socket >= 0 else { return false }
        if lanes[lane].count + messages > capacity { send(lane) }
        return true
    }

    /// Stages `message` of `owner` (after ``reserve(_:family:)`` said there is room); its
    /// pointers must stay valid until ``send()``.
    @inline(__always)
    func stage(_ message: msghdr, family: Int32, owner: SourcePreservingOutbox) {
        let lane = Self.lane(family)
        let index = lanes[lane].count
        lanes[lane].headers.unsafelyUnwrapped[index].msg_hdr = message
        lanes[lane].headers.unsafelyUnwrapped[index].msg_len = 0
        lanes[lane].owners.unsafelyUnwrapped[index] = Unmanaged.passUnretained(owner)
        lanes[lane].count = index + 1
    }

    /// Sends everything staged; each outbox is told what became of its messages.
    func send() {
        if lanes[0].count > 0 { send(0) }
        if lanes[1].count > 0 { send(1) }
    }

    private func send(_ lane: Int) {
        let count = lanes[lane].count
        guard count > 0, let headers = lanes[lane].headers, let owners = lanes[lane].owners else { return }
        defer { lanes[lane].count = 0 }
        noteHanding(owners, count)
        // The clients' own UDP sockets first; the raw socket sends what they left, in order.
        let rest = transparent?.send(headers, owners, count, family: lane == 1 ? AF_INET6 : AF_INET) ?? count
        guard rest > 0 else { return }
        // The outboxes left the UDP checksum to whichever way sends: this one carries it.
        for index in 0..<rest { SourcePreservingOutbox.fillChecksum(headers[index].msg_hdr) }
        transmit(lanes[lane].socket, headers, owners, rest)
    }

    /// The crash ledger: the listener's own datagrams among `owners[0..<count]` (not pool or
    /// template copies) are noted handed just before the first call that carries them.
    private func noteHanding(_ owners: UnsafeMutablePointer<Unmanaged<SourcePreservingOutbox>>, _ count: Int) {
        var carried = 0
        var slot: CrashLedger.Slot?
        for index in 0..<count {
            owners[index]._withUnsafeGuaranteedRef { owner in
                if let ledger = owner.ledger {
                    slot = ledger
                    carried += 1
                }
            }
        }
        slot?.handing(carried)
    }

    /// Sends messages `0..<count` (one datagram each) on `fd`, telling each owner what became of
    /// its message. A full send buffer (EAGAIN) fails the rest at once, each counted by its own
    /// outbox (send_buffer_full); any other error fails its message alone.
    private func transmit(_ fd: Int32, _ headers: UnsafeMutablePointer<shim_mmsghdr>,
                          _ owners: UnsafeMutablePointer<Unmanaged<SourcePreservingOutbox>>, _ count: Int) {
        var message = 0
        while message < count {
            let error: Int32
            do throws(SystemCallError) {
                sendCalls += 1
                if case .processed(let sent) = try Syscall.sendmmsg(fd, headers + message, count - message, Socket.dontWait), sent > 0 {
                    for index in message..<(message + sent) { owners[index]._withUnsafeGuaranteedRef { $0.delivered(headers[index].msg_hdr) } }
                    message += sent
                    continue
                }
                error = EAGAIN
            } catch let failure {
                error = failure.errno
            }
            if error == EAGAIN {
                for index in message..<count { owners[index]._withUnsafeGuaranteedRef { $0.failed(headers[index].msg_hdr, error) } }
                return
            }
            owners[message]._withUnsafeGuaranteedRef { $0.failed(headers[message].msg_hdr, error) }
            message += 1
        }
    }
}
