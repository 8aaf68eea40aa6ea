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

    public var description: String {
        switch self {
        case .invalidCapacity(let capacity):
            return "capacity \(capacity) is out of range: a group has 1...\(ReusePortMember.maximumCapacity) slots"
        case .slotOutOfRange(let slot, let capacity):
            return "slot \(slot) is out of range for a group of capacity \(capacity) (valid: 0...\(capacity - 1))"
        case .slotInUse(let slot):
            return "slot \(slot) is held by a live member; choose another index, or take it over (handover)"
        case .groupFull(let capacity):
            return "every slot of the group (capacity \(capacity)) is held by a live member"
        case .groupSettingsMismatch(let group, let existing, let requested):
            return "group \(group) exists with \(existing), but this member asked for \(requested): use the group's settings, or stop every member to recreate it"
        case .addressInUse(let address):
            return "\(address) is in use by a socket without SO_REUSEPORT (or owned by another user): stop that process or use another port"
        case .bpffsUnavailable(let path, let reason):
            return "bpffs is not mounted at \(path) and could not be mounted (\(reason)): run `mount -t bpf bpf \(path)` as root"
        case .ebpfUnavailable(let reason):
            return "eBPF steering is unavailable: \(reason); grant CAP_BPF or use steering automatic/classicBPF"
        case .countersUnavailable(let steering):
            return "kernel counters exist only with eBPF steering; this member uses \(steering)"
        case .policyNeedsEBPF(let policy, let steering):
            return "policy \(policy) cannot be served by \(steering) steering; use eBPF or automatic"
        case .system(let error):
            return error.description
        }
    }
}
