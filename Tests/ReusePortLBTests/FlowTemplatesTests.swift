// SPDX-License-Identifier: Apache-2.0
import Testing
import TestSupport
@testable import ReusePortLB

/// NetFlow v9 and IPFIX packets read as far as templates go, and the cache of each exporter's
/// latest templates with the packets that replay them.
@Suite("Flow templates")
struct FlowTemplatesTests {

    @Test("NetFlow v9: header, template and options template records as sent, data set IDs, padding after a flowset")
    func v9Packet() throws {
        let t256 = NetFlowBytes.template(256, NetFlowBytes.fields4)
        let t300 = NetFlowBytes.template(300, [(1, 4)])
        // Options template 400: scope length 4 (one field), option length 8 (two fields).
        let o400 = NetFlowBytes.be16([400, 4, 8, 1, 4, 34, 4, 36, 2])
        let packet = NetFlowBytes.v9(count: 4, sets: [NetFlowBytes.set(0, t256 + t300), NetFlowBytes.set(1, o400 + [0, 0]), NetFlowBytes.set(256, [UInt8](repeating: 1, count: 12))])
        guard case .packet(let parsed) = FlowExport.parse(packet) else { Issue.record("\(FlowExport.parse(packet))"); return }
        #expect(parsed.version == .v9 && parsed.domain == 7 && parsed.sequence == 42 && parsed.uptime == 1000 && parsed.exportTime == 1_700_000_000)
        #expect(parsed.changes == [
            .defined(.init(id: 256, options: false, record: t256)),
            .defined(.init(id: 300, options: false, record: t300)),
            .defined(.init(id: 400, options: true, record: o400)),
        ])
        #expect(parsed.dataSets == [256])
    }

    @Test("IPFIX: enterprise fields, an options template with its scope count, withdrawals of one and of all")
    func ipfixPacket() throws {
        // Field 2 of enterprise 29305, then field 8.
        let t256 = NetFlowBytes.be16([256, 2, 0x8002, 4]) + NetFlowBytes.be32(29305) + NetFlowBytes.be16([8, 4])
        let o257 = NetFlowBytes.be16([257, 2, 1, 149, 4, 41, 8])
        let packet = NetFlowBytes.ipfix(sets: [NetFlowBytes.set(2, t256), NetFlowBytes.set(3, o257), NetFlowBytes.set(2, NetFlowBytes.be16([258, 0])), NetFlowBytes.set(3, NetFlowBytes.be16([3, 0]))])
        guard case .packet(let parsed) = FlowExport.parse(packet) else { Issue.record("\(FlowExport.parse(packet))"); return }
        #expect(parsed.version == .ipfix && parsed.domain == 7 && parsed.sequence == 42)
        #expect(parsed.changes == [
            .defined(.init(id: 256, options: false, record: t256)),
            .defined(.init(id: 257, options: true, record: o257)),
            .withdrawn(id: 258, options: false),
            .withdrawnAll(options: true),
        ])
        #expect(parsed.dataSets.isEmpty)
    }

    @Test("Not flow export: NetFlow v5, sFlow v5, one byte, anything else")
    func notFlowExport() {
        let v5 = NetFlowBytes.be16([5, 1]) + [UInt8](repeating: 0, count: 70)
        let sflow = NetFlowBytes.be32(5) + NetFlowBytes.be32(1) + [UInt8](repeating: 0, count: 20)
        for bytes in [v5, sflow, [9], Array("hello".utf8)] {
            #expect(FlowExport.parse(bytes) == .notFlowExport, "\(bytes)")
        }
    }

    static let malformed: [(String, [UInt8], String)] = [
        ("v9 header cut", NetFlowBytes.be16([9, 1]) + [0, 0, 0], "shorter than the NetFlow v9 header"),
        ("IPFIX length beyond the datagram", NetFlowBytes.ipfix(sets: [], extra: 8), "IPFIX message length 24 with 16 bytes"),
        ("set length below 4", NetFlowBytes.v9(sets: [NetFlowBytes.be16([0, 2])]), "length 2, below its own header's 4"),
        ("set past the end", NetFlowBytes.v9(sets: [NetFlowBytes.be16([0, 40]) + NetFlowBytes.template(256, [(8, 4)])]), "length 40 runs past"),
        ("fields past the set", NetFlowBytes.v9(sets: [NetFlowBytes.set(0, NetFlowBytes.be16([256, 3, 8, 4]))]), "template 256: 16 bytes run past the set"),
        ("template ID below 256", NetFlowBytes.v9(sets: [NetFlowBytes.set(0, NetFlowBytes.template(255, [(8, 4)]))]), "template ID 255"),
        ("IPFIX options without a scope", NetFlowBytes.ipfix(sets: [NetFlowBytes.set(3, NetFlowBytes.be16([257, 1, 0, 8, 4]))]), "scope field count 0 of 1"),
        ("v9 options lengths not of fields", NetFlowBytes.v9(sets: [NetFlowBytes.set(1, NetFlowBytes.be16([400, 3, 4, 0, 0, 0]))]), "multiples of 4"),
        ("IPFIX withdrawal below 256", NetFlowBytes.ipfix(sets: [NetFlowBytes.set(2, NetFlowBytes.be16([100, 0]))]), "withdrawal of template ID 100"),
        ("IPFIX bytes after the last set", NetFlowBytes.ipfix(sets: [NetFlowBytes.set(256, [1, 2, 3, 4]), [0, 0]]), "2 bytes after the last set"),
    ]

    @Test("Malformed v9 and IPFIX packets: said what is wrong, never a crash", arguments: malformed)
    func malformedPackets(label: String, bytes: [UInt8], problem: String) {
        guard case .malformed(let text) = FlowExport.parse(bytes) else { Issue.record("\(label): \(FlowExport.parse(bytes))"); return }
        #expect(text.contains(problem), "\(label): \(text)")
    }

    @Test("Every prefix and every one-byte change of a valid packet parses without a crash")
    func truncatedAndFlipped() {
        let packet = NetFlowBytes.ipfix(sets: [NetFlowBytes.set(2, NetFlowBytes.be16([256, 2, 0x8002, 4]) + NetFlowBytes.be32(1) + NetFlowBytes.be16([8, 4])), NetFlowBytes.set(3, NetFlowBytes.be16([257, 2, 1, 149, 4, 41, 8])), NetFlowBytes.set(256, [1, 2, 3, 4])])
        for length in 0...packet.count { _ = FlowExport.parse(Array(packet[0..<length])) }
        for index in packet.indices {
            for value: UInt8 in [0, 1, 0x7f, 0x80, 0xff] {
                var changed = packet
                changed[index] = value
                _ = FlowExport.parse(changed)
            }
        }
    }

    static func parsed(_ bytes: [UInt8]) -> FlowExport.Packet {
        guard case .packet(let packet) = FlowExport.parse(bytes) else { fatalError("\(FlowExport.parse(bytes))") }
        return packet
    }

    @Test("The cache keeps each exporter's latest templates: a repeat changes nothing, a redefinition and a withdrawal do, data alone makes no entry")
    func cacheFollowsTheExporter() {
        var cache = FlowTemplateCache()
        let address = IPAddress("198.18.9.1")!
        let exporter = FlowTemplateCache.Exporter(address: address, version: .ipfix, domain: 7)
        func apply(_ bytes: [UInt8]) -> Bool { cache.apply(Self.parsed(bytes), from: address) }
        #expect(!apply(NetFlowBytes.ipfix(sets: [NetFlowBytes.set(256, [1, 2, 3, 4])])))
        #expect(cache.exporterCount == 0)
        let t256 = NetFlowBytes.template(256, NetFlowBytes.fields4), t257 = NetFlowBytes.template(257, [(1, 4)])
        #expect(apply(NetFlowBytes.ipfix(sets: [NetFlowBytes.set(2, t256 + t257)])))
        #expect(cache.templates(of: exporter).map(\.id) == [256, 257])
        #expect(!apply(NetFlowBytes.ipfix(sets: [NetFlowBytes.set(2, t256)])), "the same template again")
        let redefined = NetFlowBytes.template(256, [(8, 4)])
        #expect(apply(NetFlowBytes.ipfix(sets: [NetFlowBytes.set(2, redefined)])))
        #expect(cache.templates(of: exporter).first?.record == redefined)
        #expect(apply(NetFlowBytes.ipfix(sets: [NetFlowBytes.set(2, NetFlowBytes.be16([257, 0]))])))
        #expect(cache.templates(of: exporter).map(\.id) == [256])
        // An options template with the ID of a template replaces it (one ID space).
        let o256 = NetFlowBytes.be16([256, 2, 1, 149, 4, 41, 8])
        #expect(apply(NetFlowBytes.ipfix(sets: [NetFlowBytes.set(3, o256)])))
        #expect(cache.templates(of: exporter) == [.init(id: 256, options: true, record: o256)])
        #expect(apply(NetFlowBytes.ipfix(sets: [NetFlowBytes.set(3, NetFlowBytes.be16([3, 0]))])))
        #expect(cache.templates(of: exporter).isEmpty)
        // Another domain, another version: other exporters at the same address.
        cache.apply(Self.parsed(NetFlowBytes.ipfix(domain: 8, sets: [NetFlowBytes.set(2, t256)])), from: address)
        cache.apply(Self.parsed(NetFlowBytes.v9(domain: 7, sets: [NetFlowBytes.set(0, t256)])), from: address)
        #expect(cache.exporters(at: address).map { "\($0.version.rawValue)/\($0.domain)" } == ["9/7", "10/7", "10/8"])
        #expect(cache.counters == .init(defined: 5, redefined: 1, withdrawn: 2, exportersEvicted: 0, templatesRefused: 0))
    }

    @Test("Bounded: the exporter seen longest ago makes room for a new one; templates beyond the limit are refused; each counted")
    func cacheBounds() {
        var cache = FlowTemplateCache(maximumExporters: 2, maximumTemplates: 2)
        let addresses = (1...3).map { IPAddress("198.18.9.\($0)")! }
        let packet = Self.parsed(NetFlowBytes.v9(sets: [NetFlowBytes.set(0, NetFlowBytes.template(256, [(8, 4)]))]))
        cache.apply(packet, from: addresses[0])
        cache.apply(packet, from: addresses[1])
        cache.apply(Self.parsed(NetFlowBytes.v9(sets: [NetFlowBytes.set(256, [1, 2, 3, 4])])), from: addresses[0])  // seen again
        cache.apply(packet, from: addresses[2])
        #expect(cache.exporterCount == 2 && cache.exporters(at: addresses[1]).isEmpty && !cache.exporters(at: addresses[0]).isEmpty)
        cache.apply(Self.parsed(NetFlowBytes.v9(sets: [NetFlowBytes.set(0, NetFlowBytes.template(257, [(8, 4)]) + NetFlowBytes.template(258, [(8, 4)]))])), from: addresses[0])
        #expect(cache.templates(of: .init(address: addresses[0], version: .v9, domain: 7)).map(\.id) == [256, 257])
        #expect(cache.counters.exportersEvicted == 1 && cache.counters.templatesRefused == 1)
    }

    @Test("Replayed packets parse back to the same templates, with the exporter's header, split at the size limit without splitting a record", arguments: [FlowExport.Version.v9, .ipfix])
    func replay(version: FlowExport.Version) {
        var cache = FlowTemplateCache()
        let address = IPAddress("2001:db8::9")!
        let templates = (0..<40).map { NetFlowBytes.template(256 + $0, Array(repeating: (8, 4), count: 1 + $0 % 5)) }
        let options = version == .v9 ? NetFlowBytes.be16([400, 4, 8, 1, 4, 34, 4, 36, 2]) : NetFlowBytes.be16([400, 2, 1, 149, 4, 41, 8])
        let sets = [NetFlowBytes.set(Int(version.templateSet), templates.flatMap { $0 }), NetFlowBytes.set(Int(version.optionsSet), options)]
        let packet = version == .v9 ? NetFlowBytes.v9(domain: 3, sequence: 99, sets: sets) : NetFlowBytes.ipfix(domain: 3, sequence: 99, sets: sets)
        cache.apply(Self.parsed(packet), from: address)
        let exporter = FlowTemplateCache.Exporter(address: address, version: version, domain: 3)
        let replayed = cache.replay(exporter, maximumSize: 200)
        #expect(replayed.count > 1 && replayed.allSatisfy { $0.count <= 200 }, "\(replayed.map(\.count))")
        var seen: [FlowExport.Template] = []
        for bytes in replayed {
            let parsed = Self.parsed(bytes)
            #expect(parsed.domain == 3 && parsed.sequence == 99 && parsed.dataSets.isEmpty)
            if version == .v9 { #expect(Int(bytes[2]) << 8 | Int(bytes[3]) == parsed.changes.count, "v9 count: its records") }
            for change in parsed.changes { if case .defined(let template) = change { seen.append(template) } }
        }
        #expect(seen == cache.templates(of: exporter).filter { !$0.options } + cache.templates(of: exporter).filter(\.options))
        #expect(seen.count == 41)
        #expect(cache.replay(FlowTemplateCache.Exporter(address: address, version: version, domain: 4)).isEmpty)
    }
}
