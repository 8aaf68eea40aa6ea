// SPDX-License-Identifier: Apache-2.0
import CLibBPF
import BPFSupport
import CSystemShim
import Foundation
import Testing
import ReusePortLB
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// Two namespaces joined by a veth pair with two RX and two TX queues on each end:
///
///     listener namespace: xa<suffix> 198.18.0.1 ── 198.18.0.2 xb<suffix> :peer namespace
///
/// AF_XDP sockets bind to the listener end; the peer sends. Neighbours are permanent, so no
/// ARP has to cross the XDP program. `destroy()` (also deinit) deletes both namespaces, and
/// with them the veths and any XDP program on them.
final class XSKVethPair {
    let suffix = String(UInt32.random(in: 0...UInt32.max), radix: 16)
    let listener: String
    let peer: String
    let listenerInterface: String
    let peerInterface: String
    private var destroyed = false
    static let ip = "/usr/sbin/ip"

    init() throws {
        listener = "xsk-l-\(suffix)"
        peer = "xsk-p-\(suffix)"
        listenerInterface = "xa\(suffix)"
        peerInterface = "xb\(suffix)"
        for namespace in [listener, peer] {
            try Self.ip(["netns", "add", namespace])
            try Self.ip(["-n", namespace, "link", "set", "lo", "up"])
            // No IPv6 on the link: its neighbour discovery and MLD frames would reach the sockets too.
            for setting in ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"] {
                let result = try run("/usr/bin/nsenter", ["--net=/run/netns/\(namespace)", "--", "/usr/sbin/sysctl", "-q", "-w", setting])
                try #require(result.status == 0, "sysctl \(setting): \(result.output)")
            }
        }
        try Self.ip(["link", "add", listenerInterface, "numtxqueues", "2", "numrxqueues", "2", "netns", listener, "type", "veth",
                     "peer", "name", peerInterface, "numtxqueues", "2", "numrxqueues", "2", "netns", peer])
        try Self.ip(["-n", listener, "addr", "add", "198.18.0.1/24", "dev", listenerInterface])
        try Self.ip(["-n", peer, "addr", "add", "198.18.0.2/24", "dev", peerInterface])
        for (namespace, name) in [(listener, listenerInterface), (peer, peerInterface)] {
            try Self.ip(["-n", namespace, "link", "set", name, "up"])
        }
        let listenerMAC = try mac(listener, listenerInterface), peerMAC = try mac(peer, peerInterface)
        try Self.ip(["-n", listener, "neigh", "replace", "198.18.0.2", "lladdr", peerMAC, "dev", listenerInterface, "nud", "permanent"])
        try Self.ip(["-n", peer, "neigh", "replace", "198.18.0.1", "lladdr", listenerMAC, "dev", peerInterface, "nud", "permanent"])
    }

    deinit { destroy() }

    func destroy() {
        guard !destroyed else { return }
        destroyed = true
        for namespace in [listener, peer] { _ = try? run(Self.ip, ["netns", "delete", namespace]) }
    }

    private func mac(_ namespace: String, _ name: String) throws -> String {
        let result = try run(Self.ip, ["-n", namespace, "-j", "link", "show", name])
        let links = try #require(try JSONSerialization.jsonObject(with: Data(result.output.utf8)) as? [[String: Any]])
        return try #require(links.first?["address"] as? String)
    }

    static func ip(_ arguments: [String]) throws {
        let result = try run(ip, arguments)
        try #require(result.status == 0, "ip \(arguments.joined(separator: " ")): \(result.output)")
    }
}

/// The smallest XDP program that hands every frame to the AF_XDP socket of its RX queue:
/// `bpf_redirect_map(&xsks, ctx->rx_queue_index, XDP_PASS)`, from raw instructions (the real
/// program is another part's), attached in driver mode to the listener's veth end.
final class XSKRedirectProgram: Sendable {
    let map: Int32
    let program: Int32

    init(queues: UInt32) throws {
        map = bpf_map_create(BPF_MAP_TYPE_XSKMAP, "xsk_test", 4, 4, queues, nil)
        try #require(map >= 0, "bpf_map_create XSKMAP: errno \(errno)")
        var code: [UInt8] = []
        func insn(_ op: UInt8, dst: UInt8 = 0, src: UInt8 = 0, off: Int16 = 0, imm: Int32 = 0) {
            code += [op, dst | src << 4]
            withUnsafeBytes(of: off.littleEndian) { code += $0 }
            withUnsafeBytes(of: imm.littleEndian) { code += $0 }
        }
        insn(0x61, dst: 2, src: 1, off: 16)          // r2 = *(u32 *)(r1 + offsetof(struct xdp_md, rx_queue_index))
        insn(0x18, dst: 1, src: 1, imm: map)         // r1 = xsks (ld_imm64, BPF_PSEUDO_MAP_FD)
        insn(0)
        insn(0xb7, dst: 3, imm: 2)                   // r3 = XDP_PASS (when the queue has no socket)
        insn(0x85, imm: 51)                          // call bpf_redirect_map
        insn(0x95)                                   // exit
        let count = code.count / 8
        program = code.withUnsafeBytes { raw in
            bpf_prog_load(BPF_PROG_TYPE_XDP, "xsk_test", "GPL", raw.baseAddress!.assumingMemoryBound(to: bpf_insn.self), count, nil)
        }
        try #require(program >= 0, "bpf_prog_load: errno \(errno)")
    }

    deinit {
        close(program)
        close(map)
    }

    /// Attaches in driver mode (veth runs native XDP per RX queue, so rx_queue_index is the
    /// queue); run on a thread inside the interface's namespace. nil or the failure.
    func attach(interface: String) -> String? {
        let index = Int32(if_nametoindex(interface))
        guard index > 0 else { return "if_nametoindex \(interface): errno \(errno)" }
        let driverMode: UInt32 = 1 << 2  // XDP_FLAGS_DRV_MODE (linux/if_link.h, which CLibBPF does not include)
        let result = bpf_xdp_attach(index, program, driverMode, nil)
        return result == 0 ? nil : "bpf_xdp_attach: \(result)"
    }

    func insert(_ socket: XSKSocket) throws {
        var key = socket.queue
        var value = socket.fd
        try #require(bpf_map_update_elem(map, &key, &value, 0) == 0, "bpf_map_update_elem xsks[\(key)]: errno \(errno)")
    }
}

/// A socket made where it must be (the interface's namespace), or the error it gave.
func makeSocket(_ pair: XSKVethPair, queue: UInt32, _ config: XSKConfig, interface: String? = nil) -> Result<XSKSocket, XSKError> {
    let name = interface ?? pair.listenerInterface
    return inNetworkNamespace(pair.listener) {
        Result { () throws(XSKError) -> XSKSocket in try XSKSocket(interface: name, queue: queue, config: config) }
    } ?? .failure(.invalidConfig("could not enter namespace \(pair.listener)"))
}

@Suite("af_xdp: AF_XDP sockets, RX queues and UMEM frames on a 2-queue veth", .serialized,
       .enabled(if: Privileges.enabled, Privileges.reason))
struct XSKSocketTests {
    static let small = XSKConfig(frameSize: 4096, frameCount: 128, ringSize: 64, zeroCopy: .auto, busyPoll: false, batchSize: 16)

    @Test("RX queues: 2 on the 2-queue veth (ETHTOOL_GCHANNELS), 1 on lo and on a bridge only the namespace has (rtnetlink fallback), a missing interface is a named error")
    func queueCount() throws {
        let pair = try XSKVethPair()
        defer { pair.destroy() }
        let counted = inNetworkNamespace(pair.listener) { [name = pair.listenerInterface] in
            Result { () throws(XSKError) -> Int in try RXQueues.count(interface: name) }
        }
        #expect(try counted?.get() == 2)
        #expect(try RXQueues.count(interface: "lo") == 1)
        // No ethtool channels, and not in the namespace /sys was mounted from: sysfs would not see it.
        let result = try run("/usr/sbin/ip", ["-n", pair.listener, "link", "add", "qb\(pair.suffix.prefix(8))", "type", "bridge"])
        try #require(result.status == 0, "\(result.output)")
        let bridge = inNetworkNamespace(pair.listener) { [name = "qb\(pair.suffix.prefix(8))"] in
            Result { () throws(XSKError) -> Int in try RXQueues.count(interface: name) }
        }
        #expect(try bridge?.get() == 1)
        let missing = #expect(throws: XSKError.self) { try RXQueues.count(interface: "nx\(pair.suffix)") }
        #expect(missing?.description.contains("no such interface") == true && missing?.description.contains("nx\(pair.suffix)") == true,
                "\(String(describing: missing))")
    }

    @Test("Sockets bind to queue 0 and 1 in copy mode; zero-copy on veth, a taken queue and queue 5 fail with the fix named")
    func binding() throws {
        let pair = try XSKVethPair()
        defer { pair.destroy() }
        var forced = Self.small
        forced.zeroCopy = .on
        let zeroCopy = makeSocket(pair, queue: 0, forced)
        #expect(throws: XSKError.self) { try zeroCopy.get() }
        if case .failure(let error) = zeroCopy {
            #expect(error.description.contains("xsk_socket__create failed") && error.description.contains("errno \(EOPNOTSUPP)"), "\(error)")
            #expect(error.description.contains("zero-copy") && error.description.contains("settings.zero_copy: auto"), "\(error)")
        }
        // The failed attempt released its UMEM and queue: both queues bind now.
        let first = try makeSocket(pair, queue: 0, Self.small).get()
        let second = try makeSocket(pair, queue: 1, Self.small).get()
        defer { first.close(); second.close() }
        #expect(first.queue == 0 && second.queue == 1 && first.fd != second.fd)
        #expect(!first.zeroCopyInUse && !second.zeroCopyInUse, "veth has no zero-copy: auto fell back to copy mode")
        #expect(first.needWakeup)

        let taken = makeSocket(pair, queue: 0, Self.small)
        if case .failure(let error) = taken {
            #expect(error.description.contains("errno \(EBUSY)") && error.description.contains("another AF_XDP socket is bound"), "\(error)")
        } else {
            Issue.record("a second socket on queue 0 was accepted")
        }
        let outOfRange = makeSocket(pair, queue: 5, Self.small)
        if case .failure(let error) = outOfRange {
            #expect(error.description.contains("\(pair.listenerInterface) has 2 RX queues (0...1)"), "\(error)")
        } else {
            Issue.record("queue 5 of 2 was accepted")
        }
        var invalid = Self.small
        invalid.ringSize = 100
        #expect(throws: XSKError.invalidConfig("ring size 100: must be a power of two from 64 to 32768")) {
            try makeSocket(pair, queue: 1, invalid).get()
        }

        // Busy polling: the options are set on the socket. Queue 1 was just closed, and the
        // kernel frees it in deferred work: binding again right away must wait for it, not fail.
        second.close()
        var busy = Self.small
        busy.busyPoll = true
        let polled = try makeSocket(pair, queue: 1, busy).get()
        defer { polled.close() }
        var value: Int32 = 0
        var length = socklen_t(4)
        #expect(getsockopt(polled.fd, SOL_SOCKET, SO_BUSY_POLL, &value, &length) == 0 && value == 20)
        // SO_BUSY_POLL_BUDGET cannot be read back (no getsockopt case); the socket exists, so it was set.
        #expect(getsockopt(polled.fd, SOL_SOCKET, SO_PREFER_BUSY_POLL, &value, &length) == 0 && value == 1)
    }

    static func address(_ text: String, _ port: UInt16) -> sockaddr_in {
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = port.bigEndian
        _ = inet_pton(AF_INET, text, &address.sin_addr)
        return address
    }

    /// The 2-queue veth pair with a socket on each queue and the program redirecting to them attached.
    static func redirecting() throws -> (XSKVethPair, XSKRedirectProgram, [XSKSocket]) {
        let pair = try XSKVethPair()
        do {
            let program = try XSKRedirectProgram(queues: 2)
            let sockets = [try makeSocket(pair, queue: 0, small).get(), try makeSocket(pair, queue: 1, small).get()]
            for socket in sockets { try program.insert(socket) }
            let attached = inNetworkNamespace(pair.listener) { [name = pair.listenerInterface] in program.attach(interface: name) }
            guard attached == .some(nil) else {
                sockets.forEach { $0.close() }
                throw XSKError.invalidConfig("the redirect program did not attach: \(String(describing: attached))")
            }
            return (pair, program, sockets)
        } catch {
            pair.destroy()
            throw error
        }
    }

    @Test("End to end: datagrams from 16 source ports arrive on both queues, parse and match; 640 receive/recycle cycles leak no frame; frames held past the fill ring wait on the free list; a frame rewritten in UMEM and transmitted reaches the peer")
    func endToEnd() throws {
        let (pair, program, sockets) = try Self.redirecting()
        defer {
            sockets.forEach { $0.close() }
            pair.destroy()
        }
        _ = program

        // Senders in the peer namespace, each on its own source port (the flow hash picks the veth queue).
        let senders: [Int32] = inNetworkNamespace(pair.peer) {
            (0..<16).map { _ in
                let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
                var local = XSKSocketTests.address("198.18.0.2", 0)
                let bound = withUnsafePointer(to: &local) {
                    $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
                }
                return bound == 0 ? fd : -1
            }
        } ?? []
        defer { senders.forEach { _ = close($0) } }
        try #require(senders.count == 16 && senders.allSatisfy { $0 >= 0 })
        let ports: [UInt16] = senders.map { fd in
            var local = sockaddr_in()
            var length = socklen_t(MemoryLayout<sockaddr_in>.size)
            _ = withUnsafeMutablePointer(to: &local) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &length) }
            }
            return UInt16(bigEndian: local.sin_port)
        }
        var destination = Self.address("198.18.0.1", 9999)
        func send(_ fd: Int32, _ text: String) -> Bool {
            let bytes = Array(text.utf8)
            return withUnsafePointer(to: &destination) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                    sendto(fd, bytes, bytes.count, 0, $0, socklen_t(MemoryLayout<sockaddr_in>.size))
                }
            } == bytes.count
        }

        var buffer = [XSKFrame](repeating: XSKFrame(address: 0, length: 0), count: 16)
        var perQueue = [0, 0]
        var notUDP = 0
        /// Receives until `pending` (payload -> source port) is empty or 3 s passed; each frame
        /// is checked, then handed to `keep` (which may keep it: returns true) or recycled.
        func collect(_ pending: inout [String: UInt16], keep: (Int, XSKFrame, ParsedFrame) -> Bool = { _, _, _ in false }) {
            let deadline = Date().addingTimeInterval(3)
            while !pending.isEmpty, Date() < deadline {
                for (queue, socket) in sockets.enumerated() {
                    let count = buffer.withUnsafeMutableBufferPointer { socket.receive(into: $0) }
                    var recycled: [XSKFrame] = []
                    for frame in buffer[0..<count] {
                        let bytes = UnsafeRawBufferPointer(socket.bytes(frame))
                        var source = sockaddr_storage()
                        guard let parsed = FrameParser.parse(bytes, source: &source) else {
                            notUDP += 1
                            recycled.append(frame)
                            continue
                        }
                        let payload = String(decoding: bytes[parsed.payloadOffset..<(parsed.payloadOffset + parsed.payloadLength)], as: UTF8.self)
                        let sender = withUnsafeBytes(of: &source) { $0.load(as: sockaddr_in.self) }
                        #expect(pending[payload] == UInt16(bigEndian: sender.sin_port), "unexpected or repeated datagram \(payload)")
                        #expect(parsed.family == AF_INET && parsed.destinationPort == 9999 && parsed.vlanTags == 0)
                        #expect(parsed.destinationAddress.0 == Self.address("198.18.0.1", 0).sin_addr.s_addr)
                        #expect(sender.sin_addr.s_addr == Self.address("198.18.0.2", 0).sin_addr.s_addr)
                        pending[payload] = nil
                        perQueue[queue] += 1
                        if !keep(queue, frame, parsed) { recycled.append(frame) }
                    }
                    recycled.withUnsafeBufferPointer { socket.recycle($0) }
                }
                if !pending.isEmpty { for socket in sockets { _ = socket.wait(milliseconds: 1) } }
            }
        }

        for round in 0..<40 {
            var pending: [String: UInt16] = [:]
            for (index, fd) in senders.enumerated() {
                let text = "xsk round \(round) sender \(index)"
                try #require(send(fd, text), "sendto: errno \(errno)")
                pending[text] = ports[index]
            }
            collect(&pending)
            try #require(pending.isEmpty, "round \(round): never received \(pending.keys.sorted())")
        }
        #expect(perQueue[0] > 0 && perQueue[1] > 0, "both queues used: \(perQueue)")
        #expect(perQueue[0] + perQueue[1] == 640 && perQueue.max()! > Int(Self.small.frameCount), "\(perQueue)")
        #expect(notUDP == 0, "only the test's datagrams reach the sockets")
        #expect(sockets.allSatisfy { $0.fillRingFull == 0 }, "recycling one receive's frames always finds room")

        // Frames held over three rounds, then recycled at once: the fill ring (kept at ring size
        // minus one batch = 48 by receive) takes 16, the rest wait on the free list, counted.
        var held: [[XSKFrame]] = [[], []]
        for round in 0..<3 {
            var pending: [String: UInt16] = [:]
            for (index, fd) in senders.enumerated() {
                let text = "xsk held \(round) sender \(index)"
                try #require(send(fd, text), "sendto: errno \(errno)")
                pending[text] = ports[index]
            }
            collect(&pending) { queue, frame, _ in
                held[queue].append(frame)
                return true
            }
            try #require(pending.isEmpty, "held round \(round): never received \(pending.keys.sorted())")
        }
        for (queue, socket) in sockets.enumerated() {
            held[queue].withUnsafeBufferPointer { socket.recycle($0) }
            #expect(socket.fillRingFull == UInt64(max(0, held[queue].count - 16)), "queue \(queue): \(held[queue].count) held")
        }

        // TX: reflect one datagram to its sender, rewritten in place (MACs, addresses, ports swapped).
        var reflected: (queue: Int, frame: XSKFrame)?
        var pending = ["reflect me": ports[3]]
        try #require(send(senders[3], "reflect me"))
        collect(&pending) { queue, frame, parsed in
            let bytes = sockets[queue].bytes(frame)
            func swap(_ a: Int, _ b: Int, _ count: Int) {
                for offset in 0..<count { bytes.swapAt(a + offset, b + offset) }
            }
            swap(0, 6, 6)
            swap(parsed.l3Offset + 12, parsed.l3Offset + 16, 4)
            swap(parsed.l4Offset, parsed.l4Offset + 2, 2)
            // The peer's socket left the UDP checksum to offload (CHECKSUM_PARTIAL), and a veth
            // never completes it: the frame holds only the pseudo-header sum. Computed here in
            // full, as any forwarder sending a received frame on must.
            let udp = Array(bytes[parsed.l4Offset..<(parsed.payloadOffset + parsed.payloadLength)])
            var zeroed = udp
            zeroed[6] = 0
            zeroed[7] = 0
            let checksum = Packet.udpChecksum(source: Array(bytes[(parsed.l3Offset + 12)..<(parsed.l3Offset + 16)]),
                                              destination: Array(bytes[(parsed.l3Offset + 16)..<(parsed.l3Offset + 20)]), udp: zeroed)
            bytes[parsed.l4Offset + 6] = UInt8(checksum >> 8)
            bytes[parsed.l4Offset + 7] = UInt8(checksum & 0xff)
            reflected = (queue, frame)
            return true
        }
        let (queue, frame) = try #require(reflected)
        #expect([frame].withUnsafeBufferPointer { sockets[queue].transmit($0) } == 1)
        var reply = pollfd(fd: senders[3], events: Int16(POLLIN), revents: 0)
        try #require(poll(&reply, 1, 3000) == 1, "the transmitted frame never reached the peer: \(sockets[queue].statistics()), kick failures \(sockets[queue].transmitKickFailures), \((try? run("/usr/bin/nsenter", ["--net=/run/netns/\(pair.peer)", "--", "nstat", "-az", "UdpInCsumErrors", "UdpInErrors", "IpInReceives"]).output) ?? "")")
        var answer = [UInt8](repeating: 0, count: 64)
        let length = recv(senders[3], &answer, answer.count, Int32(MSG_DONTWAIT))
        #expect(length > 0 && String(decoding: answer.prefix(max(length, 0)), as: UTF8.self) == "reflect me")

        // Every frame accounted for: the transmitted one came back through the completion ring.
        let deadline = Date().addingTimeInterval(3)
        while sockets[queue].frameInventory().transmitting > 0, Date() < deadline {
            _ = buffer.withUnsafeMutableBufferPointer { sockets[queue].receive(into: $0) }
            usleep(1000)
        }
        for socket in sockets {
            let inventory = socket.frameInventory()
            let frames = inventory.free + inventory.fill
            #expect(inventory.rxRing == 0 && inventory.transmitting == 0, "queue \(socket.queue): \(inventory.rxRing) on RX, \(inventory.transmitting) on TX")
            #expect(frames.count == Int(Self.small.frameCount) && Set(frames).count == frames.count, "queue \(socket.queue): \(frames.count) frames")
            #expect(frames.allSatisfy { $0 % 4096 == 0 && $0 < 128 * 4096 })
            let statistics = socket.statistics()
            #expect(statistics.rxInvalidDescriptors == 0 && statistics.txInvalidDescriptors == 0 && statistics.rxDropped == 0
                    && statistics.rxRingFull == 0, "\(statistics)")
        }
        #expect(sockets[0].rxRingEmpty + sockets[1].rxRingEmpty > 0)
    }
}

extension XSKSocketTests {
    @Test("Taken over after a crash: a socket and its UMEM memfd handed on (as the service manager's store does) are mapped again; what the RX ring held is received whole from the same frames, given-back frames stay off the fill ring, and closing the copy leaves the original working; a memfd that is not a UMEM is refused")
    func adoption() throws {
        let (pair, program, sockets) = try Self.redirecting()
        defer {
            sockets.forEach { $0.close() }
            pair.destroy()
        }
        _ = program
        #expect(UMEMHeader.read(sockets[0].umemFD) == UMEMHeader(frameSize: 4096, frameCount: 128, ringSize: 64))

        // 24 datagrams, left on the RX rings (nobody receives: the process "crashed").
        let sent: [String] = inNetworkNamespace(pair.peer) {
            (0..<24).compactMap { index -> String? in
                let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
                defer { close(fd) }
                var destination = XSKSocketTests.address("198.18.0.1", 9999)
                let text = "left on the ring \(index)"
                let bytes = Array(text.utf8)
                let written = withUnsafePointer(to: &destination) {
                    $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { sendto(fd, bytes, bytes.count, 0, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
                }
                return written == bytes.count ? text : nil
            }
        } ?? []
        try #require(sent.count == 24)
        let deadline = Date().addingTimeInterval(3)
        while sockets.map(\.rxRingLevel).reduce(0, +) < 24, Date() < deadline { usleep(1000) }
        try #require(sockets.map(\.rxRingLevel).reduce(0, +) == 24, "on the RX rings: \(sockets.map(\.rxRingLevel))")

        var received: [String] = []
        for socket in sockets {
            let level = socket.rxRingLevel
            let fill = socket.frameInventory().fill.count
            let adopted = try XSKSocket(adopting: dup(socket.fd), umem: dup(socket.umemFD), interface: pair.listenerInterface, queue: socket.queue)
            #expect(adopted.drainOnly && adopted.config.frameCount == 128 && adopted.config.ringSize == 64 && adopted.rxRingLevel == level)
            var buffer = [XSKFrame](repeating: XSKFrame(address: 0, length: 0), count: 64)
            let count = buffer.withUnsafeMutableBufferPointer { adopted.receive(into: $0) }
            #expect(count == level)
            for frame in buffer[0..<count] {
                let bytes = UnsafeRawBufferPointer(adopted.bytes(frame))
                var source = sockaddr_storage()
                let parsed = try #require(FrameParser.parse(bytes, source: &source))
                received.append(String(decoding: bytes[parsed.payloadOffset..<(parsed.payloadOffset + parsed.payloadLength)], as: UTF8.self))
            }
            buffer[0..<count].withUnsafeBufferPointer { adopted.recycle($0) }
            let inventory = adopted.frameInventory()
            #expect(inventory.free.count == count && inventory.fill.count == fill, "given back to the free list only: \(inventory.free.count) free, \(inventory.fill.count) on the fill ring (was \(fill))")
            adopted.close()
            #expect(fcntl(socket.fd, F_GETFD) >= 0 && socket.rxRingLevel == 0, "the original's descriptor is open and its ring was read out")
        }
        #expect(received.sorted() == sent.sorted(), "every datagram left on the rings, once: \(received.count)")

        let junk = shim_memfd("junk")
        defer { close(junk) }
        #expect(ftruncate(junk, 8192) == 0)
        // Refused without taking the descriptors: the caller closes them.
        let (socketCopy, junkCopy) = (dup(sockets[0].fd), dup(junk))
        #expect(throws: XSKError.self) { try XSKSocket(adopting: socketCopy, umem: junkCopy, interface: pair.listenerInterface, queue: 0) }
        #expect(fcntl(socketCopy, F_GETFD) >= 0 && fcntl(junkCopy, F_GETFD) >= 0)
        close(socketCopy)
        close(junkCopy)
    }
}

@Suite("af_xdp: locked memory for UMEMs")
struct MemoryLockTests {
    static let mib = 1 << 20
    static let unlimited = MemoryLock.unlimited

    @Test("The plan raises the soft limit to the hard one, the hard one only when privileged, and nothing when exempt")
    func plan() {
        #expect(MemoryLock.plan(needed: 16 * Self.mib, soft: 8 * UInt64(Self.mib), hard: 8 * UInt64(Self.mib), exempt: true, canRaiseHard: false) == .enough)
        #expect(MemoryLock.plan(needed: 16 * Self.mib, soft: Self.unlimited, hard: Self.unlimited, exempt: false, canRaiseHard: false) == .enough)
        #expect(MemoryLock.plan(needed: 16 * Self.mib, soft: 16 * UInt64(Self.mib), hard: 16 * UInt64(Self.mib), exempt: false, canRaiseHard: false) == .enough)
        #expect(MemoryLock.plan(needed: 16 * Self.mib, soft: 8 * UInt64(Self.mib), hard: Self.unlimited, exempt: false, canRaiseHard: false)
            == .raise(soft: 16 * UInt64(Self.mib), hard: Self.unlimited))
        #expect(MemoryLock.plan(needed: 16 * Self.mib, soft: 8 * UInt64(Self.mib), hard: 8 * UInt64(Self.mib), exempt: false, canRaiseHard: true)
            == .raise(soft: 16 * UInt64(Self.mib), hard: 16 * UInt64(Self.mib)))
        #expect(MemoryLock.plan(needed: 16 * Self.mib, soft: 8 * UInt64(Self.mib), hard: 8 * UInt64(Self.mib), exempt: false, canRaiseHard: false)
            == .impossible)
    }

    @Test("The error names the limits and every fix")
    func message() {
        let text = XSKError.memoryLock(needed: 16 * Self.mib, soft: 8 * UInt64(Self.mib), hard: 8 * UInt64(Self.mib), errno: 0).description
        for part in ["RLIMIT_MEMLOCK is 8388608 bytes (hard 8388608 bytes)", "16777216 bytes", "CAP_IPC_LOCK", "LimitMEMLOCK=infinity",
                     "ulimit -l", "settings.umem_frames"] {
            #expect(text.contains(part), "\(part) missing from: \(text)")
        }
    }

    @Test("ensure raises the soft limit up to the hard one, the hard one only when allowed, else names the fix",
          .enabled(if: Privileges.enabled, Privileges.reason))
    func raisesLimits() throws {
        let resource = Int32(__RLIMIT_MEMLOCK.rawValue)
        var saved = rlimit()
        try #require(getrlimit(resource, &saved) == 0)
        defer { _ = setrlimit(resource, &saved) }
        // Only the soft limit is lowered: raising a hard limit back needs CAP_SYS_RESOURCE, which
        // root in a container may lack.
        let hard = saved.rlim_max
        try #require(hard == MemoryLock.unlimited || hard >= rlim_t(2 * Self.mib), "hard RLIMIT_MEMLOCK \(hard) is below 2 MiB")
        var low = rlimit(rlim_cur: rlim_t(Self.mib), rlim_max: hard)
        try #require(setrlimit(resource, &low) == 0)
        func current() -> (soft: UInt64, hard: UInt64) {
            var now = rlimit()
            _ = getrlimit(resource, &now)
            return (UInt64(now.rlim_cur), UInt64(now.rlim_max))
        }
        try MemoryLock.ensure(bytes: 2 * Self.mib, exempt: false, canRaiseHard: false)
        #expect(current() == (UInt64(2 * Self.mib), UInt64(hard)))
        guard hard != MemoryLock.unlimited else { return }
        let beyond = Int(hard) + Self.mib
        let refused = #expect(throws: XSKError.self) { try MemoryLock.ensure(bytes: beyond, exempt: false, canRaiseHard: false) }
        #expect(refused == .memoryLock(needed: beyond, soft: UInt64(2 * Self.mib), hard: UInt64(hard), errno: 0))
        #expect(refused?.description.contains("RLIMIT_MEMLOCK is 2097152 bytes (hard \(hard) bytes)") == true, "\(String(describing: refused))")
        try MemoryLock.ensure(bytes: beyond, exempt: true, canRaiseHard: false)
        #expect(current() == (UInt64(2 * Self.mib), UInt64(hard)), "exempt from the charge (CAP_IPC_LOCK): left alone")
        if Capabilities.current().has(MemoryLock.capSysResource) {
            try MemoryLock.ensure(bytes: beyond, exempt: false, canRaiseHard: true)
            #expect(current() == (UInt64(beyond), UInt64(beyond)))
        } else {
            // setrlimit refuses to raise the hard limit: its errno is in the message.
            let failed = #expect(throws: XSKError.self) { try MemoryLock.ensure(bytes: beyond, exempt: false, canRaiseHard: true) }
            #expect(failed?.description.contains("setrlimit failed: Operation not permitted (errno \(EPERM))") == true, "\(String(describing: failed))")
        }
    }
}
