// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import Logging
import ReusePortLB
import SystemCalls
import Synchronization

/// A `replies: relay` listener: ``RelayWorker``s on the listener's own socket group
/// (``SocketGroupListener``). Each worker keeps its own sessions (validation guarantees
/// per-client worker steering); a listener replaced by one that took exactly its bind over
/// drains its sessions in the background (``handOver(drainSecs:drained:)``).
final class RelayListener: RunningListener {
    let group: SocketGroupListener
    /// The workers' shared session count and reply counters.
    private let relay: RelayCounters
    private var config: Listener { group.config }
    /// This instance's entry in ``reservations`` until it goes.
    private let reservation: Int
    /// The process's relay listener instances and the session tables they may hold: the
    /// open-files limit and the local ports must fit them.
    private static let reservations = Mutex(SessionReservations())

    deinit { Self.reservations.withLock { $0.remove(reservation) } }

    /// The session and draining sockets the relay instances a reload replaced still hold.
    static var heldByHandedOver: Int { reservations.withLock { $0.heldByHandedOver } }

    /// - Parameter descriptors: the service manager's store: the listener sockets and sessions a
    ///   previous process handed over on this bind are taken from it, and this instance's are
    ///   stored (``RelayWorker/store(_:)``); nil: neither.
    init(_ config: Listener, counters: ListenerCounters, logger: Logger,
         passiveHealth: (@Sendable (SocketAddress) -> Void)? = nil, descriptors: DescriptorStore? = nil) throws(ReusePortError) {
        // The counters outlive a restart (reload of the bind or settings), and the relay totals
        // with them; the session count is this instance's.
        let relay = counters.relayCounters()
        let sessions = RelaySessionCount(maxSessions: config.settings.maxSessions)
        self.relay = relay
        let handed = descriptors.map { Self.takeSessions(config, $0) } ?? []
        var assigned = false
        defer { if !assigned { for session in handed { close(session.socket) } } }
        group = try SocketGroupListener(config, counters: counters, logger: logger, passiveHealth: passiveHealth, descriptors: descriptors,
                                        workersReadHandedOver: true) { members, shared throws(ReusePortError) in
            var adopted = [[RelaySession]](repeating: [], count: members.count)
            assigned = true
            if let descriptors, !handed.isEmpty {
                adopted = Self.assign(handed, to: members, config: config, sessions: sessions, descriptors: descriptors, logger: logger)
            }
            var workers: [RelayWorker] = []
            for (index, member) in members.enumerated() {
                do throws(ReusePortError) {
                    workers.append(try RelayWorker(index: index, member: member, listener: config, counters: counters, relay: relay,
                                                   sessions: sessions, plans: shared.plans, stop: shared.stop, handOver: shared.handOver, logger: logger,
                                                   descriptors: descriptors, inherited: shared.inherited[index], activated: shared.activated,
                                                   adopted: adopted[index], limiter: shared.limiter, sealing: shared.sealing))
                } catch {
                    // The sessions not yet in a worker close here (a worker's own close with it).
                    for session in adopted[index...].joined() { session.closeSocket() }
                    for worker in workers { worker.closeEverySession() }
                    throw error
                }
            }
            return workers
        }
        // Each session is a socket: a table the open-files limit cannot hold fails at run time,
        // client by client (counted send_error). The soft limit is raised as far as the hard one
        // allows (a shell's 1,024 is common, systemd's LimitNOFILE sets both) for every relay
        // instance of the process, one that drains on after a reload too. Whether the limits can
        // hold what the configuration needs is said once it is applied (``RelayLimitWarnings``).
        let (reservation, everyInstance) = Self.reservations.withLock { reservations in
            (reservations.add(maxSessions: config.settings.maxSessions, held: sessions), reservations.everyInstance)
        }
        self.reservation = reservation
        if let files = try? Syscall.getrlimit(Syscall.Resource.openFiles), files.rlim_cur < rlim_t(everyInstance) + 256, files.rlim_cur < files.rlim_max {
            var raised = files
            raised.rlim_cur = min(rlim_t(everyInstance) + 256, files.rlim_max)
            try? Syscall.setrlimit(Syscall.Resource.openFiles, raised)
        }
        counters.twoWaySource.withLock { $0 = { relay.snapshot(sessions: sessions) } }
    }

    /// A session socket a previous process handed over: its stored name, worker, client and the
    /// downstream it is connected to.
    struct HandedSession {
        let name: String
        let socket: Int32
        /// The socket's inode (newer sockets have larger ones).
        var inode: UInt64 {
            var status = stat()
            return fstat(socket, &status) == 0 ? UInt64(status.st_ino) : 0
        }
        let worker: Int
        let client: SocketAddress
        let downstream: SocketAddress
    }

    /// Takes the session sockets a previous process handed over on this listener's bind; one
    /// that is not a UDP socket connected to an address, or that its process sealed as it closed
    /// the session, is closed (counted rejected).
    static func takeSessions(_ config: Listener, _ descriptors: DescriptorStore) -> [HandedSession] {
        var handed: [HandedSession] = []
        for (name, fds) in descriptors.takeAll(prefix: DescriptorStore.relaySessionPrefix(config.bind)).sorted(by: { $0.key < $1.key }) {
            for fd in fds {
                var storage = sockaddr_storage()
                var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
                let connected = withUnsafeMutablePointer(to: &storage) {
                    $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getpeername(fd, $0, &length) == 0 }
                }
                let peer = connected ? withUnsafeBytes(of: &storage) { SocketAddress(storage: $0.baseAddress!) } : nil
                let type = try? Syscall.getsockopt(fd, SOL_SOCKET, SO_TYPE, initial: Int32(0))
                if let parsed = DescriptorStore.parseRelaySession(name, bind: config.bind), let peer, type == Int32(SOCK_DGRAM.rawValue), fds.count == 1 {
                    guard !SocketSeal.isSealed(fd) else {
                        // Its process sealed it to close it, and stopped or crashed before it
                        // took it out of the store: it can neither send nor receive any more.
                        close(fd)
                        descriptors.remove(name)
                        descriptors.count(Replies.relay.rawValue, .rejected, note: "listener '\(config.name)': \(name) was sealed by the previous process as it closed the session: closed (its client starts a new session)")
                        continue
                    }
                    handed.append(HandedSession(name: name, socket: fd, worker: parsed.worker, client: parsed.client, downstream: peer))
                } else {
                    close(fd)
                    descriptors.remove(name)
                    descriptors.count(Replies.relay.rawValue, .rejected, note: "listener '\(config.name)': \(name) is not a relay session's socket (a UDP socket connected to a downstream, one per name): closed")
                }
            }
        }
        return handed
    }

    /// Gives each handed-over session to the worker its client's datagrams reach now: with eBPF
    /// steering the one the kernel program picks (the same computation), else the worker of its
    /// number. One session per client (a client can have had two: a restart that changed the
    /// workers; the one to a configured downstream is kept); past `max_sessions` a session is
    /// closed. Logged and counted (rejected).
    static func assign(_ handed: [HandedSession], to members: [ReusePortMember], config: Listener, sessions: RelaySessionCount,
                       descriptors: DescriptorStore, logger: Logger) -> [[RelaySession]] {
        var adopted = [[RelaySession]](repeating: [], count: members.count)
        let now = monotonicMilliseconds()
        var byDownstream: [String: Int] = [:]
        var rejected = 0
        var duplicates = 0
        let configured = Set(config.members.filter { $0.pool == nil }.map(\.address))
        var kept: [SocketAddress: HandedSession] = [:]
        for session in handed {
            if let other = kept[session.client] {
                // Keep the one to a configured downstream, else the newer socket (the larger
                // inode: the one the client used last); close the other.
                let otherFirst = configured.contains(other.downstream) != configured.contains(session.downstream)
                    ? configured.contains(other.downstream) : other.inode > session.inode
                let (keep, drop) = otherFirst ? (other, session) : (session, other)
                kept[session.client] = keep
                close(drop.socket)
                descriptors.remove(drop.name)
                duplicates += 1
            } else {
                kept[session.client] = session
            }
        }
        var unconfigured = 0
        for session in kept.values.sorted(by: { $0.name < $1.name }) {
            guard sessions.admit() else {
                close(session.socket)
                descriptors.remove(session.name)
                rejected += 1
                continue
            }
            let steered = Self.steeredAddress(session.client)
            let worker = (try? members.first?.owner(of: steered.ip, port: steered.port)).flatMap { $0 } ?? session.worker % members.count
            let downstream = config.members.first { $0.pool == nil && $0.address == session.downstream }
                ?? Downstream(name: "\(session.downstream)", address: session.downstream)
            if !configured.contains(session.downstream) { unconfigured += 1 }
            byDownstream[downstream.name, default: 0] += 1
            adopted[worker].append(RelaySession(client: session.client, socket: session.socket, stored: session.name, downstream: downstream, now: now))
        }
        let previous = descriptors.predecessor.map { "pid \($0.pid), version \($0.version)" } ?? "an unknown process"
        let adoptedCount = kept.count - rejected
        descriptors.count(Replies.relay.rawValue, .adopted, adoptedCount, note: "listener '\(config.name)' on \(config.bind): adopted \(adoptedCount) relay session(s) from \(previous): their clients keep their downstream and source port (\(unconfigured) to a downstream this configuration does not have: they drain for settings.drain_secs, their clients move)")
        logger.info("adopted the relay sessions of the previous process: each client keeps its downstream, and replies on the way are relayed", metadata: [
            "listener": "\(config.name)", "sessions": "\(adoptedCount)",
            "by_downstream": "\(byDownstream.sorted { $0.key < $1.key }.map { "\($0.key)=\($0.value)" }.joined(separator: ","))",
        ])
        if unconfigured > 0 {
            logger.warning("adopted relay sessions to a downstream this configuration does not have (removed, or not discovered yet at the start): they drain for settings.drain_secs and their clients get another downstream at their next datagram", metadata: [
                "listener": "\(config.name)", "sessions": "\(unconfigured)", "drain_secs": "\(config.settings.drainSecs)",
            ])
        }
        if rejected > 0 {
            let note = "listener '\(config.name)': \(rejected) relay session(s) handed over beyond settings.max_sessions (\(config.settings.maxSessions)) were closed: those clients start anew"
            descriptors.count(Replies.relay.rawValue, .rejected, rejected, note: note)
            logger.warning("\(note)")
        }
        if duplicates > 0 {
            let note = "listener '\(config.name)': \(duplicates) relay session(s) handed over for a client that had another (a restart that changed workers or worker_steering gives some clients two) were closed, one per client kept"
            descriptors.count(Replies.relay.rawValue, .rejected, duplicates, note: note)
            logger.info("\(note)")
        }
        return adopted
    }

    /// The address the kernel program hashes for a client: an IPv4 client of an IPv6 socket
    /// (`::ffff:a.b.c.d`) arrives in IPv4 packets.
    static func steeredAddress(_ client: SocketAddress) -> SocketAddress {
        let bytes = client.ip.bytes
        guard bytes.count == 16, bytes[0..<10].allSatisfy({ $0 == 0 }), bytes[10] == 0xff, bytes[11] == 0xff,
              let v4 = IPAddress(bytes: bytes[12...]) else { return client }
        return SocketAddress(ip: v4, port: client.port)
    }

    /// How many ports net.ipv4.ip_local_port_range (this network namespace's) gives connect(),
    /// less the reserved ones (ip_local_reserved_ports); nil when it cannot be read.
    static func ephemeralPorts() -> Int? {
        func numbers(_ text: Substring) -> [Int] { text.split(whereSeparator: { !$0.isNumber }).compactMap { Int($0) } }
        guard let range = try? readFile("/proc/sys/net/ipv4/ip_local_port_range") else { return nil }
        let bounds = numbers(Substring(range))
        guard bounds.count == 2, bounds[0] <= bounds[1] else { return nil }
        var ports = bounds[1] - bounds[0] + 1
        // "1000-1005,2000": ranges and single ports, counted where they fall inside the range.
        for item in ((try? readFile("/proc/sys/net/ipv4/ip_local_reserved_ports")) ?? "").split(separator: ",") {
            guard let low = numbers(item).first, let high = numbers(item).last else { continue }
            ports -= max(0, min(high, bounds[1]) - max(low, bounds[0]) + 1)
        }
        return max(0, ports)
    }

    var isReceiving: Bool { group.isReceiving }
    func heartbeats() -> [PathHeartbeat] { group.heartbeats() }
    func activate() throws(DaemonError) { try group.activate() }
    var takesOverExactly: Bool { group.takesOverExactly }

    /// Swaps the downstreams, balancing and pools in place (workers pick it up at their next batch),
    /// saying once what a leaving downstream's sessions do.
    func update(downstreams: [Downstream], balancing: Balancing, quicLB: [QUICLBConfiguration], pools: [Pool], keeping: Set<String>) -> Bool {
        let staying = Set(downstreams.filter { $0.weight > 0 }.map(\.address))
        let present = Set(downstreams.map(\.address))
        for leaving in group.plans.plan.downstreams where leaving.weight > 0 && !staying.contains(leaving.address) {
            // At weight 0 it stays in the set: its sessions keep it until they end.
            if present.contains(leaving.address) {
                group.logger.info("downstream at weight 0: no new clients; its sessions stay with it until they end (remove it to move them)", metadata: [
                    "listener": "\(config.name)", "downstream": "\(leaving.name)", "address": "\(leaving.address)",
                ])
                continue
            }
            group.logger.info(config.settings.drainSecs > 0
                ? "downstream draining: no new clients; its sessions' replies are relayed until settings.drain_secs passes, later ones counted drained"
                : "downstream left the set (settings.drain_secs 0): its sessions' replies from now on are counted drained", metadata: [
                "listener": "\(config.name)", "downstream": "\(leaving.name)", "address": "\(leaving.address)", "drain_secs": "\(config.settings.drainSecs)",
            ])
        }
        group.replacePlan(downstreams: downstreams, balancing: balancing, quicLB: quicLB, pools: pools)
        return true
    }

    /// Up to `limit` sessions (client, downstream name, idle seconds) from every worker's table
    /// (each table locked briefly), and how many are open.
    func associations(limit: Int) -> (entries: [AssociationEntry], total: Int)? {
        var entries: [AssociationEntry] = []
        var total = 0
        for case let worker as RelayWorker in group.workers {
            let listed = worker.associations(limit: max(0, limit - entries.count))
            total += listed.total
            entries += listed.entries
        }
        return (entries, total)
    }

    /// A successor on the same bind took it over (eBPF steering: nothing new reaches this
    /// instance): the sessions drain in the background for the successor's `drainSecs`, so the
    /// replies to requests already sent still reach their clients from the listener's address,
    /// and later ones are counted (``RelayWorker``); `drained` is called once the last worker
    /// returned, telling whether ``shutdown()`` cut the drain short.
    func handOver(drainSecs: Int, drained: @escaping @Sendable (_ cutShort: Bool) -> Void) -> Bool {
        Self.reservations.withLock { $0.handedOver(reservation) }
        group.drainInBackground(drainSecs: drainSecs, drained: drained)
        return true
    }

    /// Stops the workers (after a handover: ends the sessions' drain now).
    func shutdown() { group.shutdown() }
    /// As ``shutdown()``, each worker sealing its socket before its last read.
    func retire() { group.shutdown(sealing: true) }
}

/// The relay listener instances of a process: the session table each may hold (its
/// `max_sessions`), for which the soft open-files limit is raised (all of them together), and the
/// session sockets each holds now.
struct SessionReservations {
    struct Instance {
        let maxSessions: Int
        /// Its sessions and draining sockets now.
        let held: RelaySessionCount
        /// Handed over to a successor by a reload: its sockets drain beside the successor's.
        var handedOver = false
    }

    /// Every instance, by a number of its own.
    private(set) var instances: [Int: Instance] = [:]
    private var next = 0

    /// Adds an instance; returns its number (for ``remove(_:)`` and ``handedOver(_:)``).
    mutating func add(maxSessions: Int, held: RelaySessionCount) -> Int {
        next += 1
        instances[next] = Instance(maxSessions: maxSessions, held: held)
        return next
    }

    mutating func remove(_ instance: Int) { instances.removeValue(forKey: instance) }

    mutating func handedOver(_ instance: Int) { instances[instance]?.handedOver = true }

    /// max_sessions summed over every instance, a replaced one that still drains too: the
    /// sockets they may hold at once.
    var everyInstance: Int { instances.values.reduce(0) { $0 + $1.maxSessions } }

    /// The session and draining sockets the instances handed over to a successor hold now, at
    /// most: a session whose socket a leaving downstream moved to draining counts twice until
    /// the handed-over worker turns its sessions into draining sockets (soon after the handover).
    var heldByHandedOver: Int {
        instances.values.filter(\.handedOver).reduce(0) { $0 + $1.held.open.load(ordering: .relaxed) + $1.held.draining.load(ordering: .relaxed) }
    }
}

/// Whether the open-files limit and the local ports can hold the session tables a
/// configuration's relay listeners may hold together: said by the daemon at start and after
/// each reload that applied, each warning again only when its figures changed (a reload that
/// replaces a relay listener, whose old instance drains beside the new one, repeats nothing),
/// and whether the sockets that replaced instances still hold leave the configuration room.
struct RelayLimitWarnings {
    /// The limits a session table needs.
    enum Limit: Hashable {
        case openFiles, localPorts
        /// Either, with the sockets of replaced instances still draining.
        case whileDraining
    }
    /// The figures each warning was last said with; none while its limit is not short.
    private var said: [Limit: [Int]] = [:]

    /// What to say of `limit` now that it is short or not (`short`) with `figures`.
    enum Change: Equatable {
        /// Short, and said with other figures or not at all since it last was not: say it.
        case short
        /// Said short before, not short now: say that it holds again.
        case holds
        /// Nothing new.
        case unchanged
    }

    /// What to say of `limit` (`short` or not, with `figures`): short the first time, and again
    /// only when the figures changed or the limit held in between; that it holds, once, when it
    /// was said short.
    mutating func change(_ limit: Limit, _ short: Bool, figures: [Int]) -> Change {
        guard short else { return said.removeValue(forKey: limit) == nil ? .unchanged : .holds }
        defer { said[limit] = figures }
        return said[limit] != figures ? .short : .unchanged
    }

    /// Says what `config`'s relay listeners need that the limits cannot hold: `openFiles`, the
    /// process's open-files limit (raised by the listeners' start), `ports` the local ports a
    /// session socket can take (``RelayListener/ephemeralPorts()``); nil: not known.
    /// `heldByHandedOver`: the sockets relay instances a reload replaced still hold
    /// (``SessionReservations/heldByHandedOver``). Lines that a limit holds again come first.
    mutating func say(for config: FanoutConfig, openFiles: rlimit?, ports: Int?, heldByHandedOver: Int, logger: Logger) {
        let relays = config.listeners.filter(RelayKind.serves)
        guard !relays.isEmpty else {
            // No relay listener: nothing to say, and a listener added later is judged afresh.
            said.removeAll()
            return
        }
        let needed = relays.reduce(0) { $0 + $1.settings.maxSessions }
        let names = relays.map(\.name).joined(separator: ",")
        let limit = openFiles.map { Int(clamping: $0.rlim_cur) }
        let files = limit.map { change(.openFiles, needed + 256 > $0, figures: [needed, $0]) } ?? .unchanged
        // Each session socket also takes a local port of the kernel's ephemeral range (connect
        // picks one, unique per source address): past them a new client's socket cannot be made.
        let localPorts = ports.map { change(.localPorts, needed > $0, figures: [needed, $0]) } ?? .unchanged
        // The configuration fits a limit, but not beside the sockets (each a descriptor and a
        // local port) the replaced instances still hold: said at each reload where that holds
        // (its figures change with the sockets).
        let filesRoom = limit.map { $0 - 256 - needed }
        let portsRoom = ports.map { $0 - needed }
        let shortWhileDraining = [("open_files", filesRoom), ("local_ports", portsRoom)].compactMap { name, room in
            room.flatMap { $0 >= 0 && heldByHandedOver > $0 ? name : nil }
        }
        let draining = change(.whileDraining, !shortWhileDraining.isEmpty,
                              figures: [needed, limit ?? -1, ports ?? -1, heldByHandedOver, shortWhileDraining.count])
        // Every line names the configuration's relay listeners and what they need together.
        func figures(_ more: Logger.Metadata) -> Logger.Metadata {
            more.merging(["relay_listeners": "\(names)", "all_relay_max_sessions": "\(needed)"]) { own, _ in own }
        }
        if files == .holds, let limit {
            logger.info("replies relay: the open-files limit now holds every relay listener's max_sessions", metadata: figures(["open_files_limit": "\(limit)"]))
        }
        if localPorts == .holds, let ports {
            logger.info("replies relay: the local ports (net.ipv4.ip_local_port_range) now hold every relay listener's max_sessions", metadata: figures(["local_ports": "\(ports)"]))
        }
        if files == .short, let limit {
            logger.warning("replies relay: settings.max_sessions (of every relay listener together) is above what the open-files limit leaves for sessions; new clients beyond it are dropped (send_error): raise the limit (LimitNOFILE=, ulimit -n) or lower max_sessions",
                           metadata: figures(["open_files_limit": "\(limit)", "sessions_that_fit": "\(max(0, limit - 256))"]))
        }
        if localPorts == .short, let ports {
            logger.notice("replies relay: settings.max_sessions (of every relay listener together) is above the local ports a session socket can take (net.ipv4.ip_local_port_range); once they are used up, new clients' datagrams are dropped (send_error, logged): widen the range (up to 1024-65535) for more sessions, or use replies: nat (tc_ebpf or xdp) for more clients than that",
                          metadata: figures(["local_ports": "\(ports)"]))
        }
        if draining == .short {
            // How many sessions fit now beside what the replaced instances hold, by the shorter limit.
            let fitNow = [limit.map { $0 - 256 - heldByHandedOver }, ports.map { $0 - heldByHandedOver }].compactMap { $0 }.min() ?? 0
            logger.notice("replies relay: relay instances replaced by a reload (this one or an earlier one) still hold session sockets, which drain until silent for their session_idle_secs after drain_secs; beside them the open-files limit or the local ports (short_limits) leave less room than every relay listener's max_sessions needs: new clients beyond it are dropped (send_error, logged) until those sockets close; raise the limit (LimitNOFILE=, ulimit -n; net.ipv4.ip_local_port_range), or lower session_idle_secs if reloads come often",
                          metadata: figures(["short_limits": "\(shortWhileDraining.joined(separator: ","))", "open_files_limit": "\(limit.map(String.init) ?? "unknown")",
                                             "local_ports": "\(ports.map(String.init) ?? "unknown")", "held_by_replaced": "\(heldByHandedOver)",
                                             "sessions_that_fit_now": "\(max(0, fitNow))"]))
        }
    }
}
