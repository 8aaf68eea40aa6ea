import CSystemShim
import ReusePortLB

/// What discovery found for one listener (its configuration holds the rest): each source's last
/// answer by its ``DiscoverySource/slot``, absent until its first answer (a DNS entry's
/// addresses, the Kubernetes Service's ready endpoints).
struct Discovered: Sendable, Equatable {
    var found: [String: [Downstream]] = [:]
}

/// Membership is one path: static downstreams and what discovery sources found make a
/// listener's *members*; health takes the down ones out, leaving the *available* set, which one
/// step (``RunningListener/update(downstreams:balancing:)``) applies in every mode. Pure
/// functions here; ``FanoutDaemon`` keeps the state and applies.
enum Membership {
    /// Every downstream of `listener`: configured ones first, in file order, then what each
    /// discovery source found, in ``DiscoverySources`` order (DNS entries' addresses sorted,
    /// then Kubernetes endpoints sorted by address). An address is a member once (the first
    /// wins: a static downstream keeps its name and weight).
    /// - Returns: the members, and why discovered addresses were left out (mode limits).
    static func members(_ listener: Listener, _ discovered: Discovered) -> (members: [Downstream], skipped: [String]) {
        var members = listener.downstreams
        var seen = Set(members.map(\.address))
        var names = Set(members.map(\.name))
        var skipped: [String] = []
        let kind = ListenerKinds.type(for: listener)
        func add(_ given: Downstream, from source: String) {
            guard seen.insert(given.address).inserted else { return }
            // Names label counters and key tc_ebpf's counter slots: one per member (a dual-stack
            // pod's two addresses, or a static entry of the same name, get the address added).
            var downstream = given
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
        for spec in DiscoverySources.of(listener) {
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
