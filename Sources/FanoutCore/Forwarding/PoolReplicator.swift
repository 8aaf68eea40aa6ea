#if canImport(Glibc)
import Glibc
#endif
import Logging
import ReusePortLB

/// Replication on one forwarding thread: the replication pools of the plan in force, each with
/// its selector, an outbox per member and the batch's tallies. The thread offers every datagram
/// it received (``replicate(_:source:hopLimit:)``), whatever becomes of it in the listener's own
/// downstreams, and sends the copies once per batch (``flush(notOffered:)``). Shared by one-way
/// workers, af_xdp forwarders and relay workers (whose pools are one way: replies come only from
/// the listener's own downstreams). Nothing is allocated per datagram.
final class PoolReplicator {
    private let listener: String
    private let counters: ListenerCounters
    private let logger: Logger
    /// The listener's `settings.output`, for pools that do not set their own.
    private let output: Output
    /// Datagrams per batch: a member's outbox holds at most one batch.
    private let capacity: Int
    private var pools: [PoolState] = []
    private var passiveHealth: (@Sendable (SocketAddress) -> Void)?

    private struct PoolState {
        let plan: PoolPlan
        var selector: DownstreamSelector?
        let outboxes: [any Outbox]
        /// This batch: datagrams copied to every member (`all`), with no member, sampled out, filtered out.
        var copiedToAll: UInt64 = 0
        var noMember: UInt64 = 0
        var sampledOut: UInt64 = 0
        var filteredOut: UInt64 = 0
    }

    init(listener: String, counters: ListenerCounters, logger: Logger, output: Output, capacity: Int) {
        self.listener = listener
        self.counters = counters
        self.logger = logger
        self.output = output
        self.capacity = capacity
    }

    /// True when the plan has no pools (the flush has nothing to do).
    var isEmpty: Bool { pools.isEmpty }

    /// Takes `plan`'s pools, with new outboxes (what the previous ones held was sent at their flush).
    func adopt(_ plan: ForwardingPlan) {
        passiveHealth = plan.passiveHealth
        pools = plan.pools.map { pool in
            let make = Outboxes.factory(output: pool.output ?? output, capacity: capacity)
            let state = PoolState(plan: pool, selector: pool.method.map(DownstreamSelector.init), outboxes: pool.members.map(make))
            for (outbox, member) in zip(state.outboxes, pool.members) {
                if let problem = outbox.unavailable {
                    logger.warning("pool member \(problem); its copies are dropped and counted, trying again every second",
                                   metadata: ["listener": "\(listener)", "pool": "\(pool.name)", "downstream": "\(member.name)"])
                }
            }
            return state
        }
    }

    /// Offers one datagram to every replication pool: each takes it if `source` passes its
    /// `sources` and `sample`, and queues it for one member, or for every member (`all`).
    /// Nothing when the listener has no pools.
    @inline(__always)
    func replicate(_ payload: UnsafeRawBufferPointer, source: UnsafePointer<sockaddr_storage>, hopLimit: UInt8 = 0) {
        for index in pools.indices {
            let pool = pools[index].plan
            guard pool.sources.admits(source) else {
                pools[index].filteredOut += 1
                continue
            }
            guard pool.samples(source) else {
                pools[index].sampledOut += 1
                continue
            }
            if pool.method == nil {
                guard !pool.everyMember.isEmpty else {
                    pools[index].noMember += 1
                    continue
                }
                for member in pool.everyMember { pools[index].outboxes[member].append(payload, source: source, hopLimit: hopLimit) }
                pools[index].copiedToAll += 1
            } else if let member = pools[index].selector?.pick(source: source) {
                pools[index].outboxes[member].append(payload, source: source, hopLimit: hopLimit)
            } else {
                pools[index].noMember += 1
            }
        }
    }

    /// Sends every pool's copies and counts the batch per pool (`notOffered`: datagrams that
    /// reached no pool, by reason).
    func flush(notOffered: [(DropReason, UInt64)]) {
        let unoffered = notOffered.reduce(0) { $0 + $1.1 }
        for index in pools.indices {
            let pool = pools[index].plan
            var forwarded = pools[index].copiedToAll
            var dropped = pools[index].noMember + unoffered
            for (member, outbox) in pools[index].outboxes.enumerated() where outbox.count > 0 {
                if outbox.reconnectIfDue() {
                    logger.notice("pool member socket connected", metadata: ["listener": "\(listener)", "pool": "\(pool.name)", "downstream": "\(pool.members[member].name)"])
                }
                var result: FlushResult = (0, 0, [:])
                outbox.flush(&result)
                if outbox.refused, let report = passiveHealth { report(pool.members[member].address) }
                let counters = pool.memberCounters[member]
                counters.forwarded.wrappingAdd(result.sent, ordering: .relaxed)
                counters.bytes.wrappingAdd(result.bytes, ordering: .relaxed)
                var copiesDropped: UInt64 = 0
                for (reason, count) in result.dropped {
                    pool.counters.addDrops(reason.rawValue, count)
                    copiesDropped += count
                }
                counters.dropped.wrappingAdd(copiesDropped, ordering: .relaxed)
                // A balanced pool's datagram is its one copy.
                if pool.method != nil {
                    forwarded += result.sent
                    dropped += copiesDropped
                }
            }
            pool.counters.addDrops("no_healthy", pools[index].noMember)
            for (reason, count) in notOffered { pool.counters.addDrops(reason.rawValue, count) }
            counters.add(pool.counters.forwarded, forwarded)
            counters.add(pool.counters.dropped, dropped)
            counters.add(pool.counters.sampledOut, pools[index].sampledOut)
            counters.add(pool.counters.filteredOut, pools[index].filteredOut)
            pools[index].copiedToAll = 0
            pools[index].noMember = 0
            pools[index].sampledOut = 0
            pools[index].filteredOut = 0
        }
    }

}
