// SPDX-License-Identifier: Apache-2.0
import Foundation
import Logging
import Testing
import TestSupport
import BPFKernelABI
import CSystemShim
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// Replication (`pools:`): each datagram to the listener's own downstreams and to every pool.
@Suite("replication pools", .serialized)
struct ReplicationTests {
    // MARK: configuration

    static let base = """
        listeners:
          - name: rep
            bind: "127.0.0.1:9100"
            downstream:
              - address: "127.0.0.1:9201"

        """

    static func parse(_ pools: String, mode: String = "") throws(ConfigError) -> FanoutConfig {
        let config = try ConfigParser.parse(base.replacingOccurrences(of: "    downstream:", with: "\(mode)    downstream:") + pools)
        try config.validate(localAddresses: [])
        return config
    }

    static func refused(_ pools: String, mode: String = "") -> ConfigError? {
        do {
            _ = try parse(pools, mode: mode)
            return nil
        } catch {
            return error
        }
    }

    @Test("pools parse: names, balancing, sample, sources (IPv4 and IPv6), output, DNS and Kubernetes members")
    func parses() throws {
        let config = try Self.parse("""
                pools:
                  - name: archive
                    balancing: all
                    downstream:
                      - name: a1
                        address: "127.0.0.1:9301"
                      - address: "archive.example:9302"
                  - name: security
                    sample: 10
                    sources: ["198.18.0.0/16", "2001:db8::/32", "127.0.0.1"]
                    output: preserve_source
                    kubernetes: {namespace: ops, service: ids, port: 2055}
            """)
        let pools = config.listeners[0].pools
        #expect(pools.map(\.name) == ["archive", "security"])
        #expect(pools[0].balancing == .all && pools[0].sample == 1 && pools[0].sources.isEmpty && pools[0].output == nil)
        #expect(pools[0].downstreams.map(\.name) == ["a1"] && pools[0].dnsDownstreams.map(\.host) == ["archive.example"])
        #expect(pools[1].balancing == .roundRobin && pools[1].sample == 10 && pools[1].output == .preserveSource)
        #expect(pools[1].sources.map(\.description) == ["198.18.0.0/16", "2001:db8::/32", "127.0.0.1/32"])
        #expect(pools[1].kubernetes == Kubernetes(namespace: "ops", service: "ids", port: 2055))
        // Each pool's discovery is its own source, in its own slot; members carry the pool's name.
        let specs = DiscoverySources.of(config.listeners[0])
        #expect(specs.map(\.slot) == ["pool/archive/dns/archive.example:9302", "pool/security/kubernetes"])
        let (members, _) = Membership.members(config.listeners[0], Discovered())
        #expect(members.map(\.name) == ["127.0.0.1:9201", "a1"] && members.map(\.pool) == [nil, "archive"])
    }

    @Test("a bad pool is refused naming its key and line: a repeated or reserved name, sample 0, a malformed prefix, no way to get members, a kind without replication, a pool asking for replies")
    func refusals() throws {
        let cases: [(pools: String, mode: String, key: String, line: Int, text: String)] = [
            ("pools:\n  - name: a\n    downstream: [{address: \"127.0.0.1:9301\"}]\n  - name: a\n    downstream: [{address: \"127.0.0.1:9302\"}]\n",
             "", "listeners[0].pools[1].name", 9, "duplicate pool name 'a'"),
            ("pools:\n  - name: default\n    downstream: [{address: \"127.0.0.1:9301\"}]\n", "", "listeners[0].pools[0].name", 7, "names the listener's own downstreams"),
            ("pools:\n  - name: s\n    sample: 0\n    downstream: [{address: \"127.0.0.1:9301\"}]\n", "", "listeners[0].pools[0].sample", 8, "out of range 1...1000000"),
            ("pools:\n  - name: s\n    sources: [\"198.18.0.0/33\"]\n    downstream: [{address: \"127.0.0.1:9301\"}]\n", "", "listeners[0].pools[0].sources[0]", 8, "client prefix"),
            ("pools:\n  - name: s\n    sources: [\"198.18.1.0/16\"]\n    downstream: [{address: \"127.0.0.1:9301\"}]\n", "", "listeners[0].pools[0].sources[0]", 8, "no bits set past the length"),
            ("pools:\n  - name: s\n    balancing: all\n", "", "listeners[0].pools[0].downstream", 7, "add at least one downstream"),
            ("pools:\n  - name: s\n    downstream: [{address: \"127.0.0.1:9301\", weight: 0}]\n", "", "listeners[0].pools[0].downstream", 8, "weight 0"),
            ("pools:\n  - name: s\n    balancing: hash\n    downstream: [{address: \"127.0.0.1:9301\"}]\n", "", "listeners[0].pools[0].balancing", 8, "not one of round_robin, source_ip, all"),
            ("pools:\n  - name: s\n    output: xdp_tx\n    downstream: [{address: \"127.0.0.1:9301\"}]\n", "", "listeners[0].pools[0].output", 8, "not one of socket, preserve_source"),
            ("pools:\n  - name: s\n    downstream: [{address: \"127.0.0.1:9100\"}]\n", "", "listeners[0].pools[0].downstream[0].address", 8, "forwarding loop"),
            ("pools:\n  - name: s\n    replies: relay\n    downstream: [{address: \"127.0.0.1:9301\"}]\n", "    replies: relay\n", "listeners[0].pools[0].replies", 9, "unknown key"),
            ("pools:\n  - name: s\n    output: preserve_source\n    downstream: [{address: \"[::1]:9301\"}]\n", "", "listeners[0].pools[0].downstream[0].address", 9, "not of the listener's address family"),
        ]
        for (pools, mode, key, line, text) in cases {
            // Under the listener, as a file has them.
            let indented = pools.split(separator: "\n").map { "    \($0)\n" }.joined()
            let error = try #require(Self.refused(indented, mode: mode), "accepted: \(pools)")
            #expect(error.key == key && error.problem.contains(text), "\(error)")
            #expect(error.line == line, "\(error)")
        }
    }

    @Test("tc_ebpf pools are refused naming the key and line: output socket (copies are made in the kernel), a member of this host or of the other family, more than 8 pools, more listeners and pools than the maps hold")
    func tcRefusals() throws {
        let base = """
            listeners:
              - name: rep
                bind: "198.18.0.1:9100"
                mode: tc_ebpf
                interface: lo
                downstream:
                  - address: "198.18.1.1:9201"

            """
        func refused(_ text: String) -> ConfigError? {
            do {
                let config = try ConfigParser.parse(text)
                try config.validate(localAddresses: [])
                return nil
            } catch {
                return error
            }
        }
        func pool(_ name: String, _ extra: String = "", member: String = "198.18.2.1:9301") -> String {
            "    pools:\n" + "      - name: \(name)\n\(extra)        downstream: [{address: \"\(member)\"}]\n"
        }
        let nine = "    pools:\n" + (1...9).map { "      - name: p\($0)\n        downstream: [{address: \"198.18.2.\($0):9301\"}]\n" }.joined()
        let cases: [(text: String, key: String, line: Int, problem: String)] = [
            (base + pool("s", "        output: socket\n"), "listeners[0].pools[0].output", 10, "keeps the client's source"),
            (base + pool("s", member: "127.0.0.1:9301"), "listeners[0].pools[0].downstream[0].address", 10, "an address of this host"),
            (base + pool("s", member: "[2001:db8::1]:9301"), "listeners[0].pools[0].downstream[0].address", 10, "not of the listener's address family"),
            (base + nine, "listeners[0].pools", 8, "at most 8 pools"),
        ]
        for (text, key, line, problem) in cases {
            let error = try #require(refused(text), "accepted: \(text)")
            #expect(error.key == key && error.problem.contains(problem), "\(error)")
            #expect(error.line == line, "\(error)")
        }
        // 8 listeners with 7 pools each: 64 slots, the maps' size; one more pool is refused.
        func listeners(_ count: Int, pools: Int) -> String {
            "listeners:\n" + (0..<count).map { index in
                "  - name: l\(index)\n    bind: \"198.18.0.1:\(9100 + index)\"\n    mode: tc_ebpf\n    interface: lo\n    downstream: [{address: \"198.18.1.1:9201\"}]\n"
                    + (pools == 0 ? "" : "    pools:\n" + (0..<pools).map { "      - name: p\($0)\n        downstream: [{address: \"198.18.2.1:\(9300 + $0)\"}]\n" }.joined())
            }.joined()
        }
        #expect(refused(listeners(8, pools: 7)) == nil)
        let full = try #require(refused(listeners(8, pools: 7) + "  - name: extra\n    bind: \"198.18.0.1:9200\"\n    mode: tc_ebpf\n    interface: lo\n    downstream: [{address: \"198.18.1.1:9201\"}]\n"))
        #expect(full.key == "listeners" && full.problem.contains("at most 64 listeners and pools together"), "\(full)")
    }

    @Test("warnings name a pool's keys: a member's health_port with health off, its mac; resolve_interval_secs counts a pool's DNS names")
    func warnings() throws {
        let config = try ConfigParser.parse(Self.base.replacingOccurrences(of: "    downstream:", with: "    settings: {resolve_interval_secs: 10}\n    downstream:") + """
                pools:
                  - name: archive
                    downstream:
                      - {address: "127.0.0.1:9301", health_port: 7, mac: "02:00:00:00:00:01"}
                      - {address: "archive.example:9302"}
            """)
        try config.validate(localAddresses: [])
        let keys = config.warnings().map(\.key)
        #expect(keys.contains("listeners[0].pools[0].downstream[0].health_port"), "\(keys)")
        #expect(keys.contains("listeners[0].pools[0].downstream[0].mac"), "\(keys)")
        #expect(!keys.contains("listeners[0].settings.resolve_interval_secs"), "\(keys)")
    }

    @Test("sources: IPv4 and IPv6 prefixes, an IPv4-mapped client as its IPv4 address; sample: one source in N, every datagram of a kept source")
    func sourcesAndSample() throws {
        let filter = SourceFilter([SourcePrefix("198.18.0.0/15")!, SourcePrefix("2001:db8::/32")!, SourcePrefix("127.0.0.5")!])
        func admits(_ text: String) -> Bool {
            var storage = ReplicationFixtures.storage(SocketAddress(ip: IPAddress(text)!, port: 1))
            return filter.admits(&storage)
        }
        #expect(admits("198.18.0.1") && admits("198.19.255.255") && !admits("198.20.0.0") && !admits("198.17.255.255"))
        #expect(admits("2001:db8::1") && admits("2001:db8:ffff::1") && !admits("2001:db9::1"))
        #expect(admits("::ffff:198.18.3.4") && !admits("::ffff:10.0.0.1"))
        #expect(admits("127.0.0.5") && !admits("127.0.0.6"))
        #expect(SourceFilter([]).isEmpty)
        #expect(SourcePrefix("0.0.0.0/0") != nil && SourcePrefix("::/0") != nil && SourcePrefix("10.0.0.0/8x") == nil && SourcePrefix("10.0.0.0/") == nil)

        let counters = ListenerCounters(name: "t", mode: "userspace")
        let pool = PoolPlan(Pool(name: "s", sample: 10), members: [], counters: counters.pool("s"))
        let sources = (0..<10_000).map { IPAddress(bytes: [10, UInt8($0 >> 8), UInt8($0 & 0xff), 1])! }
        let kept = sources.filter { address in
            var storage = ReplicationFixtures.storage(SocketAddress(ip: address, port: 1))
            // The same answer for every port of a source (datagram after datagram).
            var other = ReplicationFixtures.storage(SocketAddress(ip: address, port: 40_000))
            #expect(pool.samples(&storage) == pool.samples(&other))
            return pool.samples(&storage)
        }
        #expect((900...1100).contains(kept.count), "one source in 10: \(kept.count) of 10,000")
    }

    // MARK: forwarding

    static func poolsYAML(_ pools: [(name: String, keys: String, sinks: [Sink])]) -> String {
        var yaml = "    pools:\n"
        for pool in pools {
            yaml += "      - name: \(pool.name)\n\(pool.keys.split(separator: "\n").map { "        \($0)\n" }.joined())        downstream:\n"
            for (index, sink) in pool.sinks.enumerated() { yaml += "          - name: \(pool.name)-\(index + 1)\n            address: \"\(sink.address)\"\n" }
        }
        return yaml
    }

    /// Sends `count` datagrams from each source, tagged with the source.
    static func send(_ sources: [String], count: Int, to bind: SocketAddress) throws {
        for source in sources { try sendNumbered(to: bind, count: count, tag: source, from: source) }
    }

    static func tags(_ received: [[UInt8]]) -> [String: Int] {
        var tags: [String: Int] = [:]
        for payload in received { tags[String(String(decoding: payload, as: UTF8.self).split(separator: "-")[0]), default: 0] += 1 }
        return tags
    }


    @Test("one listener, four pools on loopback: its own pair by source, an all pair each gets every datagram, sample: 10 gets whole sources, sources: only its prefix; every pool's outcomes add up to received")
    func fourPools() throws {
        let own = try (0..<2).map { _ in try Sink() }
        let archive = try (0..<2).map { _ in try Sink() }
        let security = try Sink(), lab = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let yaml = "listeners:\n" + listenerYAML("rep", bind: bind, own, extra: "    balancing: source_ip\n") + Self.poolsYAML([
            ("archive", "balancing: all", archive), ("security", "sample: 10", [security]), ("lab", "sources: [\"127.0.0.0/29\"]", [lab]),
        ])
        let daemon = try startDaemon(yaml)
        defer { daemon.shutdown() }
        let sources = loopbackSources(100)
        try Self.send(sources, count: 10, to: bind)
        let ownReceived = own.map { Self.tags($0.drain()) }
        let archiveReceived = archive.map { Self.tags($0.drain()) }
        let securityReceived = Self.tags(security.drain()), labReceived = Self.tags(lab.drain())

        // The listener's own pair: every datagram once, each source on one member.
        #expect(ownReceived.map { $0.values.reduce(0, +) }.reduce(0, +) == 1000)
        #expect(Set(ownReceived[0].keys).isDisjoint(with: ownReceived[1].keys) && ownReceived.allSatisfy { !$0.isEmpty })
        // The all pair: each member every datagram.
        for received in archiveReceived { #expect(received == Dictionary(uniqueKeysWithValues: sources.map { ($0, 10) })) }
        // sample: 10: whole sources, the ones the sampling hash keeps (about one in ten).
        let kept = sources.filter { source in
            var storage = ReplicationFixtures.storage(SocketAddress(ip: IPAddress(source)!, port: 1))
            return rplb_reduce(DownstreamSelector.sourceHash(&storage, seed: PoolPlan.sampleSeed), 10) == 0
        }
        #expect(securityReceived == Dictionary(uniqueKeysWithValues: kept.map { ($0, 10) }))
        #expect((2...25).contains(kept.count), "\(kept.count) of 100 sources sampled")
        // sources: 127.0.0.0/29 holds 127.0.0.4 to .7 of them.
        #expect(labReceived == ["127.0.0.4": 10, "127.0.0.5": 10, "127.0.0.6": 10, "127.0.0.7": 10])

        let text = daemon.metricsText()
        #expect(metric(text, "udp_fanout_packets_received_total", "listener=\"rep\",mode=\"userspace\"") == 1000)
        #expect(metric(text, "udp_fanout_packets_forwarded_total", "listener=\"rep\",mode=\"userspace\"") == 1000)
        #expect(ReplicationFixtures.outcomes(text, "archive") == ["forwarded": 1000, "dropped": 0, "sampled_out": 0, "filtered_out": 0])
        #expect(ReplicationFixtures.outcomes(text, "security") == ["forwarded": 10 * kept.count, "dropped": 0, "sampled_out": 1000 - 10 * kept.count, "filtered_out": 0])
        #expect(ReplicationFixtures.outcomes(text, "lab") == ["forwarded": 40, "dropped": 0, "sampled_out": 0, "filtered_out": 960])
        for member in ["archive-1", "archive-2"] {
            #expect(metric(text, "udp_fanout_pool_member_copies_total", ReplicationFixtures.poolLabels("archive") + ",downstream=\"\(member)\"") == 1000)
            #expect(metric(text, "udp_fanout_pool_member_up", "listener=\"rep\",pool=\"archive\",downstream=\"\(member)\",address=\"\(archive[member == "archive-1" ? 0 : 1].address)\"") == 1)
        }
        #expect(metric(text, "udp_fanout_pool_member_copies_total", ReplicationFixtures.poolLabels("lab") + ",downstream=\"lab-1\"") == 40)
        // The listener's own series are as without pools.
        #expect(!text.contains("udp_fanout_downstream_up{listener=\"rep\",downstream=\"archive-1\""))
        #expect(metric(text, "udp_fanout_downstreams", "listener=\"rep\",source=\"static\"") == 2)
    }

    @Test("replies: relay with a pool: every request also goes one way to the pool; replies come only from the listener's own downstreams, from the listener's address")
    func relayPool() throws {
        let servers = try (1...2).map { try RelayEcho(name: "echo-\($0)") }
        let archive = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let yaml = relayYAML("rep", bind: bind, servers) + "    pools:\n      - name: archive\n        downstream:\n          - {name: archive-1, address: \"\(archive.address)\"}\n"
        let daemon = try startDaemon(yaml)
        defer { daemon.shutdown() }
        let clients = try loopbackSources(20, base: 120).map { try RelayClient(source: $0) }
        var answered = 0
        for round in 0..<10 {
            for client in clients where try client.exchange("\(client.source)-\(round)", with: bind) != nil { answered += 1 }
        }
        #expect(answered == 200)
        // Each request once at the pool, and nothing else: its member's answers (none here) are no replies.
        let copies = archive.drain().map { String(decoding: $0, as: UTF8.self) }
        #expect(copies.count == 200 && Set(copies).count == 200)
        settle { daemon.counters(of: "rep")?.twoWay?.replies == 200 }
        let text = daemon.metricsText()
        #expect(metric(text, "udp_fanout_replies_total", "listener=\"rep\",mode=\"userspace\"") == 200)
        #expect(ReplicationFixtures.outcomes(text, "archive") == ["forwarded": 200, "dropped": 0, "sampled_out": 0, "filtered_out": 0])
        #expect(metric(text, "udp_fanout_pool_member_copies_total", ReplicationFixtures.poolLabels("archive") + ",downstream=\"archive-1\"") == 200)
    }

    @Test("an all pool keeps every copy after each in-place update of the listener's own downstreams (reload, health, discovery), one-way and replies: relay", arguments: ["none", "relay"])
    func poolsAfterInPlaceUpdates(replies: String) throws {
        // Own downstreams: s1 and s4 static, s2 from a Service; the pool's two members each get every datagram.
        let own = try (0..<4).map { _ in try Sink() }
        let archive = try (0..<2).map { _ in try Sink() }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let service = Kubernetes(namespace: "test", service: "own", port: 5514)
        func yaml(_ statics: [Int]) -> String {
            let relay = replies == "relay" ? "    replies: relay\n" : ""
            let steering = replies == "relay" ? ", worker_steering: five_tuple" : ""
            return "listeners:\n  - name: rep\n    bind: \"\(bind)\"\n    mode: userspace\n\(relay)"
                + "    settings: {workers: 2\(steering), recv_buf_size: 8388608}\n"
                + "    kubernetes: {namespace: test, service: own, port: 5514}\n    downstream:\n"
                + statics.map { "      - {name: s\($0), address: \"\(own[$0 - 1].address)\"}\n" }.joined()
                + Self.poolsYAML([("archive", "balancing: all", archive)])
                + "health: {enabled: true, protocol: udp_echo, interval_secs: 60, timeout_secs: 1}\n"
        }
        let daemon = try startDaemon(yaml([1, 4]), waitReady: false)
        defer { daemon.shutdown() }
        let spec = DiscoverySpec(KubernetesSource(listener: "rep", service: service))
        daemon.discovered(spec, [Downstream(name: "s2", address: own[1].address)])
        let deadline = ContinuousClock.now + .seconds(5)
        while !daemon.isReady && ContinuousClock.now < deadline { usleep(10_000) }
        try #require(daemon.isReady, "\(daemon.readiness)")
        let sources = loopbackSources(20, base: 60)
        let perPhase = 20 * 50
        var phases: [(String, own: Int, archive: [Int])] = []
        func phase(_ name: String) throws {
            try Self.send(sources, count: 50, to: bind)
            let archiveCounts = archive.map { $0.drain().count }
            phases.append((name, own.map { $0.drain().count }.reduce(0, +), archiveCounts))
        }
        try phase("start")
        // A reload that only removes one of the listener's own static downstreams: applied in place.
        #expect(daemon.reload(text: yaml([1])))
        try phase("reload")
        daemon.healthChanged(own[1].address, up: false)
        try phase("health down")
        daemon.healthChanged(own[1].address, up: true)
        daemon.discovered(spec, [])
        try phase("discovery")
        for (name, ownCount, archiveCounts) in phases {
            #expect(ownCount == perPhase, "\(replies), \(name): the listener's own downstreams got \(ownCount) of \(perPhase)")
            #expect(archiveCounts == [perPhase, perPhase], "\(replies), \(name): each pool member gets every datagram: \(archiveCounts) of \(perPhase)")
        }
        let text = daemon.metricsText()
        #expect(ReplicationFixtures.outcomes(text, "archive") == ["forwarded": 4 * perPhase, "dropped": 0, "sampled_out": 0, "filtered_out": 0])
        for member in ["archive-1", "archive-2"] {
            #expect(metric(text, "udp_fanout_pool_member_copies_total", ReplicationFixtures.poolLabels("archive") + ",downstream=\"\(member)\"") == 4 * perPhase)
        }
    }

    @Test("a dead member of an all pool: its copies are counted dropped (unreachable), the other member, the listener's own downstreams and other pools get everything")
    func deadMember() throws {
        let own = try Sink(), alive = try Sink(), other = try Sink()
        // Nobody listens there: the kernel answers ICMP port unreachable.
        let dead = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        var yaml = "listeners:\n" + listenerYAML("rep", bind: bind, [own]) + Self.poolsYAML([("archive", "balancing: all", [alive]), ("other", "", [other])])
        yaml = yaml.replacingOccurrences(of: "          - name: archive-1\n", with: "          - name: dead\n            address: \"\(dead)\"\n          - name: archive-1\n")
        let daemon = try startDaemon(yaml)
        defer { daemon.shutdown() }
        // In rounds, so the error each send to the dead member draws is seen by the next.
        for round in 0..<20 {
            try sendNumbered(to: bind, count: 10, tag: "r\(round)")
            usleep(5_000)
        }
        #expect(own.drain().count == 200)
        #expect(alive.drain().count == 200)
        #expect(other.drain().count == 200)
        let text = daemon.metricsText()
        let labels = ReplicationFixtures.poolLabels("archive")
        let sent = try #require(metric(text, "udp_fanout_pool_member_copies_total", labels + ",downstream=\"dead\""))
        let dropped = try #require(metric(text, "udp_fanout_pool_member_dropped_total", labels + ",downstream=\"dead\""))
        #expect(sent + dropped == 200 && dropped > 0, "dead member: \(sent) sent, \(dropped) dropped")
        #expect(metric(text, "udp_fanout_pool_dropped_total", labels + ",reason=\"unreachable\"") == dropped)
        // The member's own drops by reason: all of them the dead one's, none the live one's.
        #expect(metric(text, "udp_fanout_pool_member_dropped_by_reason_total", labels + ",downstream=\"dead\",reason=\"unreachable\"") == dropped, "\(text)")
        #expect(!text.contains("udp_fanout_pool_member_dropped_by_reason_total{\(labels),downstream=\"archive-1\""), "\(text)")
        // `udp-fanout status` says the same per member.
        let members = daemon.statusReport().listeners.first?.pools.first { $0.name == "archive" }?.members ?? []
        #expect(members.first { $0.name == "dead" }?.droppedByReason == ["unreachable": UInt64(dropped)], "\(members)")
        #expect(members.first { $0.name == "archive-1" }.map { $0.droppedByReason == nil && $0.dropped == 0 } == true, "\(members)")
        #expect(metric(text, "udp_fanout_pool_member_copies_total", labels + ",downstream=\"archive-1\"") == 200)
        #expect(ReplicationFixtures.outcomes(text, "archive") == ["forwarded": 200, "dropped": 0, "sampled_out": 0, "filtered_out": 0])
        #expect(ReplicationFixtures.outcomes(text, "other") == ["forwarded": 200, "dropped": 0, "sampled_out": 0, "filtered_out": 0])
        #expect(metric(text, "udp_fanout_packets_dropped_total", "listener=\"rep\",mode=\"userspace\"") == 0)
    }

    @Test("a reload that changes one pool under traffic: the other pools and the listener's own downstreams lose nothing, and the changed pool's copies add up")
    func reloadOnePool() throws {
        let own = try (0..<2).map { _ in try Sink() }
        let archive = try (0..<2).map { _ in try Sink() }
        let before = try Sink(), after = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        func yaml(_ security: Sink) -> String {
            "listeners:\n" + listenerYAML("rep", bind: bind, own, workers: 2) + Self.poolsYAML([("archive", "balancing: all", archive), ("security", "", [security])])
        }
        let daemon = try startDaemon(yaml(before))
        defer { daemon.shutdown() }
        let total = 6000
        let sender = Thread {
            for round in 0..<(total / 20) {
                try? sendNumbered(to: bind, count: 20, tag: "r\(round)")
                usleep(1_000)
            }
        }
        sender.start()
        // The reload comes once the pool has had copies and while the sender still sends.
        let deadline = ContinuousClock.now + .seconds(5)
        while (ReplicationFixtures.outcomes(daemon.metricsText(), "security")["forwarded"] ?? 0) < 100 && ContinuousClock.now < deadline { usleep(2_000) }
        try #require(!sender.isFinished, "the sender finished before the reload")
        #expect(daemon.reload(text: yaml(after)))
        while !sender.isFinished { usleep(10_000) }
        let ownCounts = own.map { $0.drain().count }
        #expect(ownCounts.reduce(0, +) == total, "own: \(ownCounts)")
        for sink in archive {
            let received = sink.drain().map { String(decoding: $0, as: UTF8.self) }
            #expect(received.count == total && Set(received).count == total)
        }
        let moved = (before.drain().count, after.drain().count)
        #expect(moved.0 + moved.1 == total && moved.0 > 0 && moved.1 > 0, "security before and after the reload: \(moved)")
        let text = daemon.metricsText()
        #expect(ReplicationFixtures.outcomes(text, "security") == ["forwarded": total, "dropped": 0, "sampled_out": 0, "filtered_out": 0])
        #expect(ReplicationFixtures.outcomes(text, "archive") == ["forwarded": total, "dropped": 0, "sampled_out": 0, "filtered_out": 0])
    }

    @Test("a pool's members from DNS and from EndpointSlices, through the one membership path: each pool gets only what its own source found")
    func discoveredPools() throws {
        let own = try Sink(), pod = try Sink(), resolved = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let yaml = "listeners:\n" + listenerYAML("rep", bind: bind, [own]) + """
                pools:
                  - name: k8s
                    balancing: all
                    kubernetes: {namespace: test, service: ids, port: \(pod.address.port)}
                  - name: dns
                    downstream:
                      - name: archive
                        address: "archive.example:\(resolved.address.port)"

            """
        let daemon = try startDaemon(yaml, waitReady: false)
        defer { daemon.shutdown() }
        #expect(!daemon.isReady)
        #expect(daemon.readiness.joined().contains("waiting for the first EndpointSlice list of test/ids"))
        let specs = DiscoverySources.all(daemon.state.withLock { $0.config })
        let k8s = try #require(specs.first { $0.pool == "k8s" }), dns = try #require(specs.first { $0.pool == "dns" })
        daemon.discovered(k8s, [Downstream(name: "ids-pod", address: pod.address)])
        daemon.discovered(dns, [Downstream(name: "", address: resolved.address)])
        let deadline = ContinuousClock.now + .seconds(5)
        while !daemon.isReady && ContinuousClock.now < deadline { usleep(10_000) }
        try #require(daemon.isReady, "\(daemon.readiness)")
        try sendNumbered(to: bind, count: 50)
        #expect(own.drain().count == 50)
        #expect(pod.drain().count == 50)
        #expect(resolved.drain().count == 50)
        let text = daemon.metricsText()
        #expect(metric(text, "udp_fanout_pool_member_copies_total", ReplicationFixtures.poolLabels("k8s") + ",downstream=\"ids-pod\"") == 50)
        #expect(metric(text, "udp_fanout_pool_member_copies_total", ReplicationFixtures.poolLabels("dns") + ",downstream=\"archive/127.0.0.1\"") == 50)
        // The listener's own members are its static one only.
        #expect(metric(text, "udp_fanout_downstreams", "listener=\"rep\",source=\"kubernetes\"") == 0)
        // The Service's endpoints go: that pool has no member, counted; the others go on.
        daemon.discovered(k8s, [])
        try sendNumbered(to: bind, count: 30)
        #expect(own.drain().count == 30 && resolved.drain().count == 30 && pod.drain(quiet: .milliseconds(100)).isEmpty)
        let after = daemon.metricsText()
        #expect(ReplicationFixtures.outcomes(after, "k8s") == ["forwarded": 50, "dropped": 30, "sampled_out": 0, "filtered_out": 0])
        #expect(metric(after, "udp_fanout_pool_dropped_total", ReplicationFixtures.poolLabels("k8s") + ",reason=\"no_healthy\"") == 30)
        #expect(daemon.isReady, "a pool without members does not make the listener unready: \(daemon.readiness)")
    }
}

/// Real NetFlow through pools: the publisher exports NetFlow v9 from 40 exporter addresses, real
/// collectors (nfdump's nfcapd) store what each pool member gets, and nfdump decodes it.
@Suite("replication with real NetFlow collectors", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct ReplicationNetFlowTests {
    @Test("NetFlow v9 from 40 exporters: the balanced pair stores each exporter's flows at one member, each member of the all pair every flow, the sample: 10 collector every flow of about one exporter in ten; exporter addresses kept (preserve_source)")
    func netflowPools() throws {
        try #require(FileManager.default.isExecutableFile(atPath: "/usr/bin/nfcapd"), "nfcapd missing: make test installs nfdump (scripts/setup.sh)")
        let own = try (0..<2).map { _ in try NetFlowCollector() }
        let archive = try (0..<2).map { _ in try NetFlowCollector() }
        let sampled = try NetFlowCollector()
        usleep(300_000)  // the collectors bind
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        func members(_ prefix: String, _ collectors: [NetFlowCollector]) -> String {
            collectors.enumerated().map { "          - {name: \(prefix)-\($0 + 1), address: \"127.0.0.1:\($1.port)\"}\n" }.joined()
        }
        let yaml = """
            listeners:
              - name: rep
                bind: "\(bind)"
                balancing: source_ip
                settings: {output: preserve_source, workers: 2, recv_buf_size: 8388608}
                downstream:
            \(members("own", own).replacingOccurrences(of: "          - ", with: "      - "))    pools:
                  - name: archive
                    balancing: all
                    downstream:
            \(members("archive", archive))      - name: sampled
                    sample: 10
                    downstream:
            \(members("sampled", [sampled]))
            """
        let daemon = try startDaemon(yaml)
        defer { daemon.shutdown() }
        let exporters = (2...41).map { "127.0.0.\($0)" }
        let publisher = try Child("publisher", ["127.0.0.1", "\(bind.port)", "800", "--sources", "127.0.0.2-127.0.0.41", "--netflow", "v9", "--rate", "4000"])
        #expect(publisher.wait(seconds: 30) == 0, "\(publisher.stderr)")
        let report = try publisher.json()
        #expect(report.int("sent") == 800 && report.int("records") == 8000)
        usleep(500_000)
        let perExporter = 200  // 20 packets of 10 records each

        let ownFlows = try own.map { try $0.flowsByExporter() }
        // Each exporter's flows all at one member of the balanced pair, and every flow stored.
        for exporter in exporters {
            let counts = ownFlows.map { $0[exporter] ?? 0 }
            #expect(counts.sorted() == [0, perExporter], "\(exporter): \(counts)")
        }
        #expect(ownFlows.allSatisfy { !$0.isEmpty })
        for collector in archive {
            #expect(try collector.flowsByExporter() == Dictionary(uniqueKeysWithValues: exporters.map { ($0, perExporter) }))
        }
        let kept = ReplicationFixtures.sampled(exporters, sample: 10)
        #expect(try sampled.flowsByExporter() == Dictionary(uniqueKeysWithValues: kept.map { ($0, perExporter) }))
        #expect(!kept.isEmpty && kept.count < 12, "\(kept.count) of 40 exporters sampled")
        let text = daemon.metricsText()
        #expect(ReplicationFixtures.outcomes(text, "archive") == ["forwarded": 800, "dropped": 0, "sampled_out": 0, "filtered_out": 0])
        #expect(ReplicationFixtures.outcomes(text, "sampled") == ["forwarded": 20 * kept.count, "dropped": 0, "sampled_out": 800 - 20 * kept.count, "filtered_out": 0])
    }
}
