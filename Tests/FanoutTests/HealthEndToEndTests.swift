// SPDX-License-Identifier: Apache-2.0
import Foundation
import Synchronization
import Testing
import TestSupport
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// Health through the udp-fanout binary, in tc_ebpf (namespaces, ICMP) and userspace (loopback,
/// udp_echo with health ports, passive reports): a downstream that stops answering leaves its
/// listener's rotation and comes back; only its sources move (checked exactly against the table
/// every mode computes, `DaemonFixtures.owners`); all down is counted and not ready.
@Suite("HealthEndToEnd", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct HealthEndToEndTests {
    static let health = "health: {enabled: true, protocol: icmp, interval_secs: 1, timeout_secs: 1, fall: 2, rise: 2}"

    // MARK: tc_ebpf

    @Test("tc_ebpf, icmp: a backend that stops answering ICMP is taken out after fall probes and back after rise; only its sources move; nothing lost")
    func tcICMP() throws {
        let topology = try Topology(backends: 3)
        defer { topology.destroy() }
        try TCFixtures.addClientSources(topology)
        let collectors = try TCFixtures.collectors(topology)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2, 3], balancing: "source_ip") + "\n" + Self.health, "health-tc")
        defer { try? FileManager.default.removeItem(at: file) }
        let b2 = "b2\",address=\"\(Topology.backendIPv4(2)):\(TCFixtures.port)\""
        let total = 200_000
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "\(total)", "--sources", "198.18.0.10-198.18.0.73", "--rate", "20000"],
                                  prefix: topology.prefix(topology.client))
        usleep(1_000_000)
        try Self.icmp(topology, topology.backends[1], answer: false)
        let down = Probe.waitFor(seconds: 8) { (try? TCFixtures.metrics(topology))?.contains("udp_fanout_downstream_up{listener=\"tc\",downstream=\"\(b2)} 0") == true }
        #expect(down, "b2 down after fall failed probes: \(daemon.stderr)")
        // While b2 is out nothing more is forwarded to it (two scrapes after the change was applied).
        let outBefore = try TCFixtures.forwardedCounts(topology)
        usleep(500_000)
        let outAfter = try TCFixtures.forwardedCounts(topology)
        #expect(outAfter.total - outBefore.total > 3000, "still forwarding: \(outBefore) \(outAfter)")
        // Everything forwarded went to b1 and b3 (one scrape is not atomic at 20k/s: a few
        // packets of slack). b2's series stays while it is out (a downstream's counters live as
        // long as the process), and grows no more.
        #expect(abs((outAfter.total - outBefore.total) - (outAfter.b1 - outBefore.b1) - (outAfter.b3 - outBefore.b3)) <= 60,
                "while b2 is down everything forwarded went to b1 and b3: \(outBefore) \(outAfter)")
        #expect(outBefore.b2 > 0 && outAfter.b2 == outBefore.b2, "b2's series stays and no longer grows: \(outBefore) \(outAfter)")
        try Self.icmp(topology, topology.backends[1], answer: true)
        let up = Probe.waitFor(seconds: 8) { (try? TCFixtures.metrics(topology))?.contains("udp_fanout_downstream_up{listener=\"tc\",downstream=\"\(b2)} 1") == true }
        #expect(up, "b2 back after rise probes: \(daemon.stderr)")
        #expect(publisher.process.isRunning, "the run covered both changes (else the phases below are not all exercised)")
        #expect(publisher.wait(seconds: 30) == 0, "\(publisher.stderr)")
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        try Self.checkExposition(metrics)
        #expect(metric(metrics, "udp_fanout_packets_no_healthy_total", "listener=\"tc\",mode=\"tc_ebpf\"") == 0, "\(metrics)")
        let target = "\(Topology.backendIPv4(2)):\(TCFixtures.port)"
        #expect(metric(metrics, "udp_fanout_health_transitions_total", "target=\"\(target)\",to=\"down\"") == 1)
        #expect(metric(metrics, "udp_fanout_health_transitions_total", "target=\"\(target)\",to=\"up\"") == 1)
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let log = daemon.stderr
        #expect(Self.logLine(log, "downstream marked unhealthy, disabling")?.contains(target) == true, "\(log)")
        #expect(Self.logLine(log, "downstream is healthy")?.contains(target) == true, "\(log)")
        try TCFixtures.expectNothingLeft(topology)

        // b2 still received UDP while its ICMP was ignored: every datagram arrived somewhere.
        let reports = try collectors.map { try $0.stop() }
        let received = TCFixtures.received(reports)
        #expect(received.reduce(0, +) == total, "per backend \(received)")
        try Self.expectOwners(reports, phases: [[1, 2, 3], [1, 3]], movedExpected: true)
    }

    @Test("tc_ebpf, all down: datagrams counted as no_healthy (received + no_healthy == sent), /readyz 503 naming the listener, ready again when one answers")
    func tcAllDown() throws {
        let topology = try Topology(backends: 3)
        defer { topology.destroy() }
        let collectors = try TCFixtures.collectors(topology)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1, 2, 3], balancing: "source_ip") + "\n" + Self.health, "health-all")
        defer { try? FileManager.default.removeItem(at: file) }
        #expect(Probe.waitFor(seconds: 5) { Self.readyz(topology)?.status == 200 })
        let total = 80_000
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "\(total)", "--rate", "10000"], prefix: topology.prefix(topology.client))
        usleep(500_000)
        for backend in topology.backends { try Self.icmp(topology, backend, answer: false) }
        let allDown = Probe.waitFor(seconds: 8) {
            guard let text = try? TCFixtures.metrics(topology) else { return false }
            return (1...3).allSatisfy { text.contains("udp_fanout_downstream_up{listener=\"tc\",downstream=\"b\($0)\",address=\"\(Topology.backendIPv4($0)):\(TCFixtures.port)\"} 0") }
        }
        #expect(allDown, "\(daemon.stderr)")
        let ready = try #require(Self.readyz(topology))
        #expect(ready.status == 503 && ready.body.contains("listener 'tc' has no healthy downstream"), "\(ready)")
        usleep(300_000)
        let dropping = try TCFixtures.metrics(topology)
        #expect((metric(dropping, "udp_fanout_packets_no_healthy_total", "listener=\"tc\",mode=\"tc_ebpf\"") ?? 0) > 0, "\(dropping)")
        try Self.icmp(topology, topology.backends[0], answer: true)
        #expect(Probe.waitFor(seconds: 8) { Self.readyz(topology)?.status == 200 }, "ready again once b1 answers")
        #expect(publisher.process.isRunning, "the run covered the outage and the return")
        #expect(publisher.wait(seconds: 30) == 0, "\(publisher.stderr)")
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        try Self.checkExposition(metrics)
        let noHealthy = try #require(metric(metrics, "udp_fanout_packets_no_healthy_total", "listener=\"tc\",mode=\"tc_ebpf\""))
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let received = TCFixtures.received(try collectors.map { try $0.stop() })
        #expect(received.reduce(0, +) + noHealthy == total, "received \(received) + no_healthy \(noHealthy) == sent \(total)")
        #expect(received[0] > 0 && noHealthy > 0)
        try TCFixtures.expectNothingLeft(topology)
    }

    // MARK: userspace

    @Test("userspace, udp_echo on health ports: a silent responder takes its downstream out (only its sources move) and back; a closed receiver goes down by passive reports before fall probes fail")
    func userspaceEcho() throws {
        var sinks: [Sink?] = try (0..<3).map { _ in try Sink() }
        let ports = sinks.map { $0!.address.port }
        let echoes = try (0..<3).map { _ in try EchoServer() }
        defer { for echo in echoes { echo.close() } }
        let run = try Self.userspace(ports: ports, echoes: echoes, health: "health: {enabled: true, protocol: udp_echo, interval_secs: 1, timeout_secs: 1, fall: 2, rise: 1}")
        defer { try? FileManager.default.removeItem(at: run.file) }
        let pool = try SourcePool(64)
        let downstreams = ports.enumerated().map { Downstream(name: "d\($0.offset)", address: SocketAddress("127.0.0.1:\($0.element)")!) }
        func phase(_ members: [Int], rounds: Range<Int>, _ what: String) throws {
            try pool.send(to: run.bind, rounds: rounds, rate: 20_000)
            let spread = SourcePool.spread(sinks.map { $0! })
            // On a loss, the daemon's own counts say where it went (dropped by reason, or sent and lost after).
            #expect(spread.received == rounds.count * 64, "\(what): every datagram arrived: \(spread.perSink); the daemon's counts: \((Self.get(run.metrics, "/metrics")?.body ?? "").split(separator: "\n").filter { $0.hasPrefix("udp_fanout_") && ($0.contains("dropped") || $0.contains("forwarded_total") || $0.contains("receive_queue")) && !$0.hasPrefix("#") })")
            let owner = DaemonFixtures.owners(pool.sources, members.map { downstreams[$0] })
            for (source, reached) in spread.bySource {
                let expected = downstreams.firstIndex { $0.address == owner[pool.sources[source]] }!
                #expect(reached == [expected], "\(what): source \(source) reached \(reached.sorted()), the table gives \(expected)")
            }
        }
        func up(_ index: Int) -> Int? {
            metric(Self.get(run.metrics, "/metrics")?.body ?? "", "udp_fanout_downstream_up", "listener=\"u\",downstream=\"d\(index)\",address=\"127.0.0.1:\(ports[index])\"")
        }
        try phase([0, 1, 2], rounds: 0..<10, "all up")
        let owner = DaemonFixtures.owners(pool.sources, downstreams)
        #expect(owner.values.contains(downstreams[1].address), "some sources belong to d1")

        echoes[1].mode.store(EchoServer.Mode.silent.rawValue, ordering: .relaxed)
        #expect(Probe.waitFor(seconds: 8) { up(1) == 0 }, "d1 down after fall timeouts: \(run.daemon.stderr)")
        try phase([0, 2], rounds: 10..<20, "d1 down")
        echoes[1].mode.store(EchoServer.Mode.echo.rawValue, ordering: .relaxed)
        #expect(Probe.waitFor(seconds: 8) { up(1) == 1 }, "d1 back after rise: \(run.daemon.stderr)")
        try phase([0, 1, 2], rounds: 20..<30, "d1 back")

        // Passive: d2's receiver dies (its port answers ICMP port unreachable) and its echo goes
        // silent. Sends refused by the kernel take it down before fall probes have timed out.
        sinks[2] = nil
        echoes[2].mode.store(EchoServer.Mode.silent.rawValue, ordering: .relaxed)
        let target = "127.0.0.1:\(echoes[2].address.port)"
        var downScrape = ""
        var round = 30
        let deadline = ContinuousClock.now + .seconds(8)
        while ContinuousClock.now < deadline {
            try pool.send(to: run.bind, rounds: round..<(round + 1), rate: 20_000)
            round += 1
            usleep(10_000)
            let text = Self.get(run.metrics, "/metrics")?.body ?? ""
            if metric(text, "udp_fanout_downstream_up", "listener=\"u\",downstream=\"d2\",address=\"127.0.0.1:\(ports[2])\"") == 0 { downScrape = text; break }
        }
        try #require(!downScrape.isEmpty, "d2 never went down: \(run.daemon.stderr)")
        let failedProbes = ["timeout", "refused", "unreachable", "mismatch", "error"].map {
            metric(downScrape, "udp_fanout_health_probes_total", "target=\"\(target)\",result=\"\($0)\"") ?? 0
        }.reduce(0, +)
        #expect(failedProbes < 2, "down before fall (2) probes failed: \(failedProbes) failed")
        #expect((metric(downScrape, "udp_fanout_health_passive_failures_total", "target=\"\(target)\"") ?? 0) >= 1, "\(downScrape)")
        try Self.checkExposition(downScrape)
        _ = SourcePool.spread(sinks.compactMap { $0 })
        sinks[2] = try Sink(port: ports[2])
        echoes[2].mode.store(EchoServer.Mode.echo.rawValue, ordering: .relaxed)
        #expect(Probe.waitFor(seconds: 8) { up(2) == 1 }, "d2 back once it echoes: \(run.daemon.stderr)")
        try phase([0, 1, 2], rounds: 100..<110, "d2 back")

        run.daemon.signal(SIGTERM)
        #expect(run.daemon.wait() == 0)
        let log = run.daemon.stderr
        #expect(Self.logLine(log, "downstream marked unhealthy, disabling", containing: "127.0.0.1:\(echoes[1].address.port)")?.contains("timeout") == true, "\(log)")
        #expect(Self.logLine(log, "downstream marked unhealthy, disabling", containing: target)?.contains("refused (passive)") == true, "\(log)")
        #expect(Self.logLine(log, "downstream is healthy", containing: target) != nil, "\(log)")
    }

    @Test("userspace, udp_echo: sample `collector --echo` downstreams answer the probes on their data port, stay up and receive every datagram")
    func collectorEchoAnswersProbes() throws {
        let ports = (0..<3).map { _ in freePort() }
        let collectors = try ports.map { port in
            let child = try Child("collector", ["127.0.0.1", "\(port)", "0", "1", "--echo", "--tag", "c\(port)", "--rcvbuf", "4194304"])
            try child.waitFor("ready")
            return child
        }
        let run = try Self.userspace(ports: ports, health: "health: {enabled: true, protocol: udp_echo, interval_secs: 1, timeout_secs: 1, fall: 2, rise: 1}")
        defer { try? FileManager.default.removeItem(at: run.file) }
        let (daemon, bind, metrics) = (run.daemon, run.bind, run.metrics)
        func scrape() -> String { Self.get(metrics, "/metrics")?.body ?? "" }
        func probes(_ text: String, _ port: UInt16, _ result: String) -> Int {
            metric(text, "udp_fanout_health_probes_total", "target=\"127.0.0.1:\(port)\",result=\"\(result)\"") ?? 0
        }
        // fall 2 at 1 s: after 3 probes of each target a mismatching echo would have taken it down.
        #expect(Probe.waitFor(seconds: 8) { let text = scrape(); return ports.allSatisfy { probes(text, $0, "ok") >= 3 } }, "\(scrape())\n\(daemon.stderr)")
        let text = scrape()
        for (index, port) in ports.enumerated() {
            #expect(probes(text, port, "mismatch") == 0, "target 127.0.0.1:\(port) mismatch probes: \(text)")
            #expect(metric(text, "udp_fanout_health_target_up", "target=\"127.0.0.1:\(port)\"") == 1, "\(text)")
            #expect(metric(text, "udp_fanout_downstream_up", "listener=\"u\",downstream=\"d\(index)\",address=\"127.0.0.1:\(port)\"") == 1, "\(text)")
        }
        let ready = Self.get(metrics, "/readyz")
        #expect(ready?.status == 200, "\(String(describing: ready))")

        let total = 3000
        let publisher = try Child("publisher", ["127.0.0.1", "\(bind.port)", "\(total)", "--rate", "5000", "--sources", "127.0.9.1-127.0.9.30"])
        #expect(publisher.wait(seconds: 30) == 0, "\(publisher.stderr)")
        usleep(300_000)
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0, "\(daemon.stderr)")
        let reports = try collectors.map { try $0.stop() }
        // Probes are not the publisher's (counted as foreign); everything else is its traffic.
        let delivered = reports.map { $0.int("received") - $0.int("foreign") }
        #expect(delivered.reduce(0, +) == total && delivered.filter { $0 > 0 }.count >= 2, "per collector \(delivered): \(reports)")
        #expect(reports.allSatisfy { $0.int("probes_echoed") > 0 && $0.int("echo_failed") == 0 }, "each collector answered probes unchanged: \(reports)")
    }

    @Test("A reload changing health's interval and then its protocol keeps every target's state and counters")
    func reloadKeepsState() throws {
        let sinks = try (0..<2).map { _ in try Sink() }
        let ports = sinks.map { $0.address.port }
        let echoes = try (0..<2).map { _ in try EchoServer() }
        defer { for echo in echoes { echo.close() } }
        let run = try Self.userspace(ports: ports, echoes: echoes, health: "health: {enabled: true, protocol: udp_echo, interval_secs: 1, timeout_secs: 1, fall: 2, rise: 1}")
        defer { try? FileManager.default.removeItem(at: run.file) }
        let target = "127.0.0.1:\(echoes[1].address.port)"
        func scrape() -> String { Self.get(run.metrics, "/metrics")?.body ?? "" }
        func up(_ text: String) -> Int? { metric(text, "udp_fanout_downstream_up", "listener=\"u\",downstream=\"d1\",address=\"127.0.0.1:\(ports[1])\"") }
        echoes[1].mode.store(EchoServer.Mode.silent.rawValue, ordering: .relaxed)
        #expect(Probe.waitFor(seconds: 8) { up(scrape()) == 0 }, "\(run.daemon.stderr)")
        let before = scrape()
        let timeouts = try #require(metric(before, "udp_fanout_health_probes_total", "target=\"\(target)\",result=\"timeout\""))

        func reload(_ health: String, _ count: Int) throws {
            try run.yaml(health).write(to: run.file, atomically: true, encoding: .utf8)
            run.daemon.signal(SIGHUP)
            #expect(Probe.waitFor(seconds: 5) { run.daemon.stderr.components(separatedBy: "reload=true").count - 1 == count }, "\(run.daemon.stderr)")
        }
        try reload("health: {enabled: true, protocol: udp_echo, interval_secs: 2, timeout_secs: 1, fall: 2, rise: 1}", 1)
        let afterInterval = scrape()
        #expect(up(afterInterval) == 0, "still down after an interval change")
        #expect(metric(afterInterval, "udp_fanout_health_transitions_total", "target=\"\(target)\",to=\"down\"") == 1)
        #expect((metric(afterInterval, "udp_fanout_health_probes_total", "target=\"\(target)\",result=\"timeout\"") ?? 0) >= timeouts, "counters kept")

        // icmp to 127.0.0.1 answers: rise 3 at 2 s takes seconds, so right after the reload the
        // target is still down (state kept), and then it comes up.
        try reload("health: {enabled: true, protocol: icmp, interval_secs: 2, timeout_secs: 1, fall: 2, rise: 3}", 2)
        let afterProtocol = scrape()
        #expect(up(afterProtocol) == 0, "still down right after a protocol change")
        #expect(metric(afterProtocol, "udp_fanout_health_transitions_total", "target=\"\(target)\",to=\"down\"") == 1)
        #expect((metric(afterProtocol, "udp_fanout_health_probes_total", "target=\"\(target)\",result=\"timeout\"") ?? 0) >= timeouts, "counters kept")
        #expect(Probe.waitFor(seconds: 10) { up(scrape()) == 1 }, "up after rise ICMP probes: \(run.daemon.stderr)")
        let final = scrape()
        #expect(metric(final, "udp_fanout_health_transitions_total", "target=\"\(target)\",to=\"up\"") == 1)
        #expect(metric(final, "udp_fanout_health_target_up", "target=\"127.0.0.1:\(echoes[0].address.port)\"") == 1, "the other target stayed up")
        #expect(metric(final, "udp_fanout_health_transitions_total", "target=\"127.0.0.1:\(echoes[0].address.port)\",to=\"down\"") == 0)
        try Self.checkExposition(final)
        run.daemon.signal(SIGTERM)
        #expect(run.daemon.wait() == 0)
    }

    @Test("A reload enabling icmp where no ICMP socket opens (ping_group_range excludes the daemon, no CAP_NET_RAW) is rejected and the daemon keeps running; accepted once the range allows")
    func reloadICMPRejected() throws {
        let namespace = "hle-\(String(UInt32.random(in: 0...UInt32.max), radix: 16))"
        try Self.ip(["netns", "add", namespace])
        defer { _ = try? TestSupport.run("/usr/sbin/ip", ["netns", "delete", namespace]) }
        try Self.ip(["-n", namespace, "link", "set", "lo", "up"])
        let nsExec = ["/usr/sbin/ip", "netns", "exec", namespace]
        try Self.ip(["netns", "exec", namespace, "/usr/sbin/sysctl", "-q", "-w", "net.ipv4.ping_group_range=1 0"])
        let (port, sinkPort, metricsPort) = (freePort(), freePort(), freePort())
        func yaml(_ health: String) -> String {
            """
            listeners:
              - name: u
                bind: "127.0.0.1:\(port)"
                mode: userspace
                settings: {workers: 1}
                downstream:
                  - {name: d0, address: "127.0.0.1:\(sinkPort)"}
            \(health)
            metrics: {enabled: true, bind: "127.0.0.1:\(metricsPort)"}
            """
        }
        let file = try TCFixtures.write(yaml("health: {enabled: false}"), "health-rej")
        defer { try? FileManager.default.removeItem(at: file) }
        let daemon = try Child("udp-fanout", ["-c", file.path],
                               prefix: nsExec + ["/usr/bin/setpriv", "--bounding-set=-net_raw", "--inh-caps=-net_raw", "--"])
        #expect(Probe.waitFor(seconds: 10) { Probe.curl(nsExec, metricsPort, "/readyz")?.status == 200 }, "\(daemon.stderr)")
        try yaml("health: {enabled: true, protocol: icmp, interval_secs: 1, timeout_secs: 1}").write(to: file, atomically: true, encoding: .utf8)
        daemon.signal(SIGHUP)
        #expect(Probe.waitFor(seconds: 5) { daemon.stderr.contains("configuration reload rejected") }, "\(daemon.stderr)")
        let line = Self.logLine(daemon.stderr, "configuration reload rejected") ?? ""
        #expect(line.contains("ping_group_range") && line.contains("CAP_NET_RAW"), "names both fixes: \(line)")
        usleep(300_000)
        #expect(daemon.process.isRunning, "the daemon keeps running on its previous configuration")
        let metrics = Probe.curl(nsExec, metricsPort, "/metrics")?.body ?? ""
        #expect(metric(metrics, "udp_fanout_config_reloads_total", "result=\"rejected\"") == 1, "\(metrics)")
        #expect(!metrics.contains("udp_fanout_health_target_up{"), "health stays disabled")

        try Self.ip(["netns", "exec", namespace, "/usr/sbin/sysctl", "-q", "-w", "net.ipv4.ping_group_range=0 2147483647"])
        daemon.signal(SIGHUP)
        #expect(Probe.waitFor(seconds: 5) { daemon.stderr.contains("reload=true") }, "\(daemon.stderr)")
        #expect(Probe.waitFor(seconds: 5) { daemon.stderr.contains("ICMP probe socket opened") }, "\(daemon.stderr)")
        #expect(Self.logLine(daemon.stderr, "ICMP probe socket opened")?.contains("datagram") == true)
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
    }

    // MARK: helpers

    /// The udp-fanout binary on loopback with one userspace source_ip listener `u` over sinks on
    /// `ports`, each probed on its echo server's port (`health_port`), or on its own port when
    /// `echoes` is empty.
    struct Userspace {
        let daemon: Child
        let file: URL
        let bind: SocketAddress
        let metrics: SocketAddress
        let yaml: (String) -> String
    }

    static func userspace(ports: [UInt16], echoes: [EchoServer] = [], health: String) throws -> Userspace {
        let bind = SocketAddress("127.0.0.1:\(freePort())")!
        let metrics = SocketAddress("127.0.0.1:\(freePort())")!
        let yaml = { (health: String) -> String in
            """
            listeners:
              - name: u
                bind: "\(bind)"
                mode: userspace
                balancing: source_ip
                settings: {workers: 2, recv_buf_size: 8388608}
                downstream:
            \(ports.enumerated().map { "      - {name: d\($0.offset), address: \"127.0.0.1:\($0.element)\"\(echoes.isEmpty ? "" : ", health_port: \(echoes[$0.offset].address.port)")}" }.joined(separator: "\n"))
            \(health)
            metrics: {enabled: true, bind: "\(metrics)"}
            """
        }
        let file = try TCFixtures.write(yaml(health), "health-us")
        let daemon = try Child("udp-fanout", ["-c", file.path])
        let ready = Probe.waitFor(seconds: 10) { get(metrics, "/readyz")?.status == 200 }
        try #require(ready, "udp-fanout ready: \(daemon.stderr)")
        return Userspace(daemon: daemon, file: file, bind: bind, metrics: metrics, yaml: yaml)
    }

    /// Backend `namespace` answers ICMP echo or ignores it.
    static func icmp(_ topology: Topology, _ namespace: String, answer: Bool) throws {
        try topology.exec(namespace, ["/usr/sbin/sysctl", "-q", "-w", "net.ipv4.icmp_echo_ignore_all=\(answer ? 0 : 1)"])
    }

    /// `/readyz` of the daemon in the proxy namespace.
    static func readyz(_ topology: Topology) -> (status: Int, body: String)? {
        Probe.curl(topology.prefix(topology.proxy), 9464, "/readyz")
    }

    /// GET on the host's loopback, nil when nothing answers yet.
    static func get(_ address: SocketAddress, _ path: String) -> (status: Int, body: String)? {
        Probe.curl([], Int(address.port), path)
    }

    /// The first log line with `message` (and `containing`, if given).
    static func logLine(_ log: String, _ message: String, containing: String? = nil) -> String? {
        log.split(separator: "\n").first { $0.contains(message) && (containing == nil || $0.contains(containing!)) }.map(String.init)
    }

    /// Each source reached only the backends (numbered from 1) the table gives it in one of `phases`.
    static func expectOwners(_ reports: [[String: Any]], phases: [[Int]], movedExpected: Bool) throws {
        var reached: [String: Set<Int>] = [:]
        for (index, report) in reports.enumerated() {
            for source in report.object("sources").keys { reached[source, default: []].insert(index + 1) }
        }
        #expect(reached.count == 64, "64 sources seen: \(reached.count)")
        let sources = (10..<74).map { "198.18.0.\($0)" }
        func backends(_ numbers: [Int]) -> [Downstream] {
            numbers.map { Downstream(name: "b\($0)", address: SocketAddress("\(Topology.backendIPv4($0)):\(TCFixtures.port)")!) }
        }
        let owners = phases.map { phase in (phase, DaemonFixtures.owners(sources, backends(phase))) }
        var moved = 0
        for (source, backendsReached) in reached {
            let allowed = Set(owners.map { phase, owner in phase.first { owner[source]?.ip == IPAddress(Topology.backendIPv4($0))! } ?? 0 })
            #expect(backendsReached.isSubset(of: allowed), "source \(source) reached \(backendsReached.sorted()), the table allows \(allowed.sorted())")
            if backendsReached.count > 1 { moved += 1 }
        }
        if movedExpected { #expect(moved > 0 && moved < 64, "\(moved) sources moved") }
    }

    /// The exposition text is well formed: `promtool check metrics` when installed; always, each
    /// family has exactly one HELP and one TYPE line, before its samples, and every sample
    /// belongs to a declared family.
    static func checkExposition(_ text: String) throws {
        if FileManager.default.isExecutableFile(atPath: "/usr/bin/promtool") {
            let file = FileManager.default.temporaryDirectory.appendingPathComponent("metrics-\(UUID().uuidString).txt")
            try text.write(to: file, atomically: true, encoding: .utf8)
            defer { try? FileManager.default.removeItem(at: file) }
            let result = try TestSupport.run("/bin/sh", ["-c", "/usr/bin/promtool check metrics < \(file.path)"])
            #expect(result.status == 0, "promtool: \(result.output)")
        }
        var help: [String: Int] = [:]
        var type: [String: String] = [:]
        var typeCount: [String: Int] = [:]
        for line in text.split(separator: "\n") {
            let words = line.split(separator: " ", maxSplits: 3)
            if line.hasPrefix("# HELP "), words.count >= 3 {
                help[String(words[2]), default: 0] += 1
            } else if line.hasPrefix("# TYPE "), words.count >= 4 {
                typeCount[String(words[2]), default: 0] += 1
                type[String(words[2])] = String(words[3])
            } else if !line.hasPrefix("#") {
                let name = String(line.prefix { $0 != "{" && $0 != " " })
                var family = name
                for suffix in ["_sum", "_count", "_bucket"] where name.hasSuffix(suffix) {
                    let base = String(name.dropLast(suffix.count))
                    if ["summary", "histogram"].contains(type[base]) { family = base }
                }
                #expect(type[family] != nil && help[family] != nil, "sample \(line) has no HELP/TYPE before it")
            }
        }
        for (family, count) in typeCount { #expect(count == 1 && help[family] == 1, "\(family): \(count) TYPE, \(help[family] ?? 0) HELP lines") }
        for family in help.keys { #expect(typeCount[family] == 1, "\(family) has HELP but no TYPE") }
    }

    static func ip(_ arguments: [String]) throws {
        let result = try TestSupport.run("/usr/sbin/ip", arguments)
        try #require(result.status == 0, "ip \(arguments.joined(separator: " ")): \(result.output)")
    }
}
