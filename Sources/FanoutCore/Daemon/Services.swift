import Logging
import ServiceLifecycle
import UnixSignals

extension FanoutDaemon {
    /// systemd's STATUS= line: the listeners by mode, and how many reasons `/readyz` gives.
    public func statusLine() -> String {
        let (listeners, lost) = state.withLock { ($0.config.listeners, $0.lost.sorted()) }
        let modes = Dictionary(grouping: listeners, by: \.mode.rawValue).map { "\($0.value.count) \($0.key)" }.sorted()
        let notReady = readiness.count
        return "forwarding: \(listeners.count) listener(s) (\(modes.joined(separator: ", ")))"
            + (lost.isEmpty ? "" : ", \(lost.joined(separator: ", ")) not running after a failed change")
            + (notReady > 0 ? ", \(notReady) not ready (see /readyz)" : "")
    }
}

/// Runs the daemon's listeners and reloads the configuration on SIGHUP until graceful shutdown
/// (SIGTERM/SIGINT through the ServiceGroup), then stops them. Tells systemd each step
/// (sd_notify: READY, RELOADING with MONOTONIC_USEC, STOPPING, and a STATUS line).
public struct ForwardingService: Service {
    let daemon: FanoutDaemon
    let notifier: SystemdNotifier

    /// - Parameter notifier: where the sd_notify messages go (default: `$NOTIFY_SOCKET`).
    public init(daemon: FanoutDaemon, notifier: SystemdNotifier? = nil) {
        self.daemon = daemon
        self.notifier = notifier ?? SystemdNotifier(logger: daemon.logger)
    }

    public func run() async throws {
        let hangups = await UnixSignalsSequence(trapping: .sighup)
        // Loading programs, joining groups and binding block: off the cooperative pool.
        try await offCooperativePool("fanout-start") { Result { () throws(DaemonError) in try daemon.start() } }.get()
        // After start(): every listener is bound (or attached), so systemd's "started" means forwarding.
        daemon.path.markStarted()
        notifier.send("READY=1\nSTATUS=\(forwardingStatus())")
        for await _ in hangups.cancelOnGracefulShutdown() {
            // sd_notify(3), Type=notify-reload: RELOADING=1 with the monotonic time of the request.
            notifier.send("RELOADING=1\nMONOTONIC_USEC=\(SystemdNotifier.monotonicMicroseconds())\nSTATUS=reloading \(daemon.configPath ?? "the configuration")")
            daemon.logger.info("SIGHUP: reloading the configuration", metadata: ["path": "\(daemon.configPath ?? "-")"])
            let applied = await offCooperativePool("fanout-reload") { daemon.reload() }
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
        notifier.send("STOPPING=1\nSTATUS=stopping: draining the listeners")
        daemon.logger.info("shutting down: stopping listeners")
        await offCooperativePool("fanout-stop") { daemon.shutdown() }
    }

    private func forwardingStatus() -> String { daemon.statusLine() }

    /// STATUS= takes one line: newlines in an error would start new assignments.
    static func oneLine(_ text: String) -> String {
        String(text.map { $0.isNewline ? " " : $0 }.prefix(400))
    }
}
