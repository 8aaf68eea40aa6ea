// SPDX-License-Identifier: Apache-2.0
import ReusePortLB
import Synchronization

/// Why a datagram was not forwarded. Each reason is a `reason` label value.
package enum DropReason: String, CaseIterable, Sendable {
    /// Larger than settings.max_packet_size (MSG_TRUNC): never forwarded cut.
    case tooLarge = "too_large"
    /// The downstream socket's send buffer was full (EAGAIN/ENOBUFS).
    case sendBufferFull = "send_buffer_full"
    /// The downstream answered ICMP unreachable (ECONNREFUSED), or no route (EHOSTUNREACH/ENETUNREACH).
    case unreachable
    /// Any other send error.
    case sendError = "send_error"
    /// tc_ebpf: the kernel's fib lookup found no route to the downstream.
    case noRoute = "no_route"
    /// tc_ebpf: TTL or hop limit would reach 0 on forwarding.
    case ttlExpired = "ttl_expired"
    /// tc_ebpf: a kernel helper refused to rewrite or redirect the packet.
    case rewriteFailed = "rewrite_failed"
    /// af_xdp: a frame from the RX ring whose Ethernet/IP/UDP headers did not parse.
    case parseError = "parse_error"
    /// preserve_source / xdp_tx: the client's address family differs from the downstream's, so its
    /// source cannot be kept (IPv4-mapped IPv6 clients count as IPv4).
    case familyMismatch = "family_mismatch"
    /// replies relay: a new client while `settings.max_sessions` sessions are open.
    case tableFull = "table_full"
    /// Read by a process that then ended without a stop (kill -9, a fatal signal) before it sent
    /// them: counted by the next process at the listener's start (``CrashLedger``).
    case crash
    /// `rate_limit`: above its source prefix's datagram or byte rate, or a new source above
    /// `new_sources_per_second`.
    case rateLimited = "rate_limited"
    /// replies relay: a request read from a stopping worker's socket after its stop drain (the
    /// socket, sealed once its last replies were sent, is read once more): not relayed, since no
    /// reply could come back through it.
    case closing
}

/// Why a reply (downstream to client) of a two-way listener was not sent on.
package enum ReplyDropReason: String, CaseIterable, Sendable {
    /// nat: from a downstream that is not the client's associated one (sbulb's rule).
    case wrongServer = "wrong_server"
    /// nat: the kernel's fib lookup found no route to the client.
    case noRoute = "no_route"
    /// nat: TTL or hop limit would reach 0.
    case ttlExpired = "ttl_expired"
    /// nat: larger than the route's MTU toward the client; relay: larger than
    /// `settings.max_packet_size` (never relayed cut).
    case tooLarge = "too_large"
    /// nat: a kernel helper refused to rewrite or redirect it.
    case rewriteFailed = "rewrite_failed"
    /// relay: the listener socket's send buffer was full.
    case sendBufferFull = "send_buffer_full"
    /// relay: any other send error.
    case sendError = "send_error"
    /// relay: the downstream answered a request with ICMP unreachable (read on the session
    /// socket): the request was sent (counted forwarded) and no reply will come.
    case downstreamUnreachable = "downstream_unreachable"
    /// A reply from a downstream that left the set (reload, health, discovery) more than
    /// `settings.drain_secs` ago: its clients have other downstreams now.
    case drained
    /// relay: staged for its client by a process that then ended without a stop before it sent
    /// it: counted by the next process at the listener's start (``CrashLedger``).
    case crash
    /// `amplification`: it would have taken the bytes sent back to a client not yet validated
    /// past the factor of what the client sent.
    case amplificationCapped = "amplification_capped"
}

/// What happened to the associations (nat) or sessions (relay) of a two-way listener.
package enum AssociationEvent: String, CaseIterable, Sendable {
    /// A client's first datagram made one (its downstream chosen by the listener's balancing).
    case created
    /// nat: a downstream's datagram to a client without one made it (server-initiated).
    case serverInitiated = "server_initiated"
    /// Its downstream left the set (reload, health, discovery): the client got another one.
    case moved
    /// nat: the LRU map forgot it to make room for a new one (derived: made minus present).
    case evicted
    /// relay: closed after `session_idle_secs` without a datagram either way.
    case expired
    /// relay: a new client while `max_sessions` were open: its datagram was dropped.
    case tableFull = "table_full"
    /// relay: its listener was handed over to a successor on the bind (a reload that renamed or
    /// restarted it): the session drains, and the client's next datagram makes one there.
    case handedOver = "handed_over"
}

/// The reply side of a two-way listener (``Replies``).
package struct TwoWaySnapshot: Sendable {
    package var replies: UInt64 = 0
    package var replyBytes: UInt64 = 0
    package var replyDropped: [ReplyDropReason: UInt64] = [:]
    /// Associations (nat) or sessions (relay) present now.
    package var associations: UInt64 = 0
    package var events: [AssociationEvent: UInt64] = [:]
    /// Replies sent on per downstream, by name.
    package var downstreamReplies: [String: UInt64] = [:]
    /// relay: session-socket sends and receives made through the workers' io_urings (tests only:
    /// not exported, not part of the public snapshot).
    var ringSends: UInt64 = 0
    var ringReceives: UInt64 = 0

    package init() {}
}

/// One client of a two-way listener and the downstream it is associated with.
package struct AssociationEntry: Sendable, Equatable {
    package var client: SocketAddress
    /// The downstream's name, or its address when it is no longer in the set.
    package var downstream: String
    /// relay: seconds since the session's last datagram; nil for nat (the LRU map keeps no time).
    package var idleSeconds: Int?

    package init(client: SocketAddress, downstream: String, idleSeconds: Int? = nil) {
        self.client = client
        self.downstream = downstream
        self.idleSeconds = idleSeconds
    }
}

/// One listener's counters, shared by its workers (each adds once per batch) and read by
/// the metrics endpoint. Kept across reloads while the listener's name exists.
package final class ListenerCounters: Sendable {
    package let name: String
    package let mode: String
    let received = Atomic<UInt64>(0)
    let bytesReceived = Atomic<UInt64>(0)
    let forwarded = Atomic<UInt64>(0)
    let bytesForwarded = Atomic<UInt64>(0)
    let noHealthy = Atomic<UInt64>(0)
    /// Datagrams the workers' sockets dropped before we could read them (the socket drop counter, read with SO_MEMINFO).
    let receiveQueueDrops = Atomic<UInt64>(0)
    let tooLarge = Atomic<UInt64>(0)
    let sendBufferFull = Atomic<UInt64>(0)
    let unreachable = Atomic<UInt64>(0)
    let sendError = Atomic<UInt64>(0)
    let parseError = Atomic<UInt64>(0)
    /// af_xdp with a source-preserving way out: TTL/hop limit 1 or 0 on arrival.
    let ttlExpired = Atomic<UInt64>(0)
    /// A mode's own metric families (af_xdp: rings, sockets, XDP verdicts) in the Prometheus text
    /// format, merged into /metrics; nil: none.
    let modeMetrics = Mutex<(@Sendable () -> String)?>(nil)
    let familyMismatch = Atomic<UInt64>(0)
    let tableFull = Atomic<UInt64>(0)
    /// What the previous process held when it crashed (``CrashLedger``), counted at the first start.
    let crash = Atomic<UInt64>(0)
    let rateLimited = Atomic<UInt64>(0)
    let closing = Atomic<UInt64>(0)
    /// `quic_lb` listeners: datagrams by ``QUICOutcome`` (in its order); all zero otherwise.
    let quicRouted = Atomic<UInt64>(0)
    let quicFallback = Atomic<UInt64>(0)
    let quicUnknownServerID = Atomic<UInt64>(0)
    let quicUndecodable = Atomic<UInt64>(0)
    /// Set once the listener routes by QUIC connection ID (kept: the series keep their totals),
    /// so its outcomes are shown, at zero too.
    let showsQUICOutcomes = Atomic<Bool>(false)
    /// settings.busy_wait_us: what the workers' polling found and cost.
    let busyWait = BusyWaitCounters()
    /// output: preserve_source: the UDP sockets the workers hold bound to clients' addresses and
    /// ports (``TransparentSockets``); shown once a worker of the listener made its raw socket.
    let clientSockets = Atomic<Int>(0)
    let clientSocketsShown = Atomic<Bool>(false)
    /// `rate_limit`: the running instance's buckets for /status (its top limited sources and
    /// evictions); nil: none.
    private let rateLimitSource = Mutex<(@Sendable () -> RateLimitStatus)?>(nil)
    /// The crash ledger this listener's forwarding threads note what they hold in; nil: none
    /// (no service manager keeps descriptors).
    let ledger: CrashLedger?
    /// A two-way listener's reply side, for listeners whose counters are the atomics above
    /// (userspace relay); nil: one way, or inside the external snapshot.
    let twoWaySource = Mutex<(@Sendable () -> TwoWaySnapshot)?>(nil)
    /// A relay listener's reply totals, shared by its instances (made at the first relay start).
    private let relayTotals = Mutex<RelayCounters?>(nil)
    /// A userspace listener's flow export templates (`settings.flow_templates`): made at the
    /// first start with it on, kept across reloads.
    let flowTemplateState = Mutex<FlowTemplateState?>(nil)
    /// `udp-fanout capture`: the listener's running captures (none: a drop costs one atomic load).
    package let capture = DropCapture()
    let downstreams = Mutex<[String: DownstreamCounters]>([:])
    /// Replication pools' counters by pool name, made on first use and kept for the life of the
    /// process (as the downstreams').
    let pools = Mutex<[String: PoolCounters]>([:])
    /// Where a kernel-side listener's counters come from (tc_ebpf reads its maps): its running
    /// instances (two at once while a reload hands the bind from one to the other) on top of
    /// what its stopped instances counted. nil: the atomics above.
    private let external = Mutex<External?>(nil)

    struct External {
        var running: [ObjectIdentifier: @Sendable () -> Snapshot] = [:]
        /// The totals of the instances that stopped.
        var stopped = Snapshot.zero
    }

    init(name: String, mode: String, ledger: CrashLedger? = nil) {
        self.name = name
        self.mode = mode
        self.ledger = ledger
    }

    func add(_ counter: borrowing Atomic<UInt64>, _ value: UInt64) {
        if value > 0 { counter.wrappingAdd(value, ordering: .relaxed) }
    }

    /// A forwarding thread's QUIC-LB outcomes since its last flush.
    func add(_ tally: QUICTally) {
        guard !tally.isEmpty else { return }
        add(quicRouted, tally.counts.0)
        add(quicFallback, tally.counts.1)
        add(quicUnknownServerID, tally.counts.2)
        add(quicUndecodable, tally.counts.3)
    }

    func drop(_ reason: DropReason, _ count: UInt64 = 1) {
        switch reason {
        case .tooLarge: add(tooLarge, count)
        case .sendBufferFull: add(sendBufferFull, count)
        case .unreachable: add(unreachable, count)
        case .sendError: add(sendError, count)
        case .parseError: add(parseError, count)
        case .familyMismatch: add(familyMismatch, count)
        case .ttlExpired: add(ttlExpired, count)
        case .tableFull: add(tableFull, count)
        case .crash: add(crash, count)
        case .rateLimited: add(rateLimited, count)
        case .closing: add(closing, count)
        case .noRoute, .rewriteFailed: break  // counted by the tc_ebpf program
        }
    }

    /// Shows `limiter`'s buckets in /status (nil: the listener has none now).
    func showRateLimit(_ limiter: SourceRateLimiter?) {
        showRateLimit(limiter.map { limiter in
            { @Sendable in
                RateLimitStatus(limit: "\(limiter.limit)", evicted: limiter.evicted.load(ordering: .relaxed),
                                topLimited: limiter.topLimited(RateLimitStatus.topCount).map { LimitedSource(prefix: $0.prefix, limited: $0.limited) })
            }
        })
    }

    /// Shows what `source` reads in /status (a kernel kind reads its maps).
    func showRateLimit(_ source: (@Sendable () -> RateLimitStatus)?) { rateLimitSource.withLock { $0 = source } }

    /// The running instance's buckets, nil when it has none.
    func rateLimitView() -> RateLimitStatus? { rateLimitSource.withLock { $0 }?() }

    /// The counters of each downstream by name, made on first use and kept for the life of the
    /// process: a downstream that leaves the set (reload, health, discovery) keeps its series
    /// with its totals, and goes on from them when it comes back, so the per-downstream series
    /// always sum to the listener's totals.
    func downstream(_ name: String) -> DownstreamCounters { kept(name, in: downstreams, make: DownstreamCounters.init) }

    /// The counters of replication pool `name`, made on first use and kept.
    func pool(_ name: String) -> PoolCounters { kept(name, in: pools, make: PoolCounters.init) }

    /// Adds the counters of instance `owner` (read from `source`) from now on: a restarted
    /// kernel-side listener goes on from its predecessors' totals, and while both run (a reload
    /// handing the bind over) both count.
    func setSource(for owner: ObjectIdentifier, _ source: @escaping @Sendable () -> Snapshot) {
        external.withLock { external in
            var updated = external ?? External()
            updated.running[owner] = source
            external = updated
        }
    }

    /// Keeps instance `owner`'s current values in the totals (it is stopping) and stops reading it.
    func freeze(_ owner: ObjectIdentifier) {
        guard let source = external.withLock({ $0?.running[owner] }) else { return }
        var last = source()
        // Its associations are gone with it: only the running instances' count.
        last.twoWay?.associations = 0
        external.withLock { external in
            guard external?.running.removeValue(forKey: owner) != nil, let stopped = external?.stopped else { return }
            external?.stopped = last.adding(stopped)
        }
    }

    package struct Snapshot: Sendable {
        package var received, bytesReceived, forwarded, bytesForwarded, noHealthy, receiveQueueDrops: UInt64
        package var dropped: [DropReason: UInt64]
        package var downstreams: [String: (forwarded: UInt64, bytes: UInt64, dropped: UInt64)]
        /// Drops per downstream by reason, where the mode counts them so (tc_ebpf: `no_route`,
        /// `too_large`); empty otherwise.
        package var downstreamDropped: [String: [DropReason: UInt64]] = [:]
        /// Two-way listeners only.
        package var twoWay: TwoWaySnapshot? = nil
        /// `quic_lb` listeners only: datagrams by QUIC-LB outcome.
        package var quic: [QUICOutcome: UInt64] = [:]
        package var droppedTotal: UInt64 { dropped.values.reduce(0, +) }

        /// These values on top of `base`'s (a previous instance's); the associations gauge is this one's.
        func adding(_ base: Snapshot) -> Snapshot {
            var sum = self
            sum.received &+= base.received
            sum.bytesReceived &+= base.bytesReceived
            sum.forwarded &+= base.forwarded
            sum.bytesForwarded &+= base.bytesForwarded
            sum.noHealthy &+= base.noHealthy
            sum.receiveQueueDrops &+= base.receiveQueueDrops
            sum.dropped.merge(base.dropped, uniquingKeysWith: &+)
            sum.downstreams.merge(base.downstreams) { ($0.forwarded &+ $1.forwarded, $0.bytes &+ $1.bytes, $0.dropped &+ $1.dropped) }
            sum.downstreamDropped.merge(base.downstreamDropped) { $0.merging($1, uniquingKeysWith: &+) }
            sum.quic.merge(base.quic, uniquingKeysWith: &+)
            if let previous = base.twoWay {
                var twoWay = sum.twoWay ?? TwoWaySnapshot()
                twoWay.replies &+= previous.replies
                twoWay.replyBytes &+= previous.replyBytes
                twoWay.replyDropped.merge(previous.replyDropped, uniquingKeysWith: &+)
                twoWay.events.merge(previous.events, uniquingKeysWith: &+)
                twoWay.downstreamReplies.merge(previous.downstreamReplies, uniquingKeysWith: &+)
                sum.twoWay = twoWay
            }
            return sum
        }

        static let zero = Snapshot(
            received: 0, bytesReceived: 0, forwarded: 0, bytesForwarded: 0, noHealthy: 0, receiveQueueDrops: 0,
            dropped: [:], downstreams: [:])
    }

    /// The listener's flow export templates when `config` turns them on (one-way userspace,
    /// tc_ebpf, xdp and af_xdp listeners; an af_xdp listener's companion shares them), else nil.
    func flowTemplates(_ config: Listener) -> FlowTemplateState? {
        guard Self.followsTemplates(config) else {
            // Off: what was kept is dropped (an instance still running keeps its own reference),
            // so turning it on again starts from what the exporters send then, not stale templates.
            flowTemplateState.withLock { $0 = nil }
            return nil
        }
        return flowTemplateState.withLock { state in
            if let state { return state }
            let made = FlowTemplateState()
            state = made
            return made
        }
    }

    /// Whether `config` follows flow export templates: `settings.flow_templates` on a one-way
    /// listener of a kind that can (userspace, tc_ebpf, xdp, af_xdp).
    static func followsTemplates(_ config: Listener) -> Bool {
        guard config.settings.flowTemplates, config.replies == Replies.none else { return false }
        return [.userspace, .tcEBPF, .xdp, .afXDP].contains(config.mode)
    }

    /// The relay reply totals every instance of this listener adds to: a restart's old instance
    /// relays until the new one has the bind, and its replies count on the same totals.
    func relayCounters() -> RelayCounters {
        relayTotals.withLock { totals in
            if let totals { return totals }
            let made = RelayCounters()
            totals = made
            return made
        }
    }

    package func snapshot() -> Snapshot {
        if let external = external.withLock({ $0 }) {
            // Each running instance's maps are read outside the lock.
            var total = external.running.values.reduce(external.stopped) { total, source in source().adding(total) }
            // A previous process's crash, counted here when this listener's kind changed.
            let crashed = crash.load(ordering: .relaxed)
            if crashed > 0 { total.dropped[.crash, default: 0] &+= crashed }
            return total
        }
        let dropped: [DropReason: UInt64] = [
            .tooLarge: tooLarge.load(ordering: .relaxed), .sendBufferFull: sendBufferFull.load(ordering: .relaxed),
            .unreachable: unreachable.load(ordering: .relaxed), .sendError: sendError.load(ordering: .relaxed),
            .noRoute: 0, .ttlExpired: ttlExpired.load(ordering: .relaxed), .rewriteFailed: 0, .parseError: parseError.load(ordering: .relaxed),
            .familyMismatch: familyMismatch.load(ordering: .relaxed), .tableFull: tableFull.load(ordering: .relaxed),
            .crash: crash.load(ordering: .relaxed), .rateLimited: rateLimited.load(ordering: .relaxed),
            .closing: closing.load(ordering: .relaxed),
        ]
        let downstreams = self.downstreams.withLock { table in
            table.mapValues { ($0.forwarded.load(ordering: .relaxed), $0.bytes.load(ordering: .relaxed), $0.dropped.load(ordering: .relaxed)) }
        }
        var snapshot = Snapshot(
            received: received.load(ordering: .relaxed), bytesReceived: bytesReceived.load(ordering: .relaxed),
            forwarded: forwarded.load(ordering: .relaxed), bytesForwarded: bytesForwarded.load(ordering: .relaxed),
            noHealthy: noHealthy.load(ordering: .relaxed), receiveQueueDrops: receiveQueueDrops.load(ordering: .relaxed),
            dropped: dropped, downstreams: downstreams, twoWay: twoWaySource.withLock { $0 }?())
        if showsQUICOutcomes.load(ordering: .relaxed) {
            snapshot.quic = [
                .routed: quicRouted.load(ordering: .relaxed), .fallback: quicFallback.load(ordering: .relaxed),
                .unknownServerID: quicUnknownServerID.load(ordering: .relaxed), .undecodable: quicUndecodable.load(ordering: .relaxed),
            ]
        }
        return snapshot
    }
}

/// One downstream's counters.
package final class DownstreamCounters: Sendable {
    let forwarded = Atomic<UInt64>(0)
    let bytes = Atomic<UInt64>(0)
    let dropped = Atomic<UInt64>(0)
}

/// What happened to the datagrams a replication pool was offered (every datagram its listener
/// received): each is forwarded, dropped, sampled out or filtered out, so the four add up to the
/// listener's `received`. For a balanced pool a datagram is one copy, forwarded when it was sent;
/// for an `all` pool it is forwarded when every member in rotation got a copy to send, and each
/// copy's fate is its member's. Updated once per batch.
package final class PoolCounters: Sendable {
    let forwarded = Atomic<UInt64>(0)
    let dropped = Atomic<UInt64>(0)
    let sampledOut = Atomic<UInt64>(0)
    let filteredOut = Atomic<UInt64>(0)
    /// Drops by reason: datagrams with no member in rotation (`no_healthy`) or above
    /// max_packet_size (`too_large`), and copies a send dropped.
    let drops = Mutex<[String: UInt64]>([:])
    let members = Mutex<[String: DownstreamCounters]>([:])
    /// Copies a send dropped, per member and reason (what `drops` sums over the members).
    let memberDrops = Mutex<[String: [String: UInt64]]>([:])

    /// A member's copies sent, bytes and copies dropped, made on first use and kept.
    func member(_ name: String) -> DownstreamCounters { kept(name, in: members, make: DownstreamCounters.init) }

    func addDrops(_ reason: String, _ count: UInt64) {
        guard count > 0 else { return }
        drops.withLock { $0[reason, default: 0] &+= count }
    }

    /// `count` copies to member `member` a send dropped for `reason`: the pool's drops by reason
    /// and the member's.
    func addMemberDrops(_ member: String, _ reason: String, _ count: UInt64) {
        guard count > 0 else { return }
        addDrops(reason, count)
        memberDrops.withLock { $0[member, default: [:]][reason, default: 0] &+= count }
    }

    package struct Snapshot: Sendable, Equatable {
        package var forwarded, dropped, sampledOut, filteredOut: UInt64
        package var drops: [String: UInt64]
        /// Copies sent, bytes and copies dropped per member, by name.
        package var members: [String: [UInt64]]
        /// Copies dropped per member, by name, by reason (reasons seen only).
        package var memberDrops: [String: [String: UInt64]]
        package var received: UInt64 { forwarded &+ dropped &+ sampledOut &+ filteredOut }
    }

    package func snapshot() -> Snapshot {
        Snapshot(
            forwarded: forwarded.load(ordering: .relaxed), dropped: dropped.load(ordering: .relaxed),
            sampledOut: sampledOut.load(ordering: .relaxed), filteredOut: filteredOut.load(ordering: .relaxed),
            drops: drops.withLock { $0 },
            members: members.withLock { table in
                table.mapValues { [$0.forwarded.load(ordering: .relaxed), $0.bytes.load(ordering: .relaxed), $0.dropped.load(ordering: .relaxed)] }
            },
            memberDrops: memberDrops.withLock { $0 })
    }
}

/// The entry `name` of a table of counters, made by `make` on first use and kept for the life of
/// the process (a downstream or pool that leaves and comes back goes on from its totals).
func kept<Counters: Sendable>(_ name: String, in table: borrowing Mutex<[String: Counters]>, make: () -> Counters) -> Counters {
    table.withLock { table in
        if let existing = table[name] { return existing }
        let made = make()
        table[name] = made
        return made
    }
}
