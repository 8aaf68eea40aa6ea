// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import CSystemShim

/// How a group spreads datagrams over its members. The group's creator chooses it; a member
/// asking for another policy is refused with ``ReusePortError/groupSettingsMismatch(group:existing:requested:)``.
public enum BalancePolicy: String, Sendable, CaseIterable, CustomStringConvertible {
    /// Every datagram of one source address goes to one member (consistent table). What
    /// NetFlow/IPFIX/sFlow collectors need: templates and per-exporter state stay in one process.
    case sourceIP
    /// Each datagram goes to the next member (per CPU): spreads a single heavy sender.
    case roundRobin
    /// Every datagram of one source address and port goes to one member.
    case fiveTuple

    var kernelValue: UInt32 {
        switch self {
        case .sourceIP: return UInt32(RPLB_POLICY_SOURCE_IP.rawValue)
        case .roundRobin: return UInt32(RPLB_POLICY_ROUND_ROBIN.rawValue)
        case .fiveTuple: return UInt32(RPLB_POLICY_FIVE_TUPLE.rawValue)
        }
    }

    init?(kernelValue: UInt32) {
        guard let policy = Self.allCases.first(where: { $0.kernelValue == kernelValue }) else { return nil }
        self = policy
    }

    public var description: String { rawValue }
}

/// The steering mechanism in force for a member.
public enum Steering: String, Sendable, CustomStringConvertible {
    /// The sk_reuseport eBPF program with its pinned maps: the policy exactly, failover to live
    /// members, kernel counters.
    case ebpf
    /// A classic BPF program (SO_ATTACH_REUSEPORT_CBPF), which needs no privilege: `sourceIP` by
    /// a hash of the source address modulo the capacity, over sockets in join order; `roundRobin`
    /// as a random spread. No failover table and no kernel counters.
    case classicBPF
    /// The kernel's own SO_REUSEPORT hash of the 4-tuple (sticky per source address and port).
    case kernelHash

    public var description: String { rawValue }
}

/// Which steering a member asks for.
public enum SteeringPreference: String, Sendable, CaseIterable {
    /// eBPF when the process has CAP_BPF (or CAP_SYS_ADMIN), else classic BPF (or the kernel
    /// hash for `fiveTuple`), and ``ReusePortMember/steeringNote`` says why.
    case automatic
    /// eBPF or an error.
    case ebpf
    /// Classic BPF even with privileges.
    case classicBPF
    /// No program: the kernel's SO_REUSEPORT hash.
    case kernelHash
}

/// Which slot a member takes.
public enum SlotRequest: Sendable, Equatable {
    /// The lowest slot no live socket holds.
    case lowestFree
    /// This slot; fails with ``ReusePortError/slotInUse(slot:)`` if a live socket holds it.
    case index(Int)
    /// This slot, replacing the socket that holds it (zero-loss handover): the old holder sees
    /// ``ReusePortMember/isReplaced`` become true, drains its queue and leaves.
    case takeover(Int)
}

/// A group's settings and this member's options.
public struct GroupOptions: Sendable {
    /// The policy; must match the group's if it exists.
    public var policy: BalancePolicy
    /// Number of slots, 1...``ReusePortMember/maximumCapacity``; must match the group's.
    public var capacity: Int
    /// Hash seed for the consistent table. nil: a fixed default, so every host with the same
    /// group settings maps sources the same way.
    public var seed: UInt32?
    /// Which steering to use.
    public var steering: SteeringPreference
    /// Where bpffs is (or is to be mounted).
    public var bpffsRoot: String
    /// Receive buffer size for the member's socket: SO_RCVBUFFORCE when the process has
    /// CAP_NET_ADMIN, else SO_RCVBUF (capped by net.core.rmem_max); nil keeps the default.
    public var receiveBufferSize: Int?
    /// Join even where this member would replace the steering of the group's other members:
    /// a member without eBPF joining a group whose eBPF program runs (its classic program, or
    /// the kernel hash, then serves every member, and they report it through
    /// ``ReusePortMember/steeringInForce``), or an eBPF member creating a group on an address
    /// where sockets of no group pinned in this bpffs are bound. Without it those joins fail
    /// with ``ReusePortError/steeringConflict(group:running:requested:)`` and
    /// ``ReusePortError/bpffsNotShared(_:bpffs:sockets:)``.
    public var force: Bool
    /// QUIC-LB: a datagram whose QUIC destination connection ID carries a server ID a member
    /// registered (``ReusePortMember/registerServerID(_:)``) goes to that member; the others (a
    /// client's first packets, unknown IDs) to `policy`. Plaintext server IDs (no key), eBPF
    /// steering only; must match the group's. nil: no routing by connection ID.
    public var quic: QUICLBConfiguration?

    public init(
        policy: BalancePolicy = .sourceIP, capacity: Int, seed: UInt32? = nil,
        steering: SteeringPreference = .automatic, bpffsRoot: String = "/sys/fs/bpf",
        receiveBufferSize: Int? = nil, force: Bool = false, quic: QUICLBConfiguration? = nil
    ) {
        self.force = force
        self.quic = quic
        self.policy = policy
        self.capacity = capacity
        self.seed = seed
        self.steering = steering
        self.bpffsRoot = bpffsRoot
        self.receiveBufferSize = receiveBufferSize
    }

    /// The seed used when none is given ("RPLB" in ASCII).
    public static let defaultSeed: UInt32 = 0x5250_4c42

    /// The group's settings as the kernel program and the config map hold them.
    var kernelConfig: rplb_config {
        var config = rplb_config()
        config.layout_version = UInt32(RPLB_LAYOUT_VERSION)
        config.policy = policy.kernelValue
        config.capacity = UInt32(capacity)
        config.table_size = UInt32(RPLB_TABLE_SIZE)
        config.seed = seed ?? Self.defaultSeed
        return config
    }

    /// The group's QUIC-LB configuration as the kernel program and its map hold it (zero: none).
    var kernelQUICConfig: rplb_quic_config {
        var config = rplb_quic_config()
        if let quic {
            config.server_id_length = UInt32(quic.serverIDLength)
            config.nonce_length = UInt32(quic.nonceLength)
            config.config_id = UInt32(quic.configID)
        }
        return config
    }

    /// Why `quic` cannot be served (an encrypted configuration, or a steering other than eBPF);
    /// nil when it can or is not asked for.
    var quicProblem: String? {
        guard let quic else { return nil }
        if quic.isEncrypted {
            return "the sk_reuseport program reads plaintext server IDs only in this release; configure the servers' QUIC-LB without a key (a group is one host's processes), or put udp-fanout with quic_lb in front"
        }
        if steering == .classicBPF || steering == .kernelHash {
            return "it needs eBPF steering (a classic BPF program and the kernel hash cannot read connection IDs); use steering automatic or ebpf with CAP_BPF"
        }
        if policy == .roundRobin {
            return "policy roundRobin would spread a client's first flight (the packets that carry its own connection ID) over several members; use sourceIP or fiveTuple"
        }
        return nil
    }
}
