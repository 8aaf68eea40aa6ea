// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
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
    func update(downstreams: [Downstream], balancing: Balancing, pools: [Pool], keeping: Set<String>) -> Bool
    /// Stops forwarding and releases everything the listener holds.
    func shutdown()
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
    func handOver(drainSecs: Int, drained: @escaping @Sendable (_ cutShort: Bool) -> Void) -> Bool {
        shutdown()
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
    private let kinds: ListenerKinds
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
    /// Metrics of the running discovery watchers, by spec.
    let discoveryMetrics = Mutex<[DiscoverySpec: @Sendable () -> String]>([:])

    /// - Parameters:
    ///   - config: a validated configuration.
    ///   - configPath: the file SIGHUP reloads (nil: reload takes text only).
    ///   - logger: where the engine and its listeners log (the executable's, with `--log-format`).
    public init(config: FanoutConfig, configPath: String?, logger: Logger) {
        self.configPath = configPath
        self.logger = logger
        state = Mutex(State(config: config))
        kinds = ListenerKinds(logger: logger)
        let link = HealthLink()
        health = HealthChecker(policy: HealthPolicy(config.health), logger: logger) { target, up in link.forward(target, up) }
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
        do {
            try transition(to: config, from: FanoutConfig(listeners: []))
        } catch {
            shutdown()
            throw error
        }
    }

    /// Makes the running instance of one listener (not yet steering its bind: see
    /// ``RunningListener/activate()``).
    private func makeListener(_ listener: Listener) throws(DaemonError) -> any RunningListener {
        // Here, not in the transaction: a rollback's restart of the old instance is a start too.
        try failIfInjected(.start, listener.name)
        let counters = state.withLock { state in
            if let existing = state.counters[listener.name], existing.mode == listener.mode.rawValue { return existing }
            let made = ListenerCounters(name: listener.name, mode: listener.mode.rawValue)
            state.counters[listener.name] = made
            return made
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
        }, kept: kept)
        return try kinds.kind(for: listener).start(listener, context)
    }

    /// Holds the change lock for the whole step, then gives the health checker the new policy
    /// before the new targets (a target must never be probed with a protocol it was not
    /// configured for).
    private func transition(to new: FanoutConfig, from old: FanoutConfig) throws(DaemonError) {
        try changes.withLock { _ throws(DaemonError) in try transitionChangesHeld(to: new, from: old) }
    }

    private func transitionChangesHeld(to new: FanoutConfig, from old: FanoutConfig) throws(DaemonError) {
        try transitionLocked(to: new, from: old)
        // Disabled: no targets; the policy of a disabled section is not applied (nothing to probe).
        if new.health.enabled { health.setPolicy(HealthPolicy(new.health)) }
        updateHealthTargetsChangesHeld()
    }

    /// Moves the running listeners from `old` to `new` in one step that either completes or
    /// leaves `old` running:
    /// 1. listeners whose bind, mode and settings are unchanged keep running (a new downstream
    ///    set or balancing is swapped in place at the end);
    /// 2. every new or changed listener is started beside the old ones, each old instance making
    ///    way as its kind says (``Succession``): most keep forwarding (a tc_ebpf successor writes
    ///    its map entry over its predecessor's); some stop first (tc_ebpf when tc_attach changes)
    ///    or give their interface up first (af_xdp);
    /// 3. if any start fails, the old listeners take their binds back, what was started is
    ///    stopped, what was stopped early or released is started again, and the error is thrown:
    ///    `old` runs on;
    /// 4. otherwise the new listeners take their binds over (from then on every new datagram
    ///    goes to them), and only then the old instances stop, forwarding what they still hold,
    ///    or, for a kind that drains on a handover (relay), drain their sessions.
    private func transitionLocked(to new: FanoutConfig, from old: FanoutConfig) throws(DaemonError) {
        // Discovered sets carry over (see Membership.carried); listeners start with their members.
        let discovered = state.withLock { state in
            Dictionary(new.listeners.map { ($0.name, Membership.carried(state.discovered[$0.name] ?? Discovered(), into: $0)) },
                       uniquingKeysWith: { first, _ in first })
        }
        let (down, appliedBefore) = state.withLock { ($0.down, $0.applied) }
        var members: [String: [Downstream]] = [:]
        var effective: [String: Listener] = [:]
        for listener in new.listeners {
            let (found, skipped) = Membership.members(listener, discovered[listener.name] ?? Discovered())
            members[listener.name] = found
            noteSkipped(listener.name, skipped)
            effective[listener.name] = listener.withMembers(Membership.available(found, down: new.health.enabled ? down : []))
        }
        let oldByName = Dictionary(old.listeners.map { ($0.name, $0) }, uniquingKeysWith: { first, _ in first })
        let running = state.withLock { $0.listeners }
        var fresh: [Listener] = []
        var inPlace: [Listener] = []
        for listener in new.listeners {
            // A listener that is not running (lost in a failed change) starts again, even unchanged.
            if let previous = oldByName[listener.name], previous.socketShape == listener.socketShape, running[listener.name] != nil {
                // Also when only the available set changed (health turned off puts every member back).
                if previous != listener || effective[listener.name]!.members != appliedBefore[listener.name] { inPlace.append(listener) }
            } else {
                fresh.append(listener)
            }
        }
        let staying = Set(new.listeners.map(\.name)).subtracting(fresh.map(\.name))
        let retiring = old.listeners.filter { !staying.contains($0.name) }

        // How each retiring instance makes way, as its kind says: most run beside their
        // successors; some stop first (what they hold can be held once: tc_ebpf's attachment
        // when tc_attach changes); some give their interface up first and keep receiving on
        // their bind until the successor runs (af_xdp's hook and queues).
        let freshNames = Set(fresh.map(\.name))
        // Every stop first, then every release (as each kind decided).
        var stopFirst: [(listener: Listener, warning: Logger.Message)] = []
        var released: [Listener] = []
        for listener in retiring {
            switch kinds.kind(for: listener).succession(of: listener, fresh: fresh) {
            case .besideSuccessor: break
            case .stopFirst(let warning): stopFirst.append((listener, warning))
            case .releaseFirst: released.append(listener)
            }
        }
        let stopFirstListeners = stopFirst.map(\.listener)
        // The new listeners that need what an old instance gives up first: those of its kind on
        // its interface. Every other one starts before anything is stopped or released, so a
        // change that fails there (a bind another process holds) interrupts nothing.
        func sameKind(_ a: Listener, _ b: Listener) -> Bool {
            ObjectIdentifier(type(of: kinds.kind(for: a))) == ObjectIdentifier(type(of: kinds.kind(for: b)))
        }
        let makingWay = stopFirstListeners + released
        let waiting = Set(fresh.filter { listener in makingWay.contains { $0.interface == listener.interface && sameKind($0, listener) } }.map(\.name))

        var started: [String: any RunningListener] = [:]
        var activateLater: [Listener] = []
        var madeWay = false
        do {
            for listener in fresh where !waiting.contains(listener.name) { started[listener.name] = try makeListener(effective[listener.name]!) }
            madeWay = true
            for (listener, warning) in stopFirst {
                logger.warning(warning, metadata: ["listener": "\(listener.name)", "interface": "\(listener.interface ?? "")"])
                running[listener.name]?.shutdown()
            }
            for listener in released { running[listener.name]?.releaseInterface() }
            for listener in makingWay { try failIfInjected(.release, listener.name) }
            for listener in fresh where waiting.contains(listener.name) { started[listener.name] = try makeListener(effective[listener.name]!) }
            for listener in fresh {
                let instance = started[listener.name]!
                try failIfInjected(.activate, listener.name)
                // Userspace workers and af_xdp companion sockets: groups on the bind.
                let predecessor = retiring.contains { kinds.kind(for: $0).receivesOnBind && FanoutConfig.overlaps($0.bind, listener.bind) }
                if predecessor && !instance.takesOverExactly {
                    logger.warning("without eBPF worker steering the old workers on this bind keep receiving until they stop; datagrams reaching them as they close are lost and not counted (grant CAP_BPF for lossless changes)", metadata: [
                        "listener": "\(listener.name)", "bind": "\(listener.bind)",
                    ])
                    activateLater.append(listener)
                } else {
                    try instance.activate()
                }
            }
        } catch {
            // The old listeners take their binds back (a new userspace group may have activated,
            // a new tc_ebpf listener written its entry over theirs) before the new ones stop.
            // Nothing was stopped or released if the change failed before it made way.
            let stoppedEarly = madeWay ? Set(stopFirstListeners.map(\.name)) : []
            var lost: [String] = []
            for listener in retiring where !stoppedEarly.contains(listener.name) {
                do {
                    try running[listener.name]?.activate()
                } catch {
                    logger.critical("listener could not take its bind back after a failed change: its datagrams go to the kernel's hash over its sockets (userspace) or, for tc_ebpf, nowhere: it is stopped and counted lost until a reload starts it", metadata: [
                        "listener": "\(listener.name)", "error": "\(error)",
                    ])
                    // A listener with no socket on its bind (tc_ebpf) whose entries could not be
                    // written back matches nothing once its successor stops: not running, said so
                    // (the next reload starts it).
                    if !kinds.kind(for: listener).receivesOnBind {
                        running[listener.name]?.shutdown()
                        state.withLock { $0.listeners[listener.name] = nil }
                        lost.append(listener.name)
                    }
                }
            }
            for (name, instance) in started {
                instance.shutdown()
                logger.info("new listener instance stopped unused: the change is rolled back", metadata: ["listener": "\(name)"])
            }
            /// Starts `listener` again with the set last applied; nil (recorded lost) if it cannot.
            func restart(_ listener: Listener) -> (any RunningListener)? {
                do {
                    let restarted = try makeListener(state.withLock { state in
                        state.applied[listener.name].map(listener.withMembers) ?? listener
                    })
                    state.withLock { $0.listeners[listener.name] = restarted }
                    return restarted
                } catch {
                    lost.append(listener.name)
                    state.withLock { $0.listeners[listener.name] = nil }
                    logger.critical("listener stopped: it could not be started again after a failed change", metadata: [
                        "listener": "\(listener.name)", "error": "\(error)",
                    ])
                    return nil
                }
            }
            // A released af_xdp listener comes back as a new instance of its previous settings
            // (its companion socket still receives meanwhile), which takes the bind over before
            // the released one stops.
            for listener in released where madeWay {
                let previous = running[listener.name]
                if let restarted = restart(listener) {
                    do {
                        try restarted.activate()
                    } catch {
                        logger.error("listener could not take its bind over: the kernel's hash spreads its companion socket's datagrams", metadata: [
                            "listener": "\(listener.name)", "error": "\(error)",
                        ])
                    }
                }
                previous?.shutdown()
            }
            // Stopped first and started again: said in the rejection (``reloadChangesHeld(_:)``).
            let interrupted = madeWay ? stopFirstListeners.filter { restart($0) != nil }.map(\.name) : []
            state.withLock { state in
                state.lost.formUnion(lost)
                state.interrupted = interrupted
            }
            throw error
        }
        state.withLock { state in
            for listener in retiring { state.listeners[listener.name] = nil }
            for (name, instance) in started { state.listeners[name] = instance }
            state.config = new
            // Every listener of the new configuration runs now; a lost one no longer configured
            // is gone with it.
            state.lost = []
            state.discovered = discovered
            state.answered.formIntersection(DiscoverySources.all(new))
            state.members = members
            state.applied = effective.mapValues(\.members)
            state.discoveryErrors = state.discoveryErrors.filter { discovered[$0.key] != nil }
            if !new.health.enabled { state.down = [] }
        }
        for listener in inPlace {
            let downstreams = effective[listener.name]!.members
            let keeping = Set(members[listener.name]!.map(\.name))
            if running[listener.name]?.update(downstreams: downstreams, balancing: listener.balancing, pools: listener.pools, keeping: keeping) == false {
                // The previous set stays in force (logged by the listener): record it so the next
                // membership change tries again, and count it.
                state.withLock { $0.applied[listener.name] = appliedBefore[listener.name] }
                membershipFailures.wrappingAdd(1, ordering: .relaxed)
                continue
            }
            logger.info("listener downstreams updated in place", metadata: ["listener": "\(listener.name)", "downstreams": "\(downstreams.count)"])
        }
        let stoppedEarly = Set(stopFirstListeners.map(\.name))
        // Successors whose eBPF steering took their bind over, of a kind whose old instances
        // drain (relay): a predecessor on exactly that bind gets nothing new, and its sessions
        // can drain. (Another address on the port, even a wildcard, is another kernel group:
        // the old sockets would keep receiving there.)
        let successors = Dictionary(fresh.filter { listener in
            kinds.kind(for: listener).drainsOnHandOver && started[listener.name]?.takesOverExactly == true
                && !activateLater.contains { $0.name == listener.name }
        }.map { ($0.bind, $0) }, uniquingKeysWith: { first, _ in first })
        for listener in retiring where !stoppedEarly.contains(listener.name) {
            let removed = !staying.contains(listener.name) && !freshNames.contains(listener.name)
            // (Validation keeps replies: relay to its kind, so this is every relay listener.)
            if kinds.kind(for: listener).drainsOnHandOver, let successor = successors[listener.bind], let instance = running[listener.name] {
                handOver(instance, listener, to: successor)
            } else {
                running[listener.name]?.shutdown()
                if removed { logger.info("listener removed", metadata: ["listener": "\(listener.name)"]) }
            }
        }
        for listener in activateLater {
            do {
                try started[listener.name]!.activate()
            } catch {
                logger.error("listener could not take its bind over: the kernel's hash spreads its datagrams over its workers", metadata: [
                    "listener": "\(listener.name)", "error": "\(error)",
                ])
            }
        }
        endOrphanedHandOvers()
    }

    /// Ends the drain of every handed-over instance whose bind no running relay listener steers
    /// any more (its successor removed, moved or restarted without eBPF steering): the kernel
    /// would deliver that bind's datagrams to the old sockets, which no longer read requests.
    private func endOrphanedHandOvers() {
        let orphaned = state.withLock { state in
            let steered = Set(state.config.listeners.filter { listener in
                kinds.kind(for: listener).drainsOnHandOver && state.listeners[listener.name]?.takesOverExactly == true
            }.map(\.bind))
            return state.handingOver.values.filter { !steered.contains($0.bind) }.map(\.instance)
        }
        for instance in orphaned { instance.shutdown() }
    }

    /// Hands a relay instance over to the successor that took its bind: its sessions drain in
    /// the background for the successor's drain_secs (logged when it starts and ends, with its
    /// totals). At most one instance drains per bind: an earlier one still draining there ends now.
    private func handOver(_ instance: any RunningListener, _ listener: Listener, to successor: Listener) {
        let earlier = state.withLock { state in state.handingOver.values.filter { $0.bind == listener.bind }.map(\.instance) }
        for previous in earlier { previous.shutdown() }
        let drainSecs = successor.settings.drainSecs
        let metadata: Logger.Metadata = ["listener": "\(listener.name)", "successor": "\(successor.name)", "bind": "\(listener.bind)", "drain_secs": "\(drainSecs)"]
        let id = ObjectIdentifier(instance)
        let counters = state.withLock { state in
            state.handingOver[id] = HandedOver(name: listener.name, bind: listener.bind, instance: instance)
            return state.counters[listener.name]
        }
        logger.info(drainSecs > 0
            ? "listener handed over: new requests go to its successor; its sessions' replies are relayed until the successor's settings.drain_secs passes, later ones counted drained"
            : "listener handed over (the successor's settings.drain_secs is 0): new requests go to its successor; its sessions' replies from now on are counted drained", metadata: metadata)
        let draining = instance.handOver(drainSecs: drainSecs) { [weak self] cutShort in
            // Out of the state first (the entry is released once withLock returned, not under the lock).
            _ = self?.state.withLock { $0.handingOver.removeValue(forKey: id) }
            // The name's totals (every instance of it), as /metrics last showed them: a renamed
            // listener's series go now.
            var totals = metadata
            if let twoWay = counters?.snapshot().twoWay {
                totals["listener_replies_total"] = "\(twoWay.replies)"
                totals["listener_drained_total"] = "\(twoWay.replyDropped[.drained, default: 0])"
            }
            self?.logger.info(cutShort ? "handed-over listener stopped: its drain was cut short (daemon stop, or a later change ended it); later replies to its sessions reach no socket"
                                       : "handed-over listener stopped: its sessions drained", metadata: totals)
        }
        if !draining { _ = state.withLock { $0.handingOver.removeValue(forKey: id) } }
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
            if state.stopping { return ["udp-fanout is stopping"] }
            var reasons = state.lost.sorted().map { "listener '\($0)' is not running: a change failed and it could not be started again" }
            for listener in state.config.listeners where !state.lost.contains(listener.name) {
                let pending = Membership.pending(listener, state.discovered[listener.name] ?? Discovered())
                if !pending.isEmpty {
                    let error = state.discoveryErrors[listener.name].map { " (last error: \($0))" } ?? ""
                    reasons.append("listener '\(listener.name)': \(pending.joined(separator: "; "))\(error)")
                } else if state.listeners[listener.name]?.isReceiving != true {
                    reasons.append("listener '\(listener.name)' is not receiving yet")
                } else if (state.applied[listener.name] ?? []).allSatisfy({ $0.weight == 0 || $0.pool != nil }) {
                    // The listener's own downstreams (a replication pool without members is counted, not unready).
                    let members = state.members[listener.name]?.filter { $0.pool == nil }.count ?? 0
                    reasons.append("listener '\(listener.name)' has no healthy downstream (\(members) member(s), all down or none discovered): its datagrams are dropped and counted in udp_fanout_packets_no_healthy_total")
                }
            }
            return reasons
        }
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
