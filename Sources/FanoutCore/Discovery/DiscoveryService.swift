// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import AsyncHTTPClient
import Logging
import ReusePortLB
import ServiceLifecycle
import Synchronization

/// Runs one watcher per discovery source of the configuration in force (a DNS name, a
/// Kubernetes Service: `DiscoverySources`) and reconciles them on every reload: new sources
/// get a watcher, removed ones are cancelled, unchanged ones keep running unless the source says
/// a reload restarts them (Kubernetes reads its credentials again: a watcher whose credentials
/// changed starts over with the new ones; one still waiting for usable credentials tries again
/// at once). A service of the daemon's ServiceGroup.
public struct DiscoveryService: Service {
    let daemon: FanoutDaemon
    /// What the sources get from the process (tests give their own environment, service
    /// account directory and Kubernetes delays).
    var environment: DiscoveryEnvironment

    public init(
        daemon: FanoutDaemon, environment: [String: String] = ProcessEnvironment.current(),
        serviceAccountDirectory: String = "/var/run/secrets/kubernetes.io/serviceaccount"
    ) {
        self.daemon = daemon
        self.environment = DiscoveryEnvironment(variables: environment, serviceAccountDirectory: serviceAccountDirectory)
    }

    /// The EndpointSlice watchers' delays (tests lengthen the backoff to tell a reload's
    /// recovery from a retry's).
    var kubernetesTiming: EndpointSliceWatcher.Timing {
        get { environment.kubernetesTiming }
        set { environment.kubernetesTiming = newValue }
    }

    public func run() async throws {
        // One HTTP client per run, shut down at its end.
        var environment = self.environment
        environment.http = LazyHTTPClient()
        let (changes, continuation) = AsyncStream.makeStream(of: [DiscoverySpec].self, bufferingPolicy: .bufferingNewest(1))
        var watchers: [DiscoverySpec: Running] = [:]
        func start(_ spec: DiscoverySpec, restart: (any Sendable)? = nil) {
            let run = DiscoveryRun(spec: spec, daemon: daemon, environment: environment)
            // Its metrics are removed when it ends (also when it was cancelled before it started:
            // reconcile's removal may come first).
            let task = Task { [daemon] in
                await spec.watch(run, restart: restart)
                daemon.discoveryMetrics.withLock { $0[spec] = nil }
            }
            watchers[spec] = Running(task: task, run: run)
        }
        func reconcile(_ specs: [DiscoverySpec]) async {
            let wanted = Set(specs)
            for (spec, running) in watchers where !wanted.contains(spec) {
                running.task.cancel()
                watchers[spec] = nil
                daemon.discoveryMetrics.withLock { $0[spec] = nil }
            }
            for spec in specs {
                guard let running = watchers[spec], let restart = await spec.reloaded(running.run) else { continue }
                running.task.cancel()
                // Its end removes its metrics: wait for it, so it cannot remove the new one's.
                await running.task.value
                start(spec, restart: restart)
            }
            for spec in specs where watchers[spec] == nil { start(spec) }
        }
        await reconcile(daemon.attachDiscovery(continuation))
        await withGracefulShutdownHandler {
            for await specs in changes { await reconcile(specs) }
        } onGracefulShutdown: {
            continuation.finish()
        }
        for running in watchers.values { running.task.cancel() }
        for running in watchers.values { await running.task.value }
        daemon.discoveryMetrics.withLock { $0 = [:] }
        await environment.http.shutdown(logger: daemon.logger)
    }

    /// A source's watcher task and its link to the daemon.
    private struct Running {
        var task: Task<Void, Never>
        var run: DiscoveryRun
    }
}

/// One HTTP client for every Kubernetes watcher, made only when the first one needs it.
final class LazyHTTPClient: Sendable {
    private let client = Mutex<HTTPClient?>(nil)

    func get() -> HTTPClient {
        client.withLock { client in
            if let client { return client }
            let made = HTTPClient(eventLoopGroupProvider: .singleton)
            client = made
            return made
        }
    }

    func shutdown(logger: Logger) async {
        guard let made = client.withLock({ $0 }) else { return }
        do {
            try await made.shutdown()
        } catch {
            logger.warning("Kubernetes HTTP client did not shut down cleanly", metadata: ["error": "\(error)"])
        }
    }
}

/// The process environment as a dictionary.
public enum ProcessEnvironment {
    public static func current() -> [String: String] {
        var result: [String: String] = [:]
        var entry = environ
        while let pointer = entry.pointee {
            let text = String(cString: pointer)
            if let equals = text.firstIndex(of: "=") {
                result[String(text[..<equals])] = String(text[text.index(after: equals)...])
            }
            entry += 1
        }
        return result
    }
}

extension DiscoveryService: CustomStringConvertible {
    /// What ServiceLifecycle logs for the service: its name only, not its fields (the
    /// environment, credentials, the daemon's state).
    public var description: String { "DiscoveryService" }
}
