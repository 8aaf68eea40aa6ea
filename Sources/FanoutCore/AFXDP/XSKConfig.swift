// SPDX-License-Identifier: Apache-2.0
/// One AF_XDP socket's memory and rings. The defaults suit a 1500-byte MTU at line rate on one
/// queue: 16 MiB of UMEM per queue, locked (see `MemoryLock`).
struct XSKConfig: Equatable, Sendable {
    /// Bytes per UMEM frame: 2048 or 4096 (aligned mode; one frame holds one packet, so 2048
    /// only fits MTUs up to about 1750).
    var frameSize: UInt32 = 4096
    /// UMEM frames per queue: the fill ring, the RX ring, the caller's batch in flight and the TX
    /// and completion rings all draw from these.
    var frameCount: UInt32 = 4096
    /// Entries in each of the RX, TX, fill and completion rings (a power of two).
    var ringSize: UInt32 = 2048
    /// Zero-copy or copy mode.
    var zeroCopy: ZeroCopy = .auto
    /// Busy polling: SO_PREFER_BUSY_POLL, SO_BUSY_POLL (20 µs) and SO_BUSY_POLL_BUDGET
    /// (`batchSize`) on the socket; trades a spinning core for latency and fewer interrupts.
    var busyPoll: Bool = false
    /// Frames the forwarder takes per receive; also the busy-poll budget.
    var batchSize: Int = 64

    /// The UMEM's size: what RLIMIT_MEMLOCK must allow per socket (`MemoryLock.ensure`).
    var umemBytes: Int { Int(frameSize) * Int(frameCount) }

    /// Checks the values the kernel would refuse with a bare EINVAL, naming the key to change.
    func validate() throws(XSKError) {
        guard frameSize == 2048 || frameSize == 4096 else {
            throw .invalidConfig("frame size \(frameSize): must be 2048 or 4096 (UMEM aligned mode)")
        }
        guard ringSize >= 64, ringSize <= 32768, ringSize & (ringSize - 1) == 0 else {
            throw .invalidConfig("ring size \(ringSize): must be a power of two from 64 to 32768")
        }
        // Fewer frames than the fill ring holds would leave the kernel nothing for a full RX
        // ring; the kernel only refuses a UMEM without one frame, so this is checked here.
        guard frameCount >= ringSize, frameCount <= 1 << 20 else {
            throw .invalidConfig("frame count \(frameCount): must be at least the ring size (\(ringSize)) and at most 1048576")
        }
        guard batchSize >= 1, batchSize <= Int(ringSize) else {
            throw .invalidConfig("batch size \(batchSize): must be from 1 to the ring size (\(ringSize))")
        }
    }
}
