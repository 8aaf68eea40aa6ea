// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import CSystemShim
import Testing
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// The af_xdp path's frame parser: a table of frames (what it must accept, with every field,
/// and what it must refuse), every truncation of each accepted frame, and a seeded fuzz run
/// that checks it never reads or reports outside the frame. Frames come from the `Packet`
/// builder of TCProgramTests (checksums computed there, RFC 1071), not from the parser.
@Suite("af_xdp: frame parser")
struct FrameParserTests {
    static let client4: [UInt8] = [198, 18, 0, 2]
    static let server4: [UInt8] = [198, 18, 0, 1]
    static let client6: [UInt8] = [0x20, 0x01, 0x0d, 0xb8] + Array(repeating: 0, count: 11) + [2]
    static let server6: [UInt8] = [0x20, 0x01, 0x0d, 0xb8] + Array(repeating: 0, count: 11) + [1]
    /// Packet.udp's fixed source port.
    static let sourcePort: UInt16 = 40000

    /// An Ethernet header with `tags` VLAN tags (802.1ad outer, 802.1Q inner, as QinQ switches send).
    static func ethernet(type: UInt16, tags: Int) -> [UInt8] {
        var header: [UInt8] = [2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2]
        for tag in 0..<tags { header += (tag == 0 && tags == 2 ? [0x88, 0xa8] : [0x81, 0x00]) + [0, UInt8(10 + tag)] }
        return header + [UInt8(type >> 8), UInt8(type & 0xff)]
    }

    static func ipv4(payload: [UInt8], port: UInt16 = 5514, tags: Int = 0, options: [UInt8] = [], ttl: UInt8 = 64,
                     protocolNumber: UInt8 = 17, fragment: UInt16 = 0, udpLengthDelta: Int = 0) -> [UInt8] {
        var udp = Packet.udp(source: client4, destination: server4, port: port, payload: payload)
        let length = udp.count + udpLengthDelta
        udp[4] = UInt8(length >> 8 & 0xff)
        udp[5] = UInt8(length & 0xff)
        return ethernet(type: 0x0800, tags: tags)
            + Packet.ipv4Header(source: client4, destination: server4, length: udp.count, protocolNumber: protocolNumber,
                                ttl: ttl, options: options, fragment: fragment)
            + udp
    }

    /// IPv6 with a chain of extension headers (each: next header, length in 8-octet units past the first).
    static func ipv6(payload: [UInt8], port: UInt16 = 5514, tags: Int = 0, extensions: [(type: UInt8, units: Int)] = [],
                     last: UInt8 = 17) -> [UInt8] {
        let udp = Packet.udp(source: client6, destination: server6, port: port, payload: payload)
        var chain: [UInt8] = []
        let types = extensions.map(\.type) + [last]
        for (index, header) in extensions.enumerated() {
            let size = 8 * (header.units + 1)
            // Padding options (PadN) keep hop-by-hop and destination options well formed.
            chain += [types[index + 1], UInt8(header.units), 1, UInt8(size - 4)] + Array(repeating: 0, count: size - 4)
        }
        return ethernet(type: 0x86dd, tags: tags)
            + Packet.ipv6Header(next: types[0], length: chain.count + udp.count, source: client6, destination: server6)
            + chain + udp
    }

    struct Expected: Sendable {
        var family: Int32
        var vlanTags: Int
        var l3Offset: Int
        var l4Offset: Int
        var payload: [UInt8]
        var port: UInt16
        var hopLimit: UInt8
    }

    struct Case: CustomStringConvertible, Sendable {
        let description: String
        let frame: [UInt8]
        let expected: Expected?
    }

    static let payload: [UInt8] = Array("hello, collector".utf8)

    static let cases: [Case] = [
        Case(description: "IPv4", frame: ipv4(payload: payload),
             expected: Expected(family: AF_INET, vlanTags: 0, l3Offset: 14, l4Offset: 34, payload: payload, port: 5514, hopLimit: 64)),
        Case(description: "IPv4 with 12 bytes of options", frame: ipv4(payload: payload, options: [1, 1, 1, 1, 7, 7, 4, 0, 0, 0, 0, 0], ttl: 3),
             expected: Expected(family: AF_INET, vlanTags: 0, l3Offset: 14, l4Offset: 46, payload: payload, port: 5514, hopLimit: 3)),
        Case(description: "IPv4, empty payload", frame: ipv4(payload: [], port: 9),
             expected: Expected(family: AF_INET, vlanTags: 0, l3Offset: 14, l4Offset: 34, payload: [], port: 9, hopLimit: 64)),
        Case(description: "IPv4, one VLAN tag", frame: ipv4(payload: payload, tags: 1),
             expected: Expected(family: AF_INET, vlanTags: 1, l3Offset: 18, l4Offset: 38, payload: payload, port: 5514, hopLimit: 64)),
        Case(description: "IPv4, two VLAN tags (QinQ)", frame: ipv4(payload: payload, tags: 2),
             expected: Expected(family: AF_INET, vlanTags: 2, l3Offset: 22, l4Offset: 42, payload: payload, port: 5514, hopLimit: 64)),
        Case(description: "IPv4, UDP length shorter than the IP payload (trailing bytes ignored)",
             frame: ipv4(payload: payload, udpLengthDelta: -4),
             expected: Expected(family: AF_INET, vlanTags: 0, l3Offset: 14, l4Offset: 34, payload: Array(payload.dropLast(4)), port: 5514, hopLimit: 64)),
        Case(description: "IPv4 padded to Ethernet's 60-byte minimum", frame: ipv4(payload: [7]) + Array(repeating: 0, count: 17),
             expected: Expected(family: AF_INET, vlanTags: 0, l3Offset: 14, l4Offset: 34, payload: [7], port: 5514, hopLimit: 64)),
        Case(description: "IPv6", frame: ipv6(payload: payload),
             expected: Expected(family: AF_INET6, vlanTags: 0, l3Offset: 14, l4Offset: 54, payload: payload, port: 5514, hopLimit: 64)),
        Case(description: "IPv6, hop-by-hop + routing + destination options",
             frame: ipv6(payload: payload, extensions: [(0, 0), (43, 1), (60, 2)]),
             expected: Expected(family: AF_INET6, vlanTags: 0, l3Offset: 14, l4Offset: 54 + 8 + 16 + 24, payload: payload, port: 5514, hopLimit: 64)),
        Case(description: "IPv6, two VLAN tags, destination options", frame: ipv6(payload: payload, tags: 2, extensions: [(60, 0)]),
             expected: Expected(family: AF_INET6, vlanTags: 2, l3Offset: 22, l4Offset: 70, payload: payload, port: 5514, hopLimit: 64)),
        Case(description: "three VLAN tags", frame: Array(ethernet(type: 0x8100, tags: 2).dropLast(2)) + [0x81, 0, 0, 12] + Array(ipv4(payload: payload).dropFirst(12)),
             expected: nil),
        Case(description: "IPv4 UDP length > IP length", frame: ipv4(payload: payload, udpLengthDelta: 1), expected: nil),
        Case(description: "IPv4 UDP length < 8", frame: ipv4(payload: payload, udpLengthDelta: -(payload.count + 1)), expected: nil),
        Case(description: "IPv4 first fragment (MF)", frame: ipv4(payload: payload, fragment: 0x2000), expected: nil),
        Case(description: "IPv4 later fragment (offset)", frame: ipv4(payload: payload, fragment: 0x0010), expected: nil),
        Case(description: "IPv4 TCP", frame: ipv4(payload: payload, protocolNumber: 6), expected: nil),
        Case(description: "IPv4 ICMP", frame: ipv4(payload: payload, protocolNumber: 1), expected: nil),
        Case(description: "IPv6 fragment header", frame: ipv6(payload: payload, extensions: [(44, 0)]), expected: nil),
        Case(description: "IPv6 TCP", frame: ipv6(payload: payload, last: 6), expected: nil),
        Case(description: "IPv6 ESP after hop-by-hop", frame: ipv6(payload: payload, extensions: [(0, 0)], last: 50), expected: nil),
        Case(description: "ARP", frame: ethernet(type: 0x0806, tags: 0) + Array(repeating: 0, count: 28), expected: nil),
        Case(description: "IPv4 ethertype, version 6", frame: { var f = ipv4(payload: payload); f[14] = 0x65; return f }(), expected: nil),
        Case(description: "IPv4 header length 4 words", frame: { var f = ipv4(payload: payload); f[14] = 0x44; return f }(), expected: nil),
        Case(description: "IPv4 total length past the frame", frame: { var f = ipv4(payload: payload); f[17] &+= 1; return f }(), expected: nil),
        Case(description: "IPv4 total length shorter than its header", frame: { var f = ipv4(payload: payload); f[16] = 0; f[17] = 19; return f }(), expected: nil),
        Case(description: "IPv6 payload length past the frame", frame: { var f = ipv6(payload: payload); f[19] &+= 1; return f }(), expected: nil),
    ]

    @Test("Frames parse to the expected fields, source included, or are refused", arguments: cases)
    func table(_ test: Case) {
        var source = sockaddr_storage()
        let parsed = test.frame.withUnsafeBytes { FrameParser.parse($0, source: &source) }
        guard let expected = test.expected else {
            #expect(parsed == nil, "\(test.description) must be refused")
            return
        }
        guard let parsed else {
            Issue.record("\(test.description) was refused")
            return
        }
        #expect(parsed.family == expected.family)
        #expect(parsed.vlanTags == expected.vlanTags)
        #expect(parsed.l3Offset == expected.l3Offset)
        #expect(parsed.l4Offset == expected.l4Offset)
        #expect(parsed.payloadOffset == expected.l4Offset + 8)
        #expect(parsed.payloadLength == expected.payload.count)
        #expect(parsed.destinationPort == expected.port)
        #expect(parsed.hopLimit == expected.hopLimit)
        #expect(Array(test.frame[parsed.payloadOffset..<(parsed.payloadOffset + parsed.payloadLength)]) == expected.payload)
        let destination = withUnsafeBytes(of: parsed.destinationAddress) { Array($0) }
        if expected.family == AF_INET {
            #expect(Array(destination.prefix(4)) == Self.server4)
            #expect(destination.dropFirst(4).allSatisfy { $0 == 0 })
            let address = withUnsafeBytes(of: &source) { $0.load(as: sockaddr_in.self) }
            #expect(Int32(address.sin_family) == AF_INET)
            #expect(UInt16(bigEndian: address.sin_port) == Self.sourcePort)
            #expect(withUnsafeBytes(of: address.sin_addr) { Array($0) } == Self.client4)
        } else {
            #expect(destination == Self.server6)
            let address = withUnsafeBytes(of: &source) { $0.load(as: sockaddr_in6.self) }
            #expect(Int32(address.sin6_family) == AF_INET6)
            #expect(UInt16(bigEndian: address.sin6_port) == Self.sourcePort)
            #expect(withUnsafeBytes(of: address.sin6_addr) { Array($0) } == Self.client6)
            #expect(address.sin6_scope_id == 0 && address.sin6_flowinfo == 0)
        }
    }

    @Test("Every truncation of an accepted frame is refused", arguments: cases.filter { $0.expected != nil && !$0.description.contains("padded") })
    func truncated(_ test: Case) {
        for length in 0..<test.frame.count {
            var source = sockaddr_storage()
            let parsed = Array(test.frame.prefix(length)).withUnsafeBytes { FrameParser.parse($0, source: &source) }
            #expect(parsed == nil, "\(test.description) cut to \(length) of \(test.frame.count) bytes was accepted")
        }
    }

    @Test("Fuzz: random and mutated frames never crash and never report an offset outside the frame")
    func fuzz() {
        var random = PacketFuzz.Generator(state: UInt64.random(in: 0...UInt64.max))
        let seed = random.state
        let bases = Self.cases.map(\.frame)
        var accepted = 0
        for _ in 0..<5000 {
            var frame: [UInt8]
            switch random.below(4) {
            case 0: frame = random.bytes(random.below(120))
            case 1:
                // A random frame behind a valid Ethernet type, so the IP parsers see garbage.
                frame = Self.ethernet(type: random.chance(50) ? 0x0800 : 0x86dd, tags: random.below(3)) + random.bytes(random.below(120))
            default:
                frame = bases[random.below(bases.count)]
                for _ in 0...random.below(4) where !frame.isEmpty {
                    frame[random.below(min(frame.count, 80))] = random.byte()
                }
                if random.chance(30) { frame = Array(frame.prefix(random.below(frame.count + 1))) }
            }
            var source = sockaddr_storage()
            guard let parsed = frame.withUnsafeBytes({ FrameParser.parse($0, source: &source) }) else { continue }
            accepted += 1
            let inside = parsed.l3Offset >= 14 && parsed.l3Offset < parsed.l4Offset && parsed.l4Offset + 8 == parsed.payloadOffset
                && parsed.payloadLength >= 0 && parsed.payloadOffset + parsed.payloadLength <= frame.count
                && (parsed.family == AF_INET || parsed.family == AF_INET6) && (0...2).contains(parsed.vlanTags)
            #expect(inside, "seed \(seed): \(parsed) outside a \(frame.count)-byte frame \(frame)")
        }
        // Mutations that keep the frame valid are common: a parser refusing everything would fail here.
        #expect(accepted > 100, "seed \(seed): only \(accepted) accepted")
    }

    /// A received frame as the AF_XDP socket shows it: `meta` in the bytes right before it.
    static func received(_ frame: [UInt8], meta: fanout_xdp_meta?, _ body: (UnsafeMutableRawBufferPointer, UnsafeMutableRawPointer) -> Void) {
        let size = MemoryLayout<fanout_xdp_meta>.size
        var bytes = [UInt8](repeating: 0, count: size) + frame
        bytes.withUnsafeMutableBytes { all in
            if let meta { all.baseAddress!.storeBytes(of: meta, as: fanout_xdp_meta.self) }
            body(UnsafeMutableRawBufferPointer(rebasing: all[size...]), all.baseAddress!)
        }
    }

    @Test("The XDP program's metadata gives what the walk gives, source included, and its magic is cleared", arguments: cases.filter { $0.expected != nil })
    func metadataAgreesWithTheWalk(_ test: Case) throws {
        var walkedSource = sockaddr_storage()
        let walked = try #require(test.frame.withUnsafeBytes { FrameParser.parse($0, source: &walkedSource) })
        Self.received(test.frame, meta: fanout_xdp_meta(walked: walked, frame: test.frame)) { frame, metadata in
            var source = sockaddr_storage()
            var walkedFrames: UInt64 = 0
            let parsed = FrameParser.parse(received: frame, source: &source, walked: &walkedFrames)
            #expect(walkedFrames == 0, "\(test.description): taken from the metadata")
            #expect(parsed == walked, "\(test.description)")
            #expect(withUnsafeBytes(of: &source) { Array($0) } == withUnsafeBytes(of: &walkedSource) { Array($0) }, "\(test.description): source")
            #expect(metadata.load(fromByteOffset: MemoryLayout<fanout_xdp_meta>.offset(of: \.magic)!, as: UInt32.self) == 0,
                    "\(test.description): the magic stays after the frame was taken")
        }
    }

    @Test("A frame without metadata (a driver with no metadata area) is walked, and refused as the walk refuses it", arguments: cases)
    func noMetadataIsWalked(_ test: Case) {
        var walkedSource = sockaddr_storage()
        let walked = test.frame.withUnsafeBytes { FrameParser.parse($0, source: &walkedSource) }
        Self.received(test.frame, meta: nil) { frame, _ in
            var source = sockaddr_storage()
            var walkedFrames: UInt64 = 0
            #expect(FrameParser.parse(received: frame, source: &source, walked: &walkedFrames) == walked, "\(test.description)")
            #expect(walkedFrames == 1, "\(test.description): counted as walked")
        }
    }

    @Test("Metadata that disagrees with the frame is refused (a parse error), never read past the frame")
    func metadataOutsideTheFrame() throws {
        let frame = Self.ipv4(payload: Self.payload)
        var ignored = sockaddr_storage()
        let walked = try #require(frame.withUnsafeBytes { FrameParser.parse($0, source: &ignored) })
        let good = fanout_xdp_meta(walked: walked, frame: frame)
        var cases: [(String, fanout_xdp_meta)] = []
        var meta = good
        meta.ip_end = UInt16(frame.count + 1); cases.append(("IP end past the frame", meta))
        meta = good; meta.l4 = meta.ip_end - 7; cases.append(("UDP header past the IP end", meta))
        meta = good; meta.l4 = 30; cases.append(("UDP header inside the IPv4 header", meta))
        meta = good; meta.l3 = 12; cases.append(("IP header inside the Ethernet header", meta))
        meta = good; meta.l3 = 15; cases.append(("IP header not after whole VLAN tags", meta))
        meta = good; meta.family = 7; cases.append(("no such family", meta))
        meta = good; meta.family = UInt8(AF_INET6); cases.append(("IPv6 with a 20-byte header", meta))
        meta = good; meta.ip_end = UInt16(walked.l4Offset + 8 + Self.payload.count - 1); cases.append(("UDP length past the IP end", meta))
        for (description, meta) in cases {
            Self.received(frame, meta: meta) { frame, _ in
                var source = sockaddr_storage()
                var walkedFrames: UInt64 = 0
                #expect(FrameParser.parse(received: frame, source: &source, walked: &walkedFrames) == nil, "\(description)")
            }
        }
    }
}
