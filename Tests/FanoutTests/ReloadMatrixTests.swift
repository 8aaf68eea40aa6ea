// SPDX-License-Identifier: Apache-2.0
import Foundation
import Logging
import Synchronization
import Testing
import TestSupport
import ReusePortLB
import SystemCalls
// SOCK_DGRAM: see docs/development.md (test files that use Glibc's socket constants).
import CSystemShim
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// The reload matrix: for every listener kind and every key a reload can change for it, one
/// reload under traffic, then: the listener serves (a burst sent after the reload arrives
/// whole), every datagram sent is delivered or in a counter, and the log says what happened.
/// With an injected failure at each step of the transaction, the old listener must still serve
/// and the reload be logged and counted as rejected. Each cell prints one `reload matrix:` line
/// (docs/reliability.md quotes them).
///
/// Topology: client — proxy — three backends (TestSupport's ``Topology``, two RX queues on the
/// client-facing veth); the daemon runs in-process, every call of it from a thread inside the
/// proxy's namespace, so its sockets, XDP and tc attachments are made there. Collectors in the
/// backends' namespaces count what is delivered; the kernel's UDP counters of the proxy's
/// namespace count what reached no socket.
@Suite("reload matrix", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct ReloadMatrixTests {
    static let full = ProcessInfo.processInfo.environment["RELIABILITY"] == "full"

    /// A listener kind of the matrix.
    enum Kind: String, CaseIterable, Sendable, CustomTestStringConvertible {
        case userspace, relay, tcEBPF = "tc_ebpf", afXDP = "af_xdp", xdp
        var testDescription: String { rawValue }
    }

    /// The one listener a cell reloads, rendered as YAML.
    struct Shape {
        var name = "x"
        var port = 5514
        var kind: Kind
        var balancing = "round_robin"
        var replies: String?
        var settings: [(String, String)]
        var backends = [1, 2]
        /// quic_lb (plaintext, config 1, 2-octet server IDs 0a0N) with each backend's server_id.
        var quic = false
        /// rate_limit, with rates the cell's traffic stays under (every datagram is checked, none dropped).
        var rateLimit = false
        /// amplification (two-way listeners), with a factor the echo servers' replies stay under.
        var amplification = false

        init(_ kind: Kind) {
            self.kind = kind
            switch kind {
            case .userspace: settings = [("workers", "2"), ("batch_size", "32"), ("recv_buf_size", "8388608"), ("busy_wait_us", "0")]
            case .relay:
                replies = "relay"
                settings = [("workers", "2"), ("io_uring", "true"), ("recv_buf_size", "8388608"), ("busy_wait_us", "0")]
            case .tcEBPF: settings = [("tc_attach", "auto"), ("max_packet_size", "9000")]
            case .afXDP: settings = [("output", "socket"), ("queues", "2"), ("xdp_mode", "auto"), ("batch_size", "64")]
            case .xdp: settings = [("tc_attach", "auto"), ("xdp_mode", "auto"), ("max_packet_size", "9000")]
            }
        }

        func yaml(_ topology: Topology) -> String {
            let mode = switch kind {
            case .userspace, .relay: "userspace"
            case .tcEBPF: "tc_ebpf"
            case .afXDP: "af_xdp"
            case .xdp: "xdp"
            }
            var text = "listeners:\n  - name: \(name)\n    bind: \"198.18.0.1:\(port)\"\n    mode: \(mode)\n    balancing: \(balancing)\n"
            if kind == .tcEBPF || kind == .afXDP || kind == .xdp { text += "    interface: \(topology.proxyInterface)\n" }
            if let replies { text += "    replies: \(replies)\n" }
            if quic { text += "    quic_lb: {config_id: 1, server_id_length: 2, nonce_length: 6}\n" }
            if rateLimit { text += "    rate_limit: {datagrams_per_second: 1000000, bytes_per_second: 1000000000, new_sources_per_second: 100000}\n" }
            if amplification { text += "    amplification: {factor: 3}\n" }
            text += "    settings: {\(settings.map { "\($0.0): \($0.1)" }.joined(separator: ", "))}\n    downstream:\n"
            for n in backends {
                text += "      - {name: b\(n), address: \"\(Topology.backendIPv4(n)):\(ReloadMatrixTests.backendPort)\"\(quic ? ", server_id: \"0a0\(n)\"" : "")}\n"
            }
            return text
        }

        /// This shape with one setting's value replaced.
        func setting(_ key: String, _ value: String) -> Shape {
            var changed = self
            changed.settings = settings.map { $0.0 == key ? (key, value) : $0 }
            return changed
        }
    }

    /// One cell: a kind and the key its reload changes.
    struct Cell: Sendable, CustomTestStringConvertible {
        let kind: Kind
        let key: String
        var testDescription: String { "\(kind.rawValue) \(key)" }

        /// The reloaded shape: one key changed.
        func changed(_ base: Shape) -> Shape {
            var shape = base
            switch key {
            case "bind": shape.port = 5515
            case "name": shape.name = "y"
            case "balancing": shape.balancing = "source_ip"
            case "downstream": shape.backends = [1, 2, 3]
            case "replies": shape.replies = kind == .relay ? nil : "nat"
            case "workers": shape = shape.setting("workers", "3")
            case "batch_size": shape = shape.setting("batch_size", kind == .afXDP ? "32" : "16")
            case "recv_buf_size": shape = shape.setting("recv_buf_size", "4194304")
            case "io_uring": shape = shape.setting("io_uring", "false")
            case "busy_wait_us": shape = shape.setting("busy_wait_us", "200")
            case "tc_attach": shape = shape.setting("tc_attach", "clsact")
            case "max_packet_size": shape = shape.setting("max_packet_size", "4000")
            case "output": shape = shape.setting("output", "preserve_source")
            case "queues": shape = shape.setting("queues", "1")
            case "xdp_mode": shape = shape.setting("xdp_mode", "generic")
            case "flow_templates": shape = shape.setting("flow_templates", "true")
            // The matrix's datagrams are not QUIC: undecodable, sent by the balancing (counted).
            case "quic_lb": shape.quic = true
            case "rate_limit": shape.rateLimit = true
            case "amplification": shape.amplification = true
            default: Issue.record("no change defined for key \(key)")
            }
            return shape
        }
    }

    static let backendPort = 6000

    /// Every key a reload can change, per kind. `interface` is not in it: the fixture has one
    /// client-facing interface (docs/reliability.md, "Not covered").
    static let keys: [Kind: [String]] = [
        .userspace: ["workers", "batch_size", "recv_buf_size", "busy_wait_us", "flow_templates", "bind", "balancing", "downstream", "name", "quic_lb", "rate_limit"],
        .relay: ["workers", "io_uring", "busy_wait_us", "replies", "balancing", "downstream", "name", "quic_lb", "rate_limit", "amplification"],
        .tcEBPF: ["tc_attach", "max_packet_size", "flow_templates", "bind", "balancing", "downstream", "name", "replies", "quic_lb", "rate_limit"],
        .afXDP: ["output", "queues", "xdp_mode", "batch_size", "flow_templates", "bind", "balancing", "downstream", "name", "quic_lb", "rate_limit"],
        .xdp: ["xdp_mode", "tc_attach", "max_packet_size", "flow_templates", "bind", "balancing", "downstream", "name", "replies", "quic_lb", "rate_limit"],
    ]

    /// The short form (`make test`) runs every af_xdp key (issue 21's case) and each other kind's
    /// keys that rebuild the listener in a different way; RELIABILITY=full runs them all.
    static let shortKeys: [Kind: Set<String>] = [
        .userspace: ["workers", "bind", "downstream", "quic_lb", "rate_limit"],
        .relay: ["io_uring", "busy_wait_us", "replies", "quic_lb", "rate_limit", "amplification"],
        .tcEBPF: ["tc_attach", "max_packet_size", "downstream", "replies", "name", "quic_lb", "rate_limit"],
        .afXDP: Set(keys[.afXDP]!),
        .xdp: ["xdp_mode", "max_packet_size", "downstream", "replies", "name", "quic_lb", "rate_limit"],
    ]

    static let cells: [Cell] = Kind.allCases.flatMap { kind in
        keys[kind]!.filter { full || shortKeys[kind]!.contains($0) }.map { Cell(kind: kind, key: $0) }
    }

    /// The kernel's UDP counters of a namespace (/proc/net/snmp): datagrams to a port no socket
    /// holds, and those a full receive buffer dropped.
    struct KernelUDP {
        var noPorts = 0, receiveBufferErrors = 0, inErrors = 0
        /// Datagrams the client's veth could not hand to the proxy (``Topology/clientSendDrops()``,
        /// each once): a loaded machine can overflow the per-CPU backlog before any socket sees them.
        var pathDrops = 0

        init(_ topology: Topology) throws {
            let table = try topology.udpCounters(topology.proxy)
            guard table["NoPorts"] != nil else { return }
            noPorts = table["NoPorts"] ?? 0
            receiveBufferErrors = table["RcvbufErrors"] ?? 0
            inErrors = table["InErrors"] ?? 0
            pathDrops = try topology.clientSendDrops()
        }
    }

    /// A running in-process daemon in the proxy's namespace with its log kept.
    final class Harness {
        let topology: Topology
        let log = LogStore()
        let daemon: FanoutDaemon
        let collectors: [Child]

        /// - Parameters:
        ///   - collectorArguments: added to each collector's command line (`--echo`).
        ///   - collectors: false: no collector runs (the test serves the backends itself).
        init(_ base: Shape, collectorArguments: [String] = [], collectors withCollectors: Bool = true) throws {
            let topology = try Topology(backends: 3, queues: 2)
            self.topology = topology
            if base.kind == .xdp {
                // The XDP program forwards, not tc (TCFixtures.prepareXDP).
                try TCFixtures.prepareXDP(topology)
            }
            collectors = try (withCollectors ? topology.backends : []).enumerated().map { index, namespace in
                let child = try Child("collector", [Topology.backendIPv4(index + 1), "\(ReloadMatrixTests.backendPort)", "0", "1", "--rcvbuf", "8388608"] + collectorArguments,
                                      prefix: topology.prefix(namespace))
                try child.waitFor("ready")
                return child
            }
            let config = try ConfigParser.parse(base.yaml(topology))
            try config.validate()
            let daemon = FanoutDaemon(config: config, configPath: nil, logger: log.logger)
            self.daemon = daemon
            let started = inNetworkNamespace(topology.proxy) { [daemon] () -> String? in
                do throws(DaemonError) {
                    try daemon.start()
                    return nil
                } catch {
                    return "\(error)"
                }
            }
            let deadline = ContinuousClock.now + .seconds(5)
            while !daemon.isReady && ContinuousClock.now < deadline { usleep(10_000) }
            try #require(started == .some(nil), "start: \(String(describing: started))")
            try #require(daemon.isReady, "\(daemon.readiness)")
        }

        /// Reloads from inside the proxy's namespace. - Returns: reload's answer.
        func reload(_ yaml: String) -> Bool {
            inNetworkNamespace(topology.proxy) { [daemon] in daemon.reload(text: yaml) } ?? false
        }

        /// Stops the daemon (in its namespace: tc and XDP detach there), then the collectors.
        /// - Returns: what each collector received.
        func stop() throws -> [Int] {
            _ = inNetworkNamespace(topology.proxy) { [daemon] in daemon.shutdown() }
            return try collectors.map { try $0.stop().int("received") }
        }

        /// Sends `count` datagrams from the client at `rate` per second to the proxy's `port`.
        func publisher(port: Int, count: Int, rate: Int) throws -> Child {
            try Child("publisher", ["198.18.0.1", "\(port)", "\(count)", "--rate", "\(rate)", "--batch", "8"], prefix: topology.prefix(topology.client))
        }

        /// Every log line from `index` on, as "message key=value …".
        func lines(from index: Int) -> [String] {
            log.lines.withLock { Array($0[index...]) }.map { line in
                ([line.message] + line.metadata.sorted { $0.key < $1.key }.map { "\($0.key)=\($0.value)" }).joined(separator: " ")
            }
        }

        var logCount: Int { log.lines.withLock { $0.count } }

        /// The daemon's counts summed over `names` (a renamed listener counts under both).
        func counts(_ names: [String]) -> (forwarded: Int, drops: Int) {
            names.compactMap { daemon.counters(of: $0) }.reduce((0, 0)) { sum, snapshot in
                (sum.0 + Int(snapshot.forwarded), sum.1 + Int(snapshot.droppedTotal + snapshot.noHealthy))
            }
        }

        /// Waits until the daemon's forwarded count stops moving (at most 5 s).
        func settle(_ names: [String]) -> (forwarded: Int, drops: Int) {
            var last = counts(names)
            var stableSince = ContinuousClock.now
            let deadline = ContinuousClock.now + .seconds(5)
            while ContinuousClock.now - stableSince < .milliseconds(300) && ContinuousClock.now < deadline {
                usleep(50_000)
                let now = counts(names)
                if now != last { last = now; stableSince = ContinuousClock.now }
            }
            return last
        }
    }

    /// What one cell measured.
    struct Outcome {
        var sent = 0, delivered = 0, forwarded = 0, drops = 0, noPorts = 0, receiveBufferErrors = 0
        /// The kernel's Udp InErrors (receive buffer errors among them) and its drops on the
        /// client's path (veth backlog), over the cell.
        var inErrors = 0, pathDrops = 0
        var burst = 0, served = 0
        var applied = false
        var log: [String] = []
    }

    static let traffic = (count: 3000, rate: 6000, burst: 200)

    /// Runs one reload under traffic: the publisher sends to the old bind from 300 ms before the
    /// reload to about 200 ms after it, then a burst goes to the new bind once everything settled.
    /// - Parameter inject: set on the daemon before the reload (nil: no failure).
    static func run(_ kind: Kind, _ base: Shape, _ changed: Shape,
                    inject: (@Sendable (TransitionStep, String) -> Bool)? = nil) throws -> Outcome {
        let harness = try Harness(base)
        var outcome = Outcome()
        let names = Array(Set([base.name, changed.name]))
        let kernelBefore = try KernelUDP(harness.topology)
        let publisher = try harness.publisher(port: base.port, count: traffic.count, rate: traffic.rate)
        usleep(300_000)
        let mark = harness.logCount
        harness.daemon.failureInjection.withLock { $0 = inject }
        outcome.applied = harness.reload(changed.yaml(harness.topology))
        harness.daemon.failureInjection.withLock { $0 = nil }
        #expect(publisher.wait(seconds: 20) == 0, "\(publisher.stderr)")
        outcome.sent = try publisher.json().int("sent")
        let before = harness.settle(names)
        // The listener serves: a burst to the bind in force now arrives whole.
        let servingPort = outcome.applied ? changed.port : base.port
        let burst = try harness.publisher(port: servingPort, count: traffic.burst, rate: 20000)
        #expect(burst.wait(seconds: 20) == 0, "\(burst.stderr)")
        outcome.burst = try burst.json().int("sent")
        let after = harness.settle(names)
        outcome.served = after.forwarded - before.forwarded
        outcome.log = harness.lines(from: mark)
        outcome.forwarded = after.forwarded
        outcome.drops = after.drops
        let delivered = try harness.stop()
        outcome.delivered = delivered.reduce(0, +)
        let kernelAfter = try KernelUDP(harness.topology)
        outcome.noPorts = kernelAfter.noPorts - kernelBefore.noPorts
        outcome.receiveBufferErrors = kernelAfter.receiveBufferErrors - kernelBefore.receiveBufferErrors
        outcome.inErrors = kernelAfter.inErrors - kernelBefore.inErrors
        outcome.pathDrops = kernelAfter.pathDrops - kernelBefore.pathDrops
        return outcome
    }

    /// tc_ebpf and xdp changes whose old listener is stopped before the new one registers: a
    /// change of tc_attach (or xdp's xdp_mode) attaches the programs at the interface again (once
    /// per interface), which the daemon warns about; every other successor writes its entry over
    /// its predecessor's.
    static func stopsFirst(_ cell: Cell) -> Bool {
        (cell.kind == .tcEBPF && cell.key == "tc_attach") || (cell.kind == .xdp && (cell.key == "tc_attach" || cell.key == "xdp_mode"))
    }

    /// The warning a tc_attach (or xdp_mode) change logs before it stops the old listener.
    static func warnsOfReattach(_ log: [String]) -> Bool {
        log.contains { $0.contains("changes: the program") && $0.contains("attached again at this interface") }
    }

    /// What every cell asserts about its traffic.
    /// - Parameter accountedByKernel: datagrams the kernel's Udp NoPorts counted that are accepted.
    static func trafficChecks(_ outcome: Outcome, accountedByKernel: Int) -> [(Bool, String)] {
        let total = outcome.sent + outcome.burst
        return [
            (outcome.sent == traffic.count && outcome.burst == traffic.burst, "the publishers sent everything"),
            (outcome.served == outcome.burst, "the listener serves after the reload: \(outcome.served) of \(outcome.burst) forwarded"),
            (outcome.delivered == outcome.forwarded, "what the daemon forwarded arrived: delivered \(outcome.delivered), forwarded \(outcome.forwarded)"),
            // What the veths dropped before the proxy's stack (a busy machine's backlog) never
            // reached the daemon: the kernel counted it there.
            (total == outcome.delivered + outcome.drops + accountedByKernel + outcome.pathDrops,
             "sent \(total) = delivered \(outcome.delivered) + daemon drops \(outcome.drops)\(accountedByKernel > 0 ? " + kernel no_port \(accountedByKernel)" : "")\(outcome.pathDrops > 0 ? " + veth drops \(outcome.pathDrops)" : "") (kernel Udp InErrors \(outcome.inErrors))"),
        ]
    }

    /// Records the failed checks.
    static func record(_ label: String, _ checks: [(Bool, String)], _ log: [String]) {
        let context = "\nlog after the reload:\n\(log.joined(separator: "\n"))"
        for (ok, what) in checks where !ok { Issue.record("\(label): \(what)\(context)") }
    }

    /// The line a cell prints (docs/reliability.md quotes them).
    static func report(_ label: String, _ outcome: Outcome, pass: Bool) {
        print("reload matrix: \(label): \(outcome.applied ? "applied" : "rejected"); sent \(outcome.sent + outcome.burst) (\(outcome.burst) after the reload, \(outcome.served) served), delivered \(outcome.delivered), daemon forwarded \(outcome.forwarded) drops \(outcome.drops), kernel no_port \(outcome.noPorts) rcvbuf \(outcome.receiveBufferErrors) in_errors \(outcome.inErrors) veth_drops \(outcome.pathDrops): \(pass ? "pass" : "FAIL")")
    }

    @Test("A reload of one key under traffic: the listener serves afterwards, every datagram is delivered or counted, the log says it applied",
          arguments: cells)
    func reload(cell: Cell) throws {
        let base = Shape(cell.kind)
        let changed = cell.changed(base)
        let outcome = try Self.run(cell.kind, base, changed)
        let total = outcome.sent + outcome.burst
        // Datagrams sent to a bind no longer configured reach no socket: the kernel counts them
        // (Udp NoPorts). Anywhere else a datagram must reach a downstream or a daemon counter.
        // A tc_attach change re-attaches the program, warned about: what arrives meanwhile the
        // kernel counts (Udp NoPorts).
        let accountedByKernel = cell.key == "bind" || Self.stopsFirst(cell) ? outcome.noPorts : 0
        var checks: [(Bool, String)] = [
            (outcome.applied, "the reload applied"),
            (outcome.log.contains { $0.hasPrefix("configuration loaded") }, "the log says the reload applied"),
            (!outcome.log.contains { $0.contains("rejected") || $0.hasPrefix("listener stopped") }, "the log says nothing was rejected or stopped"),
            (Self.warnsOfReattach(outcome.log) == Self.stopsFirst(cell), "the log warns of a re-attach exactly when tc_attach changes"),
        ]
        checks += Self.trafficChecks(outcome, accountedByKernel: accountedByKernel)
        if cell.key != "bind" && !Self.stopsFirst(cell) {
            checks.append((outcome.noPorts == 0, "no datagram reached a port without a socket: \(outcome.noPorts)"))
        }
        Self.record(cell.testDescription, checks, outcome.log)
        Self.report("\(cell.kind.rawValue) × \(cell.key)", outcome, pass: checks.allSatisfy(\.0))
    }

    /// Injected-failure cells: a settings key per kind (a change that rebuilds the listener) and
    /// each step of the transaction the kind has (userspace kinds have no release step: their old
    /// instance stops after the change committed).
    static let injectedCells: [InjectedCell] = [(Kind.userspace, "workers"), (.relay, "workers"), (.tcEBPF, "tc_attach"), (.tcEBPF, "max_packet_size"), (.afXDP, "batch_size"), (.xdp, "xdp_mode"), (.xdp, "max_packet_size")]
        .flatMap { kind, key in
            // A release step: an af_xdp interface handed over, a tc_ebpf listener stopped first.
            TransitionStep.allCases.filter { $0 != .release || kind == .afXDP || Self.stopsFirst(Cell(kind: kind, key: key)) }
                .map { InjectedCell(cell: Cell(kind: kind, key: key), step: $0) }
        }

    struct InjectedCell: Sendable, CustomTestStringConvertible {
        let cell: Cell
        let step: TransitionStep
        var testDescription: String { "\(cell.testDescription) failing at \(step.rawValue)" }
    }

    /// A failure at `step` of listener x, once: the change's own step fails, the rollback's
    /// restart of the old instance does not.
    static func once(_ step: TransitionStep) -> @Sendable (TransitionStep, String) -> Bool {
        let fired = Atomic<Bool>(false)
        return { at, listener in
            at == step && listener == "x" && !fired.exchange(true, ordering: .relaxed)
        }
    }

    /// Before the seal at the stop, the same runs lost 9 to 11 datagrams per stop uncounted.
    @Test("A stop under 100k pps (userspace, relay): the workers seal their sockets after their drain, so what arrives later is refused by the kernel, not lost in their close (sent = delivered + daemon drops + kernel NoPorts and receive-buffer errors + path drops)",
          arguments: [Kind.userspace, .relay])
    func stopUnderTraffic(kind: Kind) throws {
        let base = Shape(kind)
        let harness = try Harness(base)
        let kernelBefore = try KernelUDP(harness.topology)
        let publisher = try harness.publisher(port: base.port, count: 300_000, rate: 100_000)
        usleep(600_000)
        let mark = harness.logCount
        let delivered = try harness.stop().reduce(0, +)
        #expect(publisher.wait(seconds: 20) == 0, "\(publisher.stderr)")
        let sent = try publisher.json().int("sent")
        let kernelAfter = try KernelUDP(harness.topology)
        let daemon = harness.counts([base.name])
        let closing = Int(harness.daemon.counters(of: base.name)?.dropped[.closing] ?? 0)
        let noPorts = kernelAfter.noPorts - kernelBefore.noPorts
        let receiveBufferErrors = kernelAfter.receiveBufferErrors - kernelBefore.receiveBufferErrors
        let pathDrops = kernelAfter.pathDrops - kernelBefore.pathDrops
        #expect(sent == 300_000)
        #expect(noPorts > 0, "the stop came while the publisher ran: \(noPorts) refused after it")
        #expect(sent == delivered + daemon.drops + noPorts + receiveBufferErrors + pathDrops,
                "sent \(sent) = delivered \(delivered) + daemon drops \(daemon.drops) (closing \(closing)) + kernel NoPorts \(noPorts) + RcvbufErrors \(receiveBufferErrors) + path drops \(pathDrops) (forwarded \(daemon.forwarded))")
        let sealed = harness.lines(from: mark).filter { $0.contains("worker socket sealed before its last read") }.count
        #expect(sealed == 2, "both workers sealed after their drain: \(sealed)")
        print("stop under traffic (\(kind)): sent \(sent), delivered \(delivered), daemon drops \(daemon.drops) (closing \(closing)), NoPorts \(noPorts), RcvbufErrors \(receiveBufferErrors), path drops \(pathDrops)")
    }

    /// Before the reply tail and the seal of the session sockets, replies queued on a session
    /// socket when it closed were lost uncounted: an operator measured 2 to 33 per stop at 30k
    /// requests/s, 222 with a downstream answering 20 ms late.
    @Test("A relay stopped under two-way traffic (echo servers answering at once, and 20 ms late): every reply to a request it forwarded is relayed or counted, none lost in the close of its session sockets (requests sent + replies echoed = requests delivered + daemon drops + replies relayed + reply drops + kernel NoPorts, receive-buffer errors and path drops)",
          arguments: [0, 20])
    func relayStopUnderExchanges(echoDelayMilliseconds: Int) throws {
        let base = Shape(.relay)
        let echo = ["--echo"] + (echoDelayMilliseconds > 0 ? ["--echo-delay-ms", "\(echoDelayMilliseconds)"] : [])
        let harness = try Harness(base, collectorArguments: echo)
        let topology = harness.topology
        let kernelBefore = try KernelUDP(topology)
        let backendDropsBefore = try topology.backendSendDrops()
        // 64 clients, 8 requests each in flight: replies keep coming while the workers stop.
        let clients = try Child("publisher", ["198.18.0.1", "\(base.port)", "1000000", "--exchange", "--clients", "64", "--window", "8",
                                              "--reply-timeout-ms", "200", "--duration", "2.5"], prefix: topology.prefix(topology.client))
        usleep(1_000_000)
        let mark = harness.logCount
        _ = inNetworkNamespace(topology.proxy) { [daemon = harness.daemon] in daemon.shutdown() }
        // Then the echo servers: echoes they still hold go out as they stop, to closed ports.
        let servers = try harness.collectors.map { try $0.stop() }
        #expect(clients.wait(seconds: 20) == 0, "\(clients.stderr)")
        let requests = try clients.json().int("requests")
        let delivered = servers.reduce(0) { $0 + $1.int("received") }
        let echoed = servers.reduce(0) { $0 + $1.int("echoed") }
        let echoFailed = servers.reduce(0) { $0 + $1.int("echo_failed") }
        let kernelAfter = try KernelUDP(topology)
        let snapshot = try #require(harness.daemon.counters(of: base.name))
        let requestDrops = Int(snapshot.droppedTotal + snapshot.noHealthy)
        let closing = Int(snapshot.dropped[.closing] ?? 0)
        let twoWay = snapshot.twoWay ?? TwoWaySnapshot()
        let relayed = Int(twoWay.replies)
        let replyDrops = Int(twoWay.replyDropped.values.reduce(0, +))
        let noPorts = kernelAfter.noPorts - kernelBefore.noPorts
        let receiveBufferErrors = kernelAfter.receiveBufferErrors - kernelBefore.receiveBufferErrors
        let pathDrops = kernelAfter.pathDrops - kernelBefore.pathDrops + (try topology.backendSendDrops()) - backendDropsBefore
        let summary = "requests \(requests) + echoed \(echoed) (echo failures \(echoFailed)) = delivered \(delivered) + daemon drops \(requestDrops) (closing \(closing)) + relayed \(relayed) + reply drops \(replyDrops) \(twoWay.replyDropped) + kernel NoPorts \(noPorts) + RcvbufErrors \(receiveBufferErrors) + path drops \(pathDrops)"
        #expect(relayed > 10_000 && noPorts > 0, "the stop came under traffic: requests went on after it, refused by the kernel: \(summary)")
        #expect(requests + echoed == delivered + requestDrops + relayed + replyDrops + noPorts + receiveBufferErrors + pathDrops, "\(summary)")
        let log = harness.lines(from: mark)
        let sealed = log.filter { $0.contains("session sockets sealed before their last read") }.count
        #expect(sealed == 2, "both workers sealed their session sockets: \(sealed)\n\(log.joined(separator: "\n"))")
        print("relay stop under exchanges (echo delay \(echoDelayMilliseconds) ms): \(summary)")
    }

    /// A draining socket closes at the latest session_idle_secs after its drain time, also while
    /// its downstream keeps sending: closed at once after its last read, it freed what arrived
    /// in between uncounted; now the sweep seals it, reads it at the next sweep, then closes it.
    /// Past the draining bound (max_sessions) a leaving session's socket was closed at once the
    /// same way (an operator saw one reply lost uncounted); now it is sealed at once instead.
    /// Both losses were microseconds wide: the old code passes this test in most runs. It checks
    /// that the sealed paths account for every datagram, it does not reproduce those losses.
    @Test("A downstream that keeps sending to its leaving session sockets: those that close while it sends (drain_secs 1, session_idle_secs 1) and those past the draining bound (max_sessions 12, two reloads within drain_secs) are sealed first; every datagram it sent is relayed, counted drained, or refused by the kernel after the seal",
          arguments: [false, true])
    func relayDrainingSocketsCloseUnderStream(pastBound: Bool) throws {
        var base = Shape(.relay)
        base.settings += pastBound ? [("drain_secs", "30"), ("session_idle_secs", "30"), ("max_sessions", "12")] : [("drain_secs", "1"), ("session_idle_secs", "1")]
        let harness = try Harness(base, collectors: false)
        let topology = harness.topology
        let mark = harness.logCount
        // Downstreams b1 and b2 are this test's sockets: they take the requests, then stream to
        // their session ports.
        let downstreams = try (1...2).map { n in
            try #require(Self.udpSocket(in: topology.backends[n - 1], bind: SocketAddress(ip: IPAddress(Topology.backendIPv4(n))!, port: UInt16(Self.backendPort))))
        }
        defer { for fd in downstreams { close(fd) } }
        let clients = try (0..<(pastBound ? 12 : 32)).map { _ in try #require(Self.udpSocket(in: topology.client, bind: nil)) }
        defer { for client in clients { close(client) } }
        let listener = SocketAddress(ip: IPAddress("198.18.0.1")!, port: UInt16(base.port))
        func request() {
            var byte: UInt8 = 1
            for client in clients { _ = listener.withSockAddr { sendto(client, &byte, 1, 0, $0, $1) } }
        }
        request()
        // The session ports, from the requests' sources: round robin splits the clients.
        let first = Self.sources(downstreams, count: clients.count)
        try #require(first[0].count + first[1].count == clients.count && !first[0].isEmpty && !first[1].isEmpty, "both downstreams got clients: \(first.map(\.count))")
        var changed = base
        changed.backends = [2]
        // b1 leaves: its sessions drain.
        #expect(harness.reload(changed.yaml(topology)))
        var streamed = first[0]
        var from = downstreams[0]
        if pastBound {
            // Every client on b2 now; then b2 leaves too, within drain_secs: its 12 sessions
            // retire beside b1's draining ones, and the bound (12) turns some away.
            request()
            let second = Self.sources(downstreams, count: clients.count)
            try #require(second[1].count == clients.count, "every client on b2: \(second.map(\.count))")
            changed.backends = [1]
            #expect(harness.reload(changed.yaml(topology)))
            streamed = second[1]
            from = downstreams[1]
        }
        let kernelBefore = try KernelUDP(topology)
        let backendDropsBefore = try topology.backendSendDrops()
        let before = try #require(harness.daemon.counters(of: base.name)?.twoWay)
        // About 14,000 datagrams a second over the session ports (for 5 s: relayed within the
        // drain time, counted drained after it, then sealed and refused; past the bound, for 2 s:
        // relayed where they drain, refused where sealed at once).
        let sent = Self.stream(from, to: streamed, seconds: pastBound ? 2 : 5)
        usleep(200_000)
        _ = try harness.stop()
        let after = try #require(harness.daemon.counters(of: base.name)?.twoWay)
        let kernelAfter = try KernelUDP(topology)
        let relayed = Int(after.replies - before.replies)
        var dropped: [ReplyDropReason: Int] = [:]
        for (reason, count) in after.replyDropped { dropped[reason] = Int(count - (before.replyDropped[reason] ?? 0)) }
        let drained = dropped[.drained] ?? 0
        let noPorts = kernelAfter.noPorts - kernelBefore.noPorts
        let receiveBufferErrors = kernelAfter.receiveBufferErrors - kernelBefore.receiveBufferErrors
        let pathDrops = try topology.backendSendDrops() - backendDropsBefore
        let summary = "sent \(sent) = relayed \(relayed) + reply drops \(dropped.values.reduce(0, +)) (drained \(drained)) + kernel NoPorts \(noPorts) + RcvbufErrors \(receiveBufferErrors) + path drops \(pathDrops)"
        if pastBound {
            let log = harness.lines(from: mark)
            #expect(log.contains { $0.contains("too many draining relay session sockets") && $0.contains("sealed at once") }, "\(log.joined(separator: "\n"))")
            #expect(relayed > 0 && noPorts > 0, "relayed where they drain, refused where sealed at once: \(summary)")
        } else {
            #expect(relayed > 0 && drained > 0 && noPorts > 0, "relayed within the drain time, drained after it, refused once sealed: \(summary)")
        }
        #expect(sent == relayed + dropped.values.reduce(0, +) + noPorts + receiveBufferErrors + pathDrops, "\(summary)")
        print("relay leaving session sockets under a stream (\(pastBound ? "past the draining bound" : "closed after the drain")): \(summary)")
    }

    /// A nonblocking UDP socket made in `namespace` (bound to `bind`, if given); nil if it cannot be.
    static func udpSocket(in namespace: String, bind: SocketAddress?) -> Int32? {
        let fd = inNetworkNamespace(namespace) { () -> Int32 in
            let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_NONBLOCK.rawValue), 0)
            guard fd >= 0 else { return -1 }
            if let bind, (try? Syscall.bind(fd, bind)) == nil {
                close(fd)
                return -1
            }
            return fd
        } ?? -1
        return fd >= 0 ? fd : nil
    }

    /// The sources of the next `count` datagrams the sockets `from` receive together (at most 3 s),
    /// by socket, each once.
    static func sources(_ from: [Int32], count: Int) -> [[SocketAddress]] {
        var found = [[SocketAddress]](repeating: [], count: from.count)
        var received = 0
        var byte: UInt8 = 0
        var storage = sockaddr_storage()
        let deadline = ContinuousClock.now + .seconds(3)
        while received < count && ContinuousClock.now < deadline {
            var got = false
            for (index, fd) in from.enumerated() {
                var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
                let read = withUnsafeMutablePointer(to: &storage) { $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { recvfrom(fd, &byte, 1, 0, $0, &length) } }
                guard read >= 0, let source = SocketAddress(storage: &storage) else { continue }
                got = true
                received += 1
                if !found[index].contains(source) { found[index].append(source) }
            }
            if !got { usleep(5_000) }
        }
        return found
    }

    /// Sends one-byte datagrams from `fd` to `destinations` in turn, 16 a millisecond, for
    /// `seconds`. - Returns: how many the kernel took.
    static func stream(_ fd: Int32, to destinations: [SocketAddress], seconds: Int) -> Int {
        var sent = 0
        var byte: UInt8 = 1
        let clock = ContinuousClock()
        let end = clock.now + .seconds(seconds)
        while clock.now < end {
            for _ in 0..<16 {
                if destinations[sent % destinations.count].withSockAddr({ sendto(fd, &byte, 1, 0, $0, $1) }) == 1 { sent += 1 }
            }
            usleep(1_000)
        }
        return sent
    }

    @Test("A reload failing at one step of its transaction under traffic: rejected and logged so, the old listener serves, every datagram delivered or counted",
          arguments: injectedCells)
    func injected(cell: InjectedCell) throws {
        let base = Shape(cell.cell.kind)
        let outcome = try Self.run(cell.cell.kind, base, cell.cell.changed(base), inject: Self.once(cell.step))
        let stopsFirst = Self.stopsFirst(cell.cell)
        var checks: [(Bool, String)] = [
            (!outcome.applied, "the reload was rejected"),
            (outcome.log.contains { $0.hasPrefix("configuration reload rejected") && $0.contains("failure injected by a test at step \(cell.step.rawValue)") },
             "the log says the reload was rejected, and why"),
            (!outcome.log.contains { $0.hasPrefix("configuration loaded") || $0.hasPrefix("listener stopped") }, "the log says nothing was applied or stopped"),
        ]
        if cell.step == .activate {
            // The new instance had started (its workers said so): its teardown is said too.
            checks.append((outcome.log.contains { $0.hasPrefix("new listener instance stopped unused") }, "the log says the new instance was stopped"))
        }
        // A tc_attach change stops the old listener first (warned about), and the rollback starts
        // it again: what arrives meanwhile the kernel counts. Every other cell has no such gap.
        checks += Self.trafficChecks(outcome, accountedByKernel: stopsFirst ? outcome.noPorts : 0)
        if stopsFirst {
            checks.append((Self.warnsOfReattach(outcome.log), "the log warns of the re-attach"))
        } else {
            checks.append((outcome.noPorts == 0, "no datagram reached a port without a socket: \(outcome.noPorts)"))
        }
        Self.record(cell.testDescription, checks, outcome.log)
        Self.report("\(cell.cell.kind.rawValue) × \(cell.cell.key), failing at \(cell.step.rawValue)", outcome, pass: checks.allSatisfy(\.0))
    }

    @Test("Issue 21 (operator): a reload whose other listener cannot start is rolled back before the tc_attach change stops the tc_ebpf listener: never interrupted, the log says the configuration was kept; when the tc_ebpf successor itself fails, the rejection says the listener was stopped and started again")
    func rollbackBeforeStopFirst() throws {
        let base = Shape(.tcEBPF)
        let changed = Cell(kind: .tcEBPF, key: "tc_attach").changed(base)
        let harness = try Harness(base)
        // Another listener of the new file, whose start fails (as a bind another process holds would).
        let other = "  - name: y\n    bind: \"127.0.0.1:\(freePort())\"\n    downstream: [{name: d, address: \"127.0.0.1:\(freePort())\"}]\n"
        var mark = harness.logCount
        harness.daemon.failureInjection.withLock { $0 = { at, listener in at == .start && listener == "y" } }
        #expect(!harness.reload(changed.yaml(harness.topology) + other))
        harness.daemon.failureInjection.withLock { $0 = nil }
        var log = harness.lines(from: mark)
        #expect(!log.contains { $0.contains("tc_attach changes") || $0.contains("detached tc_ebpf program") },
                "the tc_ebpf listener was not stopped for a change that could not be made: \(log.joined(separator: "\n"))")
        #expect(log.contains { $0.hasPrefix("configuration reload rejected") && $0.contains("keeping the running configuration") }, "\(log.joined(separator: "\n"))")
        // The tc_ebpf listener's own successor fails: it was stopped first, and is started again.
        mark = harness.logCount
        harness.daemon.failureInjection.withLock { $0 = Self.once(.start) }
        #expect(!harness.reload(changed.yaml(harness.topology)))
        harness.daemon.failureInjection.withLock { $0 = nil }
        log = harness.lines(from: mark)
        #expect(log.contains { $0.hasPrefix("configuration reload rejected") && $0.contains("'x' was stopped for it and started again") && !$0.contains("keeping the running configuration") },
                "the rejection says the listener was interrupted: \(log.joined(separator: "\n"))")
        try Self.expectServes(harness, port: base.port, "the listener serves after both rejected reloads")
    }

    @Test("Issue 21 (operator): tc_ebpf's unmatched counters do not go backwards when a tc_attach change loads the program again")
    func unmatchedAcrossReattach() throws {
        let base = Shape(.tcEBPF)
        let harness = try Harness(base)
        // Datagrams to a port no listener has: counted not_ours, then passed to the host's stack.
        func notOurs() -> Int {
            let line = harness.daemon.metricsText().split(separator: "\n").first { $0.hasPrefix("udp_fanout_tc_unmatched_packets_total{reason=\"not_ours\"}") }
            return line.flatMap { $0.split(separator: " ").last }.flatMap { Int($0) } ?? -1
        }
        let stray = try harness.publisher(port: base.port + 100, count: 50, rate: 5000)
        #expect(stray.wait(seconds: 20) == 0, "\(stray.stderr)")
        let before = notOurs()
        #expect(before >= 50, "the stray datagrams are counted not_ours: \(before)")
        let mark = harness.logCount
        #expect(harness.reload(Cell(kind: .tcEBPF, key: "tc_attach").changed(base).yaml(harness.topology)), "\(harness.lines(from: mark).joined(separator: "\n"))")
        #expect(harness.lines(from: mark).contains { $0.contains("tc_attach changes") }, "the program was attached again")
        #expect(notOurs() >= before, "not_ours after the re-attach: \(notOurs()), before: \(before)")
        _ = try harness.stop()
    }

    @Test("Issue 21: every start of a listener fails (the af_xdp query), so a failed change loses it: the log says so, /readyz and a gauge show it, and the next reload starts it again",
          arguments: [Kind.afXDP, .tcEBPF, .xdp, .userspace])
    func lost(kind: Kind) throws {
        let base = Shape(kind)
        let changed = Cell(kind: kind, key: kind == .afXDP ? "batch_size" : kind == .tcEBPF ? "tc_attach" : kind == .xdp ? "xdp_mode" : "workers").changed(base)
        let harness = try Harness(base)
        var mark = harness.logCount
        harness.daemon.failureInjection.withLock { $0 = { at, listener in at == .start && listener == "x" } }
        #expect(!harness.reload(changed.yaml(harness.topology)))
        harness.daemon.failureInjection.withLock { $0 = nil }
        let log = harness.lines(from: mark)
        // A released af_xdp (or stopped-first tc_ebpf) listener cannot be started again: lost. A
        // userspace one was never stopped: it serves on.
        let loses = kind != .userspace
        #expect(log.contains { $0.hasPrefix("listener stopped") } == loses, "\(log.joined(separator: "\n"))")
        #expect(!log.contains { $0.contains("keeping the running configuration") } == loses,
                "the log says the running configuration was kept only when it was: \(log.joined(separator: "\n"))")
        if loses {
            #expect(log.contains { $0.contains("configuration reload rejected") && $0.contains("'x'") && $0.contains("not running") }, "\(log.joined(separator: "\n"))")
        }
        let metrics = harness.daemon.metricsText()
        #expect(metrics.contains("udp_fanout_listeners_lost \(loses ? 1 : 0)\n"), "\(metrics.split(separator: "\n").filter { $0.contains("lost") })")
        #expect(harness.daemon.isReady == !loses, "\(harness.daemon.readiness)")
        // The operator reverts the file (or fixes what failed) and reloads: the listener runs again.
        mark = harness.logCount
        #expect(harness.reload(base.yaml(harness.topology)), "\(harness.lines(from: mark).joined(separator: "\n"))")
        let deadline = ContinuousClock.now + .seconds(5)
        while !harness.daemon.isReady && ContinuousClock.now < deadline { usleep(10_000) }
        #expect(harness.daemon.isReady, "\(harness.daemon.readiness)")
        #expect(harness.daemon.metricsText().contains("udp_fanout_listeners_lost 0\n"))
        let served = try Self.expectServes(harness, port: base.port, "the listener serves again after the reload")
        print("reload matrix: \(kind.rawValue) lost listener: \(loses ? "lost, then started again by the next reload" : "not lost"); \(served) of \(Self.traffic.burst) served after it")
    }

    /// After the reloads: a burst to `port` is forwarded whole by listener x, and everything it
    /// forwarded arrived (the harness is stopped). - Returns: how many of the burst it forwarded.
    @discardableResult
    static func expectServes(_ harness: Harness, port: Int, _ what: String) throws -> Int {
        let before = harness.settle(["x"])
        let burst = try harness.publisher(port: port, count: traffic.burst, rate: 20000)
        #expect(burst.wait(seconds: 20) == 0, "\(burst.stderr)")
        let after = harness.settle(["x"])
        #expect(after.forwarded - before.forwarded == traffic.burst, "\(what)")
        let delivered = try harness.stop().reduce(0, +)
        #expect(delivered == after.forwarded)
        return after.forwarded - before.forwarded
    }
}
