// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import Logging
import ReusePortLB
import Synchronization

/// A listener's NetFlow v9 / IPFIX templates (`settings.flow_templates`): each exporter's latest
/// templates, shared by the listener's workers and kept across reloads (it lives with the
/// listener's counters), and what was done with them, counted.
final class FlowTemplateState: Sendable {
    let cache = Mutex(FlowTemplateCache())
    /// A number no other state of this process has: a listener whose option was turned off and
    /// on again, or that was removed and added again, has a new state (``TemplateHandOver``).
    let serial = FlowTemplateState.serials.wrappingAdd(1, ordering: .relaxed).newValue
    private static let serials = Atomic<UInt64>(0)
    /// Flow export packets that carried templates (or withdrawals).
    let templatePackets = Atomic<UInt64>(0)
    /// Template packets sent to the other downstreams when an exporter's templates changed.
    let copies = Atomic<UInt64>(0)
    /// Template packets sent to a downstream that took over an exporter without its templates.
    let replays = Atomic<UInt64>(0)
    /// Version 9 or 10 datagrams whose sets did not add up (forwarded as they are, not learned).
    let malformed = Atomic<UInt64>(0)
    /// Copies and replays a send dropped (the downstream's socket refused them).
    let sendDropped = Atomic<UInt64>(0)
    /// Datagrams of data sent to a downstream not known to hold their exporter's templates,
    /// which are not known here either (udp-fanout has not seen them since it started, or the
    /// exporter was evicted): the collector drops them until the exporter's next template.
    let unknown = Atomic<UInt64>(0)
    /// Kernel kinds: template-bearing datagrams the program forwarded without passing them up
    /// (longer than it reads, its ring buffer full, or a fragment), from its counters.
    let kernelTooLarge = Atomic<UInt64>(0)
    /// Kernel kinds: template-bearing datagrams the program passed up (template_packets counts
    /// those the daemon took: the difference was still in the ring buffer at a stop, or came for
    /// a listener instance that had stopped), and datagrams whose sets after the program's 16th
    /// were not looked at.
    let kernelPassedUp = Atomic<UInt64>(0)
    let kernelSetsUnread = Atomic<UInt64>(0)
    /// Kernel kinds: the set the program reads as the daemon last put it in force, and each
    /// exporter address's source port (its copies and replays leave from it), kept across the
    /// listener's instances: a reload's successor replays against the set its predecessor left.
    let kernelFollowing = Mutex<(plan: KernelTemplateFollower.Plan?, ports: [IPAddress: UInt16])>((nil, [:]))
    let kernelRingFull = Atomic<UInt64>(0)
    let kernelFragmented = Atomic<UInt64>(0)
    /// Raised whenever the cache learns a change: a worker that found an exporter's templates
    /// missing asks the cache again only after it moved.
    let generation = Atomic<UInt64>(0)
    /// Raised at every change a restart must hand over (``TemplateHandOver``): the cache's, an
    /// exporter's source port, the kernel kinds' set in force.
    let handOverVersion = Atomic<UInt64>(0)

    /// The listener's families' samples (`labels` are the listener's).
    func metricsRows(_ labels: String) -> (events: [(String, UInt64)], exporters: (String, UInt64), templates: (String, UInt64)) {
        let (counters, exporters, templates) = cache.withLock { ($0.counters, $0.exporterCount, $0.templateCount) }
        let events: [(String, UInt64)] = [
            ("template_packets", templatePackets.load(ordering: .relaxed)),
            ("defined", counters.defined), ("redefined", counters.redefined), ("withdrawn", counters.withdrawn),
            ("copied", copies.load(ordering: .relaxed)), ("replayed", replays.load(ordering: .relaxed)),
            ("malformed", malformed.load(ordering: .relaxed)), ("send_dropped", sendDropped.load(ordering: .relaxed)),
            ("unknown_templates", unknown.load(ordering: .relaxed)),
            ("exporters_evicted", counters.exportersEvicted), ("templates_refused", counters.templatesRefused),
            ("too_large", kernelTooLarge.load(ordering: .relaxed)), ("ring_full", kernelRingFull.load(ordering: .relaxed)),
            ("fragmented", kernelFragmented.load(ordering: .relaxed)), ("passed_up", kernelPassedUp.load(ordering: .relaxed)),
            ("sets_unread", kernelSetsUnread.load(ordering: .relaxed)),
        ]
        return (events.map { (labels + ",event=\"\($0.0)\"", $0.1) }, (labels, UInt64(exporters)), (labels, UInt64(templates)))
    }
}

/// One worker's part of `flow_templates`: it learns the templates of the flow export datagrams
/// it receives, copies an exporter's templates to every other downstream of the plan, and to
/// every member of each balanced replication pool that takes the exporter, when they change; and
/// before a datagram of an exporter goes to a downstream or pool member not known to hold its
/// templates (it joined, came back, the exporter moved there, or a copy to it was dropped), sends
/// it the exporter's templates. Copies and replays leave through outboxes of their own, sent
/// before the batch's datagrams (so a replay leaves before the data it serves), the way the data
/// leaves (the listener's output, or a pool's own): from the exporter's address where it keeps
/// sources. A datagram of data alone costs a walk over its set headers and two lookups per
/// receiver; anything not version 9 or 10, one comparison.
final class FlowTemplateRelay {
    typealias Exporter = FlowTemplateCache.Exporter

    /// A receiver as a collector sees it: its address, and the way datagrams reach it (from the
    /// exporter's address or this host's). A collector that is a downstream of the listener and
    /// a member of a pool with the same way out is one receiver; with another way out it sees
    /// another source, so it is another.
    struct Way: Hashable {
        let address: SocketAddress
        /// From the exporter's address (`preserve_source`, `xdp_tx`), or from this host's (`socket`).
        let keepsSource: Bool

        init(address: SocketAddress, output: Output) {
            self.address = address
            keepsSource = output != .socket
        }

        /// How copies and replays leave for it.
        var output: Output { keepsSource ? .preserveSource : .socket }
    }

    let state: FlowTemplateState
    private let output: Output
    private let sender: SharedSender
    /// Per exporter: the receivers known to hold its current templates (this worker sent them a
    /// copy, a replay, or the exporter's own datagram with them), each with its epoch then.
    private var informed: [Exporter: [Way: UInt64]] = [:]
    /// Per receiver of the plan: its epoch, a value never given before, renewed when what it
    /// holds is no longer known (a send to it dropped something): every older mark is void at
    /// once. A receiver that leaves the plan loses its epoch (and its marks), one that comes back
    /// gets a new one.
    private var epochs: [Way: UInt64] = [:]
    private var nextEpoch: UInt64 = 0
    /// Exporters whose templates the cache did not have, at which generation of it.
    private var missing: [Exporter: UInt64] = [:]
    /// At most this many exporters remembered; beyond, the map starts anew (each exporter's next
    /// datagram then replays once more: harmless).
    static let maximumExporters = 65_536
    /// The listener's own downstreams, as receivers.
    private var downstreams: [Way] = []
    /// The plan's replication pools, in its order (``PoolReplicator/pick(_:)`` indexes them): each
    /// member as a receiver, those an `all` pool copies to, and whether one member takes a datagram.
    private var pools: [(members: [Way], every: [Way], balanced: Bool)] = []
    /// Every receiver of the plan, with the downstream it sends to.
    private var present: [Way: Downstream] = [:]
    /// The outboxes of copies and replays, by receiver, made on first use and kept while it is in the plan.
    private var lanes: [Way: any Outbox] = [:]
    private var touched: [Way] = []
    /// Packets waiting in the lanes (their bytes in `arena`) until ``flush()``.
    private let arena: UnsafeMutableRawPointer
    static let arenaSize = 1 << 18
    private var used = 0
    static let laneCapacity = 64
    /// How many of each lane's packets are copies and replays, for the counters.
    private var pending: [Way: (copies: UInt64, replays: UInt64)] = [:]

    /// - Parameter output: the listener's way out (its lanes hold ``laneCapacity`` packets each).
    init(state: FlowTemplateState, sender: SharedSender, output: Output) {
        self.state = state
        self.sender = sender
        self.output = output
        arena = .allocate(byteCount: Self.arenaSize, alignment: 8)
    }

    deinit { arena.deallocate() }

    /// A new plan: the receivers that left it are forgotten (one that comes back is replayed to).
    func adopt(_ plan: ForwardingPlan) {
        flush()
        let previous = Set(present.keys)
        var ways: [Way: Downstream] = [:]
        downstreams = plan.downstreams.map { downstream in
            let way = Way(address: downstream.address, output: output)
            if ways[way] == nil { ways[way] = downstream }
            return way
        }
        pools = plan.pools.map { pool in
            let members = pool.members.map { member in
                let way = Way(address: member.address, output: pool.output ?? output)
                if ways[way] == nil { ways[way] = member }
                return way
            }
            return (members, pool.everyMember.map { members[$0] }, pool.method != nil)
        }
        present = ways
        lanes = lanes.filter { ways[$0.key] != nil }
        let left = previous.filter { ways[$0] == nil }
        for way in left { epochs[way] = nil }
        if !left.isEmpty {
            for exporter in informed.keys { informed[exporter] = informed[exporter]?.filter { !left.contains($0.key) } }
        }
        for way in ways.keys where !previous.contains(way) { forget(way) }
    }

    /// What the listener's downstream at `address` holds is no longer known (a send to it
    /// dropped something): the next datagram of each exporter to it replays.
    func forget(_ address: SocketAddress) { forget(Way(address: address, output: output)) }

    /// What `way` holds is no longer known: the next datagram of each exporter to it replays.
    func forget(_ way: Way) {
        guard present[way] != nil else { return }
        nextEpoch &+= 1
        epochs[way] = nextEpoch
    }

    private func holds(_ exporter: Exporter, _ way: Way) -> Bool {
        guard let epoch = epochs[way] else { return false }
        return informed[exporter]?[way] == epoch
    }

    /// Called for each datagram before it is appended for downstream `target` (nil: none
    /// available; its templates are still learned), after the replication pools were offered it.
    /// - Parameter replicator: the thread's replication, which was offered the datagram (its
    ///   ``PoolReplicator/pick(_:)`` says what each pool did with it); nil: no pools.
    @inline(__always)
    func note(_ target: Int?, _ payload: UnsafeRawBufferPointer, source: UnsafePointer<sockaddr_storage>, pools replicator: PoolReplicator? = nil) {
        guard payload.count >= 2, payload[0] == 0, payload[1] == 9 || payload[1] == 10 else { return }
        learn(target, payload, source: source, picks: replicator)
    }

    /// Calls `body` with each receiver of the datagram: the listener's `target`, and each pool's
    /// member (or, for `all`, every weighted member) as the replicator's picks say.
    @inline(__always)
    private func forEachReceiver(_ target: Way?, _ picks: PoolReplicator?, _ body: (Way) -> Void) {
        if let target { body(target) }
        guard let picks else { return }
        for index in 0..<min(pools.count, picks.poolCount) {
            let pick = picks.pick(index)
            if pick >= 0 {
                if pick < pools[index].members.count { body(pools[index].members[pick]) }
            } else if pick == PoolReplicator.Pick.everyMember {
                for member in pools[index].every { body(member) }
            }
        }
    }

    private func learn(_ target: Int?, _ payload: UnsafeRawBufferPointer, source: UnsafePointer<sockaddr_storage>, picks: PoolReplicator?) {
        guard let ip = SocketAddress(storage: source)?.ip else { return }
        let own = target.flatMap { $0 < downstreams.count ? downstreams[$0] : nil }
        var lacking = false
        if let (version, domain) = FlowExport.header(payload) {
            let exporter = Exporter(address: ip, version: version, domain: domain)
            // The exporter's templates, asked of the shared cache once, for the first receiver
            // that lacks them, and only once the cache learned something since it last had none.
            var packets: [[UInt8]]?
            forEachReceiver(own, picks) { receiver in
                guard !holds(exporter, receiver) else { return }
                if packets == nil {
                    let generation = state.generation.load(ordering: .acquiring)
                    packets = missing[exporter] == generation ? [] : state.cache.withLock { $0.replay(exporter) }
                    if packets!.isEmpty {
                        if missing.count >= Self.maximumExporters { missing = [:] }
                        missing[exporter] = generation
                    }
                }
                guard let packets, !packets.isEmpty else {
                    lacking = true
                    return
                }
                for packet in packets { enqueue(receiver, Self.headed(packet, like: payload), source: source, copy: false) }
                inform(exporter, receiver)
            }
        }
        guard FlowExport.needsParsing(payload) else {
            if lacking { state.unknown.wrappingAdd(1, ordering: .relaxed) }
            return
        }
        let packet: FlowExport.Packet
        switch FlowExport.parse(payload) {
        case .packet(let parsed) where !parsed.changes.isEmpty: packet = parsed
        case .malformed: state.malformed.wrappingAdd(1, ordering: .relaxed); return
        default:
            if lacking { state.unknown.wrappingAdd(1, ordering: .relaxed) }
            return
        }
        state.templatePackets.wrappingAdd(1, ordering: .relaxed)
        let exporter = Exporter(address: ip, version: packet.version, domain: packet.domain)
        let copies: [[UInt8]]? = state.cache.withLock { cache in
            guard cache.apply(packet, from: ip) else { return nil }
            state.generation.wrappingAdd(1, ordering: .releasing)
            state.handOverVersion.wrappingAdd(1, ordering: .releasing)
            return cache.replay(exporter)
        }
        // The receivers get the templates with the datagram itself.
        var reached: Set<Way> = []
        forEachReceiver(own, picks) { receiver in
            inform(exporter, receiver)
            if copies != nil { reached.insert(receiver) }
        }
        guard let copies else { return }
        // Changed: every other downstream, and every other member of each balanced pool that
        // takes this exporter, gets its templates as they are now.
        func copy(to other: Way) {
            guard reached.insert(other).inserted else { return }
            for copy in copies { enqueue(other, copy, source: source, copy: true) }
            inform(exporter, other)
        }
        for other in downstreams { copy(to: other) }
        guard let picks else { return }
        for index in 0..<min(pools.count, picks.poolCount) where pools[index].balanced && picks.pick(index) != PoolReplicator.Pick.notTaken {
            for member in pools[index].members { copy(to: member) }
        }
    }

    private func inform(_ exporter: Exporter, _ way: Way) {
        guard let epoch = epochs[way] else { return }
        if informed.count >= Self.maximumExporters && informed[exporter] == nil { informed = [:] }
        informed[exporter, default: [:]][way] = epoch
    }

    /// A replayed packet with the header times and sequence number of the datagram it precedes
    /// (same version and domain): an IPFIX collector sees no gap (template records do not count
    /// in its sequence), a v9 one the datagram's number twice.
    static func headed(_ packet: [UInt8], like datagram: UnsafeRawBufferPointer) -> [UInt8] {
        var headed = packet
        let fields = packet.count >= 2 && packet[1] == 9 ? 4..<16 : 4..<12
        guard datagram.count >= fields.upperBound, headed.count >= fields.upperBound else { return packet }
        for index in fields { headed[index] = datagram[index] }
        return headed
    }

    private func enqueue(_ way: Way, _ packet: [UInt8], source: UnsafePointer<sockaddr_storage>, copy: Bool) {
        guard packet.count <= Self.arenaSize, let downstream = present[way] else { return }
        if used + packet.count > Self.arenaSize || (lanes[way]?.count ?? 0) >= Self.laneCapacity { flush() }
        let lane: any Outbox
        if let made = lanes[way] {
            lane = made
        } else {
            lane = Outboxes.factory(output: way.output, capacity: Self.laneCapacity)(downstream, sender)
            lanes[way] = lane
        }
        let bytes = UnsafeMutableRawBufferPointer(start: arena + used, count: packet.count)
        bytes.copyBytes(from: packet)
        used += packet.count
        if lane.count == 0 { touched.append(way) }
        lane.append(UnsafeRawBufferPointer(bytes), source: source, hopLimit: 0)
        if copy { pending[way, default: (0, 0)].copies += 1 } else { pending[way, default: (0, 0)].replays += 1 }
    }

    /// Sends what waits (before the batch's own datagrams), and counts it. A downstream a copy
    /// or replay could not be sent to is no longer known to hold anything: the next datagram of
    /// each exporter to it replays again.
    func flush() {
        guard !touched.isEmpty else { return }
        for way in touched {
            guard let lane = lanes[way] else { continue }
            var result: FlushResult = (0, 0, DropTally())
            _ = lane.reconnectIfDue()
            lane.flush(&result)
            let dropped = result.dropped.total
            let sent = pending[way] ?? (0, 0)
            // What was dropped is taken from the replays first, then the copies.
            let replaysSent = sent.replays - min(sent.replays, dropped)
            let copiesSent = sent.copies - min(sent.copies, dropped - min(sent.replays, dropped))
            state.replays.wrappingAdd(replaysSent, ordering: .relaxed)
            state.copies.wrappingAdd(copiesSent, ordering: .relaxed)
            if dropped > 0 {
                state.sendDropped.wrappingAdd(dropped, ordering: .relaxed)
                forget(way)
            }
        }
        touched.removeAll(keepingCapacity: true)
        pending.removeAll(keepingCapacity: true)
        used = 0
    }
}
