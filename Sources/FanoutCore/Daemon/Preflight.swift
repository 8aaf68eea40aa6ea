// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB

/// What `--check` verifies beyond the file itself, without binding, loading or attaching
/// anything: each listener's kind checks what it needs here (`ListenerKind/preflight(_:index:)`:
/// tc_ebpf interfaces, forwarding, routes and replies nat's reply interfaces; that an af_xdp listener's interface exists and
/// carries no other tool's XDP program; that no other process already serves the bind of a
/// userspace or relay listener or of af_xdp's companion socket), and discovery sources say where
/// they would look.
public enum Preflight {
    /// Problems (each naming the key and the fix; the file cannot start as it is) and notes
    /// (worth knowing, not in the way), listener by listener.
    public static func check(_ config: FanoutConfig) -> (problems: [String], notes: [String]) {
        var problems: [String] = []
        var notes: [String] = []
        for (index, listener) in config.listeners.enumerated() {
            if let kind = ListenerKinds.type(for: listener) {
                let found = kind.preflight(listener, index: index)
                problems += found.problems
                notes += found.notes
            }
        }
        notes += discoveryNotes(config)
        notes += announceNotes(config, isLocal: KernelHostRoutes.isLocal)
        return (problems, notes)
    }

    /// An announced address that a socket listener (userspace, relay, af_xdp's companion)
    /// receives on but that is not local here: the daemon starts, and keeps the address
    /// withdrawn until it is (a listener bound to the address itself cannot start); and a
    /// `replies: nat` listener on an announced address with another balancing than `source_ip`
    /// (nodes would choose differently for a client; docs/fleet.md).
    package static func announceNotes(_ config: FanoutConfig, isLocal: (IPAddress) -> Bool?) -> [String] {
        guard let announce = config.announce else { return [] }
        var notes: [String] = announce.addresses.compactMap { address in
            let serving = FanoutConfig.listeners(serving: address, in: config.listeners)
            guard serving.contains(where: { ListenerKinds.type(for: $0)?.bindsPerInterface != true }), isLocal(address) == false else { return nil }
            let bound = serving.contains { $0.bind.ip == address }
            let sysctl = address.family == AF_INET6 ? "net.ipv6.ip_nonlocal_bind" : "net.ipv4.ip_nonlocal_bind"
            return "announce.addresses: \(address) is not local on this node: \(bound ? "a listener bound to it cannot start here (unless \(sysctl) is 1), and " : "")the address stays withdrawn until it is local (add it to lo, or ip route add local \(address) dev lo table local)"
        }
        // nat in a fleet: every node must make the same choice for a client (docs/fleet.md).
        for (index, listener) in config.listeners.enumerated() where listener.replies == .nat && listener.balancing != .sourceIP
            && announce.addresses.contains(where: { FanoutConfig.listeners(serving: $0, in: [listener]).isEmpty == false })
            && (listener.downstreams.count > 1 || !listener.dnsDownstreams.isEmpty || listener.kubernetes != nil) {
            notes.append("listeners[\(index)].balancing: \(listener.balancing.rawValue) with replies: nat on an announced address: nodes of a fleet choose differently for a client, so replies crossing nodes are dropped (wrong_server) and clients change server when their flow moves; use balancing: source_ip (docs/fleet.md)")
        }
        return notes
    }

    /// A socket-receiving listener's bind (userspace, relay, af_xdp's companion socket): another process that already serves
    /// it refuses the start (a udp-fanout there is a note: most likely the daemon this file
    /// reloads); a wildcard bind overlapping another process's socket is a note.
    static func bindProblems(_ listener: Listener, index: Int) -> (problems: [String], notes: [String]) {
        var notes = SocketOverlap.warnings(listener.bind).map { "listeners[\(index)].bind: \($0)" }
        let foreign = BoundSockets.foreign(on: listener.bind)
        // Held by the service manager (systemd's descriptor store: ExecStartPre= of a restart, or
        // after a crash): the daemon this start makes takes them over (docs/restarts.md).
        // Without /proc access to PID 1 (DynamicUser=) the owner is unknown: a socket of this
        // very user is taken for one.
        let held = foreign.filter { heldByServiceManager($0, uid: geteuid()) }
        if !held.isEmpty && held.count == foreign.count {
            notes.append("listeners[\(index)].bind: \(listener.bind) has \(held.count) socket(s) held by the service manager's descriptor store (a restart): the daemon takes them over and forwards what they queued")
            return ([], notes)
        }
        guard let other = foreign.first(where: { !held.contains($0) }) else { return ([], notes) }
        let text = "listeners[\(index)].bind: \(listener.bind) is already served by another process (\(other.owner))"
        if other.command == "udp-fanout" {
            // Most likely the daemon this file is about to reload (`--check` before SIGHUP).
            notes.append(text + ": fine if that is the daemon this file reloads; a second daemon on this bind would be refused")
            return ([], notes)
        }
        return ([text + ": stop it or use another bind"], notes)
    }

    /// Whether a socket another process holds on a bind is the service manager's (its
    /// descriptor store, across a restart: `ExecStartPre=` runs while systemd holds the previous
    /// process's sockets): held by PID 1, or, when /proc does not say who holds it (DynamicUser=
    /// cannot read PID 1's descriptors), a socket of this very user `uid`.
    static func heldByServiceManager(_ socket: BoundSockets.Foreign, uid: UInt32) -> Bool {
        socket.pid == 1 || (socket.pid == nil && socket.uid == uid)
    }

    /// What each discovery source says about itself (Kubernetes: where its credentials come
    /// from; a note, not a problem: a token may appear after start, and the daemon keeps trying,
    /// its `/readyz` says what it waits for). DNS names are not resolved here: `--check` sends
    /// nothing to the network.
    static func discoveryNotes(_ config: FanoutConfig, environment: [String: String] = ProcessEnvironment.current()) -> [String] {
        let given = DiscoveryEnvironment(variables: environment, serviceAccountDirectory: KubernetesCredentials.serviceAccountDirectory)
        return config.listeners.enumerated().flatMap { index, listener in
            DiscoverySources.of(listener).compactMap { spec in
                let pool = spec.pool.flatMap { name in listener.pools.firstIndex { $0.name == name } }
                return spec.source.checkNote(path: "listeners[\(index)]\(pool.map { ".pools[\($0)]" } ?? "")", given)
            }
        }
    }
}

/// Another process's socket on a bind that overlaps a listener's (wildcard against specific):
/// the kernel gives each datagram to the most specific bind, so one of the two silently gets
/// nothing for that address. Said at start and by `--check`.
enum SocketOverlap {
    static func warnings(_ bind: SocketAddress) -> [String] {
        BoundSockets.foreign(overlapping: bind).map { other in
            FanoutConfig.isUnspecified(bind.ip)
                ? "\(other.bound) is bound by another process (\(other.owner.owner)): datagrams to \(other.bound) go to it, not to this listener"
                : "another process (\(other.owner.owner)) listens on \(other.bound): this listener takes the datagrams to \(bind) from it"
        }
    }
}
