// SPDX-License-Identifier: Apache-2.0

/// NetFlow v9 and IPFIX packets built byte by byte, for the template tests of both test targets.
public enum NetFlowBytes {
    public static func be16(_ values: [Int]) -> [UInt8] { values.flatMap { [UInt8($0 >> 8 & 0xff), UInt8($0 & 0xff)] } }
    public static func be32(_ value: UInt32) -> [UInt8] { be16([Int(value >> 16), Int(value & 0xffff)]) }

    public static func v9(domain: UInt32 = 7, sequence: UInt32 = 42, count: Int = 1, sets: [[UInt8]]) -> [UInt8] {
        be16([9, count]) + be32(1000) + be32(1_700_000_000) + be32(sequence) + be32(domain) + sets.flatMap { $0 }
    }

    /// `extra`: bytes the header's length claims beyond the sets (a malformed message).
    public static func ipfix(domain: UInt32 = 7, sequence: UInt32 = 42, sets: [[UInt8]], extra: Int = 0) -> [UInt8] {
        let body = sets.flatMap { $0 }
        return be16([10, 16 + body.count + extra]) + be32(1_700_000_000) + be32(sequence) + be32(domain) + body
    }

    public static func set(_ id: Int, _ body: [UInt8]) -> [UInt8] { be16([id, 4 + body.count]) + body }

    /// A template record: ID, field count, (type, length) pairs.
    public static func template(_ id: Int, _ fields: [(Int, Int)]) -> [UInt8] { be16([id, fields.count] + fields.flatMap { [$0.0, $0.1] }) }

    public static let fields4 = [(8, 4), (12, 4), (7, 2), (11, 2)]
}
