// SPDX-License-Identifier: Apache-2.0
import ArgumentParser

/// Export packets of NetFlow v9 (RFC 3954) or IPFIX (RFC 7011) from one exporter per source
/// address: the template first and again every `templateEvery` packets, then data records of
/// IPv4 flows; sequence numbers per exporter (v9: packets, IPFIX: data records), as a router's
/// exporter sends them. Collectors that parse what they get (nfcapd, nfacctd) decode every record.
struct NetFlowExporter {
    enum Version: String, ExpressibleByArgument, CaseIterable {
        case v9
        case ipfix
    }

    /// Fields of the one template (ID 256): IPv4 source and destination, ports, protocol,
    /// packets, bytes, first and last switched. v9: times in ms of system uptime (4 bytes);
    /// IPFIX: flowStartMilliseconds and flowEndMilliseconds (8 bytes, since the epoch).
    static func fields(_ version: Version) -> [(type: UInt16, length: UInt16)] {
        let times: [(UInt16, UInt16)] = version == .v9 ? [(22, 4), (21, 4)] : [(152, 8), (153, 8)]
        return [(8, 4), (12, 4), (7, 2), (11, 2), (4, 1), (2, 4), (1, 4)] + times
    }

    static let templateID: UInt16 = 256
    let version: Version
    let recordsPerPacket: Int
    let templateEvery: Int
    let recordLength: Int
    /// Per exporter: packets and data records sent so far.
    private var packets: [UInt64]
    private var records: [UInt64]
    private let start: UInt64

    init(version: Version, exporters: Int, recordsPerPacket: Int, templateEvery: Int, nowMilliseconds: UInt64) {
        self.version = version
        self.recordsPerPacket = recordsPerPacket
        self.templateEvery = templateEvery
        recordLength = Self.fields(version).reduce(0) { $0 + Int($1.length) }
        packets = Array(repeating: 0, count: exporters)
        records = Array(repeating: 0, count: exporters)
        start = nowMilliseconds
    }

    /// The largest packet: header, template set, data set (padded).
    var maximumSize: Int { 20 + templateSetLength + dataSetLength }
    private var templateSetLength: Int { 4 + 4 + 4 * Self.fields(version).count }
    private var dataSetLength: Int { (4 + recordsPerPacket * recordLength + 3) & ~3 }

    /// Writes exporter `exporter`'s next packet at `buffer` (at least ``maximumSize`` bytes);
    /// returns its length.
    mutating func write(into buffer: UnsafeMutableRawPointer, exporter: Int, nowMilliseconds: UInt64) -> Int {
        var writer = Writer(base: buffer)
        let withTemplate = packets[exporter] % UInt64(templateEvery) == 0
        let uptime = UInt32(truncatingIfNeeded: nowMilliseconds - start + 1000)
        switch version {
        case .v9:
            writer.u16(9)
            writer.u16(UInt16(recordsPerPacket + (withTemplate ? 1 : 0)))
            writer.u32(uptime)
            writer.u32(UInt32(truncatingIfNeeded: nowMilliseconds / 1000))
            writer.u32(UInt32(truncatingIfNeeded: packets[exporter]))
            writer.u32(0)  // source ID
        case .ipfix:
            writer.u16(10)
            writer.u16(0)  // length, below
            writer.u32(UInt32(truncatingIfNeeded: nowMilliseconds / 1000))
            writer.u32(UInt32(truncatingIfNeeded: records[exporter]))
            writer.u32(0)  // observation domain
        }
        if withTemplate {
            let fields = Self.fields(version)
            writer.u16(version == .v9 ? 0 : 2)
            writer.u16(UInt16(templateSetLength))
            writer.u16(Self.templateID)
            writer.u16(UInt16(fields.count))
            for field in fields {
                writer.u16(field.type)
                writer.u16(field.length)
            }
        }
        let setStart = writer.offset
        writer.u16(Self.templateID)
        writer.u16(UInt16(dataSetLength))
        for index in 0..<recordsPerPacket {
            let flow = records[exporter] + UInt64(index)
            writer.u32(0x0a00_0000 | UInt32(truncatingIfNeeded: exporter & 0xffff) << 8 | UInt32(flow % 250 + 1))  // 10.x.y.z
            writer.u32(0xc633_6400 | UInt32(flow % 200 + 1))  // 198.51.100.n
            writer.u16(UInt16(truncatingIfNeeded: 1024 + flow % 60000))
            writer.u16(443)
            writer.u8(17)
            writer.u32(UInt32(truncatingIfNeeded: flow % 100 + 1))
            writer.u32(UInt32(truncatingIfNeeded: (flow % 100 + 1) * 512))
            switch version {
            case .v9:
                writer.u32(uptime &- 500)
                writer.u32(uptime)
            case .ipfix:
                writer.u64(nowMilliseconds - 500)
                writer.u64(nowMilliseconds)
            }
        }
        while writer.offset < setStart + dataSetLength { writer.u8(0) }
        if version == .ipfix {
            var length = Writer(base: buffer + 2)
            length.u16(UInt16(writer.offset))
        }
        packets[exporter] += 1
        records[exporter] += UInt64(recordsPerPacket)
        return writer.offset
    }

    /// Big-endian fields written one after another.
    struct Writer {
        let base: UnsafeMutableRawPointer
        var offset = 0

        init(base: UnsafeMutableRawPointer) { self.base = base }

        mutating func u8(_ value: UInt8) {
            base.storeBytes(of: value, toByteOffset: offset, as: UInt8.self)
            offset += 1
        }
        mutating func u16(_ value: UInt16) {
            base.storeBytes(of: value.bigEndian, toByteOffset: offset, as: UInt16.self)
            offset += 2
        }
        mutating func u32(_ value: UInt32) {
            base.storeBytes(of: value.bigEndian, toByteOffset: offset, as: UInt32.self)
            offset += 4
        }
        mutating func u64(_ value: UInt64) {
            base.storeBytes(of: value.bigEndian, toByteOffset: offset, as: UInt64.self)
            offset += 8
        }
    }
}
