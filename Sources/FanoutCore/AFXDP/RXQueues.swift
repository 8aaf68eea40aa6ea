// SPDX-License-Identifier: Apache-2.0
import CLibXDP
import CSystemShim

#if canImport(Glibc)
import Glibc
#endif
import SystemCalls

/// The receive queues of an interface: af_xdp runs one socket and one forwarder per queue,
/// since an AF_XDP socket sees only the queue it is bound to.
enum RXQueues {
    /// The number of RX queues now in use on `interface`, as `ethtool -l` shows them: the larger
    /// of the RX-only and combined channel counts (drivers report one or the other). Drivers
    /// without ETHTOOL_GCHANNELS (EOPNOTSUPP, or a count of 0) are counted by the kernel's
    /// IFLA_NUM_RX_QUEUES (rtnetlink, in the calling thread's namespace).
    /// Never 0: an interface has at least one queue.
    /// - Parameter interface: the interface's name in the calling thread's network namespace.
    /// - Throws: `XSKError.queueCount` naming the call (socket, ETHTOOL_GCHANNELS) and errno;
    ///   ENODEV when there is no such interface. Calls ioctl(SIOCETHTOOL).
    static func count(interface: String) throws(XSKError) -> Int {
        let fd: Int32
        do {
            fd = try Syscall.socket(AF_INET, Socket.datagram | Socket.closeOnExec)
        } catch {
            throw .queueCount(interface: interface, call: "socket", errno: error.errno)
        }
        defer { Syscall.close(fd) }
        var rx: UInt32 = 0
        var combined: UInt32 = 0
        if xsk_shim_channels(fd, interface, &rx, &combined) == 0 {
            if max(rx, combined) > 0 { return Int(max(rx, combined)) }
        } else if errno != EOPNOTSUPP {
            throw .queueCount(interface: interface, call: "ioctl SIOCETHTOOL ETHTOOL_GCHANNELS", errno: errno)
        }
        // Drivers without ethtool channels (veth before 5.x, bridges, tunnels): the kernel's own
        // count, IFLA_NUM_RX_QUEUES over rtnetlink, which answers for this thread's network
        // namespace (/sys/class/net shows the namespace sysfs was mounted in, another one under
        // `nsenter --net`).
        let index = if_nametoindex(interface)
        guard index != 0 else { throw .queueCount(interface: interface, call: "if_nametoindex", errno: errno) }
        let attributes: [(type: UInt16, value: [UInt8])]
        do {
            attributes = try NextHopResolver.linkAttributes(index)
        } catch {
            throw .queueCount(interface: interface, call: "RTM_GETLINK IFLA_NUM_RX_QUEUES (after ETHTOOL_GCHANNELS gave no count)", errno: error.errno)
        }
        guard let value = attributes.first(where: { $0.type == 32 && $0.value.count == 4 })?.value else {  // IFLA_NUM_RX_QUEUES
            return 1
        }
        return max(1, Int(Rtnetlink.load32(value, 0)))
    }
}
