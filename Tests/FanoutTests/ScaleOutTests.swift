// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
@testable import FanoutCore
import CSystemShim
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// Scale-out: three udp-fanout nodes with one configuration behind an ECMP router (L4 hash),
/// shared backends. With `source_ip` every node must send a source to the same backend, so a
/// source whose flows the router spreads over several nodes still reaches one backend: the one
/// the table every mode computes gives it (`DaemonFixtures.owners`). Shown when a node
/// leaves the route (nobody moves) and when a backend leaves every node's configuration by
/// SIGHUP (only its sources move, each where the table for the smaller set says).
@Suite("ScaleOut", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct ScaleOutTests {
    static let port: UInt16 = 5514
    static let backendPort = 6000
    static let metricsPort = 9464
    static let nodeCount = 3
    static let backendCount = 4
    /// 48 sources × 8 ports: a source's 8 flows all hash to one node with probability
    /// 3 × (1/3)^8 ≈ 0.05 % over 3 nexthops and 2 × (1/2)^8 ≈ 0.8 % over 2, so nearly every
    /// source is carried by several nodes (the check wants 43 of 48: more than 5 on one node
    /// over 2 nexthops has a probability of about 10^-6).
    static let sourceCount = 48
    static let portsPerSource = 8
    static let roundsPerPhase = 3

    /// The configuration every node of `mode` runs (byte for byte). `reordered` lists the
    /// downstreams in reverse order under other names: the same set, which must not matter.
    /// `bind` replaces the listener's address (the VIP), e.g. `[::]` for a dual-stack socket.
    static func config(mode: String, backends: [Int], reordered: Bool = false, bind: String? = nil) -> String {
        let downstreams = (reordered ? backends.reversed() : backends).map { k in
            "      - {name: \(reordered ? "backend-" : "b")\(k), address: \"\(ScaleOutTopology.backendAddress(k)):\(backendPort)\"}"
        }.joined(separator: "\n")
        let modeKeys = mode == "tc_ebpf"
            ? "    mode: tc_ebpf\n    interface: \(ScaleOutTopology.nodeInterface)"
            : "    mode: userspace\n    settings: {workers: 1, pin_cpus: false, recv_buf_size: 8388608}"
        return """
            listeners:
              - name: lb
                bind: "\(bind ?? ScaleOutTopology.vip):\(port)"
            \(modeKeys)
                balancing: source_ip
                downstream:
            \(downstreams)
            metrics: {enabled: true, bind: "127.0.0.1:\(metricsPort)"}

            """
    }

    static func downstreams(_ backends: [Int]) -> [Downstream] {
        backends.map { Downstream(name: "b\($0)", address: SocketAddress("\(ScaleOutTopology.backendAddress($0)):\(backendPort)")!) }
    }

    /// The backend number the table gives each source over `backends`.
    static func predicted(_ sources: [String], _ backends: [Int]) -> [String: Int] {
        let owners = DaemonFixtures.owners(sources, downstreams(backends))
        return owners.mapValues { owner in backends.first { ScaleOutTopology.backendAddress($0) == owner.ip.description } ?? 0 }
    }

    @Test("ECMP over 3 nodes, source_ip: every source at one backend (the table's) whichever node carried it; a node leaving the route moves nobody; a backend removed by SIGHUP on every node, or down by every node's health probes, moves only its sources",
          .timeLimit(.minutes(2)), arguments: [NodeModes.tc, .userspace, .mixed, .dualStack])
    func nodesAgree(modes: NodeModes) throws {
        let started = ContinuousClock.now
        let topology = try ScaleOutTopology(nodes: Self.nodeCount, backends: Self.backendCount, sources: Self.sourceCount)
        defer { topology.destroy() }
        let receivers = try BackendReceivers(topology, backends: Self.backendCount)
        let flows = try ClientFlows(topology, portsPerSource: Self.portsPerSource)
        // One file per mode (one file in all unless the nodes' modes differ).
        var files: [String: URL] = [:]
        defer { for file in files.values { try? FileManager.default.removeItem(at: file) } }
        for mode in Set(modes.perNode) {
            files[mode] = try TCFixtures.write(Self.config(mode: mode, backends: Array(1...Self.backendCount), reordered: modes.reordered(mode), bind: modes.bind(mode)), "scale-out")
        }
        var daemons: [Child] = []
        // Stopped by PID before the namespaces go, even when an expectation above failed.
        defer { for daemon in daemons where daemon.process.isRunning { daemon.signal(SIGTERM); daemon.wait() } }
        for (index, node) in topology.nodes.enumerated() {
            daemons.append(try Child("udp-fanout", ["-c", files[modes.perNode[index]]!.path], prefix: topology.prefix(node)))
        }
        for (index, node) in topology.nodes.enumerated() {
            let ready = Probe.waitFor(seconds: 10) { Probe.curl(topology.prefix(node), Self.metricsPort, "/readyz")?.status == 200 }
            try #require(ready, "node \(index + 1) ready: \(daemons[index].stderr)")
            if modes.perNode[index] == "tc_ebpf" { try daemons[index].waitFor("registered listener in eBPF map") }
        }

        /// `size` 0: short datagrams; else padded to `size` bytes (3000: 3 IPv4 fragments each
        /// at the links' 1500 MTU, which tc_ebpf counts one by one and userspace reassembled).
        func phase(_ number: Int, nodes carrying: [Int], backends: [Int], size: Int = 0) throws -> [String: Int] {
            let before = try topology.nodes.indices.map { try Self.received(topology, $0, mode: modes.perNode[$0]) }
            let sent = try flows.send(phase: number, rounds: Self.roundsPerPhase, size: size)
            let arrivals = receivers.drain().filter { $0.phase == number }
            let after = try topology.nodes.indices.map { try Self.received(topology, $0, mode: modes.perNode[$0]) }
            #expect(arrivals.count == sent, "phase \(number): every datagram arrived once: \(arrivals.count) of \(sent)")
            let expected = Self.predicted(topology.sources, backends)
            var backendsOf: [String: Set<Int>] = [:]
            var nodesOf: [String: Set<Int>] = [:]
            var perNode = [Int](repeating: 0, count: Self.nodeCount + 1)
            for arrival in arrivals {
                backendsOf[arrival.client, default: []].insert(arrival.backend)
                guard let node = arrival.node else {
                    Issue.record("phase \(number): a datagram of \(arrival.client) came in on no node's link")
                    continue
                }
                nodesOf[arrival.client, default: []].insert(node)
                perNode[node] += 1
                // tc_ebpf rewrites only the destination; userspace sends from the node's own address.
                let sender = modes.perNode[node - 1] == "tc_ebpf" ? arrival.client : ScaleOutTopology.nodeAddress(node)
                #expect(arrival.sender == sender, "phase \(number): \(arrival.client) via node \(node) arrived from \(arrival.sender)")
            }
            for source in topology.sources {
                #expect(backendsOf[source] == [expected[source]!],
                        "phase \(number): \(source) reached backends \(backendsOf[source]?.sorted() ?? []) via nodes \(nodesOf[source]?.sorted() ?? []); the table says b\(expected[source]!)")
                #expect(nodesOf[source, default: []].isSubset(of: Set(carrying)), "phase \(number): \(source) via \(nodesOf[source]?.sorted() ?? [])")
            }
            // The router spread each source: most were carried by at least two nodes (else
            // agreement between nodes would not have been tested).
            let spread = topology.sources.filter { nodesOf[$0, default: []].count >= 2 }.count
            if size > 1500 {
                // Fragments carry no ports: the L4 policy hashes them by addresses, one node per source.
                #expect(spread == 0, "phase \(number): fragmented, \(spread) sources still spread over nodes")
                #expect(arrivals.allSatisfy { $0.length == size }, "phase \(number): every datagram whole")
            } else {
                #expect(spread >= Self.sourceCount * 9 / 10, "phase \(number): \(spread) of \(Self.sourceCount) sources carried by 2 or more nodes")
            }
            // Each node's own count agrees with what came in on its link.
            for i in 1...Self.nodeCount {
                let counted = after[i - 1] - before[i - 1]
                let packets = perNode[i] * (size > 1500 && modes.perNode[i - 1] == "tc_ebpf" ? 3 : 1)
                #expect(counted == packets, "phase \(number): node \(i) counted \(counted) received, \(perNode[i]) datagrams came in on its link")
                #expect((counted > 0) == carrying.contains(i), "phase \(number): node \(i) carried \(counted) (route over \(carrying))")
            }
            // What was observed (0: several backends or none), for the phases to compare.
            return backendsOf.mapValues { $0.count == 1 ? $0.first! : 0 }
        }

        // (1) Every node forwards; every source at its table backend.
        let all = try phase(1, nodes: [1, 2, 3], backends: Array(1...Self.backendCount))
        #expect(Set(all.values) == Set(1...Self.backendCount), "the sources cover every backend: \(all)")

        // (2) Node 3 leaves the route: its flows move to nodes 1 and 2, no source changes backend.
        try topology.route(through: [1, 2])
        let twoNodes = try phase(2, nodes: [1, 2], backends: Array(1...Self.backendCount))
        #expect(twoNodes == all)

        // Rewrites every node's file and reloads each node; returns once each one applied it.
        func reload(_ backends: [Int], health: Bool, count: Int) throws {
            for (mode, file) in files {
                let text = Self.config(mode: mode, backends: backends, reordered: modes.reordered(mode), bind: modes.bind(mode)) + (health ? Self.health + "\n" : "")
                try text.write(to: file, atomically: true, encoding: .utf8)
            }
            for daemon in daemons { daemon.signal(SIGHUP) }
            for (index, node) in topology.nodes.enumerated() {
                let applied = Probe.waitFor(seconds: 10) {
                    metric((try? Self.metrics(topology, node)) ?? "", "udp_fanout_config_reloads_total", "result=\"ok\"") == count
                }
                try #require(applied, "node \(index + 1) applied reload \(count): \(daemons[index].stderr)")
            }
        }
        // Exactly the sources `all` gave to `gone` moved.
        func expectOnlyMoved(_ gone: Int, _ now: [String: Int], _ what: String) {
            let moved = topology.sources.filter { now[$0] != all[$0] }
            #expect(!moved.isEmpty && moved.allSatisfy { all[$0] == gone }, "\(what): only b\(gone)'s sources moved: \(moved.map { "\($0) b\(all[$0]!)→b\(now[$0] ?? 0)" })")
            #expect(moved.count == all.values.filter { $0 == gone }.count, "\(what): every b\(gone) source moved")
        }

        // (3) b2 leaves every node's configuration (SIGHUP); node 3 is back in the route.
        try topology.route(through: [1, 2, 3])
        try reload([1, 3, 4], health: false, count: 1)
        expectOnlyMoved(2, try phase(3, nodes: [1, 2, 3], backends: [1, 3, 4]), "b2 removed by reload")

        // (4) b2 back, and ICMP health on every node: everyone returns to the first choice.
        try reload(Array(1...Self.backendCount), health: true, count: 2)
        #expect(try phase(4, nodes: [1, 2, 3], backends: Array(1...Self.backendCount)) == all, "b2 back: the first assignment again")

        // (5) b3 stops answering probes (its echo replies are blackholed; UDP still arrives):
        // each node's own probes take it out; then only b3's sources have moved, the same on every node.
        try topology.exec(topology.backends, ["/usr/sbin/ip", "route", "add", "blackhole", "default", "table", "100"])
        try topology.exec(topology.backends, ["/usr/sbin/ip", "rule", "add", "from", ScaleOutTopology.backendAddress(3), "lookup", "100"])
        for (index, node) in topology.nodes.enumerated() {
            let down = Probe.waitFor(seconds: 10) {
                ((try? Self.metrics(topology, node)) ?? "").split(separator: "\n").contains {
                    $0.hasPrefix("udp_fanout_downstream_up{") && $0.contains("address=\"\(ScaleOutTopology.backendAddress(3)):\(Self.backendPort)\"") && $0.hasSuffix(" 0")
                }
            }
            try #require(down, "node \(index + 1) took b3 out: \(daemons[index].stderr)")
        }
        expectOnlyMoved(3, try phase(5, nodes: [1, 2, 3], backends: [1, 2, 4]), "b3 down by health")

        // (6) Fragmented datagrams: the router hashes fragments by addresses only (no ports
        // after the first), so each datagram's fragments meet on one node and arrive whole.
        expectOnlyMoved(3, try phase(6, nodes: [1, 2, 3], backends: [1, 2, 4], size: 3000), "fragmented datagrams")

        for (index, daemon) in daemons.enumerated() {
            daemon.signal(SIGTERM)
            #expect(daemon.wait() == 0, "node \(index + 1): \(daemon.stderr)")
            if modes.perNode[index] == "tc_ebpf" { #expect(daemon.stderr.contains("detached tc_ebpf program")) }
            try Self.expectNothingLeft(topology, topology.nodes[index], tookLock: modes.perNode[index] == "tc_ebpf")
        }
        let elapsed = ContinuousClock.now - started
        #expect(elapsed < .seconds(60), "bounded: \(elapsed)")
    }

    /// Each node probes each backend every second; two failures take it out.
    static let health = "health: {enabled: true, protocol: icmp, interval_secs: 1, timeout_secs: 1, fall: 2, rise: 2}"

    static func metrics(_ topology: ScaleOutTopology, _ node: String) throws -> String {
        try topology.exec(node, ["/usr/bin/curl", "-s", "http://127.0.0.1:\(metricsPort)/metrics"])
    }

    static func received(_ topology: ScaleOutTopology, _ index: Int, mode: String) throws -> Int {
        let text = try metrics(topology, topology.nodes[index])
        return try #require(metric(text, "udp_fanout_packets_received_total", "listener=\"lb\",mode=\"\(mode)\""), "node \(index + 1): \(text)")
    }

    /// Nothing of ours is left on the node: no filter or tcx program on its interface, no lock
    /// file for it (the lock is named by the namespace's inode and the interface). Only a tc_ebpf
    /// node takes the lock: on a userspace node, a file of that name can only be another test's
    /// crashed daemon in a namespace whose inode this one reuses, so it is not looked for there.
    static func expectNothingLeft(_ topology: ScaleOutTopology, _ node: String, tookLock: Bool) throws {
        let interface = ScaleOutTopology.nodeInterface
        let filters = try topology.exec(node, ["tc", "filter", "show", "dev", interface, "ingress"])
        #expect(filters.isEmpty, "\(node): tc filter show: \(filters)")
        let net = try topology.exec(node, ["/usr/sbin/bpftool", "net", "show", "dev", interface])
        #expect(!net.contains("fanout_tc"), "\(node): bpftool net show: \(net)")
        guard tookLock, let lock = lockFile(topology, node) else { return }
        #expect(!FileManager.default.fileExists(atPath: lock), "\(node): lock file \(lock) left")
    }

    /// The path of the tc_ebpf lock file for the node's interface (nil if the namespace is gone).
    static func lockFile(_ topology: ScaleOutTopology, _ node: String) -> String? {
        var status = stat()
        guard stat("/run/netns/\(node)", &status) == 0 else { return nil }
        return "\(TCAttachment.lockDirectory)/tc-net\(status.st_ino)-\(ScaleOutTopology.nodeInterface).lock"
    }
}

/// The mode of each node: all tc_ebpf, all userspace, or mixed (as while a cluster moves from
/// one mode to the other): the table is the same in every mode, so mixed nodes agree too. The
/// mixed nodes' userspace file also lists the downstreams in reverse order under other names
/// (scores depend on addresses and weights only).
struct NodeModes: Sendable, CustomTestStringConvertible {
    let perNode: [String]
    var reorderedUserspace = false
    /// The userspace nodes' bind address, if not the VIP.
    var userspaceBind: String?
    static let tc = NodeModes(perNode: ["tc_ebpf", "tc_ebpf", "tc_ebpf"])
    static let userspace = NodeModes(perNode: ["userspace", "userspace", "userspace"])
    static let mixed = NodeModes(perNode: ["tc_ebpf", "userspace", "userspace"], reorderedUserspace: true)
    /// Userspace nodes on a dual-stack `[::]` socket, where an IPv4 client's address arrives
    /// IPv4-mapped (::ffff:a.b.c.d): still the IPv4 source's downstream, as on the tc_ebpf node.
    static let dualStack = NodeModes(perNode: ["tc_ebpf", "userspace", "userspace"], userspaceBind: "[::]")

    func reordered(_ mode: String) -> Bool { reorderedUserspace && mode == "userspace" }
    func bind(_ mode: String) -> String? { mode == "userspace" ? userspaceBind : nil }
    var testDescription: String {
        perNode.joined(separator: ",") + (reorderedUserspace ? " (userspace file reordered, renamed)" : "")
            + (userspaceBind.map { " (userspace bound to \($0))" } ?? "")
    }
}

/// Every client source sends from several ports (one socket each, an ephemeral port), so the
/// router's L4 hash spreads one source's flows over the nodes. Payload: `<source> <phase> <n>`.
final class ClientFlows {
    let flows: [(source: String, socket: Int32)]
    let destination = SocketAddress(ip: IPAddress(ScaleOutTopology.vip)!, port: ScaleOutTests.port)

    init(_ topology: ScaleOutTopology, portsPerSource: Int) throws {
        let sources = topology.sources.flatMap { [String](repeating: $0, count: portsPerSource) }
        // Sockets keep the namespace they were made in: made there, used from here.
        let sockets = inNetworkNamespace(topology.clients) { () -> [Int32] in
            sources.map { source in
                let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
                guard fd >= 0 else { return -1 }
                if SocketAddress(ip: IPAddress(source)!, port: 0).withSockAddr({ bind(fd, $0, $1) }) != 0 {
                    close(fd)
                    return -1
                }
                return fd
            }
        } ?? []
        flows = Array(zip(sources, sockets))
        try #require(sockets.count == sources.count && !sockets.contains(-1), "client sockets in \(topology.clients): \(sockets)")
    }

    deinit { for flow in flows { close(flow.socket) } }

    /// Sends `rounds` datagrams on every flow, paced (about 6,000 a second); returns how many.
    /// Payload: `<source> <phase> <round> <flow>` (the flow's index in ``flows``).
    /// `onRound` is told each round as it starts.
    func send(phase: Int, rounds: Int, size: Int = 0, onRound: (Int) -> Void = { _ in }) throws -> Int {
        var sent = 0
        for round in 0..<rounds {
            onRound(round)
            for (index, flow) in flows.enumerated() {
                var payload = Array("\(flow.source) \(phase) \(round) \(index)".utf8)
                // Padded with spaces, which the receivers' field split drops.
                if payload.count < size { payload += [UInt8](repeating: 0x20, count: size - payload.count) }
                let result = destination.withSockAddr { sendto(flow.socket, &payload, payload.count, 0, $0, $1) }
                try #require(result == payload.count, "sendto from \(flow.source): errno \(errno)")
                sent += 1
                if sent % 32 == 0 { usleep(5_000) }
            }
        }
        return sent
    }
}

/// One socket per backend in the backends namespace, with IP_PKTINFO: each datagram's backend,
/// the node whose link it came in on, the client named in its payload, and its source address.
final class BackendReceivers {
    struct Arrival {
        let backend: Int
        let node: Int?
        let client: String
        let phase: Int
        let sender: String
        let length: Int
        /// The round and the client flow (an index in ``ClientFlows/flows``), when the payload says.
        var round: Int? = nil
        var flow: Int? = nil
    }

    let sockets: [Int32]
    let nodeByIndex: [Int32: Int]

    init(_ topology: ScaleOutTopology, backends: Int) throws {
        let nodeCount = topology.nodes.count
        let made = inNetworkNamespace(topology.backends) { () -> ([Int32], [Int32]) in
            let sockets = (1...backends).map { k -> Int32 in
                let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
                guard fd >= 0 else { return -1 }
                var one: Int32 = 1
                var size: Int32 = 8 << 20
                let bound = SocketAddress("\(ScaleOutTopology.backendAddress(k)):\(ScaleOutTests.backendPort)")!.withSockAddr { bind(fd, $0, $1) }
                if setsockopt(fd, Int32(IPPROTO_IP), IP_PKTINFO, &one, 4) != 0 || setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, 4) != 0 || bound != 0 {
                    close(fd)
                    return -1
                }
                return fd
            }
            return (sockets, (1...nodeCount).map { Int32(if_nametoindex(ScaleOutTopology.backendsInterface($0))) })
        }
        sockets = made?.0 ?? []
        nodeByIndex = Dictionary(uniqueKeysWithValues: (made?.1 ?? []).enumerated().map { ($1, $0 + 1) })
        try #require(sockets.count == backends && !sockets.contains(-1), "backend sockets in \(topology.backends): \(sockets)")
        try #require(nodeByIndex.count == nodeCount && nodeByIndex[0] == nil, "interfaces toward the nodes: \(nodeByIndex)")
    }

    deinit { for fd in sockets { close(fd) } }

    /// Reads every socket until 300 ms pass with nothing new (at most 10 s).
    func drain() -> [Arrival] {
        var arrivals: [Arrival] = []
        let start = ContinuousClock.now
        var quietSince = start
        while ContinuousClock.now - quietSince < .milliseconds(300) && ContinuousClock.now - start < .seconds(10) {
            var any = false
            for (index, fd) in sockets.enumerated() {
                while let arrival = receive(fd, backend: index + 1) {
                    arrivals.append(arrival)
                    any = true
                }
            }
            if any { quietSince = ContinuousClock.now } else { usleep(5_000) }
        }
        return arrivals
    }

    /// One datagram (nil when none is queued), its in_pktinfo read from the control messages by
    /// hand (CMSG_FIRSTHDR/CMSG_NXTHDR are macros Swift cannot call).
    private func receive(_ fd: Int32, backend: Int) -> Arrival? {
        var data = [UInt8](repeating: 0, count: 4096)
        var control = [UInt8](repeating: 0, count: 256)
        var name = sockaddr_storage()
        var controlLength = 0
        let count = data.withUnsafeMutableBytes { dataBytes in
            control.withUnsafeMutableBytes { controlBytes in
                withUnsafeMutablePointer(to: &name) { namePointer in
                    var vector = iovec(iov_base: dataBytes.baseAddress, iov_len: dataBytes.count)
                    return withUnsafeMutablePointer(to: &vector) { vectorPointer in
                        var message = msghdr()
                        message.msg_name = UnsafeMutableRawPointer(namePointer)
                        message.msg_namelen = socklen_t(MemoryLayout<sockaddr_storage>.size)
                        message.msg_iov = vectorPointer
                        message.msg_iovlen = 1
                        message.msg_control = controlBytes.baseAddress
                        message.msg_controllen = controlBytes.count
                        let received = recvmsg(fd, &message, Int32(MSG_DONTWAIT))
                        controlLength = Int(message.msg_controllen)
                        return received
                    }
                }
            }
        }
        guard count > 0 else { return nil }
        var ifindex: Int32?
        control.withUnsafeBytes { bytes in
            let header = MemoryLayout<cmsghdr>.size
            var offset = 0
            while offset + header <= controlLength {
                let message = bytes.loadUnaligned(fromByteOffset: offset, as: cmsghdr.self)
                if message.cmsg_level == Int32(IPPROTO_IP) && message.cmsg_type == IP_PKTINFO {
                    ifindex = bytes.loadUnaligned(fromByteOffset: offset + header, as: in_pktinfo.self).ipi_ifindex
                }
                guard message.cmsg_len >= header else { break }
                offset += (Int(message.cmsg_len) + 7) & ~7
            }
        }
        let sender = withUnsafePointer(to: &name) { SocketAddress(storage: UnsafeRawPointer($0)) }
        let fields = String(decoding: data.prefix(count), as: UTF8.self).split(separator: " ")
        return Arrival(backend: backend, node: ifindex.flatMap { nodeByIndex[$0] },
                       client: fields.first.map(String.init) ?? "?", phase: fields.count == 4 ? Int(fields[1]) ?? -1 : -1,
                       sender: sender?.ip.description ?? "?", length: count,
                       round: fields.count == 4 ? Int(fields[2]) : nil, flow: fields.count == 4 ? Int(fields[3]) : nil)
    }
}

/// The source hash sees the client, not the socket's family: an IPv4 client that a dual-stack
/// `[::]` socket reports IPv4-mapped hashes as the IPv4 address (as on a node bound to an IPv4
/// address, and in tc_ebpf), so nodes bound either way agree.
@Suite("Source hash across address families")
struct SourceHashFamilyTests {
    static func hash(_ text: String) -> UInt32 {
        var storage = sockaddr_storage()
        _ = SocketAddress(text)!.write(to: &storage)
        return withUnsafePointer(to: &storage) { DownstreamSelector.sourceHash($0) }
    }

    @Test("::ffff:a.b.c.d hashes as a.b.c.d; other IPv6 addresses keep their own hash")
    func mappedIsIPv4() {
        for address in ["198.18.100.10", "10.1.2.3", "255.255.255.254"] {
            #expect(Self.hash("[::ffff:\(address)]:5514") == Self.hash("\(address):5514"), "\(address)")
        }
        #expect(Self.hash("[2001:db8::ffff:c612:640a]:1") != Self.hash("198.18.100.10:1"))
        #expect(Self.hash("[::c612:640a]:1") != Self.hash("198.18.100.10:1"), "IPv4-compatible (deprecated) is not mapped")
    }
}
