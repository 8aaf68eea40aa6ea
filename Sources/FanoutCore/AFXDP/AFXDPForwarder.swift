// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim
import Logging
import ReusePortLB
import Synchronization
import SystemCalls

/// One RX queue's forwarder thread of an af_xdp listener (`<listener>-q<N>`): takes frames off
/// its AF_XDP socket's RX ring in batches, takes the XDP program's parse of each from its
/// metadata (in place, in UMEM), picks each datagram's
/// downstream with the listener's shared ``BatchForwarder`` and sends it out the listener's way
/// (`settings.output`), then gives the frames back to the fill ring. `xdp_tx` rewrites a frame in
/// UMEM and puts it on the TX ring when the downstream's next hop is on this interface; other
/// datagrams of that listener go out as `preserve_source` (counted by reason). The thread runs
/// the shared ``ReceiveLoop``; this type is what it does with a batch.
final class AFXDPForwarder: ReceiveLoopBody, @unchecked Sendable {  // owned by its thread once started
    let queue: UInt32
    let socket: XSKSocket
    private let loop: ReceiveLoop
    /// Frames taken off the RX ring.
    let received = Atomic<UInt64>(0)
    private let listener: Listener
    private let counters: ListenerCounters
    private let afxdp: AFXDPCounters
    private let logger: Logger
    private let forwarder: BatchForwarder
    private let batch: Int
    private let frames: UnsafeMutableBufferPointer<XSKFrame>
    private let sources: UnsafeMutablePointer<sockaddr_storage>
    /// Frames that go back to the fill ring after the batch's sends returned.
    private let done: UnsafeMutableBufferPointer<XSKFrame>
    /// xdp_tx: frames rewritten for the TX ring, and their downstream index.
    private let transmit: UnsafeMutableBufferPointer<XSKFrame>
    private let transmitTargets: UnsafeMutablePointer<Int>
    /// xdp_tx: the payload bytes of each frame in `transmit` (what every path counts as bytes).
    private let transmitPayloads: UnsafeMutablePointer<UInt32>
    /// xdp_tx: per downstream, what this batch sent on the TX ring or dropped there (counted once per batch).
    private var transmitSent: [(sent: UInt64, bytes: UInt64, dropped: UInt64)] = []
    private let resolver: NextHopResolver?
    /// xdp_tx: each downstream's next hop as last looked up (index: the plan's downstreams).
    private var hops: [Result<NextHop, NextHopProblem>] = []
    private var hopsVersion: ObjectIdentifier?
    private var hopsChecked = ContinuousClock.now

    init(queue: UInt32, socket: XSKSocket, listener: Listener, ifindex: UInt32, counters: ListenerCounters, afxdp: AFXDPCounters,
         plans: PlanHolder, stop: StopSignal, logger: Logger, makeOutbox: @escaping BatchForwarder.OutboxFactory,
         limiter: SourceRateLimiter? = nil) {
        self.queue = queue
        self.socket = socket
        self.listener = listener
        self.counters = counters
        self.afxdp = afxdp
        self.logger = logger
        loop = ReceiveLoop(stop: stop, logger: logger, metadata: ["listener": "\(listener.name)", "forwarder": "\(listener.name)-q\(queue)"],
                           ledger: counters.ledger?.claim(listener: listener.name))
        batch = max(1, listener.settings.batchSize)
        forwarder = BatchForwarder(listener: listener.name, counters: counters, plans: plans, logger: logger,
                                   output: listener.settings.output, capacity: listener.settings.batchSize,
                                   templates: counters.flowTemplates(listener), limiter: limiter, makeOutbox: makeOutbox)
        forwarder.ledger = loop.ledger
        frames = .allocate(capacity: batch)
        sources = .allocate(capacity: batch)
        done = .allocate(capacity: batch)
        transmit = .allocate(capacity: batch)
        transmitTargets = .allocate(capacity: batch)
        transmitPayloads = .allocate(capacity: batch)
        resolver = listener.settings.output == .xdpTX ? NextHopResolver(ifindex: ifindex) : nil
    }

    deinit {
        frames.deallocate()
        sources.deallocate()
        done.deallocate()
        transmit.deallocate()
        transmitTargets.deallocate()
        transmitPayloads.deallocate()
    }

    func run() {
        let cpu = pinWorkerThread(listener, Int(queue), role: "queue", logger: logger)
        forwarder.adoptPlanIfChanged()
        // A previous process's socket being read out says so once done (AFXDPListener.readOut).
        if !socket.drainOnly {
            logger.info("AF_XDP forwarder started", metadata: [
                "listener": "\(listener.name)", "forwarder": "\(listener.name)-q\(queue)", "queue": "\(queue)", "cpu": "\(cpu)",
                "zero_copy": "\(socket.zeroCopyInUse)", "output": "\(listener.settings.output.rawValue)",
            ])
        }
        loop.run(self)
        loop.ledger?.release()
    }

    /// Grows at every idle wait and every batch (the path check's heartbeat).
    var progressCount: UInt64 { loop.progressCount }

    // MARK: ReceiveLoopBody

    /// Until the ring is empty: the forwarder has no other events.
    var batchesPerTurn: Int { .max }

    func receiveBatch() -> Int {
        let count = socket.receive(into: frames, ledger: loop.ledger)
        if count > 0 { received.wrappingAdd(UInt64(count), ordering: .relaxed) }
        return count
    }

    func adoptPlanIfChanged() {
        forwarder.adoptPlanIfChanged()
        if resolver != nil { refreshHops() }
    }

    /// Waits for frames (or the fill ring's wakeup). During the stop drain the program no longer
    /// redirects here: the listener cleared this queue's socket from the XSKMAP first.
    func wait(milliseconds: Int32) -> ReceiveLoop.Readiness {
        socket.wait(milliseconds: milliseconds) ? .source : .timedOut
    }

    func idle() {}
    func endOfTurn() { forwarder.publishCounts() }
    func everySecond() {
        // preserve_source's sockets bound to clients (a copy that arrived with TTL 65 leaves with
        // 64 and gets one): those idle, or whose address became the host's, close with traffic or without.
        forwarder.sender.raw.transparent?.sweepIfDue()
    }

    /// Forwards and recycles the batch ``receiveBatch()`` took off the RX ring.
    func forward(_ count: Int) {
        var doneCount = 0
        var transmitCount = 0
        var bytesReceived: UInt64 = 0
        var parseErrors: UInt64 = 0
        var walked: UInt64 = 0
        var tooLarge: UInt64 = 0
        var rateLimited: UInt64 = 0
        var noHealthy: UInt64 = 0
        var ttlExpired: UInt64 = 0
        let limiter = forwarder.limiter
        let now = limiter == nil ? 0 : SourceRateLimiter.now()
        // xdp_tx fallbacks, by NextHopProblem and for a rewrite refused: added to the shared counters once per batch.
        var fallbacks = (noRoute: UInt64(0), otherInterface: UInt64(0), noNeighbour: UInt64(0), refused: UInt64(0))
        let maximum = listener.settings.maxPacketSize
        // Source-preserving ways out send with the TTL/hop limit less one, as a router does, so a
        // forwarding loop between two balancers ends; at 1 or 0 the datagram is dropped, counted.
        let keepsSource = listener.settings.output != .socket
        // `udp-fanout capture`: the frames dropped here are offered to it while one runs.
        let capture = counters.capture
        let capturing = capture.active.load(ordering: .relaxed)
        for index in 0..<count {
            let frame = frames[index]
            let bytes = socket.bytes(frame)
            let source = sources + index
            guard let parsed = FrameParser.parse(received: bytes, source: source, walked: &walked) else {
                parseErrors += 1
                if capturing { capture.offer(DropReason.parseError.rawValue, frame: UnsafeRawBufferPointer(bytes)) }
                done[doneCount] = frame
                doneCount += 1
                continue
            }
            bytesReceived += UInt64(parsed.payloadLength)
            guard parsed.payloadLength <= maximum, !keepsSource || parsed.hopLimit > 1 else {
                if parsed.payloadLength > maximum { tooLarge += 1 } else { ttlExpired += 1 }
                if capturing {
                    capture.offer(parsed.payloadLength > maximum ? DropReason.tooLarge.rawValue : DropReason.ttlExpired.rawValue, frame: UnsafeRawBufferPointer(bytes))
                }
                done[doneCount] = frame
                doneCount += 1
                continue
            }
            if let limiter, !limiter.admits(source, length: parsed.payloadLength, now: now) {
                rateLimited += 1
                if capturing { capture.offer(DropReason.rateLimited.rawValue, frame: UnsafeRawBufferPointer(bytes)) }
                done[doneCount] = frame
                doneCount += 1
                continue
            }
            let payload = UnsafeRawBufferPointer(rebasing: UnsafeRawBufferPointer(bytes)[parsed.payloadOffset..<(parsed.payloadOffset + parsed.payloadLength)])
            // Replication: each pool's copies point at the payload in UMEM (no copy), sent at the flush.
            forwarder.replicate(payload, source: source, hopLimit: keepsSource ? parsed.hopLimit - 1 : 0)
            guard let target = forwarder.pick(source, payload) else {
                // Templates are learned even when no downstream takes the datagram.
                forwarder.noteTemplates(nil, payload, source: source)
                noHealthy += 1
                if capturing { capture.offer("no_healthy", frame: UnsafeRawBufferPointer(bytes)) }
                done[doneCount] = frame
                doneCount += 1
                continue
            }
            // flow_templates: replays this downstream lacks wait in the relay's lanes, sent before
            // the batch's datagrams (the TX ring's too, below).
            forwarder.noteTemplates(target, payload, source: source)
            if resolver != nil, let plan = forwarder.plan, target < hops.count {
                switch hops[target] {
                case .success(let hop):
                    if FrameRewriter.rewrite(bytes, l3Offset: parsed.l3Offset, l4Offset: parsed.l4Offset, family: parsed.family,
                                             to: plan.downstreams[target].address, nextHop: hop) {
                        transmit[transmitCount] = frame
                        transmitTargets[transmitCount] = target
                        transmitPayloads[transmitCount] = UInt32(parsed.payloadLength)
                        transmitCount += 1
                        continue
                    }
                    fallbacks.refused += 1
                case .failure(.noRoute): fallbacks.noRoute += 1
                case .failure(.otherInterface): fallbacks.otherInterface += 1
                case .failure(.noNeighbour): fallbacks.noNeighbour += 1
                }
            }
            forwarder.append(target, payload, source: source, hopLimit: keepsSource ? parsed.hopLimit - 1 : 0)
            done[doneCount] = frame
            doneCount += 1
        }
        var transmitted: UInt64 = 0
        var transmittedBytes: UInt64 = 0
        if transmitCount > 0 {
            // Replays and copies leave before the frames they precede.
            forwarder.templates?.flush()
            let targets = forwarder.outboxes.count
            if transmitSent.count != targets { transmitSent = Array(repeating: (0, 0, 0), count: targets) }
            let queued = socket.transmit(UnsafeBufferPointer(rebasing: transmit[0..<transmitCount]), ledger: forwarder.ledger)
            for index in 0..<transmitCount {
                let target = transmitTargets[index]
                if index < queued {
                    transmitSent[target].sent += 1
                    transmitSent[target].bytes += UInt64(transmitPayloads[index])
                } else {
                    // The TX ring is full: the frame comes back to us, dropped and counted.
                    transmitSent[target].dropped += 1
                    // It may have carried templates the relay now believes delivered.
                    if let templates = forwarder.templates, let plan = forwarder.plan, target < plan.downstreams.count {
                        templates.forget(plan.downstreams[target].address)
                    }
                    done[doneCount] = transmit[index]
                    doneCount += 1
                }
            }
            for target in 0..<targets where transmitSent[target] != (0, 0, 0) {
                let (sent, bytes, dropped) = transmitSent[target]
                forwarder.record(target, (sent, bytes, dropped > 0 ? [.sendBufferFull: dropped] : DropTally()))
                transmitted += sent
                transmittedBytes += bytes
                transmitSent[target] = (0, 0, 0)
            }
            afxdp.addFallbacks(noRoute: fallbacks.noRoute, otherInterface: fallbacks.otherInterface,
                               noNeighbour: fallbacks.noNeighbour, refused: fallbacks.refused)
        } else if resolver != nil {
            afxdp.addFallbacks(noRoute: fallbacks.noRoute, otherInterface: fallbacks.otherInterface,
                               noNeighbour: fallbacks.noNeighbour, refused: fallbacks.refused)
        }
        if ttlExpired > 0 { counters.drop(.ttlExpired, ttlExpired) }
        // The outboxes' iovecs point into UMEM: frames are recycled only after these sends returned.
        forwarder.flush(received: count, bytesReceived: bytesReceived, tooLarge: tooLarge, rateLimited: rateLimited, noHealthy: noHealthy,
                        forwarded: transmitted, bytesForwarded: transmittedBytes, notOffered: [(.parseError, parseErrors), (.ttlExpired, ttlExpired)])
        if walked > 0 { afxdp.framesWalked.wrappingAdd(walked, ordering: .relaxed) }
        if parseErrors > 0 {
            afxdp.parseErrors.wrappingAdd(parseErrors, ordering: .relaxed)
            counters.drop(.parseError, parseErrors)
        }
        socket.recycle(UnsafeBufferPointer(rebasing: done[0..<doneCount]))
    }

    /// xdp_tx: looks each downstream's next hop up again when the plan changed, and at most once a
    /// second (a neighbour learnt meanwhile moves its datagrams from the fallback to the TX ring).
    private func refreshHops() {
        guard let resolver, let plan = forwarder.plan else { return }
        let now = ContinuousClock.now
        let identity = ObjectIdentifier(plan)
        if identity != hopsVersion {
            resolver.retain(Set(plan.downstreams.map(\.address.ip)))
        } else if now - hopsChecked >= .seconds(1) {
            resolver.refresh()
        } else {
            return
        }
        hopsVersion = identity
        hopsChecked = now
        hops = plan.downstreams.map { resolver.lookup($0.address.ip) }
    }
}
