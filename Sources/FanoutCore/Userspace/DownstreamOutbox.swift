#if canImport(Glibc)
import Glibc
#endif
import CSystemShim
import ReusePortLB

/// One downstream as a worker sees it: a connected, non-blocking UDP socket (so ICMP port
/// unreachable comes back as ECONNREFUSED on the next send) and a sendmmsg batch pointing into
/// the receiver's buffers (no copy).
final class DownstreamOutbox {
    let socket: Int32
    let connectError: Int32
    private let headers: UnsafeMutablePointer<shim_mmsghdr>
    private let iovecs: UnsafeMutablePointer<iovec>
    private(set) var count = 0

    init(address: SocketAddress, capacity: Int) {
        headers = .allocate(capacity: capacity)
        iovecs = .allocate(capacity: capacity)
        for index in 0..<capacity {
            headers[index] = shim_mmsghdr()
            headers[index].msg_hdr.msg_iov = iovecs + index
            headers[index].msg_hdr.msg_iovlen = 1
        }
        let fd = Glibc.socket(address.ip.family, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_NONBLOCK.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        var error: Int32 = fd < 0 ? errno : 0
        if fd >= 0 {
            var size: Int32 = 4 << 20
            if setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &size, 4) != 0 {
                setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, 4)
            }
            if address.withSockAddr({ connect(fd, $0, $1) }) != 0 { error = errno }
        }
        socket = error == 0 ? fd : -1
        if error != 0 && fd >= 0 { close(fd) }
        connectError = error
    }

    deinit {
        if socket >= 0 { close(socket) }
        headers.deallocate()
        iovecs.deallocate()
    }

    func append(_ payload: UnsafeRawBufferPointer) {
        iovecs[count] = iovec(iov_base: UnsafeMutableRawPointer(mutating: payload.baseAddress), iov_len: payload.count)
        count += 1
    }

    /// Sends the batch. A message that fails is dropped alone with its reason; the rest go on.
    func flush(_ result: inout (sent: UInt64, bytes: UInt64, dropped: [DropReason: UInt64])) {
        defer { count = 0 }
        guard socket >= 0 else {
            result.dropped[Self.reason(connectError), default: 0] += UInt64(count)
            return
        }
        var start = 0
        while start < count {
            let sent = shim_sendmmsg(socket, headers + start, UInt32(count - start), Int32(MSG_DONTWAIT))
            if sent > 0 {
                for index in start..<(start + Int(sent)) { result.bytes += UInt64(iovecs[index].iov_len) }
                result.sent += UInt64(sent)
                start += Int(sent)
                continue
            }
            let error = errno
            if error == EINTR { continue }
            result.dropped[Self.reason(error), default: 0] += 1
            start += 1
        }
    }

    static func reason(_ error: Int32) -> DropReason {
        switch error {
        case EAGAIN, ENOBUFS: return .sendBufferFull
        case ECONNREFUSED, EHOSTUNREACH, ENETUNREACH, EHOSTDOWN: return .unreachable
        default: return .sendError
        }
    }
}
