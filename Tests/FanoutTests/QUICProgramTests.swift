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

/// quic_lb in the tc and xdp programs (bpf/include/fanout_quic.h) under BPF_PROG_TEST_RUN: the
/// draft's test vectors (plaintext, single-pass and four-pass AES-128, the kernel's crypto
/// kfuncs decrypting), each connection ID routed to the backend whose server ID it carries on a
/// round-robin listener (so three datagrams to one backend are the routing's, not the rotation's),
/// then a table of outcomes, each counted. The tc fixture's namespace (TCProgramFixture: backends
/// at 198.18.200.10, ports 6001-6003); the xdp program runs on its maps.
@Suite("quic_lb in the tc and xdp programs (BPF_PROG_TEST_RUN)", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct QUICProgramTests {
    static let id: UInt32 = 12
    static let bind = SocketAddress("198.18.100.1:5530")!
    static let client = SocketAddress("198.18.50.7:40000")!

    /// A draft vector: the configuration, the server ID and nonce, and the connection ID the
    /// draft gives for them (its octets after the first; the first is config ID << 5 | length).
    struct Vector: CustomStringConvertible, Sendable {
        var name: String
        var configID: UInt8
        var serverID: String
        var nonce: String
        var key: String?
        /// nil: none in the draft for this layout; QUICLBCodec's.
        var ciphertext: String?
        var description: String { name }
    }

    static let key = "8f95f09245765f80256934e50c66207f"
    static let vectors = [
        Vector(name: "plaintext", configID: 0, serverID: "c4605e", nonce: "4504cc4f", key: nil, ciphertext: "c4605e4504cc4f"),
        Vector(name: "four-pass, odd length", configID: 0, serverID: "ed793a", nonce: "ee080dbf", key: key, ciphertext: "20b1d07b359d3c"),
        Vector(name: "four-pass, server ID past the left half", configID: 1, serverID: "ed793a51d49b8f5fab65", nonce: "ee080dbf48", key: key,
               ciphertext: "cc381bc74cb4fbad2823a3d1f8fed2"),
        Vector(name: "single-pass", configID: 2, serverID: "ed793a51d49b8f5f", nonce: "ee080dbf48c0d1e5", key: key,
               ciphertext: "4dd2d05a7b0de9b2b9907afb5ecf8cc3"),
        Vector(name: "four-pass, even length", configID: 3, serverID: "ed793a51d49b8f5fab", nonce: "ee080dbf48c0d1e55d", key: key,
               ciphertext: "5779c9cc86beb3a3a4a3ca96fce4bfe0cdbc"),
        Vector(name: "encryption example", configID: 0, serverID: "31441a", nonce: "9c69c275", key: "fdf726a9893ec05c0632d3956680baf0",
               ciphertext: "67947d29be054a"),
        // Not the draft's: an even length whose server ID passes the left half (all four passes
        // and the right half), its connection ID from QUICLBCodec (checked against the draft).
        Vector(name: "four-pass, even length, server ID past the left half", configID: 4, serverID: "ed793a51d49b8f", nonce: "ee080dbf48",
               key: key, ciphertext: nil),
    ]

    enum Hook: String, CustomStringConvertible, CaseIterable, Sendable {
        case tc, xdp
        var description: String { rawValue }
    }

    /// The tc fixture, and the xdp program on its maps serving the quic_lb listener.
    final class Rig {
        let forward: XDPForwardProgramTests.Rig
        var program: TCProgram { forward.fixture.program }

        init(crypto: Bool = TCKernelFeatures.quicCryptoProblem == nil) throws {
            forward = try XDPForwardProgramTests.Rig(crypto: crypto)
            try forward.xdp.serve(id: QUICProgramTests.id, true)
        }

        /// Listener 5530 (round robin) over backends 6001-6003 with these server IDs, QUIC-LB `configuration`.
        func configure(_ configuration: QUICLBConfiguration, serverIDs: [[UInt8]]) throws {
            let id = QUICProgramTests.id
            program.resetListener(id: id)
            let downstreams = serverIDs.indices.map { Downstream(name: "q\($0 + 1)", address: SocketAddress("198.18.200.10:\(6001 + $0)")!) }
            let slots = Dictionary(uniqueKeysWithValues: downstreams.enumerated().map { ($1.name, UInt16($0)) })
            try program.writeSet(id: id, generation: 0, BackendSet(downstreams: downstreams, balancing: .roundRobin, slots: slots))
            try program.writeQUICConfigs(setKey: id * 2, [configuration])
            for (index, serverID) in serverIDs.enumerated() { try program.putQUICID(setKey: id * 2, serverID, index: UInt32(index)) }
            if let key = configuration.key {
                try program.setQUICKey(slot: id * 2 * UInt32(FANOUT_QUIC_CONFIGS) + UInt32(configuration.configID), key)
            }
            var entry = fanout_listener()
            entry.id = id
            entry.policy = FANOUT_POLICY_ROUND_ROBIN.rawValue
            entry.reserved = FANOUT_LISTENER_QUIC
            try program.putListener(QUICProgramTests.bind, ifindex: UInt32(forward.fixture.ifindex), entry)
        }

        /// The destination port `payload` left for through `hook`, nil when it was not sent on.
        func port(_ hook: Hook, _ payload: [UInt8]) -> UInt16? {
            let frame = TCNATProgramTests.frame(from: QUICProgramTests.client, to: QUICProgramTests.bind, payload: payload)
            let (action, output): (UInt32, [UInt8])
            switch hook {
            case .tc:
                (action, output) = forward.fixture.execute(frame)
                guard action == TCProgramFixture.redirect else { return nil }
            case .xdp:
                (action, output) = forward.run(frame)
                guard action == XDPForwardProgramTests.redirect || action == XDPForwardProgramTests.transmit else { return nil }
            }
            return Packet.parse(output)?.destinationPort
        }

        /// routed, fallback, unknown server ID, undecodable.
        var outcomes: [UInt64] { program.quicCounts(id: QUICProgramTests.id) }
    }

    static func shortHeader(_ id: [UInt8]) -> [UInt8] { [0x41] + id + [UInt8](repeating: 0x5a, count: 24) }

    /// A long header of `version` and `type` with destination ID `id` (and an empty source ID).
    static func longHeader(type: UInt8, version: UInt32 = 1, _ id: [UInt8]) -> [UInt8] {
        [0xc0 | type << 4, UInt8(version >> 24), UInt8(version >> 16 & 0xff), UInt8(version >> 8 & 0xff), UInt8(version & 0xff), UInt8(id.count)]
            + id + [0] + [UInt8](repeating: 0x33, count: 40)
    }

    @Test("the draft's vectors: each connection ID goes to the backend with its server ID, three times over on a round-robin listener; counted routed",
          arguments: Hook.allCases, vectors)
    func draftVectors(hook: Hook, vector: Vector) throws {
        let rig = try Rig()
        let configuration = try QUICLBConfiguration(configID: vector.configID, serverIDLength: vector.serverID.count / 2,
                                                    nonceLength: vector.nonce.count / 2, key: vector.key.map(octets))
        // The vector's server ID is the second backend's; the others differ in their last octet.
        let serverID = octets(vector.serverID)
        func other(_ last: UInt8) -> [UInt8] { Array(serverID.dropLast()) + [serverID.last! ^ last] }
        try rig.configure(configuration, serverIDs: [other(1), serverID, other(2)])
        let encoded = try QUICLBCodec(configuration).encode(serverID: serverID, nonce: octets(vector.nonce))
        let id = vector.ciphertext.map { [vector.configID << 5 | UInt8(configuration.plaintextLength)] + octets($0) } ?? encoded
        // The encoder agrees with the draft (QUICLBTests checks it in full).
        #expect(encoded == id)
        for round in 1...3 {
            #expect(rig.port(hook, Self.shortHeader(id)) == 6002, "\(hook) \(vector) datagram \(round)")
        }
        // A Handshake packet (server-chosen ID, long header) of the same connection too.
        #expect(rig.port(hook, Self.longHeader(type: 2, id)) == 6002, "\(hook) \(vector) handshake")
        #expect(rig.outcomes == [4, 0, 0, 0], "\(hook) \(vector): \(rig.outcomes)")
    }

    @Test("outcomes: fallback (Initial, 0-RTT, other versions), unknown server ID, undecodable; each by the rotation, counted once", arguments: Hook.allCases)
    func outcomes(hook: Hook) throws {
        let rig = try Rig()
        let configuration = try QUICLBConfiguration(configID: 1, serverIDLength: 2, nonceLength: 6, key: octets(Self.key))
        let codec = QUICLBCodec(configuration)
        try rig.configure(configuration, serverIDs: [[0x0a, 0x01], [0x0a, 0x02], [0x0a, 0x03]])
        let third = try codec.encode(serverID: [0x0a, 0x03], nonce: [1, 2, 3, 4, 5, 6])
        let stranger = try codec.encode(serverID: [0x0b, 0x07], nonce: [1, 2, 3, 4, 5, 6])
        let unconfigured = [5 << 5 | 8] + [UInt8](repeating: 0x77, count: 8)
        let clientChosen = [UInt8](repeating: 0xe1, count: 8)  // config ID 7: never routable
        // Routed whatever the packet type when the ID names a backend (an Initial of a client
        // that reuses a server's ID, say).
        #expect(rig.port(hook, Self.longHeader(type: 0, third)) == 6003)
        #expect(rig.port(hook, Self.shortHeader(third)) == 6003)
        var expected: [UInt64] = [2, 0, 0, 0]
        #expect(rig.outcomes == expected, "\(hook): \(rig.outcomes)")
        // Each of these is sent on by the rotation and counted once under its outcome.
        let cases: [(String, [UInt8], Int)] = [
            ("v1 Initial, client-chosen ID", Self.longHeader(type: 0, clientChosen), 1),
            ("v1 0-RTT, client-chosen ID", Self.longHeader(type: 1, clientChosen), 1),
            ("v2 Initial (type 1)", Self.longHeader(type: 1, version: 0x6b33_43cf, clientChosen), 1),
            ("another version's long header", Self.longHeader(type: 0, version: 0xff00_001d, unconfigured), 1),
            ("Initial naming a server ID no backend has", Self.longHeader(type: 0, stranger), 1),
            ("short header, unknown server ID", Self.shortHeader(stranger), 2),
            ("Handshake, unknown server ID", Self.longHeader(type: 2, stranger), 2),
            ("short header, unconfigured config ID", Self.shortHeader(unconfigured), 3),
            ("Handshake, client-chosen (unconfigured) ID", Self.longHeader(type: 2, clientChosen), 3),
            ("version negotiation", Self.longHeader(type: 0, version: 0, third), 3),
            ("one octet", [0x41], 3),
            ("short header cut inside its ID", [0x41] + Array(third.prefix(5)), 3),
            ("long header without a destination ID", Self.longHeader(type: 2, []), 3),
        ]
        for (name, payload, outcome) in cases {
            let port = rig.port(hook, payload)
            #expect(port.map { (6001...6003).contains($0) } == true, "\(hook) \(name): sent on by the rotation (\(String(describing: port)))")
            expected[outcome] += 1
            #expect(rig.outcomes == expected, "\(hook) \(name): \(rig.outcomes), expected \(expected)")
        }
    }

    @Test("nat with quic_lb: a migrated client is associated with its ID's backend (moved), and a backend's datagram to a client associated with another leaves (not wrong_server)")
    func natAssociations() throws {
        let (fixture, maps) = try TCNATProgramTests.natFixture()
        defer { maps.forEach { close($0) } }
        let program = fixture.program
        let id = TCNATProgramTests.natID
        let configuration = try QUICLBConfiguration(configID: 1, serverIDLength: 2, nonceLength: 6)
        let serverIDs: [[UInt8]] = [[0x0a, 0x01], [0x0a, 0x02], [0x0a, 0x03]]
        try program.writeQUICConfigs(setKey: id * 2, [configuration])
        for (index, serverID) in serverIDs.enumerated() { try program.putQUICID(setKey: id * 2, serverID, index: UInt32(index)) }
        try program.putNAT(id: id, bind: TCNATProgramTests.vip, quic: true)
        var entry = fanout_listener()
        entry.id = id
        entry.policy = FANOUT_POLICY_ROUND_ROBIN.rawValue
        entry.reserved = FANOUT_LISTENER_NAT | FANOUT_LISTENER_QUIC
        try program.putListener(TCNATProgramTests.vip, ifindex: UInt32(fixture.ifindex), entry)
        let codec = QUICLBCodec(configuration)
        let third = try codec.encode(serverID: serverIDs[2], nonce: [1, 2, 3, 4, 5, 6])
        let before = SocketAddress("198.18.50.7:40000")!, after = SocketAddress("198.18.50.7:40001")!
        // An Initial by the rotation (the first backend), then the client's ID names the third.
        let initial = TCNATProgramTests.frame(from: before, to: TCNATProgramTests.vip, payload: Self.longHeader(type: 0, [UInt8](repeating: 0xe1, count: 8)))
        #expect(try TCNATProgramTests.forwarded(fixture, initial).port == 6001)
        for client in [before, after] {
            let frame = TCNATProgramTests.frame(from: client, to: TCNATProgramTests.vip, payload: Self.shortHeader(third))
            #expect(try TCNATProgramTests.forwarded(fixture, frame).port == 6003, "\(client)")
        }
        let nat = program.natStats(id: id)
        #expect(nat.created == 2 && nat.moved == 1, "the first address moved to the third backend, the second was created there: \(nat)")
        #expect(program.quicCounts(id: id) == [2, 1, 0, 0])
        // The first backend answers the first address (now associated with the third): it leaves.
        let late = TCNATProgramTests.frame(from: SocketAddress("198.18.200.10:6001")!, to: before, payload: [0x41, 9, 9])
        #expect(fixture.execute(late, ifindex: fixture.otherIfindex).verdict == TCNATProgramTests.redirect)
        let counted = program.natStats(id: id)
        #expect(counted.verdict(FANOUT_VERDICT_REPLIED) == 1 && counted.verdict(FANOUT_VERDICT_WRONG_SERVER) == 0, "\(counted)")
        // Without quic_lb the same datagram is wrong_server (sbulb's rule).
        try program.putNAT(id: id, bind: TCNATProgramTests.vip, quic: false)
        #expect(fixture.execute(late, ifindex: fixture.otherIfindex).verdict == TCNATProgramTests.shot)
        #expect(program.natStats(id: id).verdict(FANOUT_VERDICT_WRONG_SERVER) == 1)
    }

    @Test("the build without the BPF crypto kfuncs (kernels before 6.10) loads, and routes plaintext IDs in tc and xdp; a key is refused, naming why; an encrypted configuration written anyway is never decrypted",
          arguments: Hook.allCases)
    func plainBuild(hook: Hook) throws {
        let rig = try Rig(crypto: false)
        #expect(!rig.program.crypto)
        let plaintext = try QUICLBConfiguration(configID: 0, serverIDLength: 3, nonceLength: 4)
        try rig.configure(plaintext, serverIDs: [octets("c4605f"), octets("c4605e"), octets("c4605d")])
        for _ in 1...3 { #expect(rig.port(hook, Self.shortHeader(octets("07c4605e4504cc4f"))) == 6002) }
        #expect(rig.outcomes == [3, 0, 0, 0], "\(rig.outcomes)")
        let error = #expect(throws: SystemCallError.self) { try rig.program.setQUICKey(slot: 0, octets(Self.key)) }
        #expect(error?.errno == EOPNOTSUPP && error?.call.contains("BPF crypto kfuncs") == true, "\(String(describing: error))")
        // Emptying a slot is nothing to do here.
        try rig.program.setQUICKey(slot: 0, nil)
        let encrypted = try QUICLBConfiguration(configID: 2, serverIDLength: 8, nonceLength: 8, key: octets(Self.key))
        try rig.program.writeQUICConfigs(setKey: Self.id * 2, [encrypted])
        let id = try QUICLBCodec(encrypted).encode(serverID: octets("ed793a51d49b8f5f"), nonce: octets("ee080dbf48c0d1e5"))
        #expect(rig.port(hook, Self.shortHeader(id)) != nil)
        #expect(rig.outcomes == [3, 0, 0, 1], "\(rig.outcomes)")
    }

    @Test("the two builds take each other's maps over (a kernel upgrade across 6.10): the plain one leaves the key map, the one with crypto makes its own",
          .enabled(if: TCKernelFeatures.quicCryptoProblem == nil, "this kernel has no BPF crypto kfuncs"))
    func buildsHandOver() throws {
        func mapID(_ fd: Int32) -> UInt32 {
            var info = bpf_map_info()
            var length = UInt32(MemoryLayout<bpf_map_info>.size)
            return bpf_obj_get_info_by_fd(fd, &info, &length) == 0 ? info.id : 0
        }
        let crypto = try TCProgram(crypto: true)
        defer { crypto.closeDescriptors() }
        let handed = Dictionary(uniqueKeysWithValues: crypto.handedOverMaps.map { ($0.name, dup($0.fd)) })
        defer { handed.values.forEach { close($0) } }
        let plain = try TCProgram(reusing: handed, crypto: false)
        defer { plain.closeDescriptors() }
        #expect(!plain.crypto && plain.handedOverMaps.map(\.name) == crypto.handedOverMaps.map(\.name).filter { $0 != FANOUT_MAP_QUIC_KEYS_NAME })
        #expect(mapID(plain.quicIDs) == mapID(crypto.quicIDs) && mapID(plain.listeners) == mapID(crypto.listeners))
        let back = Dictionary(uniqueKeysWithValues: plain.handedOverMaps.map { ($0.name, dup($0.fd)) })
        defer { back.values.forEach { close($0) } }
        let again = try TCProgram(reusing: back, crypto: true)
        defer { again.closeDescriptors() }
        #expect(again.crypto && mapID(again.quicConfigs) == mapID(crypto.quicConfigs) && mapID(again.quicKeys) != mapID(crypto.quicKeys))
        try again.setQUICKey(slot: 3, octets(Self.key))
        try again.setQUICKey(slot: 3, nil)
    }

    @Test("a key taken out: encrypted IDs are no longer decrypted (undecodable), plaintext configurations need none; a key slot out of range is refused")
    func keySlots() throws {
        let rig = try Rig()
        let configuration = try QUICLBConfiguration(configID: 2, serverIDLength: 8, nonceLength: 8, key: octets(Self.key))
        let serverID = octets("ed793a51d49b8f5f")
        try rig.configure(configuration, serverIDs: [[1, 1, 1, 1, 1, 1, 1, 1], serverID, [3, 3, 3, 3, 3, 3, 3, 3]])
        let id = try QUICLBCodec(configuration).encode(serverID: serverID, nonce: octets("ee080dbf48c0d1e5"))
        #expect(rig.port(.tc, Self.shortHeader(id)) == 6002)
        try rig.program.setQUICKey(slot: Self.id * 2 * UInt32(FANOUT_QUIC_CONFIGS) + 2, nil)
        #expect(rig.port(.tc, Self.shortHeader(id)) != nil)
        #expect(rig.outcomes == [1, 0, 0, 1], "\(rig.outcomes)")
        #expect(throws: SystemCallError.self) { try rig.program.setQUICKey(slot: UInt32(FANOUT_MAX_LISTENERS) * 2 * UInt32(FANOUT_QUIC_CONFIGS), octets(Self.key)) }
    }
}

private func octets(_ text: String) -> [UInt8] { QUICLBConfiguration.octets(hex: text)! }
