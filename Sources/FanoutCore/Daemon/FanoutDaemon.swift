#if canImport(Glibc)
import Glibc
#endif
import Logging
import ReusePortLB
import Synchronization

/// Why the daemon could not start.
public enum DaemonError: Error, CustomStringConvertible {
    case listener(name: String, ReusePortError)
    case tcListener(name: String, TCError)
    case modeNotImplemented(name: String, Mode)
    case metrics(SocketAddress, any Error)

    public var description: String {
        switch self {
        case .listener(let name, let error): return "listener '\(name)' could not start: \(error)"
        case .tcListener(let name, let error): return "listener '\(name)' could not start: \(error)"
        case .modeNotImplemented(let name, let mode): return "listener '\(name)' could not start: mode \(mode.rawValue) is not implemented in this release"
        case .metrics(let address, let error):
            return "metrics server error: cannot serve on \(address): \(error); free that port or set metrics.bind to another address"
        }
    }
}

/// A running listener of any mode.
protocol RunningListener: AnyObject, Sendable {
    /// Ready to forward (userspace: every worker is in its receive loop).
    var isReceiving: Bool { get }
    /// Swaps the downstreams and balancing in place, without losing datagrams.
    func update(downstreams: [Downstream], balancing: Balancing)
    /// Stops forwarding and releases everything the listener holds.
    func shutdown()
}

/// udp-fanout's engine: runs the listeners of a configuration, reloads it, serves metrics.
/// Driven in-process by tests and benchmarks; the executable is a thin command line around it.
public final class FanoutDaemon: Sendable {
    private struct State {
        var config: FanoutConfig
        var listeners: [String: any RunningListener] = [:]
        var counters: [String: ListenerCounters] = [:]
        /// How a reload reaches the running ``StatusEndpointService`` (nil until it runs).
        var endpoint: AsyncStream<Metrics>.Continuation?
    }

    let configPath: String?
    let logger: Logger
    private let state: Mutex<State>
    private let reloadsOK = Atomic<UInt64>(0)
    private let reloadsRejected = Atomic<UInt64>(0)
    private let dataplane: TCDataplane

    /// - Parameters:
    ///   - config: a validated configuration.
    ///   - configPath: the file SIGHUP reloads (nil: reload takes text only).
    public init(config: FanoutConfig, configPath: String?, logger: Logger) {
        self.configPath = configPath
        self.logger = logger
        state = Mutex(State(config: config))
        dataplane = TCDataplane(logger: logger)
    }

    /// Starts every listener. On failure stops what started. The HTTP endpoint is a service of
    /// its own: ``StatusEndpointService``.
    public func start() throws(DaemonError) {
        let config = state.withLock { $0.config }
        var byMode: [String: Int] = [:]
        for listener in config.listeners { byMode[listener.mode.rawValue, default: 0] += 1 }
        logger.info("configured listeners by mode", metadata: byMode.mapValues { "\($0)" })
        do {
            for listener in config.listeners { try startListener(listener) }
        } catch {
            shutdown()
            throw error
        }
    }

    private func startListener(_ listener: Listener) throws(DaemonError) {
        let counters = state.withLock { state in
            if let existing = state.counters[listener.name], existing.mode == listener.mode.rawValue { return existing }
            let made = ListenerCounters(name: listener.name, mode: listener.mode.rawValue)
            state.counters[listener.name] = made
            return made
        }
        let running: any RunningListener
        switch listener.mode {
        case .tcEBPF:
            do {
                running = try TCListener(listener, counters: counters, dataplane: dataplane, logger: logger)
            } catch {
                logger.error("tc_ebpf listener could not start", metadata: ["listener": "\(listener.name)", "error": "\(error)"])
                throw .tcListener(name: listener.name, error)
            }
        case .afXDP:
            // Refused at validation; a configuration built in code gets the same answer here.
            throw .modeNotImplemented(name: listener.name, .afXDP)
        case .userspace:
            do {
                running = try UserspaceListener(listener, counters: counters, logger: logger)
            } catch {
                throw .listener(name: listener.name, error)
            }
        }
        state.withLock { $0.listeners[listener.name] = running }
    }

    /// Called by ``StatusEndpointService`` when it runs: reloads that change the `metrics`
    /// section are sent to `changes`.
    /// - Returns: the section in force now.
    func attachEndpoint(_ changes: AsyncStream<Metrics>.Continuation) -> Metrics {
        state.withLock { state in
            state.endpoint = changes
            return state.config.metrics
        }
    }

    /// The path the endpoint serves the Prometheus text on (read per request, so a reload that
    /// changes only the path takes effect at once).
    var metricsPath: String { state.withLock { $0.config.metrics.path } }

    /// True once every listener's workers are in their receive loops.
    public var isReady: Bool {
        state.withLock { state in
            state.config.listeners.allSatisfy { state.listeners[$0.name]?.isReceiving == true }
        }
    }

    /// The Prometheus text of every listener's counters.
    public func metricsText() -> String {
        let counters = state.withLock { state in state.config.listeners.compactMap { state.counters[$0.name] } }
        return PrometheusText.render(
            counters, reloads: (reloadsOK.load(ordering: .relaxed), reloadsRejected.load(ordering: .relaxed)),
            unmatched: dataplane.unmatched())
    }

    /// The counters of one listener (tests and benchmarks read them directly).
    public func counters(of listener: String) -> ListenerCounters.Snapshot? {
        state.withLock { $0.counters[listener] }?.snapshot()
    }

    /// Reloads: parses and validates `text` (default: the config file). An invalid config is
    /// rejected with a log line and the running one stays. Otherwise listeners whose socket
    /// settings are unchanged keep running (a new downstream set or balancing is swapped in
    /// place); changed ones restart; removed ones stop; new ones start.
    /// - Returns: true if the new configuration is in force.
    @discardableResult
    public func reload(text: String? = nil) -> Bool {
        let new: FanoutConfig
        do {
            let source = try text ?? readFile(configPath ?? "")
            new = try ConfigParser.parse(source)
            try new.validate()
        } catch {
            reloadsRejected.wrappingAdd(1, ordering: .relaxed)
            logger.error("configuration reload rejected; keeping the running configuration", metadata: ["error": "\(error)"])
            return false
        }
        let old = state.withLock { $0.config }
        var failures: [String] = []
        let keep = Set(new.listeners.map(\.name))
        for listener in old.listeners where !keep.contains(listener.name) {
            stopListener(listener.name)
            logger.info("listener removed", metadata: ["listener": "\(listener.name)"])
        }
        for listener in new.listeners {
            if let previous = old.listeners.first(where: { $0.name == listener.name }),
                previous.socketShape == listener.socketShape
            {
                if previous != listener {
                    state.withLock { $0.listeners[listener.name] }?.update(downstreams: listener.downstreams, balancing: listener.balancing)
                    logger.info("listener downstreams updated in place", metadata: ["listener": "\(listener.name)", "downstreams": "\(listener.downstreams.count)"])
                }
                continue
            }
            stopListener(listener.name)
            do {
                try startListener(listener)
            } catch {
                failures.append(error.description)
                logger.error("listener could not start on reload", metadata: ["listener": "\(listener.name)", "error": "\(error)"])
            }
        }
        state.withLock { $0.config = new }
        if old.metrics != new.metrics {
            // The endpoint service binds the new address before it closes the old one; if that
            // bind fails it keeps the old one and logs it. Listeners are reloaded either way.
            _ = state.withLock { $0.endpoint }?.yield(new.metrics)
        }
        reloadsOK.wrappingAdd(1, ordering: .relaxed)
        logger.info("configuration loaded", metadata: ["listeners": "\(new.listeners.count)", "reload": "true", "failures": "\(failures.count)"])
        return true
    }

    private func stopListener(_ name: String) {
        let running = state.withLock { state in
            defer { state.listeners[name] = nil }
            return state.listeners[name]
        }
        running?.shutdown()
    }

    /// Stops every listener (each forwards what its sockets hold, then leaves its group).
    /// Idempotent. The HTTP endpoint stops with its own service (graceful shutdown of the
    /// `ServiceGroup`, or cancellation of its task); meanwhile `/readyz` answers 503.
    public func shutdown() {
        let listeners = state.withLock { state in
            defer { state.listeners = [:] }
            return Array(state.listeners.values)
        }
        for listener in listeners { listener.shutdown() }
    }
}

/// Reads a whole file as UTF-8.
public func readFile(_ path: String) throws(ConfigError) -> String {
    guard let file = fopen(path, "r") else {
        throw ConfigError("--config", "cannot read \(path): \(String(decoding: Array(String(cString: strerror(errno)).utf8), as: UTF8.self))")
    }
    defer { fclose(file) }
    var bytes: [UInt8] = []
    var buffer = [UInt8](repeating: 0, count: 65536)
    while true {
        let count = fread(&buffer, 1, buffer.count, file)
        if count <= 0 { break }
        bytes += buffer[0..<count]
    }
    return String(decoding: bytes, as: UTF8.self)
}
