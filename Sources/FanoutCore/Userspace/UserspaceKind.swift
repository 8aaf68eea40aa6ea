import ReusePortLB

/// userspace: recvmmsg/sendmmsg workers on a SO_REUSEPORT group of the bind (ReusePortLB).
struct UserspaceKind: ListenerKind {
    static func serves(_ listener: Listener) -> Bool { listener.mode == .userspace && listener.replies != .relay }

    /// Its bind is free of other processes (``Preflight/bindProblems(_:index:)``).
    static func preflight(_ listener: Listener, index: Int) -> (problems: [String], notes: [String]) {
        Preflight.bindProblems(listener, index: index)
    }

    static func validate(_ listener: Listener, index: Int, path: String, of config: FanoutConfig, localAddresses: Set<IPAddress>) throws(ConfigError) {
        if listener.settings.output == .xdpTX {
            throw config.configError("\(path).settings.output", "xdp_tx needs mode af_xdp (it transmits from the AF_XDP ring); userspace mode offers socket or preserve_source")
        }
        try SharedChecks.sourcePreservingFamilies(listener, path: path, of: config)
        if listener.replies == .nat { throw SharedChecks.natNeedsTC(path: path, of: config) }
    }

    static func warnings(_ listener: Listener, path: String, of config: FanoutConfig) -> [ConfigWarning] {
        var warnings: [ConfigWarning] = []
        if config.lines.isSet("\(path).interface") {
            warnings.append(config.configWarning("\(path).interface", "not used in mode userspace (the socket receives on every interface that routes to the bind address)"))
        }
        if config.lines.isSet("\(path).settings.tc_attach") { warnings.append(config.configWarning("\(path).settings.tc_attach", "applies to mode tc_ebpf only")) }
        return warnings + SharedChecks.afXDPKeys(path: path, of: config)
    }

    func start(_ listener: Listener, _ context: ListenerContext) throws(DaemonError) -> any RunningListener {
        do {
            return try UserspaceListener(listener, counters: context.counters, logger: context.logger, passiveHealth: context.refused)
        } catch {
            throw .listener(name: listener.name, error)
        }
    }
}
