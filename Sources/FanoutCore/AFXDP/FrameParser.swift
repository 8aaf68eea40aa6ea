// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI

/// Where a received frame's headers and UDP payload are, and the datagram's destination.
/// Offsets are from the start of the frame; all lie inside it.
struct ParsedFrame: Equatable, Sendable {
    /// AF_INET or AF_INET6.
    var family: Int32
    /// VLAN tags between the Ethernet addresses and the IP header (0, 1 or 2).
    var vlanTags: Int
    /// The IP header.
    var l3Offset: Int
    /// The UDP header.
    var l4Offset: Int
    /// The UDP payload (l4Offset + 8).
    var payloadOffset: Int
    /// The UDP payload's length, from the UDP header's length field.
    var payloadLength: Int
    /// The UDP destination port, host order.
    var destinationPort: UInt16
    /// The destination address in network order: IPv4 in `.0` (the rest zero), IPv6 in all four.
    var destinationAddress: (UInt32, UInt32, UInt32, UInt32)
    /// IPv4 TTL or IPv6 hop limit.
    var hopLimit: UInt8

    static func == (lhs: ParsedFrame, rhs: ParsedFrame) -> Bool {
        lhs.family == rhs.family && lhs.vlanTags == rhs.vlanTags && lhs.l3Offset == rhs.l3Offset
            && lhs.l4Offset == rhs.l4Offset && lhs.payloadOffset == rhs.payloadOffset
            && lhs.payloadLength == rhs.payloadLength && lhs.destinationPort == rhs.destinationPort
            && lhs.destinationAddress == rhs.destinationAddress && lhs.hopLimit == rhs.hopLimit
    }
}

/// Parses the frames the XDP program hands to AF_XDP sockets. Per datagram on the hot path:
/// no allocation, every read bounds checked against the frame. The forwarder takes the XDP
/// program's parse from the frame's metadata (``parse(received:source:walked:)``), checked against the
/// frame; ``parse(_:source:)`` walks the headers itself, relying on none of the program's checks.
enum FrameParser {
    static let etherTypeIPv4: UInt16 = 0x0800
    static let etherTypeIPv6: UInt16 = 0x86dd
    static let etherTypeVLAN: UInt16 = 0x8100
    static let etherTypeQinQ: UInt16 = 0x88a8
    /// IPv6 extension headers walked before giving up: a bounded loop on hostile input.
    static let maximumExtensionHeaders = 8

    /// Parses Ethernet (0-2 VLAN tags), IPv4 (options allowed; not a fragment) or IPv6
    /// (hop-by-hop, routing and destination-options headers; no fragment header), and UDP whose
    /// length fits the IP payload.
    /// - Parameters:
    ///   - frame: the frame's bytes, from the Ethernet header.
    ///   - source: receives the datagram's source as a sockaddr_in or sockaddr_in6 (only when
    ///     the frame is accepted).
    /// - Returns: the offsets and destination, or nil for anything else (the caller counts a
    ///   parse error).
    static func parse(_ frame: UnsafeRawBufferPointer, source: UnsafeMutablePointer<sockaddr_storage>) -> ParsedFrame? {
        let count = frame.count
        guard count >= 14 else { return nil }
        var offset = 12
        var type = frame.bigEndian16(at: offset)
        var tags = 0
        while type == etherTypeVLAN || type == etherTypeQinQ {
            guard tags < 2, offset + 6 <= count else { return nil }
            tags += 1
            offset += 4
            type = frame.bigEndian16(at: offset)
        }
        let l3 = offset + 2
        switch type {
        case etherTypeIPv4: return parseIPv4(frame, l3: l3, tags: tags, source: source)
        case etherTypeIPv6: return parseIPv6(frame, l3: l3, tags: tags, source: source)
        default: return nil
        }
    }

    private static func parseIPv4(_ frame: UnsafeRawBufferPointer, l3: Int, tags: Int,
                                  source: UnsafeMutablePointer<sockaddr_storage>) -> ParsedFrame? {
        guard frame.count - l3 >= 20 else { return nil }
        let versionAndLength = frame[l3]
        let headerLength = Int(versionAndLength & 0x0f) * 4
        guard versionAndLength >> 4 == 4, headerLength >= 20 else { return nil }
        let total = Int(frame.bigEndian16(at: l3 + 2))
        // total < the frame's rest is allowed: Ethernet pads short frames to 60 bytes.
        guard total >= headerLength, l3 + total <= frame.count else { return nil }
        // Any fragment (more-fragments flag or an offset) goes to the kernel, which reassembles.
        guard frame.bigEndian16(at: l3 + 6) & 0x3fff == 0, frame[l3 + 9] == UInt8(IPPROTO_UDP) else { return nil }
        return finish(frame, family: AF_INET, tags: tags, l3: l3, l4: l3 + headerLength, end: l3 + total, hopLimit: frame[l3 + 8], source: source)
    }

    private static func parseIPv6(_ frame: UnsafeRawBufferPointer, l3: Int, tags: Int,
                                  source: UnsafeMutablePointer<sockaddr_storage>) -> ParsedFrame? {
        guard frame.count - l3 >= 40, frame[l3] >> 4 == 6 else { return nil }
        let end = l3 + 40 + Int(frame.bigEndian16(at: l3 + 4))
        guard end <= frame.count else { return nil }
        var next = frame[l3 + 6]
        var l4 = l3 + 40
        var walked = 0
        // Hop-by-hop (0), routing (43) and destination options (60) share one layout: next
        // header, then the length in 8-octet units beyond the first. A fragment header (44)
        // and anything else ends the walk: only UDP is taken.
        while next == 0 || next == 43 || next == 60 {
            guard walked < maximumExtensionHeaders, l4 + 8 <= end else { return nil }
            walked += 1
            next = frame[l4]
            l4 += 8 * (Int(frame[l4 + 1]) + 1)
        }
        guard next == UInt8(IPPROTO_UDP) else { return nil }
        return finish(frame, family: AF_INET6, tags: tags, l3: l3, l4: l4, end: end, hopLimit: frame[l3 + 7], source: source)
    }

    /// The XDP program's parse of a frame it redirected to an AF_XDP socket: the
    /// ``fanout_xdp_meta`` in the frame's metadata area, which ends where `frame` starts (in the
    /// UMEM frame's headroom). It is checked against the frame, and the UDP length, which the
    /// program does not check, is checked as ``parse(_:source:)`` does; the metadata's magic is
    /// cleared, so a recycled frame never shows a stale one. A frame without metadata (a driver
    /// with no metadata area) is parsed here instead, and counted in `walked`.
    static func parse(received frame: UnsafeMutableRawBufferPointer, source: UnsafeMutablePointer<sockaddr_storage>,
                      walked: inout UInt64) -> ParsedFrame? {
        let metadata = frame.baseAddress! - MemoryLayout<fanout_xdp_meta>.size
        let meta = metadata.loadUnaligned(as: fanout_xdp_meta.self)
        guard meta.magic == FANOUT_XDP_META_MAGIC else {
            walked += 1
            return parse(UnsafeRawBufferPointer(frame), source: source)
        }
        metadata.storeBytes(of: 0, toByteOffset: MemoryLayout<fanout_xdp_meta>.offset(of: \.magic)!, as: UInt32.self)
        return parse(UnsafeRawBufferPointer(frame), meta, source: source)
    }

    /// The frame as `meta` describes it; nil where the two disagree.
    static func parse(_ frame: UnsafeRawBufferPointer, _ meta: fanout_xdp_meta,
                      source: UnsafeMutablePointer<sockaddr_storage>) -> ParsedFrame? {
        let (l3, l4, end) = (Int(meta.l3), Int(meta.l4), Int(meta.ip_end))
        let family = Int32(meta.family)
        let header = family == AF_INET ? 20 : family == AF_INET6 ? 40 : Int.max
        guard l3 >= 14, (l3 - 14) % 4 == 0, header != .max, l4 >= l3 + header, end <= frame.count else { return nil }
        return finish(frame, family: family, tags: (l3 - 14) / 4, l3: l3, l4: l4, end: end, hopLimit: meta.hop_limit, source: source)
    }

    /// The UDP datagram at `l4` of an IP packet that ends at `end`: its source into `source`,
    /// its offsets and destination.
    private static func finish(_ frame: UnsafeRawBufferPointer, family: Int32, tags: Int, l3: Int, l4: Int, end: Int, hopLimit: UInt8,
                               source: UnsafeMutablePointer<sockaddr_storage>) -> ParsedFrame? {
        guard let udp = parseUDP(frame, l4: l4, end: end) else { return nil }
        let destination: (UInt32, UInt32, UInt32, UInt32)
        if family == AF_INET {
            destination = (frame.loadUnaligned(fromByteOffset: l3 + 16, as: UInt32.self), 0, 0, 0)
            source.withMemoryRebound(to: sockaddr_in.self, capacity: 1) { address in
                address.pointee = sockaddr_in()
                address.pointee.sin_family = sa_family_t(AF_INET)
                address.pointee.sin_port = udp.sourcePortNetworkOrder
                address.pointee.sin_addr.s_addr = frame.loadUnaligned(fromByteOffset: l3 + 12, as: UInt32.self)
            }
        } else {
            destination = (frame.loadUnaligned(fromByteOffset: l3 + 24, as: UInt32.self),
                           frame.loadUnaligned(fromByteOffset: l3 + 28, as: UInt32.self),
                           frame.loadUnaligned(fromByteOffset: l3 + 32, as: UInt32.self),
                           frame.loadUnaligned(fromByteOffset: l3 + 36, as: UInt32.self))
            source.withMemoryRebound(to: sockaddr_in6.self, capacity: 1) { address in
                address.pointee = sockaddr_in6()
                address.pointee.sin6_family = sa_family_t(AF_INET6)
                address.pointee.sin6_port = udp.sourcePortNetworkOrder
                withUnsafeMutableBytes(of: &address.pointee.sin6_addr) { bytes in
                    bytes.copyMemory(from: UnsafeRawBufferPointer(rebasing: frame[(l3 + 8)..<(l3 + 24)]))
                }
            }
        }
        return ParsedFrame(family: family, vlanTags: tags, l3Offset: l3, l4Offset: l4, payloadOffset: l4 + 8,
                           payloadLength: udp.payloadLength, destinationPort: udp.destinationPort,
                           destinationAddress: destination, hopLimit: hopLimit)
    }

    /// The UDP header at `l4`, whose datagram must end at or before `end` (the IP payload's end).
    private static func parseUDP(_ frame: UnsafeRawBufferPointer, l4: Int, end: Int)
        -> (sourcePortNetworkOrder: UInt16, destinationPort: UInt16, payloadLength: Int)?
    {
        guard l4 + 8 <= end else { return nil }
        let length = Int(frame.bigEndian16(at: l4 + 4))
        // Length 0 is an IPv6 jumbogram's: not something a 1500- or 9000-byte frame carries.
        guard length >= 8, l4 + length <= end else { return nil }
        return (frame.loadUnaligned(fromByteOffset: l4, as: UInt16.self), frame.bigEndian16(at: l4 + 2), length - 8)
    }
}

extension UnsafeRawBufferPointer {
    /// A big-endian 16-bit field; the caller has checked `offset + 2 <= count`.
    @inline(__always)
    fileprivate func bigEndian16(at offset: Int) -> UInt16 {
        UInt16(bigEndian: loadUnaligned(fromByteOffset: offset, as: UInt16.self))
    }
}
