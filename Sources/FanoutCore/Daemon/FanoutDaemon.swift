// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import BPFSupport
import Logging
import ReusePortLB
import Synchronization

/// Why the daemon could not start.
package enum DaemonError: Error, CustomStringConvertible {
    /// A listener's kind could not start it (the error names what and the fix).
    case listener(name: String, any Error)
    case output(name: String, OutboxError)
    case metrics(SocketAddress, any Error)
    /// A failure a test injected at one step of a change (``FanoutDaemon/failureInjection``).
    case injected(name: String, step: TransitionStep)

    package var description: String {
        switch self {
        case .listener(let name, let error): return "listener '\(name)' could not start: \(error)"
        case .output(let name, let error): return "listener '\(name)' could not start: \(error)"
        case .metrics(let address, let error):
            return "metrics server error: cannot serve on \(address): \(error); free that port or set metrics.bind to another address"
        case .injected(let name, let step): return "listener '\(name)': failure injected by a test at step \(step.rawValue)"
        }
    }
}

/// A running listener of any mode.
protocol RunningListener: AnyObject, Sendable {
    /// Ready to forward (userspace: every worker is in its receive loop).
    var isReceiving: Bool { get }
    /// Takes over the steering of its bind (userspace: its group's program, so a previous
    /// instance on the bind gets nothing new); nothing for tc_ebpf, which steers once registered.
    func activate() throws(DaemonError)
    /// True when ``activate()`` steers every new datagram away from a previous instance on the
    /// bind (eBPF). Classic BPF picks sockets by position, where the previous instance's come
    /// first: such a listener is activated only after its predecessor stopped.
    var takesOverExactly: Bool { get }
    /// Swaps the downstreams, balancing and replication pools in place, without losing datagrams.
    /// `downstreams` holds every group's available members (a pool's carry its name).
    /// - Parameter keeping: names of members that get nothing now (health took them out) whose
    ///   counters stay.
    /// - Returns: false if the new set could not be applied (the previous one stays, logged).
    func update(downstreams: [Downstream], balancing: Balancing, quicLB: [QUICLBConfiguration], pools: [Pool], keeping: Set<String>) -> Bool
    /// Stops forwarding and releases everything the listener holds.
    func shutdown()
    /// Stops because another instance on its bind receives from now on (a successor that took
    /// the bind over, or, in a rollback, the predecessor that took it back): a socket-group
    /// listener's workers seal their sockets before their last read, so their close loses
    /// nothing (``ReusePortMember/seal()``). Others stop as ``shutdown()``.
    func retire()
    /// What the systemd watchdog checks (``WatchdogJudge``): each worker's progress counter,
    /// or whether the tc program is still attached.
    func heartbeats() -> [PathHeartbeat]
    /// Gives up what only one instance can hold (af_xdp: the interface's XDP hook and queues)
    /// while still receiving on its bind, so a successor can take it over; ``shutdown()`` follows.
    func releaseInterface()
    /// Stops in favour of a successor that took its bind over. A relay listener drains its
    /// sessions in the background first (relaying replies for the successor's `drainSecs`,
    /// counting later ones) and calls `drained` when done, telling whether its
    /// ``shutdown()`` cut the drain short (returns true); any other stops now (returns false).
    func handOver(drainSecs: Int, drained: @escaping @Sendable (_ cutShort: Bool) -> Void) -> Bool
    /// A two-way listener's associations (nat) or sessions (relay), at most `limit`, and how
    /// many there are in all; nil for a one-way listener.
    func associations(limit: Int) -> (entries: [AssociationEntry], total: Int)?
}

extension RunningListener {
    func releaseInterface() {}
    func retire() { shutdown() }
    func handOver(drainSecs: Int, drained: @escaping @Sendable (_ cutShort: Bool) -> Void) -> Bool {
        retire()
        return false
    }
    func associations(limit: Int) -> (entries: [AssociationEntry], total: Int)? { nil }
}

/// udp-fanout's engine: runs the listeners of a configuration, reloads it, serves metrics.
/// Driven in-process by tests and benchmarks; the executable is a thin command line around it.
public final class FanoutDaemon: Sendable {
    struct State {
        var config: FanoutConfig
        var listeners: [String: any RunningListener] = [:]
        var counters: [String: ListenerCounters] = [:]
        /// How a reload reaches the running ``StatusEndpointService`` (nil until it runs).
        var endpoint: AsyncStream<Metrics>.Continuation?
        /// Listeners of the configuration in force that are not running: stopped for a change
        /// that failed and could not be started again. `/readyz` is false while any is.
        var lost: Set<String> = []
        /// What discovery found, per listener.
        var discovered: [String: Discovered] = [:]
        /// Each listener's members (configured and discovered) and the available set last applied.
        var members: [String: [Downstream]] = [:]
        var applied: [String: [Downstream]] = [:]
        /// Why discovered addresses were left out, per listener (logged when it changes).
        var skipped: [String: [String]] = [:]
        /// Health targets that probes (or passive health) found down.
        var down: Set<SocketAddress> = []
        /// How a reload reaches the running ``DiscoveryService`` (nil until it runs).
        var discovery: AsyncStream<[DiscoverySpec]>.Continuation?
        /// The last discovery error per listener, for `/readyz` while its first discovery is pending.
        var discoveryErrors: [String: String] = [:]
        /// Discovery sources of the configuration in force that have answered at least once.
        var answered: Set<DiscoverySpec> = []
        /// Set by ``shutdown()``: `/readyz` says so.
        var stopping = false
        /// Set when a stop or a drain withdrew the announced addresses and serves what still
        /// arrives for `announce.drain_secs` (``ForwardingService``): `/readyz` says so.
        var draining = false
        /// A drain was asked for (SIGUSR2): the stop that follows says so.
        var drainRequested = false
        /// Listeners the last failed change stopped first and started again (their datagrams
        /// meanwhile reached no socket of ours): its rejection says so.
        var interrupted: [String] = []
        /// Relay instances replaced by a successor on their bind whose sessions still drain
        /// (``RunningListener/handOver(drainSecs:drained:)``), with their listener's name and bind: their
        /// counters stay in /metrics meanwhile, and ``shutdown()`` ends their drain.
        var handingOver: [ObjectIdentifier: HandedOver] = [:]
    }

    struct HandedOver {
        var name: String
        var bind: SocketAddress
        var instance: any RunningListener
    }

    let configPath: String?
    let logger: Logger
    let state: Mutex<State>
    let reloadsOK = Atomic<UInt64>(0)
    let reloadsRejected = Atomic<UInt64>(0)
    /// Why the last reload was rejected (systemd's STATUS= line says it).
    let lastRejection = Mutex<String?>(nil)
    let membershipUpdates = Atomic<UInt64>(0)
    /// Downstream set changes a running listener could not apply (tc_ebpf map writes).
    let membershipFailures = Atomic<UInt64>(0)
    /// The listener kinds; every listener is started and replaced through its kind.
    let kinds: ListenerKinds
    /// `settings.flow_templates` across a restart: each listener's templates in the service
    /// manager's store.
    let templateHandOver: TemplateHandOver
    /// Where the forwarding threads note what they hold, so the next process counts what a crash
    /// took (``CrashLedger``); nil when no service manager keeps descriptors.
    let crashLedger: CrashLedger?
    /// What kinds keep across a listener's instances (af_xdp: its ring and XDP counters).
    private let kept = KeptState()
    /// Serialises every change of the running listeners: reloads and membership updates.
    let changes = Mutex<Void>(())
    /// Active and passive health of every member (a service of its own in the ServiceGroup).
    public let health: HealthChecker
    /// The forwarding path's last check (``WatchdogService``): what `/healthz` answers.
    package let path = PathMonitor()
    /// Tests only (nil in production): asked at each step of a change's transaction with the
    /// listener's name; true fails that step as a real failure there would, so a test reaches
    /// every rollback path (``TransitionStep``).
    let failureInjection = Mutex<(@Sendable (TransitionStep, String) -> Bool)?>(nil)
    /// The service manager's descriptor store (``DescriptorStore``).
    package let descriptors: DescriptorStore
    /// Publishes the `announce` addresses to the routing daemon while they are ready (docs/fleet.md).
    package let announcer: RouteAnnouncer
    /// Metrics of the running discovery watchers, by spec.
    let discoveryMetrics = Mutex<[DiscoverySpec: @Sendable () -> String]>([:])

    /// - Parameters:
    ///   - config: a validated configuration.
    ///   - configPath: the file SIGHUP reloads (nil: reload takes text only).
    ///   - logger: where the engine and its listeners log (the executable's, with `--log-format`).
    ///   - descriptors: what the service manager handed over and where descriptors go for the
    ///     next process (``DescriptorStore/fromEnvironment(notifier:logger:)``); nil: nothing
    ///     handed over or stored.
    public convenience init(config: FanoutConfig, configPath: String?, logger: Logger, descriptors: DescriptorStore? = nil) {
        self.init(config: config, configPath: configPath, logger: logger, descriptors: descriptors, routes: nil)
    }

    /// The same, with `routes`: where announced addresses go (tests give their own; nil: the
    /// kernel's tables).
    package init(config: FanoutConfig, configPath: String?, logger: Logger, descriptors: DescriptorStore? = nil, routes: (any HostRoutes)?) {
        self.configPath = configPath
        self.logger = logger
        announcer = RouteAnnouncer(routes: routes ?? KernelHostRoutes(), logger: logger)
        self.descriptors = descriptors ?? .none(logger: logger)
        state = Mutex(State(config: config))
        kinds = ListenerKinds(logger: logger, descriptors: self.descriptors)
        templateHandOver = TemplateHandOver(descriptors: self.descriptors, logger: logger)
        crashLedger = CrashLedger.open(descriptors: self.descriptors, logger: logger)
        let link = HealthLink()
        health = HealthChecker(policy: HealthPolicy(config.health), probing: config.health.enabled, logger: logger) { target, up in link.forward(target, up) }
        link.connect { [weak self] target, up in self?.healthChanged(target, up: up) }
    }

    /// Starts every listener. On failure stops what started. The HTTP endpoint is a service of
    /// its own: ``StatusEndpointService``.
    package func start() throws(DaemonError) {
        let config = state.withLock { $0.config }
        var byMode: [String: Int] = [:]
        for listener in config.listeners { byMode[listener.mode.rawValue, default: 0] += 1 }
        logger.info("configured listeners by mode", metadata: byMode.mapValues { "\($0)" })
        for warning in config.warnings() { logger.warning("\(warning)") }
        // Under a service manager, a start that fails half way hands over what it took over and
        // made (fail static): every listener it started and rolls back leaves the kernel maps and
        // the stored descriptors as they are, and the plan in them forwards until a start
        // succeeds or the unit is stopped.
        descriptors.handingOverWhile(starting: true)
        do {
            try transition(to: config, from: FanoutConfig(listeners: []))
        } catch {
            shutdown()
            throw error
        }
        descriptors.handingOverWhile(starting: false)
        for kind in kinds.all { kind.applied(config, logger: logger) }
        templateHandOver.start { [weak self] in self?.templateStates() ?? [:] }
        // Every listener is in the tc program's maps: links taken over from the previous
        // process run this process's program from now on.
        kinds.tc.completeAdoptions()
        // Handed over for a bind this configuration does not have: closed, counted, logged.
        descriptors.closeUnused()
        crashLedger?.commit()
    }

    /// Makes the running instance of one listener (not yet steering its bind: see
    /// ``RunningListener/activate()``).
    func makeListener(_ listener: Listener) throws(DaemonError) -> any RunningListener {
        // Here, not in the transaction: a rollback's restart of the old instance is a start too.
        try failIfInjected(.start, listener.name)
        let ledger = crashLedger
        let counters = state.withLock { state in
            if let existing = state.counters[listener.name], existing.mode == listener.mode.rawValue { return existing }
            let made = ListenerCounters(name: listener.name, mode: listener.mode.rawValue, ledger: ledger)
            state.counters[listener.name] = made
            return made
        }
        // What the previous process's threads of this listener held when it crashed (replies
        // only where they are exported: a listener that still relays).
        if let held = crashLedger?.takeInherited(listener.name, countsReplies: listener.replies == .relay) {
            counters.drop(.crash, held.requests)
            if held.replies > 0 && listener.replies == .relay { counters.relayCounters().crash.wrappingAdd(held.replies, ordering: .relaxed) }
        }
        // The previous process's templates, before the kind's threads read the state.
        if let templates = counters.flowTemplates(listener) {
            templateHandOver.adopt(listener.name, into: templates, setInForce: listener.mode == .tcEBPF || listener.mode == .xdp)
        }
        // A way out that cannot work (preserve_source without CAP_NET_RAW) fails the start, named.
        do {
            // One of each family the listener sends to (a raw socket per family).
            // Each replication pool's way out too.
            let groups = [(listener.settings.output, listener.downstreams)] + listener.pools.map { ($0.output ?? listener.settings.output, $0.downstreams) }
            for (output, downstreams) in groups {
                var families: [Int32: SocketAddress] = [listener.bind.ip.family: listener.bind]
                for downstream in downstreams { families[downstream.address.ip.family] = downstream.address }
                for address in families.values { try Outboxes.check(output, address) }
            }
        } catch {
            throw .output(name: listener.name, error)
        }
        // Passive health: ICMP port unreachable on a send counts as a failed probe.
        let name = listener.name
        let context = ListenerContext(counters: counters, logger: logger, refused: { [weak self] address in
            self?.downstreamRefused(address, listener: name)
        }, kept: kept, descriptors: descriptors)
        return try kinds.kind(for: listener).start(listener, context)
    }

    /// Holds the change lock for the whole step, then gives the health checker the new policy
    /// before the new targets (a target must never be probed with a protocol it was not
    /// configured for).
    private func transition(to new: FanoutConfig, from old: FanoutConfig) throws(DaemonError) {
        try changes.withLock { _ throws(DaemonError) in try transitionChangesHeld(to: new, from: old) }
    }

    private func transitionChangesHeld(to new: FanoutConfig, from old: FanoutConfig) throws(DaemonError) {
        // A listener a reload removed: its sockets leave the service manager's store with it; a
        // change that failed and was rolled back leaves none of the new one's there either.
        func keepSockets(of config: FanoutConfig) {
            descriptors.forgetSockets(except: Set(config.listeners.filter { UserspaceKind.serves($0) || RelayKind.serves($0) || AFXDPKind.serves($0) }.map { DescriptorStore.socketName($0.bind) }))
        }
        do {
            try transitionLocked(to: new, from: old)
        } catch {
            // (Not at the first start: what it stored stays for the next attempt.)
            if !old.listeners.isEmpty { keepSockets(of: old) }
            throw error
        }
        keepSockets(of: new)
        // Disabled: no targets; the policy of a disabled section is not applied (nothing to probe).
        if new.health.enabled { health.setPolicy(HealthPolicy(new.health)) }
        updateHealthTargetsChangesHeld()
    }

    /// Called by ``StatusEndpointService`` when it runs: reloads that change the `metrics`
    /// section are sent to `changes`.
    /// - Returns: the section in force now.
    func attachEndpoint(_ changes: AsyncStream<Metrics>.Continuation) -> Metrics {
        state.withLock { state in
            state.endpoint = changes
            return state.config.metrics
        }
    }

    /// The path the endpoint serves the Prometheus text on (read per request, so a reload that
    /// changes only the path takes effect at once).
    var metricsPath: String { state.withLock { $0.config.metrics.path } }

    /// True once every listener's workers are in their receive loops.
    package var isReady: Bool { readiness.isEmpty }

    /// Why the daemon is not ready, one line per problem (empty: ready): a listener lost in a
    /// failed change, not yet receiving, waiting for its first discovery, or with no available
    /// downstream.
    package var readiness: [String] {
        state.withLock { state in
            let (all, byListener) = Self.readiness(state)
            guard all.isEmpty else { return all }
            let lost = state.lost.sorted().flatMap { byListener[$0] ?? [] }
            return lost + state.config.listeners.filter { !state.lost.contains($0.name) }.flatMap { byListener[$0.name] ?? [] }
        }
    }

    /// What keeps every listener from being ready (stopping, draining), and why each listener is
    /// not ready (no entry: ready).
    static func readiness(_ state: State) -> (all: [String], byListener: [String: [String]]) {
        if state.stopping { return (["udp-fanout is stopping"], [:]) }
        if state.draining { return (["udp-fanout is draining: its addresses are withdrawn, it serves what still arrives, then stops"], [:]) }
        var reasons: [String: [String]] = [:]
        for name in state.lost { reasons[name] = ["listener '\(name)' is not running: a change failed and it could not be started again"] }
        for listener in state.config.listeners where !state.lost.contains(listener.name) {
            let pending = Membership.pending(listener, state.discovered[listener.name] ?? Discovered())
            if !pending.isEmpty {
                let error = state.discoveryErrors[listener.name].map { " (last error: \($0))" } ?? ""
                reasons[listener.name] = ["listener '\(listener.name)': \(pending.joined(separator: "; "))\(error)"]
            } else if state.listeners[listener.name]?.isReceiving != true {
                reasons[listener.name] = ["listener '\(listener.name)' is not receiving yet"]
            } else if (state.applied[listener.name] ?? []).allSatisfy({ $0.weight == 0 || $0.pool != nil }) {
                // The listener's own downstreams (a replication pool without members is counted, not unready).
                let members = state.members[listener.name]?.filter { $0.pool == nil }.count ?? 0
                reasons[listener.name] = ["listener '\(listener.name)' has no healthy downstream (\(members) member(s), all down or none discovered): its datagrams are dropped and counted in udp_fanout_packets_no_healthy_total"]
            }
        }
        return ([], reasons)
    }

    /// The `announce` section in force and, per address, why it must not be announced now
    /// (empty: every listener receiving on it is ready). Stricter than `/readyz`: with health
    /// checks on, a listener counts only once one of its downstreams passed a probe (a node must
    /// not join before it knows it can forward), and a socket listener's address must be local
    /// (`isLocal`; kernel kinds take their datagrams before routing).
    package func announcementReasons(isLocal: (IPAddress) -> Bool? = { _ in true }) -> (settings: Announce?, reasons: [IPAddress: [String]]) {
        let proven = health.provenUp()
        // The proof is asked before an address joins: one announced stays while its downstreams
        // change (new targets start unproven) and health takes the down ones out.
        let announced = Set(announcer.snapshot().filter(\.entry.announced).map(\.address))
        let (settings, socketServed, reasons) = state.withLock { state -> (Announce?, Set<IPAddress>, [IPAddress: [String]]) in
            guard let settings = state.config.announce else { return (nil, [], [:]) }
            var (all, byListener) = Self.readiness(state)
            if state.drainRequested { all.append("a drain was asked for (SIGUSR2, udp-fanout drain)") }
            var reasons: [IPAddress: [String]] = [:]
            var socketServed = Set<IPAddress>()
            for address in settings.addresses {
                let serving = FanoutConfig.listeners(serving: address, in: state.config.listeners)
                guard !serving.isEmpty else {
                    reasons[address] = ["no listener receives on it"]
                    continue
                }
                var why = all + serving.flatMap { byListener[$0.name] ?? [] }
                for listener in serving {
                    if ListenerKinds.type(for: listener)?.bindsPerInterface != true { socketServed.insert(address) }
                    guard state.config.health.enabled, byListener[listener.name] == nil, !announced.contains(address) else { continue }
                    let own = (state.applied[listener.name] ?? []).filter { $0.pool == nil && $0.weight > 0 }
                    if !own.contains(where: { proven.contains($0.healthTarget) }) {
                        why.append("listener '\(listener.name)': none of its downstreams has passed a health probe yet")
                    }
                }
                reasons[address] = why
            }
            return (settings, socketServed, reasons)
        }
        var checked = reasons
        for address in socketServed where checked[address]?.isEmpty == true {
            switch isLocal(address) {
            case true?: break
            case false?: checked[address] = ["\(address) is not local on this node (no address or local route for it): a socket listener would never receive what routers send to it; add it to lo (or ip route add local \(address) dev lo table local)"]
            case nil: checked[address] = ["could not look up whether \(address) is local on this node"]
            }
        }
        return (settings, checked)
    }

    /// Brings the announced routes in line with readiness now (``RouteAnnouncer``); `verify`
    /// also compares them with the kernel's table.
    package func reconcileAnnouncements(verify: Bool = false) {
        let (settings, reasons) = announcementReasons(isLocal: KernelHostRoutes.isLocal)
        announcer.apply(settings, reasons, now: WallClock.seconds())
        if verify { announcer.verify(settings) }
    }

    /// The Prometheus text of every listener's counters.
    package func metricsText() -> String {
        let counters = state.withLock { state in
            // A handed-over relay instance that still drains under a name no longer configured
            // (a rename) keeps that name's series until it stops.
            let names = state.config.listeners.map(\.name)
            let draining = Set(state.handingOver.values.map(\.name)).subtracting(names).sorted()
            return (names + draining).compactMap { state.counters[$0] }
        }
        var text = PrometheusText.render(counters, reloads: (reloadsOK.load(ordering: .relaxed), reloadsRejected.load(ordering: .relaxed)))
        text += kinds.metricsText()
        text += PrometheusText.merge(counters.compactMap { $0.modeMetrics.withLock { $0 }?() })
        text += membershipMetrics()
        text += lostListenersMetrics()
        text += health.metricsText()
        text += announcer.metricsText()
        text += PrometheusText.merge(discoveryMetrics.withLock { $0 }.sorted { "\($0.key)" < "\($1.key)" }.map { $0.value() })
        text += ProcessMetrics.text()
        return text
    }

    /// The counters of one listener (tests and benchmarks read them directly).
    package func counters(of listener: String) -> ListenerCounters.Snapshot? {
        state.withLock { $0.counters[listener] }?.snapshot()
    }

    /// Reloads: parses and validates `text` (default: the config file), then applies it in one
    /// transactional step (see ``transition(to:from:)``). A file that is invalid, or valid but
    /// cannot be applied (a bind taken, an interface missing, an attach refused), is rejected:
    /// counted `result="rejected"`, the reason logged, and the running configuration stays
    /// exactly as it was; a later reload tries again.
    /// - Returns: true if the new configuration is in force.
    @discardableResult
    package func reload(text: String? = nil) -> Bool {
        let new: FanoutConfig
        do {
            let source = try text ?? readFile(configPath ?? "")
            new = try ConfigParser.parse(source)
            try new.validate()
        } catch {
            return rejected("configuration reload rejected; keeping the running configuration", error)
        }
        for warning in new.warnings() { logger.warning("\(warning)") }
        // One reload at a time, and none while discovery or health changes a set.
        return changes.withLock { _ in reloadChangesHeld(new) }
    }

    /// Counts a rejected reload and logs why. - Returns: false.
    private func rejected(_ message: Logger.Message, _ error: Any) -> Bool {
        reloadsRejected.wrappingAdd(1, ordering: .relaxed)
        logger.error(message, metadata: ["error": "\(error)"])
        lastRejection.withLock { $0 = "\(error)" }
        return false
    }

    private func reloadChangesHeld(_ new: FanoutConfig) -> Bool {
        let old = state.withLock { $0.config }
        if new.health.enabled && new.health.proto == "icmp" && !(old.health.enabled && old.health.proto == "icmp") {
            // The probe loop would stop on its first round (and the daemon with it): refuse now.
            do {
                _ = try ICMPProbeSocket.open(family: AF_INET)
            } catch {
                return rejected("configuration reload rejected: it could not be applied; keeping the running configuration", "health.protocol icmp: \(error)")
            }
        }
        state.withLock { $0.interrupted = [] }
        do {
            try transitionChangesHeld(to: new, from: old)
        } catch {
            // Only what is true: a listener the rollback could not start again is not kept.
            let (lost, interrupted) = state.withLock { ($0.lost, $0.interrupted) }
            guard lost.isEmpty else {
                return rejected("configuration reload rejected: it could not be applied; the running configuration stays in force, but listeners of it could not be started again and are not running (not ready; the next reload that applies starts them)",
                                "\(error); not running: \(lost.sorted().map { "'\($0)'" }.joined(separator: ", "))")
            }
            // A listener stopped first for the change (tc_attach) ran again, after a gap.
            guard interrupted.isEmpty else {
                let names = interrupted.sorted().map { "'\($0)'" }.joined(separator: ", ")
                return rejected("configuration reload rejected: it could not be applied; the running configuration is in force again, but \(interrupted.count == 1 ? "listener \(names) was" : "listeners \(names) were") stopped for it and started again: datagrams that arrived in between reached no socket of ours (the host's Udp NoPorts counts them)",
                                error)
            }
            return rejected("configuration reload rejected: it could not be applied; keeping the running configuration", error)
        }
        _ = state.withLock { $0.discovery }?.yield(DiscoverySources.all(new))
        if old.metrics != new.metrics {
            // The endpoint service binds the new address before it closes the old one; if that
            // bind fails it keeps the old one and logs it. Listeners are reloaded either way.
            _ = state.withLock { $0.endpoint }?.yield(new.metrics)
        }
        reloadsOK.wrappingAdd(1, ordering: .relaxed)
        for kind in kinds.all { kind.applied(new, logger: logger) }
        logger.info("configuration loaded", metadata: ["listeners": "\(new.listeners.count)", "reload": "true"])
        return true
    }

    /// Stops every listener (each forwards what its sockets hold, then leaves its group).
    /// Idempotent. The HTTP endpoint stops with its own service (graceful shutdown of the
    /// `ServiceGroup`, or cancellation of its task); meanwhile `/readyz` answers 503.
    package func shutdown() {
        // Not while a membership change or reload is writing to a listener.
        changes.withLock { _ in shutdownChangesHeld() }
    }

    private func shutdownChangesHeld() {
        let listeners = state.withLock { state in
            state.stopping = true
            defer { state.listeners = [:] }
            return Array(state.listeners.values) + state.handingOver.values.map(\.instance)
        }
        for listener in listeners { listener.shutdown() }
        // What the stopped listeners learnt last (a kernel kind's ring buffer consumed at its stop).
        templateHandOver.finish(states: templateStates())
    }

    /// Every listener's flow templates (`settings.flow_templates` on), by name.
    private func templateStates() -> [String: FlowTemplateState] {
        state.withLock { $0.counters }.compactMapValues { $0.flowTemplateState.withLock { $0 } }
    }
}


/// Reads a whole file as UTF-8.
package func readFile(_ path: String) throws(ConfigError) -> String {
    guard let file = fopen(path, "r") else {
        throw ConfigError("--config", "cannot read \(path): \(String(decoding: Array(String(cString: strerror(errno)).utf8), as: UTF8.self))")
    }
    defer { fclose(file) }
    var bytes: [UInt8] = []
    var buffer = [UInt8](repeating: 0, count: 65536)
    while true {
        let count = fread(&buffer, 1, buffer.count, file)
        if count <= 0 { break }
        bytes += buffer[0..<count]
    }
    // fopen opens a directory; reading it fails with EISDIR (not an empty file).
    if ferror(file) != 0 {
        throw ConfigError("--config", "cannot read \(path): \(String(decoding: Array(String(cString: strerror(errno)).utf8), as: UTF8.self))")
    }
    return String(decoding: bytes, as: UTF8.self)
}

/// Logs, at a start, which BPF programs `UDP_FANOUT_BPF_DIR` replaces (docs/development.md).
/// Returns what is wrong with the objects it names (``BPFObjectOverride/problems(programs:)``), which
/// `--check` refuses.
@discardableResult
package func logProgramOverride(_ logger: Logger, checking: Bool = false) -> [String] {
    guard let directory = BPFObjectOverride.directory else { return [] }
    let replaced = BPFObjectOverride.replaced()
    let objects = replaced.map { $0.split(separator: "/").last.map(String.init) ?? $0 }.joined(separator: ",")
    let loads = checking ? "would be loaded" : "loaded"
    if !BPFObjectOverride.directoryExists {
        logger.warning("\(BPFObjectOverride.variable) names no directory: the programs built into this binary are \(loads) (no upgrade to other programs)", metadata: ["directory": "\(directory)"])
    } else if replaced.isEmpty {
        logger.warning("\(BPFObjectOverride.variable) names a directory without any of udp-fanout's BPF objects (tc_fanout.bpf.o, xdp_fanout.bpf.o, xdp_steer.bpf.o, map_count.bpf.o, fanout_quic_keys.bpf.o, tc_fanout_plain.bpf.o, xdp_fanout_plain.bpf.o): the programs built into this binary are \(loads)", metadata: ["directory": "\(directory)"])
    } else {
        logger.warning("BPF programs \(loads) from \(BPFObjectOverride.variable) instead of the ones built into this binary (development): a start swaps them in on the running maps, as an upgrade does",
                       metadata: ["directory": "\(directory)", "objects": "\(objects)"])
    }
    return BPFObjectOverride.problems(programs: [
        .tcFanout: FANOUT_PROG_TC_NAME, .xdpFanout: FANOUT_PROG_XFWD_NAME, .xdpSteer: FANOUT_PROG_XDP_NAME, .mapCount: AssociationCounter.programName,
        .quicKeys: FANOUT_PROG_QUIC_KEYS_NAME, .tcFanoutPlain: FANOUT_PROG_TC_NAME, .xdpFanoutPlain: FANOUT_PROG_XFWD_NAME,
    ])
}
