// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB
import SystemCalls

/// A relay worker's system-call path: one send(2) per request on its session socket, and each
/// readable session socket drained with recvmmsg(2) into the free reply slots. Behind the
/// interface in RelayWorker.swift ("Session sockets"); the io_uring path
/// (RelayWorker+IOURing.swift) uses the receive side too, for sockets busy since the last wakeup.
extension RelayWorker {
    /// Sends one request on its session socket (a system call).
    func sendBySystemCall(_ payload: UnsafeRawBufferPointer, on socket: Int32, for target: Int, _ failures: inout SendFailures) {
        let error: Int32
        do {
            error = try Syscall.send(socket, payload.baseAddress, payload.count, Socket.dontWait) == .wouldBlock ? EAGAIN : 0
        } catch {
            settle(target, bytes: payload.count, error: error.errno, &failures)
            return
        }
        settle(target, bytes: payload.count, error: error, &failures)
    }

    /// Stages what session socket `fd` holds (at most `budget` batches) for its client (see ``relayQueued(_:budget:)``).
    func drainReplies(_ fd: Int32, budget: Int = .max) {
        tableLock.withLock { _ in
            if let session = bySocket[fd], session.socket == fd {
                relayQueued(session, budget: budget)
            } else if let socket = draining[fd] {
                relayDraining(socket, budget: budget)
            }
        }
    }

    /// Stages what the session's socket holds (at most `budget` batches' worth of datagrams) for
    /// its client, to be sent from the listener socket: by ``flushReplies()`` at the end of the
    /// wakeup, or at once when the stage is full. Called with the table lock held.
    func relayQueued(_ session: RelaySession, budget: Int) {
        guard session.socket >= 0 else { return }
        if receiveQueued(session.socket, for: session, counter: replyCounter(session, .plan), counting: .plan, budget: budget, relaying: true) > 0 {
            session.lastActive = monotonicMilliseconds()
        }
    }

    /// What a draining socket holds: relayed to its client as a session's replies (counted for the
    /// downstream that left) until its drain time is over, then read and counted `drained`.
    /// Called with the table lock held.
    func relayDraining(_ socket: DrainingSocket, budget: Int) {
        let now = monotonicMilliseconds()
        let relaying = now < socket.until
        if receiveQueued(socket.socket, for: socket.session, counter: socket.counter, counting: .leaving(socket.counter), budget: budget, relaying: relaying) > 0 {
            socket.lastActive = now
        }
    }

    /// Reads what socket `fd` holds (at most `budget` batches' worth of datagrams) into the free
    /// reply slots. `relaying`: staged for `session`'s client, credited to `counter`; otherwise
    /// counted `drained` and the slots stay free. Called with the table lock held.
    /// - Returns: the datagrams read.
    func receiveQueued(_ fd: Int32, for session: RelaySession, counter: RelayCounters.DownstreamReplies?, counting: ReplyCounting,
                               budget: Int, relaying: Bool) -> Int {
        // In datagrams, so that receiving into the last few free slots does not use up a batch.
        let (limit, overflow) = budget.multipliedReportingOverflow(by: replyReceiver.batchSize)
        let allowed = overflow ? Int.max : limit
        var received = 0
        var calls = 0
        while received < allowed && calls < allowed {
            calls += 1
            if replySlotsUsed == replyReceiver.batchSize { flushReplies() }
            let free = replySlotsUsed..<replyReceiver.batchSize
            let count: Int
            // The crash ledger: a receive under way until what it read is staged (or counted).
            loop.ledger?.receiving()
            defer { loop.ledger?.receiveDone() }
            do throws(SystemCallError) {
                count = try replyReceiver.receive(from: fd, flags: Socket.dontWait | Socket.truncate, slots: free)
            } catch {
                if receiveFailed(error, on: session, counting: counting) { continue }
                return received
            }
            if count == 0 { return received }
            received += count
            loop.progress.wrappingAdd(1, ordering: .relaxed)
            if relaying {
                stage(replySlotsUsed..<(replySlotsUsed + count), from: session, counter: counter)
                replySlotsUsed += count
            } else {
                relay.drained.wrappingAdd(UInt64(count), ordering: .relaxed)
            }
            // Fewer than asked for: the socket is empty.
            if count < free.count { return received }
        }
        return received
    }
}
