// SPDX-License-Identifier: Apache-2.0
import Logging
import ReusePortLB

/// A userspace listener: one-way ``SocketWorker``s on the listener's own socket group
/// (``SocketGroupListener``: joined before any thread starts, steering nothing until
/// ``activate()``, the old instance stopped after its successor took the bind over).
final class UserspaceListener: RunningListener {
    let group: SocketGroupListener

    /// - Parameter passiveHealth: told a downstream's address when a send to it got ICMP port
    ///   unreachable (at most once per batch per downstream and worker); nil: not reported.
    /// - Parameter descriptors: the service manager's store (sockets handed over by a previous
    ///   process on this bind are read out, this listener's are stored); nil: not used.
    init(_ config: Listener, counters: ListenerCounters, logger: Logger,
         passiveHealth: (@Sendable (SocketAddress) -> Void)? = nil, descriptors: DescriptorStore? = nil) throws(ReusePortError) {
        group = try SocketGroupListener.oneWay(config, counters: counters, logger: logger, passiveHealth: passiveHealth, descriptors: descriptors)
    }

    var isReceiving: Bool { group.isReceiving }
    func heartbeats() -> [PathHeartbeat] { group.heartbeats() }
    func activate() throws(DaemonError) { try group.activate() }
    var takesOverExactly: Bool { group.takesOverExactly }

    /// Swaps the downstreams, balancing and pools in place: workers pick it up at their next batch.
    func update(downstreams: [Downstream], balancing: Balancing, quicLB: [QUICLBConfiguration], pools: [Pool], keeping: Set<String>) -> Bool {
        group.replacePlan(downstreams: downstreams, balancing: balancing, quicLB: quicLB, pools: pools)
        return true
    }

    /// Stops the workers: each forwards what its socket holds, leaves the group, and returns.
    func shutdown() { group.shutdown() }
    /// As ``shutdown()``, each worker sealing its socket first (another instance receives).
    func retire() { group.shutdown(sealing: true) }
}
