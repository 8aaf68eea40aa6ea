// SPDX-License-Identifier: Apache-2.0
import CLibBPF
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
import SystemCalls

/// The XDP steering program under BPF_PROG_TEST_RUN, table-driven: the action, that the frame
/// is untouched, and that exactly one verdict counter (and received/bytes) rose in exactly one
/// stats entry.
///
/// test_run's context names the arrival interface and queue (ingress_ifindex, rx_queue_index),
/// which must exist in the caller's namespace: runs happen on a thread inside a namespace this
/// test creates, with veth x1 (two queues; the listeners' interface) and its peer x0.
@Suite("XDP program under BPF_PROG_TEST_RUN", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct XDPProgramTests {
    // The fixture's actions and frame limit, under the names the cases use.
    static let pass = XDPProgramFixture.pass, redirect = XDPProgramFixture.redirect
    static let maxFrame = XDPProgramFixture.maxFrame
    typealias Fixture = XDPProgramFixture

    // MARK: frames

    static let v4 = Packet.ipv4(payload: Array(repeating: 0x41, count: 100))
    static let v6 = Packet.ipv6(payload: Array(repeating: 0x42, count: 100))

    /// IPv6 with a hop-by-hop options header (PadN) and a destination options header before UDP.
    static func v6ExtensionHeaders() -> [UInt8] {
        let (source, destination) = (ProgramFrames.clientV6, ProgramFrames.listenerV6.ip.bytes)
        let udp = Packet.udp(source: source, destination: destination, port: 5514, payload: [1, 2, 3, 4])
        let hopByHop: [UInt8] = [60, 0, 1, 4, 0, 0, 0, 0]
        let destinationOptions: [UInt8] = [17, 1, 1, 12] + [UInt8](repeating: 0, count: 12)
        let extensions = hopByHop + destinationOptions
        return Packet.ethernetHeader(type: 0x86dd) + Packet.ipv6Header(next: 0, length: extensions.count + udp.count, source: source, destination: destination)
            + extensions + udp
    }

    /// `frame` (which has one 802.1Q tag) with an outer 802.1ad tag before it.
    static func outerTag(_ frame: [UInt8], type: [UInt8] = [0x88, 0xa8]) -> [UInt8] {
        Array(frame[0..<12]) + type + [0x00, 0x07] + Array(frame[12...])
    }

    /// A v4 frame to 198.18.100.`last`:port (checksums are not the program's concern).
    static func v4(to last: UInt8, port: UInt16) -> [UInt8] {
        var frame = Packet.ipv4(payload: [9, 9, 9], port: port)
        frame[Packet.ethernet + 19] = last
        return frame
    }

    // MARK: cases

    @Test("The Swift verdicts mirror enum fanout_xdp_verdict")
    func verdictMirror() {
        #expect(XDPVerdict.allCases.count == Int(FANOUT_XDP_VERDICT_COUNT.rawValue))
        let pairs: [(XDPVerdict, fanout_xdp_verdict)] = [
            (.redirected, FANOUT_XDP_VERDICT_REDIRECTED), (.noSocket, FANOUT_XDP_VERDICT_NO_SOCKET),
            (.fragment, FANOUT_XDP_VERDICT_FRAGMENT), (.tooLarge, FANOUT_XDP_VERDICT_TOO_LARGE),
            (.malformed, FANOUT_XDP_VERDICT_MALFORMED), (.notOurs, FANOUT_XDP_VERDICT_NOT_OURS),
        ]
        for (swift, c) in pairs { #expect(swift.raw == c, "\(swift.label)") }
        #expect(Set(XDPVerdict.allCases.map(\.label)).count == XDPVerdict.allCases.count, "labels are distinct")
    }

    @Test("Listeners' datagrams without a socket in the queue: passed, counted no_socket for the listener")
    func matchedWithoutSocket() throws {
        let fixture = try Fixture()
        let cases: [(String, [UInt8], UInt32)] = [
            ("IPv4", Self.v4, 0),
            ("IPv6", Self.v6, 1),
            ("IPv4 with options", Packet.ipv4(payload: [1, 2, 3], options: [1, 1, 1, 0]), 0),
            ("IPv6 with extension headers", Self.v6ExtensionHeaders(), 1),
            ("one 802.1Q tag", Packet.ipv4(payload: [4, 5], vlan: 42), 0),
            ("802.1ad + 802.1Q (QinQ)", Self.outerTag(Packet.ipv4(payload: [4, 5], vlan: 42)), 0),
            ("two 802.1Q tags", Self.outerTag(Packet.ipv4(payload: [4, 5], vlan: 42), type: [0x81, 0x00]), 0),
            ("IPv4 wildcard listener", Self.v4(to: 77, port: 5520), 2),
            ("IPv6 wildcard listener", Packet.ipv6(payload: [7], port: 5520), 3),
            ("exact address before the wildcard", Self.v4(to: 1, port: 5521), 4),
            ("the wildcard for another address", Self.v4(to: 2, port: 5521), 5),
            ("frame of exactly max_frame_len", Packet.ipv4(payload: [UInt8](repeating: 3, count: Int(Self.maxFrame) - 42)), 0),
        ]
        for (name, frame, key) in cases {
            fixture.expectVerdict(name, frame, action: Self.pass, key: key, .noSocket)
        }
    }

    @Test("Fragments, too large, malformed and not ours: passed untouched, each its verdict in its entry")
    func passedToTheKernel() throws {
        let fixture = try Fixture()
        let unmatched = XDPProgram.unmatched
        let payload = (0..<2400).map { UInt8(truncatingIfNeeded: $0 * 7) }
        let pieces = Packet.ipv4Fragments(payload: payload, id: 0x4242, pieceSize: 1000)
        let pieces6 = Packet.ipv6Fragments(payload: payload, id: 0x0102_0304, pieceSize: 1000)
        let cases: [(String, [UInt8], UInt32, XDPVerdict)] = [
            ("IPv4 first fragment", pieces[0], 0, .fragment),
            ("IPv4 middle fragment", pieces[1], unmatched, .fragment),
            ("IPv4 last fragment", pieces[2], unmatched, .fragment),
            ("IPv6 first fragment", pieces6[0], 1, .fragment),
            ("IPv6 later fragment", pieces6[1], unmatched, .fragment),
            ("too large for a UMEM frame", Packet.ipv4(payload: [UInt8](repeating: 3, count: Int(Self.maxFrame) - 41)), 0, .tooLarge),
            ("IPv4 header cut (frame ends 10 bytes into it)", Array(Self.v4.prefix(Packet.ethernet + 10)), unmatched, .malformed),
            ("IPv6 header cut", Array(Self.v6.prefix(Packet.ethernet + 30)), unmatched, .malformed),
            ("IPv4 options cut (IHL 15, frame ends after 24 bytes)", {
                var f = Array(Self.v4.prefix(Packet.ethernet + 24)); f[Packet.ethernet] = 0x4f; return f
            }(), unmatched, .malformed),
            ("UDP header cut", Array(Packet.ipv4(payload: [1]).prefix(Packet.ethernet + 20 + 4)), unmatched, .malformed),
            ("IPv6 extension header cut", {
                var f = Array(Packet.ipv6(payload: [1]).prefix(Packet.ethernet + 41)); f[Packet.ethernet + 6] = 0; return f
            }(), unmatched, .malformed),
            ("IPv4 total length beyond the frame", Array(Packet.ipv4(payload: [UInt8](repeating: 1, count: 100)).prefix(Packet.ethernet + 40)), unmatched, .malformed),
            ("IHL below 5", { var f = Packet.ipv4(payload: [1]); f[Packet.ethernet] = 0x44; return f }(), unmatched, .malformed),
            ("a VLAN tag cut", Array(Packet.ipv4(payload: [1], vlan: 5).prefix(Packet.ethernet + 2)), unmatched, .malformed),
            ("TCP to the listener", Packet.ipv4(payload: [1, 2, 3], protocolNumber: 6), unmatched, .notOurs),
            ("ICMP to the listener", Packet.ipv4(payload: [8, 0, 0, 0], protocolNumber: 1), unmatched, .notOurs),
            ("other port", Packet.ipv4(payload: [1, 2, 3], port: 9999), unmatched, .notOurs),
            ("other address", Self.v4(to: 2, port: 5514), unmatched, .notOurs),
            ("ARP", Packet.ethernetHeader(type: 0x0806) + [UInt8](repeating: 0, count: 28), unmatched, .notOurs),
            ("three VLAN tags", Self.outerTag(Self.outerTag(Packet.ipv4(payload: [4], vlan: 42))), unmatched, .notOurs),
        ]
        for (name, frame, key, verdict) in cases {
            fixture.expectVerdict(name, frame, action: Self.pass, key: key, verdict)
        }
        // The listener's datagram arriving on another interface is not its.
        fixture.expectVerdict("other interface", Self.v4, action: Self.pass, key: unmatched, .notOurs, ifindex: fixture.otherIfindex)
        // A removed listener no longer matches.
        fixture.program.removeListener(ProgramFrames.listenerV4, ifindex: fixture.ifindex)
        fixture.expectVerdict("removed listener", Self.v4, action: Self.pass, key: unmatched, .notOurs)
    }

    @Test("A socket in the arrival queue's XSKMAP slot: redirected; another queue or a cleared slot: no_socket")
    func redirectedToTheQueuesSocket() throws {
        let fixture = try Fixture()
        let socket = try #require(inNetworkNamespace(fixture.namespace) { TestXSK.open(interface: "x1", queue: 1) }, "namespace thread")
        let fd = try socket.get()
        defer { close(fd) }
        try fixture.program.setSocket(queue: 1, fd: fd)
        fixture.expectVerdict("queue 1 (its socket)", Self.v4, action: Self.redirect, key: 0, .redirected, queue: 1)
        fixture.expectVerdict("queue 1, IPv6", Self.v6, action: Self.redirect, key: 1, .redirected, queue: 1)
        fixture.expectVerdict("queue 0 (no socket)", Self.v4, action: Self.pass, key: 0, .noSocket, queue: 0)
        fixture.expectVerdict("not ours on queue 1", Packet.ipv4(payload: [1], port: 9999), action: Self.pass, key: XDPProgram.unmatched, .notOurs, queue: 1)
        fixture.program.clearSocket(queue: 1)
        fixture.expectVerdict("queue 1 after clearSocket", Self.v4, action: Self.pass, key: 0, .noSocket, queue: 1)
        #expect(throws: SystemCallError.self) { try fixture.program.setSocket(queue: UInt32(FANOUT_XDP_MAX_QUEUES), fd: fd) }
    }

    @Test("max_frame_len is the program's: a program loaded with 200 passes a 300-byte frame as too_large")
    func maxFrameLengthOption() throws {
        let program = try XDPProgram(maxFrameLength: 200)
        defer { program.closeDescriptors() }
        try program.putListener(SocketAddress("0.0.0.0:5514")!, ifindex: 1, id: 0)
        for (frame, verdict) in [(Packet.ipv4(payload: [UInt8](repeating: 1, count: 300 - 42)), XDPVerdict.tooLarge),
                                 (Packet.ipv4(payload: [UInt8](repeating: 1, count: 200 - 42)), .noSocket)] {
            let before = program.stats(listener: 0).verdicts[verdict]!
            var context = xdp_md()
            context.data_end = UInt32(frame.count)
            context.ingress_ifindex = 1  // lo of the test's own namespace: only its index is used
            var output = [UInt8](repeating: 0, count: 4096)
            let (result, action, _) = ProgramTestRun.run(program.program, frame, context: context, output: &output)
            #expect(result == 0 && action == Self.pass)
            #expect(program.stats(listener: 0).verdicts[verdict] == before + 1, "\(frame.count) bytes: \(verdict.label)")
        }
        #expect(throws: SystemCallError.self) { try program.putListener(SocketAddress("0.0.0.0:1")!, ifindex: 1, id: UInt32(FANOUT_MAX_LISTENERS)) }
    }
}
