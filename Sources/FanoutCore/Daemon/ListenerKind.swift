// SPDX-License-Identifier: Apache-2.0
import Logging
import ReusePortLB
import Synchronization

/// One kind of listener (userspace, relay, tc_ebpf, xdp, af_xdp): everything the daemon does with a
/// listener it does through its kind, without knowing which kind it is. A kind is a type in its
/// own folder, registered in ``ListenerKinds``.
protocol ListenerKind: Sendable {
    /// Its name in the settings table (schema/settings-table.json): the mode, or relay.
    static var name: String { get }
    /// Why the workers' settings (``UserspaceSettings``) have no effect in this kind, if they do not:
    /// the end of their warning.
    static var withoutWorkers: String? { get }
    /// True for the listeners of this kind (by `mode`, and `replies` for relay).
    static func serves(_ listener: Listener) -> Bool
    /// True when it attaches to a network interface, so `interface` must be set.
    static var attachesToInterface: Bool { get }
    /// True when its binds are entries at one interface's hook rather than the host's sockets:
    /// two of its listeners may share a bind on two interfaces, and it overlaps another
    /// listener's bind only on its own interface.
    static var bindsPerInterface: Bool { get }
    /// True when it serves replication pools (`pools:`); a listener of another kind with pools is
    /// refused at validation, naming the key.
    static var replicates: Bool { get }
    /// True when it attaches a program to its interface's XDP hook, which holds one program: two
    /// such kinds cannot share an interface.
    static var holdsXDPHook: Bool { get }
    /// True when it routes QUIC datagrams by connection ID (`quic_lb`); a listener of another
    /// kind with `quic_lb` is refused at validation, naming the key.
    static var routesQUIC: Bool { get }
    /// Checks its own keys of `listener` (`listeners[index]` of `config`, at `path`): throws the
    /// first problem, naming its key and line. Runs after the checks every kind shares.
    static func validate(_ listener: Listener, index: Int, path: String, of config: FanoutConfig, localAddresses: Set<IPAddress>) throws(ConfigError)
    /// Checks across its listeners (after each was checked alone).
    static func validateTogether(_ config: FanoutConfig) throws(ConfigError)
    /// Its keys that `listener` sets where they have no effect, besides its settings (which the
    /// settings table warns about), before the warnings every kind shares.
    static func warnings(_ listener: Listener, path: String, of config: FanoutConfig) -> [ConfigWarning]
    /// Why a discovered `downstream` cannot be a member of `listener`, which has `accepted`
    /// members so far (nil: it can). The discovered address is then skipped, with this reason.
    static func memberProblem(_ downstream: Downstream, of listener: Listener, accepted: Int) -> String?
    /// What `--check` finds for `listener` (`listeners[index]` of a validated configuration)
    /// without binding, loading or attaching anything: problems (the file cannot start here as it
    /// is; each naming the key and the fix) and notes (worth knowing, not in the way).
    static func preflight(_ listener: Listener, index: Int) -> (problems: [String], notes: [String])
    /// What it logs beyond "listener downstream set changed" when `listener` applied a new
    /// set of `downstreams` because of `cause` (a discovery kind, `health`).
    static func membershipApplied(_ listener: Listener, cause: String, downstreams: Int, logger: Logger)
    /// Starts the running instance of `listener` (not yet steering its bind:
    /// ``RunningListener/activate()`` follows). A failure is thrown as ``DaemonError/listener(name:_:)``.
    func start(_ listener: Listener, _ context: ListenerContext) throws(DaemonError) -> any RunningListener
    /// How a running instance of `old` makes way when a change starts `fresh` (new or changed
    /// listeners of every kind). Default: it runs on beside its successor until that one took
    /// its bind over.
    func succession(of old: Listener, fresh: [Listener]) -> Succession
    /// True when its instances receive on a socket group of their bind: a successor on an
    /// overlapping bind takes the group over, and one that cannot fall back to the kernel's hash
    /// over its sockets. False (tc_ebpf): it steers by a map entry and has no socket on the bind.
    var receivesOnBind: Bool { get }
    /// True when its instances hand over: a retiring one drains its sessions
    /// (``RunningListener/handOver(drainSecs:drained:)``) once a successor of a kind that also
    /// drains (relay is the only one), with eBPF steering, took exactly its bind over; while no
    /// such successor steers that bind any more, a drain still going on there ends.
    var drainsOnHandOver: Bool { get }
    /// Exposition text of what the kind counts beyond its listeners (empty: nothing).
    func metricsText() -> String
    /// Once `config` is in force (at start, and after each reload that applied): what the kind
    /// says of its listeners of it together (relay: whether the limits hold their session
    /// tables). Default: nothing.
    func applied(_ config: FanoutConfig, logger: Logger)
}

extension ListenerKind {
    static var withoutWorkers: String? { nil }
    static func warnings(_ listener: Listener, path: String, of config: FanoutConfig) -> [ConfigWarning] { [] }
    static var attachesToInterface: Bool { false }
    static var bindsPerInterface: Bool { false }
    static var replicates: Bool { false }
    static var holdsXDPHook: Bool { false }
    static var routesQUIC: Bool { false }
    static func validateTogether(_ config: FanoutConfig) throws(ConfigError) {}
    static func memberProblem(_ downstream: Downstream, of listener: Listener, accepted: Int) -> String? { nil }
    static func membershipApplied(_ listener: Listener, cause: String, downstreams: Int, logger: Logger) {}
    static func preflight(_ listener: Listener, index: Int) -> (problems: [String], notes: [String]) { ([], []) }
    func succession(of old: Listener, fresh: [Listener]) -> Succession { .besideSuccessor }
    var receivesOnBind: Bool { true }
    var drainsOnHandOver: Bool { false }
    func metricsText() -> String { "" }
    func applied(_ config: FanoutConfig, logger: Logger) {}
}

/// How an old instance makes way for the listeners a change starts.
enum Succession: Sendable {
    /// Runs beside its successor, which takes its bind over (a socket group's steering, or a map
    /// entry written over its own); it stops after, forwarding what it still holds.
    case besideSuccessor
    /// Stops before its successor starts (what it holds can be held once only); `warning` says
    /// what that costs, logged with the listener and its interface.
    case stopFirst(warning: Logger.Message)
    /// Gives up its interface (``RunningListener/releaseInterface()``) before its successor
    /// starts, still receiving on its bind until the successor took it over.
    case releaseFirst
}

/// What the daemon gives a kind to start a listener with.
struct ListenerContext: Sendable {
    /// The listener's counters (kept across its instances while its mode stays).
    let counters: ListenerCounters
    let logger: Logger
    /// Passive health: a downstream refused a datagram (ICMP port unreachable on a send).
    let refused: @Sendable (SocketAddress) -> Void
    /// What the kind keeps across the listener's instances (reloads), made once per name and type.
    let kept: KeptState
    /// The service manager's descriptor store: what a previous process handed over, and where
    /// the listener's own descriptors go for the next one.
    let descriptors: DescriptorStore
}

/// State kinds keep across a listener's instances, by listener name and type.
final class KeptState: Sendable {
    private struct Key: Hashable {
        let type: ObjectIdentifier
        let listener: String
    }
    private let values = Mutex<[Key: any Sendable]>([:])

    /// The value kept for `listener` of type `T`, made by `make` the first time (under the
    /// lock: `make` must not call back into this).
    func value<T: Sendable>(_ listener: String, make: () -> T) -> T {
        values.withLock { values in
            let key = Key(type: ObjectIdentifier(T.self), listener: listener)
            if let existing = values[key] as? T { return existing }
            let made = make()
            values[key] = made
            return made
        }
    }
}

/// The kinds this daemon runs, in the order their ``ListenerKind/serves(_:)`` is asked.
struct ListenerKinds: Sendable {
    /// Every kind, for what needs no running daemon (validation, warnings). A new kind is one
    /// line here and one in ``init(logger:)``.
    static let types: [any ListenerKind.Type] = [TCKind.self, XDPKind.self, AFXDPKind.self, RelayKind.self, UserspaceKind.self]

    /// The kinds' settings tables, each in its kind's folder (``SettingKey``): a new table is one
    /// line here. Their order is the order of the warnings (a kind's own keys, then those of
    /// the listener's shape).
    static let settingTables: [[SettingKey]] = [TCSettings.keys, AFXDPSettings.keys, UserspaceSettings.keys, RelaySettings.keys, SharedSettings.keys]

    /// Every setting of the tables once, in the reference's order: the parser reads them in
    /// it and an unknown key's error lists them in it (``SettingsTable/keys``).
    static let settingsOrder = [
        "max_packet_size", "batch_size", "workers", "pin_cpus", "recv_buf_size", "tc_attach", "worker_steering", "resolve_interval_secs",
        "output", "xdp_mode", "queues", "umem_frame_size", "umem_frames", "ring_size", "zero_copy", "busy_poll", "busy_wait_us",
        "max_associations", "reply_interfaces", "max_sessions", "session_idle_secs", "io_uring", "drain_secs", "flow_templates",
    ]

    let all: [any ListenerKind]
    /// tc_ebpf and xdp listeners are entries in one tc program's maps.
    let tc: TCDataplane

    init(logger: Logger, descriptors: DescriptorStore? = nil) {
        let tc = TCDataplane(logger: logger, descriptors: descriptors)
        self.tc = tc
        all = [TCKind(dataplane: tc), XDPKind(dataplane: tc, front: XDPFront(logger: logger, descriptors: descriptors)), AFXDPKind(), RelayKind(), UserspaceKind()]
    }

    /// The kind of a listener of a validated configuration: every mode has exactly one
    /// (ConfigTests checks each mode and replies pair).
    func kind(for listener: Listener) -> any ListenerKind {
        guard let kind = all.first(where: { Swift.type(of: $0).serves(listener) }) else {
            preconditionFailure("no listener kind serves mode \(listener.mode.rawValue) (replies \(listener.replies.rawValue)): register one in ListenerKinds")
        }
        return kind
    }

    /// Whether `listener`'s kind attaches to its interface's XDP hook.
    static func holdsXDPHook(_ listener: Listener) -> Bool {
        type(for: listener)?.holdsXDPHook ?? false
    }

    /// The kind of `listener`, nil if none serves its mode.
    static func type(for listener: Listener) -> (any ListenerKind.Type)? {
        types.first { $0.serves(listener) }
    }

    /// Every kind's own exposition text, in registry order.
    func metricsText() -> String {
        all.map { $0.metricsText() }.joined()
    }
}

/// Checks more than one kind makes.
enum SharedChecks {
    /// A socket-group listener (userspace, relay): its way out is a socket or a raw socket, and
    /// two-way in the kernel is tc_ebpf's.
    static func socketGroup(_ listener: Listener, path: String, of config: FanoutConfig) throws(ConfigError) {
        if listener.settings.output == .xdpTX {
            throw config.configError("\(path).settings.output", "xdp_tx needs mode af_xdp (it transmits from the AF_XDP ring); userspace mode offers socket or preserve_source")
        }
        try sourcePreservingFamilies(listener, path: path, of: config)
        if listener.replies == .nat { throw natNeedsTC(path: path, of: config) }
    }

    /// A socket-group listener's keys that have no effect there (besides its settings).
    static func socketGroupWarnings(_ listener: Listener, path: String, of config: FanoutConfig) -> [ConfigWarning] {
        guard config.lines.isSet("\(path).interface") else { return [] }
        return [config.configWarning("\(path).interface", "not used in mode userspace (the socket receives on every interface that routes to the bind address)")]
    }

    /// A source-preserving way out (userspace or af_xdp) keeps the client's address: a client of
    /// the bind's family cannot be sent to a downstream of the other (every datagram would be
    /// dropped). The same for each pool with its own way out.
    static func sourcePreservingFamilies(_ listener: Listener, path: String, of config: FanoutConfig) throws(ConfigError) {
        guard !FanoutConfig.isUnspecified(listener.bind.ip) else { return }
        let groups = [(path, listener.settings.output, listener.downstreams, "output")]
            + listener.pools.enumerated().map { ("\(path).pools[\($0)]", $1.output ?? listener.settings.output, $1.downstreams, $1.output == nil ? "the listener's output" : "output") }
        for (groupPath, output, downstreams, key) in groups where output != .socket {
            for (position, downstream) in downstreams.enumerated() where downstream.address.ip.family != listener.bind.ip.family {
                throw config.configError("\(groupPath).downstream[\(position)].address", "\(downstream.address) is not of the listener's address family (\(listener.bind)): \(key) \(output.rawValue) keeps the client's source address, which cannot reach a downstream of the other family; use output: socket or a downstream of the same family")
            }
        }
    }

    /// `replies: nat` on a kind that does not rewrite in the kernel.
    static func natNeedsTC(path: String, of config: FanoutConfig) -> ConfigError {
        config.configError("\(path).replies", "nat rewrites both directions in the kernel: it needs mode tc_ebpf or xdp (mode userspace offers replies: relay; af_xdp has no two-way path in this release)")
    }

    /// `replies: relay` on a kind that has no userspace sessions.
    static func relayNeedsUserspace(path: String, of config: FanoutConfig) -> ConfigError {
        config.configError("\(path).replies", "relay uses session sockets in userspace: it needs mode userspace (mode tc_ebpf offers replies: nat)")
    }
}

