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
import SystemCalls

/// The addresses the tc and XDP program fixtures configure, and the fuzz tests' frames use.
enum ProgramFrames {
    static let listenerV4 = SocketAddress("198.18.100.1:5514")!
    static let listenerV6 = SocketAddress("[2001:db8:100::1]:5514")!
    static let clientV4: [UInt8] = [198, 18, 50, 7]
    static let clientV6 = IPAddress("2001:db8:50::7")!.bytes
    static let neighbourMAC: [UInt8] = [2, 0, 0, 0, 0, 0x0a]
}

/// A namespace with interface t0 (198.18.200.1/24 and 2001:db8:200::1/64), a permanent
/// neighbour .10 / ::10 (MAC 02:00:00:00:00:0a), no neighbour for .20, no route to
/// 198.19.99.0/24, and 198.18.210.0/24 through t0 with a route MTU of 600; packets arrive on its
/// peer t1. The program is loaded with listeners:
/// 5514 (v4 and v6) round robin over three reachable backends; 5515 no backend; 5516 a
/// backend without a route; 5517 a backend without a neighbour entry.
final class TCProgramFixture {
    static let redirect: UInt32 = 7, shot: UInt32 = 2
    /// TC_ACT_UNSPEC (TCX_NEXT): not ours, on to the next filter or program.
    static let pass = UInt32(bitPattern: -1)

    let namespace: String
    let program: TCProgram
    /// Runs arrive CHECKSUM_COMPLETE (BPF_F_TEST_SKB_CHECKSUM_COMPLETE: the kernel checks the
    /// program kept `skb->csum` right, else the run fails with -EBADMSG); else CHECKSUM_NONE.
    var checksumComplete = false
    var testRunFlags: UInt32 { checksumComplete ? UInt32(BPF_F_TEST_SKB_CHECKSUM_COMPLETE) : 0 }
    /// The checksum states a run can arrive in here: CHECKSUM_NONE, and CHECKSUM_COMPLETE where
    /// BPF_PROG_TEST_RUN takes BPF_F_TEST_SKB_CHECKSUM_COMPLETE (kernel 6.11).
    static let checksumStates: [Bool] = {
        var name = utsname()
        uname(&name)
        let release = withUnsafeBytes(of: name.release) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
        let numbers = release.split(whereSeparator: { !$0.isNumber }).prefix(2).compactMap { Int($0) }
        let recent = numbers.count == 2 && (numbers[0], numbers[1]) >= (6, 11)
        return recent ? [false, true] : [false]
    }()
    var ifindex: Int32 = 0
    /// t0's index: the backends' side, where no listener of the fixture's is configured.
    var otherIfindex: Int32 = 0
    var sourceMAC: [UInt8] = []
    let namespaceFD: Int32

    /// - Parameter crypto: the program build with the BPF crypto kfuncs, or the plain one.
    init(crypto: Bool = TCKernelFeatures.quicCryptoProblem == nil) throws {
        let name = "tct-\(String(UInt32.random(in: 0...UInt32.max), radix: 16))"
        namespace = name
        // deinit runs only once every stored property is set: a throw before that (a command
        // that fails, a program that does not load) takes the namespace with it here.
        var made = false
        var descriptor: Int32 = -1
        defer {
            if !made {
                if descriptor >= 0 { close(descriptor) }
                _ = try? run("/usr/sbin/ip", ["netns", "del", name])
            }
        }
        for arguments in [
            ["netns", "add", namespace],
            ["-n", namespace, "link", "add", "t0", "type", "veth", "peer", "name", "t1"],
            ["-n", namespace, "addr", "add", "198.18.200.1/24", "dev", "t0"],
            ["-n", namespace, "-6", "addr", "add", "2001:db8:200::1/64", "dev", "t0", "nodad"],
            ["-n", namespace, "link", "set", "t0", "up"],
            ["-n", namespace, "link", "set", "t1", "up"],
            ["-n", namespace, "neigh", "add", "198.18.200.10", "lladdr", "02:00:00:00:00:0a", "dev", "t0", "nud", "permanent"],
            ["-n", namespace, "-6", "neigh", "add", "2001:db8:200::10", "lladdr", "02:00:00:00:00:0a", "dev", "t0", "nud", "permanent"],
            // A narrow path: 198.18.210.0/24 through t0 with a route MTU of 600.
            ["-n", namespace, "route", "add", "198.18.210.0/24", "dev", "t0", "mtu", "lock", "600"],
            ["-n", namespace, "neigh", "add", "198.18.210.10", "lladdr", "02:00:00:00:00:0a", "dev", "t0", "nud", "permanent"],
        ] {
            let result = try run("/usr/sbin/ip", arguments)
            try #require(result.status == 0, "ip \(arguments.joined(separator: " ")): \(result.output)")
        }
        for setting in ["net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"] {
            _ = try run("/usr/bin/nsenter", ["--net=/run/netns/\(namespace)", "--", "/usr/sbin/sysctl", "-q", "-w", setting])
        }
        descriptor = open("/run/netns/\(name)", O_RDONLY | O_CLOEXEC)
        namespaceFD = descriptor
        program = try TCProgram(crypto: crypto)
        // Every stored property is set: from here a throw runs deinit, which cleans up.
        made = true
        // Packets arrive on t1; the backends are reached through t0.
        func link(_ name: String) throws -> [String: Any] {
            let json = try run("/usr/sbin/ip", ["-n", namespace, "-j", "link", "show", name]).output
            return try #require((JSONSerialization.jsonObject(with: Data(json.utf8)) as? [[String: Any]])?.first)
        }
        ifindex = Int32(try link("t1").int("ifindex"))
        otherIfindex = Int32(try link("t0").int("ifindex"))
        sourceMAC = try #require(try link("t0")["address"] as? String).split(separator: ":").map { UInt8($0, radix: 16)! }
        let backends = (1...3).map { Downstream(name: "b\($0)", address: SocketAddress("198.18.200.10:\(6000 + $0)")!) }
        let backendsV6 = (1...3).map { Downstream(name: "b\($0)", address: SocketAddress("[2001:db8:200::10]:\(6000 + $0)")!) }
        let slots: [String: UInt16] = ["b1": 0, "b2": 1, "b3": 2]
        try add(TCProgramFixture.listenerBind(5514), id: 0, BackendSet(downstreams: backends, balancing: .roundRobin, slots: slots))
        try add(ProgramFrames.listenerV6, id: 1, BackendSet(downstreams: backendsV6, balancing: .roundRobin, slots: slots))
        try add(TCProgramFixture.listenerBind(5515), id: 2, BackendSet(downstreams: [], balancing: .roundRobin, slots: [:]))
        try add(TCProgramFixture.listenerBind(5516), id: 3, BackendSet(downstreams: [Downstream(name: "x", address: SocketAddress("198.19.99.1:7000")!)], balancing: .roundRobin, slots: ["x": 0]))
        try add(TCProgramFixture.listenerBind(5517), id: 4, BackendSet(downstreams: [Downstream(name: "n", address: SocketAddress("198.18.200.20:7000")!)], balancing: .roundRobin, slots: ["n": 0]))
    }

    static func listenerBind(_ port: UInt16) -> SocketAddress { SocketAddress(ip: ProgramFrames.listenerV4.ip, port: port) }

    func add(_ bind: SocketAddress, id: UInt32, _ set: BackendSet, ifindex: Int32? = nil) throws {
        program.resetListener(id: id)
        try program.writeSet(id: id, generation: 0, set)
        var entry = fanout_listener()
        entry.id = id
        entry.policy = FANOUT_POLICY_ROUND_ROBIN.rawValue
        try program.putListener(bind, ifindex: UInt32(ifindex ?? self.ifindex), entry)
    }

    deinit {
        program.closeDescriptors()
        close(namespaceFD)
        _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace])
    }

    /// Runs the program once on `frame` arriving on t1 (or `ifindex`), from a thread inside
    /// the namespace.
    func execute(_ frame: [UInt8], ifindex: Int32? = nil) -> (verdict: UInt32, output: [UInt8]) {
        let box = RunResultBox()
        let (program, fd, ifindex, flags) = (self.program.program, namespaceFD, ifindex ?? self.ifindex, testRunFlags)
        OSThread(name: "test-run") {
            guard shim_setns(fd, 0x4000_0000) == 0 else { return }  // CLONE_NEWNET
            // One CPU: the rotation is per CPU, so every run then takes the next entry.
            _ = shim_pin_current_thread(0)
            var output = [UInt8](repeating: 0, count: 4096)
            let (result, verdict, size) = Self.testRun(program, frame, ifindex: ifindex, output: &output, flags: flags)
            box.set(result == 0 ? (verdict, Array(output[0..<size])) : (UInt32.max - UInt32(-result), []))
        }.join()
        return box.value
    }

    /// One BPF_PROG_TEST_RUN of `frame` arriving on `ifindex`, from the calling thread (which
    /// must be in the namespace), with `flags` (``testRunFlags``). Returns libbpf's result (0 or
    /// -errno), the program's verdict and the output's length in `output`.
    static func testRun(_ program: Int32, _ frame: [UInt8], ifindex: Int32, output: inout [UInt8],
                        flags: UInt32 = 0) -> (result: Int32, verdict: UInt32, size: Int) {
        var context = __sk_buff()
        context.ifindex = UInt32(ifindex)
        let (result, verdict, size) = ProgramTestRun.run(program, frame, context: context, output: &output, flags: flags)
        return (result, verdict, size)
    }

    func stats(_ id: UInt32) -> (received: UInt64, verdicts: [UInt64]) {
        let stats = program.listenerStats(id: id)
        return (stats.received, stats.verdicts)
    }
}

/// What the test-run thread hands back to the caller, which joins the thread before reading.
private final class RunResultBox: @unchecked Sendable {
    var value: (verdict: UInt32, output: [UInt8]) = (UInt32.max, [])
    func set(_ value: (UInt32, [UInt8])) { self.value = value }
}

/// A namespace with veth x1 (two queues; the listeners' interface) and its peer x0, and the
/// XDP program loaded with listeners on x1.
final class XDPProgramFixture {
    static let pass: UInt32 = 2, redirect: UInt32 = 4  // XDP_PASS, XDP_REDIRECT
    static let maxFrame: UInt32 = 1500

    let namespace: String
    let program: XDPProgram
    var ifindex: UInt32 = 0
    var otherIfindex: UInt32 = 0

    /// - Parameter maxFrameLength: the program's max_frame_len (the table cases assume the default).
    init(maxFrameLength: UInt32 = XDPProgramFixture.maxFrame) throws {
        let name = "xdpt-\(String(UInt32.random(in: 0...UInt32.max), radix: 16))"
        namespace = name
        // deinit runs only once every stored property is set: before that, a throw takes the
        // namespace with it here.
        var made = false
        defer { if !made { _ = try? run("/usr/sbin/ip", ["netns", "del", name]) } }
        for arguments in [
            ["netns", "add", namespace],
            ["-n", namespace, "link", "add", "x0", "numrxqueues", "2", "numtxqueues", "2", "type", "veth",
             "peer", "name", "x1", "numrxqueues", "2", "numtxqueues", "2"],
            ["-n", namespace, "link", "set", "x0", "up"],
            ["-n", namespace, "link", "set", "x1", "up"],
        ] {
            let result = try run("/usr/sbin/ip", arguments)
            try #require(result.status == 0, "ip \(arguments.joined(separator: " ")): \(result.output)")
        }
        program = try XDPProgram(maxFrameLength: maxFrameLength)
        made = true  // every stored property set: a throw from here runs deinit
        func index(_ name: String) throws -> UInt32 {
            let json = try run("/usr/sbin/ip", ["-n", namespace, "-j", "link", "show", name]).output
            return UInt32(try #require((JSONSerialization.jsonObject(with: Data(json.utf8)) as? [[String: Any]])?.first).int("ifindex"))
        }
        ifindex = try index("x1")
        otherIfindex = try index("x0")
        try program.putListener(ProgramFrames.listenerV4, ifindex: ifindex, id: 0)
        try program.putListener(ProgramFrames.listenerV6, ifindex: ifindex, id: 1)
        try program.putListener(SocketAddress("0.0.0.0:5520")!, ifindex: ifindex, id: 2)
        try program.putListener(SocketAddress("[::]:5520")!, ifindex: ifindex, id: 3)
        // An exact bind and a wildcard on the same port: the exact one wins for its address.
        try program.putListener(SocketAddress("198.18.100.1:5521")!, ifindex: ifindex, id: 4)
        try program.putListener(SocketAddress("0.0.0.0:5521")!, ifindex: ifindex, id: 5)
    }

    deinit {
        program.closeDescriptors()
        _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace])
    }

    /// Runs the program once on `frame` arriving on x1 (or `ifindex`) at `queue`, from a
    /// thread inside the namespace. Returns the action (UInt32.max - errno if the run
    /// failed) and the frame as the program left it.
    func execute(_ frame: [UInt8], ifindex: UInt32? = nil, queue: UInt32 = 0) -> (action: UInt32, output: [UInt8]) {
        let (program, ifindex) = (self.program.program, ifindex ?? self.ifindex)
        return inNetworkNamespace(namespace) {
            var output = [UInt8](repeating: 0, count: 4096)
            let (result, action, size) = Self.testRun(program, frame, ifindex: ifindex, queue: queue, output: &output)
            return result == 0 ? (action, Array(output[0..<size])) : (UInt32.max - UInt32(-result), [])
        } ?? (UInt32.max, [])
    }

    /// One BPF_PROG_TEST_RUN of `frame` arriving on `ifindex` at `queue`, from the calling
    /// thread (which must be in the interface's namespace). Returns libbpf's result (0 or
    /// -errno), the program's action and the output's length in `output`.
    static func testRun(_ program: Int32, _ frame: [UInt8], ifindex: UInt32, queue: UInt32,
                        output: inout [UInt8]) -> (result: Int32, action: UInt32, size: Int) {
        var context = xdp_md()
        context.data_end = UInt32(frame.count)
        context.ingress_ifindex = ifindex
        context.rx_queue_index = queue
        let (result, action, size) = ProgramTestRun.run(program, frame, context: context, output: &output)
        return (result, action, size)
    }

    /// Every stats entry the fixture uses, and the unmatched one.
    var keys: [UInt32] { Array(0...5) + [XDPProgram.unmatched] }

    func snapshot() -> [UInt32: (received: UInt64, bytes: UInt64, verdicts: [XDPVerdict: UInt64])] {
        Dictionary(uniqueKeysWithValues: keys.map { ($0, program.stats(listener: $0)) })
    }

    /// Runs `frame` and checks the action, that the frame passed untouched (unless
    /// redirected), and that entry `key` counted it once as `verdict` with its length, and
    /// nothing else moved.
    func expectVerdict(_ name: String, _ frame: [UInt8], action: UInt32, key: UInt32, _ verdict: XDPVerdict,
                       ifindex: UInt32? = nil, queue: UInt32 = 0, sourceLocation: SourceLocation = #_sourceLocation) {
        let before = snapshot()
        let (result, output) = execute(frame, ifindex: ifindex, queue: queue)
        #expect(result == action, "\(name): action \(result)", sourceLocation: sourceLocation)
        // A redirected frame carries the program's parse in its metadata area, where the test
        // run's output starts: the forwarder's own walk of the frame must give the same.
        let metadataSize = action == Self.redirect ? MemoryLayout<fanout_xdp_meta>.size : 0
        #expect(output.count == frame.count + metadataSize && Array(output.dropFirst(metadataSize)) == frame, "\(name): frame untouched",
                sourceLocation: sourceLocation)
        if metadataSize > 0 {
            var source = sockaddr_storage()
            let walked = frame.withUnsafeBytes { FrameParser.parse($0, source: &source) }
            let expected = walked.map { fanout_xdp_meta(walked: $0, frame: frame) }.map { meta in withUnsafeBytes(of: meta) { Array($0) } }
            #expect(Array(output.prefix(metadataSize)) == expected, "\(name): metadata \(output.prefix(metadataSize)), the walk's \(String(describing: expected))",
                    sourceLocation: sourceLocation)
        }
        let after = snapshot()
        for entry in keys {
            let (old, new) = (before[entry]!, after[entry]!)
            let counted = entry == key
            #expect(new.received == old.received + (counted ? 1 : 0), "\(name): received of entry \(entry)", sourceLocation: sourceLocation)
            #expect(new.bytes == old.bytes + (counted ? UInt64(frame.count) : 0), "\(name): bytes of entry \(entry)", sourceLocation: sourceLocation)
            for each in XDPVerdict.allCases {
                let rise: UInt64 = counted && each == verdict ? 1 : 0
                #expect(new.verdicts[each] == old.verdicts[each]! + rise, "\(name): \(each.label) of entry \(entry)", sourceLocation: sourceLocation)
            }
        }
    }
}

extension fanout_xdp_meta {
    /// What the XDP program writes for a frame it redirects (its own parse, bpf/xdp_steer.bpf.c),
    /// made from the forwarder's walk of the frame (``FrameParser/parse(_:source:)``).
    init(walked parsed: ParsedFrame, frame: [UInt8]) {
        let l3 = parsed.l3Offset
        let ipEnd = parsed.family == AF_INET ? l3 + (Int(frame[l3 + 2]) << 8 | Int(frame[l3 + 3]))
                                             : l3 + 40 + (Int(frame[l3 + 4]) << 8 | Int(frame[l3 + 5]))
        self.init(l3: UInt16(l3), l4: UInt16(parsed.l4Offset), ip_end: UInt16(ipEnd), family: UInt8(parsed.family),
                  hop_limit: parsed.hopLimit, magic: FANOUT_XDP_META_MAGIC)
    }
}

/// The packet fuzz the tc and XDP program tests share: how many packets, a seeded generator, and
/// one round of base packets and their mutations.
enum PacketFuzz {
    static var packetCount: Int {
        if let text = ProcessInfo.processInfo.environment["RELIABILITY_PACKETS"], let count = Int(text), count > 0 { return count }
        return ProcessInfo.processInfo.environment["RELIABILITY"] == "full" ? 1_000_000 : 50_000
    }

    /// SplitMix64: small, fast, and reproducible from the printed seed.
    struct Generator {
        var state: UInt64
        mutating func next() -> UInt64 {
            state &+= 0x9E37_79B9_7F4A_7C15
            var z = state
            z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
            z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
            return z ^ (z >> 31)
        }
        mutating func below(_ bound: Int) -> Int { Int(next() % UInt64(bound)) }
        mutating func byte() -> UInt8 { UInt8(truncatingIfNeeded: next()) }
        mutating func bytes(_ count: Int) -> [UInt8] { (0..<count).map { _ in byte() } }
        mutating func chance(_ percent: Int) -> Bool { below(100) < percent }
    }

    static let listenerPorts: [UInt16] = [5514, 5515, 5516, 5517, 5602]

    /// One round of the fuzz: a base packet, sent as is, truncated at every header offset, with
    /// each header byte replaced, with a few random flips, or as random bytes after a plausible
    /// Ethernet type. Shared by the tc and XDP fuzz tests.
    static func mutate(_ random: inout Generator, _ execute: ([UInt8]) -> Void) {
        let (base, headerEnd) = basePacket(&random)
        switch random.below(10) {
        case 0, 1:
            execute(base)
        case 2, 3:
            // Truncated at every offset of the headers (and a few into the payload).
            for length in Packet.ethernet...min(base.count, headerEnd + 4) { execute(Array(base[0..<length])) }
        case 4, 5, 6:
            // Every header byte replaced by another value, one at a time.
            for offset in 0..<min(base.count, headerEnd) {
                var mutated = base
                mutated[offset] ^= UInt8(1 + random.below(255))
                execute(mutated)
            }
        case 7, 8:
            // A few random flips anywhere in the headers.
            var mutated = base
            for _ in 0..<(1 + random.below(4)) { mutated[random.below(min(base.count, headerEnd))] ^= UInt8(1 << random.below(8)) }
            execute(mutated)
        default:
            // Random bytes after a plausible Ethernet type.
            let types: [[UInt8]] = [[0x08, 0x00], [0x86, 0xdd], [0x81, 0x00], [0x88, 0xa8]]
            execute(Array(base[0..<12]) + types[random.below(types.count)] + random.bytes(40 + random.below(200)))
        }
    }

    /// A valid frame (IPv4 with and without options, IPv6 with extension headers, 802.1Q, QinQ,
    /// fragments, TCP, other ports and addresses, TTL 0/1), and where its headers end
    /// (truncations and byte mutations sweep the headers, not the payload).
    static func basePacket(_ random: inout Generator) -> (frame: [UInt8], headerEnd: Int) {
        let payload = random.bytes(random.chance(80) ? random.below(200) : random.below(1400))
        let port = random.chance(85) ? listenerPorts[random.below(listenerPorts.count)] : UInt16(truncatingIfNeeded: random.next())
        switch random.below(10) {
        case 0, 1, 2:
            let options = random.chance(40) ? Array(random.bytes(4 * (1 + random.below(10)))) : []
            let ttl: UInt8 = random.chance(10) ? UInt8(random.below(2)) : 64
            let vlan: UInt16? = random.chance(20) ? UInt16(random.below(4095)) : nil
            let frame = Packet.ipv4(payload: payload, port: port, ttl: ttl, options: options, vlan: vlan,
                                    zeroChecksum: random.chance(10), protocolNumber: random.chance(90) ? 17 : 6)
            return (frame, Packet.ethernet + (vlan == nil ? 0 : 4) + 20 + options.count + 8)
        case 3, 4:
            return ipv6WithExtensions(payload: payload, port: port, &random)
        case 5:
            // QinQ: an 802.1ad tag around an 802.1Q tag.
            let inner = Packet.ipv4(payload: payload, port: port, vlan: UInt16(random.below(4095)))
            let frame = Array(inner[0..<12]) + [0x88, 0xa8, 0, UInt8(random.below(256))] + Array(inner[12...])
            return (frame, Packet.ethernet + 8 + 28)
        case 6:
            let pieces = Packet.ipv4Fragments(payload: payload + random.bytes(600), id: UInt16(truncatingIfNeeded: random.next()), pieceSize: 8 * (20 + random.below(60)))
            return (pieces[random.below(pieces.count)], Packet.ethernet + 28)
        case 7:
            let pieces = Packet.ipv6Fragments(payload: payload + random.bytes(600), id: UInt32(truncatingIfNeeded: random.next()), pieceSize: 8 * (20 + random.below(60)))
            return (pieces[random.below(pieces.count)], Packet.ethernet + 56)
        case 8:
            // Another destination address, or ARP and other Ethernet types.
            if random.chance(50) {
                var frame = Packet.ipv4(payload: payload, port: port)
                frame[Packet.ethernet + 19] = random.byte()
                return (frame, Packet.ethernet + 28)
            }
            return (Packet.ethernetHeader(type: UInt16(truncatingIfNeeded: random.next())) + payload, Packet.ethernet)
        default:
            return (Packet.ipv6(payload: payload, port: port), Packet.ethernet + 48)
        }
    }

    /// IPv6 with 1 to 5 extension headers (hop-by-hop, routing, destination options, and
    /// maybe a first fragment), each of random length.
    static func ipv6WithExtensions(payload: [UInt8], port: UInt16, _ random: inout Generator) -> (frame: [UInt8], headerEnd: Int) {
        let (source, destination) = (ProgramFrames.clientV6, ProgramFrames.listenerV6.ip.bytes)
        var kinds = (0..<(1 + random.below(5))).map { _ in [UInt8(0), 43, 60][random.below(3)] }
        if random.chance(30) { kinds.append(44) }
        let udp = Packet.udp(source: source, destination: destination, port: port, payload: payload)
        var extensions: [UInt8] = []
        for (index, kind) in kinds.enumerated() {
            let next = index + 1 < kinds.count ? kinds[index + 1] : 17
            if kind == 44 {
                extensions += [next, 0, 0, 0] + random.bytes(4)  // offset 0, no more fragments
            } else {
                let units = random.below(3)
                extensions += [next, UInt8(units)] + [UInt8](repeating: 0, count: 6 + units * 8)
            }
        }
        let frame = Packet.ethernetHeader(type: 0x86dd)
            + Packet.ipv6Header(next: kinds[0], length: extensions.count + udp.count, source: source, destination: destination)
            + extensions + udp
        return (frame, Packet.ethernet + 40 + extensions.count + 8)
    }
}

/// Test frames: Ethernet, optional 802.1Q, IPv4/IPv6, UDP, built and checked with checksums
/// computed here (RFC 1071), not by the code under test.
enum Packet {
    static let ethernet = 14

    static func ethernetHeader(type: UInt16, vlan: UInt16? = nil) -> [UInt8] {
        var frame: [UInt8] = [2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2]
        if let vlan { frame += [0x81, 0x00, UInt8(vlan >> 8), UInt8(vlan & 0xff)] }
        return frame + [UInt8(type >> 8), UInt8(type & 0xff)]
    }

    static func sum(_ bytes: [UInt8], initial: UInt32 = 0) -> UInt32 {
        var total = initial
        var index = 0
        while index + 1 < bytes.count {
            total += UInt32(bytes[index]) << 8 | UInt32(bytes[index + 1])
            index += 2
        }
        if index < bytes.count { total += UInt32(bytes[index]) << 8 }
        return total
    }

    static func fold(_ value: UInt32) -> UInt16 {
        var total = value
        while total >> 16 != 0 { total = (total & 0xffff) + (total >> 16) }
        return UInt16(total)
    }

    static func udpChecksum(source: [UInt8], destination: [UInt8], udp: [UInt8]) -> UInt16 {
        let pseudo = source + destination + (source.count == 4
            ? [0, 17, UInt8(udp.count >> 8), UInt8(udp.count & 0xff)]
            : [0, 0, UInt8(udp.count >> 8), UInt8(udp.count & 0xff), 0, 0, 0, 17])
        let value = ~fold(sum(udp, initial: sum(pseudo)))
        return value == 0 ? 0xffff : value
    }

    static func udpChecksumValid(source: [UInt8], destination: [UInt8], udp: [UInt8]) -> Bool {
        let pseudo = source + destination + (source.count == 4
            ? [0, 17, UInt8(udp.count >> 8), UInt8(udp.count & 0xff)]
            : [0, 0, UInt8(udp.count >> 8), UInt8(udp.count & 0xff), 0, 0, 0, 17])
        return fold(sum(udp, initial: sum(pseudo))) == 0xffff
    }

    static func udp(source: [UInt8], destination: [UInt8], port: UInt16, payload: [UInt8], zeroChecksum: Bool = false) -> [UInt8] {
        let length = 8 + payload.count
        var udp: [UInt8] = [0x9c, 0x40, UInt8(port >> 8), UInt8(port & 0xff), UInt8(length >> 8), UInt8(length & 0xff), 0, 0] + payload
        if !zeroChecksum {
            let checksum = udpChecksum(source: source, destination: destination, udp: udp)
            udp[6] = UInt8(checksum >> 8)
            udp[7] = UInt8(checksum & 0xff)
        }
        return udp
    }

    static func ipv4Header(source: [UInt8], destination: [UInt8], length: Int, protocolNumber: UInt8 = 17, ttl: UInt8 = 64,
                           options: [UInt8] = [], id: UInt16 = 1, fragment: UInt16 = 0) -> [UInt8] {
        let headerLength = 20 + options.count
        let total = headerLength + length
        var header: [UInt8] = [UInt8(0x40 | headerLength / 4), 0, UInt8(total >> 8), UInt8(total & 0xff),
                               UInt8(id >> 8), UInt8(id & 0xff), UInt8(fragment >> 8), UInt8(fragment & 0xff),
                               ttl, protocolNumber, 0, 0] + source + destination + options
        let checksum = ~fold(sum(header))
        header[10] = UInt8(checksum >> 8)
        header[11] = UInt8(checksum & 0xff)
        return header
    }

    static func ipv4(payload: [UInt8], source: [UInt8] = ProgramFrames.clientV4, port: UInt16 = 5514, ttl: UInt8 = 64,
                     options: [UInt8] = [], vlan: UInt16? = nil, zeroChecksum: Bool = false, protocolNumber: UInt8 = 17) -> [UInt8] {
        let destination = ProgramFrames.listenerV4.ip.bytes
        let udp = udp(source: source, destination: destination, port: port, payload: payload, zeroChecksum: zeroChecksum)
        return ethernetHeader(type: 0x0800, vlan: vlan)
            + ipv4Header(source: source, destination: destination, length: udp.count, protocolNumber: protocolNumber, ttl: ttl, options: options)
            + udp
    }

    static func ipv6(payload: [UInt8], port: UInt16 = 5514) -> [UInt8] {
        let (source, destination) = (ProgramFrames.clientV6, ProgramFrames.listenerV6.ip.bytes)
        let udp = udp(source: source, destination: destination, port: port, payload: payload)
        return ethernetHeader(type: 0x86dd) + ipv6Header(next: 17, length: udp.count, source: source, destination: destination) + udp
    }

    static func ipv6Header(next: UInt8, length: Int, source: [UInt8], destination: [UInt8]) -> [UInt8] {
        [0x60, 0, 0, 0, UInt8(length >> 8), UInt8(length & 0xff), next, 64] + source + destination
    }

    /// `whole` cut into pieces of `size` bytes: each piece's offset, its bytes, and whether it is the last.
    static func pieces(_ whole: [UInt8], _ size: Int) -> [(offset: Int, piece: [UInt8], last: Bool)] {
        stride(from: 0, to: whole.count, by: size).map { offset in
            (offset, Array(whole[offset..<min(offset + size, whole.count)]), offset + size >= whole.count)
        }
    }

    /// A UDP datagram cut into IPv4 fragments of `pieceSize` bytes (a multiple of 8).
    static func ipv4Fragments(payload: [UInt8], id: UInt16, pieceSize: Int, port: UInt16 = 5514, ttl: UInt8 = 64) -> [[UInt8]] {
        let (source, destination) = (ProgramFrames.clientV4, ProgramFrames.listenerV4.ip.bytes)
        let whole = udp(source: source, destination: destination, port: port, payload: payload)
        return pieces(whole, pieceSize).map { offset, piece, last in
            let more: UInt16 = last ? 0 : 0x2000
            return ethernetHeader(type: 0x0800)
                + ipv4Header(source: source, destination: destination, length: piece.count, ttl: ttl, id: id, fragment: more | UInt16(offset / 8))
                + piece
        }
    }

    static func ipv6Fragments(payload: [UInt8], id: UInt32, pieceSize: Int) -> [[UInt8]] {
        let (source, destination) = (ProgramFrames.clientV6, ProgramFrames.listenerV6.ip.bytes)
        let whole = udp(source: source, destination: destination, port: 5514, payload: payload)
        return pieces(whole, pieceSize).map { offset, piece, last in
            let more: UInt16 = last ? 0 : 1
            let field = UInt16(offset / 8) << 3 | more
            let fragmentHeader: [UInt8] = [17, 0, UInt8(field >> 8), UInt8(field & 0xff),
                                           UInt8(id >> 24), UInt8((id >> 16) & 0xff), UInt8((id >> 8) & 0xff), UInt8(id & 0xff)]
            return ethernetHeader(type: 0x86dd) + ipv6Header(next: 44, length: 8 + piece.count, source: source, destination: destination)
                + fragmentHeader + piece
        }
    }

    struct Parsed {
        var tagged: Bool
        var l3: Int
        var l4: Int
        var source: [UInt8]
        var destination: [UInt8]
        var hopLimit: UInt8
        var destinationPort: UInt16
        var udpChecksum: UInt16
        var payload: [UInt8]
        var frame: [UInt8]
    }

    static func parse(_ frame: [UInt8]) -> Parsed? {
        guard frame.count >= ethernet else { return nil }
        var l3 = ethernet
        var type = UInt16(frame[12]) << 8 | UInt16(frame[13])
        let tagged = type == 0x8100
        if tagged {
            type = UInt16(frame[16]) << 8 | UInt16(frame[17])
            l3 += 4
        }
        let l4: Int, source: [UInt8], destination: [UInt8], hops: UInt8
        if type == 0x0800 {
            guard frame.count >= l3 + 20 else { return nil }
            l4 = l3 + Int(frame[l3] & 0x0f) * 4
            (source, destination, hops) = (Array(frame[(l3 + 12)..<(l3 + 16)]), Array(frame[(l3 + 16)..<(l3 + 20)]), frame[l3 + 8])
        } else if type == 0x86dd {
            guard frame.count >= l3 + 40 else { return nil }
            l4 = l3 + 40 + (frame[l3 + 6] == 44 ? 8 : 0)
            (source, destination, hops) = (Array(frame[(l3 + 8)..<(l3 + 24)]), Array(frame[(l3 + 24)..<(l3 + 40)]), frame[l3 + 7])
        } else {
            return nil
        }
        guard frame.count >= l4 + 8 else { return nil }
        return Parsed(tagged: tagged, l3: l3, l4: l4, source: source, destination: destination, hopLimit: hops,
                      destinationPort: UInt16(frame[l4 + 2]) << 8 | UInt16(frame[l4 + 3]),
                      udpChecksum: UInt16(frame[l4 + 6]) << 8 | UInt16(frame[l4 + 7]),
                      payload: Array(frame[(l4 + 8)...]), frame: frame)
    }

    static func ipv4HeaderValid(_ packet: Parsed) -> Bool {
        fold(sum(Array(packet.frame[packet.l3..<packet.l4]))) == 0xffff
    }

    static func udpChecksumValid(_ packet: Parsed) -> Bool {
        udpChecksumValid(source: packet.source, destination: packet.destination, udp: Array(packet.frame[packet.l4...]))
    }
}

/// A minimal AF_XDP socket for the tests (copy mode, no packets read): a UMEM of 16 frames,
/// fill, completion and RX rings, bound to one queue: enough for the XSKMAP to accept it.
/// Built from the uapi (linux/if_xdp.h) by hand so the test needs no libxdp.
enum TestXSK {
    static let afXDP: Int32 = 44, solXDP: Int32 = 283
    static let rxRing: Int32 = 2, umemReg: Int32 = 4, fillRing: Int32 = 5, completionRing: Int32 = 6
    static let copyMode: UInt16 = 1 << 1

    /// The socket's descriptor, or the failing call. Call on a thread in the interface's namespace.
    static func open(interface: String, queue: UInt32) -> Result<Int32, SystemCallError> {
        let fd = socket(afXDP, Int32(SOCK_RAW.rawValue), 0)
        guard fd >= 0 else { return .failure(SystemCallError(call: "socket AF_XDP", errno: errno)) }
        func fail(_ call: String) -> Result<Int32, SystemCallError> {
            let error = errno
            close(fd)
            return .failure(SystemCallError(call: call, errno: error))
        }
        let size = 16 * 4096
        // The UMEM stays mapped for the process's life: the socket holds it until closed.
        guard let area = mmap(nil, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0), area != MAP_FAILED else {
            return fail("mmap UMEM")
        }
        // struct xdp_umem_reg: addr, len (u64), chunk_size, headroom, flags, tx_metadata_len (u32).
        var registration: (UInt64, UInt64, UInt32, UInt32, UInt32, UInt32) = (UInt64(UInt(bitPattern: area)), UInt64(size), 4096, 0, 0, 0)
        guard setsockopt(fd, solXDP, umemReg, &registration, socklen_t(MemoryLayout.size(ofValue: registration))) == 0 else { return fail("XDP_UMEM_REG") }
        var entries: Int32 = 16
        for option in [fillRing, completionRing, rxRing] {
            guard setsockopt(fd, solXDP, option, &entries, 4) == 0 else { return fail("setsockopt SOL_XDP \(option)") }
        }
        // struct sockaddr_xdp: family, flags (u16), ifindex, queue_id, shared_umem_fd (u32).
        var address: (UInt16, UInt16, UInt32, UInt32, UInt32) = (UInt16(afXDP), copyMode, if_nametoindex(interface), queue, 0)
        let addressLength = socklen_t(MemoryLayout.size(ofValue: address))
        let bound = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, addressLength) }
        }
        guard bound == 0 else { return fail("bind AF_XDP \(interface) queue \(queue)") }
        return .success(fd)
    }
}
