/// tc_ebpf: in-kernel DNAT, fib lookup and redirect at the interface's tc hook. One program per
/// interface (``TCDataplane``), shared by that interface's listeners, each a map entry.
struct TCKind: ListenerKind {
    let dataplane: TCDataplane

    func serves(_ listener: Listener) -> Bool { listener.mode == .tcEBPF }

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
        let reattached = fresh.contains { serves($0) && $0.interface == old.interface && $0.settings.tcAttach != old.settings.tcAttach }
        return reattached
            ? .stopFirst(warning: "tc_attach changes: the program is attached again at this interface, so the old tc_ebpf listener stops before its successor starts; datagrams arriving in between pass to the host's stack (its Udp NoPorts counts them)")
            : .besideSuccessor
    }

    /// Steered by its map entry: no socket on the bind, nothing the kernel's hash could fall back to.
    var receivesOnBind: Bool { false }

    /// Packets no listener could be known for, by reason (left out while no tc_ebpf listener runs).
    func metricsText() -> String {
        let unmatched = dataplane.unmatched()
        guard !unmatched.isEmpty else { return "" }
        return PrometheusText.family("udp_fanout_tc_unmatched_packets_total", "tc_ebpf packets passed to the kernel untouched because no listener could be known (malformed headers, a later fragment whose first was not seen, or not for any listener on that interface)",
                                     rows: unmatched.map { ("reason=\"\($0.0)\"", $0.1) })
    }
}
