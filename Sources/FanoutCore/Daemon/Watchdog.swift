// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import Logging
import ServiceLifecycle
import Synchronization

/// One part of the forwarding path as the systemd watchdog sees it.
package struct PathHeartbeat: Sendable, Equatable {
    /// What moves, or what must still be in place.
    package enum Beat: Sendable, Equatable {
        /// A userspace worker: `count` grows at every idle poll timeout (100 ms) and at every
        /// batch it receives; not at a turn whose receive failed.
        case worker(index: Int, count: UInt64)
        /// A tc_ebpf listener: the path is the kernel's; alive while our program is still
        /// attached at the interface's ingress. `problem` says what the kernel answered otherwise.
        case kernel(interface: String, problem: String?)
    }

    /// The listener's name.
    package let listener: String
    /// Which running instance of the listener (a reload that rebuilds it starts a new one,
    /// whose counters start again from zero).
    package let instance: UInt64
    /// The part and its state.
    package let beat: Beat

    /// - Parameters:
    ///   - listener: the listener's name.
    ///   - instance: the running instance (``ListenerInstance/next()`` numbers them).
    ///   - beat: the worker's progress counter or the kernel attachment's state.
    package init(listener: String, instance: UInt64, beat: Beat) {
        self.listener = listener
        self.instance = instance
        self.beat = beat
    }
}

/// Numbers running listener instances for ``PathHeartbeat/instance``.
enum ListenerInstance {
    private static let serial = Atomic<UInt64>(0)
    static func next() -> UInt64 { serial.wrappingAdd(1, ordering: .relaxed).newValue }
}

/// Decides, one check at a time, whether the forwarding path is alive: every worker seen at the
/// previous check must have moved since, and every tc_ebpf attachment must still be in place. A
/// part seen for the first time counts as alive (it has just started). No clock: each call is one
/// tick of the pinger, so the decision is tested with made-up heartbeats.
package struct WatchdogJudge: Sendable {
    struct Key: Hashable {
        let listener: String
        let instance: UInt64
        let part: String
    }

    private var counts: [Key: UInt64] = [:]
    /// Parts reported stuck and not yet recovered: each stall is logged once.
    private var stuck: Set<Key> = []

    package init() {}

    /// The verdict of one check.
    package struct Verdict: Sendable, Equatable {
        /// True: send WATCHDOG=1.
        package var alive: Bool
        /// Parts that stopped since the previous check, one line each (for the log).
        package var newlyStuck: [String]
        /// Parts that move again after being reported stuck.
        package var recovered: [String]
        /// Every part stuck now, one line each (what /healthz answers).
        package var problems: [String] = []
    }

    /// Compares `heartbeats` with those of the previous check.
    /// - Returns: whether to ping, and the stalls and recoveries to log.
    package mutating func check(_ heartbeats: [PathHeartbeat]) -> Verdict {
        var verdict = Verdict(alive: true, newlyStuck: [], recovered: [])
        var seen: [Key: UInt64] = [:]
        var stuckNow: Set<Key> = []
        for heartbeat in heartbeats {
            let key: Key
            let moving: Bool
            let problem: String
            switch heartbeat.beat {
            case .worker(let index, let count):
                key = Key(listener: heartbeat.listener, instance: heartbeat.instance, part: "worker \(index)")
                seen[key] = count
                moving = counts[key].map { $0 != count } ?? true
                problem = "worker \(index) of listener '\(heartbeat.listener)' made no progress"
            case .kernel(let interface, let answer):
                key = Key(listener: heartbeat.listener, instance: heartbeat.instance, part: "tc \(interface)")
                moving = answer == nil
                problem = "the tc_ebpf program of listener '\(heartbeat.listener)' is no longer attached at \(interface) ingress (\(answer ?? ""))"
            }
            if moving {
                if stuck.contains(key) { verdict.recovered.append("watchdog: \(key.part) of listener '\(key.listener)' makes progress again") }
                continue
            }
            verdict.alive = false
            verdict.problems.append(problem)
            stuckNow.insert(key)
            if !stuck.contains(key) { verdict.newlyStuck.append("watchdog: \(problem), withholding WATCHDOG=1") }
        }
        counts = seen
        stuck = stuckNow
        return verdict
    }
}

/// systemd's watchdog settings from the environment (sd_watchdog_enabled(3)).
package enum WatchdogSettings {
    /// The interval systemd expects WATCHDOG=1 within, or nil: no watchdog for this process.
    /// - Parameters:
    ///   - environment: `WATCHDOG_USEC` (microseconds) and `WATCHDOG_PID` (when set, the
    ///     watchdog is this process's only if it equals `pid`: a child must not ping for its parent).
    ///   - pid: this process's id.
    /// - Throws: a message naming the variable when `WATCHDOG_USEC` or `WATCHDOG_PID` is not a
    ///   positive number (systemd would then kill the daemon for pings it never sends).
    package static func interval(environment: [String: String], pid: pid_t) throws(ConfigError) -> Duration? {
        guard let text = environment["WATCHDOG_USEC"], !text.isEmpty else { return nil }
        guard let microseconds = UInt64(text), microseconds > 0 else {
            throw ConfigError("WATCHDOG_USEC", "'\(text)' is not a positive number of microseconds: fix WatchdogSec= in the unit (or unset WATCHDOG_USEC)")
        }
        if let owner = environment["WATCHDOG_PID"], !owner.isEmpty {
            guard let ownerPID = pid_t(owner), ownerPID > 0 else {
                throw ConfigError("WATCHDOG_PID", "'\(owner)' is not a process id")
            }
            guard ownerPID == pid else { return nil }
        }
        return .microseconds(Int64(min(microseconds, UInt64(Int64.max))))
    }
}

/// The forwarding path's state as the last check found it: shared by the path check
/// (``WatchdogService``), `/healthz` and systemd's watchdog.
package final class PathMonitor: Sendable {
    private struct State {
        var started: Bool
        var problems: [String] = []
    }
    private let state: Mutex<State>

    /// How often the path is checked when systemd asks for no watchdog (for `/healthz`).
    package static let defaultCheckInterval: Duration = .seconds(5)

    /// - Parameter started: false until the listeners have started (``markStarted()``): a path
    ///   still starting is neither judged nor pinged for.
    package init(started: Bool = false) {
        state = Mutex(State(started: started))
    }

    /// The listeners have started: checks begin.
    package func markStarted() { state.withLock { $0.started = true } }

    var started: Bool { state.withLock { $0.started } }

    func record(_ problems: [String]) { state.withLock { $0.problems = problems } }

    /// What the last check found stuck, one line each (empty: alive). `/healthz` answers 503 with them.
    package var problems: [String] { state.withLock { $0.problems } }
}

/// Checks the forwarding path (`WatchdogJudge`) on a schedule, always: the verdict is what
/// `/healthz` answers (a Kubernetes liveness probe restarts a daemon whose workers hang), and
/// under systemd with `WatchdogSec=` each alive check sends WATCHDOG=1 (every half interval), so
/// systemd restarts a daemon whose workers hang rather than one whose timer stopped. Stalls are
/// logged once each. Stops on graceful shutdown.
public struct WatchdogService: Service {
    let checkEvery: Duration
    /// systemd's interval, or nil: no WATCHDOG=1 (the checks still feed `/healthz`).
    let interval: Duration?
    let heartbeats: @Sendable () async -> [PathHeartbeat]
    let send: @Sendable (String) -> Void
    let logger: Logger
    let monitor: PathMonitor
    /// systemd's STATUS= line now; sent at a check when it changed (readiness settles after
    /// READY=1, and discovery or health change it later). Nil: no STATUS updates.
    let status: (@Sendable () -> String)?

    /// The daemon's path check, pinging systemd when it asked for a watchdog (`WATCHDOG_USEC` set,
    /// and `WATCHDOG_PID` unset or this process).
    /// - Throws: `WatchdogSettings/interval(environment:pid:)`'s error.
    public init(daemon: FanoutDaemon, notifier: SystemdNotifier,
               environment: [String: String] = ProcessEnvironment.current()) throws(ConfigError) {
        let interval = try WatchdogSettings.interval(environment: environment, pid: getpid())
        // The check takes the daemon's locks and asks the kernel: off the cooperative pool.
        self.init(interval: interval, checkEvery: interval.map { $0 / 2 } ?? PathMonitor.defaultCheckInterval,
                  heartbeats: { await offCooperativePool("fanout-watchdog") { daemon.heartbeats() } },
                  send: { notifier.send($0) }, logger: daemon.logger, monitor: daemon.path,
                  status: { daemon.statusLine() })
    }

    /// - Parameters:
    ///   - interval: systemd's WatchdogSec; a check (and a ping when alive) every half of it.
    ///   - heartbeats: the forwarding path's state now.
    ///   - send: delivers one sd_notify message.
    ///   - logger: where stalls and recoveries are logged.
    package init(interval: Duration, heartbeats: @escaping @Sendable () async -> [PathHeartbeat],
                send: @escaping @Sendable (String) -> Void, logger: Logger) {
        self.init(interval: interval, checkEvery: interval / 2, heartbeats: heartbeats, send: send, logger: logger,
                  monitor: PathMonitor(started: true))
    }

    /// - Parameters:
    ///   - interval: systemd's WatchdogSec, or nil: check only, never ping.
    ///   - checkEvery: the time between checks.
    ///   - monitor: where each verdict goes; nothing is judged before it is marked started.
    package init(interval: Duration?, checkEvery: Duration, heartbeats: @escaping @Sendable () async -> [PathHeartbeat],
                send: @escaping @Sendable (String) -> Void, logger: Logger, monitor: PathMonitor,
                status: (@Sendable () -> String)? = nil) {
        self.status = status
        self.interval = interval
        self.checkEvery = checkEvery
        self.heartbeats = heartbeats
        self.send = send
        self.logger = logger
        self.monitor = monitor
    }

    /// Checks (and pings) every `checkEvery` until graceful shutdown or cancellation.
    public func run() async throws {
        if let interval {
            logger.info("systemd watchdog enabled: WATCHDOG=1 while the forwarding path makes progress", metadata: [
                "interval": "\(interval)", "check_every": "\(checkEvery)",
            ])
        }
        var judge = WatchdogJudge()
        var lastStatus: String?
        while !Task.isShuttingDownGracefully && !Task.isCancelled {
            // Not before the listeners have started: systemd's READY=1 comes first.
            if monitor.started {
                let verdict = judge.check(await heartbeats())
                monitor.record(verdict.problems)
                if interval != nil {
                    for line in verdict.newlyStuck { logger.error("\(line)") }
                } else {
                    for line in verdict.newlyStuck {
                        logger.error("\(line.replacing(", withholding WATCHDOG=1", with: "")); /healthz answers 503")
                    }
                }
                for line in verdict.recovered { logger.notice("\(line)") }
                if verdict.alive && interval != nil { send("WATCHDOG=1") }
            }
            // STATUS= follows readiness within a second (a start's first check may come before
            // the listeners receive), the path check keeps its own pace.
            let next = ContinuousClock.now + checkEvery
            repeat {
                if monitor.started, let status, case let line = status(), line != lastStatus {
                    send("STATUS=\(line)")
                    lastStatus = line
                }
                do {
                    try await cancelWhenGracefulShutdown { try await Task.sleep(for: min(.seconds(1), max(.zero, next - ContinuousClock.now))) }
                } catch {
                    return
                }
            } while ContinuousClock.now < next && !Task.isShuttingDownGracefully && !Task.isCancelled
        }
    }
}

extension FanoutDaemon {
    /// Every running listener's heartbeats (userspace workers' progress counters, tc_ebpf
    /// attachments' state), for the path check. Empty while stopping. A listener a failed change
    /// left stopped is not a stall but a readiness problem (`/readyz`): a restart would read the
    /// same file, fail the same way and take the other listeners down with it.
    package func heartbeats() -> [PathHeartbeat] {
        let listeners = state.withLock { state in state.stopping ? [] : Array(state.listeners.values) }
        return listeners.flatMap { $0.heartbeats() }
    }
}

extension WatchdogService: CustomStringConvertible {
    /// What ServiceLifecycle logs for the service: its name only, not its fields (the
    /// environment, credentials, the daemon's state).
    public var description: String { "WatchdogService" }
}
