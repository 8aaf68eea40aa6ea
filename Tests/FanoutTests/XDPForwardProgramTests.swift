// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import CSystemShim
import Foundation
import ReusePortLB
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// The xdp kind's program case by case under BPF_PROG_TEST_RUN, loaded with the tc fixture's maps
/// (TCProgramFixture: 5514 round robin over three reachable backends, 5515 no backend, 5516 no
/// route, 5517 no neighbour entry), its listeners served at XDP and both veth ends in its device
/// map. Each frame's action, rewrite (checked with checksums computed here) and counter. The
/// verdicts it shares with tc (no backend, no route, TTL 1; no neighbour and not ours, which it
/// passes) are rows of DecisionTableTests' table, run through both programs.
@Suite("xdp program (BPF_PROG_TEST_RUN)", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct XDPForwardProgramTests {
    static let (drop, pass, transmit, redirect): (UInt32, UInt32, UInt32, UInt32) = (1, 2, 3, 4)

    final class Rig {
        let fixture: TCProgramFixture
        let xdp: XDPForwardProgram

        init(crypto: Bool = TCKernelFeatures.quicCryptoProblem == nil) throws {
            fixture = try TCProgramFixture(crypto: crypto)
            xdp = try XDPForwardProgram(sharing: fixture.program)
            for id in UInt32(0)...4 { try xdp.serve(id: id, true) }
            try xdp.setDevice(UInt32(fixture.otherIfindex), present: true)
            try xdp.setDevice(UInt32(fixture.ifindex), present: true)
        }

        deinit { xdp.closeDescriptors() }

        /// One run of `frame` arriving on t1, from a thread in the namespace pinned to CPU 0 (the
        /// rotation is per CPU): the action and the frame as it leaves.
        func run(_ frame: [UInt8]) -> (action: UInt32, output: [UInt8]) {
            let box = Box()
            let (program, fd, ifindex) = (xdp.program, fixture.namespaceFD, UInt32(fixture.ifindex))
            OSThread(name: "xdp-test-run") {
                // CLONE_NEWNET; one CPU, so each run takes the rotation's next entry.
                guard shim_setns(fd, 0x4000_0000) == 0, shim_pin_current_thread(0) == 0 else { return }
                var output = [UInt8](repeating: 0, count: 4096)
                let (result, action, size) = XDPProgramFixture.testRun(program, frame, ifindex: ifindex, queue: 0, output: &output)
                box.value = result == 0 ? (action, Array(output[0..<size])) : (UInt32.max, [])
            }.join()
            return box.value
        }

        func verdict(_ id: UInt32, _ verdict: fanout_verdict) -> UInt64 { fixture.stats(id).verdicts[Int(verdict.rawValue)] }
        func passed(_ id: UInt32, _ reason: XDPPassReason) -> UInt64 { xdp.passedCounts(id: id)?[reason.rawValue] ?? UInt64.max }
    }

    final class Box: @unchecked Sendable { var value: (UInt32, [UInt8]) = (UInt32.max, []) }

    /// A frame sent on toward `port` of 198.18.200.10 (IPv4) or 2001:db8:200::10, from the client,
    /// one hop fewer, with the fib's MACs, untagged, and both checksums valid (a zero UDP one zero).
    func expectSent(_ rig: Rig, _ output: [UInt8], port: UInt16, ipv6: Bool = false, zeroChecksum: Bool = false, _ comment: Comment) throws {
        let packet = try #require(Packet.parse(output), comment)
        #expect(!packet.tagged, comment)
        #expect(Array(output[0..<6]) == ProgramFrames.neighbourMAC && Array(output[6..<12]) == rig.fixture.sourceMAC, comment)
        #expect(packet.destination == (ipv6 ? IPAddress("2001:db8:200::10")!.bytes : [198, 18, 200, 10]), comment)
        #expect(packet.source == (ipv6 ? ProgramFrames.clientV6 : ProgramFrames.clientV4), "the client's source kept: \(comment)")
        #expect(packet.destinationPort == port, comment)
        #expect(packet.hopLimit == 63, comment)
        if !ipv6 { #expect(Packet.ipv4HeaderValid(packet), comment) }
        if zeroChecksum {
            #expect(packet.udpChecksum == 0, "a zero UDP checksum stays zero: \(comment)")
        } else {
            #expect(Packet.udpChecksumValid(packet), comment)
        }
    }

    @Test("Forwarded at XDP: round robin in order, IPv4 (options, a tag popped, a zero checksum), IPv6; each counted forwarded")
    func forwards() throws {
        let rig = try Rig()
        let payload = Array("xdp-table".utf8)
        for n in 1...3 {
            let (action, output) = rig.run(Packet.ipv4(payload: payload))
            #expect(action == Self.redirect, "datagram \(n)")
            try expectSent(rig, output, port: UInt16(6000 + n), "round robin \(n)")
        }
        var (action, output) = rig.run(Packet.ipv4(payload: payload, options: [1, 1, 1, 0]))
        #expect(action == Self.redirect)
        try expectSent(rig, output, port: 6001, "IPv4 options")
        (action, output) = rig.run(Packet.ipv4(payload: payload, vlan: 7))
        #expect(action == Self.redirect)
        try expectSent(rig, output, port: 6002, "802.1Q tag popped")
        (action, output) = rig.run(Packet.ipv4(payload: payload, zeroChecksum: true))
        #expect(action == Self.redirect)
        try expectSent(rig, output, port: 6003, zeroChecksum: true, "zero UDP checksum")
        (action, output) = rig.run(Packet.ipv6(payload: payload))
        #expect(action == Self.redirect)
        try expectSent(rig, output, port: 6001, ipv6: true, "IPv6")
        #expect(rig.verdict(0, FANOUT_VERDICT_FORWARDED) == 6 && rig.verdict(1, FANOUT_VERDICT_FORWARDED) == 1)
    }

    @Test("Passed to tc untouched, each with its reason: no neighbour, an offloaded checksum, an interface outside the device map; not ours and a tc_ebpf listener's uncounted")
    func passes() throws {
        let rig = try Rig()
        let payload = Array("xdp-table".utf8)
        var frame = Packet.ipv4(payload: payload, port: 5517)
        var result = rig.run(frame)
        #expect(result.action == Self.pass && result.output == frame, "untouched")
        #expect(rig.passed(4, .noNeighbour) == 1)
        // The UDP checksum field holding the pseudo-header's folded sum, as an offloading sender leaves it.
        frame = Packet.ipv4(payload: payload)
        let l4 = Packet.ethernet + 20
        let udpLength = frame.count - l4
        let pseudo = Packet.fold(Packet.sum(ProgramFrames.clientV4 + ProgramFrames.listenerV4.ip.bytes + [0, 17, UInt8(udpLength >> 8), UInt8(udpLength & 0xff)]))
        frame[l4 + 6] = UInt8(pseudo >> 8)
        frame[l4 + 7] = UInt8(pseudo & 0xff)
        result = rig.run(frame)
        #expect(result.action == Self.pass && result.output == frame)
        #expect(rig.passed(0, .checksumPartial) == 1)
        // t0 (toward the backends) out of the device map: tc redirects the skb.
        try rig.xdp.setDevice(UInt32(rig.fixture.otherIfindex), present: false)
        frame = Packet.ipv4(payload: payload)
        result = rig.run(frame)
        #expect(result.action == Self.pass && result.output == frame)
        #expect(rig.passed(0, .noXDPTransmit) == 1)
        try rig.xdp.setDevice(UInt32(rig.fixture.otherIfindex), present: true)
        // The pass put the rotation back (tc chose that backend): the next datagram takes the first.
        let next = rig.run(Packet.ipv4(payload: payload))
        #expect(next.action == Self.redirect)
        try expectSent(rig, next.output, port: 6001, "the rotation moved once per datagram")
        // Not a listener's port, and a listener the XDP program does not serve (tc_ebpf's).
        let before = (0...4).map { rig.fixture.stats(UInt32($0)).verdicts.reduce(0, +) }
        #expect(rig.run(Packet.ipv4(payload: payload, port: 5999)).action == Self.pass)
        try rig.xdp.serve(id: 0, false)
        #expect(rig.run(Packet.ipv4(payload: payload)).action == Self.pass)
        #expect((0...4).map { rig.fixture.stats(UInt32($0)).verdicts.reduce(0, +) } == before, "nothing counted: tc counts those")
        #expect(rig.passed(0, .checksumPartial) == 1 && rig.passed(0, .noXDPTransmit) == 1)
    }
}
