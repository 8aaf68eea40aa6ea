// SPDX-License-Identifier: Apache-2.0
import CSystemShim
import Foundation
import Testing
import TestSupport
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// The reliability suite (issue 8): `make test` runs the short form, `make reliability`
/// (RELIABILITY=full) the full one. Figures go to docs/reliability.md.
enum Reliability {
    static let full = ProcessInfo.processInfo.environment["RELIABILITY"] == "full"
    static func scale(_ short: Int, _ full: Int) -> Int { Self.full ? full : short }
    /// One line of figures for docs/reliability.md, on stderr.
    static func report(_ line: String) {
        FileHandle.standardError.write(Data("reliability: \(line)\n".utf8))
    }
}

/// The fuzz tests' SplitMix64 generator, usable with the standard library's random APIs.
extension PacketFuzz.Generator: RandomNumberGenerator {}
typealias SeededRandom = PacketFuzz.Generator

/// Mutates configuration files the ways a hand, an editor or a fuzzer breaks them.
struct ConfigMutator {
    static let seeds: [String] = [
        ReferenceConfigs.smoke, ReferenceConfigs.userspace, ReferenceConfigs.tcKubernetes, ReferenceConfigs.afXDP,
        (try? String(contentsOf: binaryDirectory.appendingPathComponent("../../config.example.yaml"), encoding: .utf8)) ?? ReferenceConfigs.smoke,
    ]
    static let tokens: [String] = [
        "[", "]", "{", "}", "- ", ": ", "&a ", "*a", "*zz", "!!binary ", "!!str ", "? ", "|", ">", "'", "\"", "#", "\t", "\n",
        "\u{0}", "\u{7}", "\u{1b}[31m", "\u{feff}", "\u{202e}", "é", "💥", "\\", "%YAML 1.1\n", "---\n", "...\n", ",", "%",
        "-1", "0", "65536", "99999999999999999999", "1e309", "0x10", ".nan", ".inf", "~", "null", "true", "yes", "on",
        "0.0.0.0:0", "[::]:0", "[fe80::1%eth0]:53", "255.255.255.255:9", "224.0.0.1:9", "127.0.0.1:99999", "::1:80",
        String(repeating: "a", count: 100_000), String(repeating: "[", count: 100), String(repeating: "- ", count: 300),
        "a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n",
    ]

    var random: SeededRandom

    mutating func mutate() -> [UInt8] {
        var bytes = Array(Self.seeds.randomElement(using: &random)!.utf8)
        for _ in 0..<Int.random(in: 1...4, using: &random) { bytes = mutateOnce(bytes) }
        return bytes
    }

    private mutating func offset(_ bytes: [UInt8]) -> Int { bytes.isEmpty ? 0 : Int.random(in: 0...bytes.count, using: &random) }

    private mutating func mutateOnce(_ input: [UInt8]) -> [UInt8] {
        var bytes = input
        switch Int.random(in: 0..<8, using: &random) {
        case 0:  // truncate
            bytes = Array(bytes.prefix(offset(bytes)))
        case 1:  // delete a range
            let start = offset(bytes)
            bytes.removeSubrange(start..<min(bytes.count, start + Int.random(in: 1...20, using: &random)))
        case 2:  // random bytes, any value
            let insert = (0..<Int.random(in: 1...8, using: &random)).map { _ in UInt8.random(in: 0...255, using: &random) }
            bytes.insert(contentsOf: insert, at: offset(bytes))
        case 3:  // a token
            bytes.insert(contentsOf: Array(Self.tokens.randomElement(using: &random)!.utf8), at: offset(bytes))
        case 4:  // a value replaced
            var lines = bytes.split(separator: 10, omittingEmptySubsequences: false).map(Array.init)
            let index = Int.random(in: 0..<max(1, lines.count), using: &random)
            if index < lines.count, let colon = lines[index].firstIndex(of: 58) {
                lines[index] = Array(lines[index][...colon]) + Array((" " + Self.tokens.randomElement(using: &random)!).utf8)
            }
            bytes = Array(lines.joined(separator: [10]))
        case 5:  // a line duplicated, or two swapped
            var lines = bytes.split(separator: 10, omittingEmptySubsequences: false).map(Array.init)
            guard lines.count > 1 else { break }
            let a = Int.random(in: 0..<lines.count, using: &random), b = Int.random(in: 0..<lines.count, using: &random)
            if Bool.random(using: &random) { lines.insert(lines[a], at: b) } else { lines.swapAt(a, b) }
            bytes = Array(lines.joined(separator: [10]))
        case 6:  // indentation changed
            var lines = bytes.split(separator: 10, omittingEmptySubsequences: false).map(Array.init)
            let index = Int.random(in: 0..<max(1, lines.count), using: &random)
            if index < lines.count {
                if Bool.random(using: &random) {
                    lines[index] = [UInt8](repeating: 32, count: Int.random(in: 1...9, using: &random)) + lines[index]
                } else {
                    lines[index] = Array(lines[index].drop { $0 == 32 })
                }
            }
            bytes = Array(lines.joined(separator: [10]))
        default:  // one byte flipped
            if !bytes.isEmpty { bytes[Int.random(in: 0..<bytes.count, using: &random)] ^= UInt8(1 << Int.random(in: 0..<8, using: &random)) }
        }
        return bytes
    }
}

@Suite("Reliability: configurations", .serialized)
struct ConfigReliabilityTests {
    /// A configuration error names a key, or the line for errors of the whole document.
    static func namesKeyOrLine(_ error: ConfigError) -> Bool {
        guard !error.key.isEmpty else { return false }
        if error.key != "(document)" || error.line != nil { return true }
        return error.problem.contains("empty") || error.problem.contains("bytes") || error.problem.contains("not valid YAML")
    }

    @Test("Mutated configurations through the parser: no crash, no hang, every error names a key or line on one printable line")
    func inProcess() throws {
        let count = Reliability.scale(3_000, 50_000)
        var mutator = ConfigMutator(random: SeededRandom(state: 0x5EED_0001))
        var (valid, invalid, named) = (0, 0, 0)
        var keys: [String: Int] = [:]
        let started = ContinuousClock.now
        for index in 0..<count {
            let text = String(decoding: mutator.mutate(), as: UTF8.self)
            do {
                try ConfigParser.parse(text).validate(localAddresses: [])
                valid += 1
            } catch {
                invalid += 1
                if Self.namesKeyOrLine(error) { named += 1 }
                keys[error.key.split(separator: "[").first.map(String.init) ?? error.key, default: 0] += 1
                #expect(Self.namesKeyOrLine(error), "#\(index): \(error)")
                #expect(!error.description.contains("\n") && error.description.unicodeScalars.allSatisfy { $0.value >= 0x20 && $0.value != 0x7f }, "#\(index): \(error.description.debugDescription)")
            }
        }
        let common = keys.filter { $0.value > 1 }.sorted { $0.value > $1.value }.prefix(8).map { "\($0.key) \($0.value)" }
        Reliability.report("config fuzz in-process: \(count) mutated files, \(valid) valid, \(invalid) refused (\(named) naming a key or line), in \(ContinuousClock.now - started); most named: \(common.joined(separator: ", "))")
    }

    @Test("Mutated configurations through udp-fanout --check: exit 0 or 2, one error line, no crash, no hang")
    func throughCheck() throws {
        let count = Reliability.scale(100, 10_000)
        var mutator = ConfigMutator(random: SeededRandom(state: 0x5EED_0002))
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("fuzz-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        var statuses: [Int32: Int] = [:]
        let started = ContinuousClock.now
        let parallel = 4
        for batch in Swift.stride(from: 0, to: count, by: parallel) {
            var running: [(Int, Child)] = []
            for index in batch..<min(count, batch + parallel) {
                let file = directory.appendingPathComponent("\(index % parallel).yaml")
                try Data(mutator.mutate()).write(to: file)
                running.append((index, try Child("udp-fanout", ["--check", "-c", file.path, "-l", "error"])))
            }
            for (index, child) in running {
                let status = child.wait(seconds: 20)
                statuses[status, default: 0] += 1
                #expect(child.process.terminationReason == .exit, "#\(index) crashed: \(child.stderr)")
                #expect(status == 0 || status == 2, "#\(index): exit \(status): \(child.stderr)")
                if status == 2 {
                    // Either one configuration error, or (a valid file) the preflight's problems, one line each.
                    let lines = child.stderr.split(separator: "\n").filter { $0.hasPrefix("udp-fanout: ") && !$0.hasPrefix("udp-fanout: note:") && !$0.contains("configuration warning") }
                    let errors = lines.filter { $0.contains("configuration error") }
                    #expect(errors.count == 1 || (errors.isEmpty && !lines.isEmpty), "#\(index): \(child.stderr)")
                }
            }
        }
        Reliability.report("config fuzz through --check: \(count) files, exits \(statuses.sorted { $0.key < $1.key }), in \(ContinuousClock.now - started)")
    }
}

/// Reads a sink on a thread of its own while a test sends, so nothing overflows its buffer.
final class ConcurrentSink: @unchecked Sendable {
    let sink: Sink
    private let lock = NSLock()
    private var sizes: [Int: Int] = [:]
    private var count = 0
    private var bytes = 0
    private var done = false
    private var thread: Thread?

    init(_ sink: Sink) {
        self.sink = sink
        let fd = sink.fd
        thread = Thread { [unowned self] in
            var buffer = [UInt8](repeating: 0, count: 65536)
            var descriptor = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
            var quietSince = ContinuousClock.now
            while ContinuousClock.now - quietSince < .milliseconds(500) || !lock.withLock({ done }) {
                guard poll(&descriptor, 1, 50) > 0 else { continue }
                while true {
                    let length = recv(fd, &buffer, buffer.count, Int32(MSG_DONTWAIT))
                    if length < 0 { break }
                    lock.withLock {
                        sizes[length, default: 0] += 1
                        count += 1
                        bytes += length
                    }
                }
                quietSince = ContinuousClock.now
            }
        }
        thread!.start()
    }

    /// Waits until nothing arrived for 500 ms after `finish()`; returns what arrived.
    func finish() -> (count: Int, bytes: Int, sizes: [Int: Int]) {
        lock.withLock { done = true }
        while !(thread?.isFinished ?? true) { usleep(20_000) }
        return lock.withLock { (count, bytes, sizes) }
    }
}

@Suite("Reliability: datagrams and faults", .serialized)
struct DatagramReliabilityTests {
    @Test("Datagrams of every size 0...65507 (IPv4) and up to 65527 (IPv6), from IPv4-mapped sources too: no crash, each counted once")
    func everySize() throws {
        let stride = Reliability.full ? 1 : 61
        var sizes = Array(Swift.stride(from: 0, through: 65507, by: stride))
        sizes += [1, 8999, 9000, 9001, 65506, 65507].filter { !sizes.contains($0) }
        let v4 = ConcurrentSink(try Sink())
        let v6 = ConcurrentSink(try Sink(ip: "::1"))
        let bind4 = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let wildcard6 = SocketAddress(ip: IPAddress("::")!, port: freePort())
        let daemon = try startDaemon("listeners:\n" + listenerYAML("v4", bind: bind4, [v4.sink], workers: 2)
            + listenerYAML("v6", bind: wildcard6, [v6.sink], extra: "    balancing: source_ip\n", workers: 2))
        defer { daemon.shutdown() }
        /// Sends `sizes` to `listener` at `address`, 20 at a time, each 20 only once the listener
        /// has read the ones before (at most 5 s): the receive buffer never holds more than 20
        /// datagrams (1.3 MB of payload, about twice that charged), so a busy machine slows the
        /// test instead of overflowing the queue. A wait that times out (datagrams missing, which
        /// the assertions below report, or a listener stalled that long) is reported, and pacing
        /// goes on from what did arrive.
        func send(_ family: Int32, to address: SocketAddress, _ sizes: [Int], listener: String) throws {
            let fd = socket(family, Int32(SOCK_DGRAM.rawValue), 0)
            defer { close(fd) }
            var buffer = [UInt8](repeating: 0x5a, count: 65536)
            let before = daemon.counters(of: listener)?.received ?? 0
            var missing: UInt64 = 0
            for (index, size) in sizes.enumerated() {
                let sent = address.withSockAddr { sendto(fd, &buffer, size, 0, $0, $1) }
                try #require(sent == size, "sendto \(size) bytes to \(address): errno \(errno)")
                if index % 20 == 19 || index == sizes.count - 1 {
                    let deadline = ContinuousClock.now + .seconds(5)
                    let expected = before + UInt64(index + 1) - missing
                    while (daemon.counters(of: listener)?.received ?? 0) < expected {
                        guard ContinuousClock.now < deadline else {
                            let received = daemon.counters(of: listener)?.received ?? 0
                            missing += expected - received
                            Reliability.report("sizes: \(listener) had read \(received - before) of \(index + 1) after 5 s; pacing goes on from there")
                            break
                        }
                        usleep(5_000)
                    }
                }
            }
        }
        try send(AF_INET, to: bind4, sizes, listener: "v4")
        // IPv4 clients of the dual-stack listener arrive with IPv4-mapped IPv6 sources.
        let mapped = sizes.filter { $0 % 7 == 0 }
        try send(AF_INET, to: SocketAddress(ip: IPAddress("127.0.0.1")!, port: wildcard6.port), mapped, listener: "v6")
        let large6 = Array(65508...65527)
        try send(AF_INET6, to: SocketAddress(ip: IPAddress("::1")!, port: wildcard6.port), large6, listener: "v6")
        let got4 = v4.finish(), got6 = v6.finish()
        let kept = sizes.filter { $0 <= 9000 }
        #expect(got4.count == kept.count, "every datagram up to max_packet_size forwarded once")
        #expect(got4.sizes == Dictionary(kept.map { ($0, 1) }, uniquingKeysWith: +), "each size once, whole")
        let counters4 = try #require(daemon.counters(of: "v4"))
        #expect(counters4.received == UInt64(sizes.count) && counters4.forwarded == UInt64(kept.count))
        #expect(counters4.dropped[.tooLarge] == UInt64(sizes.count - kept.count))
        #expect(counters4.bytesReceived == UInt64(sizes.reduce(0, +)), "real sizes counted")
        #expect(counters4.receiveQueueDrops == 0)
        let counters6 = try #require(daemon.counters(of: "v6"))
        let kept6 = mapped.filter { $0 <= 9000 }
        #expect(counters6.received == UInt64(mapped.count + large6.count))
        #expect(counters6.forwarded == UInt64(kept6.count) && got6.count == kept6.count)
        #expect(counters6.dropped[.tooLarge] == UInt64(mapped.count - kept6.count + large6.count))
        Reliability.report("sizes: \(sizes.count) IPv4 datagrams of sizes 0...65507 (stride \(stride)), \(mapped.count) from IPv4-mapped sources, \(large6.count) IPv6 of 65508...65527: received \(counters4.received + counters6.received), forwarded \(counters4.forwarded + counters6.forwarded), too_large \((counters4.dropped[.tooLarge] ?? 0) + (counters6.dropped[.tooLarge] ?? 0)), receive-queue drops \(counters4.receiveQueueDrops + counters6.receiveQueueDrops)")
    }

    @Test("A SIGHUP storm (valid, invalid and unappliable files) while forwarding at 20k pps: nothing lost (eBPF worker steering)", .enabled(if: Privileges.enabled, Privileges.reason))
    func sighupStorm() throws {
        let seconds = Reliability.scale(2, 10)
        let sinks = try (0..<2).map { _ in try Sink() }
        let receivers = sinks.map(ConcurrentSink.init)
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let metrics = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let (squatted, squatter) = try squattedAddress()
        defer { close(squatter) }
        let tail = "metrics: {enabled: true, bind: \"\(metrics)\"}\n"
        func listener(workers: Int, batch: Int) -> String {
            listenerYAML("storm", bind: bind, sinks, workers: workers).replacingOccurrences(of: "      recv_buf_size: 8388608\n", with: "      recv_buf_size: 8388608\n      batch_size: \(batch)\n")
        }
        let variants = [
            "listeners:\n" + listener(workers: 2, batch: 32) + tail,
            "listeners:\n  - name: broken\n    bind: [\n",
            "listeners:\n" + listener(workers: 3, batch: 16) + tail,
            "listeners:\n" + listener(workers: 2, batch: 32) + listenerYAML("squatted", bind: squatted, [sinks[0]]) + tail,
            "listeners:\n" + listener(workers: 1, batch: 64) + tail,
        ]
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("storm-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        try variants[0].write(to: file, atomically: true, encoding: .utf8)
        let daemon = try Child("udp-fanout", ["-c", file.path, "-l", "info"])
        try daemon.waitFor("entering receive loop")
        usleep(100_000)
        #expect(try httpGet(metrics, "/readyz").0 == 200)
        let total = 20_000 * seconds
        let publisher = try Child("publisher", ["127.0.0.1", String(bind.port), String(total), "--rate", "20000", "--sources", "127.0.5.1-127.0.5.50"])
        var hangups = 0
        while publisher.process.isRunning {
            usleep(100_000)
            try variants[hangups % variants.count].write(to: file, atomically: true, encoding: .utf8)
            daemon.signal(SIGHUP)
            hangups += 1
        }
        #expect(publisher.wait() == 0)
        let sent = try publisher.json().int("sent")
        let received = receivers.map { $0.finish().count }
        #expect(sent == total)
        // Every SIGHUP taken is answered (applied or rejected) before the counters are read.
        for _ in 0..<100 where !reloadsAnswered(daemon.stderr) { usleep(50_000) }
        let text = try httpGet(metrics, "/metrics").1
        // On a loss, the daemon's own counts say where it went (never received, dropped, or lost after a send).
        let counts = text.split(separator: "\n").filter { $0.hasPrefix("udp_fanout_packets_") && $0.contains("listener=\"storm\"") }
        #expect(received.reduce(0, +) == sent, "nothing lost across \(hangups) SIGHUPs: \(received); the daemon's counts: \(counts)")
        let ok = metric(text, "udp_fanout_config_reloads_total", "result=\"ok\"") ?? 0
        let rejected = metric(text, "udp_fanout_config_reloads_total", "result=\"rejected\"") ?? 0
        #expect(ok > 0 && rejected > 0, "both kinds happened: ok \(ok), rejected \(rejected)")
        #expect(metric(text, "udp_fanout_receive_queue_drops_total", "listener=\"storm\",mode=\"userspace\"") == 0)
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let logged = daemon.stderr.components(separatedBy: "configuration reload rejected").count - 1
        #expect(logged == rejected, "every rejection logged and counted: \(logged) logged, \(rejected) counted")
        Reliability.report("SIGHUP storm: \(sent) datagrams at 20k/s, \(hangups) SIGHUPs (\(ok) applied, \(rejected) rejected: invalid or unappliable), received \(received.reduce(0, +)), lost \(sent - received.reduce(0, +))")
    }

    @Test("Reloads rolled back under 100k pps, each after 16 new workers joined beside the running 2 (a later listener's bind is taken): the new workers' sockets close sealed, so every datagram sent is received or counted (sent = received + receive_queue_drops); an applied change seals the replaced workers' before their drain, a stop its workers' after it")
    func rollbackStorm() throws {
        let sink = try Sink()
        let receiver = ConcurrentSink(sink)
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let metrics = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let (squatted, squatter) = try squattedAddress()
        defer { close(squatter) }
        let tail = "metrics: {enabled: true, bind: \"\(metrics)\"}\n"
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("rollback-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        try ("listeners:\n" + listenerYAML("storm", bind: bind, [sink], workers: 2) + tail).write(to: file, atomically: true, encoding: .utf8)
        let daemon = try Child("udp-fanout", ["-c", file.path, "-l", "debug"])
        defer { daemon.stopIfRunning() }
        try daemon.waitFor("entering receive loop")
        // Every reload from now on starts the storm listener's 16 new workers (the newest sockets
        // on the bind, first in the kernel's hash chain), then fails at the squatted bind and
        // rolls back: the 16 close while the running 2 take the bind back.
        try ("listeners:\n" + listenerYAML("storm", bind: bind, [sink], workers: 16) + listenerYAML("squatted", bind: squatted, [sink]) + tail)
            .write(to: file, atomically: true, encoding: .utf8)
        let total = 300_000
        let publisher = try Child("publisher", ["127.0.0.1", String(bind.port), String(total), "--rate", "100000", "--sources", "127.0.6.1-127.0.6.50"])
        var hangups = 0
        while publisher.process.isRunning {
            usleep(50_000)
            daemon.signal(SIGHUP)
            hangups += 1
        }
        #expect(publisher.wait() == 0)
        let sent = try publisher.json().int("sent")
        let (text, received, drops) = try countsAfterReloads(daemon, metrics: metrics, labels: "listener=\"storm\",mode=\"userspace\"", sent: sent)
        let rejected = metric(text, "udp_fanout_config_reloads_total", "result=\"rejected\"") ?? 0
        let stoppedUnused = daemon.stderr.components(separatedBy: "new listener instance stopped unused").count - 1
        #expect(rejected >= 5 && stoppedUnused == rejected, "the reloads were rolled back after the new instance started: \(rejected) of \(hangups), \(stoppedUnused) new instances stopped unused")
        // Each rolled-back instance's 16 workers sealed their sockets (the running 2 never).
        let sealed = daemon.stderr.components(separatedBy: "worker socket sealed before its last read").count - 1
        #expect(sealed == 16 * stoppedUnused, "\(sealed) sockets sealed for \(stoppedUnused) rolled-back instances of 16 workers")
        // An applied change: the 2 workers it replaces seal theirs once the successor took over.
        try ("listeners:\n" + listenerYAML("storm", bind: bind, [sink], workers: 3) + tail).write(to: file, atomically: true, encoding: .utf8)
        let applied = daemon.stderr.components(separatedBy: "reload=true").count - 1
        daemon.signal(SIGHUP)
        for _ in 0..<100 where daemon.stderr.components(separatedBy: "worker socket sealed before its last read").count - 1 < sealed + 2 { usleep(50_000) }
        #expect(daemon.stderr.components(separatedBy: "reload=true").count - 1 == applied + 1, "the change applied")
        #expect(daemon.stderr.components(separatedBy: "worker socket sealed before its last read").count - 1 == sealed + 2, "the replaced workers sealed their sockets")
        #expect(sent == total)
        #expect(received + drops == sent, "sent \(sent): received \(received) + receive_queue_drops \(drops) across \(rejected) rollbacks (lost uncounted: \(sent - received - drops))")
        // A stop for good: the 3 running workers seal after their drain.
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let atStop = daemon.stderr.components(separatedBy: "worker socket sealed before its last read").count - 1 - (sealed + 2)
        #expect(atStop == 3 && daemon.stderr.contains("after its stop drain (the listener stops)"), "the stop sealed its 3 workers after their drain: \(atStop)")
        let delivered = receiver.finish().count
        Reliability.report("rollback storm: \(sent) datagrams at 100k/s, \(rejected) reloads rolled back (16 workers each), daemon received \(received), receive_queue_drops \(drops), delivered \(delivered)")
    }

    @Test("A socket that overflowed at the end of a burst: its drops are counted while the listener stays idle, not with its next datagram (sent = received + receive_queue_drops)",
          arguments: ["userspace", "relay"])
    func dropsAtBurstEndCounted(kind: String) throws {
        let sink = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let metrics = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        // The smallest receive buffer the kernel grants holds a few datagrams: the rest of the burst is dropped.
        let listener = listenerYAML("burst", bind: bind, [sink], extra: kind == "relay" ? "    replies: relay\n" : "")
            .replacingOccurrences(of: "recv_buf_size: 8388608", with: "recv_buf_size: 4096")
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("burst-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        try ("listeners:\n" + listener + "metrics: {enabled: true, bind: \"\(metrics)\"}\n").write(to: file, atomically: true, encoding: .utf8)
        let daemon = try Child("udp-fanout", ["-c", file.path, "-l", "info"])
        try daemon.waitFor("entering receive loop")
        // The worker cannot read while the burst arrives; then no datagram follows it.
        daemon.signal(SIGSTOP)
        let sent = 1000
        try sendNumbered(to: bind, count: sent)
        daemon.signal(SIGCONT)
        let labels = "listener=\"burst\",mode=\"userspace\""
        var text = ""
        for _ in 0..<50 {
            text = try httpGet(metrics, "/metrics").1
            let received = metric(text, "udp_fanout_packets_received_total", labels) ?? 0
            let drops = metric(text, "udp_fanout_receive_queue_drops_total", labels) ?? 0
            if received + drops == sent { break }
            usleep(100_000)
        }
        let received = metric(text, "udp_fanout_packets_received_total", labels) ?? -1
        let drops = metric(text, "udp_fanout_receive_queue_drops_total", labels) ?? -1
        #expect(drops > 0 && received + drops == sent, "\(sent) sent: \(received) received, \(drops) counted as receive_queue_drops")
        #expect(sink.drain().count == received, "every datagram read was forwarded")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
    }

    @Test("A listener kept saturated (its socket never empty, so the worker's turn never ends): its receive-queue drops are counted while the flood goes on, not only once it stops (batch_size 1 against a GSO sender)")
    func dropsCountedUnderSaturation() throws {
        let sink = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let metrics = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        // One datagram per receive and send: the worker is far slower than a GSO sender, so its
        // queue stays full and drops for as long as the flood lasts.
        let listener = listenerYAML("flood", bind: bind, [sink])
            .replacingOccurrences(of: "recv_buf_size: 8388608", with: "recv_buf_size: 1048576\n      batch_size: 1")
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("flood-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        try ("listeners:\n" + listener + "metrics: {enabled: true, bind: \"\(metrics)\"}\n").write(to: file, atomically: true, encoding: .utf8)
        let daemon = try Child("udp-fanout", ["-c", file.path, "-l", "info"])
        defer {
            daemon.signal(SIGTERM)
            _ = daemon.wait()
        }
        try daemon.waitFor("entering receive loop")
        let publisher = try Child("publisher", ["127.0.0.1", "\(bind.port)", "20000000", "--gso", "--batch", "64"])
        defer {
            publisher.signal(SIGTERM)
            _ = publisher.wait()
        }
        let labels = "listener=\"flood\",mode=\"userspace\""
        var during: (received: Int, drops: Int) = (0, 0)
        for _ in 0..<100 {
            usleep(100_000)
            guard publisher.process.isRunning else { break }
            let text = try httpGet(metrics, "/metrics").1
            during = (metric(text, "udp_fanout_packets_received_total", labels) ?? 0, metric(text, "udp_fanout_receive_queue_drops_total", labels) ?? 0)
            if during.received > 0 && during.drops > 0 { break }
        }
        let stillFlooding = publisher.process.isRunning
        #expect(stillFlooding, "the flood outlasted the check (20,000,000 datagrams)")
        #expect(during.received > 0 && during.drops > 0, "while the flood went on: \(during.received) received, \(during.drops) counted as receive_queue_drops")
    }

    @Test("kill -9 at random moments under load, then restart: the bind is free at once, nothing pinned, every datagram after the restart forwarded")
    func killLoop() throws {
        let rounds = Reliability.scale(3, 25)
        var random = SeededRandom(state: 0x5EED_0003)
        let sink = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("kill-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        try ("listeners:\n" + listenerYAML("crash", bind: bind, [sink], workers: 2)).write(to: file, atomically: true, encoding: .utf8)
        // Userspace workers pin nothing (process-private groups); the kernel frees the sockets.
        let pins = { (try? FileManager.default.contentsOfDirectory(atPath: "/sys/fs/bpf/reuseportlb"))?.filter { $0.contains("-\(bind.port)-") } ?? [] }
        let sockets = { (try? run("/usr/bin/ss", ["-Huan", "sport = :\(bind.port)"]).output)?.split(separator: "\n").count ?? -1 }
        for round in 0..<rounds {
            let daemon = try Child("udp-fanout", ["-c", file.path, "-l", "info"])
            try daemon.waitFor("entering receive loop")
            let load = try Child("publisher", ["127.0.0.1", String(bind.port), "100000", "--rate", "20000"])
            usleep(UInt32.random(in: 50_000...400_000, using: &random))
            daemon.signal(SIGKILL)
            _ = daemon.wait()
            load.signal(SIGTERM)
            _ = load.wait()
            _ = sink.drain(quiet: .milliseconds(100))
            #expect(pins().isEmpty, "round \(round): nothing pinned")
            #expect(sockets() == 0, "round \(round): no socket left on the bind")
            let again = try Child("udp-fanout", ["-c", file.path, "-l", "info"])
            try again.waitFor("entering receive loop")
            try sendNumbered(to: bind, count: 200)
            #expect(sink.drain().count == 200, "round \(round): forwarding after restart")
            again.signal(SIGTERM)
            #expect(again.wait() == 0)
        }
        Reliability.report("kill -9 loop (userspace): \(rounds) rounds under 20k pps, restart each time: bind free at once, nothing pinned, 200/200 forwarded after every restart")
    }

    @Test("An exhausted open-file limit gives a start error naming the limit and the fix")
    func fileLimit() throws {
        let sink = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("nofile-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        try ("listeners:\n" + listenerYAML("fds", bind: bind, [sink], workers: 64)).write(to: file, atomically: true, encoding: .utf8)
        let child = try Child("udp-fanout", ["-c", file.path], prefix: ["/usr/bin/prlimit", "--nofile=40:40"])
        #expect(child.wait(seconds: 10) == 1)
        #expect(child.stderr.contains("open-file limit"), "\(child.stderr)")
        #expect(child.stderr.contains("ulimit -n"), "names the fix: \(child.stderr)")
    }
}
