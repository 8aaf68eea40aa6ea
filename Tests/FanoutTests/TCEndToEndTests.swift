// SPDX-License-Identifier: Apache-2.0
import BPFSupport
import Foundation
import Testing
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// tc_ebpf end to end: a client namespace sends to the listener in the proxy namespace, where
/// udp-fanout attaches; three backend namespaces receive. Addresses from 198.18.0.0/15 and
/// 2001:db8::/32, in namespaces each test creates and deletes.
@Suite("tc_ebpf end to end in namespaces", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct TCEndToEndTests {
    @Test("IPv4 round robin: each datagram at exactly one backend with the client's source address, evenly; SIGTERM leaves nothing")
    func roundRobinIPv4() throws {
        let topology = try Topology(backends: 3)
        let collectors = try TCFixtures.collectors(topology)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2, 3]), "tc-rr")
        defer { try? FileManager.default.removeItem(at: file) }
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "3000", "--rate", "20000", "--batch", "16"], prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0)
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        #expect(metrics.contains("udp_fanout_packets_received_total{listener=\"tc\",mode=\"tc_ebpf\"} 3000"), "\(metrics)")
        #expect(metrics.contains("udp_fanout_packets_forwarded_total{listener=\"tc\",mode=\"tc_ebpf\"} 3000"), "\(metrics)")
        for n in 1...3 {
            let line = metrics.split(separator: "\n").first { $0.hasPrefix("udp_fanout_downstream_packets_forwarded_total{listener=\"tc\",mode=\"tc_ebpf\",downstream=\"b\(n)\"}") }
            #expect(line != nil, "per-downstream series for b\(n): \(metrics)")
        }
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        #expect(daemon.stderr.contains("detached tc_ebpf program"))
        try TCFixtures.expectNothingLeft(topology)
        let reports = try collectors.map { try $0.stop() }
        let counts = TCFixtures.received(reports)
        #expect(counts.reduce(0, +) == 3000, "every datagram delivered once: \(counts)")
        // Per-CPU rotations: each backend within the number of CPUs of an exact third.
        #expect(counts.allSatisfy { abs($0 - 1000) <= 8 }, "round robin evenness: \(counts)")
        for report in reports {
            let sources = report.object("sources")
            #expect(Array(sources.keys) == ["198.18.0.2"], "client source address preserved: \(sources.keys)")
            #expect(report.int("foreign") == 0)
        }
    }

    @Test("IPv6 source_ip: every source to one backend, source addresses preserved (tc_ebpf, and xdp: none passed to tc)", arguments: ["tc_ebpf", "xdp"])
    func sourceIPv6(mode: String) throws {
        let topology = try Topology(backends: 3)
        if mode == "xdp" { try TCFixtures.prepareXDP(topology) }
        for n in 16..<48 {
            try topology.exec(topology.client, ["/usr/sbin/ip", "-6", "addr", "add", "2001:db8::\(String(n, radix: 16))/64", "dev", "cp\(topology.suffix.prefix(8))", "nodad"])
        }
        let collectors = try TCFixtures.collectors(topology, ipv6: true)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2, 3], balancing: "source_ip", ipv6: true, mode: mode), "tc-v6")
        defer { try? FileManager.default.removeItem(at: file) }
        let publisher = try Child("publisher", ["2001:db8::1", "5514", "3200", "--sources", "2001:db8::10-2001:db8::2f", "--rate", "20000"],
                                  prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0, "\(publisher.stderr)")
        usleep(300_000)
        if mode == "xdp" {
            let metrics = try TCFixtures.metrics(topology)
            #expect(metric(metrics, "udp_fanout_xdp_passed_total", "listener=\"tc\",reason=\"no_xdp_xmit\"") == 0, "\(metrics)")
            #expect(metric(metrics, "udp_fanout_xdp_passed_total", "listener=\"tc\",reason=\"checksum_partial\"").map { $0 <= TCFixtures.coincidentalPartials(3200) } == true, "\(metrics)")
        }
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        try TCFixtures.expectNothingLeft(topology)
        let reports = try collectors.map { try $0.stop() }
        #expect(TCFixtures.received(reports).reduce(0, +) == 3200, "\(TCFixtures.received(reports))")
        let owner = TCFixtures.observedOwners(reports)
        #expect(owner.count == 32, "32 client sources seen: \(owner.keys.sorted())")
        #expect(Set(owner.values).count == 3, "sources spread over all backends")
    }

    @Test("Fragmented datagrams (3000 bytes over a 1500 MTU) are reassembled whole at one backend (tc_ebpf, and xdp: each first fragment's choice followed at XDP)",
          arguments: ["tc_ebpf", "xdp"])
    func fragments(mode: String) throws {
        let topology = try Topology(backends: 3)
        if mode == "xdp" { try TCFixtures.prepareXDP(topology) }
        let collectors = try TCFixtures.collectors(topology)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2, 3], mode: mode), "tc-frag")
        defer { try? FileManager.default.removeItem(at: file) }
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "600", "--size", "3000", "--rate", "5000", "--batch", "8"],
                                  prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0)
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        // 3 fragments per datagram, each counted.
        #expect(metrics.contains("udp_fanout_packets_forwarded_total{listener=\"tc\",mode=\"\(mode)\"} 1800"), "\(metrics)")
        #expect(metrics.contains("udp_fanout_tc_unmatched_packets_total{reason=\"fragment_untracked\"} 0"), "\(metrics)")
        #expect(metrics.contains("udp_fanout_tc_next_hop_cache_on 1"), "the next-hop cache on with the namespace's default rules and routes: \(metrics)")
        if mode == "xdp" {
            #expect(metric(metrics, "udp_fanout_xdp_passed_total", "listener=\"tc\",reason=\"fragment\"") == 0, "\(metrics)")
        }
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let reports = try collectors.map { try $0.stop() }
        #expect(TCFixtures.received(reports).reduce(0, +) == 600, "\(TCFixtures.received(reports))")
        #expect(reports.map { $0.int("bytes") }.reduce(0, +) == 600 * 3000, "every datagram whole")
        #expect(TCFixtures.received(reports).allSatisfy { $0 >= 190 }, "round robin over datagrams: \(TCFixtures.received(reports))")
    }

    @Test("Backend set changed live by SIGHUP: no datagram lost, the removed backend stops receiving")
    func liveChange() throws {
        let topology = try Topology(backends: 3)
        let collectors = try TCFixtures.collectors(topology)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2, 3]), "tc-live")
        defer { try? FileManager.default.removeItem(at: file) }
        let total = 30000
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "\(total)", "--rate", "15000", "--batch", "8"], prefix: topology.prefix(topology.client))
        usleep(500_000)
        try TCFixtures.config(topology, backends: [1, 2]).write(to: file, atomically: true, encoding: .utf8)
        daemon.signal(SIGHUP)
        usleep(400_000)
        // While b3 is out, everything forwarded goes to b1 and b2 (one scrape is not atomic
        // at 15k/s: a few packets of slack).
        let before = try TCFixtures.forwardedCounts(topology)
        usleep(400_000)
        let after = try TCFixtures.forwardedCounts(topology)
        // A downstream's series lives as long as the process (issue 21): b3's stays, and grows no more.
        #expect(before.b3 > 0 && after.b3 == before.b3, "b3's series stays with its total and no longer grows: \(before) \(after)")
        #expect(after.total - before.total > 3000, "still forwarding: \(before) \(after)")
        #expect(abs((after.total - before.total) - (after.b1 - before.b1) - (after.b2 - before.b2)) <= 60,
                "everything forwarded went to b1 and b2: \(before) \(after)")
        try TCFixtures.config(topology, backends: [1, 2, 3]).write(to: file, atomically: true, encoding: .utf8)
        daemon.signal(SIGHUP)
        #expect(publisher.wait() == 0)
        usleep(300_000)
        #expect(daemon.stderr.contains("updated tc_ebpf downstream set"))
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let reports = try collectors.map { try $0.stop() }
        let counts = TCFixtures.received(reports)
        #expect(counts.reduce(0, +) == total, "no datagram lost across two reloads: \(counts)")
        #expect(counts[2] < counts[0] - 1000, "b3 missed the removed period: \(counts)")
    }

    @Test("Two listeners share one attachment; removing one by reload keeps the other forwarding; removing both detaches")
    func twoListeners() throws {
        let topology = try Topology(backends: 2)
        let collectors = try TCFixtures.collectors(topology)
        func config(_ ports: [Int]) -> String {
            "listeners:\n" + ports.map { port in
                """
                  - name: l\(port)
                    bind: "198.18.0.1:\(port)"
                    interface: \(topology.proxyInterface)
                    mode: tc_ebpf
                    downstream:
                      - {name: b\(port - 5513), address: "\(Topology.backendIPv4(port - 5513)):\(TCFixtures.port)"}

                """
            }.joined() + "metrics: {enabled: true, bind: \"127.0.0.1:9464\"}\n"
        }
        let (daemon, file) = try TCFixtures.start(topology, config([5514, 5515]), "tc-two")
        defer { try? FileManager.default.removeItem(at: file) }
        #expect(daemon.stderr.components(separatedBy: "attached tc_ebpf program").count == 2, "one attachment for both")
        for port in ["5514", "5515"] {
            #expect(try Child("publisher", ["198.18.0.1", port, "100"], prefix: topology.prefix(topology.client)).wait() == 0)
        }
        try config([5515]).write(to: file, atomically: true, encoding: .utf8)
        daemon.signal(SIGHUP)
        usleep(400_000)
        #expect(try Child("publisher", ["198.18.0.1", "5515", "100"], prefix: topology.prefix(topology.client)).wait() == 0)
        #expect(try Child("publisher", ["198.18.0.1", "5514", "100"], prefix: topology.prefix(topology.client)).wait() == 0)
        usleep(200_000)
        let metrics = try TCFixtures.metrics(topology)
        #expect(metrics.contains("udp_fanout_packets_forwarded_total{listener=\"l5515\",mode=\"tc_ebpf\"} 200"), "\(metrics)")
        #expect(!metrics.contains("listener=\"l5514\""))
        #expect(!daemon.stderr.contains("detached tc_ebpf program"), "still attached for l5515")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        try TCFixtures.expectNothingLeft(topology)
        let reports = try collectors.map { try $0.stop() }
        // The second round to 5514 found no listener: passed to the proxy's stack, not forwarded.
        #expect(TCFixtures.received(reports) == [100, 200], "\(TCFixtures.received(reports))")
    }

    @Test("Without CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON: one clear error at start, exit status 1, nothing attached")
    func withoutCapabilities() throws {
        let file = try TCFixtures.write("""
            listeners:
              - name: tc
                bind: "198.18.0.1:5514"
                interface: lo
                mode: tc_ebpf
                downstream:
                  - {name: b1, address: "198.18.1.2:6000"}
            """, "tc-caps")
        defer { try? FileManager.default.removeItem(at: file) }
        let daemon = try Child("udp-fanout", ["-c", file.path], prefix: ["/usr/bin/setpriv", "--inh-caps=-all", "--bounding-set=-all", "--"])
        #expect(daemon.wait() == 1)
        #expect(daemon.stderr.contains("tc_ebpf needs CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON"), "\(daemon.stderr)")
        let programs = try run("/usr/sbin/bpftool", ["prog", "show"]).output
        #expect(!programs.contains("fanout_tc"))
    }

    @Test("An existing clsact qdisc is used and kept; forwarding disabled on the interface is one clear error")
    func existingQdiscAndForwarding() throws {
        let topology = try Topology(backends: 1)
        try topology.exec(topology.proxy, ["tc", "qdisc", "add", "dev", topology.proxyInterface, "clsact"])
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1], attach: "clsact"), "tc-qdisc")
        defer { try? FileManager.default.removeItem(at: file) }
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        try TCFixtures.expectNothingLeft(topology)
        let qdiscs = try topology.exec(topology.proxy, ["tc", "qdisc", "show", "dev", topology.proxyInterface])
        #expect(qdiscs.contains("clsact"), "the qdisc that was there before stays: \(qdiscs)")

        try topology.exec(topology.proxy, ["/usr/sbin/sysctl", "-q", "-w", "net.ipv4.conf.\(topology.proxyInterface).forwarding=0"])
        let refused = try Child("udp-fanout", ["-c", file.path], prefix: topology.prefix(topology.proxy))
        #expect(refused.wait() == 1)
        #expect(refused.stderr.contains("sysctl -w net.ipv4.conf.\(topology.proxyInterface).forwarding=1"), "\(refused.stderr)")
        try TCFixtures.expectNothingLeft(topology)
    }

    @Test("kill -9 and restart (clsact, tcx, clsact then tcx): leftovers are removed, and SIGTERM leaves nothing")
    func crashAndRestart() throws {
        let topology = try Topology(backends: 1)
        let collectors = try TCFixtures.collectors(topology)
        // (attach of the run that is killed, attach of the restart)
        let scenarios = [("clsact", "clsact"), ("tcx", "tcx"), ("clsact", "tcx")]
        for (attach, restart) in scenarios {
            let file = try TCFixtures.write(TCFixtures.config(topology, backends: [1], attach: attach), "tc-crash")
            defer { try? FileManager.default.removeItem(at: file) }
            let first = try Child("udp-fanout", ["-c", file.path], prefix: topology.prefix(topology.proxy))
            try first.waitFor("registered listener in eBPF map")
            #expect(first.stderr.contains("attach=\(attach)"), "\(first.stderr)")
            if attach == "clsact" {
                let filters = try topology.exec(topology.proxy, ["tc", "filter", "show", "dev", topology.proxyInterface, "ingress"])
                #expect(filters.contains("fanout_tc"), "our filter is listed: \(filters)")
            }
            first.signal(SIGKILL)
            first.wait()
            if attach == "tcx" {
                // The link died with the process: nothing to clean even before a restart.
                let programs = try TCFixtures.programsAfterRelease()
                #expect(!programs.contains("fanout_tc"), "tcx link outlived kill -9: \(programs)")
            }
            try TCFixtures.config(topology, backends: [1], attach: restart).write(to: file, atomically: true, encoding: .utf8)
            let second = try Child("udp-fanout", ["-c", file.path], prefix: topology.prefix(topology.proxy))
            try second.waitFor("registered listener in eBPF map")
            if restart == "tcx" {
                let filters = try topology.exec(topology.proxy, ["tc", "filter", "show", "dev", topology.proxyInterface, "ingress"])
                #expect(filters.isEmpty, "\(attach) leftover removed when restarting with tcx: \(filters)")
            }
            let publisher = try Child("publisher", ["198.18.0.1", "5514", "500", "--rate", "10000"], prefix: topology.prefix(topology.client))
            #expect(publisher.wait() == 0)
            usleep(200_000)
            second.signal(SIGTERM)
            #expect(second.wait() == 0)
            try TCFixtures.expectNothingLeft(topology)
            let qdiscs = try topology.exec(topology.proxy, ["tc", "qdisc", "show", "dev", topology.proxyInterface])
            #expect(!qdiscs.contains("clsact"), "the clsact qdisc a run of ours created is gone: \(qdiscs)")
        }
        let report = try collectors[0].stop()
        #expect(report.int("received") == 500 * scenarios.count, "500 per restarted run: \(report)")
    }
}
