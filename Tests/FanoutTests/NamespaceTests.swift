// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// udp-fanout across a real link: two namespaces joined by a veth pair with MTU 1500.
@Suite("udp-fanout across a veth link", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct NamespaceTests {
    @Test("GSO runs above the path MTU fall back to one datagram per message: every 2000-byte datagram arrives whole")
    func gsoFallback() throws {
        let suffix = String(UInt32.random(in: 0...UInt32.max), radix: 16)
        let proxy = "rplb-p-\(suffix)", backend = "rplb-b-\(suffix)"
        let ip = "/usr/sbin/ip"
        try #require(try run(ip, ["netns", "add", proxy]).status == 0)
        defer { _ = try? run(ip, ["netns", "delete", proxy]) }
        try #require(try run(ip, ["netns", "add", backend]).status == 0)
        defer { _ = try? run(ip, ["netns", "delete", backend]) }
        for command in [
            ["link", "add", "vp\(suffix.prefix(6))", "netns", proxy, "type", "veth", "peer", "name", "vb\(suffix.prefix(6))", "netns", backend],
            ["-n", proxy, "addr", "add", "198.18.0.1/24", "dev", "vp\(suffix.prefix(6))"],
            ["-n", backend, "addr", "add", "198.18.0.2/24", "dev", "vb\(suffix.prefix(6))"],
            ["-n", proxy, "link", "set", "vp\(suffix.prefix(6))", "up", "mtu", "1500"],
            ["-n", backend, "link", "set", "vb\(suffix.prefix(6))", "up", "mtu", "1500"],
            ["-n", proxy, "link", "set", "lo", "up"],
            ["-n", backend, "link", "set", "lo", "up"],
        ] {
            let result = try run(ip, command)
            try #require(result.status == 0, "ip \(command.joined(separator: " ")): \(result.output)")
        }
        let inProxy = ["/usr/bin/nsenter", "--net=/run/netns/\(proxy)", "--"]
        let inBackend = ["/usr/bin/nsenter", "--net=/run/netns/\(backend)", "--"]
        // Resolve the neighbour first: while unresolved the kernel queues only a few packets.
        #expect(try run("/usr/bin/nsenter", ["--net=/run/netns/\(proxy)", "--", "ping", "-c", "1", "-W", "2", "198.18.0.2"]).status == 0)
        let collector = try Child("collector", ["198.18.0.2", "7001", "0", "1", "--rcvbuf", "8388608"], prefix: inBackend)
        try collector.waitFor("ready")
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("gso-\(suffix).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        try """
            listeners:
              - name: veth
                bind: "127.0.0.1:7000"
                settings: {workers: 1, batch_size: 64, recv_buf_size: 8388608}
                downstream:
                  - {name: backend, address: "198.18.0.2:7001"}
            metrics: {enabled: true, bind: "127.0.0.1:7090"}
            """.write(to: file, atomically: true, encoding: .utf8)
        let daemon = try Child("udp-fanout", ["-c", file.path], prefix: inProxy)
        try daemon.waitFor("entering receive loop")
        let publisher = try Child("publisher", ["127.0.0.1", "7000", "640", "--size", "2000", "--batch", "64", "--rate", "20000"], prefix: inProxy)
        #expect(publisher.wait() == 0)
        usleep(300_000)
        let metrics = try run("/usr/bin/nsenter", ["--net=/run/netns/\(proxy)", "--", "curl", "-s", "http://127.0.0.1:7090/metrics"]).output
        #expect(metrics.contains("udp_fanout_packets_forwarded_total{listener=\"veth\",mode=\"userspace\"} 640"), "\(metrics)")
        #expect(metrics.contains("udp_fanout_receive_queue_drops_total{listener=\"veth\",mode=\"userspace\"} 0"))
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let report = try collector.stop()
        #expect(report.int("received") == 640, "every datagram arrived: \(report)")
        #expect(report.int("bytes") == 640 * 2000, "whole, 2000 bytes each")
        #expect(report.int("lost") == 0)
    }
}

/// A downstream whose route appears only after udp-fanout started.
@Suite("udp-fanout: a downstream unreachable at start", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct LateRouteTests {
    @Test("Datagrams to a downstream with no route are counted unreachable; once the route exists they flow, without a reload")
    func recoversWithoutReload() throws {
        let suffix = String(UInt32.random(in: 0...UInt32.max), radix: 16)
        let namespace = "rplb-lr-\(suffix)"
        let ip = "/usr/sbin/ip"
        try #require(try run(ip, ["netns", "add", namespace]).status == 0)
        defer { _ = try? run(ip, ["netns", "delete", namespace]) }
        try #require(try run(ip, ["-n", namespace, "link", "set", "lo", "up"]).status == 0)
        let inside = ["/usr/bin/nsenter", "--net=/run/netns/\(namespace)", "--"]
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("late-\(suffix).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        try """
            listeners:
              - name: late
                bind: "127.0.0.1:7000"
                settings: {workers: 1}
                downstream:
                  - {name: later, address: "198.18.9.1:7001"}
            metrics: {enabled: true, bind: "127.0.0.1:7090"}
            """.write(to: file, atomically: true, encoding: .utf8)
        let daemon = try Child("udp-fanout", ["-c", file.path], prefix: inside)
        try daemon.waitFor("entering receive loop")
        #expect(daemon.stderr.contains("downstream socket could not connect"), "\(daemon.stderr)")
        let early = try Child("publisher", ["127.0.0.1", "7000", "10", "--rate", "1000"], prefix: inside)
        #expect(early.wait() == 0)
        usleep(200_000)
        let before = try run("/usr/bin/nsenter", inside.dropFirst().dropLast() + ["--", "curl", "-s", "http://127.0.0.1:7090/metrics"]).output
        #expect(before.contains("udp_fanout_packets_dropped_by_reason_total{listener=\"late\",mode=\"userspace\",reason=\"unreachable\"} 10"), "\(before)")
        // The route appears: the downstream's address on this namespace's loopback.
        try #require(try run(ip, ["-n", namespace, "addr", "add", "198.18.9.1/32", "dev", "lo"]).status == 0)
        let collector = try Child("collector", ["198.18.9.1", "7001", "0", "1"], prefix: inside)
        try collector.waitFor("ready")
        usleep(1_200_000)  // past the reconnect interval
        let late = try Child("publisher", ["127.0.0.1", "7000", "100", "--rate", "2000"], prefix: inside)
        #expect(late.wait() == 0)
        usleep(300_000)
        let report = try collector.stop()
        // The first datagram after the interval reconnects; it and every later one is delivered.
        #expect(report.int("received") == 100, "\(report)")
        #expect(daemon.stderr.contains("downstream socket connected"), "\(daemon.stderr)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
    }
}
