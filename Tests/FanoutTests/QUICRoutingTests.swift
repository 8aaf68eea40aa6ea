// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
#if canImport(Glibc)
import Glibc
#endif
@testable import FanoutCore
import ReusePortLB

/// `quic_lb`: the configuration, its validation, and routing a datagram by its QUIC destination
/// connection ID (draft-ietf-quic-load-balancers), with the listener's balancing as the fallback.
@Suite("QUIC-LB routing")
struct QUICRoutingTests {
    static let key = "8f95f09245765f80256934e50c66207f"

    static func listener(_ quic: String, downstreams: String? = nil, mode: String = "userspace", extra: String = "") -> String {
        """
        listeners:
          - name: q
            bind: "127.0.0.1:4433"
            mode: \(mode)
        \(extra)    balancing: source_ip
        \(quic)
            downstream:
        \(downstreams ?? "      - {name: a, address: \"127.0.0.1:4501\", server_id: \"0a01\"}\n      - {name: b, address: \"127.0.0.1:4502\", server_id: \"0a02\"}")

        """
    }

    static func problem(_ yaml: String) -> ConfigError? {
        do {
            try ConfigParser.parse(yaml).validate(localAddresses: [])
            return nil
        } catch {
            return error
        }
    }

    @Test("quic_lb parses as one configuration or a list; server_id as hex; key from the file or a key_file")
    func parses() throws {
        let one = try ConfigParser.parse(Self.listener("    quic_lb: {server_id_length: 2, nonce_length: 6, key: \(Self.key)}"))
        try one.validate(localAddresses: [])
        let listener = try #require(one.listeners.first)
        #expect(listener.quicLB == [try QUICLBConfiguration(configID: 0, serverIDLength: 2, nonceLength: 6, key: hex(Self.key))])
        #expect(listener.downstreams.map(\.serverID) == [[0x0a, 0x01], [0x0a, 0x02]])

        let keyFile = FileManager.default.temporaryDirectory.appendingPathComponent("quic-lb-\(UUID().uuidString).key")
        try "\(Self.key)\n".write(to: keyFile, atomically: true, encoding: .utf8)
        defer { try? FileManager.default.removeItem(at: keyFile) }
        let list = try ConfigParser.parse(Self.listener("""
                quic_lb:
                  - {config_id: 1, server_id_length: 2, nonce_length: 6}
                  - {config_id: 2, server_id_length: 2, nonce_length: 14, key_file: \(keyFile.path)}
            """))
        try list.validate(localAddresses: [])
        #expect(list.listeners[0].quicLB.map(\.configID) == [1, 2])
        #expect(list.listeners[0].quicLB[1].key == hex(Self.key))
        #expect(list.listeners[0].quicLB[1].algorithm == "single-pass AES-128")
        #expect(list.checkSummary == "configuration OK: 1 listener(s): q 127.0.0.1:4433 userspace -> 2 downstream(s), source_ip, quic_lb [config 1: 2-octet server ID, 6-octet nonce, plaintext; config 2: 2-octet server ID, 14-octet nonce, single-pass AES-128] before source_ip",
                "\(list.checkSummary)")
        // The key is never shown.
        #expect(!one.checkSummary.contains(Self.key) && one.checkSummary.contains("four-pass AES-128"), "\(one.checkSummary)")
        // relay and af_xdp route too.
        #expect(Self.problem(Self.listener("    quic_lb: {server_id_length: 2, nonce_length: 6}", extra: "    replies: relay\n")) == nil)
        let afxdp = Self.listener("    quic_lb: {server_id_length: 2, nonce_length: 6}", mode: "af_xdp", extra: "    interface: lo\n")
        #expect(Self.problem(afxdp) == nil, "\(String(describing: Self.problem(afxdp)))")
        // tc_ebpf and xdp too, encrypted where the kernel has the BPF crypto kfuncs.
        for mode in ["tc_ebpf", "xdp"] {
            for quic in ["    quic_lb: {server_id_length: 2, nonce_length: 6}", "    quic_lb: {server_id_length: 2, nonce_length: 6, key: \(Self.key)}"] {
                let remote = "      - {name: a, address: \"198.18.0.11:4501\", server_id: \"0a01\"}\n      - {name: b, address: \"198.18.0.12:4502\", server_id: \"0a02\"}"
                let kernel = Self.listener(quic, downstreams: remote, mode: mode, extra: "    interface: lo\n")
                let problem = Self.problem(kernel)
                if quic.contains("key:"), TCKernelFeatures.quicCryptoProblem != nil {
                    #expect(problem?.key == "listeners[0].quic_lb" && problem?.problem.contains("BPF crypto kfunc") == true, "\(String(describing: problem))")
                } else {
                    #expect(problem == nil, "\(mode): \(String(describing: problem))")
                }
            }
        }
    }

    @Test("The kernel's BPF crypto kfuncs are looked up in its BTF: a kfunc it lacks is named as the problem")
    func cryptoProbe() {
        #expect(TCKernelFeatures.cryptoProblem(functions: ["bpf_crypto_decrypt", "bpf_crypto_nonexistent_kfunc"])?.contains("no BPF crypto kfunc bpf_crypto_nonexistent_kfunc") == true)
        // This machine's kernel (6.10 or later) has them.
        if let release = Self.kernelRelease(), release >= (6, 10) {
            #expect(TCKernelFeatures.quicCryptoProblem == nil, "\(String(describing: TCKernelFeatures.quicCryptoProblem))")
        }
    }

    static func kernelRelease() -> (Int, Int)? {
        var name = utsname()
        guard uname(&name) == 0 else { return nil }
        let release = withUnsafeBytes(of: name.release) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
        let parts = release.split(separator: ".").prefix(2).compactMap { Int($0.prefix { $0.isNumber }) }
        return parts.count == 2 ? (parts[0], parts[1]) : nil
    }

    @Test("Refused, naming the key: each problem a quic_lb listener can have", arguments: [
        ("    quic_lb: {server_id_length: 2, nonce_length: 6}",
         "      - {name: a, address: \"127.0.0.1:4501\", server_id: \"0a01\"}\n      - {name: b, address: \"127.0.0.1:4502\"}" as String?, "userspace",
         "listeners[0].downstream[1].server_id", "required with quic_lb"),
        ("    quic_lb: {server_id_length: 3, nonce_length: 6}", nil, "userspace", "listeners[0].downstream[0].server_id", "quic_lb's server_id_length is 3"),
        ("    quic_lb: {server_id_length: 12, nonce_length: 8}", nil, "userspace", "listeners[0].quic_lb.nonce_length", "use a nonce_length of at most 7"),
        ("    quic_lb: {server_id_length: 2, nonce_length: 6, key: 00ff}", nil, "userspace", "listeners[0].quic_lb.key", "32 hexadecimal digits"),
        ("    quic_lb: {server_id_length: 2, nonce_length: 6, key_file: /nonexistent/quic.key}", nil, "userspace", "listeners[0].quic_lb.key_file", "cannot read"),
        ("    quic_lb: {nonce_length: 6}", nil, "userspace", "listeners[0].quic_lb.server_id_length", "required"),
        ("    quic_lb: {config_id: 7, server_id_length: 2, nonce_length: 6}", nil, "userspace", "listeners[0].quic_lb.config_id", "out of range"),
        ("    quic_lb: [{config_id: 1, server_id_length: 2, nonce_length: 6}, {config_id: 1, server_id_length: 2, nonce_length: 8}]", nil, "userspace",
         "listeners[0].quic_lb[1].config_id", "given twice"),
        ("    quic_lb: [{config_id: 1, server_id_length: 2, nonce_length: 6}, {config_id: 2, server_id_length: 3, nonce_length: 8}]", nil, "userspace",
         "listeners[0].quic_lb[1].server_id_length", "share one server ID length"),
        ("    quic_lb: {server_id_length: 2, nonce_length: 6}",
         "      - {name: a, address: \"127.0.0.1:4501\", server_id: \"0a01\"}\n      - {name: b, address: \"127.0.0.1:4502\", server_id: \"0A01\"}", "userspace",
         "listeners[0].downstream[1].server_id", "the same server ID as downstream 'a'"),
        ("", nil, "userspace", "listeners[0].downstream[0].server_id", "only a listener with quic_lb"),
        ("    quic_lb: {server_id_length: 2, nonce_length: 6}",
         "      - {name: a, address: \"127.0.0.1:4501\", server_id: \"0a0g\"}", "userspace", "listeners[0].downstream[0].server_id", "hexadecimal digits"),
    ])
    func refused(_ quic: String, _ downstreams: String?, _ mode: String, _ key: String, _ words: String) throws {
        let extra = mode == "tc_ebpf" ? "    interface: lo\n" : ""
        let error = try #require(Self.problem(Self.listener(quic, downstreams: downstreams, mode: mode, extra: extra)), "accepted")
        #expect(error.key == key, "\(error)")
        #expect(error.problem.contains(words), "\(error)")
    }

    @Test("key_file: a FIFO, a device or a directory is refused at once (never read), an oversized file too")
    func keyFileKinds() throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("quic-key-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        let fifo = directory.appendingPathComponent("fifo").path
        try #require(mkfifo(fifo, 0o600) == 0)
        let large = directory.appendingPathComponent("large")
        try String(repeating: "0", count: 5000).write(to: large, atomically: true, encoding: .utf8)
        for (path, words) in [(fifo, "not a regular file"), ("/dev/zero", "not a regular file"), (directory.path, "not a regular file"),
                              (large.path, "5000 bytes")] {
            let error = try #require(Self.problem(Self.listener("    quic_lb: {server_id_length: 2, nonce_length: 6, key_file: \(path)}")), "\(path)")
            #expect(error.key == "listeners[0].quic_lb.key_file" && error.problem.contains(words), "\(error)")
        }
    }

    @Test("Warned: discovered downstreams have no server ID; round_robin splits a first flight")
    func warnings() throws {
        let yaml = Self.listener("    quic_lb: {server_id_length: 2, nonce_length: 6}",
                                 downstreams: "      - {name: a, address: \"127.0.0.1:4501\", server_id: \"0a01\"}\n      - {name: d, address: \"quic.example.test:4433\"}")
            .replacingOccurrences(of: "balancing: source_ip", with: "balancing: round_robin")
        let config = try ConfigParser.parse(yaml)
        try config.validate(localAddresses: [])
        let warnings = config.warnings().map(\.description)
        #expect(warnings.contains { $0.contains("listeners[0].quic_lb") && $0.contains("no server ID") }, "\(warnings)")
        #expect(warnings.contains { $0.contains("listeners[0].balancing") && $0.contains("first flight") }, "\(warnings)")
        // One way with output: socket: the servers cannot answer the client.
        #expect(warnings.contains { $0.contains("listeners[0].settings.output") && $0.contains("preserve_source") }, "\(warnings)")
        // A relay keeps a client address and port on one session: neither warning applies.
        let relay = try ConfigParser.parse(yaml.replacingOccurrences(of: "    balancing: round_robin", with: "    replies: relay\n    balancing: round_robin"))
        try relay.validate(localAddresses: [])
        let relayWarnings = relay.warnings().map(\.description)
        #expect(!relayWarnings.contains { $0.contains("first flight") || $0.contains("settings.output") }, "\(relayWarnings)")
    }

    // MARK: routing

    static func downstreams(_ count: Int) -> [Downstream] {
        (1...count).map { Downstream(name: "s\($0)", address: SocketAddress("127.0.0.1:\(4500 + $0)")!, serverID: [0x0a, UInt8($0)]) }
    }

    static func storage(_ ip: String) -> sockaddr_storage {
        var storage = sockaddr_storage()
        _ = SocketAddress(ip: IPAddress(ip)!, port: 1).write(to: &storage)
        return storage
    }

    /// A short-header packet to `id`.
    static func short(_ id: [UInt8]) -> [UInt8] { [0x41] + id + [UInt8](repeating: 0xee, count: 24) }
    /// A QUIC v1 long-header packet of `type` (0 Initial, 1 0-RTT, 2 Handshake) to `id`.
    static func long(_ type: UInt8, _ id: [UInt8]) -> [UInt8] { [0xc0 | type << 4, 0, 0, 0, 1, UInt8(id.count)] + id + [0, 0x44, 0x10] }

    @Test("Each outcome: routed by server ID (short, Handshake, 0-RTT with a server's ID), fallback, unknown server ID, undecodable",
          arguments: [nil, "8f95f09245765f80256934e50c66207f"])
    func outcomes(_ key: String?) throws {
        let configuration = try QUICLBConfiguration(configID: 1, serverIDLength: 2, nonceLength: 6, key: key.map(hex))
        let codec = QUICLBCodec(configuration)
        let downstreams = Self.downstreams(3)
        let router = try #require(QUICRouter(configurations: [configuration], downstreams: downstreams))
        func route(_ packet: [UInt8]) -> (Int?, QUICOutcome) { packet.withUnsafeBytes { router.route($0) } }
        for n in 1...3 {
            let id = try codec.encode(serverID: [0x0a, UInt8(n)], nonce: [1, 2, 3, 4, 5, UInt8(n)])
            #expect(route(Self.short(id)) == (n - 1, .routed))
            #expect(route(Self.long(2, id)) == (n - 1, .routed))
            // A client's second Initial carries the server's ID: routed, whatever the balancing.
            #expect(route(Self.long(0, id)) == (n - 1, .routed))
            // A server's ID followed by octets of its own (a longer ID): still routed.
            #expect(route(Self.long(2, id + [9, 9])) == (n - 1, .routed))
        }
        let stranger = try codec.encode(serverID: [0x0b, 0x07], nonce: [1, 2, 3, 4, 5, 6])
        #expect(route(Self.short(stranger)) == (nil, .unknownServerID))
        #expect(route(Self.long(2, stranger)) == (nil, .unknownServerID))
        // The client's first Initial: an ID it made up (config ID 7, or one no configuration
        // has, long enough for the configuration), or one too short for it.
        #expect(route(Self.long(0, [0xe3, 1, 2, 3, 4, 5, 6, 7, 8])) == (nil, .fallback))
        #expect(route(Self.long(1, [0x03, 1, 2, 3, 4, 5, 6, 7, 8])) == (nil, .fallback))
        #expect(route(Self.long(0, [0x23, 1, 2, 3])) == (nil, .fallback))
        #expect(route(Self.long(0, stranger)) == (nil, .fallback))
        // A long header of another QUIC version: a client's first packet too.
        #expect(route([0xc0, 0x1a, 0x2a, 0x3a, 0x4a, 9] + [0x03, 1, 2, 3, 4, 5, 6, 7, 8]) == (nil, .fallback))
        // Server-chosen packets: too short for the configuration, config ID 7 or one with no
        // configuration (long enough), version negotiation, one octet.
        #expect(route(Self.long(2, Array(stranger.prefix(5)))) == (nil, .undecodable))
        #expect(route(Self.long(2, [0xe3, 1, 2, 3, 4, 5, 6, 7, 8])) == (nil, .undecodable))
        #expect(route(Self.short([0xe3, 1, 2, 3, 4, 5, 6, 7, 8])) == (nil, .undecodable))
        #expect(route(Self.short([0x03] + Array(stranger.dropFirst()))) == (nil, .undecodable))
        #expect(route([0x80, 0, 0, 0, 0, 8] + stranger) == (nil, .undecodable))
        #expect(route([0x41]) == (nil, .undecodable))
        #expect(route(Array(Self.short(stranger).prefix(5))) == (nil, .undecodable))
    }

    @Test("The selector routes by ID first, falls back to the listener's balancing, and tallies each outcome")
    func selectorFallsBack() throws {
        let configuration = try QUICLBConfiguration(configID: 0, serverIDLength: 2, nonceLength: 6, key: hex(Self.key))
        let downstreams = Self.downstreams(4)
        let method = DownstreamSelector.Method(downstreams: downstreams, balancing: .sourceIP)
        var plain = DownstreamSelector(method)
        var quic = DownstreamSelector(method, router: QUICRouter(configurations: [configuration], downstreams: downstreams))
        let id = try QUICLBCodec(configuration).encode(serverID: [0x0a, 3], nonce: [6, 5, 4, 3, 2, 1])
        for client in 1...40 {
            var source = Self.storage("198.18.0.\(client)")
            let expected = plain.pick(source: &source)
            let initial = Self.long(0, [0xe1, 2, 3, 4, 5, 6, 7, 8, UInt8(client)])
            #expect(initial.withUnsafeBytes { quic.pick(source: &source, payload: $0) } == expected)
            #expect(Self.short(id).withUnsafeBytes { quic.pick(source: &source, payload: $0) } == 2)
        }
        #expect(quic.takeTally().counts == (40, 40, 0, 0))
        // A downstream at weight 0 gets no new connection, and keeps the ones its ID names.
        var draining = downstreams
        draining[2].weight = 0
        var drainingSelector = DownstreamSelector(DownstreamSelector.Method(downstreams: draining, balancing: .sourceIP),
                                                  router: QUICRouter(configurations: [configuration], downstreams: draining))
        for client in 1...40 {
            var source = Self.storage("198.18.1.\(client)")
            let initial = Self.long(0, [0xe1, 2, 3, 4, 5, 6, 7, 8, UInt8(client)])
            #expect(initial.withUnsafeBytes { drainingSelector.pick(source: &source, payload: $0) } != 2)
            #expect(Self.short(id).withUnsafeBytes { drainingSelector.pick(source: &source, payload: $0) } == 2)
        }
        #expect(drainingSelector.takeTally().counts == (40, 40, 0, 0))
        // owner(of:) (the relay's check on a known session): the ID's downstream, nothing for
        // what the ID does not route, and nothing tallied until the caller moves (noteRouted).
        #expect(Self.short(id).withUnsafeBytes { drainingSelector.owner(of: $0) } == 2)
        #expect(Self.long(0, [0xe1, 2, 3, 4, 5, 6, 7, 8, 9]).withUnsafeBytes { drainingSelector.owner(of: $0) } == nil)
        #expect(drainingSelector.takeTally().isEmpty)
        drainingSelector.noteRouted()
        #expect(drainingSelector.takeTally().counts == (1, 0, 0, 0))
        // Without a router nothing is parsed or tallied.
        var source = Self.storage("198.18.0.1")
        _ = Self.short(id).withUnsafeBytes { plain.pick(source: &source, payload: $0) }
        #expect(plain.takeTally().isEmpty)
    }

    @Test("Two configurations at once (a key rotation): each config ID decoded with its own layout and key")
    func rotation() throws {
        let old = try QUICLBConfiguration(configID: 1, serverIDLength: 2, nonceLength: 6)
        let new = try QUICLBConfiguration(configID: 2, serverIDLength: 2, nonceLength: 9, key: hex(Self.key))
        let router = try #require(QUICRouter(configurations: [old, new], downstreams: Self.downstreams(3)))
        for n in 1...3 {
            for configuration in [old, new] {
                let id = try QUICLBCodec(configuration).encode(serverID: [0x0a, UInt8(n)], nonce: [UInt8](repeating: UInt8(n), count: configuration.nonceLength))
                #expect(Self.short(id).withUnsafeBytes { router.route($0) } == (n - 1, .routed), "\(configuration)")
                #expect(Self.long(2, id).withUnsafeBytes { router.route($0) } == (n - 1, .routed), "\(configuration)")
            }
        }
        // A config 2 ID cut to config 1's length is too short for config 2.
        let cut = Array(try QUICLBCodec(new).encode(serverID: [0x0a, 1], nonce: [UInt8](repeating: 1, count: 9)).prefix(9))
        #expect(Self.long(2, cut).withUnsafeBytes { router.route($0) } == (nil, .undecodable))
    }

    @Test("Hostile input: 20,000 random and truncated datagrams route without a crash, each to one outcome, a routed one to its owner")
    func randomInput() throws {
        let configurations = [try QUICLBConfiguration(configID: 0, serverIDLength: 1, nonceLength: 4),
                              try QUICLBConfiguration(configID: 3, serverIDLength: 1, nonceLength: 15, key: hex(Self.key))]
        let downstreams = (0..<16).map { Downstream(name: "s\($0)", address: SocketAddress("127.0.0.1:\(4600 + $0)")!, serverID: [UInt8($0)]) }
        let router = try #require(QUICRouter(configurations: configurations, downstreams: downstreams))
        var generator = SystemRandomNumberGenerator()
        var seen = Set<QUICOutcome>()
        for _ in 0..<20_000 {
            let length = Int.random(in: 0...64, using: &generator)
            var bytes = (0..<length).map { _ in UInt8.random(in: 0...255, using: &generator) }
            // Half of them long headers of QUIC v1 with a plausible ID length.
            if length > 6 && Bool.random(using: &generator) {
                bytes[0] |= 0x80
                bytes[1...4] = [0, 0, 0, 1]
                bytes[5] = UInt8.random(in: 0...20, using: &generator)
            }
            let (owner, outcome) = bytes.withUnsafeBytes { router.route($0) }
            seen.insert(outcome)
            #expect((owner != nil) == (outcome == .routed))
            if let owner { #expect((0..<16).contains(owner)) }
        }
        #expect(seen == Set(QUICOutcome.allCases), "\(seen)")
    }

    @Test("udp_fanout_quic_lb_datagrams_total: every outcome of a quic_lb listener, at zero too; nothing for other listeners")
    func metrics() throws {
        let quic = ListenerCounters(name: "q", mode: "userspace")
        let other = ListenerCounters(name: "o", mode: "userspace")
        let configuration = try QUICLBConfiguration(configID: 0, serverIDLength: 2, nonceLength: 6)
        _ = ForwardingPlan(downstreams: Self.downstreams(2), balancing: .sourceIP, quicLB: [configuration], pools: [], counters: quic)
        _ = ForwardingPlan(downstreams: Self.downstreams(2), balancing: .sourceIP, quicLB: [], pools: [], counters: other)
        var tally = QUICTally()
        tally.note(.routed)
        tally.note(.routed)
        tally.note(.unknownServerID)
        quic.add(tally)
        let text = PrometheusText.render([quic, other], reloads: (0, 0))
        #expect(text.contains("udp_fanout_quic_lb_datagrams_total{listener=\"q\",mode=\"userspace\",outcome=\"routed\"} 2"), "\(text)")
        #expect(text.contains("udp_fanout_quic_lb_datagrams_total{listener=\"q\",mode=\"userspace\",outcome=\"fallback\"} 0"))
        #expect(text.contains("udp_fanout_quic_lb_datagrams_total{listener=\"q\",mode=\"userspace\",outcome=\"unknown_server_id\"} 1"))
        #expect(text.contains("udp_fanout_quic_lb_datagrams_total{listener=\"q\",mode=\"userspace\",outcome=\"undecodable\"} 0"))
        #expect(!text.contains("quic_lb_datagrams_total{listener=\"o\""))
    }
}

private func hex(_ text: String) -> [UInt8] { ConfigParser.hexBytes(text)! }
