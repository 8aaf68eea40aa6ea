// SPDX-License-Identifier: Apache-2.0
import CSystemShim
import Foundation
import ReusePortLB
import Testing
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// Two-way load balancing end to end (issue 12): clients in one namespace exchange requests and
/// replies with echo servers (`collector --echo --tag bN`) in namespaces of their own, through
/// udp-fanout in the load balancer's namespace: tc_ebpf with `replies: nat`, and userspace with
/// `replies: relay`. The clients are `publisher --exchange` (one socket per client), or a
/// socket the test opens in the clients' namespace where one client is followed datagram by
/// datagram.
@Suite("TwoWay end to end in namespaces", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct TwoWayEndToEndTests {
    static let listenerPort: UInt16 = 5514
    static let serverPort = 6000
    static let metricsPort = 9464

    /// nat: tc_ebpf with replies nat; xdp: the same at the XDP hook; relay: userspace.
    enum Path: CustomStringConvertible { case nat, xdp, relay
        var description: String { self == .nat ? "tc_ebpf nat" : self == .xdp ? "xdp nat" : "relay" }
    }

    // MARK: helpers

    /// One two-way listener `tw` on the VIP over the given servers (numbers from 1).
    static func config(_ topology: TwoWayTopology, _ path: Path, servers: [Int], ipv6: Bool = false,
                       maxAssociations: Int? = nil, health: Bool = false, drainSecs: Int? = nil) -> String {
        let downstreams = servers.map { n in
            let address = ipv6 ? "[\(TwoWayTopology.serverAddress(n, ipv6: true))]:\(serverPort)" : "\(TwoWayTopology.serverAddress(n)):\(serverPort)"
            return "      - {name: b\(n), address: \"\(address)\"}"
        }.joined(separator: "\n")
        let vip = ipv6 ? "[\(TwoWayTopology.vip(ipv6: true))]" : TwoWayTopology.vip()
        var mode: String
        switch path {
        case .nat:
            mode = "    interface: \(topology.clientInterface)\n    mode: tc_ebpf\n    replies: nat"
        case .xdp:
            mode = "    interface: \(topology.clientInterface)\n    mode: xdp\n    replies: nat"
        case .relay:
            mode = "    mode: userspace\n    replies: relay"
        }
        let settings = [maxAssociations.map { "max_associations: \($0)" }, drainSecs.map { "drain_secs: \($0)" }].compactMap { $0 }
        if !settings.isEmpty { mode += "\n    settings: {\(settings.joined(separator: ", "))}" }
        var yaml = """
            listeners:
              - name: tw
                bind: "\(vip):\(listenerPort)"
            \(mode)
                balancing: round_robin
                downstream:
            \(downstreams)
            metrics: {enabled: true, bind: "127.0.0.1:\(metricsPort)"}

            """
        if health {
            yaml += "health: {enabled: true, protocol: icmp, interval_secs: 1, timeout_secs: 1, fall: 2, rise: 2}\n"
        }
        return yaml
    }

    /// udp-fanout in the load balancer's namespace, ready to serve.
    final class Daemon {
        let child: Child
        let file: URL
        init(_ topology: TwoWayTopology, _ path: Path, _ yaml: String) throws {
            file = try TCFixtures.write(yaml, "twoway")
            child = try Child("udp-fanout", ["-c", file.path], prefix: topology.prefix(topology.balancer))
            try child.waitFor(path == .relay ? "entering receive loop" : "registered listener in eBPF map")
        }
        deinit { try? FileManager.default.removeItem(at: file) }

        /// Rewrites the configuration and reloads it with SIGHUP; waits until it is applied.
        func reload(_ yaml: String) throws {
            let before = child.stderr.components(separatedBy: "configuration loaded").count
            try yaml.write(to: file, atomically: true, encoding: .utf8)
            child.signal(SIGHUP)
            let applied = Probe.waitFor(seconds: 10) { child.stderr.components(separatedBy: "configuration loaded").count > before }
            #expect(applied, "reload applied: \(child.stderr)")
            usleep(300_000)
        }
    }

    /// An echo server (`collector --echo --tag bN`) on each server's address.
    static func servers(_ topology: TwoWayTopology, ipv6: Bool = false, only: [Int]? = nil, initiate: [Int: String] = [:]) throws -> [Int: Child] {
        var result: [Int: Child] = [:]
        for n in only ?? Array(1...topology.servers.count) {
            result[n] = try server(topology, n, ipv6: ipv6, initiate: initiate[n])
        }
        return result
    }

    static func server(_ topology: TwoWayTopology, _ n: Int, ipv6: Bool = false, initiate: String? = nil, delayMilliseconds: Int = 0) throws -> Child {
        var arguments = [TwoWayTopology.serverAddress(n, ipv6: ipv6), "\(serverPort)", "0", "1", "--echo", "--tag", "b\(n)", "--rcvbuf", "4194304"]
        if let initiate { arguments += ["--initiate", initiate] }
        if delayMilliseconds > 0 { arguments += ["--echo-delay-ms", "\(delayMilliseconds)"] }
        let child = try Child("collector", arguments, prefix: topology.prefix(topology.servers[n - 1]))
        try child.waitFor("ready")
        return child
    }

    /// `publisher --exchange` in the clients' namespace; its JSON line.
    static func exchange(_ topology: TwoWayTopology, clients: Int, count: Int, ipv6: Bool = false, extra: [String] = []) throws -> [String: Any] {
        let arguments = [TwoWayTopology.vip(ipv6: ipv6), "\(listenerPort)", "\(count)", "--exchange", "--clients", "\(clients)",
                         "--sources", topology.clientRange(ipv6: ipv6), "--reply-timeout-ms", "1000", "--duration", "120"] + extra
        let publisher = try Child("publisher", arguments, prefix: topology.prefix(topology.clients))
        #expect(publisher.wait(seconds: 150) == 0, "publisher: \(publisher.stderr)")
        let report = try publisher.json()
        print("publisher --exchange \(clients)x\(count)\(ipv6 ? " IPv6" : ""): \(publisher.stdout.trimmingCharacters(in: .whitespacesAndNewlines))")
        return report
    }

    static func metrics(_ topology: TwoWayTopology) throws -> String {
        try topology.exec(topology.balancer, ["curl", "-s", "http://127.0.0.1:\(metricsPort)/metrics"])
    }

    /// /metrics once `settled` holds for it (at most 5 s: the nat associations gauge is
    /// refreshed every 2 s), else the last scrape.
    static func metrics(_ topology: TwoWayTopology, until settled: (String) -> Bool) throws -> String {
        var text = try metrics(topology)
        for _ in 0..<50 where !settled(text) {
            usleep(100_000)
            text = try metrics(topology)
        }
        return text
    }

    /// The two-way series of `text`, printed with the test's name (for the run's record).
    static func printTwoWay(_ text: String, _ name: String) {
        let lines = text.split(separator: "\n").filter { !$0.hasPrefix("#") && ($0.contains("association") || $0.contains("repl")) && !$0.hasSuffix(" 0") }
        print("\(name) metrics: \(lines.joined(separator: "; "))")
    }

    static func labels(_ path: Path) -> String { "listener=\"tw\",mode=\"\(path == .nat ? "tc_ebpf" : path == .xdp ? "xdp" : "userspace")\"" }

    /// xdp: every veth end the XDP program transmits to gets GRO at its peer (a veth transmits
    /// XDP frames only then), and the clients and servers compute their UDP checksums themselves
    /// (tx off), as datagrams from a NIC arrive: the XDP program then finishes both directions.
    static func prepare(_ topology: TwoWayTopology, _ path: Path) throws {
        guard path == .xdp else { return }
        var ends = [(topology.clients, topology.clientsDevice)]
        for (index, server) in topology.servers.enumerated() { ends.append((server, "v\(index + 1)\(topology.suffix.prefix(8))")) }
        for (namespace, device) in ends {
            _ = try topology.exec(namespace, ["/usr/sbin/ethtool", "-K", device, "gro", "on", "tx", "off"])
        }
    }

    /// tc_ebpf: the balancer's ends finish offloaded (CHECKSUM_PARTIAL) checksums in software
    /// (tx off), from the pseudo-header sum the program left after its rewrite, so the clients'
    /// and servers' stacks check every datagram's UDP checksum: a wrong one is dropped there, and
    /// the exchange's count comes up short.
    static func finishChecksumsAtBalancer(_ topology: TwoWayTopology) throws {
        for device in [topology.clientInterface] + (1...topology.servers.count).map(topology.serverInterface) {
            _ = try topology.exec(topology.balancer, ["/usr/sbin/ethtool", "-K", device, "tx", "off"])
        }
    }

    /// xdp: nothing of the listener's `datagrams` (both directions) went to tc because XDP could
    /// not send it or finish its checksum (but a finished checksum that looks offloaded by chance).
    static func expectFinishedAtXDP(_ text: String, _ path: Path, datagrams: Int, listener: String = "tw") {
        guard path == .xdp else { return }
        for reason in ["no_xdp_xmit", "pools", "fragment"] {
            #expect(metric(text, "udp_fanout_xdp_passed_total", "listener=\"\(listener)\",reason=\"\(reason)\"") == 0, "\(reason): \(text)")
        }
        #expect(metric(text, "udp_fanout_xdp_passed_total", "listener=\"\(listener)\",reason=\"checksum_partial\"").map { $0 <= TCFixtures.coincidentalPartials(datagrams) } == true, "\(text)")
    }

    /// A two-way family's value for the listener (with `extra` labels after mode), nil if absent.
    static func value(_ text: String, _ path: Path, _ name: String, _ extra: String = "") -> Int? {
        metric(text, name, labels(path) + extra)
    }

    /// Every exchange answered once, from the VIP, each client by one server.
    static func expectServed(_ report: [String: Any], clients: Int, count: Int) {
        #expect(report.int("clients") == clients)
        #expect(report.int("replies") == clients * count, "every exchange answered: \(report)")
        #expect(report.int("lost") == 0, "none lost: \(report)")
        #expect(report.int("wrong_source") == 0, "every reply from the VIP: \(report)")
        #expect(report.int("unsolicited") == 0 && report.int("late") == 0, "\(report)")
        #expect(report.int("servers_per_client") == 1, "one server per client: \(report)")
        #expect(report.int("clients_with_one_server") == clients, "\(report)")
        let byTag = report.object("clients_by_tag")
        #expect(byTag.values.compactMap { ($0 as? NSNumber)?.intValue }.reduce(0, +) == clients, "each client under one tag: \(byTag)")
    }

    /// The tags each client saw, by client address:port (`--per-client`).
    static func clientTags(_ report: [String: Any]) -> [String: [String]] {
        report.object("client_tags").mapValues { ($0 as? String ?? "").split(separator: ",").map(String.init) }
    }

    /// A UDP socket in the clients' namespace bound to `address`:`port` (the test's own client).
    static func clientSocket(_ topology: TwoWayTopology, _ address: String, _ port: UInt16) throws -> Int32 {
        let ip = try #require(IPAddress(address))
        let fd = inNetworkNamespace(topology.clients) { () -> Int32 in
            let fd = socket(ip.family, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
            guard fd >= 0 else { return -1 }
            guard SocketAddress(ip: ip, port: port).withSockAddr({ bind(fd, $0, $1) }) == 0 else {
                close(fd)
                return -1
            }
            return fd
        }
        return try #require(fd.flatMap { $0 >= 0 ? $0 : nil }, "client socket \(address):\(port) in \(topology.clients): errno \(errno)")
    }

    static var vip: SocketAddress { SocketAddress(ip: IPAddress(TwoWayTopology.vip())!, port: listenerPort) }

    /// Nothing of ours attached on the load balancer's interfaces (per namespace: other
    /// engineers' programs elsewhere on the host do not count).
    static func expectNothingAttached(_ topology: TwoWayTopology) throws {
        let interfaces = [topology.clientInterface] + (1...topology.servers.count).map { topology.serverInterface($0) }
        for interface in interfaces {
            let filters = try topology.exec(topology.balancer, ["tc", "filter", "show", "dev", interface, "ingress"])
                + topology.exec(topology.balancer, ["tc", "filter", "show", "dev", interface, "egress"])
            #expect(filters.isEmpty, "tc filter show dev \(interface): \(filters)")
            let net = try topology.exec(topology.balancer, ["/usr/sbin/bpftool", "net", "show", "dev", interface])
            #expect(!net.contains("fanout"), "bpftool net show dev \(interface): \(net)")
        }
        let locks = (try? FileManager.default.contentsOfDirectory(atPath: "/run/udp-fanout")) ?? []
        #expect(!locks.contains { name in interfaces.contains { name.contains($0) } }, "lock files: \(locks)")
    }

    /// Stops every server and returns their reports by server number.
    static func stop(_ servers: [Int: Child]) throws -> [Int: [String: Any]] {
        var reports: [Int: [String: Any]] = [:]
        for (n, child) in servers { reports[n] = try child.stop() }
        return reports
    }

    // MARK: tc_ebpf, replies: nat

    @Test("nat (tc_ebpf, xdp): 200 clients x 100 exchanges: each client served by one server, every reply from the VIP, none lost (tc_ebpf: checksums finished in software and checked by both ends); 200 associations",
          arguments: [Path.nat, .xdp])
    func natExchanges(path: Path) throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 50)
        try Self.prepare(topology, path)
        if path == .nat { try Self.finishChecksumsAtBalancer(topology) }
        let servers = try Self.servers(topology)
        let daemon = try Daemon(topology, path, Self.config(topology, path, servers: [1, 2, 3]))
        let report = try Self.exchange(topology, clients: 200, count: 100)
        Self.expectServed(report, clients: 200, count: 100)
        #expect(report.object("clients_by_tag").count == 3, "round robin over the three servers: \(report)")
        let text = try Self.metrics(topology) { Self.value($0, path, "udp_fanout_associations") == 200 }
        Self.printTwoWay(text, "nat 200x100")
        #expect(Self.value(text, path, "udp_fanout_associations") == 200, "\(text)")
        #expect(Self.value(text, path, "udp_fanout_association_events_total", ",event=\"created\"") == 200, "\(text)")
        #expect(Self.value(text, path, "udp_fanout_association_events_total", ",event=\"evicted\"") == 0, "\(text)")
        #expect(Self.value(text, path, "udp_fanout_replies_total") == 20000, "\(text)")
        #expect(Self.value(text, path, "udp_fanout_replies_dropped_total", ",reason=\"wrong_server\"") == 0, "\(text)")
        Self.expectFinishedAtXDP(text, path, datagrams: 40000)
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        let reports = try Self.stop(servers)
        #expect(reports.values.map { $0.int("echoed") }.reduce(0, +) == 20000, "each request reached one server once: \(reports)")
        try Self.expectNothingAttached(topology)
    }

    @Test("nat (tc_ebpf, xdp): dig against dnsmasq on three servers through the VIP: 30 queries, each answered from the VIP by one server; one association each",
          arguments: [Path.nat, .xdp])
    func natDNS(path: Path) throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 1)
        try Self.prepare(topology, path)
        // Each server answers svc.test with an address of its own: the answer names the server.
        // (dnsmasq as a SpawnedProcess: under Foundation's Process it stalls the run.)
        let servers = try (1...3).map { n in
            try SpawnedProcess(topology.prefix(topology.servers[n - 1]) + [
                "/usr/sbin/dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts", "--bind-interfaces",
                "--listen-address=\(TwoWayTopology.serverAddress(n))", "--port=\(Self.serverPort)", "--address=/svc.test/198.18.99.\(n)",
                "--pid-file=", "--user=root", "--log-facility=-"], log: FileManager.default.temporaryDirectory.appendingPathComponent("dnsmasq-\(UUID().uuidString)").path)
        }
        defer {
            for server in servers {
                server.stop()
                try? FileManager.default.removeItem(atPath: server.log)
            }
        }
        usleep(300_000)
        let daemon = try Daemon(topology, path, Self.config(topology, path, servers: [1, 2, 3]))
        var answers: [String: Int] = [:]
        // Each query from a source port of its own (dig's random ones collided now and then:
        // two queries, one association), in the clients' namespace where nothing else binds.
        for query in 0..<30 {
            let source = "\(TwoWayTopology.clientAddress(0))#\(20_000 + query)"
            let answer = try topology.exec(topology.clients, ["/usr/bin/dig", "@\(TwoWayTopology.vip())", "-p", "\(Self.listenerPort)", "-b", source, "+short", "+tries=1", "+time=2", "svc.test", "A"])
                .trimmingCharacters(in: .whitespacesAndNewlines)
            answers[answer, default: 0] += 1
        }
        #expect(Set(answers.keys) == ["198.18.99.1", "198.18.99.2", "198.18.99.3"], "every query answered by a server, all three used: \(answers)")
        #expect(answers.values.reduce(0, +) == 30)
        let text = try Self.metrics(topology) { Self.value($0, path, "udp_fanout_replies_total") == 30 }
        #expect(Self.value(text, path, "udp_fanout_replies_total") == 30, "\(text)")
        #expect(Self.value(text, path, "udp_fanout_association_events_total", ",event=\"created\"") == 30, "each query a client of its own (its own source port): \(text)")
        Self.expectFinishedAtXDP(text, path, datagrams: 60)
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        try Self.expectNothingAttached(topology)
    }

    @Test("nat: max_associations 64 with 200 clients: evictions counted, every reply from the VIP and from the server its request reached")
    func natEvictions() throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 50)
        let servers = try Self.servers(topology)
        let daemon = try Daemon(topology, .nat, Self.config(topology, .nat, servers: [1, 2, 3], maxAssociations: 64))
        let report = try Self.exchange(topology, clients: 200, count: 10)
        #expect(report.int("replies") == 2000 && report.int("lost") == 0, "every exchange answered: \(report)")
        #expect(report.int("wrong_source") == 0, "every reply from the VIP: \(report)")
        let text = try Self.metrics(topology) { (Self.value($0, .nat, "udp_fanout_association_events_total", ",event=\"evicted\"") ?? 0) > 0 }
        Self.printTwoWay(text, "nat evictions")
        let evicted = try #require(Self.value(text, .nat, "udp_fanout_association_events_total", ",event=\"evicted\""), "\(text)")
        #expect(evicted > 0, "a table of 64 for 200 clients evicts: \(text)")
        #expect((Self.value(text, .nat, "udp_fanout_associations") ?? .max) <= 64, "\(text)")
        #expect(Self.value(text, .nat, "udp_fanout_replies_total") == 2000, "\(text)")
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        // Each server's replies that went on to clients are exactly the ones it echoed: no reply
        // was dropped or delivered on behalf of another server.
        let reports = try Self.stop(servers)
        for (n, server) in reports {
            #expect(Self.value(text, .nat, "udp_fanout_downstream_replies_total", ",downstream=\"b\(n)\"") == server.int("echoed"),
                    "b\(n): echoed \(server.int("echoed")): \(text)")
        }
        #expect(Self.value(text, .nat, "udp_fanout_replies_dropped_total", ",reason=\"wrong_server\"") == 0, "\(text)")
    }

    @Test("nat: a server initiates to a new client: the client sees the VIP, and its later datagrams go to that server")
    func natServerInitiated() throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 4)
        var servers = try Self.servers(topology, only: [1, 3])
        let daemon = try Daemon(topology, .nat, Self.config(topology, .nat, servers: [1, 2, 3]))
        let client = TwoWayTopology.clientAddress(2)
        let fd = try Self.clientSocket(topology, client, 41000)
        defer { close(fd) }
        servers[2] = try Self.server(topology, 2, initiate: "\(client):41000")
        try servers[2]!.waitFor("initiated to")
        let first = try #require(Datagrams.receive(fd), "the server's datagram reached the client: \(daemon.child.stderr)")
        #expect(first.source == Self.vip, "from the VIP: \(first.source)")
        #expect(first.payload == "b2")
        for round in 0..<5 {
            try Datagrams.send(fd, "request \(round)", to: Self.vip)
            let reply = try #require(Datagrams.receive(fd), "reply \(round)")
            #expect(reply.source == Self.vip && reply.payload == "request \(round)b2", "\(reply)")
        }
        let text = try Self.metrics(topology) { Self.value($0, .nat, "udp_fanout_associations") == 1 }
        #expect(Self.value(text, .nat, "udp_fanout_association_events_total", ",event=\"server_initiated\"") == 1, "\(text)")
        #expect(Self.value(text, .nat, "udp_fanout_association_events_total", ",event=\"created\"") == 0, "\(text)")
        #expect(Self.value(text, .nat, "udp_fanout_associations") == 1, "\(text)")
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        let reports = try Self.stop(servers)
        #expect(reports[2]?.int("initiated") == 1 && reports[2]?.int("echoed") == 5, "\(reports[2] ?? [:])")
        #expect(reports[1]?.int("echoed") == 0 && reports[3]?.int("echoed") == 0)
    }

    @Test("nat: a datagram from a server that is not the client's is dropped and counted wrong_server; the client receives nothing")
    func natWrongServer() throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 4)
        var servers = try Self.servers(topology)
        let daemon = try Daemon(topology, .nat, Self.config(topology, .nat, servers: [1, 2, 3]))
        let client = TwoWayTopology.clientAddress(3)
        let fd = try Self.clientSocket(topology, client, 41001)
        defer { close(fd) }
        try Datagrams.send(fd, "hello", to: Self.vip)
        let reply = try #require(Datagrams.receive(fd), "the first reply: \(daemon.child.stderr)")
        let owner = try #require(Int(reply.payload.dropFirst("hello".count).dropFirst()), "tag b<N>: \(reply.payload)")
        let other = owner % 3 + 1
        // The other server, restarted, sends from its echo socket (its downstream address and port).
        _ = try servers[other]!.stop()
        servers[other] = try Self.server(topology, other, initiate: "\(client):41001")
        try servers[other]!.waitFor("initiated to")
        #expect(Datagrams.receive(fd, milliseconds: 1000) == nil, "nothing from b\(other) reaches the client")
        let text = try Self.metrics(topology)
        #expect(Self.value(text, .nat, "udp_fanout_replies_dropped_total", ",reason=\"wrong_server\"") == 1, "\(text)")
        #expect(Self.value(text, .nat, "udp_fanout_association_events_total", ",event=\"server_initiated\"") == 0, "\(text)")
        // The association stayed: the client is still served by its server.
        try Datagrams.send(fd, "again", to: Self.vip)
        let again = try #require(Datagrams.receive(fd), "reply after the drop")
        #expect(again.source == Self.vip && again.payload == "againb\(owner)", "\(again)")
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
    }

    /// Phase 1 with fixed client ports, the change, phase 2 with the same clients: only the
    /// removed server's clients move, and `moved` counts exactly them.
    static func expectOnlyItsClientsMove(_ topology: TwoWayTopology, _ path: Path, clients: Int, count: Int,
                                         change: () throws -> Void) throws {
        let extra = ["--client-port-base", "42000", "--per-client"]
        let before = try exchange(topology, clients: clients, count: count, extra: extra)
        expectServed(before, clients: clients, count: count)
        try change()
        let after = try exchange(topology, clients: clients, count: count, extra: extra)
        expectServed(after, clients: clients, count: count)
        let (tagsBefore, tagsAfter) = (clientTags(before), clientTags(after))
        #expect(tagsBefore.count == clients && Set(tagsBefore.keys) == Set(tagsAfter.keys), "the same clients both times")
        var movedClients = 0
        for (client, tags) in tagsBefore {
            let now = tagsAfter[client] ?? []
            if tags == ["b3"] {
                movedClients += 1
                #expect(now == ["b1"] || now == ["b2"], "\(client) of b3 moved to one remaining server: \(now)")
            } else {
                #expect(now == tags, "\(client) kept its server: \(tags) then \(now)")
            }
        }
        #expect(movedClients > 0, "b3 had clients: \(before)")
        let text = try metrics(topology)
        printTwoWay(text, "\(path) move (\(movedClients) clients of b3)")
        #expect(value(text, path, "udp_fanout_association_events_total", ",event=\"moved\"") == movedClients, "\(text)")
    }

    @Test("nat (tc_ebpf, xdp): a server removed by reload: only its clients move, moved counts them", arguments: [Path.nat, .xdp])
    func natReload(path: Path) throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 30)
        try Self.prepare(topology, path)
        let servers = try Self.servers(topology)
        let daemon = try Daemon(topology, path, Self.config(topology, path, servers: [1, 2, 3]))
        try Self.expectOnlyItsClientsMove(topology, path, clients: 60, count: 5) {
            try daemon.reload(Self.config(topology, path, servers: [1, 2]))
        }
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        _ = try Self.stop(servers)
    }

    @Test("nat: a server taken down by health (ICMP unanswered): only its clients move, moved counts them")
    func natHealth() throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 30)
        let servers = try Self.servers(topology)
        let daemon = try Daemon(topology, .nat, Self.config(topology, .nat, servers: [1, 2, 3], health: true))
        try Self.expectOnlyItsClientsMove(topology, .nat, clients: 60, count: 5) {
            try topology.exec(topology.servers[2], ["/usr/sbin/sysctl", "-q", "-w", "net.ipv4.icmp_echo_ignore_all=1"])
            let down = Probe.waitFor(seconds: 10) {
                (try? Self.metrics(topology)).map { metric($0, "udp_fanout_downstream_up", "listener=\"tw\",downstream=\"b3\",address=\"\(TwoWayTopology.serverAddress(3)):\(Self.serverPort)\"") == 0 } == true
            }
            #expect(down, "b3 down after fall probes: \(daemon.child.stderr)")
            usleep(300_000)
        }
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        _ = try Self.stop(servers)
    }

    @Test("nat (tc_ebpf, xdp), IPv6: 50 clients x 20 exchanges: one server per client, every reply from the VIP, none lost (tc_ebpf: checksums finished in software and checked by both ends)", arguments: [Path.nat, .xdp])
    func natIPv6(path: Path) throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 25)
        try Self.prepare(topology, path)
        if path == .nat { try Self.finishChecksumsAtBalancer(topology) }
        let servers = try Self.servers(topology, ipv6: true)
        let daemon = try Daemon(topology, path, Self.config(topology, path, servers: [1, 2, 3], ipv6: true))
        let report = try Self.exchange(topology, clients: 50, count: 20, ipv6: true)
        Self.expectServed(report, clients: 50, count: 20)
        let text = try Self.metrics(topology) { Self.value($0, path, "udp_fanout_associations") == 50 }
        #expect(Self.value(text, path, "udp_fanout_associations") == 50, "\(text)")
        #expect(Self.value(text, path, "udp_fanout_association_events_total", ",event=\"created\"") == 50, "\(text)")
        #expect(Self.value(text, path, "udp_fanout_replies_total") == 1000, "\(text)")
        Self.expectFinishedAtXDP(text, path, datagrams: 2000)
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        let reports = try Self.stop(servers)
        #expect(reports.values.map { $0.int("echoed") }.reduce(0, +) == 1000)
        try Self.expectNothingAttached(topology)
    }

    @Test("nat: kill -9, restart: the restart serves again, and its clean stop leaves nothing attached")
    func natKillAndRestart() throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 10)
        let servers = try Self.servers(topology)
        let yaml = Self.config(topology, .nat, servers: [1, 2, 3])
        let first = try Daemon(topology, .nat, yaml)
        Self.expectServed(try Self.exchange(topology, clients: 20, count: 5), clients: 20, count: 5)
        first.child.signal(SIGKILL)
        first.child.wait()
        let second = try Daemon(topology, .nat, yaml)
        Self.expectServed(try Self.exchange(topology, clients: 20, count: 5), clients: 20, count: 5)
        second.child.signal(SIGTERM)
        #expect(second.child.wait() == 0)
        try Self.expectNothingAttached(topology)
        let reports = try Self.stop(servers)
        #expect(reports.values.map { $0.int("echoed") }.reduce(0, +) == 200)
    }

    // MARK: userspace, replies: relay

    @Test("relay: 50 clients x 20 exchanges: one server per client, every reply from the listener's address, none lost")
    func relayExchanges() throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 25)
        let servers = try Self.servers(topology)
        let daemon = try Daemon(topology, .relay, Self.config(topology, .relay, servers: [1, 2, 3]))
        let report = try Self.exchange(topology, clients: 50, count: 20)
        Self.expectServed(report, clients: 50, count: 20)
        let text = try Self.metrics(topology) { Self.value($0, .relay, "udp_fanout_associations") == 50 }
        Self.printTwoWay(text, "relay 50x20")
        #expect(Self.value(text, .relay, "udp_fanout_associations") == 50, "one session per client: \(text)")
        #expect(Self.value(text, .relay, "udp_fanout_association_events_total", ",event=\"created\"") == 50, "\(text)")
        #expect(Self.value(text, .relay, "udp_fanout_replies_total") == 1000, "\(text)")
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        let reports = try Self.stop(servers)
        #expect(reports.values.map { $0.int("echoed") }.reduce(0, +) == 1000)
    }

    @Test("relay: a server removed by reload: only its clients move, moved counts them")
    func relayReload() throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 15)
        let servers = try Self.servers(topology)
        let daemon = try Daemon(topology, .relay, Self.config(topology, .relay, servers: [1, 2, 3]))
        try Self.expectOnlyItsClientsMove(topology, .relay, clients: 30, count: 5) {
            try daemon.reload(Self.config(topology, .relay, servers: [1, 2]))
        }
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        _ = try Self.stop(servers)
    }
    @Test("A server answering in 30 ms removed by reload under traffic: with drain_secs its clients lose no reply; with drain_secs 0 every reply lost is counted drained",
          arguments: [(Path.nat, 30), (Path.nat, 0), (Path.relay, 30), (Path.relay, 0)])
    func drainOnRemoval(path: Path, drainSecs: Int) throws {
        let topology = try TwoWayTopology(servers: 3, clientAddresses: 30)
        var servers: [Int: Child] = [:]
        for n in 1...3 { servers[n] = try Self.server(topology, n, delayMilliseconds: 30) }
        let daemon = try Daemon(topology, path, Self.config(topology, path, servers: [1, 2, 3], drainSecs: drainSecs))
        // 60 clients, one request at a time each (about 30 round trips/s each), for about 3 s;
        // b3 leaves after 1.5 s, with about 20 of its clients' replies in flight. A reply is lost
        // after 3 s (a busy machine's slow reply is not taken for a drained one).
        let arguments = [TwoWayTopology.vip(), "\(Self.listenerPort)", "90", "--exchange", "--clients", "60",
                         "--sources", topology.clientRange(), "--reply-timeout-ms", "3000", "--duration", "60"]
        let publisher = try Child("publisher", arguments, prefix: topology.prefix(topology.clients))
        usleep(1_500_000)
        try daemon.reload(Self.config(topology, path, servers: [1, 2], drainSecs: drainSecs))
        #expect(publisher.wait(seconds: 90) == 0, "publisher: \(publisher.stderr)")
        let report = try publisher.json()
        print("drain \(path) drain_secs \(drainSecs): \(publisher.stdout.trimmingCharacters(in: .whitespacesAndNewlines))")
        let text = try Self.metrics(topology)
        Self.printTwoWay(text, "drain \(path) drain_secs \(drainSecs)")
        let drained = Self.value(text, path, "udp_fanout_replies_dropped_total", ",reason=\"drained\"") ?? -1
        let lost = report.int("lost") ?? -1
        #expect(report.int("replies") == 60 * 90 - max(lost, 0) && report.int("wrong_source") == 0, "\(report)")
        if drainSecs > 0 {
            #expect(lost == 0 && drained == 0, "no reply lost within the drain time: lost \(lost), drained \(drained)")
        } else {
            #expect(lost > 0 && drained == lost, "every reply lost is counted: lost \(lost), drained \(drained)")
        }
        #expect(Self.value(text, path, "udp_fanout_downstream_replies_total", ",downstream=\"b3\"").map { $0 > 0 } == true, "b3's series stays: \(text)")
        let said = daemon.child.stderr.split(separator: "\n").filter { $0.contains("downstream=b3") }
        #expect(said.contains { $0.contains(drainSecs > 0 ? "downstream draining" : "downstream left the set (settings.drain_secs 0)") },
                "the log says what happens to b3: \(said)")
        daemon.child.signal(SIGTERM)
        #expect(daemon.child.wait() == 0)
        _ = try Self.stop(servers)
    }
}
