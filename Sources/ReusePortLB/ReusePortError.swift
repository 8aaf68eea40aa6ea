// SPDX-License-Identifier: Apache-2.0
/// Everything that can go wrong joining, using or leaving a group. Each description names the
/// problem and, where there is one, the fix.
public enum ReusePortError: Error, CustomStringConvertible, Sendable, Equatable {
    case invalidCapacity(Int)
    case slotOutOfRange(slot: Int, capacity: Int)
    case slotInUse(slot: Int)
    case groupFull(capacity: Int)
    case groupSettingsMismatch(group: String, existing: String, requested: String)
    case addressInUse(SocketAddress)
    case bpffsUnavailable(path: String, reason: String)
    case ebpfUnavailable(reason: String)
    case countersUnavailable(Steering)
    case policyNeedsEBPF(BalancePolicy, SteeringPreference)
    case system(SystemCallError)
    /// A process-private group's address is already bound by a socket of another process
    /// (which the kernel would put in the same SO_REUSEPORT group): its pid and command where
    /// /proc shows them.
    case addressServedByAnotherProcess(SocketAddress, pid: Int32?, command: String?)
    /// A member without eBPF would replace the eBPF program of a running group for every member.
    case steeringConflict(group: SocketAddress, running: String, requested: Steering)
    /// A takeover asked where the steering in force cannot hand a slot over.
    case takeoverNeedsEBPF(Steering)
    /// Sockets are bound on the address but no group is pinned in this bpffs: the other members
    /// use another bpffs mount (or do not use ReusePortLB's eBPF steering).
    case bpffsNotShared(SocketAddress, bpffs: String, sockets: Int)
    /// ``ReusePortGroup/activate()`` found no member of the group to attach through.
    case noLiveMember(SocketAddress)
    /// An address no group can use (port 0).
    case invalidAddress(SocketAddress, reason: String)
    /// A socket handed over by another process (the service manager's descriptor store) is not
    /// a UDP socket bound to the listener's address.
    case handedOverMismatch(SocketAddress, reason: String)
    /// A ``FlowTemplateStore`` cannot be opened for this member.
    case templateStoreUnavailable(reason: String)
    /// Routing by QUIC connection ID (``GroupOptions/quic``) cannot be served as asked
    /// (`errno` EOPNOTSUPP), a server ID does not fit the group (EINVAL), or another live member
    /// holds it (EEXIST): the C API returns it negated.
    case connectionIDRouting(String, errno: Int32)

    /// Why port 0 is refused.
    public static let portZeroReason = "port 0 is not a group's port: the kernel would bind each member to its own random port; use 1...65535"

    public var description: String {
        switch self {
        case .invalidCapacity(let capacity):
            return "capacity \(capacity) is out of range: a group has 1...\(ReusePortMember.maximumCapacity) slots"
        case .slotOutOfRange(let slot, let capacity):
            return "slot \(slot) is out of range for a group of capacity \(capacity) (valid: 0...\(capacity - 1))"
        case .slotInUse(let slot):
            return "slot \(slot) is held by a live member; choose another index, or take it over (SlotRequest.takeover, collector --takeover, reuseportlb_takeover)"
        case .groupFull(let capacity):
            return "every slot of the group (capacity \(capacity)) is held by a live member"
        case .groupSettingsMismatch(let group, let existing, let requested):
            return "group \(group) exists with \(existing), but this member asked for \(requested): use the group's settings, or stop every member to recreate it"
        case .addressInUse(let address):
            return "\(address) is in use by a socket without SO_REUSEPORT (or owned by another user): stop that process or use another port"
        case .bpffsUnavailable(let path, let reason):
            return "bpffs at \(path) cannot be used (\(reason)): mount it (`mount -t bpf bpf \(path)` as root) and let this user create \(path)/reuseportlb, or use steering automatic or classicBPF"
        case .ebpfUnavailable(let reason):
            return "eBPF steering is unavailable: \(reason); grant CAP_BPF or use steering automatic/classicBPF"
        case .countersUnavailable(let steering):
            return "kernel counters exist only with eBPF steering; this member uses \(steering)"
        case .policyNeedsEBPF(let policy, let steering):
            return "policy \(policy) cannot be served by \(steering) steering; use eBPF or automatic"
        case .system(let error):
            return error.description
        case .addressServedByAnotherProcess(let address, let pid, let command):
            let who = pid.map { pid in command.map { "pid \(pid), \($0)" } ?? "pid \(pid)" } ?? "its process is not visible in /proc"
            return "\(address) is already served by another process (\(who)): stop it or use another bind"
        case .steeringConflict(let group, let running, let requested):
            return "the group on \(group) runs eBPF steering (\(running)); a \(requested) member would replace it for every member: give this process CAP_BPF (steering automatic or ebpf), or force it (GroupOptions.force, collector --force) and every member reports \(requested)"
        case .takeoverNeedsEBPF(let steering):
            return "takeover needs eBPF steering, but this member would use \(steering), which cannot hand a slot's datagrams to a new socket: grant CAP_BPF, or join without takeover"
        case .bpffsNotShared(let address, let bpffs, let sockets):
            return "\(sockets) socket(s) are already bound on \(address) but no group is pinned in \(bpffs): the other members use another bpffs mount (`ip netns exec` mounts a private /sys/fs/bpf) or no eBPF steering; share bpffs (enter only the network namespace with `nsenter --net=/run/netns/NAME`, or bind-mount the same /sys/fs/bpf), or force it (GroupOptions.force, collector --force)"
        case .invalidAddress(let address, let reason):
            return "\(address): \(reason)"
        case .noLiveMember(let address):
            return "the group on \(address) has no member to attach its program through: join a slot before activate()"
        case .handedOverMismatch(let address, let reason):
            return "a socket handed over for \(address) is \(reason): closed, a new one is bound"
        case .templateStoreUnavailable(let reason):
            return "the group's flow template store cannot be opened: \(reason)"
        case .connectionIDRouting(let reason, _):
            return "QUIC connection ID routing: \(reason)"
        }
    }
}
