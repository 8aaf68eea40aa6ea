// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import Dispatch
import ReusePortLB
import Synchronization

/// One dropped datagram as a capture keeps it.
package struct CapturedPacket: Sendable {
    /// Nanoseconds since the epoch.
    package var nanoseconds: UInt64
    /// An Ethernet frame (af_xdp), not a packet from its IP header.
    package var ethernet: Bool
    package var data: [UInt8]
    package var originalLength: Int
    /// The drop reason, as the metrics name it (`rate_limited`, `amplification_capped`, ...).
    package var reason: String
    /// A reply toward a client (two-way listeners), not a client's datagram.
    package var reply: Bool
    /// tc_ebpf: the packet was modified for a replication pool's copy before it was dropped.
    package var rewritten = false

    package init(nanoseconds: UInt64, ethernet: Bool, data: [UInt8], originalLength: Int, reason: String, reply: Bool, rewritten: Bool = false) {
        (self.nanoseconds, self.ethernet, self.data, self.originalLength, self.reason, self.reply, self.rewritten) =
            (nanoseconds, ethernet, data, originalLength, reason, reply, rewritten)
    }

    /// The packet's comment in the file: its reason, and what was done to it first if anything.
    package var comment: String { rewritten ? "\(reason) (modified for a replication pool's copy first)" : reason }

    /// The packet as a file of `linkType` holds it: an IP packet gets an Ethernet header with
    /// zero addresses in an Ethernet file; a frame loses its Ethernet header (and VLAN tags) in a
    /// raw IP file.
    package func data(for linkType: UInt16) -> (bytes: [UInt8], length: Int) {
        if linkType == Pcapng.linkTypeEthernet && !ethernet {
            let type: [UInt8] = data.first.map { $0 >> 4 == 6 } == true ? [0x86, 0xdd] : [0x08, 0x00]
            return ([UInt8](repeating: 0, count: 12) + type + data, originalLength + 14)
        }
        if linkType == Pcapng.linkTypeRaw && ethernet {
            var offset = 12
            while offset + 2 <= data.count, data[offset] == 0x81 || data[offset] == 0x88, data[offset + 1] == 0x00 || data[offset + 1] == 0xa8 { offset += 4 }
            offset += 2
            return (offset <= data.count ? Array(data[offset...]) : [], max(0, originalLength - offset))
        }
        return (data, originalLength)
    }
}

/// Why a capture cannot start, each with its HTTP status and the fix.
package enum CaptureRequestError: Error, CustomStringConvertible {
    case noListener(String, known: [String])
    case noListenerNamed(known: [String])
    case unknownReason(String)
    case neverDropped(listener: String, kind: String, reason: String, possible: [String])
    case badValue(key: String, value: String, expected: String)
    case tooMany(listener: String, limit: Int)

    package var status: Int {
        switch self {
        case .noListener: return 404
        case .noListenerNamed, .unknownReason, .neverDropped, .badValue: return 400
        case .tooMany: return 429
        }
    }

    package var description: String {
        switch self {
        case .noListener(let name, let known):
            return "no listener '\(name)' in the running configuration; its listeners: \(known.isEmpty ? "none" : known.joined(separator: ", "))"
        case .noListenerNamed(let known):
            return "name the listener: /capture?listener=NAME; its listeners: \(known.isEmpty ? "none" : known.joined(separator: ", "))"
        case .neverDropped(let listener, let kind, let reason, let possible):
            return "listener '\(listener)' (\(kind)) never drops a datagram for \(reason); what it can drop, and so capture: \(possible.joined(separator: ", "))"
        case .unknownReason(let reason):
            return "unknown drop reason '\(reason)'; give one of: \(DropCapture.reasons.joined(separator: ", "))"
        case .badValue(let key, let value, let expected):
            return "\(key) '\(value)': expected \(expected)"
        case .tooMany(let listener, let limit):
            return "\(limit) captures of listener '\(listener)' are running already; end one (Ctrl-C its udp-fanout capture; a capture whose client went ends within 2 s) and try again"
        }
    }
}

/// What one `udp-fanout capture` asks for.
package struct CaptureRequest: Sendable, Equatable {
    /// Reasons to keep; empty: every reason.
    package var reasons: Set<String> = []
    /// Packets to keep, then the capture ends; nil: until the client goes.
    package var count: Int?
    /// Bytes kept of each packet (from its IP header, or the frame's start for af_xdp).
    package var snaplen = 2048
    /// Packets a second at most (the listener's drops beyond it are not captured: sampled).
    package var rate = 1000
    /// The capture ends after this many seconds; nil: when count is reached or the client goes.
    package var seconds: Double?

    package init() {}

    /// The keys of `GET /capture`'s query.
    package static let keys = ["listener", "reason", "count", "snaplen", "rate", "seconds"]

    /// Parses the query of `GET /capture` (`listener` is read by the caller).
    package static func parse(_ query: [String: String]) throws(CaptureRequestError) -> CaptureRequest {
        var request = CaptureRequest()
        if let reasons = query["reason"], !reasons.isEmpty {
            for reason in reasons.split(separator: ",").map(String.init) {
                guard DropCapture.reasons.contains(reason) else { throw .unknownReason(reason) }
                request.reasons.insert(reason)
            }
        }
        func integer(_ key: String, _ range: ClosedRange<Int>) throws(CaptureRequestError) -> Int? {
            guard let text = query[key] else { return nil }
            guard let value = Int(text), range.contains(value) else {
                throw .badValue(key: key, value: text, expected: "a whole number from \(range.lowerBound) to \(range.upperBound)")
            }
            return value
        }
        request.count = try integer("count", 1...10_000_000)
        request.snaplen = try integer("snaplen", 64...DropCapture.snaplenMax) ?? request.snaplen
        request.rate = try integer("rate", 1...DropCapture.rateMax) ?? request.rate
        if let text = query["seconds"] {
            guard let value = Double(text), value > 0, value <= 86_400 else {
                throw .badValue(key: "seconds", value: text, expected: "seconds, more than 0, at most 86400")
            }
            request.seconds = value
        }
        return request
    }
}

/// One running capture: what it asked for, and the packets taken for it that its reader has not
/// written yet (bounded: beyond it they are counted lost, not kept).
package final class CaptureSession: Sendable {
    package let request: CaptureRequest
    private let state = Mutex<State>(State())
    /// The listener's counts when the session started (its end says what grew since).
    private let start = Mutex(DropCapture.Counts())
    var baseline: DropCapture.Counts {
        get { start.withLock { $0 } }
        set { start.withLock { $0 = newValue } }
    }
    /// Packets waiting for the reader at most.
    static let queueLimit = 4096

    private struct State {
        var waiting: [CapturedPacket] = []
        var taken = 0
        var lost: UInt64 = 0
        /// When it started, then when its reader last took packets (CLOCK_MONOTONIC nanoseconds).
        var lastTake = SourceRateLimiter.now()
        /// Its reader took packets (or none) once at least.
        var started = false
    }

    /// A session whose reader never took packets this long after it started (its response was
    /// never written: the client went first) is ended by the capture's reaper. A reader that
    /// runs notices a client gone by its writes failing (its keep-alives every 2 s).
    static let abandonedAfter: Int64 = 30_000_000_000

    var isAbandoned: Bool { state.withLock { !$0.started && SourceRateLimiter.now() - $0.lastTake > Self.abandonedAfter } }

    /// Why the listener's capture ended the session before its reader did (nil: it did not).
    private let endedBy = Mutex<String?>(nil)
    var ended: String? {
        get { endedBy.withLock { $0 } }
        set { endedBy.withLock { $0 = newValue } }
    }

    init(_ request: CaptureRequest) {
        self.request = request
    }

    func wants(_ reason: String) -> Bool { request.reasons.isEmpty || request.reasons.contains(reason) }

    /// Keeps `packet` if the session wants it and has room; false once its count is reached.
    func push(_ packet: CapturedPacket) {
        guard wants(packet.reason) else { return }
        state.withLock { state in
            if let count = request.count, state.taken >= count { return }
            guard state.waiting.count < Self.queueLimit else {
                state.lost += 1
                return
            }
            state.waiting.append(packet)
            state.taken += 1
        }
    }

    /// The packets waiting, whether the count is reached (nothing more will come), the packets
    /// lost for want of room, and why the capture ended the session if it did.
    package func take() -> (packets: [CapturedPacket], complete: Bool, lost: UInt64, ended: String?) {
        let ended = self.ended
        return state.withLock { state in
            defer { state.waiting.removeAll(keepingCapacity: true) }
            state.lastTake = SourceRateLimiter.now()
            state.started = true
            return (state.waiting, request.count.map { state.taken >= $0 } ?? false, state.lost, ended)
        }
    }
}

/// The captures of one listener (held by its ``ListenerCounters``, so across reloads): the
/// forwarding threads offer what they drop while one runs, sampled to the highest rate asked;
/// the kernel kinds' programs are told what to capture by the watchers their listener instances
/// register. Without a capture a drop costs one relaxed atomic load.
package final class DropCapture: Sendable {
    /// The reasons a capture may ask for: the drops decided per datagram, before it is sent,
    /// where the datagram is at hand (client datagrams' and replies'). Not among them: what a
    /// send call refused after the batch (send_buffer_full, unreachable, send_error,
    /// family_mismatch, downstream_unreachable: counted, per downstream too), crash, and closing
    /// (relay: read by a stopping worker after its capture ended with its drain).
    package static let reasons: [String] = [
        "no_healthy", DropReason.rateLimited.rawValue, DropReason.tooLarge.rawValue, DropReason.tableFull.rawValue,
        DropReason.parseError.rawValue, DropReason.ttlExpired.rawValue, DropReason.noRoute.rawValue, DropReason.rewriteFailed.rawValue,
        ReplyDropReason.wrongServer.rawValue, ReplyDropReason.drained.rawValue, ReplyDropReason.amplificationCapped.rawValue,
    ]
    /// What `listener` can drop and so capture, by its kind (the reasons each kind decides per
    /// datagram; docs/abuse.md "Capture of drops").
    static func reasons(for listener: Listener) -> [String] {
        var kind: [String]
        if TCDataplane.serves(listener) {
            kind = ["no_healthy", "rate_limited", "too_large", "no_route", "ttl_expired", "rewrite_failed"]
            if listener.replies == .nat { kind += ["wrong_server", "drained", "amplification_capped"] }
        } else if AFXDPKind.serves(listener) {
            kind = ["no_healthy", "rate_limited", "too_large", "parse_error", "ttl_expired"]
        } else {
            kind = ["no_healthy", "rate_limited", "too_large"]
            if listener.replies == .relay { kind += ["table_full", "amplification_capped"] }
        }
        return reasons.filter { kind.contains($0) }
    }

    /// The most of a packet a capture keeps: the kernel programs' buffer (FANOUT_CAPTURE_DATA_MAX).
    package static let snaplenMax = 2048
    /// Captures of one listener at once at most.
    package static let sessionLimit = 4
    /// The highest sampling rate a capture may ask for (packets a second): each packet taken
    /// costs a forwarding thread of a socket kind a copy and a lock.
    package static let rateMax = 10_000

    /// True while a capture runs: read by the forwarding threads at each drop.
    let active = Atomic<Bool>(false)
    private let state = Mutex<State>(State())
    /// Held from a change of the sessions or watchers to the end of its publishing and of the
    /// watchers' applying it, so that changes are applied in the order they were made (never
    /// the forwarding threads' or the ring reader's: they only read).
    private let applying = Mutex(())
    /// The sampling's theoretical arrival time (nanoseconds, CLOCK_MONOTONIC), as rate_limit's GCRA.
    private let tat = Atomic<UInt64>(0)
    /// The filter for the forwarding threads, without a lock: the reasons (a bit per index in
    /// ``reasons``), the sampling's interval and tolerance, the snap length.
    private let reasonBits = Atomic<UInt64>(0)
    private let interval = Atomic<UInt64>(0)
    private let tolerance = Atomic<UInt64>(0)
    private let snaplen = Atomic<Int>(0)
    /// Each reason's bit.
    static let reasonBit: [String: UInt64] = Dictionary(uniqueKeysWithValues: reasons.enumerated().map { ($0.element, UInt64(1) << UInt64($0.offset)) })

    /// What the sessions ask for together: every reason any asks for (nil: all), the highest rate
    /// and snap length.
    package struct Filter: Sendable, Equatable {
        package var reasons: Set<String>?
        package var rate: Int
        package var snaplen: Int

        /// GCRA interval and tolerance of `rate` a second with a tenth of a second's burst (at least 1).
        var sampling: (interval: UInt64, tolerance: UInt64) {
            let interval = max(1, 1_000_000_000 / UInt64(max(1, rate)))
            return (interval, interval * UInt64(max(1, rate / 10)))
        }
    }

    private struct State {
        var sessions: [ObjectIdentifier: CaptureSession] = [:]
        var filter: Filter?
        /// The kernel kinds' running instances: told the filter (nil: none) when it changes, and
        /// asked what their program did not capture.
        var watchers: [ObjectIdentifier: Watcher] = [:]
    }

    private struct Watcher {
        var apply: @Sendable (Filter?) -> Void
        var counts: @Sendable () -> Counts
    }

    /// What was not captured, since the process started: above the sampling rate (in the threads
    /// and the programs), and taken by a program but lost (its ring buffer full, or its bytes
    /// unreadable).
    package struct Counts: Sendable, Equatable {
        package var sampledOut: UInt64 = 0
        package var kernelLost: UInt64 = 0

        /// What grew since `earlier` (a count that went back, a listener's instance replaced, is 0).
        func since(_ earlier: Counts) -> Counts {
            Counts(sampledOut: sampledOut >= earlier.sampledOut ? sampledOut - earlier.sampledOut : 0,
                   kernelLost: kernelLost >= earlier.kernelLost ? kernelLost - earlier.kernelLost : 0)
        }
    }

    /// Drops a capture wanted that the threads' sampling refused.
    private let sampledOut = Atomic<UInt64>(0)

    /// The counts now.
    package func counts() -> Counts {
        let watchers = state.withLock { Array($0.watchers.values) }
        var total = Counts(sampledOut: sampledOut.load(ordering: .relaxed))
        for watcher in watchers {
            let counted = watcher.counts()
            total.sampledOut &+= counted.sampledOut
            total.kernelLost &+= counted.kernelLost
        }
        return total
    }

    package init() {}

    /// The filter now (nil: no capture runs).
    package var filter: Filter? { state.withLock { $0.filter } }

    /// Starts `session`; a reaper ends it if its reader goes without ending it.
    /// - Throws: ``CaptureRequestError/tooMany(listener:limit:)``.
    package func start(_ session: CaptureSession, listener: String) throws(CaptureRequestError) {
        session.baseline = counts()
        try applying.withLock { _ throws(CaptureRequestError) in
            let (filter, watchers) = try state.withLock { state throws(CaptureRequestError) in
                guard state.sessions.count < Self.sessionLimit else { throw .tooMany(listener: listener, limit: Self.sessionLimit) }
                state.sessions[ObjectIdentifier(session)] = session
                return Self.refilter(&state)
            }
            publish(filter)
            for watcher in watchers { watcher(filter) }
        }
        reap(session)
    }

    /// Ends `session` (idempotent): the last one ends the listener's capture. `reason`: why, when
    /// not by its reader (its stream says so).
    package func end(_ session: CaptureSession, reason: String? = nil) {
        if let reason { session.ended = reason }
        applying.withLock { _ in
            let (filter, watchers) = state.withLock { state in
                state.sessions[ObjectIdentifier(session)] = nil
                return Self.refilter(&state)
            }
            publish(filter)
            for watcher in watchers { watcher(filter) }
        }
    }

    /// Every 5 s while `session` runs: ended when its reader never started within
    /// ``CaptureSession/abandonedAfter`` (off the forwarding threads and the ring reader).
    private func reap(_ session: CaptureSession) {
        DispatchQueue.global().asyncAfter(deadline: .now() + .seconds(5)) { [weak self] in
            guard let self, self.state.withLock({ $0.sessions[ObjectIdentifier(session)] != nil }) else { return }
            if session.isAbandoned {
                self.end(session, reason: "its reader never started (the client went)")
            } else {
                self.reap(session)
            }
        }
    }

    /// The filter into the atomics the forwarding threads read, `active` last.
    private func publish(_ filter: Filter?) {
        guard let filter else {
            active.store(false, ordering: .releasing)
            return
        }
        let bits = filter.reasons.map { $0.reduce(UInt64(0)) { $0 | (Self.reasonBit[$1] ?? 0) } } ?? UInt64.max
        reasonBits.store(bits, ordering: .relaxed)
        let (every, burst) = filter.sampling
        // Another rate starts its sampling with a whole burst.
        if interval.load(ordering: .relaxed) != every { tat.store(0, ordering: .relaxed) }
        interval.store(every, ordering: .relaxed)
        tolerance.store(burst, ordering: .relaxed)
        snaplen.store(filter.snaplen, ordering: .relaxed)
        active.store(true, ordering: .releasing)
    }

    /// A kernel listener instance: `apply` is called with the filter now, and at each change
    /// until ``unwatch(_:)``.
    /// `counts`: what its program did not capture (since it started).
    func watch(_ owner: AnyObject, counts: @escaping @Sendable () -> Counts, _ apply: @escaping @Sendable (Filter?) -> Void) {
        applying.withLock { _ in
            let filter = state.withLock { state in
                state.watchers[ObjectIdentifier(owner)] = Watcher(apply: apply, counts: counts)
                return state.filter
            }
            apply(filter)
        }
    }

    /// Once it returns, `owner`'s `apply` is not running and is not called again.
    func unwatch(_ owner: AnyObject) {
        applying.withLock { _ in
            _ = state.withLock { $0.watchers.removeValue(forKey: ObjectIdentifier(owner)) }
        }
    }

    private static func refilter(_ state: inout State) -> (Filter?, [@Sendable (Filter?) -> Void]) {
        let sessions = Array(state.sessions.values)
        if sessions.isEmpty {
            state.filter = nil
        } else {
            let all = sessions.contains { $0.request.reasons.isEmpty }
            state.filter = Filter(reasons: all ? nil : sessions.reduce(into: Set<String>()) { $0.formUnion($1.request.reasons) },
                                  rate: sessions.map(\.request.rate).max() ?? 1, snaplen: sessions.map(\.request.snaplen).max() ?? 64)
        }
        return (state.filter, state.watchers.values.map(\.apply))
    }

    // MARK: offered by the forwarding threads (only while `active`)

    /// A socket kind's dropped datagram: `payload` (what was read of it; its whole length
    /// `payloadLength`) from `source` to `destination`, made into the IP packet it arrived as.
    func offer(_ reason: String, reply: Bool = false, payload: UnsafeRawBufferPointer, payloadLength: Int,
               source: UnsafePointer<sockaddr_storage>, destination: SocketAddress) {
        guard let from = SocketAddress(storage: UnsafeRawPointer(source)) else { return }
        offer(reason, reply: reply, payload: payload, payloadLength: payloadLength, source: from, destination: destination)
    }

    func offer(_ reason: String, reply: Bool = false, payload: UnsafeRawBufferPointer, payloadLength: Int,
               source: SocketAddress, destination: SocketAddress) {
        guard let snaplen = admit(reason) else { return }
        let (bytes, length) = SyntheticPacket.make(payload: payload, payloadLength: payloadLength, from: source, to: destination, snaplen: snaplen)
        deliver(CapturedPacket(nanoseconds: Self.wallNanoseconds(), ethernet: false, data: bytes,
                               originalLength: length, reason: reason, reply: reply))
    }

    /// af_xdp: the frame as it arrived (Ethernet).
    func offer(_ reason: String, frame: UnsafeRawBufferPointer) {
        guard let snaplen = admit(reason) else { return }
        deliver(CapturedPacket(nanoseconds: Self.wallNanoseconds(), ethernet: true,
                               data: Array(frame.prefix(snaplen)), originalLength: frame.count, reason: reason, reply: false))
    }

    /// The snap length if a capture wants `reason` and the sampling lets one more packet through.
    private func admit(_ reason: String) -> Int? {
        guard active.load(ordering: .acquiring), reasonBits.load(ordering: .relaxed) & (Self.reasonBit[reason] ?? 0) != 0 else { return nil }
        let interval = interval.load(ordering: .relaxed)
        let tolerance = tolerance.load(ordering: .relaxed)
        let now = UInt64(SourceRateLimiter.now())
        var old = tat.load(ordering: .relaxed)
        while true {
            let next = max(old, now) + interval
            guard next - now <= tolerance else {
                sampledOut.add(1, ordering: .relaxed)
                return nil
            }
            let (exchanged, seen) = tat.compareExchange(expected: old, desired: next, ordering: .relaxed)
            if exchanged { return snaplen.load(ordering: .relaxed) }
            old = seen
        }
    }

    /// A packet taken (the kernel programs sample their own): to every session that wants it.
    func deliver(_ packet: CapturedPacket) {
        let sessions = state.withLock { Array($0.sessions.values) }
        for session in sessions { session.push(packet) }
    }

    static func wallNanoseconds() -> UInt64 {
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        return UInt64(now.tv_sec) * 1_000_000_000 + UInt64(now.tv_nsec)
    }
}
