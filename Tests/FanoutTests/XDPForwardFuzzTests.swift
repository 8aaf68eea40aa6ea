// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import CLibBPF
import CSystemShim
import Foundation
import ReusePortLB
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// Reliability suite, the xdp kind's program: the tc packet fuzz's random and mutated packets
/// through bpf/xdp_fanout.bpf.c under BPF_PROG_TEST_RUN, loaded with the tc fixture's maps (its
/// listeners served at XDP). Every packet the program finishes (XDP_TX, XDP_REDIRECT, XDP_DROP)
/// is counted with the tc program's verdicts, one verdict each; what it passes is tc's to finish
/// (its reasons counted apart, never more than the passes); every frame it sends on carries IPv4
/// header and UDP checksums as valid as on arrival (checked independently) and a backend's address.
@Suite("xdp program: packet fuzz (reliability)", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct XDPForwardFuzzTests {
    static let (drop, pass, transmit, redirect): (UInt32, UInt32, UInt32, UInt32) = (1, 2, 3, 4)

    @Test("Random and mutated packets at XDP: each finished one counted once with its verdict, each sent one with valid checksums and a backend's address; passes counted by reason")
    func fuzz() throws {
        let fixture = try TCProgramFixture()
        try fixture.add(TCProgramFixture.listenerBind(5602), id: 5, BackendSet(
            downstreams: [Downstream(name: "narrow", address: SocketAddress("198.18.210.10:7200")!)], balancing: .roundRobin, slots: ["narrow": 0]))
        let xdp = try XDPForwardProgram(sharing: fixture.program)
        defer { xdp.closeDescriptors() }
        for id in UInt32(0)...5 { try xdp.serve(id: id, true) }
        // t0 (toward the backends) transmits XDP frames; t1, the arrival interface, too.
        try xdp.setDevice(UInt32(fixture.otherIfindex), present: true)
        try xdp.setDevice(UInt32(fixture.ifindex), present: true)
        let ids: [UInt32] = [0, 1, 2, 3, 4, 5]
        func verdictTotals() -> [UInt64] {
            ids.map { fixture.stats($0).verdicts }.reduce([UInt64](repeating: 0, count: Int(FANOUT_VERDICT_COUNT.rawValue))) { zip($0, $1).map(+) }
        }
        func passTotals() throws -> [UInt64] {
            try (ids + [UInt32(FANOUT_UNMATCHED_STATS)]).map { try #require(xdp.passedCounts(id: $0)) }.reduce([UInt64](repeating: 0, count: XDPPassReason.allCases.count)) { zip($0, $1).map(+) }
        }
        let before = verdictTotals()
        let seed = ProcessInfo.processInfo.environment["RELIABILITY_SEED"].flatMap { UInt64($0) } ?? UInt64.random(in: 0...UInt64.max)
        let target = PacketFuzz.packetCount
        let outcome = TCPacketFuzzTests.Outcome()
        var transmitted = 0
        let (program, namespaceFD, ifindex) = (xdp.program, fixture.namespaceFD, UInt32(fixture.ifindex))
        let sent = Counter()
        OSThread(name: "xdp-fuzz") {
            guard shim_setns(namespaceFD, 0x4000_0000) == 0 else { outcome.problem("setns"); return }  // CLONE_NEWNET
            var random = PacketFuzz.Generator(state: seed)
            var output = [UInt8](repeating: 0, count: 4096)
            let start = DispatchTime.now()
            func execute(_ frame: [UInt8]) {
                guard outcome.run < target else { return }
                let (result, action, size) = XDPProgramFixture.testRun(program, frame, ifindex: ifindex, queue: 0, output: &output)
                if result != 0 {
                    // The runner refuses frames shorter than an Ethernet header; nothing else may fail.
                    if result == -EINVAL && frame.count < 14 { outcome.refused += 1 } else { outcome.problem("test run \(result) for \(frame)") }
                    return
                }
                outcome.run += 1
                switch action {
                case Self.pass: outcome.pass += 1
                case Self.drop: outcome.shot += 1
                case Self.transmit, Self.redirect:
                    if action == Self.transmit { sent.add() }
                    outcome.redirect += 1
                    TCPacketFuzzTests.checkSent(frame, Array(output[0..<size]), outcome)
                default:
                    outcome.problem("action \(action) for \(frame)")
                }
            }
            while outcome.run < target && outcome.problems.count < 20 {
                PacketFuzz.mutate(&random, execute)
            }
            outcome.seconds = Double(DispatchTime.now().uptimeNanoseconds - start.uptimeNanoseconds) / 1e9
        }.join()
        transmitted = sent.value

        let counted = zip(verdictTotals(), before).map { $0 - $1 }
        func count(_ verdict: fanout_verdict) -> UInt64 { counted[Int(verdict.rawValue)] }
        let passes = try passTotals()
        let names = ["forwarded", "forwarded_neigh", "no_backend", "no_route", "ttl_expired", "too_large", "rewrite_failed"]
        print("xdp packet fuzz: seed \(seed), \(outcome.run) packets run (\(outcome.refused) refused by the test runner) in \(String(format: "%.1f", outcome.seconds)) s; "
              + "returned redirect \(outcome.redirect - transmitted), tx \(transmitted), drop \(outcome.shot), pass \(outcome.pass); counted "
              + zip(names, counted).map { "\($0) \($1)" }.joined(separator: ", ")
              + "; passed to tc " + zip(XDPPassReason.allCases.map(\.label), passes).map { "\($0) \($1)" }.joined(separator: ", "))
        #expect(outcome.problems.isEmpty, "seed \(seed): \(outcome.problems.joined(separator: "\n"))")
        #expect(outcome.run == target)
        #expect(count(FANOUT_VERDICT_FORWARDED) == UInt64(outcome.redirect), "every frame sent on counted forwarded")
        #expect(count(FANOUT_VERDICT_NO_BACKEND) + count(FANOUT_VERDICT_NO_ROUTE) + count(FANOUT_VERDICT_TTL_EXPIRED)
                + count(FANOUT_VERDICT_REWRITE_FAILED) == UInt64(outcome.shot), "every drop counted with its verdict")
        #expect(counted.reduce(0, +) == UInt64(outcome.redirect + outcome.shot), "nothing passed is counted as finished: \(counted)")
        #expect(passes.reduce(0, +) <= UInt64(outcome.pass), "reasons counted only for passes: \(passes) of \(outcome.pass)")
        // The mix reaches the finished verdicts and the passes this fixture can produce.
        for verdict in [FANOUT_VERDICT_FORWARDED, FANOUT_VERDICT_NO_BACKEND, FANOUT_VERDICT_NO_ROUTE, FANOUT_VERDICT_TTL_EXPIRED] {
            #expect(count(verdict) > 0, "the mix reaches verdict \(verdict.rawValue)")
        }
        // (too_large needs a long frame to the narrow listener's port: some seeds' 50,000 have none.)
        for reason in [XDPPassReason.noNeighbour, .fragment] {
            #expect(passes[reason.rawValue] > 0, "the mix reaches pass reason \(reason.label)")
        }
    }

    /// Frames sent back out of the arrival interface (XDP_TX), counted on the fuzz thread.
    final class Counter: @unchecked Sendable {
        var value = 0
        func add() { value += 1 }
    }
}
