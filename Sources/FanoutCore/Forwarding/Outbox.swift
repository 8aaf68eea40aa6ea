// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB

/// What one flush of an outbox did: datagrams and bytes sent, and the datagrams dropped by reason.
typealias FlushResult = (sent: UInt64, bytes: UInt64, dropped: DropTally)

/// Datagrams dropped by reason, without an allocation: a forwarding thread makes one per
/// downstream it sent to in every batch (a dictionary there cost retains and releases per
/// downstream: perf at 3000 downstreams). Read and written as a dictionary would be:
/// `tally[reason, default: 0] += n`, `tally[reason]` (nil when none), iterated as (reason, count)
/// pairs of the reasons with drops, in ``DropReason``'s order. A count of 0 is no entry.
struct DropTally: Sequence, Equatable, ExpressibleByDictionaryLiteral, CustomStringConvertible {
    /// Room for every ``DropReason`` (``DropReason/ordinal``), as many as the mask has bits.
    static let capacity = 16
    private var counts: (UInt64, UInt64, UInt64, UInt64, UInt64, UInt64, UInt64, UInt64,
                         UInt64, UInt64, UInt64, UInt64, UInt64, UInt64, UInt64, UInt64) = (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    /// Bit `reason.ordinal` set: that reason has drops.
    private var present: UInt16 = 0

    init() {}

    init(dictionaryLiteral elements: (DropReason, UInt64)...) {
        for (reason, count) in elements { self[reason, default: 0] += count }
    }

    var isEmpty: Bool { present == 0 }

    private func count(at ordinal: Int) -> UInt64 {
        withUnsafeBytes(of: counts) { $0.load(fromByteOffset: ordinal * MemoryLayout<UInt64>.stride, as: UInt64.self) }
    }

    subscript(reason: DropReason, default value: UInt64) -> UInt64 {
        get { present & (1 << reason.ordinal) != 0 ? count(at: reason.ordinal) : value }
        set {
            withUnsafeMutableBytes(of: &counts) { $0.storeBytes(of: newValue, toByteOffset: reason.ordinal * MemoryLayout<UInt64>.stride, as: UInt64.self) }
            if newValue != 0 { present |= 1 << reason.ordinal } else { present &= ~(1 << reason.ordinal) }
        }
    }

    subscript(reason: DropReason) -> UInt64? { present & (1 << reason.ordinal) != 0 ? count(at: reason.ordinal) : nil }

    /// Every reason's drops added up (a reason without drops holds 0).
    var total: UInt64 {
        guard present != 0 else { return 0 }
        return withUnsafeBytes(of: counts) { $0.bindMemory(to: UInt64.self).reduce(0, &+) }
    }

    struct Iterator: IteratorProtocol {
        fileprivate var remaining: UInt16
        fileprivate let tally: DropTally

        mutating func next() -> (DropReason, UInt64)? {
            guard remaining != 0 else { return nil }
            let ordinal = remaining.trailingZeroBitCount
            remaining &= remaining - 1
            return (DropReason.byOrdinal[ordinal], tally.count(at: ordinal))
        }
    }

    func makeIterator() -> Iterator { Iterator(remaining: present, tally: self) }

    static func == (a: DropTally, b: DropTally) -> Bool {
        a.present == b.present && a.allSatisfy { b[$0.0] == $0.1 }
    }

    var description: String { "[" + map { "\($0.0.rawValue): \($0.1)" }.joined(separator: ", ") + "]" }
}

extension DropReason {
    /// The reason's place in ``DropTally``: its index in `allCases` (below ``DropTally/capacity``).
    var ordinal: Int {
        switch self {
        case .tooLarge: 0
        case .sendBufferFull: 1
        case .unreachable: 2
        case .sendError: 3
        case .noRoute: 4
        case .ttlExpired: 5
        case .rewriteFailed: 6
        case .parseError: 7
        case .familyMismatch: 8
        case .tableFull: 9
        case .crash: 10
        case .rateLimited: 11
        case .closing: 12
        }
    }

    static let byOrdinal: [DropReason] = allCases
}

/// Where a forwarder gathers the datagrams of one batch for one downstream and sends them in one
/// go: ``DownstreamOutbox`` (the payload through a connected UDP socket, `output: socket`) or
/// ``SourcePreservingOutbox`` (the whole datagram with the client's source, `output:
/// preserve_source`). Shared by userspace workers and af_xdp forwarders; owned by one thread.
protocol Outbox: AnyObject {
    /// Datagrams appended since the last flush.
    var count: Int { get }
    /// The last flush got ICMP port unreachable back (passive health).
    var refused: Bool { get }
    /// Adds one datagram: `payload` must stay valid until ``flush(_:)`` returns (no copy).
    /// `hopLimit`: the TTL/hop limit a source-preserving way out sends with (0: its default).
    func append(_ payload: UnsafeRawBufferPointer, source: UnsafePointer<sockaddr_storage>, hopLimit: UInt8)
    /// Hands what was appended to the thread's ``SharedSender`` when this way out sends through it
    /// (the next ``flush(_:)`` then returns the outcome instead of sending).
    func stage()
    /// An ICMP error came back to the shared socket about a datagram sent to `address`.
    func drewError(at address: SocketAddress)
    /// A plan change kept this way out: ICMP errors it holds from before are about sends of the
    /// plan that went, and are forgotten.
    func forgetErrors()
    /// Sends what was appended; every datagram is either counted sent or dropped with its reason.
    func flush(_ result: inout FlushResult)
    /// Retries a socket that could not be made, at most once a second; true when this call made it.
    func reconnectIfDue() -> Bool
    /// Why datagrams are dropped right now without a send (no socket), for a log line; nil when sending.
    var unavailable: String? { get }
    /// The crash ledger slot of the thread this outbox sends the listener's own datagrams for:
    /// each send call carrying them notes it first (``CrashLedger/Slot/handing(_:)``); nil for
    /// copies (pools, templates), which the ledger does not hold.
    var ledger: CrashLedger.Slot? { get set }
}

extension Outbox {
    func stage() {}
    func drewError(at address: SocketAddress) {}
    func forgetErrors() {}
}

/// The outboxes of a plan being replaced, by way out and address: the new plan takes those of the
/// downstreams it keeps (their sockets, GSO and error state) and makes only the others, so a
/// membership change opens sockets for new downstreams only. Taken between batches (empty outboxes).
struct OutboxShelf {
    private struct Key: Hashable {
        let output: Output
        let address: SocketAddress
    }
    private var shelf: [Key: [any Outbox]] = [:]

    /// Keeps `outbox` for the next plan, unless it is unavailable (no route, no raw socket): the
    /// next plan makes that one again, which tries again and logs what is still wrong. A kept
    /// `preserve_source` outbox keeps its path MTU (re-read when a send says it shrank).
    mutating func put(_ outbox: any Outbox, output: Output, address: SocketAddress) {
        guard outbox.unavailable == nil else { return }
        shelf[Key(output: output, address: address), default: []].append(outbox)
    }

    /// An outbox of the previous plan for `address` with `output`, or a new one from `make`
    /// (`made` says which: a new one's problems are logged once, where it is made).
    mutating func take(output: Output, address: SocketAddress, make: () -> any Outbox) -> (outbox: any Outbox, made: Bool) {
        if let outbox = shelf[Key(output: output, address: address)]?.popLast() {
            // Kept across the change: ICMP errors it holds are about sends of the plan that went.
            outbox.forgetErrors()
            return (outbox, false)
        }
        return (make(), true)
    }
}

/// Makes the way out to each downstream for a listener's `settings.output`.
enum Outboxes {
    static func factory(output: Output, capacity: Int) -> BatchForwarder.OutboxFactory {
        switch output {
        case .socket:
            return { downstream, sender in DownstreamOutbox(address: downstream.address, capacity: capacity, shared: sender) }
        case .preserveSource, .xdpTX:
            // xdp_tx's own way out is the TX ring (af_xdp's forwarder); what cannot take it goes as preserve_source.
            return { downstream, sender in
                do {
                    return try SourcePreservingOutbox(address: downstream.address, capacity: capacity, shared: sender.raw)
                } catch {
                    // Checked at the listener's start (``Outboxes/check(_:)``): reached only if the
                    // capability went away since; every datagram is then dropped and counted.
                    return UnavailableOutbox(problem: "\(error)")
                }
            }
        }
    }
}

extension Outboxes {
    /// Makes one way out of `output` toward `downstream` and throws its error, so a listener
    /// whose way out cannot work (preserve_source without CAP_NET_RAW) fails at start, naming the fix.
    static func check(_ output: Output, _ downstream: SocketAddress) throws(OutboxError) {
        guard output == .preserveSource || output == .xdpTX else { return }
        _ = try SourcePreservingOutbox(address: downstream, capacity: 1)
    }
}

/// An outbox whose socket could not be made (the reason is logged once per plan): every datagram
/// appended is dropped and counted with `reason`.
final class UnavailableOutbox: Outbox {
    private(set) var count = 0
    var ledger: CrashLedger.Slot?
    let refused = false
    let unavailable: String?
    private let reason: DropReason

    init(problem: String, reason: DropReason = .sendError) {
        unavailable = problem
        self.reason = reason
    }

    func append(_ payload: UnsafeRawBufferPointer, source: UnsafePointer<sockaddr_storage>, hopLimit: UInt8) { count += 1 }

    func flush(_ result: inout FlushResult) {
        ledger?.handing(count)
        result.dropped[reason, default: 0] += UInt64(count)
        count = 0
    }

    func reconnectIfDue() -> Bool { false }
}
