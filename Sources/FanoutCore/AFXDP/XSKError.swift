// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif

/// Why an AF_XDP socket, its UMEM or the locked memory for it could not be set up. Every
/// message names the failing call, its errno and the fix.
package enum XSKError: Error, CustomStringConvertible, Equatable, Sendable {
    /// A configuration value the kernel would refuse.
    case invalidConfig(String)
    /// RLIMIT_MEMLOCK is below `needed` bytes and cannot be raised (`setrlimit` failed with errno, or 0 when the
    /// hard limit alone is too low).
    case memoryLock(needed: Int, soft: UInt64, hard: UInt64, errno: Int32)
    /// The interface's RX queues could not be counted.
    case queueCount(interface: String, call: String, errno: Int32)
    /// The UMEM could not be mapped or registered (`mmap`, `xsk_umem__create`).
    case umem(interface: String, queue: UInt32, call: String, errno: Int32, bytes: Int)
    /// The socket could not be created or bound to the queue (`socket`, `xsk_socket__create`).
    /// `queueCount` is the interface's RX queue count when the queue is out of range.
    case socket(interface: String, queue: UInt32, call: String, errno: Int32, zeroCopy: Bool, queueCount: Int?)
    /// A socket option (busy polling) was refused.
    case socketOption(interface: String, queue: UInt32, option: String, errno: Int32)

    package var description: String {
        switch self {
        case .invalidConfig(let problem):
            return "AF_XDP settings: \(problem)"
        case let .memoryLock(needed, soft, hard, error):
            let limits = "RLIMIT_MEMLOCK is \(Self.limit(soft)) (hard \(Self.limit(hard))), AF_XDP needs \(needed) bytes of locked memory for its UMEM"
            let call = error == 0 ? "the hard limit is too low" : "setrlimit failed: \(Self.text(error))"
            return "\(limits); \(call): run with CAP_IPC_LOCK (exempts the UMEM from the limit), "
                + "or raise the limit: LimitMEMLOCK=infinity in the systemd unit, ulimit -l unlimited, "
                + "or --ulimit memlock=-1 for a container; or lower settings.umem_frames / the number of queues"
        case let .queueCount(interface, call, error):
            return "cannot count the RX queues of \(interface): \(call) failed: \(Self.text(error))"
                + (error == ENODEV ? ": no such interface in this network namespace; check the listener's interface" : "")
        case let .umem(interface, queue, call, error, bytes):
            let prefix = "AF_XDP UMEM of \(bytes) bytes for \(interface) queue \(queue): \(call) failed: \(Self.text(error))"
            // xsk_umem__create's ENOBUFS/ENOMEM/EPERM come from charging and pinning the pages:
            // socket creation, where EPERM means a missing capability, is probed first under its
            // own name ("socket").
            let pinning = call == "xsk_umem__create"
            switch error {
            case ENOBUFS where pinning, ENOMEM where pinning, EPERM where pinning:
                return prefix + ": locked memory is exhausted (the UMEM counts against RLIMIT_MEMLOCK unless the process has "
                    + "CAP_IPC_LOCK): set LimitMEMLOCK=infinity in the systemd unit (ulimit -l unlimited), grant CAP_IPC_LOCK, "
                    + "or lower settings.umem_frames"
            case EPERM, EACCES:
                return prefix + ": AF_XDP sockets need CAP_NET_RAW (and CAP_BPF or CAP_SYS_ADMIN for the XDP program); "
                    + "grant them (AmbientCapabilities= in the systemd unit, securityContext.capabilities in Kubernetes) or run as root"
            case EAFNOSUPPORT:
                return prefix + ": this kernel has no AF_XDP sockets (CONFIG_XDP_SOCKETS); use mode tc_ebpf or userspace"
            default:
                return prefix
            }
        case let .socket(interface, queue, call, error, zeroCopy, queueCount):
            let prefix = "AF_XDP socket for \(interface) queue \(queue) (\(zeroCopy ? "zero-copy" : "copy mode")): \(call) failed: \(Self.text(error))"
            switch error {
            case EBUSY:
                return prefix + ": another AF_XDP socket is bound to this queue (another udp-fanout, or a leftover process); "
                    + "stop it, or use settings.queues to leave this queue out"
            case EINVAL where queueCount.map({ Int(queue) >= $0 }) == true:
                return prefix + ": \(interface) has \(queueCount!) RX queue\(queueCount == 1 ? "" : "s") (0...\(queueCount! - 1)); "
                    + "fix settings.queues, or add queues with ethtool -L \(interface) combined N"
            case EOPNOTSUPP where zeroCopy:
                return prefix + ": the driver of \(interface) has no AF_XDP zero-copy support (or the XDP program runs in "
                    + "generic mode); set settings.zero_copy: auto (falls back to copy mode) or off"
            case ENODEV, ENXIO:
                return prefix + ": no such interface in this network namespace; check the listener's interface"
            case EPERM, EACCES:
                return prefix + ": AF_XDP sockets need CAP_NET_RAW; grant it or run as root"
            case ENETDOWN:
                return prefix + ": the interface is down; bring it up (ip link set \(interface) up)"
            default:
                return prefix
            }
        case let .socketOption(interface, queue, option, error):
            return "AF_XDP socket for \(interface) queue \(queue): setsockopt \(option) failed: \(Self.text(error))"
                + (error == EPERM ? ": a busy-poll budget above the default needs CAP_NET_ADMIN; grant it or set settings.busy_poll: false"
                    : ": this kernel may lack preferred busy polling (5.11+); set settings.busy_poll: false")
        }
    }

    private static func text(_ error: Int32) -> String { "\(String(cString: strerror(error))) (errno \(error))" }

    private static func limit(_ value: UInt64) -> String {
        value == UInt64(bitPattern: Int64(-1)) ? "unlimited" : "\(value) bytes"
    }
}
