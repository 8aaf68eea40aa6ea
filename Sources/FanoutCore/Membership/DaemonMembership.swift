// SPDX-License-Identifier: Apache-2.0
import Dispatch
import Logging
import ReusePortLB
import Synchronization

extension HealthPolicy {
    /// The probe settings of the configuration's `health` section.
    init(_ health: Health) {
        self.init(
            proto: health.proto == "udp_echo" ? .udpEcho : .icmp, interval: .seconds(health.intervalSecs),
            timeout: .seconds(health.timeoutSecs), rise: health.rise, fall: health.fall)
    }
}

/// Forwards the health checker's transitions to the daemon, which exists only after the
/// checker is made. Transitions are applied on a serial queue of their own, so the probe
/// thread never waits for a reload or a table build (a reply arriving meanwhile would be
/// counted as a timeout), and they are applied in the order they happened.
final class HealthLink: Sendable {
    private let target = Mutex<(@Sendable (SocketAddress, Bool) -> Void)?>(nil)
    private let queue = DispatchQueue(label: "udp-fanout-health-transitions")
    func connect(_ handler: @escaping @Sendable (SocketAddress, Bool) -> Void) { target.withLock { $0 = handler } }
    func forward(_ address: SocketAddress, _ up: Bool) {
        guard let handler = target.withLock({ $0 }) else { return }
        queue.async { handler(address, up) }
    }
}

extension FanoutDaemon {
    /// A discovery source found `downstreams`: records it and applies it, under the change lock
    /// (a reload running meanwhile would otherwise overwrite it with its snapshot). A spec of a
    /// configuration no longer in force changes nothing.
    func discovered(_ spec: DiscoverySpec, _ downstreams: [Downstream]) {
        changes.withLock { _ in
            let current = state.withLock { state in
                guard DiscoverySources.all(state.config).contains(spec) else { return false }
                state.discovered[spec.listener, default: Discovered()].found[spec.slot] = downstreams
                state.answered.insert(spec)
                state.discoveryErrors[spec.listener] = nil
                return true
            }
            guard current else { return }
            refreshChangesHeld(spec.listener, cause: spec.kind)
            updateHealthTargetsChangesHeld()
        }
    }

    /// A discovery source failed (its watcher keeps the last good set and retries): shown by
    /// `/readyz` while the listener's first discovery is pending.
    func discoveryFailed(_ spec: DiscoverySpec, _ error: String) {
        state.withLock { state in
            guard DiscoverySources.all(state.config).contains(spec) else { return }
            state.discoveryErrors[spec.listener] = error
        }
    }

    /// Called by ``DiscoveryService`` when it runs: reloads send it the new sources.
    /// - Returns: the sources in force now.
    func attachDiscovery(_ changes: AsyncStream<[DiscoverySpec]>.Continuation) -> [DiscoverySpec] {
        state.withLock { state in
            state.discovery = changes
            return DiscoverySources.all(state.config)
        }
    }

    /// A health target went down or came back: every listener with a member probed there changes.
    func healthChanged(_ target: SocketAddress, up: Bool) {
        changes.withLock { _ in
            let affected: [String] = state.withLock { state in
                guard state.config.health.enabled else { return [] }
                if up { state.down.remove(target) } else { state.down.insert(target) }
                return state.members.filter { $0.value.contains { $0.healthTarget == target } }.map(\.key)
            }
            for listener in affected.sorted() { refreshChangesHeld(listener, cause: "health") }
        }
    }

    /// Passive health: a send of `listener` to `downstream` was refused (ICMP port unreachable).
    func downstreamRefused(_ downstream: SocketAddress, listener: String) {
        let target: SocketAddress? = state.withLock { state in
            guard state.config.health.enabled else { return nil }
            return state.members[listener]?.first { $0.address == downstream }?.healthTarget
        }
        if let target { health.reportUnreachable(target) }
    }

    /// Recomputes one listener's members and available set and, if the set changed, applies it.
    func refresh(_ name: String, cause: String) {
        changes.withLock { _ in
            refreshChangesHeld(name, cause: cause)
            updateHealthTargetsChangesHeld()
        }
    }

    /// Applies a listener's new available set in one step (userspace: a plan swap the workers
    /// take at their next batch; tc_ebpf: the inactive map generation written, then flipped).
    /// A set the listener could not apply is not recorded, so the next change tries again.
    private func refreshChangesHeld(_ name: String, cause: String) {
        let work: (listener: Listener, running: (any RunningListener)?, available: [Downstream], previous: [Downstream]?, skipped: [String], members: [Downstream])? = state.withLock { state in
            guard let listener = state.config.listeners.first(where: { $0.name == name }) else { return nil }
            let (members, skipped) = Membership.members(listener, state.discovered[name] ?? Discovered())
            state.members[name] = members
            let available = Membership.available(members, down: state.config.health.enabled ? state.down : [])
            return (listener, state.listeners[name], available, state.applied[name], skipped, members)
        }
        guard let work else { return }
        noteSkipped(name, work.skipped)
        guard work.available != work.previous else { return }
        if let running = work.running,
            !running.update(downstreams: work.available, balancing: work.listener.balancing, quicLB: work.listener.quicLB, pools: work.listener.pools, keeping: Set(work.members.map(\.name))) {
            membershipFailures.wrappingAdd(1, ordering: .relaxed)
            return
        }
        state.withLock { $0.applied[name] = work.available }
        membershipUpdates.wrappingAdd(1, ordering: .relaxed)
        let before = Set((work.previous ?? []).map(\.address)), after = Set(work.available.map(\.address))
        ListenerKinds.type(for: work.listener)?.membershipApplied(work.listener, cause: cause, downstreams: work.available.count, logger: logger)
        logger.info("listener downstream set changed", metadata: [
            "listener": "\(name)", "cause": "\(cause)", "downstreams": "\(work.available.count)",
            "added": "\(after.subtracting(before).map(\.description).sorted())",
            "removed": "\(before.subtracting(after).map(\.description).sorted())",
        ])
    }

    /// Gives the health checker every member's health target (none while health is disabled),
    /// computed and handed over under the state lock so a newer set is never overwritten by an
    /// older one (the checker's lock is a leaf: it calls nobody back while holding it).
    func updateHealthTargetsChangesHeld() {
        state.withLock { state in
            guard state.config.health.enabled else {
                health.setTargets([])
                return
            }
            let targets = Set(state.members.values.joined().map(\.healthTarget))
            state.down.formIntersection(targets)
            health.setTargets(targets)
        }
    }

    /// Logs the discovered addresses a listener cannot use, when that list changes.
    func noteSkipped(_ listener: String, _ skipped: [String]) {
        let changed = state.withLock { state in
            defer { state.skipped[listener] = skipped }
            return state.skipped[listener, default: []] != skipped
        }
        guard changed else { return }
        for reason in skipped {
            logger.warning("discovered downstream not used", metadata: ["listener": "\(listener)", "reason": "\(reason)"])
        }
    }

    /// Where each of `members` (a listener's own downstreams, in member order) comes from:
    /// `static` for the configured ones (first), else the kind of the first discovery source (in
    /// member order) that found its address, or `unknown`.
    static func sources(of members: [Downstream], listener: Listener, discovered: Discovered?) -> [String] {
        let statics = listener.downstreams.count
        let found = DiscoverySources.of(listener).filter { $0.pool == nil }.map { spec in
            (kind: spec.kind, addresses: Set((discovered?.found[spec.slot] ?? []).map(\.address)))
        }
        return members.enumerated().map { index, member in
            index < statics ? "static" : found.first(where: { $0.addresses.contains(member.address) })?.kind ?? "unknown"
        }
    }

    /// `udp_fanout_downstream_up`, members per listener and membership updates.
    func membershipMetrics() -> String {
        let (config, members, applied, skipped, answered, discovered) = state.withLock {
            ($0.config, $0.members, $0.applied, $0.skipped, $0.answered, $0.discovered)
        }
        let listeners = config.listeners
        var out = "# HELP udp_fanout_downstream_up 1 if the downstream is in rotation, 0 if health took it out\n# TYPE udp_fanout_downstream_up gauge\n"
        for listener in listeners {
            let available = Set((applied[listener.name] ?? []).map(\.address))
            for member in members[listener.name] ?? [] where member.pool == nil {
                out += "udp_fanout_downstream_up{listener=\"\(PrometheusText.escape(listener.name))\",downstream=\"\(PrometheusText.escape(member.name))\",address=\"\(member.address)\"} \(available.contains(member.address) ? 1 : 0)\n"
            }
        }
        if listeners.contains(where: { !$0.pools.isEmpty }) {
            out += "# HELP udp_fanout_pool_member_up 1 if the member of a replication pool is in rotation, 0 if health took it out\n# TYPE udp_fanout_pool_member_up gauge\n"
            for listener in listeners where !listener.pools.isEmpty {
                let available = Set((applied[listener.name] ?? []).filter { $0.pool != nil }.map(\.address))
                for member in members[listener.name] ?? [] {
                    guard let pool = member.pool else { continue }
                    out += "udp_fanout_pool_member_up{listener=\"\(PrometheusText.escape(listener.name))\",pool=\"\(PrometheusText.escape(pool))\",downstream=\"\(PrometheusText.escape(member.name))\",address=\"\(member.address)\"} \(available.contains(member.address) ? 1 : 0)\n"
                }
            }
        }
        let kinds = DiscoverySources.types.map { $0.kind }
        out += "# HELP udp_fanout_downstreams Members of each listener by source (static, \(kinds.joined(separator: ", ")))\n# TYPE udp_fanout_downstreams gauge\n"
        for listener in listeners {
            // The listener's own downstreams (pools' members are in udp_fanout_pool_member_up).
            let all = (members[listener.name] ?? []).filter { $0.pool == nil }
            var counts: [String: Int] = [:]
            for source in Self.sources(of: all, listener: listener, discovered: discovered[listener.name]) where source != "static" {
                counts[source, default: 0] += 1
            }
            let labels = "listener=\"\(PrometheusText.escape(listener.name))\""
            out += "udp_fanout_downstreams{\(labels),source=\"static\"} \(listener.downstreams.count)\n"
            for kind in kinds { out += "udp_fanout_downstreams{\(labels),source=\"\(kind)\"} \(counts[kind] ?? 0)\n" }
        }
        out += "# HELP udp_fanout_discovered_not_used Discovered addresses a listener cannot use (address family, tc_ebpf's 64 per listener)\n# TYPE udp_fanout_discovered_not_used gauge\n"
        for listener in listeners {
            out += "udp_fanout_discovered_not_used{listener=\"\(PrometheusText.escape(listener.name))\"} \(skipped[listener.name]?.count ?? 0)\n"
        }
        out += "# HELP udp_fanout_discovery_waiting Discovery sources of a listener that have not answered yet since start or the reload that configured them (a renamed DNS entry or another Service serves the previous set meanwhile)\n# TYPE udp_fanout_discovery_waiting gauge\n"
        let specs = DiscoverySources.all(config)
        for listener in listeners {
            let waiting = specs.filter { $0.listener == listener.name && !answered.contains($0) }.count
            out += "udp_fanout_discovery_waiting{listener=\"\(PrometheusText.escape(listener.name))\"} \(waiting)\n"
        }
        out += "# HELP udp_fanout_membership_updates_total Downstream set changes applied to running listeners (discovery and health)\n# TYPE udp_fanout_membership_updates_total counter\n"
        out += "udp_fanout_membership_updates_total \(membershipUpdates.load(ordering: .relaxed))\n"
        out += "# HELP udp_fanout_membership_update_failures_total Downstream set changes a running listener could not apply (the previous set stays; the next change tries again)\n# TYPE udp_fanout_membership_update_failures_total counter\n"
        out += "udp_fanout_membership_update_failures_total \(membershipFailures.load(ordering: .relaxed))\n"
        out += descriptors.metrics()
        return out
    }
}
