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

/// Reliability suite, XDP part: the tc fuzz's random and mutated frames (TCPacketFuzzTests'
/// generator: IPv4/IPv6, options, extension chains, 802.1Q, QinQ, fragments, TCP, other ports
/// and addresses; truncated, byte-replaced, flipped, random) through the XDP program under
/// BPF_PROG_TEST_RUN, on queue 0 (no socket) and queue 1 (an AF_XDP socket in the XSKMAP).
///
/// Every frame must come back XDP_PASS or XDP_REDIRECT (never dropped or aborted), untouched,
/// and be counted exactly once; a redirected frame carries the program's parse in its metadata
/// (struct fanout_xdp_meta), which must give what the forwarder's own walk of the frame gives
/// (accepted with the same offsets and source, or refused by both), a passed one none: the verdicts' sum, the received counters' sum and the bytes
/// equal what was run; redirected frames equal the `redirected` count and happen only on
/// queue 1. Same count and seed variables as the tc fuzz (RELIABILITY_PACKETS,
/// RELIABILITY=full, RELIABILITY_SEED).
@Suite("XDP program: packet fuzz (reliability)", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct XDPPacketFuzzTests {
    final class Outcome: @unchecked Sendable {
        var run = 0, refused = 0, bytes: UInt64 = 0, redirect = 0, pass = 0, metadataAccepted = 0
        var problems: [String] = []
        func problem(_ text: String) { if problems.count < 20 { problems.append(text) } }
    }

    @Test("Random and mutated frames: each passed or redirected, untouched, counted exactly once")
    func fuzz() throws {
        // 600 bytes: the generator's frames reach up to about 1,460, so too_large is reached too.
        let fixture = try XDPProgramFixture(maxFrameLength: 600)
        let socket = try #require(inNetworkNamespace(fixture.namespace) { TestXSK.open(interface: "x1", queue: 1) }, "namespace thread")
        let fd = try socket.get()
        defer { close(fd) }
        try fixture.program.setSocket(queue: 1, fd: fd)
        let before = fixture.snapshot()
        let seed = ProcessInfo.processInfo.environment["RELIABILITY_SEED"].flatMap { UInt64($0) } ?? UInt64.random(in: 0...UInt64.max)
        let target = PacketFuzz.packetCount
        let outcome = Outcome()
        let (program, ifindex) = (fixture.program.program, fixture.ifindex)
        _ = inNetworkNamespace(fixture.namespace) {
            var random = PacketFuzz.Generator(state: seed)
            // The queue of each frame from a generator of its own: `random` is the mutator's while it runs.
            var queues = PacketFuzz.Generator(state: seed ^ 0x9e37_79b9_7f4a_7c15)
            var output = [UInt8](repeating: 0, count: 4096)
            func execute(_ frame: [UInt8]) {
                guard outcome.run < target else { return }
                let queue = UInt32(queues.below(2))
                let (result, action, size) = XDPProgramFixture.testRun(program, frame, ifindex: ifindex, queue: queue, output: &output)
                if result != 0 {
                    // The runner refuses frames shorter than an Ethernet header; nothing else may fail.
                    if result == -EINVAL && frame.count < 14 { outcome.refused += 1 } else { outcome.problem("test run \(result) for \(frame)") }
                    return
                }
                outcome.run += 1
                outcome.bytes += UInt64(frame.count)
                // The test run's output starts at the metadata area (empty unless the program wrote one).
                let metadataSize = action == XDPProgramFixture.redirect ? MemoryLayout<fanout_xdp_meta>.size : 0
                if size != frame.count + metadataSize || Array(output[metadataSize..<size]) != frame { outcome.problem("frame changed: \(frame)") }
                switch action {
                case XDPProgramFixture.pass: outcome.pass += 1
                case XDPProgramFixture.redirect:
                    outcome.redirect += 1
                    if queue != 1 { outcome.problem("redirected on queue \(queue), which has no socket: \(frame)") }
                    guard size == frame.count + metadataSize else { break }
                    let meta = output.withUnsafeBytes { $0.loadUnaligned(as: fanout_xdp_meta.self) }
                    if meta.magic != FANOUT_XDP_META_MAGIC { outcome.problem("redirected without metadata: \(frame)") }
                    var fromMetadata = sockaddr_storage(), walkedSource = sockaddr_storage()
                    let parsed = frame.withUnsafeBytes { FrameParser.parse($0, meta, source: &fromMetadata) }
                    let walked = frame.withUnsafeBytes { FrameParser.parse($0, source: &walkedSource) }
                    let sameSource = withUnsafeBytes(of: &fromMetadata) { Array($0) } == withUnsafeBytes(of: &walkedSource) { Array($0) }
                    if parsed != walked || !sameSource {
                        outcome.problem("metadata \(meta) gives \(String(describing: parsed)), the walk \(String(describing: walked)): \(frame)")
                    }
                    if parsed != nil { outcome.metadataAccepted += 1 }
                default: outcome.problem("action \(action) for \(frame)")
                }
            }
            while outcome.run < target && outcome.problems.count < 20 {
                PacketFuzz.mutate(&random, execute)
            }
            return true
        }

        let after = fixture.snapshot()
        var received: UInt64 = 0, bytes: UInt64 = 0
        var verdicts: [XDPVerdict: UInt64] = [:]
        for (key, new) in after {
            let old = before[key]!
            received += new.received - old.received
            bytes += new.bytes - old.bytes
            for verdict in XDPVerdict.allCases { verdicts[verdict, default: 0] += new.verdicts[verdict]! - old.verdicts[verdict]! }
        }
        print("xdp packet fuzz: seed \(seed), \(outcome.run) frames run (\(outcome.refused) refused by the test runner) ; returned redirect \(outcome.redirect) (\(outcome.metadataAccepted) of them forwardable by their metadata), pass \(outcome.pass); counted "
              + XDPVerdict.allCases.map { "\($0.label) \(verdicts[$0]!)" }.joined(separator: ", "))
        #expect(outcome.problems.isEmpty, "seed \(seed): \(outcome.problems.joined(separator: "\n"))")
        #expect(outcome.run == target)
        #expect(verdicts.values.reduce(0, +) == UInt64(outcome.run), "every frame counted once: \(verdicts) for \(outcome.run)")
        #expect(received == UInt64(outcome.run) && bytes == outcome.bytes, "received \(received), bytes \(bytes) vs \(outcome.bytes)")
        #expect(verdicts[.redirected] == UInt64(outcome.redirect))
        #expect(outcome.metadataAccepted > 0, "redirected frames whose metadata the forwarder takes")
        for verdict in XDPVerdict.allCases {
            #expect(verdicts[verdict]! > 0, "the mix reaches \(verdict.label)")
        }
    }
}
