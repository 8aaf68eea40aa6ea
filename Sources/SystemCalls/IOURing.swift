// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim

/// An io_uring (io_uring(7)) for batches of non-blocking sends and receives on connected
/// sockets: each operation is queued, then one ``submit()`` (io_uring_enter(2)) completes them
/// all. Through the C shim (`shim_uring_*`): Glibc wraps none of io_uring's system calls. Every
/// operation is queued with MSG_DONTWAIT, so nothing is in flight after ``submit()`` returns.
/// For one thread: the thread that made it uses it.
public final class IOURing {
    private let ring: OpaquePointer

    /// io_uring_setup(2): a ring of at least `entries` submissions (rounded up to a power of two;
    /// at most 4096), for the calling thread.
    /// - Throws: ``SystemCallError`` `io_uring_setup` with the kernel's errno: ENOSYS (no
    ///   io_uring), EPERM (kernel.io_uring_disabled, a seccomp profile), EOPNOTSUPP (before 5.6:
    ///   no send and receive operations), ENOMEM (before 5.12: RLIMIT_MEMLOCK).
    public init(entries: Int) throws(SystemCallError) {
        var error: Int32 = 0
        guard let made = shim_uring_create(UInt32(clamping: entries), &error) else {
            throw SystemCallError(call: "io_uring_setup", errno: error)
        }
        ring = made
    }

    deinit { shim_uring_destroy(ring) }

    /// Queues a send(2) of `count` bytes at `buffer` on `fd`; `data` comes back with its result.
    /// - Returns: false when the ring already holds as many operations as it has entries.
    @inlinable
    public func queueSend(_ fd: Int32, _ buffer: UnsafeRawPointer?, _ count: Int, flags: Int32 = 0, data: UInt64) -> Bool {
        shim_uring_queue_send(handle, fd, buffer, UInt32(count), flags, data) == 0
    }

    /// Queues a recv(2) of up to `count` bytes into `buffer` from `fd`; `data` comes back with
    /// its result.
    /// - Returns: false when the ring already holds as many operations as it has entries.
    @inlinable
    public func queueReceive(_ fd: Int32, _ buffer: UnsafeMutableRawPointer?, _ count: Int, flags: Int32 = 0, data: UInt64) -> Bool {
        shim_uring_queue_recv(handle, fd, buffer, UInt32(count), flags, data) == 0
    }

    /// io_uring_enter(2): submits what is queued and waits until every operation has its result.
    /// - Returns: how many operations were submitted.
    /// - Throws: ``SystemCallError`` `io_uring_enter`: the ring is unusable from then on (what
    ///   was still queued is dropped); the caller stops using it and finishes that work itself.
    @discardableResult
    public func submit() throws(SystemCallError) -> Int {
        let submitted = shim_uring_submit(ring)
        guard submitted >= 0 else { throw SystemCallError(call: "io_uring_enter", errno: -submitted) }
        return Int(submitted)
    }

    /// The oldest result: the operation's `data` and its result (bytes, or -errno); nil when
    /// none is left.
    @inlinable
    public func next() -> (data: UInt64, result: Int32)? {
        var data: UInt64 = 0
        var result: Int32 = 0
        return shim_uring_next(handle, &data, &result) == 1 ? (data, result) : nil
    }

    /// Tests: the next ``submit()`` fails with `error`, as if io_uring_enter had.
    public func failNextSubmit(_ error: Int32) { shim_uring_fail_next_submit(ring, error) }

    @usableFromInline
    var handle: OpaquePointer { ring }
}
