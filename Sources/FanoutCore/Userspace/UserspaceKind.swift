/// userspace: recvmmsg/sendmmsg workers on a SO_REUSEPORT group of the bind (ReusePortLB).
struct UserspaceKind: ListenerKind {
    func serves(_ listener: Listener) -> Bool { listener.mode == .userspace }

    func start(_ listener: Listener, _ context: ListenerContext) throws(DaemonError) -> any RunningListener {
        do {
            return try UserspaceListener(listener, counters: context.counters, logger: context.logger, passiveHealth: context.refused)
        } catch {
            throw .listener(name: listener.name, error)
        }
    }
}
