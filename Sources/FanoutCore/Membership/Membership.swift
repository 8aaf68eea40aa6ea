import CSystemShim
import ReusePortLB

/// What discovery found for one listener (its configuration holds the rest).
struct Discovered: Sendable, Equatable {
    /// The addresses each DNS downstream resolved to, by the entry's name; absent until its
    /// first successful resolution.
    var dns: [String: [SocketAddress]] = [:]
    /// The ready endpoints of the listener's Kubernetes Service; nil until the first list.
    var kubernetes: [Downstream]?
}

/// Membership is one path: static downstreams, DNS names and Kubernetes endpoints make a
/// listener's *members*; health takes the down ones out, leaving the *available* set, which one
/// step (``RunningListener/update(downstreams:balancing:)``) applies in every mode. Pure
/// functions here; ``FanoutDaemon`` keeps the state and applies.
enum Membership {
    /// Every downstream of `listener`: configured ones first, in file order, then each DNS
    /// entry's addresses (sorted), then Kubernetes endpoints (sorted by address). An address is
    /// a member once (the first wins: a static downstream keeps its name and weight).
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
        for entry in listener.dnsDownstreams {
            for address in (discovered.dns[entry.name] ?? []).sorted(by: { $0.description < $1.description }) {
                add(Downstream(name: "\(entry.name)/\(address.ip)", address: address, weight: entry.weight, healthPort: entry.healthPort),
                    from: "DNS \(entry.host)")
            }
        }
        for endpoint in (discovered.kubernetes ?? []).sorted(by: { $0.address.description < $1.address.description }) {
            add(endpoint, from: "Kubernetes \(listener.kubernetes?.service ?? "")")
        }
        return (members, skipped)
    }

    /// The members whose health target is not down.
    static func available(_ members: [Downstream], down: Set<SocketAddress>) -> [Downstream] {
        down.isEmpty ? members : members.filter { !down.contains($0.healthTarget) }
    }

    /// Why the listener's first discovery is not complete yet (empty: complete).
    static func pending(_ listener: Listener, _ discovered: Discovered) -> [String] {
        var reasons: [String] = []
        if let kubernetes = listener.kubernetes, discovered.kubernetes == nil {
            reasons.append("waiting for the first EndpointSlice list of \(kubernetes.namespace.map { "\($0)/" } ?? "")\(kubernetes.service)")
        }
        for entry in listener.dnsDownstreams where discovered.dns[entry.name] == nil {
            reasons.append("waiting for the first resolution of \(entry.host)")
        }
        return reasons
    }

    /// What a reload keeps of the discovered sets: each DNS entry's last addresses while an entry
    /// of that name stays, and the Kubernetes endpoints while the listener still discovers, even
    /// if the name, Service or port changed: the old set serves until the new watcher's first
    /// answer replaces it (the new state is ready before the old one goes).
    static func carried(_ discovered: Discovered, into listener: Listener) -> Discovered {
        var kept = Discovered()
        for entry in listener.dnsDownstreams { kept.dns[entry.name] = discovered.dns[entry.name] }
        if listener.kubernetes != nil { kept.kubernetes = discovered.kubernetes }
        return kept
    }
}
