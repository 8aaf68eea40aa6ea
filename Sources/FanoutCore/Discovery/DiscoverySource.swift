// SPDX-License-Identifier: Apache-2.0
import Logging
import ReusePortLB
import Synchronization

/// A kind of discovery source (a DNS name, a Kubernetes Service): one configured source of one
/// listener, its watcher, and how what it finds becomes members. ``DiscoveryService`` runs one
/// watcher per source and ``Membership`` merges what they found, neither knowing which kind it
/// is: a new kind is a type in a folder of its own under Discovery/ and one line in
/// ``DiscoverySources/types`` (docs/development.md, "Add a discovery source").
protocol DiscoverySource: Hashable, Sendable, CustomStringConvertible {
    /// The kind's name: the `cause` of its membership changes in the log, and the `source` label
    /// of `udp_fanout_downstreams`.
    static var kind: String { get }
    /// The sources of this kind that `listener` configures, in the order their members follow
    /// the static downstreams.
    static func sources(of listener: Listener) -> [Self]

    /// The listener it finds downstreams for.
    var listener: String { get }
    /// The pool of the listener it finds members of (nil: the listener's own downstreams).
    var pool: String? { get }
    /// Where the listener keeps what it found, and what a reload keeps: a source of the new
    /// configuration with the same slot serves the last set until its own first answer (a DNS
    /// entry keeps its name's set, a Kubernetes source its endpoints even if the Service changed).
    var slot: String { get }
    /// How the reasons for skipped addresses name it ("DNS pool.example").
    var label: String { get }
    /// What `/readyz` says while its first answer is pending.
    var waiting: String { get }

    /// The members what it `found` makes, in order (names, weights and health ports from the
    /// listener's configuration now, so a reload that changes them applies to a kept set).
    func members(_ found: [Downstream]) -> [Downstream]
    /// What `--check` says about it at `path` (`listeners[0].kubernetes`); nil: nothing. Sends
    /// nothing to the network.
    func checkNote(path: String, _ environment: DiscoveryEnvironment) -> String?

    /// What a watcher keeps for a reload to look at (Kubernetes: the watcher and its
    /// credentials), and what it starts again with.
    associatedtype Restart: Sendable
    /// Runs the watcher until cancelled, reporting through `run`; `restart`, when given, is what
    /// ``reloaded(_:)`` returned for the watcher this one replaces.
    func watch(_ run: DiscoveryRun, restart: Restart?) async
    /// A reload kept this source: whether its watcher starts again (nil: it keeps running).
    func reloaded(_ run: DiscoveryRun) async -> Restart?
}

extension DiscoverySource {
    func checkNote(path: String, _ environment: DiscoveryEnvironment) -> String? { nil }
}

extension DiscoverySource where Restart == Never {
    func reloaded(_ run: DiscoveryRun) async -> Never? { nil }
}

/// The registry of discovery kinds.
enum DiscoverySources {
    /// Every kind, in the order a listener's members follow its static downstreams.
    static let types: [any DiscoverySource.Type] = [DNSSource.self, KubernetesSource.self]

    /// The discovery sources of one listener.
    static func of(_ listener: Listener) -> [DiscoverySpec] {
        types.flatMap { kind in kind.sources(of: listener).map { DiscoverySpec($0) } }
    }

    /// Every discovery source of a configuration.
    static func all(_ config: FanoutConfig) -> [DiscoverySpec] {
        config.listeners.flatMap(of)
    }
}

/// One discovery source, whatever its kind: what ``DiscoveryService`` runs a watcher for and the
/// daemon records answers of.
struct DiscoverySpec: Hashable, Sendable, CustomStringConvertible {
    let source: any DiscoverySource

    init(_ source: any DiscoverySource) { self.source = source }

    var listener: String { source.listener }
    var pool: String? { source.pool }
    var slot: String { source.slot }
    var kind: String { type(of: source).kind }
    var description: String { source.description }

    static func == (lhs: DiscoverySpec, rhs: DiscoverySpec) -> Bool { AnyHashable(lhs.source) == AnyHashable(rhs.source) }
    func hash(into hasher: inout Hasher) { hasher.combine(AnyHashable(source)) }

    /// Starts its watcher; `restart` must be of the source's own type (nil: a fresh start).
    func watch(_ run: DiscoveryRun, restart: (any Sendable)?) async {
        await Self.watch(source, run, restart)
    }

    /// A reload kept it: what its watcher starts again with, or nil to keep it running.
    func reloaded(_ run: DiscoveryRun) async -> (any Sendable)? {
        await Self.reloaded(source, run)
    }

    private static func watch<Source: DiscoverySource>(_ source: Source, _ run: DiscoveryRun, _ restart: (any Sendable)?) async {
        await source.watch(run, restart: restart as? Source.Restart)
    }

    private static func reloaded<Source: DiscoverySource>(_ source: Source, _ run: DiscoveryRun) async -> (any Sendable)? {
        await source.reloaded(run)
    }
}

/// What the daemon's process gives discovery sources: its environment (Kubernetes credentials'
/// variables), the service account directory, one shared HTTP client, and the Kubernetes
/// watchers' delays (tests lengthen them).
struct DiscoveryEnvironment: Sendable {
    var variables: [String: String]
    var serviceAccountDirectory: String
    var kubernetesTiming = EndpointSliceWatcher.Timing()
    var http = LazyHTTPClient()
}

/// One running watcher's link to the daemon: where it reports what it found and its failures,
/// serves its metrics, and keeps what a reload looks at.
final class DiscoveryRun: Sendable {
    let spec: DiscoverySpec
    let daemon: FanoutDaemon
    let environment: DiscoveryEnvironment
    /// What the source keeps of its running watcher for ``DiscoverySource/reloaded(_:)``.
    let kept = Mutex<(any Sendable)?>(nil)

    init(spec: DiscoverySpec, daemon: FanoutDaemon, environment: DiscoveryEnvironment) {
        self.spec = spec
        self.daemon = daemon
        self.environment = environment
    }

    var logger: Logger { daemon.logger }

    /// The source found this set (DNS: addresses with the entry's port; Kubernetes: ready
    /// endpoints): the listener's members change in one step.
    func found(_ downstreams: [Downstream]) { daemon.discovered(spec, downstreams) }

    /// A lookup failed (the watcher keeps the last good set and retries): `/readyz` quotes it
    /// while the listener's first discovery is pending.
    func failed(_ error: String) { daemon.discoveryFailed(spec, error) }

    /// Serves the watcher's metrics on /metrics, labelled with its listener, until the watcher ends.
    func serveMetrics(_ metrics: @escaping @Sendable () -> String) {
        let listener = spec.listener
        daemon.discoveryMetrics.withLock { $0[spec] = { PrometheusText.adding(label: "listener", listener, to: metrics()) } }
    }
}
