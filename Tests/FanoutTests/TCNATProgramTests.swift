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

/// `replies: nat` in the tc program, under BPF_PROG_TEST_RUN in TCProgramTests' namespace
/// (clients arrive on t1, backends 198.18.200.10 / 2001:db8:200::10 behind t0), with a route
/// and a permanent neighbour for the clients (198.18.50.0/24, 2001:db8:50::/64 through t1, MAC
/// 02:00:00:00:00:0c) so that replies can be routed back.
@Suite("tc program: two-way nat listeners", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct TCNATProgramTests {
    typealias Fixture = TCProgramFixture
    static let redirect = TCProgramFixture.redirect, shot = TCProgramFixture.shot, pass = TCProgramFixture.pass
    static let clientMAC: [UInt8] = [2, 0, 0, 0, 0, 0x0c]
    static let vip = SocketAddress("198.18.100.1:5800")!
    static let vip6 = SocketAddress("[2001:db8:100::1]:5800")!
    static let natID: UInt32 = 10, natID6: UInt32 = 11

    /// The fixture with nat listeners 10 (IPv4 5800) and 11 (IPv6 5800), round robin over three
    /// backends each (slots 0-2), association maps of `maxAssociations` entries.
    static func natFixture(maxAssociations: UInt32 = 1024) throws -> (Fixture, [Int32]) {
        let fixture = try Fixture()
        for arguments in [
            ["-n", fixture.namespace, "route", "add", "198.18.50.0/24", "dev", "t1"],
            ["-n", fixture.namespace, "neigh", "add", "198.18.50.7", "lladdr", "02:00:00:00:00:0c", "dev", "t1", "nud", "permanent"],
            ["-n", fixture.namespace, "-6", "route", "add", "2001:db8:50::/64", "dev", "t1"],
            ["-n", fixture.namespace, "-6", "neigh", "add", "2001:db8:50::7", "lladdr", "02:00:00:00:00:0c", "dev", "t1", "nud", "permanent"],
        ] {
            let result = try run("/usr/sbin/ip", arguments)
            try #require(result.status == 0, "ip \(arguments.joined(separator: " ")): \(result.output)")
        }
        var maps: [Int32] = []
        for (bind, id, host) in [(vip, natID, "198.18.200.10"), (vip6, natID6, "[2001:db8:200::10]")] {
            let backends = (1...3).map { Downstream(name: "b\($0)", address: SocketAddress("\(host):\(6000 + $0)")!) }
            maps.append(try addNAT(fixture, bind: bind, id: id, backends: backends, maxAssociations: maxAssociations))
        }
        return (fixture, maps)
    }

    /// What TCListener does for a nat listener: association map, VIP, live backends, set, entry.
    static func addNAT(_ fixture: Fixture, bind: SocketAddress, id: UInt32, backends: [Downstream], maxAssociations: UInt32) throws -> Int32 {
        let program = fixture.program
        program.resetListener(id: id)
        let fd = try program.createAssociations(id: id, maxEntries: maxAssociations)
        try program.putNAT(id: id, bind: bind)
        var slots: [String: UInt16] = [:]
        for (index, backend) in backends.enumerated() {
            slots[backend.name] = UInt16(index)
            try program.putLive(backend.address, id: id, slot: UInt16(index))
        }
        try program.writeSet(id: id, generation: 0, BackendSet(downstreams: backends, balancing: .roundRobin, slots: slots))
        var entry = fanout_listener()
        entry.id = id
        entry.policy = FANOUT_POLICY_ROUND_ROBIN.rawValue
        entry.reserved = FANOUT_LISTENER_NAT
        try program.putListener(bind, ifindex: UInt32(fixture.ifindex), entry)
        return fd
    }

    /// A UDP datagram from `source` to `destination` (any addresses and ports), checksums computed here.
    static func frame(from source: SocketAddress, to destination: SocketAddress, payload: [UInt8], ttl: UInt8 = 64,
                      options: [UInt8] = [], zeroChecksum: Bool = false) -> [UInt8] {
        let (s, d) = (source.ip.bytes, destination.ip.bytes)
        let length = 8 + payload.count
        var udp: [UInt8] = [UInt8(source.port >> 8), UInt8(source.port & 0xff), UInt8(destination.port >> 8), UInt8(destination.port & 0xff),
                            UInt8(length >> 8), UInt8(length & 0xff), 0, 0] + payload
        if !zeroChecksum {
            let checksum = Packet.udpChecksum(source: s, destination: d, udp: udp)
            udp[6] = UInt8(checksum >> 8)
            udp[7] = UInt8(checksum & 0xff)
        }
        if s.count == 4 {
            return Packet.ethernetHeader(type: 0x0800) + Packet.ipv4Header(source: s, destination: d, length: udp.count, ttl: ttl, options: options) + udp
        }
        var header = Packet.ipv6Header(next: 17, length: udp.count, source: s, destination: d)
        header[7] = ttl
        return Packet.ethernetHeader(type: 0x86dd) + header + udp
    }

    static func sourcePort(_ parsed: Packet.Parsed) -> UInt16 { UInt16(parsed.frame[parsed.l4]) << 8 | UInt16(parsed.frame[parsed.l4 + 1]) }

    static func verdict(_ fixture: Fixture, _ id: UInt32, _ value: fanout_verdict) -> UInt64 {
        fixture.stats(id).verdicts[Int(value.rawValue)]
    }

    /// Takes `gone` out of nat listener 10's set, as TCListener does: the next generation without
    /// it, and the listener entry flipped to it. - Returns: the backends that remain.
    static func removeFromSet(_ fixture: Fixture, _ gone: SocketAddress) throws -> [SocketAddress] {
        let remaining = (1...3).map { SocketAddress("198.18.200.10:\(6000 + $0)")! }.filter { $0 != gone }
        let downstreams = remaining.map { Downstream(name: "p\($0.port)", address: $0) }
        try fixture.program.writeSet(id: natID, generation: 1, BackendSet(downstreams: downstreams, balancing: .roundRobin,
                                                                           slots: Dictionary(uniqueKeysWithValues: downstreams.map { ($0.name, UInt16($0.address.port - 6001)) })))
        var entry = fanout_listener()
        entry.id = natID
        entry.generation = 1
        entry.policy = FANOUT_POLICY_ROUND_ROBIN.rawValue
        entry.reserved = FANOUT_LISTENER_NAT
        try fixture.program.putListener(vip, ifindex: UInt32(fixture.ifindex), entry)
        return remaining
    }

    /// The backend a client datagram went to (redirected), as host:port.
    static func forwarded(_ fixture: Fixture, _ frame: [UInt8]) throws -> SocketAddress {
        let (result, output) = fixture.execute(frame)
        try #require(result == redirect, "client datagram redirected: \(result)")
        let parsed = try #require(Packet.parse(output))
        return SocketAddress(ip: IPAddress(bytes: parsed.destination)!, port: parsed.destinationPort)
    }

    /// Checks a reply's output: from the VIP, to the client, TTL - 1, checksums valid, client MAC.
    static func expectReply(_ output: [UInt8], from vip: SocketAddress, to client: SocketAddress, original: [UInt8], zeroChecksum: Bool = false) throws {
        let parsed = try #require(Packet.parse(output), "reply output parses")
        let before = try #require(Packet.parse(original))
        #expect(parsed.source == vip.ip.bytes, "reply source is the VIP")
        #expect(sourcePort(parsed) == vip.port, "reply source port is the VIP's")
        #expect(parsed.destination == client.ip.bytes && parsed.destinationPort == client.port, "reply to the client")
        #expect(parsed.hopLimit == before.hopLimit - 1, "TTL / hop limit decremented")
        #expect(parsed.payload == before.payload, "payload untouched")
        #expect(Array(output[0..<6]) == clientMAC, "destination MAC: the client's neighbour")
        if vip.ip.family == AF_INET { #expect(Packet.ipv4HeaderValid(parsed), "IPv4 header checksum") }
        if zeroChecksum {
            #expect(parsed.udpChecksum == 0, "a zero UDP checksum stays zero")
        } else {
            #expect(Packet.udpChecksumValid(parsed), "UDP checksum valid for the new source")
        }
    }

    @Test("IPv4: a client keeps its backend under round robin; its backend's reply leaves from VIP:port; another backend's is dropped (wrong_server); a run arriving CHECKSUM_NONE, then one CHECKSUM_COMPLETE (the kernel checks skb->csum)", arguments: TCProgramFixture.checksumStates)
    func associationAndReply(complete: Bool) throws {
        let (fixture, maps) = try Self.natFixture()
        fixture.checksumComplete = complete
        defer { maps.forEach { close($0) } }
        let client = SocketAddress("198.18.50.7:40000")!
        let other = SocketAddress("198.18.50.7:40001")!
        let first = try Self.forwarded(fixture, Self.frame(from: client, to: Self.vip, payload: [1]))
        let second = try Self.forwarded(fixture, Self.frame(from: other, to: Self.vip, payload: [2]))
        #expect(first != second, "round robin gives the next client the next backend")
        for round in 0..<4 {
            #expect(try Self.forwarded(fixture, Self.frame(from: client, to: Self.vip, payload: [3, UInt8(round)])) == first, "same client, same backend")
        }
        var nat = fixture.program.natStats(id: Self.natID)
        #expect(nat.created == 2 && nat.moved == 0 && nat.serverInitiated == 0, "\(nat)")
        #expect(fixture.stats(Self.natID).received == 6)
        #expect(TCProgram.associationEntries(maps[0], limit: 10).total == 2)

        let reply = Self.frame(from: first, to: client, payload: Array(repeating: 0x5a, count: 77))
        let (result, output) = fixture.execute(reply, ifindex: fixture.otherIfindex)
        #expect(result == Self.redirect)
        try Self.expectReply(output, from: Self.vip, to: client, original: reply)
        nat = fixture.program.natStats(id: Self.natID)
        #expect(nat.verdict(FANOUT_VERDICT_REPLIED) == 1 && Self.verdict(fixture, Self.natID, FANOUT_VERDICT_REPLIED) == 1)
        #expect(nat.replyBytes == UInt64(output.count))
        let slot = UInt16(first.port - 6001)
        #expect(fixture.program.backendStats(id: Self.natID, slot: slot).replies == 1, "per-backend replies")
        #expect(fixture.stats(Self.natID).received == 6, "a reply is not a received client datagram")

        // The other client's backend replying to the first client: sbulb's rule, dropped.
        let wrong = Self.frame(from: second, to: client, payload: [9])
        #expect(fixture.execute(wrong, ifindex: fixture.otherIfindex).verdict == Self.shot)
        nat = fixture.program.natStats(id: Self.natID)
        #expect(nat.verdict(FANOUT_VERDICT_WRONG_SERVER) == 1 && Self.verdict(fixture, Self.natID, FANOUT_VERDICT_WRONG_SERVER) == 1)

        // A reply with TTL 1: dropped, counted in the reply direction's share.
        #expect(fixture.execute(Self.frame(from: first, to: client, payload: [1], ttl: 1), ifindex: fixture.otherIfindex).verdict == Self.shot)
        #expect(fixture.program.natStats(id: Self.natID).verdict(FANOUT_VERDICT_TTL_EXPIRED) == 1)

        // A datagram from a host that is not a live backend is not ours.
        let stranger = Self.frame(from: SocketAddress("198.18.200.99:6001")!, to: client, payload: [1])
        let passed = fixture.execute(stranger, ifindex: fixture.otherIfindex)
        #expect(passed.verdict == Self.pass && passed.output == stranger)
    }

    @Test("IPv4 with options and a zero UDP checksum: the reply's headers and checksums stay right; a run arriving CHECKSUM_NONE, then one CHECKSUM_COMPLETE (the kernel checks skb->csum)", arguments: TCProgramFixture.checksumStates)
    func optionsAndZeroChecksum(complete: Bool) throws {
        let (fixture, maps) = try Self.natFixture()
        fixture.checksumComplete = complete
        defer { maps.forEach { close($0) } }
        let client = SocketAddress("198.18.50.7:40100")!
        let backend = try Self.forwarded(fixture, Self.frame(from: client, to: Self.vip, payload: [1], options: [1, 1, 1, 0]))
        let withOptions = Self.frame(from: backend, to: client, payload: Array(repeating: 3, count: 31), options: [1, 1, 1, 0])
        let (result, output) = fixture.execute(withOptions, ifindex: fixture.otherIfindex)
        #expect(result == Self.redirect)
        try Self.expectReply(output, from: Self.vip, to: client, original: withOptions)
        let zero = Self.frame(from: backend, to: client, payload: Array(repeating: 4, count: 20), zeroChecksum: true)
        let (zeroResult, zeroOutput) = fixture.execute(zero, ifindex: fixture.otherIfindex)
        #expect(zeroResult == Self.redirect)
        try Self.expectReply(zeroOutput, from: Self.vip, to: client, original: zero, zeroChecksum: true)
    }

    @Test("A backend starts a conversation: the association is made (server_initiated), the reply leaves from the VIP, the client's next datagram goes to that backend")
    func serverInitiated() throws {
        let (fixture, maps) = try Self.natFixture()
        defer { maps.forEach { close($0) } }
        let client = SocketAddress("198.18.50.7:41000")!
        for backend in ["198.18.200.10:6003", "198.18.200.10:6002"].map({ SocketAddress($0)! }) {
            let client = SocketAddress(ip: client.ip, port: client.port + backend.port)
            let initiating = Self.frame(from: backend, to: client, payload: [7, 7])
            let (result, output) = fixture.execute(initiating, ifindex: fixture.otherIfindex)
            #expect(result == Self.redirect)
            try Self.expectReply(output, from: Self.vip, to: client, original: initiating)
            for _ in 0..<3 {
                #expect(try Self.forwarded(fixture, Self.frame(from: client, to: Self.vip, payload: [8])) == backend, "the client follows the initiating backend")
            }
        }
        let nat = fixture.program.natStats(id: Self.natID)
        #expect(nat.serverInitiated == 2 && nat.created == 0, "\(nat)")
    }

    @Test("A backend's datagram to the load balancer itself (a udp_echo health probe's answer) passes untouched and associates nothing; a wrong-server reply to a client whose backend left the set moves it instead")
    func localDestinationAndGoneBackend() throws {
        let (fixture, maps) = try Self.natFixture()
        defer { maps.forEach { close($0) } }
        // The load balancer's own address on the backends' side: the answer to its probe.
        let probe = Self.frame(from: SocketAddress("198.18.200.10:6001")!, to: SocketAddress("198.18.200.1:45000")!, payload: Array(repeating: 1, count: 16))
        let passed = fixture.execute(probe, ifindex: fixture.otherIfindex)
        #expect(passed.verdict == Self.pass && passed.output == probe, "up the stack, unchanged")
        var nat = fixture.program.natStats(id: Self.natID)
        #expect(nat.serverInitiated == 0 && TCProgram.associationEntries(maps[0], limit: 10).total == 0, "\(nat)")
        #expect(Self.verdict(fixture, Self.natID, FANOUT_VERDICT_NO_ROUTE) == 0, "not counted as a reply without a route")

        // A client of backend A; A leaves the set; backend B's datagram to that client moves it to B.
        let client = SocketAddress("198.18.50.7:42000")!
        let first = try Self.forwarded(fixture, Self.frame(from: client, to: Self.vip, payload: [1]))
        fixture.program.removeLive(first, id: Self.natID)
        let other = SocketAddress(ip: first.ip, port: first.port == 6001 ? 6002 : 6001)
        let reply = Self.frame(from: other, to: client, payload: [2])
        let (result, output) = fixture.execute(reply, ifindex: fixture.otherIfindex)
        #expect(result == Self.redirect, "not wrong_server: the associated backend is gone")
        try Self.expectReply(output, from: Self.vip, to: client, original: reply)
        nat = fixture.program.natStats(id: Self.natID)
        #expect(nat.moved == 1 && nat.verdict(FANOUT_VERDICT_WRONG_SERVER) == 0, "\(nat)")
        // A removal by another listener id leaves the entry alone (a renamed successor owns it).
        fixture.program.removeLive(other, id: Self.natID6)
        #expect(try Self.forwarded(fixture, Self.frame(from: client, to: Self.vip, payload: [3])) == other, "still live, the client stays")
    }

    @Test("Drain: a draining backend gets no client, its replies to its own and to its moved clients leave from the VIP, to another live backend's client are wrong_server; gone, its datagrams are dropped drained (to the LB itself they pass)")
    func drain() throws {
        let (fixture, maps) = try Self.natFixture()
        defer { maps.forEach { close($0) } }
        let stays = SocketAddress("198.18.50.7:42100")!
        let drainingBackend = try Self.forwarded(fixture, Self.frame(from: stays, to: Self.vip, payload: [1]))
        let slot = UInt16(drainingBackend.port - 6001)
        // The draining backend leaves the set: its entry stays, marked draining.
        _ = try Self.removeFromSet(fixture, drainingBackend)
        #expect(try fixture.program.setLiveState(drainingBackend, id: Self.natID, slot: slot, state: FANOUT_LIVE_DRAINING))
        #expect(try fixture.program.setLiveState(drainingBackend, id: Self.natID6, slot: slot, state: FANOUT_LIVE_GONE) == false, "another listener's id writes nothing")

        // A reply in flight to the client that has not sent since: from the VIP.
        let inFlight = Self.frame(from: drainingBackend, to: stays, payload: [2])
        var (result, output) = fixture.execute(inFlight, ifindex: fixture.otherIfindex)
        #expect(result == Self.redirect)
        try Self.expectReply(output, from: Self.vip, to: stays, original: inFlight)
        // The client's next datagram moves it (never to the draining backend); the draining
        // backend's late reply to it still leaves from the VIP, and associates nothing.
        let moved = try Self.forwarded(fixture, Self.frame(from: stays, to: Self.vip, payload: [3]))
        #expect(moved != drainingBackend)
        let late = Self.frame(from: drainingBackend, to: stays, payload: [4])
        (result, output) = fixture.execute(late, ifindex: fixture.otherIfindex)
        #expect(result == Self.redirect, "a reply to the client that moved away while it drained")
        try Self.expectReply(output, from: Self.vip, to: stays, original: late)
        #expect(try Self.forwarded(fixture, Self.frame(from: stays, to: Self.vip, payload: [5])) == moved, "the client stays moved")
        // New clients never get the draining backend.
        for port in UInt16(43000)..<43006 {
            #expect(try Self.forwarded(fixture, Self.frame(from: SocketAddress(ip: stays.ip, port: port), to: Self.vip, payload: [6])) != drainingBackend)
        }
        // To a client of another live backend that never had it: wrong_server.
        let wrongBefore = Self.verdict(fixture, Self.natID, FANOUT_VERDICT_WRONG_SERVER)
        let wrong = Self.frame(from: drainingBackend, to: SocketAddress(ip: stays.ip, port: 43000), payload: [7])
        #expect(fixture.execute(wrong, ifindex: fixture.otherIfindex).verdict == Self.shot)
        #expect(Self.verdict(fixture, Self.natID, FANOUT_VERDICT_WRONG_SERVER) == wrongBefore + 1)

        // The drain ends: gone. Its datagram toward the client is dropped and counted drained.
        #expect(try fixture.program.setLiveState(drainingBackend, id: Self.natID, slot: slot, state: FANOUT_LIVE_GONE))
        let after = Self.frame(from: drainingBackend, to: stays, payload: [8])
        #expect(fixture.execute(after, ifindex: fixture.otherIfindex).verdict == Self.shot)
        #expect(fixture.program.natStats(id: Self.natID).verdict(FANOUT_VERDICT_DRAINED) == 1)
        // Its datagram to the load balancer itself (a probe's answer) passes untouched.
        let probe = Self.frame(from: drainingBackend, to: SocketAddress("198.18.200.1:45000")!, payload: [9])
        let passed = fixture.execute(probe, ifindex: fixture.otherIfindex)
        #expect(passed.verdict == Self.pass && passed.output == probe)
        #expect(fixture.program.natStats(id: Self.natID).verdict(FANOUT_VERDICT_DRAINED) == 1)
    }

    @Test("A backend no longer live: its clients move on their next datagram (moved), others stay; re-added it gets new clients only")
    func moved() throws {
        let (fixture, maps) = try Self.natFixture()
        defer { maps.forEach { close($0) } }
        let clients = (0..<3).map { SocketAddress(ip: IPAddress("198.18.50.7")!, port: 42000 + UInt16($0)) }
        var assigned: [SocketAddress] = []
        for client in clients { assigned.append(try Self.forwarded(fixture, Self.frame(from: client, to: Self.vip, payload: [1]))) }
        #expect(Set(assigned).count == 3)
        // Remove backend of client 0, as TCListener does: the new set, then out of the live map.
        let gone = assigned[0]
        let remaining = try Self.removeFromSet(fixture, gone)
        fixture.program.removeLive(gone, id: Self.natID)
        let movedTo = try Self.forwarded(fixture, Self.frame(from: clients[0], to: Self.vip, payload: [2]))
        #expect(movedTo != gone && remaining.contains(movedTo))
        #expect(try Self.forwarded(fixture, Self.frame(from: clients[0], to: Self.vip, payload: [3])) == movedTo, "stays moved")
        for index in 1...2 {
            #expect(try Self.forwarded(fixture, Self.frame(from: clients[index], to: Self.vip, payload: [4])) == assigned[index], "other clients stay")
        }
        #expect(fixture.program.natStats(id: Self.natID).moved == 1)
        // The gone backend's reply to its former client is not a live backend's: not ours.
        #expect(fixture.execute(Self.frame(from: gone, to: clients[0], payload: [5]), ifindex: fixture.otherIfindex).verdict == Self.pass)
        // Re-added: the moved client stays where it went.
        try fixture.program.putLive(gone, id: Self.natID, slot: UInt16(gone.port - 6001))
        #expect(try Self.forwarded(fixture, Self.frame(from: clients[0], to: Self.vip, payload: [6])) == movedTo)
        #expect(fixture.program.natStats(id: Self.natID).moved == 1)
    }

    @Test("IPv6: association, reply from the VIP with a valid UDP checksum, wrong server dropped; a run arriving CHECKSUM_NONE, then one CHECKSUM_COMPLETE (the kernel checks skb->csum)", arguments: TCProgramFixture.checksumStates)
    func ipv6(complete: Bool) throws {
        let (fixture, maps) = try Self.natFixture()
        fixture.checksumComplete = complete
        defer { maps.forEach { close($0) } }
        let client = SocketAddress("[2001:db8:50::7]:43000")!
        let backend = try Self.forwarded(fixture, Self.frame(from: client, to: Self.vip6, payload: [1, 2, 3]))
        #expect(try Self.forwarded(fixture, Self.frame(from: SocketAddress("[2001:db8:50::7]:43001")!, to: Self.vip6, payload: [1])) != backend)
        #expect(try Self.forwarded(fixture, Self.frame(from: client, to: Self.vip6, payload: [4])) == backend)
        let reply = Self.frame(from: backend, to: client, payload: Array(repeating: 0x66, count: 45))
        let (result, output) = fixture.execute(reply, ifindex: fixture.otherIfindex)
        #expect(result == Self.redirect)
        try Self.expectReply(output, from: Self.vip6, to: client, original: reply)
        let other = SocketAddress(ip: backend.ip, port: backend.port == 6001 ? 6002 : 6001)
        #expect(fixture.execute(Self.frame(from: other, to: client, payload: [1]), ifindex: fixture.otherIfindex).verdict == Self.shot)
        let nat = fixture.program.natStats(id: Self.natID6)
        #expect(nat.verdict(FANOUT_VERDICT_REPLIED) == 1 && nat.verdict(FANOUT_VERDICT_WRONG_SERVER) == 1 && nat.created == 2)
    }

    @Test("A reply in fragments: later fragments get the same source rewrite; the reassembled UDP checksum is valid")
    func replyFragments() throws {
        let (fixture, maps) = try Self.natFixture()
        defer { maps.forEach { close($0) } }
        let client = SocketAddress("198.18.50.7:44000")!
        let backend = try Self.forwarded(fixture, Self.frame(from: client, to: Self.vip, payload: [1]))
        let payload = (0..<2400).map { UInt8(truncatingIfNeeded: $0 * 3) }
        let (s, d) = (backend.ip.bytes, client.ip.bytes)
        var whole: [UInt8] = [UInt8(backend.port >> 8), UInt8(backend.port & 0xff), UInt8(client.port >> 8), UInt8(client.port & 0xff),
                              UInt8((payload.count + 8) >> 8), UInt8((payload.count + 8) & 0xff), 0, 0] + payload
        let checksum = Packet.udpChecksum(source: s, destination: d, udp: whole)
        (whole[6], whole[7]) = (UInt8(checksum >> 8), UInt8(checksum & 0xff))
        let pieces = stride(from: 0, to: whole.count, by: 1000).map { offset in
            let piece = Array(whole[offset..<min(offset + 1000, whole.count)])
            let more: UInt16 = offset + 1000 < whole.count ? 0x2000 : 0
            return Packet.ethernetHeader(type: 0x0800)
                + Packet.ipv4Header(source: s, destination: d, length: piece.count, id: 0x7777, fragment: more | UInt16(offset / 8)) + piece
        }
        var outputs: [[UInt8]] = []
        for (index, piece) in pieces.enumerated() {
            let (result, output) = fixture.execute(piece, ifindex: fixture.otherIfindex)
            #expect(result == Self.redirect, "fragment \(index)")
            let parsed = try #require(Packet.parse(output))
            #expect(parsed.source == Self.vip.ip.bytes, "fragment \(index): source rewritten")
            #expect(parsed.destination == d, "fragment \(index): destination kept")
            #expect(Packet.ipv4HeaderValid(parsed), "fragment \(index): IPv4 header checksum")
            outputs.append(output)
        }
        let first = try #require(Packet.parse(outputs[0]))
        var reassembled = Array(outputs[0][first.l4...])
        for output in outputs.dropFirst() { reassembled += output[(Packet.ethernet + 20)...] }
        #expect(Packet.udpChecksumValid(source: Self.vip.ip.bytes, destination: d, udp: reassembled), "reassembled UDP checksum")
        #expect(fixture.program.natStats(id: Self.natID).verdict(FANOUT_VERDICT_REPLIED) == UInt64(pieces.count))
    }

    @Test("LRU: 200 clients in a 64-entry association map: at most 64 present, the rest evicted (created - present > 0)")
    func lruEviction() throws {
        let (fixture, maps) = try Self.natFixture(maxAssociations: 64)
        defer { maps.forEach { close($0) } }
        for index in 0..<200 {
            _ = try Self.forwarded(fixture, Self.frame(from: SocketAddress(ip: IPAddress("198.18.50.7")!, port: 45000 + UInt16(index)), to: Self.vip, payload: [1]))
        }
        let present = TCProgram.associationEntries(maps[0], limit: 1000)
        let created = fixture.program.natStats(id: Self.natID).created
        #expect(created == 200)
        #expect(present.total <= 64 && present.total > 0, "present \(present.total)")
        #expect(present.entries.count == present.total)
        #expect(Int(created) - present.total > 0, "evicted")
        #expect(fixture.program.countAssociations(maps[0], maximum: .max) == present.total, "the kernel's count, evictions included")
        let iterated = try AssociationCounter().counts()[try AssociationCounter.mapID(maps[0])]
        #expect(iterated == present.total, "the iterator's own count")
        #expect(present.entries.allSatisfy { $0.client.ip == IPAddress("198.18.50.7")! && (6001...6003).contains($0.backend.port) })
    }

    @Test("Counting and listing associations in batches (BPF_MAP_LOOKUP_BATCH): the same clients, backends and total as a walk with get_next_key, across several batches; limit and maximum honoured; the kernel's own count (map_count iterator) agrees")
    func batchedCount() throws {
        let entries = TCProgram.associationBatch * 2 + 123
        let fd = bpf_map_create(BPF_MAP_TYPE_LRU_HASH, "fanout_assoc_t", UInt32(MemoryLayout<fanout_association_key>.size),
                                UInt32(MemoryLayout<fanout_association>.size), UInt32(entries * 2), nil)
        try #require(fd >= 0, "bpf_map_create: errno \(errno)")
        defer { close(fd) }
        for index in 0..<entries {
            var key = fanout_association_key()
            var value = fanout_association()
            // Every third client IPv6; backends 6001...6003.
            if index % 3 == 0 {
                key.family = UInt8(AF_INET6)
                key.addr = (UInt32(0x20010db8).bigEndian, 0, 0, UInt32(index).bigEndian)
                value.addr = (UInt32(0x20010db8).bigEndian, 0, 0, UInt32(0x200).bigEndian)
            } else {
                key.family = UInt8(AF_INET)
                key.addr.0 = (UInt32(0xc6120000) + UInt32(index)).bigEndian
                value.addr.0 = UInt32(0xc612c80a).bigEndian
            }
            key.port = UInt16(40000 + index % 1000).bigEndian
            value.port = UInt16(6001 + index % 3).bigEndian
            try #require(bpf_map_update_elem(fd, &key, &value, UInt64(BPF_NOEXIST)) == 0, "entry \(index): errno \(errno)")
        }
        let refusals = TCProgram.batchRefusals.load(ordering: .relaxed)
        let batched = TCProgram.associationEntries(fd, limit: .max)
        #expect(TCProgram.batchRefusals.load(ordering: .relaxed) == refusals, "the kernel took the batch lookups (no walk)")
        let walked = TCProgram.walkAssociations(fd, limit: .max, maximum: .max)
        #expect(batched.total == entries && walked.total == entries)
        let pairs = { (list: [(client: SocketAddress, backend: SocketAddress)]) in Set(list.map { "\($0.client)>\($0.backend)" }) }
        #expect(batched.entries.count == entries && pairs(batched.entries) == pairs(walked.entries))
        #expect(batched.entries.allSatisfy { (6001...6003).contains($0.backend.port) })
        let listed = TCProgram.associationEntries(fd, limit: 10)
        #expect(listed.entries.count == 10 && listed.total == entries)
        #expect(TCProgram.associationEntries(fd, limit: 0, maximum: 5000).total == 5000)
        // The kernel's own count (the map_count iterator needs Linux 6.6+ with BTF, as on this
        // machine kind): the iterator itself says so for this map, and leaves out a map without
        // the association prefix.
        let counter = try AssociationCounter()
        let other = bpf_map_create(BPF_MAP_TYPE_HASH, "fanout_other", 4, 4, 16, nil)
        try #require(other >= 0)
        defer { close(other) }
        var key: UInt32 = 1, value: UInt32 = 1
        try #require(bpf_map_update_elem(other, &key, &value, UInt64(BPF_ANY)) == 0)
        let counts = try counter.counts()
        let (mapID, otherID) = (try AssociationCounter.mapID(fd), try AssociationCounter.mapID(other))
        #expect(counts[mapID] == entries, "the iterator counted \(String(describing: counts[mapID]))")
        #expect(counts[otherID] == nil, "a map without the prefix is not counted")
        let program = try TCProgram()
        #expect(program.countAssociations(fd, maximum: .max) == entries)
        #expect(program.countsFromKernel, "the map_count iterator loaded")
        #expect(program.countAssociations(fd, maximum: 5000) == 5000)
        // Closed: no counter is made again (a scrape racing the stop falls back, then finds nothing).
        program.closeDescriptors()
        _ = program.countAssociations(fd, maximum: .max)
        #expect(!program.countsFromKernel)
        // An empty map: nothing, no error.
        let empty = bpf_map_create(BPF_MAP_TYPE_LRU_HASH, "fanout_assoc_e", UInt32(MemoryLayout<fanout_association_key>.size),
                                   UInt32(MemoryLayout<fanout_association>.size), 64, nil)
        try #require(empty >= 0)
        defer { close(empty) }
        #expect(TCProgram.associationEntries(empty, limit: 10).total == 0)
    }
}
