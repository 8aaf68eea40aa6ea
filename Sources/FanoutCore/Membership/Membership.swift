// SPDX-License-Identifier: Apache-2.0
import CSystemShim
import ReusePortLB

/// What discovery found for one listener (its configuration holds the rest): each source's last
/// answer by its ``DiscoverySource/slot``, absent until its first answer (a DNS entry's
/// addresses, the Kubernetes Service's ready endpoints).
struct Discovered: Sendable, Equatable {
    var found: [String: [Downstream]] = [:]
}

/// One set of members of a listener: its own downstreams (`pool` nil: its first pool) or one of
/// its pools. Each group's members come from its static downstreams and its own discovery
/// sources, and are balanced within the group only.
struct MemberGroup: Sendable {
    let pool: String?
    let downstreams: [Downstream]
    let dnsDownstreams: [DNSDownstream]
    let kubernetes: Kubernetes?

    /// A pool's group: its static downstreams carry the pool's name.
    init(_ pool: Pool) {
        self.pool = pool.name
        downstreams = pool.downstreams.map { downstream in
            var member = downstream
            member.pool = pool.name
            return member
        }
        dnsDownstreams = pool.dnsDownstreams
        kubernetes = pool.kubernetes
    }

    init(own listener: Listener) {
        pool = nil
        downstreams = listener.downstreams
        dnsDownstreams = listener.dnsDownstreams
        kubernetes = listener.kubernetes
    }
}

extension Listener {
    /// The listener's own downstreams as a member group.
    var ownMembers: MemberGroup { MemberGroup(own: self) }
    /// Its own downstreams, then each pool, in file order.
    var memberGroups: [MemberGroup] { [ownMembers] + pools.map(MemberGroup.init) }
    /// Every group's static members (a pool's carry its name).
    var members: [Downstream] { memberGroups.flatMap(\.downstreams) }

    /// This listener with `members` (every group's, as ``Membership/members(_:_:)`` makes them)
    /// as its own and its pools' downstreams: what a kind starts with.
    func withMembers(_ members: [Downstream]) -> Listener {
        var running = self
        running.downstreams = members.filter { $0.pool == nil }
        running.pools = pools.map { pool in
            var running = pool
            running.downstreams = members.filter { $0.pool == pool.name }
            return running
        }
        return running
    }
}

/// Membership is one path: static downstreams and what discovery sources found make a
/// listener's *members*; health takes the down ones out, leaving the *available* set, which one
/// step (``RunningListener/update(downstreams:balancing:quicLB:pools:keeping:)``) applies in every mode. Pure
/// functions here; ``FanoutDaemon`` keeps the state and applies.
enum Membership {
    /// Every downstream of `listener`: configured ones first, in file order, then what each
    /// discovery source found, in ``DiscoverySources`` order (DNS entries' addresses sorted,
    /// then Kubernetes endpoints sorted by address). An address is a member once (the first
    /// wins: a static downstream keeps its name and weight).
    /// - Returns: the members, and why discovered addresses were left out (mode limits).
    /// A pool's members follow, group by group: each group is merged alone (an address may be a
    /// member of several pools), and its members carry the pool's name.
    static func members(_ listener: Listener, _ discovered: Discovered) -> (members: [Downstream], skipped: [String]) {
        var all: [Downstream] = []
        var skipped: [String] = []
        let specs = DiscoverySources.of(listener)
        for group in listener.memberGroups {
            let (members, groupSkipped) = members(of: group, listener, specs.filter { $0.pool == group.pool }, discovered)
            all += members
            skipped += groupSkipped
        }
        return (all, skipped)
    }

    private static func members(of group: MemberGroup, _ listener: Listener, _ specs: [DiscoverySpec], _ discovered: Discovered) -> (members: [Downstream], skipped: [String]) {
        var members = group.downstreams
        var seen = Set(members.map(\.address))
        var names = Set(members.map(\.name))
        var skipped: [String] = []
        let kind = ListenerKinds.type(for: listener)
        func add(_ given: Downstream, from source: String) {
            guard seen.insert(given.address).inserted else { return }
            // Names label counters and key tc_ebpf's counter slots: one per member (a dual-stack
            // pod's two addresses, or a static entry of the same name, get the address added).
            var downstream = given
            downstream.pool = group.pool
            if names.contains(downstream.name) { downstream.name += "/\(downstream.address.ip)" }
            // What the listener's kind cannot forward to (tc_ebpf: another family, beyond its maps).
            if let problem = kind?.memberProblem(downstream, of: listener, accepted: members.count) {
                skipped.append("\(source) \(downstream.address): \(problem)")
                return
            }
            if let problem = FanoutConfig.unicastProblem(downstream.address) {
                skipped.append("\(source) \(downstream.address): \(problem)")
                return
            }
            members.append(downstream)
            names.insert(downstream.name)
        }
        for spec in specs {
            for downstream in spec.source.members(discovered.found[spec.slot] ?? []) { add(downstream, from: spec.source.label) }
        }
        return (members, skipped)
    }

    /// The members whose health target is not down.
    static func available(_ members: [Downstream], down: Set<SocketAddress>) -> [Downstream] {
        down.isEmpty ? members : members.filter { !down.contains($0.healthTarget) }
    }

    /// Why the listener's first discovery is not complete yet (empty: complete).
    static func pending(_ listener: Listener, _ discovered: Discovered) -> [String] {
        DiscoverySources.of(listener).filter { discovered.found[$0.slot] == nil }.map(\.source.waiting)
    }

    /// What a reload keeps of the discovered sets: each source's last answer while a source
    /// with its slot stays (a DNS entry of that name; the Kubernetes endpoints while the listener
    /// still discovers, even if the Service or port changed): the old set serves until the new
    /// watcher's first answer replaces it (the new state is ready before the old one goes).
    static func carried(_ discovered: Discovered, into listener: Listener) -> Discovered {
        var kept = Discovered()
        for spec in DiscoverySources.of(listener) { kept.found[spec.slot] = discovered.found[spec.slot] }
        return kept
    }
}
