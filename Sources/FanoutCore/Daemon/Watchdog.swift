#if canImport(Glibc)
import Glibc
#endif
import Logging
import ServiceLifecycle
import Synchronization

/// One part of the forwarding path as the systemd watchdog sees it.
public struct PathHeartbeat: Sendable, Equatable {
    /// What moves, or what must still be in place.
    public enum Beat: Sendable, Equatable {
        /// A userspace worker: `count` grows at every turn of its receive loop, idle poll
        /// timeouts (100 ms) included, and at every batch it forwards.
        case worker(index: Int, count: UInt64)
        /// A tc_ebpf listener: the path is the kernel's; alive while our program is still
        /// attached at the interface's ingress. `problem` says what the kernel answered otherwise.
        case kernel(interface: String, problem: String?)
    }

    /// The listener's name.
    public let listener: String
    /// Which running instance of the listener (a reload that rebuilds it starts a new one,
    /// whose counters start again from zero).
    public let instance: UInt64
    /// The part and its state.
    public let beat: Beat

    /// - Parameters:
    ///   - listener: the listener's name.
    ///   - instance: the running instance (``ListenerInstance/next()`` numbers them).
    ///   - beat: the worker's progress counter or the kernel attachment's state.
    public init(listener: String, instance: UInt64, beat: Beat) {
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
public struct WatchdogJudge: Sendable {
    struct Key: Hashable {
        let listener: String
        let instance: UInt64
        let part: String
    }

    private var counts: [Key: UInt64] = [:]
    /// Parts reported stuck and not yet recovered: each stall is logged once.
    private var stuck: Set<Key> = []

    public init() {}

    /// The verdict of one check.
    public struct Verdict: Sendable, Equatable {
        /// True: send WATCHDOG=1.
        public var alive: Bool
        /// Parts that stopped since the previous check, one line each (for the log).
        public var newlyStuck: [String]
        /// Parts that move again after being reported stuck.
        public var recovered: [String]
    }

    /// Compares `heartbeats` with those of the previous check.
    /// - Returns: whether to ping, and the stalls and recoveries to log.
    public mutating func check(_ heartbeats: [PathHeartbeat]) -> Verdict {
        var verdict = Verdict(alive: true, newlyStuck: [], recovered: [])
        var seen: [Key: UInt64] = [:]
        var stuckNow: Set<Key> = []
        for heartbeat in heartbeats {
            let key: Key
            let moving: Bool
            let stall: String
            switch heartbeat.beat {
            case .worker(let index, let count):
                key = Key(listener: heartbeat.listener, instance: heartbeat.instance, part: "worker \(index)")
                seen[key] = count
                moving = counts[key].map { $0 != count } ?? true
                stall = "watchdog: worker \(index) of listener '\(heartbeat.listener)' made no progress, withholding WATCHDOG=1"
            case .kernel(let interface, let problem):
                key = Key(listener: heartbeat.listener, instance: heartbeat.instance, part: "tc \(interface)")
                moving = problem == nil
                stall = "watchdog: the tc_ebpf program of listener '\(heartbeat.listener)' is no longer attached at \(interface) ingress (\(problem ?? "")), withholding WATCHDOG=1"
            }
            if moving {
                if stuck.contains(key) { verdict.recovered.append("watchdog: \(key.part) of listener '\(key.listener)' makes progress again") }
                continue
            }
            verdict.alive = false
            stuckNow.insert(key)
            if !stuck.contains(key) { verdict.newlyStuck.append(stall) }
        }
        counts = seen
        stuck = stuckNow
        return verdict
    }
}

/// systemd's watchdog settings from the environment (sd_watchdog_enabled(3)).
public enum WatchdogSettings {
    /// The interval systemd expects WATCHDOG=1 within, or nil: no watchdog for this process.
    /// - Parameters:
    ///   - environment: `WATCHDOG_USEC` (microseconds) and `WATCHDOG_PID` (when set, the
    ///     watchdog is this process's only if it equals `pid`: a child must not ping for its parent).
    ///   - pid: this process's id.
    /// - Throws: a message naming the variable when `WATCHDOG_USEC` or `WATCHDOG_PID` is not a
    ///   positive number (systemd would then kill the daemon for pings it never sends).
    public static func interval(environment: [String: String], pid: pid_t) throws(ConfigError) -> Duration? {
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

/// Sends WATCHDOG=1 every half interval while the forwarding path is alive (``WatchdogJudge``),
/// so systemd restarts a daemon whose workers hang rather than one whose timer stopped. Withheld
/// pings are logged once per stall. Stops on graceful shutdown.
public struct WatchdogService: Service {
    let interval: Duration
    let heartbeats: @Sendable () async -> [PathHeartbeat]
    let send: @Sendable (String) -> Void
    let logger: Logger

    /// The daemon's watchdog, or nil when systemd asked for none (`WATCHDOG_USEC` unset, or
    /// `WATCHDOG_PID` names another process).
    /// - Throws: ``WatchdogSettings/interval(environment:pid:)``'s error.
    public init?(daemon: FanoutDaemon, notifier: SystemdNotifier,
                 environment: [String: String] = ProcessEnvironment.current()) throws(ConfigError) {
        guard let interval = try WatchdogSettings.interval(environment: environment, pid: getpid()) else { return nil }
        // The check takes the daemon's locks and asks the kernel: off the cooperative pool.
        self.init(interval: interval, heartbeats: { await offCooperativePool("fanout-watchdog") { daemon.heartbeats() } },
                  send: { notifier.send($0) }, logger: daemon.logger)
    }

    /// - Parameters:
    ///   - interval: systemd's WatchdogSec; a check (and a ping when alive) every half of it.
    ///   - heartbeats: the forwarding path's state now.
    ///   - send: delivers one sd_notify message.
    ///   - logger: where stalls and recoveries are logged.
    public init(interval: Duration, heartbeats: @escaping @Sendable () async -> [PathHeartbeat],
                send: @escaping @Sendable (String) -> Void, logger: Logger) {
        self.interval = interval
        self.heartbeats = heartbeats
        self.send = send
        self.logger = logger
    }

    /// Checks and pings every half interval until graceful shutdown or cancellation.
    public func run() async throws {
        logger.info("systemd watchdog enabled: WATCHDOG=1 while the forwarding path makes progress", metadata: [
            "interval": "\(interval)", "check_every": "\(interval / 2)",
        ])
        var judge = WatchdogJudge()
        while !Task.isShuttingDownGracefully && !Task.isCancelled {
            let verdict = judge.check(await heartbeats())
            for line in verdict.newlyStuck { logger.error("\(line)") }
            for line in verdict.recovered { logger.notice("\(line)") }
            if verdict.alive { send("WATCHDOG=1") }
            do {
                try await cancelWhenGracefulShutdown { try await Task.sleep(for: interval / 2) }
            } catch {
                break
            }
        }
    }
}

extension FanoutDaemon {
    /// Every running listener's heartbeats (userspace workers' progress counters, tc_ebpf
    /// attachments' state) for the watchdog. Empty while stopping.
    public func heartbeats() -> [PathHeartbeat] {
        let listeners = state.withLock { state in state.stopping ? [] : Array(state.listeners.values) }
        return listeners.flatMap { $0.heartbeats() }
    }
}
