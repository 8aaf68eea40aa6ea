// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim

/// The kernel's RCU grace period, seen from user space. The kernel selects a reuseport socket
/// (running the group's program, reading its map) and queues the datagram on it in one RCU
/// read-side section of the receive softirq. A program replaced or a map entry deleted can
/// therefore still have a selection in flight: it lands on the old socket a moment later. That
/// moment is usually microseconds, but a CPU stalled in between (a virtual CPU the host
/// deschedules) stretches it without bound. Once a grace period has passed, every such selection
/// has been queued, so a final read of the old socket finds it.
public enum KernelGracePeriod {
    /// Whether this kernel gives a grace period to wait for (membarrier(2) lists
    /// MEMBARRIER_CMD_GLOBAL); if not, activate() and withdraw() wait ``fallback`` instead, which
    /// covers any stall seen in practice but is not a guarantee: a caller says so once.
    public static let isAvailable = shim_kernel_grace_period_available() == 1

    /// The fallback wait when the kernel refuses membarrier(2): longer than any stall seen in
    /// practice, not a guarantee.
    public static let fallback = Duration.milliseconds(50)

    /// Returns once every packet whose reception began before the call is queued on its socket:
    /// membarrier(2) `MEMBARRIER_CMD_GLOBAL`, which is synchronize_rcu() (some milliseconds to
    /// tens of milliseconds). Returns false when the kernel refuses it (nohz_full, a seccomp
    /// filter): ``fallback`` has then passed instead.
    @discardableResult
    static func wait() -> Bool {
        if shim_kernel_grace_period() == 0 { return true }
        let (seconds, attoseconds) = fallback.components
        usleep(UInt32(seconds) * 1_000_000 + UInt32(attoseconds / 1_000_000_000_000))
        return false
    }
}
