// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB

/// A configuration problem: the key path, the line where known, and what is wrong.
public struct ConfigError: Error, CustomStringConvertible, Equatable, Sendable {
    public let key: String
    public let line: Int?
    public let problem: String

    public init(_ key: String, _ problem: String, line: Int? = nil) {
        self.key = key
        self.problem = problem
        self.line = line
    }

    /// One line: control characters and bytes that are not printable are escaped, long echoes cut.
    public var description: String {
        "configuration error: \(Self.printable(key, limit: 120))\(line.map { " (line \($0))" } ?? ""): \(Self.printable(problem, limit: 400))"
    }
}

/// Parses the YAML configuration. Every key of the reference documents is accepted (listeners:
/// name, bind, interface, mode, downstream[].name/address/mac, kubernetes.namespace/service/port,
/// settings.*; health.*; metrics.*), plus ours (listeners[].balancing, downstream[].weight); any
/// other key is an error naming it.
public enum ConfigParser {
    public static func parse(_ text: String) throws(ConfigError) -> FanoutConfig {
        try ConfigLimits.check(text)
        let composed: YAMLNode?
        do throws(YAMLError) {
            composed = try YAMLComposer.compose(text)
        } catch {
            throw Self.describe(error)
        }
        guard let root = composed else { throw ConfigError("(document)", "the file is empty") }
        let top = try Fields(root, path: "")
        try top.allow(["listeners", "health", "metrics", "announce"])
        let listenerNodes = try top.sequence("listeners", required: true)
        var listeners: [Listener] = []
        for (index, node) in listenerNodes.enumerated() {
            listeners.append(try listener(node, path: "listeners[\(index)]"))
        }
        var health = Health()
        if let node = top["health"] {
            let fields = try Fields(node, path: "health")
            try fields.allow(["enabled", "interval_secs", "timeout_secs", "protocol", "rise", "fall"])
            health.enabled = try fields.bool("enabled") ?? health.enabled
            health.intervalSecs = try fields.int("interval_secs", in: 1...3600) ?? health.intervalSecs
            health.timeoutSecs = try fields.int("timeout_secs", in: 1...3600) ?? health.timeoutSecs
            health.proto = try fields.choice("protocol", ["icmp", "udp_echo"]) ?? health.proto
            health.rise = try fields.int("rise", in: 1...100) ?? health.rise
            health.fall = try fields.int("fall", in: 1...100) ?? health.fall
        }
        var metrics = Metrics()
        if let node = top["metrics"] {
            let fields = try Fields(node, path: "metrics")
            try fields.allow(["enabled", "bind", "path"])
            metrics.enabled = try fields.bool("enabled") ?? metrics.enabled
            metrics.bind = try fields.address("bind") ?? metrics.bind
            guard metrics.bind.port != 0 else {
                throw fields.error("bind", "port 0 would serve on a port chosen at each start, which Prometheus, probes and udp-fanout status cannot find: give a fixed one (e.g. 127.0.0.1:9090)")
            }
            if let path = try fields.string("path") {
                guard path.hasPrefix("/"), !path.contains(" ") else {
                    throw fields.error("path", "'\(path)' must start with / and contain no spaces")
                }
                guard !Metrics.reservedPaths.contains(path) else {
                    throw fields.error("path", "'\(path)' is one of the endpoint's own paths (\(Metrics.reservedPaths.joined(separator: ", "))): choose another, e.g. /metrics")
                }
                metrics.path = path
            }
        }
        var config = FanoutConfig(listeners: listeners, health: health, metrics: metrics)
        if let node = top["announce"] { config.announce = try announce(node) }
        config.lines = KeyLines(root)
        return config
    }

    /// The `announce` section (docs/fleet.md).
    static func announce(_ node: YAMLNode) throws(ConfigError) -> Announce {
        let fields = try Fields(node, path: "announce")
        try fields.allow(["addresses", "table", "protocol", "drain_secs"])
        var addresses: [IPAddress] = []
        for (index, entry) in try fields.sequence("addresses", required: true).enumerated() {
            let key = "announce.addresses[\(index)]"
            guard case .scalar(let scalar) = entry, !scalar.string.unicodeScalars.contains(where: { $0.value < 0x20 || $0.value == 0x7f }) else {
                throw ConfigError(key, "expected an IP address (e.g. 198.51.100.10 or 2001:db8::10)", line: entry.mark.line)
            }
            let text = scalar.string
            guard let address = IPAddress(text), !text.contains("%") else {
                throw ConfigError(key, "'\(text)' is not an IP address (e.g. 198.51.100.10 or 2001:db8::10): each is announced as one host route, /32 or /128, without a prefix length or scope", line: entry.mark.line)
            }
            let bytes = address.bytes
            guard !bytes.allSatisfy({ $0 == 0 }) else {
                throw ConfigError(key, "\(text) is the unspecified address: announce the address clients send to (the listeners may still bind the wildcard)", line: entry.mark.line)
            }
            let kind: String? = if bytes.count == 4 {
                bytes[0] == 127 ? "a loopback address: it never leaves a host"
                    : bytes[0] >= 224 ? "a multicast or reserved address"
                    : bytes[0] == 169 && bytes[1] == 254 ? "a link-local address: it is not routed"
                    : bytes[0] == 0 ? "in 0.0.0.0/8 (this network): not a destination" : nil
            } else if bytes[0] == 0xff {
                "a multicast address"
            } else if bytes == [UInt8](repeating: 0, count: 15) + [1] {
                "the loopback address: it never leaves a host"
            } else if bytes[0] == 0xfe && bytes[1] & 0xc0 == 0x80 {
                "a link-local address: it is not routed"
            } else if bytes[0..<10].allSatisfy({ $0 == 0 }) && bytes[10] == 0xff && bytes[11] == 0xff {
                "an IPv4-mapped address: announce the IPv4 address itself"
            } else {
                nil
            }
            if let kind {
                throw ConfigError(key, "\(text) is \(kind); announce a unicast address routers can forward to this node", line: entry.mark.line)
            }
            guard !addresses.contains(address) else {
                throw ConfigError(key, "\(text) is listed twice", line: entry.mark.line)
            }
            addresses.append(address)
        }
        guard !addresses.isEmpty else { throw fields.error("addresses", "empty: list the virtual addresses to announce, or remove the announce section") }
        var announce = Announce(addresses: addresses)
        if let table = try fields.int("table", in: 1...Int(UInt32.max)) {
            guard ![253, 255].contains(table) else {
                throw fields.error("table", "\(table) is the kernel's \(table == 255 ? "local" : "default") table: choose a table of its own (201 by default) or main (254)")
            }
            announce.table = UInt32(table)
        }
        if let number = try fields.int("protocol", in: 1...255) {
            guard !Announce.reservedProtocols.contains(where: { $0.contains(number) }) else {
                throw fields.error("protocol", "\(number) is the kernel's or a routing daemon's own protocol number (1-4 the kernel, 11 and 186-198 FRR, 12 BIRD, 42 babeld): the daemon would take the routes for its own; choose another, e.g. 201")
            }
            announce.protocolNumber = UInt8(number)
        }
        announce.drainSecs = try fields.int("drain_secs", in: 0...300) ?? announce.drainSecs
        return announce
    }

    /// A YAML syntax error as one line: the problem and where, without the echo of the
    /// offending line and the caret line under it that the parser's own description has.
    static func describe(_ error: YAMLError) -> ConfigError {
        switch error {
        case .syntax(let context, let problem, let mark):
            let detail = context.map { "\($0.text) (line \($0.mark.line)): " } ?? ""
            return ConfigError("(document)", "not valid YAML: \(detail)\(problem) at column \(mark.column)", line: mark.line)
        case .reader(let problem, let offset):
            return ConfigError("(document)", "not valid YAML: \(problem)\(offset.map { " at byte \($0)" } ?? "")")
        case .memory:
            return ConfigError("(document)", "not valid YAML: Memory error")
        }
    }

    static func listener(_ node: YAMLNode, path: String) throws(ConfigError) -> Listener {
        let fields = try Fields(node, path: path)
        try fields.allow(["name", "bind", "interface", "mode", "downstream", "kubernetes", "settings", "balancing", "replies", "pools", "quic_lb", "rate_limit", "amplification"])
        guard let name = try fields.string("name"), !name.isEmpty else { throw fields.error("name", "required (a non-empty name, used in metric labels)") }
        guard let bind = try fields.address("bind") else { throw fields.error("bind", "required (listen address:port, e.g. 0.0.0.0:9000)") }
        let modeText = try fields.choice("mode", Mode.allCases.map(\.rawValue)) ?? Mode.userspace.rawValue
        let (downstreams, dnsDownstreams) = try Self.downstreams(fields, path: path)
        let kubernetes = try Self.kubernetes(fields, path: path)
        var settings = Settings()
        if let node = fields["settings"] {
            settings = try SettingsTable.parse(node, path: "\(path).settings", bind: bind)
        }
        let balancing = try fields.choice("balancing", Balancing.allCases.map(\.rawValue)) ?? Balancing.roundRobin.rawValue
        let replies = try fields.choice("replies", Replies.allCases.map(\.rawValue)) ?? Replies.none.rawValue
        var pools: [Pool] = []
        for (index, item) in try fields.sequence("pools", required: false).enumerated() {
            pools.append(try pool(item, path: "\(path).pools[\(index)]"))
        }
        return Listener(
            name: name, bind: bind, interface: try fields.string("interface"), mode: Mode(rawValue: modeText)!,
            downstreams: downstreams, dnsDownstreams: dnsDownstreams, kubernetes: kubernetes, settings: settings,
            balancing: Balancing(rawValue: balancing)!, replies: Replies(rawValue: replies)!, pools: pools,
            quicLB: try quicLB(fields, path: path), rateLimit: try rateLimit(fields, path: path),
            amplification: try amplification(fields, path: path))
    }

    /// A listener's `quic_lb`: one configuration (a mapping) or several (a list, one per config
    /// ID: a key rotation in progress). docs/quic.md.
    static func quicLB(_ fields: Fields, path: String) throws(ConfigError) -> [QUICLBConfiguration] {
        guard let node = fields["quic_lb"] else { return [] }
        let items: [(YAMLNode, String)]
        if case .sequence(let sequence) = node {
            items = sequence.enumerated().map { ($1, "\(path).quic_lb[\($0)]") }
            guard !items.isEmpty else { throw fields.error("quic_lb", "an empty list: give one configuration (config_id, server_id_length, nonce_length, key) or leave quic_lb out") }
        } else {
            items = [(node, "\(path).quic_lb")]
        }
        var configurations: [QUICLBConfiguration] = []
        for (item, itemPath) in items {
            let entry = try Fields(item, path: itemPath)
            try entry.allow(["config_id", "server_id_length", "nonce_length", "key", "key_file"])
            let configID = try entry.int("config_id", in: 0...6) ?? 0
            guard let serverIDLength = try entry.int("server_id_length", in: 1...15) else {
                throw entry.error("server_id_length", "required: octets of server ID in the connection IDs (1-15, as the servers are configured)")
            }
            guard let nonceLength = try entry.int("nonce_length", in: 4...18) else {
                throw entry.error("nonce_length", "required: octets of nonce after the server ID (4-18, as the servers are configured)")
            }
            var key: [UInt8]?
            if let text = try entry.string("key") {
                guard try entry.string("key_file") == nil else { throw entry.error("key_file", "give key or key_file, not both") }
                guard let bytes = hexBytes(text), bytes.count == 16 else { throw entry.error("key", "expected 32 hexadecimal digits (a 16-octet AES-128 key)") }
                key = bytes
            } else if let file = try entry.string("key_file") {
                let text: String
                switch readKeyFile(file) {
                case .success(let read): text = read
                case .failure(let reason):
                    throw entry.error("key_file", "cannot read '\(file)' (\(reason)): give a regular file holding the key as 32 hexadecimal digits (a relative path is taken from the daemon's working directory)")
                }
                guard let bytes = hexBytes(String(text.filter { !$0.isWhitespace })), bytes.count == 16 else {
                    throw entry.error("key_file", "'\(file)' does not hold 32 hexadecimal digits (a 16-octet AES-128 key)")
                }
                key = bytes
            }
            guard serverIDLength + nonceLength <= 19 else {
                throw entry.error("nonce_length", "\(nonceLength) with server_id_length \(serverIDLength) makes \(serverIDLength + nonceLength) octets; a QUIC v1 connection ID holds at most 19 after its first octet: use a nonce_length of at most \(max(4, 19 - serverIDLength))")
            }
            do {
                configurations.append(try QUICLBConfiguration(configID: UInt8(configID), serverIDLength: serverIDLength, nonceLength: nonceLength, key: key))
            } catch {
                throw ConfigError(itemPath, error.description, line: item.mark.line)
            }
        }
        return configurations
    }

    /// A key file's text: a regular file of at most 4 KiB, opened without blocking (a FIFO or a
    /// device would hang `--check` and a reload, or read without end), else why not.
    static func readKeyFile(_ path: String) -> Result<String, KeyFileProblem> {
        let fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC)
        guard fd >= 0 else { return .failure(KeyFileProblem(String(cString: strerror(errno)))) }
        defer { close(fd) }
        var status = stat()
        guard fstat(fd, &status) == 0 else { return .failure(KeyFileProblem(String(cString: strerror(errno)))) }
        guard status.st_mode & S_IFMT == S_IFREG else { return .failure(KeyFileProblem("not a regular file")) }
        guard status.st_size <= 4096 else { return .failure(KeyFileProblem("\(status.st_size) bytes; a key file is 32 hexadecimal digits")) }
        var bytes = [UInt8](repeating: 0, count: 4096)
        let count = read(fd, &bytes, bytes.count)
        guard count >= 0 else { return .failure(KeyFileProblem(String(cString: strerror(errno)))) }
        return .success(String(decoding: bytes[0..<count], as: UTF8.self))
    }

    struct KeyFileProblem: Error, CustomStringConvertible {
        let description: String
        init(_ description: String) { self.description = description }
    }

    /// Octets from hexadecimal digits (``QUICLBConfiguration/octets(hex:)``).
    static func hexBytes(_ text: String) -> [UInt8]? { QUICLBConfiguration.octets(hex: text) }

    /// One entry of a listener's `pools` (replication; docs/replication.md).
    static func pool(_ node: YAMLNode, path: String) throws(ConfigError) -> Pool {
        let fields = try Fields(node, path: path)
        try fields.allow(["name", "balancing", "downstream", "kubernetes", "sample", "sources", "output"])
        guard let name = try fields.string("name"), !name.isEmpty else { throw fields.error("name", "required (a non-empty name, used in metric labels)") }
        let (downstreams, dnsDownstreams) = try Self.downstreams(fields, path: path)
        let balancing = try fields.choice("balancing", PoolBalancing.allCases.map(\.rawValue)) ?? PoolBalancing.roundRobin.rawValue
        var sources: [SourcePrefix] = []
        for (position, item) in try fields.sequence("sources", required: false).enumerated() {
            guard case .scalar(let scalar) = item, let prefix = SourcePrefix(scalar.string) else {
                throw ConfigError("\(path).sources[\(position)]", "expected a client prefix such as 198.18.0.0/16 or 2001:db8::/32 (an address and a length, no bits set past the length)", line: item.mark.line)
            }
            sources.append(prefix)
        }
        let output = try fields.choice("output", [Output.socket, .preserveSource].map(\.rawValue)).map { Output(rawValue: $0)! }
        return Pool(
            name: name, downstreams: downstreams, dnsDownstreams: dnsDownstreams, kubernetes: try Self.kubernetes(fields, path: path),
            balancing: PoolBalancing(rawValue: balancing)!, sample: try fields.int("sample", in: 1...1_000_000) ?? 1, sources: sources, output: output)
    }

    /// The `downstream` list of a listener or pool at `path`: by address, and by DNS name.
    static func downstreams(_ fields: Fields, path: String) throws(ConfigError) -> ([Downstream], [DNSDownstream]) {
        var downstreams: [Downstream] = []
        var dnsDownstreams: [DNSDownstream] = []
        for (index, item) in try fields.sequence("downstream", required: false).enumerated() {
            let entry = try Fields(item, path: "\(path).downstream[\(index)]")
            try entry.allow(["name", "address", "mac", "weight", "health_port", "server_id"])
            let weight = UInt32(try entry.int("weight", in: 0...1_000_000) ?? 1)
            let healthPort = try entry.int("health_port", in: 1...65535).map { UInt16($0) }
            var serverID: [UInt8]?
            if let text = try entry.string("server_id") {
                guard let bytes = hexBytes(text), bytes.count <= 15 else {
                    throw entry.error("server_id", "expected the server's QUIC-LB server ID as hexadecimal digits, two per octet (1-15 octets; quote it: \"0a01\")")
                }
                serverID = bytes
            }
            if let text = try entry.string("address"), let (host, port) = Self.hostAndPort(text) {
                if try entry.string("mac") != nil { throw entry.error("mac", "not used with a DNS name: the next hop's MAC comes from the kernel's neighbour table") }
                if serverID != nil { throw entry.error("server_id", "not with a DNS name: each address a name resolves to is its own server, and one server ID cannot name them all; give each server by address") }
                dnsDownstreams.append(DNSDownstream(
                    name: try entry.string("name") ?? text, host: host, port: port, weight: weight, healthPort: healthPort))
                continue
            }
            guard let address = try entry.address("address") else { throw entry.error("address", "required (destination ip:port, or dns-name:port)") }
            downstreams.append(Downstream(
                name: try entry.string("name") ?? address.description, address: address,
                mac: try entry.string("mac"), weight: weight, healthPort: healthPort, serverID: serverID))
        }
        return (downstreams, dnsDownstreams)
    }

    /// The `kubernetes` discovery of a listener or pool at `path`.
    static func kubernetes(_ fields: Fields, path: String) throws(ConfigError) -> Kubernetes? {
        guard let node = fields["kubernetes"] else { return nil }
        let entry = try Fields(node, path: "\(path).kubernetes")
        try entry.allow(["namespace", "service", "port"])
        guard let service = try entry.string("service") else { throw entry.error("service", "required with kubernetes") }
        guard let port = try entry.int("port", in: 1...65535) else { throw entry.error("port", "required with kubernetes (1-65535)") }
        return Kubernetes(namespace: try entry.string("namespace"), service: service, port: UInt16(port))
    }

    /// `host:port` where host is a DNS name (RFC 1123 labels of letters, digits, `-` and `_`,
    /// at least one letter, so a mistyped IPv4 address is not taken for a name); nil otherwise.
    static func hostAndPort(_ text: String) -> (String, UInt16)? {
        guard let colon = text.lastIndex(of: ":"), let port = UInt16(text[text.index(after: colon)...]), port > 0 else { return nil }
        let host = String(text[..<colon]).lowercased()
        let name = host.hasSuffix(".") ? String(host.dropLast()) : host
        guard !name.isEmpty, name.utf8.count <= 253 else { return nil }
        let labels = name.split(separator: ".", omittingEmptySubsequences: false)
        let allowed = Set("abcdefghijklmnopqrstuvwxyz0123456789-_")
        guard labels.allSatisfy({ !$0.isEmpty && $0.count <= 63 && $0.allSatisfy(allowed.contains) && $0.first != "-" && $0.last != "-" }),
            name.contains(where: \.isLetter)
        else { return nil }
        return (host, port)
    }
}

/// A YAML mapping read key by key, with errors that name the full key path.
struct Fields {
    let path: String
    let node: YAMLNode
    let pairs: [(key: String, value: YAMLNode)]

    init(_ node: YAMLNode, path: String) throws(ConfigError) {
        self.path = path
        self.node = node
        guard case .mapping(let mapping) = node else {
            throw ConfigError(path.isEmpty ? "(document)" : path, "expected a mapping of keys", line: node.mark.line)
        }
        var pairs: [(String, YAMLNode)] = []
        for (key, value) in mapping {
            guard let name = key.string else {
                throw ConfigError(path.isEmpty ? "(document)" : path, "keys must be strings (a key here is a list or a mapping)", line: key.mark.line)
            }
            pairs.append((name, value))
        }
        self.pairs = pairs
    }

    /// The full path of `name`; an empty key shows as `""`, so an error never names nothing.
    func key(_ name: String) -> String {
        let shown = name.isEmpty ? "\"\"" : name
        return path.isEmpty ? shown : "\(path).\(shown)"
    }

    func error(_ name: String, _ problem: String) -> ConfigError {
        ConfigError(key(name), problem, line: self[name]?.mark.line ?? node.mark.line)
    }

    subscript(_ name: String) -> YAMLNode? { pairs.first { $0.key == name }?.value }

    func allow(_ known: [String]) throws(ConfigError) {
        var seen = Set<String>()
        for (name, value) in pairs {
            guard known.contains(name) else {
                throw ConfigError(key(name), "unknown key (known here: \(known.joined(separator: ", ")))", line: value.mark.line)
            }
            guard seen.insert(name).inserted else { throw ConfigError(key(name), "given twice", line: value.mark.line) }
        }
    }

    func string(_ name: String) throws(ConfigError) -> String? {
        guard let value = self[name] else { return nil }
        guard case .scalar(let scalar) = value else { throw error(name, "expected a string") }
        // A NUL would cut the text where C reads it; no key takes control characters.
        guard !scalar.string.unicodeScalars.contains(where: { $0.value < 0x20 || $0.value == 0x7f }) else {
            throw error(name, "contains a control character")
        }
        return scalar.string
    }

    func bool(_ name: String) throws(ConfigError) -> Bool? {
        guard let value = self[name] else { return nil }
        guard let bool = value.bool else { throw error(name, "expected true or false") }
        return bool
    }

    func int(_ name: String, in range: ClosedRange<Int>) throws(ConfigError) -> Int? {
        guard let value = self[name] else { return nil }
        switch value.integer {
        case .value(let int)?:
            guard range.contains(int) else { throw error(name, "\(int) is out of range \(range.lowerBound)...\(range.upperBound)") }
            return int
        case .tooLarge?:
            throw error(name, "\(value.string ?? "") is out of range \(range.lowerBound)...\(range.upperBound)")
        case nil:
            throw error(name, "expected a whole number in \(range.lowerBound)...\(range.upperBound)")
        }
    }

    func choice(_ name: String, _ choices: [String]) throws(ConfigError) -> String? {
        guard let text = try string(name) else { return nil }
        guard choices.contains(text) else { throw error(name, "'\(text)' is not one of \(choices.joined(separator: ", "))") }
        return text
    }

    func address(_ name: String) throws(ConfigError) -> SocketAddress? {
        guard let text = try string(name) else { return nil }
        guard let address = SocketAddress(text) else {
            if text.contains("%") {
                let host = text.hasPrefix("[") ? String(text.dropFirst().prefix { $0 != "]" }) : text
                throw error(name, IPAddress.problem(parsing: host) ?? "'\(text)' is not an address with a port")
            }
            throw error(name, "'\(text)' is not an address with a port (e.g. 0.0.0.0:9000 or [2001:db8::1]:9000)")
        }
        return address
    }

    func sequence(_ name: String, required: Bool) throws(ConfigError) -> [YAMLNode] {
        guard let value = self[name] else {
            if required { throw ConfigError(key(name), "required (a list)", line: node.mark.line) }
            return []
        }
        guard case .sequence(let sequence) = value else { throw error(name, "expected a list") }
        return Array(sequence)
    }
}
