/// What one collector saw of one source: packets, and loss and reordering from the sequence
/// numbers of the publisher's payload.
public struct SourceTally: Sendable, Equatable {
    public private(set) var packets: UInt64 = 0
    public private(set) var lowest: UInt64 = .max
    public private(set) var highest: UInt64 = 0
    /// Datagrams that arrived after one with a higher sequence number.
    public private(set) var reordered: UInt64 = 0

    public init() {}

    public mutating func record(sequence: UInt64) {
        if packets > 0 && sequence < highest { reordered += 1 }
        packets += 1
        lowest = min(lowest, sequence)
        highest = max(highest, sequence)
    }

    /// Sequence numbers between the lowest and highest seen that never arrived (a source
    /// steered to this collector alone; with roundRobin each collector sees only a share).
    public var lost: UInt64 {
        guard packets > 0 else { return 0 }
        let span = highest - lowest + 1
        return span > packets ? span - packets : 0
    }
}
