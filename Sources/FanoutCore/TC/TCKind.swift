// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import Logging
import ReusePortLB

/// tc_ebpf: in-kernel DNAT, fib lookup and redirect at the interface's tc hook. One program per
/// interface (``TCDataplane``), shared by that interface's listeners, each a map entry.
struct TCKind: ListenerKind {
    let dataplane: TCDataplane

    static let name = Mode.tcEBPF.rawValue
    static let withoutWorkers: String? = "it sets userspace workers; the kernel forwards here"
    static func serves(_ listener: Listener) -> Bool { listener.mode == .tcEBPF }
    static var attachesToInterface: Bool { true }
    static var bindsPerInterface: Bool { true }
    /// Copies made in the kernel (bpf/include/fanout_pools.h), each keeping the client's source.
    static let replicates = true
    /// quic_lb in the kernel (bpf/include/fanout_quic.h); encrypted IDs with the BPF crypto kfuncs.
    static let routesQUIC = true

    static func validate(_ listener: Listener, index: Int, path: String, of config: FanoutConfig, localAddresses: Set<IPAddress>) throws(ConfigError) {
        switch listener.settings.output {
        case .socket, .xdpTX:
            if config.lines.isSet("\(path).settings.output") {
                throw config.configError("\(path).settings.output", "\(listener.settings.output.rawValue): \(listener.mode.rawValue) forwards in the kernel and always keeps the client's source (preserve_source); remove the key or choose mode userspace/af_xdp")
            }
        default: break
        }
        switch listener.replies {
        case .none: break
        case .nat:
            guard !FanoutConfig.isUnspecified(listener.bind.ip) else {
                throw config.configError("\(path).bind", "\(listener.bind): with replies nat the replies leave from the listener's address, so it must be the virtual address itself (e.g. 198.18.0.1:5683), not a wildcard")
            }
        case .relay: throw SharedChecks.relayNeedsUserspace(path: path, of: config)
        }
        try validateDownstreams(listener.downstreams, of: listener, path: path, config, localAddresses)
        if let encrypted = listener.quicLB.firstIndex(where: \.isEncrypted), let problem = TCKernelFeatures.quicCryptoProblem {
            let key = listener.quicLB.count > 1 ? "\(path).quic_lb[\(encrypted)]" : "\(path).quic_lb"
            throw config.configError(key, "an encrypted QUIC-LB configuration is decrypted in the kernel in mode \(listener.mode.rawValue), and \(problem): use plaintext server IDs (no key), or mode userspace, relay or af_xdp, which decrypt in the process (docs/quic.md)")
        }
        guard listener.pools.count <= Int(FANOUT_MAX_POOLS) else {
            throw config.configError("\(path).pools", "\(listener.pools.count) pools: \(listener.mode.rawValue) copies to at most \(FANOUT_MAX_POOLS) pools per listener")
        }
        for (position, pool) in listener.pools.enumerated() {
            let poolPath = "\(path).pools[\(position)]"
            if pool.output == .socket || pool.output == .xdpTX {
                throw config.configError("\(poolPath).output", "\(pool.output?.rawValue ?? ""): \(listener.mode.rawValue) copies in the kernel and always keeps the client's source (preserve_source); remove the key or choose mode userspace/af_xdp")
            }
            try validateDownstreams(pool.downstreams, of: listener, path: poolPath, config, localAddresses)
        }
    }

    /// tc_ebpf rewrites and routes at L3: a group's downstreams are other hosts of the listener's
    /// family, at most FANOUT_MAX_BACKENDS.
    private static func validateDownstreams(_ downstreams: [Downstream], of listener: Listener, path: String, _ config: FanoutConfig, _ localAddresses: Set<IPAddress>) throws(ConfigError) {
        guard downstreams.count <= Int(FANOUT_MAX_BACKENDS) else {
            throw config.configError("\(path).downstream", "\(downstreams.count) downstreams: \(listener.mode.rawValue) serves at most \(FANOUT_MAX_BACKENDS) per listener or pool")
        }
        for (position, downstream) in downstreams.enumerated() {
            let key = "\(path).downstream[\(position)].address"
            let ip = downstream.address.ip
            guard ip.family == listener.bind.ip.family else {
                throw config.configError(key, "\(downstream.address) is not of the listener's address family (\(listener.bind)): \(listener.mode.rawValue) rewrites the destination in place and cannot translate between IPv4 and IPv6")
            }
            if FanoutConfig.isUnspecified(ip) || downstream.address.port == 0 {
                throw config.configError(key, "\(downstream.address): \(listener.mode.rawValue) needs a concrete address and port")
            }
            if localAddresses.contains(ip) || ip.bytes.first == 127 || ip == IPAddress("::1")! {
                throw config.configError(key, "\(downstream.address) is an address of this host: \(listener.mode.rawValue) forwards to other hosts (routed through the kernel's fib); use mode userspace for local downstreams")
            }
        }
    }

    /// How many listeners the program's maps hold, which downstream answers for which nat
    /// listener, and one way of attaching per interface.
    static func validateTogether(_ config: FanoutConfig) throws(ConfigError) {
        let listeners = config.listeners
        // xdp listeners are entries in the same maps (TCDataplane serves both kinds).
        let tcListeners = listeners.filter(TCDataplane.serves)
        // A pool takes a listener's slot in the maps.
        let slots = tcListeners.reduce(0) { $0 + 1 + $1.pools.count }
        if slots > Int(FANOUT_MAX_LISTENERS) {
            throw config.configError("listeners", "\(tcListeners.count) tc_ebpf and xdp listeners with \(slots - tcListeners.count) pools: at most \(FANOUT_MAX_LISTENERS) listeners and pools together")
        }
        // Each pool's prefixes are in the map twice while a reload flips them.
        let prefixes = tcListeners.reduce(0) { $0 + $1.pools.reduce(0) { $0 + $1.sources.count } }
        if prefixes * 2 > Int(FANOUT_POOL_SOURCE_ENTRIES) {
            throw config.configError("listeners", "\(prefixes) pool sources prefixes over the tc_ebpf and xdp listeners: at most \(FANOUT_POOL_SOURCE_ENTRIES / 2)")
        }
        // A reply is matched to its listener by the downstream's address and port, so a
        // downstream answers for one nat listener only.
        var natDownstreams: [SocketAddress: Int] = [:]
        for (index, listener) in listeners.enumerated() where listener.replies == .nat {
            for (position, downstream) in listener.downstreams.enumerated() {
                if let other = natDownstreams[downstream.address], other != index {
                    throw config.configError("listeners[\(index)].downstream[\(position)].address", "\(downstream.address) is also a downstream of listener '\(listeners[other].name)' with replies nat: its replies could not be told apart; give each nat listener its own downstream ports")
                }
                natDownstreams[downstream.address] = index
            }
        }
        for (index, listener) in listeners.enumerated() where TCDataplane.serves(listener) {
            if let other = tcListeners.first(where: { $0.interface == listener.interface && $0.settings.tcAttach != listener.settings.tcAttach }) {
                throw config.configError("listeners[\(index)].settings.tc_attach", "\(listener.settings.tcAttach.rawValue) differs from listener '\(other.name)' on the same interface \(listener.interface ?? ""): one program per interface, set the same tc_attach")
            }
        }
    }

    /// The program rewrites in place (one family) and holds at most FANOUT_MAX_BACKENDS per listener.
    static func memberProblem(_ downstream: Downstream, of listener: Listener, accepted: Int) -> String? {
        if downstream.address.ip.family != listener.bind.ip.family {
            return "not of the listener's address family (\(listener.mode.rawValue) cannot translate between IPv4 and IPv6)"
        }
        return accepted < Int(FANOUT_MAX_BACKENDS) ? nil : "\(listener.mode.rawValue) serves at most \(FANOUT_MAX_BACKENDS) downstreams per listener"
    }

    /// The interface exists and forwards, each downstream has a route, and with replies nat the
    /// reply interfaces exist and forward (``TCPreflight``).
    static func preflight(_ listener: Listener, index: Int) -> (problems: [String], notes: [String]) {
        var problems = TCPreflight.problems(listener, index: index)
        if listener.replies == .nat { problems += TCPreflight.replyInterfaceProblems(listener, path: "listeners[\(index)]") }
        return (problems, [])
    }

    /// The reference's log line for a Kubernetes change of a tc_ebpf listener's maps.
    static func membershipApplied(_ listener: Listener, cause: String, downstreams: Int, logger: Logger) {
        guard cause == KubernetesSource.kind else { return }
        logger.info("tc_ebpf k8s membership updated", metadata: ["listener": "\(listener.name)", "downstreams": "\(downstreams)"])
    }

    func start(_ listener: Listener, _ context: ListenerContext) throws(DaemonError) -> any RunningListener {
        do {
            return try TCListener(listener, counters: context.counters, dataplane: dataplane, logger: context.logger)
        } catch {
            context.logger.error("tc_ebpf listener could not start", metadata: ["listener": "\(listener.name)", "error": "\(error)"])
            throw .listener(name: listener.name, error)
        }
    }

    /// A successor writes its map entry (keyed by bind and interface) over its predecessor's,
    /// which forwards until then. Only a change of how the interface is attached (tc_attach)
    /// stops the old listeners there first: the program is attached once per interface.
    func succession(of old: Listener, fresh: [Listener]) -> Succession {
        let reattached = fresh.contains { Self.serves($0) && $0.interface == old.interface && $0.settings.tcAttach != old.settings.tcAttach }
        return reattached
            ? .stopFirst(warning: "tc_attach changes: the program is attached again at this interface, so the old tc_ebpf listener stops before its successor starts; datagrams arriving in between pass to the host's stack (its Udp NoPorts counts them)")
            : .besideSuccessor
    }

    /// Steered by its map entry: no socket on the bind, nothing the kernel's hash could fall back to.
    var receivesOnBind: Bool { false }

    /// Packets no listener could be known for, by reason, and whether the next-hop cache is on
    /// (left out while no tc_ebpf or xdp listener runs).
    func metricsText() -> String {
        let unmatched = dataplane.unmatched()
        guard !unmatched.isEmpty else { return "" }
        var text = PrometheusText.family("udp_fanout_tc_unmatched_packets_total", "tc_ebpf packets passed to the kernel untouched because no listener could be known (malformed headers, a later fragment whose first was not seen, or not for any listener on that interface)",
                                         rows: unmatched.map { ("reason=\"\($0.0)\"", $0.1) })
        if let on = dataplane.nextHopCacheOn() {
            text += "# HELP udp_fanout_tc_next_hop_cache_on 1 while the tc_ebpf and xdp programs keep each downstream's route lookup (the next-hop cache), 0 while every datagram is looked up (the log says why: policy routing rules, a route over several next hops or by source)\n"
                + "# TYPE udp_fanout_tc_next_hop_cache_on gauge\nudp_fanout_tc_next_hop_cache_on \(on ? 1 : 0)\n"
        }
        return text
    }
}
