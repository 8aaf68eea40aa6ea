import Logging
import ReusePortLB
import Synchronization

/// One kind of listener (userspace, relay, tc_ebpf, af_xdp): everything the daemon does with a
/// listener it does through its kind, without knowing which kind it is. A kind is a type in its
/// own folder, registered in ``ListenerKinds``.
protocol ListenerKind: Sendable {
    /// True for the listeners of this kind (by `mode`, and `replies` for relay).
    func serves(_ listener: Listener) -> Bool
    /// Starts the running instance of `listener` (not yet steering its bind:
    /// ``RunningListener/activate()`` follows). A failure is thrown as ``DaemonError/listener(name:_:)``.
    func start(_ listener: Listener, _ context: ListenerContext) throws(DaemonError) -> any RunningListener
    /// How a running instance of `old` makes way when a change starts `fresh` (new or changed
    /// listeners of every kind). Default: it runs on beside its successor until that one took
    /// its bind over.
    func succession(of old: Listener, fresh: [Listener]) -> Succession
    /// True when its instances receive on a socket group of their bind: a successor on an
    /// overlapping bind takes the group over, and one that cannot fall back to the kernel's hash
    /// over its sockets. False (tc_ebpf): it steers by a map entry and has no socket on the bind.
    var receivesOnBind: Bool { get }
    /// True when a retiring instance drains its sessions after a successor of this kind took
    /// exactly its bind over (``RunningListener/handOver(drainSecs:drained:)``).
    var drainsOnHandOver: Bool { get }
    /// Exposition text of what the kind counts beyond its listeners (empty: nothing).
    func metricsText() -> String
}

extension ListenerKind {
    func succession(of old: Listener, fresh: [Listener]) -> Succession { .besideSuccessor }
    var receivesOnBind: Bool { true }
    var drainsOnHandOver: Bool { false }
    func metricsText() -> String { "" }
}

/// How an old instance makes way for the listeners a change starts.
enum Succession: Sendable {
    /// Runs beside its successor, which takes its bind over; it stops after, forwarding what its
    /// sockets still hold.
    case besideSuccessor
    /// Stops before its successor starts (what it holds can be held once only); `warning` says
    /// what that costs, logged with the listener and its interface.
    case stopFirst(warning: Logger.Message)
    /// Gives up its interface (``RunningListener/releaseInterface()``) before its successor
    /// starts, still receiving on its bind until the successor took it over.
    case releaseFirst
}

/// What the daemon gives a kind to start a listener with.
struct ListenerContext: Sendable {
    /// The listener's counters (kept across its instances while its mode stays).
    let counters: ListenerCounters
    let logger: Logger
    /// Passive health: a downstream refused a datagram (ICMP port unreachable on a send).
    let refused: @Sendable (SocketAddress) -> Void
    /// What the kind keeps across the listener's instances (reloads), made once per name.
    let kept: KeptState
}

/// State kinds keep across a listener's instances, by listener name and type.
final class KeptState: Sendable {
    private let values = Mutex<[String: any Sendable]>([:])

    /// The value kept for `listener` of type `T`, made by `make` the first time.
    func value<T: Sendable>(_ listener: String, make: () -> T) -> T {
        values.withLock { values in
            let key = "\(T.self)/\(listener)"
            if let existing = values[key] as? T { return existing }
            let made = make()
            values[key] = made
            return made
        }
    }
}

/// The kinds this daemon runs, in the order their ``ListenerKind/serves(_:)`` is asked.
struct ListenerKinds: Sendable {
    let all: [any ListenerKind]
    /// Serves a listener no other kind does (every `mode: userspace` listener but relay ones).
    private let fallback: any ListenerKind

    init(logger: Logger) {
        fallback = UserspaceKind()
        all = [TCKind(dataplane: TCDataplane(logger: logger)), AFXDPKind(), RelayKind(), fallback]
    }

    func kind(for listener: Listener) -> any ListenerKind {
        all.first { $0.serves(listener) } ?? fallback
    }

    /// Every kind's own exposition text, in registry order.
    func metricsText() -> String {
        all.map { $0.metricsText() }.joined()
    }
}
