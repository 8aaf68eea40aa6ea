// SPDX-License-Identifier: Apache-2.0
import ArgumentParser
import FanoutCore
import Logging
import ReusePortLB
import ServiceLifecycle
import UnixSignals

#if canImport(Glibc)
import Glibc
#endif

/// udp-fanout: the daemon (the default command, so `udp-fanout -c FILE` runs it as the reference
/// documents do) and `udp-fanout status`, the live view of a running one.
@main
struct UDPFanout: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "udp-fanout",
        abstract: "Forward each UDP datagram received on a listener to downstreams; show a running daemon (status); take it out of its fleet (drain).",
        discussion: """
            Without a subcommand udp-fanout runs the daemon: `udp-fanout -c FILE` is `udp-fanout run \
            -c FILE`. Its options (-c/--config, --check, -l/--log-level, --log-format, --watch-config): \
            `udp-fanout help run`.
            """,
        version: ProjectVersion.string,
        subcommands: [Run.self, Status.self, Drain.self, Withdraw.self, Capture.self],
        defaultSubcommand: Run.self)
}

/// The udp-fanout daemon: forwards each datagram received on a listener to one downstream.
struct Run: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Run the daemon (the default: `udp-fanout -c FILE` is `udp-fanout run -c FILE`).",
        discussion: """
            SIGTERM/SIGINT: stop receiving, forward what is queued, exit 0 (with an announce section, \
            first withdraw the addresses and serve for drain_secs). SIGUSR2 (udp-fanout drain): the \
            same, then exit 0. SIGHUP: reload the \
            configuration file (--watch-config: also when the file changes); unchanged listeners keep \
            forwarding, an invalid file is rejected and the running configuration stays. The environment variable UDP_FANOUT_LOG (or RUST_LOG, \
            as in the reference) overrides --log-level.
            """,
        version: ProjectVersion.string)

    @Option(name: [.customShort("c"), .long], help: "Path to the YAML configuration file.")
    var config = "config.yaml"

    @Option(name: [.customShort("l"), .customLong("log-level")], help: "trace, debug, info, warn, error or off.")
    var logLevel = "info"

    @Option(name: .customLong("log-format"), help: "text (default) or json: one JSON object per line (time, level, message, label, then the line's keys such as listener and downstream).")
    var logFormat = "text"

    @Flag(help: "Validate the configuration, print a summary and exit (0 valid, 2 invalid).")
    var check = false

    @Flag(name: .customLong("watch-config"), help: "Also reload when the configuration file changes (checked every second, as sbulb does); SIGHUP still works.")
    var watchConfig = false

    @Flag(name: .customLong("print-settings-table"), help: .hidden)
    var printSettingsTable = false

    @Option(name: .customLong("ebpf-program"), help: "Accepted for compatibility: the BPF programs are embedded in this binary; the file is not read.")
    var ebpfProgram: String?

    @Option(name: .customLong("xdp-program"), help: "Accepted for compatibility: the BPF programs are embedded in this binary; the file is not read.")
    var xdpProgram: String?

    func validate() throws {
        guard ["text", "json"].contains(logFormat) else {
            throw ValidationError("--log-format '\(logFormat)' is not one of text, json")
        }
    }

    func run() async throws {
        // The settings table as JSON (schema/settings-table.json, which schema/generate-schema.py reads).
        if printSettingsTable {
            print(SettingsTable.json(), terminator: "")
            return
        }
        // UDP_FANOUT_LOG wins over RUST_LOG; an empty one counts as unset.
        let names: [String] = ["UDP_FANOUT_LOG", "RUST_LOG"]
        let environment = names.compactMap { (name: String) -> String? in
            guard let value = getenv(name) else { return nil }
            let text = String(cString: value)
            return text.isEmpty ? nil : text
        }.first
        let filter = try Self.logFilter(environment: environment, flag: logLevel)
        let json = logFormat == "json"
        LoggingSystem.bootstrap { label in
            guard case .level(let level) = filter else { return SwiftLogNoOpLogHandler(label) }
            if json {
                var handler = JSONLogHandler(label: label)
                handler.logLevel = level
                return handler
            }
            var handler = StreamLogHandler.standardError(label: label)
            handler.logLevel = level
            return handler
        }
        let logger = Logger(label: "udp-fanout")
        logger.info(check ? "checking udp-fanout configuration" : "starting udp-fanout", metadata: ["version": "\(ProjectVersion.string)", "config": "\(config)"])
        for (flag, value) in [("--ebpf-program", ebpfProgram), ("--xdp-program", xdpProgram)] where value != nil {
            logger.notice("\(flag) is accepted for compatibility and ignored: the BPF programs are embedded in udp-fanout", metadata: ["path": "\(value!)"])
        }
        let programProblems = logProgramOverride(logger, checking: check)
        if check && !programProblems.isEmpty {
            for problem in programProblems { printError("udp-fanout: \(problem)") }
            throw ExitCode(2)
        }
        let parsed: FanoutConfig
        do {
            parsed = try ConfigParser.parse(try readFile(config))
            try parsed.validate()
        } catch {
            // Once, on one line (the error escapes what is not printable).
            printError("udp-fanout: \(error)")
            throw ExitCode(2)
        }
        for warning in parsed.warnings() {
            if check { printError("udp-fanout: \(warning)") } else { logger.warning("\(warning)") }
        }
        logger.info("configuration loaded", metadata: ["listeners": "\(parsed.listeners.count)", "path": "\(config)"])
        if !check && !KernelGracePeriod.isAvailable {
            logger.warning("the kernel refuses membarrier(MEMBARRIER_CMD_GLOBAL) (a nohz_full kernel, or a seccomp filter): a listener handed to its successor on a reload waits \(KernelGracePeriod.fallback) for datagrams already steered to it instead of a kernel grace period, which covers any stall seen in practice but is not a guarantee (allow membarrier in the seccomp profile)")
        }
        if check {
            // Interfaces, forwarding, routes and binds, checked without binding, loading or attaching.
            let (problems, notes) = Preflight.check(parsed)
            for note in notes { printError("udp-fanout: note: \(note)") }
            guard problems.isEmpty else {
                for problem in problems { printError("udp-fanout: \(problem)") }
                throw ExitCode(2)
            }
            print(parsed.checkSummary)
            return
        }
        // Graceful shutdown runs in reverse order: listeners drain first while the endpoint still
        // answers (/readyz then says 503), then probes and discovery stop, then the endpoint
        // closes its connections.
        let notifier = SystemdNotifier(logger: logger)
        // What systemd's descriptor store handed back (a restart, an upgrade, a crash's automatic
        // restart): the previous process's sockets, adopted by the listeners on their binds.
        let descriptors = DescriptorStore.fromEnvironment(notifier: notifier, logger: logger)
        let daemon = FanoutDaemon(config: parsed, configPath: config, logger: logger, descriptors: descriptors)
        // SIGUSR2 (udp-fanout drain) trapped before the endpoint answers: its default action
        // would end the process. Kept until the process exits.
        let drains = await UnixSignalsSequence(trapping: .sigusr2)
        // A drain (announce.drain_secs, up to 300 s) comes first in the graceful shutdown: the
        // deadline leaves room for it when the file at start announces (a reload that adds the
        // section later drains at most drainLimit seconds, said in the log).
        let drainLimit = parsed.announce != nil ? 300 : 5
        // The announcer stops after the listeners: a stop withdraws the addresses first
        // (ForwardingService, docs/fleet.md), then drains, then stops them.
        var services: [any Service] = [StatusEndpointService(daemon: daemon), DiscoveryService(daemon: daemon), daemon.health, AnnounceService(daemon: daemon), ForwardingService(daemon: daemon, notifier: notifier, watchInterval: watchConfig ? .seconds(1) : nil, drains: drains, drainLimit: drainLimit)]
        do {
            // The path check behind /healthz and systemd's watchdog. Last, so it stops first: no
            // ping once shutdown starts (systemd stops the watchdog for a stopping unit anyway).
            services.append(try WatchdogService(daemon: daemon, notifier: notifier))
        } catch {
            printError("udp-fanout: \(error)")
            throw ExitCode(2)
        }
        // A service that fails (a listener that cannot start) shuts the others down gracefully,
        // as SIGTERM does: cancelled instead, the HTTP server logged its own teardown as errors
        // ("Waiting on child channel: CancellationError()", "Server shutdown error: Already
        // closed") after the real one, which read as more failures. The real error still ends
        // run() and is printed below.
        var configuration = ServiceGroupConfiguration(
            // A drain (SIGUSR2) ends ForwardingService on its own: the others then stop as on SIGTERM.
            services: services.map { .init(service: $0, successTerminationBehavior: .gracefullyShutdownGroup, failureTerminationBehavior: .gracefullyShutdownGroup) },
            gracefulShutdownSignals: [.sigterm, .sigint], cancellationSignals: [], logger: logger)
        // Past this, whatever has not stopped is cancelled: a stuck client never holds the exit.
        configuration.maximumGracefulShutdownDuration = .seconds(10 + drainLimit)
        let group = ServiceGroup(configuration: configuration)
        do {
            try await group.run()
        } catch {
            printError("udp-fanout: \(error)")
            throw ExitCode(1)
        }
        logger.info("udp-fanout stopped")
        withExtendedLifetime(drains) {}
    }
}

extension Run {
    static func logFilter(environment: String?, flag: String) throws(ValidationError) -> LogDirectives.Filter {
        do {
            return try LogDirectives.filter(environment: environment, flag: flag)
        } catch {
            throw ValidationError(error.description)
        }
    }
}

func printError(_ text: String) {
    var line = text + "\n"
    line.withUTF8 { _ = write(2, $0.baseAddress, $0.count) }
}
