// SPDX-License-Identifier: Apache-2.0

/// One QUIC-LB configuration (draft-ietf-quic-load-balancers): how the servers behind a load
/// balancer put their server ID into the connection IDs they issue, so that the load balancer
/// routes every packet of a connection to its server whatever address the client sends from.
///
/// A connection ID is a first octet (the config ID in its top three bits, the length of the rest
/// in the low five), then the server ID and a nonce: in plaintext, or encrypted with AES-128
/// (one pass when server ID and nonce are 16 octets together, a four-pass Feistel otherwise).
public struct QUICLBConfiguration: Sendable, Hashable, CustomStringConvertible {
    /// The config rotation codepoint, 0...6 (7 marks unroutable IDs).
    public let configID: UInt8
    /// Octets of server ID, 1...15.
    public let serverIDLength: Int
    /// Octets of nonce, 4...18; with the server ID at most 19.
    public let nonceLength: Int
    /// The AES-128 key, nil for plaintext server IDs.
    public let key: [UInt8]?

    public init(configID: UInt8, serverIDLength: Int, nonceLength: Int, key: [UInt8]? = nil) throws(QUICLBError) {
        guard configID <= 6 else {
            throw .invalid("config ID \(configID) is out of range: use 0...6 (7 is reserved for unroutable connection IDs)")
        }
        guard (1...15).contains(serverIDLength) else {
            throw .invalid("server ID length \(serverIDLength) is out of range: use 1...15 octets")
        }
        guard nonceLength >= 4 else { throw .invalid("nonce length \(nonceLength) is too short: use at least 4 octets") }
        guard serverIDLength + nonceLength <= 19 else {
            throw .invalid("server ID length \(serverIDLength) and nonce length \(nonceLength) make \(serverIDLength + nonceLength) octets: at most 19 fit a QUIC v1 connection ID after its first octet")
        }
        if let key, key.count != 16 {
            throw .invalid("the key is \(key.count) octets: QUIC-LB keys are 16 octets (32 hexadecimal digits)")
        }
        self.configID = configID
        self.serverIDLength = serverIDLength
        self.nonceLength = nonceLength
        self.key = key
    }

    /// Octets after the first: server ID and nonce.
    public var plaintextLength: Int { serverIDLength + nonceLength }
    /// The whole connection ID's length (a server may append octets of its own after it).
    public var connectionIDLength: Int { 1 + plaintextLength }
    public var isEncrypted: Bool { key != nil }

    /// "plaintext" or the encryption ("single-pass AES-128", "four-pass AES-128").
    public var algorithm: String {
        guard isEncrypted else { return "plaintext" }
        return plaintextLength == 16 ? "single-pass AES-128" : "four-pass AES-128"
    }

    public var description: String {
        "config \(configID): \(serverIDLength)-octet server ID, \(nonceLength)-octet nonce, \(algorithm)"
    }

}

extension QUICLBConfiguration: CustomReflectable {
    /// The key stays out of dumps and logs of a configuration (equality and hashing still use it).
    public var customMirror: Mirror {
        Mirror(self, children: ["configID": configID, "serverIDLength": serverIDLength, "nonceLength": nonceLength,
                                "key": key == nil ? "none" : "(set, not shown)"])
    }
}

extension QUICLBConfiguration {
    /// Octets from hexadecimal digits, two per octet, no prefix or sign (server IDs and keys as
    /// configurations and command lines write them); nil otherwise.
    public static func octets(hex text: String) -> [UInt8]? {
        let digits = Array(text.utf8)
        guard !digits.isEmpty, digits.count % 2 == 0 else { return nil }
        func value(_ digit: UInt8) -> UInt8? {
            switch digit {
            case UInt8(ascii: "0")...UInt8(ascii: "9"): return digit - UInt8(ascii: "0")
            case UInt8(ascii: "a")...UInt8(ascii: "f"): return digit - UInt8(ascii: "a") + 10
            case UInt8(ascii: "A")...UInt8(ascii: "F"): return digit - UInt8(ascii: "A") + 10
            default: return nil
            }
        }
        var bytes: [UInt8] = []
        bytes.reserveCapacity(digits.count / 2)
        for index in stride(from: 0, to: digits.count, by: 2) {
            guard let high = value(digits[index]), let low = value(digits[index + 1]) else { return nil }
            bytes.append(high << 4 | low)
        }
        return bytes
    }
}

/// A QUIC-LB configuration that cannot be used, or input that does not fit it.
public enum QUICLBError: Error, Equatable, CustomStringConvertible {
    case invalid(String)

    public var description: String {
        switch self {
        case .invalid(let message): return message
        }
    }
}

/// Encodes server IDs into connection IDs (a server) and decodes them back (a load balancer),
/// for one ``QUICLBConfiguration``. A value: make one per configuration and share it.
public struct QUICLBCodec: Sendable {
    public let configuration: QUICLBConfiguration
    private let cipher: AES128?

    public init(_ configuration: QUICLBConfiguration) {
        self.configuration = configuration
        cipher = configuration.key.flatMap(AES128.init(key:))
    }

    /// A connection ID naming `serverID` (``QUICLBConfiguration/serverIDLength`` octets) with
    /// `nonce` (``QUICLBConfiguration/nonceLength`` octets; with a key it must never repeat, without
    /// one it must be random). The first octet carries the config ID and the length of the rest.
    public func encode(serverID: [UInt8], nonce: [UInt8]) throws(QUICLBError) -> [UInt8] {
        let c = configuration
        guard serverID.count == c.serverIDLength else {
            throw .invalid("server ID is \(serverID.count) octet(s); configuration \(c.configID) takes \(c.serverIDLength)")
        }
        guard nonce.count == c.nonceLength else {
            throw .invalid("nonce is \(nonce.count) octets; configuration \(c.configID) takes \(c.nonceLength)")
        }
        var id = [UInt8](repeating: 0, count: c.connectionIDLength)
        id[0] = c.configID << 5 | UInt8(c.plaintextLength)
        for (index, byte) in (serverID + nonce).enumerated() { id[1 + index] = byte }
        guard let cipher else { return id }
        id.withUnsafeMutableBytes { bytes in
            let body = bytes.baseAddress! + 1
            if c.plaintextLength == 16 {
                cipher.encrypt(body, body)
            } else {
                Feistel(length: c.plaintextLength, cipher: cipher).encrypt(body)
            }
        }
        return id
    }

    /// The server ID a connection ID carries, written to `serverID`
    /// (``QUICLBConfiguration/serverIDLength`` octets). `id` points at the connection ID's first
    /// octet and holds at least ``QUICLBConfiguration/connectionIDLength`` octets; the config ID
    /// is the caller's to check.
    @inline(__always)
    public func decodeServerID(_ id: UnsafeRawPointer, into serverID: UnsafeMutableRawPointer) {
        let c = configuration
        let body = id + 1
        guard let cipher else {
            serverID.copyMemory(from: body, byteCount: c.serverIDLength)
            return
        }
        if c.plaintextLength == 16 {
            withUnsafeTemporaryAllocation(byteCount: 16, alignment: 8) { block in
                cipher.decrypt(body, block.baseAddress!)
                serverID.copyMemory(from: block.baseAddress!, byteCount: c.serverIDLength)
            }
        } else {
            Feistel(length: c.plaintextLength, cipher: cipher).decryptServerID(body, serverIDLength: c.serverIDLength, into: serverID)
        }
    }

    /// The server ID and nonce of a whole connection ID (tests, servers that check their own IDs);
    /// nil if it is shorter than the configuration's or has another config ID.
    public func decode(_ id: [UInt8]) -> (serverID: [UInt8], nonce: [UInt8])? {
        let c = configuration
        guard id.count >= c.connectionIDLength, id[0] >> 5 == c.configID else { return nil }
        var plaintext = Array(id[1..<c.connectionIDLength])
        if let cipher {
            plaintext.withUnsafeMutableBytes { bytes in
                if c.plaintextLength == 16 {
                    cipher.decrypt(bytes.baseAddress!, bytes.baseAddress!)
                } else {
                    Feistel(length: c.plaintextLength, cipher: cipher).decrypt(bytes.baseAddress!)
                }
            }
        }
        return (Array(plaintext[0..<c.serverIDLength]), Array(plaintext[c.serverIDLength...]))
    }
}

/// The four-pass Feistel network of QUIC-LB for plaintexts of 5...19 octets other than 16: the
/// halves (half_len octets each; with an odd length the middle octet's nibbles are split), each
/// pass AES-encrypting one half expanded to a block and XORing the result into the other.
struct Feistel {
    let length: Int
    let cipher: AES128
    var half: Int { (length + 1) / 2 }
    var odd: Bool { length & 1 == 1 }

    /// Two halves of up to 10 octets each, in one 32-octet scratch area with a block after them.
    private typealias Scratch = UnsafeMutableRawBufferPointer

    /// XORs into `target` (half octets) the first half octets of AES(expand(source, pass)).
    @inline(__always)
    private func round(_ source: UnsafeRawPointer, _ pass: UInt8, into target: UnsafeMutableRawPointer, block: UnsafeMutableRawPointer) {
        block.initializeMemory(as: UInt8.self, repeating: 0, count: 16)
        block.copyMemory(from: source, byteCount: half)
        block.storeBytes(of: UInt8(length), toByteOffset: 14, as: UInt8.self)
        block.storeBytes(of: pass, toByteOffset: 15, as: UInt8.self)
        cipher.encrypt(block, block)
        for index in 0..<half {
            let value = target.load(fromByteOffset: index, as: UInt8.self) ^ block.load(fromByteOffset: index, as: UInt8.self)
            target.storeBytes(of: value, toByteOffset: index, as: UInt8.self)
        }
    }

    /// With an odd length the left half keeps the middle octet's high nibble, the right its low one.
    @inline(__always) private func clearLeft(_ left: UnsafeMutableRawPointer) {
        if odd { left.storeBytes(of: left.load(fromByteOffset: half - 1, as: UInt8.self) & 0xf0, toByteOffset: half - 1, as: UInt8.self) }
    }

    @inline(__always) private func clearRight(_ right: UnsafeMutableRawPointer) {
        if odd { right.storeBytes(of: right.load(as: UInt8.self) & 0x0f, as: UInt8.self) }
    }

    @inline(__always)
    private func withHalves<R>(_ bytes: UnsafeRawPointer, _ body: (UnsafeMutableRawPointer, UnsafeMutableRawPointer, UnsafeMutableRawPointer) -> R) -> R {
        withUnsafeTemporaryAllocation(byteCount: 48, alignment: 16) { scratch in
            let left = scratch.baseAddress!, right = scratch.baseAddress! + 16, block = scratch.baseAddress! + 32
            left.copyMemory(from: bytes, byteCount: half)
            right.copyMemory(from: bytes + (length - half), byteCount: half)
            clearLeft(left)
            clearRight(right)
            return body(left, right, block)
        }
    }

    /// Joins the halves back into `bytes` (length octets).
    @inline(__always)
    private func join(_ left: UnsafeRawPointer, _ right: UnsafeRawPointer, into bytes: UnsafeMutableRawPointer) {
        bytes.copyMemory(from: left, byteCount: half)
        if odd {
            let middle = left.load(fromByteOffset: half - 1, as: UInt8.self) | right.load(as: UInt8.self)
            bytes.storeBytes(of: middle, toByteOffset: half - 1, as: UInt8.self)
            bytes.advanced(by: half).copyMemory(from: right + 1, byteCount: half - 1)
        } else {
            bytes.advanced(by: half).copyMemory(from: right, byteCount: half)
        }
    }

    func encrypt(_ bytes: UnsafeMutableRawPointer) {
        withHalves(bytes) { left, right, block in
            round(left, 1, into: right, block: block); clearRight(right)
            round(right, 2, into: left, block: block); clearLeft(left)
            round(left, 3, into: right, block: block); clearRight(right)
            round(right, 4, into: left, block: block); clearLeft(left)
            join(left, right, into: bytes)
        }
    }

    func decrypt(_ bytes: UnsafeMutableRawPointer) {
        withHalves(bytes) { left, right, block in
            round(right, 4, into: left, block: block); clearLeft(left)
            round(left, 3, into: right, block: block); clearRight(right)
            round(right, 2, into: left, block: block); clearLeft(left)
            round(left, 1, into: right, block: block); clearRight(right)
            join(left, right, into: bytes)
        }
    }

    /// The server ID only: three passes when it lies in the left half, four otherwise.
    func decryptServerID(_ bytes: UnsafeRawPointer, serverIDLength: Int, into serverID: UnsafeMutableRawPointer) {
        withHalves(bytes) { left, right, block in
            round(right, 4, into: left, block: block); clearLeft(left)
            round(left, 3, into: right, block: block); clearRight(right)
            round(right, 2, into: left, block: block); clearLeft(left)
            if serverIDLength <= length / 2 {
                serverID.copyMemory(from: left, byteCount: serverIDLength)
                return
            }
            round(left, 1, into: right, block: block); clearRight(right)
            withUnsafeTemporaryAllocation(byteCount: 20, alignment: 8) { plain in
                join(left, right, into: plain.baseAddress!)
                serverID.copyMemory(from: plain.baseAddress!, byteCount: serverIDLength)
            }
        }
    }
}

/// Where a QUIC datagram's destination connection ID is (RFC 8999's version-independent header:
/// a long header says its length, a short one does not, so the configuration's length is used),
/// and whether the client chose it (Initial and 0-RTT packets of QUIC v1 and v2).
public enum QUICHeader {
    public static let version1: UInt32 = 0x0000_0001
    public static let version2: UInt32 = 0x6b33_43cf

    /// What the first packet of a datagram says about its destination connection ID.
    public enum DestinationID: Equatable, Sendable {
        /// Offset and length of the ID in the datagram (the length a long header gives, or
        /// `shortLength` for a short header); `clientChosen`: an Initial or 0-RTT packet, whose
        /// ID the client made up until the server's first reply, or a long header of a version
        /// other than 1 and 2 (a client's first packet, answered by version negotiation).
        case id(offset: Int, length: Int, clientChosen: Bool)
        /// Not a QUIC packet whose ID can be read: too short, or a version negotiation packet.
        case unreadable
    }

    /// - Parameters:
    ///   - datagram: a UDP payload: the first QUIC packet of the datagram.
    ///   - shortLength: the connection ID length of short-header packets (at least the
    ///     configurations' ``QUICLBConfiguration/connectionIDLength``).
    @inline(__always)
    public static func destinationID(_ datagram: UnsafeRawBufferPointer, shortLength: Int) -> DestinationID {
        guard datagram.count >= 1 else { return .unreadable }
        let first = datagram[0]
        guard first & 0x80 != 0 else {
            return datagram.count >= 1 + shortLength ? .id(offset: 1, length: shortLength, clientChosen: false) : .unreadable
        }
        guard datagram.count >= 6 else { return .unreadable }
        let version = UInt32(datagram[1]) << 24 | UInt32(datagram[2]) << 16 | UInt32(datagram[3]) << 8 | UInt32(datagram[4])
        let length = Int(datagram[5])
        guard version != 0, datagram.count >= 6 + length else { return .unreadable }
        let type = (first >> 4) & 0x03
        let clientChosen: Bool
        switch version {
        case version1: clientChosen = type == 0 || type == 1
        case version2: clientChosen = type == 1 || type == 2
        default: clientChosen = true
        }
        return .id(offset: 6, length: length, clientChosen: clientChosen)
    }
}
