// SPDX-License-Identifier: Apache-2.0
/// A step of the transaction that moves running listeners to a new configuration (see
/// `FanoutDaemon.transitionLocked`), where a test can inject a failure
/// (``FanoutDaemon/failureInjection``).
package enum TransitionStep: String, Sendable, CaseIterable {
    /// The old instance gives up what only one instance can hold, before its successor starts: a
    /// tc_ebpf listener is stopped (its map entries are keyed by bind and interface), an af_xdp
    /// listener releases its interface's XDP hook and queues. Userspace listeners have no such
    /// step: their old instance stops only after the change committed.
    case release
    /// A listener's instance starts: a new or changed one beside the old one, or, in a
    /// rollback, the old one again after it was released.
    case start
    /// The new instance takes its bind over (``RunningListener/activate()``).
    case activate
}

extension FanoutDaemon {
    /// Throws ``DaemonError/injected(name:step:)`` when a test's ``failureInjection`` asks for a
    /// failure at `step` of `listener`; nothing in production.
    func failIfInjected(_ step: TransitionStep, _ listener: String) throws(DaemonError) {
        if let inject = failureInjection.withLock({ $0 }), inject(step, listener) {
            throw .injected(name: listener, step: step)
        }
    }
}
