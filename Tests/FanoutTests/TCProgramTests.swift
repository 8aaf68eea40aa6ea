// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import CLibBPF
import CSystemShim
import Foundation
import ReusePortLB
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// The tc program under BPF_PROG_TEST_RUN: rewritten bytes, checksums (recomputed here
/// independently) and counters. Its table of verdicts (not ours, malformed, no backend, no route,
/// no neighbour, TTL 1) is DecisionTableTests', which runs it through the xdp program too.
///
/// The fib lookup is made deterministic by running the program from a thread inside a network
/// namespace this test creates: interface t0 with 198.18.200.1/24 and 2001:db8:200::1/64, a
/// permanent neighbour .10 / ::10 (MAC 02:00:00:00:00:0a), no neighbour for .20, and no route
/// to 198.19.99.0/24.
@Suite("tc program under BPF_PROG_TEST_RUN", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct TCProgramTests {
    // The fixture's addresses and verdicts, under the names the cases use.
    static let listenerV4 = ProgramFrames.listenerV4, listenerV6 = ProgramFrames.listenerV6
    static let clientV4 = ProgramFrames.clientV4, clientV6 = ProgramFrames.clientV6
    static let neighbourMAC = ProgramFrames.neighbourMAC
    typealias Fixture = TCProgramFixture
    static let redirect = TCProgramFixture.redirect, shot = TCProgramFixture.shot, pass = TCProgramFixture.pass

    @Test("IPv4, IPv4 with options, IPv6, VLAN and zero checksum: rewritten, checksums valid, MACs from the fib, counted; a run arriving CHECKSUM_NONE, then one CHECKSUM_COMPLETE (the kernel checks skb->csum)", arguments: TCProgramFixture.checksumStates)
    func forwarded(complete: Bool) throws {
        let fixture = try Fixture()
        fixture.checksumComplete = complete
        let cases: [(String, [UInt8], family: Int32, vlan: Bool, zeroChecksum: Bool)] = [
            ("IPv4", Packet.ipv4(payload: Array(repeating: 0x41, count: 100)), AF_INET, false, false),
            ("IPv4 with options", Packet.ipv4(payload: Array(repeating: 0x42, count: 57), options: [1, 1, 1, 0]), AF_INET, false, false),
            ("IPv6", Packet.ipv6(payload: Array(repeating: 0x43, count: 99)), AF_INET6, false, false),
            ("802.1Q", Packet.ipv4(payload: Array(repeating: 0x44, count: 64), vlan: 42), AF_INET, true, false),
            ("zero UDP checksum", Packet.ipv4(payload: Array(repeating: 0x45, count: 64), zeroChecksum: true), AF_INET, false, true),
        ]
        var seenPorts = Set<UInt16>()
        // A tag in the frame is not run CHECKSUM_COMPLETE: the test run does not mark its socket
        // buffer as at tc ingress, so bpf_skb_vlan_pop takes the tag's first four bytes off
        // skb->csum, not the four it covered (at a real ingress the kernel adds the MAC header in
        // around the pop and the sum comes out right).
        for (name, frame, family, vlan, zeroChecksum) in cases where !(complete && vlan) {
            let id: UInt32 = family == AF_INET6 ? 1 : 0
            let before = fixture.stats(id).verdicts[Int(FANOUT_VERDICT_FORWARDED.rawValue)]
            let (verdict, output) = fixture.execute(frame)
            #expect(verdict == Self.redirect, "\(name): verdict \(verdict)")
            #expect(fixture.stats(id).verdicts[Int(FANOUT_VERDICT_FORWARDED.rawValue)] == before + 1, "\(name): counted forwarded")
            let parsed = try #require(Packet.parse(output), "\(name): output parses")
            #expect(output.count == frame.count - (vlan ? 4 : 0), "\(name): length (tag removed: \(vlan))")
            #expect(!parsed.tagged, "\(name): no VLAN tag on egress")
            #expect(Array(output[0..<6]) == Self.neighbourMAC, "\(name): destination MAC from the fib")
            #expect(Array(output[6..<12]) == fixture.sourceMAC, "\(name): source MAC of the egress interface")
            let original = try #require(Packet.parse(frame))
            #expect(parsed.destination == (family == AF_INET ? [198, 18, 200, 10] : IPAddress("2001:db8:200::10")!.bytes), "\(name): destination rewritten")
            #expect(parsed.source == original.source, "\(name): source untouched")
            #expect((6001...6003).contains(parsed.destinationPort), "\(name): port of a backend")
            seenPorts.insert(parsed.destinationPort)
            #expect(parsed.hopLimit == original.hopLimit - 1, "\(name): TTL / hop limit decremented")
            #expect(parsed.payload == original.payload, "\(name): payload untouched")
            if family == AF_INET { #expect(Packet.ipv4HeaderValid(parsed), "\(name): IPv4 header checksum") }
            if zeroChecksum {
                #expect(parsed.udpChecksum == 0, "\(name): a zero UDP checksum stays zero")
            } else {
                #expect(Packet.udpChecksumValid(parsed), "\(name): UDP checksum")
            }
        }
        #expect(seenPorts.count == 3, "round robin reached every backend")
    }

    @Test("Fragments: middle and last follow the first fragment's backend; an untracked fragment passes")
    func fragments() throws {
        let fixture = try Fixture()
        let payload = (0..<2400).map { UInt8(truncatingIfNeeded: $0 * 7) }
        let pieces = Packet.ipv4Fragments(payload: payload, id: 0x4242, pieceSize: 1000)
        #expect(pieces.count == 3)
        let (firstVerdict, first) = fixture.execute(pieces[0])
        #expect(firstVerdict == Self.redirect)
        let chosen = try #require(Packet.parse(first))
        // Another datagram in between moves the rotation on.
        #expect(fixture.execute(Packet.ipv4(payload: [1, 2, 3, 4])).verdict == Self.redirect)
        for (index, piece) in pieces.enumerated().dropFirst() {
            let (verdict, output) = fixture.execute(piece)
            #expect(verdict == Self.redirect, "fragment \(index)")
            let parsed = try #require(Packet.parse(output))
            #expect(parsed.destination == chosen.destination, "fragment \(index) to the first's backend")
            #expect(Packet.ipv4HeaderValid(parsed), "fragment \(index): IPv4 header checksum")
            #expect(Array(output[parsed.l4...]) == Array(piece[(parsed.l4)...]), "fragment \(index): payload bytes untouched")
        }
        // The reassembled datagram's UDP checksum is valid for the new addresses and port.
        var whole = Array(first[chosen.l4...])
        for piece in pieces.dropFirst() { whole += piece[(Packet.ethernet + 20)...] }
        #expect(Packet.udpChecksumValid(source: chosen.source, destination: chosen.destination, udp: whole), "reassembled UDP checksum")

        let before = fixture.stats(UInt32(FANOUT_UNMATCHED_STATS)).verdicts[Int(FANOUT_VERDICT_FRAGMENT_UNTRACKED.rawValue)]
        let stray = Packet.ipv4Fragments(payload: payload, id: 0x9999, pieceSize: 1000)[1]
        let (verdict, output) = fixture.execute(stray)
        #expect(verdict == Self.pass, "untracked fragment passes down the chain")
        #expect(output == stray, "untracked fragment untouched")
        #expect(fixture.stats(UInt32(FANOUT_UNMATCHED_STATS)).verdicts[Int(FANOUT_VERDICT_FRAGMENT_UNTRACKED.rawValue)] == before + 1)

        // IPv6: the fragment header's identification, same rule.
        let pieces6 = Packet.ipv6Fragments(payload: payload, id: 0x0102_0304, pieceSize: 1000)
        let (verdict6, first6) = fixture.execute(pieces6[0])
        #expect(verdict6 == Self.redirect)
        let chosen6 = try #require(Packet.parse(first6))
        #expect(fixture.execute(Packet.ipv6(payload: [9, 9])).verdict == Self.redirect)
        for piece in pieces6.dropFirst() {
            let (verdict, output) = fixture.execute(piece)
            #expect(verdict == Self.redirect)
            #expect(Packet.parse(output)?.destination == chosen6.destination)
        }
    }

    @Test("Weights: a 1:3 rotation sends 2 of 8 packets to one backend and 6 to the other; a weight-0 backend gets none")
    func weights() throws {
        let fixture = try Fixture()
        let downstreams = [
            Downstream(name: "light", address: SocketAddress("198.18.200.10:7001")!, weight: 1),
            Downstream(name: "heavy", address: SocketAddress("198.18.200.10:7002")!, weight: 3),
            Downstream(name: "off", address: SocketAddress("198.18.200.10:7003")!, weight: 0),
        ]
        try fixture.add(Fixture.listenerBind(5601), id: 6, BackendSet(downstreams: downstreams, balancing: .roundRobin, slots: ["light": 0, "heavy": 1, "off": 2]))
        var ports: [UInt16: Int] = [:]
        for _ in 0..<8 {
            let (verdict, output) = fixture.execute(Packet.ipv4(payload: [7], port: 5601))
            #expect(verdict == Self.redirect)
            ports[Packet.parse(output)?.destinationPort ?? 0, default: 0] += 1
        }
        #expect(ports == [7001: 2, 7002: 6], "1:3, and weight 0 never chosen: \(ports)")
        #expect(fixture.program.backendStats(id: 6, slot: 1).packets == UInt64(ports[7002] ?? 0), "per-backend counter")
    }

    @Test("source_ip: every packet of a source to the backend Swift computes with the same hash and table")
    func sourceAffinity() throws {
        let fixture = try Fixture()
        let downstreams = (1...3).map { Downstream(name: "b\($0)", address: SocketAddress("198.18.200.10:\(6000 + $0)")!) }
        let set = BackendSet(downstreams: downstreams, balancing: .sourceIP, slots: ["b1": 0, "b2": 1, "b3": 2])
        try fixture.program.writeSet(id: 5, generation: 1, set)
        var entry = fanout_listener()
        entry.id = 5
        entry.generation = 1
        entry.policy = FANOUT_POLICY_SOURCE_IP.rawValue
        try fixture.program.putListener(Fixture.listenerBind(5600), ifindex: UInt32(fixture.ifindex), entry)
        var ports = Set<UInt16>()
        for last in UInt8(1)...UInt8(40) {
            let source: [UInt8] = [198, 18, 50, last]
            var words = source.withUnsafeBytes { $0.load(as: UInt32.self) }
            let hash = rplb_source_hash(&words, 1, 0, set.seed, 0)
            let expected = 6001 + UInt16(set.table[Int(rplb_reduce(hash, UInt32(set.table.count)))])
            for _ in 0..<2 {
                let (verdict, output) = fixture.execute(Packet.ipv4(payload: [last], source: source, port: 5600))
                #expect(verdict == Self.redirect)
                #expect(Packet.parse(output)?.destinationPort == expected, "source \(source)")
            }
            ports.insert(expected)
        }
        #expect(ports.count == 3)
    }
}

extension TCProgramTests {
    @Test("A listener matches only on its own interface: one bind on two interfaces, two listeners; a bind on t1 only passes on t0")
    func perInterface() throws {
        let fixture = try Fixture()
        let bind = Fixture.listenerBind(5700)
        try fixture.add(bind, id: 7, BackendSet(downstreams: [Downstream(name: "a", address: SocketAddress("198.18.200.10:7101")!)], balancing: .roundRobin, slots: ["a": 0]))
        try fixture.add(bind, id: 8, BackendSet(downstreams: [Downstream(name: "b", address: SocketAddress("198.18.200.10:7102")!)], balancing: .roundRobin, slots: ["b": 0]),
                        ifindex: fixture.otherIfindex)
        for (ifindex, port, id) in [(fixture.ifindex, UInt16(7101), UInt32(7)), (fixture.otherIfindex, 7102, 8), (fixture.ifindex, 7101, 7)] {
            let (verdict, output) = fixture.execute(Packet.ipv4(payload: [5], port: 5700), ifindex: ifindex)
            #expect(verdict == Self.redirect)
            #expect(Packet.parse(output)?.destinationPort == port, "arriving on \(ifindex): the listener of that interface")
        }
        #expect(fixture.stats(7).received == 2 && fixture.stats(8).received == 1)
        // 5514 is configured on t1 only: on t0 it is not ours.
        let frame = Packet.ipv4(payload: [6])
        let before = fixture.stats(0).received
        let (verdict, output) = fixture.execute(frame, ifindex: fixture.otherIfindex)
        #expect(verdict == Self.pass, "another interface's packet continues down the chain")
        #expect(output == frame)
        #expect(fixture.stats(0).received == before, "not counted for the t1 listener")

        // Fragments too: a later fragment arriving on t0 does not follow a first seen on t1.
        let pieces = Packet.ipv4Fragments(payload: (0..<2400).map { UInt8(truncatingIfNeeded: $0) }, id: 0x5151, pieceSize: 1000)
        #expect(fixture.execute(pieces[0]).verdict == Self.redirect)
        let untracked = fixture.stats(UInt32(FANOUT_UNMATCHED_STATS)).verdicts[Int(FANOUT_VERDICT_FRAGMENT_UNTRACKED.rawValue)]
        let (fragmentVerdict, fragmentOutput) = fixture.execute(pieces[1], ifindex: fixture.otherIfindex)
        #expect(fragmentVerdict == Self.pass && fragmentOutput == pieces[1], "another interface's fragment is not the listener's")
        #expect(fixture.stats(UInt32(FANOUT_UNMATCHED_STATS)).verdicts[Int(FANOUT_VERDICT_FRAGMENT_UNTRACKED.rawValue)] == untracked + 1)
        #expect(fixture.execute(pieces[2]).verdict == Self.redirect, "on t1 it still follows")
    }
}

extension TCProgramTests {
    @Test("no_route and too_large are counted per downstream; a datagram within the route MTU is forwarded")
    func perDownstreamDrops() throws {
        let fixture = try Fixture()
        // 5516's only downstream (slot 0) has no route.
        #expect(fixture.execute(Packet.ipv4(payload: [1, 2], port: 5516)).verdict == Self.shot)
        var counted = fixture.program.backendStats(id: 3, slot: 0)
        #expect(counted.noRoute == 1 && counted.tooLarge == 0 && counted.packets == 0, "\(counted)")
        // A downstream behind the 600-byte route MTU: 1000 bytes are too large, 100 pass.
        try fixture.add(Fixture.listenerBind(5602), id: 9, BackendSet(
            downstreams: [Downstream(name: "narrow", address: SocketAddress("198.18.210.10:7200")!)], balancing: .roundRobin, slots: ["narrow": 5]))
        #expect(fixture.execute(Packet.ipv4(payload: [UInt8](repeating: 7, count: 1000), port: 5602)).verdict == Self.shot)
        #expect(fixture.stats(9).verdicts[Int(FANOUT_VERDICT_TOO_LARGE.rawValue)] == 1, "counted too_large for the listener")
        #expect(fixture.execute(Packet.ipv4(payload: [UInt8](repeating: 7, count: 100), port: 5602)).verdict == Self.redirect)
        counted = fixture.program.backendStats(id: 9, slot: 5)
        #expect(counted.tooLarge == 1 && counted.noRoute == 0 && counted.packets == 1, "\(counted)")
    }
}
