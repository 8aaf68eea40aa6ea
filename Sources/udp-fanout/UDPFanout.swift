import ArgumentParser
import FanoutCore
import Logging
import ServiceLifecycle

#if canImport(Glibc)
import Glibc
#endif

/// The udp-fanout daemon: forwards each datagram received on a listener to one downstream.
@main
struct UDPFanout: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "udp-fanout",
        abstract: "Forward each UDP datagram received on a listener to exactly one downstream.",
        discussion: """
            SIGTERM/SIGINT: stop receiving, forward what is queued, exit 0. SIGHUP: reload the \
            configuration file; unchanged listeners keep forwarding, an invalid file is rejected \
            and the running configuration stays. The environment variable UDP_FANOUT_LOG (or RUST_LOG, \
            as in the reference) overrides --log-level.
            """,
        version: "0.1.0")

    @Option(name: [.customShort("c"), .long], help: "Path to the YAML configuration file.")
    var config = "config.yaml"

    @Option(name: [.customShort("l"), .customLong("log-level")], help: "trace, debug, info, warn or error.")
    var logLevel = "info"

    @Flag(help: "Validate the configuration, print a summary and exit (0 valid, 2 invalid).")
    var check = false

    @Option(name: .customLong("ebpf-program"), help: "Accepted for compatibility: the BPF programs are embedded in this binary; the file is not read.")
    var ebpfProgram: String?

    @Option(name: .customLong("xdp-program"), help: "Accepted for compatibility: the BPF programs are embedded in this binary; the file is not read.")
    var xdpProgram: String?

    func run() async throws {
        let names: [String] = ["UDP_FANOUT_LOG", "RUST_LOG"]
        let environment = names.compactMap { name in getenv(name).map { String(cString: $0) } }.first
        guard let level = Self.level(environment ?? logLevel) else {
            throw ValidationError("unknown log level '\(environment ?? logLevel)': use trace, debug, info, warn or error")
        }
        LoggingSystem.bootstrap { label in
            var handler = StreamLogHandler.standardError(label: label)
            handler.logLevel = level
            return handler
        }
        let logger = Logger(label: "udp-fanout")
        logger.info("starting udp-fanout", metadata: ["version": "0.1.0", "config": "\(config)"])
        for (flag, value) in [("--ebpf-program", ebpfProgram), ("--xdp-program", xdpProgram)] where value != nil {
            logger.notice("\(flag) is accepted for compatibility and ignored: the BPF programs are embedded in udp-fanout", metadata: ["path": "\(value!)"])
        }
        let parsed: FanoutConfig
        do {
            parsed = try ConfigParser.parse(try readFile(config))
            try parsed.validate()
        } catch {
            logger.error("invalid configuration", metadata: ["error": "\(error)"])
            printError("udp-fanout: \(error)")
            throw ExitCode(2)
        }
        logger.info("configuration loaded", metadata: ["listeners": "\(parsed.listeners.count)", "path": "\(config)"])
        if check {
            print("configuration OK: \(parsed.listeners.count) listener(s): " + parsed.listeners.map {
                "\($0.name) \($0.bind) \($0.mode.rawValue) -> \($0.downstreams.count) downstream(s), \($0.balancing.rawValue)"
            }.joined(separator: "; "))
            return
        }
        let daemon = FanoutDaemon(config: parsed, configPath: config, logger: logger)
        // Graceful shutdown runs in reverse order: listeners drain first while the endpoint still
        // answers (/readyz then says 503), then the endpoint closes its connections.
        var configuration = ServiceGroupConfiguration(
            services: [StatusEndpointService(daemon: daemon), ForwardingService(daemon: daemon)],
            gracefulShutdownSignals: [.sigterm, .sigint], cancellationSignals: [], logger: logger)
        // Past this, whatever has not stopped is cancelled: a stuck client never holds the exit.
        configuration.maximumGracefulShutdownDuration = .seconds(10)
        let group = ServiceGroup(configuration: configuration)
        do {
            try await group.run()
        } catch {
            printError("udp-fanout: \(error)")
            throw ExitCode(1)
        }
        logger.info("udp-fanout stopped")
    }

    static func level(_ text: String) -> Logger.Level? {
        // RUST_LOG may read "udp_fanout=debug": take the last level named.
        let value = text.split(separator: ",").last?.split(separator: "=").last.map { $0.lowercased() } ?? ""
        switch value {
        case "trace": return .trace
        case "debug": return .debug
        case "info": return .info
        case "warn", "warning": return .warning
        case "error": return .error
        default: return nil
        }
    }
}

func printError(_ text: String) {
    var line = text + "\n"
    line.withUTF8 { _ = write(2, $0.baseAddress, $0.count) }
}
