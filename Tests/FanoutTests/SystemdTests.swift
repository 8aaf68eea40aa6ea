// SPDX-License-Identifier: Apache-2.0
import BPFSupport
import Foundation
import Logging
import ServiceLifecycle
import Synchronization
import Testing
import TestSupport
// SOCK_DGRAM: see docs/development.md (test files that use Glibc's socket constants).
import CSystemShim
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// A bound AF_UNIX datagram socket standing in for systemd's $NOTIFY_SOCKET: every sd_notify
/// message the daemon sends, in order.
final class NotifySocket {
    let directory: String
    let path: String
    let fd: Int32
    private(set) var messages: [String] = []

    init() throws {
        // sun_path holds 107 bytes: a short directory of its own under /tmp.
        directory = "/tmp/notify-\(UUID().uuidString.prefix(8))"
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        path = directory + "/notify"
        fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue), 0)
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        withUnsafeMutableBytes(of: &address.sun_path) { $0.copyBytes(from: Array(path.utf8)) }
        let bound = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
        }
        try #require(fd >= 0 && bound == 0, "bind \(path): errno \(errno)")
    }

    deinit {
        close(fd)
        try? FileManager.default.removeItem(atPath: directory)
    }

    /// Reads messages until one satisfies `matches` (returned) or `seconds` pass (nil).
    func next(within seconds: Double = 10, where matches: (String) -> Bool) -> String? {
        let deadline = ContinuousClock.now + .milliseconds(Int64(seconds * 1000))
        var buffer = [UInt8](repeating: 0, count: 4096)
        var descriptor = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
        while ContinuousClock.now < deadline {
            guard poll(&descriptor, 1, 50) > 0 else { continue }
            let count = recv(fd, &buffer, buffer.count, Int32(MSG_DONTWAIT))
            guard count > 0 else { continue }
            let message = String(decoding: buffer[0..<count], as: UTF8.self)
            messages.append(message)
            if matches(message) { return message }
        }
        return nil
    }

    /// The assignments of one message.
    static func fields(_ message: String) -> [String: String] {
        Dictionary(message.split(separator: "\n").compactMap { line in
            line.firstIndex(of: "=").map { (String(line[..<$0]), String(line[line.index(after: $0)...])) }
        }, uniquingKeysWith: { _, last in last })
    }
}

/// Counts what the watchdog pinger sends, for the pinger tests.
final class SentMessages: Sendable {
    let messages = Mutex<[String]>([])
    func append(_ message: String) { messages.withLock { $0.append(message) } }
    var count: Int { messages.withLock { $0.count } }
}

/// Heartbeats a test moves by hand: worker 0 moves at every call until `stall` is set.
final class FakePath: Sendable {
    let calls = Atomic<UInt64>(0)
    let stalled = Atomic<Bool>(false)
    func heartbeats() -> [PathHeartbeat] {
        let call = calls.wrappingAdd(1, ordering: .relaxed).newValue
        let count = stalled.load(ordering: .relaxed) ? 7 : call
        return [PathHeartbeat(listener: "fake", instance: 1, beat: .worker(index: 0, count: count))]
    }
}

@Suite("systemd: sd_notify, watchdog, units", .serialized)
struct SystemdTests {
    static let repository = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()

    static func worker(_ listener: String, _ index: Int, _ count: UInt64, instance: UInt64 = 1) -> PathHeartbeat {
        PathHeartbeat(listener: listener, instance: instance, beat: .worker(index: index, count: count))
    }

    @Test("The real binary under a NOTIFY_SOCKET: READY=1 once forwarding, WATCHDOG=1 repeatedly, SIGHUP: RELOADING=1 with MONOTONIC_USEC then READY=1 (also after a rejected file, with a STATUS saying so), SIGTERM: STOPPING=1 and exit 0")
    func notifyProtocol() throws {
        let notify = try NotifySocket()
        let sink = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("notify-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        let yaml = "listeners:\n" + listenerYAML("notify", bind: bind, [sink], workers: 2)
        try yaml.write(to: file, atomically: true, encoding: .utf8)
        let daemon = try Child("udp-fanout", ["-c", file.path],
                               prefix: ["/usr/bin/env", "NOTIFY_SOCKET=\(notify.path)", "WATCHDOG_USEC=400000"])

        let ready = notify.next { NotifySocket.fields($0)["READY"] == "1" }
        try #require(ready != nil, "READY=1 not received; got \(notify.messages); stderr: \(daemon.stderr)")
        #expect(NotifySocket.fields(ready!)["STATUS"]?.hasPrefix("forwarding: 1 listener(s) (1 userspace)") == true, "\(ready!)")
        // READY=1 means bound: a datagram sent right now is forwarded.
        try sendNumbered(to: bind, count: 1)
        #expect(sink.drain().count == 1, "forwarded right after READY=1")
        // Readiness settles after READY=1 (workers entering their loops): the path check sends the
        // STATUS= line again once it changed, so systemctl status does not keep a stale "not ready".
        let settled = notify.next(within: 3) { NotifySocket.fields($0)["STATUS"] == "forwarding: 1 listener(s) (1 userspace)" }
        #expect(settled != nil, "a STATUS without 'not ready': \(notify.messages)")

        // 400 ms watchdog: a ping every 200 ms; at least 3 within 3 s.
        var pings = 0
        let watchdogDeadline = ContinuousClock.now + .seconds(3)
        while pings < 3 && ContinuousClock.now < watchdogDeadline {
            if notify.next(within: 0.5, where: { NotifySocket.fields($0)["WATCHDOG"] == "1" }) != nil { pings += 1 }
        }
        #expect(pings >= 3, "WATCHDOG=1 pings: \(notify.messages)")
        #expect(daemon.stderr.contains("systemd watchdog enabled"), "\(daemon.stderr)")

        // A valid reload: RELOADING=1 with the monotonic time of the request, then READY=1.
        let before = SystemdNotifier.monotonicMicroseconds()
        daemon.signal(SIGHUP)
        let reloading = notify.next { NotifySocket.fields($0)["RELOADING"] == "1" }
        let after = SystemdNotifier.monotonicMicroseconds()
        try #require(reloading != nil, "RELOADING=1 not received: \(notify.messages)")
        let stamp = UInt64(NotifySocket.fields(reloading!)["MONOTONIC_USEC"] ?? "")
        #expect(stamp.map { (before...after).contains($0) } == true, "MONOTONIC_USEC \(String(describing: stamp)) within [\(before), \(after)]")
        let reloaded = notify.next { NotifySocket.fields($0)["READY"] == "1" }
        #expect(reloaded.map { NotifySocket.fields($0)["STATUS"]?.hasSuffix("configuration reloaded") == true } == true, "\(String(describing: reloaded))")

        // A rejected file: the previous configuration keeps forwarding; READY=1 again, and the
        // STATUS says the reload failed and why.
        try "listeners:\n  - name: notify\n    bind: nowhere\n".write(to: file, atomically: true, encoding: .utf8)
        daemon.signal(SIGHUP)
        #expect(notify.next { NotifySocket.fields($0)["RELOADING"] == "1" } != nil, "\(notify.messages)")
        let kept = notify.next { NotifySocket.fields($0)["READY"] == "1" }
        let status = kept.flatMap { NotifySocket.fields($0)["STATUS"] } ?? ""
        #expect(status.hasPrefix("reload failed, still forwarding with the previous configuration: ") && status.contains("bind"), "\(String(describing: kept))")
        try sendNumbered(to: bind, count: 1)
        #expect(sink.drain().count == 1, "still forwarding after the rejected reload")

        daemon.signal(SIGTERM)
        #expect(notify.next { NotifySocket.fields($0)["STOPPING"] == "1" } != nil, "\(notify.messages)")
        #expect(daemon.wait(seconds: 10) == 0, "\(daemon.stderr)")
    }

    @Test("WATCHDOG_PID naming another process: no pings from this one (a child must not ping for its parent)")
    func watchdogForAnotherProcess() throws {
        let notify = try NotifySocket()
        let sink = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("notify-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        try ("listeners:\n" + listenerYAML("notpid", bind: bind, [sink])).write(to: file, atomically: true, encoding: .utf8)
        let daemon = try Child("udp-fanout", ["-c", file.path],
                               prefix: ["/usr/bin/env", "NOTIFY_SOCKET=\(notify.path)", "WATCHDOG_USEC=200000", "WATCHDOG_PID=1"])
        #expect(notify.next { NotifySocket.fields($0)["READY"] == "1" } != nil, "\(notify.messages); \(daemon.stderr)")
        #expect(notify.next(within: 1) { NotifySocket.fields($0)["WATCHDOG"] != nil } == nil, "\(notify.messages)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait(seconds: 10) == 0)
    }

    @Test("WATCHDOG_USEC and WATCHDOG_PID: unset means no watchdog; another pid means none; a bad value is an error naming the variable")
    func watchdogSettings() throws {
        #expect(try WatchdogSettings.interval(environment: [:], pid: 42) == nil)
        #expect(try WatchdogSettings.interval(environment: ["WATCHDOG_USEC": "400000"], pid: 42) == .microseconds(400_000))
        #expect(try WatchdogSettings.interval(environment: ["WATCHDOG_USEC": "400000", "WATCHDOG_PID": "42"], pid: 42) == .microseconds(400_000))
        #expect(try WatchdogSettings.interval(environment: ["WATCHDOG_USEC": "400000", "WATCHDOG_PID": "43"], pid: 42) == nil)
        for bad in ["0", "-5", "30s"] {
            #expect(throws: ConfigError.self) { try WatchdogSettings.interval(environment: ["WATCHDOG_USEC": bad], pid: 42) }
            do {
                _ = try WatchdogSettings.interval(environment: ["WATCHDOG_USEC": bad], pid: 42)
            } catch let error as ConfigError {
                #expect(error.key == "WATCHDOG_USEC" && error.problem.contains("WatchdogSec="), "\(error)")
            } catch {
                Issue.record("unexpected error \(error)")
            }
        }
    }

    @Test("The watchdog's decision: alive while every worker moves; a stuck worker withholds the ping and is reported once; it recovers; a new listener instance starts fresh; a detached tc program withholds")
    func watchdogJudge() {
        var judge = WatchdogJudge()
        #expect(judge.check([Self.worker("a", 0, 5), Self.worker("a", 1, 9)]).alive, "first sighting counts as alive")
        #expect(judge.check([Self.worker("a", 0, 6), Self.worker("a", 1, 10)]).alive)
        let stuck = judge.check([Self.worker("a", 0, 7), Self.worker("a", 1, 10)])
        #expect(!stuck.alive)
        #expect(stuck.newlyStuck == ["watchdog: worker 1 of listener 'a' made no progress, withholding WATCHDOG=1"])
        let still = judge.check([Self.worker("a", 0, 8), Self.worker("a", 1, 10)])
        #expect(!still.alive && still.newlyStuck.isEmpty, "reported once per stall")
        let recovered = judge.check([Self.worker("a", 0, 9), Self.worker("a", 1, 11)])
        #expect(recovered.alive && recovered.recovered == ["watchdog: worker 1 of listener 'a' makes progress again"])
        // A reload rebuilt the listener: its new workers' counters start again and are not stuck.
        #expect(judge.check([Self.worker("a", 0, 0, instance: 2), Self.worker("a", 1, 0, instance: 2)]).alive)
        #expect(!judge.check([Self.worker("a", 0, 0, instance: 2), Self.worker("a", 1, 1, instance: 2)]).alive)
        // tc_ebpf: alive while attached.
        var tc = WatchdogJudge()
        #expect(tc.check([PathHeartbeat(listener: "t", instance: 3, beat: .kernel(interface: "eth0", problem: nil))]).alive)
        let detached = tc.check([PathHeartbeat(listener: "t", instance: 3, beat: .kernel(interface: "eth0", problem: "bpf_prog_query failed"))])
        #expect(!detached.alive)
        #expect(detached.newlyStuck.first?.hasPrefix("watchdog: the tc_ebpf program of listener 't' is no longer attached at eth0 ingress (bpf_prog_query failed)") == true, "\(detached)")
        #expect(tc.check([]).alive, "no listener running: nothing is stuck")
    }

    @Test("The pinger sends WATCHDOG=1 while the path moves, none once a worker stalls, and stops on graceful shutdown")
    func pinger() async throws {
        let path = FakePath()
        let sent = SentMessages()
        var logger = Logger(label: "watchdog-test")
        logger.logLevel = .critical
        let service = WatchdogService(interval: .milliseconds(40), heartbeats: { path.heartbeats() }, send: { sent.append($0) }, logger: logger)
        let group = ServiceGroup(configuration: ServiceGroupConfiguration(services: [service], logger: logger))
        let running = Task { try await group.run() }
        let deadline = ContinuousClock.now + .seconds(10)
        while sent.count < 5 && ContinuousClock.now < deadline { try await Task.sleep(for: .milliseconds(10)) }
        #expect(sent.count >= 5)
        #expect(sent.messages.withLock { $0.allSatisfy { $0 == "WATCHDOG=1" } })
        path.stalled.store(true, ordering: .relaxed)
        // One check may still see the last move; after that none may pass.
        let checksAtStall = path.calls.load(ordering: .relaxed)
        while path.calls.load(ordering: .relaxed) < checksAtStall + 2 && ContinuousClock.now < deadline { try await Task.sleep(for: .milliseconds(10)) }
        let sentAtStall = sent.count
        while path.calls.load(ordering: .relaxed) < checksAtStall + 8 && ContinuousClock.now < deadline { try await Task.sleep(for: .milliseconds(10)) }
        #expect(path.calls.load(ordering: .relaxed) >= checksAtStall + 8, "the pinger kept checking")
        #expect(sent.count == sentAtStall, "no ping while the worker is stalled")
        path.stalled.store(false, ordering: .relaxed)
        while sent.count == sentAtStall && ContinuousClock.now < deadline { try await Task.sleep(for: .milliseconds(10)) }
        #expect(sent.count > sentAtStall, "pings again once it moves")
        await group.triggerGracefulShutdown()
        try await running.value
        let checksAfterStop = path.calls.load(ordering: .relaxed)
        try await Task.sleep(for: .milliseconds(200))
        #expect(path.calls.load(ordering: .relaxed) == checksAfterStop, "stopped on graceful shutdown")
    }

    @Test("Userspace workers' heartbeats move while idle (every poll timeout), one per worker")
    func workerHeartbeats() throws {
        let sink = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let daemon = try startDaemon("listeners:\n" + listenerYAML("beats", bind: bind, [sink], workers: 2))
        defer { daemon.shutdown() }
        var judge = WatchdogJudge()
        let first = daemon.heartbeats()
        #expect(first.count == 2 && Set(first.map(\.listener)) == ["beats"], "\(first)")
        #expect(judge.check(first).alive)
        usleep(350_000)
        let second = daemon.heartbeats()
        #expect(judge.check(second).alive, "\(first) -> \(second)")
        daemon.shutdown()
        #expect(daemon.heartbeats().isEmpty, "nothing once stopping")
    }

    @Test("The path check's verdict lists every stuck part (what /healthz answers); before start nothing is judged")
    func pathVerdict() async throws {
        var judge = WatchdogJudge()
        let detached = PathHeartbeat(listener: "b", instance: 0, beat: .kernel(interface: "eth0", problem: "ENOENT"))
        let first = judge.check([Self.worker("a", 0, 1), detached])
        #expect(!first.alive, "a detached program is stuck from the first check")
        #expect(first.problems == ["the tc_ebpf program of listener 'b' is no longer attached at eth0 ingress (ENOENT)"], "\(first)")
        let both = judge.check([Self.worker("a", 0, 1), detached])
        #expect(both.problems.count == 2 && both.newlyStuck == ["watchdog: worker 0 of listener 'a' made no progress, withholding WATCHDOG=1"], "\(both)")

        // A monitor not yet started: the service neither judges nor pings.
        let monitor = PathMonitor()
        let path = FakePath()
        path.stalled.store(true, ordering: .relaxed)
        let sent = SentMessages()
        var logger = Logger(label: "path-test")
        logger.logLevel = .critical
        let service = WatchdogService(interval: .milliseconds(40), checkEvery: .milliseconds(20), heartbeats: { path.heartbeats() },
                                      send: { sent.append($0) }, logger: logger, monitor: monitor)
        let group = ServiceGroup(configuration: ServiceGroupConfiguration(services: [service], logger: logger))
        let running = Task { try await group.run() }
        try await Task.sleep(for: .milliseconds(200))
        #expect(path.calls.load(ordering: .relaxed) == 0 && sent.count == 0, "nothing before the listeners start")
        monitor.markStarted()
        let deadline = ContinuousClock.now + .seconds(10)
        while monitor.problems.isEmpty && ContinuousClock.now < deadline { try await Task.sleep(for: .milliseconds(10)) }
        #expect(monitor.problems.first?.contains("made no progress") == true, "\(monitor.problems)")
        path.stalled.store(false, ordering: .relaxed)
        while !monitor.problems.isEmpty && ContinuousClock.now < deadline { try await Task.sleep(for: .milliseconds(10)) }
        #expect(monitor.problems.isEmpty, "recovered: \(monitor.problems)")
        await group.triggerGracefulShutdown()
        try await running.value
    }

    @Test("Liveness: /healthz answers 200 while the tc_ebpf program is attached, 503 naming it once the clsact qdisc is deleted by hand (the real binary, no systemd)", .enabled(if: Privileges.enabled, Privileges.reason))
    func livenessProbe() throws {
        let topology = try Topology(backends: 1)
        defer { topology.destroy() }
        let metrics = Int(freePort())
        let scratch = try Unprivileged.Scratch(TCFixtures.config(topology, backends: [1], attach: "clsact", metricsPort: metrics))
        let daemon = try Child(scratch.binary, ["-c", scratch.config], prefix: topology.prefix(topology.proxy))
        defer { daemon.signal(SIGKILL); _ = daemon.wait(seconds: 10) }
        try daemon.waitFor("registered listener in eBPF map")
        func healthz() throws -> String {
            try topology.exec(topology.proxy, ["/usr/bin/curl", "-s", "-w", "%{http_code}", "http://127.0.0.1:\(metrics)/healthz"])
        }
        // Before the first check (up to 5 s after start) and while attached: 200.
        #expect(try healthz() == "ok\n200", "\(daemon.stderr)")
        _ = try topology.exec(topology.proxy, ["/usr/sbin/tc", "qdisc", "del", "dev", topology.proxyInterface, "clsact"])
        var answer = try healthz()
        let deadline = ContinuousClock.now + .seconds(15)
        while answer.hasSuffix("200") && ContinuousClock.now < deadline {
            usleep(200_000)
            answer = try healthz()
        }
        #expect(answer.hasSuffix("503") && answer.contains("is no longer attached at \(topology.proxyInterface) ingress"), "\(answer)")
        #expect(daemon.stderr.contains("/healthz answers 503"), "\(daemon.stderr)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait(seconds: 10) == 0)
        // The filter went with the qdisc: no false "remove it by hand" at shutdown.
        #expect(daemon.stderr.contains("the tc_ebpf filter was already gone") && !daemon.stderr.contains("remove it by hand"), "\(daemon.stderr)")
    }

    @Test("tc_ebpf heartbeat: attached while the program is at the ingress; a deleted clsact qdisc or a deleted interface (TCX) is reported", .enabled(if: Privileges.enabled, Privileges.reason))
    func tcHeartbeats() throws {
        for attach in ["clsact", "tcx"] {
            let topology = try Topology(backends: 1)
            defer { topology.destroy() }
            let daemon = try DaemonFixtures.startInProxy(topology, TCFixtures.config(topology, backends: [1], attach: attach, metricsPort: Int(freePort())))
            defer { DaemonFixtures.stopInProxy(topology, daemon) }
            let attached = inNetworkNamespace(topology.proxy) { daemon.heartbeats() } ?? []
            #expect(attached == [PathHeartbeat(listener: "tc", instance: attached.first?.instance ?? 0, beat: .kernel(interface: topology.proxyInterface, problem: nil))], "\(attach): \(attached)")
            if attach == "clsact" {
                _ = try topology.exec(topology.proxy, ["/usr/sbin/tc", "qdisc", "del", "dev", topology.proxyInterface, "clsact"])
            } else {
                _ = try topology.exec(topology.proxy, ["/usr/sbin/ip", "link", "del", topology.proxyInterface])
            }
            let gone = inNetworkNamespace(topology.proxy) { daemon.heartbeats() } ?? []
            var judge = WatchdogJudge()
            let verdict = judge.check(gone)
            #expect(!verdict.alive, "\(attach): \(gone)")
            #expect(verdict.newlyStuck.first?.contains("is no longer attached at \(topology.proxyInterface) ingress") == true, "\(attach): \(verdict)")
        }
    }

    /// A capability setting as systemd reads it from a unit and its drop-ins, in order: an empty
    /// assignment resets, others add. Returns setpriv's names (`CAP_BPF` → `bpf`).
    static func capabilities(_ key: String, in files: [String]) throws -> [String] {
        var set: [String] = []
        for file in files {
            let text = try String(contentsOf: repository.appendingPathComponent(file), encoding: .utf8)
            for line in text.split(separator: "\n") where line.hasPrefix(key + "=") {
                let value = line.dropFirst(key.count + 1).split(separator: " ").map { String($0) }
                if value.isEmpty { set = [] } else { set += value.map { $0.lowercased().replacingOccurrences(of: "cap_", with: "") } }
            }
        }
        return set
    }

    @Test("The units' capability sets are the ones the daemon runs with: the drop-in's for userspace (eBPF steering as nobody), the unit's for tc_ebpf (forwards as nobody); bounding set = ambient set", .enabled(if: Privileges.enabled, Privileges.reason))
    func unitCapabilities() throws {
        let tcFiles = ["systemd/udp-fanout.service"]
        let userspaceFiles = tcFiles + ["systemd/udp-fanout-userspace.conf"]
        let tcSet = try Self.capabilities("AmbientCapabilities", in: tcFiles)
        let userspaceSet = try Self.capabilities("AmbientCapabilities", in: userspaceFiles)
        #expect(Set(tcSet) == ["bpf", "net_admin", "perfmon"], "\(tcSet)")
        #expect(userspaceSet == ["bpf"], "\(userspaceSet)")
        #expect(try Self.capabilities("CapabilityBoundingSet", in: tcFiles) == tcSet)
        #expect(try Self.capabilities("CapabilityBoundingSet", in: userspaceFiles) == userspaceSet)

        // userspace with the drop-in's set.
        let sink = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let userspace = try Unprivileged.Scratch("listeners:\n" + listenerYAML("unit", bind: bind, [sink], workers: 2).replacingOccurrences(of: "      recv_buf_size: 8388608\n", with: ""))
        let daemon = try Child(userspace.binary, ["-c", userspace.config], prefix: Unprivileged.asNobody(userspaceSet))
        try daemon.waitFor("entering receive loop")
        #expect(daemon.stderr.contains("steering=ebpf"), "\(daemon.stderr)")
        try sendNumbered(to: bind, count: 50)
        #expect(sink.drain().count == 50)
        // The --check of ExecReload=, as the same user with the same set, sees the daemon it reloads
        // (a foreign owner of the bind would fail the reload).
        let check = try run(Unprivileged.asNobody(userspaceSet)[0], Array(Unprivileged.asNobody(userspaceSet).dropFirst()) + [userspace.binary, "--check", "-c", userspace.config])
        #expect(check.status == 0 && check.output.contains("fine if that is the daemon this file reloads"), "\(check.output)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)

        // tc_ebpf with the unit's set, and /run/udp-fanout owned by the service user as
        // RuntimeDirectory= makes it.
        let topology = try Topology(backends: 1)
        let collector = try TCFixtures.collectors(topology)[0]
        let scratch = try Unprivileged.Scratch(TCFixtures.config(topology, backends: [1]))
        let runDirectory = "/run/udp-fanout"
        // Made here only if missing, and then removed again; else given back to its owner.
        let created = mkdir(runDirectory, 0o755) == 0
        var before = stat()
        stat(runDirectory, &before)
        chown(runDirectory, 65534, 65534)
        defer {
            chown(runDirectory, before.st_uid, before.st_gid)
            if created { rmdir(runDirectory) }
        }
        let tc = try Child(scratch.binary, ["-c", scratch.config], prefix: topology.prefix(topology.proxy) + Unprivileged.asNobody(tcSet))
        try tc.waitFor("registered listener in eBPF map")
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "200", "--rate", "10000"], prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0)
        usleep(300_000)
        tc.signal(SIGTERM)
        #expect(tc.wait() == 0, "\(tc.stderr)")
        #expect(try collector.stop().int("received") == 200)
    }

    /// The system calls a `SystemCallFilter=` value allows, groups expanded with
    /// `systemd-analyze syscall-filter` (this systemd's own definition of each group).
    static func allowedSystemCalls(_ filter: [String]) throws -> Set<String> {
        let listing = try run("/usr/bin/systemd-analyze", ["syscall-filter"])
        try #require(listing.status == 0, "\(listing.output)")
        var groups: [String: [String]] = [:]
        var current: String?
        for line in listing.output.split(separator: "\n") {
            if line.hasPrefix("@") {
                current = String(line)
                groups[String(line)] = []
            } else if let group = current {
                let item = line.trimmingCharacters(in: .whitespaces)
                if !item.isEmpty && !item.hasPrefix("#") { groups[group, default: []].append(item) }
            }
        }
        func expand(_ items: [String]) -> Set<String> {
            items.reduce(into: Set<String>()) { set, item in set.formUnion(item.hasPrefix("@") ? expand(groups[item] ?? []) : [item]) }
        }
        return expand(filter)
    }

    /// System call names in an `strace -f` log (`PID name(` and `PID <... name resumed>`).
    static func systemCalls(inTrace text: String) -> Set<String> {
        Set(text.split(separator: "\n").compactMap { line -> String? in
            var rest = line.drop(while: { $0.isNumber }).drop(while: { $0 == " " })
            if rest.hasPrefix("<... ") { rest = rest.dropFirst(5) }
            let name = rest.prefix(while: { $0.isLetter || $0.isNumber || $0 == "_" })
            return name.isEmpty || rest.dropFirst(name.count).first.map({ $0 != "(" && $0 != " " }) == true ? nil : String(name)
        })
    }

    /// What MemoryDenyWriteExecute= refuses (systemd's seccomp filter): memory mapped writable
    /// and executable at once, or made executable afterwards. The lines of an `strace -f` log
    /// that do it.
    static func writeExecuteViolations(inTrace text: String) -> [String] {
        text.split(separator: "\n").map(String.init).filter { line in
            (line.contains("mmap(") && line.contains("PROT_WRITE") && line.contains("PROT_EXEC"))
                || ((line.contains("mprotect(") || line.contains("pkey_mprotect(")) && line.contains("PROT_EXEC"))
                || (line.contains("shmat(") && line.contains("SHM_EXEC"))
        }
    }

    /// Runs udp-fanout under strace (in `prefix`), waits for the log line `started`, lets
    /// `exercise` drive it with the daemon's pid, stops it with SIGTERM, and returns the strace log.
    static func traced(_ config: String, prefix: [String] = [], until started: String..., exercise: (pid_t) throws -> Void) throws -> String {
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("traced-\(UUID().uuidString).yaml")
        let trace = file.path + ".trace"
        try config.write(to: file, atomically: true, encoding: .utf8)
        defer {
            try? FileManager.default.removeItem(at: file)
            try? FileManager.default.removeItem(atPath: trace)
        }
        let tracer = try Child("/usr/bin/strace", ["-f", "-qq", "-o", trace, binaryDirectory.appendingPathComponent("udp-fanout").path, "-c", file.path], prefix: prefix)
        // The daemon is strace's child (nsenter execs strace, strace forks the daemon), the one
        // that has exec'd udp-fanout: strace first forks short-lived children of its own to test
        // ptrace features, and a signal sent to one of those reached nobody.
        var daemon: pid_t = 0
        let deadline = ContinuousClock.now + .seconds(10)
        while daemon == 0 && ContinuousClock.now < deadline {
            let children = (try? String(contentsOfFile: "/proc/\(tracer.process.processIdentifier)/task/\(tracer.process.processIdentifier)/children", encoding: .utf8)) ?? ""
            daemon = children.split(separator: " ").compactMap { pid_t($0) }.first { Self.isDaemon($0, configPath: file.path) } ?? 0
            usleep(20_000)
        }
        try #require(daemon > 0, "no daemon under strace: \(tracer.stderr)")
        do {
            for text in started { try tracer.waitFor(text) }
            try exercise(daemon)
        } catch {
            // Stopped as a failed test's daemon is: SIGTERM (its own shutdown), SIGKILL after 5 s.
            if Self.isDaemon(daemon, configPath: file.path) {
                kill(daemon, SIGTERM)
                let stopped = ContinuousClock.now + .seconds(5)
                while Self.isDaemon(daemon, configPath: file.path) && ContinuousClock.now < stopped { usleep(20_000) }
                if Self.isDaemon(daemon, configPath: file.path) { kill(daemon, SIGKILL) }
            }
            tracer.wait(seconds: 20)
            throw error
        }
        kill(daemon, SIGTERM)
        // The daemon, not strace, is waited for: if it does not stop, what each of its threads
        // waits in and which signals are pending says why, and it is killed (strace, killed,
        // would leave it running untraced).
        let stopDeadline = ContinuousClock.now + .seconds(20)
        while Self.isDaemon(daemon, configPath: file.path) && ContinuousClock.now < stopDeadline { usleep(20_000) }
        if Self.isDaemon(daemon, configPath: file.path) {
            Issue.record("udp-fanout under strace did not stop 20 s after SIGTERM; its threads: \(Self.threadStates(daemon)); log: \(tracer.stderr)")
            kill(daemon, SIGKILL)
        }
        #expect(tracer.wait(seconds: 20) == 0, "\(tracer.stderr)")
        return try String(contentsOfFile: trace, encoding: .utf8)
    }

    /// True while `pid` runs udp-fanout started with `configPath`: not strace before its exec, not
    /// one of strace's test children, not a reused PID.
    static func isDaemon(_ pid: pid_t, configPath: String) -> Bool {
        // argv, not /proc/PID/exe: a build beside the test may have replaced the binary
        // ("udp-fanout (deleted)"). strace's children have strace's argv until they exec.
        let arguments = ((try? String(contentsOfFile: "/proc/\(pid)/cmdline", encoding: .utf8)) ?? "").split(separator: "\0")
        return arguments.first?.hasSuffix("/udp-fanout") == true && arguments.contains { $0 == configPath }
    }

    /// Each thread of `pid`: its name, where it waits, and its pending and blocked signal masks.
    static func threadStates(_ pid: pid_t) -> String {
        let tasks = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/\(pid)/task")) ?? []
        let shared = ((try? String(contentsOfFile: "/proc/\(pid)/status", encoding: .utf8)) ?? "").split(separator: "\n").filter { $0.hasPrefix("ShdPnd") || $0.hasPrefix("SigCgt") }
        return shared.joined(separator: " ") + "; " + tasks.sorted().map { task in
            let base = "/proc/\(pid)/task/\(task)/"
            let read = { (name: String) in ((try? String(contentsOfFile: base + name, encoding: .utf8)) ?? "?").trimmingCharacters(in: .whitespacesAndNewlines) }
            let masks = read("status").split(separator: "\n").filter { $0.hasPrefix("SigPnd") || $0.hasPrefix("SigBlk") }.joined(separator: " ")
            return "\(task) \(read("comm")) \(read("wchan")) \(masks)"
        }.joined(separator: "; ")
    }

    @Test("The unit's SystemCallFilter= allows every system call udp-fanout makes, and MemoryDenyWriteExecute= none of its mappings (strace): userspace with pinned workers, metrics, a reload; tc_ebpf in a namespace", .enabled(if: Privileges.enabled, Privileges.reason))
    func systemCallFilter() throws {
        let unit = try String(contentsOf: Self.repository.appendingPathComponent("systemd/udp-fanout.service"), encoding: .utf8)
        let filter = try #require(unit.split(separator: "\n").last { $0.hasPrefix("SystemCallFilter=") })
        let allowed = try Self.allowedSystemCalls(filter.dropFirst("SystemCallFilter=".count).split(separator: " ").map(String.init))
        #expect(allowed.contains("recvmmsg") && allowed.contains("bpf") && !allowed.contains("mount"), "the expansion is systemd's")

        let sink = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let metrics = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        // And a replies: relay listener, whose workers send through io_uring.
        let relaySink = try Sink()
        let relayBind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let yaml = "listeners:\n" + listenerYAML("traced", bind: bind, [sink], extra: "", workers: 2).replacingOccurrences(of: "      workers: 2\n", with: "      workers: 2\n      pin_cpus: true\n")
            + listenerYAML("relayed", bind: relayBind, [relaySink], extra: "    replies: relay\n")
            + "metrics: {enabled: true, bind: \"\(metrics)\"}\n"
        let userspaceTrace = try Self.traced(yaml, until: "entering receive loop", "io_uring=true") { pid in
            try sendNumbered(to: bind, count: 20)
            #expect(sink.drain().count == 20)
            try sendNumbered(to: relayBind, count: 20)
            #expect(relaySink.drain().count == 20)
            #expect(try httpGet(metrics, "/metrics").0 == 200)
            kill(pid, SIGHUP)
            usleep(500_000)
        }
        #expect(Self.writeExecuteViolations(inTrace: "12 mprotect(0x7f0000000000, 4096, PROT_READ|PROT_EXEC) = 0\n13 mmap(NULL, 8192, PROT_READ|PROT_WRITE|PROT_EXEC, MAP_PRIVATE|MAP_ANONYMOUS, -1, 0) = 0x7f0000001000\n14 mmap(NULL, 8192, PROT_READ|PROT_EXEC, MAP_PRIVATE, 3, 0) = 0x7f0000003000").count == 2,
                "the check sees what the filter refuses")
        let userspace = Self.systemCalls(inTrace: userspaceTrace)
        #expect(Self.writeExecuteViolations(inTrace: userspaceTrace).isEmpty, "\(Self.writeExecuteViolations(inTrace: userspaceTrace))")
        #expect(userspaceTrace.contains("PROT_READ|PROT_EXEC"), "the libraries' code mappings are in the trace")
        #expect(userspace.contains("recvmmsg") && userspace.contains("sendmmsg") && userspace.contains("sched_setaffinity") && userspace.contains("io_uring_enter"),
                "the trace is read: \(userspace.sorted())")
        #expect(userspace.subtracting(allowed).isEmpty, "userspace calls outside SystemCallFilter=: \(userspace.subtracting(allowed).sorted())")

        let topology = try Topology(backends: 1)
        let collector = try TCFixtures.collectors(topology)[0]
        let tcTrace = try Self.traced(TCFixtures.config(topology, backends: [1], metricsPort: Int(freePort())), prefix: topology.prefix(topology.proxy), until: "registered listener in eBPF map") { _ in
            let publisher = try Child("publisher", ["198.18.0.1", "5514", "50", "--rate", "10000"], prefix: topology.prefix(topology.client))
            #expect(publisher.wait() == 0)
            usleep(300_000)
        }
        #expect(try collector.stop().int("received") == 50)
        let tc = Self.systemCalls(inTrace: tcTrace)
        #expect(Self.writeExecuteViolations(inTrace: tcTrace).isEmpty, "\(Self.writeExecuteViolations(inTrace: tcTrace))")
        #expect(tc.contains("bpf"), "the trace is read: \(tc.sorted())")
        #expect(tc.subtracting(allowed).isEmpty, "tc_ebpf calls outside SystemCallFilter=: \(tc.subtracting(allowed).sorted())")
    }

    @Test("systemd-analyze verify passes without a warning on both units and the userspace drop-in")
    func unitsVerify() throws {
        let source = Self.repository.appendingPathComponent("systemd")
        let scratch = "/tmp/units-\(UUID().uuidString.prefix(8))"
        try FileManager.default.createDirectory(atPath: scratch + "/udp-fanout.service.d", withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: scratch) }
        // verify checks that each command exists: the built binaries stand in for /usr/local/bin.
        for unit in ["udp-fanout.service", "collector@.service"] {
            let text = try String(contentsOf: source.appendingPathComponent(unit), encoding: .utf8)
                .replacingOccurrences(of: "/usr/local/bin/", with: binaryDirectory.path + "/")
            #expect(!text.contains("/usr/local/bin"), "\(unit)")
            try text.write(toFile: "\(scratch)/\(unit)", atomically: true, encoding: .utf8)
        }
        try FileManager.default.copyItem(atPath: source.appendingPathComponent("udp-fanout-userspace.conf").path,
                                         toPath: scratch + "/udp-fanout.service.d/mode.conf")
        let result = try run("/bin/sh", ["-c", "cd \(scratch) && /usr/bin/systemd-analyze verify udp-fanout.service collector@0.service 2>&1"])
        #expect(result.status == 0, "\(result.output)")
        #expect(result.output.isEmpty, "warnings: \(result.output)")
        // The check itself sees a broken unit.
        try "[Service]\nWatchdogSecs=30s\n".write(toFile: scratch + "/udp-fanout.service.d/broken.conf", atomically: true, encoding: .utf8)
        let broken = try run("/bin/sh", ["-c", "cd \(scratch) && /usr/bin/systemd-analyze verify udp-fanout.service 2>&1"])
        #expect(broken.output.contains("WatchdogSecs"), "\(broken.output)")
    }
}
