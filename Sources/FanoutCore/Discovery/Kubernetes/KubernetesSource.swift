// SPDX-License-Identifier: Apache-2.0
import ReusePortLB

/// A listener's Kubernetes Service (`kubernetes: {namespace, service, port}`): its ready
/// EndpointSlice endpoints are members, listed and watched through the API server.
struct KubernetesSource: DiscoverySource {
    static let kind = "kubernetes"

    static func sources(of listener: Listener) -> [KubernetesSource] {
        listener.memberGroups.compactMap { group in
            group.kubernetes.map { KubernetesSource(listener: listener.name, pool: group.pool, service: $0) }
        }
    }

    let listener: String
    let pool: String?
    let service: Kubernetes

    init(listener: String, pool: String? = nil, service: Kubernetes) {
        self.listener = listener
        self.pool = pool
        self.service = service
    }

    var slot: String { "\(pool.map { "pool/\($0)/" } ?? "")kubernetes" }
    var label: String { "Kubernetes \(service.service)" }
    var waiting: String { "waiting for the first EndpointSlice list of \(service.namespace.map { "\($0)/" } ?? "")\(service.service)" }
    var description: String { "\(listener)/\(pool.map { "pool/\($0)/" } ?? "")kubernetes/\(service.namespace ?? "")/\(service.service):\(service.port)" }

    func members(_ found: [Downstream]) -> [Downstream] {
        found.sorted { $0.address.description < $1.address.description }.map { endpoint in
            var member = endpoint
            member.pool = pool
            return member
        }
    }

    /// Where Kubernetes credentials come from. A note, not a problem: a token may appear after
    /// start, and the daemon keeps trying (its `/readyz` says what it waits for).
    func checkNote(path: String, _ environment: DiscoveryEnvironment) -> String? {
        do {
            let credentials = try KubernetesCredentials.load(
                environment: environment.variables, serviceAccountDirectory: environment.serviceAccountDirectory)
            return "\(path).kubernetes: API server \(credentials.server) with credentials from \(credentials.origin) (not contacted by --check)"
        } catch {
            return "\(path).kubernetes: \(error); the listener stays not ready until credentials are found"
        }
    }

    /// Runs the watcher until cancelled. Credentials can appear later (a token mounted after
    /// start): retry until cancelled. The watcher itself retries API failures and returns only
    /// when cancelled. `restart`: the credentials a reload read, for its first attempt.
    func watch(_ run: DiscoveryRun, restart: KubernetesCredentials?) async {
        let environment = run.environment
        var delay = Duration.seconds(1)
        var given = restart
        while !Task.isCancelled {
            do {
                let credentials = try given ?? KubernetesCredentials.load(
                    environment: environment.variables, serviceAccountDirectory: environment.serviceAccountDirectory)
                given = nil
                let watcher = EndpointSliceWatcher(
                    source: service, credentials: credentials, httpClient: environment.http.get(), logger: run.logger,
                    timing: environment.kubernetesTiming,
                    onFailure: { error in run.failed(error) }
                ) { endpoints in
                    // The watcher logs the reference's `k8s discovery: 0 ready endpoints` itself.
                    run.found(endpoints.map { Downstream(name: $0.name, address: $0.address) })
                }
                run.serveMetrics { watcher.metricsText() }
                run.kept.withLock { $0 = watcher }
                try await watcher.run()
                return
            } catch {
                run.failed("\(error)")
                run.logger.error("Kubernetes discovery cannot run; trying again", metadata: ["listener": "\(listener)", "error": "\(error)", "retry_in": "\(delay)"])
                try? await Task.sleep(for: delay)
                delay = min(delay * 2, .seconds(30))
            }
        }
    }

    /// Kubernetes's own files are not part of the configuration: a reload is when the operator
    /// expects a fixed kubeconfig to be taken. Reads the credentials again (off the pool: file
    /// reads) and compares them with those of the running watcher.
    /// - Returns: the credentials to start a new watcher with, or nil to keep it running (the
    ///   same credentials, or ones that cannot be read now: the last good ones stay, and the
    ///   reason is logged).
    func reloaded(_ run: DiscoveryRun) async -> KubernetesCredentials? {
        let environment = run.environment
        let loaded = await offCooperativePool("k8s-credentials") {
            Result { () throws(DiscoveryError) in
                try KubernetesCredentials.load(environment: environment.variables, serviceAccountDirectory: environment.serviceAccountDirectory)
            }
        }
        let logger = run.logger
        let running = run.kept.withLock { $0 as? EndpointSliceWatcher }
        switch loaded {
        case .failure(let error):
            guard let running else { return nil }
            logger.error("k8s discovery: reload: the credentials cannot be read again; the watcher keeps the ones it has",
                metadata: ["listener": "\(listener)", "error": "\(error)", "credentials": "\(running.credentials.origin)"])
            return nil
        case .success(let new):
            guard let running else {
                // Still waiting for usable credentials (its retry may be 30 s away): now they are.
                logger.info("k8s discovery: reload: credentials found; starting the watch", metadata: ["listener": "\(listener)", "credentials": "\(new.origin)"])
                return new
            }
            if new.isSame(as: running.credentials) { return nil }
            logger.info("k8s discovery: reload: the credentials changed; listing and watching again with them",
                metadata: ["listener": "\(listener)", "api": "\(new.server)", "credentials": "\(new.origin)"])
            return new
        }
    }
}
