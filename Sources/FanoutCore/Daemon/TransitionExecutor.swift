// SPDX-License-Identifier: Apache-2.0
import Logging
import ReusePortLB

/// The executor of a ``TransitionPlan``: runs its phases on the running listeners, its rollback
/// when a phase fails, and the handovers it plans.
extension FanoutDaemon {
    /// Moves the running listeners from `old` to `new` in one step that either completes or
    /// leaves `old` running, as their ``TransitionPlan`` says:
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
    func transitionLocked(to new: FanoutConfig, from old: FanoutConfig) throws(DaemonError) {
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
        let running = state.withLock { $0.listeners }
        let plan = TransitionPlan.make(old: old, new: new, running: Set(running.keys),
                                       resized: Set(new.listeners.filter { effective[$0.name]!.members != appliedBefore[$0.name] }.map(\.name)), kinds: kinds)
        let oldByName = Dictionary(old.listeners.map { ($0.name, $0) }, uniquingKeysWith: { first, _ in first })
        let newByName = Dictionary(new.listeners.map { ($0.name, $0) }, uniquingKeysWith: { first, _ in first })

        var started: [String: any RunningListener] = [:]
        var activateLater: [String] = []
        var madeWay = false
        do {
            for name in plan.startBeside { started[name] = try makeListener(effective[name]!) }
            madeWay = true
            for step in plan.stopFirst {
                logger.warning(step.warning, metadata: ["listener": "\(step.name)", "interface": "\(step.interface)"])
                running[step.name]?.shutdown()
            }
            for name in plan.release { running[name]?.releaseInterface() }
            for name in plan.makingWay { try failIfInjected(.release, name) }
            for name in plan.startAfter { started[name] = try makeListener(effective[name]!) }
            for step in plan.activate {
                let instance = started[step.name]!
                try failIfInjected(.activate, step.name)
                if step.predecessorOnBind && !instance.takesOverExactly {
                    logger.warning("without eBPF worker steering the old workers on this bind keep a share of its datagrams until they stop (then they seal their sockets and forward what they hold; a relay counts requests that reach its old workers after their drain as closing), and the new workers' steering applies only once they stopped (grant CAP_BPF for an exact takeover)", metadata: [
                        "listener": "\(step.name)", "bind": "\(effective[step.name]!.bind)",
                    ])
                    activateLater.append(step.name)
                } else {
                    try instance.activate()
                }
            }
        } catch {
            // Nothing was stopped or released if the change failed before it made way.
            rollBack(madeWay ? plan.rollbackAfterMakingWay : plan.rollbackBeforeMakingWay, running: running,
                     started: plan.activate.compactMap { step in started[step.name].map { (step.name, $0, effective[step.name]!) } }, old: oldByName)
            throw error
        }
        state.withLock { state in
            for name in plan.retiring { state.listeners[name] = nil }
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
        for name in plan.inPlace {
            let listener = newByName[name]!
            let downstreams = effective[name]!.members
            let keeping = Set(members[name]!.map(\.name))
            if running[name]?.update(downstreams: downstreams, balancing: listener.balancing, quicLB: listener.quicLB, pools: listener.pools, keeping: keeping) == false {
                // The previous set stays in force (logged by the listener): record it so the next
                // membership change tries again, and count it.
                state.withLock { $0.applied[name] = appliedBefore[name] }
                membershipFailures.wrappingAdd(1, ordering: .relaxed)
                continue
            }
            logger.info("listener downstreams updated in place", metadata: ["listener": "\(name)", "downstreams": "\(downstreams.count)"])
        }
        for step in plan.retire {
            // A successor whose eBPF steering took the bind over: the predecessor gets nothing
            // new, and its sessions can drain.
            let successor = step.successors.first { started[$0]?.takesOverExactly == true && !activateLater.contains($0) }
            if let successor, let instance = running[step.name] {
                handOver(instance, oldByName[step.name]!, to: newByName[successor]!)
            } else {
                // A new group receiving on exactly its bind: the old workers seal their sockets.
                if step.receiverOnBind { running[step.name]?.retire() } else { running[step.name]?.shutdown() }
                if step.removed {
                    logger.info("listener removed", metadata: ["listener": "\(step.name)"])
                    // Its flow templates go with it: a listener of that name added later starts
                    // from what the exporters send then (its counters' other series stay).
                    state.withLock { $0.counters[step.name] }?.flowTemplateState.withLock { $0 = nil }
                }
            }
        }
        for name in activateLater {
            do {
                try started[name]!.activate()
            } catch {
                logger.error("listener could not take its bind over: the kernel's hash spreads its datagrams over its workers", metadata: [
                    "listener": "\(name)", "error": "\(error)",
                ])
            }
        }
        endOrphanedHandOvers()
    }

    /// Undoes a change that failed: the old listeners take their binds back (a new userspace
    /// group may have activated, a new tc_ebpf listener written its entry over theirs) before the
    /// `started` new instances stop; what was released or stopped first starts again. Records
    /// the listeners that could not be started again (lost) and those stopped and started again
    /// (interrupted: said in the rejection, ``reloadChangesHeld(_:)``).
    private func rollBack(_ rollback: TransitionPlan.Rollback, running: [String: any RunningListener],
                          started: [(name: String, instance: any RunningListener, listener: Listener)], old: [String: Listener]) {
        var lost: [String] = []
        var refused: Set<String> = []
        for step in rollback.takeBack {
            do {
                try running[step.name]?.activate()
            } catch {
                refused.insert(step.name)
                logger.critical("listener could not take its bind back after a failed change: its datagrams go to the kernel's hash over its sockets (userspace) or, for tc_ebpf, nowhere: it is stopped and counted lost until a reload starts it", metadata: [
                    "listener": "\(step.name)", "error": "\(error)",
                ])
                // A listener with no socket on its bind (tc_ebpf) whose entries could not be
                // written back matches nothing once its successor stops: not running, said so
                // (the next reload starts it).
                if step.stopIfRefused {
                    running[step.name]?.shutdown()
                    state.withLock { $0.listeners[step.name] = nil }
                    lost.append(step.name)
                }
            }
        }
        // Binds an old listener still receives on with a socket group (taken back, or released
        // with its companion socket receiving): a new instance there seals its sockets as it stops.
        let receiving = Set((rollback.takeBack.map(\.name) + rollback.restartReleased).compactMap { name -> SocketAddress? in
            guard !lost.contains(name), !refused.contains(name), running[name] != nil, let listener = old[name], kinds.kind(for: listener).receivesOnBind else { return nil }
            return listener.bind
        })
        for (name, instance, listener) in started {
            if kinds.kind(for: listener).receivesOnBind && receiving.contains(listener.bind) { instance.retire() } else { instance.shutdown() }
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
        for name in rollback.restartReleased {
            let previous = running[name]
            if let restarted = restart(old[name]!) {
                do {
                    try restarted.activate()
                } catch {
                    logger.error("listener could not take its bind over: the kernel's hash spreads its companion socket's datagrams", metadata: [
                        "listener": "\(name)", "error": "\(error)",
                    ])
                }
            }
            // The restarted instance receives on the bind: the released one's companion seals.
            previous?.retire()
        }
        let interrupted = rollback.restartStopped.filter { restart(old[$0]!) != nil }
        state.withLock { state in
            state.lost.formUnion(lost)
            state.interrupted = interrupted
        }
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
}
