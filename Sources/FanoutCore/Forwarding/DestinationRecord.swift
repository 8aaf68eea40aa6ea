// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif

/// One `output: socket` downstream of a forwarding thread's plan as a batch reads it: one cache
/// line of a dense per-thread table (``BatchForwarder``), indexed by the plan's downstream index.
/// It holds the downstream's address (the shared sender's msg_name points into it), whether the
/// thread may stage the downstream's runs itself, and what the shared sender delivered for it
/// since its counters were last added to. A batch that touches 64 of 3,000 downstreams then reads and writes 64 of these
/// lines and no outbox; each outbox was a few cold cache lines, and its address in an allocation
/// of its own one more, for the kernel's copy of msg_name (perf at 3,000 downstreams).
///
/// The outbox keeps the table's ``Flags/sendsShared`` and ``Flags/gso`` current
/// (``DownstreamOutbox/slot``): whenever its socket, direct period or GSO state changes.
struct DestinationRecord {
    /// The downstream as msg_name: a sockaddr_in or a sockaddr_in6 (first: at the record's start).
    var name = sockaddr_in6()
    var nameLength: socklen_t = 0
    /// ``Flags``' bits.
    var flags: UInt32 = 0
    /// Datagrams and bytes the shared sender delivered for the runs the thread staged, not yet
    /// added to the downstream's counters (``BatchForwarder/publishCounts()``: at the end of the
    /// worker's turn, and at least every ``BatchForwarder/publishInterval`` within a long one).
    var sent: UInt64 = 0
    var bytes: UInt64 = 0
    /// The downstream's outbox (the forwarder's ``BatchForwarder/outboxes`` owns it).
    let outbox: Unmanaged<DownstreamOutbox>

    enum Flags {
        /// The runs may be staged by the thread into the shared sender: the outbox has a connected
        /// socket (the downstream has a route), is not in a direct period after an ICMP error, and
        /// has a shared sender. Otherwise the outbox adopts its run and decides (as it always did).
        static let sendsShared: UInt32 = 1 << 0
        /// UDP GSO is on for the downstream (the kernel refused none of its GSO messages).
        static let gso: UInt32 = 1 << 1
        /// The address is IPv6 (the shared sender's IPv6 socket).
        static let ipv6: UInt32 = 1 << 2
        /// This batch's run was staged by the thread: what was delivered is added to ``sent`` and
        /// ``bytes``; what failed, with ``outboxHolds``, is in the outbox.
        static let staged: UInt32 = 1 << 3
        /// The shared sender reported a failed message of the run to the outbox, which holds its
        /// drops until the flush collects them (``DownstreamOutbox/collectPending(_:)``).
        static let outboxHolds: UInt32 = 1 << 4
        /// ``sent`` and ``bytes`` hold counts not yet published (the target is in the forwarder's list).
        static let unpublished: UInt32 = 1 << 5
    }

    /// Where msg_name points for this record.
    static let nameOffset = MemoryLayout<DestinationRecord>.offset(of: \.name)!

    /// A record for `outbox`: the outbox writes its address and flags when it is given the record
    /// (``DownstreamOutbox/slot``).
    init(outbox: DownstreamOutbox) {
        self.outbox = .passUnretained(outbox)
    }
}

/// The records of a forwarding thread's plan, in memory of their own, one cache line each.
struct DestinationTable {
    private(set) var base: UnsafeMutablePointer<DestinationRecord>?
    private(set) var count = 0

    /// Makes the table for `outboxes` (the plan's, in target order) and points each outbox at its
    /// record. The table before must have been released (``release()``) while its outboxes were
    /// alive.
    mutating func rebuild(_ outboxes: [Unmanaged<DownstreamOutbox>]) {
        precondition(base == nil, "DestinationTable: rebuilt without releasing the table before")
        precondition(MemoryLayout<DestinationRecord>.stride == 64 && DestinationRecord.nameOffset == 0, "DestinationRecord: one cache line, msg_name first")
        guard !outboxes.isEmpty else { return }
        let stride = MemoryLayout<DestinationRecord>.stride
        let raw = UnsafeMutableRawPointer.allocate(byteCount: outboxes.count * stride, alignment: 64)
        let records = raw.bindMemory(to: DestinationRecord.self, capacity: outboxes.count)
        for (index, outbox) in outboxes.enumerated() {
            (records + index).initialize(to: DestinationRecord(outbox: outbox.takeUnretainedValue()))
            outbox._withUnsafeGuaranteedRef { $0.slot = records + index }
        }
        base = records
        count = outboxes.count
    }

    /// Frees the records; their outboxes stop writing to them. Every outbox the table names must
    /// still be alive (the records hold them unretained).
    mutating func release() {
        guard let base else { return }
        for index in 0..<count { base[index].outbox._withUnsafeGuaranteedRef { $0.slot = nil } }
        base.deinitialize(count: count)
        UnsafeMutableRawPointer(base).deallocate()
        self.base = nil
        count = 0
    }
}
