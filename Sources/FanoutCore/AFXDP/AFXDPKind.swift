/// af_xdp: an XDP program steers the listener's datagrams into AF_XDP sockets (one per queue),
/// and a companion socket on the bind receives what the program passes.
struct AFXDPKind: ListenerKind {
    func serves(_ listener: Listener) -> Bool { listener.mode == .afXDP }

    func start(_ listener: Listener, _ context: ListenerContext) throws(DaemonError) -> any RunningListener {
        // Ring, socket and XDP counters stay across the listener's instances, as its counters do.
        let afxdp = context.kept.value(listener.name) { AFXDPCounters(listener: listener.name) }
        context.counters.modeMetrics.withLock { $0 = { afxdp.metricsText(mode: Mode.afXDP.rawValue) } }
        do {
            return try AFXDPListener(listener, counters: context.counters, afxdp: afxdp, logger: context.logger, passiveHealth: context.refused)
        } catch {
            context.logger.error("af_xdp listener could not start", metadata: ["listener": "\(listener.name)", "error": "\(error)"])
            throw .listener(name: listener.name, error)
        }
    }

    /// The interface's XDP hook and queues are held once: a successor on the same interface gets
    /// them released first, while the old companion socket keeps receiving on the bind.
    func succession(of old: Listener, fresh: [Listener]) -> Succession {
        fresh.contains { serves($0) && $0.interface == old.interface } ? .releaseFirst : .besideSuccessor
    }
}
