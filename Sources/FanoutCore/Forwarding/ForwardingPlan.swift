import ReusePortLB
import Synchronization

/// What a listener's workers forward to: replaced as a whole when a reload changes only the
/// downstreams or the balancing, so workers keep their sockets and lose nothing.
final class ForwardingPlan: Sendable {
    let downstreams: [Downstream]
    let balancing: Balancing
    let counters: [DownstreamCounters]
    /// How workers pick a downstream: built once here, not once per worker.
    let method: DownstreamSelector.Method
    /// Passive health: told a downstream's address when a send to it got ICMP port unreachable
    /// (ECONNREFUSED), at most once per batch per downstream (nil: nobody listens).
    let passiveHealth: (@Sendable (SocketAddress) -> Void)?

    /// A downstream's counters are made on first use and kept for the life of the process (see
    /// ``ListenerCounters/downstream(_:)``), so one that leaves and comes back goes on counting.
    init(downstreams: [Downstream], balancing: Balancing, counters: ListenerCounters,
         passiveHealth: (@Sendable (SocketAddress) -> Void)? = nil) {
        self.downstreams = downstreams
        self.balancing = balancing
        method = DownstreamSelector.Method(downstreams: downstreams, balancing: balancing)
        self.passiveHealth = passiveHealth
        self.counters = downstreams.map { counters.downstream($0.name) }
    }
}

/// The current plan and a version number workers compare once per batch (an atomic load).
final class PlanHolder: Sendable {
    let version = Atomic<Int>(0)
    private let current: Mutex<ForwardingPlan>

    init(_ plan: ForwardingPlan) { current = Mutex(plan) }

    var plan: ForwardingPlan { current.withLock { $0 } }

    func replace(with plan: ForwardingPlan) {
        current.withLock { $0 = plan }
        version.wrappingAdd(1, ordering: .releasing)
    }
}

/// Set once to stop a listener's workers.
final class StopSignal: Sendable {
    private let flag = Atomic<Bool>(false)
    // Release/acquire: what was written before set() (a handover's request) is seen by whoever
    // sees the flag set.
    var isSet: Bool { flag.load(ordering: .acquiring) }
    func set() { flag.store(true, ordering: .releasing) }
}

/// A relay listener's handover to a successor on its bind: `requested`, set before its workers
/// are told to stop, makes them drain their sessions (``RelayWorker``) instead of closing them;
/// `cutShort` ends that drain at once (the daemon stops, a later handover of the bind, or its
/// successor gone).
final class HandOverSignal: Sendable {
    let requested = StopSignal()
    let cutShort = StopSignal()
    /// The successor's settings.drain_secs, in milliseconds (stored before `requested`).
    let drainMilliseconds = Atomic<Int64>(0)
}
