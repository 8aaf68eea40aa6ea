// SPDX-License-Identifier: Apache-2.0
import ReusePortLB

/// The pcapng blocks `udp-fanout capture` writes (draft-ietf-opsawg-pcapng): a section header,
/// one interface (raw IP packets, or Ethernet frames for af_xdp: libpcap, and so tcpdump, reads
/// one link type per file), an enhanced packet block per dropped datagram with its reason as the
/// packet comment, and interface statistics. Little-endian, as the section header's byte-order
/// magic says; timestamps in nanoseconds (if_tsresol 9).
package enum Pcapng {
    /// LINKTYPE_RAW: the packet begins with its IPv4 or IPv6 header.
    package static let linkTypeRaw: UInt16 = 101
    /// LINKTYPE_ETHERNET.
    package static let linkTypeEthernet: UInt16 = 1

    /// The section header block, then the interface description block.
    package static func header(linkType: UInt16, snaplen: Int, listener: String, application: String = "udp-fanout capture") -> [UInt8] {
        var bytes: [UInt8] = []
        // Section header: byte-order magic, version 1.0, section length unknown (-1).
        var options = option(4, Array(application.utf8))  // shb_userappl
        options += endOfOptions
        block(0x0A0D_0D0A, body: le32(0x1A2B_3C4D) + le16(1) + le16(0) + le64(UInt64.max) + options, into: &bytes)
        // Interface description: link type, reserved, snap length; if_name (2), if_tsresol (9).
        let interfaceOptions = option(2, Array(listener.utf8)) + option(9, [9]) + endOfOptions
        block(0x0000_0001, body: le16(linkType) + le16(0) + le32(UInt32(clamping: snaplen)) + interfaceOptions, into: &bytes)
        return bytes
    }

    /// An enhanced packet block: `data` (at most the snap length of the packet, whose whole length
    /// was `originalLength`) at `nanoseconds` since the epoch, with `comment`
    /// (opt_comment) and its direction (epb_flags: inbound for a client's datagram, outbound for
    /// a reply toward a client).
    package static func packet(nanoseconds: UInt64, data: [UInt8], originalLength: Int, comment: String, inbound: Bool) -> [UInt8] {
        var body = le32(0) + le32(UInt32(truncatingIfNeeded: nanoseconds >> 32)) + le32(UInt32(truncatingIfNeeded: nanoseconds))
        body += le32(UInt32(data.count)) + le32(UInt32(clamping: max(originalLength, data.count)))
        body += data + padding(data.count)
        body += option(1, Array(comment.utf8)) + option(2, le32(inbound ? 1 : 2)) + endOfOptions
        var bytes: [UInt8] = []
        block(0x0000_0006, body: body, into: &bytes)
        return bytes
    }

    /// An interface statistics block at `nanoseconds`: isb_osdrop, the packets taken for the
    /// capture that were lost because it fell behind, and a comment.
    package static func statistics(nanoseconds: UInt64, lost: UInt64, comment: String?) -> [UInt8] {
        var body = le32(0) + le32(UInt32(truncatingIfNeeded: nanoseconds >> 32)) + le32(UInt32(truncatingIfNeeded: nanoseconds))
        if let comment { body += option(1, Array(comment.utf8)) }
        body += option(7, le64(lost)) + endOfOptions
        var bytes: [UInt8] = []
        block(0x0000_0005, body: body, into: &bytes)
        return bytes
    }

    /// How many whole blocks `bytes` holds from its start, and where the first incomplete one
    /// begins (what a reader of a stream keeps for the next read), and the enhanced packet blocks
    /// among them; nil when a block's length is impossible (not pcapng).
    /// - Returns: also the comment of the last interface statistics block among them, if any.
    package static func wholeBlocks(_ bytes: ArraySlice<UInt8>) -> (end: Int, packets: Int, statistics: String?)? {
        var offset = bytes.startIndex
        var packets = 0
        var statistics: String?
        while bytes.endIndex - offset >= 12 {
            let type = readLE32(bytes, offset)
            let length = Int(readLE32(bytes, offset + 4))
            guard length >= 12, length % 4 == 0, length <= 1 << 24 else { return nil }
            guard bytes.endIndex - offset >= length else { break }
            if type == 6 { packets += 1 }
            // An interface statistics block's options follow its 20 bytes of fixed fields.
            if type == 5, length >= 24, let comment = comment(bytes[(offset + 20)..<(offset + length - 4)]) { statistics = comment }
            offset += length
        }
        return (offset - bytes.startIndex, packets, statistics)
    }

    /// The opt_comment among `options`.
    private static func comment(_ options: ArraySlice<UInt8>) -> String? {
        var offset = options.startIndex
        while options.endIndex - offset >= 4 {
            let code = UInt16(options[offset]) | UInt16(options[offset + 1]) << 8
            let length = Int(UInt16(options[offset + 2]) | UInt16(options[offset + 3]) << 8)
            guard code != 0, options.endIndex - offset - 4 >= length else { return nil }
            if code == 1 { return String(decoding: options[(offset + 4)..<(offset + 4 + length)], as: UTF8.self) }
            offset += 4 + length + (4 - length % 4) % 4
        }
        return nil
    }

    // MARK: encoding

    private static let endOfOptions: [UInt8] = [0, 0, 0, 0]

    private static func block(_ type: UInt32, body: [UInt8], into bytes: inout [UInt8]) {
        let length = UInt32(12 + body.count)
        bytes += le32(type) + le32(length) + body + le32(length)
    }

    private static func option(_ code: UInt16, _ value: [UInt8]) -> [UInt8] {
        le16(code) + le16(UInt16(value.count)) + value + padding(value.count)
    }

    private static func padding(_ count: Int) -> [UInt8] { [UInt8](repeating: 0, count: (4 - count % 4) % 4) }
    private static func le16(_ value: UInt16) -> [UInt8] { withUnsafeBytes(of: value.littleEndian, Array.init) }
    private static func le32(_ value: UInt32) -> [UInt8] { withUnsafeBytes(of: value.littleEndian, Array.init) }
    private static func le64(_ value: UInt64) -> [UInt8] { withUnsafeBytes(of: value.littleEndian, Array.init) }

    private static func readLE32(_ bytes: ArraySlice<UInt8>, _ offset: Int) -> UInt32 {
        UInt32(bytes[offset]) | UInt32(bytes[offset + 1]) << 8 | UInt32(bytes[offset + 2]) << 16 | UInt32(bytes[offset + 3]) << 24
    }
}

/// What a socket kind knows of a dropped datagram (its payload and the two addresses) made into
/// the IP packet it arrived as, for a raw-IP capture: an IPv4 or IPv6 header and a UDP header
/// before the payload, checksums computed over the whole payload at hand (IPv4's UDP checksum
/// left 0, which IPv4 allows). An IPv4 client of an IPv6 socket (`::ffff:a.b.c.d`) makes an IPv4
/// packet when the other address is IPv4 too (or mapped, or the wildcard `::`).
package enum SyntheticPacket {
    /// - Parameters:
    ///   - payload: the datagram's payload as read (a datagram cut by the socket: what was read).
    ///   - payloadLength: the payload's whole length (the datagram may have been longer than what
    ///     was read).
    ///   - snaplen: the most of the packet kept.
    /// - Returns: the packet (at most `snaplen` bytes), and its whole length.
    package static func make(payload: UnsafeRawBufferPointer, payloadLength: Int, from source: SocketAddress, to destination: SocketAddress,
                             snaplen: Int = Int.max) -> (bytes: [UInt8], length: Int) {
        var from = source.ip.bytes
        var to = destination.ip.bytes
        if let v4 = ipv4(from), let other = to.count == 4 ? to : ipv4(to) ?? (to.allSatisfy { $0 == 0 } ? [0, 0, 0, 0] : nil) {
            (from, to) = (v4, other)
        } else if let v4 = ipv4(to), from.count == 4 {
            to = v4
        }
        let ipv4 = from.count == 4 && to.count == 4
        if !ipv4 {
            from = mapped(from)
            to = mapped(to)
        }
        let udpLength = 8 + payloadLength
        var udp = be16(source.port) + be16(destination.port) + be16(UInt16(clamping: udpLength)) + [0, 0]
        var header: [UInt8]
        if ipv4 {
            header = [0x45, 0] + be16(UInt16(clamping: 20 + udpLength)) + [0, 0, 0x40, 0, 64, 17, 0, 0] + from + to
            let checksum = header.withUnsafeBytes { IPChecksum.checksum($0) }
            withUnsafeBytes(of: checksum) { header[10] = $0[0]; header[11] = $0[1] }
        } else {
            header = [0x60, 0, 0, 0] + be16(UInt16(clamping: udpLength)) + [17, 64] + from + to
            // The UDP checksum over the pseudo-header (addresses, length, next header) and the
            // payload at hand (a datagram cut by the socket gives a checksum of what was read).
            let pseudo = from + to + be32(UInt32(udpLength)) + [0, 0, 0, 17]
            var sum = pseudo.withUnsafeBytes { IPChecksum.add($0, to: 0) }
            sum = udp.withUnsafeBytes { IPChecksum.add($0, to: sum) }
            sum = IPChecksum.add(payload, to: sum)
            var checksum = IPChecksum.finish(sum)
            if checksum == 0 { checksum = 0xffff }
            withUnsafeBytes(of: checksum) { udp[6] = $0[0]; udp[7] = $0[1] }
        }
        let headers = header + udp
        let kept = max(0, min(payload.count, snaplen - headers.count))
        return (Array(headers.prefix(snaplen)) + payload.prefix(kept), headers.count + payloadLength)
    }

    /// The IPv4 address in `::ffff:a.b.c.d`, nil for any other.
    private static func ipv4(_ bytes: [UInt8]) -> [UInt8]? {
        guard bytes.count == 16, bytes[0..<10].allSatisfy({ $0 == 0 }), bytes[10] == 0xff, bytes[11] == 0xff else { return nil }
        return Array(bytes[12...])
    }

    private static func mapped(_ bytes: [UInt8]) -> [UInt8] {
        bytes.count == 16 ? bytes : [UInt8](repeating: 0, count: 10) + [0xff, 0xff] + bytes
    }
    private static func be16(_ value: UInt16) -> [UInt8] { [UInt8(value >> 8), UInt8(value & 0xff)] }
    private static func be32(_ value: UInt32) -> [UInt8] { [UInt8(value >> 24), UInt8((value >> 16) & 0xff), UInt8((value >> 8) & 0xff), UInt8(value & 0xff)] }
}
