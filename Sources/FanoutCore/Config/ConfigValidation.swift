// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import CSystemShim
import ReusePortLB

extension FanoutConfig {
    /// Checks what the parser cannot see key by key. Throws the first problem, naming its key.
    /// - Parameter localAddresses: this host's addresses, to find downstreams that would loop
    ///   back into a wildcard listener.
    public func validate(localAddresses: Set<IPAddress> = LocalAddresses.current()) throws(ConfigError) {
        func fail(_ key: String, _ problem: String) -> ConfigError { configError(key, problem) }
        guard !listeners.isEmpty else { throw fail("listeners", "empty: configure at least one listener") }
        var names = Set<String>()
        // Binds by family and port, so the overlap and loop checks are linear in the listeners.
        // Sockets (userspace) see every interface; a tc_ebpf listener only its own, so two of
        // them may share a bind on two interfaces.
        var sockets = BindIndex(), kernel = BindIndex(), all = BindIndex()
        var kernelByInterface: [String: BindIndex] = [:]
        for (index, listener) in listeners.enumerated() {
            let path = "listeners[\(index)]"
            guard names.insert(listener.name).inserted else {
                throw fail("\(path).name", "duplicate listener name '\(listener.name)'")
            }
            guard listener.bind.port != 0 else {
                throw fail("\(path).bind", "\(listener.bind): port 0 would listen on a random port; give the port datagrams arrive on")
            }
            let interface = listener.interface ?? ""
            let perInterface = ListenerKinds.type(for: listener)?.bindsPerInterface == true
            let clash = perInterface
                ? sockets.clash(listener.bind) ?? kernelByInterface[interface, default: BindIndex()].clash(listener.bind)
                : sockets.clash(listener.bind) ?? kernel.clash(listener.bind)
            if let other = clash {
                throw fail("\(path).bind", "\(listener.bind) overlaps listeners[\(other)].bind \(listeners[other].bind)\(ListenerKinds.type(for: listeners[other])?.bindsPerInterface == true ? " on \(listeners[other].interface ?? "")" : "")")
            }
            if perInterface {
                kernel.insert(listener.bind, index)
                kernelByInterface[interface, default: BindIndex()].insert(listener.bind, index)
            } else {
                sockets.insert(listener.bind, index)
            }
            all.insert(listener.bind, index)
        }
        for (index, listener) in listeners.enumerated() {
            let path = "listeners[\(index)]"
            // A mode this release does not serve is named first: asking for its interface would
            // only lead to this error next.
            guard Mode.implemented.contains(listener.mode) else {
                throw fail("\(path).mode", "\(listener.mode.rawValue) is not implemented in this release (implemented: \(Mode.allCases.filter { Mode.implemented.contains($0) }.map(\.rawValue).joined(separator: ", "))); it is never served by another mode")
            }
            guard let kind = ListenerKinds.type(for: listener) else {
                preconditionFailure("mode \(listener.mode.rawValue) is implemented but no listener kind serves it: register one in ListenerKinds")
            }
            if kind.attachesToInterface && (listener.interface ?? "").isEmpty {
                throw fail("\(path).interface", "mode \(listener.mode.rawValue) attaches to a network interface: set interface (e.g. eth0)")
            }
            try validateMembers(of: listener, group: listener.ownMembers, path: path, all: all, localAddresses: localAddresses)
            try validateQUICLB(listener, routes: kind.routesQUIC, path: path)
            if listener.amplification != nil && listener.replies == Replies.none {
                throw fail("\(path).amplification", "caps the replies of a two-way listener; this one is one way: set replies (nat in tc_ebpf and xdp, relay in userspace) or remove amplification")
            }
            if !listener.pools.isEmpty {
                guard kind.replicates else {
                    throw fail("\(path).pools", "replication is not available in mode \(listener.mode.rawValue) in this release: remove pools or choose a mode that has it (docs/replication.md lists them)")
                }
                var poolNames: Set<String> = [Pool.defaultName]
                for (position, pool) in listener.pools.enumerated() {
                    let poolPath = "\(path).pools[\(position)]"
                    guard poolNames.insert(pool.name).inserted else {
                        throw fail("\(poolPath).name", pool.name == Pool.defaultName
                            ? "'\(Pool.defaultName)' names the listener's own downstreams (its first pool): give this pool another name"
                            : "duplicate pool name '\(pool.name)' in listener '\(listener.name)'")
                    }
                    try validateMembers(of: listener, group: MemberGroup(pool), path: poolPath, all: all, localAddresses: localAddresses)
                }
            }
            // The kind's own keys: its ways out, its two-way mode, its settings.
            try kind.validate(listener, index: index, path: path, of: self, localAddresses: localAddresses)
        }
        for kind in ListenerKinds.types { try kind.validateTogether(self) }
        if let announce {
            for (index, address) in announce.addresses.enumerated() where Self.listeners(serving: address, in: listeners).isEmpty {
                throw fail("announce.addresses[\(index)]", "no listener receives on \(address): bind one to it (or to the wildcard of its family); the address is announced only while the listeners on it are ready")
            }
        }
        if health.timeoutSecs > health.intervalSecs {
            throw fail("health.timeout_secs", "\(health.timeoutSecs) s is longer than interval_secs (\(health.intervalSecs) s): a probe must time out before the next one is due")
        }
    }

    /// The listeners that receive what is sent to `address`: bound to it, or to the wildcard of
    /// its family (`[::]` receives IPv4 too).
    static func listeners(serving address: IPAddress, in listeners: [Listener]) -> [Listener] {
        listeners.filter { listener in
            let bind = listener.bind.ip
            if bind == address { return true }
            guard bind.bytes.allSatisfy({ $0 == 0 }) else { return false }
            return bind.family == address.family || bind.family == AF_INET6
        }
    }

    /// Checks one member group of `listener` at `path` (its own downstreams, or a pool's): unique
    /// names, unicast addresses, no loop into a listener, MACs, and a way to get a member.
    private func validateMembers(of listener: Listener, group: MemberGroup, path: String, all: BindIndex, localAddresses: Set<IPAddress>) throws(ConfigError) {
        func fail(_ key: String, _ problem: String) -> ConfigError { configError(key, problem) }
        let owner = group.pool.map { "pool '\($0)' of listener '\(listener.name)'" } ?? "listener '\(listener.name)'"
        let discovered = DiscoverySources.of(listener).contains { $0.pool == group.pool }
        if let kubernetes = group.kubernetes, let namespace = kubernetes.namespace, !Self.isDNSLabel(namespace) {
            throw fail("\(path).kubernetes.namespace", "'\(namespace)' is not a Kubernetes namespace name (lowercase letters, digits and '-', at most 63)")
        }
        if let kubernetes = group.kubernetes, !Self.isDNSLabel(kubernetes.service) {
            throw fail("\(path).kubernetes.service", "'\(kubernetes.service)' is not a Kubernetes Service name (lowercase letters, digits and '-', at most 63)")
        }
        guard !group.downstreams.isEmpty || discovered else {
            throw fail("\(path).downstream", "empty, and no kubernetes discovery: add at least one downstream")
        }
        var downstreamNames = Set<String>()
        for (position, downstream) in group.downstreams.enumerated() {
            let key = "\(path).downstream[\(position)]"
            guard downstreamNames.insert(downstream.name).inserted else {
                throw fail("\(key).name", "duplicate downstream name '\(downstream.name)' in \(owner)")
            }
            if let problem = Self.unicastProblem(downstream.address) { throw fail("\(key).address", problem) }
            if let target = all.loopTarget(downstream.address, localAddresses) {
                throw fail("\(key).address", "\(downstream.address) is listener '\(listeners[target].name)' (\(listeners[target].bind)): forwarding loop")
            }
            if let mac = downstream.mac, !Self.isMAC(mac) {
                throw fail("\(key).mac", "'\(mac)' is not a MAC address (six hex pairs separated by colons, e.g. 02:00:00:00:00:01)")
            }
        }
        for downstream in group.dnsDownstreams {
            guard downstreamNames.insert(downstream.name).inserted else {
                throw fail("\(path).downstream", "duplicate downstream name '\(downstream.name)' in \(owner)")
            }
        }
        guard discovered || group.downstreams.contains(where: { $0.weight > 0 }) else {
            throw fail("\(path).downstream", "every downstream has weight 0: nothing could be forwarded")
        }
    }

    /// The error for `key`, with the line the file sets it on.
    func configError(_ key: String, _ problem: String) -> ConfigError { ConfigError(key, problem, line: lines.line(of: key)) }

    /// The warning for `key`, with the line the file sets it on.
    func configWarning(_ key: String, _ message: String) -> ConfigWarning { ConfigWarning(key: key, line: lines.line(of: key), message: message) }

    /// A Kubernetes object name of the DNS-label kind (RFC 1123): namespaces and Services.
    static func isDNSLabel(_ text: String) -> Bool {
        let allowed = Set("abcdefghijklmnopqrstuvwxyz0123456789-")
        return !text.isEmpty && text.count <= 63 && text.allSatisfy(allowed.contains) && text.first != "-" && text.last != "-"
    }

    /// Keys the file sets that this release reads but that have no effect where they stand:
    /// logged at start and on reload, and printed by `--check`, so no key is silently ignored.
    public func warnings() -> [ConfigWarning] {
        var warnings: [ConfigWarning] = []
        func warn(_ key: String, _ message: String) { warnings.append(configWarning(key, message)) }
        for (index, listener) in listeners.enumerated() {
            let path = "listeners[\(index)]"
            let kind = ListenerKinds.type(for: listener)
            // The kind's own keys, then its settings that have no effect in it.
            if let kind {
                warnings += kind.warnings(listener, path: path, of: self)
                warnings += SettingsTable.warnings(listener, of: kind, path: path, config: self) { $0 == .modes || $0 == .workers }
            }
            // The listener's own downstreams and each pool's.
            let groups = [(path, listener.ownMembers)] + listener.pools.enumerated().map { ("\(path).pools[\($0)]", MemberGroup($1)) }
            for (groupPath, group) in groups {
                for (position, downstream) in group.downstreams.enumerated() where downstream.mac != nil {
                    warn("\(groupPath).downstream[\(position)].mac", "accepted for compatibility and not used: the next hop's MAC comes from the kernel's neighbour table")
                }
                if !health.enabled {
                    for position in 0..<(group.downstreams.count + group.dnsDownstreams.count)
                    where lines.isSet("\(groupPath).downstream[\(position)].health_port") {
                        warn("\(groupPath).downstream[\(position)].health_port", "not used: health.enabled is false")
                    }
                }
            }
            // quic_lb with members that have no server ID, or a balancing that splits a first flight.
            if !listener.quicLB.isEmpty {
                if !listener.dnsDownstreams.isEmpty || listener.kubernetes != nil {
                    warn("\(path).quic_lb", "downstreams found by DNS name or Kubernetes have no server ID: only the balancing sends them datagrams, so their clients' connections break when an address changes; give QUIC servers by address with server_id")
                }
                // (A relay session and a nat association keep a client address on its first choice.)
                if listener.balancing == .roundRobin && listener.replies == .none {
                    warn("\(path).balancing", "round_robin with quic_lb: the packets of a client's first flight (Initial, 0-RTT) that carry its own connection ID can reach different servers; use balancing: source_ip")
                }
                // (tc_ebpf and xdp always keep the client's source.)
                if listener.replies == .none && listener.settings.output == .socket && listener.mode != .tcEBPF && listener.mode != .xdp {
                    warn("\(path).settings.output", "socket with a one-way quic_lb listener: the servers see this host's address, not the client's, so their replies cannot reach the client; use output: preserve_source with direct server return, or replies: relay (docs/quic.md)")
                }
            }
            // rate_limit: a byte burst below the largest datagram turns every larger one away.
            if let limit = listener.rateLimit, limit.bytesPerSecond != nil, limit.burstBytes < UInt64(listener.settings.maxPacketSize) {
                warn("\(path).rate_limit.burst_bytes", "\(limit.burstBytes) is below settings.max_packet_size (\(listener.settings.maxPacketSize)): a datagram larger than the byte burst is always dropped (rate_limited); raise burst_bytes or leave it out (default: a tenth of bytes_per_second, at least 65535)")
            }
            // flow_templates where it does less than asked.
            if listener.settings.flowTemplates && (listener.mode == .tcEBPF || listener.mode == .xdp) {
                if listener.replies != Replies.none {
                    warn("\(path).settings.flow_templates", "no effect on a two-way listener (replies: \(listener.replies.rawValue)): flow export is one-way; templates are followed on one-way listeners only")
                }
            }
            if (listener.mode == .userspace || listener.mode == .afXDP) && listener.replies == Replies.none && listener.settings.flowTemplates {
                if listener.settings.output == .socket {
                    warn("\(path).settings.flow_templates", "with output: socket every datagram, template copies and replays included, leaves from this host's address: collectors that tell exporters apart by source address (nfcapd, nfacctd) mix their templates up; set output: preserve_source")
                }
                for (index, pool) in listener.pools.enumerated() where pool.output == .socket && listener.settings.output != .socket {
                    warn("\(path).pools[\(index)].output", "with output: socket this pool's copies, and the templates sent to its members, leave from this host's address: collectors that tell exporters apart by source address (nfcapd, nfacctd) mix their templates up; set output: preserve_source")
                }
            }
            // The settings that depend on the listener's shape (its replies, its DNS downstreams).
            if let kind {
                warnings += SettingsTable.warnings(listener, of: kind, path: path, config: self) { $0 != .modes && $0 != .workers }
            }
        }
        if !health.enabled {
            for key in ["interval_secs", "timeout_secs", "protocol", "rise", "fall"] where lines.isSet("health.\(key)") {
                warn("health.\(key)", "not used: health.enabled is false, so no downstream is probed (add enabled: true to the health block)")
            }
        }
        return warnings
    }

    /// Why `address` cannot be a downstream (each datagram goes to exactly one host), or nil.
    static func unicastProblem(_ address: SocketAddress) -> String? {
        let ip = address.ip
        let oneHost = "udp-fanout sends each datagram to exactly one downstream; list the receivers' unicast addresses"
        if address.port == 0 { return "\(address): port 0 is not a destination; give the downstream's port" }
        if isUnspecified(ip) { return "\(address) is the unspecified address, not a host: give the downstream's address" }
        let bytes = ip.bytes
        if bytes.count == 4 {
            if (224...239).contains(bytes[0]) { return "\(address) is a multicast group: \(oneHost)" }
            if bytes == [255, 255, 255, 255] { return "\(address) is the broadcast address: \(oneHost)" }
        } else if bytes[0] == 0xff {
            return "\(address) is a multicast group: \(oneHost)"
        }
        return nil
    }

    static func isMAC(_ text: String) -> Bool {
        let parts = text.split(separator: ":", omittingEmptySubsequences: false)
        return parts.count == 6 && parts.allSatisfy { $0.count == 2 && UInt8($0, radix: 16) != nil }
    }

    static func isUnspecified(_ ip: IPAddress) -> Bool { ip.bytes.allSatisfy { $0 == 0 } }

    /// Two binds on one port where one is the other or a wildcard of the same family.
    static func overlaps(_ a: SocketAddress, _ b: SocketAddress) -> Bool {
        guard BindKey(a) == BindKey(b) else { return false }
        return a.ip == b.ip || isUnspecified(a.ip) || isUnspecified(b.ip)
    }

    /// Binds that can overlap: same family and port.
    struct BindKey: Hashable {
        let family: Int32
        let port: UInt16
        init(_ address: SocketAddress) {
            family = address.ip.family
            port = address.port
        }
    }

    /// Listeners' binds by family and port: by exact address, and the wildcard one (the first
    /// of each is kept).
    struct BindIndex {
        private var entries: [BindKey: (exact: [IPAddress: Int], wildcard: Int?)] = [:]

        /// The listener whose bind overlaps `bind`: the same address, or a wildcard on one side.
        func clash(_ bind: SocketAddress) -> Int? {
            guard let entry = entries[BindKey(bind)] else { return nil }
            if let wildcard = entry.wildcard { return wildcard }
            return FanoutConfig.isUnspecified(bind.ip) ? entry.exact.values.min() : entry.exact[bind.ip]
        }

        mutating func insert(_ bind: SocketAddress, _ index: Int) {
            var entry = entries[BindKey(bind)] ?? ([:], nil)
            if FanoutConfig.isUnspecified(bind.ip) {
                entry.wildcard = entry.wildcard ?? index
            } else if entry.exact[bind.ip] == nil {
                entry.exact[bind.ip] = index
            }
            entries[BindKey(bind)] = entry
        }

        /// The listener a datagram sent to `destination` would arrive at, if any.
        func loopTarget(_ destination: SocketAddress, _ local: Set<IPAddress>) -> Int? {
            guard let entry = entries[BindKey(destination)] else { return nil }
            if let exact = entry.exact[destination.ip] { return exact }
            guard let wildcard = entry.wildcard else { return nil }
            let ip = destination.ip
            return FanoutConfig.isUnspecified(ip) || local.contains(ip) || ip.bytes.first == 127 && ip.family == AF_INET ? wildcard : nil
        }
    }
}

/// A key that has no effect where it stands (see ``FanoutConfig/warnings()``).
public struct ConfigWarning: Sendable, Equatable, CustomStringConvertible {
    public let key: String
    public let line: Int?
    public let message: String

    public var description: String { "configuration warning: \(key)\(line.map { " (line \($0))" } ?? ""): \(message)" }
}

extension FanoutConfig {
    /// `quic_lb` and the downstreams' `server_id`: a kind that routes by connection ID, distinct
    /// config IDs of one server ID length, and one distinct server ID of that length on every
    /// downstream given by address (docs/quic.md).
    func validateQUICLB(_ listener: Listener, routes: Bool, path: String) throws(ConfigError) {
        func fail(_ key: String, _ problem: String) -> ConfigError { configError(key, problem) }
        if listener.quicLB.isEmpty {
            for (position, downstream) in listener.downstreams.enumerated() where downstream.serverID != nil {
                throw fail("\(path).downstream[\(position)].server_id", "only a listener with quic_lb routes by server ID: add quic_lb (docs/quic.md) or remove server_id")
            }
        } else {
            guard routes else {
                throw fail("\(path).quic_lb", "routing by QUIC connection ID is not available in mode \(listener.mode.rawValue) in this release: remove quic_lb or choose a mode that has it (docs/quic.md lists them)")
            }
            var configIDs = Set<UInt8>()
            for (position, configuration) in listener.quicLB.enumerated() {
                let key = listener.quicLB.count > 1 ? "\(path).quic_lb[\(position)]" : "\(path).quic_lb"
                guard configIDs.insert(configuration.configID).inserted else {
                    throw fail("\(key).config_id", "config ID \(configuration.configID) is given twice: each configuration of a listener has its own (0-6)")
                }
                guard configuration.serverIDLength == listener.quicLB[0].serverIDLength else {
                    throw fail("\(key).server_id_length", "\(configuration.serverIDLength) differs from the first configuration's \(listener.quicLB[0].serverIDLength): a downstream's server_id serves every configuration, so they share one server ID length")
                }
            }
            let length = listener.quicLB[0].serverIDLength
            var owners: [[UInt8]: String] = [:]
            for (position, downstream) in listener.downstreams.enumerated() {
                let key = "\(path).downstream[\(position)]"
                guard let serverID = downstream.serverID else {
                    throw fail("\(key).server_id", "required with quic_lb: the server ID (\(length) octets, \(2 * length) hexadecimal digits) this server puts in its connection IDs")
                }
                guard serverID.count == length else {
                    throw fail("\(key).server_id", "\(serverID.count) octet(s); quic_lb's server_id_length is \(length) (\(2 * length) hexadecimal digits)")
                }
                if let other = owners.updateValue(downstream.name, forKey: serverID) {
                    throw fail("\(key).server_id", "the same server ID as downstream '\(other)': each server needs its own, or one would get the other's connections")
                }
            }
        }
        for (index, pool) in listener.pools.enumerated() {
            for (position, downstream) in pool.downstreams.enumerated() where downstream.serverID != nil {
                throw fail("\(path).pools[\(index)].downstream[\(position)].server_id", "pools do not route by server ID (quic_lb routes the listener's own downstreams): remove server_id")
            }
        }
    }
}

/// This host's interface addresses (getifaddrs).
public enum LocalAddresses {
    public static func current() -> Set<IPAddress> {
        var result: Set<IPAddress> = [IPAddress("::1")!]
        var list: UnsafeMutablePointer<ifaddrs>?
        guard getifaddrs(&list) == 0 else { return result }
        defer { freeifaddrs(list) }
        var entry = list
        while let current = entry {
            if let address = current.pointee.ifa_addr, let socket = SocketAddress(storage: UnsafeRawPointer(address)) {
                result.insert(socket.ip)
            }
            entry = current.pointee.ifa_next
        }
        return result
    }
}
