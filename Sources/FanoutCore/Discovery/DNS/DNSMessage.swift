// SPDX-License-Identifier: Apache-2.0
import ReusePortLB

/// The parts of a DNS response (RFC 1035 §4.1) that downstream discovery uses, read with a
/// bounds check before every byte: the bytes come from the network, so a short, truncated or
/// hostile answer is an error naming the offset, never a crash or a loop.
struct DNSMessage: Equatable, Sendable {
    /// Resource record types the resolver asks for or follows.
    enum RecordType: UInt16, Sendable {
        case a = 1
        case cname = 5
        case soa = 6
        case aaaa = 28
    }

    /// Response codes the resolver tells apart (RFC 1035 §4.1.1).
    enum ResponseCode: UInt8, Sendable {
        case noError = 0
        case formatError = 1
        case serverFailure = 2
        case nameError = 3
        case notImplemented = 4
        case refused = 5
    }

    /// One resource record, its data decoded where the resolver needs it.
    struct Record: Equatable, Sendable {
        enum Data: Equatable, Sendable {
            case address(IPAddress)
            case canonicalName(String)
            /// The SOA's MINIMUM field: with the SOA's own TTL it bounds a negative answer's TTL (RFC 2308 §5).
            case startOfAuthority(minimum: UInt32)
            case other
        }

        /// Owner name, lower case, without the trailing dot.
        var name: String
        var type: UInt16
        var ttl: UInt32
        var data: Data
    }

    var id: UInt16
    var isResponse: Bool
    var isTruncated: Bool
    /// The 4-bit RCODE as received (values without a case are kept for the error message).
    var rcode: UInt8
    var answers: [Record]
    var authority: [Record]

    /// Why bytes are not a DNS message this parser accepts.
    struct FormatError: Error, Equatable, CustomStringConvertible {
        var reason: String
        var description: String { reason }
    }

    /// Parses a whole response. Questions are skipped, the additional section is not read.
    /// - Throws: ``FormatError`` naming the offset and the field that does not fit.
    init(parsing bytes: [UInt8]) throws(FormatError) {
        var reader = Reader(bytes: bytes)
        id = try reader.u16("header ID")
        let flags = try reader.u16("header flags")
        isResponse = flags & 0x8000 != 0
        isTruncated = flags & 0x0200 != 0
        rcode = UInt8(flags & 0x000F)
        let questions = try reader.u16("QDCOUNT")
        let answerCount = try reader.u16("ANCOUNT")
        let authorityCount = try reader.u16("NSCOUNT")
        _ = try reader.u16("ARCOUNT")
        for _ in 0..<questions {
            _ = try reader.name("question name")
            _ = try reader.u16("question type")
            _ = try reader.u16("question class")
        }
        answers = []
        // Counts come from the sender: each record needs at least 11 bytes, so a count that
        // cannot fit fails at the first short read instead of reserving memory for it.
        for _ in 0..<answerCount { answers.append(try reader.record()) }
        authority = []
        for _ in 0..<authorityCount { authority.append(try reader.record()) }
    }

    /// ID and RCODE of the response whose header starts `bytes`; nil when there are fewer than
    /// 12 bytes or the QR bit says it is not a response. Reads the header alone: a refusal kept
    /// in a buffer of unknown length cannot be parsed whole.
    static func responseHeader(_ bytes: [UInt8]) -> (id: UInt16, rcode: UInt8)? {
        guard bytes.count >= 12, bytes[2] & 0x80 != 0 else { return nil }
        return (UInt16(bytes[0]) << 8 | UInt16(bytes[1]), bytes[3] & 0x0F)
    }

    /// The addresses of `type` (A or AAAA) that answer `name`, following CNAMEs in the answer
    /// section (records owned by names outside the chain are ignored, as getaddrinfo does), and
    /// the smallest TTL of the chain's records; nil TTL when there is no address.
    func addresses(of type: RecordType, for name: String) -> (addresses: [IPAddress], ttl: UInt32?) {
        var chain: Set<String> = [DNSMessage.normalized(name)]
        var chainTTL: UInt32?
        // A chain longer than the records in it is a loop; each pass adds a name or stops.
        for _ in 0...answers.count {
            var grew = false
            for record in answers where chain.contains(record.name) {
                if case .canonicalName(let target) = record.data, !chain.contains(target) {
                    chain.insert(target)
                    chainTTL = min(chainTTL ?? record.ttl, record.ttl)
                    grew = true
                }
            }
            if !grew { break }
        }
        var addresses: [IPAddress] = []
        var ttl: UInt32?
        for record in answers where record.type == type.rawValue && chain.contains(record.name) {
            if case .address(let address) = record.data {
                addresses.append(address)
                ttl = min(ttl ?? record.ttl, record.ttl)
            }
        }
        if let found = ttl, let chainTTL { ttl = min(found, chainTTL) }
        return (addresses, ttl)
    }

    /// How long a negative answer (NXDOMAIN, no data) may be cached: the smaller of the
    /// authority SOA's TTL and its MINIMUM field (RFC 2308 §5); nil without an SOA.
    var negativeTTL: UInt32? {
        for record in authority {
            if case .startOfAuthority(let minimum) = record.data { return Swift.min(record.ttl, minimum) }
        }
        return nil
    }

    /// Lower case without the trailing dot: DNS names compare case-insensitively.
    static func normalized(_ name: String) -> String {
        var text = name.lowercased()
        if text.hasSuffix(".") { text.removeLast() }
        return text
    }

    /// A cursor over the message that checks every read against its end.
    private struct Reader {
        let bytes: [UInt8]
        var offset = 0

        mutating func u8(_ what: String) throws(FormatError) -> UInt8 {
            guard offset < bytes.count else { throw short(what, 1) }
            defer { offset += 1 }
            return bytes[offset]
        }

        mutating func u16(_ what: String) throws(FormatError) -> UInt16 {
            guard offset + 2 <= bytes.count else { throw short(what, 2) }
            defer { offset += 2 }
            return UInt16(bytes[offset]) << 8 | UInt16(bytes[offset + 1])
        }

        mutating func u32(_ what: String) throws(FormatError) -> UInt32 {
            UInt32(try u16(what)) << 16 | UInt32(try u16(what))
        }

        func short(_ what: String, _ needed: Int) -> FormatError {
            FormatError(reason: "truncated: \(what) needs \(needed) bytes at offset \(offset), the message has \(bytes.count)")
        }

        /// Reads a possibly compressed name (RFC 1035 §4.1.4). A pointer must point before the
        /// label it replaces, so a chain of pointers always ends; the name is at most 255 bytes.
        mutating func name(_ what: String) throws(FormatError) -> String {
            var labels: [String] = []
            var length = 0
            var position = offset
            var resumeAt: Int?
            while true {
                guard position < bytes.count else {
                    throw FormatError(reason: "truncated: \(what) runs past the end of the message (offset \(position) of \(bytes.count))")
                }
                let size = Int(bytes[position])
                switch size & 0xC0 {
                case 0x00:
                    if size == 0 {
                        offset = resumeAt ?? position + 1
                        return labels.joined(separator: ".").lowercased()
                    }
                    guard position + 1 + size <= bytes.count else {
                        throw FormatError(reason: "truncated: a label of \(what) at offset \(position) needs \(size) bytes, the message has \(bytes.count)")
                    }
                    length += size + 1
                    guard length <= 255 else { throw FormatError(reason: "\(what) at offset \(offset) is longer than 255 bytes") }
                    labels.append(String(decoding: bytes[(position + 1)...(position + size)], as: UTF8.self))
                    position += 1 + size
                case 0xC0:
                    guard position + 2 <= bytes.count else {
                        throw FormatError(reason: "truncated: a compression pointer of \(what) at offset \(position) needs 2 bytes")
                    }
                    let target = (size & 0x3F) << 8 | Int(bytes[position + 1])
                    guard target < position else {
                        throw FormatError(reason: "\(what): compression pointer at offset \(position) points forward to \(target) (a loop)")
                    }
                    if resumeAt == nil { resumeAt = position + 2 }
                    position = target
                default:
                    throw FormatError(reason: "\(what): label type 0x\(String(size & 0xC0, radix: 16)) at offset \(position) is not defined (RFC 6891 §5)")
                }
            }
        }

        mutating func record() throws(FormatError) -> Record {
            let name = try name("record name")
            let type = try u16("record type")
            _ = try u16("record class")
            let ttl = try u32("record TTL")
            let size = Int(try u16("RDLENGTH"))
            let start = offset
            guard start + size <= bytes.count else {
                throw FormatError(reason: "truncated: record data of \(size) bytes at offset \(start), the message has \(bytes.count)")
            }
            var data = Record.Data.other
            switch RecordType(rawValue: type) {
            case .a?, .aaaa?:
                let expected = type == RecordType.a.rawValue ? 4 : 16
                guard size == expected, let address = IPAddress(bytes: bytes[start..<(start + size)]) else {
                    throw FormatError(reason: "\(type == 1 ? "A" : "AAAA") record of \(name) at offset \(start) has \(size) bytes of data, not \(expected)")
                }
                data = .address(address)
            case .cname?:
                let target = try self.name("CNAME target")
                guard offset <= start + size else {
                    throw FormatError(reason: "CNAME target of \(name) at offset \(start) runs past its RDLENGTH \(size)")
                }
                data = .canonicalName(target)
            case .soa?:
                // MNAME, RNAME, then SERIAL REFRESH RETRY EXPIRE MINIMUM: MINIMUM is the last 4 bytes.
                guard size >= 22 else {
                    throw FormatError(reason: "SOA record of \(name) at offset \(start) has \(size) bytes of data, fewer than the 22 it needs")
                }
                let end = start + size
                data = .startOfAuthority(minimum: UInt32(bytes[end - 4]) << 24 | UInt32(bytes[end - 3]) << 16 | UInt32(bytes[end - 2]) << 8 | UInt32(bytes[end - 1]))
            case nil:
                break
            }
            offset = start + size
            // RFC 2181 §8: a TTL with the top bit set is treated as zero.
            return Record(name: name, type: type, ttl: ttl > UInt32(Int32.max) ? 0 : ttl, data: data)
        }
    }
}
