// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import Logging
import ReusePortLB
import Synchronization
import SystemCalls

/// A worker thread of a socket-group listener (one-way, relay).
protocol ListenerWorker: AnyObject, Sendable {
    var index: Int { get }
    /// Its socket in the listener's group.
    var member: ReusePortMember { get }
    /// In its receive loop (readiness).
    var isReceiving: Bool { get }
    /// Grows while the worker moves (the path check).
    var progressCount: UInt64 { get }
    /// The thread's body: until the listener's stop signal, then drain and leave the group.
    func run()
}

/// What a socket-group listener's workers share: the plan they forward by, the stop signal, and
/// the handover request (relay workers drain their sessions on it).
struct WorkerShared: Sendable {
    let plans: PlanHolder
    let stop: StopSignal
    let handOver: HandOverSignal
    /// Listeners that read a previous process's sockets themselves (relay): per worker, the
    /// handed-over sockets it reads beside its own until they are empty after ``activated``.
    let inherited: [[ReusePortMember]]
    /// Set once the group took the bind over (``SocketGroupListener/activate()``): inherited
    /// sockets get nothing new from then on.
    let activated: StopSignal
    /// `rate_limit`: the listener's buckets per source, shared by its workers; nil: none.
    let limiter: SourceRateLimiter?
    /// When the workers seal their sockets as they stop (``SealOrder``).
    let sealing: SealOrder
}

/// When a socket-group listener's workers seal their sockets (``ReusePortMember/seal()``), so
/// that closing them loses nothing the kernel still delivers. Set before the stop signal.
final class SealOrder: Sendable {
    /// Another instance receives on the bind from now on (a successor, or a rollback's
    /// predecessor): seal before the stop drain, the other instance receiving meanwhile.
    let first = StopSignal()
    /// A stop for good (the daemon's, a listener removed) that hands nothing to a service
    /// manager: the workers receive until their drain ends, then seal and read once more; what
    /// arrives after is refused by the kernel (its Udp NoPorts counts it). A stop that hands the
    /// sockets to a service manager (a restart's next process adopts them) sets neither.
    let last = StopSignal()
}

/// The part every listener that receives on its bind's sockets shares (userspace, relay, and
/// af_xdp's companion socket): `settings.workers` worker threads, each a member of the
/// listener's own ReusePortLB group (process-private: nothing pinned). Joining happens before
/// any thread starts, so a bind error fails the start. The group steers nothing until
/// ``activate()``: a reload prepares the new workers beside the old ones on the same bind,
/// activates them (from then on every new datagram goes to them), and only then stops the old
/// ones, which forward what their sockets still hold. The kind supplies its workers.
final class SocketGroupListener: Sendable {
    let config: Listener
    let counters: ListenerCounters
    let group: ReusePortGroup
    let plans: PlanHolder
    let stop = StopSignal()
    /// ``WorkerShared/sealing``.
    let sealing = SealOrder()
    let handOverSignal = HandOverSignal()
    /// Set once every worker returned after a handover (``drainInBackground(drainSecs:drained:)``).
    private let drainedSignal = StopSignal()
    let workers: [any ListenerWorker]
    private let threads: [OSThread]
    let passiveHealth: (@Sendable (SocketAddress) -> Void)?
    /// `rate_limit`'s buckets, nil when the listener has none.
    let limiter: SourceRateLimiter?
    private let instance = ListenerInstance.next()
    let logger: Logger
    /// Where this listener's sockets are handed to the service manager (one-way userspace; nil:
    /// not stored), and the sockets a previous process handed over on this bind, read out once
    /// this group took the bind over (``activate()``).
    private let descriptors: DescriptorStore?
    private let handedOver: [(slot: Int?, member: ReusePortMember)]
    /// The workers read the handed-over sockets themselves (relay: a client's queued requests
    /// must reach the worker that holds its session); else they are read out by one-way workers
    /// of their own after ``activate()``.
    private let workersReadHandedOver: Bool
    private let activated = StopSignal()
    /// Set once the store names this group's sockets (``activate()``): a stop that hands them to
    /// the next process leaves them unsealed.
    private let stored = StopSignal()
    /// What the handed-over sockets held when taken: bytes, and the kernel's drops on them.
    private let handedOverQueued: (bytes: Int, drops: UInt64)
    /// Set by the first ``activate()``: the handed-over sockets are read out once (a rollback may
    /// activate this instance again, after they closed).
    private let handedOverRead = Atomic<Bool>(false)

    /// - Parameters:
    ///   - passiveHealth: told a downstream's address when a send to it got ICMP port
    ///     unreachable (at most once per batch per downstream and worker); nil: not reported.
    ///   - makeWorkers: the kind's workers, one per member (in slot order).
    ///   - descriptors: the service manager's store: the sockets a previous process handed over
    ///     on this bind are taken from it (read out after ``activate()``), and this group's are
    ///     stored in their place; nil: neither.
    ///   - workersReadHandedOver: the handed-over sockets go to the workers
    ///     (``WorkerShared/inherited``, by the slot they had: with the same workers and steering,
    ///     each to the worker its clients' datagrams reach); false: one-way readers of their own.
    init(_ config: Listener, counters: ListenerCounters, logger: Logger,
         passiveHealth: (@Sendable (SocketAddress) -> Void)? = nil, descriptors: DescriptorStore? = nil, workersReadHandedOver: Bool = false,
         makeWorkers: ([ReusePortMember], WorkerShared) throws(ReusePortError) -> [any ListenerWorker]) throws(ReusePortError) {
        self.config = config
        self.counters = counters
        self.passiveHealth = passiveHealth
        self.logger = logger
        self.descriptors = descriptors
        self.workersReadHandedOver = workersReadHandedOver
        limiter = config.rateLimit.map(SourceRateLimiter.init)
        handedOver = Self.takeHandedOver(config, descriptors, logger: logger)
        // Before any worker reads them (relay workers read them from their start).
        handedOverQueued = Self.queue(of: handedOver)
        let count = config.settings.workers > 0 ? config.settings.workers : allowedCPUs().count
        plans = PlanHolder(ForwardingPlan(
            downstreams: config.members, balancing: config.balancing, quicLB: config.quicLB, pools: config.pools, counters: counters,
            passiveHealth: passiveHealth))
        let options = GroupOptions(
            policy: config.settings.workerSteering.policy, capacity: count,
            receiveBufferSize: config.settings.recvBufSize > 0 ? config.settings.recvBufSize : nil)
        group = try ReusePortGroup(privateTo: config.bind, options: options)
        var members: [ReusePortMember] = []
        for slot in 0..<count {
            do {
                members.append(try group.join(slot: slot))
            } catch {
                Self.leaveSealed(members, listener: config.name, logger: logger)
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
        var starting: Logger.Metadata = [
            "listener": "\(config.name)", "bind": "\(config.bind)", "workers": "\(count)",
            "downstreams": "\(config.downstreams.count)", "balancing": "\(config.balancing.rawValue)", "pools": "\(config.pools.count)",
            "steering": "\(group.steering)", "worker_steering": "\(config.settings.workerSteering.rawValue)",
        ]
        if let limit = config.rateLimit { starting["rate_limit"] = "\(limit)" }
        if let cap = config.amplification { starting["amplification"] = "\(cap)" }
        logger.info("starting userspace forwarder", metadata: starting)
        do {
            var inherited = [[ReusePortMember]](repeating: [], count: count)
            if workersReadHandedOver {
                for (position, socket) in handedOver.enumerated() { inherited[(socket.slot ?? position) % count].append(socket.member) }
            }
            workers = try makeWorkers(members, WorkerShared(plans: plans, stop: stop, handOver: handOverSignal, inherited: inherited, activated: activated, limiter: limiter, sealing: sealing))
        } catch {
            Self.leaveSealed(members, listener: config.name, logger: logger)
            throw error
        }
        threads = workers.map { worker in
            OSThread(name: "fanout-\(worker.index)") { worker.run() }
        }
        // Once the instance stands: a failed start leaves /status showing the running one's.
        counters.showRateLimit(limiter)
    }

    /// Closes the sockets of a start that failed (bound, never steered to: no worker read them),
    /// sealed first (``ReusePortMember/seal(_:)``): they are the newest on the bind, where a
    /// running listener's datagrams could reach them as they close.
    private static func leaveSealed(_ members: [ReusePortMember], listener: String, logger: Logger) {
        do {
            try ReusePortMember.seal(members)
        } catch {
            logger.warning("could not seal the sockets of a start that failed: a datagram the kernel delivers to one as it closes is lost, not counted", metadata: [
                "listener": "\(listener)", "error": "\(error)",
            ])
        }
        for member in members { member.leave() }
    }

    /// A one-way listener's group: a ``SocketWorker`` per member, each forwarding through the
    /// listener's `output`.
    static func oneWay(_ config: Listener, counters: ListenerCounters, logger: Logger,
                       passiveHealth: (@Sendable (SocketAddress) -> Void)? = nil,
                       descriptors: DescriptorStore? = nil) throws(ReusePortError) -> SocketGroupListener {
        let made = try SocketGroupListener(config, counters: counters, logger: logger, passiveHealth: passiveHealth, descriptors: descriptors) { members, shared in
            members.enumerated().map { index, member in
                SocketWorker(index: index, member: member, sealing: shared.sealing, listener: config, counters: counters, plans: shared.plans, stop: shared.stop, logger: logger,
                             makeOutbox: Outboxes.factory(output: config.settings.output, capacity: config.settings.batchSize),
                             templates: counters.flowTemplates(config), limiter: shared.limiter)
            }
        }
        // A reload that turned relay off: no two-way series for a one-way listener.
        counters.twoWaySource.withLock { $0 = nil }
        return made
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
            // Still the instance meant to serve the bind (a rollback's predecessor, or a
            // successor activated after its predecessor stopped): the store names its sockets.
            store()
            throw .listener(name: config.name, error)
        }
        // Stored before the handed-over sockets are sealed: the store never holds only sealed ones.
        store()
        sealHandedOver()
        activated.set()
        guard descriptors != nil else { return }
        drainHandedOver(handedOverQueued)
    }

    /// The service manager's store names this group's sockets for the bind (nothing without one).
    private func store() {
        guard let descriptors else { return }
        descriptors.replaceSockets(config.bind, with: workers.map(\.member.socket))
        stored.set()
    }

    /// Seals the sockets a previous process handed over, once this group took the bind over
    /// (one grace period for all): read out after, their close loses nothing.
    private func sealHandedOver() {
        let members = handedOver.map(\.member).filter { !$0.hasLeft && !$0.isSealed }
        guard !members.isEmpty else { return }
        do {
            try ReusePortMember.seal(members)
        } catch {
            logger.warning("could not seal the sockets the previous process handed over: a datagram the kernel delivers to one as it closes is lost, not counted", metadata: [
                "listener": "\(config.name)", "error": "\(error)",
            ])
        }
    }

    /// Bytes the handed-over sockets hold, and datagrams the kernel dropped on them.
    private static func queue(of handedOver: [(slot: Int?, member: ReusePortMember)]) -> (bytes: Int, drops: UInt64) {
        var queued = (bytes: 0, drops: UInt64(0))
        for (_, member) in handedOver {
            if let statistics = try? member.socketStatistics() {
                queued.bytes += statistics.queuedBytes
                queued.drops += UInt64(statistics.drops)
            }
        }
        return queued
    }

    /// The sockets a previous process handed over on this bind that are UDP sockets bound to it
    /// (others are closed, counted rejected).
    private static func takeHandedOver(_ config: Listener, _ descriptors: DescriptorStore?, logger: Logger) -> [(slot: Int?, member: ReusePortMember)] {
        guard let descriptors else { return [] }
        var members: [(slot: Int?, member: ReusePortMember)] = []
        for (slot, fd) in descriptors.takeSockets(config.bind) {
            do throws(ReusePortError) {
                members.append((slot, try ReusePortMember(handedOver: fd, address: config.bind, options: GroupOptions(policy: .fiveTuple, capacity: 1))))
            } catch {
                let note = "listener '\(config.name)': \(error)"
                descriptors.count(Mode.userspace.rawValue, .rejected, note: note)
                logger.warning("\(note)")
            }
        }
        return members
    }

    /// Reads out the sockets a previous process handed over (after ``activate()`` they get
    /// nothing new): each forwards what it holds through this listener's plan, then closes
    /// (relay: its workers read them already; this only says so).
    private func drainHandedOver(_ queue: (bytes: Int, drops: UInt64)) {
        guard !handedOver.isEmpty, let descriptors, !handedOverRead.exchange(true, ordering: .relaxed) else { return }
        let (queued, dropped) = queue
        let previous = descriptors.predecessor.map { "pid \($0.pid), version \($0.version)" } ?? "an unknown process"
        let note = "listener '\(config.name)' on \(config.bind): adopted \(handedOver.count) socket(s) from \(previous) holding \(queued) bytes, \(dropped) datagram(s) dropped by the kernel over their life (counted in receive_queue_drops)"
        descriptors.count(Mode.userspace.rawValue, .adopted, handedOver.count, note: note)
        var metadata: Logger.Metadata = [
            "listener": "\(config.name)", "bind": "\(config.bind)", "sockets": "\(handedOver.count)", "queued_bytes": "\(queued)",
            "kernel_drops": "\(dropped)",
        ]
        if let predecessor = descriptors.predecessor {
            metadata["previous_pid"] = "\(predecessor.pid)"
            metadata["previous_version"] = "\(predecessor.version)"
        }
        logger.info("adopted the sockets of the previous process: forwarding what they queued while no process read them", metadata: metadata)
        guard !workersReadHandedOver else { return }
        let stopped = StopSignal()
        stopped.set()
        let factory = Outboxes.factory(output: config.settings.output, capacity: config.settings.batchSize)
        let drains = handedOver.enumerated().map { index, socket in
            SocketWorker(index: index, member: socket.member, sealing: nil, listener: config, counters: counters, plans: plans, stop: stopped, logger: logger,
                         makeOutbox: factory, drainLimit: .seconds(30), handedOver: true, templates: counters.flowTemplates(config), limiter: limiter)
        }
        let (name, log) = (config.name, logger)
        OSThread.detached(name: "\(config.name)-adopted") {
            let threads = drains.map { worker in OSThread(name: "adopted-\(worker.index)") { worker.run() } }
            for thread in threads { thread.join() }
            log.info("the sockets of the previous process are read out and closed", metadata: ["listener": "\(name)"])
        }
    }

    /// eBPF steering selects only this group's sockets; classic BPF and the kernel hash cannot
    /// exclude a previous group's.
    var takesOverExactly: Bool { group.steering == .ebpf }

    /// Swaps the downstreams, balancing and pools in place: workers pick it up at their next batch.
    func replacePlan(downstreams: [Downstream], balancing: Balancing, quicLB: [QUICLBConfiguration], pools: [Pool]) {
        plans.replace(with: ForwardingPlan(downstreams: downstreams, balancing: balancing, quicLB: quicLB, pools: pools, counters: counters, passiveHealth: passiveHealth))
    }

    /// Asks the workers to drain for `drainSecs` in the background (relay: the sessions' replies
    /// still reach their clients); `drained` is called once the last worker returned, telling
    /// whether ``shutdown()`` cut the drain short.
    func drainInBackground(drainSecs: Int, drained: @escaping @Sendable (_ cutShort: Bool) -> Void) {
        handOverSignal.drainMilliseconds.store(Int64(drainSecs) * 1000, ordering: .relaxed)
        handOverSignal.requested.set()
        // The successor took the bind over: the workers seal their sockets at the end.
        sealing.first.set()
        stop.set()
        let (threads, finished, signal) = (self.threads, drainedSignal, handOverSignal)
        OSThread.detached(name: "\(config.name)-drain") {
            for thread in threads { thread.join() }
            // Before the signal: a shutdown() waiting on it returns after the caller heard.
            drained(signal.cutShort.isSet)
            finished.set()
        }
    }

    /// Stops the workers: each forwards what its socket holds, leaves the group, and returns.
    /// After a handover: ends the drain now and waits for the workers to return.
    /// - Parameter sealing: another instance receives on the bind from now on: each worker seals
    ///   its socket before its stop drain; otherwise after it, unless the sockets go to a
    ///   service manager for the next process (``SealOrder``).
    func shutdown(sealing: Bool = false) {
        if handOverSignal.requested.isSet {
            handOverSignal.cutShort.set()
            while !drainedSignal.isSet { usleep(10_000) }
            return
        }
        if sealing {
            self.sealing.first.set()
        } else if !(descriptors?.handingOver == true && stored.isSet) {
            // Unless these are the sockets the service manager keeps for the next process (this
            // instance stored them): one that never did seals too.
            self.sealing.last.set()
        }
        stop.set()
        for thread in threads { thread.join() }
    }
}
