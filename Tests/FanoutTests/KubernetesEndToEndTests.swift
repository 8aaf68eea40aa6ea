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

/// Kubernetes discovery through the daemon: the DiscoveryService's EndpointSlice watcher against
/// the test API server (real HTTPS, token, list + watch, bookmarks, 410), while traffic flows
/// through a userspace and a tc_ebpf listener. Endpoints are added, made not ready, moved
/// between slices, deleted; the watch is dropped and expired meanwhile. Nothing is lost, and
/// each source reaches only the downstreams the table gives it for the sets it lived through.
@Suite("KubernetesEndToEnd", .serialized)
struct KubernetesEndToEndTests {
    /// The endpoint sets the scenario goes through, as endpoint numbers (0-based).
    static let phases: [[Int]] = [[0, 1, 2], [0, 2], [0, 2, 3], [0, 1, 2, 3], [0, 1]]

    /// Drives the API server through the phases, waiting after each until the listener applied
    /// the set. `address(n)` is endpoint n's IP.
    static func scenario(_ server: KubernetesAPIServer, daemon: FanoutDaemon, listener: String, address: @escaping @Sendable (Int) -> String) async throws {
        func endpoint(_ n: Int, ready: Bool? = true) -> KubernetesAPIServer.Endpoint {
            .init(address: address(n), ready: ready, pod: "pod-\(n)")
        }
        let applied: @Sendable () -> Set<String> = {
            Set(daemon.state.withLock { $0.applied[listener] ?? [] }.map { $0.address.ip.description })
        }
        func reach(_ numbers: [Int]) async -> Bool {
            let wanted = Set(numbers.map(address))
            return await server.eventually(10) { applied() == wanted }
        }
        try await Task.sleep(for: .milliseconds(400))
        // 1. Endpoint 1 not ready.
        server.setReady(slice: "recv-a", address: address(1), false)
        #expect(await reach(phases[1]), "not ready left: \(applied())")
        try await Task.sleep(for: .milliseconds(400))
        // 2. A second slice with endpoint 3; the watch dropped mid-stream, then endpoint 2 moves
        //    from slice a to slice b (the set does not change).
        server.apply(.init(name: "recv-b", namespace: "test", service: "receivers", endpoints: [endpoint(3)]))
        #expect(await reach(phases[2]), "added: \(applied())")
        server.dropWatches()
        server.apply(.init(name: "recv-b", namespace: "test", service: "receivers", endpoints: [endpoint(2), endpoint(3)]))
        server.apply(.init(name: "recv-a", namespace: "test", service: "receivers", endpoints: [endpoint(0), endpoint(1, ready: false)]))
        server.sendBookmark()
        try await Task.sleep(for: .milliseconds(400))
        #expect(applied() == Set(phases[2].map(address)), "a split changes nothing: \(applied())")
        // 3. History expired (410 on the next watch) while endpoint 1 becomes ready again: relist.
        server.expireHistory()
        server.setReady(slice: "recv-a", address: address(1), true)
        #expect(await reach(phases[3]), "relisted: \(applied())")
        try await Task.sleep(for: .milliseconds(400))
        // 4. Slice b deleted: endpoints 2 and 3 go.
        server.delete("recv-b")
        #expect(await reach(phases[4]), "deleted: \(applied())")
        try await Task.sleep(for: .milliseconds(400))
    }

    /// Runs the DiscoveryService of `daemon` (credentials from `kubeconfig`) during `body`.
    static func withDiscovery<T: Sendable>(_ daemon: FanoutDaemon, kubeconfig: String, _ body: () async throws -> T) async throws -> T {
        let service = DiscoveryService(daemon: daemon, environment: ["KUBECONFIG": kubeconfig], serviceAccountDirectory: "/nonexistent")
        let task = Task { try await service.run() }
        defer { task.cancel() }
        let result = try await body()
        task.cancel()
        _ = try? await task.value
        return result
    }

    /// Each source's reached set must be within what the table gives it in the phases.
    static func expectOnlyTableMoves(_ reached: [String: Set<Int>], address: (Int) -> String, port: UInt16) {
        let sources = Array(reached.keys)
        let owners = phases.map { phase in
            (phase, DaemonFixtures.owners(sources, phase.map { Downstream(name: "pod-\($0)", address: SocketAddress("\(address($0)):\(port)")!) }))
        }
        var moved = 0
        for (source, endpoints) in reached {
            let allowed = Set(owners.compactMap { phase, owner in phase.first { owner[source]?.ip.description == address($0) } })
            #expect(endpoints.isSubset(of: allowed), "source \(source) reached \(endpoints.sorted()), the table allows \(allowed.sorted())")
            if endpoints.count > 1 { moved += 1 }
        }
        #expect(moved > 0 && moved < reached.count, "\(moved) of \(reached.count) sources moved")
    }

    @Test("userspace: endpoints not ready, added, split, relisted after 410, deleted under 20k pps: nothing lost, only their sources move")
    func userspace() async throws {
        let port = freePort()
        let sinks = try (0..<4).map { try Sink(ip: "127.0.0.\(51 + $0)", port: port) }
        let bind = SocketAddress("127.0.0.1:\(freePort())")!
        try await KubernetesAPIServer.with { server in
            server.apply(.init(name: "recv-a", namespace: "test", service: "receivers", endpoints: (0..<3).map {
                .init(address: "127.0.0.\(51 + $0)", pod: "pod-\($0)")
            }))
            let kubeconfig = try server.writeKubeconfig(namespace: "test")
            let config = try ConfigParser.parse("""
                listeners:
                  - name: k
                    bind: "\(bind)"
                    balancing: source_ip
                    kubernetes: {service: receivers, port: \(port)}
                    settings: {workers: 2, recv_buf_size: 8388608}
                """)
            try config.validate()
            let daemon = FanoutDaemon(config: config, configPath: nil, logger: Logger(label: "k8s-e2e") { _ in SwiftLogNoOpLogHandler() })
            try daemon.start()
            defer { daemon.shutdown() }
            #expect(!daemon.isReady)
            let pool = try SourcePool(64)
            let sent = try await Self.withDiscovery(daemon, kubeconfig: kubeconfig) {
                #expect(await server.eventually { daemon.isReady }, "\(daemon.readiness)")
                // Traffic on a thread of its own while the API server changes.
                let traffic = OSThread(name: "k8s-traffic") {
                    _ = try? pool.send(to: bind, rounds: 0..<1000, rate: 20_000)
                }
                try await Self.scenario(server, daemon: daemon, listener: "k", address: { "127.0.0.\(51 + $0)" })
                traffic.join()
                // The watcher's families, while it runs: the drop and the 410 were counted.
                let metrics = daemon.metricsText()
                #expect(metrics.contains("udp_fanout_discovery_watch_restarts_total{"), "\(metrics)")
                return 64 * 1000
            }
            let (bySource, received, perSink) = SourcePool.spread(sinks)
            let counters = try #require(daemon.counters(of: "k"))
            #expect(received == sent, "sent \(sent), received \(received) per sink \(perSink); no_healthy \(counters.noHealthy), dropped \(counters.dropped)")
            var reached: [String: Set<Int>] = [:]
            for (source, endpoints) in bySource { reached[pool.sources[source]] = endpoints }
            Self.expectOnlyTableMoves(reached, address: { "127.0.0.\(51 + $0)" }, port: port)
        }
    }

    @Test("tc_ebpf: the same scenario through the kernel path, backends in namespaces, 20k pps: nothing lost, only their sources move",
          .enabled(if: Privileges.enabled, Privileges.reason))
    func tc() async throws {
        nonisolated(unsafe) let topology = try Topology(backends: 4)
        defer { topology.destroy() }
        try TCFixtures.addClientSources(topology)
        nonisolated(unsafe) let collectors = try TCFixtures.collectors(topology)
        let port = UInt16(TCFixtures.port)
        let address: @Sendable (Int) -> String = { Topology.backendIPv4($0 + 1) }
        try await KubernetesAPIServer.with { server in
            server.apply(.init(name: "recv-a", namespace: "test", service: "receivers", endpoints: (0..<3).map { .init(address: address($0), pod: "pod-\($0)") }))
            let kubeconfig = try server.writeKubeconfig(namespace: "test")
            let daemon = try DaemonFixtures.startInProxy(topology, """
                listeners:
                  - name: tc
                    bind: "198.18.0.1:5514"
                    interface: \(topology.proxyInterface)
                    mode: tc_ebpf
                    balancing: source_ip
                    kubernetes: {service: receivers, port: \(port)}
                """)
            defer { DaemonFixtures.stopInProxy(topology, daemon) }
            let total = 64_000
            try await Self.withDiscovery(daemon, kubeconfig: kubeconfig) {
                #expect(await server.eventually { daemon.isReady }, "\(daemon.readiness)")
                let publisher = try Child("publisher", ["198.18.0.1", "5514", "\(total)", "--sources", "198.18.0.10-198.18.0.73", "--rate", "20000"],
                                          prefix: topology.prefix(topology.client))
                try await Self.scenario(server, daemon: daemon, listener: "tc", address: address)
                #expect(publisher.wait() == 0, "\(publisher.stderr)")
            }
            usleep(300_000)
            let counters = try #require(daemon.counters(of: "tc"))
            let reports = try collectors.map { try $0.stop() }
            let received = TCFixtures.received(reports)
            #expect(received.reduce(0, +) == total, "per backend \(received); no_healthy \(counters.noHealthy), dropped \(counters.dropped)")
            var reached: [String: Set<Int>] = [:]
            for (index, report) in reports.enumerated() {
                for source in report.object("sources").keys { reached[source, default: []].insert(index) }
            }
            #expect(reached.count == 64)
            Self.expectOnlyTableMoves(reached, address: address, port: port)
        }
    }

    @Test("the udp-fanout binary with KUBECONFIG: the reference's log lines, /readyz 503 until the first list and with 0 endpoints, 200 after")
    func binary() async throws {
        let port = freePort()
        let sink = try Sink(ip: "127.0.0.61", port: port)
        let (bind, metricsPort) = (freePort(), freePort())
        try await KubernetesAPIServer.with { server in
            let kubeconfig = try server.writeKubeconfig(namespace: "test")
            let file = NSTemporaryDirectory() + "k8s-binary-\(UUID().uuidString).yaml"
            defer { try? FileManager.default.removeItem(atPath: file) }
            try """
                listeners:
                  - name: k
                    bind: "127.0.0.1:\(bind)"
                    kubernetes: {service: receivers, port: \(port)}
                metrics: {enabled: true, bind: "127.0.0.1:\(metricsPort)"}
                """.write(toFile: file, atomically: true, encoding: .utf8)
            let daemon = try Child("udp-fanout", ["-c", file], prefix: ["/usr/bin/env", "KUBECONFIG=\(kubeconfig)"])
            try daemon.waitFor("starting EndpointSlice watch")
            try daemon.waitFor("k8s discovery: 0 ready endpoints")
            let metrics = SocketAddress("127.0.0.1:\(metricsPort)")!
            #expect(await server.eventually {
                let empty = try? httpGet(metrics, "/readyz")
                return empty?.0 == 503 && empty?.1.contains("listener 'k' has no healthy downstream") == true
            }, "\(String(describing: try? httpGet(metrics, "/readyz")))")
            server.apply(.init(name: "recv-a", namespace: "test", service: "receivers", endpoints: [.init(address: "127.0.0.61", pod: "pod-0")]))
            #expect(await server.eventually { (try? httpGet(metrics, "/readyz").0) == 200 }, "\(daemon.stderr)")
            try sendNumbered(to: SocketAddress("127.0.0.1:\(bind)")!, count: 100)
            #expect(sink.drain().count == 100)
            let text = try httpGet(metrics, "/metrics").1
            #expect(metric(text, "udp_fanout_downstreams", "listener=\"k\",source=\"kubernetes\"") == 1, "\(text)")
            // Every family once (several components render into one page).
            let types = text.split(separator: "\n").filter { $0.hasPrefix("# TYPE ") }
            #expect(types.count == Set(types).count, "a family declared twice")
            daemon.signal(SIGTERM)
            #expect(daemon.wait() == 0, "\(daemon.stderr)")
        }
    }

    @Test("/readyz quotes the watcher's last error while the first list fails (a token the API server refuses), and is ready once it lists")
    func readinessQuotesError() async throws {
        let port = freePort()
        try await KubernetesAPIServer.with { server in
            server.apply(.init(name: "recv-a", namespace: "test", service: "receivers", endpoints: [.init(address: "127.0.0.71", pod: "pod-0")]))
            let kubeconfig = try server.writeKubeconfig(namespace: "test")
            server.setToken("another-token")
            let config = try ConfigParser.parse("""
                listeners:
                  - name: k
                    bind: "127.0.0.1:\(freePort())"
                    kubernetes: {service: receivers, port: \(port)}
                    settings: {workers: 1}
                """)
            let daemon = FanoutDaemon(config: config, configPath: nil, logger: Logger(label: "k8s-ready") { _ in SwiftLogNoOpLogHandler() })
            try daemon.start()
            defer { daemon.shutdown() }
            try await Self.withDiscovery(daemon, kubeconfig: kubeconfig) {
                #expect(await server.eventually { daemon.readiness.joined().contains("last error") }, "\(daemon.readiness)")
                let reasons = daemon.readiness.joined()
                #expect(reasons.contains("waiting for the first EndpointSlice list") && reasons.contains("401"), "\(reasons)")
                // The operator fixes the Secret: the kubeconfig's token is accepted again.
                server.setToken(try String(contentsOfFile: kubeconfig, encoding: .utf8).components(separatedBy: "token: \"")[1].components(separatedBy: "\"")[0])
                #expect(await server.eventually(15) { daemon.isReady }, "\(daemon.readiness)")
            }
        }
    }
}
