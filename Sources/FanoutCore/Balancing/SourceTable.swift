// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB

/// The source-IP lookup table of every udp-fanout mode: `entries[hash(source) mod size]` is the
/// downstream of a source. Each entry goes to the downstream with the highest weighted
/// rendezvous score (Thaler and Ravishankar's highest random weight, with Schindelhauer and
/// Schomaker's weighting: score = weight / -ln(u), u a hash of entry and downstream in (0, 1)).
///
/// Why rendezvous and not Maglev: a membership change (a probe failing, an endpoint leaving
/// or arriving, a reload) must move only the sources of the downstreams that changed. With
/// rendezvous scores an entry's winner changes only if the winner left or a newcomer outscores
/// it: exactly the minimal disruption. Maglev fills entries in turn, so removing one backend
/// also shifts a few entries between the others. Scores depend only on the downstream's
/// address and weight, never on order or history, so every node with the same downstreams
/// builds the same table (ECMP scale-out).
enum SourceTable {
    /// - Returns: downstream indexes, `size` of them; empty if no downstream has a positive weight.
    static func entries(_ downstreams: [Downstream], size: Int) -> [UInt32] {
        let live = downstreams.indices.filter { downstreams[$0].weight > 0 }
        guard !live.isEmpty else { return [] }
        if live.count == 1 { return [UInt32](repeating: UInt32(live[0]), count: size) }
        let keys = live.map { identity(downstreams[$0]) }
        let weights = live.map { Double(downstreams[$0].weight) }
        var table = [UInt32](repeating: 0, count: size)
        for entry in 0..<size {
            var best = 0
            var bestScore = -Double.infinity
            for (position, key) in keys.enumerated() {
                let score = weights[position] / -log(unit(mix(key ^ (UInt64(entry) &* 0x9e37_79b9_7f4a_7c15))))
                if score > bestScore {
                    bestScore = score
                    best = position
                }
            }
            table[entry] = UInt32(live[best])
        }
        return table
    }

    /// A downstream's identity in the scores: its address, so names and list order do not matter.
    static func identity(_ downstream: Downstream) -> UInt64 {
        MaglevTable.fnv1a64(downstream.address.description, seed: DownstreamSelector.seed)
    }

    static func mix(_ value: UInt64) -> UInt64 { MaglevTable.mix64(value) }

    /// 53 bits of `hash` as a number strictly between 0 and 1.
    static func unit(_ hash: UInt64) -> Double { (Double(hash >> 11) + 0.5) / 9_007_199_254_740_992 }
}
