// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB

/// Rewrites a received UDP frame in UMEM so it can go straight back out of the same interface
/// on the XDP TX ring (output `xdp_tx`): a one-arm load balancer changes only the Ethernet
/// addresses, the destination address and port, and the TTL; the source stays the client's.
enum FrameRewriter {
    /// Rewrites a received frame in place to go to `downstream` out of the same interface:
    /// Ethernet addresses, destination IP (the source stays the client's), destination port,
    /// TTL/hop limit - 1, with an incremental IPv4 header checksum update (RFC 1624) and the UDP
    /// checksum computed again over pseudo-header, header and payload (a zero IPv4 UDP checksum,
    /// "none", stays zero). Not updated incrementally: a frame from a virtual NIC (veth, and
    /// virtio from a host that offloads) may carry only the pseudo-header sum the sender's stack
    /// left for a checksum offload that never ran, and an update of that is wrong at the
    /// receiver. VLAN tags are kept (same interface, same segment).
    ///
    /// - Parameters:
    ///   - frame: the whole frame, from its Ethernet header.
    ///   - l3Offset: where the IP header starts (14, 18 or 22 with VLAN tags).
    ///   - l4Offset: where the UDP header starts (after IPv4 options or IPv6 extension headers).
    ///   - family: the frame's IP family, AF_INET or AF_INET6.
    ///   - downstream: the new destination address and port.
    ///   - nextHop: the Ethernet addresses (`NextHopResolver`).
    /// - Returns: false, with the frame untouched, when it cannot: the TTL/hop limit would reach
    ///   0, the families differ, the frame is an IPv4 fragment (its UDP header is not in every
    ///   piece), or the headers do not fit in the frame.
    static func rewrite(_ frame: UnsafeMutableRawBufferPointer, l3Offset: Int, l4Offset: Int, family: Int32,
                        to downstream: SocketAddress, nextHop: NextHop) -> Bool {
        guard family == downstream.ip.family, nextHop.sourceMAC.count == 6, nextHop.destinationMAC.count == 6,
              l3Offset >= 14, l4Offset + 8 <= frame.count, let base = frame.baseAddress
        else { return false }
        let udpLength = Int(UInt16(bigEndian: (base + l4Offset).loadUnaligned(fromByteOffset: 4, as: UInt16.self)))
        guard udpLength >= 8, l4Offset + udpLength <= frame.count else { return false }
        let ip = base + l3Offset
        let udp = base + l4Offset
        let newPort = downstream.port.bigEndian
        // Computed again below; 0 on IPv4 means "none" and stays so.
        var udpChecksum = udp.loadUnaligned(fromByteOffset: 6, as: UInt16.self)
        switch downstream.ip {
        case .v4(var address):
            guard l4Offset >= l3Offset + 20, ip.load(as: UInt8.self) >> 4 == 4 else { return false }
            let fragment = UInt16(bigEndian: ip.loadUnaligned(fromByteOffset: 6, as: UInt16.self))
            guard fragment & 0x3fff == 0 else { return false }  // MF or an offset
            let ttl = ip.load(fromByteOffset: 8, as: UInt8.self)
            guard ttl > 1 else { return false }
            // TTL and protocol share a word of the header checksum.
            let oldWord = ip.loadUnaligned(fromByteOffset: 8, as: UInt16.self)
            ip.storeBytes(of: ttl - 1, toByteOffset: 8, as: UInt8.self)
            let newWord = ip.loadUnaligned(fromByteOffset: 8, as: UInt16.self)
            var ipChecksum = ip.loadUnaligned(fromByteOffset: 10, as: UInt16.self)
            ipChecksum = IPChecksum.replace(ipChecksum, old: oldWord, new: newWord)
            let old = UnsafeRawBufferPointer(start: ip + 16, count: 4)
            withUnsafeBytes(of: &address) { new in
                ipChecksum = IPChecksum.replace(ipChecksum, old: old, new: new)
            }
            ip.storeBytes(of: ipChecksum, toByteOffset: 10, as: UInt16.self)
            ip.storeBytes(of: address, toByteOffset: 16, as: UInt32.self)
        case .v6(let address):
            guard l4Offset >= l3Offset + 40, ip.load(as: UInt8.self) >> 4 == 6 else { return false }
            let hopLimit = ip.load(fromByteOffset: 7, as: UInt8.self)
            guard hopLimit > 1 else { return false }
            ip.storeBytes(of: hopLimit - 1, toByteOffset: 7, as: UInt8.self)  // in no checksum
            ip.storeBytes(of: address, toByteOffset: 24, as: in6_addr.self)
        }
        udp.storeBytes(of: newPort, toByteOffset: 2, as: UInt16.self)
        if udpChecksum != 0 || family == AF_INET6 {
            udpChecksum = Self.udpChecksum(ip: ip, udp: udp, family: family, length: udpLength)
        }
        udp.storeBytes(of: udpChecksum, toByteOffset: 6, as: UInt16.self)
        for index in 0..<6 {
            base.storeBytes(of: nextHop.destinationMAC[index], toByteOffset: index, as: UInt8.self)
            base.storeBytes(of: nextHop.sourceMAC[index], toByteOffset: 6 + index, as: UInt8.self)
        }
        return true
    }

    /// The UDP checksum of the datagram at `udp` (`length` bytes, header included) from scratch:
    /// pseudo-header (addresses, protocol, length), then the header with its checksum taken as
    /// 0, then the payload.
    static func udpChecksum(ip: UnsafeMutableRawPointer, udp: UnsafeMutableRawPointer, family: Int32, length: Int) -> UInt16 {
        var sum: UInt64
        if family == AF_INET {
            sum = IPChecksum.add(UnsafeRawBufferPointer(start: ip + 12, count: 8), to: 0)
        } else {
            sum = IPChecksum.add(UnsafeRawBufferPointer(start: ip + 8, count: 32), to: 0)
        }
        sum &+= UInt64(UInt16(17).bigEndian) &+ UInt64(UInt16(length).bigEndian)
        sum = IPChecksum.add(UnsafeRawBufferPointer(start: udp, count: 6), to: sum)
        sum = IPChecksum.add(UnsafeRawBufferPointer(start: udp + 8, count: length - 8), to: sum)
        return finishUDP(IPChecksum.finish(sum))
    }

    /// A UDP checksum that came out 0 is sent as 0xffff: 0 means "none" (RFC 768).
    @inline(__always)
    private static func finishUDP(_ checksum: UInt16) -> UInt16 { checksum == 0 ? 0xffff : checksum }
}
