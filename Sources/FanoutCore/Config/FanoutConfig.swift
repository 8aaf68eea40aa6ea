// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import ReusePortLB

/// udp-fanout's configuration: the reference documents' YAML keys plus ours. Every key is
/// documented where it is parsed (ConfigParser) and in docs/configuration.md.
public struct FanoutConfig: Equatable, Sendable {
    public var listeners: [Listener]
    public var health: Health
    public var metrics: Metrics
    /// Virtual addresses published to the node's routing daemon while their listeners are
    /// ready (docs/fleet.md); nil: nothing is announced.
    public var announce: Announce?
    /// Where each key stands in the file (empty for a configuration built in code). Not part
    /// of equality: moving a key to another line changes nothing.
    public var lines = KeyLines()

    public static func == (lhs: FanoutConfig, rhs: FanoutConfig) -> Bool {
        lhs.listeners == rhs.listeners && lhs.health == rhs.health && lhs.metrics == rhs.metrics && lhs.announce == rhs.announce
    }

    public init(listeners: [Listener], health: Health = Health(), metrics: Metrics = Metrics(), announce: Announce? = nil) {
        self.listeners = listeners
        self.health = health
        self.metrics = metrics
        self.announce = announce
    }
}

/// One listener: datagrams received on `bind` go to exactly one downstream.
public struct Listener: Equatable, Sendable {
    public var name: String
    public var bind: SocketAddress
    public var interface: String?
    public var mode: Mode
    /// Downstreams given by address.
    public var downstreams: [Downstream]
    /// Downstreams given by DNS name (`name:port`): every A/AAAA record is a downstream.
    public var dnsDownstreams: [DNSDownstream]
    /// EndpointSlice discovery; its endpoints join `downstreams` and `dnsDownstreams`.
    public var kubernetes: Kubernetes?
    public var settings: Settings
    public var balancing: Balancing
    /// One way (fan-out), or two: replies from the downstreams go back to the client from the
    /// listener's address.
    public var replies: Replies
    /// Replication: pools that each datagram also goes to, beside the listener's own downstreams
    /// (its first pool, named ``Pool/defaultName``).
    public var pools: [Pool]
    /// QUIC-LB: datagrams go to the downstream whose `server_id` their QUIC destination
    /// connection ID carries, under these configurations (one per config ID); `balancing` chooses
    /// for the others. Empty: no routing by connection ID.
    public var quicLB: [QUICLBConfiguration]
    /// Per-source token buckets (`rate_limit`); nil: no limit.
    public var rateLimit: RateLimit?
    /// Two-way listeners: the cap on bytes back to a client not yet validated; nil: none.
    public var amplification: Amplification?

    public init(
        name: String, bind: SocketAddress, interface: String? = nil, mode: Mode = .userspace,
        downstreams: [Downstream], dnsDownstreams: [DNSDownstream] = [], kubernetes: Kubernetes? = nil,
        settings: Settings = Settings(), balancing: Balancing = .roundRobin, replies: Replies = .none, pools: [Pool] = [],
        quicLB: [QUICLBConfiguration] = [], rateLimit: RateLimit? = nil, amplification: Amplification? = nil
    ) {
        self.name = name
        self.bind = bind
        self.interface = interface
        self.mode = mode
        self.downstreams = downstreams
        self.dnsDownstreams = dnsDownstreams
        self.kubernetes = kubernetes
        self.settings = settings
        self.balancing = balancing
        self.replies = replies
        self.pools = pools
        self.quicLB = quicLB
        self.rateLimit = rateLimit
        self.amplification = amplification
    }

    /// Everything but the downstreams, balancing, QUIC-LB and pools: what a reload cannot change without
    /// restarting the listener's workers (`rate_limit` and `amplification` too: their state is the
    /// running instance's).
    var socketShape: SocketShape {
        SocketShape(bind: bind, interface: interface, mode: mode, settings: settings, replies: replies, rateLimit: rateLimit, amplification: amplification)
    }

    struct SocketShape: Equatable {
        var bind: SocketAddress
        var interface: String?
        var mode: Mode
        var settings: Settings
        var replies: Replies
        var rateLimit: RateLimit?
        var amplification: Amplification?
    }
}

/// Whether a listener is one way (fan-out) or a two-way load balancer.
public enum Replies: String, Sendable, CaseIterable {
    /// One way: datagrams go to a downstream; nothing comes back through udp-fanout.
    case none
    /// tc_ebpf: a client keeps its downstream in an association (an LRU map of
    /// `settings.max_associations`), datagrams are DNATed to it, and the downstream's replies
    /// are source-NATed to the listener's address in the kernel. A downstream may also start a
    /// conversation with a client, which creates the association. The downstreams route their
    /// replies through this host (LVS-NAT style).
    case nat
    /// userspace: one session socket per client to its downstream (`settings.max_sessions`,
    /// `settings.session_idle_secs`); what the downstream sends back on it is relayed to the
    /// client from the listener's socket (nginx's `proxy_responses`).
    case relay
}

/// A forwarding path.
public enum Mode: String, Sendable, CaseIterable {
    /// Worker threads with recvmmsg/sendmmsg on a ReusePortLB group. Needs no privilege.
    case userspace
    /// In-kernel DNAT, fib lookup and redirect at tc ingress. Needs CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON.
    case tcEBPF = "tc_ebpf"
    /// XDP redirects matching datagrams to AF_XDP sockets, one per RX queue; userspace forwards
    /// them. Needs CAP_BPF, CAP_NET_ADMIN, CAP_NET_RAW (and CAP_IPC_LOCK or a locked-memory limit).
    case afXDP = "af_xdp"
    /// tc_ebpf's forwarding at the driver's XDP hook (before a socket buffer exists), with the
    /// tc_ebpf program behind it for what XDP cannot finish. Needs what tc_ebpf needs.
    case xdp

    /// Modes this release can serve; the others are refused at validation.
    public static let implemented: Set<Mode> = [.userspace, .tcEBPF, .afXDP, .xdp]
}

/// How a listener picks the downstream of each datagram.
public enum Balancing: String, Sendable, CaseIterable {
    /// Each datagram to the next downstream, in proportion to weights (the reference's behaviour).
    case roundRobin = "round_robin"
    /// Every datagram of one source address to one downstream (Maglev table over the downstreams'
    /// names and weights: the same choice on every node with the same downstreams).
    case sourceIP = "source_ip"
}

/// A pool of a replicating listener: each datagram the listener receives also goes to this pool
/// (to one member, or to every member with ``PoolBalancing/all``), if it passes the pool's
/// `sources` and `sample`. Its members come from its own downstreams and discovery, as a
/// listener's do.
public struct Pool: Equatable, Sendable {
    /// The name of a listener's own downstreams as a pool (metrics, logs); no other pool takes it.
    public static let defaultName = "default"
    public var name: String
    public var downstreams: [Downstream]
    public var dnsDownstreams: [DNSDownstream]
    public var kubernetes: Kubernetes?
    public var balancing: PoolBalancing
    /// One datagram in `sample` goes to the pool: the datagrams of one source in `sample` of the
    /// sources, chosen by a hash of the source address (`PoolPlan/sampled(_:)`); 1: every datagram.
    public var sample: Int
    /// Only datagrams from these client prefixes go to the pool (empty: every client).
    public var sources: [SourcePrefix]
    /// How copies leave for the pool's members (nil: the listener's `settings.output`).
    public var output: Output?

    public init(name: String, downstreams: [Downstream] = [], dnsDownstreams: [DNSDownstream] = [], kubernetes: Kubernetes? = nil,
                balancing: PoolBalancing = .roundRobin, sample: Int = 1, sources: [SourcePrefix] = [], output: Output? = nil) {
        self.name = name
        self.downstreams = downstreams
        self.dnsDownstreams = dnsDownstreams
        self.kubernetes = kubernetes
        self.balancing = balancing
        self.sample = sample
        self.sources = sources
        self.output = output
    }
}

/// How a pool spreads the datagrams it takes over its members.
public enum PoolBalancing: String, Sendable, CaseIterable {
    /// One member per datagram, as the listener's `round_robin`.
    case roundRobin = "round_robin"
    /// One member per source address, as the listener's `source_ip` (the same table).
    case sourceIP = "source_ip"
    /// Every member gets a copy of each datagram.
    case all

    /// The one-member balancing, nil for `all`.
    var single: Balancing? {
        switch self {
        case .roundRobin: return .roundRobin
        case .sourceIP: return .sourceIP
        case .all: return nil
        }
    }
}

/// A client prefix of a pool's `sources` (`198.18.0.0/16`, `2001:db8::/32`).
public struct SourcePrefix: Hashable, Sendable, CustomStringConvertible {
    public let address: IPAddress
    public let length: Int

    /// Parses `address/length` (a bare address is a host prefix); nil if malformed or if the
    /// address has bits set past the length.
    public init?(_ text: String) {
        let parts = text.split(separator: "/", maxSplits: 1, omittingEmptySubsequences: false)
        guard let address = IPAddress(String(parts[0])) else { return nil }
        let maximum = address.family == AF_INET ? 32 : 128
        var length = maximum
        if parts.count == 2 {
            guard let given = Int(parts[1]), (0...maximum).contains(given), parts[1].allSatisfy(\.isNumber) else { return nil }
            length = given
        }
        self.address = address
        self.length = length
        guard Self.masked(address.bytes, length) == address.bytes else { return nil }
    }

    public var description: String { "\(address)/\(length)" }

    /// `bytes` with every bit past `length` cleared.
    static func masked(_ bytes: [UInt8], _ length: Int) -> [UInt8] {
        bytes.enumerated().map { index, byte in
            let bits = min(max(length - index * 8, 0), 8)
            return bits == 8 ? byte : byte & UInt8(truncatingIfNeeded: 0xff << (8 - bits))
        }
    }

}

public struct Downstream: Equatable, Sendable {
    public var name: String
    public var address: SocketAddress
    /// Legacy field of the reference; accepted and not used.
    public var mac: String?
    /// Share of the datagrams relative to the other downstreams (default 1; 0 leaves it out).
    public var weight: UInt32
    /// Where health probes go, if not to `address`'s port.
    public var healthPort: UInt16?
    /// The pool it is a member of (nil: the listener's own downstreams, its first pool).
    public var pool: String?
    /// QUIC-LB: the server ID this downstream puts into the connection IDs it issues (a listener
    /// with `quic_lb` sends it every datagram whose ID carries it).
    public var serverID: [UInt8]?

    public init(name: String, address: SocketAddress, mac: String? = nil, weight: UInt32 = 1, healthPort: UInt16? = nil, pool: String? = nil,
                serverID: [UInt8]? = nil) {
        self.name = name
        self.address = address
        self.mac = mac
        self.weight = weight
        self.healthPort = healthPort
        self.pool = pool
        self.serverID = serverID
    }

    /// The address health probes go to.
    var healthTarget: SocketAddress { SocketAddress(ip: address.ip, port: healthPort ?? address.port) }
}

/// A downstream given by DNS name: each address the name resolves to becomes a downstream named
/// `name/address`, with this entry's weight and health port.
public struct DNSDownstream: Equatable, Sendable {
    public var name: String
    public var host: String
    public var port: UInt16
    public var weight: UInt32
    public var healthPort: UInt16?

    public init(name: String, host: String, port: UInt16, weight: UInt32 = 1, healthPort: UInt16? = nil) {
        self.name = name
        self.host = host
        self.port = port
        self.weight = weight
        self.healthPort = healthPort
    }
}

public struct Kubernetes: Hashable, Sendable {
    public var namespace: String?
    public var service: String
    public var port: UInt16
}

public struct Settings: Equatable, Sendable {
    /// Largest datagram forwarded whole (bytes); a larger one is dropped as `too_large`.
    public var maxPacketSize: Int = 9000
    /// Datagrams per recvmmsg/sendmmsg call.
    public var batchSize: Int = 32
    /// Worker threads (0: one per CPU).
    public var workers: Int = 0
    /// Pin worker i to CPU i modulo the CPU count.
    public var pinCPUs: Bool = true
    /// Receive buffer per worker socket in bytes (0: the system's).
    public var recvBufSize: Int = 0
    /// How datagrams are spread over the workers (their sockets' ReusePortLB policy).
    public var workerSteering: WorkerSteering = .fiveTuple
    /// userspace: NetFlow v9 / IPFIX templates copied to every downstream and replayed to one
    /// that takes an exporter over (docs/flow-templates.md).
    public var flowTemplates: Bool = false
    /// tc_ebpf: how the program is attached to the interface.
    public var tcAttach: TCAttach = .auto
    /// Longest time between two resolutions of a DNS downstream (the record's TTL, if shorter, wins).
    public var resolveIntervalSecs: Int = 30
    /// How datagrams leave for the downstream (userspace and af_xdp).
    public var output: Output = .socket
    /// af_xdp: how the XDP program is attached.
    public var xdpMode: XDPMode = .auto
    /// af_xdp: RX queues served, from queue 0 (0: every RX queue of the interface).
    public var queues: Int = 0
    /// Entries of the XDP program's socket map (FANOUT_XDP_MAX_QUEUES).
    public static let maximumQueues = 64
    /// af_xdp: bytes per UMEM frame (2048 or 4096: the largest frame a socket takes, headroom included).
    public var umemFrameSize: Int = 4096
    /// af_xdp: UMEM frames per queue.
    public var umemFrames: Int = 4096
    /// af_xdp: entries of each ring (RX, TX, fill, completion): a power of two.
    public var ringSize: Int = 2048
    /// af_xdp: zero-copy binding (auto: where the driver has it, else copy mode).
    public var zeroCopy: ZeroCopy = .auto
    /// af_xdp: busy polling of the sockets (SO_PREFER_BUSY_POLL), trading CPU for latency.
    public var busyPoll: Bool = false
    /// userspace, relay: after a turn that had something to do, a worker polls its sockets
    /// without sleeping for this many microseconds before it sleeps in the kernel (0: at once).
    public var busyWaitMicroseconds: Int = 0
    /// replies nat: clients remembered at once per listener (LRU: when full, the least recently
    /// used association is forgotten; counted as evicted). sbulb's default.
    public var maxAssociations: Int = 1_048_576
    /// replies nat: interfaces the downstreams' replies arrive on (the program is attached there
    /// too); empty: the interfaces the kernel routes the downstreams through (`ip route get`).
    public var replyInterfaces: [String] = []
    /// replies relay: session sockets per listener (one per client address and port); a new
    /// client beyond it is dropped and counted (`table_full`).
    public var maxSessions: Int = 65_536
    /// replies relay: a session with no datagram either way for this long is closed.
    public var sessionIdleSecs: Int = 120
    /// Two-way listeners (nat, relay): how long a downstream that left the set (reload, health,
    /// discovery) keeps relaying its clients' replies. It gets no new client meanwhile, and its
    /// clients move to another downstream on their next datagram; a reply after this time is
    /// dropped and counted (`replies_dropped_total{reason="drained"}`). 0: it goes at once.
    public var drainSecs: Int = 30
    /// replies relay: the sends and receives on session sockets go through an io_uring, many per
    /// system call; false (or a kernel that refuses io_uring, logged): one system call each.
    public var ioUring: Bool = true

    public init() {}
}

/// How a listener's datagrams leave for the downstream.
public enum Output: String, Sendable, CaseIterable {
    /// The payload through a UDP socket of this host (sendmmsg with GSO): the downstream sees this
    /// host's address as the source (the reference's behaviour).
    case socket
    /// The whole datagram with the client's source address and port, through a raw IP socket
    /// (CAP_NET_RAW): collectors keyed by exporter address keep working.
    case preserveSource = "preserve_source"
    /// af_xdp: rewritten in UMEM and sent on the queue's TX ring when the downstream's next hop
    /// is on the same interface; otherwise as preserve_source (counted).
    case xdpTX = "xdp_tx"
}

/// How the af_xdp XDP program is attached.
public enum XDPMode: String, Sendable, CaseIterable {
    /// Native (driver) mode, falling back to generic (SKB) mode with a warning.
    case auto
    /// The driver's XDP hook only: an error where the driver has none.
    case native
    /// Generic (SKB) mode: every driver, slower.
    case generic
}

/// Whether AF_XDP sockets bind in zero-copy mode.
public enum ZeroCopy: String, Sendable, CaseIterable {
    /// Zero-copy where the driver supports it, else copy mode (logged).
    case auto
    /// Zero-copy only: an error where the driver cannot.
    case on
    /// Copy mode.
    case off
}

/// How a userspace listener spreads datagrams over its workers.
public enum WorkerSteering: String, Sendable, CaseIterable {
    /// Every datagram of one flow (source address and port) to one worker: a flow keeps its
    /// order, as with nginx and the reference; one very heavy flow is served by one worker.
    case fiveTuple = "five_tuple"
    /// Every datagram of one source address to one worker.
    case sourceIP = "source_ip"
    /// Each datagram to the next worker: spreads one heavy flow over every worker, and may
    /// reorder it (workers send in parallel).
    case roundRobin = "round_robin"

    var policy: BalancePolicy {
        switch self {
        case .fiveTuple: return .fiveTuple
        case .sourceIP: return .sourceIP
        case .roundRobin: return .roundRobin
        }
    }
}

/// How tc_ebpf attaches its program to an interface.
public enum TCAttach: String, Sendable, CaseIterable {
    /// A TCX bpf_link where the kernel has it (6.6+), otherwise clsact.
    case auto
    /// A TCX bpf_link only: the kernel detaches it when the daemon exits, even on a crash.
    case tcx
    /// A cls_bpf filter on the clsact qdisc (created if absent, removed only if we created it).
    case clsact
}

public struct Health: Equatable, Sendable {
    public var enabled = false
    public var intervalSecs = 5
    public var timeoutSecs = 2
    public var proto = "icmp"
    /// Consecutive successful probes that bring a down downstream back (the reference: 1).
    public var rise = 1
    /// Consecutive failed probes that take a downstream out (the reference: 3).
    public var fall = 3

    public init() {}
}

public struct Metrics: Equatable, Sendable {
    public var enabled = false
    /// Loopback unless configured: exposing metrics and readiness to a network is a choice
    /// (`0.0.0.0:9090` or the pod IP; see docs/configuration.md).
    public var bind = SocketAddress("127.0.0.1:9090")!
    public var path = "/metrics"
    /// What the endpoint serves besides `path`, which `path` may not be.
    public static let reservedPaths = ["/status", "/healthz", "/readyz", "/associations"]

    public init() {}
}

/// The `announce` section: each address becomes a host route (/32, /128) of type blackhole in
/// `table`, marked with `protocol`, while every listener serving it is ready; the node's BIRD or
/// FRR exports those routes to its BGP peers (docs/fleet.md). A stop or a drain withdraws them
/// first, then serves what still arrives for `drainSecs`.
public struct Announce: Equatable, Sendable {
    public var addresses: [IPAddress]
    /// The kernel routing table the routes are kept in: 201 by default, a table no rule points
    /// to, so the routes change nothing in this node's forwarding.
    public var table: UInt32 = 201
    /// The routes' protocol number (`ip route ... proto N`): how the routing daemon picks them
    /// (BIRD's `krt_source`) and how udp-fanout tells its routes from others.
    public var protocolNumber: UInt8 = 201
    /// How long a stop or a drain keeps serving after the withdrawal.
    public var drainSecs = 5

    public init(addresses: [IPAddress]) {
        self.addresses = addresses
    }

    /// Protocol numbers udp-fanout will not use: the kernel's own (0 to 4), and those BIRD
    /// (12), FRR (11, 186 to 198) and babeld (42) mark their own routes with: they would take
    /// the route for theirs, and replace or delete it.
    public static let reservedProtocols: [ClosedRange<Int>] = [0...4, 11...12, 42...42, 186...198]
}

extension FanoutConfig {
    /// What `udp-fanout --check` prints for a valid configuration: each listener with its bind,
    /// kind, downstreams (static, DNS, Kubernetes), balancing, replies, QUIC-LB and replication pools,
    /// then health checks and announced addresses.
    public var checkSummary: String {
        func targets(_ downstreams: [Downstream], _ dns: [DNSDownstream], _ kubernetes: Kubernetes?) -> String {
            var targets = ["\(downstreams.count) downstream(s)"]
            targets += dns.map { "DNS \($0.host):\($0.port)" }
            if let source = kubernetes {
                targets.append("Kubernetes \(source.namespace.map { "\($0)/" } ?? "")\(source.service):\(source.port)")
            }
            return targets.joined(separator: " + ")
        }
        return "configuration OK: \(listeners.count) listener(s): " + listeners.map { listener in
            var line = "\(listener.name) \(listener.bind) \(listener.mode.rawValue) -> \(targets(listener.downstreams, listener.dnsDownstreams, listener.kubernetes)), \(listener.balancing.rawValue)"
                + (listener.replies == .none ? "" : ", replies \(listener.replies.rawValue)")
            // QUIC-LB before the balancing it falls back to (which the line names already).
            if !listener.quicLB.isEmpty {
                line += ", quic_lb [\(listener.quicLB.map(\.description).joined(separator: "; "))] before \(listener.balancing.rawValue)"
            }
            if let limit = listener.rateLimit { line += ", rate_limit \(limit)" }
            if let cap = listener.amplification { line += ", amplification: \(cap)" }
            for pool in listener.pools {
                line += ", pool \(pool.name) -> \(targets(pool.downstreams, pool.dnsDownstreams, pool.kubernetes)), \(pool.balancing.rawValue)"
                // In the order the filters apply: sources, then the sample (of sources, not datagrams).
                if !pool.sources.isEmpty { line += ", sources \(pool.sources.map(\.description).joined(separator: " "))" }
                if pool.sample > 1 { line += ", 1 source in \(pool.sample)" }
                // The kernel kinds' copies always keep the client's source (output: socket is refused there).
                let output = listener.mode == .tcEBPF || listener.mode == .xdp ? Output.preserveSource : pool.output ?? listener.settings.output
                line += ", output \(output.rawValue)"
            }
            return line
        }.joined(separator: "; ") + (health.enabled ? "; health \(health.proto) every \(health.intervalSecs) s" : "")
            + (announce.map { "; announce \($0.addresses.map(\.description).joined(separator: ", ")) (table \($0.table), protocol \($0.protocolNumber), drain \($0.drainSecs) s)" } ?? "")
    }
}
