// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
import CSystemShim
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// `output: preserve_source` in userspace mode, through a routed topology of namespaces.
@Suite("preserve_source end to end", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct PreserveSourceEndToEndTests {
    /// Starts udp-fanout with `config` in the proxy namespace, sends 3000 datagrams from the 64
    /// client addresses at 20,000/s, and returns the daemon and /metrics once `series` is 3000
    /// (polled: a loaded machine may still be forwarding when the publisher is done).
    static func publish(_ topology: Topology, _ config: String, _ name: String, until series: String) throws -> (Child, String) {
        let file = try TCFixtures.write(config, name)
        defer { try? FileManager.default.removeItem(at: file) }
        let daemon = try Child("udp-fanout", ["-c", file.path], prefix: topology.prefix(topology.proxy))
        try daemon.waitFor("entering receive loop")
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "3000", "--sources", TCFixtures.clientSources, "--rate", "20000"],
                                  prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0)
        return (daemon, try Scrape.metrics({ try topology.exec(topology.proxy, $0) }, until: series, is: 3000))
    }

    @Test("Userspace mode, output preserve_source: each collector sees the clients' own addresses (samplicator -S), sent through a UDP socket bound to each client (the gauge counts 64)")
    func userspacePreserveSource() throws {
        let topology = try Topology(backends: 3)
        try TCFixtures.addClientSources(topology)
        let collectors = try TCFixtures.collectors(topology)
        let downstreams = (1...3).map { "\(Topology.backendIPv4($0)):\(TCFixtures.port)" }.enumerated().map { "      - {name: b\($0.offset + 1), address: \"\($0.element)\"}" }.joined(separator: "\n")
        let config = """
            listeners:
              - name: u
                bind: "198.18.0.1:5514"
                balancing: source_ip
                settings: {output: preserve_source, workers: 2, recv_buf_size: 8388608}
                downstream:
            \(downstreams)
            metrics: {enabled: true, bind: "127.0.0.1:\(Scrape.metricsPort)"}
            """
        let (daemon, metrics) = try Self.publish(topology, config, "userspace-preserve",
                                                 until: "udp_fanout_packets_forwarded_total{listener=\"u\",mode=\"userspace\"}")
        #expect(Scrape.value(metrics, "udp_fanout_packets_forwarded_total{listener=\"u\",mode=\"userspace\"}") == 3000, "\(metrics)")
        // The clients' addresses are not the proxy's: each client (64 addresses, a port each, one
        // worker each) has a UDP socket bound to it, which the gauge counts.
        #expect(Scrape.value(metrics, "udp_fanout_preserve_source_client_sockets{listener=\"u\",mode=\"userspace\"}") == 64, "\(metrics)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let reports = try collectors.map { try $0.stop() }
        // Only to name where datagrams went if some are missing.
        let kernelDrops = (try? topology.clientPathDrops()).map(String.init) ?? "unreadable"
        #expect(TCFixtures.received(reports).reduce(0, +) == 3000, "\(TCFixtures.received(reports)) kernel drops \(kernelDrops)\n\(metrics)")
        var owner: [String: Int] = [:]
        for (index, report) in reports.enumerated() {
            for source in report.object("sources").keys {
                #expect(source.hasPrefix("198.18.0.") && owner[source] == nil, "\(source) at backend \(index + 1)")
                owner[source] = index
            }
        }
        #expect(owner.count == 64, "64 client addresses, each at one collector: \(owner.count)")
    }

    @Test("replies: relay with an all pool, output preserve_source: the relay's own downstream sees the proxy's address, each pool member every request from the client's own address, sent through a UDP socket bound to each client by the relay's workers (the gauge counts 64)")
    func relayPoolPreserveSource() throws {
        let topology = try Topology(backends: 3)
        try TCFixtures.addClientSources(topology)
        let collectors = try TCFixtures.collectors(topology)
        let member = { (n: Int) in "{name: b\(n), address: \"\(Topology.backendIPv4(n)):\(TCFixtures.port)\"}" }
        let config = """
            listeners:
              - name: r
                bind: "198.18.0.1:5514"
                mode: userspace
                replies: relay
                settings: {workers: 2, worker_steering: five_tuple, recv_buf_size: 8388608}
                downstream:
                  - \(member(1))
                pools:
                  - name: copies
                    balancing: all
                    output: preserve_source
                    downstream: [\(member(2)), \(member(3))]
            metrics: {enabled: true, bind: "127.0.0.1:\(Scrape.metricsPort)"}
            """
        let (daemon, metrics) = try Self.publish(topology, config, "relay-preserve",
                                                 until: "udp_fanout_pool_datagrams_total{listener=\"r\",mode=\"userspace\",pool=\"copies\",outcome=\"forwarded\"}")
        #expect(ReplicationFixtures.outcomes(metrics, "copies", listener: "r") == ["forwarded": 3000, "dropped": 0, "sampled_out": 0, "filtered_out": 0], "\(metrics)")
        // The clients' addresses are not the proxy's: each client (64 addresses, a port each, one
        // relay worker each) has a UDP socket bound to it for the pool's copies.
        #expect(Scrape.value(metrics, "udp_fanout_preserve_source_client_sockets{listener=\"r\",mode=\"userspace\"}") == 64, "\(metrics)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let reports = try collectors.map { try $0.stop() }
        let kernelDrops = (try? topology.clientPathDrops()).map(String.init) ?? "unreadable"
        #expect(TCFixtures.received(reports) == [3000, 3000, 3000], "kernel drops \(kernelDrops)\n\(metrics)")
        // The relay's own downstream: from the proxy (its sessions' sockets), never a client's address.
        #expect(Array(reports[0].object("sources").keys) == ["198.18.1.1"], "\(reports[0].object("sources").keys)")
        // Each pool member: every client, from its own address.
        for index in 1...2 {
            let sources = Set(reports[index].object("sources").keys)
            #expect(sources.count == 64 && sources.allSatisfy { $0.hasPrefix("198.18.0.") }, "backend \(index + 1): \(sources.sorted())")
        }
    }
}
