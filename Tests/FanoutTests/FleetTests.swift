// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
@testable import FanoutCore
import ReusePortLB
import CSystemShim
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// A fleet behind a real router (docs/fleet.md): three udp-fanout nodes announce the VIP through
/// their own routing daemons (BIRD 2 on nodes 1 and 2, FRR on node 3, with docs/fleet/'s example
/// configurations as written) to an FRR router that spreads it over them by ECMP with an L4
/// hash and watches them with BFD. In one topology per kind, while clients send from 48 sources
/// × 8 ports:
/// - nodes start: each is announced only once its listeners are ready;
/// - node 3 joins under traffic: nothing lost, about half the flows move (the kernel's ECMP is
///   hash-threshold: 2 nexthops to 3 moves half), and no source changes backend (`source_ip`:
///   the same choice on every node);
/// - node 2 is drained (`udp-fanout drain`) under traffic: nothing lost, the router stops
///   using it at once, the node exits 0 with its route withdrawn;
/// - node 1 dies (its packets dropped, then udp-fanout and its BIRD killed with SIGKILL): the
///   router stops using it within BFD's detection time, not BGP's hold time, and datagrams are
///   lost only while it had not.
/// Each phase prints its figures (sent, delivered, lost, flows moved, the router's convergence).
@Suite("Fleet", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct FleetTests {
    static let metricsPort = 9465
    static let backendCount = 4
    static let sourceCount = 48
    static let portsPerSource = 8
    static let vip = ScaleOutTopology.vip

    /// The configuration of node `i` in `mode`: ScaleOut's listener, plus the announce section
    /// (table 201 for the BIRD nodes, main for the FRR one, as docs/fleet/ says). Userspace also
    /// listens on the IPv6 VIP, which is then announced too.
    static func config(mode: String, node i: Int, speaker: FleetRouting.Speaker) -> String {
        let downstreams = (1...backendCount).map { k in
            "      - {name: b\(k), address: \"\(ScaleOutTopology.backendAddress(k)):\(ScaleOutTests.backendPort)\"}"
        }.joined(separator: "\n")
        let modeKeys = switch mode {
        case "userspace": "    mode: userspace\n    settings: {workers: 1, pin_cpus: false, recv_buf_size: 8388608}"
        case "relay": "    mode: userspace\n    replies: relay\n    settings: {workers: 1, pin_cpus: false, recv_buf_size: 8388608, drain_secs: 2}"
        case "nat tc_ebpf", "nat xdp": "    mode: \(mode.dropFirst(4))\n    interface: \(ScaleOutTopology.nodeInterface)\n    replies: nat"
        default: "    mode: \(mode)\n    interface: \(ScaleOutTopology.nodeInterface)"
        }
        var listeners = """
              - name: lb
                bind: "\(vip):\(ScaleOutTests.port)"
            \(modeKeys)
                balancing: source_ip
                downstream:
            \(downstreams)

            """
        var addresses = [vip]
        if mode == "userspace" {
            listeners += """
                  - name: lb6
                    bind: "[\(ScaleOutTopology.vip6)]:\(ScaleOutTests.port)"
                \(modeKeys)
                    balancing: source_ip
                    downstream:
                \(downstreams)

                """
            addresses.append(ScaleOutTopology.vip6)
        }
        return """
            listeners:
            \(listeners)metrics: {enabled: true, bind: "127.0.0.1:\(metricsPort)"}
            announce:
              addresses: [\(addresses.map { "\"\($0)\"" }.joined(separator: ", "))]
              table: \(speaker == .bird ? 201 : 254)
              drain_secs: 2

            """
    }

    /// One phase's traffic, sent from a thread while the test changes the fleet.
    final class Traffic: @unchecked Sendable {
        let flows: ClientFlows
        let phase: Int
        let rounds: Int
        private let done = DispatchSemaphore(value: 0)
        private(set) var sent = 0
        private(set) var error: (any Error)?
        /// When the first and last datagram left, and when each round started (wall clock).
        private(set) var started = 0.0, ended = 0.0
        private(set) var roundStarts: [Double] = []

        init(_ flows: ClientFlows, phase: Int, rounds: Int) {
            self.flows = flows
            self.phase = phase
            self.rounds = rounds
            Thread {
                self.started = WallClock.seconds()
                do {
                    self.sent = try self.flows.send(phase: phase, rounds: rounds) { _ in self.roundStarts.append(WallClock.seconds()) }
                } catch {
                    self.error = error
                }
                self.ended = WallClock.seconds()
                self.done.signal()
            }.start()
        }

        func wait() throws -> Int {
            done.wait()
            if let error { throw error }
            return sent
        }
    }

    /// What one phase showed.
    struct Outcome {
        var sent = 0
        var delivered = 0
        var lost: Int { sent - delivered }
        /// Flows (source and port) seen at more than one node.
        var movedFlows = 0
        var flows = 0
        /// Sources that reached more than one backend, or one the table does not give them.
        var changedBackend = 0
        var arrivals: [BackendReceivers.Arrival] = []
    }

    /// Waits for the traffic, collects its arrivals and checks every source's backend.
    static func collect(_ traffic: Traffic, _ receivers: BackendReceivers, _ topology: ScaleOutTopology, kind: String, label: String) throws -> Outcome {
        var outcome = Outcome()
        outcome.sent = try traffic.wait()
        outcome.arrivals = receivers.drain().filter { $0.phase == traffic.phase }
        outcome.delivered = outcome.arrivals.count
        let expected = ScaleOutTests.predicted(topology.sources, Array(1...backendCount))
        var backendsOf: [String: Set<Int>] = [:]
        var nodesOfFlow: [Int: Set<Int>] = [:]
        for arrival in outcome.arrivals {
            backendsOf[arrival.client, default: []].insert(arrival.backend)
            if let flow = arrival.flow, let node = arrival.node { nodesOfFlow[flow, default: []].insert(node) }
        }
        outcome.flows = nodesOfFlow.count
        outcome.movedFlows = nodesOfFlow.values.filter { $0.count > 1 }.count
        outcome.changedBackend = topology.sources.filter { source in backendsOf[source].map { $0 != [expected[source]!] } ?? false }.count
        #expect(outcome.changedBackend == 0, "\(kind) \(label): \(outcome.changedBackend) sources reached another backend than the table's")
        return outcome
    }

    /// Node `i` dies as a powered-off machine would: nothing leaves or enters it any more (an
    /// nftables table dropping everything), then its udp-fanout and routing daemon are killed
    /// with SIGKILL. Only BFD can tell the router.
    static func kill(node i: Int, _ daemon: Child, _ topology: ScaleOutTopology, _ routing: FleetRouting) throws {
        let rules = try TCFixtures.write("""
            table inet dead {
              chain i { type filter hook input priority -400; policy drop; }
              chain o { type filter hook output priority -400; policy drop; }
              chain f { type filter hook forward priority -400; policy drop; }
            }

            """, "fleet-dead")
        defer { try? FileManager.default.removeItem(at: rules) }
        try topology.exec(topology.nodes[i - 1], ["/usr/sbin/nft", "-f", rules.path])
        daemon.signal(SIGKILL)
        daemon.wait()
        routing.kill(node: i)
        // A crashed tc_ebpf or xdp daemon leaves its lock file in /run/udp-fanout, as it would
        // on a machine (the next start there takes it over). This test caused the crash, so it
        // removes the file: the name is the namespace's inode, which a later namespace reuses.
        // Every interface's: nat attaches to the reply interface (down0) too.
        if let lock = ScaleOutTests.lockFile(topology, topology.nodes[i - 1]) {
            let prefix = (lock as NSString).lastPathComponent.replacingOccurrences(of: "-\(ScaleOutTopology.nodeInterface).lock", with: "-")
            for name in (try? FileManager.default.contentsOfDirectory(atPath: TCAttachment.lockDirectory)) ?? [] where name.hasPrefix(prefix) {
                unlink("\(TCAttachment.lockDirectory)/\(name)")
            }
        }
    }

    static func report(_ line: String) {
        FileHandle.standardError.write(Data("fleet: \(line)\n".utf8))
    }

    @Test("BGP fleet (BIRD and FRR nodes, an FRR router with ECMP and BFD): announced once ready, a joining node moves half the flows (hash-threshold ECMP) and no source's backend, a drain loses nothing, a dead node is dropped within BFD's detection time",
          .timeLimit(.minutes(3)), arguments: ["userspace", "tc_ebpf", "xdp"])
    func fleet(mode: String) throws {
        try #require(FleetRouting.installed, "BIRD 2 and FRR are missing: run scripts/setup.sh (apt-get install bird2 frr)")
        let speakers: [FleetRouting.Speaker] = [.bird, .bird, .frr]
        let topology = try ScaleOutTopology(nodes: 3, backends: Self.backendCount, sources: Self.sourceCount, bgp: true)
        defer { topology.destroy() }
        let routing = try FleetRouting(topology, speakers: speakers)
        defer { routing.stop() }
        let receivers = try BackendReceivers(topology, backends: Self.backendCount)
        let flows = try ClientFlows(topology, portsPerSource: Self.portsPerSource)
        var files: [URL] = []
        defer { for file in files { try? FileManager.default.removeItem(at: file) } }
        for i in 1...3 {
            files.append(try TCFixtures.write(Self.config(mode: mode, node: i, speaker: speakers[i - 1]), "fleet-node\(i)"))
        }
        var daemons: [Int: Child] = [:]
        defer { for daemon in daemons.values where daemon.process.isRunning { daemon.signal(SIGTERM); daemon.wait() } }
        let sessions = Probe.waitFor(seconds: 30) { routing.establishedNodes() == ([1, 2, 3], [1, 2, 3]) }
        try #require(sessions, "BGP sessions: \(routing.establishedNodes())\n\(routing.logs)")
        #expect(routing.routerNodes(Self.vip).isEmpty, "nothing announced before udp-fanout runs")

        func start(_ i: Int) throws {
            let namespace = topology.nodes[i - 1]
            daemons[i] = try Child("udp-fanout", ["-c", files[i - 1].path], prefix: topology.prefix(namespace))
        }
        func readyAt(_ i: Int) throws -> Double {
            var at = 0.0
            let ready = Probe.waitFor(seconds: 15) {
                guard Probe.curl(topology.prefix(topology.nodes[i - 1]), Self.metricsPort, "/readyz")?.status == 200 else { return false }
                at = WallClock.seconds()
                return true
            }
            try #require(ready, "node \(i) ready: \(daemons[i]?.stderr ?? "")")
            return at
        }

        // 1. Nodes 1 and 2 start: each announced once ready (its log says so after its listeners
        //    entered their receive loops), the router uses both, every datagram arrives.
        try start(1)
        try start(2)
        for i in [1, 2] { _ = try readyAt(i) }
        try #require(routing.waitForRouter(Self.vip, nodes: [1, 2]) != nil, "router via nodes 1 and 2: \(routing.routerNodes(Self.vip))\n\(routing.logs)")
        if mode == "userspace" {
            #expect(routing.waitForRouter(ScaleOutTopology.vip6, nodes: [1, 2]) != nil, "IPv6 VIP via nodes 1 and 2: \(routing.routerNodes(ScaleOutTopology.vip6))")
        }
        let baseline = try Self.collect(Traffic(flows, phase: 1, rounds: 10), receivers, topology, kind: mode, label: "two nodes")
        #expect(baseline.lost == 0, "\(mode) two nodes: \(baseline.lost) of \(baseline.sent) lost")
        Self.report("\(mode) two nodes: sent \(baseline.sent) delivered \(baseline.delivered) lost \(baseline.lost)")

        // 2. Node 3 (FRR) joins under traffic.
        // Long enough that node 3 joins well inside it on a busy machine (about 5 s).
        let joining = Traffic(flows, phase: 2, rounds: 80)
        usleep(400_000)
        let start3 = WallClock.seconds()
        try start(3)
        let ready3 = try readyAt(3) - start3
        let joined = routing.waitForRouter(Self.vip, nodes: [1, 2, 3]).map { _ in WallClock.seconds() }
        let join = try Self.collect(joining, receivers, topology, kind: mode, label: "join")
        let joinedAt = try #require(joined, "router via all three nodes: \(routing.routerNodes(Self.vip))\n\(routing.logs)")
        // Otherwise the phase shows nothing about a join (the machine was too slow for its rounds).
        try #require(joinedAt < joining.ended - 0.5, "node 3 joined \(joinedAt - joining.ended) s after the traffic ended")
        let joinChange = routing.convergence(Self.vip, after: start3)
        #expect(join.lost == 0, "\(mode) join: \(join.lost) of \(join.sent) lost")
        // The kernel's ECMP is hash-threshold (RFC 2992): from 2 nexthops to 3 moves half the
        // flows (384 here, so 134 to 250), not a third; no source changes backend all the same.
        #expect((join.flows * 35 / 100...join.flows * 65 / 100).contains(join.movedFlows), "\(mode) join: \(join.movedFlows) of \(join.flows) flows moved")
        Self.report("\(mode) node 3 joins: sent \(join.sent) delivered \(join.delivered) lost \(join.lost); flows moved \(join.movedFlows) of \(join.flows); sources that changed backend \(join.changedBackend); node 3 seen ready (/readyz 200, polled) \(String(format: "%.0f ms", ready3 * 1000)) and in the router's route \(joinChange.map { String(format: "%.0f ms", $0 * 1000) } ?? "?") after its udp-fanout started")

        // 3. Node 2 is drained under traffic: withdrawn at once, serves for drain_secs, exits 0.
        let draining = Traffic(flows, phase: 3, rounds: 80)
        usleep(400_000)
        let drainStarted = WallClock.seconds()
        let drain = try Child("udp-fanout", ["drain", "--endpoint", "127.0.0.1:\(Self.metricsPort)"], prefix: topology.prefix(topology.nodes[1]))
        let withdrawn = routing.waitForRouter(Self.vip, nodes: [1, 3]).map { _ in WallClock.seconds() }
        let drained = try Self.collect(draining, receivers, topology, kind: mode, label: "drain")
        try #require(withdrawn.map { $0 < draining.ended - 0.5 } == true, "node 2 withdrawn while the traffic ran: \(withdrawn.map { "\($0 - draining.ended) s after its end" } ?? "never")")
        #expect(drain.wait(seconds: 20) == 0, "udp-fanout drain: \(drain.stdout) \(drain.stderr)")
        #expect(daemons[2]!.wait(seconds: 20) == 0, "node 2 after the drain: \(daemons[2]!.stderr)")
        try #require(withdrawn != nil, "router via nodes 1 and 3 after the drain: \(routing.routerNodes(Self.vip))")
        let drainChange = routing.convergence(Self.vip, after: drainStarted)
        #expect(drained.lost == 0, "\(mode) drain: \(drained.lost) of \(drained.sent) lost")
        for family in ["-4", "-6"] {
            let left = try topology.exec(topology.nodes[1], ["/usr/sbin/ip", family, "route", "show", "table", "all", "proto", "201"])
            #expect(left.isEmpty, "node 2's routes of protocol 201 (\(family)) after the drain: \(left)")
        }
        Self.report("\(mode) node 2 drained: sent \(drained.sent) delivered \(drained.delivered) lost \(drained.lost); router withdrew it \(drainChange.map { String(format: "%.0f ms", $0 * 1000) } ?? "?") after the command")

        // 4. Node 1 dies: nothing leaves or enters it any more (as a powered-off machine), then
        //    its udp-fanout and BIRD are killed. BFD (3 x 100 ms) takes it out.
        let dying = Traffic(flows, phase: 4, rounds: 40)
        usleep(400_000)
        let death = WallClock.seconds()
        try Self.kill(node: 1, daemons[1]!, topology, routing)
        let dropped = routing.waitForRouter(Self.vip, nodes: [3])
        let died = try Self.collect(dying, receivers, topology, kind: mode, label: "node death")
        try #require(dropped != nil, "router via node 3 only: \(routing.routerNodes(Self.vip))")
        let convergence = routing.convergence(Self.vip, after: death) ?? 99
        // Within BFD's detection (300 ms) and the router's reaction, well short of the 9 s hold time.
        #expect(convergence < 3, "\(mode) node death: the router took \(convergence) s")
        // Lost: only what the router sent to node 1 before it converged (and none after).
        let lateLost = Self.lostAfter(death + convergence, dying, received: died.arrivals.map { ($0.flow ?? -1, $0.round ?? -1) }, kind: mode)
        #expect(lateLost == 0, "\(mode) node death: \(lateLost) datagrams lost after the router converged")
        Self.report("\(mode) node 1 killed: sent \(died.sent) delivered \(died.delivered) lost \(died.lost) (all before the router converged: \(lateLost == 0)); router dropped it \(String(format: "%.0f ms", convergence * 1000)) after the node went silent")
    }

    /// What `traffic` lost in its rounds that started half a second after `converged` (by their
    /// own start times): `received` are the (flow, round) that arrived.
    static func lostAfter(_ converged: Double, _ traffic: Traffic, received: [(flow: Int, round: Int)], kind: String) -> Int {
        let arrived = Set(received.map { "\($0.flow) \($0.round)" })
        let roundsAfter = traffic.roundStarts.firstIndex { $0 > converged + 0.5 } ?? traffic.rounds
        #expect(roundsAfter < traffic.rounds, "\(kind) node death: no round was sent after the routers converged")
        var lost = 0
        for round in roundsAfter..<traffic.rounds {
            for flow in traffic.flows.flows.indices where !arrived.contains("\(flow) \(round)") { lost += 1 }
        }
        return lost
    }

    /// Reads the non-blocking `sockets` while `running` holds, each datagram to `handle` (the
    /// socket's index, its bytes, its sender and the sender's length); idles 0.5 ms when none has one.
    static func pump(_ sockets: [Int32], _ running: borrowing Atomic<Bool>, _ handle: (Int, [UInt8], sockaddr_storage, socklen_t) -> Void) {
        var buffer = [UInt8](repeating: 0, count: 2048)
        while running.load(ordering: .relaxed) {
            var any = false
            for (index, fd) in sockets.enumerated() {
                while true {
                    var peer = sockaddr_storage()
                    var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
                    let count = withUnsafeMutablePointer(to: &peer) { pointer in
                        pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { recvfrom(fd, &buffer, 1900, Int32(MSG_DONTWAIT), $0, &length) }
                    }
                    guard count > 0 else { break }
                    any = true
                    handle(index, Array(buffer[0..<count]), peer, length)
                }
            }
            if !any { usleep(500) }
        }
    }

    /// Backends that answer (in the backends namespace): each datagram goes back to its sender
    /// (the relay node's session socket) with ` b<k>` appended.
    final class EchoBackends: @unchecked Sendable {
        let sockets: [Int32]
        let running = Atomic<Bool>(true)
        private let done = DispatchSemaphore(value: 0)

        init(_ topology: ScaleOutTopology, backends: Int) throws {
            sockets = inNetworkNamespace(topology.backends) { () -> [Int32] in
                (1...backends).map { k -> Int32 in
                    let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_NONBLOCK.rawValue), 0)
                    var size: Int32 = 8 << 20
                    let bound = SocketAddress("\(ScaleOutTopology.backendAddress(k)):\(ScaleOutTests.backendPort)")!.withSockAddr { bind(fd, $0, $1) }
                    guard fd >= 0, bound == 0, setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, 4) == 0 else { return -1 }
                    return fd
                }
            } ?? []
            try #require(sockets.count == backends && !sockets.contains(-1), "echo backends: \(sockets)")
            Thread { [self] in
                FleetTests.pump(sockets, running) { index, bytes, peer, length in
                    var reply = bytes + Array(" b\(index + 1)".utf8)
                    var peer = peer
                    _ = withUnsafePointer(to: &peer) { pointer in
                        pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { sendto(sockets[index], &reply, reply.count, 0, $0, length) }
                    }
                }
                done.signal()
            }.start()
        }

        func stop() {
            guard running.exchange(false, ordering: .relaxed) else { return }
            done.wait()
            for fd in sockets { close(fd) }
        }

        deinit { stop() }
    }

    /// Reads the clients' sockets for replies: (flow, phase, round, backend, sender) each.
    final class ReplyReader: @unchecked Sendable {
        struct Reply { let flow: Int; let phase: Int; let round: Int; let backend: Int; let sender: String }
        let replies = Mutex<[Reply]>([])
        let running = Atomic<Bool>(true)
        private let done = DispatchSemaphore(value: 0)

        init(_ flows: ClientFlows) {
            let sockets = flows.flows.map(\.socket)
            Thread { [self] in
                FleetTests.pump(sockets, running) { index, bytes, peer, _ in
                    // `<source> <phase> <round> <flow> b<k>`
                    let fields = String(decoding: bytes, as: UTF8.self).split(separator: " ")
                    var peer = peer
                    let sender = withUnsafePointer(to: &peer) { SocketAddress(storage: UnsafeRawPointer($0)) }.map { "\($0)" } ?? "?"
                    guard fields.count == 5, let phase = Int(fields[1]), let round = Int(fields[2]), let backend = Int(fields[4].dropFirst()) else {
                        replies.withLock { $0.append(Reply(flow: index, phase: -1, round: -1, backend: -1, sender: sender)) }
                        return
                    }
                    replies.withLock { $0.append(Reply(flow: index, phase: phase, round: round, backend: backend, sender: sender)) }
                }
                done.signal()
            }.start()
        }

        /// The replies of `phase`, once none has come for 1.5 s (at most 15 s).
        func take(phase: Int) -> [Reply] {
            var count = -1
            let start = ContinuousClock.now
            while ContinuousClock.now - start < .seconds(15) {
                let now = replies.withLock { $0.count }
                if now == count { break }
                count = now
                usleep(1_500_000)
            }
            return replies.withLock { $0 }.filter { $0.phase == phase }
        }

        func stop() {
            guard running.exchange(false, ordering: .relaxed) else { return }
            done.wait()
        }

        deinit { stop() }
    }

    @Test("BGP fleet, two-way (source_ip; relay, and nat with the servers' router routing replies through the ready nodes): a client whose flow moves to another node keeps its server and gets every reply from the VIP; a joining node and a drain lose no reply; a dead node loses only what the routers sent it before BFD took it out",
          .timeLimit(.minutes(3)), arguments: ["relay", "nat tc_ebpf", "nat xdp"])
    func twoWayFleet(kind: String) throws {
        try #require(FleetRouting.installed, "BIRD 2 and FRR are missing: run scripts/setup.sh (apt-get install bird2 frr)")
        let speakers: [FleetRouting.Speaker] = [.bird, .bird, .frr]
        // nat keeps the client's address: the servers reply to it, through the nodes their
        // router learned the VIP from (docs/fleet/frr-servers.conf).
        let nat = kind.hasPrefix("nat")
        let topology = try ScaleOutTopology(nodes: 3, backends: Self.backendCount, sources: Self.sourceCount, bgp: true)
        defer { topology.destroy() }
        let routing = try FleetRouting(topology, speakers: speakers, servers: nat)
        defer { routing.stop() }
        let backends = try EchoBackends(topology, backends: Self.backendCount)
        defer { backends.stop() }
        let flows = try ClientFlows(topology, portsPerSource: Self.portsPerSource)
        let reader = ReplyReader(flows)
        defer { reader.stop() }
        var files: [URL] = []
        defer { for file in files { try? FileManager.default.removeItem(at: file) } }
        for i in 1...3 { files.append(try TCFixtures.write(Self.config(mode: kind, node: i, speaker: speakers[i - 1]), "fleet-2way\(i)")) }
        var daemons: [Int: Child] = [:]
        defer { for daemon in daemons.values where daemon.process.isRunning { daemon.signal(SIGTERM); daemon.wait() } }
        if nat {
            // docs/fleet.md's rule against un-translated replies, as written: the program's
            // replies leave by redirect and never meet it (every reply below comes from the VIP).
            for node in topology.nodes {
                try topology.exec(node, ["/usr/sbin/nft", "add", "table", "inet", "fanout-nat"])
                try topology.exec(node, ["/usr/sbin/nft", "add", "chain", "inet", "fanout-nat", "forward", "{ type filter hook forward priority 0; }"])
                try topology.exec(node, ["/usr/sbin/nft", "add", "rule", "inet", "fanout-nat", "forward", "oifname", "up0", "ip", "saddr", "198.18.210.0/24",
                                         "udp", "sport", "\(ScaleOutTests.backendPort)", "counter", "drop"])
            }
        }
        let sessions = Probe.waitFor(seconds: 30) {
            routing.establishedNodes().v4 == [1, 2, 3] && (!nat || routing.establishedNodes(servers: true).v4 == [1, 2, 3])
        }
        try #require(sessions, "BGP sessions: \(routing.establishedNodes()), servers' \(routing.establishedNodes(servers: true))\n\(routing.logs)")
        func start(_ i: Int) throws {
            daemons[i] = try Child("udp-fanout", ["-c", files[i - 1].path], prefix: topology.prefix(topology.nodes[i - 1]))
            let ready = Probe.waitFor(seconds: 15) { Probe.curl(topology.prefix(topology.nodes[i - 1]), Self.metricsPort, "/readyz")?.status == 200 }
            try #require(ready, "node \(i) ready: \(daemons[i]?.stderr ?? "")")
        }
        /// Both routers (the servers' with nat) use exactly `nodes`.
        func routed(_ nodes: Set<Int>) throws {
            try #require(routing.waitForRouter(Self.vip, nodes: nodes) != nil, "\(kind): router via \(nodes.sorted()): \(routing.routerNodes(Self.vip))\n\(routing.logs)")
            if nat {
                try #require(routing.waitForRouter(FleetRouting.clientsPrefix, nodes: nodes, servers: true) != nil,
                             "\(kind): servers' route to the clients via \(nodes.sorted()): \(routing.routerNodes(FleetRouting.clientsPrefix, servers: true))\n\((try? routing.vtysh(topology.backends, name: "servers", ["-c", "show ip route"]).output) ?? "")\n\(routing.logs)")
            }
        }
        let expected = ScaleOutTests.predicted(topology.sources, Array(1...Self.backendCount))
        let vip = "\(Self.vip):\(ScaleOutTests.port)"
        var serversOf: [String: Set<Int>] = [:]
        /// Sends a phase (the fleet changed by `during` meanwhile); returns sent and replies.
        func phase(_ number: Int, rounds: Int, label: String, during: () throws -> Void = {}) throws -> (sent: Int, replies: [ReplyReader.Reply], ended: Double, traffic: Traffic) {
            let traffic = Traffic(flows, phase: number, rounds: rounds)
            usleep(400_000)
            try during()
            let sent = try traffic.wait()
            let replies = reader.take(phase: number)
            #expect(replies.allSatisfy { $0.sender == vip }, "\(kind) \(label): replies from \(Set(replies.map(\.sender)))")
            for reply in replies { serversOf[flows.flows[reply.flow].source, default: []].insert(reply.backend) }
            return (sent, replies, traffic.ended, traffic)
        }

        try start(1)
        try start(2)
        try routed([1, 2])
        let baseline = try phase(1, rounds: 10, label: "two nodes")
        #expect(baseline.replies.count == baseline.sent, "\(kind) two nodes: \(baseline.replies.count) replies of \(baseline.sent)")
        Self.report("\(kind) two nodes: requests \(baseline.sent) replies \(baseline.replies.count) lost \(baseline.sent - baseline.replies.count)")

        var joinedAt = 0.0
        let join = try phase(2, rounds: 80, label: "join") {
            try start(3)
            try routed([1, 2, 3])
            joinedAt = WallClock.seconds()
        }
        try #require(joinedAt < join.ended - 0.5, "node 3 joined \(joinedAt - join.ended) s after the requests ended")
        #expect(join.replies.count == join.sent, "\(kind) join: \(join.replies.count) replies of \(join.sent)")
        Self.report("\(kind) node 3 joins: requests \(join.sent) replies \(join.replies.count) lost \(join.sent - join.replies.count)")

        var drainStarted = 0.0
        var withdrawnAt = 0.0
        let drained = try phase(3, rounds: 80, label: "drain") {
            drainStarted = WallClock.seconds()
            let drain = try Child("udp-fanout", ["drain", "--endpoint", "127.0.0.1:\(Self.metricsPort)"], prefix: topology.prefix(topology.nodes[1]))
            try routed([1, 3])
            withdrawnAt = WallClock.seconds()
            #expect(drain.wait(seconds: 20) == 0, "udp-fanout drain: \(drain.stderr)")
        }
        try #require(withdrawnAt < drained.ended - 0.5, "node 2 withdrawn \(withdrawnAt - drained.ended) s after the requests ended")
        #expect(drained.replies.count == drained.sent, "\(kind) drain: \(drained.replies.count) replies of \(drained.sent)")
        #expect(daemons[2]!.wait(seconds: 20) == 0, "node 2 after the drain: \(daemons[2]!.stderr)")
        Self.report("\(kind) node 2 drained: requests \(drained.sent) replies \(drained.replies.count) lost \(drained.sent - drained.replies.count); \(Self.convergences(routing, after: drainStarted)) after the command")

        // With nat, node 3's associations show how many clients' replies came through it without
        // their requests having made an association there first (server_initiated): replies did
        // cross nodes; none was refused (wrong_server), and none left a running node untranslated
        // (the nft rule's counter).
        var associations = ""
        if nat {
            let text = try Self.metrics(topology, node: 3)
            associations = Self.associationEvents(text)
            let crossed = text.split(separator: "\n").first { $0.hasPrefix("udp_fanout_association_events_total{") && $0.contains("event=\"server_initiated\"") }
                .flatMap { $0.split(separator: " ").last }.flatMap { Int($0) } ?? 0
            #expect(crossed > 0, "\(kind): no reply crossed nodes: \(associations)")
            // The two running nodes (node 2 is drained and gone).
            for i in [1, 3] {
                for line in try Self.metrics(topology, node: i).split(separator: "\n") where line.hasPrefix("udp_fanout_replies_dropped_total{") && line.contains("wrong_server") {
                    #expect(line.hasSuffix(" 0"), "\(kind) node \(i): \(line)")
                }
                let rule = try topology.exec(topology.nodes[i - 1], ["/usr/sbin/nft", "list", "chain", "inet", "fanout-nat", "forward"])
                #expect(rule.contains("counter packets 0 "), "\(kind): replies left node \(i) untranslated: \(rule)")
            }
        }
        var death = 0.0
        let died = try phase(4, rounds: 40, label: "node death") {
            death = WallClock.seconds()
            try Self.kill(node: 1, daemons[1]!, topology, routing)
            try routed([3])
        }
        let convergence = routing.convergence(Self.vip, after: death) ?? 99
        let serversConvergence = nat ? routing.convergence(FleetRouting.clientsPrefix, after: death, servers: true) ?? 99 : 0
        #expect(convergence < 3, "\(kind) node death: the router took \(convergence) s")
        #expect(serversConvergence < 3, "\(kind) node death: the servers' router took \(serversConvergence) s")
        // Replies lost: only requests the router sent to node 1, and replies the servers' router
        // sent through it, before they converged (and none after).
        let lateLost = Self.lostAfter(death + max(convergence, serversConvergence), died.traffic, received: died.replies.map { ($0.flow, $0.round) }, kind: kind)
        #expect(lateLost == 0, "\(kind) node death: \(lateLost) replies lost after the routers converged")
        Self.report("\(kind) node 1 killed: requests \(died.sent) replies \(died.replies.count) lost \(died.sent - died.replies.count) (all before the routers converged: \(lateLost == 0)); \(Self.convergences(routing, after: death)) after the node went silent")

        // Every client kept one server, the table's, whichever nodes its flows went through.
        let changed = topology.sources.filter { source in serversOf[source].map { $0 != [expected[source]!] } ?? true }
        #expect(changed.isEmpty, "\(kind): clients that changed server or got none: \(changed.map { "\($0) \(serversOf[$0].map { $0.sorted() } ?? [])" })")
        Self.report("\(kind): \(topology.sources.count - changed.count) of \(topology.sources.count) clients kept their server through join, drain and node death; every reply from \(vip)\(nat ? "; node 3's associations before node 1 died: \(associations)" : "")")
    }

    /// "router 140 ms" (and "servers' router 150 ms"): when their routes first changed after `time`.
    static func convergences(_ routing: FleetRouting, after time: Double) -> String {
        func text(_ seconds: Double?) -> String { seconds.map { String(format: "%.0f ms", $0 * 1000) } ?? "?" }
        var line = "router changed its route \(text(routing.convergence(vip, after: time)))"
        if routing.servers { line += ", servers' router \(text(routing.convergence(FleetRouting.clientsPrefix, after: time, servers: true)))" }
        return line
    }

    static func metrics(_ topology: ScaleOutTopology, node i: Int) throws -> String {
        try topology.exec(topology.nodes[i - 1], ["/usr/bin/curl", "-s", "http://127.0.0.1:\(metricsPort)/metrics"])
    }

    /// `created 10 server_initiated 38 ...` from udp_fanout_association_events_total.
    static func associationEvents(_ text: String) -> String {
        text.split(separator: "\n").filter { $0.hasPrefix("udp_fanout_association_events_total{") && !$0.hasSuffix(" 0") }.compactMap { line -> String? in
            guard let range = line.range(of: "event=\""), let end = line[range.upperBound...].firstIndex(of: "\"") else { return nil }
            return "\(line[range.upperBound..<end]) \(line.split(separator: " ").last ?? "?")"
        }.joined(separator: ", ")
    }
}
