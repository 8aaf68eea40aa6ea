// SPDX-License-Identifier: Apache-2.0
import ReusePortLB

/// userspace: recvmmsg/sendmmsg workers on a SO_REUSEPORT group of the bind (ReusePortLB).
struct UserspaceKind: ListenerKind {
    static let name = Mode.userspace.rawValue
    static func serves(_ listener: Listener) -> Bool { listener.mode == .userspace && listener.replies != .relay }
    /// Each datagram to every pool: one receive, one batch per pool member out.
    static let replicates = true
    static let routesQUIC = true

    /// Its bind is free of other processes (``Preflight/bindProblems(_:index:)``).
    static func preflight(_ listener: Listener, index: Int) -> (problems: [String], notes: [String]) {
        Preflight.bindProblems(listener, index: index)
    }

    static func validate(_ listener: Listener, index: Int, path: String, of config: FanoutConfig, localAddresses: Set<IPAddress>) throws(ConfigError) {
        try SharedChecks.socketGroup(listener, path: path, of: config)
    }

    static func warnings(_ listener: Listener, path: String, of config: FanoutConfig) -> [ConfigWarning] {
        SharedChecks.socketGroupWarnings(listener, path: path, of: config)
    }

    func start(_ listener: Listener, _ context: ListenerContext) throws(DaemonError) -> any RunningListener {
        do {
            return try UserspaceListener(listener, counters: context.counters, logger: context.logger, passiveHealth: context.refused,
                                         descriptors: context.descriptors)
        } catch {
            throw .listener(name: listener.name, error)
        }
    }
}
