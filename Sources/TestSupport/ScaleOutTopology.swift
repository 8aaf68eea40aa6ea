// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// Several load-balancer nodes behind ECMP, in network namespaces this process creates
/// (addresses from 198.18.0.0/15 only):
///
///     clients ── router ══ multipath route to the VIP ══ node 1...N ── backends
///
/// - `clients`: 198.18.100.2 and the client sources 198.18.100.10... on `up0`, default route
///   to the router (198.18.100.1).
/// - `router`: one veth `n<i>` per node (198.18.(110+i).1), forwarding, the VIP 198.18.200.1/32
///   routed over every node at once (`nexthop via ... nexthop via ...`) with
///   `fib_multipath_hash_policy=1`: the L4 hash, so a source's ports spread it over the nodes.
/// - `node i`: `up0` toward the router (198.18.(110+i).2: the same name on every node, so every
///   node runs the same configuration), `down0` toward the backends (198.18.(120+i).1), the VIP
///   on `lo`, forwarding on, routes to the clients and to the backends' addresses.
/// - `backends`: one veth `n<i>` per node (198.18.(120+i).2), the backends' addresses
///   198.18.210.k/32 on `lo`, no route back (one way: receivers only count), `rp_filter` off so
///   a client's address may arrive on any node's link.
///
/// Names carry a random suffix so runs cannot collide; `destroy()` (also on deinit) deletes
/// the namespaces, and with them the veths.
public final class ScaleOutTopology {
    public let suffix: String
    public let clients: String
    public let router: String
    public let nodes: [String]
    public let backends: String
    /// The client source addresses, on the clients' interface.
    public let sources: [String]
    private var destroyed = false

    /// The address every node holds and the router spreads over them.
    public static let vip = "198.18.200.1"
    /// Each node's interface toward the router (where tc_ebpf attaches): one name on every node.
    public static let nodeInterface = "up0"
    /// Backend k's address (k from 1), on the backends namespace's loopback.
    public static func backendAddress(_ k: Int) -> String { "198.18.210.\(k)" }
    /// Node i's address toward the backends (i from 1): the source of what it forwards in userspace.
    public static func nodeAddress(_ i: Int) -> String { "198.18.\(120 + i).1" }
    /// The backends namespace's interface toward node i (i from 1).
    public static func backendsInterface(_ i: Int) -> String { "n\(i)" }

    /// With `bgp`, the router learns the VIP from the nodes (``FleetRouting``) instead of a
    /// static multipath route, and the router-node links have IPv6 addresses too
    /// (2001:db8:(110+i)::1 and ::2), with the IPv6 VIP ``vip6`` on every node's `lo`.
    public let bgp: Bool

    /// The IPv6 virtual address (with `bgp`).
    public static let vip6 = "2001:db8:200::1"

    public init(nodes count: Int, backends backendCount: Int, sources sourceCount: Int, bgp: Bool = false) throws {
        self.bgp = bgp
        precondition((1...9).contains(count) && (1...250).contains(backendCount) && (1...240).contains(sourceCount))
        let suffix = String(UInt32.random(in: 0...UInt32.max), radix: 16)
        self.suffix = suffix
        clients = "soc-\(suffix)"
        router = "sor-\(suffix)"
        nodes = (1...count).map { "so\($0)-\(suffix)" }
        backends = "sob-\(suffix)"
        sources = (0..<sourceCount).map { "198.18.100.\(10 + $0)" }
        do {
            try build(backendCount)
        } catch {
            destroy()
            throw error
        }
    }

    private func build(_ backendCount: Int) throws {
        for namespace in [clients, router, backends] + nodes {
            try Topology.ip(["netns", "add", namespace])
            try Topology.ip(["-n", namespace, "link", "set", "lo", "up"])
        }
        // Each veth is created inside one of its namespaces, so equal names on different nodes
        // (up0, down0) never meet in the host's namespace.
        try Topology.ip(["-n", clients, "link", "add", "up0", "type", "veth", "peer", "name", "cl0", "netns", router])
        try address(clients, "up0", "198.18.100.2/24")
        for source in sources { try Topology.ip(["-n", clients, "addr", "add", "\(source)/24", "dev", "up0"]) }
        try address(router, "cl0", "198.18.100.1/24")
        try Topology.ip(["-n", clients, "route", "add", "default", "via", "198.18.100.1"])
        for (index, node) in nodes.enumerated() {
            let i = index + 1
            try Topology.ip(["-n", node, "link", "add", Self.nodeInterface, "type", "veth", "peer", "name", "n\(i)", "netns", router])
            try address(node, Self.nodeInterface, "198.18.\(110 + i).2/24")
            try address(router, "n\(i)", "198.18.\(110 + i).1/24")
            try Topology.ip(["-n", node, "link", "add", "down0", "type", "veth", "peer", "name", Self.backendsInterface(i), "netns", backends])
            try address(node, "down0", "\(Self.nodeAddress(i))/24")
            try address(backends, Self.backendsInterface(i), "198.18.\(120 + i).2/24")
            try Topology.ip(["-n", node, "addr", "add", "\(Self.vip)/32", "dev", "lo"])
            try Topology.ip(["-n", node, "route", "add", "198.18.100.0/24", "via", "198.18.\(110 + i).1"])
            try Topology.ip(["-n", node, "route", "add", "198.18.210.0/24", "via", "198.18.\(120 + i).2"])
            try exec(node, ["/usr/sbin/sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        }
        for k in 1...backendCount { try Topology.ip(["-n", backends, "addr", "add", "\(Self.backendAddress(k))/32", "dev", "lo"]) }
        for name in ["all", "default"] + nodes.indices.map({ Self.backendsInterface($0 + 1) }) {
            try exec(backends, ["/usr/sbin/sysctl", "-q", "-w", "net.ipv4.conf.\(name).rp_filter=0"])
        }
        try exec(router, ["/usr/sbin/sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        try exec(router, ["/usr/sbin/sysctl", "-q", "-w", "net.ipv4.fib_multipath_hash_policy=1"])
        if bgp {
            try exec(router, ["/usr/sbin/sysctl", "-q", "-w", "net.ipv6.conf.all.forwarding=1"])
            try exec(router, ["/usr/sbin/sysctl", "-q", "-w", "net.ipv6.fib_multipath_hash_policy=1"])
            for (index, node) in nodes.enumerated() {
                let i = index + 1
                try Topology.ip(["-n", node, "addr", "add", "2001:db8:\(110 + i)::2/64", "dev", Self.nodeInterface, "nodad"])
                try Topology.ip(["-n", router, "addr", "add", "2001:db8:\(110 + i)::1/64", "dev", "n\(i)", "nodad"])
                try Topology.ip(["-n", node, "addr", "add", "\(Self.vip6)/128", "dev", "lo"])
            }
        } else {
            try route(through: Array(1...nodes.count))
        }
        // Neighbours resolved up front: while unresolved the kernel queues only a few packets
        // (and tc_ebpf's fib lookup finds no neighbour at all).
        try exec(clients, ["ping", "-c", "1", "-W", "3", "198.18.100.1"])
        for (index, node) in nodes.enumerated() {
            try exec(router, ["ping", "-c", "1", "-W", "3", "198.18.\(111 + index).2"])
            try exec(node, ["ping", "-c", "1", "-W", "3", "198.18.\(121 + index).2"])
        }
    }

    /// Routes the VIP over the given nodes (numbers from 1) with one equal-cost nexthop each.
    public func route(through chosen: [Int]) throws {
        let hops = chosen.flatMap { ["nexthop", "via", "198.18.\(110 + $0).2", "dev", "n\($0)"] }
        try Topology.ip(["-n", router, "route", "replace", "\(Self.vip)/32"] + hops)
    }

    deinit { destroy() }

    public func destroy() {
        guard !destroyed else { return }
        destroyed = true
        for namespace in [clients, router, backends] + nodes { _ = try? run(Topology.ip, ["netns", "delete", namespace]) }
    }

    /// The prefix that runs a command in `namespace`.
    public func prefix(_ namespace: String) -> [String] {
        ["/usr/bin/nsenter", "--net=/run/netns/\(namespace)", "--"]
    }

    /// Runs a command in `namespace`; throws with its output if it fails.
    @discardableResult
    public func exec(_ namespace: String, _ command: [String]) throws -> String {
        let result = try run("/usr/bin/nsenter", Array(prefix(namespace).dropFirst()) + command)
        try #require(result.status == 0, "\(command.joined(separator: " ")) in \(namespace): \(result.output)")
        return result.output
    }

    private func address(_ namespace: String, _ device: String, _ cidr: String) throws {
        try Topology.ip(["-n", namespace, "addr", "add", cidr, "dev", device])
        try Topology.ip(["-n", namespace, "link", "set", device, "up"])
    }
}
