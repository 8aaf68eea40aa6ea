// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB

/// What one flush of an outbox did: datagrams and bytes sent, and the datagrams dropped by reason.
typealias FlushResult = (sent: UInt64, bytes: UInt64, dropped: [DropReason: UInt64])

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
            return { downstream, _ in
                do {
                    return try SourcePreservingOutbox(address: downstream.address, capacity: capacity)
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
