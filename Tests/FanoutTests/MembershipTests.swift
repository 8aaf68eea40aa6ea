// SPDX-License-Identifier: Apache-2.0
import Testing
@testable import FanoutCore
import ReusePortLB

/// The membership path's logic: the source table's minimal disruption, how members are made
/// from static, DNS and Kubernetes sources, and the configuration keys that feed it.
@Suite("Membership")
struct MembershipTests {
    static func downstreams(_ count: Int, base: Int = 1, weight: UInt32 = 1) -> [Downstream] {
        (base..<(base + count)).map { Downstream(name: "d\($0)", address: SocketAddress("198.18.\($0).2:5514")!, weight: weight) }
    }

    /// The address each entry points at.
    static func owners(_ downstreams: [Downstream]) -> [SocketAddress] {
        SourceTable.entries(downstreams, size: DownstreamSelector.tableSize).map { downstreams[Int($0)].address }
    }

    @Test("removing a downstream moves only its entries; adding one moves entries only to it")
    func minimalDisruption() {
        for count in [2, 3, 5, 8, 17] {
            let all = Self.downstreams(count)
            let before = Self.owners(all)
            for removed in [0, count / 2, count - 1] {
                var fewer = all
                let gone = fewer.remove(at: removed).address
                let after = Self.owners(fewer)
                for (old, new) in zip(before, after) where old != new {
                    #expect(old == gone, "\(count) downstreams, removing \(gone): an entry moved from \(old) to \(new)")
                }
                #expect(!after.contains(gone))
                // And back: exactly the old table.
                #expect(Self.owners(all) == before)
            }
            let newcomer = Self.downstreams(1, base: 100)[0]
            let grown = Self.owners(all + [newcomer])
            let moved = zip(before, grown).filter { $0 != $1 }
            #expect(moved.allSatisfy { $0.1 == newcomer.address })
            // About 1/(n+1) of the entries go to the newcomer.
            let share = Double(moved.count) / Double(before.count)
            #expect(abs(share - 1 / Double(count + 1)) < 0.03, "newcomer share \(share) with \(count) others")
        }
    }

    @Test("a weight change moves entries only to or from that downstream")
    func weightChange() {
        let all = Self.downstreams(4)
        var heavier = all
        heavier[2].weight = 3
        let (before, after) = (Self.owners(all), Self.owners(heavier))
        for (old, new) in zip(before, after) where old != new {
            #expect(new == all[2].address)
        }
        let counts = Dictionary(after.map { ($0, 1) }, uniquingKeysWith: +)
        // Weights 1:1:3:1 of 16381 entries.
        let expected = Double(after.count) * 3 / 6
        #expect(abs(Double(counts[all[2].address]!) - expected) / expected < 0.05)
    }

    @Test("balance, and the same table whatever the names or list order (nodes agree)")
    func balanceAndOrder() {
        let all = Self.downstreams(6)
        let counts = Dictionary(Self.owners(all).map { ($0, 1) }, uniquingKeysWith: +)
        let mean = Double(DownstreamSelector.tableSize) / 6
        for (_, count) in counts { #expect(abs(Double(count) - mean) / mean < 0.05) }
        var renamed = Array(all.reversed())
        for index in renamed.indices { renamed[index].name = "other-\(index)" }
        #expect(Self.owners(renamed) == Self.owners(all))
        // Weight 0 is left out; none with weight: an empty table.
        var zero = all
        zero[0].weight = 0
        #expect(!Self.owners(zero).contains(all[0].address))
        #expect(SourceTable.entries(Self.downstreams(2, weight: 0), size: 101).isEmpty)
    }

    static func listener(_ yaml: String) throws -> Listener {
        try ConfigParser.parse("listeners:\n" + yaml).listeners[0]
    }

    /// What a DNS source records: the addresses it resolved (the entry names them).
    static func addresses(_ texts: String...) -> [Downstream] {
        texts.map { Downstream(name: "", address: SocketAddress($0)!) }
    }

    @Test("members: static first, then each DNS entry's addresses, then Kubernetes endpoints; an address once")
    func members() throws {
        let listener = try Self.listener("""
              - name: l
                bind: "0.0.0.0:5514"
                kubernetes: {namespace: logging, service: receivers, port: 5514}
                downstream:
                  - {name: fixed, address: "198.18.1.2:5514", weight: 2}
                  - {name: pool, address: "pool.example:6000", weight: 3, health_port: 7}
            """)
        #expect(listener.dnsDownstreams == [DNSDownstream(name: "pool", host: "pool.example", port: 6000, weight: 3, healthPort: 7)])
        var discovered = Discovered()
        #expect(Membership.pending(listener, discovered).count == 2)
        discovered.found["dns/pool"] = Self.addresses("198.18.3.2:6000", "198.18.2.2:6000")
        discovered.found["kubernetes"] = [
            Downstream(name: "pod-b:5514", address: SocketAddress("198.18.9.2:5514")!),
            Downstream(name: "dup:5514", address: SocketAddress("198.18.1.2:5514")!),
            Downstream(name: "pod-a:5514", address: SocketAddress("[2001:db8::9]:5514")!),
        ]
        #expect(Membership.pending(listener, discovered).isEmpty)
        let (members, skipped) = Membership.members(listener, discovered)
        #expect(members.map(\.name) == ["fixed", "pool/198.18.2.2", "pool/198.18.3.2", "pod-b:5514", "pod-a:5514"])
        #expect(members[0].weight == 2 && members[1].weight == 3 && members[1].healthTarget == SocketAddress("198.18.2.2:7")!)
        #expect(skipped.isEmpty)
        // Down targets leave the available set; a health port is what is probed.
        let available = Membership.available(members, down: [SocketAddress("198.18.2.2:7")!, SocketAddress("198.18.9.2:5514")!])
        #expect(available.map(\.name) == ["fixed", "pool/198.18.3.2", "pod-a:5514"])
    }

    @Test("tc_ebpf: discovered addresses of the other family and beyond 64 are left out, with the reason")
    func tcLimits() throws {
        let listener = try Self.listener("""
              - name: t
                bind: "198.18.0.1:5514"
                interface: eth0
                mode: tc_ebpf
                kubernetes: {service: receivers, port: 5514}
            """)
        var discovered = Discovered()
        discovered.found["kubernetes"] = (0..<70).map { Downstream(name: "p\($0)", address: SocketAddress("198.18.\($0 / 200 + 1).\($0 % 200 + 2):5514")!) }
            + [Downstream(name: "v6", address: SocketAddress("[2001:db8::5]:5514")!)]
        let (members, skipped) = Membership.members(listener, discovered)
        #expect(members.count == 64)
        #expect(skipped.count == 7)
        #expect(skipped.contains { $0.contains("address family") })
        #expect(skipped.contains { $0.contains("at most 64") })
    }

    @Test("a reload keeps discovered sets while their source stays, and drops them when it goes")
    func carried() throws {
        var discovered = Discovered()
        discovered.found["dns/pool"] = Self.addresses("198.18.3.2:6000")
        discovered.found["dns/gone"] = Self.addresses("198.18.4.2:6000")
        discovered.found["kubernetes"] = [Downstream(name: "p", address: SocketAddress("198.18.9.2:5514")!)]
        let listener = try Self.listener("""
              - name: l
                bind: "0.0.0.0:5514"
                downstream:
                  - {name: pool, address: "other.example:6000"}
            """)
        let kept = Membership.carried(discovered, into: listener)
        #expect(kept.found == ["dns/pool": Self.addresses("198.18.3.2:6000")])
        #expect(kept.found["kubernetes"] == nil)
    }

    @Test("configuration: health rise/fall, health_port, DNS names, resolve interval, kubernetes without static downstreams")
    func configuration() throws {
        let config = try ConfigParser.parse("""
            listeners:
              - name: k
                bind: "0.0.0.0:5514"
                kubernetes: {namespace: logging, service: vector-receivers, port: 5514}
              - name: d
                bind: "0.0.0.0:5515"
                settings: {resolve_interval_secs: 10}
                downstream:
                  - {address: "receivers.logging.svc.cluster.local.:5514"}
                  - {address: "198.18.1.2:5514", health_port: 7}
            health: {enabled: true, protocol: udp_echo, interval_secs: 2, timeout_secs: 1, rise: 2, fall: 4}
            """)
        try config.validate()
        #expect(config.health.rise == 2 && config.health.fall == 4)
        #expect(config.listeners[1].dnsDownstreams.map(\.host) == ["receivers.logging.svc.cluster.local."])
        #expect(config.listeners[1].dnsDownstreams[0].name == "receivers.logging.svc.cluster.local.:5514")
        #expect(config.listeners[1].settings.resolveIntervalSecs == 10)
        #expect(config.listeners[1].downstreams[0].healthTarget == SocketAddress("198.18.1.2:7")!)
        #expect(config.warnings().isEmpty)
        #expect(DiscoverySources.all(config).count == 2)
    }

    @Test("configuration errors name the key and the fix", arguments: [
        ("health: {enabled: true, interval_secs: 2, timeout_secs: 3}", "health.timeout_secs"),
        ("health: {fall: 0}", "health.fall"),
        ("health: {rise: 101}", "health.rise"),
    ])
    func healthErrors(_ section: String, _ key: String) throws {
        let yaml = "listeners:\n  - {name: a, bind: \"0.0.0.0:5514\", downstream: [{address: \"198.18.1.2:5514\"}]}\n\(section)\n"
        #expect {
            try ConfigParser.parse(yaml).validate()
        } throws: { ($0 as? ConfigError)?.key == key }
    }

    @Test("addresses: a mistyped IPv4 address is not taken for a DNS name; bad names and Services are refused", arguments: [
        ("{address: \"10.0.0.300:5514\"}", "listeners[0].downstream[0].address"),
        ("{address: \"-bad.example:5514\"}", "listeners[0].downstream[0].address"),
        ("{address: \"pool.example:0\"}", "listeners[0].downstream[0].address"),
        ("{address: \"pool.example:5514\", mac: \"02:00:00:00:00:01\"}", "listeners[0].downstream[0].mac"),
    ])
    func addressErrors(_ entry: String, _ key: String) throws {
        let yaml = "listeners:\n  - {name: a, bind: \"0.0.0.0:5514\", downstream: [\(entry)]}\n"
        #expect {
            try ConfigParser.parse(yaml).validate()
        } throws: { ($0 as? ConfigError)?.key == key }
        #expect {
            try ConfigParser.parse("listeners:\n  - {name: a, bind: \"0.0.0.0:5514\", kubernetes: {service: Bad_Name, port: 5514}}\n").validate()
        } throws: { ($0 as? ConfigError)?.key == "listeners[0].kubernetes.service" }
    }

    @Test("a listener with neither downstreams nor discovery is refused")
    func nothingToForwardTo() {
        #expect {
            try ConfigParser.parse("listeners:\n  - {name: a, bind: \"0.0.0.0:5514\"}\n").validate()
        } throws: { ($0 as? ConfigError)?.key == "listeners[0].downstream" }
    }

    @Test("metrics of several components merge into one family each")
    func mergeMetrics() {
        let a = "# HELP x_total X\n# TYPE x_total counter\nx_total{n=\"a\"} 1\n# HELP y Y\n# TYPE y gauge\ny{n=\"a\"} 2\n"
        let b = "# HELP x_total X\n# TYPE x_total counter\nx_total{n=\"b\"} 3\n"
        #expect(PrometheusText.merge([a, b]) == "# HELP x_total X\n# TYPE x_total counter\nx_total{n=\"a\"} 1\nx_total{n=\"b\"} 3\n# HELP y Y\n# TYPE y gauge\ny{n=\"a\"} 2\n")
    }

    @Test("a component's samples get the listener label")
    func addLabel() {
        #expect(PrometheusText.adding(label: "listener", "a\"b", to: "# TYPE x gauge\nx{n=\"1\"} 2\ny 3\nz{} 4\n")
                == "# TYPE x gauge\nx{listener=\"a\\\"b\",n=\"1\"} 2\ny{listener=\"a\\\"b\"} 3\nz{listener=\"a\\\"b\"} 4\n")
    }
}
