// SPDX-License-Identifier: Apache-2.0
import Foundation
import Logging
import Testing
import TestSupport
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

@Suite("udp-fanout forwarding", .serialized)
struct ForwardingTests {
    @Test("Reference smoke test (000 section 6.1): same config, nc sends 10, each delivered exactly once, metrics 10/10")
    func smoke() throws {
        let sinks = try (19001...19003).map { try Sink(port: UInt16($0)) }
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("test-config-\(UUID().uuidString).yaml")
        try ReferenceConfigs.smoke.write(to: file, atomically: true, encoding: .utf8)
        defer { try? FileManager.default.removeItem(at: file) }
        let daemon = try Child("udp-fanout", ["--config", file.path, "--log-level", "debug"])
        try daemon.waitFor("entering receive loop")
        for line in ["starting udp-fanout", "configuration loaded", "configured listeners by mode", "starting userspace forwarder"] {
            #expect(daemon.stderr.contains(line), "log line '\(line)'")
        }
        let metrics = SocketAddress("127.0.0.1:19090")!
        // Ready once the daemon has taken in the listener its worker just started (on a busy
        // machine a moment after the worker's log line): asked until then, at most 5 s.
        var ready = try httpGet(metrics, "/readyz")
        let deadline = ContinuousClock.now + .seconds(5)
        while ready != (200, "ready\n") && ContinuousClock.now < deadline {
            usleep(20_000)
            ready = try httpGet(metrics, "/readyz")
        }
        #expect(ready == (200, "ready\n"))
        #expect(try httpGet(metrics, "/healthz") == (200, "ok\n"))
        // The reference runs `nc -u -w0`; netcat-openbsd's -w0 may exit before it has read stdin,
        // sending nothing (seen under load: 5 of 10 reached a plain socket). -q0 sends, then quits.
        let sent = try run("/bin/sh", ["-c", "for i in $(seq 1 10); do echo \"test-packet-$i\" | nc -u -q0 127.0.0.1 19000; done"])
        #expect(sent.status == 0, "\(sent.output)")
        let received = sinks.map { $0.drain() }
        let payloads = received.flatMap { $0 }.map { String(decoding: $0, as: UTF8.self) }
        #expect(payloads.count == 10)
        #expect(Set(payloads) == Set((1...10).map { "test-packet-\($0)\n" }), "each exactly once")
        #expect(received.allSatisfy { (3...4).contains($0.count) }, "round robin: \(received.map(\.count))")
        let (status, text) = try httpGet(metrics, "/metrics")
        #expect(status == 200)
        let labels = "listener=\"test-fanout\",mode=\"userspace\""
        #expect(metric(text, "udp_fanout_packets_received_total", labels) == 10)
        #expect(metric(text, "udp_fanout_packets_forwarded_total", labels) == 10)
        #expect(metric(text, "udp_fanout_packets_dropped_total", labels) == 0)
        #expect(metric(text, "udp_fanout_packets_no_healthy_total", labels) == 0)
        #expect(metric(text, "udp_fanout_bytes_received_total", labels) == payloads.reduce(0) { $0 + $1.utf8.count })
        #expect(metric(text, "udp_fanout_downstream_packets_forwarded_total", labels + ",downstream=\"sink-1\"") == received[0].count)
        let start = ContinuousClock.now
        daemon.signal(SIGTERM)
        #expect(daemon.wait(seconds: 5) == 0)
        #expect(ContinuousClock.now - start < .seconds(1), "exits within a second of SIGTERM")
    }

    @Test("Round robin: 300 datagrams of one sender, 100 per downstream; with 2 workers still within 10 %")
    func roundRobin() throws {
        for workers in [1, 2] {
            let sinks = try (0..<3).map { _ in try Sink() }
            let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
            let daemon = try startDaemon("listeners:\n" + listenerYAML("rr", bind: bind, sinks, workers: workers))
            defer { daemon.shutdown() }
            try sendNumbered(to: bind, count: 300)
            let counts = sinks.map { $0.drain().count }
            #expect(counts.reduce(0, +) == 300)
            if workers == 1 {
                #expect(counts == [100, 100, 100])
            } else {
                #expect(counts.allSatisfy { (90...110).contains($0) }, "\(counts)")
            }
        }
    }

    @Test("Source-IP affinity: each source's datagrams all reach one downstream")
    func sourceAffinity() throws {
        let sinks = try (0..<3).map { _ in try Sink() }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let daemon = try startDaemon("listeners:\n" + listenerYAML("affinity", bind: bind, sinks, extra: "    balancing: source_ip\n", workers: 2))
        defer { daemon.shutdown() }
        for source in loopbackSources(60, base: 40) { try sendNumbered(to: bind, count: 5, tag: source, from: source) }
        let received = sinks.map { $0.drain().map { String(decoding: $0, as: UTF8.self).split(separator: "-").first.map(String.init)! } }
        #expect(received.map(\.count).reduce(0, +) == 300)
        var owner: [String: Int] = [:]
        for (index, sources) in received.enumerated() {
            for source in sources {
                #expect(owner[source] == nil || owner[source] == index, "\(source) reached two downstreams")
                owner[source] = index
            }
        }
        #expect(owner.count == 60 && Set(owner.values).count == 3)
    }

    @Test("Weights 1:3 give 100 and 300 of 400")
    func weights() throws {
        let sinks = try (0..<2).map { _ in try Sink() }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let daemon = try startDaemon("listeners:\n" + listenerYAML("weighted", bind: bind, sinks, weights: [1, 3]))
        defer { daemon.shutdown() }
        try sendNumbered(to: bind, count: 400)
        #expect(sinks.map { $0.drain().count } == [100, 300])
    }

    @Test("Datagrams above max_packet_size are dropped as too_large, never forwarded cut; the rest byte for byte")
    func truncation() throws {
        let sink = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let yaml = "listeners:\n" + listenerYAML("small", bind: bind, [sink]).replacingOccurrences(of: "      workers: 1\n", with: "      workers: 1\n      max_packet_size: 1000\n")
        let daemon = try startDaemon(yaml)
        defer { daemon.shutdown() }
        try sendNumbered(to: bind, count: 20, tag: "big", size: 1001)
        try sendNumbered(to: bind, count: 20, tag: "fit", size: 1000)
        let received = sink.drain()
        #expect(received.count == 20)
        #expect(received.allSatisfy { $0.count == 1000 && $0.starts(with: Array("fit-".utf8)) })
        for (index, payload) in received.enumerated() {
            var expected = Array("fit-\(index)".utf8)
            expected += [UInt8](repeating: UInt8(index % 251), count: 1000 - expected.count)
            #expect(payload == expected, "byte for byte")
        }
        let counters = try #require(daemon.counters(of: "small"))
        #expect(counters.received == 40 && counters.forwarded == 20 && counters.dropped[.tooLarge] == 20)
        #expect(counters.bytesReceived == 20 * 1001 + 20 * 1000, "the real size of the oversized ones: \(counters.bytesReceived)")
        #expect(counters.bytesForwarded == 20 * 1000)
    }

    @Test("An unreachable downstream costs counted drops for its own datagrams only")
    func unreachable() throws {
        let sink = try Sink()
        let closed = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let yaml = """
            listeners:
              - name: half
                bind: "\(bind)"
                settings: {workers: 1}
                downstream:
                  - {name: alive, address: "\(sink.address)"}
                  - {name: gone, address: "\(closed)"}
            """
        let daemon = try startDaemon(yaml)
        defer { daemon.shutdown() }
        for _ in 0..<20 {
            try sendNumbered(to: bind, count: 10)
            usleep(5_000)  // lets the ICMP port unreachable come back between batches
        }
        #expect(sink.drain().count == 100, "the live downstream gets every one of its datagrams")
        let counters = try #require(daemon.counters(of: "half"))
        #expect(counters.dropped[.unreachable, default: 0] > 0)
        #expect(counters.received == counters.forwarded + counters.droppedTotal + counters.noHealthy)
        #expect(counters.downstreams["alive"]?.forwarded == 100 && counters.downstreams["alive"]?.dropped == 0)
    }

    @Test("Reload: unchanged and downstream-changed listeners lose nothing; an invalid config is rejected and the old one stays")
    func reloadWithoutLoss() throws {
        let sinksA = try (0..<3).map { _ in try Sink() }
        let sinkB = try Sink(), sinkB2 = try Sink(), sinkC = try Sink()
        let bindA = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let bindB = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let bindC = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let daemon = try startDaemon("listeners:\n" + listenerYAML("a", bind: bindA, Array(sinksA.prefix(2)), workers: 2) + listenerYAML("b", bind: bindB, [sinkB]))
        defer { daemon.shutdown() }
        let publisher = try Child("publisher", ["127.0.0.1", String(bindA.port), "40000", "--rate", "20000", "--sources", "127.0.3.1-127.0.3.20"])
        usleep(500_000)
        // b gets a new downstream (in place), c is new, a is unchanged.
        #expect(daemon.reload(text: "listeners:\n" + listenerYAML("a", bind: bindA, Array(sinksA.prefix(2)), workers: 2)
                              + listenerYAML("b", bind: bindB, [sinkB2]) + listenerYAML("c", bind: bindC, [sinkC])))
        usleep(300_000)
        #expect(!daemon.reload(text: "listeners:\n  - name: broken\n"), "invalid config rejected")
        usleep(300_000)
        // a's downstreams change in place: a third sink joins the rotation.
        #expect(daemon.reload(text: "listeners:\n" + listenerYAML("a", bind: bindA, sinksA, workers: 2) + listenerYAML("c", bind: bindC, [sinkC])))
        #expect(publisher.wait(seconds: 30) == 0)
        let sent = try publisher.json().int("sent")
        let received = sinksA.map { $0.drain().count }
        #expect(sent == 40000)
        #expect(received.reduce(0, +) == sent, "no datagram lost across three reloads: \(received)")
        #expect(received[2] > 0, "the added downstream receives")
        let counters = try #require(daemon.counters(of: "a"))
        #expect(counters.received == UInt64(sent) && counters.forwarded == UInt64(sent) && counters.receiveQueueDrops == 0)
        try sendNumbered(to: bindC, count: 5)
        #expect(sinkC.drain().count == 5, "the new listener forwards")
        #expect(metric(daemon.metricsText(), "udp_fanout_config_reloads_total", "result=\"rejected\"") == 1)
        #expect(metric(daemon.metricsText(), "udp_fanout_config_reloads_total", "result=\"ok\"") == 2)
        #expect(daemon.counters(of: "a") != nil && !daemon.metricsText().contains("listener=\"b\""), "removed listener leaves /metrics")
    }

    @Test("A downstream removed and added again continues its counters: the per-downstream series still sum to the listener's total")
    func downstreamCountersContinue() throws {
        let sinks = try (0..<2).map { _ in try Sink() }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let daemon = try startDaemon("listeners:\n" + listenerYAML("k", bind: bind, sinks))
        defer { daemon.shutdown() }
        try sendNumbered(to: bind, count: 100)
        #expect(sinks.map { $0.drain().count } == [50, 50])
        #expect(daemon.reload(text: "listeners:\n" + listenerYAML("k", bind: bind, [sinks[0]])))
        try sendNumbered(to: bind, count: 20)
        #expect(sinks[0].drain().count == 20)
        let removed = try #require(daemon.counters(of: "k"))
        #expect(removed.downstreams["k-sink-2"]?.forwarded == 50, "a removed downstream's series stays with its total: \(removed.downstreams)")
        #expect(daemon.reload(text: "listeners:\n" + listenerYAML("k", bind: bind, sinks)))
        try sendNumbered(to: bind, count: 100)
        #expect(sinks.map { $0.drain().count } == [50, 50])
        let counters = try #require(daemon.counters(of: "k"))
        #expect(counters.downstreams["k-sink-1"]?.forwarded == 120 && counters.downstreams["k-sink-2"]?.forwarded == 100,
                "each continues where it was: \(counters.downstreams)")
        #expect(counters.downstreams.values.map(\.forwarded).reduce(0, +) == counters.forwarded && counters.forwarded == 220)
    }

    @Test("IPv6 listener and downstreams")
    func ipv6() throws {
        let sinks = try (0..<2).map { _ in try Sink(ip: "::1") }
        let bind = SocketAddress(ip: IPAddress("::1")!, port: freePort())
        let daemon = try startDaemon("listeners:\n" + listenerYAML("v6", bind: bind, sinks))
        defer { daemon.shutdown() }
        try sendNumbered(to: bind, count: 20)
        #expect(sinks.map { $0.drain().count } == [10, 10])
    }

    @Test("SIGHUP reloads the file: an invalid file is logged and ignored, a valid one takes effect")
    func sighup() throws {
        let first = try Sink(), second = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("fanout-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        try ("listeners:\n" + listenerYAML("hup", bind: bind, [first])).write(to: file, atomically: true, encoding: .utf8)
        let daemon = try Child("udp-fanout", ["-c", file.path])
        try daemon.waitFor("entering receive loop")
        try "listeners:\n  - name: hup\n    bind: nowhere\n".write(to: file, atomically: true, encoding: .utf8)
        daemon.signal(SIGHUP)
        try daemon.waitFor("configuration reload rejected")
        try sendNumbered(to: bind, count: 4)
        #expect(first.drain().count == 4, "still forwarding with the old configuration")
        try ("listeners:\n" + listenerYAML("hup", bind: bind, [second])).write(to: file, atomically: true, encoding: .utf8)
        daemon.signal(SIGHUP)
        try daemon.waitFor("downstreams updated in place")
        try sendNumbered(to: bind, count: 4)
        #expect(second.drain().count == 4 && first.drain().isEmpty)
        daemon.signal(SIGTERM)
        #expect(daemon.wait(seconds: 5) == 0)
    }

    @Test("--watch-config reloads when the file changes (an editor's rename or an in-place write), not when it is only touched; an invalid change is rejected and the old configuration stays")
    func watchConfig() throws {
        let first = try Sink(), second = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let metrics = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("watch-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        let metricsYAML = "metrics: {enabled: true, bind: \"\(metrics)\"}\n"
        try ("listeners:\n" + listenerYAML("watched", bind: bind, [first]) + metricsYAML).write(to: file, atomically: true, encoding: .utf8)
        let daemon = try Child("udp-fanout", ["-c", file.path, "--watch-config"])
        defer { daemon.signal(SIGKILL); _ = daemon.wait(seconds: 5) }
        try daemon.waitFor("entering receive loop")
        try daemon.waitFor("watching the configuration file for changes")
        // Touched: same bytes, new times. Nothing reloads.
        let now = Date().addingTimeInterval(5)
        try FileManager.default.setAttributes([.modificationDate: now], ofItemAtPath: file.path)
        Thread.sleep(forTimeInterval: 2.5)
        #expect(try httpGet(metrics, "/metrics").1.contains("udp_fanout_config_reloads_total{result=\"ok\"} 0"))
        // Replaced by rename (atomically: true), as editors and ConfigMaps do.
        try ("listeners:\n" + listenerYAML("watched", bind: bind, [second]) + metricsYAML).write(to: file, atomically: true, encoding: .utf8)
        try daemon.waitFor("configuration file changed: reloading")
        try daemon.waitFor("downstreams updated in place")
        try sendNumbered(to: bind, count: 4)
        #expect(second.drain().count == 4 && first.drain().isEmpty)
        // Written in place with something invalid: rejected, still forwarding to the second.
        let handle = try FileHandle(forWritingTo: file)
        try handle.truncate(atOffset: 0)
        try handle.write(contentsOf: Data("listeners:\n  - name: watched\n    bind: nowhere\n".utf8))
        try handle.close()
        try daemon.waitFor("configuration reload rejected")
        try sendNumbered(to: bind, count: 4)
        #expect(second.drain().count == 4)
        let text = try httpGet(metrics, "/metrics").1
        #expect(text.contains("udp_fanout_config_reloads_total{result=\"ok\"} 1") && text.contains("udp_fanout_config_reloads_total{result=\"rejected\"} 1"), "\(text)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait(seconds: 5) == 0)
    }

    @Test("--check: a valid file exits 0; an invalid one exits 2 naming the key; nothing binds")
    func check() throws {
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("check-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        try ReferenceConfigs.smoke.write(to: file, atomically: true, encoding: .utf8)
        let valid = try run(binaryDirectory.appendingPathComponent("udp-fanout").path, ["--check", "-c", file.path])
        #expect(valid.status == 0 && valid.output.contains("configuration OK: 1 listener(s)"))
        // A check starts nothing, and its log does not say it does.
        #expect(!valid.output.contains("starting udp-fanout") && valid.output.contains("checking udp-fanout configuration"), "\(valid.output)")
        try ReferenceConfigs.afXDP.replacingOccurrences(of: "    interface: eth0\n", with: "").write(to: file, atomically: true, encoding: .utf8)
        let invalid = try run(binaryDirectory.appendingPathComponent("udp-fanout").path, ["--check", "-c", file.path])
        #expect(invalid.status == 2)
        #expect(invalid.output.contains("listeners[0].interface") && invalid.output.contains("attaches to a network interface"))
        let missing = try run(binaryDirectory.appendingPathComponent("udp-fanout").path, ["-c", "/nonexistent.yaml"])
        #expect(missing.status == 2 && missing.output.contains("cannot read /nonexistent.yaml"))
    }

    @Test("pin_cpus stays within the CPUs the daemon was given: under taskset -c 1, every worker (one-way and relay) runs on CPU 1 only")
    func pinningKeepsTheGivenCPUs() throws {
        guard sysconf(Int32(_SC_NPROCESSORS_ONLN)) >= 2 else {
            try #require(ProcessInfo.processInfo.environment["CI"] != "true", "CI machines have 2 CPUs")
            print("skipped: needs 2 CPUs")
            return
        }
        let sinks = try (0..<2).map { _ in try Sink() }
        let yaml = "metrics:\n  bind: \"127.0.0.1:\(freePort())\"\nlisteners:\n"
            + listenerYAML("pin-oneway", bind: SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort()), sinks, workers: 2)
            + listenerYAML("pin-relay", bind: SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort()), sinks,
                           extra: "    replies: relay\n", workers: 2)
                .replacingOccurrences(of: "      workers: 2\n", with: "      workers: 2\n      worker_steering: source_ip\n")
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("pin-\(UUID().uuidString).yaml")
        try yaml.write(to: file, atomically: true, encoding: .utf8)
        defer { try? FileManager.default.removeItem(at: file) }
        let daemon = try Child("udp-fanout", ["-c", file.path], prefix: ["/usr/bin/taskset", "-c", "1"])
        let deadline = ContinuousClock.now + .seconds(10)
        while daemon.stderr.components(separatedBy: "entering receive loop").count - 1 < 4 && ContinuousClock.now < deadline && daemon.process.isRunning {
            usleep(20_000)
        }
        try #require(daemon.stderr.components(separatedBy: "entering receive loop").count - 1 == 4, "\(daemon.stderr)")
        // Every thread of the process, workers included: allowed CPU 1 only (before, worker 0 of
        // each listener pinned itself to CPU 0, outside what the operator gave the daemon).
        let tasks = "/proc/\(daemon.process.processIdentifier)/task"
        var seen = 0
        for task in try FileManager.default.contentsOfDirectory(atPath: tasks) {
            guard let status = try? String(contentsOfFile: "\(tasks)/\(task)/status", encoding: .utf8) else { continue }
            let name = status.split(separator: "\n").first { $0.hasPrefix("Name:") } ?? ""
            let allowed = status.split(separator: "\n").first { $0.hasPrefix("Cpus_allowed_list:") }?.split(separator: "\t").last ?? ""
            #expect(allowed == "1", "thread \(task) (\(name)) allowed \(allowed)")
            seen += 1
        }
        #expect(seen >= 5, "the main thread and 4 workers")
        #expect(!daemon.stderr.contains("cpu=0"), "every worker logs cpu=1")
        // Given both CPUs while running, a reload that restarts the workers (a new batch_size)
        // spreads them again: the allowed set is read at each start, not once.
        try #require(run("/usr/bin/taskset", ["-a", "-p", "-c", "0,1", "\(daemon.process.processIdentifier)"]).status == 0)
        try yaml.replacingOccurrences(of: "      workers: 2\n", with: "      workers: 2\n      batch_size: 16\n").write(to: file, atomically: true, encoding: .utf8)
        daemon.signal(SIGHUP)
        let reloaded = ContinuousClock.now + .seconds(10)
        while daemon.stderr.components(separatedBy: "entering receive loop").count - 1 < 8 && ContinuousClock.now < reloaded && daemon.process.isRunning {
            usleep(20_000)
        }
        // Metadata comes before the message: "... cpu=1 listener=... [FanoutCore] entering receive loop".
        let after = daemon.stderr.split(separator: "\n").filter { $0.contains("entering receive loop") }.dropFirst(4)
        #expect(after.count == 4, "\(daemon.stderr)")
        #expect(after.filter { $0.contains("cpu=0") }.count == 2 && after.filter { $0.contains("cpu=1") }.count == 2, "\(daemon.stderr)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait(seconds: 5) == 0)
    }

    @Test("ServiceLifecycle logs a service by its name: the discovery service's environment (tokens, secrets) stays out of the log")
    func serviceDescriptionsHoldNoSecrets() throws {
        let config = try ConfigParser.parse("listeners:\n" + listenerYAML("desc", bind: SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort()), [try Sink()]))
        let daemon = FanoutDaemon(config: config, configPath: nil, logger: Logger(label: "test"))
        let discovery = DiscoveryService(daemon: daemon, environment: ["API_TOKEN": "s3cr3t-value"])
        #expect("\(discovery)" == "DiscoveryService")
        #expect("\(ForwardingService(daemon: daemon))" == "ForwardingService")
    }
}
