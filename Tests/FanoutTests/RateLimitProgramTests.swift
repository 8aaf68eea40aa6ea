// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import CLibBPF
import Foundation
import Logging
import ReusePortLB
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// rate_limit in the tc and xdp programs (bpf/include/fanout_rate.h) under BPF_PROG_TEST_RUN: the
/// runs of one test follow each other within milliseconds, so each source gets its burst and (at
/// a rate of one a second) nothing more. The tc fixture's listeners (TCProgramFixture): 5514
/// round robin over three backends (id 0), 5517 a backend without a neighbour (id 4: xdp passes
/// its datagrams to tc).
@Suite("rate_limit in the tc and xdp programs (BPF_PROG_TEST_RUN)", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct RateLimitProgramTests {
    enum Hook: String, CustomStringConvertible, CaseIterable, Sendable {
        case tc, xdp
        var description: String { rawValue }
    }

    final class Rig {
        let forward: XDPForwardProgramTests.Rig
        var fixture: TCProgramFixture { forward.fixture }
        var program: TCProgram { forward.fixture.program }
        var buckets: [UInt32: Int32] = [:]

        init() throws { forward = try XDPForwardProgramTests.Rig() }

        deinit { for fd in buckets.values { close(fd) } }

        /// Puts `limit` on listener `id` (at `port`, IPv4; id 1: the IPv6 listener) and flags its entry.
        func limit(id: UInt32, port: UInt16, _ limit: RateLimit) throws {
            let bind = id == 1 ? ProgramFrames.listenerV6 : TCProgramFixture.listenerBind(port)
            buckets[id] = try program.putRateLimit(id: id, limit)
            var entry = fanout_listener()
            entry.id = id
            entry.policy = FANOUT_POLICY_ROUND_ROBIN.rawValue
            entry.reserved = FANOUT_LISTENER_RATE
            try program.putListener(bind, ifindex: UInt32(fixture.ifindex), entry)
        }

        /// Whether a datagram from `source` to listener port `port` was sent on (or, xdp, passed
        /// to tc) rather than dropped.
        func sent(_ hook: Hook, from source: String, port: UInt16 = 5514, payload: Int = 100) -> Bool {
            let to = SocketAddress(ip: IPAddress(source)!.family == AF_INET ? ProgramFrames.listenerV4.ip : ProgramFrames.listenerV6.ip, port: port)
            let frame = TCNATProgramTests.frame(from: SocketAddress(ip: IPAddress(source)!, port: 4000), to: to, payload: [UInt8](repeating: 0x61, count: payload))
            switch hook {
            case .tc: return fixture.execute(frame).verdict != TCProgramFixture.shot
            case .xdp: return forward.run(frame).action != 1  // XDP_DROP
            }
        }

        /// limited, limited bytes, new sources refused.
        func counts(_ id: UInt32) -> [UInt64] {
            let counts = program.rateCounts(id: id)
            return [counts.limited, counts.bytes, counts.newSources]
        }
    }

    @Test("each source its burst, then dropped and counted (received too); sources share their /24; allow prefixes never limited", arguments: Hook.allCases)
    func burstsAndPrefixes(hook: Hook) throws {
        let rig = try Rig()
        try rig.limit(id: 0, port: 5514, RateLimit(datagramsPerSecond: 1, burstDatagrams: 5, ipv4PrefixLength: 24,
                                                    allow: [SourcePrefix("198.18.9.0/24")!]))
        let first = (1...8).filter { rig.sent(hook, from: "198.18.50.\($0)") }.count
        #expect(first == 5, "\(hook): 8 sources of one /24, one burst: \(first)")
        #expect(rig.counts(0) == [3, 300, 0], "\(hook): \(rig.counts(0))")
        #expect(rig.fixture.stats(0).received == 8, "\(hook): the limited ones counted received")
        #expect((1...3).allSatisfy { _ in rig.sent(hook, from: "198.18.51.1") }, "\(hook): another /24 has its own bucket")
        #expect((1...20).allSatisfy { _ in rig.sent(hook, from: "198.18.9.77") }, "\(hook): allowed")
        let top = TCProgram.topLimited(try #require(rig.buckets[0]), ipv4Length: 24, ipv6Length: 64, count: 10, maxEntries: 65_536)
        #expect(top.map(\.prefix) == ["198.18.50.0/24"] && top.first?.limited == 3, "\(top)")
    }

    @Test("IPv6 sources share their /64: rotating addresses inside it gains nothing", arguments: Hook.allCases)
    func ipv6Rotation(hook: Hook) throws {
        let rig = try Rig()
        try rig.limit(id: 1, port: 5514, RateLimit(datagramsPerSecond: 1, burstDatagrams: 4))
        let rotating = (1...40).filter { rig.sent(hook, from: "2001:db8:77:1::\(String($0, radix: 16))") }.count
        #expect(rotating == 4, "\(hook): \(rotating)")
        #expect(rig.sent(hook, from: "2001:db8:77:2::1"), "\(hook): another /64")
        #expect(rig.counts(1)[0] == 36)
    }

    @Test("bytes_per_second and new_sources_per_second", arguments: Hook.allCases)
    func bytesAndNewSources(hook: Hook) throws {
        let rig = try Rig()
        // 1,000 bytes a second, burst 2,500: two datagrams of 1,000 payload bytes; a small one still fits.
        try rig.limit(id: 0, port: 5514, RateLimit(bytesPerSecond: 1000, burstBytes: 2500, newSourcesPerSecond: 1, burstNewSources: 3))
        #expect((1...4).filter { _ in rig.sent(hook, from: "198.18.60.1", payload: 1000) }.count == 2)
        #expect(rig.sent(hook, from: "198.18.60.1", payload: 400))
        // Two more new sources fit in the ceiling's burst of 3, the fourth is refused.
        #expect(rig.sent(hook, from: "198.18.60.2") && rig.sent(hook, from: "198.18.60.3"))
        #expect(!rig.sent(hook, from: "198.18.60.4"))
        #expect(rig.counts(0) == [2, 2100, 1], "\(hook): \(rig.counts(0))")
    }

    @Test("xdp passes a datagram to tc (no neighbour) after charging its source: given back, so the source is charged once")
    func xdpPassChargesOnce() throws {
        let rig = try Rig()
        try rig.limit(id: 4, port: 5517, RateLimit(datagramsPerSecond: 1, burstDatagrams: 3))
        let frame = { TCNATProgramTests.frame(from: SocketAddress("198.18.70.1:4000")!, to: TCProgramFixture.listenerBind(5517), payload: Array("n".utf8)) }
        // Each datagram: XDP charges and passes it (no neighbour), then tc charges it and sends it.
        for round in 1...3 {
            #expect(rig.forward.run(frame()).action == XDPForwardProgramTests.pass, "round \(round)")
            #expect(rig.fixture.execute(frame()).verdict == TCProgramFixture.redirect, "round \(round)")
        }
        #expect(rig.forward.run(frame()).action == 1, "the fourth: dropped at XDP")
        #expect(rig.counts(4)[0] == 1)
    }

    @Test("amplification on a nat listener: replies to a client at most 3x its bytes, the rest dropped and counted; validated after 2 exchanges; a client never seen is not capped")
    func amplification() throws {
        let (fixture, maps) = try TCNATProgramTests.natFixture()
        defer { maps.forEach { close($0) } }
        let program = fixture.program
        let id = TCNATProgramTests.natID
        let clients = try program.putAmplification(id: id, Amplification(factor: 3, validatedAfter: 2), maxEntries: 1024)
        defer { close(clients) }
        var entry = fanout_listener()
        entry.id = id
        entry.policy = FANOUT_POLICY_ROUND_ROBIN.rawValue
        entry.reserved = FANOUT_LISTENER_NAT | FANOUT_LISTENER_AMP
        try program.putListener(TCNATProgramTests.vip, ifindex: UInt32(fixture.ifindex), entry)
        let client = SocketAddress("198.18.50.9:41000")!
        func request(_ bytes: Int) throws -> SocketAddress {
            try TCNATProgramTests.forwarded(fixture, TCNATProgramTests.frame(from: client, to: TCNATProgramTests.vip, payload: [UInt8](repeating: 0x71, count: bytes)))
        }
        func reply(_ bytes: Int, from port: UInt16, to destination: SocketAddress = client) -> Bool {
            let frame = TCNATProgramTests.frame(from: SocketAddress("198.18.200.10:\(port)")!, to: destination, payload: [UInt8](repeating: 0x72, count: bytes))
            return fixture.execute(frame, ifindex: fixture.otherIfindex).verdict == TCNATProgramTests.redirect
        }
        let backend = try request(100).port
        // 300 bytes may go back for the client's 100: 250 + 50, then nothing more.
        #expect(reply(250, from: backend) && reply(50, from: backend))
        #expect(!reply(1, from: backend) && !reply(1000, from: backend))
        #expect(program.rateCounts(id: id).capped == 2 && program.rateCounts(id: id).cappedBytes == 1001, "\(program.rateCounts(id: id))")
        // Its next datagram (after replies went to it) is an exchange and raises the cap by 300.
        _ = try request(100)
        #expect(reply(300, from: backend) && !reply(1, from: backend))
        // The second exchange validates it: no cap from then on.
        _ = try request(10)
        #expect(reply(1400, from: backend) && reply(1400, from: backend))
        // A client the listener never had a datagram from is not capped (its server started the
        // conversation, or it was associated before this process).
        #expect(reply(1400, from: backend, to: SocketAddress("198.18.50.10:41000")!))
        program.clearAmplification(id: id)
    }

    @Test("a listener's replication pools count each limited datagram offered and dropped (rate_limited at the pool's id), so their outcomes still add up")
    func pools() throws {
        let fixture = try TCProgramFixture()
        let buckets = try fixture.program.putRateLimit(id: 10, RateLimit(datagramsPerSecond: 1, burstDatagrams: 2))
        defer { close(buckets) }
        try fixture.addListener(bind: TCProgramFixture.listenerBind(5521), id: 10, own: TCPoolProgramTests.own, pools: [
            TCProgramFixture.PoolSpec(id: 11, policy: FANOUT_POLICY_ALL, members: TCPoolProgramTests.allMembers),
            TCProgramFixture.PoolSpec(id: 12, policy: FANOUT_POLICY_ROUND_ROBIN, members: TCPoolProgramTests.allMembers),
        ], reserved: FANOUT_LISTENER_RATE)
        let frame = Packet.ipv4(payload: [1, 2, 3, 4], port: 5521)
        let verdicts = (1...5).map { _ in fixture.execute(frame).verdict }
        #expect(verdicts.filter { $0 == TCProgramFixture.shot }.count == 3, "\(verdicts)")
        #expect(fixture.stats(10).received == 5 && fixture.program.rateCounts(id: 10).limited == 3)
        for pool: UInt32 in [11, 12] {
            let counted = fixture.pool(pool)
            let limited = fixture.program.rateCounts(id: pool).limited
            #expect(counted.received == 5 && limited == 3, "pool \(pool): \(counted), limited \(limited)")
            #expect(counted.forwarded + counted.dropped + limited + counted.sampledOut + counted.filteredOut == counted.received, "pool \(pool): \(counted)")
        }
        fixture.program.clearRateLimit(id: 10, allow: [])
    }

    @Test("a fragmented datagram is charged whole at its first fragment (its UDP length), and the later fragments of a limited one are dropped with it, counted", arguments: Hook.allCases)
    func fragments(hook: Hook) throws {
        let rig = try Rig()
        try rig.limit(id: 0, port: 5514, RateLimit(bytesPerSecond: 1000, burstBytes: 1500))
        func verdicts(_ pieces: [[UInt8]]) -> [Bool] {
            pieces.map { piece in
                switch hook {
                case .tc: rig.fixture.execute(piece).verdict != TCProgramFixture.shot
                // Later fragments XDP cannot follow go to tc, which finishes them.
                case .xdp:
                    { action in action == XDPForwardProgramTests.pass ? rig.fixture.execute(piece).verdict != TCProgramFixture.shot : action != 1 }(rig.forward.run(piece).action)
                }
            }
        }
        // 2,400 bytes in pieces of 1,000: above the 1,500-byte burst though each piece is below it.
        let big = Packet.ipv4Fragments(payload: [UInt8](repeating: 0x42, count: 2400), id: 0x6161, pieceSize: 1000)
        #expect(big.count == 3)
        #expect(verdicts(big) == [false, false, false], "\(hook): the whole datagram dropped")
        #expect(rig.counts(0)[0] == 3, "\(hook): its three pieces counted rate_limited: \(rig.counts(0))")
        // 1,200 bytes in two pieces fit the burst: both leave.
        let small = Packet.ipv4Fragments(payload: [UInt8](repeating: 0x43, count: 1200), id: 0x6262, pieceSize: 1000)
        #expect(verdicts(small) == [true, true], "\(hook)")
        #expect(rig.counts(0)[0] == 3)
    }

    @Test("taken out: the program limits nothing for the listener, and its allow prefixes are gone")
    func clear() throws {
        let rig = try Rig()
        let limit = RateLimit(datagramsPerSecond: 1, burstDatagrams: 1, allow: [SourcePrefix("198.18.9.0/24")!])
        try rig.limit(id: 0, port: 5514, limit)
        #expect(rig.sent(.tc, from: "198.18.80.1") && !rig.sent(.tc, from: "198.18.80.1"))
        rig.program.clearRateLimit(id: 0, allow: limit.allow)
        #expect((1...5).allSatisfy { _ in rig.sent(.tc, from: "198.18.80.1") })
        var key = TCProgram.allowKey(id: 0, limit.allow[0])
        var value: UInt8 = 0
        #expect(bpf_map_lookup_elem(rig.program.rateAllow, &key, &value) != 0)
    }

    @Test("udp-fanout capture: what rate_limit drops goes into the ring with its reason, from its IP header, sampled (the rest counted sampled_out); a reason not asked for, or no capture, puts nothing there", arguments: Hook.allCases)
    func capture(hook: Hook) throws {
        let rig = try Rig()
        try rig.limit(id: 0, port: 5514, RateLimit(datagramsPerSecond: 1, burstDatagrams: 2))
        let capture = DropCapture()
        let session = CaptureSession(CaptureRequest())
        try capture.start(session, listener: "t")
        defer { capture.end(session) }
        let tap = try KernelCaptureTap(ringBuffer: rig.program.capture, logger: Logger(label: "capture-test"))
        defer { tap.stop() }
        tap.register(id: 0, capture)
        func configure(_ filter: DropCapture.Filter?, interval: UInt64 = 1_000_000_000_000, burst: UInt64 = 3) throws {
            var key: UInt32 = 0
            var config = KernelCaptureTap.config(filter)
            if filter != nil { (config.interval, config.tolerance) = (interval, interval * burst) }
            try #require(bpf_map_update_elem(rig.program.captureConfigs, &key, &config, UInt64(BPF_ANY)) == 0)
        }
        func counts() -> [UInt64] {
            let counted = rig.program.captureCounts(id: 0)
            return [counted.captured, counted.sampledOut, counted.ringFull]
        }
        // Another reason asked for: the burst of 2 passes, the 3 limited ones are not captured.
        try configure(DropCapture.Filter(reasons: ["no_route"], rate: 1000, snaplen: 2048))
        #expect((1...5).filter { _ in rig.sent(hook, from: "198.18.50.1") }.count == 2)
        #expect(counts() == [0, 0, 0], "\(hook): \(counts())")
        // rate_limited asked for, a sampling of 3 at once: 3 of 6 captured, 3 sampled out.
        try configure(DropCapture.Filter(reasons: ["rate_limited"], rate: 1000, snaplen: 2048))
        #expect((1...6).filter { _ in rig.sent(hook, from: "198.18.50.1") }.isEmpty)
        #expect(counts() == [3, 3, 0], "\(hook): \(counts())")
        var packets: [CapturedPacket] = []
        for _ in 0..<200 where packets.count < 3 {
            packets += session.take().packets
            usleep(10_000)
        }
        #expect(packets.count == 3, "\(hook): \(packets.count)")
        for packet in packets {
            // IPv4, 20 + 8 + 100 bytes, from 198.18.50.1 to the listener.
            #expect(packet.reason == "rate_limited" && !packet.reply && !packet.ethernet && packet.data.count == 128 && packet.originalLength == 128)
            #expect(packet.data.first == 0x45 && Array(packet.data[12..<16]) == [198, 18, 50, 1] && packet.data[28...].allSatisfy { $0 == 0x61 }, "\(hook)")
        }
        // A snap length of 64: the packet's first 64 bytes, its whole length still said.
        try configure(DropCapture.Filter(reasons: nil, rate: 1000, snaplen: 64), burst: 1)
        #expect(!rig.sent(hook, from: "198.18.50.1"))
        var cut: [CapturedPacket] = []
        for _ in 0..<200 where cut.isEmpty {
            cut = session.take().packets
            usleep(10_000)
        }
        #expect(cut.count == 1 && cut.first?.data.count == 64 && cut.first?.originalLength == 128, "\(hook): \(cut.map { ($0.data.count, $0.originalLength) })")
        // No capture: nothing more is taken.
        try configure(nil)
        #expect(!rig.sent(hook, from: "198.18.50.1"))
        #expect(counts() == [4, 3, 0], "\(hook): \(counts())")
    }

    @Test("udp-fanout capture in tc: a datagram dropped after its listener's pools took a copy (the copies are made from the packet itself) is said to be modified for the copy; one without pools is not")
    func captureAfterPoolCopies() throws {
        let fixture = try TCProgramFixture()
        // No backend of its own (no_healthy), a pool taking a copy of each datagram.
        try fixture.addListener(bind: TCProgramFixture.listenerBind(5522), id: 20, own: [], pools: [
            TCProgramFixture.PoolSpec(id: 21, policy: FANOUT_POLICY_ROUND_ROBIN, members: TCPoolProgramTests.allMembers),
        ])
        try fixture.addListener(bind: TCProgramFixture.listenerBind(5523), id: 22, own: [], pools: [])
        let capture = DropCapture()
        let session = CaptureSession(CaptureRequest())
        try capture.start(session, listener: "t")
        defer { capture.end(session) }
        let tap = try KernelCaptureTap(ringBuffer: fixture.program.capture, logger: Logger(label: "capture-test"))
        defer { tap.stop() }
        for id: UInt32 in [20, 22] {
            tap.register(id: id, capture)
            var key = id
            var config = KernelCaptureTap.config(DropCapture.Filter(reasons: ["no_healthy"], rate: 1000, snaplen: 2048))
            try #require(bpf_map_update_elem(fixture.program.captureConfigs, &key, &config, UInt64(BPF_ANY)) == 0)
        }
        #expect(fixture.execute(Packet.ipv4(payload: [1, 2, 3, 4], port: 5522)).verdict == TCProgramFixture.shot)
        #expect(fixture.execute(Packet.ipv4(payload: [1, 2, 3, 4], port: 5523)).verdict == TCProgramFixture.shot)
        var packets: [CapturedPacket] = []
        for _ in 0..<200 where packets.count < 2 {
            packets += session.take().packets
            usleep(10_000)
        }
        let comments = packets.map(\.comment).sorted()
        #expect(comments == ["no_healthy", "no_healthy (modified for a replication pool's copy first)"], "\(comments)")
        for id: UInt32 in [20, 22] {
            var key = id
            var empty = fanout_capture_config()
            bpf_map_update_elem(fixture.program.captureConfigs, &key, &empty, UInt64(BPF_ANY))
        }
    }
}
