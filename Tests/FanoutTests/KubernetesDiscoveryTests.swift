// SPDX-License-Identifier: Apache-2.0
import AsyncHTTPClient
import Foundation
import Logging
import NIOCore
import ReusePortLB
import ServiceLifecycle
import Synchronization
import Testing
import TestSupport
@testable import FanoutCore

/// Kubernetes EndpointSlice discovery against ``KubernetesAPIServer`` (HTTPS with a CA made
/// by the test, bearer tokens, list + watch in the real wire format). Each test asserts the
/// exact sequence of endpoint sets the watcher hands on.
@Suite("KubernetesDiscovery")
struct KubernetesDiscoveryTests {
    /// Short delays so retries happen within a test; pages of 2 so every list paginates.
    static let timing = EndpointSliceWatcher.Timing(
        initialBackoff: .milliseconds(50), maximumBackoff: .milliseconds(200), watchTimeoutSeconds: 60...60,
        requestTimeout: .seconds(5), stallMargin: .seconds(30), pageSize: 2, minimumWatchDuration: .milliseconds(1))

    // MARK: Credentials

    @Test("In-cluster: host and port from the environment, token file, ca.crt, namespace file; IPv6 host bracketed")
    func inClusterCredentials() throws {
        let directory = try Self.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let pem = try Self.testCertificatePEM()
        try pem.write(toFile: directory + "/ca.crt", atomically: true, encoding: .utf8)
        try "abc.def\n".write(toFile: directory + "/token", atomically: true, encoding: .utf8)
        try "logging\n".write(toFile: directory + "/namespace", atomically: true, encoding: .utf8)
        let credentials = try KubernetesCredentials.load(
            environment: ["KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"], serviceAccountDirectory: directory)
        #expect(credentials.server == "https://[fd00::1]:443")
        #expect(credentials.defaultNamespace == "logging")
        #expect(credentials.origin == "in-cluster")
        #expect(try credentials.authorization() == "Bearer abc.def")
        // Re-read per request: a rotated token is used at once.
        try "rotated\n".write(toFile: directory + "/token", atomically: true, encoding: .utf8)
        #expect(try credentials.authorization() == "Bearer rotated")

        // No namespace file: "default".
        try FileManager.default.removeItem(atPath: directory + "/namespace")
        let plain = try KubernetesCredentials.load(
            environment: ["KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"], serviceAccountDirectory: directory)
        #expect(plain.server == "https://10.0.0.1:6443" && plain.defaultNamespace == "default")

        // No token mounted: a loud error naming the file and the fix.
        try FileManager.default.removeItem(atPath: directory + "/token")
        let missing = Self.loadError(["KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"], directory)
        #expect(missing.contains(directory + "/token") && missing.contains("automountServiceAccountToken"), "\(missing)")

        // Neither in a cluster nor a kubeconfig.
        let nothing = Self.loadError(["HOME": directory], directory)
        #expect(nothing.contains("no Kubernetes API configuration") && nothing.contains("KUBECONFIG"), "\(nothing)")
    }

    @Test("kubeconfig: current-context, token, CA data or file (relative to the file), context namespace, client certificate; exec users refused")
    func kubeconfigCredentials() throws {
        let directory = try Self.temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let pem = try Self.testCertificatePEM()
        let caData = Data(pem.utf8).base64EncodedString()
        try pem.write(toFile: directory + "/ca.pem", atomically: true, encoding: .utf8)
        let config = """
            apiVersion: v1
            kind: Config
            preferences: {}
            current-context: prod
            clusters:
            - name: prod-cluster
              cluster:
                server: https://127.0.0.1:6443/
                certificate-authority-data: \(caData)
            - name: file-cluster
              cluster:
                server: https://127.0.0.1:7443
                certificate-authority: ca.pem
            contexts:
            - name: prod
              context: {cluster: prod-cluster, user: robot, namespace: telemetry}
            - name: other
              context: {cluster: file-cluster, user: plugin}
            users:
            - name: robot
              user:
                token: s3cret
            - name: plugin
              user:
                exec: {apiVersion: client.authentication.k8s.io/v1, command: aws}
            """
        try config.write(toFile: directory + "/config", atomically: true, encoding: .utf8)
        let credentials = try KubernetesCredentials.load(environment: ["KUBECONFIG": "/nonexistent-\(UInt32.random(in: 0...UInt32.max)):" + directory + "/config"])
        #expect(credentials.server == "https://127.0.0.1:6443")
        #expect(credentials.defaultNamespace == "telemetry")
        #expect(try credentials.authorization() == "Bearer s3cret")
        #expect(credentials.origin.contains("context prod"))

        // KUBECONFIG wins over in-cluster, and ~/.kube/config is the fallback.
        try FileManager.default.createDirectory(atPath: directory + "/.kube", withIntermediateDirectories: true)
        try pem.write(toFile: directory + "/.kube/ca.pem", atomically: true, encoding: .utf8)
        try config.replacingOccurrences(of: "current-context: prod", with: "current-context: other")
            .write(toFile: directory + "/.kube/config", atomically: true, encoding: .utf8)
        let plugin = Self.loadError(["HOME": directory], directory)
        #expect(plugin.contains("exec or auth-provider") && plugin.contains("user 'plugin'"), "\(plugin)")

        let broken = config.replacingOccurrences(of: "current-context: prod", with: "current-context: nowhere")
        try broken.write(toFile: directory + "/broken", atomically: true, encoding: .utf8)
        let missingContext = Self.loadError(["KUBECONFIG": directory + "/broken"], directory)
        #expect(missingContext.contains("'nowhere'") && missingContext.contains("kubeconfig"), "\(missingContext)")
    }

    @Test("kubeconfig with a client certificate (files) and CA file talks to a server that requires the certificate")
    func clientCertificate() async throws {
        try await KubernetesAPIServer.with(clientCertificates: true) { server in
            server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [.init(address: "198.18.0.10", pod: "vector-0")]))
            let directory = try Self.temporaryDirectory()
            defer { try? FileManager.default.removeItem(atPath: directory) }
            let config = """
                current-context: test
                clusters: [{name: c, cluster: {server: "\(server.url)", certificate-authority: "\(server.caPath)"}}]
                contexts: [{name: test, context: {cluster: c, user: u}}]
                users: [{name: u, user: {client-certificate: "\(server.clientCertificatePath)", client-key: "\(server.clientKeyPath)"}}]
                """
            try config.write(toFile: directory + "/config", atomically: true, encoding: .utf8)
            let credentials = try KubernetesCredentials.load(environment: ["KUBECONFIG": directory + "/config"])
            #expect(credentials.authentication == .none)
            try await Self.watch(server, credentials: credentials) { watcher, updates, _ in
                #expect(await updates.count(1))
                #expect(updates.sets == [["vector-0:5514=198.18.0.10:5514"]])
            }
            // The same without the certificate fails the handshake: loud, counted, no update.
            var stripped = credentials
            stripped.tlsConfiguration.certificateChain = []
            stripped.tlsConfiguration.privateKey = nil
            try await Self.watch(server, credentials: stripped) { watcher, updates, log in
                #expect(await server.eventually { watcher.errorCount("transport") >= 2 })
                #expect(updates.sets.isEmpty)
                #expect(log.count(.error, containing: "cannot reach the API server") >= 2)
            }
        }
    }

    // MARK: Watching

    @Test("Endpoints added, made not-ready, deleted: the exact sequence of sets; pagination; one list")
    func addReadyDelete() async throws {
        try await KubernetesAPIServer.with { server in
            // Three slices of the service (pages of 2) and one of another service.
            server.apply(.init(name: "syslog-a", service: "syslog", endpoints: [.init(address: "198.18.0.1", pod: "pod-1"), .init(address: "198.18.0.2", ready: nil)]))
            server.apply(.init(name: "syslog-b", service: "syslog", endpoints: [.init(address: "198.18.0.3", pod: "pod-3")]))
            server.apply(.init(name: "syslog-c", service: "syslog", endpoints: [.init(address: "198.18.0.9", ready: false, pod: "pod-9")]))
            server.apply(.init(name: "other-a", service: "other", endpoints: [.init(address: "198.18.0.7", pod: "pod-7")]))
            try await Self.watch(server) { watcher, updates, log in
                #expect(await updates.count(1))
                server.apply(.init(name: "syslog-b", service: "syslog", endpoints: [.init(address: "198.18.0.3", pod: "pod-3"), .init(address: "198.18.0.4", pod: "pod-4")]))
                #expect(await updates.count(2))
                server.setReady(slice: "syslog-a", address: "198.18.0.1", false)
                #expect(await updates.count(3))
                server.delete("syslog-b")
                #expect(await updates.count(4))
                server.delete("syslog-a")
                #expect(await updates.count(5))
                #expect(updates.sets == [
                    ["pod-1:5514=198.18.0.1:5514", "198.18.0.2:5514=198.18.0.2:5514", "pod-3:5514=198.18.0.3:5514"],
                    ["pod-1:5514=198.18.0.1:5514", "198.18.0.2:5514=198.18.0.2:5514", "pod-3:5514=198.18.0.3:5514", "pod-4:5514=198.18.0.4:5514"],
                    ["198.18.0.2:5514=198.18.0.2:5514", "pod-3:5514=198.18.0.3:5514", "pod-4:5514=198.18.0.4:5514"],
                    ["198.18.0.2:5514=198.18.0.2:5514"],
                    [],
                ])
                #expect(server.listsServed == 1 && server.watchesServed == 1)
                #expect(log.count(.info, containing: "starting EndpointSlice watch") == 1)
                #expect(log.count(.warning, containing: "k8s discovery: 0 ready endpoints") == 1)
                #expect(log.count(.info, containing: "k8s discovery: endpoint set changed") == 4)
                let metrics = watcher.metricsText()
                #expect(metrics.contains("udp_fanout_discovered_endpoints{source=\"kubernetes\",namespace=\"default\",service=\"syslog\"} 0"), "\(metrics)")
                #expect(metrics.contains("# TYPE udp_fanout_discovery_watch_restarts_total counter"))
            }
        }
    }

    @Test("An empty service is handed on once after the first list; a later endpoint follows")
    func emptyServiceFirst() async throws {
        try await KubernetesAPIServer.with { server in
            try await Self.watch(server) { _, updates, log in
                #expect(await updates.count(1))
                #expect(log.count(.warning, containing: "k8s discovery: 0 ready endpoints") == 1)
                server.apply(.init(name: "syslog-a", service: "syslog", endpoints: [.init(address: "198.18.0.1", pod: "pod-1")]))
                #expect(await updates.count(2))
                #expect(updates.sets == [[], ["pod-1:5514=198.18.0.1:5514"]])
            }
        }
    }

    @Test("A slice split in two and merged back, and bookmarks, hand on nothing; the next real change does")
    func splitAndMerge() async throws {
        try await KubernetesAPIServer.with { server in
            let a = KubernetesAPIServer.Endpoint(address: "198.18.0.1", pod: "pod-1")
            let b = KubernetesAPIServer.Endpoint(address: "198.18.0.2", pod: "pod-2")
            let c = KubernetesAPIServer.Endpoint(address: "198.18.0.3", pod: "pod-3")
            server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [a, b, c]))
            try await Self.watch(server) { _, updates, _ in
                #expect(await updates.count(1))
                // Split the way the controller does: the new slice first, then the old one shrinks.
                server.apply(.init(name: "syslog-2", service: "syslog", endpoints: [c]))
                server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [a, b]))
                server.sendBookmark()
                // Merge back.
                server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [a, b, c]))
                server.delete("syslog-2")
                server.sendBookmark()
                server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [a, b, c, .init(address: "198.18.0.4", pod: "pod-4")]))
                #expect(await updates.count(2))
                #expect(updates.sets == [
                    ["pod-1:5514=198.18.0.1:5514", "pod-2:5514=198.18.0.2:5514", "pod-3:5514=198.18.0.3:5514"],
                    ["pod-1:5514=198.18.0.1:5514", "pod-2:5514=198.18.0.2:5514", "pod-3:5514=198.18.0.3:5514", "pod-4:5514=198.18.0.4:5514"],
                ])
                #expect(server.listsServed == 1)
            }
        }
    }

    @Test("A watch dropped mid-stream is opened again from the last resourceVersion, without a list; so is one that ends")
    func dropRewatch() async throws {
        try await KubernetesAPIServer.with { server in
            server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [.init(address: "198.18.0.1", pod: "pod-1")]))
            try await Self.watch(server) { watcher, updates, _ in
                #expect(await updates.count(1))
                #expect(await server.eventually { server.activeWatches == 1 })
                server.dropWatches()
                // Made while no watch is open: the next watch replays it from the version it asks for.
                server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [.init(address: "198.18.0.1", pod: "pod-1"), .init(address: "198.18.0.2", pod: "pod-2")]))
                #expect(await updates.count(2))
                #expect(await server.eventually { server.activeWatches == 1 && server.watchesServed == 2 })
                #expect(watcher.restartCount("error") == 1 && watcher.errorCount("transport") == 1)
                server.endWatches()
                server.delete("syslog-1")
                #expect(await updates.count(3))
                #expect(updates.sets == [["pod-1:5514=198.18.0.1:5514"], ["pod-1:5514=198.18.0.1:5514", "pod-2:5514=198.18.0.2:5514"], []])
                #expect(server.listsServed == 1 && server.watchesServed == 3)
                #expect(watcher.restartCount("closed") == 1 && watcher.restartCount("gone") == 0)
            }
        }
    }

    @Test("410 Gone (ERROR event, HTTP status, or sent on an open watch) leads to a new list; changes made meanwhile arrive once")
    func goneRelists() async throws {
        try await KubernetesAPIServer.with { server in
            server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [.init(address: "198.18.0.1", pod: "pod-1")]))
            try await Self.watch(server) { watcher, updates, log in
                #expect(await updates.count(1))
                #expect(await server.eventually { server.activeWatches == 1 })
                // ERROR event on the next watch. The change is made after the watch ended, so it
                // reaches the watcher through the new list or the watch after it: once either way.
                server.expireHistory(style: .errorEvent)
                server.endWatches()
                server.apply(.init(name: "syslog-2", service: "syslog", endpoints: [.init(address: "198.18.0.2", pod: "pod-2")]))
                #expect(await updates.count(2))
                #expect(await server.eventually { server.listsServed == 2 && server.activeWatches == 1 })
                // HTTP 410 on the next watch.
                server.expireHistory(style: .httpStatus)
                server.dropWatches()
                server.delete("syslog-1")
                #expect(await updates.count(3))
                #expect(await server.eventually { server.listsServed == 3 && server.activeWatches == 1 })
                // 410 on the open watch itself (the watch cache was reset).
                server.expireHistory(style: .errorEvent)
                server.sendGoneToWatches()
                server.apply(.init(name: "syslog-3", service: "syslog", endpoints: [.init(address: "198.18.0.3", pod: "pod-3")]))
                #expect(await updates.count(4))
                #expect(await server.eventually { server.listsServed == 4 })
                #expect(updates.sets == [
                    ["pod-1:5514=198.18.0.1:5514"],
                    ["pod-1:5514=198.18.0.1:5514", "pod-2:5514=198.18.0.2:5514"],
                    ["pod-2:5514=198.18.0.2:5514"],
                    ["pod-2:5514=198.18.0.2:5514", "pod-3:5514=198.18.0.3:5514"],
                ])
                #expect(server.listsServed == 4 && server.goneServed == 2)
                #expect(watcher.restartCount("gone") == 3)
                // Each 410 is logged once: at info when it follows a watch that stayed open (the
                // test's minimum), at error as a repeat when a busy machine made that watch shorter.
                #expect(log.count(.info, containing: "410 Gone") + log.count(.error, containing: "410 Gone") == 3)
                #expect(log.count(.info, containing: "410 Gone") >= 1, "the first relists at once, at info")
            }
        }
    }

    @Test("A list answered 410 again and again is retried after the backoff, not in a tight loop")
    func goneListBacksOff() async throws {
        try await KubernetesAPIServer.with { server in
            server.setListsGone(true)
            try await Self.watch(server) { watcher, updates, _ in
                #expect(await server.eventually { server.listsRefused >= 3 })
                try await Task.sleep(for: .seconds(1))
                // Backoff of 50 ms doubling to 200 ms: about ten lists in a second; a tight loop
                // makes thousands.
                #expect(server.listsRefused < 40, "lists refused: \(server.listsRefused)")
                #expect(updates.sets.isEmpty)
                server.setListsGone(false)
                #expect(await updates.count(1))
                #expect(updates.sets == [[]])
                #expect(watcher.restartCount("gone") == UInt64(server.listsRefused))
            }
        }
    }

    @Test("A watch answered 410 every time: the first relists at once, the repeats after a growing backoff, each loud and counted")
    func goneWatchBacksOff() async throws {
        try await KubernetesAPIServer.with { server in
            server.setWatchesGone(.errorEvent)
            // The daemon's backoff (client-go's reflector: 0.8 s doubling to 30 s) and healthy
            // watch duration; only the watch timeout and request bound are the tests'.
            var timing = EndpointSliceWatcher.Timing()
            timing.watchTimeoutSeconds = 60...60
            timing.requestTimeout = .seconds(5)
            try await Self.watch(server, timing: timing) { watcher, updates, log in
                try await Task.sleep(for: .seconds(5))
                // Each round is a list and a watch. A tight loop made 101 requests in 5 s; the
                // backoff (0, 0.4-0.8, 0.8-1.6, 1.6-3.2 s) allows about ten.
                let requests = server.requestTimes.count
                #expect(requests <= 20, "requests in 5 s: \(requests)")
                let lists = server.listTimes
                #expect(lists.count >= 3, "lists in 5 s: \(lists.count): the watcher must keep trying")
                let gaps = zip(lists.dropFirst(), lists).map { $0 - $1 }
                #expect(gaps.count >= 2 && gaps.last! > gaps.first! && gaps.last! >= .milliseconds(400), "gaps between lists: \(gaps)")
                // Loud: the first 410 is the usual info line; every repeat an error with retry_in,
                // counted as an error of reason gone as well as a restart.
                #expect(watcher.restartCount("gone") >= UInt64(lists.count - 1))
                #expect(watcher.errorCount("gone") >= UInt64(lists.count - 2) && watcher.errorCount("gone") >= 1)
                #expect(log.count(.info, containing: "410 Gone") == 1)
                let repeated = log.all.filter { $0.level == .error && $0.message.contains("410 Gone") }
                #expect(repeated.count >= 1 && repeated.allSatisfy { $0.metadata["retry_in"] != nil }, "\(repeated.map(\.message))")
                // The server recovers: the next list and watch work, and a change arrives.
                server.setWatchesGone(nil)
                server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [.init(address: "198.18.0.1", pod: "pod-1")]))
                #expect(await updates.count(2))
                #expect(updates.sets == [[], ["pod-1:5514=198.18.0.1:5514"]])
            }
        }
    }

    @Test("A watch silent past its timeoutSeconds is taken as a dead connection and opened again from its resourceVersion")
    func stalledWatch() async throws {
        try await KubernetesAPIServer.with { server in
            server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [.init(address: "198.18.0.1", pod: "pod-1")]))
            // The test server never ends a watch by itself: with timeoutSeconds 1 the watch is
            // silent past 1 s + 0.3 s, as a connection that died without a TCP error would be.
            var timing = Self.timing
            timing.watchTimeoutSeconds = 1...1
            timing.stallMargin = .milliseconds(300)
            try await Self.watch(server, timing: timing) { watcher, updates, log in
                #expect(await updates.count(1))
                #expect(await server.eventually { watcher.errorCount("watch_stalled") >= 1 && server.watchesServed >= 2 })
                #expect(log.count(.error, containing: "the watch delivered nothing") >= 1)
                server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [.init(address: "198.18.0.2", pod: "pod-2")]))
                #expect(await updates.count(2))
                #expect(updates.sets == [["pod-1:5514=198.18.0.1:5514"], ["pod-2:5514=198.18.0.2:5514"]])
                #expect(server.listsServed == 1)
            }
        }
    }

    @Test("A wrong token is a loud, counted error retried with backoff; fixing the token file recovers without a restart")
    func wrongTokenRecovers() async throws {
        try await KubernetesAPIServer.with { server in
            server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [.init(address: "198.18.0.1", pod: "pod-1")]))
            try await Self.watch(server, token: "wrong") { watcher, updates, log in
                // The error is counted, then logged: both, for each of the three.
                #expect(await server.eventually { watcher.errorCount("unauthorized") >= 3 && log.count(.error, containing: "HTTP 401") >= 3 })
                #expect(updates.sets.isEmpty)
                #expect(log.count(.error, containing: "HTTP 401") >= 3)
                let metrics = watcher.metricsText()
                #expect(metrics.contains("udp_fanout_discovery_errors_total{source=\"kubernetes\",namespace=\"default\",service=\"syslog\",reason=\"unauthorized\"}"), "\(metrics)")
                try server.token.write(toFile: watcher.credentialsTokenPath, atomically: true, encoding: .utf8)
                #expect(await updates.count(1))
                #expect(updates.sets == [["pod-1:5514=198.18.0.1:5514"]])
            }
        }
    }

    @Test("A wrong inline kubeconfig token: loud 401s; the token fixed in the file is read again after a 401, without a reload")
    func wrongInlineTokenRecovers() async throws {
        try await KubernetesAPIServer.with { server in
            server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [.init(address: "198.18.0.1", pod: "pod-1")]))
            let directory = try Self.temporaryDirectory()
            defer { try? FileManager.default.removeItem(atPath: directory) }
            let path = try server.writeKubeconfig(token: "wrong", to: directory + "/config")
            let credentials = try KubernetesCredentials.load(environment: ["KUBECONFIG": path])
            #expect(credentials.authentication == .token("wrong"))
            try await Self.watch(server, credentials: credentials) { watcher, updates, log in
                // The error is counted, then logged: both, for each of the three.
                #expect(await server.eventually { watcher.errorCount("unauthorized") >= 3 && log.count(.error, containing: "HTTP 401") >= 3 })
                #expect(updates.sets.isEmpty)
                #expect(log.count(.error, containing: "HTTP 401") >= 3)
                try server.writeKubeconfig(to: path)
                #expect(await updates.count(1))
                #expect(updates.sets == [["pod-1:5514=198.18.0.1:5514"]])
                #expect(watcher.credentials.authentication == .token(server.token))
                #expect(log.count(.info, containing: "credentials read again after HTTP 401") == 1)
            }
        }
    }

    @Test("A wrong inline kubeconfig token fixed in the file is taken by the next reload at once, whatever the backoff; an unchanged one restarts nothing")
    func reloadRereadsKubeconfig() async throws {
        try await KubernetesAPIServer.with { server in
            let port = freePort()
            server.apply(.init(name: "recv-a", namespace: "test", service: "receivers", endpoints: [.init(address: "127.0.0.71", pod: "pod-0")]))
            let kubeconfig = try server.writeKubeconfig(namespace: "test", token: "wrong")
            let text = """
                listeners:
                  - name: k
                    bind: "127.0.0.1:\(freePort())"
                    kubernetes: {service: receivers, port: \(port)}
                """
            let config = try ConfigParser.parse(text)
            try config.validate()
            let log = CapturedLog()
            let daemon = FanoutDaemon(config: config, configPath: nil, logger: log.logger("daemon", level: .info))
            try daemon.start()
            defer { daemon.shutdown() }
            var service = DiscoveryService(daemon: daemon, environment: ["KUBECONFIG": kubeconfig], serviceAccountDirectory: "/nonexistent")
            // A retry comes only a minute after a failure: recovery within the bound below is the reload's.
            service.kubernetesTiming.initialBackoff = .seconds(60)
            service.kubernetesTiming.maximumBackoff = .seconds(60)
            service.kubernetesTiming.requestTimeout = .seconds(5)
            let running = service
            let task = Task { try await running.run() }
            defer { task.cancel() }
            #expect(await server.eventually { server.unauthorizedServed >= 1 })
            #expect(await server.eventually { daemon.readiness.joined().contains("HTTP 401") }, "\(daemon.readiness)")
            try server.writeKubeconfig(namespace: "test", to: kubeconfig)
            #expect(daemon.reload(text: text))
            #expect(await server.eventually(10) { daemon.isReady && server.activeWatches == 1 }, "\(daemon.readiness)")
            #expect(server.listsServed == 1 && server.unauthorizedServed == 1)
            #expect(log.count(.info, containing: "credentials changed") == 1)
            // Unchanged credentials: the running watch stays.
            #expect(daemon.reload(text: text))
            try await Task.sleep(for: .milliseconds(500))
            #expect(server.listsServed == 1 && server.watchesServed == 1 && server.activeWatches == 1)
            task.cancel()
            _ = try? await task.value
        }
    }

    @Test("403 names the RBAC rule to grant; access granted later recovers")
    func forbiddenNamesRBAC() async throws {
        try await KubernetesAPIServer.with { server in
            server.setForbidden(true)
            try await Self.watch(server) { watcher, updates, log in
                #expect(await server.eventually { watcher.errorCount("forbidden") >= 2 })
                let line = log.all.first { $0.level == .error && $0.message.contains("HTTP 403") }?.message ?? ""
                #expect(line.contains("list and watch") && line.contains("endpointslices") && line.contains("discovery.k8s.io") && line.contains("RBAC"), "\(line)")
                server.setForbidden(false)
                #expect(await updates.count(1))
                #expect(updates.sets == [[]])
            }
        }
    }

    @Test("Garbage and malformed events are logged, counted and skipped; the watch goes on")
    func garbageSkipped() async throws {
        try await KubernetesAPIServer.with { server in
            server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [.init(address: "198.18.0.1", pod: "pod-1")]))
            try await Self.watch(server) { watcher, updates, log in
                #expect(await updates.count(1))
                #expect(await server.eventually { server.activeWatches == 1 })
                server.sendRaw("{this is not json")
                server.sendRaw(#"{"type":"MODIFIED","object":{"kind":"EndpointSlice","metadata":{"name":"syslog-1"},"endpoints":"not a list"}}"#)
                server.sendRaw(#"{"type":"SURPRISE","object":{}}"#)
                server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [
                    .init(address: "198.18.0.1", pod: "pod-1"), .init(address: "not-an-ip", pod: "pod-x"), .init(address: "198.18.0.2", pod: "pod-2"),
                ]))
                #expect(await updates.count(2))
                #expect(updates.sets == [["pod-1:5514=198.18.0.1:5514"], ["pod-1:5514=198.18.0.1:5514", "pod-2:5514=198.18.0.2:5514"]])
                #expect(watcher.errorCount("malformed_event") == 2)
                #expect(watcher.errorCount("malformed_object") == 2)
                #expect(server.listsServed == 1 && server.watchesServed == 1)
                #expect(log.count(.warning, containing: "not-an-ip") == 1)
            }
        }
    }

    @Test("IPv6 slices become downstreams; FQDN slices are ignored with a debug line; another namespace is watched when configured")
    func ipv6AndFQDN() async throws {
        try await KubernetesAPIServer.with { server in
            server.apply(.init(name: "syslog-v6", namespace: "logging", service: "syslog", addressType: "IPv6", endpoints: [
                .init(address: "2001:db8::2"), .init(address: "2001:db8::1", pod: "pod-1"), .init(address: "198.18.0.5", pod: "wrong-family"),
            ]))
            server.apply(.init(name: "syslog-v4", namespace: "logging", service: "syslog", endpoints: [.init(address: "198.18.0.1", pod: "pod-4")]))
            server.apply(.init(name: "syslog-fqdn", namespace: "logging", service: "syslog", addressType: "FQDN", endpoints: [.init(address: "collector.example")]))
            try await Self.watch(server, namespace: "logging") { watcher, updates, log in
                #expect(await updates.count(1))
                server.setReady(slice: "syslog-v6", address: "2001:db8::1", false)
                #expect(await updates.count(2))
                #expect(updates.sets == [
                    ["pod-4:5514=198.18.0.1:5514", "pod-1:5514=[2001:db8::1]:5514", "[2001:db8::2]:5514=[2001:db8::2]:5514"],
                    ["pod-4:5514=198.18.0.1:5514", "[2001:db8::2]:5514=[2001:db8::2]:5514"],
                ])
                #expect(log.count(.debug, containing: "addressType FQDN ignored") == 1)
                #expect(watcher.namespace == "logging")
            }
        }
    }

    @Test("Stopping a watcher with a watch open (graceful shutdown, or a reload's cancel) ends its run and closes its connection at once")
    func stopIsPrompt() async throws {
        try await KubernetesAPIServer.with { server in
            server.apply(.init(name: "syslog-1", service: "syslog", endpoints: [.init(address: "198.18.0.1", pod: "pod-1")]))
            let credentials = try Self.inCluster(server)
            defer { try? FileManager.default.removeItem(atPath: credentials.directory) }
            // A request bound far above the bound asserted: a stop that waited for it would show.
            var timing = Self.timing
            timing.requestTimeout = .seconds(20)
            let bound = Duration.seconds(3)
            let log = CapturedLog()
            func watcher() -> EndpointSliceWatcher {
                EndpointSliceWatcher(
                    source: Kubernetes(namespace: nil, service: "syslog", port: 5514), credentials: credentials.credentials,
                    httpClient: .shared, logger: log.logger(), timing: timing, onUpdate: { _ in })
            }
            /// Waits until the watch of `task` is open, stops it with `stop` and expects its run to
            /// end and its connection to close within `bound`.
            func expectPromptStop(_ task: Task<Void, any Error>, on what: String, _ stop: () async -> Void) async throws {
                #expect(await server.eventually { server.activeWatches == 1 }, "no watch opened before \(what)")
                let start = ContinuousClock.now
                await stop()
                await Self.waitForEnd(of: task, within: bound, what)
                let took = ContinuousClock.now - start
                try await task.value
                #expect(took < bound, "the watcher stopped \(took) after \(what)")
                let closed = await Self.watchesClosed(server)
                #expect(closed.map { $0 < bound } == true, "the watch connection closed \(closed.map { "\($0)" } ?? "not within 10 s") after the watcher stopped on \(what)")
            }
            // SIGTERM: the daemon's ServiceGroup shuts down gracefully.
            let group = ServiceGroup(configuration: .init(services: [watcher()], logger: log.logger("group", level: .warning)))
            try await expectPromptStop(Task { try await group.run() }, on: "graceful shutdown") { await group.triggerGracefulShutdown() }
            // A reload: DiscoveryService cancels the watcher's task and waits for it.
            let running = watcher()
            let task = Task { try await running.run() }
            try await expectPromptStop(task, on: "cancellation") { task.cancel() }
        }
    }

    @Test("The udp-fanout binary with a Kubernetes listener and its watch open exits promptly on SIGTERM")
    func binaryStopsPromptly() async throws {
        try await KubernetesAPIServer.with { server in
            server.apply(.init(name: "recv-a", namespace: "test", service: "receivers", endpoints: [.init(address: "127.0.0.71", pod: "pod-0")]))
            let kubeconfig = try server.writeKubeconfig(namespace: "test")
            let directory = try Self.temporaryDirectory()
            defer { try? FileManager.default.removeItem(atPath: directory) }
            try """
                listeners:
                  - name: k
                    bind: "127.0.0.1:\(freePort())"
                    kubernetes: {service: receivers, port: \(freePort())}
                """.write(toFile: directory + "/udp-fanout.yaml", atomically: true, encoding: .utf8)
            let daemon = try Child("udp-fanout", ["-c", directory + "/udp-fanout.yaml"], prefix: ["/usr/bin/env", "KUBECONFIG=\(kubeconfig)"])
            #expect(await server.eventually { server.activeWatches == 1 }, "no watch opened: \(daemon.stderr)")
            let start = ContinuousClock.now
            daemon.signal(SIGTERM)
            // Polled here rather than in Child.wait, which would block a thread the server may need.
            for _ in 0..<1000 where daemon.process.isRunning { try await Task.sleep(for: .milliseconds(10)) }
            let took = ContinuousClock.now - start
            #expect(daemon.wait(seconds: 10) == 0, "\(daemon.stderr)")
            #expect(took < .seconds(3), "udp-fanout exited \(took) after SIGTERM with a watch open: \(daemon.stderr)")
        }
    }

    // MARK: Selection rules (pure)

    @Test("Serving-terminating endpoints are used only while no endpoint is ready; nil conditions follow the API docs")
    func terminatingFallback() {
        typealias E = EndpointSlice.Endpoint
        func slice(_ endpoints: [E]) -> [String: EndpointSlice] {
            ["s": EndpointSlice(metadata: ObjectMeta(name: "s"), addressType: "IPv4", endpoints: endpoints)]
        }
        func endpoint(_ address: String, ready: Bool?, serving: Bool? = nil, terminating: Bool? = nil) -> E {
            E(addresses: [address], conditions: .init(ready: ready, serving: serving, terminating: terminating), targetRef: nil)
        }
        func names(_ slices: [String: EndpointSlice]) -> [String] {
            EndpointSelection.endpoints(of: slices, port: 9).endpoints.map(\.address.description)
        }
        let draining = endpoint("198.18.0.2", ready: false, serving: true, terminating: true)
        #expect(names(slice([endpoint("198.18.0.1", ready: true), draining])) == ["198.18.0.1:9"])
        #expect(names(slice([endpoint("198.18.0.1", ready: false, serving: false, terminating: true), draining])) == ["198.18.0.2:9"])
        #expect(EndpointSelection.endpoints(of: slice([draining]), port: 9).usedTerminating)
        // ready nil: ready. serving nil defers to ready. terminating nil: not terminating.
        #expect(names(slice([endpoint("198.18.0.3", ready: nil)])) == ["198.18.0.3:9"])
        #expect(names(slice([endpoint("198.18.0.4", ready: false, serving: nil, terminating: true)])) == [])
        #expect(names(slice([endpoint("198.18.0.5", ready: false, serving: true, terminating: nil)])) == [])
        #expect(names(slice([E(addresses: nil, conditions: nil, targetRef: nil), E(addresses: ["198.18.0.6"], conditions: nil, targetRef: nil)])) == ["198.18.0.6:9"])
    }

    @Test("Lines split across chunks and several lines in one chunk are put back together")
    func lineSplitter() throws {
        var splitter = EndpointSliceWatcher.LineSplitter(limit: 64)
        #expect(try splitter.append(ByteBuffer(string: "{\"a\"")).isEmpty)
        #expect(try splitter.append(ByteBuffer(string: ":1}\n{\"b\":2}\n{\"c")).map { String(decoding: $0, as: UTF8.self) } == ["{\"a\":1}", "{\"b\":2}"])
        #expect(splitter.remainder.map { String(decoding: $0, as: UTF8.self) } == "{\"c")
        #expect(throws: DiscoveryError.self) { try splitter.append(ByteBuffer(string: String(repeating: "x", count: 100))) }
    }

    // MARK: Helpers

    /// Records every set handed on, as `name=address` strings.
    final class Updates: Sendable {
        private let recorded = Mutex<[[String]]>([])
        func record(_ endpoints: [DiscoveredEndpoint]) { recorded.withLock { $0.append(endpoints.map(\.description)) } }
        var sets: [[String]] { recorded.withLock { $0 } }
        /// Waits (at most 10 s) until at least `n` sets were handed on.
        func count(_ n: Int) async -> Bool {
            let end = ContinuousClock.now + .seconds(10)
            while ContinuousClock.now < end {
                if sets.count >= n { return true }
                try? await Task.sleep(for: .milliseconds(10))
            }
            return sets.count >= n
        }
    }

    /// A service-account directory for `server` (its CA, the given token, no namespace file).
    static func inCluster(_ server: KubernetesAPIServer, token: String? = nil) throws -> (credentials: KubernetesCredentials, directory: String) {
        let directory = try temporaryDirectory()
        try FileManager.default.copyItem(atPath: server.caPath, toPath: directory + "/ca.crt")
        try (token ?? server.token).write(toFile: directory + "/token", atomically: true, encoding: .utf8)
        let credentials = try KubernetesCredentials.load(
            environment: ["KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "\(server.port)"], serviceAccountDirectory: directory)
        return (credentials, directory)
    }

    /// Runs a watcher of service `syslog` (port 5514) for the duration of `body`.
    static func watch(
        _ server: KubernetesAPIServer, credentials given: KubernetesCredentials? = nil, token: String? = nil, namespace: String? = nil,
        timing: EndpointSliceWatcher.Timing = timing, _ body: @Sendable (EndpointSliceWatcher, Updates, CapturedLog) async throws -> Void
    ) async throws {
        let made = given == nil ? try inCluster(server, token: token) : nil
        defer { if let made { try? FileManager.default.removeItem(atPath: made.directory) } }
        let log = CapturedLog()
        let updates = Updates()
        let watcher = EndpointSliceWatcher(
            source: Kubernetes(namespace: namespace, service: "syslog", port: 5514), credentials: given ?? made!.credentials,
            httpClient: .shared, logger: log.logger(), timing: timing, onUpdate: { updates.record($0) })
        try await withThrowingTaskGroup(of: Void.self) { tasks in
            tasks.addTask { try await watcher.run() }
            do {
                try await body(watcher, updates, log)
            } catch {
                tasks.cancelAll()
                throw error
            }
            tasks.cancelAll()
        }
    }

    /// Waits for `task` to end, at most `bound` plus a second: past that it is a failure naming
    /// `what`, and the task is cancelled and waited for, so nothing outlives the test and a slow
    /// stop shows as a failure rather than a hung run.
    static func waitForEnd(of task: Task<Void, any Error>, within bound: Duration, _ what: String) async {
        let done = Mutex(false)
        let waiter = Task {
            _ = try? await task.value
            done.withLock { $0 = true }
        }
        let end = ContinuousClock.now + bound + .seconds(1)
        while !done.withLock({ $0 }) && ContinuousClock.now < end { try? await Task.sleep(for: .milliseconds(10)) }
        if !done.withLock({ $0 }) {
            Issue.record("the watcher did not stop within \(bound + .seconds(1)) of \(what); cancelled")
            task.cancel()
        }
        await waiter.value
    }

    /// How long until the server sees no open watch, polling for at most 10 s (it notices a
    /// closed connection when it next writes to it, so a bookmark is sent on each poll); nil
    /// when one is still open then.
    static func watchesClosed(_ server: KubernetesAPIServer) async -> Duration? {
        let start = ContinuousClock.now
        let closed = await server.eventually(10) {
            server.sendBookmark()
            return server.activeWatches == 0
        }
        return closed ? ContinuousClock.now - start : nil
    }

    static func temporaryDirectory() throws -> String {
        let directory = NSTemporaryDirectory() + "k8s-creds-\(UInt64.random(in: 0...UInt64.max))"
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        return directory
    }

    static func loadError(_ environment: [String: String], _ directory: String) -> String {
        do {
            _ = try KubernetesCredentials.load(environment: environment, serviceAccountDirectory: directory)
            return "loaded"
        } catch {
            return error.description
        }
    }

    /// A self-signed certificate, made once per test with openssl.
    static func testCertificatePEM() throws -> String {
        let directory = try temporaryDirectory()
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let result = try TestSupport.run("/usr/bin/openssl", [
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", directory + "/k.pem", "-out", directory + "/c.pem", "-days", "1", "-subj", "/CN=test",
        ])
        #expect(result.status == 0, "\(result.output)")
        return try String(contentsOfFile: directory + "/c.pem", encoding: .utf8)
    }
}

extension EndpointSliceWatcher {
    /// The in-cluster token file the tests rewrite.
    var credentialsTokenPath: String {
        if case .tokenFile(let path) = credentials.authentication { return path }
        return ""
    }
}
