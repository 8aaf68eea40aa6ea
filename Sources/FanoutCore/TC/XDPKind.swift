// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import Logging
import ReusePortLB

/// xdp: tc_ebpf's forwarding at the driver's XDP hook. It lives beside TCKind because it is the
/// same dataplane with one more program in front. A listener is an entry in the tc program's
/// maps (``TCDataplane``, shared with tc_ebpf) and an XDP program (bpf/xdp_fanout.bpf.c,
/// ``XDPFront``) loaded with those maps sits in front of the tc program at its interfaces: it
/// finishes what it can before the kernel builds a socket buffer and passes the rest, counted by
/// reason, for the tc program to finish.
struct XDPKind: ListenerKind {
    let dataplane: TCDataplane
    let front: XDPFront

    static let name = Mode.xdp.rawValue
    static let withoutWorkers = TCKind.withoutWorkers
    static func serves(_ listener: Listener) -> Bool { listener.mode == .xdp }
    static var attachesToInterface: Bool { true }
    static var bindsPerInterface: Bool { true }
    /// The copies are tc's (bpf_clone_redirect): a listener with pools is passed to it, counted `pools`.
    static let replicates = true
    /// quic_lb in the kernel (bpf/include/fanout_quic.h); encrypted IDs with the BPF crypto kfuncs.
    static let routesQUIC = true
    /// Its program sits at the interface's XDP hook (and at a nat listener's reply interfaces').
    static let holdsXDPHook = true

    /// tc_ebpf's keys and limits (the same maps and rewrite), and xdp_mode's.
    static func validate(_ listener: Listener, index: Int, path: String, of config: FanoutConfig, localAddresses: Set<IPAddress>) throws(ConfigError) {
        try TCKind.validate(listener, index: index, path: path, of: config, localAddresses: localAddresses)
    }

    /// tc_ebpf's checks across the shared maps (TCKind's, which counts both kinds), and one XDP
    /// program per interface: an af_xdp listener there would need the hook too, and every xdp
    /// listener of an interface attaches in the same xdp_mode.
    static func validateTogether(_ config: FanoutConfig) throws(ConfigError) {
        let listeners = config.listeners
        for (index, listener) in listeners.enumerated() where serves(listener) {
            if let other = listeners.first(where: { !serves($0) && ListenerKinds.holdsXDPHook($0) && $0.interface == listener.interface }) {
                throw config.configError("listeners[\(index)].interface", "\(listener.interface ?? "") also serves \(other.mode.rawValue) listener '\(other.name)': an interface runs one XDP program, and both kinds need it; put one of them on another interface, or use mode tc_ebpf for this listener (the same forwarding at the tc hook)")
            }
            if let other = listeners.first(where: { serves($0) && $0.interface == listener.interface && $0.settings.xdpMode != listener.settings.xdpMode }) {
                throw config.configError("listeners[\(index)].settings.xdp_mode", "\(listener.settings.xdpMode.rawValue) differs from listener '\(other.name)' on the same interface \(listener.interface ?? ""): one XDP program per interface, set the same xdp_mode")
            }
        }
        for (index, listener) in listeners.enumerated() where serves(listener) && listener.replies == .nat {
            for interface in listener.settings.replyInterfaces {
                if let other = listeners.first(where: { !serves($0) && ListenerKinds.holdsXDPHook($0) && $0.interface == interface }) {
                    throw config.configError("listeners[\(index)].settings.reply_interfaces", "\(interface) serves \(other.mode.rawValue) listener '\(other.name)': the xdp program attaches where replies arrive, and an interface runs one XDP program; use mode tc_ebpf for this listener or another interface")
                }
            }
        }
    }

    static func memberProblem(_ downstream: Downstream, of listener: Listener, accepted: Int) -> String? {
        TCKind.memberProblem(downstream, of: listener, accepted: accepted)
    }

    /// tc_ebpf's (interface, forwarding, routes, reply interfaces), and no other tool's XDP
    /// program on the interface.
    static func preflight(_ listener: Listener, index: Int) -> (problems: [String], notes: [String]) {
        var (problems, notes) = TCKind.preflight(listener, index: index)
        let interface = listener.interface ?? ""
        let ifindex = if_nametoindex(interface)
        guard ifindex > 0 else { return (problems, notes) }
        let xdp = XDPAttachment.preflight(listener, index: index, ifindex: ifindex, ours: FANOUT_PROG_XFWD_NAME, kind: "daemon's xdp program")
        problems += xdp.problems
        notes += xdp.notes
        return (problems, notes)
    }

    func start(_ listener: Listener, _ context: ListenerContext) throws(DaemonError) -> any RunningListener {
        do {
            return try TCListener(listener, counters: context.counters, dataplane: dataplane, front: (front, listener.settings.xdpMode), logger: context.logger)
        } catch {
            context.logger.error("xdp listener could not start", metadata: ["listener": "\(listener.name)", "error": "\(error)"])
            throw .listener(name: listener.name, error)
        }
    }

    /// As tc_ebpf: a successor writes its map entry over its predecessor's. A change of how the
    /// interface is attached (tc_attach, xdp_mode) stops the old listeners there first.
    func succession(of old: Listener, fresh: [Listener]) -> Succession {
        let reattached = fresh.contains {
            TCDataplane.serves($0) && $0.interface == old.interface && ($0.settings.tcAttach != old.settings.tcAttach || (Self.serves($0) && $0.settings.xdpMode != old.settings.xdpMode))
        }
        return reattached
            ? .stopFirst(warning: "tc_attach or xdp_mode changes: the programs are attached again at this interface, so the old xdp listener stops before its successor starts; datagrams arriving in between pass to the host's stack (its Udp NoPorts counts them)")
            : .besideSuccessor
    }

    var receivesOnBind: Bool { false }

    /// What the XDP program passed to the tc program, by listener and reason (left out while no
    /// xdp listener ever ran).
    func metricsText() -> String {
        guard let passed = front.passed() else { return "" }
        return PrometheusText.family("udp_fanout_xdp_passed_total", "xdp datagrams of a listener that the XDP program passed to the stack for the tc program at the same interface to finish (and count), by reason: no_neighbour (the next hop's MAC unresolved), too_large (over the route's MTU), fragment (a later fragment whose first did not leave at XDP), pools (replication copies are made by tc), no_xdp_xmit (the route leaves through an interface that cannot transmit XDP frames), checksum_partial (a UDP checksum left for offload by a local sender, as through a veth)",
                                     rows: passed.map { ("listener=\"\($0.listener)\",reason=\"\($0.reason)\"", $0.count) })
    }
}
