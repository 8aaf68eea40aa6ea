// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import SystemCalls
import CSystemShim
import ReusePortLB

/// A client's address and port as a fixed-size key: hashing it allocates nothing.
struct ClientKey: Hashable {
    let high: UInt64
    let low: UInt64
    /// Family in the upper half, port (network order) in the lower.
    let familyPort: UInt32

    init(_ source: UnsafePointer<sockaddr_storage>) {
        let raw = UnsafeRawPointer(source)
        let family = raw.loadUnaligned(as: sa_family_t.self)
        if Int32(family) == AF_INET6 {
            // sin6_port at 2, sin6_addr at 8.
            high = raw.loadUnaligned(fromByteOffset: 8, as: UInt64.self)
            low = raw.loadUnaligned(fromByteOffset: 16, as: UInt64.self)
        } else {
            // sin_port at 2, sin_addr at 4.
            high = 0
            low = UInt64(raw.loadUnaligned(fromByteOffset: 4, as: UInt32.self))
        }
        familyPort = UInt32(family) << 16 | UInt32(raw.loadUnaligned(fromByteOffset: 2, as: UInt16.self))
    }
}

/// One client of a relay worker: a UDP socket connect()ed to the client's downstream (so the
/// downstream sees one source port per client and its replies come back here), and the client's
/// address the replies go to. Owned by one worker; read under its table lock by ``RelayWorker/associations()``.
final class RelaySession {
    /// The client's address as recvmmsg gave it: the replies' msg_name.
    let client: UnsafeMutablePointer<sockaddr_storage>
    let clientLength: socklen_t
    /// -1 after its downstream left the plan (the socket went on as a ``DrainingSocket``): the
    /// next datagram picks another downstream and makes a new socket (event `moved`).
    var socket: Int32 = -1
    /// The downstream by name and address (a reload keeps the session only if both stay).
    var downstream: Downstream
    /// Index of ``downstream`` in the worker's current plan (meaningless while `socket` is -1).
    var target: Int
    /// Monotonic milliseconds of the last datagram either way.
    var lastActive: Int64
    /// quic_lb: monotonic milliseconds of the last move to the downstream a connection ID named
    /// (a session moves so at most once a second).
    var movedByIDAt: Int64 = .min / 2
    /// The worker's last epoll wakeup that reported this session's socket readable: a session
    /// readable in consecutive wakeups is busy, and is read in batches (recvmmsg).
    var readyWakeup: UInt64 = .max
    /// The name its socket is stored under in the service manager's store (a restart or crash
    /// hands it to the next process); nil: not stored.
    var stored: String?
    /// `amplification`: bytes received from the client and relayed back to it, its exchanges
    /// (a datagram of its own after a reply was sent to it), and whether it is validated (no
    /// cap). A session handed over by a previous process is validated: its counts are unknown.
    var bytesIn: UInt64 = 0
    var bytesOut: UInt64 = 0
    var exchanges = 0
    var repliedSinceRequest = false
    var validated = false

    /// A datagram of `length` bytes from the client: counted, and an exchange when a reply
    /// was sent since its last one.
    @inline(__always)
    func noteRequest(_ length: Int, validatedAfter: Int) {
        bytesIn &+= UInt64(length)
        guard repliedSinceRequest else { return }
        repliedSinceRequest = false
        exchanges += 1
        if validatedAfter > 0 && exchanges >= validatedAfter { validated = true }
    }

    /// Whether a reply of `length` bytes may go back under `factor` (charged when it may).
    @inline(__always)
    func admitsReply(_ length: Int, factor: Int) -> Bool {
        if !validated {
            let after = bytesOut &+ UInt64(length)
            guard after <= UInt64(factor) &* bytesIn else { return false }
            bytesOut = after
        }
        repliedSinceRequest = true
        return true
    }

    /// A session the previous process handed over: its connected `socket` and stored name.
    convenience init(client: SocketAddress, socket: Int32, stored: String, downstream: Downstream, now: Int64) {
        var storage = sockaddr_storage()
        _ = client.write(to: &storage)
        self.init(client: &storage, downstream: downstream, target: 0, now: now)
        self.socket = socket
        self.stored = stored
        validated = true
    }

    init(client source: UnsafePointer<sockaddr_storage>, downstream: Downstream, target: Int, now: Int64) {
        client = .allocate(capacity: 1)
        client.initialize(to: source.pointee)
        clientLength = socklen_t(Int32(source.pointee.ss_family) == AF_INET6 ? MemoryLayout<sockaddr_in6>.size : MemoryLayout<sockaddr_in>.size)
        self.downstream = downstream
        self.target = target
        lastActive = now
    }

    deinit {
        precondition(socket < 0, "a relay session's socket is closed before the session goes")
        client.deallocate()
    }

    /// Makes the session socket toward `downstream.address` (non-blocking, connected: ICMP
    /// port unreachable comes back as ECONNREFUSED). - Returns: 0, or the errno that failed.
    func connect() -> Int32 {
        let address = downstream.address
        let fd: Int32
        do {
            fd = try Syscall.socket(address.ip.family, Socket.datagram | Socket.nonBlocking | Socket.closeOnExec)
        } catch {
            return error.errno
        }
        do {
            try Syscall.connect(fd, address)
        } catch {
            Syscall.close(fd)
            return error.errno
        }
        socket = fd
        return 0
    }

    func closeSocket() {
        if socket >= 0 { Syscall.close(socket) }
        socket = -1
    }

    var clientAddress: SocketAddress? { SocketAddress(storage: UnsafeRawPointer(client)) }
}

/// Monotonic milliseconds (CLOCK_MONOTONIC), taken once per batch.
func monotonicMilliseconds() -> Int64 {
    var now = timespec()
    clock_gettime(CLOCK_MONOTONIC, &now)
    return Int64(now.tv_sec) * 1000 + Int64(now.tv_nsec) / 1_000_000
}
