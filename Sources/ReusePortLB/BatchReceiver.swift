// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim
import BPFSupport
import SystemCalls

/// Receives datagrams in batches with recvmmsg(2) into buffers made once and reused: nothing is
/// allocated per datagram. Used by the collector and by udp-fanout's userspace workers.
public final class BatchReceiver {
    /// Datagrams per recvmmsg call.
    public let batchSize: Int
    /// Largest datagram kept whole; a larger one is marked ``isTruncated(_:)``.
    public let maximumDatagramSize: Int
    /// The socket's drop count as the last SO_RXQ_OVFL control message reported it.
    public private(set) var socketDrops: UInt32 = 0

    private let buffers: UnsafeMutableRawBufferPointer
    private let names: UnsafeMutablePointer<sockaddr_storage>
    private let controls: UnsafeMutableRawBufferPointer
    private let iovecs: UnsafeMutablePointer<iovec>
    private let headers: UnsafeMutablePointer<shim_mmsghdr>
    private let controlSpace: Int

    /// - Parameters:
    ///   - batchSize: datagrams per call (1...1024).
    ///   - maximumDatagramSize: buffer size per datagram (1...65535).
    public init(batchSize: Int, maximumDatagramSize: Int) {
        precondition((1...1024).contains(batchSize) && (1...65535).contains(maximumDatagramSize))
        self.batchSize = batchSize
        self.maximumDatagramSize = maximumDatagramSize
        controlSpace = Int(shim_rxq_ovfl_space())
        buffers = .allocate(byteCount: batchSize * maximumDatagramSize, alignment: 16)
        names = .allocate(capacity: batchSize)
        controls = .allocate(byteCount: batchSize * controlSpace, alignment: 16)
        iovecs = .allocate(capacity: batchSize)
        headers = .allocate(capacity: batchSize)
        for index in 0..<batchSize {
            iovecs[index] = iovec(
                iov_base: buffers.baseAddress! + index * maximumDatagramSize, iov_len: maximumDatagramSize)
            headers[index] = shim_mmsghdr()
            headers[index].msg_hdr.msg_iov = iovecs + index
            headers[index].msg_hdr.msg_iovlen = 1
            headers[index].msg_hdr.msg_name = UnsafeMutableRawPointer(names + index)
            headers[index].msg_hdr.msg_control = controls.baseAddress! + index * controlSpace
        }
    }

    deinit {
        buffers.deallocate()
        names.deallocate()
        controls.deallocate()
        iovecs.deallocate()
        headers.deallocate()
    }

    /// Receives up to ``batchSize`` datagrams (recvmmsg with `flags`, MSG_DONTWAIT by default).
    /// - Returns: how many arrived; 0 when none was waiting (EAGAIN).
    /// - Throws: ``SystemCallError`` for any other failure.
    public func receive(from socket: Int32, flags: Int32 = Int32(MSG_DONTWAIT)) throws(SystemCallError) -> Int {
        try receive(from: socket, flags: flags, slots: 0..<batchSize)
    }

    /// Receives up to `slots.count` datagrams into slots `slots` (indices of ``payload(_:)`` and
    /// the others), leaving the other slots as they were: a caller can gather datagrams from
    /// several sockets into one batch. `slots` must be non-empty and lie within 0..<``batchSize``.
    /// - Returns: how many arrived, in `slots.lowerBound...`; 0 when none was waiting (EAGAIN).
    public func receive(from socket: Int32, flags: Int32 = Int32(MSG_DONTWAIT), slots: Range<Int>) throws(SystemCallError) -> Int {
        // Empty, 0 would read as "nothing waiting" to a caller that drains until 0.
        precondition(!slots.isEmpty && slots.lowerBound >= 0 && slots.upperBound <= batchSize)
        for index in slots {
            headers[index].msg_hdr.msg_namelen = socklen_t(MemoryLayout<sockaddr_storage>.size)
            headers[index].msg_hdr.msg_controllen = controlSpace
            headers[index].msg_hdr.msg_flags = 0
        }
        switch try Syscall.recvmmsg(socket, headers + slots.lowerBound, slots.count, flags) {
        case .wouldBlock:
            return 0
        case .processed(let count):
            if count > 0 {
                var drops: UInt32 = 0
                if shim_rxq_ovfl(&headers[slots.lowerBound + count - 1].msg_hdr, &drops) == 1 { socketDrops = drops }
            }
            return count
        }
    }

    /// Slot `index`'s buffer (``maximumDatagramSize`` bytes), for a datagram received by other
    /// means (an io_uring receive); ``record(_:length:)`` then says what arrived there.
    public func buffer(_ index: Int) -> UnsafeMutableRawBufferPointer {
        precondition(index >= 0 && index < batchSize)
        return UnsafeMutableRawBufferPointer(start: iovecs[index].iov_base, count: maximumDatagramSize)
    }

    /// Marks slot `index` as holding a datagram of `length` bytes on the wire, received into
    /// ``buffer(_:)`` with `MSG_TRUNC` (so a longer datagram reports its whole size): a length
    /// over ``maximumDatagramSize`` reads as ``isTruncated(_:)``. ``source(_:)`` is then nil.
    public func record(_ index: Int, length: Int) {
        precondition(index >= 0 && index < batchSize && length >= 0 && length <= Int(UInt32.max))
        headers[index].msg_len = UInt32(length)
        headers[index].msg_hdr.msg_flags = length > maximumDatagramSize ? Int32(MSG_TRUNC) : 0
        headers[index].msg_hdr.msg_namelen = 0
        names[index].ss_family = sa_family_t(AF_UNSPEC)
    }

    /// The bytes of datagram `index` of the last batch (at most ``maximumDatagramSize``).
    public func payload(_ index: Int) -> UnsafeRawBufferPointer {
        UnsafeRawBufferPointer(start: iovecs[index].iov_base, count: min(Int(headers[index].msg_len), maximumDatagramSize))
    }

    /// The size datagram `index` had on the wire: its payload's size, or, for a truncated
    /// datagram received with `MSG_TRUNC` in the flags, its whole size.
    public func length(_ index: Int) -> Int {
        Int(headers[index].msg_len)
    }

    /// True if datagram `index` was larger than ``maximumDatagramSize`` (MSG_TRUNC): its
    /// payload is cut and must not be forwarded.
    public func isTruncated(_ index: Int) -> Bool {
        headers[index].msg_hdr.msg_flags & Int32(MSG_TRUNC) != 0
    }

    /// The source address of datagram `index`.
    public func source(_ index: Int) -> SocketAddress? {
        SocketAddress(storage: UnsafeRawPointer(names + index))
    }

    /// The source address of datagram `index` as raw `sockaddr` storage (no copy).
    public func sourceStorage(_ index: Int) -> UnsafePointer<sockaddr_storage> {
        UnsafePointer(names + index)
    }
}
