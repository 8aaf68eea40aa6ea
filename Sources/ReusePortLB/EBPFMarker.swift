// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import SystemCalls

/// A sign, visible to every process of the network namespace whatever its bpffs mount and
/// privileges, that an eBPF-steered group runs on an address: each eBPF member holds an
/// abstract unix socket named `reuseportlb-ebpf:<group>:<pid>-<n>` (abstract names belong to
/// the network namespace and vanish with the socket, even on kill -9). A member that would
/// join without eBPF looks for it in /proc/net/unix when it cannot see the group's pins
/// (another bpffs mount, or pins it may not open), so it never replaces that group's
/// program unknowingly.
enum EBPFMarker {
    private static let counter = Counter()

    private final class Counter: @unchecked Sendable {
        private var value = 0
        private var lock = pthread_mutex_t()
        init() { pthread_mutex_init(&lock, nil) }
        func next() -> Int {
            pthread_mutex_lock(&lock)
            defer { pthread_mutex_unlock(&lock) }
            value += 1
            return value
        }
    }

    static func prefix(_ address: SocketAddress) -> String {
        let family = address.ip.family == AF_INET ? "udp4" : "udp6"
        return "reuseportlb-ebpf:\(family)-\(address.ip.description.bpffsSafe)-\(address.port):"
    }

    /// Binds the marker for one member; the caller closes it when the member leaves. -1 if the
    /// socket cannot be made (the marker is a safeguard for others, not needed to steer).
    static func hold(_ address: SocketAddress) -> Int32 {
        guard let fd = try? Syscall.socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue)) else { return -1 }
        let name = Array((prefix(address) + "\(getpid())-\(counter.next())").utf8.prefix(100))
        var unix = sockaddr_un()
        unix.sun_family = sa_family_t(AF_UNIX)
        withUnsafeMutableBytes(of: &unix.sun_path) { path in
            path[0] = 0  // abstract namespace
            for (index, byte) in name.enumerated() { path[index + 1] = byte }
        }
        let length = socklen_t(MemoryLayout<sa_family_t>.size + 1 + name.count)
        let bound = withUnsafePointer(to: &unix) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { try? Syscall.bind(fd, $0, length) }
        }
        guard bound != nil else {
            Syscall.close(fd)
            return -1
        }
        return fd
    }

    /// True when a live eBPF member of the group on `address` holds its marker.
    static func present(_ address: SocketAddress) -> Bool {
        let wanted = "@" + prefix(address)
        return BoundSockets.lines(of: "/proc/thread-self/net/unix").dropFirst().contains { line in
            line.split(separator: " ", omittingEmptySubsequences: true).last?.hasPrefix(wanted) ?? false
        }
    }
}
