// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB
import SystemCalls
import Synchronization

/// A relay worker's io_uring path (settings.io_uring): a turn's requests in one submit of
/// sends, the replies of the session sockets a wakeup reported readable in one submit of
/// receives. Behind the interface in RelayWorker.swift ("Session sockets"); a failed submit
/// leaves the ring for the system-call path (RelayWorker+SystemCalls.swift).
extension RelayWorker {
    /// Makes the worker's ring (settings.io_uring), on its own thread; a refusal is logged and
    /// the worker makes one system call per session send and receive instead.
    func openRing() {
        guard listener.settings.ioUring, ring == nil else { return }
        let failure: SystemCallError
        do {
            ring = try IOURing(entries: listener.settings.batchSize)
            return
        } catch {
            failure = error
        }
        let fix = switch failure.errno {
        case EOPNOTSUPP: "a kernel of 5.6 or later has io_uring's send and receive"
        case ENOSYS: "a kernel built with CONFIG_IO_URING"
        case ENOMEM: "before Linux 5.12 the ring counts against the locked-memory limit: raise LimitMEMLOCK / ulimit -l"
        default: "allow io_uring: sysctl kernel.io_uring_disabled=0 (or 1 with the daemon's group in kernel.io_uring_group), a seccomp profile that permits io_uring_setup, io_uring_enter and io_uring_register"
        }
        logger.warning("io_uring refused: this relay worker makes one system call per session-socket send and receive, which costs CPU (\(fix); or set settings.io_uring: false)",
                       metadata: ["listener": "\(listener.name)", "worker": "\(index)", "error": "\(failure)"])
    }

    /// Tests: the errno the next submit of sends (or of receives) of any relay worker fails with
    /// (0: none), to reach ``ringFailed(_:)``.
    static let injectedSendFailure = Atomic<Int32>(0)

    static let injectedReceiveFailure = Atomic<Int32>(0)

    /// Submits what the ring holds and waits for every result (``IOURing/submit()``).
    /// - Returns: nil, or why the kernel refused the submit (the ring is unusable then).
    func submit(_ ring: IOURing, sending: Bool) -> SystemCallError? {
        let injected = sending ? Self.injectedSendFailure.exchange(0, ordering: .relaxed) : Self.injectedReceiveFailure.exchange(0, ordering: .relaxed)
        if injected != 0 { ring.failNextSubmit(injected) }
        do {
            try ring.submit()
            return nil
        } catch {
            return error
        }
    }

    /// A submit through the ring failed (the kernel refused io_uring_enter): logged, and the
    /// worker goes on without the ring. The caller finishes, by system calls, what it had queued.
    func ringFailed(_ error: SystemCallError) {
        logger.error("io_uring submit failed: this relay worker goes on with one system call per session-socket send and receive",
                     metadata: ["listener": "\(listener.name)", "worker": "\(index)", "error": "\(error)"])
        ring = nil
    }

    /// Submits the batch's queued sends and counts their results. If the submit fails, the
    /// worker leaves the ring and sends the datagrams the kernel did not take by system calls,
    /// in order (they are the last ones queued).
    func completeSends(_ ring: IOURing, _ count: Int, _ failures: inout SendFailures) {
        let failure = submit(ring, sending: true)
        var ringSends: UInt64 = 0
        while let (data, result) = ring.next() {
            let datagram = Int(data)
            guard datagram < count, ringTargets[datagram] >= 0 else { continue }
            settle(ringTargets[datagram], bytes: receiver.payload(datagram).count, error: result >= 0 ? 0 : -result, &failures)
            ringTargets[datagram] = -1
            ringSends += 1
        }
        if ringSends > 0 { relay.ringSends.wrappingAdd(ringSends, ordering: .relaxed) }
        if let failure {
            ringFailed(failure)
            for datagram in 0..<count where ringTargets[datagram] >= 0 {
                sendBySystemCall(receiver.payload(datagram), on: ringSockets[datagram], for: ringTargets[datagram], &failures)
                ringTargets[datagram] = -1
            }
        }
    }

    /// Reads the replies of the session sockets this wakeup reported readable through the ring:
    /// one receive per socket into the next free reply slot, all of them in one submit (more when
    /// the slots fill). A socket readable in the previous wakeup too is busy: it is drained in
    /// batches (recvmmsg) after the others, as without the ring; draining sockets last.
    func receiveReadyReplies() {
        tableLock.withLock { _ in
            for fd in readySockets {
                guard let session = bySocket[fd], session.socket == fd else {
                    // Draining sockets are few and short-lived: read by system calls, after the
                    // ring's receives below. Read now, one could fill the stage and flush it, and
                    // read on into the slots whose receives are queued in the ring: the ring
                    // would then write another session's reply over what was staged for this
                    // socket's client.
                    if let socket = draining[fd] { readyDraining.append(socket) }
                    continue
                }
                let busy = session.readyWakeup &+ 1 == wakeup
                session.readyWakeup = wakeup
                if !busy, replySlotsUsed == replyReceiver.batchSize, let ring {
                    completeReceives(ring)
                    flushReplies()
                }
                // Looked up after the submit above: a failed one leaves the ring (and frees it).
                guard let ring, !busy else {
                    busySessions.append(session)
                    continue
                }
                let slot = replySlotsUsed
                let buffer = replyReceiver.buffer(slot)
                // At most a batch of slots is in the ring, and it holds a batch: this cannot fail.
                guard ring.queueReceive(fd, buffer.baseAddress, buffer.count, flags: Socket.truncate, data: UInt64(slot)) else {
                    busySessions.append(session)
                    continue
                }
                ringSessions[slot] = session
                // A receive that finds nothing (or an error) leaves its slot unused until the flush.
                replySlotsUsed += 1
            }
            if let ring { completeReceives(ring) }
            for session in busySessions { relayQueued(session, budget: Self.batchesPerWakeup) }
            for socket in readyDraining { relayDraining(socket, budget: Self.batchesPerWakeup) }
        }
        readySockets.removeAll(keepingCapacity: true)
        busySessions.removeAll(keepingCapacity: true)
        readyDraining.removeAll(keepingCapacity: true)
    }

    /// Submits the queued receives and stages what they read. If the submit fails, the worker
    /// leaves the ring and drains the sockets whose receive was not taken by system calls.
    func completeReceives(_ ring: IOURing) {
        // The crash ledger: a receive under way until what it read is staged.
        loop.ledger?.receiving()
        defer { loop.ledger?.receiveDone() }
        let failure = submit(ring, sending: false)
        var ringReceives: UInt64 = 0
        defer { if ringReceives > 0 { relay.ringReceives.wrappingAdd(ringReceives, ordering: .relaxed) } }
        let now = monotonicMilliseconds()
        while let (data, result) = ring.next() {
            let slot = Int(data)
            guard slot < ringSessions.count, let session = ringSessions[slot] else { continue }
            ringSessions[slot] = nil
            ringReceives += 1
            if result >= 0 {
                replyReceiver.record(slot, length: Int(result))
                session.lastActive = now
                loop.progress.wrappingAdd(1, ordering: .relaxed)
                stage(slot..<(slot + 1), from: session, counter: replyCounter(session, .plan))
            } else if -result != EAGAIN {
                _ = receiveFailed(SystemCallError(call: "io_uring recv", errno: -result), on: session, counting: .plan)
            }
        }
        guard let failure else { return }
        ringFailed(failure)
        for slot in ringSessions.indices {
            guard let session = ringSessions[slot] else { continue }
            ringSessions[slot] = nil
            busySessions.append(session)
        }
    }
}
