// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import SystemCalls
import CSystemShim

/// The raw IP sockets of one forwarding thread for `output: preserve_source`: one per family,
/// shared by every preserve_source downstream and pool member of the thread, and one sendmmsg per
/// batch for all of them (each message names its downstream in msg_name; a raw socket routes by
/// the address of each message, connected or not). Part of the thread's ``SharedSender``, whose
/// ``SharedSender/send()`` sends it.
///
/// Before it, each downstream had a raw socket (and a connected UDP socket to read its path MTU)
/// and a sendmmsg of its own per batch: three copies of a datagram were three system calls, and
/// 3,000 downstreams held 6,000 descriptors. (The CPU per copy is mostly the raw send path
/// itself, which has neither GSO nor a cached route: docs/benchmarks.md, Replication.)
///
/// ``SourcePreservingOutbox`` builds its messages as before and stages them here
/// (``SourcePreservingOutbox/stage()``); ``send()`` tells each outbox what became of each of its
/// messages (``SourcePreservingOutbox/delivered(_:)``, ``SourcePreservingOutbox/failed(_:_:)``).
/// A batch holding a datagram to fragment is not staged: its outbox sends it itself, in order, on
/// the same socket.
///
/// Raw IPPROTO_RAW sockets get no ICMP errors (the kernel matches an error's inner protocol, UDP,
/// to raw sockets of that protocol only): nothing is pending on them, so a failed message is its own.
final class SharedRawSender {
    private struct Lane {
        var socket: Int32 = -1
        let headers: UnsafeMutablePointer<shim_mmsghdr>
        let owners: UnsafeMutablePointer<Unmanaged<SourcePreservingOutbox>>
        var count = 0
    }

    /// Messages staged per family before a send is forced.
    let capacity: Int
    private let sendBuffer: Int32
    @exclusivity(unchecked) private var lanes: [Lane]
    /// sendmmsg calls made (tests check that a batch costs one).
    @exclusivity(unchecked) private(set) var sendCalls = 0

    /// - Parameters:
    ///   - capacity: messages staged per family before they are sent (a batch's size).
    ///   - sendBuffer: each socket's send buffer: one socket carries every preserve_source
    ///     downstream of the thread (SO_SNDBUFFORCE where allowed, else SO_SNDBUF up to wmem_max).
    init(capacity: Int, sendBuffer: Int32 = 16 << 20) {
        self.capacity = max(capacity, 1)
        self.sendBuffer = sendBuffer
        lanes = (0..<2).map { _ in
            let lane = Lane(headers: .allocate(capacity: max(capacity, 1)), owners: .allocate(capacity: max(capacity, 1)))
            for index in 0..<max(capacity, 1) { lane.headers[index] = shim_mmsghdr() }
            return lane
        }
    }

    deinit {
        for lane in lanes {
            if lane.socket >= 0 { close(lane.socket) }
            lane.headers.deallocate()
            lane.owners.deallocate()
        }
    }

    private static func lane(_ family: Int32) -> Int { family == AF_INET6 ? 1 : 0 }

    /// The family's raw socket, made on first use in the calling thread's network namespace (an
    /// outbox asks when it is made). A socket that cannot be made is tried again on the next call
    /// (the next plan's outboxes), as each outbox's own socket was.
    /// - Throws: the failing call's error (EPERM without CAP_NET_RAW).
    func socket(family: Int32) throws(SystemCallError) -> Int32 {
        let lane = Self.lane(family)
        if lanes[lane].socket >= 0 { return lanes[lane].socket }
        let fd = try SourcePreservingOutbox.openRawSocket(family: family, sendBuffer: sendBuffer)
        lanes[lane].socket = fd
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
        lanes[lane].headers[index].msg_hdr = message
        lanes[lane].headers[index].msg_len = 0
        lanes[lane].owners[index] = Unmanaged.passUnretained(owner)
        lanes[lane].count = index + 1
    }

    /// Sends everything staged; each outbox is told what became of its messages.
    func send() {
        if lanes[0].count > 0 { send(0) }
        if lanes[1].count > 0 { send(1) }
    }

    private func send(_ lane: Int) {
        let count = lanes[lane].count
        guard count > 0 else { return }
        defer { lanes[lane].count = 0 }
        transmit(lanes[lane].socket, lanes[lane].headers, lanes[lane].owners, count)
    }

    /// Sends messages `0..<count` (one datagram each) on `fd`, telling each owner what became of
    /// its message. A full send buffer (EAGAIN) fails the rest at once, each counted by its own
    /// outbox (send_buffer_full); any other error fails its message alone.
    private func transmit(_ fd: Int32, _ headers: UnsafeMutablePointer<shim_mmsghdr>,
                          _ owners: UnsafeMutablePointer<Unmanaged<SourcePreservingOutbox>>, _ count: Int) {
        // The crash ledger: the listener's own datagrams (not pool or template copies) are noted
        // handed just before the first call that carries them.
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
