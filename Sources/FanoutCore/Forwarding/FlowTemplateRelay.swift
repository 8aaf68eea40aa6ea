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

    /// The listener's families' samples (`labels` are the listener's).
    func metricsRows(_ labels: String) -> (events: [(String, UInt64)], exporters: (String, UInt64), templates: (String, UInt64)) {
        let (counters, exporters, templates) = cache.withLock { ($0.counters, $0.exporterCount, $0.templateCount) }
        let events: [(String, UInt64)] = [
            ("template_packets", templatePackets.load(ordering: .relaxed)),
            ("defined", counters.defined), ("redefined", counters.redefined), ("withdrawn", counters.withdrawn),
            ("copied", copies.load(ordering: .relaxed)), ("replayed", replays.load(ordering: .relaxed)),
            ("malformed", malformed.load(ordering: .relaxed)), ("send_dropped", sendDropped.load(ordering: .relaxed)),
            ("exporters_evicted", counters.exportersEvicted), ("templates_refused", counters.templatesRefused),
        ]
        return (events.map { (labels + ",event=\"\($0.0)\"", $0.1) }, (labels, UInt64(exporters)), (labels, UInt64(templates)))
    }
}

/// One worker's part of `flow_templates`: it learns the templates of the flow export datagrams
/// it forwards, copies an exporter's templates to every other downstream of the plan when they
/// change, and before the first datagram of an exporter to a downstream that does not hold its
/// templates (it joined, came back, or the exporter moved there), sends that downstream the
/// exporter's templates. Copies and replays leave through outboxes of their own, sent before the
/// batch's datagrams (so a replay arrives before the data it serves), from the exporter's address
/// where the listener's `output` keeps sources. Only datagrams whose first two bytes say version
/// 9 or 10 are parsed; anything else costs one comparison.
final class FlowTemplateRelay {
    let state: FlowTemplateState
    private let makeOutbox: BatchForwarder.OutboxFactory
    private let sender: SharedSender
    /// Per exporter address: the downstreams known to hold its current templates (they were
    /// sent a copy or a replay by this worker, or its datagrams with the templates).
    private var informed: [IPAddress: Set<SocketAddress>] = [:]
    /// At most this many exporters remembered; beyond, the map starts anew (each exporter's next
    /// datagram then replays once more: harmless).
    static let maximumExporters = 65_536
    private var downstreams: [Downstream] = []
    /// The outboxes of copies and replays, by downstream index, made on first use per plan.
    private var lanes: [Int: any Outbox] = [:]
    private var touched: [Int] = []
    /// Packets waiting in the lanes (their bytes in `arena`) until ``flush()``.
    private let arena: UnsafeMutableRawPointer
    static let arenaSize = 1 << 18
    private var used = 0
    static let laneCapacity = 64
    /// Which packets each lane holds are copies (else replays), for the counters.
    private var pending: [Int: (copies: UInt64, replays: UInt64)] = [:]

    /// - Parameter output: the listener's way out (its lanes hold ``laneCapacity`` packets each).
    init(state: FlowTemplateState, sender: SharedSender, output: Output) {
        self.state = state
        self.sender = sender
        makeOutbox = Outboxes.factory(output: output, capacity: Self.laneCapacity)
        arena = .allocate(byteCount: Self.arenaSize, alignment: 8)
    }

    deinit { arena.deallocate() }

    /// A new plan: the downstreams that left it are forgotten (one that comes back is replayed to).
    func adopt(_ plan: ForwardingPlan) {
        flush()
        downstreams = plan.downstreams
        lanes = [:]
        let present = Set(plan.downstreams.map(\.address))
        for (exporter, holders) in informed { informed[exporter] = holders.intersection(present) }
    }

    /// Called for each datagram before it is appended for downstream `target`.
    @inline(__always)
    func note(_ target: Int, _ payload: UnsafeRawBufferPointer, source: UnsafePointer<sockaddr_storage>) {
        guard payload.count >= 16, payload[0] == 0, payload[1] == 9 || payload[1] == 10 else { return }
        learn(target, payload, source: source)
    }

    private func learn(_ target: Int, _ payload: UnsafeRawBufferPointer, source: UnsafePointer<sockaddr_storage>) {
        guard target < downstreams.count, let exporter = SocketAddress(storage: source)?.ip else { return }
        let address = downstreams[target].address
        if informed.count >= Self.maximumExporters && informed[exporter] == nil { informed = [:] }
        if !(informed[exporter]?.contains(address) ?? false) {
            // This downstream lacks what the cache holds for the exporter (nothing, on first contact).
            let packets = state.cache.withLock { cache in cache.exporters(at: exporter).flatMap { cache.replay($0) } }
            for packet in packets { enqueue(target, packet, source: source, copy: false) }
            informed[exporter, default: []].insert(address)
        }
        let packet: FlowExport.Packet
        switch FlowExport.parse(payload) {
        case .packet(let parsed) where !parsed.changes.isEmpty: packet = parsed
        case .malformed: state.malformed.wrappingAdd(1, ordering: .relaxed); return
        default: return
        }
        state.templatePackets.wrappingAdd(1, ordering: .relaxed)
        let copies: [[UInt8]]? = state.cache.withLock { cache in
            guard cache.apply(packet, from: exporter) else { return nil }
            return cache.replay(FlowTemplateCache.Exporter(address: exporter, version: packet.version, domain: packet.domain))
        }
        guard let copies else { return }
        // Changed: every other downstream gets the exporter's templates as they are now.
        for other in downstreams.indices where downstreams[other].address != address {
            for packet in copies { enqueue(other, packet, source: source, copy: true) }
        }
        informed[exporter] = Set(downstreams.map(\.address))
    }

    private func enqueue(_ target: Int, _ packet: [UInt8], source: UnsafePointer<sockaddr_storage>, copy: Bool) {
        guard packet.count <= Self.arenaSize else { return }
        if used + packet.count > Self.arenaSize || (lanes[target]?.count ?? 0) >= Self.laneCapacity { flush() }
        let lane: any Outbox
        if let made = lanes[target] {
            lane = made
        } else {
            lane = makeOutbox(downstreams[target], sender)
            lanes[target] = lane
        }
        let bytes = UnsafeMutableRawBufferPointer(start: arena + used, count: packet.count)
        bytes.copyBytes(from: packet)
        used += packet.count
        if lane.count == 0 { touched.append(target) }
        lane.append(UnsafeRawBufferPointer(bytes), source: source, hopLimit: 0)
        if copy { pending[target, default: (0, 0)].copies += 1 } else { pending[target, default: (0, 0)].replays += 1 }
    }

    /// Sends what waits (before the batch's own datagrams), and counts it.
    func flush() {
        guard !touched.isEmpty else { return }
        for target in touched {
            guard let lane = lanes[target] else { continue }
            var result: FlushResult = (0, 0, [:])
            _ = lane.reconnectIfDue()
            lane.flush(&result)
            let dropped = result.dropped.values.reduce(0, +)
            let sent = pending[target] ?? (0, 0)
            // What was dropped is taken from the replays first, then the copies.
            let replaysSent = sent.replays - min(sent.replays, dropped)
            let copiesSent = sent.copies - min(sent.copies, dropped - min(sent.replays, dropped))
            state.replays.wrappingAdd(replaysSent, ordering: .relaxed)
            state.copies.wrappingAdd(copiesSent, ordering: .relaxed)
            if dropped > 0 { state.sendDropped.wrappingAdd(dropped, ordering: .relaxed) }
        }
        touched.removeAll(keepingCapacity: true)
        pending.removeAll(keepingCapacity: true)
        used = 0
    }
}
