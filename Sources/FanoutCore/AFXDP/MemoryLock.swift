// SPDX-License-Identifier: Apache-2.0
import BPFSupport
import ReusePortLB
import SystemCalls

#if canImport(Glibc)
import Glibc
#endif

/// Locked memory for AF_XDP UMEMs. The kernel pins every UMEM page and charges it to the
/// user's RLIMIT_MEMLOCK (summed over all the user's processes) unless the process has
/// CAP_IPC_LOCK; over the limit, UMEM registration fails with ENOBUFS. Distributions default
/// to 8 MiB, less than one queue's default UMEM (16 MiB).
enum MemoryLock {
    static let capIPCLock = 14
    static let capSysResource = 24
    static let unlimited = UInt64(bitPattern: Int64(-1))  // RLIM_INFINITY

    /// What `ensure` does for given limits.
    enum Plan: Equatable {
        /// Nothing: the limit already fits, or the UMEM is not charged (CAP_IPC_LOCK).
        case enough
        /// setrlimit with these soft and hard values.
        case raise(soft: UInt64, hard: UInt64)
        /// Neither possible: the hard limit is too low and may not be raised.
        case impossible
    }

    /// Decides how to fit `needed` bytes: raise the soft limit up to the hard one, and the hard
    /// one too when privileged (CAP_SYS_RESOURCE).
    static func plan(needed: Int, soft: UInt64, hard: UInt64, exempt: Bool, canRaiseHard: Bool) -> Plan {
        let needed = UInt64(max(needed, 0))
        if exempt || soft == unlimited || soft >= needed { return .enough }
        if hard == unlimited || hard >= needed { return .raise(soft: needed, hard: hard) }
        return canRaiseHard ? .raise(soft: needed, hard: needed) : .impossible
    }

    /// Makes RLIMIT_MEMLOCK fit `bytes` of UMEM, raising it when allowed.
    /// - Parameters:
    ///   - bytes: every UMEM this process will register (queues × frame size × frame count),
    ///     since the kernel sums them.
    ///   - exempt, canRaiseHard: whether the process has CAP_IPC_LOCK / CAP_SYS_RESOURCE; read
    ///     from the process's capabilities when nil (tests pass them).
    /// - Throws: `XSKError.memoryLock` naming the limits and the fixes (CAP_IPC_LOCK,
    ///   LimitMEMLOCK=infinity, ulimit -l) when the limit cannot be raised. Calls getrlimit(2)
    ///   and setrlimit(2).
    static func ensure(bytes: Int, exempt: Bool? = nil, canRaiseHard: Bool? = nil) throws(XSKError) {
        let limit: rlimit
        do {
            limit = try Syscall.getrlimit(Syscall.Resource.lockedMemory)
        } catch {
            throw .memoryLock(needed: bytes, soft: 0, hard: 0, errno: error.errno)
        }
        let capabilities = Capabilities.current()
        switch plan(needed: bytes, soft: UInt64(limit.rlim_cur), hard: UInt64(limit.rlim_max),
                    exempt: exempt ?? capabilities.has(capIPCLock), canRaiseHard: canRaiseHard ?? capabilities.has(capSysResource)) {
        case .enough:
            return
        case .impossible:
            throw .memoryLock(needed: bytes, soft: UInt64(limit.rlim_cur), hard: UInt64(limit.rlim_max), errno: 0)
        case let .raise(soft, hard):
            do {
                try Syscall.setrlimit(Syscall.Resource.lockedMemory, rlimit(rlim_cur: rlim_t(soft), rlim_max: rlim_t(hard)))
            } catch {
                throw .memoryLock(needed: bytes, soft: UInt64(limit.rlim_cur), hard: UInt64(limit.rlim_max), errno: error.errno)
            }
        }
    }
}
