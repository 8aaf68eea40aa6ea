// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import ReusePortLB

/// af_xdp: an XDP program steers the listener's datagrams into AF_XDP sockets (one per queue),
/// and a companion socket on the bind receives what the program passes.
struct AFXDPKind: ListenerKind {
    static let name = Mode.afXDP.rawValue
    static let withoutWorkers: String? = "one forwarder per RX queue: settings.queues"
    static func serves(_ listener: Listener) -> Bool { listener.mode == .afXDP }
    static var attachesToInterface: Bool { true }
    /// Each frame's payload to every pool from UMEM, through the pools' sockets (socket or
    /// preserve_source; a listener's xdp_tx leaves pools as preserve_source).
    static let replicates = true
    static let routesQUIC = true
    /// Its steering program holds the interface's XDP hook.
    static let holdsXDPHook = true

    static func validate(_ listener: Listener, index: Int, path: String, of config: FanoutConfig, localAddresses: Set<IPAddress>) throws(ConfigError) {
        try SharedChecks.sourcePreservingFamilies(listener, path: path, of: config)
        if listener.settings.zeroCopy == .on && listener.settings.xdpMode == .generic {
            throw config.configError("\(path).settings.zero_copy", "on with xdp_mode: generic cannot bind: zero-copy needs the driver's XDP hook (xdp_mode: native or auto), or set zero_copy: auto/off")
        }
        if let other = config.listeners[..<index].firstIndex(where: { serves($0) && $0.interface == listener.interface }) {
            throw config.configError("\(path).interface", "\(listener.interface ?? "") already serves listener '\(config.listeners[other].name)': one af_xdp listener per interface (its AF_XDP sockets hold the interface's queues); use another interface, or mode userspace/tc_ebpf for this bind")
        }
        if listener.settings.umemFrames < 2 * listener.settings.ringSize {
            throw config.configError("\(path).settings.umem_frames", "\(listener.settings.umemFrames) frames: must be at least twice ring_size (\(listener.settings.ringSize)), so the fill ring stays full while frames are in flight")
        }
        switch listener.replies {
        case .none: break
        case .nat: throw SharedChecks.natNeedsTC(path: path, of: config)
        case .relay: throw SharedChecks.relayNeedsUserspace(path: path, of: config)
        }
    }

    /// Its companion socket's bind is free of other processes (``Preflight/bindProblems(_:index:)``),
    /// and its interface exists, carries no other tool's XDP program and has the queues asked for.
    static func preflight(_ listener: Listener, index: Int) -> (problems: [String], notes: [String]) {
        var (problems, notes) = Preflight.bindProblems(listener, index: index)
        let interface = listener.interface ?? ""
        let ifindex = if_nametoindex(interface)
        guard ifindex > 0 else {
            problems.append("listeners[\(index)].interface: listener '\(listener.name)': interface '\(interface)' not found in this network namespace: fix the name (ip link show lists them) or create the interface first")
            return (problems, notes)
        }
        // The start's own check: another tool's XDP program on the interface refuses it.
        let xdp = XDPAttachment.preflight(listener, index: index, ifindex: ifindex, ours: FANOUT_PROG_XDP_NAME, kind: "af_xdp daemon")
        problems += xdp.problems
        notes += xdp.notes
        if listener.settings.queues > 0, let available = try? RXQueues.count(interface: interface), listener.settings.queues > available {
            problems.append("listeners[\(index)].settings.queues: listener '\(listener.name)': \(listener.settings.queues) but \(interface) has \(available) RX queue(s): lower it (0 serves them all)")
        }
        return (problems, notes)
    }

    func start(_ listener: Listener, _ context: ListenerContext) throws(DaemonError) -> any RunningListener {
        // Ring, socket and XDP counters stay across the listener's instances (even across a change
        // of mode and back, which starts its other counters again).
        let afxdp = context.kept.value(listener.name) { AFXDPCounters(listener: listener.name) }
        context.counters.modeMetrics.withLock { $0 = { afxdp.metricsText(mode: Mode.afXDP.rawValue) } }
        do {
            return try AFXDPListener(listener, counters: context.counters, afxdp: afxdp, logger: context.logger, passiveHealth: context.refused,
                                     descriptors: context.descriptors)
        } catch {
            context.logger.error("af_xdp listener could not start", metadata: ["listener": "\(listener.name)", "error": "\(error)"])
            throw .listener(name: listener.name, error)
        }
    }

    /// The interface's XDP hook and queues are held once: a successor on the same interface gets
    /// them released first, while the old companion socket keeps receiving on the bind.
    func succession(of old: Listener, fresh: [Listener]) -> Succession {
        fresh.contains { Self.serves($0) && $0.interface == old.interface } ? .releaseFirst : .besideSuccessor
    }
}
