// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
@testable import ReusePortLB
import CLibBPF

#if canImport(Glibc)
import Glibc
#endif

/// Decoding as a collector does: record layouts from templates, data sets counted, a data set
/// without its template dropped and counted.
@Suite("Flow decoding (sample collector)")
struct FlowDecoderTests {
    typealias T = NetFlowBytes
    static let exporter = IPAddress("192.0.2.9")!

    static func decode(_ decoder: inout FlowDecoder, _ packets: [[UInt8]], now: UInt64 = 1) {
        for packet in packets { packet.withUnsafeBytes { decoder.decode($0, from: exporter, now: now) } }
    }

    @Test("v9: records decode once the template came; before it, the set is dropped and the header's count says how many records")
    func v9Records() {
        var decoder = FlowDecoder(store: nil)
        let data = T.set(256, [UInt8](repeating: 1, count: 12 * 3 + 2))  // 3 records of 12 bytes, 2 bytes of padding
        Self.decode(&decoder, [T.v9(count: 3, sets: [data])])
        #expect(decoder.counters.records == 0 && decoder.counters.unknownTemplateSets == 1 && decoder.counters.unknownTemplateRecords == 3)
        Self.decode(&decoder, [T.v9(count: 4, sets: [T.set(0, T.template(256, T.fields4)), data])])
        #expect(decoder.counters.records == 3 && decoder.counters.templateRecords == 1 && decoder.counters.unknownTemplateSets == 1)
        // Another domain of the same address is another exporter.
        Self.decode(&decoder, [T.v9(domain: 8, count: 3, sets: [data])])
        #expect(decoder.counters.unknownTemplateSets == 2 && decoder.counters.packets == 3 && decoder.counters.malformed == 0)
        // v5 and sFlow are neither: counted apart.
        Self.decode(&decoder, [[0, 5] + [UInt8](repeating: 0, count: 46)])
        #expect(decoder.counters.otherPackets == 1)
    }

    @Test("IPFIX: variable-length fields (short and long form), enterprise fields, options templates, a withdrawal")
    func ipfixRecords() {
        var decoder = FlowDecoder(store: nil)
        // Template 300: field 8 (4 bytes), then a variable-length field; 301: enterprise field (2 bytes), field 7 (2).
        let t300 = T.be16([300, 2, 8, 4, 82, 65535])
        let t301 = T.be16([301, 2, 0x8001, 2]) + T.be32(29305) + T.be16([7, 2])
        let o302 = T.be16([302, 2, 1, 149, 4, 41, 8])
        let records300: [UInt8] = [1, 2, 3, 4, 3, 0x61, 0x62, 0x63] + [5, 6, 7, 8, 255, 0, 2, 0x61, 0x62]
        let packet = T.ipfix(sets: [T.set(2, t300 + t301), T.set(3, o302), T.set(300, records300),
                                    T.set(301, [UInt8](repeating: 0, count: 8)), T.set(302, [UInt8](repeating: 0, count: 12))])
        Self.decode(&decoder, [packet])
        #expect(decoder.counters.records == 2 + 2 + 1, "\(decoder.counters)")
        #expect(decoder.counters.templateRecords == 3 && decoder.counters.malformed == 0)
        Self.decode(&decoder, [T.ipfix(sets: [T.set(2, T.be16([300, 0]))]), T.ipfix(sets: [T.set(300, records300)])])
        #expect(decoder.counters.records == 5 && decoder.counters.unknownTemplateSets == 1, "withdrawn: \(decoder.counters)")
        // A template of variable-length fields only: padding zeros after the records are not records.
        let t303 = T.be16([303, 2, 82, 65535, 83, 65535])
        let before = decoder.counters.records
        Self.decode(&decoder, [T.ipfix(sets: [T.set(2, t303), T.set(303, [2, 0x61, 0x62, 0, 0, 0, 0])])])
        #expect(decoder.counters.records == before + 2, "two records (the second of two empty fields) and one byte of padding: \(decoder.counters)")
        // A variable-length length running past the set is malformed, not a crash.
        Self.decode(&decoder, [T.ipfix(sets: [T.set(2, t300)]), T.ipfix(sets: [T.set(300, [1, 2, 3, 4, 255, 0])])])
        #expect(decoder.counters.malformed == 1)
    }

    @Test("Layouts: v9 options templates count scope and option fields; a template of zero-length fields is refused")
    func layouts() {
        let o400 = T.be16([400, 4, 8, 1, 4, 34, 4, 36, 2])
        #expect(FlowDecoder.Layout(record: o400, options: true, version: .v9)?.lengths == [4, 4, 2])
        #expect(FlowDecoder.Layout(record: T.template(256, [(1, 0)]), options: false, version: .v9) == nil)
        #expect(FlowDecoder.Layout(record: T.be16([256, 3, 1, 4]), options: false, version: .v9) == nil, "fields past the record")
    }
}

/// The group's template store: a pinned map members write and read.
@Suite("Flow template store", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct FlowTemplateStoreTests {
    typealias T = NetFlowBytes

    func member(_ port: UInt16, slot: Int = 0, steering: SteeringPreference = .ebpf) throws -> ReusePortMember {
        try ReusePortMember(joining: SocketAddress(ip: IPAddress("127.0.0.1")!, port: port), slot: .index(slot),
                            options: GroupOptions(policy: .sourceIP, capacity: 2, steering: steering))
    }

    @Test("Two members share one store: definitions, redefinitions and IPFIX withdrawals (of one, of all options templates) seen by the other; the last leave removes it")
    func sharedStore() throws {
        let port = freePort()
        let first = try member(port, slot: 0)
        let second = try member(port, slot: 1)
        let writer = try FlowTemplateStore(member: first)
        let reader = try FlowTemplateStore(member: second)
        #expect(writer.path == reader.path && FileManager.default.fileExists(atPath: writer.path))
        let exporter = IPAddress("2001:db8::7")!
        let t256 = T.template(256, T.fields4)
        #expect(T.v9(sets: [T.set(0, t256)]).withUnsafeBytes { writer.learn($0, from: exporter) } == 1)
        #expect(reader.template(exporter: exporter, version: 9, domain: 7, id: 256) == FlowTemplate(id: 256, options: false, record: t256))
        #expect(reader.template(exporter: exporter, version: 9, domain: 8, id: 256) == nil, "another domain")
        #expect(reader.template(exporter: IPAddress("2001:db8::8")!, version: 9, domain: 7, id: 256) == nil, "another exporter")
        // Data alone changes nothing; a redefinition replaces.
        #expect(T.v9(sets: [T.set(256, [UInt8](repeating: 0, count: 12))]).withUnsafeBytes { writer.learn($0, from: exporter) } == 0)
        let t256b = T.template(256, [(8, 4)])
        _ = T.v9(sets: [T.set(0, t256b)]).withUnsafeBytes { reader.learn($0, from: exporter) }
        #expect(writer.template(exporter: exporter, version: 9, domain: 7, id: 256)?.record == t256b)
        // IPFIX of an IPv4 exporter: two templates, an options template; withdraw one, then all options templates.
        let v4 = IPAddress("192.0.2.1")!
        let o300 = T.be16([300, 2, 1, 149, 4, 41, 8])
        _ = T.ipfix(sets: [T.set(2, T.template(257, T.fields4) + T.template(258, T.fields4)), T.set(3, o300)]).withUnsafeBytes { writer.learn($0, from: v4) }
        #expect(reader.templates(exporter: v4, version: 10, domain: 7).map(\.id) == [257, 258, 300])
        _ = T.ipfix(sets: [T.set(2, T.be16([258, 0]))]).withUnsafeBytes { reader.learn($0, from: v4) }
        _ = T.ipfix(sets: [T.set(3, T.be16([3, 0]))]).withUnsafeBytes { reader.learn($0, from: v4) }
        #expect(writer.templates(exporter: v4, version: 10, domain: 7).map(\.id) == [257])
        #expect(writer.counters.written == 4 && reader.counters.written == 1 && reader.counters.withdrawn == 2)
        #expect(writer.counters.failed == 0 && reader.counters.failed == 0)
        // Too large to keep: refused and counted.
        let huge = T.template(259, Array(repeating: (1, 4), count: 300))
        _ = T.v9(sets: [T.set(0, huge)]).withUnsafeBytes { writer.learn($0, from: v4) }
        #expect(writer.counters.refusedTooLarge == 1)
        first.leave()
        #expect(FileManager.default.fileExists(atPath: writer.path), "a member is left")
        second.leave()
        #expect(!FileManager.default.fileExists(atPath: writer.path), "the last leave removes the store with the group")
        #expect(!FileManager.default.fileExists(atPath: (writer.path as NSString).deletingLastPathComponent))
    }

    @Test("No store without a pinned eBPF group: a classic BPF member is told why and what to do")
    func needsEBPF() throws {
        let classic = try member(freePort(), steering: .classicBPF)
        defer { classic.leave() }
        #expect(throws: ReusePortError.self) { try FlowTemplateStore(member: classic) }
        do {
            _ = try FlowTemplateStore(member: classic)
        } catch {
            #expect(error.description.contains("classicBPF steering") && error.description.contains("join with eBPF steering"), "\(error)")
        }
    }

    @Test("collector --shared-templates without eBPF steering exits 2 naming why, before it says ready")
    func collectorRefuses() throws {
        let child = try Child("collector", ["127.0.0.1", String(freePort()), "0", "2", "--steering", "classicBPF", "--flows", "--shared-templates", "--duration", "5"])
        #expect(child.wait(seconds: 10) == 2)
        #expect(child.stderr.contains("--shared-templates: the group's flow template store cannot be opened: this member uses classicBPF steering"), "\(child.stderr)")
        #expect(!child.stderr.contains("ready"), "\(child.stderr)")
    }

    @Test("A pinned store of another shape is refused, naming the difference and the fix")
    func otherShape() throws {
        let joined = try member(freePort())
        defer { joined.leave() }
        let store = try FlowTemplateStore(member: joined)
        let path = store.path
        store.close()
        unlink(path)
        let other = bpf_map_create_wrapper(keySize: 24, valueSize: 64)
        try #require(other >= 0)
        defer { close(other) }
        try #require(bpf_obj_pin(other, path) == 0)
        do {
            _ = try FlowTemplateStore(member: joined)
            Issue.record("opened a store of value size 64")
        } catch {
            #expect(error.description.contains("value size 64") && error.description.contains("stop every member"), "\(error)")
        }
    }
}

/// A hash map of another shape, for the refusal test.
private func bpf_map_create_wrapper(keySize: UInt32, valueSize: UInt32) -> Int32 {
    bpf_map_create(BPF_MAP_TYPE_HASH, "rplb_other", keySize, valueSize, 16, nil)
}

/// A ReusePortLB group of sample collectors decoding NetFlow v9 and IPFIX from 40 exporters
/// whose templates are sent once: mid-run one collector is killed (kill -9), then one is added.
/// With the shared store every record sent to a living collector decodes; without it the
/// exporters that changed collector lose their records until templates come again (never here).
@Suite("Flow template store: a group of sample collectors through a kill -9 and a join", .serialized,
       .enabled(if: Privileges.enabled, Privileges.reason))
struct FlowTemplateGroupTests {
    struct Outcome {
        var records = 0
        var decoded = 0
        var toKilled = 0
        var reports: [[String: Any]] = []
        var unknownSets: Int { reports.map { $0.object("flows").int("unknown_template_sets") }.reduce(0, +) }
        var fromStore: Int { reports.map { $0.object("flows").int("templates_from_store") }.reduce(0, +) }
    }

    static func run(_ version: String, shared: Bool) throws -> Outcome {
        let port = freePort()
        let options = ["--rcvbuf", "8388608", "--flows"] + (shared ? ["--shared-templates"] : [])
        func collector(_ slot: Int) throws -> Child {
            let child = try Child("collector", ["127.0.0.1", String(port), String(slot), "3"] + options)
            try child.waitFor("ready")
            return child
        }
        let first = try [collector(0), collector(1)]
        // 40 exporters, 150 packets each of 10 records at 2,000 packets/s: 3 s; templates in each
        // exporter's first packet only.
        let publisher = try Child("publisher", ["127.0.0.1", String(port), "6000", "--sources", "127.0.3.2-127.0.3.41", "--netflow", version,
                                                "--template-every", "100000", "--rate", "2000"])
        usleep(1_000_000)
        first[0].signal(SIGKILL)
        first[0].wait()
        usleep(700_000)
        let added = try collector(2)
        #expect(publisher.wait(seconds: 30) == 0, "\(publisher.stderr)")
        let sent = try publisher.json()
        usleep(300_000)
        var outcome = Outcome()
        outcome.reports = try [first[1].stop(), added.stop()]
        outcome.records = sent.int("records")
        outcome.decoded = outcome.reports.map { $0.object("flows").int("records") }.reduce(0, +)
        // What the kernel steered to the killed collector's slot (lost with it: queued or read
        // and not reported), from the group's counters.
        outcome.toKilled = outcome.reports[0].object("kernel").object("delivered_by_slot").int("0") * 10
        #expect(sent.int("sent") == 6000 && outcome.records == 60_000, "\(sent)")
        #expect(outcome.reports.allSatisfy { $0.int("socket_drops") == 0 && $0.object("flows").int("malformed") == 0 }, "\(outcome.reports)")
        #expect(outcome.reports[1].int("received") > 0, "the added collector got exporters")
        print("ReusePortLB group, flow templates \(version) \(shared ? "shared" : "not shared"): records sent \(outcome.records), to the killed collector \(outcome.toKilled), decoded by the others \(outcome.decoded), lost \(outcome.records - outcome.toKilled - outcome.decoded); templates from the store \(outcome.fromStore), data sets dropped for an unknown template \(outcome.unknownSets)")
        return outcome
    }

    @Test("Shared store: every record sent to a living collector decodes (v9, IPFIX); templates obtained from the store, counted",
          arguments: ["v9", "ipfix"])
    func sharedTemplates(version: String) throws {
        let outcome = try Self.run(version, shared: true)
        #expect(outcome.toKilled > 0 && outcome.decoded == outcome.records - outcome.toKilled,
                "sent \(outcome.records), to the killed collector \(outcome.toKilled), decoded \(outcome.decoded)")
        #expect(outcome.unknownSets == 0)
        #expect(outcome.reports.allSatisfy { $0.object("flows").int("templates_from_store") > 0 }, "the survivor took the killed one's exporters, the added one some of both")
        #expect(outcome.reports.allSatisfy { $0.object("flows").object("store").int("failed") == 0 })
        // The last collector out removed the group with its store.
        let path = outcome.reports[0].object("flows").object("store")["path"] as? String ?? ""
        #expect(!path.isEmpty && !FileManager.default.fileExists(atPath: path), "\(path) left pinned")
    }

    @Test("Without the store (what it fixes): exporters that changed collector lose their records, counted as data sets of an unknown template")
    func withoutStore() throws {
        let outcome = try Self.run("v9", shared: false)
        #expect(outcome.decoded < outcome.records - outcome.toKilled, "sent \(outcome.records), to the killed collector \(outcome.toKilled), decoded \(outcome.decoded)")
        #expect(outcome.unknownSets > 0)
        let unknownRecords = outcome.reports.map { $0.object("flows").int("unknown_template_records_v9") }.reduce(0, +)
        #expect(unknownRecords == outcome.records - outcome.toKilled - outcome.decoded, "every record not decoded is counted: \(unknownRecords)")
    }
}
