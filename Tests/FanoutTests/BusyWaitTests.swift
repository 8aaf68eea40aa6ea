// SPDX-License-Identifier: Apache-2.0
import Foundation
import Logging
import Testing
@testable import FanoutCore
import ReusePortLB
import SystemCalls
import TestSupport

/// A ``ReceiveLoopBody`` whose waits return what its script says, in order (then `.timedOut`),
/// recording the timeout each wait was asked for. A `.source` wait has one datagram to receive.
/// `stopWhen` sees each wait's timeout and the number of waits so far; true sets the stop signal.
private final class ScriptedBody: ReceiveLoopBody, @unchecked Sendable {
    var waits: [Int32] = []
    var script: [ReceiveLoop.Readiness]
    var toReceive = 0
    var forwarded = 0
    let stop: StopSignal
    let stopWhen: (Int32, Int) -> Bool

    init(_ script: [ReceiveLoop.Readiness], stop: StopSignal, stopWhen: @escaping (Int32, Int) -> Bool) {
        self.script = script
        self.stop = stop
        self.stopWhen = stopWhen
    }

    /// Batches a turn takes before the loop looks again (`.max`: until the source is empty).
    var batchesPerTurn = Int.max

    func receiveBatch() throws(SystemCallError) -> Int {
        guard toReceive > 0 else { return 0 }
        toReceive -= 1
        return 1
    }

    func adoptPlanIfChanged() {}
    func forward(_ count: Int) { forwarded += count }

    func wait(milliseconds: Int32) -> ReceiveLoop.Readiness {
        waits.append(milliseconds)
        if stopWhen(milliseconds, waits.count) { stop.set() }
        guard !script.isEmpty else { return .timedOut }
        let next = script.removeFirst()
        if next == .source { toReceive += 1 }
        return next
    }

    func idle() {}
    func endOfTurn() {}
    func everySecond() {}
}

@Suite("settings.busy_wait_us: the receive loop polls before it sleeps")
struct BusyWaitTests {
    private func loop(_ stop: StopSignal, window: Duration?, _ counters: BusyWaitCounters) -> ReceiveLoop {
        ReceiveLoop(stop: stop, logger: Logger(label: "busy-wait-test"), metadata: [:], drainLimit: .milliseconds(50),
                    busyWait: window.map { ($0, counters) })
    }

    @Test("After a turn with traffic the loop polls (timeout 0) and serves what comes within the window: counted found, no sleep between")
    func pollFindsTraffic() {
        let stop = StopSignal()
        let counters = BusyWaitCounters()
        // The third poll finds a datagram; the loop then polls again until the stop (the 12th wait).
        let body = ScriptedBody([.source, .timedOut, .timedOut, .source], stop: stop) { _, count in count >= 12 }
        loop(stop, window: .seconds(5), counters).run(body)
        #expect(Array(body.waits.prefix(12)) == [100] + Array(repeating: 0, count: 11), "\(body.waits)")
        #expect(body.forwarded == 2)
        #expect(counters.found.load(ordering: .relaxed) == 1)
        // The second poll ended at the stop: not counted slept, and no sleep after it (only the
        // stop drain's 20 ms wait).
        #expect(counters.slept.load(ordering: .relaxed) == 0)
        #expect(!body.waits.contains(100) || body.waits.lastIndex(of: 100) == 0, "\(body.waits.suffix(3))")
        #expect(counters.nanoseconds.load(ordering: .relaxed) > 0)
        let shown = counters.shown.load(ordering: .relaxed)
        #expect(shown)
    }

    @Test("A window that passes empty ends in a sleep (timeout 100 ms), counted slept, its time counted")
    func windowPassesEmpty() {
        let stop = StopSignal()
        let counters = BusyWaitCounters()
        // Stops at the first sleep after the poll (or after 10 s: a loop that never sleeps fails
        // the expectations below instead of hanging).
        let started = ContinuousClock.now
        let body = ScriptedBody([.source], stop: stop) { timeout, count in
            (timeout == 100 && count > 1) || ContinuousClock.now - started > .seconds(10)
        }
        loop(stop, window: .milliseconds(20), counters).run(body)
        #expect(ContinuousClock.now - started >= .milliseconds(20))
        #expect(body.waits.first == 100)
        let sleep = try? #require(body.waits.dropFirst().firstIndex(of: 100))
        #expect(sleep.map { body.waits[1..<$0].allSatisfy { $0 == 0 } && $0 > 1 } == true, "polls, then the sleep: \(body.waits)")
        #expect(counters.found.load(ordering: .relaxed) == 0)
        #expect(counters.slept.load(ordering: .relaxed) == 1)
        // The thread's CPU time while polling (what it yielded to other threads is not counted).
        #expect(counters.nanoseconds.load(ordering: .relaxed) > 0)
    }

    @Test("A turn that spent its batch budget looks again at once (timeout 0), not counted as a poll; the turn after the last one polls")
    func pendingThenPoll() {
        let stop = StopSignal()
        let counters = BusyWaitCounters()
        // One batch per turn. The wake-up's turn spends its budget; the look after it (a wait
        // of timeout 0 that finds the source again) is no poll; the next look finds it empty
        // and that turn ends; the one after polls, and its second poll finds a datagram.
        let body = ScriptedBody([.source, .source, .timedOut, .timedOut, .source], stop: stop) { _, count in count >= 9 }
        body.batchesPerTurn = 1
        loop(stop, window: .seconds(5), counters).run(body)
        #expect(body.forwarded == 3)
        #expect(Array(body.waits.prefix(9)) == [100] + Array(repeating: 0, count: 8), "\(body.waits)")
        #expect(counters.found.load(ordering: .relaxed) == 1, "only the poll's find")
        #expect(counters.slept.load(ordering: .relaxed) == 0)
    }

    @Test("No poll after an idle timeout (nothing came), and none at all without the setting")
    func noPollWhenIdleOrOff() {
        for window in [Duration?.some(.seconds(5)), nil, .zero] {
            let stop = StopSignal()
            let counters = BusyWaitCounters()
            let script: [ReceiveLoop.Readiness] = window == .seconds(5) ? [.timedOut, .timedOut] : [.source, .source]
            let body = ScriptedBody(script, stop: stop) { _, count in count >= 3 }
            loop(stop, window: window, counters).run(body)
            // Then the stop drain's wait (20 ms).
            #expect(Array(body.waits.prefix(3)) == [100, 100, 100], "window \(String(describing: window)): \(body.waits)")
            #expect(counters.found.load(ordering: .relaxed) == 0 && counters.slept.load(ordering: .relaxed) == 0)
            let shown = counters.shown.load(ordering: .relaxed)
            #expect(shown == (window == .seconds(5)))
        }
    }

    @Test("busy_wait_us: userspace and relay take 0-1000000; above is an error naming the range; other kinds warn it is not used")
    func setting() throws {
        let relay = try ConfigParser.parse("listeners:\n  - name: r\n    bind: \"127.0.0.1:5514\"\n    mode: userspace\n    replies: relay\n    settings: {busy_wait_us: 250}\n    downstream:\n      - {name: a, address: \"127.0.0.1:9\"}\n")
        #expect(relay.listeners[0].settings.busyWaitMicroseconds == 250)
        let plain = try ConfigParser.parse("listeners:\n  - name: u\n    bind: \"127.0.0.1:5514\"\n    downstream:\n      - {name: a, address: \"127.0.0.1:9\"}\n")
        #expect(plain.listeners[0].settings.busyWaitMicroseconds == 0)
        #expect(throws: ConfigError.self) {
            try ConfigParser.parse("listeners:\n  - name: u\n    bind: \"127.0.0.1:5514\"\n    settings: {busy_wait_us: 1000001}\n    downstream:\n      - {name: a, address: \"127.0.0.1:9\"}\n")
        }
        do {
            _ = try ConfigParser.parse("listeners:\n  - name: u\n    bind: \"127.0.0.1:5514\"\n    settings: {busy_wait_us: -1}\n    downstream:\n      - {name: a, address: \"127.0.0.1:9\"}\n")
            Issue.record("-1 was taken")
        } catch {
            #expect("\(error)".contains("busy_wait_us") && "\(error)".contains("1000000"), "\(error)")
        }
        let tc = try ConfigParser.parse("listeners:\n  - name: t\n    bind: \"127.0.0.1:5514\"\n    interface: lo\n    mode: tc_ebpf\n    settings: {busy_wait_us: 50}\n    downstream:\n      - {name: a, address: \"127.0.0.1:9\"}\n")
        #expect(tc.warnings().contains { $0.key == "listeners[0].settings.busy_wait_us" }, "\(tc.warnings())")
    }

    @Test("A relay with busy_wait_us: 20 clients x 10 exchanges all answered from the listener; its polls found the replies and requests (busy-wait series in /metrics)",
          .serialized, arguments: [true, false])
    func relayServes(ioUring: Bool) throws {
        let servers = try (1...2).map { try RelayEcho(name: "echo-\($0)") }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        // A 20 ms window: a loopback echo answers well within it even on a busy machine.
        let daemon = try startDaemon(relayYAML("spin", bind: bind, servers, settings: "      busy_wait_us: 20000\n      io_uring: \(ioUring)\n"))
        defer { daemon.shutdown() }
        let clients = try loopbackSources(20, base: 90).map { try RelayClient(source: $0) }
        var answered = 0
        for round in 0..<10 {
            for client in clients {
                if try client.exchange("\(client.source)-\(round)", with: bind) != nil { answered += 1 }
            }
        }
        #expect(answered == 200)
        settle { daemon.counters(of: "spin")?.twoWay?.replies == 200 }
        #expect(daemon.counters(of: "spin")?.twoWay?.replies == 200)
        // The workers add their counts once a second.
        var text = ""
        let deadline = ContinuousClock.now + .seconds(5)
        repeat {
            text = daemon.metricsText()
            if (metric(text, "udp_fanout_busy_wait_total", "listener=\"spin\",mode=\"userspace\",outcome=\"found\"") ?? 0) > 0 { break }
            usleep(100_000)
        } while ContinuousClock.now < deadline
        let found = metric(text, "udp_fanout_busy_wait_total", "listener=\"spin\",mode=\"userspace\",outcome=\"found\"") ?? 0
        #expect(found > 0, "\(text)")
        #expect(text.contains("# TYPE udp_fanout_busy_wait_seconds_total counter\nudp_fanout_busy_wait_seconds_total{listener=\"spin\",mode=\"userspace\"} "), "\(text)")
    }

    @Test("A userspace listener with busy_wait_us forwards every datagram (30 bursts of 10, 1 ms apart: round robin, 100 each); its polls found the bursts")
    func userspaceForwards() throws {
        let sinks = try (0..<3).map { _ in try Sink() }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let yaml = "listeners:\n" + listenerYAML("spin", bind: bind, sinks, workers: 1)
        let spinning = yaml.replacingOccurrences(of: "    settings:\n", with: "    settings:\n      busy_wait_us: 50000\n")
        #expect(try ConfigParser.parse(spinning).listeners.first?.settings.busyWaitMicroseconds == 50000, "the test's YAML sets it")
        let daemon = try startDaemon(spinning)
        defer { daemon.shutdown() }
        for burst in 0..<30 {
            try sendNumbered(to: bind, count: 10, tag: "burst-\(burst)")
            usleep(1000)
        }
        #expect(sinks.map { $0.drain().count } == [100, 100, 100])
        var found = 0
        let deadline = ContinuousClock.now + .seconds(5)
        repeat {
            found = metric(daemon.metricsText(), "udp_fanout_busy_wait_total", "listener=\"spin\",mode=\"userspace\",outcome=\"found\"") ?? 0
            if found > 0 { break }
            usleep(100_000)
        } while ContinuousClock.now < deadline
        #expect(found > 0, "the bursts 1 ms apart come within the 50 ms window")
    }
}
