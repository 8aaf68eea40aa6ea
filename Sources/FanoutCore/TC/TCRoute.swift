#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB

/// Asks the kernel for its route to an address (RTM_GETROUTE over rtnetlink, what `ip route get`
/// asks), in the calling thread's network namespace: the route the program's fib lookup will
/// find, known before the first packet is dropped `no_route`.
enum TCRoute {
    /// Why there is no unicast route to `ip`, or nil when there is one.
    static func problem(to ip: IPAddress) -> String? {
        do {
            return try lookup(ip)
        } catch {
            return "the route lookup failed: \(error)"
        }
    }

    private static let getRoute: UInt16 = 26, newRoute: UInt16 = 24, error: UInt16 = 2  // RTM_GETROUTE, RTM_NEWROUTE, NLMSG_ERROR

    private static func lookup(_ ip: IPAddress) throws(SystemCallError) -> String? {
        let fd = try systemCall("socket AF_NETLINK NETLINK_ROUTE") { socket(AF_NETLINK, Int32(SOCK_RAW.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0) }
        defer { close(fd) }
        // nlmsghdr (16) + rtmsg (12) + rtattr RTA_DST (4 + address).
        let address = ip.bytes
        var request = [UInt8](repeating: 0, count: 32 + address.count)
        func put32(_ value: UInt32, at offset: Int) { withUnsafeBytes(of: value) { for (i, byte) in $0.enumerated() { request[offset + i] = byte } } }
        func put16(_ value: UInt16, at offset: Int) { withUnsafeBytes(of: value) { for (i, byte) in $0.enumerated() { request[offset + i] = byte } } }
        put32(UInt32(request.count), at: 0)
        put16(getRoute, at: 4)
        put16(1, at: 6)  // NLM_F_REQUEST
        put32(1, at: 8)  // sequence
        request[16] = UInt8(ip.family)
        request[17] = UInt8(address.count * 8)  // rtm_dst_len: a host route
        put16(UInt16(4 + address.count), at: 28)
        put16(1, at: 30)  // RTA_DST
        for (index, byte) in address.enumerated() { request[32 + index] = byte }
        try systemCall("send RTM_GETROUTE") { send(fd, request, request.count, 0) }
        var reply = [UInt8](repeating: 0, count: 4096)
        let count = try systemCall("recv RTM_GETROUTE") { recv(fd, &reply, reply.count, 0) }
        guard count >= 20 else { return "the kernel's route reply was \(count) bytes" }
        let type = reply.withUnsafeBytes { $0.loadUnaligned(fromByteOffset: 4, as: UInt16.self) }
        if type == error {
            let code = -reply.withUnsafeBytes { $0.loadUnaligned(fromByteOffset: 16, as: Int32.self) }
            return code == 0 ? nil : "no route: \(String(cString: strerror(code)))"
        }
        guard type == newRoute, count >= 28 else { return "unexpected route reply type \(type)" }
        switch reply[16 + 7] {  // rtm_type
        case 1: return nil  // RTN_UNICAST
        case 2: return "the address is local to this host"
        case 6: return "a blackhole route"
        case 7: return "an unreachable route"
        case 8: return "a prohibit route"
        case let other: return "a route of type \(other), not unicast"
        }
    }
}
