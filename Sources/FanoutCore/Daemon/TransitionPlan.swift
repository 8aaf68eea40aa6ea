// SPDX-License-Identifier: Apache-2.0
import Logging

/// What a change of configuration does to the running listeners, phase by phase, and how a
/// failure in it is undone: data, computed by ``make(old:new:running:resized:kinds:)`` from the old
/// and new configurations and the kinds' policies alone (no socket, no running instance), and run
/// by the daemon's executor (`FanoutDaemon.transitionLocked`). Listeners are named; the executor
/// finds them in the configurations.
///
/// The phases, in the order the executor runs them:
/// 1. ``startBeside``: new or changed listeners start beside the old instances;
/// 2. ``stopFirst``, then ``release``: old instances make way as their kind says (``Succession``);
/// 3. ``startAfter``: the new listeners that needed that start;
/// 4. ``activate``: every started listener takes its bind over;
/// 5. the change commits; ``inPlace`` listeners get their new downstreams;
/// 6. ``retire``: the old instances stop, or hand over and drain.
/// A failure in 1 is undone by ``rollbackBeforeMakingWay``, in 2 to 4 by ``rollbackAfterMakingWay``
/// (the new instances started so far stop in both).
struct TransitionPlan: Equatable, Sendable {
    /// An old instance stopped before its successor starts.
    struct StopFirst: Equatable, Sendable {
        var name: String
        /// Its interface ("" when it has none), logged with the warning.
        var interface: String
        /// What its kind says the stop costs.
        var warning: Logger.Message
    }

    /// A started listener taking its bind over.
    struct Activation: Equatable, Sendable {
        var name: String
        /// An old instance receives on a socket group of an overlapping bind: without eBPF
        /// steering (``RunningListener/takesOverExactly``) this one activates only after the old
        /// instances stopped, and says so.
        var predecessorOnBind: Bool
    }

    /// An old instance that stops once the change committed.
    struct Retirement: Equatable, Sendable {
        var name: String
        /// Not in the new configuration (removed or renamed): its stop is logged so.
        var removed: Bool
        /// New listeners on exactly its bind that it can hand over to and drain for, first
        /// first: the executor takes the first whose eBPF steering took the bind over (its kind
        /// and theirs drain on a handover); none: it stops now.
        var successors: [String]
        /// Both it and a new listener receive on a socket group of exactly its bind: its workers
        /// seal their sockets as they stop (``RunningListener/retire()``), the new group receiving.
        var receiverOnBind: Bool = false
    }

    /// An old instance taking its bind back in a rollback.
    struct TakeBack: Equatable, Sendable {
        var name: String
        /// Its kind has no socket on its bind (tc_ebpf, xdp): if it cannot take the bind back it
        /// matches nothing once its successor stops, so it is stopped and counted lost.
        var stopIfRefused: Bool
    }

    /// How a failed change is undone, after the new instances started so far stopped.
    struct Rollback: Equatable, Sendable {
        /// Old instances that take their binds back, first of all.
        var takeBack: [TakeBack]
        /// Old instances that gave their interface up: a new instance of the old settings
        /// starts, takes the bind over, and the released one stops.
        var restartReleased: [String]
        /// Old instances stopped first: started again (the rejection says they were interrupted).
        var restartStopped: [String]
    }

    /// Listeners that run on untouched.
    var kept: [String]
    /// Listeners whose bind, mode and settings stay but whose downstreams, balancing, pools or
    /// available set change: updated in place once the change committed.
    var inPlace: [String]
    /// New or changed listeners (and ones not running) that start before anything makes way, so
    /// a change failing there interrupts nothing.
    var startBeside: [String]
    /// Old instances stopped before their successors start, in the order of the old configuration.
    var stopFirst: [StopFirst]
    /// Old instances that give their interface up before their successors start.
    var release: [String]
    /// New listeners that need what an old instance gives up (of its kind, on its interface):
    /// they start once the old ones made way.
    var startAfter: [String]
    /// Every started listener, in the order of the new configuration.
    var activate: [Activation]
    /// Old instances that stop (or hand over) after the change committed: every one not stopped first.
    var retire: [Retirement]
    /// Undoes a failure before anything made way.
    var rollbackBeforeMakingWay: Rollback
    /// Undoes a failure once the old instances made way.
    var rollbackAfterMakingWay: Rollback

    /// The old instances that make way, as the executor checks them (``TransitionStep/release``).
    var makingWay: [String] { stopFirst.map(\.name) + release }

    /// Every old instance the change replaces or removes.
    var retiring: [String] { stopFirst.map(\.name) + retire.map(\.name) }

    /// The plan that moves the listeners of `old` to those of `new`.
    /// - Parameters:
    ///   - running: the listeners that run (one of `old` lost in a failed change starts again,
    ///     even unchanged).
    ///   - resized: listeners of `new` whose available set differs from the one last applied
    ///     (they are updated in place even when their configuration is unchanged).
    ///   - kinds: whose policies say how each old instance makes way, whether it receives on its
    ///     bind and whether it drains on a handover.
    static func make(old: FanoutConfig, new: FanoutConfig, running: Set<String>, resized: Set<String>, kinds: ListenerKinds) -> TransitionPlan {
        let oldByName = Dictionary(old.listeners.map { ($0.name, $0) }, uniquingKeysWith: { first, _ in first })
        var fresh: [Listener] = []
        var inPlace: [String] = []
        var kept: [String] = []
        for listener in new.listeners {
            // A listener that is not running (lost in a failed change) starts again, even unchanged.
            if let previous = oldByName[listener.name], previous.socketShape == listener.socketShape, running.contains(listener.name) {
                // Also when only the available set changed (health turned off puts every member back).
                if previous != listener || resized.contains(listener.name) { inPlace.append(listener.name) } else { kept.append(listener.name) }
            } else {
                fresh.append(listener)
            }
        }
        let freshNames = Set(fresh.map(\.name))
        let staying = Set(new.listeners.map(\.name)).subtracting(freshNames)
        let retiring = old.listeners.filter { !staying.contains($0.name) }

        // How each retiring instance makes way, as its kind says: most run beside their
        // successors; some stop first (what they hold can be held once: tc_ebpf's attachment
        // when tc_attach changes); some give their interface up first and keep receiving on
        // their bind until the successor runs (af_xdp's hook and queues).
        var stopFirst: [StopFirst] = []
        var released: [Listener] = []
        var stoppedFirst: [Listener] = []
        for listener in retiring {
            switch kinds.kind(for: listener).succession(of: listener, fresh: fresh) {
            case .besideSuccessor: break
            case .stopFirst(let warning):
                stopFirst.append(StopFirst(name: listener.name, interface: listener.interface ?? "", warning: warning))
                stoppedFirst.append(listener)
            case .releaseFirst: released.append(listener)
            }
        }
        // The new listeners that need what an old instance gives up first: those of its kind on
        // its interface. Every other one starts before anything is stopped or released.
        func sameKind(_ a: Listener, _ b: Listener) -> Bool {
            ObjectIdentifier(type(of: kinds.kind(for: a))) == ObjectIdentifier(type(of: kinds.kind(for: b)))
        }
        let makingWay = stoppedFirst + released
        let waiting = Set(fresh.filter { listener in makingWay.contains { $0.interface == listener.interface && sameKind($0, listener) } }.map(\.name))

        // Userspace workers and af_xdp companion sockets: groups on the bind.
        let activate = fresh.map { listener in
            Activation(name: listener.name, predecessorOnBind: retiring.contains { kinds.kind(for: $0).receivesOnBind && FanoutConfig.overlaps($0.bind, listener.bind) })
        }
        // A retiring instance of a kind that drains (relay) hands over to a successor of such a
        // kind on exactly its bind. (Another address on the port, even a wildcard, is another
        // kernel group: the old sockets would keep receiving there.)
        let drainers = fresh.filter { kinds.kind(for: $0).drainsOnHandOver }
        let stoppedFirstNames = Set(stoppedFirst.map(\.name))
        let retire = retiring.filter { !stoppedFirstNames.contains($0.name) }.map { listener in
            Retirement(name: listener.name, removed: !staying.contains(listener.name) && !freshNames.contains(listener.name),
                       successors: kinds.kind(for: listener).drainsOnHandOver ? drainers.filter { $0.bind == listener.bind }.map(\.name) : [],
                       receiverOnBind: kinds.kind(for: listener).receivesOnBind
                           && fresh.contains { kinds.kind(for: $0).receivesOnBind && $0.bind == listener.bind })
        }
        let takeBack = retiring.map { TakeBack(name: $0.name, stopIfRefused: !kinds.kind(for: $0).receivesOnBind) }
        return TransitionPlan(
            kept: kept, inPlace: inPlace,
            startBeside: fresh.filter { !waiting.contains($0.name) }.map(\.name),
            stopFirst: stopFirst, release: released.map(\.name),
            startAfter: fresh.filter { waiting.contains($0.name) }.map(\.name),
            activate: activate, retire: retire,
            rollbackBeforeMakingWay: Rollback(takeBack: takeBack, restartReleased: [], restartStopped: []),
            rollbackAfterMakingWay: Rollback(takeBack: takeBack.filter { !stoppedFirstNames.contains($0.name) },
                                             restartReleased: released.map(\.name), restartStopped: stoppedFirst.map(\.name)))
    }
}
