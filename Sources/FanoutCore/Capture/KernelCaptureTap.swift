// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import CLibBPF
import Logging
import Synchronization
import SystemCalls

/// `udp-fanout capture` in the kernel kinds (tc_ebpf, xdp): the programs copy what a listener
/// with a running capture drops into a ring buffer (bpf/include/fanout_capture.h); this reads it
/// on a thread of its own while any capture runs, and hands each packet to its listener's
/// ``DropCapture``.
final class KernelCaptureTap: Sendable {
    private let captures = Mutex<[UInt32: DropCapture]>([:])
    private let reader = Mutex<RingBufferReader?>(nil)

    /// The programs' reason codes (enum fanout_verdict; FANOUT_CAPTURE_RATE_LIMITED and
    /// FANOUT_CAPTURE_AMP_CAPPED follow FANOUT_VERDICT_COUNT) and the metrics' names.
    static let reasonCodes: [(code: UInt32, name: String)] = [
        (FANOUT_VERDICT_NO_BACKEND.rawValue, "no_healthy"), (FANOUT_VERDICT_NO_ROUTE.rawValue, DropReason.noRoute.rawValue),
        (FANOUT_VERDICT_TTL_EXPIRED.rawValue, DropReason.ttlExpired.rawValue), (FANOUT_VERDICT_TOO_LARGE.rawValue, DropReason.tooLarge.rawValue),
        (FANOUT_VERDICT_REWRITE_FAILED.rawValue, DropReason.rewriteFailed.rawValue),
        (FANOUT_VERDICT_WRONG_SERVER.rawValue, ReplyDropReason.wrongServer.rawValue), (FANOUT_VERDICT_DRAINED.rawValue, ReplyDropReason.drained.rawValue),
        (FANOUT_VERDICT_COUNT.rawValue + 0, DropReason.rateLimited.rawValue),
        (FANOUT_VERDICT_COUNT.rawValue + 1, ReplyDropReason.amplificationCapped.rawValue),
    ]

    /// A reason code's name (a code this build does not name: `verdict_N`).
    static func reason(code: UInt32) -> String {
        reasonCodes.first { $0.code == code }?.name ?? "verdict_\(code)"
    }

    /// The programs' form of `filter` (nil: no capture).
    static func config(_ filter: DropCapture.Filter?) -> fanout_capture_config {
        var config = fanout_capture_config()
        guard let filter else { return config }
        let mask = filter.reasons.map { names in reasonCodes.filter { names.contains($0.name) }.reduce(UInt64(0)) { $0 | (UInt64(1) << UInt64($1.code)) } } ?? UInt64.max
        config.forward_reasons = mask
        config.reply_reasons = mask
        (config.interval, config.tolerance) = filter.sampling
        config.snaplen = UInt32(min(filter.snaplen, Int(FANOUT_CAPTURE_DATA_MAX)))
        return config
    }

    init(ringBuffer fd: Int32, logger: Logger) throws(SystemCallError) {
        let made = try RingBufferReader(
            ringBuffer: fd, map: FANOUT_MAP_CAPTURE_NAME, threadName: "udp-fanout-cap",
            failure: "capture: reading the programs' dropped packets failed; the capture gets none while it lasts", logger: logger,
            deliver: { [weak self] data, size in self?.deliver(data, size: size) })
        reader.withLock { $0 = made }
    }

    func register(id: UInt32, _ capture: DropCapture) {
        captures.withLock { $0[id] = capture }
    }

    /// - Returns: whether no listener is left.
    func unregister(id: UInt32) -> Bool {
        captures.withLock { captures in
            captures[id] = nil
            return captures.isEmpty
        }
    }

    /// Stops the reader (within its 100 ms poll) and frees the ring. Idempotent.
    func stop() {
        reader.withLock { $0 }?.stop()
    }

    private func deliver(_ data: UnsafeRawPointer, size: Int) {
        let header = MemoryLayout<fanout_capture_event>.offset(of: \.data)!
        guard size >= header else { return }
        func field<T>(_ path: KeyPath<fanout_capture_event, T>, _ type: T.Type) -> T {
            data.loadUnaligned(fromByteOffset: MemoryLayout<fanout_capture_event>.offset(of: path)!, as: type)
        }
        let time = field(\.time, UInt64.self)
        let id = field(\.listener_id, UInt32.self)
        let wire = field(\.wire_length, UInt32.self)
        let length = field(\.length, UInt32.self)
        let reason = field(\.reason, UInt16.self)
        let flags = UInt32(field(\.flags, UInt8.self))
        guard Int(length) <= size - header, let capture = captures.withLock({ $0[id] }) else { return }
        // bpf_ktime_get_ns is CLOCK_MONOTONIC: moved to the wall clock by the offset now.
        let offset = Int64(bitPattern: DropCapture.wallNanoseconds()) - SourceRateLimiter.now()
        let bytes = Array(UnsafeRawBufferPointer(start: data + header, count: Int(length)))
        capture.deliver(CapturedPacket(nanoseconds: UInt64(max(0, Int64(bitPattern: time) + offset)), ethernet: false, data: bytes,
                                       originalLength: Int(wire), reason: Self.reason(code: UInt32(reason)), reply: flags & UInt32(FANOUT_CAPTURE_FLAG_REPLY) != 0,
                                       rewritten: flags & UInt32(FANOUT_CAPTURE_FLAG_REWRITTEN) != 0))
    }
}
