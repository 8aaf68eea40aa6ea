// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import Foundation
import ReusePortLB
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// Replication in tc_ebpf through the daemon, over veth namespaces: copies made in the kernel
/// reach each pool's collectors with the clients' addresses, a sampled and source-filtered pool
/// keeps exactly the sources userspace's hash keeps, a reload that changes one pool moves nothing
/// in the others and loses nothing, and a clean stop leaves no program and no neighbour entry.
@Suite("tc_ebpf replication end to end", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct TCReplicationEndToEndTests {
    static func config(_ topology: Topology, archive: [Int]) -> String {
        func member(_ n: Int) -> String { "{name: b\(n), address: \"\(Topology.backendIPv4(n)):\(TCFixtures.port)\"}" }
        return """
            listeners:
              - name: tc
                bind: "198.18.0.1:5514"
                interface: \(topology.proxyInterface)
                mode: tc_ebpf
                downstream: [\(member(1))]
                pools:
                  - name: archive
                    balancing: all
                    downstream: [\(archive.map(member).joined(separator: ", "))]
                  - name: security
                    sample: 2
                    sources: ["198.18.0.0/27"]
                    downstream: [\(member(4))]
            metrics: {enabled: true, bind: "127.0.0.1:9464"}
            """
    }

    /// A tc_ebpf listener whose own downstream is backend 1, with an `all` pool `archive` of `members` (YAML flow items).
    static func allPool(_ topology: Topology, members: String) -> String {
        """
        listeners:
          - name: tc
            bind: "198.18.0.1:5514"
            interface: \(topology.proxyInterface)
            mode: tc_ebpf
            downstream: [{name: b1, address: "\(Topology.backendIPv4(1)):\(TCFixtures.port)"}]
            pools:
              - name: archive
                balancing: all
                downstream: [\(members)]
        metrics: {enabled: true, bind: "127.0.0.1:9464"}
        """
    }

    /// The clients (publisher --sources) the security pool keeps: in 198.18.0.0/27 and one in 2
    /// by the sampling hash, as userspace decides it.
    static func keptBySecurity() -> Set<String> {
        let pool = PoolPlan(Pool(name: "security", sample: 2, sources: [SourcePrefix("198.18.0.0/27")!]), members: [], counters: PoolCounters())
        return Set((10..<74).map { "198.18.0.\($0)" }.filter { address in
            var storage = ReplicationFixtures.storage(SocketAddress("\(address):1")!)
            return withUnsafePointer(to: &storage) { pool.sources.admits($0) && pool.samples($0) }
        })
    }

    static func packets(_ report: [String: Any]) -> [String: Int] {
        report.object("sources").mapValues { (($0 as? [String: Any]) ?? [:]).int("packets") }
    }

    @Test("Own downstream, an all pool of two and a sampled, source-filtered pool: every copy in the kernel with the client's address; the sampled pool keeps userspace's sources; a reload of one pool moves nothing in the other; SIGTERM leaves no program and no managed neighbour")
    func pools() throws {
        let topology = try Topology(backends: 4)
        defer { topology.destroy() }
        try TCFixtures.addClientSources(topology)
        // Unresolved next hops, as on a host that has not talked to its collectors yet: the pools'
        // copies need managed neighbour entries (the listener's own datagram resolves its own).
        _ = try topology.exec(topology.proxy, ["/usr/sbin/ip", "neigh", "flush", "all"])
        let collectors = try TCFixtures.collectors(topology)
        let (daemon, file) = try TCFixtures.start(topology, Self.config(topology, archive: [2, 3]), "tc-pools")
        defer { try? FileManager.default.removeItem(at: file) }
        // The managed entries resolve within a few probes.
        var neighbours = ""
        for _ in 0..<50 {
            neighbours = try topology.exec(topology.proxy, ["/usr/sbin/ip", "neigh", "show"])
            if (2...4).allSatisfy({ n in neighbours.split(separator: "\n").contains { $0.hasPrefix("\(Topology.backendIPv4(n)) ") && $0.contains("managed") && $0.contains("REACHABLE") } }) { break }
            usleep(100_000)
        }
        #expect((2...4).allSatisfy { n in neighbours.contains("\(Topology.backendIPv4(n)) ") }, "managed neighbour entries for the pools' members: \(neighbours)")

        let perPhase = 6400
        func send() throws {
            let publisher = try Child("publisher", ["198.18.0.1", "5514", "\(perPhase)", "--rate", "20000", "--batch", "16", "--sources", TCFixtures.clientSources],
                                      prefix: topology.prefix(topology.client))
            #expect(publisher.wait() == 0)
            usleep(300_000)
        }
        try send()
        let metrics = try TCFixtures.metrics(topology)
        #expect(metrics.contains("udp_fanout_packets_received_total{listener=\"tc\",mode=\"tc_ebpf\"} \(perPhase)"), "\(metrics)")
        let archive = ReplicationFixtures.outcomes(metrics, "archive", listener: "tc", mode: "tc_ebpf")
        #expect(archive["forwarded"] == perPhase && archive.values.reduce(0, +) == perPhase, "archive: \(archive)")
        let security = ReplicationFixtures.outcomes(metrics, "security", listener: "tc", mode: "tc_ebpf")
        #expect(security.values.reduce(0, +) == perPhase, "security's outcomes add up to received: \(security)")
        #expect(metrics.contains("udp_fanout_pool_member_copies_total{listener=\"tc\",mode=\"tc_ebpf\",pool=\"archive\",downstream=\"b2\"} \(perPhase)"), "\(metrics)")

        // Phase 2: the archive pool loses b3 by reload; the security pool and the own downstream move nothing.
        try Self.config(topology, archive: [2]).write(to: file, atomically: true, encoding: .utf8)
        daemon.signal(SIGHUP)
        try daemon.waitFor("updated tc_ebpf downstream set")
        try send()
        let after = try TCFixtures.metrics(topology)
        #expect(ReplicationFixtures.outcomes(after, "archive", listener: "tc", mode: "tc_ebpf")["forwarded"] == 2 * perPhase, "\(ReplicationFixtures.outcomes(after, "archive", listener: "tc", mode: "tc_ebpf"))")
        #expect(ReplicationFixtures.outcomes(after, "security", listener: "tc", mode: "tc_ebpf").values.reduce(0, +) == 2 * perPhase)

        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        try TCFixtures.expectNothingLeft(topology)
        let left = try topology.exec(topology.proxy, ["/usr/sbin/ip", "neigh", "show"])
        #expect(!left.contains("managed"), "the managed neighbour entries udp-fanout made are gone: \(left)")

        let reports = try collectors.map { try $0.stop() }
        let counts = TCFixtures.received(reports)
        #expect(counts[0] == 2 * perPhase, "own downstream: every datagram: \(counts)")
        #expect(counts[1] == 2 * perPhase, "archive b2: every datagram of both phases: \(counts)")
        #expect(counts[2] == perPhase, "archive b3: the first phase only: \(counts)")
        let bySource = reports.map(Self.packets)
        #expect(bySource[1].count == 64 && bySource[1] == bySource[0], "archive copies keep each client's address, as many per client as the own downstream got")
        let kept = Self.keptBySecurity()
        #expect(!kept.isEmpty && kept.count < 22, "the sample keeps some of the 22 sources in the prefix: \(kept.sorted())")
        #expect(Set(bySource[3].keys) == kept, "security: exactly the sources userspace's hash keeps: \(bySource[3].keys.sorted()) vs \(kept.sorted())")
        for source in kept { #expect(bySource[3][source] == bySource[0][source], "security gets every datagram of \(source)") }
        let securityOutcomes = ReplicationFixtures.outcomes(after, "security", listener: "tc", mode: "tc_ebpf")
        #expect(securityOutcomes["forwarded"] == counts[3], "security forwarded as its collector counted: \(securityOutcomes) \(counts)")
        #expect((securityOutcomes["filtered_out"] ?? 0) > 0 && (securityOutcomes["sampled_out"] ?? 0) > 0, "\(securityOutcomes)")
        for report in reports { #expect(report.int("foreign") == 0) }
    }

    @Test("A member of an all pool with no route: its copies are counted dropped by reason at the member (no_route) and at the pool; the other member gets every copy and counts no drop")
    func memberDropReasons() throws {
        let topology = try Topology(backends: 2)
        defer { topology.destroy() }
        let collectors = try TCFixtures.collectors(topology)
        // 198.19.77.2: no route toward it in the proxy namespace.
        let config = Self.allPool(topology, members: "{name: b2, address: \"\(Topology.backendIPv4(2)):\(TCFixtures.port)\"}, {name: void, address: \"198.19.77.2:\(TCFixtures.port)\"}")
        let (daemon, file) = try TCFixtures.start(topology, config, "tc-member-drops")
        defer { try? FileManager.default.removeItem(at: file) }
        let count = 500
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "\(count)", "--rate", "5000"], prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0)
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        let labels = ReplicationFixtures.poolLabels("archive", listener: "tc", mode: "tc_ebpf")
        #expect(metric(metrics, "udp_fanout_pool_member_copies_total", labels + ",downstream=\"b2\"") == count, "\(metrics)")
        #expect(metric(metrics, "udp_fanout_pool_member_dropped_total", labels + ",downstream=\"void\"") == count, "\(metrics)")
        #expect(metric(metrics, "udp_fanout_pool_member_dropped_by_reason_total", labels + ",downstream=\"void\",reason=\"no_route\"") == count, "\(metrics)")
        #expect(!metrics.contains("udp_fanout_pool_member_dropped_by_reason_total{\(labels),downstream=\"b2\""), "\(metrics)")
        #expect(metric(metrics, "udp_fanout_pool_dropped_total", labels + ",reason=\"no_route\"") == count, "\(metrics)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let counts = TCFixtures.received(try collectors.map { try $0.stop() })
        #expect(counts == [count, count], "own downstream and b2: every datagram: \(counts)")
    }

    @Test("Checksums through the copies' rewrites, IPv4 and IPv6: the client's checksum left to offload (CHECKSUM_PARTIAL at tc) or computed at send (CHECKSUM_NONE); the proxy's links to the backends complete offloaded checksums in software, so each backend's stack checks every copy and own datagram: all arrive, no checksum error", arguments: [true, false])
    func checksums(offloaded: Bool) throws {
        let topology = try Topology(backends: 3)
        defer { topology.destroy() }
        if !offloaded {
            _ = try topology.exec(topology.client, ["/usr/sbin/ethtool", "-K", "cp\(topology.suffix.prefix(8))", "tx", "off"])
        }
        for n in 1...3 {
            _ = try topology.exec(topology.proxy, ["/usr/sbin/ethtool", "-K", "pb\(n)\(topology.suffix.prefix(7))", "tx", "off"])
        }
        func listener(_ name: String, _ ipv6: Bool) -> String {
            func member(_ n: Int) -> String { "{name: b\(n), address: \"\(ipv6 ? "[\(Topology.backendIPv6(n))]" : Topology.backendIPv4(n)):\(TCFixtures.port)\"}" }
            return """
                  - name: \(name)
                    bind: "\(ipv6 ? "[2001:db8::1]" : "198.18.0.1"):5514"
                    interface: \(topology.proxyInterface)
                    mode: tc_ebpf
                    downstream: [\(member(1))]
                    pools: [{name: archive, balancing: all, downstream: [\(member(2)), \(member(3))]}]
                """
        }
        let config = "listeners:\n" + listener("v4", false) + "\n" + listener("v6", true) + "\nmetrics: {enabled: true, bind: \"127.0.0.1:9464\"}\n"
        let collectors = try TCFixtures.collectors(topology) + TCFixtures.collectors(topology, ipv6: true)
        let (daemon, file) = try TCFixtures.start(topology, config, "tc-checksums")
        defer { try? FileManager.default.removeItem(at: file) }
        let datagrams = 2000
        for target in ["198.18.0.1", "2001:db8::1"] {
            let publisher = try Child("publisher", [target, "5514", "\(datagrams)", "--rate", "20000", "--batch", "16"], prefix: topology.prefix(topology.client))
            #expect(publisher.wait() == 0, "\(publisher.stderr)")
        }
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        for name in ["v4", "v6"] {
            #expect(metrics.contains("udp_fanout_packets_forwarded_total{listener=\"\(name)\",mode=\"tc_ebpf\"} \(datagrams)"), "\(metrics)")
            let archive = ReplicationFixtures.outcomes(metrics, "archive", listener: name, mode: "tc_ebpf")
            #expect(archive["forwarded"] == datagrams, "\(name) archive: \(archive)")
        }
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let counts = TCFixtures.received(try collectors.map { try $0.stop() })
        #expect(counts == Array(repeating: datagrams, count: 6), "every copy and own datagram passed the backend's checksum check (IPv4 b1-b3, then IPv6 b1-b3): \(counts)")
        for backend in topology.backends {
            let counters = try topology.udpCounters(backend)
            #expect(counters["InCsumErrors"] == 0 && counters["Udp6InCsumErrors"] == 0,
                    "\(backend): UDP checksum errors \(counters["InCsumErrors"] as Int?), \(counters["Udp6InCsumErrors"] as Int?)")
        }
    }
}

/// A listener's in-place updates (reload, health, discovery) carry its pools along in every
/// kernel kind, as in userspace and relay (ReplicationTests.poolsAfterInPlaceUpdates).
@Suite("kernel kinds: pools across in-place updates", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct KernelPoolUpdateTests {
    @Test("A pool member's next hop after path changes: an entry the kernel flushed (its link down and up) is made again at the next heartbeat; a route moved behind another interface gets a managed entry there (logged) and the old one is deleted; the copies leave, none counted no_neighbour; SIGTERM deletes what it made")
    func memberRouteMoved() throws {
        let topology = try Topology(backends: 3)
        defer { topology.destroy() }
        // Unresolved next hops: the daemon makes the pool member's managed entry itself.
        _ = try topology.exec(topology.proxy, ["/usr/sbin/ip", "neigh", "flush", "all"])
        let config = TCReplicationEndToEndTests.allPool(topology, members: "{name: b2, address: \"\(Topology.backendIPv4(2)):\(TCFixtures.port)\"}")
        let (daemon, file) = try TCFixtures.start(topology, config, "tc-pool-moved")
        defer { try? FileManager.default.removeItem(at: file) }
        let second = "pb2\(topology.suffix.prefix(7))", third = "pb3\(topology.suffix.prefix(7))", inner = "b3\(topology.suffix.prefix(8))"
        func entry(_ interface: String) -> String {
            (try? topology.exec(topology.proxy, ["/usr/sbin/ip", "neigh", "show", Topology.backendIPv4(2), "dev", interface])) ?? ""
        }
        func resolved(_ interface: String) -> Bool { entry(interface).contains("managed") && entry(interface).contains("lladdr") }
        let member = ReplicationFixtures.poolLabels("archive", listener: "tc", mode: "tc_ebpf") + ",downstream=\"b2\""
        func send(expecting copies: Int) throws {
            let publisher = try Child("publisher", ["198.18.0.1", "5514", "1200", "--rate", "20000", "--batch", "16"], prefix: topology.prefix(topology.client))
            #expect(publisher.wait() == 0)
            usleep(300_000)
            let metrics = try TCFixtures.metrics(topology)
            #expect(metrics.contains("udp_fanout_pool_member_copies_total{\(member)} \(copies)"), "every copy left: \(metrics)")
            #expect(!metrics.split(separator: "\n").contains { $0.hasPrefix("udp_fanout_pool_member_dropped_total{\(member)") && !$0.hasSuffix(" 0") }, "no copy dropped: \(metrics)")
        }
        try waitUntil("b2's managed entry at \(second) resolved: \(entry(second))", seconds: 10) { resolved(second) }
        func made(at interface: String) -> Int {
            daemon.stderr.split(separator: "\n").filter { $0.contains("added a managed neighbour entry") && $0.contains("interface=\(interface)") }.count
        }
        let madeBefore = made(at: second)
        // The proxy's link toward b2 down and up: the kernel flushes the entry with it (the
        // connected route comes back); the heartbeat after makes it again.
        _ = try topology.exec(topology.proxy, ["/usr/sbin/ip", "link", "set", second, "down"])
        #expect(!entry(second).contains("managed"), "flushed with the link: \(entry(second))")
        _ = try topology.exec(topology.proxy, ["/usr/sbin/ip", "link", "set", second, "up"])
        try waitUntil("the entry at \(second) made again: \(daemon.stderr)", seconds: 15) { made(at: second) > madeBefore && resolved(second) }
        try send(expecting: 1200)
        // b2's address moves behind backend 3's link (backend 3 takes it too); nothing has
        // resolved it there, and a copy cannot wait for the kernel to.
        _ = try topology.exec(topology.backends[2], ["/usr/sbin/ip", "addr", "add", "\(Topology.backendIPv4(2))/32", "dev", inner])
        _ = try topology.exec(topology.proxy, ["/usr/sbin/ip", "route", "add", "\(Topology.backendIPv4(2))/32", "dev", third])
        // The heartbeat comes every 5 s: the next one after the change holds the new next hop.
        try waitUntil("a managed neighbour entry at \(third): \(daemon.stderr)", seconds: 15) { made(at: third) > 0 }
        try waitUntil("the entry at \(third) resolved", seconds: 10) { resolved(third) }
        try waitUntil("the entry at the old next hop deleted: \(entry(second))", seconds: 5) { !entry(second).contains("managed") }
        try send(expecting: 2400)
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        try TCFixtures.expectNothingLeft(topology)
        let left = try topology.exec(topology.proxy, ["/usr/sbin/ip", "neigh", "show"])
        #expect(!left.contains("managed"), "the managed neighbour entries udp-fanout made are gone: \(left)")
    }

    @Test("an all pool of two keeps every copy after each in-place update of the listener's own downstreams: a reload, a health change, a discovery change", arguments: ["tc_ebpf", "xdp", "af_xdp"])
    func poolsAfterInPlaceUpdates(mode: String) throws {
        let topology = try Topology(backends: 5, queues: 2)
        defer { topology.destroy() }
        if mode == "xdp" { try TCFixtures.prepareXDP(topology) }
        let collectors = try TCFixtures.collectors(topology)
        let port = TCFixtures.port
        func member(_ n: Int) -> String { "{name: b\(n), address: \"\(Topology.backendIPv4(n)):\(port)\"}" }
        let kind = mode == "af_xdp" ? "mode: af_xdp\n    settings: {output: preserve_source}" : "mode: \(mode)"
        // Own downstreams: b1 and b4 static, b2 from a Service; the pool: b3 and b5, each every datagram.
        func yaml(_ statics: [Int]) -> String {
            """
            listeners:
              - name: up
                bind: "198.18.0.1:5514"
                interface: \(topology.proxyInterface)
                \(kind)
                kubernetes: {namespace: test, service: own, port: \(port)}
                downstream: [\(statics.map(member).joined(separator: ", "))]
                pools:
                  - {name: archive, balancing: all, downstream: [\(member(3)), \(member(5))]}
            health: {enabled: true, protocol: icmp, interval_secs: 60, timeout_secs: 1}
            """
        }
        let daemon = try DaemonFixtures.startInProxy(topology, yaml([1, 4]))
        defer { DaemonFixtures.stopInProxy(topology, daemon) }
        let spec = DiscoverySpec(KubernetesSource(listener: "up", service: Kubernetes(namespace: "test", service: "own", port: UInt16(port))))
        let b2 = SocketAddress("\(Topology.backendIPv4(2)):\(port)")!
        _ = inNetworkNamespace(topology.proxy) { daemon.discovered(spec, [Downstream(name: "b2", address: b2)]) }
        #expect(daemon.isReady, "\(daemon.readiness)")
        let perPhase = 2000
        var copies: [(String, [Int])] = []
        func phase(_ name: String) throws {
            let publisher = try Child("publisher", ["198.18.0.1", "5514", "\(perPhase)", "--rate", "20000", "--sources", "198.18.0.2-198.18.0.2"],
                                      prefix: topology.prefix(topology.client))
            #expect(publisher.wait() == 0, "\(publisher.stderr)")
            usleep(300_000)
            let text = daemon.metricsText()
            copies.append((name, ["b3", "b5"].map { metric(text, "udp_fanout_pool_member_copies_total", ReplicationFixtures.poolLabels("archive", listener: "up", mode: mode) + ",downstream=\"\($0)\"") ?? -1 }))
        }
        try phase("start")
        // Each change from inside the proxy's namespace, as the daemon's own threads run there.
        let reloaded = yaml([1])
        #expect(inNetworkNamespace(topology.proxy) { daemon.reload(text: reloaded) } == true)
        try phase("reload")
        _ = inNetworkNamespace(topology.proxy) { daemon.healthChanged(b2, up: false) }
        try phase("health down")
        _ = inNetworkNamespace(topology.proxy) {
            daemon.healthChanged(b2, up: true)
            daemon.discovered(spec, [])
        }
        try phase("discovery")
        for (index, (name, counts)) in copies.enumerated() {
            #expect(counts == [perPhase * (index + 1), perPhase * (index + 1)], "\(mode), after \(name): the pool members' copies \(counts), expected \(perPhase * (index + 1)) each")
        }
        DaemonFixtures.stopInProxy(topology, daemon)
        let received = TCFixtures.received(try collectors.map { try $0.stop() })
        #expect(received[2] == 4 * perPhase && received[4] == 4 * perPhase, "\(mode): each pool member received every datagram of the four phases: \(received)")
        #expect(received[0] + received[1] + received[3] == 4 * perPhase, "\(mode): the own downstreams every datagram once: \(received)")
    }
}

/// The issue's NetFlow check in the kernel modes: three pools (a balanced pair, an `all` pair, a
/// `sample: 10` single collector) fed by the publisher's NetFlow v9 from 40 exporters, stored by
/// nfcapd in the backend namespaces and decoded by nfdump.
@Suite("replication with real NetFlow collectors, tc_ebpf, xdp and af_xdp", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct KernelModeNetFlowTests {
    @Test("NetFlow v9 from 40 exporters into nfcapd through three pools: each exporter's flows at one member of the balanced pair, every flow at each member of the all pair, every flow of the exporters userspace's sample keeps at the sampled one; exporter addresses kept (xdp: every datagram passed to tc, which copies, counted pools)", arguments: ["tc_ebpf", "xdp", "af_xdp"])
    func netflow(mode: String) throws {
        try #require(FileManager.default.isExecutableFile(atPath: "/usr/bin/nfcapd"), "nfcapd missing: make test installs nfdump (scripts/setup.sh)")
        let topology = try Topology(backends: 5, queues: 2)
        defer { topology.destroy() }
        try TCFixtures.addClientSources(topology)
        if mode == "xdp" { try TCFixtures.prepareXDP(topology) }
        let collectors = try (1...5).map { n in
            try NetFlowCollector(address: Topology.backendIPv4(n), port: UInt16(TCFixtures.port), prefix: topology.prefix(topology.backends[n - 1]))
        }
        usleep(300_000)  // the collectors bind
        func members(_ numbers: [Int]) -> String {
            numbers.map { "{name: b\($0), address: \"\(Topology.backendIPv4($0)):\(TCFixtures.port)\"}" }.joined(separator: ", ")
        }
        let kind = mode == "af_xdp" ? "mode: af_xdp\n    settings: {output: preserve_source}" : "mode: \(mode)"
        let file = try TCFixtures.write("""
            listeners:
              - name: nf
                bind: "198.18.0.1:2055"
                interface: \(topology.proxyInterface)
                \(kind)
                balancing: source_ip
                downstream: [\(members([1, 2]))]
                pools:
                  - {name: archive, balancing: all, downstream: [\(members([3, 4]))]}
                  - {name: sampled, sample: 10, downstream: [\(members([5]))]}
            metrics: {enabled: true, bind: "127.0.0.1:9464"}
            """, "netflow-\(mode)")
        defer { try? FileManager.default.removeItem(at: file) }
        let daemon = try Child("udp-fanout", ["-c", file.path], prefix: topology.prefix(topology.proxy))
        try daemon.waitFor(mode == "af_xdp" ? "AF_XDP path initialized" : "registered listener in eBPF map")
        let exporters = (10..<50).map { "198.18.0.\($0)" }
        let publisher = try Child("publisher", ["198.18.0.1", "2055", "800", "--sources", "198.18.0.10-198.18.0.49", "--netflow", "v9", "--rate", "4000"],
                                  prefix: topology.prefix(topology.client))
        #expect(publisher.wait(seconds: 30) == 0, "\(publisher.stderr)")
        usleep(500_000)
        if mode == "xdp" {
            let metrics = try TCFixtures.metrics(topology)
            #expect(metric(metrics, "udp_fanout_xdp_passed_total", "listener=\"nf\",reason=\"pools\"") == 800, "\(metrics)")
        }
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0, "\(daemon.stderr)")
        let perExporter = 200  // 20 packets of 10 records each
        let flows = try collectors.map { try $0.flowsByExporter() }
        for exporter in exporters {
            let counts = flows[0..<2].map { $0[exporter] ?? 0 }
            #expect(counts.sorted() == [0, perExporter], "\(mode), \(exporter) in the balanced pair: \(counts)")
        }
        #expect(flows[0..<2].allSatisfy { !$0.isEmpty }, "\(mode): both members of the balanced pair")
        let every = Dictionary(uniqueKeysWithValues: exporters.map { ($0, perExporter) })
        #expect(flows[2] == every && flows[3] == every, "\(mode): every flow at each member of the all pair, under its exporter's address")
        let kept = ReplicationFixtures.sampled(exporters, sample: 10)
        #expect(!kept.isEmpty && kept.count < 12, "\(kept.count) of 40 exporters sampled")
        #expect(flows[4] == Dictionary(uniqueKeysWithValues: kept.map { ($0, perExporter) }), "\(mode): the sampled collector has the kept exporters, whole")
    }
}
