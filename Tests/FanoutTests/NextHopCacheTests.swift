// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import CSystemShim
import Logging
import ReusePortLB
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// The next-hop cache (bpf/include/fanout_hops.h): the tc and xdp programs under
/// BPF_PROG_TEST_RUN with the route generation written by hand (an answer used until the
/// generation changes; off, past its deadline, or longer than the route's MTU, looked up), and
/// the route watch that writes it against the kernel of a namespace of the test's own (on with
/// the kernel's defaults; a new generation on a notification; off for a policy rule, a route over
/// several next hops, a next-hop group or by source; off when it stops).
@Suite("next-hop cache (tc and xdp programs, the route watch)", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct NextHopCacheTests {
    static let redirect = TCProgramFixture.redirect, shot = TCProgramFixture.shot

    static func coarseNow() -> UInt64 { TCRouteWatch.coarseNow() }

    /// The backends' neighbour entry (198.18.200.10 on t0) with link-layer address 02:00:00:00:00:`last`.
    static func neighbour(_ fixture: TCProgramFixture, _ last: UInt8) throws {
        let mac = String(format: "02:00:00:00:00:%02x", last)
        let result = try run("/usr/sbin/ip", ["-n", fixture.namespace, "neigh", "replace", "198.18.200.10", "lladdr", mac, "dev", "t0", "nud", "permanent"])
        try #require(result.status == 0, "ip neigh replace: \(result.output)")
    }

    static func mac(_ last: UInt8) -> [UInt8] { [2, 0, 0, 0, 0, last] }

    /// Three datagrams to 5514 (round robin: each of its three backend slots once): the
    /// destination MAC each left with.
    static func macs(_ run: ([UInt8]) -> (UInt32, [UInt8]), expecting action: UInt32) -> [[UInt8]] {
        (1...3).map { _ in
            let (verdict, output) = run(Packet.ipv4(payload: Array("hop".utf8)))
            return verdict == action && output.count >= 6 ? Array(output[0..<6]) : []
        }
    }

    /// The same steps through either program: `run` one frame.
    static func cachedUntilTheGenerationChanges(_ fixture: TCProgramFixture, action: UInt32, run: ([UInt8]) -> (UInt32, [UInt8])) throws {
        let far = coarseNow() + 600_000_000_000
        // Off (a new program's state): each datagram is looked up.
        try neighbour(fixture, 0x0b)
        #expect(macs(run, expecting: action) == Array(repeating: mac(0x0b), count: 3), "off: looked up")
        try neighbour(fixture, 0x0c)
        #expect(macs(run, expecting: action) == Array(repeating: mac(0x0c), count: 3), "off: looked up again")
        // On: the first datagram of each slot is looked up and kept; the next take the kept answer
        // even though the neighbour changed, until the generation does.
        try fixture.program.setRoute(generation: 1, validUntil: far)
        #expect(macs(run, expecting: action) == Array(repeating: mac(0x0c), count: 3), "on: looked up and kept")
        try neighbour(fixture, 0x0d)
        #expect(macs(run, expecting: action) == Array(repeating: mac(0x0c), count: 3), "on: the kept answer (the neighbour changed unnoticed)")
        try fixture.program.setRoute(generation: 2, validUntil: far)
        #expect(macs(run, expecting: action) == Array(repeating: mac(0x0d), count: 3), "a new generation: looked up again")
        // Past its deadline the generation holds nothing.
        try neighbour(fixture, 0x0e)
        try fixture.program.setRoute(generation: 2, validUntil: coarseNow() - 1)
        #expect(macs(run, expecting: action) == Array(repeating: mac(0x0e), count: 3), "past the deadline: looked up")
        // Off again.
        try fixture.program.setRoute(generation: 3, validUntil: far)
        _ = macs(run, expecting: action)
        try neighbour(fixture, 0x0a)
        try fixture.program.setRoute(generation: 0, validUntil: far)
        #expect(macs(run, expecting: action) == Array(repeating: mac(0x0a), count: 3), "off: looked up")
    }

    @Test("tc: an answer kept per backend slot is used until the generation changes; off or past its deadline, looked up")
    func tcKept() throws {
        let fixture = try TCProgramFixture()
        try Self.cachedUntilTheGenerationChanges(fixture, action: Self.redirect) { fixture.execute($0) }
        #expect(fixture.stats(0).verdicts[Int(FANOUT_VERDICT_FORWARDED.rawValue)] == 24, "every datagram forwarded")
    }

    @Test("xdp: the same answers through the xdp program (which shares the tc program's cache)")
    func xdpKept() throws {
        let rig = try XDPForwardProgramTests.Rig()
        try Self.cachedUntilTheGenerationChanges(rig.fixture, action: XDPForwardProgramTests.redirect) { rig.run($0) }
        #expect(rig.verdict(0, FANOUT_VERDICT_FORWARDED) == 24, "every datagram forwarded at XDP")
    }

    @Test("tc: a datagram longer than the kept route's MTU is looked up and dropped too_large; one within it uses the kept answer")
    func tcMTU() throws {
        let fixture = try TCProgramFixture()
        try fixture.add(TCProgramFixture.listenerBind(5602), id: 9, BackendSet(
            downstreams: [Downstream(name: "narrow", address: SocketAddress("198.18.210.10:7200")!)], balancing: .roundRobin, slots: ["narrow": 5]))
        try fixture.program.setRoute(generation: 1, validUntil: Self.coarseNow() + 600_000_000_000)
        let small = Packet.ipv4(payload: [UInt8](repeating: 7, count: 100), port: 5602)
        let large = Packet.ipv4(payload: [UInt8](repeating: 7, count: 1000), port: 5602)
        #expect(fixture.execute(small).verdict == Self.redirect, "looked up, kept (route MTU 600)")
        #expect(fixture.execute(large).verdict == Self.shot, "longer than the kept MTU: looked up, too large")
        #expect(fixture.execute(small).verdict == Self.redirect)
        let counted = fixture.program.backendStats(id: 9, slot: 5)
        #expect(counted.tooLarge == 1 && counted.packets == 2, "\(counted)")
    }

    @Test("tc: a replication pool's copies take the kept answer too, per member, until the generation changes; a copy longer than a member's kept MTU is looked up and dropped too_large")
    func tcPoolCopies() throws {
        typealias Fixture = TCProgramFixture
        let fixture = try Fixture()
        let members = [Fixture.member("a1", "198.18.200.10:7001"), Fixture.member("a2", "198.18.210.10:7002")]
        try fixture.addListener(bind: SocketAddress(ip: ProgramFrames.listenerV4.ip, port: 5521), id: 20,
                                own: [Fixture.member("b1", "198.18.200.10:6001")],
                                pools: [Fixture.PoolSpec(id: 21, policy: FANOUT_POLICY_ALL, members: members)])
        let ports: Set<UInt16> = [7001, 7002]
        let small = Packet.ipv4(payload: Array(repeating: 0x41, count: 100), port: 5521)
        /// The destination MAC of the copy to 198.18.200.10 (a1), and how many copies left.
        func copyMAC() -> ([UInt8], Int) {
            let (verdict, _, copies) = TCPoolProgramTests.executeCapturing(fixture, small, ports: ports, expected: 2)
            #expect(verdict == Self.redirect, "the own datagram redirected")
            let toA1 = copies.first { Packet.parse($0)?.destinationPort == 7001 }
            return (toA1.map { Array($0[0..<6]) } ?? [], copies.count)
        }
        let far = Self.coarseNow() + 600_000_000_000
        try Self.neighbour(fixture, 0x0b)
        try fixture.program.setRoute(generation: 1, validUntil: far)
        #expect(copyMAC() == (Self.mac(0x0b), 2), "on: looked up and kept")
        try Self.neighbour(fixture, 0x0c)
        #expect(copyMAC() == (Self.mac(0x0b), 2), "on: the copy takes the kept answer (the neighbour changed unnoticed)")
        try fixture.program.setRoute(generation: 2, validUntil: far)
        #expect(copyMAC() == (Self.mac(0x0c), 2), "a new generation: looked up again")
        try Self.neighbour(fixture, 0x0d)
        try fixture.program.setRoute(generation: 0, validUntil: far)
        #expect(copyMAC() == (Self.mac(0x0d), 2), "off: looked up")
        // a2 sits behind the fixture's 600-byte route: a copy longer than that is looked up and dropped.
        try fixture.program.setRoute(generation: 3, validUntil: far)
        let large = Packet.ipv4(payload: Array(repeating: 0x42, count: 1000), port: 5521)
        let (_, _, copies) = TCPoolProgramTests.executeCapturing(fixture, large, ports: ports, expected: 1)
        #expect(copies.compactMap { Packet.parse($0)?.destinationPort } == [7001], "only a1's copy leaves")
        #expect(copyMAC() == (Self.mac(0x0d), 2), "within the MTU: kept answers")
        let a2 = fixture.program.memberStats(id: 21, slot: 1)
        #expect(a2.copies == 5 && a2.dropped["too_large"] == 1, "a2: \(a2)")
        #expect(fixture.program.memberStats(id: 21, slot: 0).copies == 6, "a1: every copy")
    }

    /// Runs `body` on a thread inside the fixture's namespace.
    static func inNamespace(_ fixture: TCProgramFixture, _ body: @escaping @Sendable () -> Void) {
        let fd = fixture.namespaceFD
        OSThread(name: "hop-test") {
            guard shim_setns(fd, 0x4000_0000) == 0 else { return }  // CLONE_NEWNET
            body()
        }.join()
    }

    static func ip(_ fixture: TCProgramFixture, _ arguments: [String]) throws -> Bool {
        try run("/usr/sbin/ip", ["-n", fixture.namespace] + arguments).status == 0
    }

    @Test("The route watch: on with the kernel's defaults, a new generation on a notification; off for a policy rule, a route over several next hops, a next-hop group or by source, and when it stops")
    func watch() throws {
        let fixture = try TCProgramFixture()
        try withExtendedLifetime(fixture) { try watching(fixture) }
    }

    func watching(_ fixture: TCProgramFixture) throws {
        let watch = TCRouteWatch(program: fixture.program, logger: Logger(label: "route-watch-test"))
        Self.inNamespace(fixture) { watch.start() }
        defer { watch.stop() }
        let program = fixture.program
        try waitUntil("on with the kernel's default rules and routes") { program.route.generation != 0 }
        // A notification (a neighbour replaced) makes a new generation.
        var seen = watch.notifications.load(ordering: .relaxed)
        var generation = program.route.generation
        try Self.neighbour(fixture, 0x0b)
        try waitUntil("a neighbour's notification seen") { watch.notifications.load(ordering: .relaxed) > seen }
        try waitUntil("a new generation after it") { program.route.generation != generation && program.route.generation != 0 }
        #expect(program.route.valid_until > Self.coarseNow(), "a deadline ahead")
        // A policy rule: off, and it stays off through renewals.
        try #require(try Self.ip(fixture, ["rule", "add", "from", "198.18.0.0/16", "table", "100", "priority", "100"]))
        try waitUntil("off for a policy rule") { program.route.generation == 0 && watch.problem?.contains("priority 100") == true }
        usleep(1_500_000)
        #expect(program.route.generation == 0, "stays off past a renewal")
        try #require(try Self.ip(fixture, ["rule", "del", "priority", "100"]))
        try waitUntil("on again once the rule is gone") { program.route.generation != 0 }
        // A route over two next hops (ECMP) in the main table: off; gone: on.
        try #require(try Self.ip(fixture, ["route", "add", "198.19.60.0/24", "nexthop", "via", "198.18.200.10", "dev", "t0", "nexthop", "via", "198.18.200.11", "dev", "t0"]))
        try waitUntil("off for a route over several next hops") { program.route.generation == 0 && watch.problem?.contains("several next hops") == true }
        try #require(try Self.ip(fixture, ["route", "del", "198.19.60.0/24"]))
        try waitUntil("on again once that route is gone") { program.route.generation != 0 }
        // A route in a table no default rule looks up changes nothing but the generation.
        seen = watch.notifications.load(ordering: .relaxed)
        generation = program.route.generation
        try #require(try Self.ip(fixture, ["route", "add", "198.19.61.0/24", "table", "100", "nexthop", "via", "198.18.200.10", "dev", "t0", "nexthop", "via", "198.18.200.11", "dev", "t0"]))
        try waitUntil("the other table's notification seen") { watch.notifications.load(ordering: .relaxed) > seen }
        try waitUntil("a new generation, still on") { program.route.generation != generation && program.route.generation != 0 }
        // An IPv6 route chosen by source (where the kernel has source routing).
        if try Self.ip(fixture, ["-6", "route", "add", "2001:db8:300::/64", "from", "2001:db8:50::/64", "dev", "t0"]) {
            try waitUntil("off for a route by source") { program.route.generation == 0 && watch.problem?.contains("by source") == true }
            try #require(try Self.ip(fixture, ["-6", "route", "del", "2001:db8:300::/64", "from", "2001:db8:50::/64", "dev", "t0"]))
            try waitUntil("on again once it is gone") { program.route.generation != 0 }
        }
        // Next-hop objects (where the kernel has them): a route through a single one stays on, through a group goes off.
        if try Self.ip(fixture, ["nexthop", "add", "id", "71", "via", "198.18.200.10", "dev", "t0"]),
           try Self.ip(fixture, ["nexthop", "add", "id", "72", "via", "198.18.200.11", "dev", "t0"]),
           try Self.ip(fixture, ["nexthop", "add", "id", "70", "group", "71/72"]) {
            seen = watch.notifications.load(ordering: .relaxed)
            try #require(try Self.ip(fixture, ["route", "add", "198.19.62.0/24", "nhid", "71"]))
            try waitUntil("the route's notification seen") { watch.notifications.load(ordering: .relaxed) > seen }
            try waitUntil("still on through a single next-hop object") { program.route.generation != 0 && watch.problem == nil }
            // Without the compatibility listing (net.ipv4.nexthop_compat_mode 1, the default, also
            // lists the group's next hops) the route names the group alone: off for the group itself.
            let compat = try run("/usr/bin/nsenter", ["--net=/run/netns/\(fixture.namespace)", "--", "/usr/sbin/sysctl", "-q", "-w", "net.ipv4.nexthop_compat_mode=0"])
            try #require(compat.status == 0, "sysctl net.ipv4.nexthop_compat_mode=0: \(compat.output)")
            try #require(try Self.ip(fixture, ["route", "add", "198.19.63.0/24", "nhid", "70"]))
            try waitUntil("off through a next-hop group") { program.route.generation == 0 && watch.problem?.contains("198.19.63.0/24 goes over next-hop group 70") == true }
            try #require(try Self.ip(fixture, ["nexthop", "del", "id", "70"]))
            try waitUntil("on again once the group (and its route) is gone") { program.route.generation != 0 && watch.problem == nil }
        }
        // An IPv4 spread behind a second key of the same prefix (IPv4 keeps both): deleting the
        // plain one leaves the spread, and the cache off.
        try #require(try Self.ip(fixture, ["route", "add", "198.19.64.0/24", "via", "198.18.200.10", "dev", "t0"]))
        try #require(try Self.ip(fixture, ["route", "append", "198.19.64.0/24", "nexthop", "via", "198.18.200.10", "dev", "t0", "nexthop", "via", "198.18.200.11", "dev", "t0"]))
        try waitUntil("off for the appended spread") { program.route.generation == 0 && watch.problem?.contains("198.19.64.0/24") == true }
        seen = watch.notifications.load(ordering: .relaxed)
        try #require(try Self.ip(fixture, ["route", "del", "198.19.64.0/24", "via", "198.18.200.10", "dev", "t0"]))
        try waitUntil("the plain route's deletion seen (and its key read again)") { watch.notifications.load(ordering: .relaxed) > seen }
        usleep(1_200_000)
        #expect(program.route.generation == 0 && watch.problem?.contains("198.19.64.0/24") == true, "still off past a renewal: the spread is left")
        try #require(try Self.ip(fixture, ["route", "del", "198.19.64.0/24"]))
        try waitUntil("on once the spread is gone too") { program.route.generation != 0 && watch.problem == nil }
        // A link down takes its routes along unannounced: a spread through it goes, and the cache comes on.
        try #require(try Self.ip(fixture, ["link", "add", "t9", "type", "veth", "peer", "name", "t9p"]))
        try #require(try Self.ip(fixture, ["link", "set", "t9", "up"]))
        try #require(try Self.ip(fixture, ["link", "set", "t9p", "up"]))
        try #require(try Self.ip(fixture, ["addr", "add", "198.19.90.1/24", "dev", "t9"]))
        try #require(try Self.ip(fixture, ["route", "add", "198.19.65.0/24", "nexthop", "via", "198.19.90.2", "dev", "t9", "nexthop", "via", "198.19.90.3", "dev", "t9"]))
        try waitUntil("off for a spread through t9") { program.route.generation == 0 && watch.problem?.contains("198.19.65.0/24") == true }
        try #require(try Self.ip(fixture, ["link", "del", "t9"]))
        try waitUntil("on once t9 and its routes are gone") { program.route.generation != 0 && watch.problem == nil }
        watch.stop()
        #expect(program.route.generation == 0, "off once stopped")
    }

    @Test("Rules, routes and next-hop objects as the kernel lists them: the defaults, plain and TOS routes, other tables and single next-hop objects pass; a selector, another table or priority, a spread, a group, a source route do not, until replaced or deleted")
    func classification() {
        func rule(family: Int32 = AF_INET, priority: UInt32, table: UInt32, extra: [(UInt16, [UInt8])] = [], header: [UInt8] = []) -> [UInt8] {
            var payload: [UInt8] = header.isEmpty ? [UInt8(family), 0, 0, 0, UInt8(min(table, 252)), 0, 0, 1, 0, 0, 0, 0] : header
            for (type, value) in [(UInt16(15), withUnsafeBytes(of: table) { Array($0) }), (UInt16(6), withUnsafeBytes(of: priority) { Array($0) })] + extra {
                NextHopResolver.appendAttribute(&payload, type: type, value)
            }
            return payload
        }
        #expect(TCRouteWatch.ruleProblem(rule(priority: 32766, table: 254)) == nil)
        #expect(TCRouteWatch.ruleProblem(rule(family: AF_INET6, priority: 32766, table: 254)) == nil)
        #expect(TCRouteWatch.ruleProblem(rule(priority: 32766, table: 254, extra: [(14, [0xff, 0xff, 0xff, 0xff]), (21, [2])])) == nil, "unset suppress_prefixlen, protocol")
        #expect(TCRouteWatch.ruleProblem(rule(priority: 100, table: 100)) != nil)
        #expect(TCRouteWatch.ruleProblem(rule(family: AF_INET6, priority: 32767, table: 253)) != nil, "IPv6 has no default table rule")
        #expect(TCRouteWatch.ruleProblem(rule(priority: 32766, table: 254, extra: [(10, [1, 0, 0, 0])])) != nil, "a fwmark selector")
        #expect(TCRouteWatch.ruleProblem(rule(priority: 32766, table: 254, header: [UInt8(AF_INET), 0, 16, 0, 254, 0, 0, 1, 0, 0, 0, 0])) != nil, "from a prefix")
        #expect(TCRouteWatch.ruleProblem([2, 0]) != nil, "unreadable")
        func route(family: Int32 = AF_INET, source: UInt8 = 0, tos: UInt8 = 0, table: UInt8 = 254, extra: [(UInt16, [UInt8])] = []) -> [UInt8] {
            var payload: [UInt8] = [UInt8(family), 24, source, tos, table, 3, 0, 1, 0, 0, 0, 0]
            NextHopResolver.appendAttribute(&payload, type: 1, family == AF_INET ? [198, 19, 0, 0] : [UInt8](repeating: 0x20, count: 16))
            for (type, value) in extra { NextHopResolver.appendAttribute(&payload, type: type, value) }
            return payload
        }
        var policy = TCRouteWatch.Policy()
        var looked = policy.noteRoute(route(), flags: 0, deleted: false)
        #expect(looked && policy.problem == nil, "a plain route")
        looked = policy.noteRoute(route(tos: 0x10), flags: 0, deleted: false)
        #expect(looked && policy.problem == nil, "by TOS: the programs look up TOS 0, as cached")
        looked = policy.noteRoute(route(table: 100, extra: [(9, [0, 0, 0, 0])]), flags: 0, deleted: false)
        #expect(!looked && policy.problem == nil, "a table no default rule looks up")
        looked = policy.noteRoute(route(table: 252, extra: [(15, [0, 1, 0, 0]), (9, [0, 0, 0, 0])]), flags: 0, deleted: false)
        #expect(!looked && policy.problem == nil, "RTA_TABLE 256")
        _ = policy.noteRoute(route(extra: [(9, [0, 0, 0, 0])]), flags: 0, deleted: false)
        #expect(policy.problem?.contains("several next hops") == true, "multipath")
        // What is left under a described key, deleted or replaced without a spread, is read
        // again (IPv4 keeps several routes under one key; IPv6 deletes next hops one by one).
        _ = policy.noteRoute(route(), flags: 0, deleted: false)
        #expect(policy.problem != nil && policy.reread == [UInt8(AF_INET)], "replaced by a plain route: read again, off meanwhile")
        policy.reread = []
        _ = policy.noteRoute(route(), flags: 0, deleted: true)
        #expect(policy.problem != nil && policy.reread == [UInt8(AF_INET)], "deleted: read again, off meanwhile")
        policy.reread = []
        policy.routes = [:]
        _ = policy.noteRoute(route(), flags: 0, deleted: true)
        #expect(policy.reread.isEmpty, "a route never described deleted: nothing to read")
        // A dump lists every route under a key: a plain one after a spread describes nothing and
        // asks for no read (the dump is the read).
        _ = policy.noteRoute(route(extra: [(9, [0, 0, 0, 0])]), flags: 0, deleted: false, dumped: true)
        _ = policy.noteRoute(route(), flags: 0, deleted: false, dumped: true)
        #expect(policy.problem != nil && policy.reread.isEmpty, "spread, then plain, in one dump")
        policy.routes = [:]
        _ = policy.noteRoute(route(family: AF_INET6, extra: [(9, [0, 0, 0, 0])]), flags: 0, deleted: false)
        _ = policy.noteRoute(route(family: AF_INET6), flags: 0, deleted: true)
        #expect(policy.reread == [UInt8(AF_INET6)], "an IPv6 spread's next hop deleted: IPv6 read again")
        policy.reread = []
        policy.routes = [:]
        _ = policy.noteRoute(route(family: AF_INET6), flags: 0x800, deleted: false)
        #expect(policy.problem?.contains("several next hops") == true, "IPv6 NLM_F_APPEND: a next hop added to a spread")
        policy.routes = [:]
        looked = policy.noteRoute(route(family: AF_INET6, table: 253, extra: [(9, [0, 0, 0, 0])]), flags: 0, deleted: false)
        #expect(!looked && policy.problem == nil, "IPv6 has no rule looking up table 253")
        _ = policy.noteRoute(route(family: AF_INET6, source: 64), flags: 0, deleted: false)
        #expect(policy.problem?.contains("by source") == true)
        policy.routes = [:]
        // Next-hop objects: one is a single next hop, a group spreads.
        func nexthop(_ id: UInt32, group: Bool) -> [UInt8] {
            var payload: [UInt8] = [UInt8(AF_INET), 0, 3, 0, 0, 0, 0, 0]
            NextHopResolver.appendAttribute(&payload, type: 1, withUnsafeBytes(of: id) { Array($0) })
            if group { NextHopResolver.appendAttribute(&payload, type: 2, [1, 0, 0, 0, 0, 0, 0, 0]) }
            return payload
        }
        _ = policy.noteNexthop(nexthop(7, group: false), deleted: false)
        _ = policy.noteNexthop(nexthop(8, group: true), deleted: false)
        _ = policy.noteRoute(route(extra: [(30, [7, 0, 0, 0])]), flags: 0, deleted: false)
        #expect(policy.problem == nil, "through a single next-hop object")
        _ = policy.noteRoute(route(extra: [(30, [8, 0, 0, 0])]), flags: 0, deleted: false)
        #expect(policy.problem?.contains("next-hop group 8") == true)
        _ = policy.noteNexthop(nexthop(8, group: true), deleted: true)
        #expect(policy.reread == [UInt8(AF_INET), UInt8(AF_INET6)], "a group deleted takes its routes along unannounced: read again")
    }
}

