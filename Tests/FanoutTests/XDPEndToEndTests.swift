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
    /// GRO on at each backend's end of its veth: the proxy's end can then transmit XDP frames.
    static func enableGRO(_ topology: Topology) throws {
        for (index, backend) in topology.backends.enumerated() {
            let device = "b\(index + 1)\(topology.suffix.prefix(8))"
            _ = try topology.exec(backend, ["/usr/sbin/ethtool", "-K", device, "gro", "on"])
        }
    }

    /// The client's veth computes UDP checksums itself (tx off), as datagrams from a NIC arrive;
    /// with offload on, a local sender's checksum holds only the pseudo-header's sum (CHECKSUM_PARTIAL).
    static func completeChecksums(_ topology: Topology) throws {
        _ = try topology.exec(topology.client, ["/usr/sbin/ethtool", "-K", "cp\(topology.suffix.prefix(8))", "tx", "off"])
    }

    static func value(_ metrics: String, _ series: String) -> Int? {
        metrics.split(separator: "\n").first { $0.hasPrefix(series + " ") }.flatMap { $0.split(separator: " ").last }.flatMap { Int($0) }
    }

    /// Nothing of ours left: tc's checks, and no XDP program on the interface or loaded.
    static func expectNothingLeft(_ topology: Topology) throws {
        try TCFixtures.expectNothingLeft(topology)
        let link = try topology.exec(topology.proxy, ["/usr/sbin/ip", "link", "show", "dev", topology.proxyInterface])
        #expect(!link.contains("xdp"), "ip link show: \(link)")
        var programs = ""
        for _ in 0..<50 {
            programs = try run("/usr/sbin/bpftool", ["prog", "show"]).output
            if !programs.contains("fanout_xfwd") { break }
            usleep(20_000)
        }
        #expect(!programs.contains("fanout_xfwd"), "a fanout_xfwd program is still loaded: \(programs)")
    }

    @Test("IPv4 round robin at XDP (native on veth): each datagram at exactly one backend with the client's source, evenly, none passed to tc; SIGTERM leaves nothing")
    func roundRobinIPv4() throws {
        let topology = try Topology(backends: 3)
        try Self.enableGRO(topology)
        try Self.completeChecksums(topology)
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
        for reason in ["no_neighbour", "too_large", "fragment", "pools", "no_xdp_xmit", "checksum_partial"] {
            #expect(Self.value(metrics, "udp_fanout_xdp_passed_total{listener=\"tc\",reason=\"\(reason)\"}") == 0, "\(reason): \(metrics)")
        }
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        #expect(daemon.stderr.contains("detached XDP program"))
        try Self.expectNothingLeft(topology)
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
        let topology = try Topology(backends: 3)
        try Self.completeChecksums(topology)
        let collectors = try TCFixtures.collectors(topology)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2, 3], mode: "xdp"), "xdp-noxmit")
        defer { try? FileManager.default.removeItem(at: file) }
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "1200", "--rate", "20000", "--batch", "16"], prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0)
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        #expect(Self.value(metrics, "udp_fanout_xdp_passed_total{listener=\"tc\",reason=\"no_xdp_xmit\"}") == 1200, "\(metrics)")
        #expect(metrics.contains("udp_fanout_packets_forwarded_total{listener=\"tc\",mode=\"xdp\"} 1200"), "\(metrics)")
        #expect(daemon.stderr.contains("interface cannot transmit XDP frames"), "\(daemon.stderr)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        try Self.expectNothingLeft(topology)
        let reports = try collectors.map { try $0.stop() }
        #expect(TCFixtures.received(reports).reduce(0, +) == 1200, "\(TCFixtures.received(reports))")
    }

    @Test("A local sender through a veth with checksum offload (CHECKSUM_PARTIAL): each datagram passed to tc, counted checksum_partial, delivered with a valid checksum")
    func checksumPartial() throws {
        let topology = try Topology(backends: 3)
        try Self.enableGRO(topology)
        let collectors = try TCFixtures.collectors(topology)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2, 3], mode: "xdp"), "xdp-partial")
        defer { try? FileManager.default.removeItem(at: file) }
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "1200", "--rate", "20000", "--batch", "16"], prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0)
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        #expect(Self.value(metrics, "udp_fanout_xdp_passed_total{listener=\"tc\",reason=\"checksum_partial\"}") == 1200, "\(metrics)")
        #expect(metrics.contains("udp_fanout_packets_forwarded_total{listener=\"tc\",mode=\"xdp\"} 1200"), "\(metrics)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        try Self.expectNothingLeft(topology)
        // The collectors' sockets drop a datagram whose checksum is wrong: all arrived.
        let reports = try collectors.map { try $0.stop() }
        #expect(TCFixtures.received(reports).reduce(0, +) == 1200, "\(TCFixtures.received(reports))")
    }

    @Test("IPv6 source_ip at XDP: every source to one backend, source addresses preserved")
    func sourceIPv6() throws {
        let topology = try Topology(backends: 3)
        try Self.enableGRO(topology)
        try Self.completeChecksums(topology)
        for n in 16..<48 {
            try topology.exec(topology.client, ["/usr/sbin/ip", "-6", "addr", "add", "2001:db8::\(String(n, radix: 16))/64", "dev", "cp\(topology.suffix.prefix(8))", "nodad"])
        }
        let collectors = try TCFixtures.collectors(topology, ipv6: true)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2, 3], balancing: "source_ip", ipv6: true, mode: "xdp"), "xdp-v6")
        defer { try? FileManager.default.removeItem(at: file) }
        let publisher = try Child("publisher", ["2001:db8::1", "5514", "3200", "--sources", "2001:db8::10-2001:db8::2f", "--rate", "20000"],
                                  prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0, "\(publisher.stderr)")
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        #expect(Self.value(metrics, "udp_fanout_xdp_passed_total{listener=\"tc\",reason=\"no_xdp_xmit\"}") == 0, "\(metrics)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        try Self.expectNothingLeft(topology)
        let reports = try collectors.map { try $0.stop() }
        #expect(TCFixtures.received(reports).reduce(0, +) == 3200, "\(TCFixtures.received(reports))")
        let owner = TCFixtures.observedOwners(reports)
        #expect(owner.count == 32, "32 client sources seen: \(owner.keys.sorted())")
        #expect(Set(owner.values).count == 3, "sources spread over all backends")
    }

    @Test("Fragmented datagrams (3000 bytes over a 1500 MTU): each first fragment's choice followed at XDP, reassembled whole at one backend")
    func fragments() throws {
        let topology = try Topology(backends: 3)
        try Self.enableGRO(topology)
        try Self.completeChecksums(topology)
        let collectors = try TCFixtures.collectors(topology)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2, 3], mode: "xdp"), "xdp-frag")
        defer { try? FileManager.default.removeItem(at: file) }
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "600", "--size", "3000", "--rate", "5000", "--batch", "8"],
                                  prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0)
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        #expect(metrics.contains("udp_fanout_packets_forwarded_total{listener=\"tc\",mode=\"xdp\"} 1800"), "\(metrics)")
        #expect(Self.value(metrics, "udp_fanout_xdp_passed_total{listener=\"tc\",reason=\"fragment\"}") == 0, "\(metrics)")
        #expect(metrics.contains("udp_fanout_tc_unmatched_packets_total{reason=\"fragment_untracked\"} 0"), "\(metrics)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let reports = try collectors.map { try $0.stop() }
        #expect(TCFixtures.received(reports).reduce(0, +) == 600, "\(TCFixtures.received(reports))")
        #expect(reports.map { $0.int("bytes") }.reduce(0, +) == 600 * 3000, "every datagram whole")
    }

    @Test("kill -9 leaves no XDP program attached (a BPF link); the restart attaches again and its SIGTERM leaves nothing")
    func killNine() throws {
        let topology = try Topology(backends: 1)
        try Self.enableGRO(topology)
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
        try Self.expectNothingLeft(topology)
    }
}
