// SPDX-License-Identifier: Apache-2.0
import Foundation
import Logging
import Testing
import TestSupport
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// `settings.flow_templates` with real collectors: NetFlow v9 and IPFIX from 40 exporters whose
/// templates are sent once (in each exporter's first packet), balanced by source over two nfcapd
/// collectors; mid-run one collector is killed (kill -9: what it stored is gone) and taken out
/// by a reload, then a third collector, pmacct's nfacctd, is added by another. Every record the living collectors
/// were sent must decode; without the option the exporters that moved lose theirs.
@Suite("flow templates: real collectors keep decoding when exporters change collector (userspace)", .serialized,
       .enabled(if: Privileges.enabled, Privileges.reason))
struct FlowTemplateEndToEndTests {
    struct Outcome {
        var records = 0
        /// Records decoded by the two collectors alive at the end.
        var decoded = 0
        /// Records in the datagrams the killed collector was given (lost with it).
        var toKilled = 0
        /// Pooled: records decoded by the listener's own collector (every datagram reaches it).
        var decodedByOwn = 0
        var metrics = ""

        func event(_ name: String) -> Int? { metric(metrics, "udp_fanout_flow_templates_total", "listener=\"nf\",mode=\"userspace\",event=\"\(name)\"") }
    }

    /// - Parameter pooled: the three collectors are members of a replication pool (`collectors`,
    ///   source_ip) instead of the listener's own downstreams, which are one more nfcapd that
    ///   gets every datagram.
    static func run(_ version: String, templates: Bool, pooled: Bool = false) throws -> Outcome {
        try #require(FileManager.default.isExecutableFile(atPath: "/usr/bin/nfcapd"), "nfcapd missing: make test installs nfdump (scripts/setup.sh)")
        // Two nfcapd and, added mid-run, pmacct's nfacctd (pooled: and the listener's own nfcapd).
        let collectors: [any FlowCollector] = [try NetFlowCollector(), try NetFlowCollector(), try NFAcctCollector()]
        let own = pooled ? try NetFlowCollector() : nil
        usleep(300_000)  // the collectors bind
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        func yaml(_ members: [Int]) -> String {
            let list = members.map { "      - {name: c\($0), address: \"127.0.0.1:\(collectors[$0].port)\"}\n" }.joined()
            guard let own else {
                return """
                    listeners:
                      - name: nf
                        bind: "\(bind)"
                        balancing: source_ip
                        settings: {output: preserve_source, workers: 2, recv_buf_size: 8388608, flow_templates: \(templates)}
                        downstream:
                    \(list)
                    """
            }
            return """
                listeners:
                  - name: nf
                    bind: "\(bind)"
                    settings: {output: preserve_source, workers: 2, recv_buf_size: 8388608, flow_templates: \(templates)}
                    downstream:
                      - {name: own, address: "127.0.0.1:\(own.port)"}
                    pools:
                      - name: collectors
                        balancing: source_ip
                        downstream:
                \(list.split(separator: "\n").map { "    " + $0 + "\n" }.joined())
                """
        }
        let daemon = try startDaemon(yaml([0, 1]))
        defer { daemon.shutdown() }
        // 40 exporters, 150 packets each of 10 records at 2,000 packets/s: 3 s. Templates in
        // each exporter's first packet only.
        let publisher = try Child("publisher", ["127.0.0.1", "\(bind.port)", "6000", "--sources", "127.0.0.2-127.0.0.41", "--netflow", version,
                                                "--template-every", "100000", "--rate", "2000"])
        usleep(1_000_000)
        collectors[0].child.signal(SIGKILL)
        _ = collectors[0].child.wait(seconds: 5)
        #expect(daemon.reload(text: yaml([1])), "c0 taken out")
        usleep(700_000)
        #expect(daemon.reload(text: yaml([1, 2])), "c2 added")
        #expect(publisher.wait(seconds: 30) == 0, "\(publisher.stderr)")
        let report = try publisher.json()
        usleep(500_000)
        var outcome = Outcome()
        outcome.records = report.int("records")
        outcome.metrics = daemon.metricsText()
        func count(_ family: String, _ member: String) -> Int {
            pooled ? metric(outcome.metrics, "udp_fanout_pool_member_\(family == "forwarded" ? "copies" : family)_total", "listener=\"nf\",mode=\"userspace\",pool=\"collectors\",downstream=\"\(member)\"") ?? 0
                   : metric(outcome.metrics, "udp_fanout_downstream_packets_\(family)_total", "listener=\"nf\",mode=\"userspace\",downstream=\"\(member)\"") ?? 0
        }
        outcome.toKilled = (count("forwarded", "c0") + count("dropped", "c0")) * 10
        let flows = try collectors[1...].map { try $0.flowsByExporter() }
        outcome.decoded = flows.map { $0.values.reduce(0, +) }.reduce(0, +)
        #expect(report.int("sent") == 6000 && outcome.records == 60_000, "\(report)")
        // Forwarded to, whether it could decode them or not (off: it cannot).
        #expect(count("forwarded", "c2") > 0, "the added collector got exporters: \(outcome.metrics)")
        if let own {
            outcome.decodedByOwn = try own.flowsByExporter().values.reduce(0, +)
        }
        print("flow templates \(version) \(templates ? "on" : "off")\(pooled ? ", the collectors in a replication pool" : ""): records sent \(outcome.records), to the killed collector \(outcome.toKilled), decoded by the others \(outcome.decoded), lost \(outcome.records - outcome.toKilled - outcome.decoded); replayed \(outcome.event("replayed").map(String.init) ?? "-"), copied \(outcome.event("copied").map(String.init) ?? "-")")
        return outcome
    }

    @Test("on: every record sent to a living collector decodes, through a kill -9 and an added collector (v9, IPFIX); templates copied and replayed, counted",
          arguments: ["v9", "ipfix"])
    func templatesFollow(version: String) throws {
        let outcome = try Self.run(version, templates: true)
        #expect(outcome.toKilled > 0 && outcome.decoded == outcome.records - outcome.toKilled,
                "sent \(outcome.records), to the killed collector \(outcome.toKilled), decoded \(outcome.decoded)")
        #expect(outcome.event("template_packets") == 40, "each exporter's first packet: \(outcome.metrics)")
        #expect((outcome.event("copied") ?? 0) >= 40, "each exporter's templates to the other collector")
        #expect((outcome.event("replayed") ?? 0) > 0, "to the added collector")
        #expect(outcome.event("malformed") == 0 && outcome.event("send_dropped") == 0)
        #expect(metric(outcome.metrics, "udp_fanout_flow_template_exporters", "listener=\"nf\",mode=\"userspace\"") == 40)
    }

    @Test("on, the collectors members of a replication pool: every record sent to a living member decodes through the kill -9 and the added member; the listener's own collector decodes every record")
    func templatesFollowInPool() throws {
        let outcome = try Self.run("v9", templates: true, pooled: true)
        #expect(outcome.toKilled > 0 && outcome.decoded == outcome.records - outcome.toKilled,
                "sent \(outcome.records), to the killed member \(outcome.toKilled), decoded \(outcome.decoded)")
        #expect(outcome.decodedByOwn == outcome.records, "the listener's own collector: \(outcome.decodedByOwn) of \(outcome.records)")
        #expect((outcome.event("copied") ?? 0) >= 40 && (outcome.event("replayed") ?? 0) > 0, "\(outcome.metrics)")
        #expect(outcome.event("send_dropped") == 0 && outcome.event("unknown_templates") == 0, "\(outcome.metrics)")
    }

    @Test("off (what the option fixes): the exporters that moved lose their records at their new collector (the listener's own, or a replication pool's member)",
          arguments: [false, true])
    func withoutTemplates(pooled: Bool) throws {
        let outcome = try Self.run("v9", templates: false, pooled: pooled)
        #expect(outcome.decoded < outcome.records - outcome.toKilled, "sent \(outcome.records), to the killed collector \(outcome.toKilled), decoded \(outcome.decoded)")
        #expect(outcome.event("replayed") == nil, "no template series without the option")
    }
}

/// One worker's part, without a daemon: copies and replays through its own lanes.
@Suite("flow templates: a worker's copies and replays")
struct FlowTemplateRelayTests {
    /// A NetFlow v9 packet: a template (ID 256, one field) and, unless `templateOnly`, one data record of it.
    static func v9(template: Bool, data: Bool, sequence: UInt32 = 1) -> [UInt8] {
        var body: [UInt8] = []
        if template { body += [0, 0, 0, 12, 1, 0, 0, 1, 0, 8, 0, 4] }
        if data { body += [1, 0, 0, 8, 10, 0, 0, 1] }
        let count = UInt16((template ? 1 : 0) + (data ? 1 : 0))
        return [0, 9, UInt8(count >> 8), UInt8(count & 0xff), 0, 0, 0, 1, 0, 0, 0, 2]
            + withUnsafeBytes(of: sequence.bigEndian) { Array($0) } + [0, 0, 0, 7] + body
    }

    @Test("200 exporters' templates in one batch reach the other downstream whole (a lane flushed as it fills); a downstream that joins gets an exporter's templates once, before its data; data to a downstream that holds them adds nothing")
    func copiesAndReplays() throws {
        let sinks = try (0..<3).map { _ in try Sink() }
        let downstreams = sinks.enumerated().map { Downstream(name: "s\($0.offset)", address: $0.element.address) }
        let counters = ListenerCounters(name: "t", mode: "userspace")
        let state = FlowTemplateState()
        let relay = FlowTemplateRelay(state: state, sender: SharedSender(capacity: 32), output: .socket)
        relay.adopt(ForwardingPlan(downstreams: Array(downstreams[0..<2]), balancing: .roundRobin, quicLB: [], pools: [], counters: counters))
        func note(_ target: Int, _ packet: [UInt8], exporter: Int) {
            var storage = sockaddr_storage()
            _ = SocketAddress(ip: IPAddress("10.0.\(exporter / 250).\(exporter % 250 + 1)")!, port: 2055).write(to: &storage)
            packet.withUnsafeBytes { bytes in withUnsafePointer(to: &storage) { relay.note(target, bytes, source: $0) } }
        }
        for exporter in 0..<200 { note(0, Self.v9(template: true, data: true), exporter: exporter) }
        relay.flush()
        usleep(100_000)
        #expect(sinks[1].drain().count == 200, "a copy of each exporter's templates")
        #expect(sinks[0].drain().isEmpty, "the datagram itself is the forwarder's to send")
        #expect(state.copies.load(ordering: .relaxed) == 200 && state.templatePackets.load(ordering: .relaxed) == 200)
        // The same templates again change nothing: no copy.
        note(0, Self.v9(template: true, data: true, sequence: 2), exporter: 0)
        relay.flush()
        #expect(state.copies.load(ordering: .relaxed) == 200)
        // s2 joins; exporter 0's data goes there: one replay, once.
        relay.adopt(ForwardingPlan(downstreams: downstreams, balancing: .roundRobin, quicLB: [], pools: [], counters: counters))
        note(2, Self.v9(template: false, data: true, sequence: 3), exporter: 0)
        note(2, Self.v9(template: false, data: true, sequence: 4), exporter: 0)
        note(1, Self.v9(template: false, data: true, sequence: 5), exporter: 0)
        relay.flush()
        usleep(100_000)
        let replayed = sinks[2].drain()
        #expect(replayed.count == 1 && state.replays.load(ordering: .relaxed) == 1, "\(replayed.count) replays")
        #expect(replayed.first.map { Array($0.prefix(2)) } == [0, 9] && replayed.first.map { Array($0.suffix(12)) } == [0, 0, 0, 12, 1, 0, 0, 1, 0, 8, 0, 4],
                "the template, with no data record: \(replayed)")
        #expect(sinks[1].drain().isEmpty, "s1 holds the templates already")
        // A malformed version 9 datagram is counted, not learned.
        note(0, Array(Self.v9(template: true, data: false).prefix(26)) + [0, 0], exporter: 7)
        #expect(state.malformed.load(ordering: .relaxed) == 1)
        // Templates that arrive while no downstream is available are learned all the same: the
        // downstream that takes the exporter's data later gets them first.
        var storage = sockaddr_storage()
        _ = SocketAddress(ip: IPAddress("10.0.9.9")!, port: 2055).write(to: &storage)
        relay.adopt(ForwardingPlan(downstreams: [], balancing: .roundRobin, quicLB: [], pools: [], counters: counters))
        Self.v9(template: true, data: true).withUnsafeBytes { bytes in withUnsafePointer(to: &storage) { relay.note(nil, bytes, source: $0) } }
        relay.flush()
        relay.adopt(ForwardingPlan(downstreams: downstreams, balancing: .roundRobin, quicLB: [], pools: [], counters: counters))
        Self.v9(template: false, data: true, sequence: 9).withUnsafeBytes { bytes in withUnsafePointer(to: &storage) { relay.note(2, bytes, source: $0) } }
        relay.flush()
        usleep(100_000)
        let late = sinks[2].drain()
        #expect(late.count == 1 && late.first.map { Array($0[12..<16]) } == [0, 0, 0, 9], "the replay carries the datagram's sequence number: \(late)")
        // Data of an exporter nobody knows the templates of: counted, nothing sent.
        note(1, Self.v9(template: false, data: true), exporter: 600)
        relay.flush()
        #expect(state.unknown.load(ordering: .relaxed) == 1)
        #expect(sinks.allSatisfy { $0.drain(quiet: .milliseconds(100)).isEmpty })
    }

    /// One batch through `forwarder` as a worker forwards it: each exporter's datagram (from
    /// port 2055) offered to the pools, to the listener's choice, and to the templates.
    static func batch(_ forwarder: BatchForwarder, _ packet: [UInt8], from exporters: [IPAddress]) {
        forwarder.adoptPlanIfChanged()
        for exporter in exporters {
            var storage = sockaddr_storage()
            _ = SocketAddress(ip: exporter, port: 2055).write(to: &storage)
            packet.withUnsafeBytes { payload in
                withUnsafePointer(to: &storage) { source in
                    forwarder.replicate(payload, source: source)
                    let target = forwarder.pick(source, payload)
                    forwarder.noteTemplates(target, payload, source: source)
                    if let target { forwarder.append(target, payload, source: source) }
                }
            }
        }
        forwarder.flush(received: exporters.count, bytesReceived: 0)
    }

    @Test("Replication pools: a template change is copied to every member of a balanced pool that takes the exporter, not to a pool whose sources leave it out, nor again to an `all` pool's members (each got the datagram); a member that joins a pool is sent an exporter's templates before its data (through the forwarder, as a worker does)")
    func pools() throws {
        let sinks = try (0..<9).map { _ in try Sink() }
        // s0, s1: the listener's own; s2, s3: pool `balanced` (source_ip); s4, s5: pool `every`
        // (all); s6, s7: pool `elsewhere` (source_ip, sources 10.99.0.0/16: none of these exporters);
        // s8 joins `balanced`, then `every`.
        func member(_ index: Int, _ pool: String?) -> Downstream {
            Downstream(name: "s\(index)", address: sinks[index].address, pool: pool)
        }
        let poolConfigs = [
            Pool(name: "balanced", balancing: .sourceIP),
            Pool(name: "every", balancing: .all),
            Pool(name: "elsewhere", balancing: .sourceIP, sources: [SourcePrefix("10.99.0.0/16")!]),
        ]
        let counters = ListenerCounters(name: "t", mode: "userspace")
        func plan(balanced: [Int], every: [Int]) -> ForwardingPlan {
            ForwardingPlan(downstreams: [member(0, nil), member(1, nil)] + balanced.map { member($0, "balanced") } + every.map { member($0, "every") }
                             + [member(6, "elsewhere"), member(7, "elsewhere")],
                           balancing: .sourceIP, quicLB: [], pools: poolConfigs, counters: counters)
        }
        let plans = PlanHolder(plan(balanced: [2, 3], every: [4, 5]))
        let state = FlowTemplateState()
        let forwarder = BatchForwarder(listener: "t", counters: counters, plans: plans, logger: Logger(label: "test"), output: .socket, capacity: 64,
                                       templates: state, makeOutbox: Outboxes.factory(output: .socket, capacity: 64))
        // 60 exporters: under source_ip each moves to the joining member with a chance of one in
        // three, so none moving (which the test must see) is (2/3)^60, about 3e-11 (with 20 it was
        // 3e-4, and it happened).
        let n = 60
        func batch(_ packet: [UInt8], exporters: Range<Int>) {
            Self.batch(forwarder, packet, from: exporters.map { IPAddress("10.0.0.\($0 + 1)")! })
        }
        batch(Self.v9(template: true, data: true), exporters: 0..<n)
        var got = sinks.map { $0.drain(quiet: .milliseconds(150)).count }
        // The listener's pair and `balanced`: each exporter's datagram to one, its copy to the other.
        #expect(got[0] + got[1] == 2 * n && got[0] >= n && got[1] >= n, "the listener's own: \(got)")
        #expect(got[2] + got[3] == 2 * n && got[2] >= n && got[3] >= n, "balanced: \(got)")
        #expect(got[4] == n && got[5] == n, "every: the datagrams themselves, no copy: \(got)")
        #expect(got[6] == 0 && got[7] == 0 && got[8] == 0, "elsewhere takes none of these exporters: \(got)")
        #expect(state.copies.load(ordering: .relaxed) == 2 * n && state.replays.load(ordering: .relaxed) == 0)
        // s8 joins `balanced` and `every`: data alone from every exporter. Each exporter `balanced`
        // now gives s8 is sent its templates first; `every` gives s8 all of them.
        plans.replace(with: plan(balanced: [2, 3, 8], every: [4, 5, 8]))
        batch(Self.v9(template: false, data: true, sequence: 2), exporters: 0..<n)
        let packets = sinks[8].drain(quiet: .milliseconds(150))
        got = sinks.map { $0.drain(quiet: .milliseconds(150)).count }
        let templatesFirst = packets.prefix { $0.count > 21 && $0[20] == 0 && $0[21] == 0 }
        // s8 gets `every`'s datagram of each exporter, and `balanced`'s of those that moved there.
        let moved = packets.count - templatesFirst.count - n
        #expect(moved > 0, "some exporters moved to s8 in `balanced`: \(packets.count) packets")
        #expect(templatesFirst.count == n && state.replays.load(ordering: .relaxed) == n,
                "s8: each exporter's templates once (it is one collector in two pools), before the batch's datagrams: \(packets.count) packets, \(templatesFirst.count) templates first")
        #expect(got[2] + got[3] == n - moved && got[4] == n && got[5] == n && got[0] + got[1] == n, "no replay to a member that holds them: \(got)")
        #expect(state.unknown.load(ordering: .relaxed) == 0 && state.sendDropped.load(ordering: .relaxed) == 0)
    }

    @Test("A collector reached two ways (the listener's output: socket, a pool's preserve_source) is two receivers: one holding the templates does not spare the other its replay")
    func twoWaysToOneCollector() throws {
        let sinks = try (0..<2).map { _ in try Sink() }
        let counters = ListenerCounters(name: "t", mode: "userspace")
        let pool = Pool(name: "raw", balancing: .sourceIP, output: .preserveSource)
        func plan(_ member: Int) -> ForwardingPlan {
            ForwardingPlan(downstreams: [Downstream(name: "own", address: sinks[0].address), Downstream(name: "m", address: sinks[member].address, pool: "raw")],
                           balancing: .sourceIP, quicLB: [], pools: [pool], counters: counters)
        }
        let plans = PlanHolder(plan(1))
        let state = FlowTemplateState()
        let forwarder = BatchForwarder(listener: "t", counters: counters, plans: plans, logger: Logger(label: "test"), output: .socket, capacity: 64,
                                       templates: state, makeOutbox: Outboxes.factory(output: .socket, capacity: 64))
        func send(_ packet: [UInt8]) { Self.batch(forwarder, packet, from: [IPAddress("127.0.0.9")!]) }
        send(Self.v9(template: true, data: true))
        #expect(sinks.map { $0.drain(quiet: .milliseconds(150)).count } == [1, 1], "each way its datagram")
        // The pool's member is now the listener's own collector, reached from the exporter's address.
        plans.replace(with: plan(0))
        send(Self.v9(template: false, data: true, sequence: 2))
        let got = sinks[0].drain(quiet: .milliseconds(150))
        #expect(got.count == 3 && got.filter { $0.count > 21 && $0[20] == 0 && $0[21] == 0 }.count == 1 && state.replays.load(ordering: .relaxed) == 1,
                "one replay (for the pool's way), then the two datagrams: \(got.map(\.count))")
    }

    @Test("Which datagrams are parsed: template and options template sets and malformed ones; data alone, v5 and others are not")
    func needsParsing() {
        func needs(_ bytes: [UInt8]) -> Bool { bytes.withUnsafeBytes { FlowExport.needsParsing($0) } }
        #expect(needs(Self.v9(template: true, data: true)))
        #expect(!needs(Self.v9(template: false, data: true)))
        #expect(needs(Array(Self.v9(template: false, data: true).prefix(26))), "a set running past the end")
        #expect(!needs([0, 5] + [UInt8](repeating: 0, count: 70)), "NetFlow v5")
        #expect(!needs([0, 0, 0, 5] + [UInt8](repeating: 0, count: 24)), "sFlow v5")
        #expect(needs([0, 9, 0, 1]), "a v9 header cut short")
    }
}
