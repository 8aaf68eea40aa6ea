// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
@testable import FanoutCore
import ReusePortLB
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// DNS discovery through the udp-fanout binary: the daemon runs under `ip netns exec` in a
/// namespace the test makes, so it reads /etc/netns/<ns>/resolv.conf, which names a dnsmasq
/// inside that namespace serving a hosts file the test edits. Collectors, the publisher and the
/// metrics endpoint live in the same namespace (127.0.0.0/8 there is the namespace's own).
@Suite("DNSEndToEnd", .serialized)
struct DNSEndToEndTests {
    static let name = "sinks.fanout.test"

    /// `hosts` lines giving `name` the addresses 127.0.0.<n> for each n.
    static func hosts(_ numbers: [Int]) -> [String] { numbers.map { "127.0.0.\($0) \(name)" } }

    /// The config: one userspace source_ip listener whose one downstream entry is the name.
    static func config(port: UInt16, interval: Int) -> String {
        """
        listeners:
          - name: d
            bind: "127.0.0.1:5514"
            balancing: source_ip
            settings: {resolve_interval_secs: \(interval), workers: 2, recv_buf_size: 8388608}
            downstream:
              - {name: sinks, address: "\(name):\(port)"}
        metrics: {enabled: true, bind: "127.0.0.1:9464"}
        """
    }

    @Test("records changed, then the server stopped and restarted with new records, under 20k pps: nothing lost, each source only where the table sends it",
          .enabled(if: Privileges.enabled, Privileges.reason))
    func changesUnderLoad() async throws {
        let rig = try DNSNamespace()
        defer { rig.destroy() }
        let port = freePort()
        // Phases of the name's addresses (last octets): 12 removed and 14 added; then, after the
        // server was down, 13 removed and 12 back.
        let phases = [[11, 12, 13], [11, 13, 14], [11, 12, 14]]
        try rig.startServer(ttl: 1, hosts: Self.hosts(phases[0]))
        // Sinks and senders made inside the namespace (sockets stay in the namespace they were
        // made in). The userspace mode forwards from its own address, so the payload names the
        // source (`s-<index>-<round>`). Each sink is read during the run: 128k datagrams would
        // overflow a socket buffer read only at the end.
        let made = inNetworkNamespace(rig.namespace) { () -> ([Sink], SourcePool)? in
            guard let sinks = try? (11...14).map({ try Sink(ip: "127.0.0.\($0)", port: port) }), let pool = try? SourcePool(64) else { return nil }
            return (sinks, pool)
        }
        let (sinks, pool) = try #require(made ?? nil, "sinks and sources in \(rig.namespace)")
        let readers = sinks.map { SinkReader($0) }
        let daemon = try rig.daemon(Self.config(port: port, interval: 2))
        try daemon.waitFor("listener downstream set changed")
        try await rig.eventually("ready") { rig.get("/readyz").code == 200 }

        let rounds = 3000  // 9.6 s at 20k pps: the three phases take about 7 s
        let trafficDone = DoneFlag()
        let traffic = OSThread(name: "dns-traffic") {
            _ = try? pool.send(to: SocketAddress("127.0.0.1:5514")!, rounds: 0..<rounds, rate: 20_000)
            trafficDone.set()
        }
        try await Task.sleep(for: .seconds(1))
        // 1. Records changed (SIGHUP): seen within about the TTL.
        try rig.server?.replaceHosts(Self.hosts(phases[1]))
        try await rig.eventually("second set applied") { daemon.count("listener downstream set changed") >= 2 }
        let change = daemon.lines("listener downstream set changed").last ?? ""
        #expect(change.contains("127.0.0.14:\(port)") && change.contains("127.0.0.12:\(port)"), "\(change)")
        #expect(rig.metric("udp_fanout_dns_addresses", "listener=\"d\",name=\"\(Self.name)\"") == 3)
        try await Task.sleep(for: .seconds(1))
        // 2. The server stopped: the last good set keeps forwarding; the failure is logged and counted.
        rig.stopServer()
        try await rig.eventually("failure logged") { daemon.count("DNS resolution failed, keeping the last good set") >= 1 }
        let failures = rig.metric("udp_fanout_dns_resolutions_total", "listener=\"d\",name=\"\(Self.name)\",result=\"unreachable\"") ?? 0
        #expect(failures >= 1, "\(rig.get("/metrics").body)")
        #expect(daemon.lines("DNS resolution failed").last?.contains("kept=3") == true, "\(daemon.lines("DNS resolution failed"))")
        #expect(daemon.count("listener downstream set changed") == 2, "a failure changed the set: \(daemon.stderr)")
        try await Task.sleep(for: .seconds(1))
        // 3. Restarted with other records: picked up.
        try rig.startServer(ttl: 1, hosts: Self.hosts(phases[2]))
        try await rig.eventually("third set applied") { daemon.count("listener downstream set changed") >= 3 }
        #expect(!trafficDone.isSet, "the last set was applied after the traffic ended: the run is too short to test it")
        traffic.join()
        let perSink = readers.map { $0.stop() }
        let metrics = rig.get("/metrics").body

        let total = 64 * rounds
        let received = perSink.map(\.count)
        #expect(received.reduce(0, +) == total, "per sink \(received); daemon: \(metrics)")
        var reached: [String: Set<Int>] = [:]
        for (index, datagrams) in perSink.enumerated() {
            for datagram in datagrams {
                let parts = String(decoding: datagram, as: UTF8.self).split(separator: "-")
                guard parts.count == 3, let source = Int(parts[1]) else { continue }
                reached[pool.sources[source], default: []].insert(11 + index)
            }
        }
        #expect(reached.count == 64)
        let sources = Array(reached.keys)
        let owners = phases.map { phase in
            (phase, DaemonFixtures.owners(sources, phase.map {
                Downstream(name: "sinks/127.0.0.\($0)", address: SocketAddress("127.0.0.\($0):\(port)")!)
            }))
        }
        var moved = 0
        for (source, numbers) in reached {
            let allowed = Set(owners.compactMap { phase, owner in phase.first { owner[source] == SocketAddress("127.0.0.\($0):\(port)")! } })
            #expect(numbers.isSubset(of: allowed), "source \(source) reached \(numbers.sorted()), the table allows \(allowed.sorted())")
            if numbers.count > 1 { moved += 1 }
        }
        #expect(moved > 0 && moved < 64, "\(moved) of 64 sources moved")
        #expect(received[3] > 0, "the added address served: \(received)")
        #expect(metric(metrics, "udp_fanout_dns_addresses", "listener=\"d\",name=\"\(Self.name)\"") == 3, "\(metrics)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0, "\(daemon.stderr)")
    }

    @Test("/readyz: 503 naming the listener, the name and the NXDOMAIN while the name does not resolve; 200 once it does",
          .enabled(if: Privileges.enabled, Privileges.reason))
    func readinessWhileTheNameDoesNotResolve() async throws {
        let rig = try DNSNamespace()
        defer { rig.destroy() }
        let port = freePort()
        try rig.startServer(ttl: 1, hosts: ["127.0.0.99 other.fanout.test"])
        let daemon = try rig.daemon(Self.config(port: port, interval: 2))
        try daemon.waitFor("DNS resolution failed, keeping the last good set")
        try await rig.eventually("503 with the error") {
            let ready = rig.get("/readyz")
            return ready.code == 503 && ready.body.contains("NXDOMAIN")
        }
        let ready = rig.get("/readyz")
        #expect(ready.code == 503)
        #expect(ready.body.contains("listener 'd'") && ready.body.contains("waiting for the first resolution of \(Self.name)"), "\(ready.body)")
        #expect(ready.body.contains("resolving '\(Self.name)': no such name (NXDOMAIN)"), "\(ready.body)")
        #expect((rig.metric("udp_fanout_dns_resolutions_total", "listener=\"d\",name=\"\(Self.name)\",result=\"nxdomain\"") ?? 0) >= 1)

        try rig.server?.replaceHosts(Self.hosts([11]))
        try await rig.eventually("200 after the fix") { rig.get("/readyz").code == 200 }
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0, "\(daemon.stderr)")
    }

    /// Seconds from a record change (dnsmasq reread its hosts file) until the daemon applied it.
    func secondsToSeeAChange(ttl: Int, interval: Int) async throws -> Double {
        let rig = try DNSNamespace()
        defer { rig.destroy() }
        let port = freePort()
        try rig.startServer(ttl: ttl, hosts: Self.hosts([11]))
        let daemon = try rig.daemon(Self.config(port: port, interval: interval))
        try daemon.waitFor("listener downstream set changed")
        #expect(rig.metric("udp_fanout_dns_ttl_seconds", "listener=\"d\",name=\"\(Self.name)\"") == ttl)
        // Half a period in, so the change does not land just before a scheduled resolution.
        try await Task.sleep(for: .milliseconds(500))
        try rig.server?.replaceHosts(Self.hosts([12]))
        let changed = ContinuousClock.now
        try await rig.eventually("change applied", seconds: 40) { daemon.count("listener downstream set changed") >= 2 }
        let elapsed = ContinuousClock.now - changed
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0, "\(daemon.stderr)")
        return Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18
    }

    @Test("a TTL of 1 s is honoured although resolve_interval_secs is 30", .enabled(if: Privileges.enabled, Privileges.reason))
    func shortTTLIsHonoured() async throws {
        let seconds = try await secondsToSeeAChange(ttl: 1, interval: 30)
        #expect(seconds < 2.5, "the change took \(seconds) s with a TTL of 1 s")
    }

    @Test("a TTL of 3600 s is capped at resolve_interval_secs 2", .enabled(if: Privileges.enabled, Privileges.reason))
    func longTTLIsCappedAtTheInterval() async throws {
        let seconds = try await secondsToSeeAChange(ttl: 3600, interval: 2)
        #expect(seconds < 3.5, "the change took \(seconds) s with resolve_interval_secs 2")
    }
}

/// A network namespace with lo up, a resolv.conf naming 127.0.0.1 in /etc/netns/<ns>, and a
/// dnsmasq there; children started with `prefix` run inside. `destroy()` stops dnsmasq by its
/// PID and removes the directory and the namespace.
final class DNSNamespace {
    let namespace = "fdnse\(UInt32.random(in: 0...UInt32.max))"
    let directory: URL
    private(set) var server: DNSServer?
    private var daemons: [Child] = []
    private var configFiles: [URL] = []

    init() throws {
        directory = URL(fileURLWithPath: "/etc/netns/\(namespace)")
        try #require(try run("/usr/sbin/ip", ["netns", "add", namespace]).status == 0)
        do {
            try #require(try run("/usr/sbin/ip", ["-n", namespace, "link", "set", "lo", "up"]).status == 0)
            try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
            // One attempt of 1 s: the server is local, more would only slow the failure cases.
            try "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n".write(
                to: directory.appendingPathComponent("resolv.conf"), atomically: true, encoding: .utf8)
        } catch {
            destroy()
            throw error
        }
    }

    var prefix: [String] { ["/usr/sbin/ip", "netns", "exec", namespace] }

    func startServer(ttl: Int, hosts: [String]) throws {
        server?.stop()
        server = try DNSServer(ttl: ttl, hosts: hosts, namespace: namespace)
    }

    func stopServer() {
        server?.stop()
        server = nil
    }

    /// The udp-fanout binary inside the namespace on `yaml` (written to a file in the directory).
    func daemon(_ yaml: String) throws -> Child {
        // Not in /etc/netns/<ns>: ip netns exec bind-mounts every file there over /etc.
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("\(namespace)-udp-fanout-\(daemons.count).yaml")
        configFiles.append(file)
        try yaml.write(to: file, atomically: true, encoding: .utf8)
        let child = try Child("udp-fanout", ["-c", file.path], prefix: prefix)
        daemons.append(child)
        return child
    }

    @discardableResult
    func exec(_ arguments: [String]) throws -> String {
        try run("/usr/sbin/ip", ["netns", "exec", namespace] + arguments).output
    }

    /// GET on the metrics endpoint inside the namespace: (status, body); (0, error) if curl failed.
    func get(_ path: String) -> (code: Int, body: String) {
        guard let output = try? exec(["curl", "-s", "-w", "\n%{http_code}", "http://127.0.0.1:9464\(path)"]) else { return (0, "curl failed") }
        let lines = output.split(separator: "\n", omittingEmptySubsequences: false)
        return (Int(lines.last ?? "") ?? 0, lines.dropLast().joined(separator: "\n"))
    }

    func metric(_ name: String, _ labels: String) -> Int? { FanoutTests.metric(get("/metrics").body, name, labels) }

    /// Waits (at most `seconds`) until `condition` holds; records an issue naming `what` if not.
    func eventually(_ what: String, seconds: Int = 10, _ condition: () -> Bool) async throws {
        let deadline = ContinuousClock.now + .seconds(seconds)
        while !condition() {
            guard ContinuousClock.now < deadline else {
                Issue.record("\(what): not within \(seconds) s; daemon: \(daemons.last?.stderr ?? "")")
                throw CancellationError()
            }
            try await Task.sleep(for: .milliseconds(50))
        }
    }

    /// Stops the daemons (by PID) and dnsmasq, removes the resolv.conf directory and the namespace.
    func destroy() {
        for daemon in daemons where daemon.process.isRunning {
            daemon.signal(SIGTERM)
            daemon.wait()
        }
        stopServer()
        for file in configFiles { try? FileManager.default.removeItem(at: file) }
        try? FileManager.default.removeItem(at: directory)
        _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace])
    }
}

extension Child {
    /// The stderr lines containing `text`.
    func lines(_ text: String) -> [String] { stderr.split(separator: "\n").filter { $0.contains(text) }.map(String.init) }
    func count(_ text: String) -> Int { lines(text).count }
}

/// Reads one sink on a thread of its own until stopped, keeping every datagram.
final class SinkReader {
    private final class Shared: Sendable {
        let datagrams = Mutex<[[UInt8]]>([])
        let stopped = Atomic<Bool>(false)
    }

    private let shared = Shared()
    private let thread: OSThread

    init(_ sink: Sink) {
        let shared = shared
        thread = OSThread(name: "dns-sink") {
            // Bounded: after stop, the first quiet 300 ms ends it.
            while true {
                let got = sink.drain(quiet: .milliseconds(300))
                shared.datagrams.withLock { $0 += got }
                if got.isEmpty && shared.stopped.load(ordering: .acquiring) { return }
            }
        }
    }

    /// Stops after the sink has been quiet for 300 ms; every datagram it received.
    func stop() -> [[UInt8]] {
        shared.stopped.store(true, ordering: .releasing)
        thread.join()
        return shared.datagrams.withLock { $0 }
    }
}

/// Set once by a thread, read by the test.
final class DoneFlag: Sendable {
    private let value = Atomic<Bool>(false)
    func set() { value.store(true, ordering: .releasing) }
    var isSet: Bool { value.load(ordering: .acquiring) }
}
