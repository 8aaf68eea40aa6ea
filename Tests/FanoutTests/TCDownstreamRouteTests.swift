// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// A downstream the proxy has no route to is never silent: a warning at start and at reload,
/// and its drops counted per downstream with a reason.
@Suite("tc_ebpf downstream without a route", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct TCDownstreamRouteTests {
    static func config(_ topology: Topology, unroutable: String) -> String {
        """
        listeners:
          - name: tc
            bind: "198.18.0.1:5514"
            interface: \(topology.proxyInterface)
            mode: tc_ebpf
            downstream:
              - {name: b1, address: "\(Topology.backendIPv4(1)):\(TCFixtures.port)"}
              - {name: lost, address: "\(unroutable):\(TCFixtures.port)"}
        metrics: {enabled: true, bind: "127.0.0.1:9464"}
        """
    }

    @Test("Warned at start and at reload; no_route counted for that downstream, with a reason label")
    func warnedAndCounted() throws {
        let topology = try Topology(backends: 1)
        let collectors = try TCFixtures.collectors(topology)
        // 198.19.99.0/24 is routed nowhere in the proxy namespace.
        let (daemon, file) = try TCFixtures.start(topology, Self.config(topology, unroutable: "198.19.99.1"), "tc-noroute")
        defer { try? FileManager.default.removeItem(at: file) }
        let warning = daemon.stderr.split(separator: "\n").first { $0.contains("no route to downstream") }
        #expect(warning != nil, "a warning at start: \(daemon.stderr)")
        #expect(warning?.contains("lost") == true && warning?.contains("198.19.99.1") == true, "names the downstream: \(warning ?? "")")
        #expect(daemon.stderr.components(separatedBy: "no route to downstream").count == 2, "b1 has a route: only one warning")

        #expect(try Child("publisher", ["198.18.0.1", "5514", "100"], prefix: topology.prefix(topology.client)).wait() == 0)
        usleep(200_000)
        let metrics = try TCFixtures.metrics(topology)
        func value(_ series: String) -> Int {
            metrics.split(separator: "\n").first { $0.hasPrefix(series + " ") }.flatMap { $0.split(separator: " ").last }.flatMap { Int($0) } ?? -1
        }
        let labels = "listener=\"tc\",mode=\"tc_ebpf\",downstream=\"lost\""
        let noRoute = value("udp_fanout_downstream_packets_dropped_by_reason_total{\(labels),reason=\"no_route\"}")
        let forwarded = value("udp_fanout_downstream_packets_forwarded_total{listener=\"tc\",mode=\"tc_ebpf\",downstream=\"b1\"}")
        #expect(noRoute > 0 && noRoute + forwarded == 100, "no_route \(noRoute) + forwarded \(forwarded): \(metrics)")
        #expect(value("udp_fanout_downstream_packets_dropped_by_reason_total{\(labels),reason=\"too_large\"}") == 0)
        #expect(value("udp_fanout_downstream_packets_dropped_total{\(labels)}") == noRoute)

        try Self.config(topology, unroutable: "198.19.98.1").write(to: file, atomically: true, encoding: .utf8)
        daemon.signal(SIGHUP)
        try daemon.waitFor("198.19.98.1")
        #expect(daemon.stderr.split(separator: "\n").contains { $0.contains("no route to downstream") && $0.contains("198.19.98.1") },
                "a warning at reload: \(daemon.stderr)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        #expect(try collectors[0].stop().int("received") == forwarded)
    }
}
