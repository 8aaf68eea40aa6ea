// SPDX-License-Identifier: Apache-2.0
import Logging
import ReusePortLB
import Synchronization
import SystemCalls

/// relay (`mode: userspace` with `replies: relay`): two-way in userspace, a session socket per
/// client towards its downstream, replies relayed from the listener's address.
struct RelayKind: ListenerKind {
    static let name = Replies.relay.rawValue
    static func serves(_ listener: Listener) -> Bool { listener.mode == .userspace && listener.replies == .relay }
    /// Pools get one-way copies of the requests; replies come only from the listener's own downstreams.
    static let replicates = true
    static let routesQUIC = true

    /// Its bind is free of other processes (``Preflight/bindProblems(_:index:)``).
    static func preflight(_ listener: Listener, index: Int) -> (problems: [String], notes: [String]) {
        Preflight.bindProblems(listener, index: index)
    }

    /// A userspace listener's checks, then the sessions'.
    static func validate(_ listener: Listener, index: Int, path: String, of config: FanoutConfig, localAddresses: Set<IPAddress>) throws(ConfigError) {
        try SharedChecks.socketGroup(listener, path: path, of: config)
        guard listener.settings.output == .socket else {
            throw config.configError("\(path).settings.output", "\(listener.settings.output.rawValue): replies relay receives the downstreams' replies on its own session sockets, so datagrams must leave through them (output: socket)")
        }
        guard listener.settings.workerSteering != .roundRobin else {
            throw config.configError("\(path).settings.worker_steering", "round_robin spreads one client over every worker, and each worker keeps its own sessions: replies relay needs five_tuple or source_ip")
        }
    }

    static func warnings(_ listener: Listener, path: String, of config: FanoutConfig) -> [ConfigWarning] {
        SharedChecks.socketGroupWarnings(listener, path: path, of: config)
    }

    /// Relay workers (``RelayWorker``) on the listener's socket group (``RelayListener``).
    func start(_ listener: Listener, _ context: ListenerContext) throws(DaemonError) -> any RunningListener {
        do {
            return try RelayListener(listener, counters: context.counters, logger: context.logger, passiveHealth: context.refused,
                                     descriptors: context.descriptors)
        } catch {
            throw .listener(name: listener.name, error)
        }
    }

    /// A successor with eBPF steering on exactly the same bind gets every new request, so the
    /// old sessions can drain (another address on the port, even a wildcard, is another kernel
    /// group: the old sockets would keep receiving there).
    var drainsOnHandOver: Bool { true }

    /// What this daemon said of the limits its relay listeners' session tables need
    /// (``RelayLimitWarnings``): said again only when the figures change.
    private let limits = LimitWarnings()

    private final class LimitWarnings: Sendable {
        let said = Mutex(RelayLimitWarnings())
    }

    /// Says whether the open-files limit (as the relay listeners' start raised it) and the local
    /// ports can hold what `config`'s relay listeners need.
    func applied(_ config: FanoutConfig, logger: Logger) {
        let openFiles = try? Syscall.getrlimit(Syscall.Resource.openFiles)
        let ports = RelayListener.ephemeralPorts()
        let held = RelayListener.heldByHandedOver
        limits.said.withLock { $0.say(for: config, openFiles: openFiles, ports: ports, heldByHandedOver: held, logger: logger) }
    }
}
