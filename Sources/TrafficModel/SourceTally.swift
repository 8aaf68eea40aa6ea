// SPDX-License-Identifier: Apache-2.0
/// What one collector saw of one source address: every datagram, and for those that carry the
/// publisher's header, loss and reordering from its sequence numbers.
public struct SourceTally: Sendable, Equatable {
    /// Every datagram from the source.
    public private(set) var packets: UInt64 = 0
    /// Of those, the ones with the publisher's header (a sequence number).
    public private(set) var sequenced: UInt64 = 0
    public private(set) var lowest: UInt64 = .max
    public private(set) var highest: UInt64 = 0
    /// Datagrams that arrived after one with a higher sequence number.
    public private(set) var reordered: UInt64 = 0

    public init() {}

    /// A datagram with the publisher's sequence number.
    public mutating func record(sequence: UInt64) {
        if sequenced > 0 && sequence < highest { reordered += 1 }
        packets += 1
        sequenced += 1
        lowest = min(lowest, sequence)
        highest = max(highest, sequence)
    }

    /// A datagram without the publisher's header: counted, nothing to check.
    public mutating func recordUnsequenced() {
        packets += 1
    }

    /// More sequenced datagrams than numbers between the lowest and highest: the sequences of
    /// several senders share this address (a proxy in between, or publishers run one after
    /// another), so ``lost`` and ``reordered`` mean nothing here.
    public var isMixed: Bool {
        sequenced > 0 && sequenced > highest - lowest + 1
    }

    /// Sequence numbers between the lowest and highest seen that never arrived. Meaningful only
    /// where every datagram of a source reaches one collector (not with roundRobin) and the
    /// source is one sender (not ``isMixed``).
    public var lost: UInt64 {
        guard sequenced > 0 else { return 0 }
        let span = highest - lowest + 1
        return span > sequenced ? span - sequenced : 0
    }
}

/// Per-source tallies with a bound: the first `limit` distinct sources are counted exactly,
/// datagrams of any further source go to one `other` count, so spoofed source addresses cannot
/// grow the table without limit.
public struct SourceTable<Key: Hashable> {
    public let limit: Int
    public private(set) var tallies: [Key: SourceTally] = [:]
    /// Datagrams from sources past the limit.
    public private(set) var otherPackets: UInt64 = 0

    public init(limit: Int) {
        precondition(limit >= 0)
        self.limit = limit
        tallies.reserveCapacity(min(limit, 4096))
    }

    /// Records one datagram of `source`, with the publisher's sequence number if it has one.
    public mutating func record(_ source: Key, sequence: UInt64?) {
        if tallies[source] == nil && tallies.count >= limit {
            otherPackets += 1
            return
        }
        if let sequence {
            tallies[source, default: SourceTally()].record(sequence: sequence)
        } else {
            tallies[source, default: SourceTally()].recordUnsequenced()
        }
    }
}
