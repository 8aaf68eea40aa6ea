// SPDX-License-Identifier: Apache-2.0
import CSystemShim
import Foundation
import Logging
import Synchronization
import Testing
import TestSupport
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// Active health probes (ICMP, udp_echo) and passive reports, against real sockets: loopback,
/// and a namespace reached over a veth whose only address is in 198.18.0.0/15.
@Suite("Health", .serialized)
struct HealthTests {
    // MARK: state machine

    @Test("State machine: down after fall consecutive failures, up after rise consecutive successes; a success resets the failures; each transition reported once")
    func stateMachine() {
        var state = HealthState()
        #expect(state.isUp, "new targets start up")
        // A success between failures resets the run: fall 3 needs three in a row.
        #expect(state.record(success: false, rise: 2, fall: 3) == nil)
        #expect(state.record(success: false, rise: 2, fall: 3) == nil)
        #expect(state.record(success: true, rise: 2, fall: 3) == nil)
        #expect(state.record(success: false, rise: 2, fall: 3) == nil)
        #expect(state.record(success: false, rise: 2, fall: 3) == nil)
        #expect(state.isUp)
        #expect(state.record(success: false, rise: 2, fall: 3) == .down)
        #expect(!state.isUp && state.consecutiveFailures == 3)
        // Further failures: no second transition.
        #expect(state.record(success: false, rise: 2, fall: 3) == nil)
        // rise 2: one success is not enough, a failure resets the run.
        #expect(state.record(success: true, rise: 2, fall: 3) == nil)
        #expect(state.record(success: false, rise: 2, fall: 3) == nil)
        #expect(state.record(success: true, rise: 2, fall: 3) == nil)
        #expect(state.record(success: true, rise: 2, fall: 3) == .up)
        #expect(state.isUp && state.consecutiveSuccesses == 2)
        #expect(state.record(success: true, rise: 2, fall: 3) == nil)
        // The reference's rule (fall 3, rise 1).
        var reference = HealthState()
        let outcomes = [false, false, false, true].map { reference.record(success: $0, rise: 1, fall: 3) }
        #expect(outcomes == [nil, nil, .down, .up])
    }

    @Test("ICMP echo request and reply: checksum valid, identifier and token checked, IPv4 header of raw sockets skipped")
    func icmpMatching() {
        let request = ICMPProbeSocket.echoRequest(family: AF_INET, identifier: 0x1234, sequence: 7, token: 0xfeed)
        #expect(request.count == 24 && request[0] == 8)
        #expect(ICMPProbeSocket.internetChecksum(request) == 0, "a valid checksum sums to 0")
        var reply = request
        reply[0] = 0  // echo reply
        let match = { (bytes: [UInt8], header: Bool) in
            ICMPProbeSocket.matchReply(bytes[...], family: AF_INET, hasIPHeader: header, identifier: 0x1234, token: 0xfeed)
        }
        #expect(match(reply, false) == 7)
        #expect(match(request, false) == nil, "an echo request (our own, seen by a raw socket) is not a reply")
        var otherIdentifier = reply
        otherIdentifier[5] = 0x35
        #expect(match(otherIdentifier, false) == nil, "another process's echo")
        var otherToken = reply
        otherToken[15] ^= 1
        #expect(match(otherToken, false) == nil, "same identifier, not our token")
        let ipHeader: [UInt8] = [0x45] + [UInt8](repeating: 0, count: 19)
        #expect(match(ipHeader + reply, true) == 7)
        #expect(match(Array(reply.prefix(10)), false) == nil, "truncated")
        let v6 = ICMPProbeSocket.echoRequest(family: AF_INET6, identifier: 9, sequence: 300, token: 5)
        var v6Reply = v6
        v6Reply[0] = 129
        #expect(v6[0] == 128)
        #expect(ICMPProbeSocket.matchReply(v6Reply[...], family: AF_INET6, hasIPHeader: false, identifier: 9, token: 5) == 300)
    }

    @Test("ICMP reply to probe: only a waiting sequence from the target's address is a success; another address is a mismatch, another sequence nothing")
    func icmpOutcome() {
        let target = SocketAddress("198.18.0.2:0")!
        let waiting: [UInt16: SocketAddress] = [7: target]
        #expect(ProbeLoop.icmpOutcome(inFlight: waiting, source: target.ip, sequence: 7).map { $0.0 == target && $0.1 == .ok } == true)
        #expect(ProbeLoop.icmpOutcome(inFlight: waiting, source: IPAddress("198.18.0.3")!, sequence: 7).map { $0.1 } == .mismatch)
        #expect(ProbeLoop.icmpOutcome(inFlight: waiting, source: target.ip, sequence: 8) == nil, "a sequence no probe waits for")
    }

    // MARK: ICMP

    @Test("ICMP to 127.0.0.1 and ::1: probes succeed, both stay up, no transition", .enabled(if: Privileges.enabled, Privileges.reason))
    func icmpLoopback() async throws {
        let log = LogStore()
        let changes = Changes()
        let checker = HealthChecker(policy: HealthPolicy(proto: .icmp, interval: .milliseconds(100), timeout: .milliseconds(500), rise: 1, fall: 1),
                                    logger: log.logger, onChange: changes.record)
        let targets = [SocketAddress("127.0.0.1:0")!, SocketAddress("[::1]:0")!]
        checker.setTargets(Set(targets))
        try await running(checker) {
            for target in targets {
                try #require(await eventually { probes(checker, target, .ok) >= 3 }, "ICMP replies from \(target): \(checker.metricsText())")
                #expect(checker.isUp(target))
                for result in ProbeResult.allCases where result != .ok { #expect(probes(checker, target, result) == 0, "\(result)") }
                #expect(metric(checker.metricsText(), "udp_fanout_health_probe_duration_seconds_count", "target=\"\(target)\"").map { $0 >= 3 } == true)
            }
        }
        #expect(changes.events.isEmpty)
        #expect(log.contains("ICMP probe socket opened"))
    }

    @Test("ICMP datagram socket: refused where ping_group_range excludes us, and run fails naming ping_group_range and CAP_NET_RAW; probes once the range allows", .enabled(if: Privileges.enabled, Privileges.reason))
    func icmpDatagramSocket() async throws {
        let namespace = "hlt-\(String(UInt32.random(in: 0...UInt32.max), radix: 16))"
        try ip(["netns", "add", namespace])
        defer { _ = try? TestSupport.run("/usr/sbin/ip", ["netns", "delete", namespace]) }
        try ip(["-n", namespace, "link", "set", "lo", "up"])
        try sysctl(namespace, "net.ipv4.ping_group_range=1 0")
        let log = LogStore()
        let target = SocketAddress("127.0.0.1:0")!
        // Only the datagram kind: root could always fall back to a raw socket.
        let refused = HealthChecker(policy: HealthPolicy(interval: .milliseconds(100)), logger: log.logger, icmpKinds: [.datagram]) { _, _ in }
        refused.setTargets([target])
        let outcome = inNetworkNamespace(namespace) { Result { () throws(HealthError) in try ProbeLoop(checker: refused).run() } }
        guard case .failure(let error) = try #require(outcome, "could not enter \(namespace)") else {
            Issue.record("the probe loop must fail when no ICMP socket opens")
            return
        }
        guard case .icmpUnavailable(let family, let datagram, _) = error else {
            Issue.record("unexpected error \(error)")
            return
        }
        #expect(family == "IPv4" && datagram.errno == EACCES)
        #expect(error.description.contains("ping_group_range") && error.description.contains("CAP_NET_RAW"), "\(error)")

        try sysctl(namespace, "net.ipv4.ping_group_range=0 2147483647")
        let checker = HealthChecker(policy: HealthPolicy(interval: .milliseconds(100)), logger: log.logger, icmpKinds: [.datagram]) { _, _ in }
        checker.setTargets([target])
        let thread = OSThread(name: "hlt-netns") {
            let fd = open("/run/netns/\(namespace)", O_RDONLY | O_CLOEXEC)
            guard fd >= 0, shim_setns_net(fd) else { return }
            close(fd)
            try? ProbeLoop(checker: checker).run()
        }
        let probed = await eventually { probes(checker, target, .ok) >= 2 }
        checker.stop()
        thread.join()
        #expect(probed, "datagram ICMP probes answered: \(checker.metricsText())")
        #expect(log.contains("ICMP probe socket opened", key: "kind", value: "datagram"))
    }

    @Test("ICMP and ICMPv6 to a namespace's addresses that stop answering: down after fall probes, back up after rise once they answer again", .enabled(if: Privileges.enabled, Privileges.reason))
    func icmpNamespace() async throws {
        let peer = try PeerNamespace()
        defer { peer.destroy() }
        let log = LogStore()
        let changes = Changes()
        let checker = HealthChecker(policy: HealthPolicy(proto: .icmp, interval: .milliseconds(150), timeout: .milliseconds(100), rise: 2, fall: 3),
                                    logger: log.logger, onChange: changes.record)
        let targets = [SocketAddress(ip: IPAddress(peer.peerIP)!, port: 0), SocketAddress(ip: IPAddress(peer.peerIPv6)!, port: 0)]
        let ignore = ["net.ipv4.icmp_echo_ignore_all", "net.ipv6.icmp.echo_ignore_all"]
        checker.setTargets(Set(targets))
        try await running(checker) {
            for (target, setting) in zip(targets, ignore) {
                try #require(await eventually { probes(checker, target, .ok) >= 2 }, "\(target) answers: \(checker.metricsText())")
                #expect(checker.isUp(target) && changes.events.isEmpty)
                try sysctl(peer.name, "\(setting)=1")
                try #require(await eventually(seconds: 10) { !checker.isUp(target) }, "\(target) down once it stops answering")
                #expect(probes(checker, target, .timeout) >= 3)
                // The state flips under the checker's lock; the log line and onChange follow on the
                // probe thread (a loaded machine showed isUp false with no event yet).
                #expect(await eventually { changes.events == [Changes.Event(target: target, up: false)] }, "\(changes.events)")
                #expect(log.contains("downstream marked unhealthy, disabling", key: "reason", value: "timeout"))
                #expect(log.contains("downstream marked unhealthy, disabling", key: "consecutive", value: "3"))
                #expect(targets.allSatisfy { $0 == target || checker.isUp($0) }, "the other family is not affected")
                try sysctl(peer.name, "\(setting)=0")
                try #require(await eventually(seconds: 10) { checker.isUp(target) }, "\(target) up once it answers again")
                #expect(await eventually { changes.events == [Changes.Event(target: target, up: false), Changes.Event(target: target, up: true)] }, "\(changes.events)")
                #expect(log.contains("downstream is healthy", key: "consecutive", value: "2"))
                let text = checker.metricsText()
                let label = "target=\"\(target)\""
                #expect(metric(text, "udp_fanout_health_transitions_total", label + ",to=\"down\"") == 1)
                #expect(metric(text, "udp_fanout_health_transitions_total", label + ",to=\"up\"") == 1)
                #expect(metric(text, "udp_fanout_health_target_up", label) == 1)
                changes.clear()
            }
        }
    }

    // MARK: udp_echo

    @Test("udp_echo: an echoing socket is up; silent → down (timeout); wrong payload → mismatch; closed → refused; back up when it echoes again")
    func udpEcho() async throws {
        let server = try EchoServer()
        defer { server.close() }
        let log = LogStore()
        let changes = Changes()
        let checker = HealthChecker(policy: HealthPolicy(proto: .udpEcho, interval: .milliseconds(100), timeout: .milliseconds(80), rise: 1, fall: 2),
                                    logger: log.logger, onChange: changes.record)
        let target = server.address
        checker.setTargets([target])
        try await running(checker) {
            try #require(await eventually { probes(checker, target, .ok) >= 2 })
            #expect(checker.isUp(target))

            server.mode.store(EchoServer.Mode.silent.rawValue, ordering: .relaxed)
            try #require(await eventually { !checker.isUp(target) }, "silent: down")
            #expect(probes(checker, target, .timeout) >= 2)
            #expect(await eventually { log.contains("downstream marked unhealthy, disabling", key: "reason", value: "timeout") })

            server.mode.store(EchoServer.Mode.echo.rawValue, ordering: .relaxed)
            try #require(await eventually { checker.isUp(target) }, "echoing again: up")

            server.mode.store(EchoServer.Mode.wrong.rawValue, ordering: .relaxed)
            try #require(await eventually { !checker.isUp(target) }, "wrong payload: down")
            #expect(probes(checker, target, .mismatch) >= 2)
            #expect(await eventually { log.contains("downstream marked unhealthy, disabling", key: "reason", value: "mismatch") })

            server.mode.store(EchoServer.Mode.echo.rawValue, ordering: .relaxed)
            try #require(await eventually { checker.isUp(target) })

            server.close()
            try #require(await eventually { !checker.isUp(target) }, "closed: down")
            #expect(probes(checker, target, .refused) >= 2)
            #expect(await eventually { log.contains("downstream marked unhealthy, disabling", key: "reason", value: "refused") })

            try server.open()
            try #require(await eventually { checker.isUp(target) }, "reopened: up")
            // onChange follows the state's flip on the probe thread: wait for the last one.
            #expect(await eventually { changes.events.map(\.up) == [false, true, false, true, false, true] }, "each transition once: \(changes.events)")
        }
    }

    @Test("Targets: a new target is probed at once, a removed one forgotten; a policy change keeps state and counters")
    func targetsAndPolicy() async throws {
        let first = try EchoServer(), second = try EchoServer()
        defer { first.close(); second.close() }
        let checker = HealthChecker(policy: HealthPolicy(proto: .udpEcho, interval: .seconds(30), timeout: .milliseconds(200)), logger: LogStore().logger) { _, _ in }
        checker.setTargets([first.address])
        try await running(checker) {
            try #require(await eventually { probes(checker, first.address, .ok) == 1 }, "probed at once despite a 30 s interval")
            checker.setTargets([first.address, second.address])
            try #require(await eventually { probes(checker, second.address, .ok) == 1 })
            checker.setTargets([second.address])
            #expect(!checker.metricsText().contains("\(first.address)"), "forgotten")
            checker.setPolicy(HealthPolicy(proto: .udpEcho, interval: .milliseconds(100), timeout: .milliseconds(200)))
            try #require(await eventually { probes(checker, second.address, .ok) >= 3 }, "the new interval applies")
        }
    }

    // MARK: passive

    @Test("Passive: a userspace listener sending to a loopback port with nothing bound reports it; the checker counts it toward fall", .enabled(if: Privileges.enabled, Privileges.reason))
    func passive() async throws {
        let dead = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let other = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let changes = Changes()
        // ICMP to 127.0.0.1 always answers and the next probe is an hour away: after the first
        // (successful) probe only passive reports can take the target down.
        let checker = HealthChecker(policy: HealthPolicy(proto: .icmp, interval: .seconds(3600), timeout: .milliseconds(500), rise: 1, fall: 3),
                                    logger: LogStore().logger, onChange: changes.record)
        checker.setTargets([dead, other])
        let reports = Locked<[SocketAddress]>([])
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        var settings = Settings()
        settings.workers = 1
        let config = Listener(name: "passive", bind: bind, downstreams: [Downstream(name: "dead", address: dead)], settings: settings)
        let listener = try UserspaceListener(config, counters: ListenerCounters(name: "passive", mode: "userspace"), logger: LogStore().logger) { address in
            reports.withLock { $0.append(address) }
            checker.reportUnreachable(address)
        }
        defer { listener.shutdown() }
        try listener.activate()
        try await running(checker) {
            try #require(await eventually { probes(checker, dead, .ok) == 1 && probes(checker, other, .ok) == 1 })
            // The first send draws the ICMP port unreachable; a later send returns it as ECONNREFUSED.
            for round in 0..<40 where reports.withLock({ $0.count < 3 }) {
                try sendNumbered(to: bind, count: 2, tag: "round\(round)")
                try await Task.sleep(for: .milliseconds(30))
            }
            let seen = reports.withLock { $0 }
            #expect(seen.count >= 3 && seen.allSatisfy { $0 == dead }, "\(seen)")
            try #require(await eventually { !checker.isUp(dead) }, "three passive failures take it down")
            #expect(checker.isUp(other))
            #expect(await eventually { changes.events == [Changes.Event(target: dead, up: false)] }, "\(changes.events)")
            #expect(metric(checker.metricsText(), "udp_fanout_health_passive_failures_total", "target=\"\(dead)\"").map { $0 >= 3 } == true)
            #expect(probes(checker, dead, .refused) == 0, "passive reports are not probes")
        }
        checker.reportUnreachable(SocketAddress("127.0.0.1:9")!)
        #expect(checker.metricsText().contains("udp_fanout_health_passive_unmatched_total 1\n"))
    }
}

// MARK: helpers

/// The count of `target`'s probes with `result`.
private func probes(_ checker: HealthChecker, _ target: SocketAddress, _ result: ProbeResult) -> Int {
    metric(checker.metricsText(), "udp_fanout_health_probes_total", "target=\"\(target)\",result=\"\(result.rawValue)\"") ?? -1
}

/// Polls `condition` every 20 ms for at most `seconds`.
private func eventually(seconds: Double = 5, _ condition: () -> Bool) async -> Bool {
    let deadline = ContinuousClock.now + .milliseconds(Int(seconds * 1000))
    while ContinuousClock.now < deadline {
        if condition() { return true }
        try? await Task.sleep(for: .milliseconds(20))
    }
    return condition()
}

/// Runs the checker's service around `body`, and stops it even when `body` throws.
private func running(_ checker: HealthChecker, _ body: () async throws -> Void) async throws {
    let task = Task { try await checker.run() }
    do {
        try await body()
    } catch {
        checker.stop()
        _ = try? await task.value
        throw error
    }
    checker.stop()
    try await task.value
}

private func ip(_ arguments: [String]) throws {
    let result = try TestSupport.run("/usr/sbin/ip", arguments)
    try #require(result.status == 0, "ip \(arguments.joined(separator: " ")): \(result.output)")
}

private func sysctl(_ namespace: String, _ setting: String) throws {
    try ip(["netns", "exec", namespace, "/usr/sbin/sysctl", "-q", "-w", setting])
}

/// setns into a network namespace (CLONE_NEWNET) from the calling thread.
private func shim_setns_net(_ fd: Int32) -> Bool { shim_setns(fd, 0x4000_0000) == 0 }

/// A value shared with closures that escape (a Mutex cannot be captured: it is not copyable).
final class Locked<Value: Sendable>: Sendable {
    private let mutex: Mutex<Value>
    init(_ value: Value) { mutex = Mutex(value) }
    func withLock<R: Sendable>(_ body: (inout Value) -> R) -> R { mutex.withLock { body(&$0) } }
}

/// The onChange calls a checker made.
private final class Changes: Sendable {
    struct Event: Equatable, Sendable {
        var target: SocketAddress
        var up: Bool
    }

    private let store = Mutex<[Event]>([])
    var events: [Event] { store.withLock { $0 } }
    func clear() { store.withLock { $0.removeAll() } }
    var record: @Sendable (SocketAddress, Bool) -> Void { { [self] target, up in self.store.withLock { $0.append(Event(target: target, up: up)) } } }
}

/// A log handler keeping every message with its metadata, to check the reference's log lines.
final class LogStore: Sendable {
    struct Line: Sendable {
        var message: String
        var metadata: [String: String]
    }

    let lines = Mutex<[Line]>([])

    var logger: Logger {
        var logger = Logger(label: "health-test") { _ in Handler(store: self) }
        logger.logLevel = .debug
        return logger
    }

    func contains(_ message: String, key: String? = nil, value: String? = nil) -> Bool {
        lines.withLock { lines in
            lines.contains { $0.message == message && (key == nil || $0.metadata[key!] == value) }
        }
    }

    struct Handler: LogHandler {
        let store: LogStore
        var metadata: Logger.Metadata = [:]
        var logLevel: Logger.Level = .debug
        var metadataProvider: Logger.MetadataProvider?

        subscript(metadataKey key: String) -> Logger.Metadata.Value? {
            get { metadata[key] }
            set { metadata[key] = newValue }
        }

        func log(event: LogEvent) {
            let line = Line(message: event.message.description, metadata: (event.metadata ?? [:]).mapValues { "\($0)" })
            store.lines.withLock { $0.append(line) }
        }
    }
}

/// A UDP echo responder on loopback: echoes, stays silent, or answers another payload; can be
/// closed (its port then answers ICMP port unreachable) and opened again on the same port.
final class EchoServer: @unchecked Sendable {
    enum Mode: Int {
        case echo, silent, wrong
    }

    let address: SocketAddress
    let mode = Atomic<Int>(Mode.echo.rawValue)
    private let stopping = Atomic<Bool>(false)
    private var fd: Int32 = -1
    private var thread: OSThread?

    init(port: UInt16 = freePort()) throws {
        address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: port)
        try open()
    }

    func open() throws {
        let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
        let bound = address.withSockAddr { bind(fd, $0, $1) }
        try #require(bound == 0, "bind \(address): errno \(errno)")
        self.fd = fd
        stopping.store(false, ordering: .relaxed)
        thread = OSThread(name: "echo") { [self] in self.serve(fd) }
    }

    private func serve(_ fd: Int32) {
        var buffer = [UInt8](repeating: 0, count: 2048)
        var descriptor = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
        while !stopping.load(ordering: .relaxed) {
            guard poll(&descriptor, 1, 20) > 0 else { continue }
            var storage = sockaddr_storage()
            var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
            let count = withUnsafeMutablePointer(to: &storage) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { recvfrom(fd, &buffer, buffer.count, Int32(MSG_DONTWAIT), $0, &length) }
            }
            guard count >= 0 else { continue }
            var reply = Array(buffer[0..<count])
            switch Mode(rawValue: mode.load(ordering: .relaxed))! {
            case .silent: continue
            case .wrong: reply = reply.map { $0 ^ 0x5a }
            case .echo: break
            }
            _ = withUnsafePointer(to: &storage) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { sendto(fd, reply, reply.count, 0, $0, length) }
            }
        }
    }

    func close() {
        guard let thread else { return }
        stopping.store(true, ordering: .relaxed)
        thread.join()
        self.thread = nil
        Glibc.close(fd)
    }
}

/// A network namespace reached from the host over a veth pair: the host holds one address of a
/// random /30 in 198.19.0.0/16 (inside 198.18.0.0/15) and of a random /64 in 2001:db8::/32, the
/// namespace the other. Removed by
/// `destroy()`, which deletes the namespace and with it the veth pair.
final class PeerNamespace {
    let name: String
    let hostIP: String
    let peerIP: String
    let peerIPv6: String
    private var destroyed = false

    init() throws {
        let suffix = String(UInt32.random(in: 0...UInt32.max), radix: 16)
        name = "hlt-\(suffix)"
        let (third, fourth) = (Int.random(in: 0...255), Int.random(in: 0...63) * 4)
        hostIP = "198.19.\(third).\(fourth + 1)"
        peerIP = "198.19.\(third).\(fourth + 2)"
        let prefix = "2001:db8:\(String(UInt16.random(in: 0x100...0xffff), radix: 16)):\(String(UInt16.random(in: 1...0xffff), radix: 16))"
        peerIPv6 = "\(prefix)::2"
        let (hostSide, peerSide) = ("hh\(suffix.prefix(8))", "hn\(suffix.prefix(8))")
        try ip(["netns", "add", name])
        do {
            try ip(["link", "add", hostSide, "type", "veth", "peer", "name", peerSide, "netns", name])
            try ip(["addr", "add", "\(hostIP)/30", "dev", hostSide])
            try ip(["-6", "addr", "add", "\(prefix)::1/64", "dev", hostSide, "nodad"])
            try ip(["link", "set", hostSide, "up"])
            try ip(["-n", name, "addr", "add", "\(peerIP)/30", "dev", peerSide])
            try ip(["-n", name, "-6", "addr", "add", "\(peerIPv6)/64", "dev", peerSide, "nodad"])
            try ip(["-n", name, "link", "set", peerSide, "up"])
            try ip(["-n", name, "link", "set", "lo", "up"])
        } catch {
            destroy()
            throw error
        }
    }

    deinit { destroy() }

    func destroy() {
        guard !destroyed else { return }
        destroyed = true
        _ = try? TestSupport.run("/usr/sbin/ip", ["netns", "delete", name])
    }
}
