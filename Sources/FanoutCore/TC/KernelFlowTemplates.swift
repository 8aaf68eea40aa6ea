// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import CLibBPF
import Logging
import ReusePortLB
import Synchronization
import SystemCalls

/// `settings.flow_templates` in the kernel kinds (tc_ebpf, xdp): the program forwards every
/// datagram itself and passes a copy of each template-bearing one to the daemon through a ring
/// buffer (bpf/include/fanout_templates.h). This reads that ring buffer on a thread of its own,
/// one per loaded program, and hands each datagram to its listener's ``KernelTemplateFollower``.
final class TCTemplateTap: Sendable {
    private let followers = Mutex<[UInt32: KernelTemplateFollower]>([:])
    /// Ids unregistered, with the reader's round then: each keeps its follower until a round
    /// that began after it, so what its listener's program entry passed up before it stopped
    /// still reaches its follower (whose templates a reload's successor shares).
    private let retiring = Mutex<[UInt32: UInt64]>([:])
    private let rounds = Atomic<UInt64>(0)
    private let reader = Mutex<RingBufferReader?>(nil)
    /// Events of a listener id no follower is registered for (a listener stopping, or one turned off).
    let unclaimed = Atomic<UInt64>(0)

    init(ringBuffer fd: Int32, logger: Logger) throws(SystemCallError) {
        let made = try RingBufferReader(
            ringBuffer: fd, map: FANOUT_MAP_TEMPLATES_NAME, threadName: "udp-fanout-tpl",
            failure: "flow_templates: reading the program's template-bearing datagrams failed; they are forwarded but not learned while it lasts (counted: passed_up grows, template_packets does not)",
            logger: logger,
            round: { [weak self] pollOnce in
                guard let self else {
                    _ = pollOnce()  // gone without stop(): still no busy loop
                    return
                }
                let round = self.rounds.add(1, ordering: .relaxed).newValue
                let result = pollOnce()
                self.retire(before: round)
                // The kernel wakes an idle reader for each datagram: with the exporters'
                // templates every few packets that is a wakeup per template. Letting them
                // gather for a moment takes them in batches (make bench BENCH=templates).
                if result > 0 { usleep(Self.gather) }
            },
            drainAtStop: true,
            deliver: { [weak self] data, size in self?.deliver(data, size: size) })
        reader.withLock { $0 = made }
    }

    /// How long the reader lets datagrams gather after it took some, in microseconds: templates
    /// are learned, copied and replayed within that much more.
    static let gather: useconds_t = 5_000

    func register(id: UInt32, _ follower: KernelTemplateFollower) {
        retiring.withLock { _ = $0.removeValue(forKey: id) }
        followers.withLock { $0[id] = follower }
    }

    /// Takes `id`'s follower out once the reader has read what was passed up for it so far.
    func unregister(id: UInt32) {
        let round = rounds.load(ordering: .relaxed)
        retiring.withLock { $0[id] = round }
    }

    /// Drops the followers of ids unregistered before the round `round` began.
    private func retire(before round: UInt64) {
        let gone = retiring.withLock { retiring -> [UInt32] in
            let due = retiring.filter { $0.value < round }.map(\.key)
            for id in due { retiring[id] = nil }
            return due
        }
        guard !gone.isEmpty else { return }
        followers.withLock { followers in for id in gone { followers[id] = nil } }
    }

    /// No follower left but the retiring ones.
    var isEmpty: Bool {
        let leaving = retiring.withLock { Set($0.keys) }
        return followers.withLock { $0.keys.allSatisfy { leaving.contains($0) } }
    }

    /// Stops the reader (within its 100 ms poll; what the ring holds is still delivered) and
    /// frees the ring. Idempotent.
    func stop() {
        reader.withLock { $0 }?.stop()
    }

    private func deliver(_ data: UnsafeRawPointer, size: Int) {
        let header = MemoryLayout<fanout_template_event>.offset(of: \.data)!
        guard size >= header else { return }
        let event = data.loadUnaligned(as: (UInt32, UInt32).self)
        let (id, length) = event
        guard Int(length) <= size - header, Int(length) <= Int(FANOUT_TEMPLATE_DATA_MAX) else { return }
        let words = data.loadUnaligned(fromByteOffset: MemoryLayout<fanout_template_event>.offset(of: \.saddr)!, as: (UInt32, UInt32, UInt32, UInt32).self)
        let port = UInt16(bigEndian: data.loadUnaligned(fromByteOffset: MemoryLayout<fanout_template_event>.offset(of: \.sport)!, as: UInt16.self))
        let family = data.load(fromByteOffset: MemoryLayout<fanout_template_event>.offset(of: \.family)!, as: UInt8.self)
        let ip: IPAddress? = withUnsafeBytes(of: words) { raw in
            Int32(family) == AF_INET ? IPAddress(bytes: raw.prefix(4)) : IPAddress(bytes: raw)
        }
        guard let ip, let follower = followers.withLock({ $0[id] }) else {
            unclaimed.add(1, ordering: .relaxed)
            return
        }
        follower.received(UnsafeRawBufferPointer(start: data + header, count: Int(length)), from: SocketAddress(ip: ip, port: port))
    }
}

/// One kernel-kind listener's part of `flow_templates`: it learns the templates the program
/// passes up (into the listener's ``FlowTemplateState``, kept across reloads), copies an
/// exporter's templates to every downstream of the set, and to every member of each replication
/// pool that takes the exporter, when they change, and, whenever a set changes (a reload, health,
/// discovery, a weight), sends each downstream or pool member that becomes an exporter's (its
/// table slot moved there, or it joined a round-robin or `all` set) that exporter's templates
/// before the new set is in force. Copies and replays leave from the exporter's address
/// and port, as the program's own datagrams do, through a raw socket (CAP_NET_RAW).
final class KernelTemplateFollower: @unchecked Sendable {  // everything mutable is under `plan`
    typealias Exporter = FlowTemplateCache.Exporter
    let state: FlowTemplateState
    private let listener: String
    private let logger: Logger

    /// The set in force as the program reads it: the listener's, and each replication pool's.
    struct Plan: Sendable {
        var downstreams: [SocketAddress] = []
        var sourceIP = true
        var table: [UInt16] = []
        var seed: UInt32 = 0
        /// The listener's replication pools (bpf/include/fanout_pools.h), in its order.
        var pools: [Pool] = []

        /// A replication pool as the program reads it: its set, and which sources it takes.
        struct Pool: Sendable {
            /// `downstreams`: the members in its set (an `all` pool: those with a weight);
            /// `sourceIP` false: round robin or `all`, every member gets the exporter's data.
            var set: Plan
            var sample: UInt32
            /// Its `sources` (empty: every source), and their filter.
            let prefixes: [SourcePrefix]
            let sources: SourceFilter

            init(set: Plan, sample: UInt32, prefixes: [SourcePrefix]) {
                self.set = set
                self.sample = sample
                self.prefixes = prefixes
                sources = SourceFilter(prefixes)
            }

            /// The pool takes `address`'s datagrams: its `sources` admit it and its `sample` keeps it.
            func takes(_ address: IPAddress) -> Bool {
                var storage = sockaddr_storage()
                _ = SocketAddress(ip: address, port: 0).write(to: &storage)
                return withUnsafePointer(to: &storage) { source in
                    sources.admits(source) && PoolPlan.samples(source, sample)
                }
            }
        }

        init() {}

        init(_ set: BackendSet, downstreams: [SocketAddress], sourceIP: Bool, pools: [Pool] = []) {
            self.downstreams = downstreams
            self.sourceIP = sourceIP
            table = set.table
            seed = set.seed
            self.pools = pools
        }

        /// The listener's downstream that receives `address`'s datagrams: one (source_ip), or
        /// nil for round robin (every one) and an empty set.
        func owner(of address: IPAddress) -> SocketAddress? {
            guard sourceIP, !table.isEmpty else { return nil }
            var words = address.words
            let count: UInt32 = address.family == AF_INET ? 1 : 4
            let hash = withUnsafePointer(to: &words) { $0.withMemoryRebound(to: UInt32.self, capacity: 4) { rplb_source_hash($0, count, 0, seed, 0) } }
            let index = Int(table[Int(rplb_reduce(hash, UInt32(table.count)))])
            return index < downstreams.count ? downstreams[index] : nil
        }

        /// Every address that receives `address`'s datagrams: the listener's downstream (or
        /// downstreams), and those of each pool that takes it; each once.
        func receivers(of address: IPAddress) -> [SocketAddress] {
            var all = ownReceivers(of: address)
            for pool in pools where pool.takes(address) { all += pool.set.ownReceivers(of: address) }
            return Self.unique(all)
        }

        /// Every address that is sent a copy when `address`'s templates change: each downstream
        /// of the listener's set and of each pool that takes it, once.
        func copyTargets(of address: IPAddress) -> [SocketAddress] {
            Self.unique(downstreams + pools.filter { $0.takes(address) }.flatMap(\.set.downstreams))
        }

        /// Every address of the plan (ways out to others close).
        var everyAddress: Set<SocketAddress> { Set(downstreams + pools.flatMap(\.set.downstreams)) }

        private func ownReceivers(of address: IPAddress) -> [SocketAddress] {
            if sourceIP { return owner(of: address).map { [$0] } ?? [] }
            return downstreams
        }

        private static func unique(_ addresses: [SocketAddress]) -> [SocketAddress] {
            var seen = Set<SocketAddress>()
            return addresses.filter { seen.insert($0).inserted }
        }
    }

    private struct Mutable {
        /// The set this instance last put in force (``reassert()`` puts it back).
        var lastPlan: Plan?
        var outboxes: [SocketAddress: SourcePreservingOutbox] = [:]
        /// Downstreams whose raw socket could not be opened, said once each.
        var refused: Set<SocketAddress> = []
    }
    private let mutable = Mutex(Mutable())

    init(listener: String, state: FlowTemplateState, logger: Logger) {
        self.listener = listener
        self.state = state
        self.logger = logger
    }

    /// A template-bearing datagram the program passed up (the tap's thread).
    func received(_ payload: UnsafeRawBufferPointer, from source: SocketAddress) {
        state.templatePackets.add(1, ordering: .relaxed)
        let packet: FlowExport.Packet
        switch FlowExport.parse(payload) {
        case .notFlowExport: return
        case .malformed:
            state.malformed.add(1, ordering: .relaxed)
            return
        case .packet(let parsed): packet = parsed
        }
        let changed = state.cache.withLock { $0.apply(packet, from: source.ip) }
        if changed {
            state.generation.add(1, ordering: .relaxed)
            state.handOverVersion.add(1, ordering: .relaxed)
        }
        mutable.withLock { mutable in
            // Bounded: beyond the limit, the ports of addresses the cache no longer holds go.
            let kept: Set<IPAddress>? = state.kernelFollowing.withLock { $0.ports[source.ip] == nil && $0.ports.count >= Self.maximumPorts }
                ? Set(state.cache.withLock { $0.allExporters.map(\.address) }) : nil
            let plan = state.kernelFollowing.withLock { following in
                if let kept { following.ports = following.ports.filter { kept.contains($0.key) } }
                if following.ports.updateValue(source.port, forKey: source.ip) != source.port { state.handOverVersion.add(1, ordering: .relaxed) }
                return following.plan
            }
            guard changed, let plan else { return }
            // Every downstream of the set in force gets a copy, and every member of each pool
            // that takes the exporter, its own too: the program forwarded the datagram by the
            // set it read then, which may be the one before this plan (a flip between the two),
            // and this exporter may have been unknown to the replays of that flip. A collector
            // takes a template it has again.
            let exporter = Exporter(address: source.ip, version: packet.version, domain: packet.domain)
            let sent = send(state.cache.withLock { $0.replay(exporter) }, from: source, to: plan.copyTargets(of: source.ip), in: &mutable)
            state.copies.add(sent, ordering: .relaxed)
        }
    }

    /// Puts `plan` in force for what follows: before the caller flips the program to the new
    /// set, each downstream that receives an exporter's datagrams in `plan` and did not in the
    /// previous plan is sent that exporter's templates. Returns the previous plan (for
    /// ``restore(_:)`` when the flip fails).
    @discardableResult
    func switchPlan(to plan: Plan) -> Plan? {
        mutable.withLock { mutable in
            // Under this lock, so an exporter learnt meanwhile is either replayed here or copied
            // by ``received(_:from:)`` under this plan.
            let exporters = state.cache.withLock { $0.allExporters }
            mutable.lastPlan = plan
            let (previous, ports) = state.kernelFollowing.withLock { following in
                defer {
                    following.plan = plan
                    state.handOverVersion.add(1, ordering: .relaxed)
                }
                return (following.plan, following.ports)
            }
            guard !exporters.isEmpty else { return previous }
            var replayed: UInt64 = 0
            for exporter in exporters {
                let before = Set(previous?.receivers(of: exporter.address) ?? [])
                let newly = plan.receivers(of: exporter.address).filter { !before.contains($0) }
                guard !newly.isEmpty else { continue }
                let packets = state.cache.withLock { $0.replay(exporter) }
                guard let port = ports[exporter.address] else {
                    // Its port was pruned (more than maximumPorts addresses sent templates): no
                    // source port to send from until its next template. Counted, not sent from port 0.
                    state.sendDropped.add(UInt64(packets.count * newly.count), ordering: .relaxed)
                    continue
                }
                replayed += send(packets, from: SocketAddress(ip: exporter.address, port: port), to: newly, in: &mutable)
            }
            state.replays.add(replayed, ordering: .relaxed)
            // Ways out to downstreams no longer in the set close.
            let present = plan.everyAddress
            for address in mutable.outboxes.keys where !present.contains(address) { mutable.outboxes[address] = nil }
            return previous
        }
    }

    /// The plan before a flip that failed: the program still reads it (what was replayed for the
    /// failed one is harmless, a collector takes a template it has again).
    func restore(_ plan: Plan?) {
        mutable.withLock { _ in state.kernelFollowing.withLock { $0.plan = plan } }
        state.handOverVersion.add(1, ordering: .relaxed)
    }

    /// This instance's set is in force again (a failed reload's rollback wrote its listener
    /// entry back): replays to the downstreams it gives exporters back to, as for any change.
    func reassert() {
        guard let plan = mutable.withLock({ $0.lastPlan }) else { return }
        switchPlan(to: plan)
    }

    static let maximumPorts = 65_536

    /// Sends `packets` from `source` to each of `targets`; returns how many left, counts the rest
    /// `send_dropped`.
    private func send(_ packets: [[UInt8]], from source: SocketAddress, to targets: [SocketAddress], in mutable: inout Mutable) -> UInt64 {
        guard !packets.isEmpty, !targets.isEmpty else { return 0 }
        var storage = sockaddr_storage()
        _ = source.write(to: &storage)
        var sent: UInt64 = 0
        for target in targets {
            guard let outbox = outbox(target, in: &mutable) else {
                state.sendDropped.add(UInt64(packets.count), ordering: .relaxed)
                continue
            }
            var result: FlushResult = (0, 0, DropTally())
            for start in stride(from: 0, to: packets.count, by: Self.batch) {
                let part = packets[start..<min(packets.count, start + Self.batch)]
                withUnsafePointer(to: &storage) { source in
                    // The payloads stay in place until the flush, within this closure.
                    func append(_ rest: ArraySlice<[UInt8]>) {
                        guard let first = rest.first else {
                            outbox.flush(&result)
                            return
                        }
                        first.withUnsafeBytes { bytes in
                            outbox.append(bytes, source: source, hopLimit: 0)
                            append(rest.dropFirst())
                        }
                    }
                    append(part)
                }
            }
            sent += result.sent
            let dropped = result.dropped.total
            if dropped > 0 { state.sendDropped.add(dropped, ordering: .relaxed) }
        }
        return sent
    }

    static let batch = 16

    private func outbox(_ address: SocketAddress, in mutable: inout Mutable) -> SourcePreservingOutbox? {
        if let made = mutable.outboxes[address] { return made }
        do throws(OutboxError) {
            let made = try SourcePreservingOutbox(address: address, capacity: Self.batch)
            mutable.outboxes[address] = made
            mutable.refused.remove(address)
            return made
        } catch {
            if mutable.refused.insert(address).inserted {
                logger.error("flow_templates: cannot send templates to a downstream (counted send_dropped)", metadata: [
                    "listener": "\(listener)", "downstream": "\(address)", "error": "\(error)",
                ])
            }
            return nil
        }
    }
}
