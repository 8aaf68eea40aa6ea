// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB
import SystemCalls

/// Where a frame for a downstream leaves and the Ethernet addresses it carries (output `xdp_tx`).
struct NextHop: Equatable {
    var ifindex: UInt32
    /// The outgoing interface's own MAC address.
    var sourceMAC: [UInt8]
    /// The neighbour's MAC address: the gateway's, or the downstream's own when it is on-link.
    var destinationMAC: [UInt8]
}

/// Why a downstream cannot be reached by XDP TX from this interface; each is a `reason` label
/// value of the fallback to preserve_source.
enum NextHopProblem: String, Error {
    /// The kernel has no unicast route to the downstream.
    case noRoute = "no_route"
    /// The route leaves through another interface: XDP TX only sends out of the one it received on.
    case otherInterface = "other_interface"
    /// The next hop's MAC address is not (or no longer) in the neighbour table.
    case noNeighbour = "no_neighbour"
}

/// Where a datagram to `destination` leaves and the Ethernet addresses it needs: netlink
/// RTM_GETROUTE (oif, gateway or on-link), then the neighbour table (RTM_GETNEIGH get:
/// NUD_REACHABLE/STALE/DELAY/PROBE/PERMANENT count as known), and the interface's own MAC
/// (RTM_GETLINK). Questions go to the calling thread's network namespace.
///
/// Cached per destination: `lookup` answers from the cache (asking the kernel only the first time
/// it sees a destination); `refresh()`, called by the forwarder off the hot path, asks again for
/// entries at least a second old. An unknown neighbour becomes known once the kernel resolves it:
/// the fallback (preserve_source) sends through the kernel's routing, which starts ARP/ND.
final class NextHopResolver {
    let ifindex: UInt32
    static let refreshInterval = Duration.seconds(1)
    private var cache: [IPAddress: (result: Result<NextHop, NextHopProblem>, resolved: ContinuousClock.Instant)] = [:]

    init(ifindex: UInt32) {
        self.ifindex = ifindex
    }

    /// The next hop toward `destination`, from the cache; resolved now the first time.
    func lookup(_ destination: IPAddress) -> Result<NextHop, NextHopProblem> {
        if let entry = cache[destination] { return entry.result }
        let result = resolve(destination)
        cache[destination] = (result, ContinuousClock.now)
        return result
    }

    /// Resolves again every cached destination whose answer is at least a second old.
    func refresh() {
        let now = ContinuousClock.now
        for (destination, entry) in cache where now - entry.resolved >= Self.refreshInterval {
            cache[destination] = (resolve(destination), now)
        }
    }

    /// Forgets destinations no longer configured.
    func retain(_ destinations: Set<IPAddress>) {
        cache = cache.filter { destinations.contains($0.key) }
    }

    /// Asks the kernel: route, neighbour, own MAC.
    func resolve(_ destination: IPAddress) -> Result<NextHop, NextHopProblem> {
        guard let route = Self.route(to: destination) else { return .failure(.noRoute) }
        guard route.ifindex == ifindex else { return .failure(.otherInterface) }
        guard let neighbour = Self.neighbour(route.gateway ?? destination, ifindex: ifindex),
              let own = Self.linkAddress(ifindex)
        else { return .failure(.noNeighbour) }
        return .success(NextHop(ifindex: ifindex, sourceMAC: own, destinationMAC: neighbour))
    }

    /// The unicast route to `destination`: its outgoing interface and gateway (nil: on-link).
    static func route(to destination: IPAddress) -> (ifindex: UInt32, gateway: IPAddress?)? {
        let address = destination.bytes
        // rtmsg (family, dst_len, src_len, tos, table, protocol, scope, type, flags) + RTA_DST.
        var body: [UInt8] = [UInt8(destination.family), UInt8(address.count * 8), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        appendAttribute(&body, type: 1, address)  // RTA_DST
        guard let reply = try? Rtnetlink.request(type: 26, flags: 0, body: body).first,  // RTM_GETROUTE
              reply.type == 24, reply.payload.count >= 12, reply.payload[7] == 1  // RTM_NEWROUTE, RTN_UNICAST
        else { return nil }
        var ifindex: UInt32?
        var gateway: IPAddress?
        for (type, value) in attributes(reply.payload, from: 12) {
            switch type {
            case 4 where value.count == 4: ifindex = Rtnetlink.load32(value, 0)  // RTA_OIF
            case 5: gateway = IPAddress(bytes: value)  // RTA_GATEWAY
            case 18 where value.count > 2: gateway = IPAddress(bytes: value.dropFirst(2))  // RTA_VIA (family, address)
            default: break
            }
        }
        return ifindex.map { ($0, gateway) }
    }

    /// The link-layer address of neighbour `ip` on `ifindex` when its state says it is known.
    static func neighbour(_ ip: IPAddress, ifindex: UInt32) -> [UInt8]? {
        // ndmsg (family, pad x3, ifindex, state u16, flags, type) + NDA_DST.
        var body: [UInt8] = [UInt8(ip.family), 0, 0, 0]
        Rtnetlink.append32(&body, ifindex)
        body += [0, 0, 0, 0]
        appendAttribute(&body, type: 1, ip.bytes)  // NDA_DST
        guard let reply = try? Rtnetlink.request(type: 30, flags: 0, body: body).first,  // RTM_GETNEIGH
              reply.type == 28, reply.payload.count >= 12  // RTM_NEWNEIGH
        else { return nil }
        // NUD_REACHABLE | NUD_STALE | NUD_DELAY | NUD_PROBE | NUD_PERMANENT
        guard Rtnetlink.load16(reply.payload, 8) & (0x02 | 0x04 | 0x08 | 0x10 | 0x80) != 0 else { return nil }
        return attributes(reply.payload, from: 12).first { $0.type == 2 && $0.value.count == 6 }?.value  // NDA_LLADDR
    }

    /// The interface's own MAC address (RTM_GETLINK, IFLA_ADDRESS).
    static func linkAddress(_ ifindex: UInt32) -> [UInt8]? {
        (try? linkAttributes(ifindex))?.first { $0.type == 1 && $0.value.count == 6 }?.value  // IFLA_ADDRESS
    }

    /// The interface's attributes (RTM_GETLINK), in the calling thread's network namespace.
    static func linkAttributes(_ ifindex: UInt32) throws(SystemCallError) -> [(type: UInt16, value: [UInt8])] {
        // ifinfomsg (family, pad, type u16, index i32, flags u32, change u32).
        var body: [UInt8] = [UInt8(AF_UNSPEC), 0, 0, 0]
        Rtnetlink.append32(&body, ifindex)
        body += [UInt8](repeating: 0, count: 8)
        guard let reply = try Rtnetlink.request(type: 18, flags: 0, body: body).first,  // RTM_GETLINK
              reply.type == 16, reply.payload.count >= 16  // RTM_NEWLINK
        else { return [] }
        return attributes(reply.payload, from: 16)
    }

    static func appendAttribute(_ body: inout [UInt8], type: UInt16, _ value: [UInt8]) {
        Rtnetlink.append16(&body, UInt16(4 + value.count))
        Rtnetlink.append16(&body, type)
        body += value
        while body.count % 4 != 0 { body.append(0) }
    }

    /// The rtattrs of `payload` from `offset`: (type without flag bits, value).
    static func attributes(_ payload: [UInt8], from offset: Int) -> [(type: UInt16, value: [UInt8])] {
        var result: [(UInt16, [UInt8])] = []
        var position = offset
        while position + 4 <= payload.count {
            let length = Int(Rtnetlink.load16(payload, position))
            guard length >= 4, position + length <= payload.count else { break }
            result.append((Rtnetlink.load16(payload, position + 2) & 0x3fff, Array(payload[(position + 4)..<(position + length)])))
            position += (length + 3) & ~3
        }
        return result
    }
}
