// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// The routing daemons of a ``ScaleOutTopology`` made with `bgp: true`: FRR (zebra, bgpd, bfdd)
/// on the router with docs/fleet/frr-router.conf as written, and on each node BIRD 2 with
/// docs/fleet/bird-node.conf or FRR with docs/fleet/frr-node.conf, node 1's addresses replaced by
/// the node's own. Every daemon runs in the foreground as a child of the test (stopped by its
/// PID), with its configuration, control socket and pid file in a directory of this run.
/// `ip -ts monitor route` on the router records when the VIP's nexthops change.
///
/// With `servers`, the backends' namespace runs the servers' router too (FRR with
/// docs/fleet/frr-servers.conf as written), and every node's configuration gets its servers'
/// part (docs/fleet/bird-node-servers.conf or frr-node-servers.conf) appended: the backends'
/// route to the clients then goes through the ready nodes only, as `replies: nat` needs.
public final class FleetRouting {
    public enum Speaker: String, Sendable { case bird, frr }

    public let topology: ScaleOutTopology
    public let speakers: [Speaker]
    /// Whether the servers' router runs (in the backends' namespace).
    public let servers: Bool
    public let directory: URL
    private var children: [String: [Child]] = [:]
    private let monitor: Child
    /// `ip -ts monitor route` in the backends' namespace (with `servers`).
    private let serversMonitor: Child?
    private var stopped = false

    /// docs/fleet/ of this checkout.
    public static let examples = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .deletingLastPathComponent().appendingPathComponent("docs/fleet")

    /// Whether BIRD and FRR are installed (scripts/setup.sh installs them).
    public static var installed: Bool {
        FileManager.default.isExecutableFile(atPath: "/usr/sbin/bird") && FileManager.default.isExecutableFile(atPath: "/usr/lib/frr/bgpd")
    }

    /// The router's address toward node `i` and the node's own (IPv4).
    public static func routerAddress(_ i: Int) -> String { "198.18.\(110 + i).1" }
    public static func nodeUplink(_ i: Int) -> String { "198.18.\(110 + i).2" }

    /// The clients' prefix, routed by the servers' router through the VIP.
    public static let clientsPrefix = "198.18.100.0/24"

    public init(_ topology: ScaleOutTopology, speakers: [Speaker], servers: Bool = false) throws {
        precondition(topology.bgp && speakers.count == topology.nodes.count)
        self.topology = topology
        self.speakers = speakers
        self.servers = servers
        directory = URL(fileURLWithPath: "/tmp/fleet-\(topology.suffix)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        monitor = try Child.unblocked("/usr/sbin/ip", ["-n", topology.router, "-ts", "monitor", "route"])
        do {
            serversMonitor = servers ? try Child.unblocked("/usr/sbin/ip", ["-n", topology.backends, "-ts", "monitor", "route"]) : nil
        } catch {
            monitor.signal(SIGTERM)
            Self.end(monitor)
            throw error
        }
        do {
            try startFRR(in: topology.router, name: "router", config: try String(contentsOf: Self.examples.appendingPathComponent("frr-router.conf"), encoding: .utf8))
            if servers {
                try topology.exec(topology.backends, ["/usr/sbin/sysctl", "-q", "-w", "net.ipv4.fib_multipath_hash_policy=1"])
                try startFRR(in: topology.backends, name: "servers", daemons: ["zebra", "bfdd", "bgpd", "staticd"], config: try String(contentsOf: Self.examples.appendingPathComponent("frr-servers.conf"), encoding: .utf8))
            }
            for index in topology.nodes.indices { try startNode(index + 1) }
        } catch {
            stop()
            throw error
        }
    }

    deinit { stop() }

    /// Node 1's lines of an example, made node `i`'s.
    static func forNode(_ text: String, _ i: Int) -> String {
        text.replacingOccurrences(of: "198.18.111.", with: "198.18.\(110 + i).")
            .replacingOccurrences(of: "198.18.121.", with: "198.18.\(120 + i).")
            .replacingOccurrences(of: "2001:db8:111::", with: "2001:db8:\(110 + i)::")
            .replacingOccurrences(of: "hostname fanout-node", with: "hostname node\(i)")
    }

    /// Starts node `i`'s routing daemon (again, after ``kill(node:)``).
    public func startNode(_ i: Int) throws {
        let namespace = topology.nodes[i - 1]
        switch speakers[i - 1] {
        case .bird:
            var example = try String(contentsOf: Self.examples.appendingPathComponent("bird-node.conf"), encoding: .utf8)
            if servers { example += "\n" + (try String(contentsOf: Self.examples.appendingPathComponent("bird-node-servers.conf"), encoding: .utf8)) }
            let node = directory.appendingPathComponent("node\(i)")
            try FileManager.default.createDirectory(at: node, withIntermediateDirectories: true)
            let config = node.appendingPathComponent("bird.conf")
            try Self.forNode(example, i).write(to: config, atomically: true, encoding: .utf8)
            children[namespace] = [try Child.unblocked("/usr/sbin/bird", ["-f", "-c", config.path, "-s", node.appendingPathComponent("bird.ctl").path,
                                                                         "-P", node.appendingPathComponent("bird.pid").path], prefix: topology.prefix(namespace))]
        case .frr:
            // zebra announces a prefix's best route only, and an address would be a connected
            // route that always wins: the VIPs are local routes here (docs/fleet/frr-node.conf).
            for (address, length) in [(ScaleOutTopology.vip, 32), (ScaleOutTopology.vip6, 128)] {
                _ = try? run("/usr/sbin/ip", ["-n", namespace, "addr", "del", "\(address)/\(length)", "dev", "lo"])
                let family = length == 32 ? "-4" : "-6"
                if (try? run("/usr/sbin/ip", [family, "-n", namespace, "route", "show", "table", "local", address]))?.output.isEmpty ?? true {
                    try Topology.ip([family, "-n", namespace, "route", "add", "local", "\(address)/\(length)", "dev", "lo", "table", "local"])
                }
            }
            try topology.exec(namespace, ["/usr/sbin/sysctl", "-q", "-w", "net.ipv6.ip_nonlocal_bind=1"])
            var example = try String(contentsOf: Self.examples.appendingPathComponent("frr-node.conf"), encoding: .utf8)
            if servers { example += "!\n" + (try String(contentsOf: Self.examples.appendingPathComponent("frr-node-servers.conf"), encoding: .utf8)) }
            try startFRR(in: namespace, name: "node\(i)", config: Self.forNode(example, i))
        }
    }

    /// FRR's `daemons` (zebra first) in `namespace`, then `config` loaded through vtysh.
    private func startFRR(in namespace: String, name: String, daemons: [String] = ["zebra", "bfdd", "bgpd"], config: String) throws {
        let place = directory.appendingPathComponent(name)
        try FileManager.default.createDirectory(at: place, withIntermediateDirectories: true)
        let empty = place.appendingPathComponent("empty.conf")
        try "".write(to: empty, atomically: true, encoding: .utf8)
        let file = place.appendingPathComponent("frr.conf")
        try config.write(to: file, atomically: true, encoding: .utf8)
        // The daemons drop to user frr: their directory must be its.
        _ = try run("/usr/bin/chown", ["-R", "frr:frr", place.path])
        children[namespace] = []
        for daemon in daemons {
            var arguments = ["-u", "frr", "-g", "frr", "-f", empty.path, "-i", place.appendingPathComponent("\(daemon).pid").path,
                             "-z", place.appendingPathComponent("zserv.api").path, "--vty_socket", place.path, "-A", "127.0.0.1", "-P", "0"]
            if daemon == "bfdd" { arguments += ["--bfdctl", place.appendingPathComponent("bfdd.sock").path] }
            // Kept at once: a later failure still stops it.
            children[namespace, default: []].append(try Child.unblocked("/usr/lib/frr/\(daemon)", arguments, prefix: topology.prefix(namespace)))
            // bgpd and bfdd connect to zebra's socket.
            if daemon == "zebra" {
                _ = Probe.waitFor(seconds: 5) { FileManager.default.fileExists(atPath: place.appendingPathComponent("zserv.api").path) }
            }
        }
        let started = children[namespace] ?? []
        let ready = Probe.waitFor(seconds: 10) {
            daemons.allSatisfy { FileManager.default.fileExists(atPath: place.appendingPathComponent("\($0).vty").path) }
        }
        try #require(ready, "FRR in \(namespace): \(started.map(\.stderr).joined(separator: "\n"))")
        let loaded = try vtysh(namespace, name: name, ["-f", file.path])
        try #require(loaded.status == 0, "vtysh -f \(file.lastPathComponent) in \(namespace): \(loaded.output)")
        _ = try vtysh(namespace, name: name, ["-c", "configure terminal", "-c", "log file \(place.appendingPathComponent("frr.log").path)", "-c", "log timestamp precision 3"])
    }

    /// Runs vtysh against the FRR of `name` (router, node<i>).
    @discardableResult
    public func vtysh(_ namespace: String, name: String, _ arguments: [String]) throws -> (status: Int32, output: String) {
        try run("/usr/bin/nsenter", ["--net=/run/netns/\(namespace)", "--", "/usr/bin/vtysh", "--vty_socket", directory.appendingPathComponent(name).path] + arguments)
    }

    /// The nodes (numbers from 1) whose sessions with the router (or the servers' router) are
    /// established, IPv4 and IPv6.
    public func establishedNodes(servers: Bool = false) -> (v4: Set<Int>, v6: Set<Int>) {
        var v4 = Set<Int>(), v6 = Set<Int>()
        let (namespace, name) = servers ? (topology.backends, "servers") : (topology.router, "router")
        guard let text = try? vtysh(namespace, name: name, ["-c", "show bgp summary json"]).output,
              let object = try? JSONSerialization.jsonObject(with: Data(text.utf8)) as? [String: Any] else { return (v4, v6) }
        for (family, key) in [("ipv4Unicast", 4), ("ipv6Unicast", 6)] {
            let peers = (object[family] as? [String: Any])?["peers"] as? [String: Any] ?? [:]
            for (peer, value) in peers where (value as? [String: Any])?["state"] as? String == "Established" {
                for i in topology.nodes.indices.map({ $0 + 1 })
                where peer == Self.nodeUplink(i) || peer == "2001:db8:\(110 + i)::2" || peer == ScaleOutTopology.nodeAddress(i) {
                    if key == 4 { v4.insert(i) } else { v6.insert(i) }
                }
            }
        }
        return (v4, v6)
    }

    /// The nodes (numbers from 1) the router's route to `address` goes through now (with
    /// `servers`, the servers' route: its devices n<i> lead to node i too).
    public func routerNodes(_ address: String, servers: Bool = false) -> Set<Int> {
        let namespace = servers ? topology.backends : topology.router
        guard let text = try? run("/usr/sbin/ip", [address.contains(":") ? "-6" : "-4", "-n", namespace, "-j", "route", "show", address]).output,
              let routes = try? JSONSerialization.jsonObject(with: Data(text.utf8)) as? [[String: Any]] else { return [] }
        // By device: IPv6 nexthops are the nodes' link-local addresses.
        var devices: [String] = []
        for route in routes {
            if let device = route["dev"] as? String { devices.append(device) }
            for hop in route["nexthops"] as? [[String: Any]] ?? [] { if let device = hop["dev"] as? String { devices.append(device) } }
        }
        return Set(topology.nodes.indices.map { $0 + 1 }.filter { devices.contains("n\($0)") })
    }

    /// Waits until the router's route to `address` goes through exactly `nodes`; returns when
    /// it did (nil: not within `seconds`).
    public func waitForRouter(_ address: String, nodes: Set<Int>, servers: Bool = false, seconds: Double = 15) -> ContinuousClock.Instant? {
        let deadline = ContinuousClock.now + .milliseconds(Int(seconds * 1000))
        while ContinuousClock.now < deadline {
            if routerNodes(address, servers: servers) == nodes { return ContinuousClock.now }
            usleep(50_000)
        }
        return nil
    }

    /// When the router's (or the servers' router's) route to `address` changed, as `ip -ts
    /// monitor route` printed it (wall clock, seconds since the epoch).
    public func routeChanges(_ address: String, servers: Bool = false) -> [Double] {
        ((servers ? serversMonitor : monitor)?.stdout ?? "").split(separator: "\n").compactMap { line -> Double? in
            // "[2026-11-26T16:12:43.123456] [Deleted ]198.18.200.1 ..."; nexthop lines follow.
            guard line.hasPrefix("["), let close = line.firstIndex(of: "]"), line.contains(" \(address) ") else { return nil }
            return Self.seconds(String(line[line.index(after: line.startIndex)..<close]))
        }
    }

    /// The first change of the router's route to `address` at or after `time`, seconds after it.
    public func convergence(_ address: String, after time: Double, servers: Bool = false) -> Double? {
        routeChanges(address, servers: servers).first { $0 >= time }.map { $0 - time }
    }

    static func seconds(_ stamp: String) -> Double? {
        // 2026-11-26T16:12:43.123456
        let parts = stamp.split(separator: ".")
        guard parts.count == 2, let fraction = Double("0." + parts[1]) else { return nil }
        let formatter = DateFormatter()
        formatter.locale = Locale(identifier: "en_US_POSIX")
        formatter.timeZone = TimeZone.current  // ip -ts prints local time
        formatter.dateFormat = "yyyy-MM-dd'T'HH:mm:ss"
        guard let date = formatter.date(from: String(parts[0])) else { return nil }
        return date.timeIntervalSince1970 + fraction
    }

    /// Kills node `i`'s routing daemon with SIGKILL (a crash: no withdrawal, no notification).
    public func kill(node i: Int) {
        for child in children[topology.nodes[i - 1]] ?? [] where child.process.isRunning {
            child.signal(SIGKILL)
            Self.end(child)
        }
    }

    /// Waits up to 5 s for a child signalled to end, then kills it: a slow cleanup is not a
    /// test failure.
    static func end(_ child: Child) {
        for _ in 0..<250 where child.process.isRunning { usleep(20_000) }
        if child.process.isRunning { child.signal(SIGKILL) }
        child.process.waitUntilExit()
    }

    /// The routing daemons' own logs, for a failed expectation.
    public var logs: String {
        children.map { namespace, started in "\(namespace):\n" + started.map { $0.stderr.suffix(2000) }.joined(separator: "\n") }.joined(separator: "\n")
    }

    /// Stops every daemon of this run by its PID, then removes the directory.
    public func stop() {
        guard !stopped else { return }
        stopped = true
        for started in children.values {
            for child in started where child.process.isRunning { child.signal(SIGTERM) }
            for child in started { Self.end(child) }
        }
        for monitor in [monitor, serversMonitor].compactMap({ $0 }) {
            if monitor.process.isRunning { monitor.signal(SIGTERM) }
            Self.end(monitor)
        }
        try? FileManager.default.removeItem(at: directory)
    }
}
