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

    @Test("A listener's templates round-trip through the record: IPv4 and IPv6 exporters, v9 and IPFIX, options templates, source ports; the taken-in templates are not counted as defined; anything else is refused whole")
    func roundTrip() throws {
        let state = FlowTemplateState()
        let exporters = [SocketAddress("198.18.0.10:2055")!, SocketAddress("[2001:db8::10]:4739")!]
        let v9 = T.v9(domain: 7, sets: [T.set(0, T.template(256, T.fields4)), T.set(1, [1, 1, 0, 4, 0, 4, 0, 1, 0, 4, 0, 8, 0, 4])])
        let ipfix = T.ipfix(domain: 9, sets: [T.set(2, T.template(300, T.fields4) + T.template(301, [(8, 4)]))])
        state.cache.withLock { cache in
            for (packet, exporter) in [(v9, exporters[0]), (ipfix, exporters[1])] {
                guard case .packet(let parsed) = packet.withUnsafeBytes({ FlowExport.parse($0) }) else { return }
                cache.apply(parsed, from: exporter.ip)
            }
        }
        state.kernelFollowing.withLock { $0.ports = [exporters[0].ip: 2055] }
        let bytes = state.handOverBytes()
        let next = FlowTemplateState()
        let taken = try #require(next.restore(bytes))
        #expect(taken.exporters == 2 && taken.templates == 4, "\(taken)")
        let (before, after) = (state.cache.withLock { $0 }, next.cache.withLock { $0 })
        for exporter in before.allExporters {
            #expect(after.templates(of: exporter) == before.templates(of: exporter), "\(exporter)")
            #expect(after.replay(exporter) == before.replay(exporter), "the same packets replayed: \(exporter)")
        }
        #expect(after.counters.defined == 0 && after.counters.redefined == 0, "taken in, not defined here: \(after.counters)")
        #expect(next.kernelFollowing.withLock { $0.ports } == [exporters[0].ip: 2055])
        // Not a record: nothing taken.
        let empty = FlowTemplateState()
        for bad in [[], Array("hello".utf8), Array(bytes.dropLast(3)), FlowTemplateState.handOverMagic + [5] + [UInt8](repeating: 0, count: 20)] {
            #expect(empty.restore(bad) == nil, "\(bad.prefix(12))")
        }
        #expect(empty.cache.withLock { $0.exporterCount } == 0)
        #expect(FlowTemplateState().restore(FlowTemplateState.handOverMagic).map { [$0.exporters, $0.templates] } == [0, 0], "an empty record: nothing to take")
    }

    @Test("Store names: printable, no ':', at most 255 characters, one per listener")
    func names() {
        let names = ["nf", "netflow:2055", "ünïcode listener", String(repeating: "x", count: 300), String(repeating: "x", count: 299) + "y"].map(TemplateHandOver.name)
        #expect(names[0] == "udp-fanout.tpl.nf" && names[1] == "udp-fanout.tpl.netflow%3A2055")
        #expect(names.allSatisfy { !$0.contains(":") && $0.utf8.count <= 255 && $0.allSatisfy { $0.isASCII && !$0.isWhitespace } }, "\(names)")
        #expect(Set(names).count == names.count)
    }

    @Test("The writer stores a listener's templates once they changed, not again while they stay, and takes them out of the store when the listener stops following templates")
    func writer() throws {
        let notify = try NotifySocket()
        let store = DescriptorStore(inherited: [:], notifier: SystemdNotifier(environment: notify.path), logger: LogStore().logger)
        let handOver = TemplateHandOver(descriptors: store, logger: LogStore().logger)
        let state = FlowTemplateState()
        /// The notifications sent since last asked: (FDSTORE or FDSTOREREMOVE, name, descriptors).
        func sent() -> [(String, String, Int)] {
            var found: [(String, String, Int)] = []
            var buffer = [UInt8](repeating: 0, count: 4096)
            var received = [Int32](repeating: -1, count: 253)
            var descriptor = pollfd(fd: notify.fd, events: Int16(POLLIN), revents: 0)
            while poll(&descriptor, 1, 50) > 0 {
                var count: Int32 = 0
                let length = shim_receive_with_descriptors(notify.fd, &buffer, buffer.count, &received, Int32(received.count), &count)
                guard length > 0 else { break }
                for fd in received[0..<Int(count)] { close(fd) }
                let fields = NotifySocket.fields(String(decoding: buffer[0..<Int(length)], as: UTF8.self))
                found.append((fields["FDSTORE"] == "1" ? "store" : fields["FDSTOREREMOVE"] == "1" ? "remove" : "other", fields["FDNAME"] ?? "", Int(count)))
            }
            return found
        }
        handOver.write(["nf": state])
        _ = sent()
        state.cache.withLock { cache in
            guard case .packet(let parsed) = T.v9(sets: [T.set(0, T.template(256, T.fields4))]).withUnsafeBytes({ FlowExport.parse($0) }) else { return }
            cache.apply(parsed, from: IPAddress("198.18.0.10")!)
        }
        state.generation.wrappingAdd(1, ordering: .releasing)
        #expect(handOver.write(["nf": state]))
        let stored = sent()
        #expect(stored.contains { $0 == ("store", "udp-fanout.tpl.nf", 1) }, "\(stored)")
        #expect(!handOver.write(["nf": state]), "unchanged: not written again")
        #expect(sent().isEmpty)
        #expect(store.isStored("udp-fanout.tpl.nf"))
        handOver.write([:])
        let removed = sent()
        #expect(removed.contains { $0.0 == "remove" && $0.1 == "udp-fanout.tpl.nf" } && !store.isStored("udp-fanout.tpl.nf"), "\(removed)")
    }
}

