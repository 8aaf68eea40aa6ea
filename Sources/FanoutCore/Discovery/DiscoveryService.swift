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
/// ones are cancelled, unchanged ones keep running. A reload also reads the Kubernetes
/// credentials again: a watcher whose credentials changed (a fixed kubeconfig token, another
/// server, context or namespace) starts over with the new ones; one still waiting for usable
/// credentials tries again at once. A service of the daemon's ServiceGroup.
public struct DiscoveryService: Service {
    let daemon: FanoutDaemon
    /// Where Kubernetes credentials come from (tests give their own).
    let environment: [String: String]
    let serviceAccountDirectory: String
    /// The EndpointSlice watchers' delays (tests lengthen the backoff to tell a reload's
    /// recovery from a retry's).
    var kubernetesTiming = EndpointSliceWatcher.Timing()

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
        var watchers: [DiscoverySpec: Running] = [:]
        let client = LazyHTTPClient()
        func start(_ spec: DiscoverySpec, credentials: KubernetesCredentials? = nil) {
            let slot = KubernetesSlot()
            watchers[spec] = Running(task: Task { await watch(spec, client: client, slot: slot, credentials: credentials) }, kubernetes: slot)
        }
        func reconcile(_ specs: [DiscoverySpec]) async {
            let wanted = Set(specs)
            for (spec, running) in watchers where !wanted.contains(spec) {
                running.task.cancel()
                watchers[spec] = nil
                daemon.discoveryMetrics.withLock { $0[spec] = nil }
            }
            for spec in specs {
                guard case .kubernetes = spec, let running = watchers[spec] else { continue }
                // Kubernetes's own files are not part of the configuration: a reload is when
                // the operator expects a fixed kubeconfig to be taken.
                guard let restart = await credentialsChanged(spec, running.kubernetes) else { continue }
                running.task.cancel()
                // Its end removes its metrics: wait for it, so it cannot remove the new one's.
                await running.task.value
                start(spec, credentials: restart)
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
        await client.shutdown(logger: daemon.logger)
    }

    /// A source's watcher task, and for a Kubernetes source the watcher it runs now.
    private struct Running {
        var task: Task<Void, Never>
        var kubernetes: KubernetesSlot
    }

    /// On a reload, reads the Kubernetes credentials again (off the pool: file reads) and
    /// compares them with those of the source's watcher.
    /// - Returns: the credentials to start a new watcher with, or nil to keep it running (the
    ///   same credentials, or ones that cannot be read now: the last good ones stay, and the
    ///   reason is logged).
    private func credentialsChanged(_ spec: DiscoverySpec, _ slot: KubernetesSlot) async -> KubernetesCredentials? {
        let (environment, directory) = (self.environment, serviceAccountDirectory)
        let loaded = await offCooperativePool("k8s-credentials") {
            Result { () throws(DiscoveryError) in try KubernetesCredentials.load(environment: environment, serviceAccountDirectory: directory) }
        }
        let logger = daemon.logger
        switch loaded {
        case .failure(let error):
            guard let watcher = slot.watcher.withLock({ $0 }) else { return nil }
            logger.error("k8s discovery: reload: the credentials cannot be read again; the watcher keeps the ones it has",
                metadata: ["listener": "\(spec.listener)", "error": "\(error)", "credentials": "\(watcher.credentials.origin)"])
            return nil
        case .success(let new):
            guard let watcher = slot.watcher.withLock({ $0 }) else {
                // Still waiting for usable credentials (its retry may be 30 s away): now they are.
                logger.info("k8s discovery: reload: credentials found; starting the watch", metadata: ["listener": "\(spec.listener)", "credentials": "\(new.origin)"])
                return new
            }
            if new.isSame(as: watcher.credentials) { return nil }
            logger.info("k8s discovery: reload: the credentials changed; listing and watching again with them",
                metadata: ["listener": "\(spec.listener)", "api": "\(new.server)", "credentials": "\(new.origin)"])
            return new
        }
    }

    /// Runs the watcher of one source until cancelled. A Kubernetes watcher is put in `slot`
    /// once it exists; `credentials`, when given, are used for its first attempt.
    private func watch(_ spec: DiscoverySpec, client: LazyHTTPClient, slot: KubernetesSlot, credentials given: KubernetesCredentials?) async {
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
            var given = given
            while !Task.isCancelled {
                do {
                    let credentials = try given ?? KubernetesCredentials.load(environment: environment, serviceAccountDirectory: serviceAccountDirectory)
                    given = nil
                    let watcher = EndpointSliceWatcher(
                        source: source, credentials: credentials, httpClient: client.get(), logger: logger, timing: kubernetesTiming,
                        onFailure: { [daemon] error in daemon.discoveryFailed(spec, error) }
                    ) { [daemon] endpoints in
                        daemon.discovered(spec, kubernetes: endpoints.map { Downstream(name: $0.name, address: $0.address) })
                    }
                    register(spec) { watcher.metricsText() }
                    slot.watcher.withLock { $0 = watcher }
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

/// The EndpointSliceWatcher a source's task runs (nil until its credentials could be loaded),
/// so a reload can compare its credentials with the files as they are now.
final class KubernetesSlot: Sendable {
    let watcher = Mutex<EndpointSliceWatcher?>(nil)
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
