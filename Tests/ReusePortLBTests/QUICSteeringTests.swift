// SPDX-License-Identifier: Apache-2.0
import Foundation
import SystemCalls
import Testing
import TestSupport
@testable import ReusePortLB
// SOCK_DGRAM: see docs/development.md (test files that use Glibc's socket constants).
import CSystemShim

#if canImport(Glibc)
import Glibc
#endif

/// QUIC-LB groups: the sk_reuseport program sends a datagram whose QUIC destination connection ID
/// carries a member's registered server ID to that member, from any source; the rest by policy.
@Suite("QUIC-LB steering on loopback", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct QUICSteeringTests {
    static let configuration = try! QUICLBConfiguration(configID: 2, serverIDLength: 2, nonceLength: 6)

    /// `count` members of a QUIC-LB group, member i registering server ID 0x0b, i+1.
    func group(_ count: Int, policy: BalancePolicy = .sourceIP) throws -> (SocketAddress, [ReusePortMember]) {
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let options = GroupOptions(policy: policy, capacity: count, steering: .ebpf, receiveBufferSize: 4 << 20, quic: Self.configuration)
        let members = try (0..<count).map { try ReusePortMember(joining: address, slot: .index($0), options: options) }
        for (index, member) in members.enumerated() { try member.registerServerID([0x0b, UInt8(index + 1)]) }
        return (address, members)
    }

    static func connectionID(_ member: Int, nonce: UInt8 = 7) throws -> [UInt8] {
        try QUICLBCodec(configuration).encode(serverID: [0x0b, UInt8(member + 1)], nonce: [1, 2, 3, 4, 5, nonce])
    }

    /// Sends `payload` from `source` (a new socket each time: a new port) to `destination`.
    static func send(_ payload: [UInt8], from source: String, to destination: SocketAddress) throws {
        let fd = try Syscall.socket(destination.ip.family, Int32(SOCK_DGRAM.rawValue))
        defer { Syscall.close(fd) }
        try Syscall.bind(fd, SocketAddress(ip: IPAddress(source)!, port: 0), call: "bind \(source)")
        let sent = try Syscall.sendto(fd, payload, payload.count, 0, destination)
        try #require(sent == .processed(payload.count), "sendto: \(sent)")
    }

    static func short(_ id: [UInt8]) -> [UInt8] { [0x41] + id + [UInt8](repeating: 0x5a, count: 40) }
    static func long(_ type: UInt8, _ id: [UInt8]) -> [UInt8] { [0xc0 | type << 4, 0, 0, 0, 1, UInt8(id.count)] + id + [0, 0x44, 0x10] + [UInt8](repeating: 0, count: 40) }

    @Test("Short and Handshake packets go to the member whose server ID they carry, from 40 sources; Initials by the source hash")
    func routesByServerID() throws {
        let (address, members) = try group(3)
        defer { for member in members { member.leave() } }
        let sources = loopbackSources(40)
        for (index, source) in sources.enumerated() {
            let target = index % 3
            try Self.send(Self.short(try Self.connectionID(target)), from: source, to: address)
            try Self.send(Self.long(2, try Self.connectionID(target)), from: source, to: address)
        }
        let received = drain(members)
        for (index, source) in sources.enumerated() {
            #expect(received[index % 3][source] == 2, "\(source): \(received.map { $0[source] ?? 0 })")
        }
        // A client's first Initial (a made-up ID): where its source hashes, the owner(of:) member.
        for source in sources { try Self.send(Self.long(0, [0xe1, 9, 8, 7, 6, 5, 4, 3, 2]), from: source, to: address) }
        let initials = drain(members)
        for source in sources {
            let owner = try #require(try members[0].owner(of: IPAddress(source)!))
            #expect(initials[owner][source] == 1, "\(source)")
        }
        let counters = try members[0].counters()
        #expect(counters.quicRouted == 80 && counters.quicFallback == 40 && counters.quicUnknownServerID == 0 && counters.quicUndecodable == 0,
                "\(counters)")
        #expect(counters.selected == 120 && counters.fallback == 0)
    }

    @Test("Unknown server IDs, other config IDs and short datagrams go by the policy, counted; a withdrawn ID and a dead member's too")
    func fallsBack() throws {
        let (address, members) = try group(2)
        defer { for member in members { member.leave() } }
        let stranger = try QUICLBCodec(Self.configuration).encode(serverID: [0x0c, 1], nonce: [1, 2, 3, 4, 5, 6])
        try Self.send(Self.short(stranger), from: "127.0.3.2", to: address)
        try Self.send(Self.short([0x03] + stranger.dropFirst()), from: "127.0.3.3", to: address)
        try Self.send([0x41, 0x43], from: "127.0.3.4", to: address)
        try Self.send([0x80, 0, 0, 0, 0, 9] + stranger, from: "127.0.3.5", to: address)
        var received = drain(members)
        #expect(received.flatMap(\.values).reduce(0, +) == 4, "every one delivered: \(received)")
        var counters = try members[0].counters()
        #expect(counters.quicUnknownServerID == 1 && counters.quicUndecodable == 3 && counters.quicRouted == 0, "\(counters)")
        // Withdrawn: member 1's ID now goes by the policy.
        #expect(try members[1].withdrawServerID([0x0b, 2]))
        #expect(try !members[0].withdrawServerID([0x0b, 2]))
        try Self.send(Self.short(try Self.connectionID(1)), from: "127.0.3.6", to: address)
        received = drain(members)
        let owner = try #require(try members[0].owner(of: IPAddress("127.0.3.6")!))
        #expect(received[owner]["127.0.3.6"] == 1)
        counters = try members[0].counters()
        #expect(counters.quicUnknownServerID == 2, "\(counters)")
        // A member that left: its ID is still registered for its slot, which is empty, so the
        // policy takes the datagram to the live member (counted unknown: no live member holds it).
        try members[1].registerServerID([0x0b, 2])
        members[1].leave()
        try Self.send(Self.short(try Self.connectionID(1)), from: "127.0.3.7", to: address)
        received = drain([members[0]])
        #expect(received[0]["127.0.3.7"] == 1)
        counters = try members[0].counters()
        #expect(counters.quicRouted == 0 && counters.quicUnknownServerID == 3, "\(counters)")
    }

    @Test("Registrations belong to the socket that made them: a takeover inherits them, a member joining the empty slot does not, and the old owner can register its ID again elsewhere")
    func registrationLifecycle() throws {
        let (address, members) = try group(3)
        var all = members
        defer { for member in all { member.leave() } }
        let options = members[0].options
        // A takeover of slot 0 keeps 0b01: its datagrams reach the new socket.
        let successor = try ReusePortMember(joining: address, slot: .takeover(0), options: options)
        all.append(successor)
        #expect(members[0].isReplaced)
        // The replaced member cannot withdraw what its successor serves now.
        #expect(try !members[0].withdrawServerID([0x0b, 1]))
        try Self.send(Self.short(try Self.connectionID(0)), from: "127.0.4.2", to: address)
        #expect(drain([successor])[0]["127.0.4.2"] == 1)
        members[0].leave()
        // Slot 1's member leaves; a newcomer takes the empty slot (not a takeover): 0b02 is not
        // its, and is gone, so the old server can register it again in another slot.
        members[1].leave()
        let newcomer = try ReusePortMember(joining: address, slot: .index(1), options: options)
        all.append(newcomer)
        try Self.send(Self.short(try Self.connectionID(1)), from: "127.0.4.3", to: address)
        let counters = try newcomer.counters()
        #expect(counters.quicUnknownServerID == 1, "\(counters)")
        members[2].leave()
        let returning = try ReusePortMember(joining: address, slot: .index(2), options: options)
        all.append(returning)
        try returning.registerServerID([0x0b, 2])
        try Self.send(Self.short(try Self.connectionID(1)), from: "127.0.4.4", to: address)
        #expect(drain([successor, newcomer, returning])[2]["127.0.4.4"] == 1)
    }

    @Test("A server ID held by a live member, of another length, or in a group without QUIC-LB is refused; so are encrypted configurations and classic BPF")
    func refusals() throws {
        let (address, members) = try group(2)
        defer { for member in members { member.leave() } }
        #expect(throws: ReusePortError.connectionIDRouting("server ID 0b01 is registered by slot 0, whose member is live: each server ID names one member", errno: EEXIST)) {
            try members[1].registerServerID([0x0b, 1])
        }
        #expect(throws: ReusePortError.self) { try members[0].registerServerID([0x0b]) }
        // A member asking for another QUIC-LB layout is refused like any other setting.
        let other = GroupOptions(policy: .sourceIP, capacity: 2, steering: .ebpf,
                                 quic: try QUICLBConfiguration(configID: 2, serverIDLength: 3, nonceLength: 6))
        #expect(throws: ReusePortError.self) { try ReusePortMember(joining: address, slot: .lowestFree, options: other) }
        let keyed = GroupOptions(capacity: 1, steering: .ebpf,
                                 quic: try QUICLBConfiguration(configID: 0, serverIDLength: 2, nonceLength: 6, key: [UInt8](repeating: 1, count: 16)))
        do {
            _ = try ReusePortMember(joining: SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort()), options: keyed)
            Issue.record("an encrypted configuration was accepted")
        } catch {
            #expect(error.description.contains("plaintext server IDs only"), "\(error)")
        }
        let classic = GroupOptions(capacity: 1, steering: .classicBPF, quic: Self.configuration)
        #expect(throws: ReusePortError.self) { try ReusePortMember(joining: SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort()), options: classic) }
        // Round robin would spread a client's first flight; process-private groups check the same.
        let spread = GroupOptions(policy: .roundRobin, capacity: 1, steering: .ebpf, quic: Self.configuration)
        #expect(throws: ReusePortError.self) { try ReusePortMember(joining: SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort()), options: spread) }
        #expect(throws: ReusePortError.self) { try ReusePortGroup(privateTo: SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort()), options: keyed) }
        let plain = try ReusePortMember(joining: SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort()), options: GroupOptions(capacity: 1, steering: .ebpf))
        defer { plain.leave() }
        #expect(throws: ReusePortError.self) { try plain.registerServerID([0x0b, 1]) }
    }
}
