// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import SystemCalls
import CSystemShim
import Logging
import ReusePortLB
import Synchronization

/// One one-way worker thread of a socket-group listener (userspace, and af_xdp's companion
/// socket): its own socket in the listener's ReusePortLB group (steered per flow by default:
/// `settings.worker_steering`), recvmmsg in, one sendmmsg batch per downstream out, in the shared
/// ``ReceiveLoop``. Nothing is allocated per datagram.
final class SocketWorker: ListenerWorker, ReceiveLoopBody, @unchecked Sendable {
    let index: Int
    let member: ReusePortMember
    let receivingNow = Atomic<Bool>(false)
    /// Reads out a socket the previous process handed over (its log line says so).
    private let handedOver: Bool
    /// When the worker seals its socket (``SealOrder``). nil for a handed-over socket, which the
    /// listener sealed when its group took the bind over.
    private let sealing: SealOrder?
    private let loop: ReceiveLoop
    private let listener: Listener
    private let counters: ListenerCounters
    private let logger: Logger
    private let receiver: BatchReceiver
    // Owned by the worker thread once it runs:
    private let forwarder: BatchForwarder
    @exclusivity(unchecked) private var drops: ReceiveQueueDropReading
    private var descriptor: pollfd
    /// Seconds since the last heartbeat line (one every 5 s, at debug level).
    private var secondsSinceHeartbeat = 0

    /// - Parameters:
    ///   - makeOutbox: the way out to each downstream (``Listener/settings``' output).
    ///   - sealing: ``WorkerShared/sealing`` (nil with `handedOver`).
    init(index: Int, member: ReusePortMember, sealing: SealOrder?, listener: Listener, counters: ListenerCounters,
         plans: PlanHolder, stop: StopSignal, logger: Logger, makeOutbox: @escaping BatchForwarder.OutboxFactory,
         drainLimit: Duration = .seconds(1), handedOver: Bool = false, templates: FlowTemplateState? = nil, limiter: SourceRateLimiter? = nil) {
        self.handedOver = handedOver
        self.sealing = sealing
        self.index = index
        self.member = member
        drops = ReceiveQueueDropReading(member)
        self.listener = listener
        self.counters = counters
        self.logger = logger
        loop = ReceiveLoop(stop: stop, logger: logger, metadata: ["listener": "\(listener.name)", "worker": "\(index)"], drainLimit: drainLimit,
                           ledger: counters.ledger?.claim(listener: listener.name),
                           busyWait: (.microseconds(listener.settings.busyWaitMicroseconds), counters.busyWait))
        descriptor = pollfd(fd: member.socket, events: Int16(POLLIN), revents: 0)
        forwarder = BatchForwarder(listener: listener.name, counters: counters, plans: plans, logger: logger,
                                   output: listener.settings.output, capacity: listener.settings.batchSize, templates: templates,
                                   limiter: limiter, makeOutbox: makeOutbox)
        forwarder.ledger = loop.ledger
        // One byte more than the largest datagram kept: MSG_TRUNC marks anything larger.
        receiver = BatchReceiver(batchSize: listener.settings.batchSize, maximumDatagramSize: listener.settings.maxPacketSize)
    }

    var isReceiving: Bool { receivingNow.load(ordering: .relaxed) }
    var progressCount: UInt64 { loop.progressCount }

    func run() {
        let cpu = pinWorkerThread(listener, index, logger: logger)
        forwarder.adoptPlanIfChanged()
        receivingNow.store(true, ordering: .relaxed)
        if handedOver {
            logger.info("reading out a socket the previous process handed over", metadata: ["listener": "\(listener.name)", "socket": "\(index)", "cpu": "\(cpu)"])
        } else {
            logger.info("entering receive loop", metadata: ["listener": "\(listener.name)", "worker": "\(index)", "steering": "\(member.steering)", "cpu": "\(cpu)",
                                                            "busy_wait_us": "\(listener.settings.busyWaitMicroseconds)"])
        }
        loop.run(self)
        drops.read(member, into: counters)
        receivingNow.store(false, ordering: .relaxed)
        loop.ledger?.release()
        member.leave()
    }

    // MARK: ReceiveLoopBody

    var batchesPerTurn: Int { .max }

    func receiveBatch() throws(SystemCallError) -> Int {
        // MSG_TRUNC: a datagram above max_packet_size reports its real size (bytes_received).
        try receiver.receiveNoting(loop.ledger, from: member.socket, flags: Socket.dontWait | Socket.truncate)
    }

    func adoptPlanIfChanged() { forwarder.adoptPlanIfChanged() }

    func wait(milliseconds: Int32) -> ReceiveLoop.Readiness {
        // A failed poll is no idle turn: the path check must not see the worker alive through it.
        guard let ready = try? Syscall.poll(&descriptor, 1, milliseconds) else { return .failed }
        return ready > 0 ? .source : .timedOut
    }

    func idle() { drops.read(member, into: counters) }

    func endOfTurn() {
        forwarder.publishCounts()
        drops.endOfTurn(member, into: counters)
    }

    func everySecond() {
        // preserve_source's sockets bound to clients: those idle close even while no traffic comes.
        forwarder.sender.raw.transparent?.sweepIfDue()
        secondsSinceHeartbeat += 1
        guard secondsSinceHeartbeat >= 5 else { return }
        secondsSinceHeartbeat = 0
        let snapshot = counters.snapshot()
        logger.debug("userspace worker heartbeat", metadata: [
            "listener": "\(listener.name)", "worker": "\(index)", "downstreams": "\(forwarder.outboxes.count)",
            "received": "\(snapshot.received)", "forwarded": "\(snapshot.forwarded)", "dropped": "\(snapshot.droppedTotal)",
        ])
    }

    /// Seals the socket before the stop drain when another instance receives on the bind from
    /// now on: closing an unsealed socket of a reuseport group can lose a datagram the kernel
    /// delivers to it in the close itself (``ReusePortMember/seal()``).
    func stopping() {
        guard sealing?.first.isSet == true else { return }
        seal(when: "before its stop drain (another instance receives on the bind)")
    }

    var sourceSealed: Bool { member.isSealed }

    /// A stop for good: the drain over, the socket is sealed and read once more.
    func sealAfterDrain() -> Bool {
        guard sealing?.last.isSet == true, !member.isSealed else { return false }
        return seal(when: "after its stop drain (the listener stops)")
    }

    @discardableResult
    private func seal(when: String) -> Bool {
        do {
            try member.seal()
            logger.debug("worker socket sealed before its last read", metadata: ["listener": "\(listener.name)", "worker": "\(index)", "when": "\(when)"])
            return true
        } catch {
            logger.warning("could not seal the socket before its last read: a datagram the kernel delivers to it as it closes is lost, not counted", metadata: [
                "listener": "\(listener.name)", "worker": "\(index)", "error": "\(error)",
            ])
            return false
        }
    }

    func forward(_ count: Int) {
        var bytesReceived: UInt64 = 0
        var tooLarge: UInt64 = 0
        var rateLimited: UInt64 = 0
        var noHealthy: UInt64 = 0
        let limiter = forwarder.limiter
        let now = limiter == nil ? 0 : SourceRateLimiter.now()
        // `udp-fanout capture`: what is dropped here is offered to it while one runs.
        let capture = counters.capture
        let capturing = capture.active.load(ordering: .relaxed)
        for datagram in 0..<count {
            let length = receiver.length(datagram)
            bytesReceived += UInt64(length)
            if receiver.isTruncated(datagram) {
                tooLarge += 1
                if capturing { offer(capture, DropReason.tooLarge.rawValue, datagram) }
                continue
            }
            let source = receiver.sourceStorage(datagram)
            if let limiter, !limiter.admits(source, length: length, now: now) {
                rateLimited += 1
                if capturing { offer(capture, DropReason.rateLimited.rawValue, datagram) }
                continue
            }
            let payload = receiver.payload(datagram)
            forwarder.replicate(payload, source: source)
            guard let target = forwarder.pick(source, payload) else {
                // Templates are learned even when no downstream takes the datagram.
                forwarder.noteTemplates(nil, payload, source: source)
                noHealthy += 1
                if capturing { offer(capture, "no_healthy", datagram) }
                continue
            }
            forwarder.noteTemplates(target, payload, source: source)
            forwarder.append(target, payload, source: source)
        }
        forwarder.flush(received: count, bytesReceived: bytesReceived, tooLarge: tooLarge, rateLimited: rateLimited, noHealthy: noHealthy)
        // Under saturation a turn never ends (the socket is never empty): the drop counter is
        // read here too, at most every 10 ms (a clock read per batch otherwise).
        drops.endOfTurn(member, into: counters)
    }

    /// Datagram `index` of the batch, dropped for `reason`, to the running capture.
    private func offer(_ capture: DropCapture, _ reason: String, _ index: Int) {
        capture.offer(reason, payload: receiver.payload(index), payloadLength: receiver.length(index),
                      source: receiver.sourceStorage(index), destination: listener.bind)
    }
}

/// Pins the calling worker thread (a userspace or relay worker, or an AF_XDP queue's forwarder:
/// `role` names its index in the log) if settings.pin_cpus: the CPU for the thread's log line
/// ("any" when not pinned). A failure is logged, naming the fix, and the thread runs unpinned.
func pinWorkerThread(_ listener: Listener, _ index: Int, role: String = "worker", logger: Logger) -> String {
    guard listener.settings.pinCPUs else { return "any" }
    let (cpu, error) = pinCurrentThread(toAllowedCPU: index)
    guard let error else { return "\(cpu)" }
    logger.warning("could not pin the thread to its CPU; it runs unpinned (set settings.pin_cpus: false to stop trying)", metadata: [
        "listener": "\(listener.name)", "\(role)": "\(index)", "cpu": "\(cpu)", "errno": "\(error)", "error": "\(String(cString: strerror(error)))",
    ])
    return "any"
}

/// A worker's reading of its socket's drop counter (sk_drops, receive_queue_drops): SO_MEMINFO at
/// the end of a turn at most every ``interval``, and whenever the worker idles or stops. The
/// socket's SO_RXQ_OVFL is turned off: a control message with every datagram cost the kernel
/// about a tenth of a small datagram's forwarding (measured: __sock_recv_cmsgs and put_cmsg), where
/// a reading is one system call per turn at the most.
struct ReceiveQueueDropReading {
    private var reported: UInt32 = 0
    private var lastRead: Int64 = 0
    /// Milliseconds between readings at the end of busy turns.
    static let interval: Int64 = 10

    /// Turns the member's SO_RXQ_OVFL off (best effort: on failure the messages only cost time).
    init(_ member: ReusePortMember) {
        _ = try? Syscall.setsockopt(member.socket, SOL_SOCKET, SO_RXQ_OVFL, Int32(0))
    }

    /// Reads the counter now (idle, stopping) and adds what is new to the listener's.
    mutating func read(_ member: ReusePortMember, into counters: ListenerCounters) {
        // Noted before the attempt: a reading that fails is not retried on every batch.
        lastRead = coarseMonotonicMilliseconds()
        guard let drops = try? member.socketStatistics().drops else { return }
        let new = drops &- reported
        guard new != 0, new < UInt32.max / 2 else { return }
        counters.add(counters.receiveQueueDrops, UInt64(new))
        reported = drops
    }

    /// At the end of a turn: reads if ``interval`` has passed since the last reading.
    mutating func endOfTurn(_ member: ReusePortMember, into counters: ListenerCounters) {
        if coarseMonotonicMilliseconds() - lastRead >= Self.interval { read(member, into: counters) }
    }
}

/// CLOCK_MONOTONIC_COARSE (the vDSO's, a few nanoseconds) in milliseconds.
func coarseMonotonicMilliseconds() -> Int64 {
    var now = timespec()
    clock_gettime(CLOCK_MONOTONIC_COARSE, &now)
    return Int64(now.tv_sec) * 1000 + Int64(now.tv_nsec) / 1_000_000
}
