// SPDX-License-Identifier: Apache-2.0
import Foundation
import ReusePortLB
import Synchronization
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// `udp-fanout capture`'s parts: the pcapng blocks, the packets made from what a socket saw, the
/// request's parsing, and the per-listener capture (filter, sampling, count, sessions).
@Suite("capture of drops: pcapng, sampling, sessions")
struct CaptureTests {
    static func payload(_ text: String) -> [UInt8] { Array(text.utf8) }

    static func synthetic(_ text: String, from: String, to: String, length: Int? = nil) -> (bytes: [UInt8], length: Int) {
        let bytes = payload(text)
        return bytes.withUnsafeBytes {
            SyntheticPacket.make(payload: $0, payloadLength: length ?? bytes.count, from: SocketAddress(from)!, to: SocketAddress(to)!)
        }
    }

    @Test("the blocks: a reader of the stream finds whole blocks, the packets among them and the statistics' comment; a cut block waits; what is not pcapng is refused")
    func blocks() {
        let header = Pcapng.header(linkType: Pcapng.linkTypeRaw, snaplen: 2048, listener: "dns")
        let packet = Pcapng.packet(nanoseconds: 1_700_000_000_123_456_789, data: [0x45, 0, 0, 20], originalLength: 20, comment: "rate_limited", inbound: true)
        let statistics = Pcapng.statistics(nanoseconds: 1_700_000_001_000_000_000, lost: 2, comment: "3 captured, 2 lost")
        let stream = header + packet + packet + statistics
        #expect(header.count % 4 == 0 && packet.count % 4 == 0 && statistics.count % 4 == 0)
        let whole = Pcapng.wholeBlocks(stream[...])
        #expect(whole?.end == stream.count && whole?.packets == 2 && whole?.statistics == "3 captured, 2 lost")
        // Cut in the second packet: up to the first one's end, which the reader keeps writing from.
        let cut = Pcapng.wholeBlocks(stream[..<(header.count + packet.count + 7)])
        #expect(cut?.end == header.count + packet.count && cut?.packets == 1 && cut?.statistics == nil)
        #expect(Pcapng.wholeBlocks([0x0A, 0x0D, 0x0D, 0x0A, 5, 0, 0, 0, 0, 0, 0, 0][...]) == nil, "a length that is no block's")
    }

    @Test("packets made from what a socket saw: IPv4 with a valid header checksum, IPv6 with a valid UDP checksum, an IPv4 client of an IPv6 socket as IPv6; a cut payload keeps its whole length")
    func synthetic() {
        let v4 = Self.synthetic("hello", from: "198.18.0.7:4000", to: "198.18.0.1:53")
        #expect(v4.bytes.count == 33 && v4.length == 33 && v4.bytes[0] == 0x45 && v4.bytes[9] == 17)
        #expect(Array(v4.bytes[12..<20]) == [198, 18, 0, 7, 198, 18, 0, 1] && Array(v4.bytes[20..<24]) == [0x0f, 0xa0, 0, 53])
        #expect(v4.bytes.withUnsafeBytes { IPChecksum.checksum(UnsafeRawBufferPointer(rebasing: $0[0..<20])) } == 0, "the header's checksum verifies")
        let v6 = Self.synthetic("hello", from: "[2001:db8::7]:4000", to: "[2001:db8::1]:53")
        #expect(v6.bytes.count == 53 && v6.bytes[0] == 0x60 && v6.bytes[6] == 17)
        // The UDP checksum over the pseudo-header and the datagram verifies (sums to 0).
        let pseudo = Array(v6.bytes[8..<40]) + [0, 0, 0, 13, 0, 0, 0, 17]
        let sum = IPChecksum.add(UnsafeRawBufferPointer(rebasing: v6.bytes.withUnsafeBytes { $0 }[40...]), to: pseudo.withUnsafeBytes { IPChecksum.add($0, to: 0) })
        #expect(IPChecksum.finish(sum) == 0)
        let mapped = Self.synthetic("x", from: "198.18.0.7:4000", to: "[2001:db8::1]:53")
        #expect(mapped.bytes[0] == 0x60 && Array(mapped.bytes[8..<24]) == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 198, 18, 0, 7])
        // An IPv4 client of a wildcard IPv6 socket ([::]) is an IPv4 packet to 0.0.0.0.
        let unmapped = Self.synthetic("x", from: "[::ffff:198.18.0.7]:4000", to: "[::]:53")
        #expect(unmapped.bytes[0] == 0x45 && Array(unmapped.bytes[12..<20]) == [198, 18, 0, 7, 0, 0, 0, 0], "\(unmapped.bytes)")
        // A snap length: the headers and what fits of the payload; the checksum over the whole payload.
        let long = Self.payload(String(repeating: "y", count: 100))
        let snapped = long.withUnsafeBytes {
            SyntheticPacket.make(payload: $0, payloadLength: 100, from: SocketAddress("[2001:db8::7]:4000")!, to: SocketAddress("[2001:db8::1]:53")!, snaplen: 64)
        }
        let whole = long.withUnsafeBytes {
            SyntheticPacket.make(payload: $0, payloadLength: 100, from: SocketAddress("[2001:db8::7]:4000")!, to: SocketAddress("[2001:db8::1]:53")!)
        }
        #expect(snapped.bytes.count == 64 && snapped.length == 148 && snapped.bytes == Array(whole.bytes.prefix(64)))
        let cut = Self.synthetic("abc", from: "198.18.0.7:4000", to: "198.18.0.1:53", length: 1000)
        #expect(cut.bytes.count == 31 && cut.length == 1028 && cut.bytes[2] == 0x04 && cut.bytes[3] == 0x04, "the IP and UDP lengths say the whole datagram")
    }

    @Test("a packet in the other link type: an IP packet gets an Ethernet header (its type from its version), a frame loses its Ethernet header and VLAN tags")
    func linkTypes() {
        let ip = CapturedPacket(nanoseconds: 0, ethernet: false, data: [0x60, 1, 2, 3], originalLength: 100, reason: "too_large", reply: false)
        let framed = ip.data(for: Pcapng.linkTypeEthernet)
        #expect(framed.bytes.count == 18 && Array(framed.bytes[12..<14]) == [0x86, 0xdd] && framed.length == 114)
        #expect(ip.data(for: Pcapng.linkTypeRaw).bytes == ip.data)
        let tagged = [UInt8](repeating: 1, count: 12) + [0x81, 0x00, 0, 5, 0x08, 0x00, 0x45, 9]
        let frame = CapturedPacket(nanoseconds: 0, ethernet: true, data: tagged, originalLength: 60, reason: "parse_error", reply: false)
        let raw = frame.data(for: Pcapng.linkTypeRaw)
        #expect(raw.bytes == [0x45, 9] && raw.length == 42)
    }

    @Test("the request: defaults, reasons, and each bad value named with what is expected")
    func request() throws {
        let defaults = try CaptureRequest.parse([:])
        #expect(defaults.reasons.isEmpty && defaults.count == nil && defaults.snaplen == 2048 && defaults.rate == 1000 && defaults.seconds == nil)
        let asked = try CaptureRequest.parse(["reason": "rate_limited,amplification_capped", "count": "50", "snaplen": "128", "rate": "20", "seconds": "2.5"])
        #expect(asked.reasons == ["rate_limited", "amplification_capped"] && asked.count == 50 && asked.snaplen == 128 && asked.rate == 20 && asked.seconds == 2.5)
        for (query, text) in [(["reason": "send_error"], "unknown drop reason 'send_error'"), (["count": "0"], "count '0': expected a whole number from 1"),
                              (["rate": "10001"], "rate '10001': expected a whole number from 1 to 10000"),
                              (["snaplen": "4096"], "snaplen '4096'"), (["rate": "x"], "rate 'x'"), (["seconds": "-1"], "seconds '-1'")] {
            #expect(throws: CaptureRequestError.self) { try CaptureRequest.parse(query) }
            do {
                _ = try CaptureRequest.parse(query)
            } catch {
                #expect(error.description.contains(text) && error.status == 400, "\(error)")
            }
        }
    }

    @Test("a listener's capture: inactive until a session starts; each session gets the reasons it asked for up to its count; the union is sampled at the highest rate (the rest counted); at most 4 sessions; the last one's end makes it inactive")
    func sessions() throws {
        let capture = DropCapture()
        let payload = Self.payload("abc")
        func offer(_ reason: String, _ times: Int = 1) {
            payload.withUnsafeBytes { bytes in
                for _ in 0..<times {
                    capture.offer(reason, payload: bytes, payloadLength: 3, source: SocketAddress("198.18.0.7:4000")!, destination: SocketAddress("198.18.0.1:53")!)
                }
            }
        }
        let idle = capture.active.load(ordering: .relaxed)
        #expect(!idle)
        var limited = CaptureRequest()
        limited.reasons = ["rate_limited"]
        limited.count = 2
        let first = CaptureSession(limited)
        try capture.start(first, listener: "dns")
        let running = capture.active.load(ordering: .relaxed)
        #expect(running && capture.filter == DropCapture.Filter(reasons: ["rate_limited"], rate: 1000, snaplen: 2048))
        offer("no_healthy")
        offer("rate_limited", 3)
        var taken = first.take()
        #expect(taken.packets.map(\.reason) == ["rate_limited", "rate_limited"] && taken.complete, "its count: 2")
        #expect(taken.packets.first?.data.count == 31 && taken.packets.first?.originalLength == 31)
        // A second session for every reason at 10 a second: the union, sampled at 10/s with a
        // burst of 1: of 50 at once one is taken, 49 counted sampled out.
        var all = CaptureRequest()
        all.rate = 10
        let second = CaptureSession(all)
        try capture.start(second, listener: "dns")
        #expect(capture.filter == DropCapture.Filter(reasons: nil, rate: 1000, snaplen: 2048))
        capture.end(first)
        #expect(capture.filter == DropCapture.Filter(reasons: nil, rate: 10, snaplen: 2048))
        let before = capture.counts()
        offer("too_large", 50)
        taken = second.take()
        #expect(taken.packets.count == 1 && taken.packets[0].reason == "too_large" && !taken.complete)
        #expect(capture.counts().since(before) == DropCapture.Counts(sampledOut: 49, kernelLost: 0))
        // At most 4 at once.
        let more = (0..<3).map { _ in CaptureSession(CaptureRequest()) }
        for session in more { try capture.start(session, listener: "dns") }
        #expect(throws: CaptureRequestError.self) { try capture.start(CaptureSession(CaptureRequest()), listener: "dns") }
        for session in more { capture.end(session) }
        capture.end(second)
        capture.end(second)
        let ended = capture.active.load(ordering: .relaxed)
        #expect(!ended && capture.filter == nil)
        offer("rate_limited")
        #expect(second.take().packets.isEmpty)
        // Ended by the capture (its reader gone): the stream is told why.
        let third = CaptureSession(CaptureRequest())
        try capture.start(third, listener: "dns")
        capture.end(third, reason: "its reader took nothing for 30 s")
        let after = third.take()
        let stopped = capture.active.load(ordering: .relaxed)
        #expect(after.ended == "its reader took nothing for 30 s" && !stopped)
    }

    @Test("a kernel listener's watcher is told the filter at once and at each change, and its counts are added")
    func watchers() throws {
        final class Owner: Sendable {}
        let capture = DropCapture()
        let owner = Owner()
        let seen = Mutex<[DropCapture.Filter?]>([])
        capture.watch(owner, counts: { DropCapture.Counts(sampledOut: 5, kernelLost: 2) }) { filter in seen.withLock { $0.append(filter) } }
        let session = CaptureSession(CaptureRequest())
        try capture.start(session, listener: "dns")
        #expect(capture.counts() == DropCapture.Counts(sampledOut: 5, kernelLost: 2))
        capture.end(session)
        capture.unwatch(owner)
        try capture.start(session, listener: "dns")
        capture.end(session)
        #expect(seen.withLock { $0 } == [nil, DropCapture.Filter(reasons: nil, rate: 1000, snaplen: 2048), nil])
    }

    @Test("tshark reads what the capture writes: the comment, the direction, the addresses and ports, and the checksums verify", .enabled(if: FileManager.default.isExecutableFile(atPath: "/usr/bin/tshark") || ProcessInfo.processInfo.environment["CI"] == "true", "tshark is not installed (make test installs it)"))
    func tshark() throws {
        var stream = Pcapng.header(linkType: Pcapng.linkTypeRaw, snaplen: 2048, listener: "dns")
        let request = Self.synthetic("request", from: "198.18.0.7:4000", to: "198.18.0.1:53")
        let reply = Self.synthetic("reply", from: "[2001:db8::2]:53", to: "[2001:db8::7]:4000")
        stream += Pcapng.packet(nanoseconds: 1_700_000_000_000_000_001, data: request.bytes, originalLength: request.length, comment: "rate_limited", inbound: true)
        stream += Pcapng.packet(nanoseconds: 1_700_000_000_000_000_002, data: reply.bytes, originalLength: reply.length, comment: "amplification_capped", inbound: false)
        stream += Pcapng.statistics(nanoseconds: 1_700_000_000_000_000_003, lost: 0, comment: "2 captured")
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("capture-\(UUID().uuidString).pcapng")
        defer { try? FileManager.default.removeItem(at: file) }
        try Data(stream).write(to: file)
        let read = try run("/usr/bin/tshark", ["-r", file.path, "-o", "ip.check_checksum:TRUE", "-o", "udp.check_checksum:TRUE", "-T", "fields", "-E", "separator=|",
                                               "-e", "frame.comment", "-e", "frame.packet_flags_direction", "-e", "ip.src", "-e", "ipv6.src", "-e", "udp.srcport", "-e", "udp.dstport",
                                               "-e", "ip.checksum.status", "-e", "udp.checksum.status", "-e", "frame.time_epoch"])
        let lines = read.output.split(separator: "\n").filter { $0.contains("|") }
        #expect(read.status == 0 && lines.count == 2, "\(read.output)")
        // Inbound (a client's datagram) and outbound (a reply); IPv4's header checksum good (1)
        // and its UDP checksum absent (3, as IPv4 allows), IPv6's UDP checksum good.
        #expect(lines.first?.hasPrefix("rate_limited|0x00000001|198.18.0.7||4000|53|1|3|") == true, "\(lines)")
        #expect(lines.last?.hasPrefix("amplification_capped|0x00000002||2001:db8::2|53|4000||1|") == true, "\(lines)")
        #expect(lines.first?.hasSuffix("1700000000.000000001") == true, "nanoseconds: \(lines)")
    }

    @Test("udp-fanout capture against a daemon on loopback: -w - to standard output read by tshark (too_large drops, cut where the socket cut them, their whole length said); an unknown listener named with the daemon's (the file left as it was); a reload that removes the listener ends its capture; a fifth capture at once refused; no daemon; Ctrl-C and the daemon's stop each end a capture with a whole file")
    func command() throws {
        let (listen, metrics, sink, other) = (freePort(), freePort(), freePort(), freePort())
        let file = try TCFixtures.write("""
            listeners:
              - name: events
                bind: "127.0.0.1:\(listen)"
                downstream: [{name: sink, address: "127.0.0.1:\(sink)"}]
                settings: {max_packet_size: 1000}
              - name: other
                bind: "127.0.0.1:\(other)"
                downstream: [{name: sink, address: "127.0.0.1:\(sink)"}]
            metrics: {enabled: true, bind: "127.0.0.1:\(metrics)"}

            """, "capture-command")
        defer { try? FileManager.default.removeItem(at: file) }
        let collector = try Child("collector", ["127.0.0.1", "\(sink)", "0", "1"])
        defer { collector.signal(SIGTERM); _ = collector.wait() }
        try collector.waitFor("ready")
        let daemon = try Child("udp-fanout", ["-c", file.path])
        defer { if daemon.process.isRunning { daemon.signal(SIGTERM); _ = daemon.wait() } }
        try daemon.waitFor("metrics endpoint listening")
        let binary = binaryDirectory.appendingPathComponent("udp-fanout").path
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("capture-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        func started() -> Int { daemon.stderr.components(separatedBy: "capture started").count - 1 }

        // -w -: the stream on standard output, here into a file by the shell.
        let piped = directory.appendingPathComponent("piped.pcapng").path
        let capture = try Child("/bin/sh", ["-c", "exec '\(binary)' capture --listener events --reason too_large -c 5 -w - --config '\(file.path)' > '\(piped)'"])
        #expect(Probe.waitFor(seconds: 10) { started() == 1 }, "\(daemon.stderr)")
        let large = try Child("publisher", ["127.0.0.1", "\(listen)", "50", "--rate", "200", "--size", "2000"])
        #expect(large.wait() == 0)
        #expect(capture.wait(seconds: 20) == 0, "\(capture.stderr)")
        #expect(capture.stderr.contains("udp-fanout capture: 5 packet(s) written to standard output; the daemon: ended: its count reached; 5 captured, 0 lost"), "\(capture.stderr)")
        let read = try run("/usr/bin/tshark", ["-r", piped, "-T", "fields", "-E", "separator=|", "-e", "frame.comment", "-e", "ip.src", "-e", "udp.dstport", "-e", "frame.cap_len", "-e", "frame.len"])
        let lines = read.output.split(separator: "\n").filter { $0.contains("|") }
        #expect(read.status == 0 && lines.count == 5 && lines.allSatisfy { $0 == "too_large|127.0.0.1|\(listen)|1028|2028" }, "\(read.output)")

        // An unknown listener: the daemon's listeners are named, and the file given is left as it was.
        let kept = directory.appendingPathComponent("kept")
        try Data("keep me".utf8).write(to: kept)
        let unknown = try Child("udp-fanout", ["capture", "--listener", "nope", "-w", kept.path, "--config", file.path])
        #expect(unknown.wait() == 1)
        #expect(unknown.stderr.contains("answered HTTP 404: no listener 'nope' in the running configuration; its listeners: events, other"), "\(unknown.stderr)")
        #expect(try String(contentsOf: kept, encoding: .utf8) == "keep me")

        // A device (or a pipe) is written as it is: -w /dev/null.
        let device = try Child("udp-fanout", ["capture", "--listener", "events", "--seconds", "1", "-w", "/dev/null", "--config", file.path])
        #expect(device.wait() == 0, "\(device.stderr)")
        #expect(device.stderr.contains("packet(s) written to /dev/null; the daemon: ended: its seconds passed"), "\(device.stderr)")

        // A reason the listener's kind never drops for is refused, naming what it can capture.
        let never = try Child("udp-fanout", ["capture", "--listener", "events", "--reason", "no_route", "-w", directory.appendingPathComponent("never").path, "--config", file.path])
        #expect(never.wait() == 1)
        #expect(never.stderr.contains("answered HTTP 400: listener 'events' (userspace) never drops a datagram for no_route; what it can drop, and so capture: no_healthy, rate_limited, too_large"), "\(never.stderr)")
        #expect(!FileManager.default.fileExists(atPath: directory.appendingPathComponent("never").path), "a file made for a refused capture is removed")

        // A reload that takes the listener out ends its capture, saying so.
        let removed = try Child("udp-fanout", ["capture", "--listener", "other", "-w", directory.appendingPathComponent("other.pcapng").path, "--config", file.path])
        #expect(Probe.waitFor(seconds: 10) { started() == 3 }, "\(daemon.stderr)")
        let text = try String(contentsOf: file, encoding: .utf8)
        let without = text.components(separatedBy: "  - name: other")[0] + "metrics: {enabled: true, bind: \"127.0.0.1:\(metrics)\"}\n"
        try without.write(to: file, atomically: true, encoding: .utf8)
        daemon.signal(SIGHUP)
        #expect(removed.wait(seconds: 20) == 0, "\(removed.stderr)")
        #expect(removed.stderr.contains("the daemon: ended: the listener left the configuration (a reload); 0 captured"), "\(removed.stderr)")
        #expect(try run("/usr/bin/tshark", ["-r", directory.appendingPathComponent("other.pcapng").path]).status == 0)

        // Four at once; a fifth is refused.
        let running = try (0..<4).map { n in
            try Child("udp-fanout", ["capture", "--listener", "events", "--seconds", "60", "-w", directory.appendingPathComponent("r\(n).pcapng").path, "--config", file.path])
        }
        #expect(Probe.waitFor(seconds: 10) { started() == 7 }, "\(daemon.stderr)")
        let fifth = try Child("udp-fanout", ["capture", "--listener", "events", "-w", directory.appendingPathComponent("f").path, "--endpoint", "127.0.0.1:\(metrics)"])
        #expect(fifth.wait() == 1)
        #expect(fifth.stderr.contains("answered HTTP 429: 4 captures of listener 'events' are running already"), "\(fifth.stderr)")

        // Ctrl-C ends one: a whole file (tshark reads it, no packet in it).
        running[0].signal(SIGINT)
        #expect(running[0].wait(seconds: 10) == 0, "\(running[0].stderr)")
        #expect(running[0].stderr.contains("udp-fanout capture: interrupted; 0 packet(s) written to"), "\(running[0].stderr)")
        #expect(try run("/usr/bin/tshark", ["-r", directory.appendingPathComponent("r0.pcapng").path]).status == 0)
        // The daemon stops: each running capture ends with the stream, its file whole.
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0, "\(daemon.stderr.suffix(2000))")
        for n in 1..<4 {
            #expect(running[n].wait(seconds: 10) == 0, "\(running[n].stderr)")
            #expect(running[n].stderr.contains("the daemon: ended: the daemon's endpoint stops"), "\(running[n].stderr)")
            #expect(try run("/usr/bin/tshark", ["-r", directory.appendingPathComponent("r\(n).pcapng").path]).status == 0)
        }
        // No daemon there now.
        let nobody = try Child("udp-fanout", ["capture", "--listener", "events", "-w", directory.appendingPathComponent("n").path, "--endpoint", "127.0.0.1:\(metrics)"])
        #expect(nobody.wait() == 1)
        #expect(nobody.stderr.contains("cannot reach udp-fanout at http://127.0.0.1:\(metrics)/status: connection refused"), "\(nobody.stderr)")
        #expect(!FileManager.default.fileExists(atPath: directory.appendingPathComponent("n").path), "no file made without a capture")
    }
}
