// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// `GET /status` and `udp-fanout status`: the model, the rates and the screen, then the command
/// as an operator runs it, in tmux against a daemon forwarding traffic.
@Suite("status")
struct StatusTests {
    static func downstream(_ name: String, forwarded: UInt64, bytes: UInt64, health: String? = "up") -> DownstreamStatus {
        DownstreamStatus(
            name: name, address: "127.0.0.1:9", source: "static", weight: 1, inRotation: health != "down", health: health, healthSince: 1_000,
            forwarded: forwarded, bytes: bytes, dropped: 0, droppedByReason: nil, replySent: nil)
    }

    static func report(time: Double, received: UInt64, tooLarge: UInt64, sink: UInt64, pid: Int32 = 7) -> StatusReport {
        let listener = ListenerStatus(
            name: "syslog", mode: "userspace", bind: "127.0.0.1:5514", balancing: "round_robin", replies: "none", running: true,
            received: received, bytesReceived: received * 100, forwarded: received - tooLarge, bytesForwarded: (received - tooLarge) * 100,
            noHealthy: 0, receiveQueueDrops: 0, dropped: tooLarge == 0 ? [:] : ["too_large": tooLarge],
            downstreams: [downstream("sink-1", forwarded: sink, bytes: sink * 100), downstream("sink-2", forwarded: 0, bytes: 0, health: "down")],
            pools: [])
        return StatusReport(
            version: "1.2.3", pid: pid, startedAt: 900, time: time, monotonic: time - 800, ready: true, notReady: [], healthy: true, problems: [],
            reloads: Reloads(ok: 2, rejected: 1), healthProtocol: "udp_echo", healthIntervalSecs: 1, listeners: [listener])
    }

    @Test("Rates between two reports per second, per reason and per downstream; none across a restart or for a counter that went back; the JSON keeps every field (snake_case) and reads back equal")
    func rates() throws {
        let before = Self.report(time: 1_000, received: 1_000, tooLarge: 10, sink: 500)
        let after = Self.report(time: 1_002, received: 5_000, tooLarge: 30, sink: 2_500)
        let report = StatusView.rates(from: before, to: after)
        #expect(report.intervalSeconds == 2)
        let rates = try #require(report.listeners[0].rates)
        #expect(rates.received == 2_000 && rates.bytesReceived == 200_000 && rates.forwarded == 1_990 && rates.dropped == 10)
        #expect(rates.droppedByReason == ["too_large": 10])
        #expect(report.listeners[0].downstreams[0].rates?.forwarded == 1_000 && report.listeners[0].downstreams[1].rates?.forwarded == 0)
        // Another process (a restart): no rates at all, rather than a negative or a huge one.
        let restarted = StatusView.rates(from: before, to: Self.report(time: 1_002, received: 5, tooLarge: 0, sink: 1, pid: 8))
        #expect(restarted.listeners[0].rates == nil && restarted.intervalSeconds == nil)
        let back = StatusView.rates(from: after, to: Self.report(time: 1_003, received: 6_000, tooLarge: 30, sink: 100))
        #expect(back.listeners[0].downstreams[0].rates?.forwarded == nil && back.listeners[0].rates?.received == 1_000)

        let json = report.json()
        #expect(json.contains("\"bytes_received\":") && json.contains("\"health_since\":") && json.contains("\"reloads\":{\"ok\":2,\"rejected\":1}"), "\(json)")
        #expect(try StatusReport.decode(Array(json.utf8)) == report)
    }

    @Test("The screen: the daemon's line (version, endpoint, ready, reloads), per listener its rates and drops by reason, a row per downstream with source, health and since when, '-' where no rate is known yet")
    func screen() {
        let report = StatusView.rates(
            from: Self.report(time: 1_000, received: 1_000, tooLarge: 10, sink: 500),
            to: Self.report(time: 1_002, received: 5_000, tooLarge: 30, sink: 2_500))
        let screen = StatusView.render(report, endpoint: "http://127.0.0.1:9090")
        let lines = screen.split(separator: "\n").map(String.init)
        #expect(lines[0].hasPrefix("udp-fanout 1.2.3 at http://127.0.0.1:9090  pid 7  up 1m42s  ready  reloads 2 ok, 1 rejected"), "\(screen)")
        #expect(screen.contains("health: udp_echo probes every 1 s"))
        #expect(screen.contains("LISTENER syslog  userspace  127.0.0.1:5514  round_robin\n"), "\(screen)")
        #expect(screen.contains("  in  2.0k dgram/s  200.0 kB/s   out 2.0k dgram/s  199.0 kB/s   dropped 10/s"), "\(screen)")
        #expect(screen.contains("  total in 5,000 (500,000 B), out 4,970 (497,000 B)"), "\(screen)")
        #expect(screen.contains("  drops: too_large 10/s (30 total)"), "\(screen)")
        let row = try? #require(lines.first { $0.hasPrefix("  sink-1") })
        #expect(row?.split(separator: " ", omittingEmptySubsequences: true) == ["sink-1", "127.0.0.1:9", "static", "up", "2s", "1.0k", "100.0", "kB", "0", "0"], "\(screen)")
        #expect(lines.contains { $0.hasPrefix("  sink-2") && $0.contains("down 2s") }, "\(screen)")
        // The first screen of --watch: no rates yet.
        let first = StatusView.render(Self.report(time: 1_000, received: 1_000, tooLarge: 0, sink: 500), endpoint: "http://x")
        #expect(first.contains("  in  - dgram/s  -/s   out - dgram/s  -/s"), "\(first)")
        #expect(StatusView.grouped(1_234_567) == "1,234,567" && StatusView.grouped(999) == "999" && StatusView.grouped(1_000) == "1,000")
        #expect(StatusView.count(0.5) == "0.5" && StatusView.count(999) == "999" && StatusView.count(1_250_000) == "1.3M")
        #expect(StatusView.duration(59) == "59s" && StatusView.duration(3_661) == "1h01m" && StatusView.duration(90_000) == "1d01h")
    }

    @Test("The endpoint of a configuration: metrics.bind, a wildcard read as loopback (IPv4 and IPv6); none when metrics are off, with the fix")
    func endpoint() throws {
        var config = try ConfigParser.parse("""
            listeners:
              - name: a
                bind: "127.0.0.1:5514"
                downstream:
                  - address: "127.0.0.1:9"
            metrics:
              enabled: true
              bind: "0.0.0.0:9191"
            """)
        #expect(try StatusClient.endpoint(of: config, path: "c.yaml") == "http://127.0.0.1:9191")
        config.metrics.bind = SocketAddress("[::]:9191")!
        #expect(try StatusClient.endpoint(of: config, path: "c.yaml") == "http://[::1]:9191")
        config.metrics.bind = SocketAddress("[2001:db8::5]:9191")!
        #expect(try StatusClient.endpoint(of: config, path: "c.yaml") == "http://[2001:db8::5]:9191")
        config.metrics.bind = SocketAddress("198.18.0.1:80")!
        #expect(try StatusClient.endpoint(of: config, path: "c.yaml") == "http://198.18.0.1:80")
        // Another server's answer in an error line: one short line, an HTML page named as such.
        #expect(StatusClient.excerpt(Array("<!DOCTYPE HTML>\n<html>\n  <body>404</body>".utf8)) == "an HTML page")
        #expect(StatusClient.excerpt(Array("not\n  found\n".utf8)) == "not found")
        #expect(StatusClient.excerpt(Array("a\u{1b}[2Jb".utf8)) == "a?[2Jb", "no terminal escape reaches stderr")
        #expect(StatusClient.excerpt(Array(String(repeating: "x", count: 500).utf8)) == String(repeating: "x", count: 120) + "…")
        // --endpoint: with or without the scheme or /status; another scheme or path is refused with the fix.
        #expect(try StatusClient.statusURL("127.0.0.1:9191") == "http://127.0.0.1:9191/status")
        #expect(try StatusClient.statusURL("http://[::1]:9191/") == "http://[::1]:9191/status")
        #expect(try StatusClient.statusURL("HTTP://h:1/status") == "http://h:1/status")
        for (bad, said) in [("https://h:1", "only http://"), ("http://h:1/metrics", "'/metrics' is a path"), ("http://", "no HOST:PORT"), ("not a url", "no HOST:PORT")] {
            #expect {
                try StatusClient.statusURL(bad)
            } throws: { error in
                "\(error)".contains(said) && "\(error)".contains("http://HOST:PORT")
            }
        }
        // metrics.bind needs a fixed port.
        #expect {
            try ConfigParser.parse("listeners: []\nmetrics:\n  enabled: true\n  bind: \"127.0.0.1:0\"\n")
        } throws: { error in
            "\(error)".contains("metrics.bind") && "\(error)".contains("port 0")
        }
        // metrics.path may not hide /status (or the other paths the endpoint serves).
        for reserved in Metrics.reservedPaths {
            #expect(throws: ConfigError.self) { try ConfigParser.parse("listeners: []\nmetrics:\n  enabled: true\n  path: \(reserved)\n") }
        }
        // A directory given as the file: its read error, not "empty".
        #expect {
            try StatusClient.endpoint(configFile: "/tmp")
        } throws: { error in
            "\(error)".contains("cannot read /tmp: Is a directory") && "\(error)".contains("--endpoint")
        }
        config.metrics.enabled = false
        #expect {
            try StatusClient.endpoint(of: config, path: "c.yaml")
        } throws: { error in
            "\(error)".contains("c.yaml has no HTTP endpoint (metrics.enabled is false)") && "\(error)".contains("--endpoint")
        }
    }

    /// Runs tmux on a server of its own (`-L`).
    static func tmux(_ socket: String, _ arguments: [String]) throws -> (status: Int32, output: String) {
        try run("/usr/bin/tmux", ["-L", socket] + arguments)
    }

    /// Starts tmux's server with a session running `command`. Spawned without Foundation's
    /// Process: the server it forks outlives the client, which stalls Process's reaping.
    static func tmuxSession(_ socket: String, _ session: String, _ command: [String]) throws -> Int32? {
        let log = FileManager.default.temporaryDirectory.appendingPathComponent("\(socket).log").path
        defer { try? FileManager.default.removeItem(atPath: log) }
        let client = try SpawnedProcess(["/usr/bin/tmux", "-L", socket, "new-session", "-d", "-s", session, "-x", "150", "-y", "50"] + command, log: log)
        return client.wait(seconds: 10)
    }

    @Test("udp-fanout status --watch in tmux against a daemon forwarding traffic: the screen shows each listener's rates, drops by reason, every downstream with its source and health (one down), relay sessions; --json the same with rates; clear errors when no daemon answers or metrics are off")
    func watchInTmux() async throws {
        guard FileManager.default.isExecutableFile(atPath: "/usr/bin/tmux") else {
            #expect(ProcessInfo.processInfo.environment["CI"] != "true", "tmux is missing under CI (scripts/setup.sh installs it)")
            return
        }
        let (listen, relay, metrics) = (freePort(), freePort(), freePort())
        let sinks = (0..<3).map { _ in freePort() }
        let (echoPort, dead) = (freePort(), freePort())
        let file = try TCFixtures.write("""
            listeners:
              - name: events
                bind: "127.0.0.1:\(listen)"
                downstream:
                  - { name: sink-1, address: "127.0.0.1:\(sinks[0])" }
                  - { name: sink-2, address: "127.0.0.1:\(sinks[1])" }
                  - { name: sink-3, address: "127.0.0.1:\(sinks[2])" }
                  - { name: gone, address: "127.0.0.1:\(dead)" }
                settings:
                  max_packet_size: 1000
                  workers: 1
              - name: queries
                bind: "127.0.0.1:\(relay)"
                replies: relay
                downstream:
                  - { name: echo, address: "127.0.0.1:\(echoPort)" }
            health:
              enabled: true
              protocol: udp_echo
              interval_secs: 1
              timeout_secs: 1
              fall: 1
            metrics:
              enabled: true
              bind: "0.0.0.0:\(metrics)"
            """, "status-watch")
        defer { try? FileManager.default.removeItem(at: file) }
        // Echo servers answer the udp_echo probes (and the relay's requests); nothing listens on `dead`.
        let servers = try sinks.enumerated().map { index, port in
            try Child("collector", ["127.0.0.1", "\(port)", "0", "1", "--echo", "--tag", "s\(index)"])
        } + [try Child("collector", ["127.0.0.1", "\(echoPort)", "0", "1", "--echo", "--tag", "e"])]
        defer { for server in servers { server.signal(SIGTERM); _ = server.wait() } }
        for server in servers { try server.waitFor("ready") }
        let daemon = try Child("udp-fanout", ["-c", file.path])
        defer {
            daemon.signal(SIGTERM)
            _ = daemon.wait()
        }
        try daemon.waitFor("downstream marked unhealthy", seconds: 15)

        // Traffic for the whole capture, bounded: small datagrams and some above max_packet_size.
        let small = try Child("publisher", ["127.0.0.1", "\(listen)", "60000", "--rate", "5000", "--duration", "20", "--sources", "127.0.1.1-127.0.1.32"])
        let large = try Child("publisher", ["127.0.0.1", "\(listen)", "2000", "--rate", "100", "--duration", "20", "--size", "2000"])
        let clients = try Child("publisher", ["127.0.0.1", "\(relay)", "2000", "--exchange", "--clients", "4", "--duration", "20"])
        defer { for child in [small, large, clients] { child.signal(SIGTERM); _ = child.wait() } }

        let socket = "udp-fanout-status-\(getpid())-\(metrics)"
        let command = [binaryDirectory.appendingPathComponent("udp-fanout").path, "status", "--watch", "-c", file.path]
        #expect(try Self.tmuxSession(socket, "status", command) == 0)
        defer { _ = try? Self.tmux(socket, ["kill-server"]) }
        // A screen with rates (the second frame on) and every listener; up to 15 s.
        var screen = ""
        let deadline = ContinuousClock.now + .seconds(15)
        while ContinuousClock.now < deadline {
            try await Task.sleep(for: .milliseconds(500))
            screen = try Self.tmux(socket, ["capture-pane", "-p", "-t", "status"]).output
            if screen.contains("LISTENER queries") && screen.contains("drops: too_large") && !screen.contains("in  - dgram/s") && screen.contains("sessions 4") { break }
        }
        let shown = screen.split(separator: "\n", omittingEmptySubsequences: false).reversed().drop { $0.trimmingCharacters(in: .whitespaces).isEmpty }.reversed()
        FileHandle.standardError.write(Data("status: the screen of `udp-fanout status --watch` in tmux:\n\(shown.joined(separator: "\n"))\n".utf8))
        let lines = screen.split(separator: "\n").map(String.init)
        #expect(lines.first?.hasPrefix("udp-fanout \(ProjectVersion.string) at http://127.0.0.1:\(metrics)  pid \(daemon.process.processIdentifier)  up ") == true, "\(screen)")
        #expect(lines.first?.contains("  ready  reloads 0 ok, 0 rejected") == true, "\(screen)")
        #expect(screen.contains("health: udp_echo probes every 1 s"), "\(screen)")
        #expect(screen.contains("LISTENER events  userspace  127.0.0.1:\(listen)  round_robin"), "\(screen)")
        #expect(screen.contains("LISTENER queries  userspace  127.0.0.1:\(relay)  round_robin  replies relay"), "\(screen)")
        // Rates: about 5,000/s in; the exact figure depends on the moment.
        let rateLine = lines.first { $0.hasPrefix("  in  ") }
        #expect(rateLine.map { !$0.hasPrefix("  in  0 dgram/s") && !$0.hasPrefix("  in  - dgram/s") } == true, "\(screen)")
        #expect(lines.contains { $0.hasPrefix("  drops: too_large ") && $0.contains(" total)") }, "\(screen)")
        for (index, port) in sinks.enumerated() {
            let row = lines.first { $0.hasPrefix("  sink-\(index + 1) ") }
            #expect(row?.contains("127.0.0.1:\(port)") == true && row?.contains(" static ") == true && row?.contains(" up ") == true, "\(screen)")
        }
        #expect(lines.contains { $0.hasPrefix("  gone ") && $0.contains("127.0.0.1:\(dead)") && $0.contains(" down ") }, "\(screen)")
        #expect(lines.contains { $0.hasPrefix("  sessions 4 ") }, "\(screen)")
        #expect(lines.contains { $0.hasPrefix("  echo ") && $0.contains(" up ") }, "\(screen)")
        // Ctrl-C ends it, as it ends top.
        _ = try Self.tmux(socket, ["send-keys", "-t", "status", "C-c"])
        // The pane closes with its command, and the session with it: capture-pane then fails.
        var after = try Self.tmux(socket, ["capture-pane", "-p", "-t", "status"])
        let stopBy = ContinuousClock.now + .seconds(10)
        while after.status == 0 && after.output.contains("LISTENER") && ContinuousClock.now < stopBy {
            try await Task.sleep(for: .milliseconds(100))
            after = try Self.tmux(socket, ["capture-pane", "-p", "-t", "status"])
        }
        #expect(after.status != 0 || !after.output.contains("LISTENER"), "still drawing after Ctrl-C: \(after.output)")

        // --json: one report with rates, for scripts.
        let json = try Child("udp-fanout", ["status", "-c", file.path, "--json", "--interval", "0.5"])
        #expect(json.wait() == 0, "\(json.stderr)")
        let report = try StatusReport.decode(Array(json.stdout.utf8))
        #expect(report.intervalSeconds != nil && report.pid == daemon.process.processIdentifier)
        let events = try #require(report.listeners.first { $0.name == "events" })
        #expect((events.rates?.received ?? 0) > 0 && events.dropped["too_large", default: 0] > 0, "\(json.stdout)")
        #expect(events.downstreams.map(\.health) == ["up", "up", "up", "down"] && events.downstreams.map(\.inRotation) == [true, true, true, false])
        #expect(report.listeners.first { $0.name == "queries" }?.associations == 4)

        // No daemon there, and a configuration without an endpoint: exit 1 and 2, each naming the fix.
        let nobody = try Child("udp-fanout", ["status", "--endpoint", "http://127.0.0.1:\(freePort())"])
        #expect(nobody.wait() == 1)
        #expect(nobody.stderr.contains("udp-fanout status: cannot reach udp-fanout at http://127.0.0.1:") && nobody.stderr.contains("is udp-fanout running"), "\(nobody.stderr)")
        let off = try TCFixtures.write("listeners:\n  - name: a\n    bind: \"127.0.0.1:\(listen)\"\n    downstream:\n      - address: \"127.0.0.1:9\"\n", "status-off")
        defer { try? FileManager.default.removeItem(at: off) }
        let disabled = try Child("udp-fanout", ["status", "-c", off.path])
        #expect(disabled.wait() == 2)
        #expect(disabled.stderr.contains("has no HTTP endpoint (metrics.enabled is false)"), "\(disabled.stderr)")
    }
}
