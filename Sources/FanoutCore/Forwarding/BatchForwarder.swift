#if canImport(Glibc)
import Glibc
#endif
import Logging
import ReusePortLB

/// The per-datagram choice and the downstream outboxes of one forwarding thread, shared by
/// userspace workers (datagrams from recvmmsg) and af_xdp forwarders (payloads in UMEM): the
/// thread receives a batch, calls ``pick(_:)`` and ``append(_:_:source:)`` per datagram, then
/// ``flush(received:bytesReceived:tooLarge:noHealthy:)`` once. Nothing is allocated per datagram;
/// the plan (downstreams, balancing) is taken at the next batch after a reload swapped it.
final class BatchForwarder {
    typealias OutboxFactory = (Downstream) -> any Outbox
    let listener: String
    private let counters: ListenerCounters
    private let plans: PlanHolder
    private let logger: Logger
    private let makeOutbox: OutboxFactory
    private var version = -1
    private(set) var plan: ForwardingPlan?
    private var selector = DownstreamSelector(downstreams: [], balancing: .roundRobin)
    private(set) var outboxes: [any Outbox] = []
    /// Replication: the plan's pools, offered each datagram.
    private let replicator: PoolReplicator

    /// - Parameters:
    ///   - makeOutbox: the way out to each of the listener's own downstreams.
    ///   - output: the listener's `settings.output`, for pools that do not set their own.
    ///   - capacity: datagrams per batch (a pool member's outbox holds at most one batch).
    init(listener: String, counters: ListenerCounters, plans: PlanHolder, logger: Logger, output: Output, capacity: Int,
         makeOutbox: @escaping OutboxFactory) {
        self.listener = listener
        self.counters = counters
        self.plans = plans
        self.logger = logger
        self.makeOutbox = makeOutbox
        replicator = PoolReplicator(listener: listener, counters: counters, logger: logger, output: output, capacity: capacity)
    }

    /// Takes the current plan if a reload or membership change replaced it (one atomic load).
    func adoptPlanIfChanged() {
        let current = plans.version.load(ordering: .acquiring)
        guard current != version else { return }
        version = current
        let plan = plans.plan
        self.plan = plan
        selector = DownstreamSelector(plan.method)
        outboxes = plan.downstreams.map(makeOutbox)
        for (outbox, downstream) in zip(outboxes, plan.downstreams) {
            if let problem = outbox.unavailable {
                logger.warning("downstream \(problem); its datagrams are dropped and counted, trying again every second",
                               metadata: ["listener": "\(listener)", "downstream": "\(downstream.name)"])
            }
        }
        replicator.adopt(plan)
    }

    /// Offers one datagram to every replication pool (``PoolReplicator/replicate(_:source:hopLimit:)``).
    @inline(__always)
    func replicate(_ payload: UnsafeRawBufferPointer, source: UnsafePointer<sockaddr_storage>, hopLimit: UInt8 = 0) {
        replicator.replicate(payload, source: source, hopLimit: hopLimit)
    }

    /// The downstream index for a datagram from `source`, nil if none is available.
    @inline(__always)
    func pick(_ source: UnsafePointer<sockaddr_storage>) -> Int? { selector.pick(source: source) }

    @inline(__always)
    func append(_ target: Int, _ payload: UnsafeRawBufferPointer, source: UnsafePointer<sockaddr_storage>, hopLimit: UInt8 = 0) {
        outboxes[target].append(payload, source: source, hopLimit: hopLimit)
    }

    /// Adds what was sent to (or dropped for) downstream `target` to its counters and the
    /// listener's; returns the datagrams and bytes sent.
    @discardableResult
    func record(_ target: Int, _ result: FlushResult) -> (sent: UInt64, bytes: UInt64) {
        guard let plan else { return (0, 0) }
        let downstream = plan.counters[target]
        downstream.forwarded.wrappingAdd(result.sent, ordering: .relaxed)
        downstream.bytes.wrappingAdd(result.bytes, ordering: .relaxed)
        for (reason, dropped) in result.dropped {
            counters.drop(reason, dropped)
            downstream.dropped.wrappingAdd(dropped, ordering: .relaxed)
        }
        return (result.sent, result.bytes)
    }

    /// Sends every outbox, then counts the batch: `received` datagrams of `bytesReceived` bytes,
    /// of which `tooLarge` and `noHealthy` were not appended; `forwarded` and `bytesForwarded`
    /// add datagrams the caller sent another way (af_xdp's TX ring).
    /// `notOffered`: datagrams dropped before any pool was offered them, other than `tooLarge`
    /// (af_xdp: unparsable frames, TTL expired), so each pool's outcomes add up to `received`.
    func flush(received: Int, bytesReceived: UInt64, tooLarge: UInt64 = 0, noHealthy: UInt64 = 0,
               forwarded extraForwarded: UInt64 = 0, bytesForwarded extraBytes: UInt64 = 0, notOffered: [(DropReason, UInt64)] = []) {
        var forwarded = extraForwarded
        var bytesForwarded = extraBytes
        if let plan {
            for (target, outbox) in outboxes.enumerated() where outbox.count > 0 {
                if outbox.reconnectIfDue() {
                    logger.notice("downstream socket connected", metadata: ["listener": "\(listener)", "downstream": "\(plan.downstreams[target].name)"])
                }
                var result: FlushResult = (0, 0, [:])
                outbox.flush(&result)
                if outbox.refused, let report = plan.passiveHealth { report(plan.downstreams[target].address) }
                let sent = record(target, result)
                forwarded += sent.sent
                bytesForwarded += sent.bytes
            }
        }
        if !replicator.isEmpty { replicator.flush(notOffered: [(.tooLarge, tooLarge)] + notOffered) }
        counters.add(counters.received, UInt64(received))
        counters.add(counters.bytesReceived, bytesReceived)
        counters.add(counters.forwarded, forwarded)
        counters.add(counters.bytesForwarded, bytesForwarded)
        counters.add(counters.noHealthy, noHealthy)
        counters.drop(.tooLarge, tooLarge)
    }
}
