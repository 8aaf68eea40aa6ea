// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// A routed test topology in network namespaces this process creates (addresses from
/// 198.18.0.0/15 and 2001:db8::/32 only):
///
///     client 198.18.0.2 ── 198.18.0.1 proxy 198.18.N.1 ── 198.18.N.2 backend N   (N = 1...)
///            2001:db8::2     2001:db8::1    2001:db8:N::1    2001:db8:N::2
///
/// The proxy forwards (IPv4 and IPv6), the client's and backends' default routes point at it,
/// and every neighbour is resolved up front. Names carry a random suffix so runs cannot
/// collide; `destroy()` (also on deinit) deletes the namespaces, and with them the veths.
public final class Topology {
    public let suffix: String
    public let client: String
    public let proxy: String
    public let backends: [String]
    /// The proxy's interface toward the client (where tc_ebpf attaches).
    public let proxyInterface: String
    private var destroyed = false
    static let ip = "/usr/sbin/ip"

    /// - Parameter queues: TX and RX queues of the client–proxy veth pair (af_xdp serves one
    ///   AF_XDP socket per RX queue; the client's flows spread over them by hash).
    public init(backends count: Int, mtu: Int = 1500, queues: Int = 1) throws {
        let suffix = String(UInt32.random(in: 0...UInt32.max), radix: 16)
        self.suffix = suffix
        client = "tcc-\(suffix)"
        proxy = "tcp-\(suffix)"
        backends = (1...count).map { "tcb\($0)-\(suffix)" }
        proxyInterface = "pc\(suffix.prefix(8))"
        for namespace in [client, proxy] + backends {
            try Self.ip(["netns", "add", namespace])
            try Self.ip(["-n", namespace, "link", "set", "lo", "up"])
        }
        let queueArguments = ["numtxqueues", "\(queues)", "numrxqueues", "\(queues)"]
        try Self.ip(["link", "add", "cp\(suffix.prefix(8))", "netns", client, "mtu", "\(mtu)"] + queueArguments + ["type", "veth",
                     "peer", "name", proxyInterface, "netns", proxy, "mtu", "\(mtu)"] + queueArguments)
        try link(client, "cp\(suffix.prefix(8))", v4: "198.18.0.2/24", v6: "2001:db8::2/64")
        try link(proxy, proxyInterface, v4: "198.18.0.1/24", v6: "2001:db8::1/64")
        try Self.ip(["-n", client, "route", "add", "default", "via", "198.18.0.1"])
        try Self.ip(["-n", client, "-6", "route", "add", "default", "via", "2001:db8::1"])
        for (index, backend) in backends.enumerated() {
            let n = index + 1
            let (outer, inner) = ("pb\(n)\(suffix.prefix(7))", "b\(n)\(suffix.prefix(8))")
            try Self.ip(["link", "add", outer, "netns", proxy, "mtu", "\(mtu)", "type", "veth", "peer", "name", inner, "netns", backend, "mtu", "\(mtu)"])
            try link(proxy, outer, v4: "198.18.\(n).1/24", v6: "2001:db8:\(n)::1/64")
            try link(backend, inner, v4: "198.18.\(n).2/24", v6: "2001:db8:\(n)::2/64")
            try Self.ip(["-n", backend, "route", "add", "default", "via", "198.18.\(n).1"])
            try Self.ip(["-n", backend, "-6", "route", "add", "default", "via", "2001:db8:\(n)::1"])
        }
        for setting in ["net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"] {
            try exec(proxy, ["/usr/sbin/sysctl", "-q", "-w", setting])
        }
        // Neighbours resolved up front: while unresolved the kernel queues only a few packets.
        for n in 0...count {
            try exec(proxy, ["ping", "-c", "1", "-W", "3", "198.18.\(n).2"])
            try exec(proxy, ["ping", "-6", "-c", "1", "-W", "3", "2001:db8:\(n == 0 ? "" : "\(n):"):2"])
        }
    }

    deinit { destroy() }

    public func destroy() {
        guard !destroyed else { return }
        destroyed = true
        for namespace in [client, proxy] + backends { _ = try? run(Self.ip, ["netns", "delete", namespace]) }
    }

    /// The prefix that runs a command in `namespace`.
    public func prefix(_ namespace: String) -> [String] { Self.prefix(namespace) }

    /// Runs a command in `namespace`; throws with its output if it fails.
    @discardableResult
    public func exec(_ namespace: String, _ command: [String]) throws -> String { try Self.exec(namespace, command) }

    /// nsenter, not `ip netns exec` (which remounts /sys and hides /sys/fs/bpf).
    static func prefix(_ namespace: String) -> [String] {
        ["/usr/bin/nsenter", "--net=/run/netns/\(namespace)", "--"]
    }

    static func exec(_ namespace: String, _ command: [String]) throws -> String {
        let result = try run(prefix(namespace)[0], Array(prefix(namespace).dropFirst()) + command)
        try #require(result.status == 0, "\(command.joined(separator: " ")) in \(namespace): \(result.output)")
        return result.output
    }

    /// What the kernel dropped between the client and the proxy, before any socket of the proxy:
    /// the client veth's TX drops (veth counts a full backlog of its peer there) plus the proxy
    /// interface's RX drops. A loaded machine can overflow the per-CPU backlog
    /// (`net.core.netdev_max_backlog`) while softirqs wait for a CPU; no udp-fanout counter can
    /// see those datagrams, the kernel's do.
    public func clientPathDrops() throws -> Int {
        try Self.dropped(self, client, "cp\(suffix.prefix(8))", "tx") + Self.dropped(self, proxy, proxyInterface, "rx")
    }

    /// The datagrams the client's veth could not hand to the proxy's side (its TX drops: veth
    /// counts there each one its peer's full backlog refused), each once. The proxy side's RX
    /// drops count the same datagrams again (the backlog's own drop), and any other packet too.
    public func clientSendDrops() throws -> Int {
        try Self.dropped(self, client, "cp\(suffix.prefix(8))", "tx")
    }

    /// The datagrams the backends' veths could not hand to the proxy's side (their TX drops, as
    /// ``clientSendDrops()``): replies a full backlog refused before any proxy socket saw them.
    public func backendSendDrops() throws -> Int {
        try backends.enumerated().reduce(0) { sum, backend in
            try sum + Self.dropped(self, backend.element, "b\(backend.offset + 1)\(suffix.prefix(8))", "tx")
        }
    }

    /// The kernel's UDP counters in `namespace`: /proc/net/snmp's `Udp:` row by name (`NoPorts`,
    /// `RcvbufErrors`, `InErrors`, `InCsumErrors`, ...) and /proc/net/snmp6's `Udp6...` lines
    /// (`Udp6InCsumErrors`, ...). A counter the kernel does not print is absent.
    public func udpCounters(_ namespace: String) throws -> [String: Int] {
        var counters: [String: Int] = [:]
        let rows = try exec(namespace, ["cat", "/proc/net/snmp"]).split(separator: "\n").filter { $0.hasPrefix("Udp: ") }
        if rows.count == 2 {
            for (name, value) in zip(rows[0].split(separator: " "), rows[1].split(separator: " ")) { counters[String(name)] = Int(value) }
        }
        for line in try exec(namespace, ["cat", "/proc/net/snmp6"]).split(separator: "\n") where line.hasPrefix("Udp6") {
            let fields = line.split(whereSeparator: { $0 == " " || $0 == "\t" })
            if fields.count == 2 { counters[String(fields[0])] = Int(fields[1]) }
        }
        return counters
    }

    private static func dropped(_ topology: Topology, _ namespace: String, _ interface: String, _ direction: String) throws -> Int {
        let text = try topology.exec(namespace, [Self.ip, "-s", "-j", "link", "show", "dev", interface])
        guard let links = try JSONSerialization.jsonObject(with: Data(text.utf8)) as? [[String: Any]],
              let stats = links.first?["stats64"] as? [String: Any], let side = stats[direction] as? [String: Any],
              let value = side["dropped"] as? Int else {
            throw TopologyError.unreadable("ip -s -j link show dev \(interface) in \(namespace): \(text)")
        }
        return value
    }

    /// Backend N's IPv4 / IPv6 address (N from 1).
    public static func backendIPv4(_ n: Int) -> String { "198.18.\(n).2" }
    public static func backendIPv6(_ n: Int) -> String { "2001:db8:\(n)::2" }

    private func link(_ namespace: String, _ name: String, v4: String, v6: String) throws {
        try Self.ip(["-n", namespace, "addr", "add", v4, "dev", name])
        try Self.ip(["-n", namespace, "-6", "addr", "add", v6, "dev", name, "nodad"])
        try Self.ip(["-n", namespace, "link", "set", name, "up"])
    }

    static func ip(_ arguments: [String]) throws {
        let result = try run(ip, arguments)
        try #require(result.status == 0, "ip \(arguments.joined(separator: " ")): \(result.output)")
    }
}

/// A one-arm test topology: client, load balancer and backends on one Ethernet segment (a bridge
/// in a namespace of its own), all in 198.18.0.0/24 and 2001:db8::/64, as with MetalLB L2 on one
/// NIC. The load balancer's veth has `queues` RX and TX queues, and every neighbour is resolved
/// up front.
///
///     client 198.18.0.2 ─┐
///     lb     198.18.0.1 ─┼─ bridge
///     backend N 198.18.0.1N ─┘   (2001:db8::2, ::1, ::1N)
public final class OneArmTopology {
    public let suffix: String
    public let bridge: String
    public let client: String
    public let balancer: String
    public let backends: [String]
    /// The load balancer's interface on the segment.
    public let balancerInterface: String
    private var destroyed = false

    public static func backendIPv4(_ n: Int) -> String { "198.18.0.1\(n)" }
    public static func backendIPv6(_ n: Int) -> String { "2001:db8::1\(n)" }

    public init(backends count: Int, queues: Int = 2) throws {
        let suffix = String(UInt32.random(in: 0...UInt32.max), radix: 16)
        self.suffix = suffix
        bridge = "oab-\(suffix)"
        client = "oac-\(suffix)"
        balancer = "oal-\(suffix)"
        backends = (1...count).map { "oa\($0)-\(suffix)" }
        balancerInterface = "l\(suffix.prefix(8))"
        for namespace in [bridge, client, balancer] + backends {
            try Topology.ip(["netns", "add", namespace])
            try Topology.ip(["-n", namespace, "link", "set", "lo", "up"])
        }
        try Topology.ip(["-n", bridge, "link", "add", "br0", "type", "bridge"])
        try Topology.ip(["-n", bridge, "link", "set", "br0", "up"])
        let queueArguments = ["numtxqueues", "\(queues)", "numrxqueues", "\(queues)"]
        var ends: [(namespace: String, name: String, v4: String, v6: String, queues: [String])] = [
            (client, "c\(suffix.prefix(8))", "198.18.0.2/24", "2001:db8::2/64", []),
            (balancer, balancerInterface, "198.18.0.1/24", "2001:db8::1/64", queueArguments),
        ]
        for (index, backend) in backends.enumerated() {
            ends.append((backend, "b\(index + 1)\(suffix.prefix(7))", "\(Self.backendIPv4(index + 1))/24", "\(Self.backendIPv6(index + 1))/64", []))
        }
        for (index, end) in ends.enumerated() {
            let port = "p\(index)\(suffix.prefix(8))"
            try Topology.ip(["link", "add", port, "netns", bridge] + end.queues + ["type", "veth", "peer", "name", end.name, "netns", end.namespace] + end.queues)
            try Topology.ip(["-n", bridge, "link", "set", port, "master", "br0"])
            try Topology.ip(["-n", bridge, "link", "set", port, "up"])
            try Topology.ip(["-n", end.namespace, "addr", "add", end.v4, "dev", end.name])
            try Topology.ip(["-n", end.namespace, "-6", "addr", "add", end.v6, "dev", end.name, "nodad"])
            try Topology.ip(["-n", end.namespace, "link", "set", end.name, "up"])
        }
        // Neighbours resolved up front, both ways (the balancer's toward every backend is what xdp_tx reads).
        for n in 1...count {
            try exec(balancer, ["ping", "-c", "1", "-W", "3", Self.backendIPv4(n)])
            try exec(balancer, ["ping", "-6", "-c", "1", "-W", "3", Self.backendIPv6(n)])
        }
        try exec(client, ["ping", "-c", "1", "-W", "3", "198.18.0.1"])
        try exec(client, ["ping", "-6", "-c", "1", "-W", "3", "2001:db8::1"])
    }

    deinit { destroy() }

    public func destroy() {
        guard !destroyed else { return }
        destroyed = true
        for namespace in [bridge, client, balancer] + backends { _ = try? run(Topology.ip, ["netns", "delete", namespace]) }
    }

    public func prefix(_ namespace: String) -> [String] { Topology.prefix(namespace) }

    @discardableResult
    public func exec(_ namespace: String, _ command: [String]) throws -> String { try Topology.exec(namespace, command) }
}

/// A topology's state could not be read.
public enum TopologyError: Error, CustomStringConvertible {
    case unreadable(String)

    public var description: String {
        switch self {
        case .unreadable(let what): return "could not read \(what)"
        }
    }
}
