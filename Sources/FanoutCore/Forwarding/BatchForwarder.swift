// SPDX-License-Identifier: Apache-2.0
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
///
/// The state the per-datagram and per-downstream path touches (here the plan, selector, outboxes,
/// touched list and counters; in ``DownstreamOutbox``, ``SharedSender`` and ``PoolReplicator``
/// what a batch stages, sends and counts) is the forwarding thread's alone and is marked
/// `@exclusivity(unchecked)`: not checked for exclusive access at run time (the compile-time
/// checks remain). Those checks were about 4 % of the forwarder's CPU at 3000 downstreams (perf:
/// `swift_beginAccess` per datagram and per downstream). The rule they enforced still holds and
/// is now the code's to keep: no callback re-enters one of these objects while one of its
/// properties is being modified (SharedSender's per-message callbacks touch only the outcome of
/// the message's owner: its outbox, or its record in the thread's table and the sender's own
/// total); a violation would corrupt, not trap.
final class BatchForwarder {
    /// The way out to one downstream; `output: socket` ones send through the thread's shared sender.
    typealias OutboxFactory = (Downstream, SharedSender) -> any Outbox
    let listener: String
    private let counters: ListenerCounters
    private let plans: PlanHolder
    private let logger: Logger
    private let makeOutbox: OutboxFactory
    @exclusivity(unchecked) private var version = -1
    @exclusivity(unchecked) private(set) var plan: ForwardingPlan?
    @exclusivity(unchecked) private var selector = DownstreamSelector(downstreams: [], balancing: .roundRobin)
    @exclusivity(unchecked) private(set) var outboxes: [any Outbox] = []
    /// The same outboxes, unretained, when every one is a ``DownstreamOutbox`` (`output: socket`,
    /// the usual case), else empty: the per-datagram path calls them without an existential and
    /// without a retain and release per call (``outboxes`` owns them; both change together).
    @exclusivity(unchecked) private var sockets: [Unmanaged<DownstreamOutbox>] = []
    /// With ``sockets``: each downstream's record, one cache line in a dense table, indexed like
    /// them. A batch stages a downstream's run into the shared sender from its record and counts
    /// what was delivered there, touching no outbox, unless the record says the outbox must
    /// decide (no connected socket, a direct period, no shared sender); a failed message is
    /// the outbox's to count, and the flush collects it from there.
    @exclusivity(unchecked) private var destinations = DestinationTable()
    /// The targets whose records hold counts not yet added to their downstream's counters, and how
    /// many (each at most once: ``DestinationRecord/Flags/unpublished``); room for every downstream.
    @exclusivity(unchecked) private var unpublished: UnsafeMutablePointer<Int32>
    @exclusivity(unchecked) private var unpublishedCount = 0
    /// When ``publishCounts()`` last ran (CLOCK_MONOTONIC_COARSE, ms).
    @exclusivity(unchecked) private var lastPublished: Int64 = 0
    /// The longest a record's delivered counts wait within a turn (ms). At the end of every
    /// turn they are published anyway, so an idle or lightly loaded thread's counters are exact;
    /// under saturation each downstream's counters are touched once per interval, not per batch
    /// (at 3,000 downstreams each is a cold cache line and two atomic adds).
    let publishInterval: Int64
    /// Runs staged from ``destinations`` without their outbox (tests check the batch path takes it).
    @exclusivity(unchecked) private(set) var runsStagedFromTable = 0
    /// The plan's per-downstream counters, unretained (``plan`` owns them): counting a
    /// downstream's batch is then two atomic adds, without a retain and release of its counters
    /// (one more atomic each, on a cache line of its own per downstream: perf at 3000 downstreams).
    @exclusivity(unchecked) private var downstreamCounters: [Unmanaged<DownstreamCounters>] = []
    /// The outboxes of each downstream address (an ICMP error names an address).
    private var outboxesAt: [SocketAddress: [Int]] = [:]
    /// The listener's way out (what `makeOutbox` makes): outboxes are kept across plans by it and address.
    private let output: Output
    /// The indexes of the outboxes appended to since the last flush (a batch touches at most
    /// its size of them, whatever the number of downstreams).
    @exclusivity(unchecked) private var touched: [Int] = []
    /// Datagrams per batch (``append(_:_:source:hopLimit:)`` is called at most this often between flushes).
    private let capacity: Int
    /// When every outbox is a ``DownstreamOutbox`` (``sockets``), the batch is gathered here in
    /// storage of the thread's own instead of in the outboxes: each datagram's target and iovec
    /// in arrival order, and per downstream how many it has (``perTarget``, indexed by target).
    /// At the flush the batch is grouped by target into ``grouped`` and each run is staged from
    /// its downstream's record (``destinations``), or adopted by its outbox when the record says
    /// the outbox must decide (``DownstreamOutbox/adopt(_:count:)``). The per-datagram path
    /// writes a few dense arrays and touches no outbox, each of which is a cache miss once there
    /// are thousands (perf at 3,000 downstreams).
    private let arrivals: UnsafeMutablePointer<iovec>
    private let arrivalTargets: UnsafeMutablePointer<Int32>
    private let grouped: UnsafeMutablePointer<iovec>
    @exclusivity(unchecked) private var arrived = 0
    /// Per downstream of the plan: datagrams of this batch (then, during the flush, offsets into
    /// ``grouped``); all 0 between batches.
    @exclusivity(unchecked) private var perTarget: UnsafeMutablePointer<Int32>
    @exclusivity(unchecked) private var perTargetCapacity = 0
    /// One unconnected socket per family and one sendmmsg per batch for every `output: socket`
    /// downstream and pool member of this thread.
    let sender: SharedSender
    /// Replication: the plan's pools, offered each datagram.
    private let replicator: PoolReplicator
    /// `settings.flow_templates`: the caller offers it each datagram before appending it.
    let templates: FlowTemplateRelay?
    /// `rate_limit`: the listener's buckets per source (shared by its threads), nil when none.
    let limiter: SourceRateLimiter?
    /// The thread's crash ledger slot: the listener's own outboxes note in it what each send call
    /// carries, just before the call.
    var ledger: CrashLedger.Slot? {
        didSet { for outbox in outboxes { outbox.ledger = ledger } }
    }

    /// - Parameters:
    ///   - makeOutbox: the way out to each of the listener's own downstreams.
    ///   - output: the listener's `settings.output`, for pools that do not set their own.
    ///   - capacity: datagrams per batch (a pool member's outbox holds at most one batch).
    ///   - templates: the listener's flow export templates (`settings.flow_templates`), nil when off.
    ///   - limiter: the listener's `rate_limit` buckets, nil when it has none.
    ///   - sendBuffer: the shared sender's sockets' send buffer (tests make it small to fill it).
    ///   - publishInterval: ``publishInterval`` in milliseconds.
    init(listener: String, counters: ListenerCounters, plans: PlanHolder, logger: Logger, output: Output, capacity: Int,
         templates: FlowTemplateState? = nil, limiter: SourceRateLimiter? = nil, sendBuffer: Int32 = 16 << 20, publishInterval: Int64 = 100,
         makeOutbox: @escaping OutboxFactory) {
        self.publishInterval = publishInterval
        self.limiter = limiter
        self.listener = listener
        self.counters = counters
        self.plans = plans
        self.logger = logger
        self.makeOutbox = makeOutbox
        self.output = output
        self.capacity = max(capacity, 1)
        arrivals = .allocate(capacity: max(capacity, 1))
        arrivalTargets = .allocate(capacity: max(capacity, 1))
        grouped = .allocate(capacity: max(capacity, 1))
        perTarget = .allocate(capacity: 0)
        unpublished = .allocate(capacity: 0)
        sender = SharedSender(capacity: capacity, logger: logger, sendBuffer: sendBuffer, counters: counters)
        touched.reserveCapacity(capacity)
        replicator = PoolReplicator(listener: listener, counters: counters, logger: logger, output: output, capacity: capacity, sender: sender)
        let shared = sender
        let relay = templates.map { FlowTemplateRelay(state: $0, sender: shared, output: output) }
        self.templates = relay
        replicator.templates = relay
    }

    deinit {
        // The plan (which owns the counters) and the outboxes are alive until the body returns.
        publishCounts()
        destinations.release()
        arrivals.deallocate()
        arrivalTargets.deallocate()
        grouped.deallocate()
        perTarget.deallocate()
        unpublished.deallocate()
    }

    /// `settings.flow_templates`: offers the datagram to the relay, with downstream `target`
    /// (nil: none available) and what each replication pool did with it; after ``replicate(_:source:hopLimit:)``.
    @inline(__always)
    func noteTemplates(_ target: Int?, _ payload: UnsafeRawBufferPointer, source: UnsafePointer<sockaddr_storage>) {
        guard let templates else { return }
        templates.note(target, payload, source: source, pools: replicator.isEmpty ? nil : replicator)
    }

    /// Takes the current plan if a reload or membership change replaced it (one atomic load).
    func adoptPlanIfChanged() {
        let current = plans.version.load(ordering: .acquiring)
        guard current != version else { return }
        // What the records hold goes to the counters of the plan it was counted under; then the
        // table goes, while every outbox it names is alive (the plan's outboxes that are not
        // kept are released below).
        publishCounts()
        destinations.release()
        version = current
        let plan = plans.plan
        var shelf = OutboxShelf()
        for (outbox, downstream) in zip(outboxes, self.plan?.downstreams ?? []) { shelf.put(outbox, output: output, address: downstream.address) }
        self.plan = plan
        downstreamCounters = plan.counters.map { Unmanaged.passUnretained($0) }
        selector = DownstreamSelector(plan.method, router: plan.quic)
        outboxes = plan.downstreams.map { downstream in
            let (outbox, made) = shelf.take(output: output, address: downstream.address) { makeOutbox(downstream, sender) }
            if made, let problem = outbox.unavailable {
                logger.warning("downstream \(problem); its datagrams are dropped and counted, trying again every second",
                               metadata: ["listener": "\(listener)", "downstream": "\(downstream.name)"])
            }
            return outbox
        }
        for outbox in outboxes { outbox.ledger = ledger }
        let direct = outboxes.compactMap { $0 as? DownstreamOutbox }
        sockets = direct.count == outboxes.count ? direct.map { Unmanaged.passUnretained($0) } : []
        // Between batches: no record holds an outcome.
        destinations.rebuild(sockets)
        if outboxes.count > perTargetCapacity {
            perTarget.deallocate()
            unpublished.deallocate()
            perTargetCapacity = outboxes.count
            perTarget = .allocate(capacity: perTargetCapacity)
            unpublished = .allocate(capacity: perTargetCapacity)
        }
        perTarget.initialize(repeating: 0, count: perTargetCapacity)
        outboxesAt = Dictionary(grouping: plan.downstreams.indices, by: { plan.downstreams[$0].address })
        touched.removeAll(keepingCapacity: true)
        replicator.adopt(plan)
        templates?.adopt(plan)
    }

    /// Offers one datagram to every replication pool (``PoolReplicator/replicate(_:source:hopLimit:)``).
    @inline(__always)
    func replicate(_ payload: UnsafeRawBufferPointer, source: UnsafePointer<sockaddr_storage>, hopLimit: UInt8 = 0) {
        replicator.replicate(payload, source: source, hopLimit: hopLimit)
    }

    /// The downstream index for `payload` from `source` (by its QUIC connection ID first, with
    /// `quic_lb`), nil if none is available.
    @inline(__always)
    func pick(_ source: UnsafePointer<sockaddr_storage>, _ payload: UnsafeRawBufferPointer) -> Int? {
        selector.pick(source: source, payload: payload)
    }

    @inline(__always)
    func append(_ target: Int, _ payload: UnsafeRawBufferPointer, source: UnsafePointer<sockaddr_storage>, hopLimit: UInt8 = 0) {
        if !sockets.isEmpty {
            // Gathered here; the outboxes adopt their runs at the flush (``arrivals``).
            precondition(arrived < capacity, "BatchForwarder: more than \(capacity) datagrams before a flush")
            if perTarget[target] == 0 { touched.append(target) }
            perTarget[target] += 1
            arrivals[arrived] = iovec(iov_base: UnsafeMutableRawPointer(mutating: payload.baseAddress), iov_len: payload.count)
            arrivalTargets[arrived] = Int32(truncatingIfNeeded: target)
            arrived += 1
            return
        }
        let outbox = outboxes[target]
        if outbox.count == 0 { touched.append(target) }
        outbox.append(payload, source: source, hopLimit: hopLimit)
    }

    /// Adds what was sent to (or dropped for) downstream `target` to its counters and the
    /// listener's; returns the datagrams and bytes sent.
    @discardableResult
    func record(_ target: Int, _ result: FlushResult) -> (sent: UInt64, bytes: UInt64) {
        guard plan != nil else { return (0, 0) }
        count(target, result)
        return (result.sent, result.bytes)
    }

    /// Adds one downstream's flush to its counters and the listener's (a plan is in force).
    @inline(__always)
    private func count(_ target: Int, _ result: FlushResult) {
        downstreamCounters[target]._withUnsafeGuaranteedRef { downstream in
            if result.sent > 0 {
                downstream.forwarded.wrappingAdd(result.sent, ordering: .relaxed)
                downstream.bytes.wrappingAdd(result.bytes, ordering: .relaxed)
            }
            guard !result.dropped.isEmpty else { return }
            for (reason, dropped) in result.dropped {
                counters.drop(reason, dropped)
                downstream.dropped.wrappingAdd(dropped, ordering: .relaxed)
            }
        }
    }

    /// Sends every outbox, then counts the batch: `received` datagrams of `bytesReceived` bytes,
    /// of which `tooLarge`, `rateLimited` and `noHealthy` were not appended; `forwarded` and `bytesForwarded`
    /// add datagrams the caller sent another way (af_xdp's TX ring).
    /// `notOffered`: datagrams dropped before any pool was offered them, other than `tooLarge`
    /// and `rateLimited` (af_xdp: unparsable frames, TTL expired), so each pool's outcomes add up to `received`.
    func flush(received: Int, bytesReceived: UInt64, tooLarge: UInt64 = 0, rateLimited: UInt64 = 0, noHealthy: UInt64 = 0,
               forwarded extraForwarded: UInt64 = 0, bytesForwarded extraBytes: UInt64 = 0, notOffered: [(DropReason, UInt64)] = []) {
        var forwarded = extraForwarded
        var bytesForwarded = extraBytes
        // Template copies and replays first: a replay arrives before the data it serves.
        templates?.flush()
        // Everything of the batch for the shared socket goes in one sendmmsg: stage, then send.
        if sockets.isEmpty {
            for target in touched { outboxes[target].stage() }
        } else {
            // Each run is staged from its record, or by its outbox.
            handOutArrivals()
        }
        if !replicator.isEmpty { replicator.stage() }
        sender.send()
        let fromTable = sender.takeDeliveredFromTable()
        forwarded += fromTable.sent
        bytesForwarded += fromTable.bytes
        noteICMPErrors()
        if let plan {
            for target in touched {
                var result: FlushResult = (0, 0, DropTally())
                // A run the thread staged: its outcome is in the record (a connected socket sends
                // nothing of it, so nothing is refused: ICMP errors come by the error queue).
                let refused = sockets.isEmpty ? flush(outboxes[target], target, plan, &result)
                    : collect(destinations.base.unsafelyUnwrapped + target, &result) ? false
                    : sockets[target]._withUnsafeGuaranteedRef { flush($0, target, plan, &result) }
                if refused {
                    let address = plan.downstreams[target].address
                    if sender.firstReport(of: address), let report = plan.passiveHealth { report(address) }
                }
                // A datagram that carried templates may be among the dropped ones.
                if !result.dropped.isEmpty, let templates { templates.forget(plan.downstreams[target].address) }
                count(target, result)
                forwarded += result.sent
                bytesForwarded += result.bytes
            }
        }
        touched.removeAll(keepingCapacity: true)
        if !replicator.isEmpty { replicator.flush(notOffered: [(.tooLarge, tooLarge), (.rateLimited, rateLimited)] + notOffered, sent: true) }
        counters.add(counters.received, UInt64(received))
        counters.add(counters.bytesReceived, bytesReceived)
        counters.add(counters.forwarded, forwarded)
        counters.add(counters.bytesForwarded, bytesForwarded)
        counters.add(counters.noHealthy, noHealthy)
        counters.drop(.tooLarge, tooLarge)
        counters.drop(.rateLimited, rateLimited)
        if selector.router != nil { counters.add(selector.takeTally()) }
        if unpublishedCount > 0 && coarseMonotonicMilliseconds() - lastPublished >= publishInterval { publishCounts() }
    }

    /// Groups the gathered batch by downstream, in the order the downstreams were first met and
    /// each downstream's datagrams in arrival order (a counting sort: ``perTarget`` becomes each
    /// run's offset), and gives each touched outbox its run, which it stages; ``perTarget`` is
    /// all 0 again after.
    private func handOutArrivals() {
        guard arrived > 0 else { return }
        var offset: Int32 = 0
        for target in touched {
            let count = perTarget[target]
            perTarget[target] = offset
            offset += count
        }
        for index in 0..<arrived {
            let target = Int(arrivalTargets[index])
            grouped[Int(perTarget[target])] = arrivals[index]
            perTarget[target] += 1
        }
        // perTarget[target] is now the end of its run, which starts where the one before ended.
        var start = 0
        let records = destinations.base.unsafelyUnwrapped
        for target in touched {
            let end = Int(perTarget[target])
            perTarget[target] = 0
            if !stage(target, records + target, grouped + start, count: end - start) {
                sockets[target]._withUnsafeGuaranteedRef { $0.adopt(grouped + start, count: end - start) }
            }
            start = end
        }
        arrived = 0
    }

    /// Stages one downstream's run (`count` datagrams at `datagrams`) into the shared sender from
    /// its record, as its outbox would (GSO runs, msg_name the record's address), when the record
    /// says the shared sender sends for it; false otherwise (the outbox adopts the run).
    @inline(__always)
    private func stage(_ target: Int, _ record: UnsafeMutablePointer<DestinationRecord>, _ datagrams: UnsafeMutablePointer<iovec>, count: Int) -> Bool {
        let flags = record.pointee.flags
        guard flags & DestinationRecord.Flags.sendsShared != 0 else { return false }
        let family = flags & DestinationRecord.Flags.ipv6 != 0 ? AF_INET6 : AF_INET
        guard sender.reserve(count, family: family) else { return false }
        let gso = flags & DestinationRecord.Flags.gso != 0
        let name = UnsafeMutableRawPointer(record) + DestinationRecord.nameOffset
        let nameLength = record.pointee.nameLength
        let owner = SharedSender.Owner(record)
        var index = 0
        while index < count {
            let end = DownstreamOutbox.runEnd(datagrams, index, count, gso: gso)
            let next = sender.next(family: family)
            next.header.pointee.msg_hdr.msg_name = name
            next.header.pointee.msg_hdr.msg_namelen = nameLength
            DownstreamOutbox.fill(&next.header.pointee.msg_hdr, control: next.control, datagrams, from: index, to: end)
            sender.commit(family: family, owner: owner, ledger: ledger)
            index = end
        }
        if flags & DestinationRecord.Flags.unpublished == 0 {
            unpublished[unpublishedCount] = Int32(truncatingIfNeeded: target)
            unpublishedCount += 1
        }
        // Only bits are added: a send that reserve() forced may have changed the flags since
        // they were read (a GSO refusal, a failure the outbox holds).
        record.pointee.flags |= DestinationRecord.Flags.staged | DestinationRecord.Flags.unpublished
        runsStagedFromTable &+= 1
        return true
    }

    /// Adds what the records hold (delivered datagrams and bytes of runs the thread staged) to
    /// their downstreams' counters. Workers call it at the end of every turn; ``flush(received:bytesReceived:tooLarge:rateLimited:noHealthy:forwarded:bytesForwarded:notOffered:)``
    /// calls it once ``publishInterval`` has passed, and a plan change before it takes the new plan.
    func publishCounts() {
        lastPublished = coarseMonotonicMilliseconds()
        guard unpublishedCount > 0 else { return }
        guard let records = destinations.base else {
            // Not reached: a target is listed only when staged from a table, which a plan change
            // publishes before releasing.
            unpublishedCount = 0
            return
        }
        for index in 0..<unpublishedCount {
            let target = Int(unpublished[index])
            let record = records + target
            downstreamCounters[target]._withUnsafeGuaranteedRef { downstream in
                downstream.forwarded.wrappingAdd(record.pointee.sent, ordering: .relaxed)
                downstream.bytes.wrappingAdd(record.pointee.bytes, ordering: .relaxed)
            }
            record.pointee.sent = 0
            record.pointee.bytes = 0
            record.pointee.flags &= ~DestinationRecord.Flags.unpublished
        }
        unpublishedCount = 0
    }

    /// The drops of the run the thread staged for `record`'s downstream this batch (what was
    /// delivered is counted in the record, and for the listener by the sender: ``SharedSender/takeDeliveredFromTable()``);
    /// false: the thread did not stage it (its outbox flushes).
    @inline(__always)
    private func collect(_ record: UnsafeMutablePointer<DestinationRecord>, _ result: inout FlushResult) -> Bool {
        let flags = record.pointee.flags
        guard flags & DestinationRecord.Flags.staged != 0 else { return false }
        if flags & DestinationRecord.Flags.outboxHolds != 0 {
            record.pointee.outbox._withUnsafeGuaranteedRef { $0.collectPending(&result) }
        }
        record.pointee.flags = flags & ~(DestinationRecord.Flags.staged | DestinationRecord.Flags.outboxHolds)
        return true
    }

    /// Flushes one outbox (reconnecting it first if due): whether it was refused (port unreachable).
    @inline(__always)
    private func flush<Box: Outbox>(_ outbox: Box, _ target: Int, _ plan: ForwardingPlan, _ result: inout FlushResult) -> Bool {
        if outbox.reconnectIfDue() {
            logger.notice("downstream socket connected", metadata: ["listener": "\(listener)", "downstream": "\(plan.downstreams[target].name)"])
        }
        outbox.flush(&result)
        return outbox.refused
    }

    /// ICMP errors the shared socket's error queue held: each downstream (or pool member) they were
    /// about sends through its own connected socket for a while, and a port unreachable is
    /// reported to passive health, as a connected socket's ECONNREFUSED is.
    private func noteICMPErrors() {
        for (address, error) in sender.takeErrors() {
            for target in outboxesAt[address] ?? [] { outboxes[target].drewError(at: address) }
            replicator.drewError(at: address)
            if error == ECONNREFUSED, sender.firstReport(of: address), let report = plan?.passiveHealth { report(address) }
        }
    }
}
