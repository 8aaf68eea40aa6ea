// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFSupport
import Logging
import ReusePortLB
import Synchronization
import SystemCalls

/// Why an af_xdp listener could not start; each names the problem and the fix.
package enum AFXDPError: Error, CustomStringConvertible, Sendable {
    case capabilities(missing: [String])
    case noInterface(String)
    case queues(interface: String, configured: Int, available: Int)
    case program(SystemCallError)
    case attach(XDPError)
    case socket(queue: UInt32, XSKError)
    case memory(XSKError)
    case queueCount(XSKError)
    case companion(ReusePortError)

    package var description: String {
        switch self {
        case .capabilities(let missing):
            return "af_xdp needs \(missing.joined(separator: ", ")): grant them (systemd: AmbientCapabilities=; Kubernetes: securityContext.capabilities.add) or run as root"
        case .noInterface(let name):
            return "interface '\(name)' does not exist in this network namespace: set interface to one `ip link` lists"
        case .queues(let interface, let configured, let available):
            return "settings.queues is \(configured) but \(interface) has \(available) RX queue(s): lower settings.queues (0 serves them all) or raise the interface's (ethtool -L \(interface) combined N)"
        case .program(let error): return "the XDP program could not be loaded: \(error)"
        case .attach(let error): return "\(error)"
        case .socket(let queue, let error): return "AF_XDP socket for queue \(queue): \(error)"
        case .memory(let error), .queueCount(let error): return "\(error)"
        case .companion(let error): return "the companion UDP socket (it receives what XDP passes to the kernel: fragments, frames too large for a UMEM frame) could not bind: \(error); the bind must be an address of this host or 0.0.0.0/:: (a VIP: put it on the host, e.g. ip addr add VIP/32 dev lo)"
        }
    }
}

/// An af_xdp listener: the XDP program on `interface` hands the listener's datagrams to one
/// AF_XDP socket per RX queue and passes everything else to the kernel; one forwarder thread
/// per queue (``AFXDPForwarder``) sends them on. A companion userspace listener on the same bind
/// receives what the program passes to the kernel for this listener (fragments, frames larger
/// than a UMEM frame, a queue without a socket while sockets change), so nothing is lost.
///
/// Start: companion socket, program loaded with the listener in its map, attached (native or
/// generic), sockets bound and put in the XSKMAP, forwarders started. Stop: the sockets leave the
/// XSKMAP first (new frames go to the kernel, hence the companion), the forwarders drain their
/// rings, the program is detached (a BPF link: a crash detaches it too), and the companion
/// stops last, forwarding what it holds.
final class AFXDPListener: RunningListener {
    let config: Listener
    let counters: ListenerCounters
    private let afxdp: AFXDPCounters
    private let plans: PlanHolder
    private let stop = StopSignal()
    private let program: XDPProgram
    private let attachment: XDPAttachment
    private let sockets: [XSKSocket]
    private let forwarders: [AFXDPForwarder]
    private let threads: [OSThread]
    private let companion: SocketGroupListener
    private let passiveHealth: (@Sendable (SocketAddress) -> Void)?
    private let instance = ListenerInstance.next()
    private let released = Atomic<Bool>(false)
    private let logger: Logger
    /// The XDP program's listener id (one af_xdp listener per interface, hence per program).
    static let listenerID: UInt32 = 0
    /// Bytes the kernel keeps in front of each frame's data (XDP_PACKET_HEADROOM).
    static let headroom = 256
    /// The companion socket's receive buffer when `recv_buf_size` is 0 (af_xdp has CAP_NET_ADMIN,
    /// so SO_RCVBUFFORCE grants it whatever `net.core.rmem_max` says).
    static let companionReceiveBuffer = 8 << 20
    /// UMEM bytes the running af_xdp listeners of this process hold (RLIMIT_MEMLOCK counts them all).
    static let registeredUMEM = Atomic<Int>(0)
    private let umemBytes: Int
    private let descriptors: DescriptorStore?

    /// - Parameter descriptors: the service manager's store: the companion's sockets go there (a
    ///   restart or crash: the XDP program detaches with the process, and what the kernel then
    ///   delivers waits in them for the next process), and a previous process's are read out.
    init(_ config: Listener, counters: ListenerCounters, afxdp: AFXDPCounters, logger: Logger,
         passiveHealth: (@Sendable (SocketAddress) -> Void)? = nil, descriptors: DescriptorStore? = nil) throws(AFXDPError) {
        self.config = config
        self.counters = counters
        self.afxdp = afxdp
        self.logger = logger
        self.passiveHealth = passiveHealth
        self.descriptors = descriptors
        let settings = config.settings
        let interface = config.interface ?? ""
        let capabilities = Capabilities.current()
        var missing: [String] = []
        if !capabilities.canLoadBPF { missing.append("CAP_BPF") }
        if !capabilities.has(Capabilities.netAdmin) { missing.append("CAP_NET_ADMIN") }
        if !capabilities.canUsePointerArithmetic { missing.append("CAP_PERFMON") }
        if !capabilities.has(Capabilities.netRaw) { missing.append("CAP_NET_RAW") }
        guard missing.isEmpty else { throw .capabilities(missing: missing) }
        let ifindex = if_nametoindex(interface)
        guard ifindex != 0 else { throw .noInterface(interface) }
        let available: Int
        do { available = try RXQueues.count(interface: interface) } catch { throw .queueCount(error) }
        logger.info("detected available RX queues on interface", metadata: ["listener": "\(config.name)", "interface": "\(interface)", "num_queues": "\(available)"])
        let queueCount = settings.queues == 0 ? min(available, Settings.maximumQueues) : settings.queues
        guard queueCount <= available else { throw .queues(interface: interface, configured: settings.queues, available: available) }
        // The kernel charges every UMEM of the process's user to one limit: size it for all of ours.
        umemBytes = queueCount * settings.umemFrames * settings.umemFrameSize
        do {
            try MemoryLock.ensure(bytes: Self.registeredUMEM.load(ordering: .relaxed) + umemBytes)
        } catch {
            throw .memory(error)
        }
        plans = PlanHolder(ForwardingPlan(downstreams: config.members, balancing: config.balancing, quicLB: config.quicLB, pools: config.pools, counters: counters, passiveHealth: passiveHealth))

        // Everything made so far is undone if a later step fails.
        var undo: [() -> Void] = []
        func failed(_ error: AFXDPError) -> AFXDPError {
            for step in undo.reversed() { step() }
            return error
        }
        var companionConfig = config
        companionConfig.mode = .userspace
        companionConfig.settings.workers = 1
        // flow_templates as the listener's: the companion's workers share its templates (one
        // state per listener name) for the datagrams that reach the companion.
        // While the interface is handed over (a settings reload) every datagram of the listener
        // comes through this one socket: unless recv_buf_size says otherwise, give it room for a
        // stalled worker at a high rate rather than the system's default (about 200 KiB).
        if companionConfig.settings.recvBufSize == 0 { companionConfig.settings.recvBufSize = Self.companionReceiveBuffer }
        if companionConfig.settings.output == .xdpTX { companionConfig.settings.output = .preserveSource }
        do {
            companion = try SocketGroupListener.oneWay(companionConfig, counters: counters, logger: logger, passiveHealth: passiveHealth,
                                                       descriptors: descriptors)
        } catch {
            throw failed(.companion(error))
        }
        undo.append { [companion] in companion.shutdown() }
        do {
            program = try XDPProgram(maxFrameLength: UInt32(settings.umemFrameSize - Self.headroom))
            undo.append { [program] in program.closeDescriptors() }
            try program.putListener(config.bind, ifindex: ifindex, id: Self.listenerID)
        } catch {
            throw failed(.program(error))
        }
        // An xdp listener's link the previous process left here (the interface changed kind):
        // it goes first, or it would count as another program.
        descriptors?.closeHandedOver(DescriptorStore.xdpLinkName(interface), kind: Mode.xdp.rawValue,
                                     why: "the previous process's xdp link at \(interface), where this configuration runs af_xdp",
                                     close: XDPAttachment.detach(link:))
        do {
            attachment = try XDPAttachment.attach(program, interface: interface, mode: settings.xdpMode, logger: logger)
        } catch {
            throw failed(.attach(error))
        }
        undo.append { [attachment] in attachment.detach() }
        var xsk = XSKConfig()
        xsk.frameSize = UInt32(settings.umemFrameSize)
        xsk.frameCount = UInt32(settings.umemFrames)
        xsk.ringSize = UInt32(settings.ringSize)
        // Zero-copy needs the driver's XDP hook: in generic mode only copy mode binds.
        xsk.zeroCopy = attachment.attachedMode == .generic && settings.zeroCopy == .auto ? .off : settings.zeroCopy
        xsk.busyPoll = settings.busyPoll
        xsk.batchSize = settings.batchSize
        let makeOutbox = Outboxes.factory(output: settings.output, capacity: settings.batchSize)
        // A previous process that crashed left its sockets in the store: what their RX rings hold
        // goes out first (it came before what waits in the companion), and the queues are freed.
        if let descriptors {
            Self.readOut(descriptors, interface: interface, ifindex: ifindex, config: config, counters: counters, afxdp: afxdp, plans: plans,
                         logger: logger, makeOutbox: makeOutbox)
        }
        var made: [XSKSocket] = []
        for queue in 0..<UInt32(queueCount) {
            do {
                let socket = try XSKSocket(interface: interface, queue: queue, config: xsk)
                made.append(socket)
                undo.append { socket.close() }
            } catch {
                throw failed(.socket(queue: queue, error))
            }
        }
        sockets = made
        Self.registeredUMEM.wrappingAdd(umemBytes, ordering: .relaxed)
        let (plans, stop) = (self.plans, self.stop)
        // The companion's buckets: a source is limited once, whichever way its datagrams come.
        let limiter = companion.limiter
        forwarders = made.map { socket in
            AFXDPForwarder(queue: socket.queue, socket: socket, listener: config, ifindex: ifindex, counters: counters, afxdp: afxdp,
                           plans: plans, stop: stop, logger: logger, makeOutbox: makeOutbox, limiter: limiter)
        }
        for socket in made {
            do {
                try program.setSocket(queue: socket.queue, fd: socket.fd)
            } catch {
                for queue in made.map(\.queue) { program.clearSocket(queue: queue) }
                throw failed(.program(error))
            }
        }
        // In the store once nothing can fail any more: a crash leaves what the rings hold to the
        // next process (a clean stop drains them and takes them out).
        if let descriptors, descriptors.stores {
            for socket in made {
                let names = DescriptorStore.xskNames(interface, queue: socket.queue)
                _ = descriptors.replace(names.socket, with: [socket.fd])
                _ = descriptors.replace(names.umem, with: [socket.umemFD])
            }
        }
        threads = forwarders.map { forwarder in
            OSThread(name: "\(config.name)-q\(forwarder.queue)") { forwarder.run() }
        }
        let (program, sockets, forwarders) = (self.program, self.sockets, self.forwarders)
        afxdp.setLive(instance) {
            var totals = AFXDPCounters.Totals()
            for forwarder in forwarders { totals.received[forwarder.queue] = forwarder.received.load(ordering: .relaxed) }
            for socket in sockets {
                totals.rxRingEmpty &+= socket.rxRingEmpty
                totals.fillRingFull &+= socket.fillRingFull
                var kinds = socket.statistics().byKind
                kinds["tx_kick_failures"] = socket.transmitKickFailures
                totals.queues[socket.queue] = kinds
            }
            let stats = program.stats(listener: Self.listenerID)
            for (verdict, value) in stats.verdicts { totals.verdicts[verdict.label] = value }
            // No listener known: only these verdicts can be given (the rest need a listener).
            for (verdict, value) in program.stats(listener: XDPProgram.unmatched).verdicts where [.fragment, .malformed, .notOurs].contains(verdict) {
                totals.unmatched[verdict.label] = value
            }
            return totals
        }
        logger.info("AF_XDP path initialized", metadata: [
            "listener": "\(config.name)", "interface": "\(interface)", "listeners": "1", "forwarders": "\(forwarders.count)",
            "queues_per_listener": "\(queueCount)", "xdp_mode": "\(attachment.attachedMode.rawValue)",
            "zero_copy": "\(made.allSatisfy(\.zeroCopyInUse))", "output": "\(settings.output.rawValue)",
            "downstreams": "\(config.downstreams.count)", "balancing": "\(config.balancing.rawValue)",
        ])
    }

    var isReceiving: Bool { companion.isReceiving }

    func activate() throws(DaemonError) { try companion.activate() }

    var takesOverExactly: Bool { companion.takesOverExactly }

    func update(downstreams: [Downstream], balancing: Balancing, quicLB: [QUICLBConfiguration], pools: [Pool], keeping: Set<String>) -> Bool {
        plans.replace(with: ForwardingPlan(downstreams: downstreams, balancing: balancing, quicLB: quicLB, pools: pools, counters: counters, passiveHealth: passiveHealth))
        companion.replacePlan(downstreams: downstreams, balancing: balancing, quicLB: quicLB, pools: pools)
        return true
    }

    func heartbeats() -> [PathHeartbeat] {
        guard !released.load(ordering: .relaxed) else { return companion.heartbeats() }
        let interface = config.interface ?? ""
        var beats = forwarders.map {
            PathHeartbeat(listener: config.name, instance: instance, beat: .worker(index: Int($0.queue), count: $0.progressCount))
        }
        beats.append(PathHeartbeat(listener: config.name, instance: instance, beat: .kernel(interface: interface, problem: attachment.isAttached ? nil : "the XDP program is no longer attached to \(interface)")))
        return beats + companion.heartbeats()
    }

    /// Gives the interface up (sockets out of the XSKMAP, rings drained, program detached) while
    /// the companion socket keeps receiving everything the kernel now delivers: a successor on the
    /// same interface can then attach and bind the queues without a datagram lost in between.
    func releaseInterface() {
        guard !released.exchange(true, ordering: .relaxed) else { return }
        for socket in sockets { program.clearSocket(queue: socket.queue) }
        stop.set()
        for thread in threads { thread.join() }
        afxdp.retire(instance)
        attachment.detach()
        // Drained: nothing for a successor to read out.
        if let descriptors, descriptors.stores {
            for socket in sockets {
                let names = DescriptorStore.xskNames(config.interface ?? "", queue: socket.queue)
                descriptors.remove(names.socket)
                descriptors.remove(names.umem)
            }
        }
        for socket in sockets { socket.close() }
        Self.registeredUMEM.wrappingSubtract(umemBytes, ordering: .relaxed)
        program.closeDescriptors()
        logger.info("AF_XDP path released", metadata: ["listener": "\(config.name)", "interface": "\(config.interface ?? "")"])
    }

    func shutdown() {
        releaseInterface()
        companion.shutdown()
    }

    /// As ``shutdown()``, the companion socket's workers sealing theirs first (another instance
    /// receives on the bind).
    func retire() {
        releaseInterface()
        companion.shutdown(sealing: true)
    }

    /// Reads out the AF_XDP sockets a previous process left in the store at `interface` (it
    /// ended without a stop): each one's RX ring is forwarded by a forwarder of its own under
    /// this listener's plan, what its TX ring holds is sent, then it is closed and taken out of
    /// the store, so the queue can be bound anew. Logged and counted
    /// (`udp_fanout_adoptions_total{kind="af_xdp"}`); one that cannot be mapped is closed,
    /// counted rejected.
    private static func readOut(_ descriptors: DescriptorStore, interface: String, ifindex: UInt32, config: Listener, counters: ListenerCounters,
                                afxdp: AFXDPCounters, plans: PlanHolder, logger: Logger, makeOutbox: @escaping BatchForwarder.OutboxFactory) {
        let prefix = String(DescriptorStore.xskNames(interface, queue: 0).socket.dropLast(1))
        // Only this interface's queues: another interface's name may begin with this one's and a dot.
        let named = descriptors.takeAll(prefix: prefix) { rest in !rest.isEmpty && rest.utf8.allSatisfy { (0x30...0x39).contains($0) } }
        for (name, fds) in named.sorted(by: { $0.key < $1.key }) {
            guard let queue = UInt32(name.dropFirst(prefix.count)), let socketFD = fds.first else {
                for fd in fds { close(fd) }
                descriptors.remove(name)
                let note = "\(name): a queue number out of range: closed"
                descriptors.count(Mode.afXDP.rawValue, .rejected, note: note)
                logger.warning("\(note)")
                continue
            }
            for fd in fds.dropFirst() { close(fd) }
            let names = DescriptorStore.xskNames(interface, queue: queue)
            let umemFDs = descriptors.take(names.umem)
            defer {
                descriptors.remove(names.socket)
                descriptors.remove(names.umem)
            }
            guard let umemFD = umemFDs.first else {
                close(socketFD)
                let note = "\(name): an AF_XDP socket handed over without its UMEM: closed, what its RX ring held is lost"
                descriptors.count(Mode.afXDP.rawValue, .rejected, note: note)
                logger.warning("\(note)")
                continue
            }
            for fd in umemFDs.dropFirst() { close(fd) }
            let socket: XSKSocket
            do {
                socket = try XSKSocket(adopting: socketFD, umem: umemFD, interface: interface, queue: queue)
            } catch {
                close(socketFD)
                close(umemFD)
                let note = "\(name): the previous process's AF_XDP socket could not be read out (\(error)): closed, what its RX ring held is lost"
                descriptors.count(Mode.afXDP.rawValue, .rejected, note: note)
                logger.warning("\(note)")
                continue
            }
            let waiting = socket.rxRingLevel
            let queued = socket.txRingLevel
            let stopped = StopSignal()
            stopped.set()
            let forwarder = AFXDPForwarder(queue: queue, socket: socket, listener: config, ifindex: ifindex, counters: counters, afxdp: afxdp,
                                           plans: plans, stop: stopped, logger: logger, makeOutbox: makeOutbox)
            OSThread(name: "\(config.name)-r\(queue)") { forwarder.run() }.join()
            // What the read-out put on the TX ring (xdp_tx) and what the previous process had left there.
            let unsent = socket.finishTransmitting(milliseconds: 100)
            let left = socket.rxRingLevel
            // The kernel's events on it since it opened: frames it dropped while the ring was full
            // (a stalled or stopped process) are counted here, not lost silently.
            let events = socket.statistics()
            afxdp.addReadOut(queue: queue, events.byKind)
            socket.close()
            var note = "\(name): the previous process's AF_XDP socket read out: \(waiting - left) frame(s) from its RX ring forwarded, \(queued) found on its TX ring"
            if unsent > 0 {
                // Lost with the socket: counted as what the crash took.
                counters.drop(.crash, UInt64(unsent))
                note += ", \(unsent) frame(s) the kernel did not take from the TX ring in 100 ms, lost (counted crash)"
            }
            if events.rxRingFull + events.rxDropped > 0 {
                // A stalled or stopped process leaves its fill ring empty first: those drops are rx_dropped.
                note += "; the kernel dropped \(events.rxRingFull + events.rxDropped) frame(s) on it since it opened (rx_dropped \(events.rxDropped): no fill ring entry, as when its process stalls or stops; rx_ring_full \(events.rxRingFull)), counted in udp_fanout_afxdp_socket_events_total"
            }
            descriptors.count(Mode.afXDP.rawValue, .adopted, note: note)
            let fields: Logger.Metadata = [
                "listener": "\(config.name)", "interface": "\(interface)", "queue": "\(queue)", "frames": "\(waiting - left)", "tx_found": "\(queued)",
                "tx_unsent": "\(unsent)", "rx_ring_full": "\(events.rxRingFull)", "rx_dropped": "\(events.rxDropped)",
            ]
            if unsent > 0 || events.rxRingFull + events.rxDropped > 0 {
                logger.warning("the previous process's AF_XDP socket read out: what its RX ring held is forwarded, then the queue is bound anew; the kernel dropped frames on it (rx_ring_full, rx_dropped: since it opened) or did not send all its TX ring held (tx_unsent)", metadata: fields)
            } else {
                logger.notice("the previous process's AF_XDP socket read out: what its RX ring held is forwarded, then the queue is bound anew", metadata: fields)
            }
        }
    }
}
