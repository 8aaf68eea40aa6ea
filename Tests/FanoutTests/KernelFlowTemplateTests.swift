// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import CSystemShim
import Foundation
import Logging
import ReusePortLB
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// flow_templates in the tc and xdp programs (BPF_PROG_TEST_RUN): which datagrams of a listener
/// that follows templates are passed up through the ring buffer, and what is counted instead.
@Suite("flow templates: the kernel programs pass template-bearing datagrams up (BPF_PROG_TEST_RUN)", .serialized,
       .enabled(if: Privileges.enabled, Privileges.reason))
struct KernelFlowTemplateProgramTests {
    typealias T = NetFlowBytes
    static let id: UInt32 = 9
    static let bind = TCProgramFixture.listenerBind(2055)
    static let client = SocketAddress(ip: IPAddress(bytes: ProgramFrames.clientV4)!, port: 40000)

    final class Rig {
        let fixture: TCProgramFixture
        let state = FlowTemplateState()
        let follower: KernelTemplateFollower
        let tap: TCTemplateTap

        init(templates: Bool = true) throws {
            fixture = try TCProgramFixture()
            let backends = (1...3).map { Downstream(name: "b\($0)", address: SocketAddress("198.18.200.10:\(6000 + $0)")!) }
            let set = BackendSet(downstreams: backends, balancing: .sourceIP, slots: ["b1": 0, "b2": 1, "b3": 2])
            fixture.program.resetListener(id: id)
            try fixture.program.writeSet(id: id, generation: 0, set)
            var entry = fanout_listener()
            entry.id = id
            entry.policy = FANOUT_POLICY_SOURCE_IP.rawValue
            entry.reserved = templates ? FANOUT_LISTENER_TEMPLATES : 0
            try fixture.program.putListener(bind, ifindex: UInt32(fixture.ifindex), entry)
            follower = KernelTemplateFollower(listener: "nf", state: state, logger: Logger(label: "test"))
            tap = try TCTemplateTap(ringBuffer: fixture.program.templates, logger: Logger(label: "test"))
            tap.register(id: id, follower)
        }

        deinit { tap.stop() }

        /// Waits (up to 2 s) until the daemon side has taken `count` template-bearing datagrams.
        func waitForTemplatePackets(_ count: UInt64) -> UInt64 {
            for _ in 0..<200 where state.templatePackets.load(ordering: .relaxed) < count { usleep(10_000) }
            usleep(50_000)  // and nothing more arrives
            return state.templatePackets.load(ordering: .relaxed)
        }
    }

    static func frame(_ payload: [UInt8], from source: SocketAddress = client) -> [UInt8] {
        TCNATProgramTests.frame(from: source, to: bind, payload: payload)
    }

    static let t256 = T.template(256, T.fields4)
    static let data = T.set(256, [UInt8](repeating: 1, count: 12))

    @Test("tc: a v9 datagram with a template set is forwarded and passed up (the template learned); data alone, v5 and other listeners' datagrams are not; IPFIX with the template set second is")
    func tcPassesTemplates() throws {
        let rig = try Rig()
        let verdict = rig.fixture.execute(Self.frame(T.v9(count: 2, sets: [T.set(0, Self.t256), Self.data]))).verdict
        #expect(verdict == TCProgramFixture.redirect, "forwarded as any other datagram")
        #expect(rig.waitForTemplatePackets(1) == 1)
        let exporter = FlowTemplateCache.Exporter(address: Self.client.ip, version: .v9, domain: 7)
        #expect(rig.state.cache.withLock { $0.templates(of: exporter) }.map(\.record) == [Self.t256])
        // Data alone, NetFlow v5, and a template to a listener that does not follow templates.
        _ = rig.fixture.execute(Self.frame(T.v9(sets: [Self.data])))
        _ = rig.fixture.execute(Self.frame([0, 5] + [UInt8](repeating: 0, count: 70)))
        _ = rig.fixture.execute(TCNATProgramTests.frame(from: Self.client, to: TCProgramFixture.listenerBind(5514), payload: T.v9(sets: [T.set(0, Self.t256)])))
        #expect(rig.waitForTemplatePackets(2) == 1, "nothing else passed up")
        // IPFIX: a data set, then an options template set.
        let o300 = T.be16([300, 2, 1, 149, 4, 41, 8])
        _ = rig.fixture.execute(Self.frame(T.ipfix(sets: [T.set(256, [UInt8](repeating: 0, count: 12)), T.set(3, o300)])))
        #expect(rig.waitForTemplatePackets(2) == 2)
        #expect(rig.fixture.program.templateCounts(id: Self.id).captured == 2)
        #expect(rig.tap.unclaimed.load(ordering: .relaxed) == 0)
    }

    @Test("tc: an IPv6 exporter's and a VLAN-tagged frame's templates are passed up too, with their exporter's address and port")
    func tcPassesIPv6AndTagged() throws {
        let rig = try Rig()
        let bind6 = SocketAddress("[2001:db8:100::1]:2055")!
        let members = (1...2).map { Downstream(name: "v\($0)", address: SocketAddress("[2001:db8:200::10]:\(6100 + $0)")!) }
        let set = BackendSet(downstreams: members, balancing: .sourceIP, slots: ["v1": 0, "v2": 1])
        rig.fixture.program.resetListener(id: 12)
        try rig.fixture.program.writeSet(id: 12, generation: 0, set)
        var entry = fanout_listener()
        entry.id = 12
        entry.policy = FANOUT_POLICY_SOURCE_IP.rawValue
        entry.reserved = FANOUT_LISTENER_TEMPLATES
        try rig.fixture.program.putListener(bind6, ifindex: UInt32(rig.fixture.ifindex), entry)
        let follower6 = KernelTemplateFollower(listener: "nf6", state: rig.state, logger: Logger(label: "test"))
        rig.tap.register(id: 12, follower6)
        let client6 = SocketAddress(ip: IPAddress(bytes: ProgramFrames.clientV6)!, port: 40001)
        #expect(rig.fixture.execute(TCNATProgramTests.frame(from: client6, to: bind6, payload: T.v9(domain: 3, sets: [T.set(0, Self.t256)]))).verdict == TCProgramFixture.redirect)
        // IPv4 with an 802.1Q tag (VLAN 5) in front.
        var tagged = Self.frame(T.v9(domain: 4, sets: [T.set(0, Self.t256)]))
        tagged.replaceSubrange(0..<14, with: Packet.ethernetHeader(type: 0x0800, vlan: 5))
        #expect(rig.fixture.execute(tagged).verdict == TCProgramFixture.redirect)
        #expect(rig.waitForTemplatePackets(2) == 2)
        rig.state.cache.withLock { cache in
            #expect(cache.templates(of: .init(address: client6.ip, version: .v9, domain: 3)).map(\.record) == [Self.t256])
            #expect(cache.templates(of: .init(address: Self.client.ip, version: .v9, domain: 4)).map(\.record) == [Self.t256])
        }
        rig.state.kernelFollowing.withLock { following in
            #expect(following.ports[client6.ip] == 40001 && following.ports[Self.client.ip] == 40000, "each exporter's port, for its copies and replays")
        }
    }

    @Test("tc: a template-bearing datagram longer than the program reads is counted too_large, a first fragment fragmented; neither passed up")
    func tcCountsWhatItCannotRead() throws {
        let rig = try Rig()
        // 2,100 bytes of UDP payload: the template set, then a long data set.
        let long = T.v9(count: 2, sets: [T.set(0, Self.t256), T.set(256, [UInt8](repeating: 1, count: 12 * 170))])
        #expect(long.count > Int(FANOUT_TEMPLATE_DATA_MAX))
        // (Longer than this route's MTU too: the datagram itself is dropped, counted too_large
        // with the listener's verdicts; on a jumbo-frame path it would be forwarded.)
        #expect(rig.fixture.execute(Self.frame(long)).verdict == TCProgramFixture.shot)
        #expect(rig.fixture.stats(Self.id).verdicts[Int(FANOUT_VERDICT_TOO_LARGE.rawValue)] == 1)
        // A first fragment (more fragments set) of a template-bearing datagram.
        var fragment = Self.frame(T.v9(sets: [T.set(0, Self.t256)]))
        fragment[14 + 6] = 0x20
        _ = rig.fixture.execute(fragment)
        #expect(rig.waitForTemplatePackets(1) == 0)
        let counts = rig.fixture.program.templateCounts(id: Self.id)
        #expect(counts.tooLarge == 1 && counts.fragmented == 1 && counts.captured == 0, "\(counts)")
    }

    @Test("xdp: the XDP program passes the template-bearing datagrams it forwards up too, into the same ring buffer")
    func xdpPassesTemplates() throws {
        let rig = try Rig()
        let xdp = try XDPForwardProgram(sharing: rig.fixture.program)
        defer { xdp.closeDescriptors() }
        try xdp.serve(id: Self.id, true)
        try xdp.setDevice(UInt32(rig.fixture.otherIfindex), present: true)
        try xdp.setDevice(UInt32(rig.fixture.ifindex), present: true)
        let (program, fd, ifindex) = (xdp.program, rig.fixture.namespaceFD, UInt32(rig.fixture.ifindex))
        let frame = Self.frame(T.v9(count: 2, sets: [T.set(0, Self.t256), Self.data]))
        let box = XDPForwardProgramTests.Box()
        OSThread(name: "xdp-test-run") {
            guard shim_setns(fd, 0x4000_0000) == 0 else { return }
            var output = [UInt8](repeating: 0, count: 4096)
            let (result, action, size) = XDPProgramFixture.testRun(program, frame, ifindex: ifindex, queue: 0, output: &output)
            box.value = result == 0 ? (action, Array(output[0..<size])) : (UInt32.max, [])
        }.join()
        #expect(box.value.0 == XDPForwardProgramTests.redirect, "forwarded at XDP")
        #expect(rig.waitForTemplatePackets(1) == 1)
        #expect(rig.fixture.program.templateCounts(id: Self.id).captured == 1)
    }

    @Test("The follower's owner of an exporter is the program's choice (source_ip; IPv4 and IPv6, a weight-0 member in the set)")
    func ownerIsTheProgramsChoice() throws {
        let rig = try Rig(templates: false)
        for (id, bind, host) in [(UInt32(10), SocketAddress("198.18.100.1:2056")!, "198.18.200.10"), (11, SocketAddress("[2001:db8:100::1]:2056")!, "[2001:db8:200::10]")] {
            var members = (1...4).map { Downstream(name: "m\($0)", address: SocketAddress("\(host):\(7000 + $0)")!) }
            members[2].weight = 0
            let set = BackendSet(downstreams: members, balancing: .sourceIP, slots: ["m1": 0, "m2": 1, "m3": 2, "m4": 3])
            rig.fixture.program.resetListener(id: id)
            try rig.fixture.program.writeSet(id: id, generation: 0, set)
            var entry = fanout_listener()
            entry.id = id
            entry.policy = FANOUT_POLICY_SOURCE_IP.rawValue
            try rig.fixture.program.putListener(bind, ifindex: UInt32(rig.fixture.ifindex), entry)
            let plan = KernelTemplateFollower.Plan(set, downstreams: members.map(\.address), sourceIP: true)
            var seen = Set<UInt16>()
            for n in 1...64 {
                let ip = bind.ip.family == AF_INET ? IPAddress("198.18.\(50 + n / 200).\(n % 200 + 1)")! : IPAddress("2001:db8:50::\(String(n, radix: 16))")!
                let output = rig.fixture.execute(TCNATProgramTests.frame(from: SocketAddress(ip: ip, port: 40000), to: bind, payload: [1, 2, 3])).output
                let parsed = try #require(Packet.parse(output), "\(ip)")
                #expect(parsed.destinationPort == plan.owner(of: ip)?.port, "\(ip)")
                seen.insert(parsed.destinationPort)
            }
            #expect(seen == [7001, 7002, 7004], "every weighted member chosen, the weight-0 one never: \(seen)")
        }
    }

    @Test("The follower: a change of template is copied to every downstream of the set; a set change replays to each downstream that becomes an exporter's, before the flip; a successor and a rollback replay against the set the program reads")
    func followerCopiesAndReplays() throws {
        let state = FlowTemplateState()
        let follower = KernelTemplateFollower(listener: "nf", state: state, logger: Logger(label: "test"))
        // Three collectors on loopback: what the raw socket sends from the exporter's address arrives there.
        let sockets = try (0..<3).map { _ in try UDPReceiver(port: freePort()) }
        let downstreams = sockets.map { SocketAddress(ip: IPAddress("127.0.0.1")!, port: $0.port) }
        func plan(_ members: [Int]) -> KernelTemplateFollower.Plan {
            let chosen = members.map { Downstream(name: "c\($0)", address: downstreams[$0]) }
            return .init(BackendSet(downstreams: chosen, balancing: .sourceIP, slots: [:]), downstreams: chosen.map(\.address), sourceIP: true)
        }
        follower.switchPlan(to: plan([0, 1]))
        let exporters = (2..<42).map { SocketAddress(ip: IPAddress("127.0.0.\($0)")!, port: 2055) }
        for exporter in exporters {
            T.v9(sets: [T.set(0, Self.t256)]).withUnsafeBytes { follower.received($0, from: exporter) }
        }
        // Each exporter's template copied to both downstreams of the set (its own too: the
        // program may have forwarded it by the set before).
        #expect(state.copies.load(ordering: .relaxed) == 80)
        let copied = sockets.map { $0.drain() }
        #expect(copied[0].count == 40 && copied[1].count == 40 && copied[2].isEmpty, "\(copied.map(\.count))")
        #expect(Set(copied[0].map(\.source)) == Set(exporters) && Set(copied[1].map(\.source)) == Set(exporters), "from each exporter's address and port")
        #expect(copied.flatMap { $0 }.allSatisfy { packet in
            packet.payload.withUnsafeBytes { FlowExport.parse($0) }.templates == [Self.t256]
        }, "the template, as a template-only packet")
        // The same template again changes nothing: no copy.
        T.v9(sets: [T.set(0, Self.t256)]).withUnsafeBytes { follower.received($0, from: exporters[0]) }
        #expect(state.copies.load(ordering: .relaxed) == 80)
        // c0 leaves, c2 joins: the exporters whose owner changed are replayed to the new owner, before the caller's flip.
        let before = plan([0, 1]), after = plan([1, 2])
        let moved = exporters.filter { before.owner(of: $0.ip) != after.owner(of: $0.ip) }
        follower.switchPlan(to: after)
        #expect(state.replays.load(ordering: .relaxed) == UInt64(moved.count) && !moved.isEmpty)
        let replayed = sockets.map { $0.drain() }
        #expect(replayed[0].isEmpty)
        for exporter in moved {
            let owner = try #require(after.owner(of: exporter.ip))
            let index = try #require(downstreams.firstIndex(of: owner))
            #expect(replayed[index].contains { $0.source == exporter }, "\(exporter) replayed to its new owner \(owner)")
        }
        #expect(state.sendDropped.load(ordering: .relaxed) == 0)
        // A reload's successor (a new instance, the same listener's state): the same set replays
        // nothing; its first change replays from each exporter's own port, never port 0.
        let successor = KernelTemplateFollower(listener: "nf", state: state, logger: Logger(label: "test"))
        let replaysBefore = state.replays.load(ordering: .relaxed)
        successor.switchPlan(to: after)
        #expect(state.replays.load(ordering: .relaxed) == replaysBefore, "the set the program reads is known to the successor")
        let third = plan([0, 2])
        successor.switchPlan(to: third)
        let again = sockets.map { $0.drain() }.flatMap { $0 }
        #expect(!again.isEmpty && again.allSatisfy { $0.source.port == 2055 }, "\(again.map(\.source))")
        #expect(state.sendDropped.load(ordering: .relaxed) == 0)
        // The reload fails and is rolled back: the first follower's set ([1, 2]) is the program's
        // again, and the exporters it gives back to c1 are replayed there.
        let givenBack = exporters.filter { third.owner(of: $0.ip) != after.owner(of: $0.ip) && after.owner(of: $0.ip) == downstreams[1] }
        follower.reassert()
        let back = sockets.map { $0.drain() }
        #expect(!givenBack.isEmpty && Set(back[1].map(\.source)) == Set(givenBack), "\(back.map(\.count)) for \(givenBack.count)")
        #expect(state.kernelFollowing.withLock { $0.plan?.downstreams } == after.downstreams)
    }

    @Test("The follower with replication pools: a change of template is copied to the listener's set and to every member of each pool that takes the exporter (not one whose sources leave it out); a member joining a pool gets the exporters it becomes the receiver of, before the flip")
    func followerFollowsPools() throws {
        let state = FlowTemplateState()
        let follower = KernelTemplateFollower(listener: "nf", state: state, logger: Logger(label: "test"))
        let sockets = try (0..<6).map { _ in try UDPReceiver(port: freePort()) }
        let addresses = sockets.map { SocketAddress(ip: IPAddress("127.0.0.1")!, port: $0.port) }
        func set(_ members: [Int], sourceIP: Bool) -> KernelTemplateFollower.Plan {
            let chosen = members.map { Downstream(name: "c\($0)", address: addresses[$0]) }
            return .init(BackendSet(downstreams: chosen, balancing: sourceIP ? .sourceIP : .roundRobin, slots: [:]), downstreams: chosen.map(\.address), sourceIP: sourceIP)
        }
        // c0: the listener's; c1, c2: a source_ip pool; c3: an `all` pool; c4: a pool taking 10.99.0.0/16 only.
        func plan(balanced: [Int]) -> KernelTemplateFollower.Plan {
            var plan = set([0], sourceIP: true)
            plan.pools = [
                .init(set: set(balanced, sourceIP: true), sample: 1, prefixes: []),
                .init(set: set([3], sourceIP: false), sample: 1, prefixes: []),
                .init(set: set([4], sourceIP: true), sample: 1, prefixes: [SourcePrefix("10.99.0.0/16")!]),
            ]
            return plan
        }
        follower.switchPlan(to: plan(balanced: [1, 2]))
        let exporters = (2..<42).map { SocketAddress(ip: IPAddress("127.0.0.\($0)")!, port: 2055) }
        for exporter in exporters {
            T.v9(sets: [T.set(0, Self.t256)]).withUnsafeBytes { follower.received($0, from: exporter) }
        }
        let copied = sockets.map { $0.drain().count }
        #expect(copied == [40, 40, 40, 40, 0, 0], "every exporter's template to c0-c3, none to c4: \(copied)")
        #expect(state.copies.load(ordering: .relaxed) == 160)
        // c5 joins the source_ip pool: the exporters it now receives are replayed there, and only there.
        let before = plan(balanced: [1, 2]), after = plan(balanced: [1, 2, 5])
        let moved = exporters.filter { before.pools[0].set.owner(of: $0.ip) != after.pools[0].set.owner(of: $0.ip) }
        follower.switchPlan(to: after)
        let replayed = sockets.map { $0.drain() }
        #expect(!moved.isEmpty && moved.allSatisfy { after.pools[0].set.owner(of: $0.ip) == addresses[5] })
        #expect(Set(replayed[5].map(\.source)) == Set(moved) && replayed[5].count == moved.count, "\(replayed.map(\.count)) for \(moved.count) moved")
        #expect(replayed[0...4].allSatisfy { $0.isEmpty })
        #expect(state.replays.load(ordering: .relaxed) == UInt64(moved.count) && state.sendDropped.load(ordering: .relaxed) == 0)
        // A listener's downstream that is also a pool's member is one receiver: sent once.
        var shared = plan(balanced: [1, 2, 5])
        shared.pools[1] = .init(set: set([0, 3], sourceIP: false), sample: 1, prefixes: [])
        T.v9(sets: [T.set(0, T.template(257, T.fields4))]).withUnsafeBytes { follower.switchPlan(to: shared); follower.received($0, from: exporters[0]) }
        let once = sockets.map { $0.drain().count }
        #expect(once[0] == 1 && once[3] == 1 && once[4] == 0, "\(once)")
    }
}

extension FlowExport.Parsed {
    /// The template records a parsed packet defines (empty for anything else).
    var templates: [[UInt8]] {
        guard case .packet(let packet) = self else { return [] }
        return packet.changes.compactMap { if case .defined(let template) = $0 { template.record } else { nil } }
    }
}

/// A UDP socket on loopback that reads what has arrived, with its sources.
final class UDPReceiver {
    let fd: Int32
    let port: UInt16

    init(port: UInt16) throws {
        fd = socket(AF_INET, 2 | 0o4000, 0)  // SOCK_DGRAM | SOCK_NONBLOCK
        self.port = port
        var address = sockaddr_storage()
        _ = SocketAddress(ip: IPAddress("127.0.0.1")!, port: port).write(to: &address)
        let bound = withUnsafePointer(to: &address) { $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) } }
        try #require(fd >= 0 && bound == 0, "bind 127.0.0.1:\(port): errno \(errno)")
    }

    deinit { close(fd) }

    /// Everything queued now (after a moment for the loopback to deliver).
    func drain() -> [(source: SocketAddress, payload: [UInt8])] {
        usleep(50_000)
        var found: [(SocketAddress, [UInt8])] = []
        var buffer = [UInt8](repeating: 0, count: 65536)
        while true {
            var address = sockaddr_storage()
            var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
            let count = withUnsafeMutablePointer(to: &address) { pointer in
                pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { recvfrom(fd, &buffer, buffer.count, 0, $0, &length) }
            }
            guard count >= 0, let source = withUnsafePointer(to: &address, { SocketAddress(storage: UnsafeRawPointer($0)) }) else { break }
            found.append((source, Array(buffer[0..<count])))
        }
        return found
    }
}

/// settings.flow_templates with real collectors in the kernel kinds: the userspace test's scenario
/// (FlowTemplateEndToEndTests) in namespaces, through tc_ebpf, xdp and af_xdp. 40 exporters send
/// NetFlow v9 or IPFIX, templates in each one's first packet only, balanced by source over two
/// nfcapd collectors; mid-run one collector is killed (kill -9) and a reload takes it out, then a
/// third, pmacct's nfacctd, is added by another reload.
@Suite("flow templates: real collectors keep decoding when exporters change collector (tc_ebpf, xdp, af_xdp)", .serialized,
       .enabled(if: Privileges.enabled, Privileges.reason))
struct KernelFlowTemplateEndToEndTests {
    struct Outcome {
        var records = 0
        var decoded = 0
        var toKilled = 0
        var metrics = ""
        var mode = ""
        /// Pooled: records decoded by the listener's own collector (every datagram reaches it).
        var decodedByOwn = 0

        func event(_ name: String) -> Int? { metric(metrics, "udp_fanout_flow_templates_total", "listener=\"nf\",mode=\"\(mode)\",event=\"\(name)\"") }
    }

    /// - Parameter pooled: the three collectors are members of a replication pool (`collectors`,
    ///   source_ip) instead of the listener's own downstreams, which are one more nfcapd (in the
    ///   third backend, on the next port) that gets every datagram.
    static func run(_ mode: String, _ version: String, templates: Bool, pooled: Bool = false) throws -> Outcome {
        try #require(FileManager.default.isExecutableFile(atPath: "/usr/bin/nfcapd"), "nfcapd missing: make test installs nfdump (scripts/setup.sh)")
        let topology = try Topology(backends: 3, queues: mode == "af_xdp" ? 2 : 1)
        defer { topology.destroy() }
        try TCFixtures.addClientSources(topology)
        if mode == "xdp" { try TCFixtures.prepareXDP(topology) }
        // Two nfcapd and, added mid-run, pmacct's nfacctd.
        let collectors: [any FlowCollector] = try (1...3).map { n in
            let (address, prefix) = (Topology.backendIPv4(n), topology.prefix(topology.backends[n - 1]))
            return n < 3 ? try NetFlowCollector(address: address, port: UInt16(TCFixtures.port), prefix: prefix)
                : try NFAcctCollector(address: address, port: UInt16(TCFixtures.port), prefix: prefix)
        }
        let own = pooled ? try NetFlowCollector(address: Topology.backendIPv4(3), port: UInt16(TCFixtures.port + 1), prefix: topology.prefix(topology.backends[2])) : nil
        usleep(300_000)  // the collectors bind
        func yaml(_ members: [Int]) -> String {
            let list = "[\(members.map { "{name: c\($0), address: \"\(Topology.backendIPv4($0)):\(TCFixtures.port)\"}" }.joined(separator: ", "))]"
            return """
                listeners:
                  - name: nf
                    bind: "198.18.0.1:2055"
                    interface: \(topology.proxyInterface)
                    mode: \(mode)
                    balancing: source_ip
                    settings: {flow_templates: \(templates)\(mode == "af_xdp" ? ", output: preserve_source" : "")}
                    downstream: \(own == nil ? list : "[{name: own, address: \"\(Topology.backendIPv4(3)):\(TCFixtures.port + 1)\"}]")
                \(own == nil ? "" : "    pools: [{name: collectors, balancing: source_ip, downstream: \(list)}]\n")metrics: {enabled: true, bind: "127.0.0.1:9464"}
                """
        }
        let file = try TCFixtures.write(yaml([1, 2]), "flow-templates-\(mode)")
        defer { try? FileManager.default.removeItem(at: file) }
        let daemon = try Child("udp-fanout", ["-c", file.path], prefix: topology.prefix(topology.proxy))
        try daemon.waitFor(mode == "af_xdp" ? "AF_XDP path initialized" : "registered listener in eBPF map")
        let publisher = try Child("publisher", ["198.18.0.1", "2055", "6000", "--sources", "198.18.0.10-198.18.0.49", "--netflow", version,
                                                "--template-every", "100000", "--rate", "2000"], prefix: topology.prefix(topology.client))
        usleep(1_000_000)
        collectors[0].child.signal(SIGKILL)
        _ = collectors[0].child.wait(seconds: 5)
        try yaml([2]).write(to: file, atomically: true, encoding: .utf8)
        daemon.signal(SIGHUP)
        usleep(700_000)
        try yaml([2, 3]).write(to: file, atomically: true, encoding: .utf8)
        daemon.signal(SIGHUP)
        #expect(publisher.wait(seconds: 30) == 0, "\(publisher.stderr)")
        let report = try publisher.json()
        usleep(500_000)
        var outcome = Outcome()
        outcome.mode = mode
        outcome.records = report.int("records")
        outcome.metrics = try TCFixtures.metrics(topology)
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0, "\(daemon.stderr)")
        #expect(daemon.stderr.components(separatedBy: "reload=true").count - 1 == 2, "two reloads applied: \(daemon.stderr)")
        func forwarded(_ member: String) -> Int {
            pooled ? metric(outcome.metrics, "udp_fanout_pool_member_copies_total", "listener=\"nf\",mode=\"\(mode)\",pool=\"collectors\",downstream=\"\(member)\"") ?? 0
                   : metric(outcome.metrics, "udp_fanout_downstream_packets_forwarded_total", "listener=\"nf\",mode=\"\(mode)\",downstream=\"\(member)\"") ?? 0
        }
        outcome.toKilled = forwarded("c1") * 10
        let flows = try collectors[1...].map { try $0.flowsByExporter() }
        outcome.decoded = flows.map { $0.values.reduce(0, +) }.reduce(0, +)
        if let own { outcome.decodedByOwn = try own.flowsByExporter().values.reduce(0, +) }
        #expect(report.int("sent") == 6000 && outcome.records == 60_000, "\(report)")
        // Forwarded to, whether it could decode them or not (off: it cannot).
        #expect(forwarded("c3") > 0, "the added collector got exporters: \(outcome.metrics)")
        print("flow templates \(mode) \(version) \(templates ? "on" : "off")\(pooled ? ", the collectors in a replication pool" : ""): records sent \(outcome.records), to the killed collector \(outcome.toKilled), decoded by the others \(outcome.decoded), lost \(outcome.records - outcome.toKilled - outcome.decoded); template packets passed up \(outcome.event("template_packets").map(String.init) ?? "-"), replayed \(outcome.event("replayed").map(String.init) ?? "-"), copied \(outcome.event("copied").map(String.init) ?? "-")")
        return outcome
    }

    @Test("on: every record sent to a living collector decodes, through a kill -9 and an added collector; templates passed up, copied and replayed, counted",
          arguments: [("tc_ebpf", "v9"), ("tc_ebpf", "ipfix"), ("xdp", "v9"), ("af_xdp", "v9")])
    func templatesFollow(mode: String, version: String) throws {
        let outcome = try Self.run(mode, version, templates: true)
        #expect(outcome.toKilled > 0 && outcome.decoded == outcome.records - outcome.toKilled,
                "sent \(outcome.records), to the killed collector \(outcome.toKilled), decoded \(outcome.decoded)")
        #expect((outcome.event("template_packets") ?? 0) >= 40, "each exporter's first packet (xdp: tc may pass one up again): \(outcome.metrics)")
        // tc_ebpf and xdp copy to both collectors of the set; af_xdp's relay to the other one.
        #expect(mode == "af_xdp" ? (outcome.event("copied") ?? 0) >= 40 : outcome.event("copied") == 80, "each exporter's templates to the collectors")
        #expect((outcome.event("replayed") ?? 0) > 0, "to the added collector")
        for event in ["malformed", "send_dropped"] + (mode == "af_xdp" ? [] : ["too_large", "ring_full", "fragmented"]) {
            #expect(outcome.event(event) == 0, "\(event): \(outcome.metrics)")
        }
        #expect(metric(outcome.metrics, "udp_fanout_flow_template_exporters", "listener=\"nf\",mode=\"\(mode)\"") == 40)
    }

    @Test("on, the collectors members of a replication pool: every record sent to a living member decodes through the kill -9 and the added member; the listener's own collector decodes every record",
          arguments: ["tc_ebpf", "af_xdp"])
    func templatesFollowInPool(mode: String) throws {
        let outcome = try Self.run(mode, "v9", templates: true, pooled: true)
        #expect(outcome.toKilled > 0 && outcome.decoded == outcome.records - outcome.toKilled,
                "sent \(outcome.records), to the killed member \(outcome.toKilled), decoded \(outcome.decoded)")
        #expect(outcome.decodedByOwn == outcome.records, "the listener's own collector: \(outcome.decodedByOwn) of \(outcome.records)")
        #expect((outcome.event("copied") ?? 0) >= 40 && (outcome.event("replayed") ?? 0) > 0, "\(outcome.metrics)")
        #expect(outcome.event("send_dropped") == 0 && outcome.event("malformed") == 0, "\(outcome.metrics)")
    }

    @Test("off (what the option fixes): the exporters that moved lose their records at their new collector", arguments: ["tc_ebpf", "xdp", "af_xdp"])
    func withoutTemplates(mode: String) throws {
        let outcome = try Self.run(mode, "v9", templates: false)
        #expect(outcome.decoded < outcome.records - outcome.toKilled, "sent \(outcome.records), to the killed collector \(outcome.toKilled), decoded \(outcome.decoded)")
        #expect(outcome.event("template_packets") == nil, "no template series without the option")
    }
}
