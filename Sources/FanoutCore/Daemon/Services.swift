// SPDX-License-Identifier: Apache-2.0
import Logging
import ReusePortLB
import Synchronization
import ServiceLifecycle
import UnixSignals

extension FanoutDaemon {
    /// systemd's STATUS= line: the listeners by mode, and how many reasons `/readyz` gives.
    package func statusLine() -> String {
        let (listeners, lost) = state.withLock { ($0.config.listeners, $0.lost.sorted()) }
        let modes = Dictionary(grouping: listeners, by: \.mode.rawValue).map { "\($0.value.count) \($0.key)" }.sorted()
        let notReady = readiness.count
        return "forwarding: \(listeners.count) listener(s) (\(modes.joined(separator: ", ")))"
            + (lost.isEmpty ? "" : ", \(lost.joined(separator: ", ")) not running after a failed change")
            + (notReady > 0 ? ", \(notReady) not ready (see /readyz)" : "")
    }
}

extension FanoutDaemon {
    /// Most entries `/associations` lists at once (`limit`).
    static let associationsLimit = 100_000

    /// `GET /associations?listener=NAME&limit=N`: a two-way listener's clients and their
    /// downstreams, one per line (`client downstream` and, for relay, `idle_secs=N`), after a
    /// first line with the count shown and the total. The listener may be left out when only
    /// one is two-way. - Returns: the HTTP status and the body.
    func associationsText(listener name: String?, limit: Int?) -> (status: Int, body: String) {
        guard let limit, (0...Self.associationsLimit).contains(limit) else {
            return (400, "limit must be a whole number 0...\(Self.associationsLimit)\n")
        }
        let (config, running) = state.withLock { ($0.config, $0.listeners) }
        let twoWay = config.listeners.filter { $0.replies != .none }.map(\.name)
        guard let chosen = name ?? (twoWay.count == 1 ? twoWay.first : nil) else {
            return (400, twoWay.isEmpty
                ? "no listener has replies nat or relay: associations exist only on two-way listeners\n"
                : "name the listener: /associations?listener=NAME (two-way listeners: \(twoWay.joined(separator: ", ")))\n")
        }
        guard let listener = config.listeners.first(where: { $0.name == chosen }) else {
            return (404, "no listener named '\(chosen)'\n")
        }
        guard listener.replies != .none else {
            return (404, "listener '\(chosen)' is one way (replies: none): it keeps no associations\n")
        }
        guard let associations = running[chosen]?.associations(limit: limit) else {
            return (503, "listener '\(chosen)' is not running (see /readyz)\n")
        }
        var body = "# listener \(chosen) replies \(listener.replies.rawValue): \(associations.entries.count) of \(associations.total) shown\n"
        for entry in associations.entries {
            body += "\(entry.client) \(entry.downstream)\(entry.idleSeconds.map { " idle_secs=\($0)" } ?? "")\n"
        }
        return (200, body)
    }
}

/// Runs the daemon's listeners and reloads the configuration on SIGHUP (and, with
/// `--watch-config`, when the file changes) until graceful shutdown (SIGTERM/SIGINT through the
/// ServiceGroup), then stops them. Tells systemd each step (sd_notify: READY, RELOADING with
/// MONOTONIC_USEC, STOPPING, and a STATUS line).
public struct ForwardingService: Service {
    let daemon: FanoutDaemon
    let notifier: SystemdNotifier
    let watchInterval: Duration?
    /// SIGUSR2, trapped by the caller before anything else started (so a drain asked for early
    /// is not the signal's default action, termination); nil: trapped when this service runs.
    let drains: UnixSignalsSequence?
    /// The longest drain the process's shutdown deadline leaves room for (seconds).
    let drainLimit: Int

    /// - Parameters:
    ///   - daemon: the engine whose listeners this service starts, reloads and stops.
    ///   - notifier: where the sd_notify messages go (default: `$NOTIFY_SOCKET`).
    ///   - watchInterval: how often the configuration file is checked for changes (`--watch-config`);
    ///     nil: only SIGHUP reloads.
    ///   - drains: SIGUSR2 trapped early by the caller (nil: trapped when the service runs).
    ///   - drainLimit: the longest drain the caller's shutdown deadline allows, in seconds.
    public init(daemon: FanoutDaemon, notifier: SystemdNotifier? = nil, watchInterval: Duration? = nil,
                drains: UnixSignalsSequence? = nil, drainLimit: Int = 300) {
        self.daemon = daemon
        self.notifier = notifier ?? SystemdNotifier(logger: daemon.logger)
        self.watchInterval = watchInterval
        self.drains = drains
        self.drainLimit = drainLimit
    }

    /// What asked for a reload.
    enum Trigger: Sendable {
        case hangup
        /// The watcher's read of the changed file: the reload parses these very bytes.
        case fileChanged(String)
    }

    /// SIGTERM and SIGINT received so far (the first starts the graceful shutdown; during a
    /// drain, one more cuts it short).
    private let stopSignals = StopSignalCount()

    final class StopSignalCount: Sendable {
        let count = Atomic<Int>(0)
    }

    public func run() async throws {
        let hangups = await UnixSignalsSequence(trapping: .sighup)
        // Counted from the start, so none is missed however late a drain begins (the service
        // group handles the first itself; libdispatch gives every source of a signal each
        // delivery, so the group's and this one coexist). One sent while this registers, or two
        // sent so close that the kernel merges them, counts once.
        let stops = await UnixSignalsSequence(trapping: .sigterm, .sigint)
        let stopWatch = Task { [stopSignals] in
            for await _ in stops { stopSignals.count.add(1, ordering: .relaxed) }
        }
        defer { stopWatch.cancel() }
        // `udp-fanout drain` (or `systemctl kill -s SIGUSR2`): withdraw, serve, then stop and exit 0.
        let drains = if let given = self.drains { given } else { await UnixSignalsSequence(trapping: .sigusr2) }
        // One reload at a time, in order; a request that arrives during a reload waits (one is enough).
        let (triggers, requests) = AsyncStream<Trigger>.makeStream(bufferingPolicy: .bufferingNewest(1))
        // Listened to from before the start: a drain asked for meanwhile keeps the addresses
        // withdrawn (a readiness reason) and ends the run as soon as the start is done.
        let drainWatch = Task {
            for await _ in drains {
                daemon.logger.notice("SIGUSR2: draining, then stopping")
                daemon.state.withLock { $0.drainRequested = true }
                // The reload under way (if any) ends first; then the loop below ends.
                requests.finish()
                break
            }
        }
        defer { drainWatch.cancel() }
        let startedAt = ProcessMetrics.startTime() ?? WallClock.seconds()
        // Which process this one takes over from (logged), and this one's record for the next.
        daemon.descriptors.announce(version: ProjectVersion.string, startedAt: startedAt)
        // Loading programs, joining groups and binding block: off the cooperative pool.
        do {
            try await offCooperativePool("fanout-start") { Result { () throws(DaemonError) in try daemon.start() } }.get()
        } catch {
            daemon.descriptors.startFailed(version: ProjectVersion.string, startedAt: startedAt)
            throw error
        }
        // After start(): every listener is bound (or attached), so systemd's "started" means forwarding.
        daemon.path.markStarted()
        notifier.send("READY=1\nSTATUS=\(forwardingStatus())")
        let watcher = SharedWatcher(watchInterval != nil ? daemon.configPath.map { ConfigFileWatcher(path: $0) } : nil)
        await withDiscardingTaskGroup { group in
            group.addTask {
                for await _ in hangups.cancelOnGracefulShutdown() { requests.yield(.hangup) }
                requests.finish()
            }
            if let interval = watchInterval, let path = daemon.configPath {
                daemon.logger.info("watching the configuration file for changes", metadata: ["path": "\(path)", "interval": "\(interval)"])
                group.addTask {
                    while (try? await Task.sleep(for: interval)) != nil, !Task.isCancelled {
                        switch watcher.state.withLock({ $0?.look() }) {
                        case .changed(let text)?: requests.yield(.fileChanged(text))
                        case .unreadable(let problem)?:
                            daemon.logger.warning("cannot read the watched configuration file; the running configuration stays", metadata: ["problem": "\(problem)"])
                        case .unchanged?, nil: break
                        }
                    }
                }
            }
            for await trigger in triggers {
                // A reload buffered before a drain request is not applied: the drain comes first.
                if daemon.state.withLock({ $0.drainRequested }) { break }
                await reload(trigger)
                // After a SIGHUP the file as it is now is the baseline, so a change the SIGHUP
                // loaded is not loaded again when the watcher sees it. (A file-triggered reload
                // loaded the watcher's own bytes: its baseline already.)
                if case .hangup = trigger { watcher.state.withLock { $0?.rebase() } }
            }
            group.cancelAll()
        }
        await drain()
        daemon.descriptors.stopping(version: ProjectVersion.string, startedAt: startedAt)
        notifier.send("STOPPING=1\nSTATUS=stopping: draining the listeners")
        daemon.logger.info("shutting down: stopping listeners")
        await offCooperativePool("fanout-stop") { daemon.shutdown() }
    }

    /// Before a stop (SIGTERM, SIGINT) or after a drain request (SIGUSR2) with addresses to
    /// announce: withdraws them, then keeps every listener serving what still arrives (datagrams
    /// routers already sent, two-way replies) for `announce.drain_secs`. Routers stop sending
    /// here within their convergence time; the stop that follows loses only what arrives later.
    private func drain() async {
        let (settings, requested) = daemon.state.withLock { state in
            state.draining = state.config.announce != nil
            return (state.config.announce, state.drainRequested)
        }
        // Whatever is still announced goes, even if a reload just removed the section.
        let withdrawn = await offCooperativePool("fanout-drain") {
            daemon.announcer.withdrawAll(reason: requested ? "drained (SIGUSR2, udp-fanout drain)" : "udp-fanout is stopping", now: WallClock.seconds())
        }
        guard let settings else {
            if requested { daemon.logger.notice("drain: no announce section: nothing to withdraw, stopping now") }
            return
        }
        // Serve as long as routers may still send here: drain_secs after the last withdrawal
        // (none if nothing was announced within that time), within the shutdown deadline.
        let since = WallClock.seconds() - daemon.announcer.lastWithdrawal
        var wait = withdrawn.isEmpty ? max(0, Double(settings.drainSecs) - since) : Double(settings.drainSecs)
        if wait > Double(drainLimit) {
            daemon.logger.warning("drain cut short: the shutdown deadline set at start leaves \(drainLimit) s (the process started without an announce section): restart to apply drain_secs \(settings.drainSecs)")
            wait = Double(drainLimit)
        }
        guard wait > 0 else {
            daemon.logger.info("stopping: nothing was announced within drain_secs, no drain needed")
            return
        }
        notifier.send("STOPPING=1\nSTATUS=draining: addresses withdrawn, serving for \(Int(wait.rounded())) s")
        daemon.logger.notice("draining: addresses withdrawn; serving what still arrives, then stopping", metadata: [
            "withdrawn": "\(withdrawn.map { "\($0)" }.joined(separator: ","))", "serving_secs": "\(Int(wait.rounded()))",
        ])
        // Not cut short by the graceful shutdown itself (this is its first step). A stop asked
        // for during a drain (SIGTERM after udp-fanout drain) waits for it, and says so; one more
        // SIGTERM or SIGINT (Ctrl-C) cuts it short.
        let alreadyStopping = Task.isShuttingDownGracefully
        let serving = wait
        // Every stop signal of the process leads to this one drain: the first started the stop
        // or came during the drain (it waits for it), the second cuts it short.
        let cutAt = 2
        await withGracefulShutdownHandler {
            let end = ContinuousClock.now + .milliseconds(Int(serving * 1000))
            while ContinuousClock.now < end {
                if stopSignals.count.load(ordering: .relaxed) >= cutAt {
                    daemon.logger.notice("a stop signal again during the drain (SIGTERM or SIGINT): cut short, stopping now")
                    return
                }
                guard (try? await Task.sleep(for: .milliseconds(50))) != nil else { return }
            }
        } onGracefulShutdown: { [daemon] in
            guard !alreadyStopping else { return }
            daemon.logger.notice("a stop was asked for during the drain: stopping when the drain ends (send it again to stop now)", metadata: ["serving_secs": "\(Int(serving.rounded()))"])
        }
    }

    /// The watcher, shared by the polling task and the reload loop (which rebases it).
    final class SharedWatcher: Sendable {
        let state: Mutex<ConfigFileWatcher?>
        init(_ watcher: ConfigFileWatcher?) { state = Mutex(watcher) }
    }

    private func reload(_ trigger: Trigger) async {
        // sd_notify(3), Type=notify-reload: RELOADING=1 with the monotonic time of the request.
        notifier.send("RELOADING=1\nMONOTONIC_USEC=\(SystemdNotifier.monotonicMicroseconds())\nSTATUS=reloading \(daemon.configPath ?? "the configuration")")
        switch trigger {
        case .hangup: daemon.logger.info("SIGHUP: reloading the configuration", metadata: ["path": "\(daemon.configPath ?? "-")"])
        case .fileChanged: daemon.logger.info("configuration file changed: reloading", metadata: ["path": "\(daemon.configPath ?? "-")"])
        }
        let text: String?
        if case .fileChanged(let read) = trigger { text = read } else { text = nil }
        let applied = await offCooperativePool("fanout-reload") { daemon.reload(text: text) }
        if applied {
            notifier.send("READY=1\nSTATUS=\(forwardingStatus()); configuration reloaded")
        } else {
            // The previous configuration keeps forwarding: the daemon is ready, and says why the reload failed.
            let reason = daemon.lastRejection.withLock { $0 } ?? "see the log"
            let lost = daemon.state.withLock { $0.lost.sorted() }
            let kept = lost.isEmpty
                ? "still forwarding with the previous configuration"
                : "listener(s) \(lost.joined(separator: ", ")) not running (see /readyz), the others forwarding with the previous configuration"
            notifier.send("READY=1\nSTATUS=reload failed, \(kept): \(Self.oneLine(reason))")
        }
    }

    private func forwardingStatus() -> String { daemon.statusLine() }

    /// STATUS= takes one line: newlines in an error would start new assignments.
    static func oneLine(_ text: String) -> String {
        String(text.map { $0.isNewline ? " " : $0 }.prefix(400))
    }
}

extension ForwardingService: CustomStringConvertible {
    /// What ServiceLifecycle logs for the service: its name only, not its fields (the
    /// environment, credentials, the daemon's state).
    public var description: String { "ForwardingService" }
}
