/// The publisher's datagram header, which the collector reads to find loss and reordering:
/// `"RPLB"`, the source's id (big-endian u32), its sequence number (big-endian u64), then padding
/// up to the chosen size.
public enum Payload {
    public static let headerSize = 16

    /// Writes the header into the first ``headerSize`` bytes of `buffer`.
    public static func write(into buffer: UnsafeMutableRawPointer, source: UInt32, sequence: UInt64) {
        buffer.storeBytes(of: UInt32(0x5250_4c42).bigEndian, as: UInt32.self)
        buffer.storeBytes(of: source.bigEndian, toByteOffset: 4, as: UInt32.self)
        buffer.storeBytes(of: sequence.bigEndian, toByteOffset: 8, as: UInt64.self)
    }

    /// Reads the header; nil if the datagram is not the publisher's.
    public static func read(_ bytes: UnsafeRawBufferPointer) -> (source: UInt32, sequence: UInt64)? {
        guard bytes.count >= headerSize,
            UInt32(bigEndian: bytes.loadUnaligned(as: UInt32.self)) == 0x5250_4c42
        else { return nil }
        return (
            UInt32(bigEndian: bytes.loadUnaligned(fromByteOffset: 4, as: UInt32.self)),
            UInt64(bigEndian: bytes.loadUnaligned(fromByteOffset: 8, as: UInt64.self))
        )
    }
}
