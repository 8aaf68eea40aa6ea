// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// rate_limit under a spoofed flood, in every kind, through one routed topology of namespaces
/// (Topology: the client namespace is the attacker's and the legitimate client's). The
/// attacker (Tests/attack/flood.py) forges sources with raw sockets: 6 heavy IPv4 sources at
/// 400 datagrams/s, 10,000 sources (198.18.64.0/18: 500 sending 25 back to back, the others 3),
/// 1,000 IPv6 addresses rotating inside one /64, and an allowed source at 400/s; a legitimate
/// client sends 50/s from its own socket. The listeners allow 100 datagrams/s per source prefix
/// with a burst of 20 (a stall of up to 200 ms, of the sender or of a busy machine's forwarder,
/// costs a steady source nothing). A counter behind the listener counts what arrives by the tag
/// each payload starts with.
@Suite("rate_limit under a spoofed flood, every kind", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct AbuseEndToEndTests {
    static let script = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .appendingPathComponent("attack").appendingPathComponent("flood.py").path
    static let rate = 100
    static let burst = 20
    static let seconds = 3.0
    static let spread = 10_000
    static let spreadCount = 3
    /// The first `spreadBursts` forged sources send `spreadBurstCount` back to back: each gets its burst.
    static let spreadBursts = 500
    static let spreadBurstCount = 25

    enum Kind: String, CaseIterable, CustomStringConvertible {
        case userspace, relay, tcEBPF = "tc_ebpf", xdp, afXDP = "af_xdp"
        var description: String { rawValue }
        /// The mode label of its metrics.
        var mode: String { self == .relay ? "userspace" : rawValue }
        /// af_xdp holds its interface for one listener: the IPv6 rotation goes to the others.
        var ipv6: Bool { self != .afXDP }
    }

    static func config(_ kind: Kind, interface: String) -> String {
        func listener(_ name: String, _ bind: String, _ downstream: String) -> String {
            var lines = """
                  - name: \(name)
                    bind: "\(bind)"
                    mode: \(kind.mode)
                    balancing: source_ip
                    downstream: [{name: b1, address: "\(downstream)"}]
                    rate_limit: {datagrams_per_second: \(rate), burst_datagrams: \(burst), allow: [198.18.0.3/32]}

                """
            switch kind {
            case .userspace: lines += "    settings: {workers: 2, recv_buf_size: 8388608}\n"
            case .relay: lines += "    replies: relay\n    settings: {workers: 2, recv_buf_size: 8388608, max_sessions: 16000}\n"
            case .tcEBPF, .xdp: lines += "    interface: \(interface)\n"
            case .afXDP: lines += "    interface: \(interface)\n    settings: {batch_size: 64}\n"
            }
            return lines
        }
        var text = "listeners:\n" + listener("a4", "198.18.0.1:5600", "198.18.1.2:7000")
        if kind.ipv6 { text += listener("a6", "[2001:db8::1]:5600", "[2001:db8:1::2]:7000") }
        return text + "metrics: {enabled: true, bind: \"127.0.0.1:\(Scrape.metricsPort)\"}\n"
    }

    /// What one kind's run measured: the attack table's row.
    struct Row: CustomStringConvertible {
        var kind: Kind
        var sent = 0, accepted = 0, limited = 0, legitimateLost = 0
        /// Each heavy source's and the rotating /64's accepted count over what its limit allows in its span.
        var heavyRatios: [Double] = []
        var rotationRatio: Double?
        var forgedAccepted = 0
        var captured = 0
        var description: String {
            let heavy = heavyRatios.isEmpty ? "-" : String(format: "%.3f-%.3f", heavyRatios.min()!, heavyRatios.max()!)
            return "\(kind): sent \(sent), accepted \(accepted), limited \(limited), legitimate client lost \(legitimateLost); "
                + "heavy sources accepted/limit \(heavy), rotating /64 \(rotationRatio.map { String(format: "%.3f", $0) } ?? "-"), "
                + "10,000 forged sources accepted \(forgedAccepted), captured \(captured) rate_limited"
        }
    }

    @Test("per source: its burst plus its rate (±5 %) whatever it sends, the same for a /64 rotating its addresses; 10,000 forged sources each held to its burst; the allowed source and the legitimate client lose nothing; every drop counted rate_limited")
    func flood() throws {
        let topology = try Topology(backends: 1)
        defer { topology.destroy() }
        // The forged sources route back toward the attacker (as on the Internet), so the proxy's
        // reverse-path check passes them.
        try topology.exec(topology.proxy, ["ip", "route", "add", "198.18.64.0/18", "via", "198.18.0.2"])
        try topology.exec(topology.proxy, ["ip", "-6", "route", "add", "2001:db8:77::/48", "via", "2001:db8::2"])
        var rows: [Row] = []
        for kind in Kind.allCases {
            rows.append(try attack(kind, topology))
        }
        print("rate_limit attack table:\n" + rows.map { "  \($0)" }.joined(separator: "\n"))
    }

    func attack(_ kind: Kind, _ topology: Topology) throws -> Row {
        let file = try TCFixtures.write(Self.config(kind, interface: topology.proxyInterface), "abuse-\(kind)")
        defer { try? FileManager.default.removeItem(at: file) }
        let counter = try Child.unblocked(Self.script, ["count", "--port", "7000", "--seconds", "120"], prefix: topology.prefix(topology.backends[0]))
        defer { if counter.process.isRunning { counter.signal(SIGKILL); _ = counter.wait() } }
        try counter.waitFor("counting")
        let daemon = try Child("udp-fanout", ["-c", file.path], prefix: topology.prefix(topology.proxy))
        defer { if daemon.process.isRunning { daemon.signal(SIGKILL); _ = daemon.wait() } }
        try waitReady(topology, daemon)
        // `udp-fanout capture` of the IPv4 listener's rate_limited drops, through the flood.
        let capture = try startCapture(topology, daemon, listener: "a4", reason: "rate_limited", count: Self.captured, tag: "\(kind)")
        defer { try? FileManager.default.removeItem(at: capture.file) }
        var arguments = ["send", "--listener4", "198.18.0.1:5600", "--seconds", "\(Self.seconds)", "--spread", "\(Self.spread)",
                         "--spread-count", "\(Self.spreadCount)", "--spread-bursts", "\(Self.spreadBursts)", "--spread-burst-count", "\(Self.spreadBurstCount)"]
        if kind.ipv6 { arguments += ["--listener6", "[2001:db8::1]:5600"] }
        let sender = try Child.unblocked(Self.script, arguments, prefix: topology.prefix(topology.client))
        #expect(sender.wait(seconds: 90) == 0, "\(kind): \(sender.stderr)")
        let report = try sender.json()
        let sent = report.object("sent").mapValues { ($0 as? NSNumber)?.intValue ?? 0 }
        let spans = report.object("spans").mapValues { ($0 as? NSNumber)?.doubleValue ?? 0 }
        let total = sent.values.reduce(0, +)
        // Everything sent is received (or dropped by the kernel before the proxy) before the counts are read.
        let listeners = kind.ipv6 ? ["a4", "a6"] : ["a4"]
        func metric(_ name: String, _ listener: String, _ metrics: String) -> Int {
            Scrape.value(metrics, "\(name){listener=\"\(listener)\",mode=\"\(kind.mode)\"}")
        }
        var metrics = ""
        let pathDrops = (try? topology.clientPathDrops()) ?? -1
        for _ in 0..<100 {
            metrics = try topology.exec(topology.proxy, ["curl", "-s", "http://127.0.0.1:\(Scrape.metricsPort)/metrics"])
            let received = listeners.map { metric("udp_fanout_packets_received_total", $0, metrics) }.reduce(0, +)
            if received >= total - max(pathDrops, 0) { break }
            usleep(100_000)
        }
        usleep(500_000)
        metrics = try topology.exec(topology.proxy, ["curl", "-s", "http://127.0.0.1:\(Scrape.metricsPort)/metrics"])
        let status = try topology.exec(topology.proxy, ["curl", "-s", "http://127.0.0.1:\(Scrape.metricsPort)/status"])
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0, "\(kind): \(daemon.stderr.suffix(2000))")
        counter.signal(SIGTERM)
        #expect(counter.wait() == 0)
        let counts = try counter.json().object("counts").mapValues { ($0 as? NSNumber)?.intValue ?? 0 }

        var row = Row(kind: kind)
        row.sent = total
        row.accepted = counts.values.reduce(0, +)
        var received = 0, forwarded = 0
        for listener in listeners {
            received += metric("udp_fanout_packets_received_total", listener, metrics)
            forwarded += metric("udp_fanout_packets_forwarded_total", listener, metrics)
            row.limited += Scrape.value(metrics, "udp_fanout_packets_dropped_by_reason_total{listener=\"\(listener)\",mode=\"\(kind.mode)\",reason=\"rate_limited\"}")
            #expect(metric("udp_fanout_packets_dropped_total", listener, metrics) == Scrape.value(
                metrics, "udp_fanout_packets_dropped_by_reason_total{listener=\"\(listener)\",mode=\"\(kind.mode)\",reason=\"rate_limited\"}"),
                "\(kind) \(listener): every drop is rate_limited")
        }
        // Every datagram the proxy received is forwarded or counted rate_limited, and every one
        // forwarded arrived; what the kernel dropped before the proxy is the only difference to what was sent.
        let reasons = metrics.split(separator: "\n").filter { $0.hasPrefix("udp_fanout_packets_dropped_by_reason_total") && !$0.hasSuffix(" 0") }
        #expect(received == forwarded + row.limited, "\(kind): received \(received), forwarded \(forwarded), limited \(row.limited); \(reasons)")
        #expect(row.accepted == forwarded, "\(kind): counted behind the listener \(row.accepted), forwarded \(forwarded)")
        let kernelDrops = (try? topology.clientPathDrops()) ?? -1
        #expect(received + max(kernelDrops, 0) >= total, "\(kind): sent \(total), received \(received), dropped before the proxy \(kernelDrops)")

        // The legitimate client and the allowed source: nothing lost.
        row.legitimateLost = (sent["legit"] ?? 0) - (counts["legit"] ?? 0)
        #expect(sent["legit"] == Int(50 * Self.seconds) && row.legitimateLost == 0, "\(kind): legitimate \(counts["legit"] ?? 0) of \(sent["legit"] ?? 0)")
        #expect(counts["allowed"] == sent["allowed"], "\(kind): allowed \(counts["allowed"] ?? 0) of \(sent["allowed"] ?? 0)")
        // Each heavy source (400/s offered): its burst plus its rate over its span, within ±5 %.
        for n in 1...6 {
            let tag = "h\(n)"
            let expected = Double(Self.burst) + Double(Self.rate) * (spans[tag] ?? 0)
            let got = Double(counts[tag] ?? 0)
            row.heavyRatios.append(got / expected)
            #expect(abs(got - expected) <= 0.05 * expected, "\(kind) \(tag): accepted \(Int(got)), expected \(Int(expected)) ±5 % (sent \(sent[tag] ?? 0) over \(spans[tag] ?? 0) s)")
        }
        // The /64 whose addresses rotate: one source's worth, not one per address.
        if kind.ipv6 {
            let expected = Double(Self.burst) + Double(Self.rate) * (spans["r"] ?? 0)
            let got = Double(counts["r"] ?? 0)
            row.rotationRatio = got / expected
            #expect(abs(got - expected) <= 0.05 * expected, "\(kind) rotation in a /64: accepted \(Int(got)), expected \(Int(expected)) ±5 % (sent \(sent["r"] ?? 0))")
        }
        // The 10,000 forged sources: those sending 3 lose nothing (the table holds them all);
        // those sending 25 back to back get their burst of 20 (a few more when a stall of the
        // sender or the forwarder took their datagrams apart), never all 25.
        var spreadAccepted = 0, overBurst = 0, missing = 0
        for n in 0..<Self.spread {
            let got = counts["s\(n)"] ?? 0
            spreadAccepted += got
            if n < Self.spreadBursts {
                if got > Self.burst + 3 || got < Self.burst { overBurst += 1 }
            } else if got != Self.spreadCount {
                missing += 1
            }
        }
        row.forgedAccepted = spreadAccepted
        #expect(overBurst <= max(kernelDrops, 0) + Self.spreadBursts / 100,
                "\(kind): \(overBurst) of the \(Self.spreadBursts) forged sources sending \(Self.spreadBurstCount) got outside \(Self.burst)...\(Self.burst + 3)")
        #expect(missing <= max(kernelDrops, 0), "\(kind): \(missing) forged sources sending \(Self.spreadCount) did not get them all (kernel drops \(kernelDrops))")
        #expect(spreadAccepted <= (Self.spread - Self.spreadBursts) * Self.spreadCount + Self.spreadBursts * (Self.burst + 1),
                "\(kind): forged sources accepted \(spreadAccepted)")
        // /status names the sources limited most (the heavy ones and the /64).
        #expect(status.contains("\"top_limited\"") && status.contains("198.18.110."), "\(kind): \(status.prefix(3000))")

        // The capture: exactly its count, each a datagram of a limited source (a heavy one or a
        // forged one sending 25) to the listener, with its reason; never the legitimate client's
        // nor the allowed source's. tshark and tcpdump both read the file.
        #expect(capture.child.wait(seconds: 30) == 0, "\(kind): \(capture.child.stderr)")
        let packets = try Self.readCapture(capture.file)
        row.captured = packets.count
        #expect(packets.count == Self.captured, "\(kind): captured \(packets.count) of \(Self.captured): \(capture.child.stderr)")
        for packet in packets {
            let tag = String(decoding: Self.bytes(hex: packet.payload).prefix { $0 != UInt8(ascii: " ") }, as: UTF8.self)
            // The source each limited tag is sent from (flood.py): h<n> 198.18.110.<n>, s<N> the Nth of 198.18.64.0/18.
            var expected: String?
            if tag.hasPrefix("h"), let n = Int(tag.dropFirst()) { expected = "198.18.110.\(n)" }
            if tag.hasPrefix("s"), let n = Int(tag.dropFirst()), n < Self.spreadBursts { expected = "198.18.\(64 + n / 256).\(n % 256)" }
            #expect(packet.comment == "rate_limited" && packet.destination == "198.18.0.1" && expected != nil && packet.source == expected,
                    "\(kind): a captured packet that is no limited source's: \(packet) (tag \(tag))")
        }
        // What an operator sees: tshark's summary of the first packets, with their comments.
        let excerpt = try run("/usr/bin/tshark", ["-r", capture.file.path, "-c", "4", "-T", "fields", "-e", "frame.number", "-e", "frame.time_relative",
                                                  "-e", "ip.src", "-e", "udp.srcport", "-e", "ip.dst", "-e", "udp.dstport", "-e", "udp.length", "-e", "frame.comment"])
        print("\(kind) capture (tshark -r, the first 4 of \(packets.count)):\n\(excerpt.output.split(separator: "\n").filter { !$0.hasPrefix("Running as") }.joined(separator: "\n"))")
        return row
    }

    /// Packets each capture of the flood keeps.
    static let captured = 200

    /// `udp-fanout capture` of `listener`'s drops for `reason` in the proxy's namespace, running
    /// once the daemon says so (before the traffic starts).
    func startCapture(_ topology: Topology, _ daemon: Child, listener: String, reason: String, count: Int, tag: String) throws -> (child: Child, file: URL) {
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("capture-\(tag)-\(UUID().uuidString).pcapng")
        let child = try Child("udp-fanout", ["capture", "--listener", listener, "--reason", reason, "-c", "\(count)", "--seconds", "60",
                                             "-w", file.path, "--endpoint", "127.0.0.1:\(Scrape.metricsPort)"], prefix: topology.prefix(topology.proxy))
        try daemon.waitFor("capture started")
        return (child, file)
    }

    /// A capture file's packets as tshark reads them (its comment, the IP addresses, the UDP
    /// payload in hex), after tcpdump read it whole too.
    static func readCapture(_ file: URL) throws -> [(comment: String, source: String, destination: String, payload: String)] {
        let tcpdump = try run("/usr/bin/tcpdump", ["-r", file.path, "-nn"])
        #expect(tcpdump.status == 0 && !tcpdump.output.contains("pcap_loop"), "tcpdump -r: \(tcpdump.output.suffix(1000))")
        let tshark = try run("/usr/bin/tshark", ["-r", file.path, "-T", "fields", "-E", "separator=|", "-e", "frame.comment",
                                                 "-e", "ip.src", "-e", "ipv6.src", "-e", "ip.dst", "-e", "ipv6.dst", "-e", "udp.payload"])
        #expect(tshark.status == 0, "tshark -r: \(tshark.output.suffix(1000))")
        let lines = tshark.output.split(separator: "\n").map(String.init).filter { $0.contains("|") }
        // One line per packet: its time, then IP or IP6 (the first line names the file).
        let tcpdumpLines = tcpdump.output.split(separator: "\n").filter { ["IP", "IP6"].contains($0.split(separator: " ").dropFirst().first ?? "") }.count
        #expect(tcpdumpLines == lines.count, "tcpdump read \(tcpdumpLines) packets, tshark \(lines.count)")
        return lines.map { line in
            let fields = line.split(separator: "|", omittingEmptySubsequences: false).map(String.init)
            func field(_ index: Int) -> String { index < fields.count ? fields[index] : "" }
            return (field(0), field(1).isEmpty ? field(2) : field(1), field(3).isEmpty ? field(4) : field(3), field(5))
        }
    }

    static func bytes(hex: String) -> [UInt8] {
        var bytes: [UInt8] = []
        var index = hex.startIndex
        while let next = hex.index(index, offsetBy: 2, limitedBy: hex.endIndex), index != hex.endIndex {
            if let byte = UInt8(hex[index..<next], radix: 16) { bytes.append(byte) }
            index = next
        }
        return bytes
    }

    enum TwoWay: String, CaseIterable, CustomStringConvertible {
        case relay, tcEBPF = "tc_ebpf", xdp
        var description: String { rawValue }
        var mode: String { self == .relay ? "userspace" : rawValue }
    }

    /// What one reflection run measured.
    struct Reflection: CustomStringConvertible {
        var kind: TwoWay
        var capped: Bool
        var attackerBytes = 0, victimBytes = 0, cappedReplies = 0, legitimateSent = 0, legitimateReplies = 0
        var description: String {
            "\(kind) \(capped ? "with amplification: {factor: 3}" : "without a cap"): attacker sent \(attackerBytes) B, victim got \(victimBytes) B "
                + "(\(String(format: "%.2f", Double(victimBytes) / Double(max(attackerBytes, 1))))x), replies capped \(cappedReplies), "
                + "legitimate client \(legitimateReplies)/\(legitimateSent) replies"
        }
    }

    @Test("amplification: a reflection through a two-way listener (the victim's address forged, a server answering 20x): the victim gets at most 3x the attacker's bytes with the cap (about 14x without), every reply dropped counted amplification_capped, and the legitimate client (2x exchanges) loses nothing")
    func reflection() throws {
        let topology = try Topology(backends: 1)
        defer { topology.destroy() }
        // The victim: an address of the client's namespace (its replies are delivered there).
        try topology.exec(topology.client, ["ip", "addr", "add", "198.18.0.9/24", "dev", "cp\(topology.suffix.prefix(8))"])
        var rows: [Reflection] = []
        for kind in TwoWay.allCases {
            for capped in [true, false] {
                rows.append(try reflect(kind, capped: capped, topology))
            }
        }
        print("amplification table:\n" + rows.map { "  \($0)" }.joined(separator: "\n"))
    }

    func reflect(_ kind: TwoWay, capped: Bool, _ topology: Topology) throws -> Reflection {
        var listener = """
            listeners:
              - name: amp
                bind: "198.18.0.1:5700"
                mode: \(kind.mode)
                downstream: [{name: b1, address: "198.18.1.2:7000"}]

            """
        listener += kind == .relay ? "    replies: relay\n" : "    replies: nat\n    interface: \(topology.proxyInterface)\n"
        if capped { listener += "    amplification: {factor: 3}\n" }
        listener += "metrics: {enabled: true, bind: \"127.0.0.1:\(Scrape.metricsPort)\"}\n"
        let file = try TCFixtures.write(listener, "amplification-\(kind)")
        defer { try? FileManager.default.removeItem(at: file) }
        let server = try Child.unblocked(Self.script, ["serve", "--port", "7000", "--seconds", "120"], prefix: topology.prefix(topology.backends[0]))
        defer { if server.process.isRunning { server.signal(SIGKILL); _ = server.wait() } }
        try server.waitFor("serving")
        let victim = try Child.unblocked(Self.script, ["count", "--port", "9999", "--seconds", "120"], prefix: topology.prefix(topology.client))
        defer { if victim.process.isRunning { victim.signal(SIGKILL); _ = victim.wait() } }
        try victim.waitFor("counting")
        let daemon = try Child("udp-fanout", ["-c", file.path], prefix: topology.prefix(topology.proxy))
        defer { if daemon.process.isRunning { daemon.signal(SIGKILL); _ = daemon.wait() } }
        try waitReady(topology, daemon)
        // With the cap: `udp-fanout capture` of the replies it drops.
        let capture = capped ? try startCapture(topology, daemon, listener: "amp", reason: "amplification_capped", count: 20, tag: "amp-\(kind)") : nil
        defer { if let capture { try? FileManager.default.removeItem(at: capture.file) } }
        let attacker = try Child.unblocked(Self.script, ["amp", "--listener", "198.18.0.1:5700", "--victim", "198.18.0.9:9999", "--requests", "300",
                                                         "--legit", "60", "--seconds", "3"], prefix: topology.prefix(topology.client))
        #expect(attacker.wait(seconds: 60) == 0, "\(kind): \(attacker.stderr)")
        let report = try attacker.json()
        usleep(500_000)
        let metrics = try topology.exec(topology.proxy, ["curl", "-s", "http://127.0.0.1:\(Scrape.metricsPort)/metrics"])
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0, "\(kind): \(daemon.stderr.suffix(2000))")
        victim.signal(SIGTERM)
        #expect(victim.wait() == 0)
        server.signal(SIGTERM)
        #expect(server.wait() == 0)
        #expect(try server.json().int("failed") == 0, "\(kind): the server could not send every answer")
        let received = try victim.json().object("bytes").mapValues { ($0 as? NSNumber)?.intValue ?? 0 }
        var row = Reflection(kind: kind, capped: capped)
        row.attackerBytes = report.int("attacker_bytes")
        row.victimBytes = received.values.reduce(0, +)
        row.legitimateSent = report.int("legit_sent")
        row.legitimateReplies = report.int("legit_replies")
        let labels = "listener=\"amp\",mode=\"\(kind.mode)\""
        row.cappedReplies = Scrape.value(metrics, "udp_fanout_replies_dropped_total{\(labels),reason=\"amplification_capped\"}")
        let replies = Scrape.value(metrics, "udp_fanout_replies_total{\(labels)}")
        #expect(row.legitimateSent == 60 && row.legitimateReplies == 60, "\(kind): legitimate client \(row.legitimateReplies) of \(row.legitimateSent)")
        if capped {
            #expect(row.victimBytes <= 3 * row.attackerBytes, "\(kind): \(row)")
            // Each of the 300 forged requests was answered by the server: those not relayed are counted.
            #expect(replies + row.cappedReplies == 300 + 60, "\(kind): replies \(replies), capped \(row.cappedReplies)")
            #expect(row.cappedReplies > 0)
            // The capture: 20 replies of the server toward the victim, each amplification_capped
            // (nat: as the server sent it; relay: from the server's address, as the relay read it).
            if let capture {
                #expect(capture.child.wait(seconds: 30) == 0, "\(kind): \(capture.child.stderr)")
                let packets = try Self.readCapture(capture.file)
                #expect(packets.count == 20, "\(kind): captured \(packets.count) of 20: \(capture.child.stderr)")
                for packet in packets {
                    #expect(packet.comment == "amplification_capped" && packet.source == "198.18.1.2" && packet.destination == "198.18.0.9",
                            "\(kind): \(packet)")
                }
                if let first = packets.first { print("\(kind) amplification capture: \(packets.count) packets, the first: \(first)") }
            }
        } else {
            #expect(row.victimBytes > 10 * row.attackerBytes, "\(kind): without a cap the server's 20x reaches the victim: \(row)")
            #expect(row.cappedReplies == 0)
        }
        return row
    }

    /// Until /readyz answers 200 (the listeners are up), at most 20 s.
    func waitReady(_ topology: Topology, _ daemon: Child) throws {
        for _ in 0..<200 {
            let code = try run(topology.prefix(topology.proxy)[0], Array(topology.prefix(topology.proxy).dropFirst())
                               + ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "http://127.0.0.1:\(Scrape.metricsPort)/readyz"]).output
            if code == "200" { return }
            try #require(daemon.process.isRunning, "udp-fanout ended: \(daemon.stderr.suffix(2000)) \(daemon.stdout.suffix(2000))")
            usleep(100_000)
        }
        Issue.record("not ready in 20 s: \(daemon.stderr.suffix(2000))")
    }
}
