// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import Foundation
import Logging
import Testing
import TestSupport
@testable import FanoutCore
import CSystemShim
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// Paced traffic from many loopback source addresses, one socket each: datagram `s-<source>-<n>`.
final class SourcePool: Sendable {
    let sources: [String]
    private let sockets: [Int32]

    init(_ count: Int) throws {
        sources = loopbackSources(count, base: 20)
        sockets = try sources.map { source in
            let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
            try #require(SocketAddress(ip: IPAddress(source)!, port: 0).withSockAddr { bind(fd, $0, $1) } == 0)
            return fd
        }
    }

    deinit { for fd in sockets { close(fd) } }

    /// Sends `rounds` rounds (one datagram per source each) at about `rate` datagrams a second,
    /// calling `between(round)` before each round. Returns the datagrams sent.
    @discardableResult
    func send(to destination: SocketAddress, rounds: Range<Int>, rate: Int, between: (Int) -> Void = { _ in }) throws -> Int {
        let start = ContinuousClock.now
        var sent = 0
        let total = Double(rounds.count * sources.count)
        for round in rounds {
            between(round)
            for (index, fd) in sockets.enumerated() {
                var payload = Array("s-\(index)-\(round)".utf8)
                try #require(destination.withSockAddr { sendto(fd, &payload, payload.count, 0, $0, $1) } == payload.count)
                sent += 1
            }
            // Pace: never ahead of the rate (bounded: the loop ends with the rounds).
            let due = start + .seconds(Double(sent) / Double(rate))
            if ContinuousClock.now < due { try? sleepUntil(due) }
            _ = total
        }
        return sent
    }

    /// Which sinks each source's datagrams reached, and how many arrived in all.
    static func spread(_ sinks: [Sink]) -> (bySource: [Int: Set<Int>], received: Int, perSink: [Int]) {
        var bySource: [Int: Set<Int>] = [:]
        var received = 0
        var perSink: [Int] = []
        for (sinkIndex, sink) in sinks.enumerated() {
            let datagrams = sink.drain()
            perSink.append(datagrams.count)
            for datagram in datagrams {
                let parts = String(decoding: datagram, as: UTF8.self).split(separator: "-")
                guard parts.count == 3, parts[0] == "s", let source = Int(parts[1]) else { continue }
                bySource[source, default: []].insert(sinkIndex)
                received += 1
            }
        }
        return (bySource, received, perSink)
    }
}

private func sleepUntil(_ instant: ContinuousClock.Instant) throws {
    let left = instant - ContinuousClock.now
    if left > .zero { usleep(UInt32(left.components.seconds * 1_000_000 + left.components.attoseconds / 1_000_000_000_000)) }
}

/// The membership path in a running userspace listener, driven the way discovery and health
/// drive it (the watchers and probes have suites of their own): only the changed downstreams'
/// sources move, and nothing is lost while the set changes under load.
@Suite("MembershipPath", .serialized)
struct MembershipPathTests {
    static func start(_ yaml: String) throws -> FanoutDaemon { try startDaemon(yaml, waitReady: false) }

    static func endpoints(_ sinks: [Sink]) -> [Downstream] {
        sinks.map { Downstream(name: "pod-\($0.address.port)", address: $0.address) }
    }

    @Test("Kubernetes endpoints added and removed under 20k pps: nothing lost, only their sources move; not ready until the first list")
    func discoveryUnderLoad() throws {
        let sinks = try (0..<4).map { _ in try Sink() }
        let port = freePort()
        let bind = SocketAddress("127.0.0.1:\(port)")!
        let daemon = try Self.start("""
            listeners:
              - name: k
                bind: "\(bind)"
                balancing: source_ip
                kubernetes: {namespace: test, service: receivers, port: 5514}
                settings: {workers: 2, recv_buf_size: 8388608}
            """)
        defer { daemon.shutdown() }
        #expect(!daemon.isReady)
        #expect(daemon.readiness.joined().contains("waiting for the first EndpointSlice list of test/receivers"))
        let spec = DiscoverySpec(KubernetesSource(listener: "k", service: Kubernetes(namespace: "test", service: "receivers", port: 5514)))
        daemon.discovered(spec, Self.endpoints(Array(sinks[0..<3])))
        let deadline = ContinuousClock.now + .seconds(5)
        while !daemon.isReady && ContinuousClock.now < deadline { usleep(10_000) }
        #expect(daemon.isReady, "\(daemon.readiness)")

        // Phase 1: sinks 0, 1, 2. Phase 2: sink 1 gone, sink 3 added. Phase 3: back to 0, 1, 2.
        let pool = try SourcePool(64)
        let sent = try pool.send(to: bind, rounds: 0..<300, rate: 20_000) { round in
            if round == 100 { daemon.discovered(spec, Self.endpoints([sinks[0], sinks[2], sinks[3]])) }
            if round == 200 { daemon.discovered(spec, Self.endpoints(Array(sinks[0..<3]))) }
        }
        let (bySource, received, perSink) = SourcePool.spread(sinks)
        let counters = try #require(daemon.counters(of: "k"))
        #expect(received == sent, "sent \(sent), received \(received) (per sink \(perSink)), no_healthy \(counters.noHealthy), dropped \(counters.dropped)")
        #expect(counters.noHealthy == 0 && counters.droppedTotal == 0)
        // Each source reached only the sinks the table gives it in the three phases (the same
        // function the tc_ebpf test checks against: one table in every mode).
        let phases = [[0, 1, 2], [0, 2, 3]].map { DaemonFixtures.owners(pool.sources, Self.endpoints($0.map { sinks[$0] })) }
        var moved = 0
        for (source, reached) in bySource {
            let allowed = Set(phases.map { phase in sinks.firstIndex { $0.address == phase[pool.sources[source]] }! })
            #expect(reached.isSubset(of: allowed), "source \(source) reached \(reached.sorted()), the table allows \(allowed.sorted())")
            if reached.count > 1 { moved += 1 }
        }
        #expect(moved > 0, "some sources were on the removed sink or went to the added one")
        #expect(bySource.values.filter { $0 == [0] || $0 == [2] }.count > 0, "others stayed where they were")
        let metrics = daemon.metricsText()
        #expect(metric(metrics, "udp_fanout_downstreams", "listener=\"k\",source=\"kubernetes\"") == 3)
    }

    @Test("health: a down downstream's sources move to the others and come back; all down is no_healthy and not ready")
    func healthUnderLoad() throws {
        let sinks = try (0..<3).map { _ in try Sink() }
        let port = freePort()
        let bind = SocketAddress("127.0.0.1:\(port)")!
        let yaml = """
            listeners:
              - name: h
                bind: "\(bind)"
                balancing: source_ip
                settings: {workers: 2, recv_buf_size: 8388608}
                downstream:
            \(sinks.enumerated().map { "      - {name: s\($0.offset), address: \"\($0.element.address)\"}" }.joined(separator: "\n"))
            health: {enabled: true, protocol: udp_echo, interval_secs: 60, timeout_secs: 1}
            """
        let daemon = try Self.start(yaml)
        defer { daemon.shutdown() }
        let pool = try SourcePool(48)
        // Before: where each source goes with all three.
        try pool.send(to: bind, rounds: 0..<20, rate: 20_000)
        let before = SourcePool.spread(sinks).bySource
        #expect(before.count == 48 && before.values.allSatisfy { $0.count == 1 })
        // Sink 1 down: its sources move, nobody else's.
        daemon.healthChanged(sinks[1].address, up: false)
        try pool.send(to: bind, rounds: 20..<40, rate: 20_000)
        let during = SourcePool.spread(sinks)
        #expect(during.received == 20 * 48)
        for (source, reached) in during.bySource {
            #expect(!reached.contains(1))
            if before[source] != [1] { #expect(reached == before[source]!, "source \(source) moved though its sink stayed up") }
        }
        #expect(metric(daemon.metricsText(), "udp_fanout_downstream_up", "listener=\"h\",downstream=\"s1\",address=\"\(sinks[1].address)\"") == 0)
        // Back up: every source where it was.
        daemon.healthChanged(sinks[1].address, up: true)
        try pool.send(to: bind, rounds: 40..<60, rate: 20_000)
        #expect(SourcePool.spread(sinks).bySource == before)
        // All down: dropped and counted, /readyz says which listener.
        for sink in sinks { daemon.healthChanged(sink.address, up: false) }
        try pool.send(to: bind, rounds: 60..<62, rate: 20_000)
        let deadline = ContinuousClock.now + .seconds(2)
        while (daemon.counters(of: "h")?.noHealthy ?? 0) < 96 && ContinuousClock.now < deadline { usleep(10_000) }
        #expect(daemon.counters(of: "h")?.noHealthy == 96)
        #expect(daemon.readiness.joined().contains("listener 'h' has no healthy downstream"))
        #expect(SourcePool.spread(sinks).received == 0)
        // A reload that turns health off puts every member back at once, where it was.
        #expect(daemon.reload(text: yaml.replacingOccurrences(of: "enabled: true", with: "enabled: false")))
        try pool.send(to: bind, rounds: 62..<82, rate: 20_000)
        #expect(SourcePool.spread(sinks).bySource == before)
        #expect(daemon.isReady, "\(daemon.readiness)")
    }

    @Test("tc_ebpf: endpoints replaced and a backend down and up under 20k pps: nothing lost, each source only at the backends the table gives it",
          .enabled(if: Privileges.enabled, Privileges.reason))
    func tcUnderLoad() throws {
        let topology = try Topology(backends: 4)
        defer { topology.destroy() }
        try TCFixtures.addClientSources(topology)
        let collectors = try TCFixtures.collectors(topology)
        let port = TCFixtures.port
        let daemon = try DaemonFixtures.startInProxy(topology, """
            listeners:
              - name: tc
                bind: "198.18.0.1:5514"
                interface: \(topology.proxyInterface)
                mode: tc_ebpf
                balancing: source_ip
                kubernetes: {namespace: test, service: receivers, port: \(port)}
            health: {enabled: true, protocol: icmp, interval_secs: 60, timeout_secs: 1}
            """)
        defer { DaemonFixtures.stopInProxy(topology, daemon) }
        let spec = DiscoverySpec(KubernetesSource(listener: "tc", service: Kubernetes(namespace: "test", service: "receivers", port: UInt16(port))))
        func backends(_ numbers: [Int]) -> [Downstream] {
            numbers.map { Downstream(name: "b\($0)", address: SocketAddress("\(Topology.backendIPv4($0)):\(port)")!) }
        }
        daemon.discovered(spec, backends([1, 2, 3]))
        #expect(daemon.isReady, "\(daemon.readiness)")
        // Phases: {1,2,3}; endpoint 2 deleted and 4 added: {1,3,4}; 3 down: {1,4}; 3 back: {1,3,4}.
        let phases = [[1, 2, 3], [1, 3, 4], [1, 4], [1, 3, 4]]
        let total = 64_000
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "\(total)", "--sources", "198.18.0.10-198.18.0.73", "--rate", "20000"],
                                  prefix: topology.prefix(topology.client))
        usleep(700_000)
        daemon.discovered(spec, backends([1, 3, 4]))
        usleep(700_000)
        daemon.healthChanged(SocketAddress("\(Topology.backendIPv4(3)):\(port)")!, up: false)
        usleep(700_000)
        daemon.healthChanged(SocketAddress("\(Topology.backendIPv4(3)):\(port)")!, up: true)
        #expect(publisher.wait() == 0, "\(publisher.stderr)")
        usleep(300_000)
        let counters = try #require(daemon.counters(of: "tc"))
        let reports = try collectors.map { try $0.stop() }
        let received = TCFixtures.received(reports)
        #expect(received.reduce(0, +) == total, "per backend \(received); no_healthy \(counters.noHealthy), dropped \(counters.dropped)")
        #expect(counters.noHealthy == 0)
        var reached: [String: Set<Int>] = [:]
        for (index, report) in reports.enumerated() {
            for source in report.object("sources").keys { reached[source, default: []].insert(index + 1) }
        }
        #expect(reached.count == 64)
        let sources = (10..<74).map { "198.18.0.\($0)" }
        let owners = phases.map { phase in (phase, DaemonFixtures.owners(sources, backends(phase))) }
        var moved = 0
        for (source, backendsReached) in reached {
            let allowed = Set(owners.map { phase, owner in
                phase.first { owner[source]?.ip == IPAddress(Topology.backendIPv4($0))! } ?? 0
            })
            #expect(backendsReached.isSubset(of: allowed), "source \(source) reached \(backendsReached.sorted()), the table allows \(allowed.sorted())")
            if backendsReached.count > 1 { moved += 1 }
        }
        #expect(moved > 0 && moved < 64, "\(moved) sources moved")
        #expect(received[1] > 0 && received[3] > 0, "the removed and the added backend both served: \(received)")
        // Backend 2 served only the first phase (about 0.7 s of 3.2 s), not its sources' share of the whole run.
        let share = owners[0].1.values.filter { $0.ip == IPAddress(Topology.backendIPv4(2))! }.count
        #expect(Double(received[1]) < Double(total * share / 64) * 0.9, "backend 2 stopped receiving when its endpoint went: \(received), its sources \(share) of 64")
    }

    @Test("a reload to another Service keeps the old endpoints until the new list; the old watcher's late answers are ignored; static entries join")
    func reloadKeepsDiscovered() throws {
        let sinks = try (0..<3).map { _ in try Sink() }
        let bind = SocketAddress("127.0.0.1:\(freePort())")!
        func yaml(_ service: String, static extra: Sink? = nil) -> String {
            """
            listeners:
              - name: r
                bind: "\(bind)"
                kubernetes: {namespace: test, service: \(service), port: 5514}
                settings: {workers: 1}
            \(extra.map { "    downstream: [{name: fixed, address: \"\($0.address)\"}]" } ?? "")
            """
        }
        let daemon = try Self.start(yaml("old"))
        defer { daemon.shutdown() }
        let old = DiscoverySpec(KubernetesSource(listener: "r", service: Kubernetes(namespace: "test", service: "old", port: 5514)))
        let new = DiscoverySpec(KubernetesSource(listener: "r", service: Kubernetes(namespace: "test", service: "new", port: 5514)))
        daemon.discovered(old, Self.endpoints([sinks[0]]))
        #expect(daemon.reload(text: yaml("new")))
        // Still ready and forwarding to the old Service's endpoint until the new one lists.
        let deadline = ContinuousClock.now + .seconds(5)
        while !daemon.isReady && ContinuousClock.now < deadline { usleep(10_000) }
        #expect(daemon.isReady, "\(daemon.readiness)")
        try sendNumbered(to: bind, count: 10)
        #expect(sinks[0].drain().count == 10)
        daemon.discovered(old, Self.endpoints([sinks[2]]))
        try sendNumbered(to: bind, count: 10)
        #expect(sinks[0].drain().count == 10 && sinks[2].drain().isEmpty, "a watcher of the old configuration changes nothing")
        daemon.discovered(new, Self.endpoints([sinks[1]]))
        try sendNumbered(to: bind, count: 10)
        #expect(sinks[1].drain().count == 10 && sinks[0].drain().isEmpty)
        // A static entry added by reload joins the discovered one.
        #expect(daemon.reload(text: yaml("new", static: sinks[2])))
        try sendNumbered(to: bind, count: 10)
        #expect(sinks[1].drain().count == 5 && sinks[2].drain().count == 5)
    }
}
