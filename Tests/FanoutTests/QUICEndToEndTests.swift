// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// Real QUIC through udp-fanout in namespaces: aioquic servers that issue QUIC-LB connection IDs
/// (Tests/quic/quic_lb_server.py) behind a listener, and aioquic clients that change their
/// address and port halfway through a transfer (Tests/quic/quic_migrate_client.py). With
/// `quic_lb` every connection completes on its server; with source-IP balancing alone the
/// migration sends a connection to another server, which does not know it.
@Suite("QUIC-LB end to end in namespaces", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct QUICEndToEndTests {
    static let port: UInt16 = 4433
    static let metricsPort = 9465
    static let scripts = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().appendingPathComponent("quic")
    /// The client addresses the connections start from and move to (connection i from source
    /// i mod 4 to source i+1 mod 4).
    static let sources = (1...4).map { TwoWayTopology.clientAddress($0) }

    /// One QUIC-LB layout: plaintext, four-pass or single-pass.
    struct Layout: CustomStringConvertible, Sendable {
        var serverIDLength: Int
        var nonceLength: Int
        var key: String?
        var description: String { key == nil ? "plaintext" : serverIDLength + nonceLength == 16 ? "single-pass AES" : "four-pass AES" }
        func serverID(_ n: Int) -> String { String(repeating: "0a", count: serverIDLength - 1) + String(format: "%02x", n) }
    }

    static let layouts = [
        Layout(serverIDLength: 2, nonceLength: 6, key: nil),
        Layout(serverIDLength: 2, nonceLength: 6, key: "8f95f09245765f80256934e50c66207f"),
        Layout(serverIDLength: 8, nonceLength: 8, key: "fdf726a9893ec05c0632d3956680baf0"),
    ]

    /// A two-way listener on the VIP over servers 1...count (a relay, or tc_ebpf or xdp nat at
    /// the clients' interface); `layout` nil: source-IP balancing alone.
    static func config(servers count: Int, layout: Layout?, path: TwoWayEndToEndTests.Path = .relay, topology: TwoWayTopology? = nil) -> String {
        let mode: String
        switch path {
        case .relay: mode = "    mode: userspace\n    replies: relay"
        case .nat: mode = "    interface: \(topology?.clientInterface ?? "")\n    mode: tc_ebpf\n    replies: nat"
        case .xdp: mode = "    interface: \(topology?.clientInterface ?? "")\n    mode: xdp\n    replies: nat"
        }
        let downstreams = (1...count).map { n in
            "      - {name: s\(n), address: \"\(TwoWayTopology.serverAddress(n)):\(port)\"\(layout.map { ", server_id: \"\($0.serverID(n))\"" } ?? "")}"
        }.joined(separator: "\n")
        let quic = layout.map { layout in
            "    quic_lb: {config_id: 1, server_id_length: \(layout.serverIDLength), nonce_length: \(layout.nonceLength)\(layout.key.map { ", key: \($0)" } ?? "")}\n"
        } ?? ""
        return """
            listeners:
              - name: quic
                bind: "\(TwoWayTopology.vip()):\(port)"
            \(mode)
                balancing: source_ip
            \(quic)    downstream:
            \(downstreams)
            metrics: {enabled: true, bind: "127.0.0.1:\(metricsPort)"}

            """
    }

    /// The QUIC servers, each issuing IDs of its server ID under `layout` (config ID 1).
    static func servers(_ topology: TwoWayTopology, layout: Layout) throws -> [Child] {
        try (1...topology.servers.count).map { n in
            var arguments = ["--listen", "\(TwoWayTopology.serverAddress(n)):\(port)",
                             "--name", "s\(n)", "--server-id", layout.serverID(n), "--config-id", "1", "--nonce-length", "\(layout.nonceLength)",
                             "--duration", "120"]
            if let key = layout.key { arguments += ["--key", key] }
            // The scripts run with the python3 on PATH (where scripts/setup.sh installs aioquic).
            let child = try Child.unblocked(scripts.appendingPathComponent("quic_lb_server.py").path, arguments, prefix: topology.prefix(topology.servers[n - 1]))
            let ready = Probe.waitFor(seconds: 20) { child.stdout.contains("\"ready\"") || !child.process.isRunning }
            try #require(ready && child.process.isRunning, "server s\(n) not ready: \(child.stderr)")
            return child
        }
    }

    /// `connections` clients transferring `bytes` each through the VIP (moving halfway with
    /// `migrate`), started.
    static func startClients(_ topology: TwoWayTopology, connections: Int, bytes: Int, migrate: Bool = true, timeout: Int = 15) throws -> Child {
        try Child.unblocked(scripts.appendingPathComponent("quic_migrate_client.py").path, [
            "--server", "\(TwoWayTopology.vip()):\(port)",
            "--sources", sources.joined(separator: ","), "--connections", "\(connections)", "--bytes", "\(bytes)",
            "--server-name-check", "--timeout", "\(timeout)",
        ] + (migrate ? ["--migrate"] : []), prefix: topology.prefix(topology.clients))
    }

    /// `connections` clients transferring `bytes` each through the VIP, moving halfway; the client's JSON report.
    static func migrate(_ topology: TwoWayTopology, connections: Int, bytes: Int) throws -> [String: Any] {
        let client = try startClients(topology, connections: connections, bytes: bytes)
        #expect(client.wait(seconds: 40) == 0, "client: \(client.stderr)")
        let report = try client.json()
        print("quic_migrate_client \(connections) x \(bytes) B: \(client.stdout.trimmingCharacters(in: .whitespacesAndNewlines))")
        return report
    }

    static func value(_ text: String, _ series: String) -> Int? {
        text.split(separator: "\n").first { $0.hasPrefix(series + " ") }.flatMap { Int($0.split(separator: " ").last ?? "") }
    }

    static func failures(_ report: [String: Any]) -> Int { (report["failed"] as? [Any])?.count ?? -1 }

    @Test("relay with quic_lb: 12 connections migrate mid-transfer, all complete on their server; each new client address is routed by its ID",
          arguments: layouts)
    func relayRoutesMigrations(layout: Layout) throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 4)
        let servers = try Self.servers(topology, layout: layout)
        let daemon = try TwoWayEndToEndTests.Daemon(topology, .relay, Self.config(servers: 3, layout: layout))
        let report = try Self.migrate(topology, connections: 12, bytes: 200_000)
        #expect(report.int("connections") == 12 && report.int("completed") == 12 && report.int("migrated") == 12, "\(layout): \(report)")
        #expect(Self.failures(report) == 0, "\(report)")
        let text = try topology.exec(topology.balancer, ["curl", "-s", "http://127.0.0.1:\(Self.metricsPort)/metrics"])
        let labels = "listener=\"quic\",mode=\"userspace\""
        func outcome(_ name: String) -> Int? { Self.value(text, "udp_fanout_quic_lb_datagrams_total{\(labels),outcome=\"\(name)\"}") }
        // A relay chooses once per client address and port: each connection's first Initial (its
        // own ID: the balancing chose; a retransmitted Initial from a new port on a loaded
        // machine may add one), and its first datagram from the new address (by ID).
        #expect((outcome("fallback") ?? 0) >= 12 && outcome("routed") == 12, "\(text)")
        #expect(outcome("unknown_server_id") == 0 && outcome("undecodable") == 0, "\(text)")
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        let totals = try servers.map { try $0.stop() }
        print("QUIC servers (\(layout)): \(totals)")
        #expect(totals.map { $0.int("migrated_connections") }.reduce(0, +) == 12, "\(totals)")
        #expect(totals.allSatisfy { $0.int("stray_datagrams") == 0 && $0.int("cids_not_quic_lb") == 0 }, "\(totals)")
    }

    @Test("tc_ebpf and xdp nat with quic_lb: 12 connections migrate mid-transfer, all complete on their server; each datagram of a known ID routed in the kernel",
          arguments: [TwoWayEndToEndTests.Path.nat, .xdp], layouts)
    func kernelRoutesMigrations(path: TwoWayEndToEndTests.Path, layout: Layout) throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 4)
        try TwoWayEndToEndTests.prepare(topology, path)
        let servers = try Self.servers(topology, layout: layout)
        let daemon = try TwoWayEndToEndTests.Daemon(topology, path, Self.config(servers: 3, layout: layout, path: path, topology: topology))
        let report = try Self.migrate(topology, connections: 12, bytes: 200_000)
        #expect(report.int("connections") == 12 && report.int("completed") == 12 && report.int("migrated") == 12, "\(path) \(layout): \(report)")
        #expect(Self.failures(report) == 0, "\(report)")
        let text = try topology.exec(topology.balancer, ["curl", "-s", "http://127.0.0.1:\(Self.metricsPort)/metrics"])
        let labels = "listener=\"quic\",mode=\"\(path == .nat ? "tc_ebpf" : "xdp")\""
        func outcome(_ name: String) -> Int? { Self.value(text, "udp_fanout_quic_lb_datagrams_total{\(labels),outcome=\"\(name)\"}") }
        // The kernel decides every datagram: each connection's Initials fall back (a
        // retransmitted one adds one), everything after them carries a server's ID (each
        // connection sends at least its Handshake and acknowledgements from both addresses).
        #expect((outcome("fallback") ?? 0) >= 12 && (outcome("routed") ?? 0) >= 12 * 3, "\(text)")
        #expect(outcome("unknown_server_id") == 0 && outcome("undecodable") == 0, "\(text)")
        // xdp: decided and sent at XDP, not passed to tc.
        let datagrams = (Self.value(text, "udp_fanout_packets_received_total{\(labels)}") ?? 0) + (Self.value(text, "udp_fanout_replies_total{\(labels)}") ?? 0)
        TwoWayEndToEndTests.expectFinishedAtXDP(text, path, datagrams: datagrams, listener: "quic")
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        let totals = try servers.map { try $0.stop() }
        print("QUIC servers (\(path), \(layout)): \(totals)")
        #expect(totals.map { $0.int("migrated_connections") }.reduce(0, +) == 12, "\(totals)")
        #expect(totals.allSatisfy { $0.int("stray_datagrams") == 0 && $0.int("cids_not_quic_lb") == 0 }, "\(totals)")
    }

    @Test("tc_ebpf and xdp nat with quic_lb (four-pass): a planned restart while 12 connections transfer and migrate: each completes on its server; the QUIC-LB maps are taken over",
          arguments: [TwoWayEndToEndTests.Path.nat, .xdp])
    func kernelRestart(path: TwoWayEndToEndTests.Path) throws {
        let layout = Self.layouts[1]
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 4)
        try TwoWayEndToEndTests.prepare(topology, path)
        let servers = try Self.servers(topology, layout: layout)
        let file = try TCFixtures.write(Self.config(servers: 3, layout: layout, path: path, topology: topology), "quic-restart")
        defer { try? FileManager.default.removeItem(at: file) }
        let manager = try ServiceManager(topology.prefix(topology.balancer) + [binaryDirectory.appendingPathComponent("udp-fanout").path, "-c", file.path])
        try manager.start()
        // The restart comes as soon as every connection is up, so each migrates (halfway through
        // its transfer) after it, however fast this machine moves the bytes: a fixed second was
        // past every migration on a fast one.
        let client = try Self.startClients(topology, connections: 12, bytes: 12_000_000, timeout: 30)
        let deadline = ContinuousClock.now + .seconds(10)
        while ((try? Self.sessions(topology, mode: Self.mode(path))) ?? 0) < 12 && ContinuousClock.now < deadline { manager.pump(within: 0.05) }
        try manager.terminate()
        try manager.start()
        for _ in 0..<900 where client.process.isRunning { manager.pump(within: 0.05) }
        #expect(client.wait(seconds: 40) == 0, "client: \(client.stderr)")
        let report = try client.json()
        print("quic_migrate_client 12 x 12 MB across a restart (\(path)): \(client.stdout.trimmingCharacters(in: .whitespacesAndNewlines))")
        #expect(report.int("completed") == 12 && report.int("migrated") == 12 && Self.failures(report) == 0, "\(report)")
        let log = manager.output
        #expect(log.contains("took over the tc_ebpf maps of the previous process"), "\(log)")
        // The second process's own counts: the migrations after the restart were routed by ID.
        let text = try topology.exec(topology.balancer, ["curl", "-s", "http://127.0.0.1:\(Self.metricsPort)/metrics"])
        let routed = Self.value(text, "udp_fanout_quic_lb_datagrams_total{listener=\"quic\",mode=\"\(Self.mode(path))\",outcome=\"routed\"}") ?? 0
        #expect(routed > 0, "\(text)")
        try manager.stop()
        let totals = try servers.map { try $0.stop() }
        print("QUIC servers across the restart (\(path)): \(totals)")
        #expect(totals.allSatisfy { $0.int("stray_datagrams") == 0 }, "\(totals)")
    }

    @Test("tc_ebpf and xdp nat with quic_lb: a server set to weight 0 by a reload keeps its connections past the drain (routed by ID, its replies leave); new connections go to the others",
          arguments: [TwoWayEndToEndTests.Path.nat, .xdp])
    func weightZeroKeepsConnections(path: TwoWayEndToEndTests.Path) throws {
        let layout = Self.layouts[0]
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 4)
        try TwoWayEndToEndTests.prepare(topology, path)
        let servers = try Self.servers(topology, layout: layout)
        let all = Self.config(servers: 3, layout: layout, path: path, topology: topology)
            .replacingOccurrences(of: "    balancing: source_ip\n", with: "    balancing: source_ip\n    settings: {drain_secs: 1}\n")
        let daemon = try TwoWayEndToEndTests.Daemon(topology, path, all)
        let mode = Self.mode(path)
        let client = try Self.startClients(topology, connections: 8, bytes: 4_000_000, migrate: false, timeout: 30)
        let started = Probe.waitFor(seconds: 10) { (try? Self.sessions(topology, mode: mode)) ?? 0 >= 8 }
        #expect(started, "8 associations")
        try daemon.reload(all.replacingOccurrences(of: "{name: s1,", with: "{name: s1, weight: 0,"))
        // Past the drain (1 s): a backend that left the live set would have its replies dropped now.
        usleep(2_000_000)
        let fresh = try Self.startClients(topology, connections: 4, bytes: 50_000, migrate: false, timeout: 20)
        #expect(fresh.wait(seconds: 40) == 0, "fresh clients: \(fresh.stderr)")
        let newcomers = try fresh.json()
        #expect(client.wait(seconds: 60) == 0, "client: \(client.stderr)")
        let report = try client.json()
        print("quic_migrate_client 8 x 4 MB across s1 set to weight 0 (\(path)): \(client.stdout.trimmingCharacters(in: .whitespacesAndNewlines)); afterwards: \(fresh.stdout.trimmingCharacters(in: .whitespacesAndNewlines))")
        let onS1 = (report["by_connection"] as? [String] ?? []).filter { $0 == "s1" }.count
        #expect(onS1 > 0, "no connection on s1: the test would prove nothing: \(report)")
        #expect(report.int("completed") == 8 && Self.failures(report) == 0, "\(report)")
        #expect(newcomers.int("completed") == 4 && !(newcomers["by_connection"] as? [String] ?? []).contains("s1"), "\(newcomers)")
        let text = try topology.exec(topology.balancer, ["curl", "-s", "http://127.0.0.1:\(Self.metricsPort)/metrics"])
        #expect(Self.value(text, "udp_fanout_replies_dropped_total{listener=\"quic\",mode=\"\(mode)\",reason=\"drained\"}") ?? 0 == 0, "\(text)")
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        _ = try servers.map { try $0.stop() }
    }

    /// One-way with direct server return, as docs/quic.md describes it: each server holds the VIP
    /// on lo, rewrites the destination of arriving QUIC datagrams to it (nftables, raw priority),
    /// and answers from it straight through the load balancer as a router (accept_local: the
    /// replies come from its own address). The listener forwards the clients' datagrams only.
    static func directServerReturn(_ topology: TwoWayTopology) throws {
        let vip = TwoWayTopology.vip()
        for (index, server) in topology.servers.enumerated() {
            try topology.exec(server, ["ip", "addr", "add", "\(vip)/32", "dev", "lo"])
            let rules = "table ip dsr {\n chain pre {\n  type filter hook prerouting priority raw; policy accept;\n"
                + "  ip daddr \(TwoWayTopology.serverAddress(index + 1)) udp dport \(port) ip daddr set \(vip) notrack\n }\n}\n"
            let file = try TCFixtures.write(rules, "dsr-nft")
            defer { try? FileManager.default.removeItem(at: file) }
            try topology.exec(server, ["nft", "-f", file.path])
        }
        for setting in ["net.ipv4.conf.all.accept_local=1", "net.ipv4.conf.all.rp_filter=0"]
            + (1...topology.servers.count).flatMap({ ["net.ipv4.conf.\(topology.serverInterface($0)).accept_local=1", "net.ipv4.conf.\(topology.serverInterface($0)).rp_filter=0"] }) {
            try topology.exec(topology.balancer, ["/usr/sbin/sysctl", "-q", "-w", setting])
        }
    }

    @Test("One way (userspace, tc_ebpf, xdp, af_xdp) with direct server return: 12 aioquic connections migrate mid-transfer, each completes on its server by ID; source-IP balancing alone breaks those that move",
          arguments: ["userspace", "tc_ebpf", "xdp", "af_xdp"], [true, false])
    func oneWayMigrations(mode: String, quic: Bool) throws {
        let layout = Self.layouts[1]
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 4)
        // XDP transmits to the servers' veths (GRO on there) only whole checksums (the clients' tx off).
        if mode == "xdp" || mode == "af_xdp" { try TwoWayEndToEndTests.prepare(topology, .xdp) }
        try Self.directServerReturn(topology)
        // The servers listen on the VIP (their lo), as direct server return needs.
        let servers = try (1...3).map { n in
            var arguments = ["--listen", "\(TwoWayTopology.vip()):\(Self.port)", "--name", "s\(n)", "--server-id", layout.serverID(n),
                             "--config-id", "1", "--nonce-length", "\(layout.nonceLength)", "--duration", "120"]
            if let key = layout.key { arguments += ["--key", key] }
            let child = try Child.unblocked(Self.scripts.appendingPathComponent("quic_lb_server.py").path, arguments, prefix: topology.prefix(topology.servers[n - 1]))
            let ready = Probe.waitFor(seconds: 20) { child.stdout.contains("\"ready\"") || !child.process.isRunning }
            try #require(ready && child.process.isRunning, "server s\(n) not ready: \(child.stderr)")
            return child
        }
        let downstreams = (1...3).map { n in
            "      - {name: s\(n), address: \"\(TwoWayTopology.serverAddress(n)):\(Self.port)\"\(quic ? ", server_id: \"\(layout.serverID(n))\"" : "")}"
        }.joined(separator: "\n")
        // userspace and af_xdp send from this host's address unless told to keep the client's.
        var where_ = mode == "userspace" ? "" : "    interface: \(topology.clientInterface)\n"
        if mode == "userspace" || mode == "af_xdp" { where_ += "    settings: {output: preserve_source}\n" }
        let yaml = """
            listeners:
              - name: quic
                bind: "\(TwoWayTopology.vip()):\(Self.port)"
                mode: \(mode)
            \(where_)    balancing: source_ip
            \(quic ? "    quic_lb: {config_id: 1, server_id_length: \(layout.serverIDLength), nonce_length: \(layout.nonceLength), key: \(layout.key!)}\n" : "")    downstream:
            \(downstreams)
            metrics: {enabled: true, bind: "127.0.0.1:\(Self.metricsPort)"}

            """
        let file = try TCFixtures.write(yaml, "quic-oneway")
        defer { try? FileManager.default.removeItem(at: file) }
        let daemon = try Child("udp-fanout", ["-c", file.path], prefix: topology.prefix(topology.balancer))
        try daemon.waitFor(mode == "tc_ebpf" || mode == "xdp" ? "registered listener in eBPF map" : "entering receive loop")
        let report = try Self.migrate(topology, connections: 12, bytes: 200_000)
        #expect(report.int("migrated") == 12, "\(mode): \(report)")
        let text = try topology.exec(topology.balancer, ["curl", "-s", "http://127.0.0.1:\(Self.metricsPort)/metrics"])
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0, "\(daemon.stderr)")
        if report.int("completed") == 0 { print("udp-fanout (\(mode)): \(daemon.stderr.suffix(3000))\n\(text.split(separator: "\n").filter { $0.contains("listener=\"quic\"") && !$0.hasSuffix(" 0") }.joined(separator: "\n"))") }
        let totals = try servers.map { try $0.stop() }
        print("QUIC one way \(mode), \(quic ? "quic_lb" : "source_ip"): \(report); servers \(totals)")
        if quic {
            #expect(report.int("completed") == 12 && Self.failures(report) == 0, "\(mode): \(report)")
            #expect(Self.value(text, "udp_fanout_quic_lb_datagrams_total{listener=\"quic\",mode=\"\(mode)\",outcome=\"routed\"}") ?? 0 >= 12 * 3, "\(text)")
            #expect(totals.allSatisfy { $0.int("stray_datagrams") == 0 }, "\(totals)")
        } else {
            #expect(report.int("completed") < 12 && Self.failures(report) > 0, "source-IP balancing kept every migrated connection: \(report)")
        }
    }

    @Test("relay, tc_ebpf and xdp nat with source-IP balancing alone: the same migrations reach other servers, which do not know them; connections fail",
          arguments: [TwoWayEndToEndTests.Path.relay, .nat, .xdp])
    func kernelSourceIPBreaksMigrations(path: TwoWayEndToEndTests.Path) throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 4)
        try TwoWayEndToEndTests.prepare(topology, path)
        let servers = try Self.servers(topology, layout: Self.layouts[0])
        let daemon = try TwoWayEndToEndTests.Daemon(topology, path, Self.config(servers: 3, layout: nil, path: path, topology: topology))
        let report = try Self.migrate(topology, connections: 12, bytes: 200_000)
        #expect(report.int("migrated") == 12, "\(report)")
        #expect(report.int("completed") < 12 && Self.failures(report) > 0, "source-IP balancing kept every migrated connection: \(report)")
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        let totals = try servers.map { try $0.stop() }
        print("QUIC servers (\(path), source_ip): \(totals)")
        #expect(totals.map { $0.int("stray_datagrams") }.reduce(0, +) > 0, "\(totals)")
    }

    @Test("relay, tc_ebpf and xdp nat with quic_lb: a server taken out by a reload and back a second later gets its connections back; each completes",
          arguments: [TwoWayEndToEndTests.Path.relay, .nat, .xdp])
    func followsIDBack(path: TwoWayEndToEndTests.Path) throws {
        let layout = Self.layouts[1]
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 4)
        try TwoWayEndToEndTests.prepare(topology, path)
        let servers = try Self.servers(topology, layout: layout)
        let all = Self.config(servers: 3, layout: layout, path: path, topology: topology)
        let daemon = try TwoWayEndToEndTests.Daemon(topology, path, all)
        let mode = Self.mode(path)
        // Long transfers without migration: every connection runs while its server leaves and
        // returns (4 MB each ended before the first reload took effect on a fast machine).
        let client = try Self.startClients(topology, connections: 8, bytes: 12_000_000, migrate: false, timeout: 30)
        let started = Probe.waitFor(seconds: 10) { (try? Self.sessions(topology, mode: mode)) ?? 0 >= 8 }
        #expect(started, "8 sessions")
        // s1 leaves: its sessions move to another server by the balancing (which does not know
        // their connections), then s1 comes back and the sessions follow their IDs to it.
        let without = all.split(separator: "\n").filter { !$0.contains("name: s1,") }.joined(separator: "\n") + "\n"
        try daemon.reload(without)
        // s1's sessions moved away (their next datagrams), then about a second without s1.
        let movedAway = Probe.waitFor(seconds: 10) { ((try? Self.moved(topology, mode: mode)) ?? 0) > 0 }
        #expect(movedAway, "no session moved away from s1")
        usleep(1_000_000)
        try daemon.reload(all)
        #expect(client.wait(seconds: 60) == 0, "client: \(client.stderr)")
        let report = try client.json()
        print("quic_migrate_client 8 x 12 MB across a reload (\(path)): \(client.stdout.trimmingCharacters(in: .whitespacesAndNewlines))")
        let onS1 = (report["by_connection"] as? [String] ?? []).filter { $0 == "s1" }.count
        #expect(onS1 > 0, "no connection on s1: the test would prove nothing: \(report)")
        #expect(report.int("completed") == 8 && Self.failures(report) == 0, "\(report)")
        let text = try topology.exec(topology.balancer, ["curl", "-s", "http://127.0.0.1:\(Self.metricsPort)/metrics"])
        let moved = Self.value(text, "udp_fanout_association_events_total{listener=\"quic\",mode=\"\(mode)\",event=\"moved\"}") ?? 0
        // Each of s1's sessions moved away, and back by its ID.
        #expect(moved >= 2 * onS1, "\(text)")
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        let totals = try servers.map { try $0.stop() }
        print("QUIC servers across the reload (\(path)): \(totals)")
    }

    @Test("A ReusePortLB group of three aioquic servers on one port: with QUIC-LB every migrated connection completes on its server; a plain source-IP group breaks those whose new address hashes elsewhere")
    func reusePortGroup() throws {
        let library = binaryDirectory.appendingPathComponent("libreuseportlb.so").path
        var outcomes: [Bool: (report: [String: Any], totals: [[String: Any]])] = [:]
        for quic in [true, false] {
            let port = freePort()
            let servers = try (0..<3).map { slot in
                let child = try Child.unblocked(Self.scripts.appendingPathComponent("quic_lb_server.py").path, [
                    "--listen", "127.0.0.1:\(port)", "--name", "s\(slot + 1)", "--server-id", String(format: "0a%02x", slot + 1), "--config-id", "1",
                    "--reuseportlb", library, "--group-slot", "\(slot)", "--group-capacity", "3", "--duration", "120",
                ] + (quic ? [] : ["--group-no-quic"]))
                let ready = Probe.waitFor(seconds: 20) { child.stdout.contains("\"ready\"") || !child.process.isRunning }
                try #require(ready && child.process.isRunning, "server s\(slot + 1) not ready: \(child.stderr)")
                return child
            }
            let client = try Child.unblocked(Self.scripts.appendingPathComponent("quic_migrate_client.py").path, [
                "--server", "127.0.0.1:\(port)", "--sources", "127.0.0.2,127.0.0.3,127.0.0.4,127.0.0.5", "--connections", "12",
                "--bytes", "200000", "--migrate", "--server-name-check", "--timeout", "10",
            ])
            #expect(client.wait(seconds: 40) == 0, "client: \(client.stderr)")
            let report = try client.json()
            print("ReusePortLB group (\(quic ? "QUIC-LB" : "source IP")): \(client.stdout.trimmingCharacters(in: .whitespacesAndNewlines))")
            let totals = try servers.map { try $0.stop() }
            print("group members: \(totals)")
            outcomes[quic] = (report, totals)
        }
        let routed = try #require(outcomes[true]), plain = try #require(outcomes[false])
        #expect(routed.report.int("completed") == 12 && routed.report.int("migrated") == 12 && Self.failures(routed.report) == 0, "\(routed.report)")
        #expect(routed.totals.map { $0.int("migrated_connections") }.reduce(0, +) == 12, "\(routed.totals)")
        #expect(routed.totals.allSatisfy { $0.int("stray_datagrams") == 0 }, "\(routed.totals)")
        let counters = routed.totals[0].object("group_counters")
        #expect(counters.int("routed") > 0 && counters.int("fallback") == 12 && counters.int("unknown_server_id") == 0 && counters.int("undecodable") == 0,
                "\(counters)")
        #expect(plain.report.int("migrated") == 12 && plain.report.int("completed") < 12, "a plain group kept every migrated connection: \(plain.report)")
        #expect(plain.totals.map { $0.int("stray_datagrams") }.reduce(0, +) > 0, "\(plain.totals)")
    }

    @Test("One-way userspace with quic_lb on loopback: 6,000 QUIC packets from 60 sources, an exact third to each server ID's downstream, counted routed")
    func oneWayUserspace() throws {
        let ports = (0..<3).map { _ in freePort() }
        let sinks = try ports.map { port in
            let child = try Child("collector", ["127.0.0.1", "\(port)", "0", "1"])
            try child.waitFor("ready")
            return child
        }
        let listen = freePort(), metrics = Int(freePort())
        let downstreams = ports.enumerated().map { "      - {name: s\($0 + 1), address: \"127.0.0.1:\($1)\", server_id: \"0a0\($0 + 1)\"}" }.joined(separator: "\n")
        let yaml = "listeners:\n  - name: quic\n    bind: \"127.0.0.1:\(listen)\"\n    balancing: source_ip\n"
            + "    quic_lb: {config_id: 1, server_id_length: 2, nonce_length: 6}\n    settings: {output: socket}\n    downstream:\n"
            + downstreams + "\nmetrics: {enabled: true, bind: \"127.0.0.1:\(metrics)\"}\n"
        let file = try TCFixtures.write(yaml, "quic-oneway")
        defer { try? FileManager.default.removeItem(at: file) }
        let daemon = try Child("udp-fanout", ["-c", file.path])
        try daemon.waitFor("entering receive loop")
        let publisher = try Child("publisher", ["127.0.0.1", "\(listen)", "6000", "--sources", "127.0.5.2-127.0.5.61", "--rate", "5000", "--quic", "2:6:1",
                                                "--server-ids", "0a01,0a02,0a03"])
        #expect(publisher.wait() == 0, "\(publisher.stderr)")
        let series = "udp_fanout_quic_lb_datagrams_total{listener=\"quic\",mode=\"userspace\",outcome=\"routed\"}"
        let text = try Scrape.metrics({ try run("/usr/bin/curl", Array($0.dropFirst())).output }, port: metrics, until: series, is: 6000)
        #expect(Scrape.value(text, series) == 6000, "\(text)")
        // output: socket on a one-way quic_lb listener is warned about (the servers could not answer).
        #expect(daemon.stderr.contains("settings.output") && daemon.stderr.contains("preserve_source"), "\(daemon.stderr)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let counts = try sinks.map { try $0.stop().int("received") }
        #expect(counts == [2000, 2000, 2000], "\(counts)")
    }

    /// The `mode` label of a path's listener.
    static func mode(_ path: TwoWayEndToEndTests.Path) -> String { path == .relay ? "userspace" : path == .nat ? "tc_ebpf" : "xdp" }

    /// The listener's `moved` association events so far.
    static func moved(_ topology: TwoWayTopology, mode: String = "userspace") throws -> Int {
        let text = try topology.exec(topology.balancer, ["curl", "-s", "http://127.0.0.1:\(metricsPort)/metrics"])
        return value(text, "udp_fanout_association_events_total{listener=\"quic\",mode=\"\(mode)\",event=\"moved\"}") ?? 0
    }

    /// The listener's sessions or associations now (udp_fanout_associations).
    static func sessions(_ topology: TwoWayTopology, mode: String = "userspace") throws -> Int {
        let text = try topology.exec(topology.balancer, ["curl", "-s", "http://127.0.0.1:\(metricsPort)/metrics"])
        return value(text, "udp_fanout_associations{listener=\"quic\",mode=\"\(mode)\"}") ?? 0
    }
}
