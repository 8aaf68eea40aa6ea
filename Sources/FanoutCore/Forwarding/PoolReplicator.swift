// SPDX-License-Identifier: Apache-2.0
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
    @exclusivity(unchecked) private var pools: [PoolState] = []
    private var passiveHealth: (@Sendable (SocketAddress) -> Void)?
    /// The thread's shared way out for `output: socket` members.
    private let sender: SharedSender
    /// preserve_source's sockets bound to clients (``TransparentSockets``): those idle close;
    /// the thread calls it every second, with traffic or without.
    func sweepIdleSockets() { sender.raw.transparent?.sweepIfDue() }
    /// Per pool, what ``replicate(_:source:hopLimit:)`` did with the datagram it was last
    /// offered (``Pick``): `settings.flow_templates` reads it to know which members got it.
    @exclusivity(unchecked) private var picks: [Int] = []
    /// `settings.flow_templates`: told of members whose copies a send dropped (they may have
    /// carried templates).
    var templates: FlowTemplateRelay?

    /// What a pool did with the datagram last offered, in ``picks``: a member's index, or one of these.
    enum Pick {
        /// Filtered or sampled out: the pool never sees this source.
        static let notTaken = -1
        /// Taken, but no member was available.
        static let noMember = -2
        /// Copied to every member with a weight (`all`).
        static let everyMember = -3
    }

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

    /// - Parameter sender: the thread's (a one-way forwarder shares its own: one sendmmsg for the batch).
    init(listener: String, counters: ListenerCounters, logger: Logger, output: Output, capacity: Int, sender: SharedSender) {
        self.listener = listener
        self.sender = sender
        self.counters = counters
        self.logger = logger
        self.output = output
        self.capacity = capacity
    }

    /// How many pools ``pick(_:)`` answers for.
    var poolCount: Int { picks.count }

    /// What pool `index` did with the datagram last offered (``Pick``, or a member's index).
    @inline(__always)
    func pick(_ index: Int) -> Int { picks[index] }

    /// True when the plan has no pools (the flush has nothing to do).
    var isEmpty: Bool { pools.isEmpty }

    /// Takes `plan`'s pools; members kept (same address and way out) keep their outboxes, the
    /// others get new ones (what the previous ones held was sent at their flush).
    func adopt(_ plan: ForwardingPlan) {
        passiveHealth = plan.passiveHealth
        // Every plan change of the thread comes here (one-way forwarders and relay workers):
        // ICMP errors queued before it are about sends of a plan that is gone (a worker without
        // traffic for a while adopts late): dropped, not reported, so that a downstream that was
        // dead and is back is not reported refused, nor fails a send, for them. A downstream
        // still dead draws new errors with its next datagrams. (Kept outboxes forget theirs in
        // OutboxShelf.take.)
        sender.discardErrors()
        var shelf = OutboxShelf()
        for pool in pools {
            for (outbox, member) in zip(pool.outboxes, pool.plan.members) { shelf.put(outbox, output: pool.plan.output ?? output, address: member.address) }
        }
        pools = plan.pools.map { pool in
            let way = pool.output ?? output
            let make = Outboxes.factory(output: way, capacity: capacity)
            let outboxes = pool.members.map { member in
                let (outbox, made) = shelf.take(output: way, address: member.address) { make(member, sender) }
                if made, let problem = outbox.unavailable {
                    logger.warning("pool member \(problem); its copies are dropped and counted, trying again every second",
                                   metadata: ["listener": "\(listener)", "pool": "\(pool.name)", "downstream": "\(member.name)"])
                }
                return outbox
            }
            return PoolState(plan: pool, selector: pool.method.map { DownstreamSelector($0) }, outboxes: outboxes)
        }
        picks = Array(repeating: Pick.notTaken, count: pools.count)
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
                picks[index] = Pick.notTaken
                continue
            }
            guard pool.samples(source) else {
                pools[index].sampledOut += 1
                picks[index] = Pick.notTaken
                continue
            }
            if pool.method == nil {
                guard !pool.everyMember.isEmpty else {
                    pools[index].noMember += 1
                    picks[index] = Pick.noMember
                    continue
                }
                for member in pool.everyMember { pools[index].outboxes[member].append(payload, source: source, hopLimit: hopLimit) }
                pools[index].copiedToAll += 1
                picks[index] = Pick.everyMember
            } else if let member = pools[index].selector?.pick(source: source) {
                pools[index].outboxes[member].append(payload, source: source, hopLimit: hopLimit)
                picks[index] = member
            } else {
                pools[index].noMember += 1
                picks[index] = Pick.noMember
            }
        }
    }

    /// Hands the copies for `output: socket` members to the shared sender.
    func stage() {
        for pool in pools {
            for outbox in pool.outboxes where outbox.count > 0 { outbox.stage() }
        }
    }

    /// An ICMP error came back to the shared socket about a copy sent to `address`.
    func drewError(at address: SocketAddress) {
        for pool in pools {
            for outbox in pool.outboxes { outbox.drewError(at: address) }
        }
    }

    /// Sends every pool's copies and counts the batch per pool (`notOffered`: datagrams that
    /// reached no pool, by reason). `sent`: the caller already staged them and sent its shared
    /// sender (a one-way forwarder, whose own downstreams go in the same sendmmsg).
    func flush(notOffered: [(DropReason, UInt64)], sent: Bool = false) {
        if !sent {
            stage()
            sender.send()
            for (address, error) in sender.takeErrors() {
                drewError(at: address)
                if error == ECONNREFUSED, sender.firstReport(of: address), let passiveHealth { passiveHealth(address) }
            }
        }
        let unoffered = notOffered.reduce(0) { $0 + $1.1 }
        for index in pools.indices {
            let pool = pools[index].plan
            var forwarded = pools[index].copiedToAll
            var dropped = pools[index].noMember + unoffered
            for (member, outbox) in pools[index].outboxes.enumerated() where outbox.count > 0 {
                if outbox.reconnectIfDue() {
                    logger.notice("pool member socket connected", metadata: ["listener": "\(listener)", "pool": "\(pool.name)", "downstream": "\(pool.members[member].name)"])
                }
                var result: FlushResult = (0, 0, DropTally())
                outbox.flush(&result)
                let address = pool.members[member].address
                if outbox.refused, sender.firstReport(of: address), let report = passiveHealth { report(address) }
                let counters = pool.memberCounters[member]
                counters.forwarded.wrappingAdd(result.sent, ordering: .relaxed)
                counters.bytes.wrappingAdd(result.bytes, ordering: .relaxed)
                var copiesDropped: UInt64 = 0
                for (reason, count) in result.dropped {
                    pool.counters.addMemberDrops(pool.members[member].name, reason.rawValue, count)
                    copiesDropped += count
                }
                counters.dropped.wrappingAdd(copiesDropped, ordering: .relaxed)
                // A copy that carried templates may be among the dropped ones.
                if copiesDropped > 0, let templates { templates.forget(FlowTemplateRelay.Way(address: address, output: pool.output ?? output)) }
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
