// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// A two-way load-balancing topology in network namespaces this process creates (addresses
/// from 198.18.0.0/15 and 2001:db8::/32 only):
///
///     clients ─── lb ─── server N   (one namespace each, N = 1...)
///
/// - `clients`: one veth toward the load balancer with `clientAddress(0)` (198.18.0.2,
///   2001:db8::2) and the client addresses `clientAddress(1...)` (198.18.0.10..., 2001:db8::10...);
///   default routes via the load balancer.
/// - `lb`: the VIP (198.18.0.1, 2001:db8::1) on `clientInterface`, forwarding on, one veth per
///   server (`serverInterface(N)`: 198.18.N.1, 2001:db8:N::1); every client address's neighbour
///   entry is written up front (permanent), so the first reply to a client is not held back by
///   neighbour resolution.
/// - `server N`: 198.18.N.2 and 2001:db8:N::2 on its own veth, default route via the load
///   balancer: replies go back through it, as two-way balancing (LVS-NAT style) needs.
///
/// Names carry a random suffix so runs cannot collide; a failure while building deletes what
/// was made, and `destroy()` (also on deinit) deletes the namespaces, and with them the veths.
public final class TwoWayTopology {
    public let suffix: String
    public let clients: String
    public let balancer: String
    public let servers: [String]
    /// The load balancer's interface toward the clients (holds the VIP).
    public let clientInterface: String
    /// The clients' interface toward the load balancer.
    public let clientsDevice: String
    /// Client addresses besides `clientAddress(0)`.
    public let clientAddressCount: Int
    private var destroyed = false

    /// The VIP of one family.
    public static func vip(ipv6: Bool = false) -> String { ipv6 ? "2001:db8::1" : "198.18.0.1" }
    /// Client address `k`: 0 is the clients' own address, 1... the extra client addresses.
    public static func clientAddress(_ k: Int, ipv6: Bool = false) -> String {
        if k == 0 { return ipv6 ? "2001:db8::2" : "198.18.0.2" }
        return ipv6 ? "2001:db8::\(String(0x10 + k - 1, radix: 16))" : "198.18.0.\(10 + k - 1)"
    }
    /// The client addresses 1...count as a `publisher --sources` range.
    public func clientRange(ipv6: Bool = false) -> String {
        "\(Self.clientAddress(1, ipv6: ipv6))-\(Self.clientAddress(clientAddressCount, ipv6: ipv6))"
    }
    /// Server N's address (N from 1).
    public static func serverAddress(_ n: Int, ipv6: Bool = false) -> String { ipv6 ? "2001:db8:\(n)::2" : "198.18.\(n).2" }
    /// The load balancer's interface toward server N (N from 1).
    public func serverInterface(_ n: Int) -> String { "s\(n)\(suffix.prefix(8))" }

    /// - Parameters:
    ///   - servers: real servers, 1...200.
    ///   - clientAddresses: client addresses besides the clients' own, 1...240.
    public init(servers count: Int, clientAddresses: Int = 50) throws {
        precondition((1...200).contains(count) && (1...240).contains(clientAddresses))
        let suffix = String(UInt32.random(in: 0...UInt32.max), radix: 16)
        self.suffix = suffix
        clients = "twc-\(suffix)"
        balancer = "twl-\(suffix)"
        servers = (1...count).map { "tw\($0)-\(suffix)" }
        clientInterface = "l\(suffix.prefix(8))"
        clientsDevice = "c\(suffix.prefix(8))"
        clientAddressCount = clientAddresses
        do {
            try build()
        } catch {
            destroy()
            throw error
        }
    }

    private func build() throws {
        for namespace in [clients, balancer] + servers {
            try Topology.ip(["netns", "add", namespace])
            try Topology.ip(["-n", namespace, "link", "set", "lo", "up"])
        }
        try Topology.ip(["link", "add", clientsDevice, "netns", clients, "type", "veth", "peer", "name", clientInterface, "netns", balancer])
        try link(clients, clientsDevice, v4: "198.18.0.2/24", v6: "2001:db8::2/64")
        try link(balancer, clientInterface, v4: "198.18.0.1/24", v6: "2001:db8::1/64")
        var batch = ""
        for k in 1...clientAddressCount {
            batch += "addr add \(Self.clientAddress(k))/24 dev \(clientsDevice)\n"
            batch += "addr add \(Self.clientAddress(k, ipv6: true))/64 dev \(clientsDevice) nodad\n"
        }
        try batchIP(clients, batch)
        try Topology.ip(["-n", clients, "route", "add", "default", "via", "198.18.0.1"])
        try Topology.ip(["-n", clients, "-6", "route", "add", "default", "via", "2001:db8::1"])
        for (index, server) in servers.enumerated() {
            let n = index + 1
            let inner = "v\(n)\(suffix.prefix(8))"
            try Topology.ip(["link", "add", serverInterface(n), "netns", balancer, "type", "veth", "peer", "name", inner, "netns", server])
            try link(balancer, serverInterface(n), v4: "198.18.\(n).1/24", v6: "2001:db8:\(n)::1/64")
            try link(server, inner, v4: "\(Self.serverAddress(n))/24", v6: "\(Self.serverAddress(n, ipv6: true))/64")
            try Topology.ip(["-n", server, "route", "add", "default", "via", "198.18.\(n).1"])
            try Topology.ip(["-n", server, "-6", "route", "add", "default", "via", "2001:db8:\(n)::1"])
        }
        for setting in ["net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"] {
            try exec(balancer, ["/usr/sbin/sysctl", "-q", "-w", setting])
        }
        // Every client address's neighbour entry on the load balancer, permanent: replies to
        // 240 clients at once would otherwise wait on (and overflow) neighbour resolution.
        // (`ip link`, not /sys/class/net: nsenter keeps the host's /sys.)
        let link = try exec(clients, [Topology.ip, "-o", "link", "show", "dev", clientsDevice])
        let words = link.split(separator: " ")
        let mac = try #require(words.firstIndex(of: "link/ether").map { String(words[$0 + 1]) }, "no MAC in: \(link)")
        var neighbours = ""
        for k in 0...clientAddressCount {
            neighbours += "neigh replace \(Self.clientAddress(k)) lladdr \(mac) dev \(clientInterface) nud permanent\n"
            neighbours += "neigh replace \(Self.clientAddress(k, ipv6: true)) lladdr \(mac) dev \(clientInterface) nud permanent\n"
        }
        try batchIP(balancer, neighbours)
        // The other neighbours resolved by a ping each way.
        try exec(clients, ["ping", "-c", "1", "-W", "3", "198.18.0.1"])
        try exec(clients, ["ping", "-6", "-c", "1", "-W", "3", "2001:db8::1"])
        for n in 1...servers.count {
            try exec(balancer, ["ping", "-c", "1", "-W", "3", Self.serverAddress(n)])
            try exec(balancer, ["ping", "-6", "-c", "1", "-W", "3", Self.serverAddress(n, ipv6: true)])
            try exec(servers[n - 1], ["ping", "-c", "1", "-W", "3", "198.18.\(n).1"])
            try exec(servers[n - 1], ["ping", "-6", "-c", "1", "-W", "3", "2001:db8:\(n)::1"])
        }
    }

    deinit { destroy() }

    public func destroy() {
        guard !destroyed else { return }
        destroyed = true
        for namespace in [clients, balancer] + servers { _ = try? run(Topology.ip, ["netns", "delete", namespace]) }
    }

    /// The prefix that runs a command in `namespace` (nsenter: keeps /sys/fs/bpf visible).
    public func prefix(_ namespace: String) -> [String] { Topology.prefix(namespace) }

    /// Runs a command in `namespace`; throws with its output if it fails.
    @discardableResult
    public func exec(_ namespace: String, _ command: [String]) throws -> String { try Topology.exec(namespace, command) }

    private func link(_ namespace: String, _ name: String, v4: String, v6: String) throws {
        try Topology.ip(["-n", namespace, "addr", "add", v4, "dev", name])
        try Topology.ip(["-n", namespace, "-6", "addr", "add", v6, "dev", name, "nodad"])
        try Topology.ip(["-n", namespace, "link", "set", name, "up"])
    }

    /// `ip -batch` in `namespace`: hundreds of commands in one process.
    private func batchIP(_ namespace: String, _ commands: String) throws {
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("twoway-\(UUID().uuidString).ip")
        try commands.write(to: file, atomically: true, encoding: .utf8)
        defer { try? FileManager.default.removeItem(at: file) }
        try Topology.ip(["-n", namespace, "-batch", file.path])
    }
}
