// SPDX-License-Identifier: Apache-2.0

/// Counts the data records of NetFlow v9 and IPFIX datagrams the way a collector decodes them:
/// a data set decodes only with its template (from the exporter, or from the group's
/// ``FlowTemplateStore``), and one without is dropped and counted. The sample collector's
/// `--flows`; records are counted, not stored.
package struct FlowDecoder {
    package struct Counters: Equatable, Sendable {
        /// Datagrams of version 9 or 10, and of neither.
        package var packets: UInt64 = 0
        package var otherPackets: UInt64 = 0
        /// Data records decoded.
        package var records: UInt64 = 0
        /// Template and options template records received.
        package var templateRecords: UInt64 = 0
        /// Data sets dropped: no template known for their ID.
        package var unknownTemplateSets: UInt64 = 0
        /// Of those, the records a v9 header's count says were in them (IPFIX does not say).
        package var unknownTemplateRecords: UInt64 = 0
        /// Templates obtained from the store for an exporter this collector had not heard them from.
        package var templatesFromStore: UInt64 = 0
        /// Datagrams whose sets do not add up, and data sets their template cannot decode.
        package var malformed: UInt64 = 0
    }

    /// A template's record layout: the field lengths (65535: variable, IPFIX).
    package struct Layout: Equatable, Sendable {
        package var lengths: [UInt16]
        package var fixedLength: Int? { lengths.contains(65535) ? nil : lengths.reduce(0) { $0 + Int($1) } }

        /// The layout of a template or options template record; nil when it says nothing usable.
        package init?(record: [UInt8], options: Bool, version: FlowExport.Version) {
            func u16(_ offset: Int) -> Int { Int(record[offset]) << 8 | Int(record[offset + 1]) }
            guard record.count >= 4 else { return nil }
            var offset: Int
            var count: Int
            switch (version, options) {
            case (.v9, true):
                guard record.count >= 6 else { return nil }
                count = (u16(2) + u16(4)) / 4
                offset = 6
            case (.ipfix, true):
                count = u16(2)
                offset = 6
            case (_, false):
                count = u16(2)
                offset = 4
            }
            var lengths: [UInt16] = []
            for _ in 0..<count {
                guard offset + 4 <= record.count else { return nil }
                let type = u16(offset)
                lengths.append(UInt16(u16(offset + 2)))
                offset += version == .ipfix && type & 0x8000 != 0 ? 8 : 4
            }
            guard !lengths.isEmpty, lengths.contains(where: { $0 > 0 }) else { return nil }
            self.lengths = lengths
        }

        /// How many records `body` (a data set after its header) holds; nil when a variable-length
        /// field runs past it. Trailing bytes shorter than a record are padding.
        package func records(in body: UnsafeRawBufferPointer) -> Int? {
            if let fixedLength { return body.count / fixedLength }
            // The shortest record: every variable-length field empty (one length byte). What is
            // left shorter than that is padding (RFC 7011, 3.3.1).
            let shortest = lengths.reduce(0) { $0 + ($1 == 65535 ? 1 : Int($1)) }
            var offset = 0
            var count = 0
            records: while body.count - offset >= shortest {
                var end = offset
                for length in lengths {
                    var field = Int(length)
                    if length == 65535 {
                        guard end < body.count else { break records }
                        field = Int(body[end])
                        end += 1
                        if field == 255 {
                            guard end + 2 <= body.count else { return nil }
                            field = Int(body[end]) << 8 | Int(body[end + 1])
                            end += 2
                        }
                    }
                    end += field
                    guard end <= body.count else { break records }
                }
                count += 1
                offset = end
            }
            return count
        }
    }

    struct Key: Hashable {
        var exporter: FlowTemplateCache.Exporter
        var id: UInt16
    }

    struct Known {
        var layout: Layout
        /// When it was last read from the exporter or the store.
        var checked: UInt64
    }

    package private(set) var counters = Counters()
    private var known: [Key: Known] = [:]
    /// Each exporter's last datagram, and when it came back after a silence.
    private var lastSeen: [FlowTemplateCache.Exporter: UInt64] = [:]
    private var returned: [FlowTemplateCache.Exporter: UInt64] = [:]
    package let store: FlowTemplateStore?
    /// An exporter silent this long may have sent templates to another member meanwhile: its
    /// templates are read again from the store at their next use.
    package let recheckAfter: UInt64

    package init(store: FlowTemplateStore?, recheckAfterNanoseconds: UInt64 = 1_000_000_000) {
        self.store = store
        recheckAfter = recheckAfterNanoseconds
    }

    /// Decodes one datagram from `address` received at `now` (nanoseconds, any monotonic clock).
    package mutating func decode(_ bytes: UnsafeRawBufferPointer, from address: IPAddress, now: UInt64) {
        guard let (version, domain) = FlowExport.header(bytes) else {
            counters.otherPackets += 1
            return
        }
        counters.packets += 1
        let exporter = FlowTemplateCache.Exporter(address: address, version: version, domain: domain)
        if let last = lastSeen[exporter], now &- last > recheckAfter { returned[exporter] = now }
        lastSeen[exporter] = now
        if FlowExport.needsParsing(bytes) {
            guard case .packet(let packet) = FlowExport.parse(bytes) else {
                counters.malformed += 1
                return
            }
            // The store learns from this parse (a datagram of data alone changes nothing there).
            store?.learn(packet, from: address)
            for change in packet.changes {
                switch change {
                case .defined(let template):
                    counters.templateRecords += 1
                    if let layout = Layout(record: template.record, options: template.options, version: version) {
                        known[Key(exporter: exporter, id: template.id)] = Known(layout: layout, checked: now)
                    } else {
                        counters.malformed += 1
                    }
                case .withdrawn(let id, _):
                    counters.templateRecords += 1
                    known[Key(exporter: exporter, id: id)] = nil
                case .withdrawnAll:
                    counters.templateRecords += 1
                    for key in known.keys where key.exporter == exporter { known[key] = nil }
                }
            }
        }
        var decodedHere = 0
        var templatesHere = 0
        var unknownHere = 0
        var offset = version.headerLength
        var end = bytes.count
        if version == .ipfix { end = min(end, Int(FlowExport.u16(bytes, 2))) }
        while end - offset >= 4 {
            let id = FlowExport.u16(bytes, offset)
            let length = Int(FlowExport.u16(bytes, offset + 2))
            guard length >= 4, offset + length <= end else { break }
            let body = UnsafeRawBufferPointer(rebasing: bytes[(offset + 4)..<(offset + length)])
            offset += length
            if id == version.templateSet || id == version.optionsSet {
                templatesHere += countTemplateRecords(body, version: version, options: id == version.optionsSet)
                continue
            }
            guard id >= 256 else { continue }
            guard let layout = layout(Key(exporter: exporter, id: id), now: now) else {
                counters.unknownTemplateSets += 1
                unknownHere += 1
                continue
            }
            guard let count = layout.records(in: body) else {
                counters.malformed += 1
                continue
            }
            counters.records += UInt64(count)
            decodedHere += count
        }
        if version == .v9, unknownHere > 0 {
            // The header's count is of every record in the packet, templates included.
            let said = Int(FlowExport.u16(bytes, 2))
            let unknown = said - templatesHere - decodedHere
            if unknown > 0 { counters.unknownTemplateRecords += UInt64(unknown) }
        }
    }

    /// The template's layout, from this decoder, or the store when this decoder has none or the
    /// exporter came back after a silence (another member may have heard a newer one).
    mutating func layout(_ key: Key, now: UInt64) -> Layout? {
        let local = known[key]
        if let local, local.checked >= (returned[key.exporter] ?? 0) { return local.layout }
        guard let store else { return local?.layout }
        if let stored = store.template(exporter: key.exporter.address, version: key.exporter.version.rawValue,
                                       domain: key.exporter.domain, id: key.id),
           let layout = Layout(record: stored.record, options: stored.options, version: key.exporter.version)
        {
            if local?.layout != layout { counters.templatesFromStore += 1 }
            known[key] = Known(layout: layout, checked: now)
            return layout
        }
        if var local {
            local.checked = now
            known[key] = local
            return local.layout
        }
        return nil
    }

    /// Records in a template set's body (for the v9 header count's share of templates).
    func countTemplateRecords(_ body: UnsafeRawBufferPointer, version: FlowExport.Version, options: Bool) -> Int {
        if case .success(let changes) = FlowExport.records(body, version: version, options: options) { return changes.count }
        return 0
    }
}
