/// relay (`mode: userspace` with `replies: relay`): two-way in userspace, a session socket per
/// client towards its downstream, replies relayed from the listener's address.
struct RelayKind: ListenerKind {
    func serves(_ listener: Listener) -> Bool { listener.mode == .userspace && listener.replies == .relay }

    /// Its workers are userspace workers with a relay loop (``RelayWorker``).
    func start(_ listener: Listener, _ context: ListenerContext) throws(DaemonError) -> any RunningListener {
        try UserspaceKind().start(listener, context)
    }

    /// A successor with eBPF steering on exactly the same bind gets every new request, so the
    /// old sessions can drain (another address on the port, even a wildcard, is another kernel
    /// group: the old sockets would keep receiving there).
    var drainsOnHandOver: Bool { true }
}
