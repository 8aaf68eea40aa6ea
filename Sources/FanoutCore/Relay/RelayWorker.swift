// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim
import Logging
import ReusePortLB
import Synchronization
import SystemCalls

/// One worker thread of a `replies: relay` listener. Like ``SocketWorker`` it owns one socket
/// of the listener's ReusePortLB group (steered per client: five_tuple or source_ip, so a client
/// always reaches the same worker), and it keeps its own session table: client address and port
/// → ``RelaySession``. A client's datagrams leave on its session socket; one epoll set holds the
/// listener socket and every session socket, and what a session socket receives (the
/// downstream's replies) is sent to the client from the listener socket, so the client sees the
/// listener's address and port as the source. The thread runs the shared ``ReceiveLoop``, with
/// the session sockets as this body's other events.
final class RelayWorker: ListenerWorker, ReceiveLoopBody, @unchecked Sendable {
    let index: Int
    let member: ReusePortMember
    let receivingNow = Atomic<Bool>(false)
    let loop: ReceiveLoop
    let listener: Listener
    let counters: ListenerCounters
    let relay: RelayCounters
    let sessionCount: RelaySessionCount
    let plans: PlanHolder
    let stop: StopSignal
    let handOver: HandOverSignal
    let logger: Logger
    let idleMilliseconds: Int64
    /// settings.drain_secs: how long a draining socket's replies are still relayed.
    let drainMilliseconds: Int64
    // Owned by the worker thread once it runs:
    let receiver: BatchReceiver
    let replyReceiver: BatchReceiver
    let replyHeaders: UnsafeMutablePointer<shim_mmsghdr>
    let replyIovecs: UnsafeMutablePointer<iovec>
    /// Replies received from session sockets and not yet sent: they fill ``replyReceiver``'s
    /// slots 0..<replySlotsUsed (gathered from every session socket an epoll wakeup reports) and
    /// leave in one sendmmsg on the listener socket (``flushReplies()``), not one call per
    /// session. A run per receive call: its session (held, so its client address stays valid
    /// until the flush even if the session closes first), its downstream's reply counter, and
    /// the end of its messages in replyHeaders (0..<stagedMessages).
    var replySlotsUsed = 0
    var stagedMessages = 0
    var stagedRuns: [(session: RelaySession, counter: RelayCounters.DownstreamReplies?, end: Int)] = []
    var stagedTooLarge: UInt64 = 0
    /// `amplification`: replies not staged for a client not yet validated, since the last flush.
    var stagedCapped: UInt64 = 0
    /// The listener's `amplification` (nil: none).
    let amplification: Amplification?
    let epoll: Int32
    let events: UnsafeMutablePointer<epoll_event>
    /// The io_uring the per-session sends and receives go through, a batch's worth per system
    /// call (settings.io_uring); nil: one system call each (the setting is off, or the kernel
    /// refused, logged once per worker at start). Made by the worker thread in ``run()``.
    var ring: IOURing?
    /// Per datagram of the batch being forwarded through the ring: its session socket and its
    /// downstream's index (-1: not in the ring).
    let ringSockets: UnsafeMutablePointer<Int32>
    let ringTargets: UnsafeMutablePointer<Int>
    /// Per reply slot being received into through the ring: its session.
    var ringSessions: [RelaySession?]
    /// The session sockets the current wakeup reported readable, and the busy ones among them
    /// (readable in the previous wakeup too): read in batches (recvmmsg), as without the ring.
    var readySockets: [Int32] = []
    var busySessions: [RelaySession] = []
    /// The draining sockets among them: read by system calls once the ring's receives are in
    /// (their reads may flush the stage and reuse its slots, which a queued receive still owns).
    var readyDraining: [DrainingSocket] = []
    var wakeup: UInt64 = 0
    static let eventCapacity = 256
    /// Batches read from one socket per epoll wakeup.
    static let batchesPerWakeup = 8
    var version = -1
    var plan: ForwardingPlan?
    var selector = DownstreamSelector(downstreams: [], balancing: .roundRobin)
    var replyCounters: [RelayCounters.DownstreamReplies] = []
    /// Replication: the plan's pools get a one-way copy of every request (replies come only from
    /// the listener's own downstreams, through the sessions).
    let replicator: PoolReplicator
    /// Per downstream of the plan, for one batch: datagrams and bytes sent, datagrams dropped,
    /// and whether a send was refused (passive health is told once per batch).
    var batchSent: [UInt64] = []
    var batchBytes: [UInt64] = []
    var batchDropped: [UInt64] = []
    var batchRefused: [Bool] = []
    var drops: ReceiveQueueDropReading
    var lastFailureLog: Int64 = -1_000_000
    var failuresSinceLog = 0
    /// The session table. The worker holds ``tableLock`` while it changes the table or a
    /// session (one batch at a time), ``associations()`` while it reads it.
    let tableLock = Mutex<Void>(())
    var sessions: [ClientKey: RelaySession] = [:]
    var bySocket: [Int32: RelaySession] = [:]
    /// Session sockets whose downstream left the plan, by descriptor: in the same epoll set,
    /// told apart from ``bySocket``'s by lookup (they are few, and only while a change drains).
    var draining: [Int32: DrainingSocket] = [:]
    /// Sockets closing (expired sessions', silent draining ones, leaving ones past the draining
    /// bound), sealed and out of the epoll set, with the monotonic milliseconds of their seal:
    /// read a last time and closed at a sweep at least ``sealedMinimum`` later (``closeSealedLater(_:)``).
    var sealedClosing: [(socket: DrainingSocket, sealedAt: Int64)] = []
    /// How long a socket ``closeSealedLater(_:)`` sealed stays open at least: far longer than a
    /// kernel grace period in practice (milliseconds), not a guarantee.
    static let sealedMinimum: Int64 = 100
    /// The service manager's store: each session socket is handed to it as it opens and taken
    /// out as it closes, so a restart or crash keeps the sessions (nil: not stored).
    let descriptors: DescriptorStore?
    /// Listener sockets of the previous process (a restart) this worker reads before its own:
    /// a client's requests queued there while no process ran reach the worker that holds its
    /// session. Each closes once empty after ``activated``.
    var inherited: [ReusePortMember]
    /// Set once the listener's group took the bind over: the inherited sockets get nothing new.
    let activated: StopSignal
    /// When the worker seals its socket (``SealOrder``): either way once its replies are sent, then
    /// it reads it once more.
    let sealing: SealOrder
    /// `rate_limit`: the listener's buckets per source (requests only), nil when none.
    let limiter: SourceRateLimiter?

    /// - Parameters:
    ///   - inherited: listener sockets a previous process handed over, read beside `member`.
    ///   - adopted: sessions a previous process handed over whose clients this worker's
    ///     steering receives (socket open, counted in `sessions` already).
    init(index: Int, member: ReusePortMember, listener: Listener, counters: ListenerCounters, relay: RelayCounters,
         sessions: RelaySessionCount, plans: PlanHolder, stop: StopSignal, handOver: HandOverSignal, logger: Logger,
         descriptors: DescriptorStore? = nil, inherited: [ReusePortMember] = [], activated: StopSignal = StopSignal(),
         adopted: [RelaySession] = [], limiter: SourceRateLimiter? = nil, sealing: SealOrder = SealOrder()) throws(ReusePortError) {
        self.sealing = sealing
        self.limiter = limiter
        amplification = listener.amplification
        self.index = index
        self.member = member
        self.descriptors = descriptors
        self.inherited = inherited
        self.activated = activated
        drops = ReceiveQueueDropReading(member)
        self.listener = listener
        self.counters = counters
        self.relay = relay
        sessionCount = sessions
        self.plans = plans
        self.stop = stop
        self.handOver = handOver
        self.logger = logger
        replicator = PoolReplicator(listener: listener.name, counters: counters, logger: logger, output: listener.settings.output,
                                    capacity: listener.settings.batchSize,
                                    sender: SharedSender(capacity: listener.settings.batchSize, logger: logger, counters: counters))
        loop = ReceiveLoop(stop: stop, logger: logger, metadata: ["listener": "\(listener.name)", "worker": "\(index)"],
                           ledger: counters.ledger?.claim(listener: listener.name),
                           busyWait: (.microseconds(listener.settings.busyWaitMicroseconds), counters.busyWait))
        idleMilliseconds = Int64(listener.settings.sessionIdleSecs) * 1000
        drainMilliseconds = Int64(listener.settings.drainSecs) * 1000
        let batch = listener.settings.batchSize
        receiver = BatchReceiver(batchSize: batch, maximumDatagramSize: listener.settings.maxPacketSize)
        replyReceiver = BatchReceiver(batchSize: batch, maximumDatagramSize: listener.settings.maxPacketSize)
        replyHeaders = .allocate(capacity: batch)
        replyIovecs = .allocate(capacity: batch)
        for slot in 0..<batch { replyHeaders[slot] = shim_mmsghdr() }
        stagedRuns.reserveCapacity(batch)
        ringSockets = .allocate(capacity: batch)
        ringTargets = .allocate(capacity: batch)
        ringTargets.initialize(repeating: -1, count: batch)
        ringSessions = Array(repeating: nil, count: batch)
        events = .allocate(capacity: Self.eventCapacity)
        var created: Int32 = -1
        do {
            created = try Syscall.epollCreate()
            for socket in [member.socket] + inherited.map(\.socket) + adopted.map(\.socket) {
                var event = epoll_event()
                event.events = UInt32(EPOLLIN.rawValue)
                event.data.fd = socket
                try Syscall.epollControl(created, EPOLL_CTL_ADD, socket, &event)
            }
        } catch {
            if created >= 0 { Syscall.close(created) }
            replyHeaders.deallocate()
            replyIovecs.deallocate()
            ringSockets.deallocate()
            ringTargets.deallocate()
            events.deallocate()
            throw .system(error)
        }
        epoll = created
        for session in adopted {
            // One session per client (the listener keeps one): a second would be overwritten
            // in the table and never closed.
            precondition(self.sessions[ClientKey(session.client)] == nil, "one adopted relay session per client")
            self.sessions[ClientKey(session.client)] = session
            bySocket[session.socket] = session
        }
    }

    deinit {
        // Here, not at the end of run(): a worker whose thread never ran (a later worker of the
        // listener failed to start) must not leak its epoll descriptor.
        close(epoll)
        replyHeaders.deallocate()
        replyIovecs.deallocate()
        ringSockets.deallocate()
        ringTargets.deallocate()
        events.deallocate()
    }

    var isReceiving: Bool { receivingNow.load(ordering: .relaxed) }
    var progressCount: UInt64 { loop.progressCount }

    func run() {
        let cpu = pinWorkerThread(listener, index, logger: logger)
        openRing()
        tableLock.withLock { _ in adoptPlanLocked() }
        receivingNow.store(true, ordering: .relaxed)
        logger.info("entering receive loop", metadata: ["listener": "\(listener.name)", "worker": "\(index)", "steering": "\(member.steering)", "replies": "relay", "cpu": "\(cpu)",
                                                        "io_uring": "\(ring != nil)", "busy_wait_us": "\(listener.settings.busyWaitMicroseconds)"])
        // The loop's stop drain forwards what the listener socket still holds (until it stays
        // empty 20 ms, at most 1 s); replies already queued are relayed once more below.
        loop.run(self)
        drops.read(member, into: counters)
        for fd in Array(bySocket.keys) { drainReplies(fd) }
        for fd in Array(draining.keys) { drainReplies(fd) }
        flushReplies()
        if handOver.requested.isSet { drainAfterHandOver() }
        // Sessions going to the service manager's store for the next process stay as they are;
        // draining sockets (never stored) are sealed and read all the same. No reply tail where
        // another instance receives on the bind (a successor, a rollback's predecessor, a
        // handover's successor when its drain was cut short): without eBPF steering this
        // worker's socket shares the bind until its seal, and a tail would only delay that.
        let handing = descriptors?.handingOver == true
        relayLastReplies(tail: !handing && !sealing.first.isSet, sessions: !handing)
        if sealing.first.isSet || sealing.last.isSet { sealAndCountLast() }
        receivingNow.store(false, ordering: .relaxed)
        // Handing over: every session goes to the store, waiting for the service manager now;
        // else every one goes out of it (the removals it did not take at once, waiting too).
        if descriptors?.handingOver == true { storePending(waiting: true) }
        closeEverySession()
        storePending(waiting: true)
        for socket in inherited { socket.leave() }
        loop.ledger?.release()
        member.leave()
        ring = nil
    }

    // MARK: ReceiveLoopBody

    /// A few batches per turn (epoll is level-triggered: a listener socket that still holds
    /// datagrams is reported again), so a flood of requests cannot starve the replies or the idle
    /// sweep.
    var batchesPerTurn: Int { Self.batchesPerWakeup }

    func receiveBatch() throws(SystemCallError) -> Int {
        // What the previous process's sockets hold came first; each closes once empty after the
        // group took the bind over (sealed then: nothing new reaches it, not even as it closes).
        var position = 0
        while position < inherited.count {
            let socket = inherited[position]
            let count = try receiver.receiveNoting(loop.ledger, from: socket.socket, flags: Socket.dontWait | Socket.truncate)
            if count > 0 { return count }
            if activated.isSet {
                try? Syscall.epollControl(epoll, EPOLL_CTL_DEL, socket.socket, nil)
                socket.leave()
                inherited.remove(at: position)
            } else {
                position += 1
            }
        }
        return try receiver.receiveNoting(loop.ledger, from: member.socket, flags: Socket.dontWait | Socket.truncate)
    }

    func adoptPlanIfChanged() { tableLock.withLock { _ in adoptPlanLocked() } }

    func forward(_ count: Int) { tableLock.withLock { _ in forwardLocked(count) } }

    /// One epoll wait over the listener socket and every session socket: the session sockets'
    /// replies are read here (a few batches per socket per wakeup, so one chatty downstream
    /// cannot starve the others) and staged for ``endOfTurn()``.
    func wait(milliseconds: Int32) -> ReceiveLoop.Readiness {
        guard let ready = try? Syscall.epollWait(epoll, events, Int32(Self.eventCapacity), milliseconds) else { return .failed }
        guard ready > 0 else { return .timedOut }
        wakeup &+= 1
        // A plan a reload or health replaced applies before the replies of this wakeup are read,
        // not only at the next request: from then on a leaving downstream's replies are its
        // drain's (counted drained once drain_secs is over), as the daemon's log says.
        adoptPlanIfChanged()
        var listenerReady = false
        for slot in 0..<ready {
            let fd = events[slot].data.fd
            if fd == member.socket || inherited.contains(where: { $0.socket == fd }) {
                listenerReady = true
            } else {
                replyReady(fd)
            }
        }
        finishReadyReplies()
        return listenerReady ? .source : .other
    }

    func idle() { drops.read(member, into: counters) }

    /// What this turn gathered from the session sockets goes to the clients in one call.
    func endOfTurn() {
        drops.endOfTurn(member, into: counters)
        flushReplies()
        storePending(waiting: false)
    }

    func everySecond() {
        sweep(now: monotonicMilliseconds())
        replicator.sweepIdleSockets()
        storeWithinBudget()
        // Replies can keep the loop from ever idling: drops of the listener's socket are read
        // here too, not only with its next request.
        drops.read(member, into: counters)
    }

    /// Up to `limit` sessions' client, downstream name (its address once the downstream left the
    /// plan) and seconds since the last datagram, and how many sessions the worker has: the table
    /// is locked only while at most `limit` entries are made.
    func associations(limit: Int) -> (entries: [AssociationEntry], total: Int) {
        let now = monotonicMilliseconds()
        return tableLock.withLock { _ in
            var entries: [AssociationEntry] = []
            entries.reserveCapacity(min(limit, sessions.count))
            for session in sessions.values {
                guard entries.count < limit else { break }
                guard let client = session.clientAddress else { continue }
                let name = session.socket >= 0 ? session.downstream.name : "\(session.downstream.address)"
                entries.append(AssociationEntry(client: client, downstream: name, idleSeconds: Int(max(0, now - session.lastActive) / 1000)))
            }
            return (entries, sessions.count)
        }
    }

    // MARK: Session sockets: two paths behind one interface

    // The rest of the worker moves datagrams on its session sockets through these four calls
    // alone. The ring path (RelayWorker+IOURing.swift) batches a turn's sends and receives into
    // one io_uring submit each; the system-call path (RelayWorker+SystemCalls.swift) makes one
    // send(2) per request and drains each readable socket with recvmmsg(2). A worker starts on
    // the ring when settings.io_uring is on and the kernel allows it, and falls back to system
    // calls for good when a submit fails (after finishing what the ring had not taken).

    /// Sends request `datagram` of the received batch on its session's socket: queued in the
    /// ring (returns true: ``finishRequests(_:_:)`` submits it), else one system call now.
    func sendRequest(_ datagram: Int, on session: RelaySession, _ failures: inout SendFailures) -> Bool {
        let payload = receiver.payload(datagram)
        // The ring holds at most a batch, and it is empty here: queueing cannot fail.
        if let ring, ring.queueSend(session.socket, payload.baseAddress, payload.count, data: UInt64(datagram)) {
            ringSockets[datagram] = session.socket
            ringTargets[datagram] = session.target
            return true
        }
        sendBySystemCall(payload, on: session.socket, for: session.target, &failures)
        return false
    }

    /// Submits the batch's queued requests (the batch had `count` datagrams) and counts them.
    func finishRequests(_ count: Int, _ failures: inout SendFailures) {
        if let ring { completeSends(ring, count, &failures) }
    }

    /// A session socket this wakeup reported readable: drained now by system calls, or queued
    /// for the ring's one submit in ``finishReadyReplies()``.
    func replyReady(_ fd: Int32) {
        if ring != nil {
            readySockets.append(fd)
        } else {
            drainReplies(fd, budget: Self.batchesPerWakeup)
        }
    }

    /// Reads what ``replyReady(_:)`` queued for the ring, if anything.
    func finishReadyReplies() {
        if !readySockets.isEmpty { receiveReadyReplies() }
    }

    // MARK: Plan

    /// Takes the current plan if a reload or health replaced it. Sessions whose downstream (name
    /// and address) stays are kept, at its new index; the others lose their socket and get a new
    /// downstream at their client's next datagram (counted `moved` then). A leaving downstream's
    /// drain time counts from when the plan was replaced, not from this adoption: a worker that
    /// adopts late (its first wakeup after the reload) does not relay what arrived meanwhile
    /// beyond `drain_secs` (with 0: a reply not read before the reload is counted drained).
    /// Called with the table lock held.
    func adoptPlanLocked() {
        let current = plans.version.load(ordering: .acquiring)
        guard current != version else { return }
        version = current
        let (plan, replacedAt) = plans.planAndTime
        self.plan = plan
        selector = DownstreamSelector(plan.method, router: plan.quic)
        replicator.adopt(plan)
        let previousCounters = replyCounters
        replyCounters = plan.downstreams.map { relay.downstream($0.name) }
        batchSent = Array(repeating: 0, count: plan.downstreams.count)
        batchBytes = batchSent
        batchDropped = batchSent
        batchRefused = Array(repeating: false, count: plan.downstreams.count)
        var index: [String: Int] = [:]
        for (position, downstream) in plan.downstreams.enumerated() { index["\(downstream.name)|\(downstream.address)"] = position }
        let now = monotonicMilliseconds()
        for session in sessions.values where session.socket >= 0 {
            if let target = index["\(session.downstream.name)|\(session.downstream.address)"] {
                session.target = target
            } else {
                // Its target is an index into the previous plan: its replies count there. Replies
                // already queued are relayed within the drain time, else counted drained.
                let counter = session.target < previousCounters.count ? previousCounters[session.target] : nil
                let fd = session.socket
                retire(session, counter: counter, now: now, until: replacedAt + drainMilliseconds)
                if let socket = draining[fd] { relayDraining(socket, budget: .max) }
            }
        }
    }

    /// Takes the session's socket out of the session (the client's next datagram picks another
    /// downstream) and keeps it draining: the downstream may still answer requests it took.
    /// Beyond ``RelaySessionCount/admitDraining()``'s bound the socket does not drain (logged):
    /// sealed at once and closed at the next sweep (``closeSealedLater(_:)``), unless `bounded`
    /// is false (a handover: every session becomes a draining socket).
    func retire(_ session: RelaySession, counter: RelayCounters.DownstreamReplies?, now: Int64, bounded: Bool = true, drain: Int64? = nil,
                        until: Int64? = nil) {
        let fd = session.socket
        let deadline = until ?? now + (drain ?? drainMilliseconds)
        bySocket[fd] = nil
        // A draining socket is not a session: a restart does not keep it.
        unstore(session)
        if !bounded { sessionCount.forceDraining() }
        guard !bounded || sessionCount.admitDraining() else {
            // What it holds already is relayed within the drain time, else counted drained; it
            // stays open, sealed, until the next sweep (a slot beyond the bound that long).
            let socket = DrainingSocket(socket: fd, session: session, counter: counter, until: deadline, now: now)
            relayDraining(socket, budget: .max)
            session.socket = -1
            sessionCount.forceDraining()
            closeSealedLater(socket)
            logFailure("too many draining relay session sockets (settings.max_sessions of them): a leaving downstream's session socket was sealed at once, its later replies are refused by the kernel (Udp NoPorts), not relayed (raise settings.max_sessions or lower settings.drain_secs)",
                       DrainingLimitReached(downstream: session.downstream.address, limit: sessionCount.maxSessions))
            return
        }
        // The descriptor moves, still in the epoll set: the session makes a new one when its
        // client next sends.
        session.socket = -1
        draining[fd] = DrainingSocket(socket: fd, session: session, counter: counter, until: deadline, now: now)
    }

    // MARK: Client → downstream

    /// Why requests of one batch were not sent (send_buffer_full, unreachable, send_error).
    struct SendFailures {
        var bufferFull: UInt64 = 0
        var unreachable: UInt64 = 0
        var other: UInt64 = 0
    }

    /// Sends each datagram of the batch on its client's session socket (a send per datagram:
    /// consecutive datagrams rarely share a session; all of them in one io_uring submit when the
    /// worker has its ring), making sessions for new clients.
    func forwardLocked(_ count: Int) {
        let now = monotonicMilliseconds()
        var bytesReceived: UInt64 = 0
        var tooLarge: UInt64 = 0
        var rateLimited: UInt64 = 0
        let nanoseconds = limiter == nil ? 0 : SourceRateLimiter.now()
        var noHealthy: UInt64 = 0
        var tableFull: UInt64 = 0
        var created: UInt64 = 0
        var moved: UInt64 = 0
        var unavailable: UInt64 = 0
        var failures = SendFailures()
        var queued = 0
        // `udp-fanout capture`: what is dropped here is offered to it while one runs.
        let capturing = counters.capture.active.load(ordering: .relaxed)
        for datagram in 0..<count {
            bytesReceived += UInt64(receiver.length(datagram))
            if receiver.isTruncated(datagram) {
                tooLarge += 1
                if capturing { offer(DropReason.tooLarge.rawValue, datagram) }
                continue
            }
            let source = receiver.sourceStorage(datagram)
            // Before a session is made: a flood of spoofed sources makes none.
            if let limiter, !limiter.admits(source, length: receiver.length(datagram), now: nanoseconds) {
                rateLimited += 1
                if capturing { offer(DropReason.rateLimited.rawValue, datagram) }
                continue
            }
            replicator.replicate(receiver.payload(datagram), source: source)
            let key = ClientKey(source)
            let session: RelaySession
            if let known = sessions[key] {
                session = known
                var target: Int?
                if session.socket < 0 {
                    // Its downstream left the plan: the client gets another one now.
                    guard let picked = selector.pick(source: source, payload: receiver.payload(datagram)), plan != nil else {
                        noHealthy += 1
                        if capturing { offer("no_healthy", datagram) }
                        continue
                    }
                    target = picked
                } else if selector.router != nil, now - session.movedByIDAt >= 1000,
                          let owner = selector.owner(of: receiver.payload(datagram)), owner != session.target {
                    // quic_lb: a session follows its connection ID. The ID names another
                    // downstream than the session's (its server came back after health or a
                    // reload moved the session, or the address and port now carry another
                    // connection): the old socket drains and the session moves there, at most
                    // once a second (two connections on one client address and port to two
                    // servers must not make a socket per datagram).
                    retire(session, counter: session.target < replyCounters.count ? replyCounters[session.target] : nil, now: now)
                    session.movedByIDAt = now
                    selector.noteRouted()
                    target = owner
                }
                if let target, let plan {
                    session.downstream = plan.downstreams[target]
                    session.target = target
                    guard open(session) else {
                        unavailable += 1
                        continue
                    }
                    moved += 1
                }
            } else {
                // Admitted first: a client turned away must not use up a round-robin turn.
                guard sessionCount.admit() else {
                    tableFull += 1
                    if capturing { offer(DropReason.tableFull.rawValue, datagram) }
                    continue
                }
                guard let target = selector.pick(source: source, payload: receiver.payload(datagram)), let plan else {
                    sessionCount.release()
                    noHealthy += 1
                    if capturing { offer("no_healthy", datagram) }
                    continue
                }
                let fresh = RelaySession(client: source, downstream: plan.downstreams[target], target: target, now: now)
                guard open(fresh) else {
                    sessionCount.release()
                    unavailable += 1
                    continue
                }
                sessions[key] = fresh
                session = fresh
                created += 1
            }
            session.lastActive = now
            if let amplification { session.noteRequest(receiver.length(datagram), validatedAfter: amplification.validatedAfter) }
            // The crash ledger: a request sent by a system call now is noted handed just before
            // it; those queued for the ring, before its submit.
            if ring == nil { loop.ledger?.handing(1) }
            if sendRequest(datagram, on: session, &failures) { queued += 1 }
        }
        if queued > 0 {
            loop.ledger?.handing(queued)
            finishRequests(count, &failures)
        }
        if !replicator.isEmpty { replicator.flush(notOffered: [(.tooLarge, tooLarge), (.rateLimited, rateLimited)]) }
        var forwarded: UInt64 = 0
        var bytesForwarded: UInt64 = 0
        if let plan {
            for target in 0..<plan.downstreams.count {
                if batchSent[target] > 0 || batchDropped[target] > 0 {
                    plan.counters[target].forwarded.wrappingAdd(batchSent[target], ordering: .relaxed)
                    plan.counters[target].bytes.wrappingAdd(batchBytes[target], ordering: .relaxed)
                    plan.counters[target].dropped.wrappingAdd(batchDropped[target], ordering: .relaxed)
                    forwarded += batchSent[target]
                    bytesForwarded += batchBytes[target]
                    (batchSent[target], batchBytes[target], batchDropped[target]) = (0, 0, 0)
                }
                if batchRefused[target] {
                    batchRefused[target] = false
                    plan.passiveHealth?(plan.downstreams[target].address)
                }
            }
        }
        counters.add(counters.received, UInt64(count))
        counters.add(counters.bytesReceived, bytesReceived)
        counters.add(counters.forwarded, forwarded)
        counters.add(counters.bytesForwarded, bytesForwarded)
        counters.add(counters.noHealthy, noHealthy)
        counters.drop(.tooLarge, tooLarge)
        counters.drop(.tableFull, tableFull)
        counters.drop(.rateLimited, rateLimited)
        if selector.router != nil { counters.add(selector.takeTally()) }
        counters.drop(.sendBufferFull, failures.bufferFull)
        counters.drop(.unreachable, failures.unreachable)
        counters.drop(.sendError, failures.other + unavailable)
        if tableFull > 0 { relay.tableFull.wrappingAdd(tableFull, ordering: .relaxed) }
        sessionCount.tableFullWarning.record(tableFull, listener: listener.name, logger: logger)
        if created > 0 { relay.created.wrappingAdd(created, ordering: .relaxed) }
        if moved > 0 { relay.moved.wrappingAdd(moved, ordering: .relaxed) }
    }

    /// Request `index` of the batch, dropped for `reason`, to the running capture.
    private func offer(_ reason: String, _ index: Int) {
        counters.capture.offer(reason, payload: receiver.payload(index), payloadLength: receiver.length(index),
                               source: receiver.sourceStorage(index), destination: listener.bind)
    }

    /// Counts one request for downstream `target`: sent (`error` 0), or dropped for `error`.
    func settle(_ target: Int, bytes: Int, error: Int32, _ failures: inout SendFailures) {
        if error == 0 {
            batchSent[target] += 1
            batchBytes[target] += UInt64(bytes)
            return
        }
        batchDropped[target] += 1
        switch DownstreamOutbox.reason(error) {
        case .sendBufferFull: failures.bufferFull += 1
        case .unreachable: failures.unreachable += 1
        default: failures.other += 1
        }
        if error == ECONNREFUSED { batchRefused[target] = true }
    }

    /// Opens the session's socket and adds it to the epoll set; false (logged, at most once a
    /// second) when it cannot: the datagram is dropped as send_error.
    func open(_ session: RelaySession) -> Bool {
        let error = session.connect()
        if error == 0 {
            var event = epoll_event()
            event.events = UInt32(EPOLLIN.rawValue)
            event.data.fd = session.socket
            do {
                try Syscall.epollControl(epoll, EPOLL_CTL_ADD, session.socket, &event)
                bySocket[session.socket] = session
                store(session)
                return true
            } catch {
                session.closeSocket()
                logFailure("relay session socket could not join the worker's epoll set", error)
                return false
            }
        }
        // EMFILE/ENFILE: raise the open-files limit (LimitNOFILE) or lower settings.max_sessions;
        // EADDRNOTAVAIL/EAGAIN: the ephemeral ports (net.ipv4.ip_local_port_range) are used up.
        logFailure("relay session socket could not be made (raise LimitNOFILE / net.ipv4.ip_local_port_range, or lower settings.max_sessions; after a reload a replaced relay instance's draining sessions count too, until silent for its session_idle_secs)",
                   SystemCallError(call: "socket/connect \(session.downstream.address)", errno: error))
        return false
    }

    // MARK: Downstream → client

    /// Which downstream a session's replies count for.
    enum ReplyCounting {
        /// The plan's downstream at the session's `target`.
        case plan
        /// A downstream that left the plan (this is its counter).
        case leaving(RelayCounters.DownstreamReplies?)
    }

    /// The counter a session's replies are credited to.
    func replyCounter(_ session: RelaySession, _ counting: ReplyCounting) -> RelayCounters.DownstreamReplies? {
        switch counting {
        case .plan: session.target < replyCounters.count ? replyCounters[session.target] : nil
        case .leaving(let previous): previous
        }
    }

    /// Counts a failed receive on a session socket. - Returns: true when the socket may still
    /// hold replies (the error was an ICMP report, which reading clears).
    func receiveFailed(_ error: SystemCallError, on session: RelaySession, counting: ReplyCounting) -> Bool {
        if error.errno == ECONNREFUSED || error.errno == EHOSTUNREACH || error.errno == ENETUNREACH {
            // ICMP unreachable for a request sent on this session: the downstream did not take
            // it. The request was counted forwarded, so this is counted on the reply side (no
            // reply will come), and passive health is told. Reading the error clears it, so the
            // client's next datagram is sent (not refused in its place).
            relay.downstreamUnreachable.wrappingAdd(1, ordering: .relaxed)
            if error.errno == ECONNREFUSED, case .plan = counting, let plan, session.target < plan.downstreams.count { plan.passiveHealth?(plan.downstreams[session.target].address) }
            return true
        }
        relay.replySendError.wrappingAdd(1, ordering: .relaxed)
        logFailure("receive on a relay session socket failed (counted replies_dropped send_error)", error)
        return false
    }

    /// Adds the replies just received into `slots` to the staged batch, addressed to the
    /// session's client (the caller marks the slots used).
    func stage(_ slots: Range<Int>, from session: RelaySession, counter: RelayCounters.DownstreamReplies?) {
        let capture = counters.capture
        for slot in slots {
            if replyReceiver.isTruncated(slot) {
                stagedTooLarge += 1
                if capture.active.load(ordering: .relaxed), let client = session.clientAddress {
                    capture.offer(ReplyDropReason.tooLarge.rawValue, reply: true, payload: replyReceiver.payload(slot), payloadLength: replyReceiver.length(slot),
                                  source: session.downstream.address, destination: client)
                }
                continue
            }
            let payload = replyReceiver.payload(slot)
            if let amplification, !session.admitsReply(payload.count, factor: amplification.factor) {
                stagedCapped += 1
                if capture.active.load(ordering: .relaxed), let client = session.clientAddress {
                    capture.offer(ReplyDropReason.amplificationCapped.rawValue, reply: true, payload: payload, payloadLength: payload.count,
                                  source: session.downstream.address, destination: client)
                }
                continue
            }
            let message = stagedMessages
            replyIovecs[message] = iovec(iov_base: UnsafeMutableRawPointer(mutating: payload.baseAddress), iov_len: payload.count)
            replyHeaders[message].msg_hdr.msg_name = UnsafeMutableRawPointer(session.client)
            replyHeaders[message].msg_hdr.msg_namelen = session.clientLength
            replyHeaders[message].msg_hdr.msg_iov = replyIovecs + message
            replyHeaders[message].msg_hdr.msg_iovlen = 1
            replyHeaders[message].msg_hdr.msg_control = nil
            replyHeaders[message].msg_hdr.msg_controllen = 0
            stagedMessages += 1
        }
        stagedRuns.append((session, counter, stagedMessages))
        loop.ledger?.holdingReplies(stagedMessages)
    }

    /// Sends the staged replies to their clients (sendmmsg on the listener socket), counts them,
    /// and empties the stage. Holding each reply's session keeps its client address valid even
    /// if the session closed (idle, reload) after the reply was staged.
    func flushReplies() {
        let messages = stagedMessages
        // Credits the messages `sent` (a range of replyHeaders) to their runs' downstreams.
        var run = 0
        func credit(_ sent: Range<Int>) {
            var lower = sent.lowerBound
            while lower < sent.upperBound && run < stagedRuns.count {
                if stagedRuns[run].end <= lower {
                    run += 1
                    continue
                }
                let upper = min(sent.upperBound, stagedRuns[run].end)
                stagedRuns[run].counter?.replies.wrappingAdd(UInt64(upper - lower), ordering: .relaxed)
                lower = upper
            }
        }
        var bufferFull: UInt64 = 0
        var failed: UInt64 = 0
        var message = 0
        // The crash ledger: every staged reply is handed to the send calls below (or dropped, counted).
        if messages > 0 { loop.ledger?.holdingReplies(0) }
        while message < messages {
            let error: Int32
            do throws(SystemCallError) {
                if case .processed(let result) = try Syscall.sendmmsg(member.socket, replyHeaders + message, messages - message, Socket.dontWait), result > 0 {
                    var bytes: UInt64 = 0
                    for index in message..<(message + result) { bytes += UInt64(replyIovecs[index].iov_len) }
                    credit(message..<(message + result))
                    relay.replies.wrappingAdd(UInt64(result), ordering: .relaxed)
                    relay.replyBytes.wrappingAdd(bytes, ordering: .relaxed)
                    message += result
                    continue
                }
                error = EAGAIN
            } catch let failure {
                error = failure.errno
            }
            if error == EAGAIN || error == ENOBUFS { bufferFull += 1 } else { failed += 1 }
            message += 1
        }
        if bufferFull > 0 { relay.replySendBufferFull.wrappingAdd(bufferFull, ordering: .relaxed) }
        if failed > 0 { relay.replySendError.wrappingAdd(failed, ordering: .relaxed) }
        if stagedTooLarge > 0 { relay.replyTooLarge.wrappingAdd(stagedTooLarge, ordering: .relaxed) }
        stagedTooLarge = 0
        if stagedCapped > 0 { relay.amplificationCapped.wrappingAdd(stagedCapped, ordering: .relaxed) }
        stagedCapped = 0
        stagedRuns.removeAll(keepingCapacity: true)
        stagedMessages = 0
        replySlotsUsed = 0
        loop.ledger?.holdingReplies(0)
    }

    // MARK: Idle and stop

    /// Closes the sessions without a datagram either way for `session_idle_secs` (event `expired`).
    /// Each socket it closes is sealed first and closed at the next sweep (``closeSealedLater(_:)``).
    func sweep(now: Int64) {
        tableLock.withLock { _ in
            finishSealedLocked(now: now)
            adoptPlanLocked()
            // Keys first: removing while iterating would copy the whole table.
            let idle = sessions.compactMap { now - $0.value.lastActive >= idleMilliseconds ? $0.key : nil }
            var expired = 0
            for key in idle {
                guard let session = sessions.removeValue(forKey: key) else { continue }
                // A reply that arrived in this very instant still goes out.
                relayQueued(session, budget: .max)
                unstore(session)
                if session.socket >= 0 {
                    bySocket[session.socket] = nil
                    // Open until the next sweep: it holds a draining slot until then. What its
                    // last read finds is a reply to its client: relayed.
                    sessionCount.forceDraining()
                    closeSealedLater(DrainingSocket(socket: session.socket, session: session, counter: replyCounter(session, .plan), until: .max, now: now))
                    session.socket = -1
                }
                expired += 1
            }
            sessionCount.release(expired)
            if expired > 0 { relay.expired.wrappingAdd(UInt64(expired), ordering: .relaxed) }
            // Draining sockets past their drain time close once silent for session_idle_secs, and at
            // the latest session_idle_secs after it (a downstream that keeps sending cannot hold one).
            let silent = draining.compactMap { fd, socket in
                now >= socket.until && (now - socket.lastActive >= idleMilliseconds || now - socket.until >= idleMilliseconds) ? fd : nil
            }
            for fd in silent {
                guard let socket = draining.removeValue(forKey: fd) else { continue }
                // One last read: a reply that arrived in this very instant is counted too.
                relayDraining(socket, budget: .max)
                closeSealedLater(socket)
            }
            if !silent.isEmpty {
                logger.debug("draining session sockets sealed: closed at the next sweep", metadata: [
                    "listener": "\(listener.name)", "worker": "\(index)", "sockets": "\(silent.count)", "still_draining": "\(draining.count)",
                ])
            }
        }
    }

    /// Closes `socket`, which holds a draining slot, at a later sweep rather than now: out of
    /// the epoll set and sealed now (``SocketSeal``: the kernel delivers nothing new to it, a
    /// later reply is refused and counted in Udp NoPorts), read once more and closed, its slot
    /// released, at the first sweep at least ``sealedMinimum`` later. A close at once would free,
    /// uncounted, a reply that arrived after the last read. That wait is far longer than a
    /// kernel grace period in practice (a reply whose lookup met the socket before the seal is
    /// queued by then), not a guarantee: a CPU stalled that long would still lose one. At a
    /// stop, ``relayLastReplies(tail:sessions:)`` waits a grace period for them. Where the
    /// kernel refuses the seal, read and closed now. Called with the table lock held.
    func closeSealedLater(_ socket: DrainingSocket) {
        try? Syscall.epollControl(epoll, EPOLL_CTL_DEL, socket.socket, nil)
        do throws(SystemCallError) {
            _ = try SocketSeal.sealWithoutWaiting(socket.socket)
            sealedClosing.append((socket, monotonicMilliseconds()))
            return
        } catch {
            logFailure("could not seal a closing relay session socket before its last read: a reply the kernel delivers to it as it closes is lost, not counted", error)
        }
        relayDraining(socket, budget: .max)
        close(socket.socket)
        sessionCount.releaseDraining()
    }

    /// Reads each socket ``closeSealedLater(_:)`` sealed at least ``sealedMinimum`` before `now`
    /// (every one when `now` is nil: at a stop, after a grace period) once more (relayed to its
    /// client, or counted `drained` past its drain time), closes it and releases its draining
    /// slot. Called with the table lock held.
    func finishSealedLocked(now: Int64? = nil) {
        guard !sealedClosing.isEmpty else { return }
        var kept: [(socket: DrainingSocket, sealedAt: Int64)] = []
        for entry in sealedClosing {
            if let now, now - entry.sealedAt < Self.sealedMinimum {
                kept.append(entry)
                continue
            }
            relayDraining(entry.socket, budget: .max)
            close(entry.socket.socket)
        }
        sessionCount.releaseDraining(sealedClosing.count - kept.count)
        sealedClosing = kept
    }

    /// The listener was handed over to a successor on its bind (a rename, or a change that
    /// starts it again): new requests go to the successor's workers, which open sessions of
    /// their own, but the downstreams may still answer requests sent through this worker's
    /// sessions. Every session drains as a leaving downstream's does: its replies are relayed
    /// from the listener's address until the successor's settings.drain_secs passes (with 0:
    /// none), later ones read and counted `drained` until the socket is silent
    /// (``sweep(now:)``). Returns when the last one closed, or soon after the handover is cut short.
    func drainAfterHandOver() {
        // Requests are the successor's now (its eBPF steering selects only its own sockets); the
        // stop drain read out what the sockets held.
        for socket in [member.socket] + inherited.map(\.socket) { try? Syscall.epollControl(epoll, EPOLL_CTL_DEL, socket, nil) }
        let now = monotonicMilliseconds()
        let drain = handOver.drainMilliseconds.load(ordering: .relaxed)
        tableLock.withLock { _ in
            var handed: UInt64 = 0
            for session in sessions.values where session.socket >= 0 {
                // The session's slot first, then its socket's draining slot: the two counts
                // together (what a reload's limit check reads) never hold the socket twice.
                sessionCount.release()
                retire(session, counter: session.target < replyCounters.count ? replyCounters[session.target] : nil, now: now, bounded: false, drain: drain)
                handed += 1
            }
            relay.handedOver.wrappingAdd(handed, ordering: .relaxed)
            // The sessions without a socket (it drains already, or could not be made).
            sessionCount.release(sessions.count - Int(handed))
            sessions = [:]
            bySocket = [:]
        }
        var nextSweep = now + 1000
        while !draining.isEmpty && !handOver.cutShort.isSet {
            let ready = (try? Syscall.epollWait(epoll, events, Int32(Self.eventCapacity), 100)) ?? 0
            loop.progress.wrappingAdd(1, ordering: .relaxed)
            for slot in 0..<ready { drainReplies(events[slot].data.fd, budget: Self.batchesPerWakeup) }
            flushReplies()
            // Once a second, as in the receive loop: it closes the sockets silent long enough.
            let time = monotonicMilliseconds()
            if time >= nextSweep {
                nextSweep = time + 1000
                sweep(now: time)
            }
        }
        // Cut short: what the sockets hold already is still relayed (or counted) before they close.
        for fd in Array(draining.keys) { drainReplies(fd) }
        flushReplies()
    }

    /// The replies' end of a stop, before the listener socket is sealed (replies go out from
    /// it). `tail`: the listener socket is read no more (a request arriving now waits there,
    /// counted `closing` once the socket is sealed), but the downstreams still answer the
    /// requests the worker sent: their replies are relayed until every session socket has been
    /// silent ``replyTailQuiet`` milliseconds, at most ``replyTailLimit``. Then every draining
    /// socket, and with `sessions` every session socket, is sealed (``SocketSeal``: the kernel
    /// delivers nothing to it any more, not even as it closes; a later reply is refused, counted
    /// in Udp NoPorts) and read once more after a kernel grace period, as are the sockets the
    /// sweep sealed (``closeSealedLater(_:)``, closed here): what was queued is relayed, none
    /// freed uncounted at the close.
    func relayLastReplies(tail: Bool, sessions: Bool) {
        guard (sessions && !bySocket.isEmpty) || !draining.isEmpty || !sealedClosing.isEmpty else { return }
        for socket in [member.socket] + inherited.map(\.socket) { try? Syscall.epollControl(epoll, EPOLL_CTL_DEL, socket, nil) }
        let start = monotonicMilliseconds()
        var lastReply = start
        while tail && !(bySocket.isEmpty && draining.isEmpty) {
            let ready = (try? Syscall.epollWait(epoll, events, Int32(Self.eventCapacity), 5)) ?? 0
            let now = monotonicMilliseconds()
            if ready > 0 {
                loop.progress.wrappingAdd(1, ordering: .relaxed)
                for slot in 0..<ready { drainReplies(events[slot].data.fd, budget: Self.batchesPerWakeup) }
                flushReplies()
                lastReply = now
            }
            if now - lastReply >= Self.replyTailQuiet || now - start >= Self.replyTailLimit { break }
        }
        let tailMilliseconds = monotonicMilliseconds() - start
        let sockets = (sessions ? Array(bySocket.keys) : []) + Array(draining.keys)
        let refused = SocketSeal.seal(sockets)
        // Sealed by the sweep perhaps a moment ago: a grace period for them too, if the seal
        // above waited none.
        if refused.count == sockets.count && !sealedClosing.isEmpty { SocketSeal.waitForGracePeriod() }
        if let first = refused.first {
            logger.warning("could not seal some session sockets before their last read: a reply the kernel delivers to them as they close is lost, not counted", metadata: [
                "listener": "\(listener.name)", "worker": "\(index)", "refused": "\(refused.count)", "error": "\(first.error)",
            ])
        }
        var metadata: Logger.Metadata = ["listener": "\(listener.name)", "worker": "\(index)", "sockets": "\(sockets.count - refused.count)"]
        if tail { metadata["reply_tail_ms"] = "\(tailMilliseconds)" }
        logger.debug("session sockets sealed before their last read", metadata: metadata)
        for fd in sockets { drainReplies(fd) }
        tableLock.withLock { _ in finishSealedLocked() }
        flushReplies()
    }

    /// ``relayLastReplies(tail:sessions:)``: the session sockets' silence that ends a stop's reply tail, and
    /// the longest tail (milliseconds).
    static let replyTailQuiet: Int64 = 100
    static let replyTailLimit: Int64 = 1000

    /// Its last replies sent, the worker seals its socket (the kernel delivers nothing to it any
    /// more, not even as it closes) and reads it once more. What that read finds arrived after
    /// the stop drain (or, after a handover, in the close race): counted `closing`, not relayed,
    /// since no reply could come back through the sealed socket.
    func sealAndCountLast() {
        do {
            try member.seal()
        } catch {
            logger.warning("could not seal the socket before its last read: a request the kernel delivers to it as it closes is lost, not counted", metadata: [
                "listener": "\(listener.name)", "worker": "\(index)", "error": "\(error)",
            ])
            return
        }
        logger.debug("worker socket sealed before its last read", metadata: ["listener": "\(listener.name)", "worker": "\(index)"])
        // The queue is finite and nothing new arrives: read to the end.
        var (last, bytes, truncated): (UInt64, UInt64, UInt64) = (0, 0, 0)
        while let count = try? receiver.receive(from: member.socket, flags: Socket.dontWait | Socket.truncate), count > 0 {
            last += UInt64(count)
            for datagram in 0..<count {
                bytes += UInt64(receiver.length(datagram))
                // The pools' copies need no reply: they go out as in the loop.
                if receiver.isTruncated(datagram) { truncated += 1 } else { replicator.replicate(receiver.payload(datagram), source: receiver.sourceStorage(datagram)) }
            }
        }
        drops.read(member, into: counters)
        guard last > 0 else { return }
        counters.add(counters.received, last)
        counters.add(counters.bytesReceived, bytes)
        counters.drop(.closing, last)
        if !replicator.isEmpty { replicator.flush(notOffered: [(.tooLarge, truncated)]) }
    }

    /// Closes every session and draining socket. A process that stops to hand its data path
    /// over (a restart) leaves the sessions in the service manager's store for the next one.
    func closeEverySession() {
        let handing = descriptors?.handingOver ?? false
        tableLock.withLock { _ in
            for session in sessions.values {
                if !handing { unstore(session) }
                closeSession(session)
            }
            sessionCount.release(sessions.count)
            for fd in draining.keys { closeDraining(fd) }
            sessionCount.releaseDraining(draining.count)
            sessions = [:]
            bySocket = [:]
            draining = [:]
        }
    }

    /// Hands the session's socket to the service manager's store under a name of its own (its
    /// client in it), without waiting. One whose message the store's full queue refused waits
    /// in ``pendingStore`` to be sent again; one past the store's budget for sessions
    /// (`DescriptorStore.sessionNameBudget`) is not stored (said once per worker): a restart
    /// starts that client's session anew.
    func store(_ session: RelaySession) {
        guard descriptors?.stores == true else { return }
        if attemptStore(session, waiting: false) == .busy {
            if pendingStore.isEmpty && pendingRemoval.isEmpty { pendingSince = monotonicMilliseconds() }
            // Bounded: past it (the service manager does not read at all) the rest is not stored.
            if pendingStore.count < Self.pendingLimit { pendingStore.append(session) }
        }
    }

    /// One attempt to store `session`'s socket; anything but `.busy` is final (and said).
    func attemptStore(_ session: RelaySession, waiting: Bool) -> DescriptorStore.StoreOutcome {
        guard let descriptors, session.socket >= 0, session.stored == nil, let client = session.clientAddress else { return .stored }
        var status = stat()
        guard fstat(session.socket, &status) == 0 else { return .failed("fstat") }
        let name = DescriptorStore.relaySessionName(listener.bind, worker: index, inode: UInt64(status.st_ino), client: client)
        let outcome = descriptors.store(name, session.socket, waiting: waiting)
        switch outcome {
        case .stored:
            session.stored = name
        case .busy:
            break
        case .overBudget:
            budgetRefused = true
            if !budgetSaid {
                budgetSaid = true
                logger.warning("relay sessions past the service manager's store budget are not handed to it: after a restart their clients start new sessions (with round_robin possibly on another server). systemd gives every stored name back in one environment variable the kernel limits to 128 KiB, and the unit keeps at most FileDescriptorStoreMax=4096", metadata: [
                    "listener": "\(listener.name)", "worker": "\(index)", "stored_descriptors": "\(descriptors.storedDescriptors)", "stored_name_bytes": "\(descriptors.storedNameBytes)",
                ])
            }
        case .failed(let problem):
            logFailure("a relay session socket could not be handed to the service manager's store: after a restart its client starts a new session",
                       SystemCallError(call: "sd_notify FDSTORE=1 \(name): \(problem)", errno: EIO))
        }
        return outcome
    }

    /// Stores up to 256 of the sessions the budget turned away, while it has room again (closed
    /// sessions made some); once none is left unstored, stops looking.
    func storeWithinBudget() {
        guard budgetRefused, pendingStore.isEmpty else { return }
        var stored = 0
        for session in sessions.values where session.socket >= 0 && session.stored == nil {
            guard stored < 256 else { return }
            guard attemptStore(session, waiting: false) == .stored else { return }
            stored += 1
        }
        budgetRefused = false
    }

    /// Takes the session's socket out of the service manager's store (it closes, or stops being
    /// a session), without waiting; a refused request waits in ``pendingRemoval``.
    func unstore(_ session: RelaySession) {
        guard let name = session.stored, let descriptors else { return }
        session.stored = nil
        switch descriptors.remove(name, waiting: false) {
        case .busy:
            // Until it goes, the store's copy keeps the socket (and its port) open.
            if pendingStore.isEmpty && pendingRemoval.isEmpty { pendingSince = monotonicMilliseconds() }
            if pendingRemoval.count < Self.pendingLimit { pendingRemoval.append(name) }
        case .failed(let problem):
            logFailure("a closed relay session could not be taken out of the service manager's store: its copy stays open there until the unit stops",
                       SystemCallError(call: "sd_notify FDSTOREREMOVE=1 \(name): \(problem)", errno: EIO))
        case .stored, .overBudget:
            break
        }
    }

    /// Sessions the service manager's queue refused when they opened (a burst of new clients),
    /// and names of closed ones it did not take out, sent again at the end of a turn (at most
    /// every 20 ms) and, waiting, when the process stops; since when some wait.
    var pendingStore: [RelaySession] = []
    var pendingRemoval: [String] = []
    var pendingSince: Int64 = 0
    var lastStoreRetry: Int64 = 0
    /// The session budget's warning was said (once per worker).
    var budgetSaid = false
    /// Some session was not stored for the budget: once a second, while there is room again
    /// (sessions closed), ``storeWithinBudget()`` stores some of those that are not.
    var budgetRefused = false
    static let pendingLimit = 4096

    /// Sends what waits again, in order, until the service manager's queue refuses one (waiting:
    /// each send waits at most 2 s, and all of them stop at the first refusal).
    func storePending(waiting: Bool) {
        guard !pendingStore.isEmpty || !pendingRemoval.isEmpty else { return }
        let now = monotonicMilliseconds()
        guard waiting || now - lastStoreRetry >= 20 else { return }
        lastStoreRetry = now
        while let name = pendingRemoval.first, descriptors?.remove(name, waiting: waiting) != .busy { pendingRemoval.removeFirst() }
        while let session = pendingStore.first, pendingRemoval.isEmpty, attemptStore(session, waiting: waiting) != .busy { pendingStore.removeFirst() }
        if pendingStore.isEmpty && pendingRemoval.isEmpty { return }
        // Said at most every 10 s while some wait longer than a second (a burst of new or
        // expiring clients fills the queue for a moment; what waits is sent again).
        guard waiting || (now - pendingSince >= 1000 && now - lastPendingLine >= 10_000) else { return }
        lastPendingLine = now
        logger.warning("the service manager's queue stays full: relay session store messages wait to be sent again", metadata: [
            "listener": "\(listener.name)", "worker": "\(index)",
            "new_sessions_waiting": "\(pendingStore.count)", "closed_sessions_waiting": "\(pendingRemoval.count)",
            "meaning": "a restart or crash now starts the new ones anew; the closed ones stay open in the store until it takes them out",
        ])
    }
    var lastPendingLine: Int64 = -1_000_000

    /// Closes a session's socket, out of the epoll set first: the service manager's copy keeps
    /// the socket open, and epoll would go on reporting a descriptor this worker no longer has.
    func closeSession(_ session: RelaySession) {
        if session.socket >= 0 { try? Syscall.epollControl(epoll, EPOLL_CTL_DEL, session.socket, nil) }
        session.closeSocket()
    }

    /// Closes a draining socket, out of the epoll set first (as ``closeSession(_:)``).
    func closeDraining(_ fd: Int32) {
        try? Syscall.epollControl(epoll, EPOLL_CTL_DEL, fd, nil)
        close(fd)
    }

    /// At most one line a second: an error that repeats every datagram must not flood the log.
    func logFailure(_ message: Logger.Message, _ error: any Error) {
        failuresSinceLog += 1
        let now = monotonicMilliseconds()
        guard now - lastFailureLog >= 1000 else { return }
        logger.error(message, metadata: ["listener": "\(listener.name)", "worker": "\(index)", "error": "\(error)", "failures_since_last_line": "\(failuresSinceLog)"])
        lastFailureLog = now
        failuresSinceLog = 0
    }
}

/// A leaving downstream's session socket closed at once: the listener holds `limit` draining ones.
private struct DrainingLimitReached: Error, CustomStringConvertible {
    let downstream: SocketAddress
    let limit: Int
    var description: String { "\(limit) draining session sockets held already; sealed the one to \(downstream)" }
}
