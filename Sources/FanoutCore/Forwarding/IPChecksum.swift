// SPDX-License-Identifier: Apache-2.0
/// The Internet checksum (RFC 1071) for headers built or rewritten in userspace: the UDP checksum
/// of a source-preserving datagram, and the incremental updates (RFC 1624) of a frame rewritten for
/// XDP TX.
///
/// Sums are kept in the machine's byte order: the ones' complement sum of 16-bit words does not
/// depend on byte order (RFC 1071 section 2(B)), so words are loaded and the result stored as they
/// are in memory, without swapping; `finish` returns the value to store with a plain (native) store.
enum IPChecksum {
    /// Adds `bytes` to a running sum. Every piece but the last must have an even length, so the
    /// words stay aligned to the start of what is summed.
    @inline(__always)
    static func add(_ bytes: UnsafeRawBufferPointer, to sum: UInt64) -> UInt64 {
        var total = sum
        let count = bytes.count
        guard count > 0, let base = bytes.baseAddress else { return total }
        var offset = 0
        // 32-bit words into 64 bits: carries accumulate in the high half (no overflow below 2^32
        // words) and are folded once at the end.
        while offset + 4 <= count {
            total &+= UInt64(base.loadUnaligned(fromByteOffset: offset, as: UInt32.self))
            offset += 4
        }
        if offset + 2 <= count {
            total &+= UInt64(base.loadUnaligned(fromByteOffset: offset, as: UInt16.self))
            offset += 2
        }
        if offset < count {
            // An odd last byte is the first byte of a word padded with zero.
            var word: UInt16 = 0
            withUnsafeMutableBytes(of: &word) { $0[0] = base.load(fromByteOffset: offset, as: UInt8.self) }
            total &+= UInt64(word)
        }
        return total
    }

    /// Folds a running sum to 16 bits (end-around carries).
    @inline(__always)
    static func fold(_ sum: UInt64) -> UInt16 {
        var value = (sum & 0xffff_ffff) &+ (sum >> 32)
        value = (value & 0xffff) &+ (value >> 16)
        value = (value & 0xffff) &+ (value >> 16)
        value = (value & 0xffff) &+ (value >> 16)
        return UInt16(truncatingIfNeeded: value)
    }

    /// The checksum of a running sum: folded and complemented, to be stored as is.
    @inline(__always)
    static func finish(_ sum: UInt64) -> UInt16 { ~fold(sum) }

    /// The checksum of `bytes`, to be stored as is.
    static func checksum(_ bytes: UnsafeRawBufferPointer) -> UInt16 { finish(add(bytes, to: 0)) }

    /// A checksum after the 16-bit words `old` (at an even offset of what it covers) became `new`:
    /// RFC 1624 equation 3, HC' = ~(~HC + ~m + m'), which never yields the 0x0000 that eqn. 2 can.
    @inline(__always)
    static func replace(_ checksum: UInt16, old: UInt16, new: UInt16) -> UInt16 {
        ~fold(UInt64(~checksum) &+ UInt64(~old) &+ UInt64(new))
    }

    /// The same for a field of several words (an address): `old` and `new` of equal, even length.
    static func replace(_ checksum: UInt16, old: UnsafeRawBufferPointer, new: UnsafeRawBufferPointer) -> UInt16 {
        var sum = UInt64(~checksum)
        var offset = 0
        while offset + 2 <= old.count {
            sum &+= UInt64(~old.loadUnaligned(fromByteOffset: offset, as: UInt16.self))
            sum &+= UInt64(new.loadUnaligned(fromByteOffset: offset, as: UInt16.self))
            offset += 2
        }
        return ~fold(sum)
    }
}
