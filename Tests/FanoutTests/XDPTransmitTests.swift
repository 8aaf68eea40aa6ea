// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
import ReusePortLB
@testable import FanoutCore
import CSystemShim

#if canImport(Glibc)
import Glibc
#endif

/// A received UDP frame as the XDP program hands it over, built with correct checksums.
struct TestFrame {
    var bytes: [UInt8]
    var l3: Int
    var l4: Int
    var family: Int32

    static let clientMAC: [UInt8] = [0x02, 0xc1, 0, 0, 0, 1]
    static let lbMAC: [UInt8] = [0x02, 0x1b, 0, 0, 0, 1]

    /// Ethernet (with `vlans` 802.1Q tags), IPv4 with `options` bytes of options or IPv6, UDP, payload.
    init(source: SocketAddress, destination: SocketAddress, payload: [UInt8], vlans: Int = 0, options: Int = 0,
         ttl: UInt8 = 64, udpChecksum: Bool = true) {
        var frame = Self.lbMAC + Self.clientMAC
        for vlan in 0..<vlans { frame += [0x81, 0x00, 0x00, UInt8(10 + vlan)] }
        let udpLength = 8 + payload.count
        let sourceBytes = source.ip.bytes, destinationBytes = destination.ip.bytes
        l3 = frame.count + 2
        if case .v4 = source.ip {
            family = AF_INET
            frame += [0x08, 0x00]
            let ihl = 5 + options / 4
            let total = ihl * 4 + udpLength
            var ip: [UInt8] = [UInt8(0x40 | ihl), 0, UInt8(total >> 8), UInt8(total & 0xff), 0x12, 0x34, 0x40, 0, ttl, 17, 0, 0]
            ip += sourceBytes + destinationBytes
            ip += (0..<options).map { $0 == options - 1 ? 0 : 1 }  // NOPs then end of options
            let checksum = referenceChecksum(ip)
            ip[10] = UInt8(checksum >> 8)
            ip[11] = UInt8(checksum & 0xff)
            frame += ip
        } else {
            family = AF_INET6
            frame += [0x86, 0xdd]
            frame += [0x60, 0, 0, 0, UInt8(udpLength >> 8), UInt8(udpLength & 0xff), 17, ttl] + sourceBytes + destinationBytes
        }
        l4 = frame.count
        var udp: [UInt8] = [UInt8(source.port >> 8), UInt8(source.port & 0xff), UInt8(destination.port >> 8), UInt8(destination.port & 0xff),
                            UInt8(udpLength >> 8), UInt8(udpLength & 0xff), 0, 0]
        if udpChecksum {
            let checksum = referenceUDPChecksum(source: sourceBytes, destination: destinationBytes, udp: udp + payload)
            udp[6] = UInt8(checksum >> 8)
            udp[7] = UInt8(checksum & 0xff)
        }
        bytes = frame + udp + payload
    }

    func word(_ offset: Int) -> Int { Int(bytes[offset]) << 8 | Int(bytes[offset + 1]) }
}

@Suite("xdp_tx: frame rewrite")
struct FrameRewriterTests {
    static let nextHop = NextHop(ifindex: 3, sourceMAC: TestFrame.lbMAC, destinationMAC: [0x02, 0xbe, 0, 0, 0, 7])

    struct Case: CustomStringConvertible {
        var description: String
        var client: String
        var listener: String
        var downstream: String
        var vlans = 0
        var options = 0
        var udpChecksum = true
    }

    static let cases: [Case] = [
        Case(description: "IPv4", client: "198.18.0.77:40000", listener: "198.18.0.1:5514", downstream: "198.18.0.20:2055"),
        Case(description: "IPv4 with 8 bytes of options", client: "198.18.0.77:40000", listener: "198.18.0.1:5514", downstream: "198.18.0.20:2055", options: 8),
        Case(description: "IPv4, zero UDP checksum", client: "198.18.0.77:40000", listener: "198.18.0.1:5514", downstream: "198.18.0.20:2055", udpChecksum: false),
        Case(description: "IPv4 behind one VLAN tag", client: "198.18.0.77:40000", listener: "198.18.0.1:5514", downstream: "198.18.0.20:2055", vlans: 1),
        Case(description: "IPv6", client: "[2001:db8::77]:40000", listener: "[2001:db8::1]:5514", downstream: "[2001:db8::20]:2055"),
        Case(description: "IPv6 behind two VLAN tags", client: "[2001:db8::77]:40000", listener: "[2001:db8::1]:5514", downstream: "[2001:db8:ffff::fffe]:65535", vlans: 2),
    ]

    @Test("Rewritten frames carry the next hop's MACs, the downstream's address and port, TTL - 1, the client's source, VLAN tags and payload as they were, and checksums that verify from scratch", arguments: cases)
    func rewrite(_ test: Case) throws {
        for length in [0, 1, 2, 333, 1400] {
            let payload = (0..<length).map { UInt8(truncatingIfNeeded: $0 &* 11 &+ length) }
            let client = SocketAddress(test.client)!, downstream = SocketAddress(test.downstream)!
            var frame = TestFrame(source: client, destination: SocketAddress(test.listener)!, payload: payload, vlans: test.vlans,
                                  options: test.options, udpChecksum: test.udpChecksum)
            let before = frame.bytes
            let done = frame.bytes.withUnsafeMutableBytes {
                FrameRewriter.rewrite($0, l3Offset: frame.l3, l4Offset: frame.l4, family: frame.family, to: downstream, nextHop: Self.nextHop)
            }
            #expect(done, "\(test), \(length)")
            let bytes = frame.bytes
            #expect(Array(bytes[0..<6]) == Self.nextHop.destinationMAC && Array(bytes[6..<12]) == Self.nextHop.sourceMAC)
            #expect(bytes[12..<frame.l3] == before[12..<frame.l3], "VLAN tags and EtherType kept")
            #expect(bytes[(frame.l4 + 8)...] == before[(frame.l4 + 8)...], "payload untouched")
            #expect(frame.word(frame.l4) == Int(client.port) && frame.word(frame.l4 + 2) == Int(downstream.port))
            let udp = Array(bytes[frame.l4...])
            if frame.family == AF_INET {
                let header = Array(bytes[frame.l3..<frame.l4])
                #expect(header[8] == 63, "TTL - 1")
                #expect(Array(header[12..<16]) == client.ip.bytes && Array(header[16..<20]) == downstream.ip.bytes)
                #expect(referenceChecksum(header) == 0, "IPv4 header checksum verifies (\(test), \(length))")
                #expect(header[20...] == before[(frame.l3 + 20)..<frame.l4], "options kept")
                if test.udpChecksum {
                    #expect(frame.word(frame.l4 + 6) == Int(referenceUDPChecksum(source: client.ip.bytes, destination: downstream.ip.bytes, udp: udp)), "\(test), \(length)")
                } else {
                    #expect(frame.word(frame.l4 + 6) == 0, "a zero (absent) UDP checksum stays zero")
                }
            } else {
                let header = Array(bytes[frame.l3..<frame.l4])
                #expect(header[7] == 63, "hop limit - 1")
                #expect(Array(header[8..<24]) == client.ip.bytes && Array(header[24..<40]) == downstream.ip.bytes)
                #expect(frame.word(frame.l4 + 6) == Int(referenceUDPChecksum(source: client.ip.bytes, destination: downstream.ip.bytes, udp: udp)), "\(test), \(length)")
            }
        }
    }

    @Test("A frame from a virtual NIC whose UDP checksum field holds only the pseudo-header sum (left for an offload that never ran) leaves with a checksum that verifies")
    func partialChecksum() throws {
        for (client, listener, downstream) in [("198.18.0.77:40000", "198.18.0.1:5514", "198.18.0.20:2055"),
                                               ("[2001:db8::77]:40000", "[2001:db8::1]:5514", "[2001:db8::20]:2055")] {
            let source = SocketAddress(client)!, target = SocketAddress(downstream)!
            var frame = TestFrame(source: source, destination: SocketAddress(listener)!, payload: Array(repeating: 7, count: 64))
            // What the sender's stack leaves with CHECKSUM_PARTIAL: not the datagram's checksum.
            frame.bytes[frame.l4 + 6] = 0x5a
            frame.bytes[frame.l4 + 7] = 0xa5
            let done = frame.bytes.withUnsafeMutableBytes {
                FrameRewriter.rewrite($0, l3Offset: frame.l3, l4Offset: frame.l4, family: frame.family, to: target, nextHop: Self.nextHop)
            }
            #expect(done)
            let udp = Array(frame.bytes[frame.l4...])
            #expect(frame.word(frame.l4 + 6) == Int(referenceUDPChecksum(source: source.ip.bytes, destination: target.ip.bytes, udp: udp)), "\(client)")
        }
    }

    @Test("Random addresses, ports and payloads: the checksums always equal the ones computed from scratch (2000 frames)")
    func randomFrames() {
        for round in 0..<2000 {
            let v6 = round % 2 == 1
            func address() -> String {
                v6 ? "[2001:db8:\(String(UInt16.random(in: 0...0xffff), radix: 16))::\(String(UInt16.random(in: 0...0xffff), radix: 16))]:\(UInt16.random(in: 0...0xffff))"
                   : "198.\(Int.random(in: 18...19)).\(Int.random(in: 0...255)).\(Int.random(in: 0...255)):\(UInt16.random(in: 0...0xffff))"
            }
            let client = SocketAddress(address())!, downstream = SocketAddress(address())!
            let payload = (0..<Int.random(in: 0...200)).map { _ in UInt8.random(in: 0...255) }
            var frame = TestFrame(source: client, destination: SocketAddress(address())!, payload: payload, vlans: round % 3, options: v6 ? 0 : 4 * (round % 4))
            let done = frame.bytes.withUnsafeMutableBytes {
                FrameRewriter.rewrite($0, l3Offset: frame.l3, l4Offset: frame.l4, family: frame.family, to: downstream, nextHop: Self.nextHop)
            }
            #expect(done)
            let udp = Array(frame.bytes[frame.l4...])
            #expect(frame.word(frame.l4 + 6) == Int(referenceUDPChecksum(source: client.ip.bytes, destination: downstream.ip.bytes, udp: udp)), "round \(round)")
            if !v6 { #expect(referenceChecksum(Array(frame.bytes[frame.l3..<frame.l4])) == 0, "round \(round)") }
        }
    }

    @Test("Refused with the frame untouched: TTL 1 and 0, hop limit 1, family differs, an IPv4 fragment, headers past the frame's end")
    func refused() {
        let v4 = SocketAddress("198.18.0.20:2055")!, v6 = SocketAddress("[2001:db8::20]:2055")!
        let client4 = SocketAddress("198.18.0.77:40000")!, listener4 = SocketAddress("198.18.0.1:5514")!
        var frames: [(String, TestFrame, SocketAddress, Int)] = [
            ("TTL 1", TestFrame(source: client4, destination: listener4, payload: [1, 2, 3], ttl: 1), v4, 0),
            ("TTL 0", TestFrame(source: client4, destination: listener4, payload: [1, 2, 3], ttl: 0), v4, 0),
            ("hop limit 1", TestFrame(source: SocketAddress("[2001:db8::77]:40000")!, destination: SocketAddress("[2001:db8::1]:5514")!, payload: [1], ttl: 1), v6, 0),
            ("IPv4 frame, IPv6 downstream", TestFrame(source: client4, destination: listener4, payload: [1, 2, 3]), v6, 0),
            ("cut in the UDP header", TestFrame(source: client4, destination: listener4, payload: []), v4, 1),
        ]
        var fragment = TestFrame(source: client4, destination: listener4, payload: [1, 2, 3])
        fragment.bytes[fragment.l3 + 6] = 0x20  // MF
        frames.append(("first fragment (MF)", fragment, v4, 0))
        fragment.bytes[fragment.l3 + 6] = 0
        fragment.bytes[fragment.l3 + 7] = 0x10  // offset 16 bytes
        frames.append(("later fragment", fragment, v4, 0))
        for (name, frame, downstream, cut) in frames {
            var bytes = Array(frame.bytes.dropLast(cut))
            let before = bytes
            let done = bytes.withUnsafeMutableBytes {
                FrameRewriter.rewrite($0, l3Offset: frame.l3, l4Offset: frame.l4, family: frame.family, to: downstream, nextHop: Self.nextHop)
            }
            #expect(!done, "\(name)")
            #expect(bytes == before, "\(name): untouched")
        }
    }
}

/// Namespaces for the resolver, made and removed here (names with a random suffix):
///
///     lb (A: 198.18.10.1/24, 2001:db8:10::1/64) ── peer (198.18.10.2, 2001:db8:10::2)
///     lb (B: 198.18.11.1/24)                     ── other (198.18.11.2)
///     lb routes: 198.18.20.0/24 via 198.18.10.2 (A), 198.18.21.0/24 via 198.18.11.2 (B),
///     2001:db8:20::/64 via 2001:db8:10::2 (A); no default.
final class ResolverTopology {
    let suffix = String(UInt32.random(in: 0...UInt32.max), radix: 16)
    var lb: String { "nhl-\(suffix)" }
    var peer: String { "nhp-\(suffix)" }
    var other: String { "nho-\(suffix)" }
    var a: String { "nha\(suffix)" }
    var b: String { "nhb\(suffix)" }
    static let lbMAC = "02:1b:00:00:0a:01", peerMAC = "02:be:00:00:0a:02", otherMAC = "02:be:00:00:0b:02"

    init() throws {
        for namespace in [lb, peer, other] { try Self.ip(["netns", "add", namespace]) }
        try Self.ip(["link", "add", a, "netns", lb, "address", Self.lbMAC, "type", "veth", "peer", "name", "p\(suffix)", "netns", peer, "address", Self.peerMAC])
        try Self.ip(["link", "add", b, "netns", lb, "type", "veth", "peer", "name", "o\(suffix)", "netns", other, "address", Self.otherMAC])
        for (namespace, name, v4, v6) in [(lb, a, "198.18.10.1/24", "2001:db8:10::1/64"), (peer, "p\(suffix)", "198.18.10.2/24", "2001:db8:10::2/64"),
                                          (lb, b, "198.18.11.1/24", "2001:db8:11::1/64"), (other, "o\(suffix)", "198.18.11.2/24", "2001:db8:11::2/64")] {
            try Self.ip(["-n", namespace, "addr", "add", v4, "dev", name])
            try Self.ip(["-n", namespace, "-6", "addr", "add", v6, "dev", name, "nodad"])
            try Self.ip(["-n", namespace, "link", "set", name, "up"])
        }
        try Self.ip(["-n", lb, "route", "add", "198.18.20.0/24", "via", "198.18.10.2"])
        try Self.ip(["-n", lb, "route", "add", "198.18.21.0/24", "via", "198.18.11.2"])
        try Self.ip(["-n", lb, "-6", "route", "add", "2001:db8:20::/64", "via", "2001:db8:10::2"])
    }

    deinit {
        for namespace in [lb, peer, other] { _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace]) }
    }

    static func ip(_ arguments: [String]) throws {
        let result = try run("/usr/sbin/ip", arguments)
        try #require(result.status == 0, "ip \(arguments.joined(separator: " ")): \(result.output)")
    }

    func ping(_ target: String) throws {
        let result = try run("/usr/bin/nsenter", ["--net=/run/netns/\(lb)", "--", "ping", "-c", "1", "-W", "3", target])
        try #require(result.status == 0, "ping \(target): \(result.output)")
    }
}

func mac(_ text: String) -> [UInt8] { text.split(separator: ":").map { UInt8($0, radix: 16)! } }

@Suite("xdp_tx: next hop resolver", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct NextHopResolverTests {
    typealias Answer = Result<NextHop, NextHopProblem>

    @Test("On-link neighbours after a ping (IPv4, IPv6), gateway routes (IPv4, IPv6), another interface, no route, an unknown neighbour")
    func answers() throws {
        let topology = try ResolverTopology()
        try topology.ping("198.18.10.2")
        try topology.ping("2001:db8:10::2")
        let a = topology.a
        let answers = try #require(inNetworkNamespace(topology.lb) { () -> (UInt32, [String: Answer]) in
            let ifindex = if_nametoindex(a)
            let resolver = NextHopResolver(ifindex: ifindex)
            var answers: [String: Answer] = [:]
            for target in ["198.18.10.2", "2001:db8:10::2", "198.18.20.5", "2001:db8:20::5", "198.18.21.5", "198.18.11.2", "198.19.99.1", "2001:db8:99::1", "198.18.10.9"] {
                answers[target] = resolver.lookup(IPAddress(target)!)
            }
            return (ifindex, answers)
        })
        let (ifindex, results) = answers
        #expect(ifindex > 0)
        let expected = NextHop(ifindex: ifindex, sourceMAC: mac(ResolverTopology.lbMAC), destinationMAC: mac(ResolverTopology.peerMAC))
        #expect(results["198.18.10.2"] == .success(expected), "on-link, known after a ping")
        #expect(results["2001:db8:10::2"] == .success(expected), "IPv6 on-link, known after a ping")
        #expect(results["198.18.20.5"] == .success(expected), "via the gateway 198.18.10.2: the gateway's MAC")
        #expect(results["2001:db8:20::5"] == .success(expected), "via the IPv6 gateway 2001:db8:10::2: the gateway's MAC")
        #expect(results["198.18.21.5"] == .failure(.otherInterface), "the gateway is on B")
        #expect(results["198.18.11.2"] == .failure(.otherInterface), "on-link on B")
        #expect(results["198.19.99.1"] == .failure(.noRoute))
        #expect(results["2001:db8:99::1"] == .failure(.noRoute))
        #expect(results["198.18.10.9"] == .failure(.noNeighbour), "nobody answered for it")
    }

    @Test("Answers are cached; refresh() asks again only for answers at least a second old: a neighbour added later is found then")
    func refresh() throws {
        let topology = try ResolverTopology()
        let (a, lb) = (topology.a, topology.lb)
        let answers = try #require(inNetworkNamespace(topology.lb) { () -> [Answer] in
            let resolver = NextHopResolver(ifindex: if_nametoindex(a))
            let target = IPAddress("198.18.10.9")!
            var answers = [resolver.lookup(target)]
            _ = try? run("/usr/sbin/ip", ["-n", lb, "neigh", "replace", "198.18.10.9", "lladdr", "02:be:00:00:0a:09", "dev", a, "nud", "permanent"])
            answers.append(resolver.lookup(target))  // cached
            resolver.refresh()                      // too soon: still cached
            answers.append(resolver.lookup(target))
            usleep(1_100_000)
            resolver.refresh()
            answers.append(resolver.lookup(target))
            answers.append(resolver.resolve(IPAddress("198.18.10.9")!))
            return answers
        })
        #expect(answers[0] == .failure(.noNeighbour))
        #expect(answers[1] == .failure(.noNeighbour), "lookup answers from the cache")
        #expect(answers[2] == .failure(.noNeighbour), "refresh within a second keeps the answer")
        let expected = NextHop(ifindex: try answers[4].get().ifindex, sourceMAC: mac(ResolverTopology.lbMAC), destinationMAC: mac("02:be:00:00:0a:09"))
        #expect(answers[3] == .success(expected), "refreshed after a second")
    }
}
