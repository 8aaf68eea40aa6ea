import Logging
import ServiceLifecycle
import UnixSignals

/// Runs the daemon's listeners and reloads the configuration on SIGHUP until graceful shutdown
/// (SIGTERM/SIGINT through the ServiceGroup), then stops them.
public struct ForwardingService: Service {
    let daemon: FanoutDaemon
    let notifier: SystemdNotifier

    public init(daemon: FanoutDaemon) {
        self.daemon = daemon
        notifier = SystemdNotifier()
    }

    public func run() async throws {
        let hangups = await UnixSignalsSequence(trapping: .sighup)
        // Loading programs, joining groups and binding block: off the cooperative pool.
        try await offCooperativePool("fanout-start") { Result { () throws(DaemonError) in try daemon.start() } }.get()
        notifier.send("READY=1\nSTATUS=forwarding")
        for await _ in hangups.cancelOnGracefulShutdown() {
            notifier.send("RELOADING=1")
            daemon.logger.info("SIGHUP: reloading the configuration", metadata: ["path": "\(daemon.configPath ?? "-")"])
            await offCooperativePool("fanout-reload") { daemon.reload() }
            notifier.send("READY=1")
        }
        notifier.send("STOPPING=1")
        daemon.logger.info("shutting down: stopping listeners")
        await offCooperativePool("fanout-stop") { daemon.shutdown() }
    }
}
