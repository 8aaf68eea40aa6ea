// SPDX-License-Identifier: Apache-2.0
import Foundation
import Logging
import Synchronization
import Testing
import TestSupport
@testable import FanoutCore
import ReusePortLB
import SystemCalls
import CSystemShim

#if canImport(Glibc)
import Glibc
#endif

/// The `announce` section (docs/fleet.md): its keys, the announcer's state machine against a
/// table in memory, the daemon's readiness per address, and the real routes in a namespace.
@Suite("Announce")
struct AnnounceTests {
    static let listener = "listeners:\n  - name: a\n    bind: \"198.18.0.1:5514\"\n    downstream: [{address: \"198.18.1.2:2\"}]\n"

    @Test("The announce keys parse, with their defaults")
    func parses() throws {
        let config = try ConfigParser.parse(Self.listener + "announce: {addresses: [198.18.0.1]}\n")
        try config.validate(localAddresses: [])
        #expect(config.announce?.addresses == [IPAddress("198.18.0.1")!])
        #expect(config.announce?.table == 201 && config.announce?.protocolNumber == 201 && config.announce?.drainSecs == 5)
        let wildcard = try ConfigParser.parse("listeners:\n  - name: a\n    bind: \"[::]:5514\"\n    downstream: [{address: \"198.18.1.2:2\"}]\n"
            + "announce: {addresses: [198.18.0.9, \"2001:db8::9\"], table: 1000, protocol: 250, drain_secs: 0}\n")
        try wildcard.validate(localAddresses: [])
        #expect(wildcard.announce?.table == 1000 && wildcard.announce?.protocolNumber == 250 && wildcard.announce?.drainSecs == 0)
    }

    static let invalidSections: [(String, String, String)] = [
        ("announce: {addresses: []}\n", "announce.addresses", "empty"),
        ("announce: {}\n", "announce.addresses", "required"),
        ("announce: {addresses: [198.18.0.1/32]}\n", "announce.addresses[0]", "not an IP address"),
        ("announce: {addresses: [\"fe80::1%eth0\"]}\n", "announce.addresses[0]", "not an IP address"),
        ("announce: {addresses: [0.0.0.0]}\n", "announce.addresses[0]", "unspecified"),
        ("announce: {addresses: [127.0.0.1]}\n", "announce.addresses[0]", "loopback"),
        ("announce: {addresses: [224.0.0.5]}\n", "announce.addresses[0]", "multicast"),
        ("announce: {addresses: [169.254.1.1]}\n", "announce.addresses[0]", "link-local"),
        ("announce: {addresses: [\"fe80::1\"]}\n", "announce.addresses[0]", "link-local"),
        ("announce: {addresses: [\"::ffff:198.18.0.1\"]}\n", "announce.addresses[0]", "IPv4-mapped"),
        ("announce: {addresses: [198.18.0.1, 198.18.0.1]}\n", "announce.addresses[1]", "listed twice"),
        ("announce: {addresses: [198.18.0.2]}\n", "announce.addresses[0]", "no listener receives on 198.18.0.2"),
        ("announce: {addresses: [\"2001:db8::1\"]}\n", "announce.addresses[0]", "no listener receives"),
        ("announce: {addresses: [198.18.0.1], table: 255}\n", "announce.table", "local"),
        ("announce: {addresses: [198.18.0.1], table: 0}\n", "announce.table", "out of range"),
        ("announce: {addresses: [198.18.0.1], protocol: 12}\n", "announce.protocol", "routing daemon's own"),
        ("announce: {addresses: [198.18.0.1], protocol: 186}\n", "announce.protocol", "routing daemon's own"),
        ("announce: {addresses: [198.18.0.1], protocol: 2}\n", "announce.protocol", "kernel's"),
        ("announce: {addresses: [198.18.0.1], drain_secs: 301}\n", "announce.drain_secs", "out of range"),
        ("announce: {addresses: [198.18.0.1], hold: 1}\n", "announce.hold", "unknown key"),
    ]

    @Test("An invalid announce section: one message naming the key and the problem", arguments: invalidSections)
    func invalid(section: String, key: String, problem: String) {
        do {
            try ConfigParser.parse(Self.listener + section).validate(localAddresses: [])
            Issue.record("accepted: \(section)")
        } catch {
            #expect(error.key == key, "\(error)")
            #expect(error.problem.contains(problem), "\(error)")
        }
    }

    /// A routing table in memory, with failures on demand.
    final class MemoryRoutes: HostRoutes {
        let routes = Mutex<Set<String>>([])
        let failing = Mutex(false)
        let failOnRemove = Mutex(false)

        static func key(_ address: IPAddress, _ table: UInt32, _ number: UInt8) -> String { "\(address) \(table) \(number)" }

        func add(_ address: IPAddress, table: UInt32, protocolNumber: UInt8) throws(SystemCallError) {
            if failing.withLock({ $0 }) { throw SystemCallError(call: "add route", errno: EPERM) }
            routes.withLock { _ = $0.insert(Self.key(address, table, protocolNumber)) }
        }

        func remove(_ address: IPAddress, table: UInt32, protocolNumber: UInt8) throws(SystemCallError) {
            if failing.withLock({ $0 }) || failOnRemove.withLock({ $0 }) { throw SystemCallError(call: "remove route", errno: EPERM) }
            routes.withLock { _ = $0.remove(Self.key(address, table, protocolNumber)) }
        }

        func list(table: UInt32, protocolNumber: UInt8) throws(SystemCallError) -> Set<IPAddress> {
            Set(routes.withLock { $0 }.compactMap { entry in
                let parts = entry.split(separator: " ")
                return parts[1] == "\(table)" && parts[2] == "\(protocolNumber)" ? IPAddress(String(parts[0])) : nil
            })
        }
    }

    @Test("--check: the announce section in the summary; an announced address a socket listener receives on that is not local here is a note, not for a tc_ebpf listener")
    func check() throws {
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("announce-check-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        let userspace = "listeners:\n  - name: a\n    bind: \"0.0.0.0:5514\"\n    downstream: [{address: \"198.18.1.2:2\"}]\n"
        try (userspace + "announce: {addresses: [198.18.77.1], drain_secs: 3}\n").write(to: file, atomically: true, encoding: .utf8)
        let checked = try run(binaryDirectory.appendingPathComponent("udp-fanout").path, ["--check", "-c", file.path])
        #expect(checked.status == 0, "\(checked.output)")
        #expect(checked.output.contains("; announce 198.18.77.1 (table 201, protocol 201, drain 3 s)"), "\(checked.output)")
        #expect(checked.output.contains("note: announce.addresses: 198.18.77.1 is not local on this node: the address stays withdrawn until it is local"), "\(checked.output)")
        // nat on an announced address with another balancing than source_ip: a note.
        let nat = try ConfigParser.parse("listeners:\n  - name: a\n    mode: tc_ebpf\n    interface: lo\n    replies: nat\n    bind: \"198.18.77.1:5514\"\n"
            + "    downstream: [{address: \"198.18.1.2:2\"}, {address: \"198.18.1.3:2\"}]\n" + "announce: {addresses: [198.18.77.1]}\n")
        #expect(Preflight.announceNotes(nat, isLocal: { _ in true }).first?.contains("listeners[0].balancing: round_robin with replies: nat on an announced address") == true)
        // One static downstream: every node chooses it, nothing to note.
        let single = try ConfigParser.parse("listeners:\n  - name: a\n    mode: tc_ebpf\n    interface: lo\n    replies: nat\n    bind: \"198.18.77.1:5514\"\n"
            + "    downstream: [{address: \"198.18.1.2:2\"}]\n" + "announce: {addresses: [198.18.77.1]}\n")
        #expect(Preflight.announceNotes(single, isLocal: { _ in true }).isEmpty)
        // The rule itself, with the locality given: a tc_ebpf listener takes datagrams before routing.
        let socket = try ConfigParser.parse(userspace + "announce: {addresses: [198.18.77.1]}\n")
        #expect(Preflight.announceNotes(socket, isLocal: { _ in false }).count == 1)
        #expect(Preflight.announceNotes(socket, isLocal: { _ in true }).isEmpty)
        #expect(Preflight.announceNotes(socket, isLocal: { _ in nil }).isEmpty)
        // A listener bound to the address itself cannot even start (unless non-local binds are allowed).
        let bound = try ConfigParser.parse("listeners:\n  - name: a\n    bind: \"198.18.77.1:5514\"\n    downstream: [{address: \"198.18.1.2:2\"}]\n"
            + "announce: {addresses: [198.18.77.1]}\n")
        #expect(Preflight.announceNotes(bound, isLocal: { _ in false }).first?.contains("a listener bound to it cannot start here (unless net.ipv4.ip_nonlocal_bind is 1)") == true)
        let tc = try ConfigParser.parse("listeners:\n  - name: a\n    mode: tc_ebpf\n    interface: lo\n    bind: \"198.18.77.1:5514\"\n    downstream: [{address: \"198.18.1.2:2\"}]\n"
            + "announce: {addresses: [198.18.77.1]}\n")
        #expect(Preflight.announceNotes(tc, isLocal: { _ in false }).isEmpty)
    }

    @Test("Announced while ready, withdrawn at the first reason, moved by a table change, repaired when the kernel differs, failures counted and retried")
    func stateMachine() {
        let routes = MemoryRoutes()
        let log = LogStore()
        let announcer = RouteAnnouncer(routes: routes, logger: log.logger)
        let a = IPAddress("198.18.0.1")!, b = IPAddress("2001:db8::1")!
        var settings = Announce(addresses: [a, b])
        announcer.apply(settings, [a: [], b: ["listener 'x' is not receiving yet"]], now: 1)
        // An address that stays withdrawn says why in the log, once per reason that lasts 2 s.
        func logged() -> [String] { log.lines.withLock { $0 }.filter { $0.message == "not announced" }.map { $0.metadata["reason"] ?? "" } }
        announcer.apply(settings, [a: [], b: ["listener 'x' is not receiving yet"]], now: 1.5)
        #expect(logged().isEmpty, "a passing reason is not logged")
        announcer.apply(settings, [a: [], b: ["listener 'x' is not receiving yet"]], now: 3.1)
        announcer.apply(settings, [a: [], b: ["listener 'x' is not receiving yet"]], now: 3.3)
        #expect(logged() == ["listener 'x' is not receiving yet"])
        #expect(routes.routes.withLock { $0 } == ["198.18.0.1 201 201"])
        #expect(announcer.snapshot().map(\.entry.announced) == [true, false])
        #expect(announcer.snapshot().first { $0.address == b }?.entry.reason == "listener 'x' is not receiving yet")
        announcer.apply(settings, [a: [], b: []], now: 2)
        #expect(routes.routes.withLock { $0 } == ["198.18.0.1 201 201", "2001:db8::1 201 201"])
        // Unready: withdrawn, with the reason.
        announcer.apply(settings, [a: ["listener 'a' has no healthy downstream"], b: []], now: 3)
        #expect(routes.routes.withLock { $0 } == ["2001:db8::1 201 201"])
        let entryA = announcer.snapshot().first { $0.address == a }!.entry
        #expect(!entryA.announced && entryA.withdrawals == 1 && entryA.announcements == 1 && entryA.since == 3)
        // A reload moves the table: the new route, then the old one goes.
        settings.table = 1000
        announcer.apply(settings, [a: [], b: []], now: 4)
        #expect(routes.routes.withLock { $0 } == ["198.18.0.1 1000 201", "2001:db8::1 1000 201"])
        // Someone removed one; a route of ours for an address not configured (another
        // instance's) and another protocol's route are left alone.
        routes.routes.withLock { $0 = ["2001:db8::1 1000 201", "198.18.9.9 1000 201", "198.18.9.8 1000 7"] }
        announcer.verify(settings)
        #expect(routes.routes.withLock { $0 } == ["198.18.0.1 1000 201", "2001:db8::1 1000 201", "198.18.9.9 1000 201", "198.18.9.8 1000 7"])
        #expect(announcer.repairs.load(ordering: .relaxed) == 1)
        routes.routes.withLock { _ = $0.remove("198.18.9.9 1000 201") }
        // The kernel refuses: counted, said in the reason, tried again at the next check.
        routes.failing.withLock { $0 = true }
        announcer.apply(settings, [a: ["stopping"], b: []], now: 5)
        #expect(announcer.errors.load(ordering: .relaxed) == 1)
        #expect(announcer.snapshot().first { $0.address == a }?.entry.announced == true, "still announced: the route is still there")
        routes.failing.withLock { $0 = false }
        announcer.apply(settings, [a: ["stopping"], b: []], now: 6)
        #expect(routes.routes.withLock { $0 } == ["2001:db8::1 1000 201", "198.18.9.8 1000 7"])
        // A configured address that is not ready but has a route of ours (a killed run's): removed.
        routes.routes.withLock { _ = $0.insert("198.18.0.1 1000 201") }
        announcer.verify(settings)
        #expect(routes.routes.withLock { $0 } == ["2001:db8::1 1000 201", "198.18.9.8 1000 7"])
        #expect(announcer.repairs.load(ordering: .relaxed) == 2)
        // An address removed from the section is withdrawn and forgotten; so is all at a stop.
        settings.addresses = [a]
        announcer.apply(settings, [a: []], now: 7)
        #expect(routes.routes.withLock { $0 } == ["198.18.0.1 1000 201", "198.18.9.8 1000 7"])
        #expect(announcer.snapshot().map(\.address) == [a])
        // A move whose removal of the old route fails keeps it, and removes it at a later check.
        routes.failOnRemove.withLock { $0 = true }
        settings.table = 1001
        announcer.apply(settings, [a: []], now: 7.5)
        #expect(routes.routes.withLock { $0 } == ["198.18.0.1 1000 201", "198.18.0.1 1001 201", "198.18.9.8 1000 7"])
        routes.failOnRemove.withLock { $0 = false }
        announcer.apply(settings, [a: []], now: 7.6)
        #expect(routes.routes.withLock { $0 } == ["198.18.0.1 1001 201", "198.18.9.8 1000 7"])
        #expect(announcer.withdrawAll(reason: "stopping", now: 8) == [a])
        #expect(routes.routes.withLock { $0 } == ["198.18.9.8 1000 7"])
        // Sealed by the stop: a check that finds every listener ready announces nothing; the
        // withdrawal's reason stays, and the drain's checks log no "not announced".
        let before = logged()
        announcer.apply(settings, [a: []], now: 9)
        announcer.apply(settings, [a: ["udp-fanout is stopping"]], now: 8.2)
        announcer.apply(settings, [a: ["udp-fanout is stopping"]], now: 11)
        #expect(routes.routes.withLock { $0 } == ["198.18.9.8 1000 7"])
        #expect(announcer.snapshot().first { $0.address == a }?.entry.reason == "stopping")
        #expect(logged() == before, "\(logged())")
        #expect(announcer.lastWithdrawal == 8)
        let text = announcer.metricsText()
        #expect(text.contains("udp_fanout_announced{address=\"198.18.0.1\"} 0"))
        #expect(text.contains("udp_fanout_announce_changes_total{address=\"198.18.0.1\",action=\"announce\"} 4"), "\(text)")
        #expect(text.contains("udp_fanout_announce_errors_total 2"), "\(text)")
        #expect(text.contains("udp_fanout_announce_repairs_total 2"), "\(text)")
    }

    @Test("The daemon's reasons per address: a listener not running keeps its address withdrawn, a stop withdraws every address")
    func daemonReasons() throws {
        let config = try ConfigParser.parse("""
            listeners:
              - name: a
                bind: "198.18.0.1:5514"
                downstream: [{address: "198.18.1.2:2"}]
              - name: b
                bind: "0.0.0.0:5515"
                downstream: [{address: "198.18.1.2:2"}]
            announce: {addresses: [198.18.0.1, 198.18.0.2]}

            """)
        try config.validate(localAddresses: [])
        let routes = MemoryRoutes()
        let daemon = FanoutDaemon(config: config, configPath: nil, logger: Logger(label: "test"), routes: routes)
        let (settings, reasons) = daemon.announcementReasons()
        #expect(settings == config.announce)
        // Nothing started: every listener is "not receiving yet"; 198.18.0.1 has both, .2 only b.
        #expect(reasons[IPAddress("198.18.0.1")!] == ["listener 'a' is not receiving yet", "listener 'b' is not receiving yet"])
        #expect(reasons[IPAddress("198.18.0.2")!] == ["listener 'b' is not receiving yet"])
        daemon.reconcileAnnouncements(verify: true)
        #expect(routes.routes.withLock { $0 }.isEmpty)
        daemon.shutdown()
        #expect(daemon.announcementReasons().reasons[IPAddress("198.18.0.2")!] == ["udp-fanout is stopping"])
    }

    @Test("A listener receiving, with health checks on, is not announced before one of its downstreams passed a probe (an operator saw a node join ECMP with its backend dead); without health checks it is, if its address is local",
          .enabled(if: Privileges.enabled, Privileges.reason))
    func announcedOnlyWhenProven() throws {
        let address = IPAddress("127.0.0.1")!
        for health in [true, false] {
            var config = try ConfigParser.parse("""
                listeners:
                  - name: a
                    bind: "127.0.0.1:\(freePort())"
                    downstream: [{address: "127.0.0.1:\(freePort())"}]
                health: {enabled: \(health), protocol: udp_echo, interval_secs: 1, timeout_secs: 1}

                """)
            // Loopback is refused in a file (it never leaves the host): set in code, unvalidated.
            config.announce = Announce(addresses: [address])
            let daemon = FanoutDaemon(config: config, configPath: nil, logger: Logger(label: "test"), routes: MemoryRoutes())
            try daemon.start()
            defer { daemon.shutdown() }
            let ready = Probe.waitFor(seconds: 5) { daemon.readiness.isEmpty }
            #expect(ready, "\(daemon.readiness)")
            // The health checker is not running here: no probe ever passes.
            let reasons = daemon.announcementReasons().reasons[address] ?? []
            if health {
                #expect(reasons == ["listener 'a': none of its downstreams has passed a health probe yet"], "\(reasons)")
            } else {
                #expect(reasons.isEmpty, "\(reasons)")
                let notLocal = daemon.announcementReasons(isLocal: { _ in false }).reasons[address] ?? []
                #expect(notLocal.count == 1 && notLocal[0].contains("is not local on this node"), "\(notLocal)")
                #expect(daemon.announcementReasons(isLocal: KernelHostRoutes.isLocal).reasons[address]?.isEmpty == true, "127.0.0.1 is local")
            }
        }
    }

    @Test("udp-fanout drain on one node (no router needed): the route leaves at once, /readyz says draining, a datagram arriving meanwhile is still forwarded, a SIGTERM during the drain is logged and waits for it, exit 0, no route left; after a kill -9, udp-fanout withdraw removes the route the crash left",
          .enabled(if: Privileges.enabled, Privileges.reason), .timeLimit(.minutes(1)))
    func drainCommand() throws {
        let namespace = "tca-\(String(UInt32.random(in: 0...UInt32.max), radix: 16))"
        try #require(try run("/usr/sbin/ip", ["netns", "add", namespace]).status == 0)
        defer { _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace]) }
        let prefix = ["/usr/bin/nsenter", "--net=/run/netns/\(namespace)", "--"]
        for command in [["link", "set", "lo", "up"], ["addr", "add", "198.18.5.1/32", "dev", "lo"], ["addr", "add", "198.18.5.2/32", "dev", "lo"]] {
            try #require(try run("/usr/sbin/ip", ["-n", namespace] + command).status == 0)
        }
        let (receiver, client) = inNetworkNamespace(namespace) { () -> (Int32, Int32) in
            let receiver = socket(AF_INET, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_NONBLOCK.rawValue), 0)
            let bound = SocketAddress("198.18.5.2:6000")!.withSockAddr { bind(receiver, $0, $1) }
            let client = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
            return (bound == 0 ? receiver : -1, client)
        } ?? (-1, -1)
        defer { close(receiver); close(client) }
        try #require(receiver >= 0 && client >= 0)
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("announce-drain-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        try """
            listeners:
              - name: a
                bind: "198.18.5.1:5514"
                settings: {workers: 1, pin_cpus: false}
                downstream: [{address: "198.18.5.2:6000"}]
            metrics: {enabled: true, bind: "127.0.0.1:9466"}
            announce: {addresses: [198.18.5.1], drain_secs: 10}

            """.write(to: file, atomically: true, encoding: .utf8)
        func routes() -> String { (try? run("/usr/sbin/ip", ["-n", namespace, "route", "show", "table", "201"]).output) ?? "?" }
        func received() -> Int {
            var count = 0
            var buffer = [UInt8](repeating: 0, count: 64)
            while recv(receiver, &buffer, buffer.count, Int32(MSG_DONTWAIT)) > 0 { count += 1 }
            return count
        }
        func send() {
            var byte: UInt8 = 1
            _ = SocketAddress("198.18.5.1:5514")!.withSockAddr { sendto(client, &byte, 1, 0, $0, $1) }
        }

        let daemon = try Child("udp-fanout", ["-c", file.path], prefix: prefix)
        defer { if daemon.process.isRunning { daemon.signal(SIGKILL); daemon.wait() } }
        try #require(Probe.waitFor(seconds: 10) { routes().contains("blackhole 198.18.5.1 proto 201") }, "announced: \(routes())\n\(daemon.stderr)")
        // The command waits for the daemon to stop (--no-wait would not).
        let drainStarted = ContinuousClock.now
        let drain = try Child("udp-fanout", ["drain", "--endpoint", "127.0.0.1:9466"], prefix: prefix)
        #expect(Probe.waitFor(seconds: 2) { routes().isEmpty }, "withdrawn at once: \(routes())")
        let ready = Probe.curl(prefix, 9466, "/readyz")
        #expect(ready?.status == 503 && ready?.body.contains("draining") == true, "/readyz while draining: \(String(describing: ready))")
        _ = received()
        send()
        #expect(Probe.waitFor(seconds: 2) { received() == 1 }, "a datagram that arrives during the drain is forwarded")
        daemon.signal(SIGTERM)
        try daemon.waitFor("a stop was asked for during the drain: stopping when the drain ends (send it again to stop now)")
        #expect(daemon.wait(seconds: 20) == 0, "\(daemon.stderr)")
        // The SIGTERM waited for the drain: no exit before its 10 s were up.
        #expect(ContinuousClock.now - drainStarted >= .milliseconds(9500), "stopped \(ContinuousClock.now - drainStarted) after the drain began")
        #expect(drain.wait(seconds: 5) == 0, "udp-fanout drain: \(drain.stdout) \(drain.stderr)")
        #expect(drain.stdout.contains("stopped"), "udp-fanout drain waited for the stop: \(drain.stdout)")
        #expect(routes().isEmpty, "after the drain: \(routes())")

        #expect(!daemon.stderr.contains("cut short"), "\(daemon.stderr)")

        // Drains of 120 s here. After `udp-fanout drain`, a first SIGTERM waits and the next stop
        // signal, SIGINT (Ctrl-C), cuts it short; after a SIGTERM, the next one does.
        try String(contentsOf: file, encoding: .utf8).replacingOccurrences(of: "drain_secs: 10", with: "drain_secs: 120").write(to: file, atomically: true, encoding: .utf8)
        for drainedBy in ["udp-fanout drain", "SIGTERM"] {
            let interrupted = try Child("udp-fanout", ["-c", file.path], prefix: prefix)
            defer { if interrupted.process.isRunning { interrupted.signal(SIGKILL); interrupted.wait() } }
            try #require(Probe.waitFor(seconds: 10) { routes().contains("blackhole 198.18.5.1 proto 201") }, "announced: \(routes())\n\(interrupted.stderr)")
            if drainedBy == "SIGTERM" {
                interrupted.signal(SIGTERM)
                try interrupted.waitFor("draining: addresses withdrawn")
                interrupted.signal(SIGTERM)
            } else {
                let asked = try Child("udp-fanout", ["drain", "--no-wait", "--endpoint", "127.0.0.1:9466"], prefix: prefix)
                #expect(asked.wait(seconds: 10) == 0, "\(asked.stdout) \(asked.stderr)")
                try interrupted.waitFor("draining: addresses withdrawn")
                interrupted.signal(SIGTERM)
                try interrupted.waitFor("a stop was asked for during the drain")
                interrupted.signal(SIGINT)
            }
            try interrupted.waitFor("a stop signal again during the drain (SIGTERM or SIGINT): cut short, stopping now")
            #expect(interrupted.wait(seconds: 10) == 0, "\(drainedBy): \(interrupted.stderr)")
            #expect(routes().isEmpty, "after the interrupted drain (\(drainedBy)): \(routes())")
        }

        // A crash leaves the route (the kernel keeps it); the unit's ExecStopPost runs withdraw.
        let crashed = try Child("udp-fanout", ["-c", file.path], prefix: prefix)
        try #require(Probe.waitFor(seconds: 10) { routes().contains("blackhole 198.18.5.1 proto 201") }, "announced again: \(routes())\n\(crashed.stderr)")
        crashed.signal(SIGKILL)
        crashed.wait()
        #expect(routes().contains("blackhole 198.18.5.1 proto 201"), "kill -9 leaves the route: \(routes())")
        let withdraw = try run("/usr/bin/nsenter", ["--net=/run/netns/\(namespace)", "--", binaryDirectory.appendingPathComponent("udp-fanout").path, "withdraw", "-c", file.path])
        #expect(withdraw.status == 0, "udp-fanout withdraw: \(withdraw.output)")
        #expect(routes().isEmpty, "after udp-fanout withdraw: \(routes())")
    }

    @Test("Real routes: added, listed, replaced and removed by rtnetlink in a namespace of this test, IPv4 and IPv6, a table above 255; another protocol's route is left",
          .enabled(if: Privileges.enabled, Privileges.reason))
    func kernelRoutes() throws {
        let namespace = "tca-\(String(UInt32.random(in: 0...UInt32.max), radix: 16))"
        try #require(try run("/usr/sbin/ip", ["netns", "add", namespace]).status == 0)
        defer { _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace]) }
        // Another program's route of an address, in the same table: never taken over.
        try #require(try run("/usr/sbin/ip", ["-n", namespace, "route", "add", "blackhole", "198.18.0.9/32", "table", "201", "proto", "202"]).status == 0)
        let outcome = inNetworkNamespace(namespace) { () -> String in
            let routes = KernelHostRoutes()
            let a = IPAddress("198.18.0.1")!, b = IPAddress("2001:db8::1")!
            do {
                for table: UInt32 in [201, 70000] {
                    try routes.add(a, table: table, protocolNumber: 201)
                    try routes.add(a, table: table, protocolNumber: 201)  // ours already: EEXIST taken as success
                    try routes.add(b, table: table, protocolNumber: 201)
                    guard try routes.list(table: table, protocolNumber: 201) == [a, b] else { return "list \(table): \(try routes.list(table: table, protocolNumber: 201))" }
                    guard try routes.list(table: table, protocolNumber: 202) == (table == 201 ? [IPAddress("198.18.0.9")!] : []) else { return "the other protocol's list: \(try routes.list(table: table, protocolNumber: 202))" }
                    // Another protocol's route of the same address is not removed by ours.
                    try routes.remove(a, table: table, protocolNumber: 202)
                    guard try routes.list(table: table, protocolNumber: 201) == [a, b] else { return "removed by another protocol number" }
                    try routes.remove(a, table: table, protocolNumber: 201)
                    try routes.remove(a, table: table, protocolNumber: 201)  // gone already: no error
                    try routes.remove(b, table: table, protocolNumber: 201)
                    guard try routes.list(table: table, protocolNumber: 201).isEmpty else { return "left in \(table)" }
                }
                do {
                    try routes.add(IPAddress("198.18.0.9")!, table: 201, protocolNumber: 201)
                    return "announced over another protocol's route"
                } catch let error as SystemCallError where error.errno == EEXIST {
                    guard try routes.list(table: 201, protocolNumber: 202) == [IPAddress("198.18.0.9")!] else { return "the other route is gone" }
                }
                return "ok"
            } catch {
                return "\(error)"
            }
        }
        #expect(outcome == "ok")
    }
}
