import CLibXDP
import CSystemShim

#if canImport(Glibc)
import Glibc
#endif

/// The receive queues of an interface: af_xdp runs one socket and one forwarder per queue,
/// since an AF_XDP socket sees only the queue it is bound to.
enum RXQueues {
    /// The number of RX queues now in use on `interface`, as `ethtool -l` shows them: the larger
    /// of the RX-only and combined channel counts (drivers report one or the other). Drivers
    /// without ETHTOOL_GCHANNELS (EOPNOTSUPP, or a count of 0) are counted from
    /// /sys/class/net/IF/queues/rx-* (sysfs shows the network namespace it was mounted in).
    /// Never 0: an interface has at least one queue.
    /// - Parameter interface: the interface's name in the calling thread's network namespace.
    /// - Throws: `XSKError.queueCount` naming the call (socket, ETHTOOL_GCHANNELS) and errno;
    ///   ENODEV when there is no such interface. Calls ioctl(SIOCETHTOOL).
    static func count(interface: String) throws(XSKError) -> Int {
        let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw .queueCount(interface: interface, call: "socket", errno: errno) }
        defer { close(fd) }
        var rx: UInt32 = 0
        var combined: UInt32 = 0
        if xsk_shim_channels(fd, interface, &rx, &combined) == 0 {
            if max(rx, combined) > 0 { return Int(max(rx, combined)) }
        } else if errno != EOPNOTSUPP {
            throw .queueCount(interface: interface, call: "ioctl SIOCETHTOOL ETHTOOL_GCHANNELS", errno: errno)
        }
        guard let directory = opendir("/sys/class/net/\(interface)/queues") else {
            throw .queueCount(interface: interface, call: "opendir /sys/class/net/\(interface)/queues (after ETHTOOL_GCHANNELS gave no count)",
                              errno: errno)
        }
        defer { closedir(directory) }
        var queues = 0
        while let entry = readdir(directory) {
            let name = withUnsafeBytes(of: entry.pointee.d_name) { String(decoding: $0.prefix(while: { $0 != 0 }), as: UTF8.self) }
            if name.hasPrefix("rx-") { queues += 1 }
        }
        return max(queues, 1)
    }
}
