// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import Foundation
import ReusePortLB
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// One table of datagrams run through both hooks of the one decision (bpf/include/fanout_decide.h,
/// compiled into the tc and xdp programs), as katran's fixtures run one table through its
/// programs: each row says what tc does and what XDP does (the same verdict, or XDP passing the
/// datagram to tc where tc finishes it). The tc column runs the tc program alone
/// (TCProgramFixture); the xdp column the xdp program loaded with that fixture's maps
/// (XDPForwardProgramTests.Rig: its listeners served at XDP, both veth ends in its device map).
/// Each run is on a fresh fixture: the action, an untouched frame where it passes, and the one
/// counter expected to rise (or none at all).
@Suite("tc and xdp programs: one decision table (BPF_PROG_TEST_RUN)", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct DecisionTableTests {
    static let tcRedirect = TCProgramFixture.redirect, tcShot = TCProgramFixture.shot, tcPass = TCProgramFixture.pass
    static let xdpDrop = XDPForwardProgramTests.drop, xdpPass = XDPForwardProgramTests.pass

    /// What one hook does with a row's frame: its action, and the counter expected to rise by one:
    /// a verdict (stats key, verdict), or for XDP a reason it passed the datagram to tc (listener
    /// id, reason). nil: nothing counted.
    struct Expected: Sendable {
        var action: UInt32
        var counter: (UInt32, fanout_verdict)?
        var passed: (UInt32, XDPPassReason)?
    }

    struct Case: CustomStringConvertible, Sendable {
        var name: String
        var frame: @Sendable () -> [UInt8]
        var tc: Expected
        var xdp: Expected
        var description: String { name }
    }

    static let unmatched = UInt32(FANOUT_UNMATCHED_STATS)
    /// Not ours for both: tc counts it unmatched and continues down the chain; XDP passes it to tc
    /// uncounted.
    static func notOurs(_ name: String, _ verdict: fanout_verdict = FANOUT_VERDICT_NOT_OURS, _ frame: @escaping @Sendable () -> [UInt8]) -> Case {
        Case(name: name, frame: frame, tc: Expected(action: tcPass, counter: (unmatched, verdict)), xdp: Expected(action: xdpPass))
    }

    static let cases: [Case] = [
        notOurs("TCP to the listener") { Packet.ipv4(payload: [1, 2, 3], protocolNumber: 6) },
        notOurs("other port") { Packet.ipv4(payload: [1, 2, 3], port: 9999) },
        notOurs("ARP") { Packet.ethernetHeader(type: 0x0806) + [UInt8](repeating: 0, count: 28) },
        // The kernel's test runner refuses frames shorter than a base IPv4/IPv6 header, so the
        // cut headers are options and extension headers.
        notOurs("IPv4 options cut (IHL 15, frame ends after 24 bytes)", FANOUT_VERDICT_MALFORMED) {
            var f = Array(Packet.ipv4(payload: [1]).prefix(Packet.ethernet + 24)); f[Packet.ethernet] = 0x4f; return f
        },
        notOurs("UDP header cut", FANOUT_VERDICT_MALFORMED) { Array(Packet.ipv4(payload: [1]).prefix(Packet.ethernet + 20 + 4)) },
        notOurs("IPv6 extension header cut", FANOUT_VERDICT_MALFORMED) {
            var f = Array(Packet.ipv6(payload: [1]).prefix(Packet.ethernet + 41)); f[Packet.ethernet + 6] = 0; return f
        },
        notOurs("IPv4 total length beyond the frame (cut in transit)", FANOUT_VERDICT_MALFORMED) {
            Array(Packet.ipv4(payload: [UInt8](repeating: 1, count: 100)).prefix(Packet.ethernet + 40))
        },
        notOurs("IPv6 payload length beyond the frame", FANOUT_VERDICT_MALFORMED) {
            Array(Packet.ipv6(payload: [UInt8](repeating: 1, count: 100)).prefix(Packet.ethernet + 60))
        },
        notOurs("IHL below 5", FANOUT_VERDICT_MALFORMED) { var f = Packet.ipv4(payload: [1]); f[Packet.ethernet] = 0x44; return f },
        Case(name: "no backend", frame: { Packet.ipv4(payload: [1, 2], port: 5515) },
             tc: Expected(action: tcShot, counter: (2, FANOUT_VERDICT_NO_BACKEND)),
             xdp: Expected(action: xdpDrop, counter: (2, FANOUT_VERDICT_NO_BACKEND))),
        Case(name: "no route", frame: { Packet.ipv4(payload: [1, 2], port: 5516) },
             tc: Expected(action: tcShot, counter: (3, FANOUT_VERDICT_NO_ROUTE)),
             xdp: Expected(action: xdpDrop, counter: (3, FANOUT_VERDICT_NO_ROUTE))),
        // tc's bpf_redirect_neigh lets the kernel resolve the next hop; XDP cannot wait for it.
        Case(name: "no neighbour: bpf_redirect_neigh", frame: { Packet.ipv4(payload: [1, 2], port: 5517) },
             tc: Expected(action: tcRedirect, counter: (4, FANOUT_VERDICT_FORWARDED_NEIGH)),
             xdp: Expected(action: xdpPass, passed: (4, .noNeighbour))),
        Case(name: "TTL 1", frame: { Packet.ipv4(payload: [1, 2], ttl: 1) },
             tc: Expected(action: tcShot, counter: (0, FANOUT_VERDICT_TTL_EXPIRED)),
             xdp: Expected(action: xdpDrop, counter: (0, FANOUT_VERDICT_TTL_EXPIRED))),
    ]

    /// The listeners' and the unmatched key's verdict counters, all of them.
    static func verdictTotals(_ fixture: TCProgramFixture) -> [UInt64] {
        (0...4).map { fixture.stats(UInt32($0)).verdicts.reduce(0, +) } + [fixture.stats(unmatched).verdicts.reduce(0, +)]
    }

    /// Checks one hook's run of `frame`: `run` gives the action and the frame as it leaves.
    static func check(_ name: String, _ frame: [UInt8], _ expected: Expected, pass: UInt32, fixture: TCProgramFixture,
                      passedCounts: () -> [UInt64], run: ([UInt8]) -> (UInt32, [UInt8])) {
        let before = expected.counter.map { fixture.stats($0.0).verdicts[Int($0.1.rawValue)] }
        let totals = verdictTotals(fixture)
        let passedBefore = passedCounts()
        let (action, output) = run(frame)
        #expect(action == expected.action, "\(name): action \(action)")
        if expected.action == pass { #expect(output == frame, "\(name): passed untouched") }
        if let (key, counted) = expected.counter {
            #expect(fixture.stats(key).verdicts[Int(counted.rawValue)] == before! + 1, "\(name): counted")
        } else {
            #expect(verdictTotals(fixture) == totals, "\(name): no verdict counted")
        }
        if let (id, reason) = expected.passed {
            var counts = passedBefore
            counts[Int(id) * XDPPassReason.allCases.count + reason.rawValue] += 1
            #expect(passedCounts() == counts, "\(name): passed to tc, counted \(reason.label) and nothing else")
        } else {
            #expect(passedCounts() == passedBefore, "\(name): no pass reason counted")
        }
    }

    @Test("tc: each row's verdict and counter (not ours too)", arguments: cases)
    func tc(_ test: Case) throws {
        let fixture = try TCProgramFixture()
        Self.check(test.name, test.frame(), test.tc, pass: Self.tcPass, fixture: fixture, passedCounts: { [] }) { fixture.execute($0) }
    }

    /// A first fragment dropped at listener `id` (port `port`, TTL `ttl`) with `verdict`.
    struct DroppedFirst: CustomStringConvertible, Sendable {
        var name: String
        var port: UInt16
        var ttl: UInt8 = 64
        var id: UInt32
        var verdict: fanout_verdict
        /// The downstream's counter slot.
        var slot: UInt16 = 0
        /// XDP passes the first fragment to tc with this reason (tc then drops it), instead of
        /// dropping it itself.
        var xdpPassesFirst: XDPPassReason? = nil
        var description: String { name }
    }

    static let droppedFirsts = [
        DroppedFirst(name: "no backend", port: 5515, id: 2, verdict: FANOUT_VERDICT_NO_BACKEND),
        DroppedFirst(name: "no route", port: 5516, id: 3, verdict: FANOUT_VERDICT_NO_ROUTE),
        DroppedFirst(name: "TTL 1", port: 5514, ttl: 1, id: 0, verdict: FANOUT_VERDICT_TTL_EXPIRED),
        DroppedFirst(name: "too large for the route MTU", port: 5602, id: 9, verdict: FANOUT_VERDICT_TOO_LARGE, slot: 5, xdpPassesFirst: .tooLarge),
    ]

    /// Listener 9 at 5602: one downstream (slot 5) behind the fixture's 600-byte route MTU.
    static func addNarrow(_ fixture: TCProgramFixture) throws {
        try fixture.add(TCProgramFixture.listenerBind(5602), id: 9, BackendSet(
            downstreams: [Downstream(name: "narrow", address: SocketAddress("198.18.210.10:7200")!)], balancing: .roundRobin, slots: ["narrow": 5]))
    }

    /// Each fragment counted once at the listener, received and with the first's verdict, none
    /// untracked; at the downstream (no_route, too_large) once each, and nothing sent.
    static func checkDroppedWhole(_ test: DroppedFirst, _ fixture: TCProgramFixture, _ hook: String) {
        let stats = fixture.stats(test.id)
        #expect(stats.received == 3, "\(hook): each fragment received once")
        #expect(stats.verdicts[Int(test.verdict.rawValue)] == 3 && stats.verdicts.reduce(0, +) == 3,
                "\(hook): each fragment counted with the first's verdict, nothing else: \(stats.verdicts)")
        #expect(fixture.stats(Self.unmatched).verdicts[Int(FANOUT_VERDICT_FRAGMENT_UNTRACKED.rawValue)] == 0, "\(hook): no fragment untracked")
        let downstream = fixture.program.backendStats(id: test.id, slot: test.slot)
        #expect(downstream.noRoute == (test.verdict == FANOUT_VERDICT_NO_ROUTE ? 3 : 0)
                && downstream.tooLarge == (test.verdict == FANOUT_VERDICT_TOO_LARGE ? 3 : 0) && downstream.packets == 0,
                "\(hook): at the downstream \(downstream)")
    }

    /// A datagram whose first fragment is dropped is dropped whole, each fragment counted once
    /// with the first's verdict (and at the downstream it was meant for), by both programs: tc
    /// follows the first fragment's memory; XDP drops the first (or passes it to tc, which drops
    /// it), passes the later ones to tc (reason fragment), and tc drops them the same way. None
    /// goes up the stack as untracked.
    @Test("A dropped first fragment: its later fragments are dropped with its verdict, at tc and through xdp", arguments: droppedFirsts)
    func droppedFirstFragment(_ test: DroppedFirst) throws {
        let pieces = Packet.ipv4Fragments(payload: (0..<2400).map { UInt8(truncatingIfNeeded: $0) }, id: 0x3838, pieceSize: 1000,
                                          port: test.port, ttl: test.ttl)
        #expect(pieces.count == 3)
        do {
            let fixture = try TCProgramFixture()
            try Self.addNarrow(fixture)
            for (index, piece) in pieces.enumerated() {
                #expect(fixture.execute(piece).verdict == Self.tcShot, "tc: fragment \(index) dropped")
            }
            Self.checkDroppedWhole(test, fixture, "tc")
        }
        do {
            let rig = try XDPForwardProgramTests.Rig()
            try Self.addNarrow(rig.fixture)
            try rig.xdp.serve(id: 9, true)
            let (action, output) = rig.run(pieces[0])
            if let reason = test.xdpPassesFirst {
                #expect(action == Self.xdpPass && output == pieces[0], "xdp: the first fragment passed to tc untouched")
                #expect(rig.passed(test.id, reason) == 1, "xdp: passed with reason \(reason.label)")
                #expect(rig.fixture.execute(pieces[0]).verdict == Self.tcShot, "xdp: the first fragment dropped by tc")
            } else {
                #expect(action == Self.xdpDrop, "xdp: the first fragment dropped")
            }
            for (index, piece) in pieces.enumerated().dropFirst() {
                let (action, output) = rig.run(piece)
                #expect(action == Self.xdpPass && output == piece, "xdp: fragment \(index) passed to tc untouched")
                #expect(rig.fixture.execute(piece).verdict == Self.tcShot, "xdp: fragment \(index) dropped by tc")
            }
            #expect(rig.passed(test.id, .fragment) == 2, "xdp: the later fragments passed with reason fragment")
            Self.checkDroppedWhole(test, rig.fixture, "xdp")
        }
    }

    @Test("xdp: each row's verdict and counter, or the reason it passes the datagram to tc", arguments: cases)
    func xdp(_ test: Case) throws {
        let rig = try XDPForwardProgramTests.Rig()
        let passedCounts = {
            (0...4).flatMap { rig.xdp.passedCounts(id: UInt32($0)) ?? [] } + (rig.xdp.passedCounts(id: Self.unmatched) ?? [])
        }
        Self.check(test.name, test.frame(), test.xdp, pass: Self.xdpPass, fixture: rig.fixture, passedCounts: passedCounts) { rig.run($0) }
    }
}
