#if canImport(Glibc)
import Glibc
#endif
import Logging
import ReusePortLB
import SystemCalls

/// A userspace listener: `settings.workers` worker threads, each a member of the listener's
/// own ReusePortLB group (process-private: nothing pinned). Joining happens before any thread
/// starts, so a bind error fails the start. The group steers nothing until ``activate()``:
/// a reload prepares the new workers beside the old ones on the same bind, activates them (from
/// then on every new datagram goes to them), and only then stops the old ones, which forward
/// what their sockets still hold.
final class UserspaceListener: RunningListener {
    let config: Listener
    let counters: ListenerCounters
    private let group: ReusePortGroup
    private let plans: PlanHolder
    private let stop = StopSignal()
    private let handOverSignal = HandOverSignal()
    /// Set once every worker returned after a handover (``handOver(drainSecs:drained:)``).
    private let drainedSignal = StopSignal()
    private let workers: [any ListenerWorker]
    /// `replies: relay`: the workers' shared session count and reply counters; nil: one way.
    private let relay: RelayCounters?
    private let threads: [OSThread]
    private let passiveHealth: (@Sendable (SocketAddress) -> Void)?
    private let instance = ListenerInstance.next()
    private let logger: Logger

    /// - Parameter passiveHealth: told a downstream's address when a send to it got ICMP port
    ///   unreachable (at most once per batch per downstream and worker); nil: not reported.
    init(_ config: Listener, counters: ListenerCounters, logger: Logger,
         passiveHealth: (@Sendable (SocketAddress) -> Void)? = nil) throws(ReusePortError) {
        self.config = config
        self.counters = counters
        self.passiveHealth = passiveHealth
        self.logger = logger
        let count = config.settings.workers > 0 ? config.settings.workers : allowedCPUs().count
        plans = PlanHolder(ForwardingPlan(downstreams: config.downstreams, balancing: config.balancing, counters: counters, passiveHealth: passiveHealth))
        let options = GroupOptions(
            policy: config.settings.workerSteering.policy, capacity: count,
            receiveBufferSize: config.settings.recvBufSize > 0 ? config.settings.recvBufSize : nil)
        group = try ReusePortGroup(privateTo: config.bind, options: options)
        var members: [ReusePortMember] = []
        for slot in 0..<count {
            do {
                members.append(try group.join(slot: slot))
            } catch {
                for member in members { member.leave() }
                throw error
            }
        }
        for overlap in SocketOverlap.warnings(config.bind) {
            logger.warning("bind overlaps another process's socket", metadata: ["listener": "\(config.name)", "overlap": "\(overlap)"])
        }
        if let note = group.steeringNote {
            logger.warning("worker steering fallback", metadata: ["listener": "\(config.name)", "note": "\(note)"])
        }
        if let member = members.first, let granted = Self.receiveBufferShortfall(socket: member.socket, requested: config.settings.recvBufSize) {
            logger.warning("recv_buf_size was capped by the kernel: raise net.core.rmem_max (sysctl -w net.core.rmem_max=\(config.settings.recvBufSize)) or grant CAP_NET_ADMIN (SO_RCVBUFFORCE)", metadata: [
                "listener": "\(config.name)", "recv_buf_size": "\(config.settings.recvBufSize)", "granted": "\(granted)",
                "rmem_max": "\(Self.rmemMax.map(String.init) ?? "unknown")",
            ])
        }
        logger.info("starting userspace forwarder", metadata: [
            "listener": "\(config.name)", "bind": "\(config.bind)", "workers": "\(count)",
            "downstreams": "\(config.downstreams.count)", "balancing": "\(config.balancing.rawValue)",
            "steering": "\(group.steering)", "worker_steering": "\(config.settings.workerSteering.rawValue)",
        ])
        let (plans, stop) = (self.plans, self.stop)
        if config.replies == .relay {
            // Two-way: each worker keeps its own sessions (validation guarantees per-client
            // worker steering); the one-way workers below stay exactly as they are.
            // The counters outlive a restart (reload of the bind or settings), and the relay totals
            // with them; the session count is this instance's.
            let relay = counters.relayCounters()
            let sessions = RelaySessionCount(maxSessions: config.settings.maxSessions)
            var relayWorkers: [RelayWorker] = []
            for (index, member) in members.enumerated() {
                do {
                    relayWorkers.append(try RelayWorker(index: index, member: member, listener: config, counters: counters, relay: relay,
                                                        sessions: sessions, plans: plans, stop: stop, handOver: handOverSignal, logger: logger))
                } catch {
                    for member in members { member.leave() }
                    throw error
                }
            }
            self.relay = relay
            workers = relayWorkers
            // Each session is a socket: a table the open-files limit cannot hold fails at run time,
            // client by client (counted send_error). Say so now.
            var files = rlimit()
            if getrlimit(Int32(RLIMIT_NOFILE.rawValue), &files) == 0, UInt64(config.settings.maxSessions) + 256 > UInt64(files.rlim_cur) {
                logger.warning("replies relay: settings.max_sessions is above what the open-files limit leaves for sessions; new clients beyond it are dropped (send_error): raise the limit (LimitNOFILE=, ulimit -n) or lower max_sessions", metadata: [
                    "listener": "\(config.name)", "max_sessions": "\(config.settings.maxSessions)", "open_files_limit": "\(files.rlim_cur)",
                ])
            }
            counters.twoWaySource.withLock { $0 = { relay.snapshot(sessions: sessions) } }
        } else {
            relay = nil
            // A reload that turned relay off: no two-way series for a one-way listener.
            counters.twoWaySource.withLock { $0 = nil }
            workers = members.enumerated().map { index, member in
                UserspaceWorker(index: index, member: member, listener: config, counters: counters, plans: plans, stop: stop, logger: logger,
                                makeOutbox: Outboxes.factory(output: config.settings.output, capacity: config.settings.batchSize))
            }
        }
        threads = workers.map { worker in
            OSThread(name: "fanout-\(worker.index)") { worker.run() }
        }
    }

    /// The receive buffer a socket got when it is smaller than `requested` (bytes; 0: none
    /// requested), else nil. The kernel reports twice what it grants (bookkeeping overhead), and
    /// without CAP_NET_ADMIN it caps a request at net.core.rmem_max, silently.
    static func receiveBufferShortfall(socket: Int32, requested: Int) -> Int? {
        guard requested > 0 else { return nil }
        guard let value = try? Syscall.getsockopt(socket, SOL_SOCKET, SO_RCVBUF, initial: Int32(0)) else { return nil }
        let granted = Int(value) / 2
        return granted < requested ? granted : nil
    }

    static var rmemMax: Int? {
        (try? readFile("/proc/sys/net/core/rmem_max")).flatMap { Int($0.filter(\.isNumber)) }
    }

    /// Every worker is in its receive loop.
    var isReceiving: Bool { workers.allSatisfy(\.isReceiving) }

    /// Each worker's progress counter, for the systemd watchdog.
    func heartbeats() -> [PathHeartbeat] {
        // Stopping (replaced in a reload, or shutdown): its workers drain and leave, not stuck.
        guard !stop.isSet else { return [] }
        return workers.map { PathHeartbeat(listener: config.name, instance: instance, beat: .worker(index: $0.index, count: $0.progressCount)) }
    }

    /// Makes this listener's group the steering on its bind: every new datagram goes to these
    /// workers from now on (a previous listener on the bind keeps only what it has queued).
    func activate() throws(DaemonError) {
        do {
            try group.activate()
        } catch {
            throw .listener(name: config.name, error)
        }
    }

    /// eBPF steering selects only this group's sockets; classic BPF and the kernel hash cannot
    /// exclude a previous group's.
    var takesOverExactly: Bool { group.steering == .ebpf }

    /// Swaps the downstreams and balancing in place: workers pick it up at their next batch.
    func update(downstreams: [Downstream], balancing: Balancing, keeping: Set<String>) -> Bool {
        if relay != nil {
            // What a relay drain does is said once here, not by each worker.
            let staying = Set(downstreams.filter { $0.weight > 0 }.map(\.address))
            for leaving in plans.plan.downstreams where leaving.weight > 0 && !staying.contains(leaving.address) {
                logger.info(config.settings.drainSecs > 0
                    ? "downstream draining: no new clients; its sessions' replies are relayed until settings.drain_secs passes, later ones counted drained"
                    : "downstream left the set (settings.drain_secs 0): its sessions' replies from now on are counted drained", metadata: [
                    "listener": "\(config.name)", "downstream": "\(leaving.name)", "address": "\(leaving.address)", "drain_secs": "\(config.settings.drainSecs)",
                ])
            }
        }
        plans.replace(with: ForwardingPlan(downstreams: downstreams, balancing: balancing, counters: counters, passiveHealth: passiveHealth))
        return true
    }

    /// `replies: relay`: up to `limit` sessions (client, downstream name, idle seconds) from every
    /// worker's table (each table locked briefly), and how many are open; nil for a one-way listener.
    func associations(limit: Int) -> (entries: [AssociationEntry], total: Int)? {
        guard relay != nil else { return nil }
        var entries: [AssociationEntry] = []
        var total = 0
        for case let worker as RelayWorker in workers {
            let listed = worker.associations(limit: max(0, limit - entries.count))
            total += listed.total
            entries += listed.entries
        }
        return (entries, total)
    }

    /// A successor on the same bind took it over (eBPF steering: nothing new reaches this
    /// instance). A relay listener keeps its sessions draining in the background for the
    /// successor's `drainSecs`, so the replies to requests it already sent still reach their
    /// clients from the listener's address, and later ones are counted (``RelayWorker``);
    /// `drained` is called once its last worker
    /// returned, telling whether ``shutdown()`` cut the drain short. Any other listener stops at
    /// once, as ``shutdown()`` does.
    /// - Returns: true if it drains in the background (``shutdown()`` cuts that short).
    func handOver(drainSecs: Int, drained: @escaping @Sendable (_ cutShort: Bool) -> Void) -> Bool {
        guard relay != nil else {
            shutdown()
            return false
        }
        handOverSignal.drainMilliseconds.store(Int64(drainSecs) * 1000, ordering: .relaxed)
        handOverSignal.requested.set()
        stop.set()
        let (threads, finished, signal) = (self.threads, drainedSignal, handOverSignal)
        OSThread.detached(name: "\(config.name)-drain") {
            for thread in threads { thread.join() }
            // Before the signal: a shutdown() waiting on it returns after the caller heard.
            drained(signal.cutShort.isSet)
            finished.set()
        }
        return true
    }

    /// Stops the workers: each forwards what its socket holds, leaves the group, and returns.
    /// After a handover: ends the sessions' drain now and waits for the workers to return.
    func shutdown() {
        if handOverSignal.requested.isSet {
            handOverSignal.cutShort.set()
            while !drainedSignal.isSet { usleep(10_000) }
            return
        }
        stop.set()
        for thread in threads { thread.join() }
    }
}
