#if canImport(Glibc)
import Glibc
#endif
import AsyncHTTPClient
import Logging
import ReusePortLB
import ServiceLifecycle
import Synchronization

/// Runs one watcher per discovery source of the configuration in force (a DNS name, a
/// Kubernetes Service) and reconciles them on every reload: new sources get a watcher, removed
/// ones are cancelled, unchanged ones keep running. A service of the daemon's ServiceGroup.
public struct DiscoveryService: Service {
    let daemon: FanoutDaemon
    /// Where Kubernetes credentials come from (tests give their own).
    let environment: [String: String]
    let serviceAccountDirectory: String

    public init(
        daemon: FanoutDaemon, environment: [String: String] = ProcessEnvironment.current(),
        serviceAccountDirectory: String = "/var/run/secrets/kubernetes.io/serviceaccount"
    ) {
        self.daemon = daemon
        self.environment = environment
        self.serviceAccountDirectory = serviceAccountDirectory
    }

    public func run() async throws {
        let (changes, continuation) = AsyncStream.makeStream(of: [DiscoverySpec].self, bufferingPolicy: .bufferingNewest(1))
        var watchers: [DiscoverySpec: Task<Void, Never>] = [:]
        let client = LazyHTTPClient()
        func reconcile(_ specs: [DiscoverySpec]) {
            let wanted = Set(specs)
            for (spec, task) in watchers where !wanted.contains(spec) {
                task.cancel()
                watchers[spec] = nil
                daemon.discoveryMetrics.withLock { $0[spec] = nil }
            }
            for spec in specs where watchers[spec] == nil {
                watchers[spec] = Task { await watch(spec, client: client) }
            }
        }
        reconcile(daemon.attachDiscovery(continuation))
        await withGracefulShutdownHandler {
            for await specs in changes { reconcile(specs) }
        } onGracefulShutdown: {
            continuation.finish()
        }
        for task in watchers.values { task.cancel() }
        for task in watchers.values { await task.value }
        daemon.discoveryMetrics.withLock { $0 = [:] }
        await client.shutdown(logger: daemon.logger)
    }

    /// Runs the watcher of one source until cancelled.
    private func watch(_ spec: DiscoverySpec, client: LazyHTTPClient) async {
        let logger = daemon.logger
        // Set below once the watcher exists; removed when it ends (also when it was cancelled
        // before it started: reconcile's removal may come first).
        defer { daemon.discoveryMetrics.withLock { $0[spec] = nil } }
        switch spec {
        case .dns(_, _, let host, let port, let maximumInterval):
            let watcher = DNSWatcher(
                host: host, port: port, maximumInterval: .seconds(maximumInterval), resolver: DNSResolver(), logger: logger,
                // /readyz quotes it while the first resolution is pending.
                onFailure: { [daemon] error in daemon.discoveryFailed(spec, error.description) }
            ) { [daemon] addresses in
                daemon.discovered(spec, dns: addresses)
            }
            register(spec) { watcher.metricsText() }
            do {
                try await watcher.run()
            } catch {
                daemon.discoveryFailed(spec, "\(error)")
                logger.error("DNS discovery stopped", metadata: ["listener": "\(spec.listener)", "name": "\(host)", "error": "\(error)"])
            }
        case .kubernetes(_, let source):
            // Credentials can appear later (a token mounted after start): retry until cancelled.
            // The watcher itself retries API failures and returns only when cancelled.
            var delay = Duration.seconds(1)
            while !Task.isCancelled {
                do {
                    let credentials = try KubernetesCredentials.load(environment: environment, serviceAccountDirectory: serviceAccountDirectory)
                    let watcher = EndpointSliceWatcher(
                        source: source, credentials: credentials, httpClient: client.get(), logger: logger,
                        onFailure: { [daemon] error in daemon.discoveryFailed(spec, error) }
                    ) { [daemon] endpoints in
                        daemon.discovered(spec, kubernetes: endpoints.map { Downstream(name: $0.name, address: $0.address) })
                    }
                    register(spec) { watcher.metricsText() }
                    try await watcher.run()
                    return
                } catch {
                    daemon.discoveryFailed(spec, "\(error)")
                    logger.error("Kubernetes discovery cannot run; trying again", metadata: ["listener": "\(spec.listener)", "error": "\(error)", "retry_in": "\(delay)"])
                    try? await Task.sleep(for: delay)
                    delay = min(delay * 2, .seconds(30))
                }
            }
        }
    }

    /// Serves a watcher's metrics on /metrics, labelled with its listener.
    private func register(_ spec: DiscoverySpec, _ metrics: @escaping @Sendable () -> String) {
        daemon.discoveryMetrics.withLock { $0[spec] = { PrometheusText.adding(label: "listener", spec.listener, to: metrics()) } }
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
