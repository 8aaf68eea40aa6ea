// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import Logging
import Synchronization
import SystemCalls

/// What one kind does inside the shared ``ReceiveLoop``: where its batches come from and what it
/// does with each. A userspace worker's source is its group member's socket, a relay worker's
/// the same socket plus its session sockets (its other events), an af_xdp queue's forwarder its
/// AF_XDP socket's RX ring.
protocol ReceiveLoopBody: AnyObject {
    /// Batches taken in a row before the loop looks at the body's other events again (relay: its
    /// session sockets' replies; a flood of requests must not starve them). `.max`: until the
    /// source is empty or the loop is told to stop.
    var batchesPerTurn: Int { get }
    /// Receives one batch without blocking: the datagrams received (0: the source is empty).
    /// - Throws: the failed receive; the loop logs it (at most a line a second) and backs off.
    func receiveBatch() throws(SystemCallError) -> Int
    /// Takes the current plan if a reload, health or discovery replaced it: before every batch.
    func adoptPlanIfChanged()
    /// Forwards the `count` datagrams the last ``receiveBatch()`` took.
    func forward(_ count: Int)
    /// Waits up to `milliseconds` for the source to become readable, and handles the body's
    /// other events that arrive meanwhile.
    func wait(milliseconds: Int32) -> ReceiveLoop.Readiness
    /// After a wait that timed out (the loop is idle): the socket's own drop counter is read here,
    /// so drops at the end of a burst are counted without waiting for more traffic.
    func idle()
    /// After each turn's batches (and a failed receive): what the turn gathered goes out (relay:
    /// the replies, in one call) and the receive counters are settled.
    func endOfTurn()
    /// Once a second, whatever the traffic: a heartbeat line, the relay's idle sweep.
    func everySecond()
    /// Once, when the loop sees the stop signal, before the stop drain: a one-way worker whose
    /// bind another instance receives on now seals its socket here (``ReusePortMember/seal()``).
    func stopping()
    /// Once the stop drain ended: true if the body sealed its source now (a stop for good), so
    /// the loop reads it once more.
    func sealAfterDrain() -> Bool
    /// The source is sealed: nothing new reaches it, so what it holds is read to the end.
    var sourceSealed: Bool { get }
}

extension ReceiveLoopBody {
    func stopping() {}
    func sealAfterDrain() -> Bool { false }
    var sourceSealed: Bool { false }
}

/// The receive loop of every forwarding thread (userspace and relay workers, af_xdp queue
/// forwarders): wait, drain up to the body's budget, adopt a new plan before each batch, count
/// progress for the path check (/healthz and systemd's watchdog), and on stop forward what the
/// source still holds. The kind supplies only a ``ReceiveLoopBody``: what it does with a batch.
final class ReceiveLoop: Sendable {
    /// What a wait saw.
    enum Readiness {
        /// Nothing came before the timeout.
        case timedOut
        /// The source holds datagrams.
        case source
        /// Only the body's other events came (handled by the body's wait): neither idle (no
        /// progress) nor a reason to receive.
        case other
        /// The wait itself failed: as `.other`, and no reason to poll (settings.busy_wait_us)
        /// unless the turn before spent its budget.
        case failed
    }

    /// Grows at every idle wait timeout (100 ms) and every batch received, not at a turn whose
    /// receive failed: the path check sees the thread alive only while it moves. Under sustained
    /// load the loop never idles: the batches are the progress.
    let progress = Atomic<UInt64>(0)
    private let stop: StopSignal
    /// How long the stop drain may last (1 s; a socket handed over by a previous process, which
    /// gets nothing new, longer).
    private let drainLimit: Duration
    private let logger: Logger
    private let metadata: Logger.Metadata
    /// Receive failures since the last "receive failed" line, and when that line was logged.
    private let failures = Mutex<(count: Int, lastLine: ContinuousClock.Instant?)>((0, nil))
    /// Where the thread notes the batch it holds from its receive (the body notes it there) until
    /// its sends (``CrashLedger``): what a crash takes is counted by the next process. Emptied
    /// here after each batch; the thread releases it when it ends.
    let ledger: CrashLedger.Slot?
    /// settings.busy_wait_us: how long the thread polls its source without sleeping after a turn
    /// that had something to do (zero: it sleeps at once), and where it counts what that found.
    private let busyWait: Duration
    private let busyWaitCounters: BusyWaitCounters?

    /// - Parameters:
    ///   - stop: ends the loop (after the stop drain).
    ///   - metadata: the thread's log identity (listener, worker), on the loop's own log lines.
    ///   - ledger: the thread's slot in the crash ledger; nil: none.
    ///   - busyWait: settings.busy_wait_us and the listener's counters of it; nil: none.
    init(stop: StopSignal, logger: Logger, metadata: Logger.Metadata, drainLimit: Duration = .seconds(1), ledger: CrashLedger.Slot? = nil,
         busyWait: (window: Duration, counters: BusyWaitCounters)? = nil) {
        self.ledger = ledger
        if let busyWait, busyWait.window > .zero {
            self.busyWait = busyWait.window
            busyWaitCounters = busyWait.counters
            busyWait.counters.shown.store(true, ordering: .relaxed)
        } else {
            self.busyWait = .zero
            busyWaitCounters = nil
        }
        self.stop = stop
        self.drainLimit = drainLimit
        self.logger = logger
        self.metadata = metadata
    }

    var progressCount: UInt64 { progress.load(ordering: .relaxed) }

    /// Runs `body` until the stop signal, then drains: forwards what the source holds until it
    /// stays quiet for 20 ms (a datagram steered here before the stop is still read; one steered
    /// before a successor took the bind over is queued once the successor's activation, which
    /// waits a kernel grace period, returned; the body's ``ReceiveLoopBody/stopping()`` may seal
    /// the source first), at most 1 s. Generic, so each kind's loop is
    /// specialised: no existential on the per-batch path.
    func run<Body: ReceiveLoopBody>(_ body: Body) {
        let clock = ContinuousClock()
        var nextSecond = clock.now + .seconds(1)
        // The previous turn spent its budget: the source still holds datagrams, so the body's
        // other events are looked at without waiting.
        var pending = false
        // The last turn had traffic (its wait saw something, or the turn before spent its
        // budget): with settings.busy_wait_us the next wait polls first.
        var active = false
        var spins = BusyWaitTally()
        defer { spins.flush(into: busyWaitCounters) }
        while !stop.isSet {
            let readiness: Readiness
            if pending {
                readiness = body.wait(milliseconds: 0)
            } else if active, busyWaitCounters != nil {
                readiness = spin(body, clock: clock, &spins)
            } else {
                readiness = body.wait(milliseconds: 100)
            }
            active = pending || readiness == .source || readiness == .other
            if readiness == .timedOut && !pending {
                progress.wrappingAdd(1, ordering: .relaxed)
                body.idle()
            }
            var drained = Drained.empty
            if readiness == .source || pending {
                drained = drain(body, budget: body.batchesPerTurn, deadline: nil)
            }
            body.endOfTurn()
            // A receive that fails while the source says readable would spin a core: wait a little.
            if drained == .failed { usleep(10_000) }
            pending = drained == .budgetSpent
            let now = clock.now
            if now >= nextSecond {
                nextSecond = now + .seconds(1)
                body.everySecond()
                spins.flush(into: busyWaitCounters)
            }
        }
        body.stopping()
        let deadline = clock.now + drainLimit
        repeat {
            _ = drain(body, budget: .max, deadline: deadline)
            body.endOfTurn()
        } while clock.now < deadline && body.wait(milliseconds: 20) != .timedOut
        // Sealed (before the drain, or now): nothing new arrives, so what the queue holds (an
        // overloaded worker's, past the drain's limit) is read to the end rather than freed at
        // the close; the queue is finite, the bound only a guard.
        if body.sealAfterDrain() || body.sourceSealed {
            _ = drain(body, budget: .max, deadline: clock.now + .seconds(10))
            body.endOfTurn()
        }
    }

    private enum Drained { case empty, budgetSpent, failed }

    /// settings.busy_wait_us: polls the source (and the body's other events) without sleeping,
    /// yielding the CPU between polls to any other runnable thread, until something comes or the
    /// window passes, then sleeps in the kernel as without it. What
    /// the window catches is served without the wake-up of a sleeping thread (tens of µs in a
    /// virtual machine); a window that passes empty cost its length in CPU.
    /// The time it counts is the thread's CPU time (what it yielded to other threads is not;
    /// a relay's poll that finds replies includes reading them, which its wait does).
    private func spin<Body: ReceiveLoopBody>(_ body: Body, clock: ContinuousClock, _ tally: inout BusyWaitTally) -> Readiness {
        let deadline = clock.now + busyWait
        let cpuStart = threadCPUNanoseconds()
        repeat {
            let readiness = body.wait(milliseconds: 0)
            if readiness != .timedOut {
                tally.nanoseconds &+= threadCPUNanoseconds() &- cpuStart
                // A failed wait is no traffic: the loop goes on as after any failed wait.
                if readiness != .failed { tally.found += 1 }
                return readiness
            }
            // Another thread runnable on this CPU (a server, a client, the kernel's softirq
            // thread) runs first: polling must not take the CPU the traffic it waits for needs.
            sched_yield()
        } while clock.now < deadline && !stop.isSet
        tally.nanoseconds &+= threadCPUNanoseconds() &- cpuStart
        // Stopping: the loop ends now, not after a sleep.
        if stop.isSet { return .timedOut }
        tally.slept += 1
        // An empty window is a turn of an idle thread: the path check sees it alive (a window
        // of up to 1 s must not look like a stuck thread).
        progress.wrappingAdd(1, ordering: .relaxed)
        return body.wait(milliseconds: 100)
    }

    /// CLOCK_THREAD_CPUTIME_ID: the calling thread's CPU time.
    private func threadCPUNanoseconds() -> UInt64 {
        var now = timespec()
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now)
        return UInt64(now.tv_sec) &* 1_000_000_000 &+ UInt64(now.tv_nsec)
    }

    /// Receives and forwards batches until the source is empty, `budget` batches, or the stop
    /// signal (with a deadline: until the deadline instead).
    private func drain<Body: ReceiveLoopBody>(_ body: Body, budget: Int, deadline: ContinuousClock.Instant?) -> Drained {
        var batches = 0
        while batches < budget {
            let count: Int
            do {
                count = try body.receiveBatch()
            } catch {
                logFailure(error)
                return .failed
            }
            if count == 0 { return .empty }
            batches += 1
            progress.wrappingAdd(1, ordering: .relaxed)
            body.adoptPlanIfChanged()
            body.forward(count)
            ledger?.holding(0)
            if deadline.map({ ContinuousClock.now >= $0 }) ?? stop.isSet { break }
        }
        return .budgetSpent
    }

    /// At most one line a second: a receive that fails every time must not flood the log (the
    /// path check reports the thread stuck).
    private func logFailure(_ error: SystemCallError) {
        let now = ContinuousClock.now
        let line: Int? = failures.withLock { state in
            state.count += 1
            guard state.lastLine.map({ now - $0 >= .seconds(1) }) ?? true else { return nil }
            defer { state = (0, now) }
            return state.count
        }
        guard let count = line else { return }
        var fields = metadata
        fields["error"] = "\(error)"
        fields["failures_since_last_line"] = "\(count)"
        logger.error("receive failed", metadata: fields)
    }
}

/// A listener's settings.busy_wait_us counters, added to by its forwarding threads once a second
/// (and when they stop): polls that found something (a wake-up saved), polls whose window passed
/// empty (the thread then slept), and the CPU time spent polling.
final class BusyWaitCounters: Sendable {
    let found = Atomic<UInt64>(0)
    let slept = Atomic<UInt64>(0)
    let nanoseconds = Atomic<UInt64>(0)
    /// Set once a thread of the listener polls (kept: the series keep their totals).
    let shown = Atomic<Bool>(false)
}

/// One thread's busy-wait counts since its last flush.
struct BusyWaitTally {
    var found: UInt64 = 0
    var slept: UInt64 = 0
    var nanoseconds: UInt64 = 0

    mutating func flush(into counters: BusyWaitCounters?) {
        guard let counters, found > 0 || slept > 0 || nanoseconds > 0 else { return }
        counters.found.wrappingAdd(found, ordering: .relaxed)
        counters.slept.wrappingAdd(slept, ordering: .relaxed)
        counters.nanoseconds.wrappingAdd(nanoseconds, ordering: .relaxed)
        self = BusyWaitTally()
    }
}
