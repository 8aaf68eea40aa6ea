// SPDX-License-Identifier: Apache-2.0
/// A Maglev consistent-hashing lookup table (Eisenbud et al., NSDI 2016): every entry names one
/// backend, each backend owns entries in proportion to its weight, and adding or removing one of
/// N backends changes about 1/N of the entries.
///
/// ReusePortLB fills its kernel lookup table with it (backends are member slots); udp-fanout
/// uses the same table for source-IP affinity with weights.
public struct MaglevTable: Sendable, Equatable {
    /// The entries: `entries[i]` is an index into the `backends` the table was built from.
    public let entries: [UInt32]

    /// One backend: a stable name (so every node that has the same backends builds the same
    /// table) and a weight (0 leaves the backend out).
    public struct Backend: Sendable, Hashable {
        public var name: String
        public var weight: UInt32
        public init(name: String, weight: UInt32 = 1) {
            self.name = name
            self.weight = weight
        }
    }

    /// Builds the table.
    /// - Parameters:
    ///   - backends: the backends in index order; entries refer to positions in this array.
    ///   - size: the table size, a prime larger than the number of backends (a larger size
    ///     balances better).
    ///   - seed: mixed into each backend's permutation.
    /// - Returns: nil if no backend has a positive weight.
    public init?(backends: [Backend], size: Int, seed: UInt32) {
        precondition(size > 1, "Maglev table size must be a prime above 1")
        let live = backends.indices.filter { backends[$0].weight > 0 }
        guard !live.isEmpty else { return nil }
        let m = UInt64(size)
        var offsets = [UInt64](repeating: 0, count: backends.count)
        var skips = [UInt64](repeating: 0, count: backends.count)
        for index in live {
            let h = Self.fnv1a64(backends[index].name, seed: seed)
            offsets[index] = (h & 0xffff_ffff) % m
            skips[index] = (h >> 32) % (m - 1) + 1
        }
        let maxWeight = Double(live.map { backends[$0].weight }.max()!)
        var next = [UInt64](repeating: 0, count: backends.count)
        var credit = [Double](repeating: 0, count: backends.count)
        var table = [UInt32](repeating: UInt32.max, count: size)
        var filled = 0
        fill: while true {
            for index in live {
                credit[index] += Double(backends[index].weight) / maxWeight
                while credit[index] >= 1 {
                    credit[index] -= 1
                    var candidate = (offsets[index] + next[index] * skips[index]) % m
                    while table[Int(candidate)] != UInt32.max {
                        next[index] += 1
                        candidate = (offsets[index] + next[index] * skips[index]) % m
                    }
                    table[Int(candidate)] = UInt32(index)
                    next[index] += 1
                    filled += 1
                    if filled == size { break fill }
                }
            }
        }
        entries = table
    }

    /// FNV-1a over the name's UTF-8 bytes, started from the seed (udp-fanout's source table
    /// names its downstreams with it too).
    package static func fnv1a64(_ text: String, seed: UInt32) -> UInt64 {
        var hash: UInt64 = 0xcbf2_9ce4_8422_2325 ^ UInt64(seed)
        for byte in text.utf8 {
            hash ^= UInt64(byte)
            hash &*= 0x0000_0100_0000_01b3
        }
        // FNV's low bits mix poorly: finish with a 64-bit avalanche.
        return mix64(hash)
    }

    /// splitmix64's finaliser: every input bit reaches every output bit.
    package static func mix64(_ value: UInt64) -> UInt64 {
        var hash = value
        hash ^= hash >> 30
        hash &*= 0xbf58_476d_1ce4_e5b9
        hash ^= hash >> 27
        hash &*= 0x94d0_49bb_1331_11eb
        hash ^= hash >> 31
        return hash
    }
}
