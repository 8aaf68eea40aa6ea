// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CLibBPF
import Logging
import Synchronization
import SystemCalls

/// A BPF ring buffer of the tc and xdp programs read on a thread of its own (libbpf's
/// ring_buffer__poll, 100 ms at a time), each record handed to `deliver` on that thread: the
/// template-bearing datagrams of `settings.flow_templates` (``TCTemplateTap``) and the dropped
/// packets of `udp-fanout capture` (``KernelCaptureTap``).
final class RingBufferReader: @unchecked Sendable {  // the ring is used by its thread, then freed by stop()
    private let ring: OpaquePointer
    private let running = Atomic<Bool>(true)
    private let thread = Mutex<OSThread?>(nil)
    /// The reader's pthread_t: stop() must not join (nor free the ring under) its own thread.
    private let readerThread = Atomic<UInt>(0)
    /// stop() came from the reader's own thread: the thread frees the ring as it ends.
    private let freeOnExit = Atomic<Bool>(false)
    private let holder: Holder

    /// The callback's context: what the ring holds (retained by the reader, not by the ring).
    private final class Holder: @unchecked Sendable {
        let deliver: @Sendable (UnsafeRawPointer, Int) -> Void
        init(_ deliver: @escaping @Sendable (UnsafeRawPointer, Int) -> Void) { self.deliver = deliver }
    }

    /// - Parameters:
    ///   - map: the ring's map name (said in errors); threadName: the reader thread's name.
    ///   - failure: the error logged (once) when polling fails: what is lost meanwhile.
    ///   - round: each turn of the reader, given the poll to run (it returns ring_buffer__poll's
    ///     result; failures are said and slowed down already): what the owner does around it.
    ///   - drainAtStop: whether what is in the ring at the stop is still delivered.
    ///   - deliver: one record (its bytes and size), on the reader's thread.
    init(ringBuffer fd: Int32, map: String, threadName: String, failure: String, logger: Logger,
         round: @escaping @Sendable (() -> Int32) -> Void = { pollOnce in _ = pollOnce() }, drainAtStop: Bool = false,
         deliver: @escaping @Sendable (UnsafeRawPointer, Int) -> Void) throws(SystemCallError) {
        let holder = Holder(deliver)
        let made = ring_buffer__new(fd, { context, data, size in
            guard let context, let data else { return 0 }
            Unmanaged<Holder>.fromOpaque(context).takeUnretainedValue().deliver(UnsafeRawPointer(data), size)
            return 0
        }, Unmanaged.passUnretained(holder).toOpaque(), nil)
        guard let made else { throw SystemCallError(call: "ring_buffer__new \(map)", errno: errno) }
        ring = made
        self.holder = holder
        let started = OSThread(name: threadName) { [self] in
            readerThread.store(UInt(pthread_self()), ordering: .relaxed)
            var said = false
            let pollOnce = { [self] () -> Int32 in
                let result = ring_buffer__poll(ring, 100)
                if result < 0 && result != -EINTR {
                    // Not expected (the ring's descriptors are this process's): said once, and
                    // no busy loop while it lasts.
                    if !said {
                        said = true
                        logger.error("\(failure)", metadata: ["error": "\(SystemCallError(call: "ring_buffer__poll \(map)", errno: -result))"])
                    }
                    usleep(100_000)
                }
                return result
            }
            while running.load(ordering: .relaxed) { round(pollOnce) }
            // What the program passed up before the stop is still taken, if asked.
            if drainAtStop { _ = ring_buffer__consume(ring) }
            if freeOnExit.load(ordering: .acquiring) { ring_buffer__free(ring) }
        }
        thread.withLock { $0 = started }
    }

    /// Stops the thread (within its 100 ms poll) and frees the ring. Idempotent. From the reader's
    /// own thread (a delivery that ends the last user) it asks the thread to end and free the
    /// ring itself, after its poll returns.
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
}
