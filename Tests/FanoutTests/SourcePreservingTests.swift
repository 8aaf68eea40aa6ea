// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import Logging
import TestSupport
import ReusePortLB
@testable import FanoutCore
import CSystemShim

#if canImport(Glibc)
import Glibc
#endif

/// The ones' complement sum as RFC 1071 states it: 16-bit big-endian words, an odd last byte
/// padded with zero, carries folded, complemented. The reference the fast sum is checked against.
func referenceChecksum(_ bytes: [UInt8]) -> UInt16 {
    var sum: UInt32 = 0
    var index = 0
    while index < bytes.count {
        let high = UInt32(bytes[index]) << 8
        let low = index + 1 < bytes.count ? UInt32(bytes[index + 1]) : 0
        sum += high | low
        while sum > 0xffff { sum = (sum & 0xffff) + (sum >> 16) }
        index += 2
    }
    return ~UInt16(sum)
}

/// The checksum `IPChecksum` computes over `bytes`, read as the two bytes it writes (network order).
func fastChecksum(_ bytes: [UInt8]) -> UInt16 {
    let stored = bytes.withUnsafeBytes { IPChecksum.checksum($0) }
    return withUnsafeBytes(of: stored) { UInt16($0[0]) << 8 | UInt16($0[1]) }
}

/// A UDP checksum recomputed from scratch over the pseudo-header, the UDP header (checksum field
/// taken as zero) and the payload, as a receiver checks it. `udp` is the UDP header and payload.
func referenceUDPChecksum(source: [UInt8], destination: [UInt8], udp: [UInt8]) -> UInt16 {
    var pseudo = source + destination
    if source.count == 4 {
        pseudo += [0, 17, UInt8(udp.count >> 8), UInt8(udp.count & 0xff)]
    } else {
        pseudo += [UInt8(udp.count >> 24), UInt8((udp.count >> 16) & 0xff), UInt8((udp.count >> 8) & 0xff), UInt8(udp.count & 0xff), 0, 0, 0, 17]
    }
    var zeroed = udp
    zeroed[6] = 0
    zeroed[7] = 0
    let value = referenceChecksum(pseudo + zeroed)
    return value == 0 ? 0xffff : value
}

func storage(_ text: String) -> sockaddr_storage {
    var result = sockaddr_storage()
    _ = SocketAddress(text)!.write(to: &result)
    return result
}

/// The headers `writeHeaders` builds for `payload`, nil when it refuses.
func headers(_ source: String, _ destination: String, _ payload: [UInt8]) -> [UInt8]? {
    var header = [UInt8](repeating: 0xaa, count: SourcePreservingOutbox.maximumHeaderSize)
    let written = header.withUnsafeMutableBytes { raw in
        payload.withUnsafeBytes { SourcePreservingOutbox.writeHeaders(into: raw, source: SocketAddress(source)!, destination: SocketAddress(destination)!, payload: $0) }
    }
    return written.map { Array(header.prefix($0)) }
}

@Suite("preserve_source: checksums and headers")
struct SourcePreservingHeaderTests {
    @Test("RFC 1071 section 3 example: the sum of 00 01 f2 03 f4 f5 f6 f7 is ddf2, the checksum its complement")
    func rfc1071Example() {
        let bytes: [UInt8] = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]
        #expect(referenceChecksum(bytes) == ~UInt16(0xddf2))
        #expect(fastChecksum(bytes) == ~UInt16(0xddf2))
        // A header that carries its own checksum sums to zero (RFC 1071 section 1, "to check").
        let header: [UInt8] = [0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0xb8, 0x61, 0xc0, 0xa8, 0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7]
        #expect(fastChecksum(header) == 0)
        #expect(fastChecksum([]) == 0xffff)
        #expect(fastChecksum([0xff]) == referenceChecksum([0xff]))
    }

    @Test("The fast sum equals the reference over 2000 random buffers of every length 0...1600, odd ones included, and sums in pieces")
    func randomPayloads() {
        var generator = SystemRandomNumberGenerator()
        for round in 0..<2000 {
            let length = round < 64 ? round : Int.random(in: 0...1600, using: &generator)
            let bytes = (0..<length).map { _ in UInt8.random(in: 0...255, using: &generator) }
            let expected = referenceChecksum(bytes)
            #expect(fastChecksum(bytes) == expected, "length \(length)")
            // Even-length leading pieces then the rest: how the UDP checksum is summed.
            let split = (length / 2) & ~1
            let pieces = bytes.withUnsafeBytes { raw in
                let first = IPChecksum.add(UnsafeRawBufferPointer(rebasing: raw[0..<split]), to: 0)
                return IPChecksum.finish(IPChecksum.add(UnsafeRawBufferPointer(rebasing: raw[split...]), to: first))
            }
            #expect(withUnsafeBytes(of: pieces) { UInt16($0[0]) << 8 | UInt16($0[1]) } == expected, "pieces at \(split) of \(length)")
        }
        // Many all-ones words: the carries of a long sum are folded, not lost.
        let ones = [UInt8](repeating: 0xff, count: 65535)
        #expect(fastChecksum(ones) == referenceChecksum(ones))
    }

    @Test("IPv4 header: version, IHL, lengths, id 0, DF clear, TTL 64, UDP, addresses and ports; UDP checksum verifies")
    func ipv4Header() throws {
        for length in [0, 1, 17, 1471] {
            let payload = (0..<length).map { UInt8(truncatingIfNeeded: $0 &* 7 &+ 3) }
            let header = try #require(headers("198.18.0.77:4242", "198.18.1.2:5514", payload))
            #expect(header.count == 28)
            let ip = Array(header[0..<20]), udp = Array(header[20..<28])
            #expect(ip[0] == 0x45, "version 4, IHL 5")
            #expect(Int(ip[2]) << 8 | Int(ip[3]) == 28 + length, "total length")
            #expect(ip[4] == 0 && ip[5] == 0, "id 0: the kernel picks one")
            #expect(ip[6] == 0 && ip[7] == 0, "DF clear, no fragment offset")
            #expect(ip[8] == 64 && ip[9] == 17, "TTL 64, UDP")
            #expect(Array(ip[12..<16]) == [198, 18, 0, 77] && Array(ip[16..<20]) == [198, 18, 1, 2])
            #expect(Array(udp[0..<4]) == [0x10, 0x92, 0x15, 0x8a], "ports 4242 -> 5514")
            #expect(Int(udp[4]) << 8 | Int(udp[5]) == 8 + length, "UDP length")
            let checksum = UInt16(udp[6]) << 8 | UInt16(udp[7])
            #expect(checksum != 0, "IPv4 UDP checksum is computed, not left out")
            #expect(checksum == referenceUDPChecksum(source: [198, 18, 0, 77], destination: [198, 18, 1, 2], udp: udp + payload), "length \(length)")
        }
    }

    @Test("IPv6 header: version 6, payload length, next header UDP, hop limit 64, addresses; UDP checksum verifies")
    func ipv6Header() throws {
        for length in [0, 3, 1000, 1452] {
            let payload = (0..<length).map { UInt8(truncatingIfNeeded: $0 &* 13 &+ 1) }
            let header = try #require(headers("[2001:db8::77]:4242", "[2001:db8:1::2]:5514", payload))
            #expect(header.count == 48)
            let ip = Array(header[0..<40]), udp = Array(header[40..<48])
            #expect(Array(ip[0..<4]) == [0x60, 0, 0, 0], "version 6, class 0, flow 0")
            #expect(Int(ip[4]) << 8 | Int(ip[5]) == 8 + length, "payload length")
            #expect(ip[6] == 17 && ip[7] == 64, "next header UDP, hop limit 64")
            let source = IPAddress("2001:db8::77")!.bytes, destination = IPAddress("2001:db8:1::2")!.bytes
            #expect(Array(ip[8..<24]) == source && Array(ip[24..<40]) == destination)
            #expect(Array(udp[0..<4]) == [0x10, 0x92, 0x15, 0x8a])
            #expect(Int(udp[4]) << 8 | Int(udp[5]) == 8 + length)
            let checksum = UInt16(udp[6]) << 8 | UInt16(udp[7])
            #expect(checksum == referenceUDPChecksum(source: source, destination: destination, udp: udp + payload), "length \(length)")
        }
    }

    @Test("A datagram whose IP length would pass 65535 is not built (nil: dropped too_large); one at the limit is")
    func tooLong() {
        #expect(headers("198.18.0.77:1", "198.18.1.2:2", [UInt8](repeating: 1, count: 65535 - 28 + 1)) == nil)
        #expect(headers("198.18.0.77:1", "198.18.1.2:2", [UInt8](repeating: 1, count: 65535 - 28)) != nil)
        #expect(headers("[2001:db8::77]:1", "[2001:db8:1::2]:2", [UInt8](repeating: 1, count: 65535 - 8 + 1)) == nil)
    }

    @Test("Headers built without the UDP checksum (an outbox's, left to the way that sends) get it from fillChecksum: the same bytes as built with it, whatever the field held, IPv4 and IPv6, every length 0...600 and one summing to 0 (sent 0xffff)")
    func checksumLater() throws {
        for (source, destination) in [("198.18.0.77:40001", "198.18.1.2:2055"), ("[2001:db8::77]:40001", "[2001:db8:1::2]:2055")] {
            for length in Array(0...600) + [1400, 8000] {
                let payload = (0..<length).map { UInt8(truncatingIfNeeded: $0 &* 7 &+ length) }
                let whole = try #require(headers(source, destination, payload))
                for garbage: UInt16 in [0, 0xffff, 0x1234] {
                    var later = [UInt8](repeating: 0xaa, count: SourcePreservingOutbox.maximumHeaderSize)
                    let written = later.withUnsafeMutableBytes { raw in
                        payload.withUnsafeBytes {
                            SourcePreservingOutbox.writeHeaders(into: raw, source: SocketAddress(source)!, destination: SocketAddress(destination)!,
                                                                payload: $0, checksum: false)
                        }
                    }
                    #expect(written == whole.count)
                    let udp = whole.count - 8
                    #expect(later[udp + 6] == 0 && later[udp + 7] == 0, "left 0")
                    later[udp + 6] = UInt8(garbage >> 8)
                    later[udp + 7] = UInt8(garbage & 0xff)
                    later.withUnsafeMutableBytes { raw in payload.withUnsafeBytes { SourcePreservingOutbox.fillChecksum(header: raw.baseAddress!, payload: $0) } }
                    #expect(Array(later.prefix(whole.count)) == whole, "\(destination), \(length) bytes, field \(garbage)")
                }
            }
            // A payload whose datagram sums to 0 (RFC 768: sent as 0xffff): its last two bytes
            // chosen to cancel everything before them.
            var payload = [UInt8](repeating: 0x5a, count: 64) + [0, 0]
            let open = try #require(headers(source, destination, payload))
            let stored = UInt16(open[open.count - 2]) << 8 | UInt16(open[open.count - 1])
            payload[64] = UInt8(stored >> 8)
            payload[65] = UInt8(stored & 0xff)
            let closed = try #require(headers(source, destination, payload))
            #expect(closed[closed.count - 2] == 0xff && closed[closed.count - 1] == 0xff, "\(destination): a sum of 0 is sent as 0xffff")
        }
    }

    /// The fragments `sendFragments` sends for `payload` (headers built by `writeHeaders`), each
    /// as the bytes its iovecs hold, in order.
    static func fragments(_ source: String, _ destination: String, _ payload: [UInt8], mtu: Int, identification: UInt32) throws -> [[UInt8]] {
        var header = [UInt8](repeating: 0, count: SourcePreservingOutbox.maximumHeaderSize)
        let length = try #require(header.withUnsafeMutableBytes { raw in
            payload.withUnsafeBytes { SourcePreservingOutbox.writeHeaders(into: raw, source: SocketAddress(source)!, destination: SocketAddress(destination)!, payload: $0) }
        })
        var sent: [[UInt8]] = []
        let scratch = UnsafeMutableRawPointer.allocate(byteCount: SourcePreservingOutbox.maximumFragmentHeaderSize, alignment: 8)
        defer { scratch.deallocate() }
        let iovecs = UnsafeMutablePointer<iovec>.allocate(capacity: 3)
        defer { iovecs.deallocate() }
        let error = header.withUnsafeBytes { head in
            payload.withUnsafeBytes { body in
                SourcePreservingOutbox.sendFragments(header: head.baseAddress!, headerLength: length, payload: body, mtu: mtu, identification: identification,
                                                     scratch: scratch, iovecs: iovecs) { vectors, count in
                    var bytes: [UInt8] = []
                    for index in 0..<count { bytes += UnsafeRawBufferPointer(start: vectors[index].iov_base, count: vectors[index].iov_len) }
                    sent.append(bytes)
                    return 0
                }
            }
        }
        #expect(error == 0)
        return sent
    }

    @Test("IPv4 fragments: each 20 + n <= MTU bytes, n a multiple of 8 but the last, same nonzero id, MF on all but the last, offsets in 8 bytes; reassembled they are the datagram and its UDP checksum verifies")
    func ipv4Fragments() throws {
        for (length, mtu) in [(3000, 1500), (8000, 1500), (1473, 1500), (65507, 1500), (1000, 68), (2000, 1006)] {
            let payload = (0..<length).map { UInt8(truncatingIfNeeded: $0 &* 7 &+ 5) }
            let parts = try Self.fragments("198.18.0.77:4242", "198.18.1.2:5514", payload, mtu: mtu, identification: 0x1_2345)
            #expect(parts.count == (8 + length + (mtu - 20) / 8 * 8 - 1) / ((mtu - 20) / 8 * 8), "\(length) over \(mtu)")
            var reassembled: [UInt8] = []
            for (index, part) in parts.enumerated() {
                let last = index == parts.count - 1
                #expect(part.count <= mtu && part.count > 20)
                #expect(part[0] == 0x45 && part[8] == 64 && part[9] == 17)
                #expect(Array(part[12..<20]) == [198, 18, 0, 77, 198, 18, 1, 2])
                #expect(Int(part[2]) << 8 | Int(part[3]) == part.count, "total length per fragment")
                #expect(part[4] == 0x23 && part[5] == 0x45, "the low 16 bits of the identification, the same in every fragment")
                let flags = Int(part[6]) << 8 | Int(part[7])
                #expect(flags & 0x4000 == 0, "DF clear")
                #expect((flags & 0x2000 != 0) == !last, "MF on all but the last")
                #expect((flags & 0x1fff) * 8 == reassembled.count, "offset in 8-byte units")
                if !last { #expect((part.count - 20) % 8 == 0) }
                reassembled += part[20...]
            }
            #expect(reassembled.count == 8 + length)
            #expect(Array(reassembled[8...]) == payload, "payload intact")
            #expect(Array(reassembled[0..<6]) == [0x10, 0x92, 0x15, 0x8a, UInt8((8 + length) >> 8), UInt8((8 + length) & 0xff)])
            let checksum = UInt16(reassembled[6]) << 8 | UInt16(reassembled[7])
            #expect(checksum == referenceUDPChecksum(source: [198, 18, 0, 77], destination: [198, 18, 1, 2], udp: reassembled), "\(length)")
        }
    }

    @Test("IPv6 fragments: 40-byte header with next header 44 and payload length per fragment, then a Fragment header (next header UDP, offset|M, 32-bit id); reassembled they are the datagram and its UDP checksum verifies")
    func ipv6Fragments() throws {
        let source = IPAddress("2001:db8::77")!.bytes, destination = IPAddress("2001:db8:1::2")!.bytes
        for (length, mtu) in [(3000, 1500), (8000, 1500), (1453, 1500), (65527, 1280), (5000, 1283)] {
            let payload = (0..<length).map { UInt8(truncatingIfNeeded: $0 &* 13 &+ 1) }
            let parts = try Self.fragments("[2001:db8::77]:4242", "[2001:db8:1::2]:5514", payload, mtu: mtu, identification: 0x8765_4321)
            let step = (mtu - 48) / 8 * 8
            #expect(parts.count == (8 + length + step - 1) / step, "\(length) over \(mtu)")
            var reassembled: [UInt8] = []
            for (index, part) in parts.enumerated() {
                let last = index == parts.count - 1
                #expect(part.count <= mtu && part.count > 48)
                #expect(Array(part[0..<4]) == [0x60, 0, 0, 0] && part[6] == 44 && part[7] == 64, "next header Fragment, hop limit kept")
                #expect(Int(part[4]) << 8 | Int(part[5]) == part.count - 40, "payload length per fragment")
                #expect(Array(part[8..<24]) == source && Array(part[24..<40]) == destination)
                #expect(part[40] == 17 && part[41] == 0, "Fragment header: next header UDP, reserved 0")
                let field = Int(part[42]) << 8 | Int(part[43])
                #expect((field & 1 == 1) == !last, "M on all but the last")
                #expect(field & 6 == 0, "reserved bits 0")
                #expect(field & ~7 == reassembled.count, "offset in 8-byte units")
                #expect(Array(part[44..<48]) == [0x87, 0x65, 0x43, 0x21], "identification")
                if !last { #expect((part.count - 48) % 8 == 0) }
                reassembled += part[48...]
            }
            #expect(reassembled.count == 8 + length)
            #expect(Array(reassembled[8...]) == payload, "payload intact")
            let checksum = UInt16(reassembled[6]) << 8 | UInt16(reassembled[7])
            #expect(checksum == referenceUDPChecksum(source: source, destination: destination, udp: reassembled), "\(length)")
        }
    }

    @Test("A fragment send that fails stops the datagram with its errno; an MTU too small for 8 bytes of data is EMSGSIZE")
    func fragmentFailure() throws {
        var header = [UInt8](repeating: 0, count: SourcePreservingOutbox.maximumHeaderSize)
        let payload = [UInt8](repeating: 3, count: 4000)
        let length = try #require(header.withUnsafeMutableBytes { raw in
            payload.withUnsafeBytes { SourcePreservingOutbox.writeHeaders(into: raw, source: SocketAddress("198.18.0.77:1")!, destination: SocketAddress("198.18.1.2:2")!, payload: $0) }
        })
        let scratch = UnsafeMutableRawPointer.allocate(byteCount: SourcePreservingOutbox.maximumFragmentHeaderSize, alignment: 8)
        defer { scratch.deallocate() }
        let iovecs = UnsafeMutablePointer<iovec>.allocate(capacity: 3)
        defer { iovecs.deallocate() }
        var calls = 0
        let failed = header.withUnsafeBytes { head in
            payload.withUnsafeBytes { body in
                SourcePreservingOutbox.sendFragments(header: head.baseAddress!, headerLength: length, payload: body, mtu: 1500, identification: 1,
                                                     scratch: scratch, iovecs: iovecs) { _, _ in
                    calls += 1
                    return calls == 2 ? ENOBUFS : 0
                }
            }
        }
        #expect(failed == ENOBUFS && calls == 2, "stops at the failing fragment")
        let tiny = header.withUnsafeBytes { head in
            payload.withUnsafeBytes { body in
                SourcePreservingOutbox.sendFragments(header: head.baseAddress!, headerLength: length, payload: body, mtu: 27, identification: 1,
                                                     scratch: scratch, iovecs: iovecs) { _, _ in 0 }
            }
        }
        #expect(tiny == EMSGSIZE)
    }

    @Test("Client family: v4-mapped IPv6 to an IPv4 downstream is unmapped; v4 to v6 and v6 to v4 are mismatches")
    func families() {
        var mapped = storage("[::ffff:198.18.0.77]:4242")
        #expect(SourcePreservingOutbox.source(&mapped, family: AF_INET) == SocketAddress("198.18.0.77:4242"))
        var v4 = storage("198.18.0.77:4242")
        #expect(SourcePreservingOutbox.source(&v4, family: AF_INET) == SocketAddress("198.18.0.77:4242"))
        #expect(SourcePreservingOutbox.source(&v4, family: AF_INET6) == nil)
        #expect(SourcePreservingOutbox.source(&mapped, family: AF_INET6) == nil, "::ffff:a.b.c.d on the wire is not the client's IPv6 address")
        var v6 = storage("[2001:db8::77]:4242")
        #expect(SourcePreservingOutbox.source(&v6, family: AF_INET) == nil)
        #expect(SourcePreservingOutbox.source(&v6, family: AF_INET6) == SocketAddress("[2001:db8::77]:4242"))
    }

    @Test("family_mismatch drops reach the listener's counters and /metrics with their reason label")
    func familyMismatchCounted() {
        let counters = ListenerCounters(name: "ps", mode: "userspace")
        counters.drop(.familyMismatch, 3)
        counters.drop(.tooLarge, 1)
        let snapshot = counters.snapshot()
        #expect(snapshot.dropped[.familyMismatch] == 3 && snapshot.droppedTotal == 4)
        let text = PrometheusText.render([counters], reloads: (0, 0))
        #expect(text.contains("udp_fanout_packets_dropped_by_reason_total{listener=\"ps\",mode=\"userspace\",reason=\"family_mismatch\"} 3"), "\(text)")
    }

    @Test("errno to drop reason: EMSGSIZE is too_large, the rest as the socket way out maps them")
    func reasons() {
        #expect(SourcePreservingOutbox.reason(EMSGSIZE) == .tooLarge)
        #expect(SourcePreservingOutbox.reason(EAGAIN) == .sendBufferFull)
        #expect(SourcePreservingOutbox.reason(ENOBUFS) == .sendBufferFull)
        #expect(SourcePreservingOutbox.reason(ENETUNREACH) == .unreachable)
        #expect(SourcePreservingOutbox.reason(EACCES) == .unreachable, "a prohibit route")
        #expect(SourcePreservingOutbox.reason(EPERM) == .sendError)
    }
}

/// Reads datagrams until `expected` arrived or 300 ms pass with nothing new (at most 10 s).
func receiveAll(_ fd: Int32, expected: Int) -> [(source: SocketAddress, payload: [UInt8])] {
    var result: [(SocketAddress, [UInt8])] = []
    var buffer = [UInt8](repeating: 0, count: 65536)
    let start = ContinuousClock.now
    var quietSince = start
    while result.count < expected && ContinuousClock.now - quietSince < .milliseconds(300) && ContinuousClock.now - start < .seconds(10) {
        var from = sockaddr_storage()
        var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
        let count = withUnsafeMutablePointer(to: &from) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { recvfrom(fd, &buffer, buffer.count, Int32(MSG_DONTWAIT), $0, &length) }
        }
        if count < 0 {
            usleep(2000)
            continue
        }
        quietSince = ContinuousClock.now
        result.append((withUnsafePointer(to: &from) { SocketAddress(storage: $0)! }, Array(buffer[0..<count])))
    }
    return result
}

/// A bound UDP socket made inside `namespace` (it stays there; it is read from any thread).
func boundSocket(in namespace: String, _ address: SocketAddress) throws -> Int32 {
    let fd = try #require(inNetworkNamespace(namespace) { () -> Int32 in
        let fd = socket(address.ip.family, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        var size: Int32 = 8 << 20
        setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, 4)
        return address.withSockAddr { bind(fd, $0, $1) } == 0 ? fd : -1 - errno
    })
    try #require(fd >= 0, "bind \(address) in \(namespace): errno \(-1 - fd)")
    return fd
}

/// A raw IPPROTO_UDP socket of `family` made inside `namespace`: it sees every UDP datagram
/// delivered there (after reassembly), its UDP header as sent, whatever its checksum (the UDP
/// socket's receive would let a 0, "none", through in IPv4).
func rawUDPSocket(in namespace: String, family: Int32) throws -> Int32 {
    let fd = try #require(inNetworkNamespace(namespace) { () -> Int32 in
        let fd = socket(family, Int32(SOCK_RAW.rawValue) | Int32(SOCK_CLOEXEC.rawValue), Int32(IPPROTO_UDP))
        var size: Int32 = 16 << 20
        setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, 4)
        return fd >= 0 ? fd : -1 - errno
    })
    try #require(fd >= 0, "a raw UDP socket in \(namespace): errno \(-1 - fd)")
    return fd
}

/// The UDP checksums of the datagrams to `destination` that `fd` (``rawUDPSocket(in:family:)``)
/// holds: each as stored and as a receiver computes it (``referenceUDPChecksum``), with the
/// datagram's UDP source port.
func udpChecksums(_ fd: Int32, to destination: SocketAddress) -> [(stored: UInt16, computed: UInt16, sourcePort: UInt16)] {
    var result: [(UInt16, UInt16, UInt16)] = []
    var buffer = [UInt8](repeating: 0, count: 65536)
    let target = destination.ip.bytes
    while true {
        var from = sockaddr_storage()
        var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
        let count = withUnsafeMutablePointer(to: &from) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { recvfrom(fd, &buffer, buffer.count, Int32(MSG_DONTWAIT), $0, &length) }
        }
        guard count > 0 else { return result }
        // IPv4: the IP header comes first; IPv6: the UDP header does, the source in `from`.
        let (source, udpStart): ([UInt8], Int) = destination.ip.family == AF_INET
            ? (Array(buffer[12..<16]), Int(buffer[0] & 0x0f) * 4)
            : (withUnsafePointer(to: &from) { SocketAddress(storage: $0)!.ip.bytes }, 0)
        if destination.ip.family == AF_INET && Array(buffer[16..<20]) != target { continue }
        let udp = Array(buffer[udpStart..<count])
        guard udp.count >= 8, UInt16(udp[2]) << 8 | UInt16(udp[3]) == destination.port else { continue }
        result.append((UInt16(udp[6]) << 8 | UInt16(udp[7]), referenceUDPChecksum(source: source, destination: target, udp: udp),
                       UInt16(udp[0]) << 8 | UInt16(udp[1])))
    }
}

/// The payload of datagram `index`: its number, then a pattern, `length` bytes in all.
func numberedPayload(_ index: Int, length: Int) -> [UInt8] {
    var bytes = withUnsafeBytes(of: UInt32(index).bigEndian) { Array($0) }
    bytes += (4..<max(4, length)).map { UInt8(truncatingIfNeeded: $0 &* 31 &+ index) }
    return bytes
}

@Suite("preserve_source: end to end", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct SourcePreservingEndToEndTests {
    /// client namespace (the outbox) -> proxy namespace (routes) -> backend 1 (a plain UDP socket).
    @Test("IPv4 and IPv6, with an outbox's own raw socket and through the thread's shared one: 600 datagrams of mixed sizes (1...MTU) and 3 above the MTU (sent as fragments) arrive once each, whole and intact, from the client's address and port; one past 65535 is too_large; a client of the other family is counted family_mismatch, never sent; shared, every batch without fragments is one sendmmsg")
    func throughARouter() throws {
        let topology = try Topology(backends: 1)
        defer { topology.destroy() }
        for shared in [false, true] {
            let port = freePort()
            for (downstreamText, clientText, otherFamily, maximum, limit) in [
                ("198.18.1.2:\(port)", "198.18.0.77:40001", "[2001:db8::77]:40001", 1472, 65535 - 28),
                ("[2001:db8:1::2]:\(port)", "[2001:db8::77]:40002", "198.18.0.77:40002", 1452, 65535 - 8),
            ] {
                let downstream = SocketAddress(downstreamText)!
                let receiver = try boundSocket(in: topology.backends[0], downstream)
                defer { close(receiver) }
                let watcher = try rawUDPSocket(in: topology.backends[0], family: downstream.ip.family)
                defer { close(watcher) }
                let count = 600
                // Above the 1500 MTU of the veths: just above, a few fragments, many fragments.
                let large = [maximum + 1, 3000, 8000]
                let sizes = (0..<count).map { $0 % 5 == 0 ? maximum : Int.random(in: 4...maximum) } + large
                let payloads = (0..<sizes.count).map { numberedPayload($0, length: sizes[$0]) }
                let result = inNetworkNamespace(topology.client) { () -> Result<(FlushResult, batches: Int, calls: Int), OutboxError> in
                    // The raw socket's way (the clients' address is not the namespace's: without
                    // `transparent: false` it would go through a UDP socket bound to it).
                    let sender = shared ? SharedSender(capacity: 64, transparent: false) : nil
                    let outbox: SourcePreservingOutbox
                    do throws(OutboxError) { outbox = try SourcePreservingOutbox(address: downstream, capacity: 64, shared: sender?.raw) } catch { return .failure(error) }
                    var client = storage(clientText)
                    var other = storage(otherFamily)
                    let oversized = [UInt8](repeating: 9, count: limit + 1)
                    var total: FlushResult = (0, 0, [:])
                    var index = 0
                    var batches = 0
                    while index < count {
                        batches += 1
                        let end = min(count, index + 64 - 2 - large.count)
                        if index == 0 {
                            // First in the batch, so the ordinary ones after the fragments must go out too.
                            for datagram in count..<sizes.count {
                                payloads[datagram].withUnsafeBytes { outbox.append($0, source: &client, hopLimit: 0) }
                            }
                            oversized.withUnsafeBytes { outbox.append($0, source: &client, hopLimit: 0) }
                            payloads[0].withUnsafeBytes { outbox.append($0, source: &other, hopLimit: 0) }
                        }
                        for datagram in index..<end {
                            payloads[datagram].withUnsafeBytes { outbox.append($0, source: &client, hopLimit: 0) }
                        }
                        outbox.stage()
                        sender?.send()
                        outbox.flush(&total)
                        if outbox.count != 0 { return .failure(OutboxError(downstream: downstream, call: "flush left \(outbox.count) queued", errno: 0)) }
                        index = end
                    }
                    return .success((total, batches, sender?.raw.sendCalls ?? 0))
                }
                let (total, batches, calls) = try #require(result).get()
                // The first batch holds the datagrams to fragment: its outbox sends it itself, in order.
                if shared { #expect(calls == batches - 1, "\(downstream): one sendmmsg per batch without fragments") }
                #expect(total.sent == UInt64(sizes.count), "\(downstream): sent")
                #expect(total.bytes == UInt64(sizes.reduce(0, +)), "payload bytes, not header bytes")
                #expect(total.dropped == [DropReason.tooLarge: 1, .familyMismatch: 1], "\(downstream): \(total.dropped)")
                let received = receiveAll(receiver, expected: sizes.count + 1)
                #expect(received.count == sizes.count, "\(downstream): every datagram once, nothing else")
                var seen = Set<Int>()
                for (source, payload) in received {
                    #expect(source == SocketAddress(clientText)!, "the client's address and port")
                    let index = Int(payload.prefix(4).reduce(UInt32(0)) { $0 << 8 | UInt32($1) })
                    #expect(index < sizes.count && seen.insert(index).inserted, "datagram \(index) once")
                    if index < sizes.count { #expect(payload == payloads[index], "datagram \(index) (\(sizes[index]) bytes) whole and intact") }
                }
                #expect(seen.count == sizes.count)
                #expect(large.indices.allSatisfy { seen.contains(count + $0) }, "\(downstream): the datagrams above the MTU arrived")
                // The UDP checksum as sent (a raw sender computes it; a 0 passes an IPv4 receiver
                // as "none"), every datagram, fragmented ones included.
                let checksums = udpChecksums(watcher, to: downstream)
                #expect(checksums.count == sizes.count, "\(downstream), shared \(shared): the raw socket saw every datagram")
                #expect(checksums.allSatisfy { $0.stored != 0 && $0.stored == $0.computed },
                        "\(downstream), shared \(shared): UDP checksums \(checksums.filter { $0.stored == 0 || $0.stored != $0.computed }.prefix(3))")
            }
        }
    }

    @Test("Without CAP_NET_RAW (dropped from this thread's effective set with capset) the outbox is refused with an error naming CAP_NET_RAW and how to grant it")
    func withoutCapability() throws {
        let message = try #require(Capability.withoutNetRaw { () -> String? in
            do throws(OutboxError) {
                _ = try SourcePreservingOutbox(address: SocketAddress("127.0.0.1:9")!, capacity: 4)
                return nil
            } catch {
                return error.description
            }
        })
        let text = try #require(message, "the raw socket opened without CAP_NET_RAW")
        #expect(text.contains("CAP_NET_RAW") && text.contains("AmbientCapabilities") && text.contains("NET_RAW"), "\(text)")
        #expect(text.contains("127.0.0.1:9"), "names the downstream: \(text)")
        // The capability is back for everyone else: the same call works on another thread.
        #expect((try? SourcePreservingOutbox(address: SocketAddress("127.0.0.1:9")!, capacity: 4)) != nil)
    }
}

/// capget/capset(2) through glibc's wrappers (no header declares them without libcap): capabilities
/// are per thread, so a dedicated thread can give one up without touching the test runner's.
enum Capability {
    typealias Call = @convention(c) (UnsafeMutableRawPointer, UnsafeMutableRawPointer) -> Int32

    static func function(_ name: String) -> Call? {
        guard let handle = dlopen(nil, RTLD_NOW), let symbol = dlsym(handle, name) else { return nil }
        return unsafeBitCast(symbol, to: Call.self)
    }

    /// Runs `body` on a new thread whose effective set lacks CAP_NET_RAW; nil if capset failed.
    static func withoutNetRaw<T: Sendable>(_ body: @escaping @Sendable () -> T) -> T? {
        let box = Box<T>()
        OSThread(name: "no-net-raw") {
            guard let capget = function("capget"), let capset = function("capset") else { return }
            var header: (UInt32, Int32) = (0x2008_0522, 0)  // _LINUX_CAPABILITY_VERSION_3, this thread
            var data = [UInt32](repeating: 0, count: 6)  // two of (effective, permitted, inheritable)
            guard capget(&header, &data) == 0 else { return }
            data[0] &= ~(UInt32(1) << 13)  // CAP_NET_RAW
            guard capset(&header, &data) == 0 else { return }
            box.value = body()
        }.join()
        return box.value
    }

    private final class Box<T>: @unchecked Sendable {
        var value: T?
    }
}

@Suite("preserve_source: the forwarding thread's shared raw sockets", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct SharedRawSenderTests {
    /// A UDP socket bound to `address` with port 0; returns it and its address.
    static func receiver(_ text: String) throws -> (Int32, SocketAddress) {
        let address = SocketAddress(text)!
        let fd = socket(address.ip.family, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        try #require(fd >= 0)
        var size: Int32 = 8 << 20
        setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, 4)
        try #require(address.withSockAddr { bind(fd, $0, $1) } == 0, "bind \(text): errno \(errno)")
        var bound = sockaddr_storage()
        var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
        _ = withUnsafeMutablePointer(to: &bound) { $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &length) } }
        return (fd, try #require(withUnsafePointer(to: &bound) { SocketAddress(storage: $0) }))
    }

    @Test("Six preserve_source downstreams of one thread (3 IPv4, 3 IPv6) send through one raw socket per family, which they do not own: each batch is one sendmmsg per family, every datagram arrives once, intact, from the client's address and port, and the sockets outlive the outboxes")
    func oneCallPerFamilyPerBatch() throws {
        let sender = SharedSender(capacity: 64)
        let receivers = try ["127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0", "[::1]:0", "[::1]:0", "[::1]:0"].map { try Self.receiver($0) }
        defer { for (fd, _) in receivers { close(fd) } }
        var outboxes: [SourcePreservingOutbox] = try receivers.map { try SourcePreservingOutbox(address: $0.1, capacity: 64, shared: sender.raw) }
        let sockets = Set(outboxes.map(\.socket))
        #expect(sockets.count == 2, "one raw socket per family: \(outboxes.map(\.socket))")
        let clients = [SocketAddress("127.0.0.77:40001")!, SocketAddress("[::1]:40002")!]
        let batches = 10, perBatch = 5
        var totals = [FlushResult](repeating: (0, 0, [:]), count: outboxes.count)
        // The payloads stay in place until the batch is sent (the outboxes hold pointers to them).
        let payloads = (0..<outboxes.count).map { index in (0..<batches * perBatch).map { numberedPayload($0, length: 100 + index) } }
        for batch in 0..<batches {
            for (index, outbox) in outboxes.enumerated() {
                var client = storage("\(clients[index < 3 ? 0 : 1])")
                for datagram in 0..<perBatch {
                    payloads[index][batch * perBatch + datagram].withUnsafeBytes { outbox.append($0, source: &client, hopLimit: 0) }
                }
            }
            for outbox in outboxes { outbox.stage() }
            sender.send()
            for (index, outbox) in outboxes.enumerated() { outbox.flush(&totals[index]) }
        }
        #expect(sender.raw.sendCalls == 2 * batches, "one sendmmsg per family per batch")
        for (index, total) in totals.enumerated() {
            #expect(total.sent == UInt64(batches * perBatch) && total.dropped.isEmpty, "downstream \(index): \(total)")
            #expect(total.bytes == UInt64(batches * perBatch * (100 + index)), "payload bytes")
            let received = receiveAll(receivers[index].0, expected: batches * perBatch + 1)
            #expect(received.count == batches * perBatch, "downstream \(index): every datagram once, nothing else")
            #expect(Set(received.map { Int($0.payload.prefix(4).reduce(UInt32(0)) { $0 << 8 | UInt32($1) }) }) == Set(0..<batches * perBatch))
            for (source, payload) in received {
                #expect(source == clients[index < 3 ? 0 : 1], "the client's address and port")
                let number = Int(payload.prefix(4).reduce(UInt32(0)) { $0 << 8 | UInt32($1) })
                #expect(payload == numberedPayload(number, length: 100 + index), "intact")
            }
        }
        outboxes.removeAll()
        for fd in sockets { #expect(fcntl(fd, F_GETFD) >= 0, "the shared socket \(fd) is the sender's: an outbox going does not close it") }
    }

    @Test("A forwarder with output: preserve_source, made by the listener's factory (its own downstream and an all pool of two): each batch's 96 copies go out in one sendmmsg through the thread's raw socket, every copy whole, in order, from the client's address and port, and counted")
    func forwarderOneCallPerBatch() throws {
        let receivers = try (0..<3).map { _ in try Self.receiver("127.0.0.1:0") }
        defer { for (fd, _) in receivers { close(fd) } }
        let counters = ListenerCounters(name: "raw", mode: "userspace")
        let plan = ForwardingPlan(downstreams: [Downstream(name: "own", address: receivers[0].1),
                                                Downstream(name: "m1", address: receivers[1].1, pool: "copies"),
                                                Downstream(name: "m2", address: receivers[2].1, pool: "copies")],
                                  balancing: .roundRobin, quicLB: [], pools: [Pool(name: "copies", balancing: .all)], counters: counters)
        let forwarder = BatchForwarder(listener: "raw", counters: counters, plans: PlanHolder(plan), logger: Logger(label: "raw-test"), output: .preserveSource,
                                       capacity: 32, makeOutbox: Outboxes.factory(output: .preserveSource, capacity: 32))
        forwarder.adoptPlanIfChanged()
        let client = SocketAddress("127.0.0.78:40003")!
        var source = storage("\(client)")
        let batches = 5
        let payloads = (0..<batches * 32).map { numberedPayload($0, length: 200) }
        payloads.withUnsafeBufferPointer { all in
            for batch in 0..<batches {
                for index in (batch * 32)..<((batch + 1) * 32) {
                    all[index].withUnsafeBytes { payload in
                        forwarder.replicate(payload, source: &source)
                        if let target = forwarder.pick(&source, payload) { forwarder.append(target, payload, source: &source) }
                    }
                }
                forwarder.flush(received: 32, bytesReceived: 32 * 200)
            }
        }
        #expect(forwarder.sender.raw.sendCalls == batches, "one sendmmsg per batch for the 32 datagrams and their 64 copies: \(forwarder.sender.raw.sendCalls)")
        for (index, receiver) in receivers.enumerated() {
            let received = receiveAll(receiver.0, expected: payloads.count + 1)
            #expect(received.map(\.payload) == payloads, "receiver \(index): every datagram once, whole, in order (\(received.count))")
            #expect(received.allSatisfy { $0.source == client }, "receiver \(index): the client's address and port")
        }
        #expect(counters.forwarded.load(ordering: .relaxed) == UInt64(payloads.count))
        #expect(forwarder.plan?.counters.first?.forwarded.load(ordering: .relaxed) == UInt64(payloads.count))
    }

    @Test("The thread's way out with a full send buffer, the raw socket and a client's UDP socket (the client's address not the namespace's): the rest of the call fails at once, each copy counted send_buffer_full by its own downstream (a veth whose tbf qdisc holds what it was given, in a namespace of the test's)",
          arguments: [false, true])
    func sendBufferFull(transparent: Bool) throws {
        let namespace = try SharedSenderTests.vethNamespace("rplb-rawbuf", [("rb", 78)])
        defer { _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace]) }
        // 8 kbit/s: the qdisc keeps nearly every datagram queued, charged to the sending socket.
        try SharedSenderTests.shape(namespace, "rb0", limit: 10_000_000)
        let payload = [UInt8](repeating: 7, count: 1000)
        let outcome = inNetworkNamespace(namespace) { () -> Result<(calls: Int, sockets: Int, results: [FlushResult]), OutboxError> in
            // Room for a few 1,000-byte datagrams only (the kernel doubles SO_SNDBUF, up to its minimum).
            let sender = SharedSender(capacity: 64, sendBuffer: 4096, transparent: transparent)
            var outboxes: [SourcePreservingOutbox] = []
            for index in 0..<64 {
                do throws(OutboxError) {
                    outboxes.append(try SourcePreservingOutbox(address: SocketAddress(ip: IPAddress("198.18.78.2")!, port: UInt16(7000 + index)), capacity: 4, shared: sender.raw))
                } catch {
                    return .failure(error)
                }
            }
            var source = storage("198.18.78.50:40000")
            let results = payload.withUnsafeBytes { bytes in
                for outbox in outboxes { outbox.append(bytes, source: &source, hopLimit: 0) }
                for outbox in outboxes { outbox.stage() }
                sender.send()
                return outboxes.map { outbox in
                    var result: FlushResult = (0, 0, [:])
                    outbox.flush(&result)
                    return result
                }
            }
            let sockets = sender.raw.transparent?.sockets ?? 0
            return .success((transparent ? sender.raw.transparent?.sendCalls ?? -1 : sender.raw.sendCalls, sockets, results))
        }
        let (calls, sockets, results) = try #require(outcome, "entered \(namespace)").get()
        #expect(sockets == (transparent ? 1 : 0), "a socket bound to the client when transparent: \(sockets)")
        let sent = results.reduce(0) { $0 + $1.sent }
        let dropped = results.reduce(0) { $0 + ($1.dropped[.sendBufferFull] ?? 0) }
        #expect(sent > 0 && sent < 64, "a few went before the buffer filled: \(sent)")
        #expect(results.allSatisfy { $0.sent + ($0.dropped[.sendBufferFull] ?? 0) == 1 }, "each copy sent or counted send_buffer_full by its own downstream: \(results.map(\.dropped))")
        #expect(sent + dropped == 64)
        #expect(calls <= 2, "the rest failed at once: \(calls) sendmmsg calls")
    }

    @Test("A staged datagram that meets an MTU that shrank after it was built (EMSGSIZE from the shared socket) is sent as fragments with the MTU read again, and arrives whole; the same without a shared socket")
    func mtuShrankWhileStaged() throws {
        let topology = try Topology(backends: 1)
        defer { topology.destroy() }
        let port = freePort()
        let downstream = SocketAddress("198.18.1.2:\(port)")!
        let receiver = try boundSocket(in: topology.backends[0], downstream)
        defer { close(receiver) }
        let watcher = try rawUDPSocket(in: topology.backends[0], family: AF_INET)
        defer { close(watcher) }
        let interface = "cp\(topology.suffix.prefix(8))"
        let client = topology.client
        for shared in [true, false] {
            try topology.exec(client, ["/usr/sbin/ip", "link", "set", interface, "mtu", "1500"])
            let payload = numberedPayload(shared ? 1 : 2, length: 1400)
            let outcome = inNetworkNamespace(client) { () -> Result<(FlushResult, Int, Int), OutboxError> in
                let sender = shared ? SharedSender(capacity: 8, transparent: false) : nil
                let outbox: SourcePreservingOutbox
                do throws(OutboxError) { outbox = try SourcePreservingOutbox(address: downstream, capacity: 8, shared: sender?.raw) } catch { return .failure(error) }
                var source = storage("198.18.0.77:40001")
                payload.withUnsafeBytes { outbox.append($0, source: &source, hopLimit: 0) }
                // Smaller than the datagram now: the send is refused with EMSGSIZE.
                let changed = (try? run("/usr/sbin/ip", ["-n", client, "link", "set", interface, "mtu", "1280"]))?.status == 0
                guard changed else { return .failure(OutboxError(downstream: downstream, call: "ip link set mtu 1280", errno: 0)) }
                var total: FlushResult = (0, 0, [:])
                outbox.stage()
                sender?.send()
                outbox.flush(&total)
                return .success((total, outbox.mtu, sender?.raw.sendCalls ?? -1))
            }
            let (total, mtu, calls) = try #require(outcome).get()
            #expect(total.sent == 1 && total.dropped.isEmpty, "shared \(shared): \(total)")
            #expect(mtu == 1280, "shared \(shared): the MTU read again")
            if shared { #expect(calls == 1, "staged and sent through the shared socket") }
            let received = receiveAll(receiver, expected: 2)
            #expect(received.count == 1 && received.first?.payload == payload, "shared \(shared): reassembled whole, once")
            #expect(received.first?.source == SocketAddress("198.18.0.77:40001")!)
            let checksums = udpChecksums(watcher, to: downstream)
            #expect(checksums.count == 1 && checksums.allSatisfy { $0.stored != 0 && $0.stored == $0.computed },
                    "shared \(shared): the fragments' UDP checksum: \(checksums)")
        }
    }
}
