// SPDX-License-Identifier: Apache-2.0
import Testing
@testable import ReusePortLB

func hex(_ text: String) -> [UInt8] {
    let digits = Array(text.utf8)
    return stride(from: 0, to: digits.count, by: 2).map { UInt8(String(decoding: digits[$0..<$0 + 2], as: UTF8.self), radix: 16)! }
}

func hexText(_ bytes: [UInt8]) -> String {
    bytes.map { ($0 < 16 ? "0" : "") + String($0, radix: 16) }.joined()
}

/// AES-128 against FIPS 197, and QUIC-LB against the draft's test vectors
/// (draft-ietf-quic-load-balancers, "Load Balancer Test Vectors" and "Encryption Example").
@Suite("QUIC-LB")
struct QUICLBTests {
    @Test("AES-128: FIPS 197 appendix C.1 and B, both ways")
    func aesVectors() throws {
        let vectors = [
            ("000102030405060708090a0b0c0d0e0f", "00112233445566778899aabbccddeeff", "69c4e0d86a7b0430d8cdb78070b4c55a"),
            ("2b7e151628aed2a6abf7158809cf4f3c", "3243f6a8885a308d313198a2e0370734", "3925841d02dc09fbdc118597196a0b32"),
        ]
        for (key, plain, cipher) in vectors {
            let aes = try #require(AES128(key: hex(key)))
            #expect(hexText(aes.encrypt(hex(plain))) == cipher)
            #expect(hexText(aes.decrypt(hex(cipher))) == plain)
        }
        #expect(AES128(key: [UInt8](repeating: 0, count: 15)) == nil)
    }

    @Test("plaintext vector: the server ID is the octets after the first")
    func plaintextVector() throws {
        let codec = QUICLBCodec(try QUICLBConfiguration(configID: 0, serverIDLength: 3, nonceLength: 4))
        #expect(hexText(try codec.encode(serverID: hex("c4605e"), nonce: hex("4504cc4f"))) == "07c4605e4504cc4f")
        let decoded = try #require(codec.decode(hex("07c4605e4504cc4f")))
        #expect(hexText(decoded.serverID) == "c4605e")
        #expect(hexText(decoded.nonce) == "4504cc4f")
    }

    /// The encrypted vectors (key 8f95f092...): four-pass with an odd length, four-pass needing
    /// the fourth decryption pass (server ID longer than the nonce), single-pass (16 octets) and
    /// four-pass with an even length. The draft's first octets do not all carry the config ID
    /// they are listed with (the last shows 0x12 for config 3), so the octets after the first
    /// are compared, and the first octet is the one this encoder writes.
    @Test("encrypted vectors: single-pass and four-pass, both ways", arguments: [
        (UInt8(0), "ed793a", "ee080dbf", "20b1d07b359d3c"),
        (UInt8(1), "ed793a51d49b8f5fab65", "ee080dbf48", "cc381bc74cb4fbad2823a3d1f8fed2"),
        (UInt8(2), "ed793a51d49b8f5f", "ee080dbf48c0d1e5", "4dd2d05a7b0de9b2b9907afb5ecf8cc3"),
        (UInt8(3), "ed793a51d49b8f5fab", "ee080dbf48c0d1e55d", "5779c9cc86beb3a3a4a3ca96fce4bfe0cdbc"),
    ])
    func encryptedVectors(_ vector: (UInt8, String, String, String)) throws {
        let (configID, serverID, nonce, ciphertext) = vector
        let configuration = try QUICLBConfiguration(configID: configID, serverIDLength: serverID.count / 2, nonceLength: nonce.count / 2,
                                                    key: hex("8f95f09245765f80256934e50c66207f"))
        let codec = QUICLBCodec(configuration)
        let id = try codec.encode(serverID: hex(serverID), nonce: hex(nonce))
        #expect(id[0] == configID << 5 | UInt8(configuration.plaintextLength))
        #expect(hexText(Array(id.dropFirst())) == ciphertext)
        let decoded = try #require(codec.decode(id))
        #expect(hexText(decoded.serverID) == serverID)
        #expect(hexText(decoded.nonce) == nonce)
        // The load balancer's path: the server ID only (three passes where it can).
        var routed = [UInt8](repeating: 0, count: configuration.serverIDLength)
        id.withUnsafeBytes { cid in routed.withUnsafeMutableBytes { codec.decodeServerID(cid.baseAddress!, into: $0.baseAddress!) } }
        #expect(hexText(routed) == serverID)
    }

    @Test("the draft's worked four-pass example (7 octets, key fdf726a9...)")
    func encryptionExample() throws {
        let codec = QUICLBCodec(try QUICLBConfiguration(configID: 0, serverIDLength: 3, nonceLength: 4, key: hex("fdf726a9893ec05c0632d3956680baf0")))
        #expect(hexText(try codec.encode(serverID: hex("31441a"), nonce: hex("9c69c275"))) == "0767947d29be054a")
    }

    @Test("every layout round-trips, and the server ID path agrees with the whole decode")
    func everyLayout() throws {
        var generator = SystemRandomNumberGenerator()
        for serverIDLength in 1...15 {
            for nonceLength in 4...(19 - serverIDLength) {
                for key in [nil, (0..<16).map { _ in UInt8.random(in: 0...255, using: &generator) }] {
                    let configuration = try QUICLBConfiguration(configID: 5, serverIDLength: serverIDLength, nonceLength: nonceLength, key: key)
                    let codec = QUICLBCodec(configuration)
                    let serverID = (0..<serverIDLength).map { _ in UInt8.random(in: 0...255, using: &generator) }
                    let nonce = (0..<nonceLength).map { _ in UInt8.random(in: 0...255, using: &generator) }
                    let id = try codec.encode(serverID: serverID, nonce: nonce)
                    #expect(id.count == 1 + serverIDLength + nonceLength)
                    if key != nil { #expect(Array(id[1...serverIDLength]) != serverID || serverIDLength < 3) }
                    let decoded = try #require(codec.decode(id))
                    #expect(decoded.serverID == serverID, "\(configuration)")
                    #expect(decoded.nonce == nonce, "\(configuration)")
                    var routed = [UInt8](repeating: 0, count: serverIDLength)
                    id.withUnsafeBytes { cid in routed.withUnsafeMutableBytes { codec.decodeServerID(cid.baseAddress!, into: $0.baseAddress!) } }
                    #expect(routed == serverID, "\(configuration)")
                }
            }
        }
    }

    @Test("configurations out of the draft's ranges are refused, naming the limit")
    func invalidConfigurations() {
        #expect(throws: QUICLBError.self) { try QUICLBConfiguration(configID: 7, serverIDLength: 2, nonceLength: 6) }
        #expect(throws: QUICLBError.self) { try QUICLBConfiguration(configID: 0, serverIDLength: 0, nonceLength: 6) }
        #expect(throws: QUICLBError.self) { try QUICLBConfiguration(configID: 0, serverIDLength: 2, nonceLength: 3) }
        #expect(throws: QUICLBError.self) { try QUICLBConfiguration(configID: 0, serverIDLength: 10, nonceLength: 10) }
        #expect(throws: QUICLBError.self) { try QUICLBConfiguration(configID: 0, serverIDLength: 2, nonceLength: 6, key: [1, 2, 3]) }
        do {
            _ = try QUICLBConfiguration(configID: 0, serverIDLength: 10, nonceLength: 10)
            Issue.record("20 octets accepted")
        } catch {
            #expect(error.description.contains("at most 19"))
        }
    }

    @Test("QUIC headers: long header IDs, short header IDs, client-chosen packets, unreadable ones")
    func headers() {
        func parse(_ bytes: [UInt8], short: Int = 8) -> QUICHeader.DestinationID {
            bytes.withUnsafeBytes { QUICHeader.destinationID($0, shortLength: short) }
        }
        // v1 Initial (type 0), Handshake (type 2), 0-RTT (type 1) with an 8-octet ID.
        let id: [UInt8] = [7, 1, 2, 3, 4, 5, 6, 7]
        #expect(parse([0xc0, 0, 0, 0, 1, 8] + id + [0]) == .id(offset: 6, length: 8, clientChosen: true))
        #expect(parse([0xd0, 0, 0, 0, 1, 8] + id) == .id(offset: 6, length: 8, clientChosen: true))
        #expect(parse([0xe0, 0, 0, 0, 1, 8] + id) == .id(offset: 6, length: 8, clientChosen: false))
        // v1 Retry (type 3): the server's.
        #expect(parse([0xf0, 0, 0, 0, 1, 8] + id) == .id(offset: 6, length: 8, clientChosen: false))
        // v2: Initial is type 1, 0-RTT type 2, Handshake type 3, Retry type 0.
        #expect(parse([0xd0, 0x6b, 0x33, 0x43, 0xcf, 8] + id) == .id(offset: 6, length: 8, clientChosen: true))
        #expect(parse([0xe0, 0x6b, 0x33, 0x43, 0xcf, 8] + id) == .id(offset: 6, length: 8, clientChosen: true))
        #expect(parse([0xf0, 0x6b, 0x33, 0x43, 0xcf, 8] + id) == .id(offset: 6, length: 8, clientChosen: false))
        #expect(parse([0xc0, 0x6b, 0x33, 0x43, 0xcf, 8] + id) == .id(offset: 6, length: 8, clientChosen: false))
        // Another version: a client's first packet.
        #expect(parse([0xc0, 0xff, 0, 0, 0x1d, 8] + id) == .id(offset: 6, length: 8, clientChosen: true))
        // Short header: the configured length.
        #expect(parse([0x40] + id) == .id(offset: 1, length: 8, clientChosen: false))
        #expect(parse([0x40] + id.dropLast()) == .unreadable)
        // Version negotiation, truncated long headers, empty datagrams.
        #expect(parse([0x80, 0, 0, 0, 0, 8] + id) == .unreadable)
        #expect(parse([0xc0, 0, 0, 0, 1, 9] + id) == .unreadable)
        #expect(parse([0xc0, 0, 0]) == .unreadable)
        #expect(parse([]) == .unreadable)
    }
}
