// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import FoundationEssentials
import ReusePortLB

/// What `GET /status` answers (JSON, keys in snake_case): the daemon, each listener and each
/// downstream now, with counters since start (a listener's name keeps its totals across reloads).
/// `udp-fanout status` reads it twice and shows the rates in between (``StatusView``).
/// docs/udp-fanout.md ("Status") documents every key.
package struct StatusReport: Codable, Sendable, Equatable {
    package var version: String
    package var pid: Int32
    /// When the process started, seconds since the epoch.
    package var startedAt: Double
    /// When this report was made, seconds since the epoch.
    package var time: Double
    /// The daemon's monotonic clock then (seconds): what rates divide by, so a wall-clock step
    /// between two reports does not skew them.
    package var monotonic: Double
    /// `/readyz`: true, or false with `notReady` saying why.
    package var ready: Bool
    package var notReady: [String]
    /// `/healthz`: true, or false with `problems` saying what is stuck.
    package var healthy: Bool
    package var problems: [String]
    /// Configuration reloads applied and rejected since start.
    package var reloads: Reloads
    /// Health probes' protocol (udp, icmp) and interval, nil when health checking is off.
    package var healthProtocol: String?
    package var healthIntervalSecs: Int?
    package var listeners: [ListenerStatus]
    /// Filled by `udp-fanout status` from two reports; never sent by the daemon.
    package var intervalSeconds: Double?
    /// What this process took over from the previous one at start (the service manager's
    /// descriptor store); nil: nothing was handed over.
    package var takeover: Takeover?
    /// The `announce` section's addresses and where each stands (nil: no announce section).
    package var announce: AnnounceStatus? = nil
}

/// The virtual addresses published to the routing daemon (docs/fleet.md).
package struct AnnounceStatus: Codable, Sendable, Equatable {
    package var table: UInt32
    package var protocolNumber: Int
    package var drainSecs: Int
    /// True while a stop or a drain serves what still arrives after withdrawing.
    package var draining: Bool
    package var addresses: [AnnouncedAddress]
}

package struct AnnouncedAddress: Codable, Sendable, Equatable {
    package var address: String
    package var announced: Bool
    /// When it was last announced or withdrawn, seconds since the epoch.
    package var since: Double
    /// Why it is not announced (nil while it is).
    package var reason: String?
    package var announcements: UInt64
    package var withdrawals: UInt64
}

/// A start that took over descriptors from a previous process (docs/restarts.md).
package struct Takeover: Codable, Sendable, Equatable {
    /// The previous process's pid and version (nil: it left no record).
    package var previousPid: Int32?
    package var previousVersion: String?
    /// True: it stopped cleanly (a restart or an upgrade); false: it ended without a stop (a
    /// crash or kill -9), and its data path ran unattended for `unattendedSeconds`.
    package var previousStoppedCleanly: Bool?
    package var unattendedSeconds: Double?
    /// What was adopted, rejected or left unused, and why, one line each.
    package var notes: [String]
}

package struct Reloads: Codable, Sendable, Equatable {
    package var ok: UInt64
    package var rejected: UInt64
}

package struct ListenerStatus: Codable, Sendable, Equatable {
    package var name: String
    package var mode: String
    package var bind: String
    package var balancing: String
    /// none (one-way), nat or relay.
    package var replies: String
    /// False while a failed change left it stopped (`/readyz` says so too).
    package var running: Bool
    package var received: UInt64
    package var bytesReceived: UInt64
    package var forwarded: UInt64
    package var bytesForwarded: UInt64
    /// Datagrams dropped because no downstream was available.
    package var noHealthy: UInt64
    /// Datagrams the listener's sockets dropped before they were read.
    package var receiveQueueDrops: UInt64
    /// Drops by reason (the `reason` label of udp_fanout_packets_dropped_by_reason_total); reasons never seen are left out.
    package var dropped: [String: UInt64]
    /// Two-way listeners: replies sent on to clients, their bytes, replies dropped by reason, and
    /// associations (nat) or sessions (relay) present now.
    package var replySent: UInt64?
    package var replyBytes: UInt64?
    package var repliesDropped: [String: UInt64]?
    package var associations: UInt64?
    /// Its own downstreams (configured first, then discovered), then each replication pool's.
    package var downstreams: [DownstreamStatus]
    package var pools: [PoolStatus]
    package var rates: Rates?
    /// `rate_limit` listeners: the running instance's view of its buckets.
    package var rateLimit: RateLimitStatus? = nil
    /// `amplification` listeners: the cap as configured.
    package var amplification: String? = nil
}

/// A `rate_limit` listener's buckets as its running instance sees them: the sources with most
/// datagrams dropped while tracked (at most ``RateLimitStatus/topCount``), and how many sources it forgot
/// before their buckets were full again (the table, `max_sources`, was too small).
package struct RateLimitStatus: Codable, Sendable, Equatable {
    package static let topCount = 10
    package var limit: String
    /// nil in the kernel kinds: the kernel's LRU maps do not count what they evict.
    package var evicted: UInt64?
    package var topLimited: [LimitedSource]

    package init(limit: String, evicted: UInt64?, topLimited: [LimitedSource]) {
        self.limit = limit
        self.evicted = evicted
        self.topLimited = topLimited
    }
}

package struct LimitedSource: Codable, Sendable, Equatable {
    package var prefix: String
    package var limited: UInt64
}

package struct PoolStatus: Codable, Sendable, Equatable {
    package var name: String
    package var balancing: String
    /// Datagrams offered to the pool by outcome: forwarded, dropped, sampled_out, filtered_out.
    package var datagrams: [String: UInt64]
    package var members: [DownstreamStatus]
}

package struct DownstreamStatus: Codable, Sendable, Equatable {
    package var name: String
    package var address: String
    /// static, or the discovery kind that found it (dns, kubernetes).
    package var source: String
    package var weight: UInt32
    /// In rotation now: false while health (or weight 0) keeps it out.
    package var inRotation: Bool
    /// up or down, and since when (seconds since the epoch); nil when health checking is off.
    package var health: String?
    package var healthSince: Double?
    package var forwarded: UInt64
    package var bytes: UInt64
    package var dropped: UInt64
    /// Drops by reason where the kind counts them per downstream (tc_ebpf, xdp); a pool member's
    /// in every kind (the reasons seen).
    package var droppedByReason: [String: UInt64]?
    /// Two-way listeners: replies from this downstream sent on to clients.
    package var replySent: UInt64?
    package var rates: Rates?
}

/// Per-second rates between two reports (``StatusView/rates(from:to:)``); a counter that went
/// back (the daemon restarted) has none.
package struct Rates: Codable, Sendable, Equatable {
    package var received: Double?
    package var bytesReceived: Double?
    package var forwarded: Double?
    package var bytesForwarded: Double?
    package var dropped: Double?
    package var noHealthy: Double?
    package var receiveQueueDrops: Double?
    package var replies: Double?
    package var droppedByReason: [String: Double]?

    package init() {}
}

extension StatusReport {
    package static func decode(_ bytes: some Collection<UInt8>) throws -> StatusReport {
        let decoder = JSONDecoder()
        decoder.keyDecodingStrategy = .convertFromSnakeCase
        return try decoder.decode(StatusReport.self, from: Data(bytes))
    }

    package func json(pretty: Bool = false) -> String {
        let encoder = JSONEncoder()
        encoder.keyEncodingStrategy = .convertToSnakeCase
        encoder.outputFormatting = pretty ? [.sortedKeys, .prettyPrinted] : [.sortedKeys]
        // Every value is a string, number, bool, array or dictionary of them: encoding cannot fail.
        return (try? String(decoding: encoder.encode(self), as: UTF8.self)) ?? "{}"
    }
}

extension FanoutDaemon {
    /// The report `GET /status` answers with.
    package func statusReport() -> StatusReport {
        let (config, members, applied, discovered, lost, counters) = state.withLock {
            ($0.config, $0.members, $0.applied, $0.discovered, $0.lost, $0.counters)
        }
        let healthStates = config.health.enabled ? health.states() : [:]
        let reasons = readiness
        let problems = path.problems
        var listeners: [ListenerStatus] = []
        for listener in config.listeners {
            let snapshot = counters[listener.name]?.snapshot() ?? .zero
            let available = Set((applied[listener.name] ?? []).filter { $0.weight > 0 }.map { DownstreamKey($0) })
            func status(_ member: Downstream, source: String) -> DownstreamStatus {
                let sent = snapshot.downstreams[member.name]
                let target = config.health.enabled ? healthStates[member.healthTarget] : nil
                return DownstreamStatus(
                    name: member.name, address: "\(member.address)", source: source, weight: member.weight,
                    inRotation: available.contains(DownstreamKey(member)),
                    health: target.map { $0.up ? "up" : "down" }, healthSince: target?.since,
                    forwarded: sent?.forwarded ?? 0, bytes: sent?.bytes ?? 0, dropped: sent?.dropped ?? 0,
                    droppedByReason: snapshot.downstreamDropped[member.name].map(Self.named),
                    replySent: snapshot.twoWay.map { $0.downstreamReplies[member.name] ?? 0 })
            }
            let own = (members[listener.name] ?? []).filter { $0.pool == nil }
            let sources = Self.sources(of: own, listener: listener, discovered: discovered[listener.name])
            let poolCounters = counters[listener.name]?.pools.withLock { $0 } ?? [:]
            let pools = listener.pools.map { pool in
                let values = poolCounters[pool.name]?.snapshot()
                let poolMembers = (members[listener.name] ?? []).filter { $0.pool == pool.name }
                return PoolStatus(
                    name: pool.name, balancing: pool.balancing.rawValue,
                    datagrams: ["forwarded": values?.forwarded ?? 0, "dropped": values?.dropped ?? 0,
                                "sampled_out": values?.sampledOut ?? 0, "filtered_out": values?.filteredOut ?? 0],
                    members: poolMembers.map { member in
                        var entry = status(member, source: pool.downstreams.contains { $0.address == member.address } ? "static" : "discovered")
                        let copies = values?.members[member.name] ?? [0, 0, 0]
                        (entry.forwarded, entry.bytes, entry.dropped) = (copies[0], copies[1], copies[2])
                        // A pool member's drops by reason are its copies' (every kind), not a listener
                        // downstream's of the same name; it sends no replies (a pool is one way).
                        entry.droppedByReason = values?.memberDrops[member.name]
                        entry.replySent = nil
                        return entry
                    })
            }
            listeners.append(ListenerStatus(
                name: listener.name, mode: listener.mode.rawValue, bind: "\(listener.bind)", balancing: listener.balancing.rawValue,
                replies: listener.replies.rawValue, running: !lost.contains(listener.name),
                received: snapshot.received, bytesReceived: snapshot.bytesReceived, forwarded: snapshot.forwarded,
                bytesForwarded: snapshot.bytesForwarded, noHealthy: snapshot.noHealthy, receiveQueueDrops: snapshot.receiveQueueDrops,
                dropped: Self.named(snapshot.dropped),
                replySent: snapshot.twoWay?.replies, replyBytes: snapshot.twoWay?.replyBytes,
                repliesDropped: snapshot.twoWay.map { Self.named($0.replyDropped) }, associations: snapshot.twoWay?.associations,
                downstreams: zip(own, sources).map { status($0, source: $1) }, pools: pools,
                rateLimit: listener.rateLimit == nil ? nil : counters[listener.name]?.rateLimitView(),
                amplification: listener.amplification.map(\.description)))
        }
        return StatusReport(
            version: ProjectVersion.string, pid: getpid(), startedAt: ProcessMetrics.startTime() ?? 0, time: WallClock.seconds(), monotonic: Double(monotonicMilliseconds()) / 1000,
            ready: reasons.isEmpty, notReady: reasons, healthy: problems.isEmpty, problems: problems,
            reloads: Reloads(ok: reloadsOK.load(ordering: .relaxed), rejected: reloadsRejected.load(ordering: .relaxed)),
            healthProtocol: config.health.enabled ? config.health.proto : nil,
            healthIntervalSecs: config.health.enabled ? config.health.intervalSecs : nil,
            listeners: listeners, takeover: takeover, announce: announceStatus)
    }

    /// ``StatusReport/announce`` from the announcer.
    private var announceStatus: AnnounceStatus? {
        let (settings, draining) = state.withLock { ($0.config.announce, $0.draining) }
        guard let settings else { return nil }
        let entries = Dictionary(announcer.snapshot().map { ("\($0.address)", $0.entry) }, uniquingKeysWith: { first, _ in first })
        return AnnounceStatus(
            table: settings.table, protocolNumber: Int(settings.protocolNumber), drainSecs: settings.drainSecs, draining: draining,
            addresses: settings.addresses.map { address in
                let entry = entries["\(address)"]
                return AnnouncedAddress(address: "\(address)", announced: entry?.announced ?? false, since: entry?.since ?? 0,
                                        reason: entry.map { $0.reason } ?? "not checked yet",
                                        announcements: entry?.announcements ?? 0, withdrawals: entry?.withdrawals ?? 0)
            })
    }

    /// ``StatusReport/takeover`` from the descriptor store.
    private var takeover: Takeover? {
        let previous = descriptors.predecessor
        let notes = descriptors.report
        guard previous != nil || !notes.isEmpty else { return nil }
        return Takeover(
            previousPid: previous?.pid, previousVersion: previous?.version, previousStoppedCleanly: previous.map { $0.stoppedAt != nil },
            unattendedSeconds: previous.flatMap { $0.stoppedAt == nil ? descriptors.startedAt - $0.lastSeenAt : nil }, notes: notes)
    }

    /// Non-zero counts by their label value.
    private static func named<Reason: RawRepresentable<String>>(_ counts: [Reason: UInt64]) -> [String: UInt64] {
        Dictionary(uniqueKeysWithValues: counts.filter { $0.value > 0 }.map { ($0.key.rawValue, $0.value) })
    }
}

/// A member as the available set names it: the same address in two pools is two members.
private struct DownstreamKey: Hashable {
    var address: SocketAddress
    var pool: String?
    init(_ member: Downstream) {
        address = member.address
        pool = member.pool
    }
}
