// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import CSystemShim
import ReusePortLB
import Synchronization

/// What a listener's workers forward to: replaced as a whole when a reload changes only the
/// downstreams or the balancing, so workers keep their sockets and lose nothing.
final class ForwardingPlan: Sendable {
    /// The listener's own downstreams (its first pool).
    let downstreams: [Downstream]
    let balancing: Balancing
    let counters: [DownstreamCounters]
    /// How workers pick a downstream: built once here, not once per worker.
    let method: DownstreamSelector.Method
    /// Passive health: told a downstream's address when a send to it got ICMP port unreachable
    /// (ECONNREFUSED), at most once per batch per downstream (nil: nobody listens).
    let passiveHealth: (@Sendable (SocketAddress) -> Void)?
    /// Replication: the listener's other pools, in file order.
    let pools: [PoolPlan]
    /// QUIC-LB routing over ``downstreams`` (`quic_lb`), nil when the listener has none.
    let quic: QUICRouter?

    /// A downstream's counters are made on first use and kept for the life of the process (see
    /// ``ListenerCounters/downstream(_:)``), so one that leaves and comes back goes on counting.
    /// - Parameters:
    ///   - downstreams: the available members of every group (a pool's carry its name).
    ///   - pools: the listener's pools as configured.
    ///   - quicLB: the listener's QUIC-LB configurations (empty: none).
    init(downstreams: [Downstream], balancing: Balancing, quicLB: [QUICLBConfiguration], pools: [Pool], counters: ListenerCounters,
         passiveHealth: (@Sendable (SocketAddress) -> Void)? = nil) {
        let own = downstreams.filter { $0.pool == nil }
        self.downstreams = own
        self.balancing = balancing
        method = DownstreamSelector.Method(downstreams: own, balancing: balancing)
        quic = QUICRouter(configurations: quicLB, downstreams: own)
        if quic != nil { counters.showsQUICOutcomes.store(true, ordering: .relaxed) }
        self.passiveHealth = passiveHealth
        self.counters = own.map { counters.downstream($0.name) }
        self.pools = pools.map { pool in PoolPlan(pool, members: downstreams.filter { $0.pool == pool.name }, counters: counters.pool(pool.name)) }
    }
}

/// One replication pool of a plan: its members in rotation, how it picks among them (or copies
/// to all), and which datagrams it takes (`sources`, then `sample`).
final class PoolPlan: Sendable {
    /// The `reason` values of `udp_fanout_pool_dropped_total`.
    /// (tc_ebpf's copies: `no_route`, `no_neighbour`, `rewrite_failed` too, see bpf/include/fanout_pools.h.)
    static let dropReasons = ["no_healthy"] + [DropReason.tooLarge, .parseError, .ttlExpired, .rateLimited, .sendBufferFull, .unreachable, .sendError, .familyMismatch, .noRoute].map(\.rawValue)
        + ["no_neighbour", DropReason.rewriteFailed.rawValue]
    /// Seed of the sampling hash: not the balancing's, so which sources a sampled pool keeps does
    /// not follow which downstream of another pool they go to.
    static let sampleSeed: UInt32 = 0x5341_4d50

    let name: String
    let members: [Downstream]
    /// How one member is picked; nil: every member with a weight gets a copy (`all`).
    let method: DownstreamSelector.Method?
    /// The members an `all` pool copies to (weight above 0).
    let everyMember: [Int]
    let sample: UInt32
    let sources: SourceFilter
    /// nil: the listener's output.
    let output: Output?
    let counters: PoolCounters
    let memberCounters: [DownstreamCounters]

    init(_ pool: Pool, members: [Downstream], counters: PoolCounters) {
        name = pool.name
        self.members = members
        method = pool.balancing.single.map { DownstreamSelector.Method(downstreams: members, balancing: $0) }
        everyMember = members.indices.filter { members[$0].weight > 0 }
        sample = UInt32(pool.sample)
        sources = SourceFilter(pool.sources)
        output = pool.output
        self.counters = counters
        memberCounters = members.map { counters.member($0.name) }
    }

    /// True when the pool takes the datagrams of `source` under its `sample`: one source in
    /// `sample`, by a hash of its address (the same on every worker, node and restart), so a
    /// sampled exporter's stream reaches the pool whole, templates included.
    @inline(__always)
    func samples(_ source: UnsafePointer<sockaddr_storage>) -> Bool { Self.samples(source, sample) }

    /// Whether a pool with `sample` takes `source` (the kernel kinds' program decides the same).
    @inline(__always)
    static func samples(_ source: UnsafePointer<sockaddr_storage>, _ sample: UInt32) -> Bool {
        sample <= 1 || rplb_reduce(DownstreamSelector.sourceHash(source, seed: sampleSeed), sample) == 0
    }
}

/// A pool's `sources`: which client addresses it takes (IPv4-mapped IPv6 clients as the IPv4
/// address they are).
struct SourceFilter: Sendable {
    private let v4: [(bytes: [UInt8], length: Int)]
    private let v6: [(bytes: [UInt8], length: Int)]
    let isEmpty: Bool

    init(_ prefixes: [SourcePrefix]) {
        v4 = prefixes.filter { $0.address.family == AF_INET }.map { ($0.address.bytes, $0.length) }
        v6 = prefixes.filter { $0.address.family == AF_INET6 }.map { ($0.address.bytes, $0.length) }
        isEmpty = prefixes.isEmpty
    }

    @inline(__always)
    func admits(_ source: UnsafePointer<sockaddr_storage>) -> Bool {
        if isEmpty { return true }
        let raw = UnsafeRawPointer(source)
        if Int32(source.pointee.ss_family) == AF_INET6 {
            let address = raw + MemoryLayout<sockaddr_in6>.offset(of: \.sin6_addr)!
            let mapped = address.loadUnaligned(as: UInt64.self) == 0 && address.loadUnaligned(fromByteOffset: 8, as: UInt32.self) == UInt32(0x0000_ffff).bigEndian
            return mapped ? Self.matches(v4, address + 12) : Self.matches(v6, address)
        }
        return Self.matches(v4, raw + MemoryLayout<sockaddr_in>.offset(of: \.sin_addr)!)
    }

    private static func matches(_ prefixes: [(bytes: [UInt8], length: Int)], _ address: UnsafeRawPointer) -> Bool {
        for prefix in prefixes where contains(prefix, address) { return true }
        return false
    }

    /// `address` (as many bytes as the prefix has) is within `prefix`.
    private static func contains(_ prefix: (bytes: [UInt8], length: Int), _ address: UnsafeRawPointer) -> Bool {
        var remaining = prefix.length
        var index = 0
        while remaining >= 8 {
            if address.load(fromByteOffset: index, as: UInt8.self) != prefix.bytes[index] { return false }
            remaining -= 8
            index += 1
        }
        guard remaining > 0 else { return true }
        let mask = UInt8(truncatingIfNeeded: 0xff << (8 - remaining))
        return address.load(fromByteOffset: index, as: UInt8.self) & mask == prefix.bytes[index]
    }
}

/// The current plan and a version number workers compare once per batch (an atomic load).
final class PlanHolder: Sendable {
    let version = Atomic<Int>(0)
    private let current: Mutex<(plan: ForwardingPlan, replacedAt: Int64)>

    init(_ plan: ForwardingPlan) { current = Mutex((plan, monotonicMilliseconds())) }

    var plan: ForwardingPlan { current.withLock { $0.plan } }

    /// The plan and when it replaced the previous one (``monotonicMilliseconds()``): a relay
    /// worker that adopts it later still counts a leaving downstream's drain from then.
    var planAndTime: (plan: ForwardingPlan, replacedAt: Int64) { current.withLock { $0 } }

    func replace(with plan: ForwardingPlan) {
        current.withLock { $0 = (plan, monotonicMilliseconds()) }
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
