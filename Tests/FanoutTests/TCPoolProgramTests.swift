// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import CSystemShim
import Foundation
import ReusePortLB
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// Replication in the tc program (bpf/include/fanout_pools.h) under BPF_PROG_TEST_RUN: the
/// listener's own datagram is the program's output, and each pool's copy is a clone sent out of
/// the fixture's t0, captured on its veth peer t1 with a packet socket. Every copy is checked
/// byte by byte (destination, the client's source kept, TTL decremented once, checksums recomputed
/// here), and every pool's counters add up (received = forwarded + dropped + sampled out +
/// filtered out).
@Suite("tc program: replication pools", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct TCPoolProgramTests {
    typealias Fixture = TCProgramFixture
    static let redirect = TCProgramFixture.redirect, shot = TCProgramFixture.shot

    static func expectBalanced(_ fixture: Fixture, _ ids: [UInt32], received: UInt64, sourceLocation: SourceLocation = #_sourceLocation) {
        for id in ids {
            let counted = fixture.pool(id)
            #expect(counted.received == received, "pool \(id) offered \(counted.received)", sourceLocation: sourceLocation)
            #expect(counted.forwarded + counted.dropped + counted.sampledOut + counted.filteredOut == counted.received,
                    "pool \(id): \(counted)", sourceLocation: sourceLocation)
        }
    }

    /// Runs the program on `frame` (arriving on t1) and captures the frames the clones put on t1
    /// (UDP to `ports`): until `expected` arrived and 100 ms more passed with nothing else (a
    /// busy machine delays the backlog, not the count), or for 300 ms when none is expected; at
    /// most 5 s.
    static func executeCapturing(_ fixture: Fixture, _ frame: [UInt8], ports: Set<UInt16>, expected: Int,
                                 accept: (@Sendable (Packet.Parsed) -> Bool)? = nil) -> (verdict: UInt32, output: [UInt8], copies: [[UInt8]]) {
        let box = CaptureBox()
        let (program, fd, ifindex, flags) = (fixture.program.program, fixture.namespaceFD, fixture.ifindex, fixture.testRunFlags)
        OSThread(name: "test-run") {
            guard shim_setns(fd, 0x4000_0000) == 0 else { return }  // CLONE_NEWNET
            _ = shim_pin_current_thread(0)
            let all = UInt16(0x0003).bigEndian  // ETH_P_ALL
            let capture = socket(AF_PACKET, Int32(SOCK_RAW.rawValue) | Int32(SOCK_NONBLOCK.rawValue), Int32(all))
            guard capture >= 0 else { return }
            defer { close(capture) }
            // struct sockaddr_ll: family, protocol, ifindex, then hatype, pkttype, halen, addr (unused by bind).
            var link = [UInt8](repeating: 0, count: 20)
            link.withUnsafeMutableBytes { raw in
                raw.storeBytes(of: UInt16(AF_PACKET), toByteOffset: 0, as: UInt16.self)
                raw.storeBytes(of: all, toByteOffset: 2, as: UInt16.self)
                raw.storeBytes(of: ifindex, toByteOffset: 4, as: Int32.self)
            }
            let bound = link.withUnsafeBytes { bind(capture, $0.baseAddress!.assumingMemoryBound(to: sockaddr.self), socklen_t(20)) }
            guard bound == 0 else { return }
            var output = [UInt8](repeating: 0, count: 4096)
            let (result, verdict, size) = Fixture.testRun(program, frame, ifindex: ifindex, output: &output, flags: flags)
            var copies: [[UInt8]] = []
            var buffer = [UInt8](repeating: 0, count: 4096)
            // Clones cross the veth through the backlog.
            var quietSince = ContinuousClock.now
            let deadline = ContinuousClock.now + .seconds(5)
            func done() -> Bool {
                let quiet = ContinuousClock.now - quietSince
                return expected == 0 ? quiet >= .milliseconds(300) : copies.count >= expected && quiet >= .milliseconds(100)
            }
            while !done() && ContinuousClock.now < deadline {
                let count = recv(capture, &buffer, buffer.count, 0)
                if count > 0 {
                    let received = Array(buffer[0..<count])
                    if let parsed = Packet.parse(received), accept?(parsed) ?? ports.contains(parsed.destinationPort) { copies.append(received) }
                    quietSince = ContinuousClock.now
                } else {
                    usleep(2000)
                }
            }
            box.set((result == 0 ? verdict : UInt32.max, Array(output[0..<size]), copies))
        }.join()
        return box.value
    }

    /// One copy: to one of `members`, the client's source and the payload kept, TTL once down, checksums valid.
    static func expectCopy(_ copy: [UInt8], of frame: [UInt8], to members: [Downstream], sourceMAC: [UInt8], sourceLocation: SourceLocation = #_sourceLocation) throws {
        let parsed = try #require(Packet.parse(copy), sourceLocation: sourceLocation)
        let original = try #require(Packet.parse(frame), sourceLocation: sourceLocation)
        let target = members.first { $0.address.ip.bytes == parsed.destination && $0.address.port == parsed.destinationPort }
        #expect(target != nil, "copy to \(parsed.destination):\(parsed.destinationPort), not a member", sourceLocation: sourceLocation)
        #expect(!parsed.tagged, "no VLAN tag on a copy", sourceLocation: sourceLocation)
        #expect(Array(copy[0..<6]) == ProgramFrames.neighbourMAC && Array(copy[6..<12]) == sourceMAC, "MACs from the fib", sourceLocation: sourceLocation)
        #expect(parsed.source == original.source, "the client's source kept", sourceLocation: sourceLocation)
        #expect(parsed.hopLimit == original.hopLimit - 1, "TTL / hop limit decremented once", sourceLocation: sourceLocation)
        #expect(parsed.payload == original.payload, "payload untouched", sourceLocation: sourceLocation)
        if parsed.destination.count == 4 { #expect(Packet.ipv4HeaderValid(parsed), "IPv4 header checksum", sourceLocation: sourceLocation) }
        #expect(Packet.udpChecksumValid(parsed), "UDP checksum", sourceLocation: sourceLocation)
    }

    // MARK: cases

    static let allMembers = [Fixture.member("a1", "198.18.200.10:7001"), Fixture.member("a2", "198.18.200.10:7002")]
    static let rrMembers = [Fixture.member("r1", "198.18.200.10:7101"), Fixture.member("r2", "198.18.200.10:7102")]
    static let own = (1...3).map { Fixture.member("b\($0)", "198.18.200.10:\(6000 + $0)") }
    static let copyPorts: Set<UInt16> = [7001, 7002, 7101, 7102, 7201, 7301, 7401]

    @Test("IPv4, with options, 802.1Q, zero checksum: one copy per member of an all pool and one to a round-robin pool, each rewritten (source kept, TTL once, checksums valid); the own datagram as before; sample and sources count what they keep out; a run arriving CHECKSUM_NONE, then one CHECKSUM_COMPLETE (the kernel checks skb->csum)", arguments: TCProgramFixture.checksumStates)
    func copies(complete: Bool) throws {
        let fixture = try Fixture()
        fixture.checksumComplete = complete
        let bind = SocketAddress(ip: ProgramFrames.listenerV4.ip, port: 5520)
        try fixture.addListener(bind: bind, id: 10, own: Self.own, pools: [
            Fixture.PoolSpec(id: 11, policy: FANOUT_POLICY_ALL, members: Self.allMembers),
            Fixture.PoolSpec(id: 12, policy: FANOUT_POLICY_ROUND_ROBIN, members: Self.rrMembers),
            // One source in a million: this client is kept out (checked against userspace's hash below).
            Fixture.PoolSpec(id: 13, policy: FANOUT_POLICY_ROUND_ROBIN, members: [Fixture.member("s", "198.18.200.10:7201")], sample: 1_000_000),
            Fixture.PoolSpec(id: 14, policy: FANOUT_POLICY_ROUND_ROBIN, members: [Fixture.member("f", "198.18.200.10:7301")], sources: [SourcePrefix("198.19.0.0/16")!, SourcePrefix("2001:db8:99::/48")!]),
        ])
        #expect(ReplicationFixtures.sampled([ProgramFrames.clientV4.map(String.init).joined(separator: ".")], sample: 1_000_000).isEmpty,
                "userspace keeps this client out of a 1-in-a-million sample too")
        let frames: [(String, [UInt8])] = [
            ("IPv4", Packet.ipv4(payload: Array(repeating: 0x41, count: 100), port: 5520)),
            ("IPv4 with options", Packet.ipv4(payload: Array(repeating: 0x42, count: 57), port: 5520, options: [1, 1, 1, 0])),
            ("802.1Q", Packet.ipv4(payload: Array(repeating: 0x44, count: 64), port: 5520, vlan: 42)),
            ("zero UDP checksum", Packet.ipv4(payload: Array(repeating: 0x45, count: 64), port: 5520, zeroChecksum: true)),
        ].filter { !(complete && $0.0 == "802.1Q") }  // TCProgramTests.forwarded says why
        let sent = UInt64(frames.count)
        var roundRobin = Set<UInt16>()
        for (index, (name, frame)) in frames.enumerated() {
            let (verdict, output, copies) = Self.executeCapturing(fixture, frame, ports: Self.copyPorts, expected: 3)
            #expect(verdict == Self.redirect, "\(name): the own datagram redirected")
            let own = try #require(Packet.parse(output), "\(name)")
            #expect((6001...6003).contains(own.destinationPort) && own.hopLimit == 63 && Packet.ipv4HeaderValid(own), "\(name): own rewritten, TTL once")
            if name == "zero UDP checksum" {
                #expect(own.udpChecksum == 0, "\(name): a zero UDP checksum stays zero")
            } else {
                #expect(Packet.udpChecksumValid(own), "\(name): own UDP checksum")
            }
            #expect(copies.count == 3, "\(name): two copies for the all pool, one for the round-robin pool: \(copies.count)")
            let ports = copies.compactMap { Packet.parse($0)?.destinationPort }
            #expect(ports.filter { $0 == 7001 }.count == 1 && ports.filter { $0 == 7002 }.count == 1, "\(name): every member of the all pool: \(ports)")
            roundRobin.formUnion(ports.filter { $0 >= 7101 })
            for copy in copies {
                if name == "zero UDP checksum" {
                    #expect(Packet.parse(copy)?.udpChecksum == 0, "\(name): a zero UDP checksum stays zero in a copy")
                } else {
                    try Self.expectCopy(copy, of: frame, to: Self.allMembers + Self.rrMembers, sourceMAC: fixture.sourceMAC)
                }
            }
            Self.expectBalanced(fixture, [11, 12, 13, 14], received: UInt64(index + 1))
        }
        #expect(roundRobin == [7101, 7102], "the round-robin pool alternates")
        #expect(fixture.pool(11).forwarded == sent && fixture.pool(12).forwarded == sent)
        #expect(fixture.pool(13).sampledOut == sent && fixture.pool(14).filteredOut == sent)
        #expect(fixture.program.memberStats(id: 11, slot: 0).copies == sent && fixture.program.memberStats(id: 11, slot: 1).copies == sent)
        #expect(fixture.program.memberStats(id: 12, slot: 0).copies + fixture.program.memberStats(id: 12, slot: 1).copies == sent)
        #expect(fixture.stats(10).verdicts[Int(FANOUT_VERDICT_FORWARDED.rawValue)] == sent, "the listener's own: forwarded \(sent)")
    }

    @Test("IPv6, and a source inside the pool's sources: copies rewritten with the IPv6 pseudo-header checksum; a source-ip pool sends one source to one member; a run arriving CHECKSUM_NONE, then one CHECKSUM_COMPLETE (the kernel checks skb->csum)", arguments: TCProgramFixture.checksumStates)
    func ipv6(complete: Bool) throws {
        let fixture = try Fixture()
        fixture.checksumComplete = complete
        let members = [Fixture.member("v1", "[2001:db8:200::10]:7101"), Fixture.member("v2", "[2001:db8:200::10]:7102")]
        try fixture.addListener(bind: ProgramFrames.listenerV6, id: 1, own: (1...3).map { Fixture.member("b\($0)", "[2001:db8:200::10]:\(6000 + $0)") }, pools: [
            Fixture.PoolSpec(id: 21, policy: FANOUT_POLICY_SOURCE_IP, members: members, sources: [SourcePrefix("2001:db8:50::/48")!]),
        ])
        var chosen = Set<UInt16>()
        for round in 0..<4 {
            let frame = Packet.ipv6(payload: Array(repeating: UInt8(round), count: 99))
            let (verdict, _, copies) = Self.executeCapturing(fixture, frame, ports: Self.copyPorts, expected: 1)
            #expect(verdict == Self.redirect)
            #expect(copies.count == 1, "round \(round): one copy")
            for copy in copies {
                try Self.expectCopy(copy, of: frame, to: members, sourceMAC: fixture.sourceMAC)
                chosen.insert(Packet.parse(copy)!.destinationPort)
            }
        }
        #expect(chosen.count == 1, "one source, one member of a source_ip pool")
        Self.expectBalanced(fixture, [21], received: 4)
        #expect(fixture.pool(21).forwarded == 4)
    }

    @Test("The listener with no backend of its own still copies to its pools; a copy whose next hop has no neighbour entry is dropped no_neighbour; TTL 1 goes to no pool; every pool's counts add up")
    func dropsAndNoBackend() throws {
        let fixture = try Fixture()
        let bind = SocketAddress(ip: ProgramFrames.listenerV4.ip, port: 5521)
        try fixture.addListener(bind: bind, id: 10, own: [], pools: [
            Fixture.PoolSpec(id: 11, policy: FANOUT_POLICY_ALL, members: Self.allMembers + [Fixture.member("far", "198.18.200.20:7401")]),
            Fixture.PoolSpec(id: 12, policy: FANOUT_POLICY_ROUND_ROBIN, members: [Fixture.member("n", "198.18.200.20:7401")]),
            Fixture.PoolSpec(id: 13, policy: FANOUT_POLICY_ROUND_ROBIN, members: [Fixture.member("x", "198.19.99.1:7401")]),
        ])
        let frame = Packet.ipv4(payload: [1, 2, 3, 4], port: 5521)
        let (verdict, _, copies) = Self.executeCapturing(fixture, frame, ports: Self.copyPorts, expected: 2)
        #expect(verdict == Self.shot, "no backend of its own: dropped, after the copies")
        #expect(fixture.stats(10).verdicts[Int(FANOUT_VERDICT_NO_BACKEND.rawValue)] == 1)
        #expect(copies.count == 2, "the all pool's two members with a neighbour: \(copies.count)")
        for copy in copies { try Self.expectCopy(copy, of: frame, to: Self.allMembers, sourceMAC: fixture.sourceMAC) }
        #expect(fixture.program.memberStats(id: 11, slot: 2).dropped["no_neighbour"] == 1, "the all pool's member without a neighbour")
        #expect(fixture.pool(11).forwarded == 1, "an all pool's datagram is forwarded once copied to its members")
        #expect(fixture.pool(12).verdicts[Int(FANOUT_VERDICT_NO_NEIGHBOUR.rawValue)] == 1)
        #expect(fixture.program.memberStats(id: 12, slot: 0).dropped["no_neighbour"] == 1)
        #expect(fixture.pool(13).verdicts[Int(FANOUT_VERDICT_NO_ROUTE.rawValue)] == 1)
        #expect(fixture.program.memberStats(id: 13, slot: 0).dropped["no_route"] == 1)

        let expiring = Packet.ipv4(payload: [5], port: 5521, ttl: 1)
        let (_, _, none) = Self.executeCapturing(fixture, expiring, ports: Self.copyPorts, expected: 0)
        #expect(none.isEmpty, "TTL 1: no copy")
        for id: UInt32 in [11, 12, 13] { #expect(fixture.pool(id).verdicts[Int(FANOUT_VERDICT_TTL_EXPIRED.rawValue)] == 1, "pool \(id): ttl_expired") }
        Self.expectBalanced(fixture, [11, 12, 13], received: 2)
    }

    @Test("Fragments: later fragments follow their first fragment's pools (the same round-robin member, every member of an all pool)")
    func fragments() throws {
        let fixture = try Fixture()
        try fixture.addListener(bind: ProgramFrames.listenerV4, id: 0, own: Self.own, pools: [
            Fixture.PoolSpec(id: 11, policy: FANOUT_POLICY_ALL, members: Self.allMembers),
            Fixture.PoolSpec(id: 12, policy: FANOUT_POLICY_ROUND_ROBIN, members: Self.rrMembers),
        ])
        let payload = (0..<2400).map { UInt8(truncatingIfNeeded: $0 * 7) }
        let pieces = Packet.ipv4Fragments(payload: payload, id: 0x5151, pieceSize: 1000)
        var byPiece: [[(UInt16, [UInt8])]] = []
        for (index, piece) in pieces.enumerated() {
            if index == 1 {
                // Another datagram in between moves the round-robin pool on.
                #expect(Self.executeCapturing(fixture, Packet.ipv4(payload: [9]), ports: Self.copyPorts, expected: 3).copies.count == 3)
            }
            // Later fragments have no UDP header: copies are told by address.
            let (verdict, output, copies) = Self.executeCapturing(fixture, piece, ports: [], expected: 3, accept: { $0.destination == [198, 18, 200, 10] && $0.source == ProgramFrames.clientV4 })
            #expect(verdict == Self.redirect, "fragment \(index)")
            #expect(Packet.parse(output)?.destination == [198, 18, 200, 10], "fragment \(index): the own datagram rewritten")
            #expect(copies.count == 3, "fragment \(index): three copies")
            byPiece.append(copies.compactMap { copy in
                guard let parsed = Packet.parse(copy) else { return nil }
                #expect(parsed.destination == [198, 18, 200, 10], "fragment \(index): to the members' address")
                #expect(Packet.ipv4HeaderValid(parsed) && parsed.hopLimit == 63, "fragment \(index): IPv4 header checksum, TTL once")
                return (parsed.destinationPort, copy)
            })
        }
        // The first fragment carries the UDP header: its copies' ports name the members; the later
        // ones are the same datagram's, so the reassembled copies must each be whole at one member.
        let firstPorts = byPiece[0].compactMap { Packet.parse($0.1)?.destinationPort }.sorted()
        #expect(firstPorts.count == 3 && firstPorts.filter { $0 == 7001 || $0 == 7002 }.count == 2, "first fragment: every all member and one round-robin member: \(firstPorts)")
        Self.expectBalanced(fixture, [11, 12], received: 4)
        #expect(fixture.pool(12).forwarded == 4, "every fragment's copy left")
        #expect(fixture.stats(0).verdicts[Int(FANOUT_VERDICT_FORWARDED.rawValue)] == 4, "the own datagram's three pieces and the one in between forwarded")
        // Each member got exactly the datagram's three pieces (the round-robin one included).
        let member = try #require(firstPorts.first { $0 >= 7101 })
        let rrCopies = fixture.program.memberStats(id: 12, slot: member == 7101 ? 0 : 1).copies
        #expect(rrCopies == 3, "the round-robin member chosen by the first fragment got all three pieces: \(rrCopies)")
    }
}

/// What the capture thread hands back to the caller, which joins the thread before reading.
private final class CaptureBox: @unchecked Sendable {
    var value: (verdict: UInt32, output: [UInt8], copies: [[UInt8]]) = (UInt32.max, [], [])
    func set(_ value: (UInt32, [UInt8], [[UInt8]])) { self.value = value }
}
