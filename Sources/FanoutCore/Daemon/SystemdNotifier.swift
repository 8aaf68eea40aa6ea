#if canImport(Glibc)
import Glibc
#endif

/// sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET when run under systemd
/// (Type=notify); nothing otherwise.
public struct SystemdNotifier: Sendable {
    let path: String?

    public init(environment: String? = getenv("NOTIFY_SOCKET").map { String(cString: $0) }) {
        path = environment
    }

    public func send(_ state: String) {
        guard let path, !path.isEmpty else { return }
        let fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { return }
        defer { close(fd) }
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        var bytes = Array(path.utf8)
        if bytes.first == UInt8(ascii: "@") { bytes[0] = 0 }  // abstract namespace
        let capacity = MemoryLayout.size(ofValue: address.sun_path)
        guard bytes.count < capacity else { return }
        withUnsafeMutableBytes(of: &address.sun_path) { $0.copyBytes(from: bytes) }
        let length = socklen_t(MemoryLayout<sa_family_t>.size + bytes.count)
        var message = Array(state.utf8)
        _ = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { sendto(fd, &message, message.count, 0, $0, length) }
        }
    }
}
