// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB
import SystemCalls

/// Asks the kernel for its route to an address (RTM_GETROUTE, what `ip route get` asks), in the
/// calling thread's network namespace: the route the program's fib lookup will find, known
/// before the first packet is dropped `no_route`.
enum TCRoute {
    /// Why there is no unicast route to `ip`, or nil when there is one.
    static func problem(to ip: IPAddress) -> String? {
        let replies: [Rtnetlink.Message]
        do {
            replies = try lookup(ip)
        } catch {
            return "the route lookup failed: \(error)"
        }
        guard let reply = replies.first else { return "the kernel did not answer the route lookup" }
        if reply.type == Rtnetlink.error {
            let code = Rtnetlink.errorCode(reply)
            return code == 0 ? nil : "no route: \(String(cString: strerror(code)))"
        }
        guard reply.type == 24, reply.payload.count >= 12 else { return "unexpected route reply type \(reply.type)" }  // RTM_NEWROUTE
        switch reply.payload[7] {  // rtm_type
        case 1: return nil  // RTN_UNICAST
        case 2: return "the address is local to this host"
        case 6: return "a blackhole route"
        case 7: return "an unreachable route"
        case 8: return "a prohibit route"
        case let other: return "a route of type \(other), not unicast"
        }
    }

    /// The name of the interface the kernel routes `ip` through (the route's RTA_OIF), or nil
    /// when there is no unicast route: where a nat listener's downstream sends its replies from
    /// this host's point of view, so where they arrive.
    /// A failed lookup is nil too: the caller says the downstream has no interface to watch.
    static func interface(to ip: IPAddress) -> String? {
        guard let replies = try? lookup(ip), let reply = replies.first, reply.type == 24, reply.payload.count >= 12, reply.payload[7] == 1  // RTM_NEWROUTE, RTN_UNICAST
        else { return nil }
        var offset = 12
        while offset + 4 <= reply.payload.count {
            let length = Int(Rtnetlink.load16(reply.payload, offset))
            guard length >= 4, offset + length <= reply.payload.count else { break }
            if Rtnetlink.load16(reply.payload, offset + 2) == 4, length >= 8 {  // RTA_OIF
                var name = [CChar](repeating: 0, count: Int(IF_NAMESIZE) + 1)
                guard if_indextoname(Rtnetlink.load32(reply.payload, offset + 4), &name) != nil else { return nil }
                return String(decoding: name.prefix(while: { $0 != 0 }).map { UInt8(bitPattern: $0) }, as: UTF8.self)
            }
            offset += (length + 3) & ~3
        }
        return nil
    }

    /// The name of interface `ifindex`, or "ifindex N" when it has none (gone meanwhile).
    static func interfaceName(_ ifindex: UInt32) -> String {
        var name = [CChar](repeating: 0, count: Int(IF_NAMESIZE) + 1)
        guard if_indextoname(ifindex, &name) != nil else { return "ifindex \(ifindex)" }
        return String(decoding: name.prefix(while: { $0 != 0 }).map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }

    /// The next hop the kernel routes `ip` through: the route's interface index (RTA_OIF) and its
    /// gateway (RTA_GATEWAY), or `ip` itself on a directly connected route; nil without a unicast route.
    static func nextHop(to ip: IPAddress) -> (ifindex: UInt32, address: IPAddress)? {
        guard let replies = try? lookup(ip), let reply = replies.first, reply.type == 24, reply.payload.count >= 12, reply.payload[7] == 1  // RTM_NEWROUTE, RTN_UNICAST
        else { return nil }
        var ifindex: UInt32?
        var gateway: IPAddress?
        var offset = 12
        while offset + 4 <= reply.payload.count {
            let length = Int(Rtnetlink.load16(reply.payload, offset))
            guard length >= 4, offset + length <= reply.payload.count else { break }
            switch Rtnetlink.load16(reply.payload, offset + 2) {
            case 4 where length >= 8: ifindex = Rtnetlink.load32(reply.payload, offset + 4)  // RTA_OIF
            case 5: gateway = IPAddress(bytes: Array(reply.payload[(offset + 4)..<(offset + length)]))  // RTA_GATEWAY
            default: break
            }
            offset += (length + 3) & ~3
        }
        return ifindex.map { ($0, gateway ?? ip) }
    }

    /// Asks the kernel to keep the neighbour entry of `address` at `ifindex` resolved on its own
    /// (a managed entry, NTF_EXT_MANAGED: what bpf_fib_lookup needs to hand a copy its MAC).
    /// Returns true when this call made the entry (false: one was there already, left as it is).
    static func addManagedNeighbour(_ address: IPAddress, ifindex: UInt32) throws(SystemCallError) -> Bool {
        let reply = try Rtnetlink.request(type: 28, flags: 0x4 | 0x400 | 0x200, body: neighbourBody(address, ifindex: ifindex, managed: true))  // RTM_NEWNEIGH, ACK|CREATE|EXCL
        guard let message = reply.first, message.type == Rtnetlink.error else { return false }
        let code = Rtnetlink.errorCode(message)
        if code == EEXIST { return false }
        guard code == 0 else { throw SystemCallError(call: "RTM_NEWNEIGH \(address) managed", errno: code) }
        return true
    }

    /// Deletes a neighbour entry this process made.
    static func removeNeighbour(_ address: IPAddress, ifindex: UInt32) {
        _ = try? Rtnetlink.request(type: 29, flags: 0x4, body: neighbourBody(address, ifindex: ifindex, managed: false))  // RTM_DELNEIGH, ACK
    }

    /// ndmsg (family, pads, ifindex, state NUD_NONE, flags, type), NDA_DST, and NDA_FLAGS_EXT.
    private static func neighbourBody(_ address: IPAddress, ifindex: UInt32, managed: Bool) -> [UInt8] {
        var body: [UInt8] = [UInt8(address.family), 0, 0, 0]
        Rtnetlink.append32(&body, ifindex)
        body += [0, 0, 0, 0]
        Rtnetlink.append16(&body, UInt16(4 + address.bytes.count))
        Rtnetlink.append16(&body, 1)  // NDA_DST
        body += address.bytes
        if managed {
            Rtnetlink.append16(&body, 8)
            Rtnetlink.append16(&body, 15)  // NDA_FLAGS_EXT
            Rtnetlink.append32(&body, 1)   // NTF_EXT_MANAGED
        }
        return body
    }

    /// The kernel's answer to RTM_GETROUTE for `ip`: rtmsg (family, dst_len, src_len, tos, table,
    /// protocol, scope, type, flags) and RTA_DST.
    private static func lookup(_ ip: IPAddress) throws(SystemCallError) -> [Rtnetlink.Message] {
        let address = ip.bytes
        var body: [UInt8] = [UInt8(ip.family), UInt8(address.count * 8), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        Rtnetlink.append16(&body, UInt16(4 + address.count))
        Rtnetlink.append16(&body, 1)  // RTA_DST
        body += address
        return try Rtnetlink.request(type: 26, flags: 0, body: body)  // RTM_GETROUTE
    }
}
