// SPDX-License-Identifier: Apache-2.0

/// NetFlow v9 (RFC 3954) and IPFIX (RFC 7011) export packets, read as far as a load balancer
/// needs to let templates follow their exporter: the header (version, observation domain or
/// source ID, sequence, times), each set's ID and length, and the template and options template
/// records, kept as the exporter sent them. Data records are not decoded.
///
/// Everything else is `.notFlowExport` (NetFlow v5 and sFlow describe themselves: they need no
/// template), and a packet of version 9 or 10 whose lengths do not add up is `.malformed`, with
/// what is wrong.
package enum FlowExport {
    package enum Version: UInt16, Sendable, Hashable {
        case v9 = 9
        case ipfix = 10

        /// The set IDs of template and options template sets.
        var templateSet: UInt16 { self == .v9 ? 0 : 2 }
        var optionsSet: UInt16 { self == .v9 ? 1 : 3 }
        var headerLength: Int { self == .v9 ? 20 : 16 }
    }

    /// A template or options template record, byte for byte as the exporter sent it.
    package struct Template: Equatable, Sendable {
        package var id: UInt16
        package var options: Bool
        package var record: [UInt8]

        package init(id: UInt16, options: Bool, record: [UInt8]) {
            self.id = id
            self.options = options
            self.record = record
        }
    }

    /// What a template or options template set says.
    package enum Change: Equatable, Sendable {
        /// A template defined (new, or redefined with the same ID).
        case defined(Template)
        /// IPFIX withdrawal of one template (a record with field count 0).
        case withdrawn(id: UInt16, options: Bool)
        /// IPFIX withdrawal of every template (ID 2) or options template (ID 3) of the domain.
        case withdrawnAll(options: Bool)
    }

    package struct Packet: Equatable, Sendable {
        package var version: Version
        /// The observation domain (IPFIX) or source ID (v9).
        package var domain: UInt32
        package var sequence: UInt32
        /// v9: the Unix seconds; IPFIX: the export time.
        package var exportTime: UInt32
        /// v9: milliseconds since the exporter booted (0 for IPFIX).
        package var uptime: UInt32
        package var changes: [Change]
        /// The IDs of the data sets (256 and up), in order.
        package var dataSets: [UInt16]
    }

    package enum Parsed: Equatable, Sendable {
        case notFlowExport
        case malformed(String)
        case packet(Packet)
    }

    package static func parse(_ bytes: [UInt8]) -> Parsed {
        bytes.withUnsafeBytes { parse($0) }
    }

    /// The exporter a version 9 or 10 datagram's header names (its version and observation
    /// domain or source ID), read without parsing the sets; nil when it is neither or too short.
    package static func header(_ bytes: UnsafeRawBufferPointer) -> (version: Version, domain: UInt32)? {
        guard bytes.count >= 2, let version = Version(rawValue: u16(bytes, 0)), bytes.count >= version.headerLength else { return nil }
        return (version, u32(bytes, version == .v9 ? 16 : 12))
    }

    /// Whether ``parse(_:)`` has more to say than "data": a template or options template set, or
    /// sets whose lengths do not add up (malformed). Walks the set headers only, allocates nothing:
    /// the cost of a datagram of data alone.
    package static func needsParsing(_ bytes: UnsafeRawBufferPointer) -> Bool {
        guard bytes.count >= 2, let version = Version(rawValue: u16(bytes, 0)) else { return false }
        guard bytes.count >= version.headerLength else { return true }
        var end = bytes.count
        if version == .ipfix {
            let length = Int(u16(bytes, 2))
            guard length >= 16, length <= bytes.count else { return true }
            end = length
        }
        var offset = version.headerLength
        while end - offset >= 4 {
            let id = u16(bytes, offset)
            let length = Int(u16(bytes, offset + 2))
            if length < 4 || offset + length > end || id == version.templateSet || id == version.optionsSet { return true }
            offset += length
        }
        return version == .ipfix && offset != end
    }

    package static func parse(_ bytes: UnsafeRawBufferPointer) -> Parsed {
        guard bytes.count >= 2, let version = Version(rawValue: u16(bytes, 0)) else { return .notFlowExport }
        guard bytes.count >= version.headerLength else {
            return .malformed("\(bytes.count) bytes: shorter than the \(version == .v9 ? "NetFlow v9" : "IPFIX") header (\(version.headerLength))")
        }
        var end = bytes.count
        var packet: Packet
        switch version {
        case .v9:
            packet = Packet(version: .v9, domain: u32(bytes, 16), sequence: u32(bytes, 12), exportTime: u32(bytes, 8), uptime: u32(bytes, 4), changes: [], dataSets: [])
        case .ipfix:
            let length = Int(u16(bytes, 2))
            guard length >= 16, length <= bytes.count else {
                return .malformed("IPFIX message length \(length) with \(bytes.count) bytes received")
            }
            end = length
            packet = Packet(version: .ipfix, domain: u32(bytes, 12), sequence: u32(bytes, 8), exportTime: u32(bytes, 4), uptime: 0, changes: [], dataSets: [])
        }
        var offset = version.headerLength
        // v9 allows padding after the last flowset; IPFIX sets fill the message exactly.
        while end - offset >= 4 {
            let id = u16(bytes, offset)
            let length = Int(u16(bytes, offset + 2))
            guard length >= 4 else { return .malformed("set \(id) at byte \(offset): length \(length), below its own header's 4") }
            guard offset + length <= end else {
                return .malformed("set \(id) at byte \(offset): length \(length) runs past the \(end) bytes of the packet")
            }
            let set = UnsafeRawBufferPointer(rebasing: bytes[(offset + 4)..<(offset + length)])
            if id == version.templateSet || id == version.optionsSet {
                switch records(set, version: version, options: id == version.optionsSet) {
                case .success(let changes): packet.changes += changes
                case .failure(let problem): return .malformed("set \(id) at byte \(offset): \(problem.text)")
                }
            } else if id >= 256 {
                packet.dataSets.append(id)
            }
            offset += length
        }
        if version == .ipfix && offset != end {
            return .malformed("IPFIX message: \(end - offset) bytes after the last set")
        }
        return .packet(packet)
    }

    struct Problem: Error {
        let text: String
    }

    /// The records of a template or options template set (its body, after the set header).
    static func records(_ set: UnsafeRawBufferPointer, version: Version, options: Bool) -> Result<[Change], Problem> {
        var changes: [Change] = []
        var offset = 0
        // Each record's fixed part: ID and field count (v9 options: ID, scope and option lengths).
        let fixed = options ? 6 : 4
        while set.count - offset >= 4 {
            let id = u16(set, offset)
            let count = Int(u16(set, offset + 2))
            if version == .ipfix && count == 0 {
                // A withdrawal: ID and a field count of 0, nothing else (RFC 7011, 8.1).
                if id == (options ? 3 : 2) {
                    changes.append(.withdrawnAll(options: options))
                } else if id >= 256 {
                    changes.append(.withdrawn(id: id, options: options))
                } else {
                    return .failure(Problem(text: "withdrawal of template ID \(id) (below 256)"))
                }
                offset += 4
                continue
            }
            // Padding: what is left is shorter than a record, or zeros where an ID would be.
            if id == 0 && set[offset...].allSatisfy({ $0 == 0 }) { break }
            guard set.count - offset >= fixed else { break }
            guard id >= 256 else { return .failure(Problem(text: "template ID \(id) (template IDs start at 256)")) }
            var length = fixed
            switch (version, options) {
            case (.v9, false):
                length += 4 * count
            case (.v9, true):
                // ID, scope length and option length in bytes, then the field specifiers.
                let scope = count, option = Int(u16(set, offset + 4))
                guard scope % 4 == 0, option % 4 == 0, scope + option > 0 else {
                    return .failure(Problem(text: "options template \(id): scope length \(scope) and option length \(option) must be multiples of 4, not both 0"))
                }
                length += scope + option
            case (.ipfix, _):
                // Field specifiers of 4 bytes, 8 with an enterprise number (the type's top bit).
                if options {
                    let scope = Int(u16(set, offset + 4))
                    guard scope >= 1, scope <= count else {
                        return .failure(Problem(text: "options template \(id): scope field count \(scope) of \(count) fields"))
                    }
                }
                for _ in 0..<count {
                    guard offset + length + 4 <= set.count else {
                        return .failure(Problem(text: "template \(id): \(count) fields run past the set"))
                    }
                    length += u16(set, offset + length) & 0x8000 != 0 ? 8 : 4
                }
            }
            guard offset + length <= set.count else {
                return .failure(Problem(text: "template \(id): \(length) bytes run past the set"))
            }
            changes.append(.defined(Template(id: id, options: options, record: Array(set[offset..<(offset + length)]))))
            offset += length
        }
        return .success(changes)
    }

    static func u16(_ bytes: UnsafeRawBufferPointer, _ offset: Int) -> UInt16 {
        UInt16(bytes[offset]) << 8 | UInt16(bytes[offset + 1])
    }

    static func u32(_ bytes: UnsafeRawBufferPointer, _ offset: Int) -> UInt32 {
        UInt32(u16(bytes, offset)) << 16 | UInt32(u16(bytes, offset + 2))
    }
}

/// The latest templates of each exporter: (exporter address, version, observation domain or
/// source ID) to its templates and options templates by ID, as the exporter last defined them;
/// withdrawals (IPFIX) followed. Bounded: at most `maximumExporters` exporters (the one seen
/// longest ago goes first) and `maximumTemplates` templates each (a new one beyond is refused),
/// each counted.
package struct FlowTemplateCache: Sendable {
    package struct Exporter: Hashable, Sendable {
        package var address: IPAddress
        package var version: FlowExport.Version
        package var domain: UInt32

        package init(address: IPAddress, version: FlowExport.Version, domain: UInt32) {
            self.address = address
            self.version = version
            self.domain = domain
        }
    }

    struct Key: Hashable {
        var id: UInt16
        var options: Bool
    }

    struct Entry {
        var templates: [Key: FlowExport.Template] = [:]
        /// The last packet's header fields, for the replayed packets' headers.
        var sequence: UInt32 = 0
        var exportTime: UInt32 = 0
        var uptime: UInt32 = 0
        var lastSeen: UInt64 = 0
    }

    package struct Counters: Equatable, Sendable {
        package var defined: UInt64 = 0
        package var redefined: UInt64 = 0
        package var withdrawn: UInt64 = 0
        /// Exporters forgotten to make room for a new one.
        package var exportersEvicted: UInt64 = 0
        /// Templates refused: the exporter already had `maximumTemplates`.
        package var templatesRefused: UInt64 = 0
    }

    package let maximumExporters: Int
    package let maximumTemplates: Int
    private var entries: [Exporter: Entry] = [:]
    private var clock: UInt64 = 0
    package private(set) var counters = Counters()

    package init(maximumExporters: Int = 65_536, maximumTemplates: Int = 256) {
        precondition(maximumExporters > 0 && maximumTemplates > 0)
        self.maximumExporters = maximumExporters
        self.maximumTemplates = maximumTemplates
    }

    package var exporterCount: Int { entries.count }
    package var templateCount: Int { entries.values.reduce(0) { $0 + $1.templates.count } }

    /// Takes in what one packet from `address` says; returns whether the exporter's templates
    /// changed (a template defined anew or differently, or withdrawn).
    @discardableResult
    package mutating func apply(_ packet: FlowExport.Packet, from address: IPAddress) -> Bool {
        let exporter = Exporter(address: address, version: packet.version, domain: packet.domain)
        clock += 1
        if entries[exporter] == nil {
            // Nothing to remember from a packet of data alone.
            guard packet.changes.contains(where: { if case .defined = $0 { true } else { false } }) else { return false }
            if entries.count >= maximumExporters, let oldest = entries.min(by: { $0.value.lastSeen < $1.value.lastSeen })?.key {
                entries[oldest] = nil
                counters.exportersEvicted += 1
            }
            entries[exporter] = Entry()
        }
        var entry = entries[exporter]!
        entry.sequence = packet.sequence
        entry.exportTime = packet.exportTime
        entry.uptime = packet.uptime
        entry.lastSeen = clock
        var changed = false
        for change in packet.changes {
            switch change {
            case .defined(let template):
                let key = Key(id: template.id, options: template.options)
                // A template and an options template share the ID space: the newer replaces.
                let other = Key(id: template.id, options: !template.options)
                if entry.templates[other] != nil {
                    entry.templates[other] = nil
                }
                switch entry.templates[key] {
                case template?:
                    continue
                case nil where entry.templates.count >= maximumTemplates:
                    counters.templatesRefused += 1
                    continue
                case nil:
                    counters.defined += 1
                case _?:
                    counters.redefined += 1
                }
                entry.templates[key] = template
                changed = true
            case .withdrawn(let id, let options):
                if entry.templates.removeValue(forKey: Key(id: id, options: options)) != nil {
                    counters.withdrawn += 1
                    changed = true
                }
            case .withdrawnAll(let options):
                let gone = entry.templates.keys.filter { $0.options == options }
                for key in gone { entry.templates[key] = nil }
                counters.withdrawn += UInt64(gone.count)
                changed = changed || !gone.isEmpty
            }
        }
        entries[exporter] = entry
        return changed
    }

    /// Takes in a packet a previous process's cache replayed (a restart hands them over), as
    /// ``apply(_:from:)`` does, without counting what it defines: they were counted there.
    package mutating func restore(_ packet: FlowExport.Packet, from address: IPAddress) {
        let counted = counters
        apply(packet, from: address)
        counters = counted
    }

    /// The exporter's templates, by ID (templates and options templates).
    package func templates(of exporter: Exporter) -> [FlowExport.Template] {
        (entries[exporter]?.templates.values).map { $0.sorted { ($0.id, $0.options ? 1 : 0) < ($1.id, $1.options ? 1 : 0) } } ?? []
    }

    /// Every exporter whose templates are kept.
    package var allExporters: [Exporter] { Array(entries.keys) }

    /// The exporters of `address` (one per version and domain).
    package func exporters(at address: IPAddress) -> [Exporter] {
        entries.keys.filter { $0.address == address }.sorted { ($0.version.rawValue, $0.domain) < ($1.version.rawValue, $1.domain) }
    }

    /// Packets that carry all of the exporter's templates, each at most `maximumSize` bytes
    /// (template sets and options template sets, records never split), headed as the exporter's
    /// last packet was: the same domain, times and sequence number (a template-only packet does
    /// not advance an IPFIX sequence; for v9 a collector may count it as one packet out of order).
    package func replay(_ exporter: Exporter, maximumSize: Int = 1400) -> [[UInt8]] {
        guard let entry = entries[exporter], !entry.templates.isEmpty else { return [] }
        let version = exporter.version
        var packets: [[UInt8]] = []
        var body: [UInt8] = []
        var records = 0
        func flush() {
            guard !body.isEmpty else { return }
            var packet: [UInt8] = []
            packet.reserveCapacity(version.headerLength + body.count)
            switch version {
            case .v9:
                Self.put16(&packet, 9)
                Self.put16(&packet, UInt16(records))
                Self.put32(&packet, entry.uptime)
                Self.put32(&packet, entry.exportTime)
                Self.put32(&packet, entry.sequence)
                Self.put32(&packet, exporter.domain)
            case .ipfix:
                Self.put16(&packet, 10)
                Self.put16(&packet, UInt16(version.headerLength + body.count))
                Self.put32(&packet, entry.exportTime)
                Self.put32(&packet, entry.sequence)
                Self.put32(&packet, exporter.domain)
            }
            packets.append(packet + body)
            body = []
            records = 0
        }
        for options in [false, true] {
            let templates = templates(of: exporter).filter { $0.options == options }
            var set: [UInt8] = []
            func closeSet() {
                guard !set.isEmpty else { return }
                var header: [UInt8] = []
                Self.put16(&header, options ? version.optionsSet : version.templateSet)
                Self.put16(&header, UInt16(4 + set.count))
                body += header + set
                set = []
            }
            for template in templates {
                if version.headerLength + body.count + 4 + set.count + template.record.count > maximumSize {
                    closeSet()
                    flush()
                }
                set += template.record
                records += 1
            }
            closeSet()
        }
        flush()
        return packets
    }

    static func put16(_ bytes: inout [UInt8], _ value: UInt16) {
        bytes.append(UInt8(value >> 8))
        bytes.append(UInt8(value & 0xff))
    }

    static func put32(_ bytes: inout [UInt8], _ value: UInt32) {
        put16(&bytes, UInt16(value >> 16))
        put16(&bytes, UInt16(value & 0xffff))
    }
}
