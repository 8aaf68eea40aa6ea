// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif

/// The publisher's datagram header, which the collector reads to find loss, reordering and
/// latency: a magic (`"RPLB"`, or `"RPLT"` when a send time follows), the source's id
/// (big-endian u32), its sequence number (big-endian u64), then, with `"RPLT"`, the send time
/// in CLOCK_MONOTONIC nanoseconds (big-endian u64), then padding up to the chosen size.
public enum Payload {
    public static let headerSize = 16
    public static let timestampedSize = 24
    static let plain: UInt32 = 0x5250_4c42  // "RPLB"
    static let timestamped: UInt32 = 0x5250_4c54  // "RPLT"

    /// Writes the header into `buffer`; with `capacity` >= 24 also the send time.
    public static func write(into buffer: UnsafeMutableRawPointer, capacity: Int, source: UInt32, sequence: UInt64) {
        let stamped = capacity >= timestampedSize
        buffer.storeBytes(of: (stamped ? timestamped : plain).bigEndian, as: UInt32.self)
        buffer.storeBytes(of: source.bigEndian, toByteOffset: 4, as: UInt32.self)
        buffer.storeBytes(of: sequence.bigEndian, toByteOffset: 8, as: UInt64.self)
        if stamped { buffer.storeBytes(of: monotonicNanoseconds().bigEndian, toByteOffset: 16, as: UInt64.self) }
    }

    /// Reads the header; nil if the datagram is not the publisher's.
    public static func read(_ bytes: UnsafeRawBufferPointer) -> (source: UInt32, sequence: UInt64, sentAt: UInt64?)? {
        guard bytes.count >= headerSize else { return nil }
        let magic = UInt32(bigEndian: bytes.loadUnaligned(as: UInt32.self))
        guard magic == plain || magic == timestamped && bytes.count >= timestampedSize else { return nil }
        return (
            UInt32(bigEndian: bytes.loadUnaligned(fromByteOffset: 4, as: UInt32.self)),
            UInt64(bigEndian: bytes.loadUnaligned(fromByteOffset: 8, as: UInt64.self)),
            magic == timestamped ? UInt64(bigEndian: bytes.loadUnaligned(fromByteOffset: 16, as: UInt64.self)) : nil
        )
    }

    /// CLOCK_MONOTONIC in nanoseconds: the same clock in every process on the host.
    public static func monotonicNanoseconds() -> UInt64 {
        var now = timespec()
        clock_gettime(CLOCK_MONOTONIC, &now)
        return UInt64(now.tv_sec) * 1_000_000_000 + UInt64(now.tv_nsec)
    }
}

/// One-way latency from the publisher's send time to the collector's receive, in fixed buckets
/// (1 µs up to 10 ms, then 100 µs up to 1 s): recording allocates nothing.
public struct LatencyHistogram: Sendable {
    private var fine = [UInt64](repeating: 0, count: 10_000)
    private var coarse = [UInt64](repeating: 0, count: 10_000)
    private var over: UInt64 = 0
    public private(set) var samples: UInt64 = 0

    public init() {}

    public mutating func record(nanoseconds: UInt64) {
        samples += 1
        let micros = Int(nanoseconds / 1000)
        if micros < 10_000 {
            fine[micros] += 1
        } else if micros < 1_000_000 {
            coarse[micros / 100] += 1
        } else {
            over += 1
        }
    }

    /// The latency in µs below which `fraction` of the samples lie (upper bucket edge).
    public func percentile(_ fraction: Double) -> Double? {
        guard samples > 0 else { return nil }
        let target = UInt64((Double(samples) * fraction).rounded(.up))
        var seen: UInt64 = 0
        for (micros, count) in fine.enumerated() {
            seen += count
            if seen >= target { return Double(micros + 1) }
        }
        for (bucket, count) in coarse.enumerated() where bucket >= 100 {
            seen += count
            if seen >= target { return Double((bucket + 1) * 100) }
        }
        return 1_000_000
    }
}
