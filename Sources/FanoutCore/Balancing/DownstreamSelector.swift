// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import CSystemShim
import ReusePortLB

/// Picks the downstream of each datagram: a per-worker value, so picking takes no lock and
/// allocates nothing.
struct DownstreamSelector {
    enum Method {
        /// Smooth weighted round robin, precomputed as a rotation of downstream indexes.
        case rotation([Int])
        /// Source-IP affinity: the ``SourceTable`` over the downstreams (by address and weight),
        /// the source hashed with ReusePortLB's shared hash.
        case table([UInt32])

        /// Computed once per downstream set (building a table costs size × downstreams scores),
        /// then shared by every worker.
        init(downstreams: [Downstream], balancing: Balancing) {
            switch balancing {
            case .roundRobin: self = .rotation(DownstreamSelector.rotation(weights: downstreams.map(\.weight)))
            case .sourceIP: self = .table(SourceTable.entries(downstreams, size: DownstreamSelector.tableSize))
            }
        }
    }

    let method: Method
    private var position = 0
    /// QUIC-LB: tried first, `method` when it names no downstream; nil when the listener does
    /// not route by connection ID.
    let router: QUICRouter?
    /// What ``router`` made of the datagrams since the last ``takeTally()``.
    private(set) var tally = QUICTally()

    /// Seed of the source hash and table: fixed, so every node with the same downstreams agrees.
    static let seed: UInt32 = 0x5544_5046
    /// One table size for every mode (the tc_ebpf map's), so a source lands on the same
    /// downstream whichever mode forwards it.
    static let tableSize = Int(FANOUT_TABLE_SIZE)

    init(_ method: Method, router: QUICRouter? = nil) {
        self.method = method
        self.router = router
    }

    init(downstreams: [Downstream], balancing: Balancing) {
        self.init(Method(downstreams: downstreams, balancing: balancing))
    }

    /// The downstream index for `payload` from `source`: the one its QUIC connection ID names
    /// (with a ``router``), else the balancing's; nil if none can be chosen.
    @inline(__always)
    mutating func pick(source: UnsafePointer<sockaddr_storage>, payload: UnsafeRawBufferPointer) -> Int? {
        guard let router else { return pick(source: source) }
        let (owner, outcome) = router.route(payload)
        tally.note(outcome)
        return owner ?? pick(source: source)
    }

    /// The downstream `payload`'s QUIC connection ID names, nil when it names none or there is
    /// no ``router``. Nothing is tallied: a caller that moves to it notes ``noteRouted()``.
    @inline(__always)
    func owner(of payload: UnsafeRawBufferPointer) -> Int? {
        guard let router else { return nil }
        let (owner, outcome) = router.route(payload)
        return outcome == .routed ? owner : nil
    }

    /// Tallies a datagram that a caller sent where ``owner(of:)`` named.
    mutating func noteRouted() { tally.note(.routed) }

    /// The outcomes tallied since the last call, and a fresh tally.
    mutating func takeTally() -> QUICTally {
        defer { tally = QUICTally() }
        return tally
    }

    /// The downstream index for a datagram from `source`; nil if none can be chosen.
    mutating func pick(source: UnsafePointer<sockaddr_storage>) -> Int? {
        switch method {
        case .rotation(let rotation):
            guard !rotation.isEmpty else { return nil }
            if position >= rotation.count { position = 0 }
            defer { position += 1 }
            return rotation[position]
        case .table(let table):
            guard !table.isEmpty else { return nil }
            return Int(table[Int(rplb_reduce(Self.sourceHash(source), UInt32(table.count)))])
        }
    }

    /// The same hash ReusePortLB's kernel program computes for a source address (with `seed`:
    /// the balancing's, or another for a choice that must not follow it).
    static func sourceHash(_ source: UnsafePointer<sockaddr_storage>, seed: UInt32 = seed) -> UInt32 {
        let raw = UnsafeRawPointer(source)
        var words: (UInt32, UInt32, UInt32, UInt32) = (0, 0, 0, 0)
        let count: UInt32
        if Int32(source.pointee.ss_family) == AF_INET6 {
            let offset = MemoryLayout<sockaddr_in6>.offset(of: \.sin6_addr)!
            words = raw.loadUnaligned(fromByteOffset: offset, as: (UInt32, UInt32, UInt32, UInt32).self)
            // An IPv4 client on a dual-stack `[::]` socket arrives IPv4-mapped (::ffff:a.b.c.d):
            // hashed as the IPv4 address it is, or this node would send it elsewhere than a
            // node (or mode) that sees it as IPv4.
            if words.0 == 0 && words.1 == 0 && words.2 == UInt32(0x0000_ffff).bigEndian {
                words = (words.3, 0, 0, 0)
                count = 1
            } else {
                count = 4
            }
        } else {
            words.0 = raw.loadUnaligned(fromByteOffset: MemoryLayout<sockaddr_in>.offset(of: \.sin_addr)!, as: UInt32.self)
            count = 1
        }
        return withUnsafePointer(to: &words) {
            $0.withMemoryRebound(to: UInt32.self, capacity: 4) { rplb_source_hash($0, count, 0, seed, 0) }
        }
    }

    /// Smooth weighted round robin (as nginx): each step adds every weight to its current value,
    /// picks the largest and subtracts the total. Weights are scaled so the rotation stays at
    /// most `limit` long.
    static func rotation(weights: [UInt32], limit: Int = 4096) -> [Int] {
        var scaled = weights.map(Int.init)
        let total = scaled.reduce(0, +)
        guard total > 0 else { return [] }
        if total > limit { scaled = scaled.map { $0 == 0 ? 0 : max(1, $0 * limit / total) } }
        let divisor = scaled.filter { $0 > 0 }.reduce(0) { gcd($0, $1) }
        scaled = scaled.map { $0 / divisor }
        let sum = scaled.reduce(0, +)
        var current = [Int](repeating: 0, count: scaled.count)
        var rotation: [Int] = []
        rotation.reserveCapacity(sum)
        for _ in 0..<sum {
            var best = -1
            for index in scaled.indices where scaled[index] > 0 {
                current[index] += scaled[index]
                if best < 0 || current[index] > current[best] { best = index }
            }
            current[best] -= sum
            rotation.append(best)
        }
        return rotation
    }

    static func gcd(_ a: Int, _ b: Int) -> Int { b == 0 ? a : gcd(b, a % b) }
}
