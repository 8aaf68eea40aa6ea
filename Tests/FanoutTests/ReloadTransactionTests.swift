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

/// Reloads are one transactional step: the new state is ready before the old one goes, a change
/// that cannot be applied keeps the old state running and is counted `rejected`.
@Suite("udp-fanout transactional reload", .serialized)
struct ReloadTransactionTests {
    func rejected(_ daemon: FanoutDaemon) -> Int? { metric(daemon.metricsText(), "udp_fanout_config_reloads_total", "result=\"rejected\"") }
    func ok(_ daemon: FanoutDaemon) -> Int? { metric(daemon.metricsText(), "udp_fanout_config_reloads_total", "result=\"ok\"") }

    @Test("A reload that parses but cannot be applied (bind taken) keeps every listener running, counts rejected; a later reload succeeds")
    func unappliable() throws {
        let sinkA = try Sink(), sinkB = try Sink()
        let bindA = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let bindB = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let daemon = try startDaemon("listeners:\n" + listenerYAML("a", bind: bindA, [sinkA], workers: 2))
        defer { daemon.shutdown() }
        // Another socket (no SO_REUSEPORT) holds b's bind.
        let squatter = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
        try #require(bindB.withSockAddr { bind(squatter, $0, $1) } == 0)
        // a changes its settings (a new group of workers) and b is new: both or neither.
        let wanted = "listeners:\n" + listenerYAML("a", bind: bindA, [sinkA], workers: 3) + listenerYAML("b", bind: bindB, [sinkB])
        #expect(!daemon.reload(text: wanted))
        #expect(rejected(daemon) == 1 && ok(daemon) == 0)
        try sendNumbered(to: bindA, count: 50)
        #expect(sinkA.drain().count == 50, "the old a still forwards")
        #expect(daemon.isReady)
        close(squatter)
        #expect(daemon.reload(text: wanted), "retried once the bind is free")
        try sendNumbered(to: bindA, count: 50)
        try sendNumbered(to: bindB, count: 20)
        #expect(sinkA.drain().count == 50 && sinkB.drain().count == 20)
        #expect(rejected(daemon) == 1 && ok(daemon) == 1)
    }

    @Test("A bind moved from one listener to another: the new owner forwards it, the old one its new bind")
    func movedBind() throws {
        let sinkA = try Sink(), sinkB = try Sink()
        let first = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let second = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let daemon = try startDaemon("listeners:\n" + listenerYAML("a", bind: first, [sinkA]))
        defer { daemon.shutdown() }
        #expect(daemon.reload(text: "listeners:\n" + listenerYAML("a", bind: second, [sinkA]) + listenerYAML("b", bind: first, [sinkB])))
        try sendNumbered(to: first, count: 30)
        try sendNumbered(to: second, count: 10)
        #expect(sinkB.drain().count == 30, "b owns the first bind")
        #expect(sinkA.drain().count == 10, "a moved to the second")
    }

    @Test("Settings reloads (workers, batch_size, recv_buf_size) under 20k pps lose nothing (eBPF worker steering)", .enabled(if: Privileges.enabled, Privileges.reason))
    func settingsUnderLoad() throws {
        let sinks = try (0..<2).map { _ in try Sink() }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        func yaml(workers: Int, batch: Int, buffer: Int) -> String {
            "listeners:\n" + listenerYAML("s", bind: bind, sinks, workers: workers)
                .replacingOccurrences(of: "      recv_buf_size: 8388608\n", with: "      recv_buf_size: \(buffer)\n      batch_size: \(batch)\n")
        }
        let daemon = try startDaemon(yaml(workers: 2, batch: 32, buffer: 8_388_608))
        defer { daemon.shutdown() }
        let publisher = try Child("publisher", ["127.0.0.1", String(bind.port), "40000", "--rate", "20000", "--sources", "127.0.4.1-127.0.4.40"])
        for (workers, batch, buffer) in [(3, 16, 4_194_304), (1, 64, 8_388_608), (4, 8, 16_777_216), (2, 32, 8_388_608)] {
            usleep(350_000)
            #expect(daemon.reload(text: yaml(workers: workers, batch: batch, buffer: buffer)))
        }
        #expect(publisher.wait(seconds: 30) == 0)
        let sent = try publisher.json().int("sent")
        let received = sinks.map { $0.drain().count }
        #expect(sent == 40000)
        #expect(received.reduce(0, +) == sent, "no datagram lost across four settings reloads: \(received)")
        let counters = try #require(daemon.counters(of: "s"))
        #expect(counters.received == UInt64(sent) && counters.forwarded == UInt64(sent))
        #expect(counters.receiveQueueDrops == 0)
        #expect(ok(daemon) == 4)
    }

    @Test("A second daemon on the same bind gets an operator's message naming the other process")
    func secondInstance() throws {
        let sink = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let daemon = try startDaemon("listeners:\n" + listenerYAML("one", bind: bind, [sink]))
        defer { daemon.shutdown() }
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("second-\(UUID().uuidString).yaml")
        try ("listeners:\n" + listenerYAML("two", bind: bind, [sink])).write(to: file, atomically: true, encoding: .utf8)
        defer { try? FileManager.default.removeItem(at: file) }
        // Another program (here the test process) on the bind: --check says so first.
        let check = try Child("udp-fanout", ["--check", "-c", file.path])
        #expect(check.wait(seconds: 10) == 2)
        #expect(check.stderr.contains("listeners[0].bind: \(bind) is already served by another process (pid \(getpid())"), "\(check.stderr)")
        let second = try Child("udp-fanout", ["-c", file.path])
        #expect(second.wait(seconds: 10) == 1)
        #expect(second.stderr.contains("already served by another process (pid \(getpid())"), "\(second.stderr)")
        try sendNumbered(to: bind, count: 10)
        #expect(sink.drain().count == 10, "the first one still forwards everything")
    }

    @Test("--check of the file a running udp-fanout serves (before its SIGHUP): a note, exit 0")
    func checkBeforeReload() throws {
        let sink = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("served-\(UUID().uuidString).yaml")
        try ("listeners:\n" + listenerYAML("served", bind: bind, [sink])).write(to: file, atomically: true, encoding: .utf8)
        defer { try? FileManager.default.removeItem(at: file) }
        let daemon = try Child("udp-fanout", ["-c", file.path])
        try daemon.waitFor("entering receive loop")
        let check = try Child("udp-fanout", ["--check", "-c", file.path])
        #expect(check.wait(seconds: 10) == 0, "\(check.stderr)")
        #expect(check.stderr.contains("note: listeners[0].bind: \(bind) is already served by another process (pid \(daemon.process.processIdentifier), udp-fanout): fine if that is the daemon this file reloads"), "\(check.stderr)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
    }

    @Test("A bind overlapping another process's socket (wildcard against specific) is warned about at start and by --check, both ways")
    func overlappingBinds() throws {
        let sink = try Sink()
        let port = freePort()
        for (ours, theirs, words) in [("0.0.0.0", "127.0.0.1", "go to it, not to this listener"), ("127.0.0.1", "0.0.0.0", "this listener takes the datagrams")] {
            // SO_REUSEPORT, as another udp-fanout's sockets have: without it the kernel refuses
            // the overlapping bind itself (EADDRINUSE), which is loud already.
            let other = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
            defer { close(other) }
            var one: Int32 = 1
            setsockopt(other, SOL_SOCKET, SO_REUSEPORT, &one, 4)
            try #require(SocketAddress(ip: IPAddress(theirs)!, port: port).withSockAddr { Glibc.bind(other, $0, $1) } == 0)
            let file = FileManager.default.temporaryDirectory.appendingPathComponent("overlap-\(UUID().uuidString).yaml")
            try ("listeners:\n" + listenerYAML("o", bind: SocketAddress(ip: IPAddress(ours)!, port: port), [sink])).write(to: file, atomically: true, encoding: .utf8)
            defer { try? FileManager.default.removeItem(at: file) }
            let check = try Child("udp-fanout", ["--check", "-c", file.path])
            #expect(check.wait(seconds: 10) == 0)
            #expect(check.stderr.contains("note: listeners[0].bind: ") && check.stderr.contains(words), "\(check.stderr)")
            let daemon = try Child("udp-fanout", ["-c", file.path])
            try daemon.waitFor("entering receive loop")
            #expect(daemon.stderr.contains("bind overlaps another process's socket") && daemon.stderr.contains("pid \(getpid())"), "\(daemon.stderr)")
            daemon.signal(SIGTERM)
            #expect(daemon.wait() == 0)
        }
    }
}
