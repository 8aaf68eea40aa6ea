// SPDX-License-Identifier: Apache-2.0
import ArgumentParser
import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// `udp-fanout status`: a running daemon's listeners and downstreams now, from its `GET /status`.
struct Status: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Show a running udp-fanout: rates, drops by reason, health and membership of every listener and downstream.",
        discussion: """
            Reads GET /status from the daemon's HTTP endpoint twice, --interval apart, and prints \
            the rates in between: per listener datagrams/s and bytes/s in and out, drops by reason, \
            associations or sessions of two-way listeners; per downstream its address, where it \
            came from (static, dns, kubernetes), its health and since when, and its rates. The \
            endpoint is metrics.bind of the configuration the daemon runs with (-c, as for the \
            daemon; a wildcard address is read as loopback) or --endpoint. --watch redraws the \
            screen every --interval, as top does, until interrupted (Ctrl-C); --json prints one \
            report with the rates as JSON, for scripts (docs/udp-fanout.md, "Status"). Exit status: \
            0 shown, 1 no daemon answered, 2 the file cannot be read or has no endpoint, 64 usage.
            """)

    @OptionGroup var daemon: DaemonEndpoint

    @Flag(help: "Redraw every --interval until interrupted.")
    var watch = false

    @Flag(help: "Print one report, with the rates, as JSON.")
    var json = false

    @Option(help: "Seconds between the two reads that give the rates, and between redraws (0.1 to 3600).")
    var interval: Double = 1

    func validate() throws {
        guard interval >= 0.1 && interval <= 3600 else {
            throw ValidationError("--interval \(interval) is out of range: give seconds from 0.1 to 3600")
        }
        guard !(watch && json) else { throw ValidationError("--watch and --json do not go together: --json prints one report") }
    }

    func run() async throws {
        let url = try daemon.url("status")
        let pause = Duration.milliseconds(Int64((interval * 1000).rounded()))
        guard watch else {
            do {
                let first = try await StatusClient.fetch(url)
                try await Task.sleep(for: pause)
                let report = StatusView.rates(from: first, to: try await StatusClient.fetch(url))
                if json { print(report.json(pretty: true)) } else { print(StatusView.render(report, endpoint: url), terminator: "") }
            } catch let error as StatusClientError {
                printError("udp-fanout status: \(error)")
                throw ExitCode(1)
            }
            return
        }
        var previous: StatusReport?
        while true {
            var screen: String
            do {
                let report = try await StatusClient.fetch(url)
                screen = StatusView.render(previous.map { StatusView.rates(from: $0, to: report) } ?? report, endpoint: url)
                previous = report
            } catch {
                // The daemon restarting or gone: said on the screen, and tried again.
                screen = "udp-fanout status: \(error)\n"
                previous = nil
            }
            // Home and clear, then the screen, as top redraws: one write, so no half screen shows.
            var frame = "\u{1B}[H\u{1B}[2J" + screen
            frame.withUTF8 { _ = write(1, $0.baseAddress, $0.count) }
            try await Task.sleep(for: pause)
        }
    }
}
