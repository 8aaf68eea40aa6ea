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
final class KernelCaptureTap: @unchecked Sendable {  // the ring is used by its thread, then freed by stop()
    private let ring: OpaquePointer
    private let captures = Mutex<[UInt32: DropCapture]>([:])
    private let running = Atomic<Bool>(true)
    private let thread = Mutex<OSThread?>(nil)
    /// The reader's pthread_t: stop() must not join (nor free the ring under) its own thread.
    private let readerThread = Atomic<UInt>(0)
    /// stop() came from the reader's own thread: the thread frees the ring as it ends.
    private let freeOnExit = Atomic<Bool>(false)

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
        let holder = Holder()
        let made = ring_buffer__new(fd, { context, data, size in
            guard let context, let data else { return 0 }
            Unmanaged<Holder>.fromOpaque(context).takeUnretainedValue().tap?.deliver(UnsafeRawPointer(data), size: size)
            return 0
        }, Unmanaged.passUnretained(holder).toOpaque(), nil)
        guard let made else { throw SystemCallError(call: "ring_buffer__new \(FANOUT_MAP_CAPTURE_NAME)", errno: errno) }
        ring = made
        self.holder = holder
        holder.tap = self
        let started = OSThread(name: "udp-fanout-cap") { [self] in
            readerThread.store(UInt(pthread_self()), ordering: .relaxed)
            var said = false
            while running.load(ordering: .relaxed) {
                let result = ring_buffer__poll(ring, 100)
                if result < 0 && result != -EINTR {
                    if !said {
                        said = true
                        logger.error("capture: reading the programs' dropped packets failed; the capture gets none while it lasts", metadata: [
                            "error": "\(SystemCallError(call: "ring_buffer__poll \(FANOUT_MAP_CAPTURE_NAME)", errno: -result))",
                        ])
                    }
                    usleep(100_000)
                }
            }
            // Stopped from this thread itself: nobody joins it, so it frees the ring.
            if freeOnExit.load(ordering: .acquiring) { ring_buffer__free(ring) }
        }
        thread.withLock { $0 = started }
    }

    /// The callback's context: a reference the ring holds without retaining the tap.
    private final class Holder: @unchecked Sendable {
        weak var tap: KernelCaptureTap?
    }
    private let holder: Holder

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

    /// Stops the thread (within its 100 ms poll) and frees the ring. Idempotent. From the reader's
    /// own thread (nothing does that: a delivery only queues the packet) it asks the thread to
    /// end and free the ring itself, after its poll returns.
    func stop() {
        if readerThread.load(ordering: .relaxed) == UInt(pthread_self()) {
            freeOnExit.store(true, ordering: .releasing)
            running.store(false, ordering: .relaxed)
            return
        }
        running.store(false, ordering: .relaxed)
        guard let started = thread.withLock({ state -> OSThread? in
            defer { state = nil }
            return state
        }) else { return }
        started.join()
        if !freeOnExit.load(ordering: .acquiring) { ring_buffer__free(ring) }
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
