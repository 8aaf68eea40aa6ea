// SPDX-License-Identifier: Apache-2.0
import CSystemShim
import Foundation
import Testing
import TestSupport
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// `settings.flow_templates` across a restart of udp-fanout under a service manager (the test's
/// ``ServiceManager``, as systemd keeps the store): 40 exporters send NetFlow v9, templates in
/// each one's first packet only, balanced by source over two nfcapd; 1 s in, the daemon is
/// restarted (SIGTERM, or kill -9 as `Restart=on-failure` meets a crash) and, once the new
/// process runs, a reload moves the exporters: the first nfcapd leaves the set (it stays alive:
/// what it was sent decodes) and pmacct's nfacctd joins. Every record must decode: the new
/// process took the old one's templates in and replays them to the collectors its exporters move
/// to. Without the option the exporters that moved lose their records.
@Suite("flow templates across a restart: the next process takes the templates in", .serialized,
       .enabled(if: Privileges.enabled, Privileges.reason))
struct FlowTemplateRestartTests {
    struct Outcome {
        var records = 0
        var decoded = 0
        /// The second process's log and metrics.
        var log = ""
        var metrics = ""
        var mode = ""

        func event(_ name: String) -> Int? { metric(metrics, "udp_fanout_flow_templates_total", "listener=\"nf\",mode=\"\(mode)\",event=\"\(name)\"") }
    }

    /// - Parameter mode: `userspace` on loopback, or `tc_ebpf` in namespaces (the collectors in
    ///   the backends, the exporters in the client's).
    static func run(_ mode: String = "userspace", templates: Bool, crash: Bool = false) throws -> Outcome {
        try #require(FileManager.default.isExecutableFile(atPath: "/usr/bin/nfcapd"), "nfcapd missing: make test installs nfdump (scripts/setup.sh)")
        let kernel = mode != "userspace"
        let topology = kernel ? try Topology(backends: 3, queues: 1) : nil
        defer { topology?.destroy() }
        if let topology { try TCFixtures.addClientSources(topology) }
        let collectors: [any FlowCollector] = try (1...3).map { n in
            guard let topology else { return n < 3 ? try NetFlowCollector() : try NFAcctCollector() }
            let (address, prefix) = (Topology.backendIPv4(n), topology.prefix(topology.backends[n - 1]))
            return n < 3 ? try NetFlowCollector(address: address, port: UInt16(TCFixtures.port), prefix: prefix)
                : try NFAcctCollector(address: address, port: UInt16(TCFixtures.port), prefix: prefix)
        }
        usleep(300_000)  // the collectors bind
        let bind = kernel ? SocketAddress("198.18.0.1:2055")! : SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let metricsPort = kernel ? 9464 : Int(freePort())
        let file = "/tmp/flow-templates-restart-\(UUID().uuidString.prefix(8)).yaml"
        defer { try? FileManager.default.removeItem(atPath: file) }
        func write(_ members: [Int]) throws {
            let address = { (index: Int) in kernel ? "\(Topology.backendIPv4(index + 1)):\(TCFixtures.port)" : "127.0.0.1:\(collectors[index].port)" }
            let settings = kernel ? "interface: \(topology!.proxyInterface)\n    mode: \(mode)\n    settings: {flow_templates: \(templates)}"
                : "settings: {output: preserve_source, workers: 2, recv_buf_size: 8388608, flow_templates: \(templates)}"
            try """
                listeners:
                  - name: nf
                    bind: "\(bind)"
                    balancing: source_ip
                    \(settings)
                    downstream:
                \(members.map { "      - {name: c\($0), address: \"\(address($0))\"}\n" }.joined())metrics: {enabled: true, bind: "127.0.0.1:\(metricsPort)"}

                """.write(toFile: file, atomically: true, encoding: .utf8)
        }
        try write([0, 1])
        let manager = try ServiceManager((topology.map { $0.prefix($0.proxy) } ?? []) + [binaryDirectory.appendingPathComponent("udp-fanout").path, "-c", file])
        try manager.start()
        // 40 exporters, 150 packets each of 10 records at 2,000 packets/s: 3 s.
        let publisher = try Child("publisher", [bind.ip.description, "\(bind.port)", "6000", "--sources", kernel ? "198.18.0.10-198.18.0.49" : "127.0.0.2-127.0.0.41",
                                                "--netflow", "v9", "--template-every", "100000", "--rate", "2000"], prefix: topology.map { $0.prefix($0.client) } ?? [])
        manager.pump(within: 1.0)
        if crash { try manager.kill9() } else { try manager.terminate() }
        try manager.start()
        manager.pump(within: 0.3)
        try write([1, 2])
        manager.process?.signal(SIGHUP)
        #expect(manager.pump(within: 10) { $0["READY"] == "1" && ($0["STATUS"] ?? "").contains("configuration reloaded") }, "the reload applied")
        // The rest of the publisher's 3 s, the store kept meanwhile.
        manager.pump(within: 2.0)
        #expect(publisher.wait(seconds: 30) == 0, "\(publisher.stderr)")
        let report = try publisher.json()
        manager.pump(within: 0.5)
        var outcome = Outcome()
        outcome.mode = mode
        outcome.records = report.int("records")
        let scrape = ["/usr/bin/curl", "-s", "http://127.0.0.1:\(metricsPort)/metrics"]
        let command = (topology.map { $0.prefix($0.proxy) } ?? []) + scrape
        outcome.metrics = try TestSupport.run(command[0], Array(command.dropFirst())).output
        outcome.log = manager.output
        try manager.stop()
        if let topology { try TCFixtures.expectNothingLeft(topology) }
        outcome.decoded = try collectors.map { try $0.flowsByExporter().values.reduce(0, +) }.reduce(0, +)
        #expect(report.int("sent") == 6000 && outcome.records == 60_000, "\(report)")
        print("flow templates across a \(crash ? "kill -9" : "restart") (\(mode)), \(templates ? "on" : "off"): records sent \(outcome.records), decoded \(outcome.decoded), lost \(outcome.records - outcome.decoded); replayed after it \(outcome.event("replayed").map(String.init) ?? "-"), unknown_templates \(outcome.event("unknown_templates").map(String.init) ?? "-")")
        return outcome
    }

    @Test("on: a planned restart, then a reload that moves exporters: every record decodes; the new process says it took 40 exporters' templates in and replays them",
          arguments: ["userspace", "tc_ebpf"])
    func restart(mode: String) throws {
        let outcome = try Self.run(mode, templates: true)
        #expect(outcome.decoded == outcome.records, "sent \(outcome.records), decoded \(outcome.decoded)")
        #expect(outcome.log.contains("the previous process's templates taken in") && outcome.log.contains("exporters=40"), "\(outcome.log)")
        #expect((outcome.event("replayed") ?? 0) > 0 && (mode != "userspace" || outcome.event("unknown_templates") == 0), "\(outcome.metrics)")
        #expect(outcome.event("send_dropped") == 0, "\(outcome.metrics)")
        #expect(metric(outcome.metrics, "udp_fanout_adoptions_total", "kind=\"flow_templates\",outcome=\"adopted\"") == 1, "\(outcome.metrics)")
        if mode != "userspace" {
            // The set the old program read was handed over: only the exporters the reload moved
            // are replayed, not every exporter to its collector (40 or more).
            #expect((outcome.event("replayed") ?? 0) < 40, "\(outcome.metrics)")
        }
    }

    @Test("on: kill -9 (a crash), then a start and the reload: the templates, written once they were still for 100 ms, are taken in; no data record is lost for want of a template")
    func crash() throws {
        let outcome = try Self.run(templates: true, crash: true)
        #expect(outcome.log.contains("the previous process's templates taken in") && outcome.log.contains("exporters=40"), "\(outcome.log)")
        #expect(outcome.event("unknown_templates") == 0, "\(outcome.metrics)")
        // What the killed workers had read and not sent is lost with them (at most a batch each).
        #expect(outcome.decoded >= outcome.records - 2 * 64 * 10, "sent \(outcome.records), decoded \(outcome.decoded)")
    }

    @Test("off (what the option fixes): the exporters the reload moves after the restart lose their records at their new collector",
          arguments: ["userspace", "tc_ebpf"])
    func withoutTemplates(mode: String) throws {
        let outcome = try Self.run(mode, templates: false)
        #expect(outcome.decoded < outcome.records, "sent \(outcome.records), decoded \(outcome.decoded)")
    }
}

/// What a restart hands over, without a daemon.
@Suite("flow templates: the hand-over record")
struct TemplateHandOverTests {
    typealias T = NetFlowBytes

    /// A state with two exporters (IPv4 v9 with an options template, IPv6 IPFIX), a port and a
    /// kernel set in force with a pool.
    static func sample() throws -> FlowTemplateState {
        let state = FlowTemplateState()
        let exporters = [SocketAddress("198.18.0.10:2055")!, SocketAddress("[2001:db8::10]:4739")!]
        let v9 = T.v9(domain: 7, sets: [T.set(0, T.template(256, T.fields4)), T.set(1, [1, 1, 0, 4, 0, 4, 0, 1, 0, 4, 0, 8, 0, 4])])
        let ipfix = T.ipfix(domain: 9, sets: [T.set(2, T.template(300, T.fields4) + T.template(301, [(8, 4)]))])
        for (packet, exporter) in [(v9, exporters[0]), (ipfix, exporters[1])] {
            let parsed = try #require({ if case .packet(let parsed) = packet.withUnsafeBytes({ FlowExport.parse($0) }) { parsed } else { nil } }())
            state.cache.withLock { _ = $0.apply(parsed, from: exporter.ip) }
        }
        let members = (1...3).map { Downstream(name: "m\($0)", address: SocketAddress("198.18.1.\($0):2055")!) }
        var plan = KernelTemplateFollower.Plan(BackendSet(downstreams: members, balancing: .sourceIP, slots: [:]), downstreams: members.map(\.address), sourceIP: true)
        plan.pools = [.init(set: .init(BackendSet(downstreams: Array(members[1...]), balancing: .roundRobin, slots: [:]), downstreams: members[1...].map(\.address), sourceIP: false),
                            sample: 3, prefixes: [SourcePrefix("198.18.0.0/24")!, SourcePrefix("2001:db8::/32")!])]
        state.kernelFollowing.withLock { $0 = (plan, [exporters[0].ip: 2055]) }
        return state
    }

    @Test("A listener's record round-trips: IPv4 and IPv6 exporters, v9 and IPFIX, options templates, source ports, the set in force with its pools; the taken-in templates are not counted as defined; anything else is refused whole")
    func roundTrip() throws {
        let state = try Self.sample()
        let bytes = state.record()
        let next = FlowTemplateState()
        let taken = try #require(next.restore(bytes))
        #expect(taken.exporters == 2 && taken.templates == 4, "\(taken)")
        let (before, after) = (state.cache.withLock { $0 }, next.cache.withLock { $0 })
        for exporter in before.allExporters {
            #expect(after.templates(of: exporter) == before.templates(of: exporter), "\(exporter)")
            #expect(after.replay(exporter) == before.replay(exporter), "the same packets replayed: \(exporter)")
        }
        #expect(after.counters.defined == 0 && after.counters.redefined == 0, "taken in, not defined here: \(after.counters)")
        let (was, now) = (state.kernelFollowing.withLock { $0 }, next.kernelFollowing.withLock { $0 })
        #expect(now.ports == was.ports)
        let plan = try #require(now.plan)
        #expect(plan.downstreams == was.plan!.downstreams && plan.table == was.plan!.table && plan.seed == was.plan!.seed && plan.sourceIP)
        #expect(plan.pools.count == 1 && plan.pools[0].set.downstreams == was.plan!.pools[0].set.downstreams && !plan.pools[0].set.sourceIP
                && plan.pools[0].sample == 3 && plan.pools[0].prefixes == was.plan!.pools[0].prefixes)
        for n in 1...200 {
            let address = IPAddress(n % 2 == 0 ? "198.18.0.\(n % 250)" : "2001:db8::\(String(n, radix: 16))")!
            #expect(plan.receivers(of: address) == was.plan!.receivers(of: address), "\(address)")
        }
        #expect(next.handOverVersion.load(ordering: .relaxed) > 0, "what was taken in is written for the next process too")
        // Not a record: nothing taken.
        let empty = FlowTemplateState()
        for bad in [[], Array("hello".utf8), Array(bytes.dropLast(3)), FlowTemplateState.recordMagic + [0, 5] + [UInt8](repeating: 0, count: 20),
                    FlowTemplateState.recordMagic + [2]] {
            #expect(empty.restore(bad) == nil, "\(bad.prefix(12))")
        }
        #expect(empty.cache.withLock { $0.exporterCount } == 0 && empty.kernelFollowing.withLock { $0.plan == nil })
        #expect(FlowTemplateState().restore(FlowTemplateState.recordMagic + [0]).map { [$0.exporters, $0.templates] } == [0, 0], "an empty record: nothing to take")
    }

    @Test("The follower's pool admission is the program's: sources and a sample of 3 decide as the userspace pool does, for IPv4 and IPv6 exporters")
    func poolAdmission() throws {
        let prefixes = [SourcePrefix("10.1.0.0/16")!, SourcePrefix("2001:db8:1::/48")!]
        let pool = KernelTemplateFollower.Plan.Pool(set: .init(), sample: 3, prefixes: prefixes)
        let userspace = PoolPlan(Pool(name: "p", balancing: .sourceIP, sample: 3, sources: prefixes), members: [], counters: ListenerCounters(name: "t", mode: "tc_ebpf").pool("p"))
        var taken = 0
        for n in 0..<600 {
            let address = IPAddress(n % 3 == 0 ? "10.\(n % 2 + 1).\(n / 250).\(n % 250)" : n % 3 == 1 ? "2001:db8:\(n % 2 + 1)::\(String(n, radix: 16))" : "10.1.7.\(n % 250)")!
            var storage = sockaddr_storage()
            _ = SocketAddress(ip: address, port: 40_000).write(to: &storage)
            let expected = withUnsafePointer(to: &storage) { userspace.sources.admits($0) && userspace.samples($0) }
            #expect(pool.takes(address) == expected, "\(address)")
            if expected { taken += 1 }
        }
        #expect(taken > 50 && taken < 300, "a third of the admitted sources: \(taken)")
    }

    @Test("Store names: printable, no ':', at most 255 characters, two per listener, no two listeners share one")
    func names() {
        let listeners = ["nf", "netflow:2055", "ünïcode listener", String(repeating: "x", count: 300), String(repeating: "x", count: 299) + "y",
                         String(repeating: "é", count: 90)]
        let names = listeners.map(TemplateHandOver.names)
        #expect(names[0] == ["udp-fanout.tpl.nf.0", "udp-fanout.tpl.nf.1"] && names[1][0] == "udp-fanout.tpl.netflow%3A2055.0")
        #expect(names.joined().allSatisfy { !$0.contains(":") && $0.utf8.count <= 255 && $0.allSatisfy { $0.isASCII && !$0.isWhitespace } }, "\(names)")
        #expect(Set(names.joined()).count == 2 * listeners.count)
    }

    /// The notifications the store sent since last asked: (FDSTORE or FDSTOREREMOVE, name, descriptors).
    static func sent(_ notify: NotifySocket) -> [(String, String, Int)] {
        messages(notify).map { fields, fds in
            for fd in fds { close(fd) }
            return (fields["FDSTORE"] == "1" ? "store" : fields["FDSTOREREMOVE"] == "1" ? "remove" : "other", fields["FDNAME"] ?? "", fds.count)
        }
    }

    /// Every notification waiting on `notify`, with the descriptors it carried (the caller's to close).
    static func messages(_ notify: NotifySocket) -> [(fields: [String: String], fds: [Int32])] {
        var found: [(fields: [String: String], fds: [Int32])] = []
        var buffer = [UInt8](repeating: 0, count: 4096)
        var received = [Int32](repeating: -1, count: 253)
        var descriptor = pollfd(fd: notify.fd, events: Int16(POLLIN), revents: 0)
        while poll(&descriptor, 1, 50) > 0 {
            var count: Int32 = 0
            let length = shim_receive_with_descriptors(notify.fd, &buffer, buffer.count, &received, Int32(received.count), &count)
            guard length > 0 else { break }
            found.append((NotifySocket.fields(String(decoding: buffer[0..<Int(length)], as: UTF8.self)), Array(received[0..<Int(count)])))
        }
        return found
    }

    @Test("The writer: a changed listener's record goes to the other of its two names, then the first is taken out; an unchanged one is not written again; a listener started anew (another state) is written even at the same version; a listener gone is taken out")
    func writer() throws {
        let notify = try NotifySocket()
        let store = DescriptorStore(inherited: [:], notifier: SystemdNotifier(environment: notify.path), logger: LogStore().logger)
        let handOver = TemplateHandOver(descriptors: store, logger: LogStore().logger)
        let state = try Self.sample()
        #expect(handOver.write(["nf": state]))
        var stored = Self.sent(notify)
        #expect(stored.contains { $0 == ("store", "udp-fanout.tpl.nf.0", 1) } && store.isStored("udp-fanout.tpl.nf.0"), "\(stored)")
        #expect(!handOver.write(["nf": state]) && Self.sent(notify).isEmpty, "unchanged: not written again")
        state.handOverVersion.wrappingAdd(1, ordering: .relaxed)
        #expect(handOver.write(["nf": state]))
        stored = Self.sent(notify)
        let store1 = stored.firstIndex { $0 == ("store", "udp-fanout.tpl.nf.1", 1) }, remove0 = stored.lastIndex { $0.0 == "remove" && $0.1 == "udp-fanout.tpl.nf.0" }
        #expect(store1 != nil && remove0 != nil && store1! < remove0!, "the new one stored before the old one is taken out: \(stored)")
        #expect(store.isStored("udp-fanout.tpl.nf.1") && !store.isStored("udp-fanout.tpl.nf.0"))
        // The option turned off and on again: another state, its version back at 0.
        let anew = FlowTemplateState()
        anew.handOverVersion.store(state.handOverVersion.load(ordering: .relaxed), ordering: .relaxed)
        #expect(handOver.write(["nf": anew]), "another state is written whatever its version")
        _ = Self.sent(notify)
        handOver.write([:])
        let removed = Self.sent(notify)
        #expect(removed.contains { $0.0 == "remove" && $0.1.hasPrefix("udp-fanout.tpl.nf.") } && store.storedNames(prefix: TemplateHandOver.prefix).isEmpty, "\(removed)")
    }

    @Test("The first write after an adoption goes to the other name than the record taken in, stored before that one is taken out; a userspace listener does not keep a kernel set in force")
    func firstWriteAfterAdoption() throws {
        let notify = try NotifySocket()
        let state = try Self.sample()
        let fd = shim_memfd("test")
        let bytes = TemplateHandOver.magic + [0, 0, 0, 0, 0, 0, 0, 4] + state.record()
        _ = bytes.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, 0) }
        let store = DescriptorStore(inherited: ["udp-fanout.tpl.nf.0": [fd]], notifier: SystemdNotifier(environment: notify.path), logger: LogStore().logger)
        let handOver = TemplateHandOver(descriptors: store, logger: LogStore().logger)
        let next = FlowTemplateState()
        handOver.adopt("nf", into: next, setInForce: false)
        #expect(next.cache.withLock { $0.exporterCount } == 2 && next.kernelFollowing.withLock { $0.plan == nil }, "templates taken, no set in force for a userspace listener")
        #expect(handOver.write(["nf": next]))
        let sent = Self.sent(notify)
        let storeOne = sent.firstIndex { $0 == ("store", "udp-fanout.tpl.nf.1", 1) }, removeZero = sent.firstIndex { $0.0 == "remove" && $0.1 == "udp-fanout.tpl.nf.0" }
        let removeOne = sent.firstIndex { $0.0 == "remove" && $0.1 == "udp-fanout.tpl.nf.1" }
        #expect(storeOne != nil && removeZero != nil && storeOne! < removeZero!, "stored under .1, then .0 taken out: \(sent)")
        #expect(removeOne == nil || removeOne! < storeOne!, "\(sent)")
    }

    @Test("Adoption takes the newer of the two records that reads whole: a record half written by a crash, or of another version, does not stop it; one numbered lower loses to one numbered higher")
    func adoption() throws {
        func memfd(_ bytes: [UInt8]) -> Int32 {
            let fd = shim_memfd("test")
            _ = bytes.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, 0) }
            return fd
        }
        func record(_ number: UInt64, _ state: FlowTemplateState) -> [UInt8] {
            TemplateHandOver.magic + (0..<8).map { UInt8(truncatingIfNeeded: number >> (56 - 8 * $0)) } + state.record()
        }
        let older = try Self.sample()
        let newer = try Self.sample()
        newer.cache.withLock { cache in
            guard case .packet(let parsed) = T.v9(domain: 8, sets: [T.set(0, T.template(260, T.fields4))]).withUnsafeBytes({ FlowExport.parse($0) }) else { return }
            _ = cache.apply(parsed, from: IPAddress("198.18.0.77")!)
        }
        for (first, second, exporters) in [(record(5, older), record(9, newer), 3), (record(9, newer), record(5, older), 3),
                                           (record(9, newer), Array(record(12, older).dropLast(5)), 3), (record(7, older), Array("junk".utf8), 2)] {
            let log = LogStore()
            let store = DescriptorStore(inherited: ["udp-fanout.tpl.nf.0": [memfd(first)], "udp-fanout.tpl.nf.1": [memfd(second)]], notifier: nil, logger: log.logger)
            let state = FlowTemplateState()
            TemplateHandOver(descriptors: store, logger: log.logger).adopt("nf", into: state, setInForce: true)
            #expect(state.cache.withLock { $0.exporterCount } == exporters, "\(log.lines.withLock { $0.map(\.message) })")
            #expect(store.outcomes["flow_templates"]?[.adopted] == 1)
        }
        // Nothing readable: counted rejected, said.
        let log = LogStore()
        let store = DescriptorStore(inherited: ["udp-fanout.tpl.nf.0": [memfd(Array("junk".utf8))]], notifier: nil, logger: log.logger)
        TemplateHandOver(descriptors: store, logger: log.logger).adopt("nf", into: FlowTemplateState(), setInForce: true)
        #expect(store.outcomes["flow_templates"]?[.rejected] == 1 && log.lines.withLock { $0.contains { $0.message.contains("no record of the previous process's flow templates") } })
    }
}
