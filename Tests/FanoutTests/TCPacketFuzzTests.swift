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

/// Reliability suite, BPF part: random and mutated packets through the tc program under
/// BPF_PROG_TEST_RUN. Every packet must get a verdict the program counts (the counters' sum
/// equals the packets run, verdict by verdict against the return codes), and every redirected
/// packet's IPv4 header and UDP checksums must be as valid as they were on arrival, checked
/// here independently of the program.
///
/// Packets: IPv4 with and without options, IPv6 with extension header chains (hop-by-hop,
/// routing, destination options, fragment), 802.1Q, QinQ, fragments, TCP, other ports and
/// addresses, TTL 0/1; each as is, truncated at every offset of its headers, with every header
/// byte replaced, with random byte flips, or entirely random. Seeded: the seed is printed.
///
/// Count (packets run; frames the test runner refuses are reported apart): RELIABILITY_PACKETS,
/// else 1,000,000 with RELIABILITY=full, else 50,000 (make test). RELIABILITY_SEED repeats a run.
@Suite("tc program: packet fuzz (reliability)", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct TCPacketFuzzTests {
    typealias Generator = PacketFuzz.Generator
    /// Where the fixture's backends are: a redirected packet goes to one of them.
    static let backends: Set<[UInt8]> = [[198, 18, 200, 10], [198, 18, 200, 20], [198, 18, 210, 10], IPAddress("2001:db8:200::10")!.bytes]

    /// Where a frame's layers start, walked as the program walks them (one tag, IPv4 options,
    /// up to four IPv6 extension headers); nil if it is not IP carrying UDP, or the UDP header
    /// of a whole datagram or first fragment is cut. `udp`: a UDP header is there (a later
    /// fragment has none).
    struct Layers {
        var l3: Int, l4: Int, family: Int32, fragment: Bool, udp: Bool
    }

    static func layers(_ frame: [UInt8]) -> Layers? {
        guard frame.count >= 14 else { return nil }
        var l3 = 14
        var type = UInt16(frame[12]) << 8 | UInt16(frame[13])
        if type == 0x8100 || type == 0x88a8 {
            guard frame.count >= 18 else { return nil }
            type = UInt16(frame[16]) << 8 | UInt16(frame[17])
            l3 = 18
        }
        if type == 0x0800 {
            guard frame.count >= l3 + 20 else { return nil }
            let l4 = l3 + Int(frame[l3] & 0x0f) * 4
            let field = UInt16(frame[l3 + 6] & 0x3f) << 8 | UInt16(frame[l3 + 7])
            let udp = field & 0x1fff == 0
            guard frame.count >= l4 + (udp ? 8 : 0) else { return nil }
            return Layers(l3: l3, l4: l4, family: AF_INET, fragment: field != 0, udp: udp)
        }
        guard type == 0x86dd, frame.count >= l3 + 40 else { return nil }
        var next = frame[l3 + 6], offset = l3 + 40, fragment = false, first = true
        for _ in 0..<4 where next != 17 && first {
            guard frame.count >= offset + 8 else { return nil }
            if next == 44 {
                fragment = true
                first = (UInt16(frame[offset + 2]) << 8 | UInt16(frame[offset + 3])) & 0xfff8 == 0
                next = frame[offset]
                offset += 8
                continue
            }
            next = frame[offset]
            offset += (Int(frame[offset + 1]) + 1) * 8
        }
        guard next == 17, frame.count >= offset + (first ? 8 : 0) else { return nil }
        return Layers(l3: l3, l4: offset, family: AF_INET6, fragment: fragment, udp: first)
    }

    /// The IPv4 header checksum holds, and the UDP checksum holds over the frame's UDP bytes.
    static func checksums(_ frame: [UInt8], _ at: Layers) -> (ipv4: Bool, udp: Bool, udpField: UInt16) {
        let ipv4 = at.family == AF_INET && Packet.fold(Packet.sum(Array(frame[at.l3..<at.l4]))) == 0xffff
        let (source, destination) = at.family == AF_INET
            ? (Array(frame[(at.l3 + 12)..<(at.l3 + 16)]), Array(frame[(at.l3 + 16)..<(at.l3 + 20)]))
            : (Array(frame[(at.l3 + 8)..<(at.l3 + 24)]), Array(frame[(at.l3 + 24)..<(at.l3 + 40)]))
        guard at.udp else { return (ipv4, false, 0) }
        let udp = Array(frame[at.l4...])
        return (ipv4, Packet.udpChecksumValid(source: source, destination: destination, udp: udp), UInt16(udp[6]) << 8 | UInt16(udp[7]))
    }

    final class Outcome: @unchecked Sendable {
        var run = 0, refused = 0, redirect = 0, shot = 0, pass = 0
        var problems: [String] = []
        var seconds = 0.0
        func problem(_ text: String) { if problems.count < 20 { problems.append(text) } }
    }

    /// A frame the program sent on (`out`, from `frame`): a UDP packet to a backend, its IPv4
    /// header and UDP checksums as valid as on arrival (a zero UDP checksum stays zero; a
    /// fragment carries only part of its datagram, so its UDP checksum is not checked).
    static func checkSent(_ frame: [UInt8], _ out: [UInt8], _ outcome: Outcome) {
        guard let inLayers = layers(frame), let outLayers = layers(out) else {
            outcome.problem("sent on, but not a UDP packet: \(frame) -> \(out)")
            return
        }
        let destination = Array(out[(outLayers.l3 + (outLayers.family == AF_INET ? 16 : 24))..<(outLayers.l3 + (outLayers.family == AF_INET ? 20 : 40))])
        if !backends.contains(destination) { outcome.problem("sent to \(destination), not a backend: \(frame)") }
        let (a, b) = (checksums(frame, inLayers), checksums(out, outLayers))
        if a.ipv4 != b.ipv4 { outcome.problem("IPv4 header checksum valid \(a.ipv4) -> \(b.ipv4): \(frame)") }
        if !inLayers.fragment {
            if a.udpField == 0 {
                if b.udpField != 0 { outcome.problem("a zero UDP checksum became \(b.udpField): \(frame)") }
            } else if a.udp != b.udp {
                outcome.problem("UDP checksum valid \(a.udp) -> \(b.udp): \(frame)")
            }
        }
    }

    @Test("The independent checksum check sees a valid frame as valid, and one changed address byte as invalid")
    func checkerCatches() throws {
        for frame in [Packet.ipv4(payload: [1, 2, 3], options: [1, 1, 1, 0], vlan: 7), Packet.ipv6(payload: [4, 5, 6])] {
            let at = try #require(Self.layers(frame))
            let valid = Self.checksums(frame, at)
            #expect(valid.udp && (valid.ipv4 || at.family == AF_INET6))
            var changed = frame
            changed[at.l3 + (at.family == AF_INET ? 16 : 24)] ^= 1
            let broken = Self.checksums(changed, at)
            #expect(!broken.udp && !broken.ipv4)
        }
    }

    @Test("Random and mutated packets: every one gets a counted verdict; redirected checksums as valid as on arrival (with replication pools: after every copy's rewrite, and each pool's counts add up)", arguments: [false, true])
    func fuzz(pools: Bool) throws {
        let fixture = try TCProgramFixture()
        // A listener behind a 600-byte route MTU, so too_large is reached too.
        try fixture.add(TCProgramFixture.listenerBind(5602), id: 5, BackendSet(
            downstreams: [Downstream(name: "narrow", address: SocketAddress("198.18.210.10:7200")!)], balancing: .roundRobin, slots: ["narrow": 0]))
        if pools {
            // The 5514 listeners again, each with pools: copies (one without a neighbour), a sample.
            let member = TCProgramFixture.member
            try fixture.addListener(bind: ProgramFrames.listenerV4, id: 0, own: (1...3).map { member("b\($0)", "198.18.200.10:\(6000 + $0)") }, pools: [
                .init(id: 11, policy: FANOUT_POLICY_ALL, members: [member("a1", "198.18.200.10:7001"), member("a2", "198.18.200.20:7002")]),
                .init(id: 12, policy: FANOUT_POLICY_SOURCE_IP, members: [member("s1", "198.18.200.10:7101"), member("s2", "198.18.210.10:7102")], sample: 2),
            ])
            try fixture.addListener(bind: ProgramFrames.listenerV6, id: 1, own: (1...3).map { member("b\($0)", "[2001:db8:200::10]:\(6000 + $0)") }, pools: [
                .init(id: 13, policy: FANOUT_POLICY_ROUND_ROBIN, members: [member("v1", "[2001:db8:200::10]:7201")], sources: [SourcePrefix("2001:db8::/32")!]),
            ])
        }
        let receivedBefore = (fixture.program.listenerStats(id: 0).received, fixture.program.listenerStats(id: 1).received)
        let ids: [UInt32] = [0, 1, 2, 3, 4, 5, UInt32(FANOUT_UNMATCHED_STATS)]
        func verdictTotals() -> [UInt64] {
            ids.map { fixture.stats($0).verdicts }.reduce([UInt64](repeating: 0, count: Int(FANOUT_VERDICT_COUNT.rawValue))) { zip($0, $1).map(+) }
        }
        let before = verdictTotals()
        let seed = ProcessInfo.processInfo.environment["RELIABILITY_SEED"].flatMap { UInt64($0) } ?? UInt64.random(in: 0...UInt64.max)
        let target = PacketFuzz.packetCount
        let outcome = Outcome()
        let (program, namespaceFD, ifindex) = (fixture.program.program, fixture.namespaceFD, fixture.ifindex)
        OSThread(name: "fuzz") {
            guard shim_setns(namespaceFD, 0x4000_0000) == 0 else { outcome.problem("setns"); return }  // CLONE_NEWNET
            var random = Generator(state: seed)
            var output = [UInt8](repeating: 0, count: 4096)
            let start = DispatchTime.now()
            func execute(_ frame: [UInt8]) {
                guard outcome.run < target else { return }
                let (result, verdict, size) = TCProgramFixture.testRun(program, frame, ifindex: ifindex, output: &output)
                if result != 0 {
                    // The runner itself refuses frames shorter than Ethernet plus a base IPv4 /
                    // IPv6 header (for those Ethernet types); nothing else may fail.
                    let type = frame.count >= 14 ? UInt16(frame[12]) << 8 | UInt16(frame[13]) : 0
                    let short = frame.count < 14 || (type == 0x0800 && frame.count < 34) || (type == 0x86dd && frame.count < 54)
                    if result == -EINVAL && short { outcome.refused += 1 } else { outcome.problem("test run \(result) for \(frame)") }
                    return
                }
                outcome.run += 1
                switch verdict {
                case UInt32(bitPattern: -1): outcome.pass += 1
                case 2: outcome.shot += 1
                case 7:
                    outcome.redirect += 1
                    Self.checkSent(frame, Array(output[0..<size]), outcome)
                default:
                    outcome.problem("verdict \(verdict) for \(frame)")
                }
            }
            while outcome.run < target && outcome.problems.count < 20 {
                PacketFuzz.mutate(&random, execute)
            }
            outcome.seconds = Double(DispatchTime.now().uptimeNanoseconds - start.uptimeNanoseconds) / 1e9
        }.join()

        let counted = zip(verdictTotals(), before).map { $0 - $1 }
        func count(_ verdict: fanout_verdict) -> UInt64 { counted[Int(verdict.rawValue)] }
        let names = ["forwarded", "forwarded_neigh", "no_backend", "no_route", "ttl_expired", "too_large", "rewrite_failed",
                     "fragment_untracked", "malformed", "not_ours"]
        print("tc packet fuzz: seed \(seed), \(outcome.run) packets run (\(outcome.refused) refused by the test runner as shorter than a base IP header) in \(String(format: "%.1f", outcome.seconds)) s; "
              + "returned redirect \(outcome.redirect), shot \(outcome.shot), pass \(outcome.pass); counted "
              + zip(names, counted).map { "\($0) \($1)" }.joined(separator: ", "))
        #expect(outcome.problems.isEmpty, "seed \(seed): \(outcome.problems.joined(separator: "\n"))")
        #expect(outcome.run == target)
        #expect(counted.reduce(0, +) == UInt64(outcome.run), "every packet run is counted once: \(counted) for \(outcome.run)")
        #expect(count(FANOUT_VERDICT_FORWARDED) + count(FANOUT_VERDICT_FORWARDED_NEIGH) == UInt64(outcome.redirect))
        #expect(count(FANOUT_VERDICT_NO_BACKEND) + count(FANOUT_VERDICT_NO_ROUTE) + count(FANOUT_VERDICT_TTL_EXPIRED)
                + count(FANOUT_VERDICT_TOO_LARGE) + count(FANOUT_VERDICT_REWRITE_FAILED) == UInt64(outcome.shot))
        #expect(count(FANOUT_VERDICT_FRAGMENT_UNTRACKED) + count(FANOUT_VERDICT_MALFORMED) + count(FANOUT_VERDICT_NOT_OURS) == UInt64(outcome.pass))
        if pools {
            // Every datagram a listener received was offered to each of its pools, and each had one outcome.
            let received = (fixture.program.listenerStats(id: 0).received - receivedBefore.0, fixture.program.listenerStats(id: 1).received - receivedBefore.1)
            for (id, listener) in [(UInt32(11), received.0), (12, received.0), (13, received.1)] {
                let counted = fixture.pool(id)
                #expect(counted.received == listener, "pool \(id) offered \(counted.received) of \(listener)")
                #expect(counted.forwarded + counted.dropped + counted.sampledOut + counted.filteredOut == counted.received, "pool \(id): \(counted)")
                #expect(counted.forwarded > 0, "pool \(id) copied")
            }
            print("tc packet fuzz, pools: " + [UInt32(11), 12, 13].map { "pool \($0) \(fixture.pool($0))" }.joined(separator: "; "))
        }
        // The mix reaches every verdict but rewrite_failed (no helper refuses a valid rewrite).
        for (index, name) in names.enumerated() where name != "rewrite_failed" {
            #expect(counted[index] > 0, "the mix reaches \(name)")
        }
    }
}
