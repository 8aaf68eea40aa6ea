// SPDX-License-Identifier: Apache-2.0
import BPFSupport
import Foundation
import Testing
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// xdp end to end: the tc_ebpf topology (client, proxy, three backends in namespaces of their
/// own), the listener in mode xdp. The XDP program attaches natively to the proxy's veth; a veth
/// transmits frames XDP redirects to it only while its peer has GRO on (or an XDP program), so
/// the tests turn GRO on at the backends' ends except where they check what happens without.
@Suite("xdp end to end in namespaces", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct XDPEndToEndTests {
    static func value(_ metrics: String, _ series: String) -> Int? {
        metrics.split(separator: "\n").first { $0.hasPrefix(series + " ") }.flatMap { $0.split(separator: " ").last }.flatMap { Int($0) }
    }

    @Test("IPv4 round robin at XDP (native on veth): each datagram at exactly one backend with the client's source, evenly, none passed to tc; SIGTERM leaves nothing")
    func roundRobinIPv4() throws {
        let topology = try Topology(backends: 3)
        try TCFixtures.prepareXDP(topology)
        let collectors = try TCFixtures.collectors(topology)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2, 3], mode: "xdp"), "xdp-rr")
        defer { try? FileManager.default.removeItem(at: file) }
        #expect(daemon.stderr.contains("attached XDP program") && daemon.stderr.contains("mode=native"), "\(daemon.stderr)")
        let link = try topology.exec(topology.proxy, ["/usr/sbin/ip", "link", "show", "dev", topology.proxyInterface])
        #expect(link.contains("xdp ") || link.contains("prog/xdp"), "native XDP on the proxy's veth: \(link)")
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "3000", "--rate", "20000", "--batch", "16"], prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0)
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        #expect(metrics.contains("udp_fanout_packets_received_total{listener=\"tc\",mode=\"xdp\"} 3000"), "\(metrics)")
        #expect(metrics.contains("udp_fanout_packets_forwarded_total{listener=\"tc\",mode=\"xdp\"} 3000"), "\(metrics)")
        for reason in ["no_neighbour", "too_large", "fragment", "pools", "no_xdp_xmit"] {
            #expect(Self.value(metrics, "udp_fanout_xdp_passed_total{listener=\"tc\",reason=\"\(reason)\"}") == 0, "\(reason): \(metrics)")
        }
        #expect(Self.value(metrics, "udp_fanout_xdp_passed_total{listener=\"tc\",reason=\"checksum_partial\"}").map { $0 <= TCFixtures.coincidentalPartials(3000) } == true, "\(metrics)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        #expect(daemon.stderr.contains("detached XDP program"))
        try TCFixtures.expectNothingLeft(topology)
        let reports = try collectors.map { try $0.stop() }
        let counts = TCFixtures.received(reports)
        #expect(counts.reduce(0, +) == 3000, "every datagram delivered once: \(counts)")
        #expect(counts.allSatisfy { abs($0 - 1000) <= 8 }, "round robin evenness: \(counts)")
        for report in reports {
            #expect(Array(report.object("sources").keys) == ["198.18.0.2"], "client source address preserved")
            #expect(report.int("foreign") == 0)
        }
    }

    @Test("A route through an interface that cannot transmit XDP frames (its veth peer without GRO): every datagram passed to tc, counted no_xdp_xmit, delivered; the log says why")
    func noXDPTransmit() throws {
        let topology = try Topology(backends: 2)
        try TCFixtures.prepareXDP(topology, gro: false)
        let collectors = try TCFixtures.collectors(topology)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2], mode: "xdp"), "xdp-noxmit")
        defer { try? FileManager.default.removeItem(at: file) }
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "1200", "--rate", "20000", "--batch", "16"], prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0)
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        // Every datagram passed to tc once, under a reason true for it: no_xdp_xmit, except the
        // few whose finished checksum equals the pseudo-header's sum by chance (the payload carries
        // the send time, so which ones differs run by run): the program checks that first and
        // rightly passes them as checksum_partial. Nothing else, and no drop.
        let noTransmit = Self.value(metrics, "udp_fanout_xdp_passed_total{listener=\"tc\",reason=\"no_xdp_xmit\"}") ?? -1
        let partial = Self.value(metrics, "udp_fanout_xdp_passed_total{listener=\"tc\",reason=\"checksum_partial\"}") ?? -1
        #expect(noTransmit + partial == 1200 && (0...TCFixtures.coincidentalPartials(1200)).contains(partial),
                "no_xdp_xmit \(noTransmit) + checksum_partial \(partial) (at most \(TCFixtures.coincidentalPartials(1200)) by chance) must be 1200: \(metrics)")
        for reason in ["no_neighbour", "too_large", "fragment", "pools"] {
            #expect(Self.value(metrics, "udp_fanout_xdp_passed_total{listener=\"tc\",reason=\"\(reason)\"}") == 0, "\(reason): \(metrics)")
        }
        #expect(metrics.contains("udp_fanout_packets_forwarded_total{listener=\"tc\",mode=\"xdp\"} 1200"), "\(metrics)")
        #expect(daemon.stderr.contains("interface cannot transmit XDP frames"), "\(daemon.stderr)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        try TCFixtures.expectNothingLeft(topology)
        let reports = try collectors.map { try $0.stop() }
        #expect(TCFixtures.received(reports).reduce(0, +) == 1200, "\(TCFixtures.received(reports))")
        // XDP's choice is tc's: the rotation moves once per datagram, so two backends stay even.
        #expect(TCFixtures.received(reports).allSatisfy { abs($0 - 600) <= 8 }, "round robin evenness through tc: \(TCFixtures.received(reports))")
    }

    @Test("A local sender through a veth with checksum offload (CHECKSUM_PARTIAL): each datagram passed to tc, counted checksum_partial, delivered with a valid checksum")
    func checksumPartial() throws {
        let topology = try Topology(backends: 2)
        try TCFixtures.prepareXDP(topology, checksums: false)
        let collectors = try TCFixtures.collectors(topology)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2], mode: "xdp"), "xdp-partial")
        defer { try? FileManager.default.removeItem(at: file) }
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "1200", "--rate", "20000", "--batch", "16"], prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0)
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        #expect(Self.value(metrics, "udp_fanout_xdp_passed_total{listener=\"tc\",reason=\"checksum_partial\"}") == 1200, "\(metrics)")
        #expect(metrics.contains("udp_fanout_packets_forwarded_total{listener=\"tc\",mode=\"xdp\"} 1200"), "\(metrics)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        try TCFixtures.expectNothingLeft(topology)
        // The collectors' sockets drop a datagram whose checksum is wrong: all arrived.
        let reports = try collectors.map { try $0.stop() }
        #expect(TCFixtures.received(reports).reduce(0, +) == 1200, "\(TCFixtures.received(reports))")
        #expect(TCFixtures.received(reports).allSatisfy { abs($0 - 600) <= 8 }, "round robin evenness through tc: \(TCFixtures.received(reports))")
    }

    @Test("NetFlow v9 from 40 exporters through XDP itself (source_ip over two nfcapd, no pools): each exporter's flows whole at one collector under its own address; nothing passed to tc")
    func netflow() throws {
        let topology = try Topology(backends: 2)
        try TCFixtures.addClientSources(topology)
        try TCFixtures.prepareXDP(topology)
        let collectors = try (1...2).map { n in
            try NetFlowCollector(address: Topology.backendIPv4(n), port: UInt16(TCFixtures.port), prefix: topology.prefix(topology.backends[n - 1]))
        }
        usleep(300_000)  // the collectors bind
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2], balancing: "source_ip", mode: "xdp"), "xdp-netflow")
        defer { try? FileManager.default.removeItem(at: file) }
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "800", "--sources", "198.18.0.10-198.18.0.49", "--netflow", "v9", "--rate", "4000"],
                                  prefix: topology.prefix(topology.client))
        #expect(publisher.wait(seconds: 30) == 0, "\(publisher.stderr)")
        usleep(500_000)
        let metrics = try TCFixtures.metrics(topology)
        #expect(metrics.contains("udp_fanout_packets_forwarded_total{listener=\"tc\",mode=\"xdp\"} 800"), "\(metrics)")
        for reason in ["no_neighbour", "no_xdp_xmit", "pools", "fragment"] {
            #expect(Self.value(metrics, "udp_fanout_xdp_passed_total{listener=\"tc\",reason=\"\(reason)\"}") == 0, "\(reason): \(metrics)")
        }
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let flows = try collectors.map { try $0.flowsByExporter() }
        for exporter in (10..<50).map({ "198.18.0.\($0)" }) {
            #expect(flows.map { $0[exporter] ?? 0 }.sorted() == [0, 200], "\(exporter): 200 flows at exactly one collector, under its address: \(flows.map { $0[exporter] ?? 0 })")
        }
        #expect(flows.allSatisfy { !$0.isEmpty }, "both collectors used")
    }

    @Test("A downstream's route moved at runtime to an interface no downstream used: that interface joins the device map at the next heartbeat (logged), and the datagrams routed through it leave at XDP, none passed to tc")
    func routeMovedToAnotherInterface() throws {
        let topology = try Topology(backends: 3)
        try TCFixtures.prepareXDP(topology)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2], mode: "xdp"), "xdp-moved")
        defer { try? FileManager.default.removeItem(at: file) }
        let third = "pb3\(topology.suffix.prefix(7))", inner = "b3\(topology.suffix.prefix(8))"
        #expect(!daemon.stderr.contains("interface=\(third)"), "no downstream's route leaves through \(third) at start: \(daemon.stderr)")
        // Backend 1's address moves behind backend 3's link (backend 3 takes it too).
        let links = try JSONSerialization.jsonObject(with: Data(try topology.exec(topology.backends[2], ["/usr/sbin/ip", "-j", "link", "show", "dev", inner]).utf8)) as? [[String: Any]]
        let mac = try #require(links?.first?["address"] as? String, "backend 3's MAC")
        _ = try topology.exec(topology.backends[2], ["/usr/sbin/ip", "addr", "add", "198.18.1.2/32", "dev", inner])
        _ = try topology.exec(topology.proxy, ["/usr/sbin/ip", "neigh", "replace", "198.18.1.2", "lladdr", mac, "dev", third, "nud", "permanent"])
        _ = try topology.exec(topology.proxy, ["/usr/sbin/ip", "route", "add", "198.18.1.2/32", "dev", third])
        // The heartbeat comes every 5 s: the next one after the change looks the routes up again.
        try waitUntil("\(third) in the xdp device map: \(daemon.stderr)", seconds: 15) {
            daemon.stderr.split(separator: "\n").contains { $0.contains("in the xdp device map") && $0.contains("interface=\(third)") }
        }
        func transmitted() throws -> Int {
            let shown = try JSONSerialization.jsonObject(with: Data(try topology.exec(topology.proxy, ["/usr/sbin/ip", "-j", "-s", "link", "show", "dev", third]).utf8)) as? [[String: Any]]
            return ((shown?.first?["stats64"] as? [String: Any])?["tx"] as? [String: Any])?["packets"] as? Int ?? -1
        }
        let before = try transmitted()
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "1200", "--rate", "20000", "--batch", "16"], prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0)
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        #expect(metrics.contains("udp_fanout_packets_forwarded_total{listener=\"tc\",mode=\"xdp\"} 1200"), "\(metrics)")
        for reason in ["no_neighbour", "too_large", "fragment", "pools", "no_xdp_xmit"] {
            #expect(Self.value(metrics, "udp_fanout_xdp_passed_total{listener=\"tc\",reason=\"\(reason)\"}") == 0, "\(reason): \(metrics)")
        }
        #expect(try transmitted() - before >= 590, "backend 1's half (a rotation per CPU: about 600) left through \(third)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        try TCFixtures.expectNothingLeft(topology)
    }

    @Test("kill -9 leaves no XDP program attached (a BPF link); the restart attaches again and its SIGTERM leaves nothing")
    func killNine() throws {
        let topology = try Topology(backends: 1)
        try TCFixtures.prepareXDP(topology, checksums: false)
        let config = TCFixtures.config(topology, backends: [1], mode: "xdp")
        let (daemon, file) = try TCFixtures.start(topology, config, "xdp-kill")
        defer { try? FileManager.default.removeItem(at: file) }
        daemon.signal(SIGKILL)
        _ = daemon.wait()
        var link = ""
        for _ in 0..<50 {
            link = try topology.exec(topology.proxy, ["/usr/sbin/ip", "link", "show", "dev", topology.proxyInterface])
            if !link.contains("xdp") { break }
            usleep(20_000)
        }
        #expect(!link.contains("xdp"), "after kill -9: \(link)")
        let restarted = try Child("udp-fanout", ["-c", file.path], prefix: topology.prefix(topology.proxy))
        try restarted.waitFor("registered listener in eBPF map")
        #expect(restarted.stderr.contains("attached XDP program"), "\(restarted.stderr)")
        restarted.signal(SIGTERM)
        #expect(restarted.wait() == 0)
        try TCFixtures.expectNothingLeft(topology)
    }
}
