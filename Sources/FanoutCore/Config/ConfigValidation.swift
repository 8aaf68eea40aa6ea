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
        func fail(_ key: String, _ problem: String) -> ConfigError { ConfigError(key, problem, line: lines.line(of: key)) }
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
            let clash = listener.mode == .tcEBPF
                ? sockets.clash(listener.bind) ?? kernelByInterface[interface, default: BindIndex()].clash(listener.bind)
                : sockets.clash(listener.bind) ?? kernel.clash(listener.bind)
            if let other = clash {
                throw fail("\(path).bind", "\(listener.bind) overlaps listeners[\(other)].bind \(listeners[other].bind)\(listeners[other].mode == .tcEBPF ? " on \(listeners[other].interface ?? "")" : "")")
            }
            if listener.mode == .tcEBPF {
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
            if listener.mode != .userspace && (listener.interface ?? "").isEmpty {
                throw fail("\(path).interface", "mode \(listener.mode.rawValue) attaches to a network interface: set interface (e.g. eth0)")
            }
            if let kubernetes = listener.kubernetes, let namespace = kubernetes.namespace, !Self.isDNSLabel(namespace) {
                throw fail("\(path).kubernetes.namespace", "'\(namespace)' is not a Kubernetes namespace name (lowercase letters, digits and '-', at most 63)")
            }
            if let kubernetes = listener.kubernetes, !Self.isDNSLabel(kubernetes.service) {
                throw fail("\(path).kubernetes.service", "'\(kubernetes.service)' is not a Kubernetes Service name (lowercase letters, digits and '-', at most 63)")
            }
            let discovered = listener.kubernetes != nil || !listener.dnsDownstreams.isEmpty
            guard !listener.downstreams.isEmpty || discovered else {
                throw fail("\(path).downstream", "empty, and no kubernetes discovery: add at least one downstream")
            }
            var downstreamNames = Set<String>()
            for (position, downstream) in listener.downstreams.enumerated() {
                let key = "\(path).downstream[\(position)]"
                guard downstreamNames.insert(downstream.name).inserted else {
                    throw fail("\(key).name", "duplicate downstream name '\(downstream.name)' in listener '\(listener.name)'")
                }
                if let problem = Self.unicastProblem(downstream.address) { throw fail("\(key).address", problem) }
                if let target = all.loopTarget(downstream.address, localAddresses) {
                    throw fail("\(key).address", "\(downstream.address) is listener '\(listeners[target].name)' (\(listeners[target].bind)): forwarding loop")
                }
                if let mac = downstream.mac, !Self.isMAC(mac) {
                    throw fail("\(key).mac", "'\(mac)' is not a MAC address (six hex pairs separated by colons, e.g. 02:00:00:00:00:01)")
                }
            }
            for downstream in listener.dnsDownstreams {
                guard downstreamNames.insert(downstream.name).inserted else {
                    throw fail("\(path).downstream", "duplicate downstream name '\(downstream.name)' in listener '\(listener.name)'")
                }
            }
            guard discovered || listener.downstreams.contains(where: { $0.weight > 0 }) else {
                throw fail("\(path).downstream", "every downstream has weight 0: nothing could be forwarded")
            }
            switch (listener.mode, listener.settings.output) {
            case (.tcEBPF, .socket), (.tcEBPF, .xdpTX):
                if lines.isSet("\(path).settings.output") {
                    throw fail("\(path).settings.output", "\(listener.settings.output.rawValue): tc_ebpf forwards in the kernel and always keeps the client's source (preserve_source); remove the key or choose mode userspace/af_xdp")
                }
            case (.userspace, .xdpTX):
                throw fail("\(path).settings.output", "xdp_tx needs mode af_xdp (it transmits from the AF_XDP ring); userspace mode offers socket or preserve_source")
            default: break
            }
            if listener.settings.output != .socket, listener.mode != .tcEBPF, !Self.isUnspecified(listener.bind.ip) {
                // A source-preserving way out keeps the client's address: a client of the bind's
                // family cannot be sent to a downstream of the other (every datagram would be dropped).
                for (position, downstream) in listener.downstreams.enumerated() where downstream.address.ip.family != listener.bind.ip.family {
                    throw fail("\(path).downstream[\(position)].address", "\(downstream.address) is not of the listener's address family (\(listener.bind)): output \(listener.settings.output.rawValue) keeps the client's source address, which cannot reach a downstream of the other family; use output: socket or a downstream of the same family")
                }
            }
            if listener.mode == .afXDP {
                if listener.settings.zeroCopy == .on && listener.settings.xdpMode == .generic {
                    throw fail("\(path).settings.zero_copy", "on with xdp_mode: generic cannot bind: zero-copy needs the driver's XDP hook (xdp_mode: native or auto), or set zero_copy: auto/off")
                }
                if let other = listeners[..<index].firstIndex(where: { $0.mode == .afXDP && $0.interface == listener.interface }) {
                    throw fail("\(path).interface", "\(listener.interface ?? "") already serves listener '\(listeners[other].name)': one af_xdp listener per interface (its AF_XDP sockets hold the interface's queues); use another interface, or mode userspace/tc_ebpf for this bind")
                }
                if listener.settings.umemFrames < 2 * listener.settings.ringSize {
                    throw fail("\(path).settings.umem_frames", "\(listener.settings.umemFrames) frames: must be at least twice ring_size (\(listener.settings.ringSize)), so the fill ring stays full while frames are in flight")
                }
            }
            switch listener.replies {
            case .none: break
            case .nat:
                guard listener.mode == .tcEBPF else {
                    throw fail("\(path).replies", "nat rewrites both directions in the kernel: it needs mode tc_ebpf (mode userspace offers replies: relay; af_xdp has no two-way path in this release)")
                }
                guard !Self.isUnspecified(listener.bind.ip) else {
                    throw fail("\(path).bind", "\(listener.bind): with replies nat the replies leave from the listener's address, so it must be the virtual address itself (e.g. 198.18.0.1:5683), not a wildcard")
                }
            case .relay:
                guard listener.mode == .userspace else {
                    throw fail("\(path).replies", "relay uses session sockets in userspace: it needs mode userspace (mode tc_ebpf offers replies: nat)")
                }
                guard listener.settings.output == .socket else {
                    throw fail("\(path).settings.output", "\(listener.settings.output.rawValue): replies relay receives the downstreams' replies on its own session sockets, so datagrams must leave through them (output: socket)")
                }
                guard listener.settings.workerSteering != .roundRobin else {
                    throw fail("\(path).settings.worker_steering", "round_robin spreads one client over every worker, and each worker keeps its own sessions: replies relay needs five_tuple or source_ip")
                }
            }
            if listener.mode == .tcEBPF {
                do throws(ConfigError) {
                    try Self.validateTC(listener, path: path, localAddresses)
                } catch {
                    throw fail(error.key, error.problem)
                }
            }
        }
        let tcListeners = listeners.filter { $0.mode == .tcEBPF }
        if tcListeners.count > Int(FANOUT_MAX_LISTENERS) {
            throw fail("listeners", "\(tcListeners.count) tc_ebpf listeners: at most \(FANOUT_MAX_LISTENERS)")
        }
        // A reply is matched to its listener by the downstream's address and port, so a
        // downstream answers for one nat listener only.
        var natDownstreams: [SocketAddress: Int] = [:]
        for (index, listener) in listeners.enumerated() where listener.replies == .nat {
            for (position, downstream) in listener.downstreams.enumerated() {
                if let other = natDownstreams[downstream.address], other != index {
                    throw fail("listeners[\(index)].downstream[\(position)].address", "\(downstream.address) is also a downstream of listener '\(listeners[other].name)' with replies nat: its replies could not be told apart; give each nat listener its own downstream ports")
                }
                natDownstreams[downstream.address] = index
            }
        }
        for (index, listener) in listeners.enumerated() where listener.mode == .tcEBPF {
            if let other = tcListeners.first(where: { $0.interface == listener.interface && $0.settings.tcAttach != listener.settings.tcAttach }) {
                throw fail("listeners[\(index)].settings.tc_attach", "\(listener.settings.tcAttach.rawValue) differs from listener '\(other.name)' on the same interface \(listener.interface ?? ""): one program per interface, set the same tc_attach")
            }
        }
        if health.timeoutSecs > health.intervalSecs {
            throw fail("health.timeout_secs", "\(health.timeoutSecs) s is longer than interval_secs (\(health.intervalSecs) s): a probe must time out before the next one is due")
        }
    }

    /// A Kubernetes object name of the DNS-label kind (RFC 1123): namespaces and Services.
    static func isDNSLabel(_ text: String) -> Bool {
        let allowed = Set("abcdefghijklmnopqrstuvwxyz0123456789-")
        return !text.isEmpty && text.count <= 63 && text.allSatisfy(allowed.contains) && text.first != "-" && text.last != "-"
    }

    /// Keys the file sets that this release reads but that have no effect where they stand:
    /// logged at start and on reload, and printed by `--check`, so no key is silently ignored.
    public func warnings() -> [ConfigWarning] {
        var warnings: [ConfigWarning] = []
        func warn(_ key: String, _ message: String) {
            warnings.append(ConfigWarning(key: key, line: lines.line(of: key), message: message))
        }
        for (index, listener) in listeners.enumerated() {
            let path = "listeners[\(index)]"
            if listener.mode == .userspace {
                if lines.isSet("\(path).interface") {
                    warn("\(path).interface", "not used in mode userspace (the socket receives on every interface that routes to the bind address)")
                }
                if lines.isSet("\(path).settings.tc_attach") { warn("\(path).settings.tc_attach", "applies to mode tc_ebpf only") }
            }
            if listener.mode != .afXDP {
                for key in ["xdp_mode", "queues", "umem_frame_size", "umem_frames", "ring_size", "zero_copy", "busy_poll"] where lines.isSet("\(path).settings.\(key)") {
                    warn("\(path).settings.\(key)", "applies to mode af_xdp only")
                }
            }
            if listener.mode == .afXDP {
                if lines.isSet("\(path).settings.tc_attach") { warn("\(path).settings.tc_attach", "applies to mode tc_ebpf only") }
                for key in ["workers", "worker_steering"] where lines.isSet("\(path).settings.\(key)") {
                    warn("\(path).settings.\(key)", "not used in mode af_xdp (one forwarder per RX queue: settings.queues)")
                }
            } else if listener.mode == .tcEBPF {
                for key in ["workers", "batch_size", "pin_cpus", "recv_buf_size", "max_packet_size", "worker_steering"] where lines.isSet("\(path).settings.\(key)") {
                    warn("\(path).settings.\(key)", "not used in mode \(listener.mode.rawValue) (it sets userspace workers; the kernel forwards here)")
                }
            }
            for (position, downstream) in listener.downstreams.enumerated() where downstream.mac != nil {
                warn("\(path).downstream[\(position)].mac", "accepted for compatibility and not used: the next hop's MAC comes from the kernel's neighbour table")
            }
            if !health.enabled {
                for position in 0..<(listener.downstreams.count + listener.dnsDownstreams.count)
                where lines.isSet("\(path).downstream[\(position)].health_port") {
                    warn("\(path).downstream[\(position)].health_port", "not used: health.enabled is false")
                }
            }
            for key in ["max_associations", "reply_interfaces"] where listener.replies != .nat && lines.isSet("\(path).settings.\(key)") {
                warn("\(path).settings.\(key)", "applies to replies: nat only")
            }
            for key in ["max_sessions", "session_idle_secs", "io_uring"] where listener.replies != .relay && lines.isSet("\(path).settings.\(key)") {
                warn("\(path).settings.\(key)", "applies to replies: relay only")
            }
            if listener.replies == .none && lines.isSet("\(path).settings.drain_secs") {
                warn("\(path).settings.drain_secs", "applies to two-way listeners (replies: nat or relay) only")
            }
            if listener.dnsDownstreams.isEmpty && lines.isSet("\(path).settings.resolve_interval_secs") {
                warn("\(path).settings.resolve_interval_secs", "not used: no downstream of this listener is given by DNS name")
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

    /// tc_ebpf rewrites and routes at L3: downstreams are other hosts of the listener's family.
    static func validateTC(_ listener: Listener, path: String, _ local: Set<IPAddress>) throws(ConfigError) {
        guard listener.downstreams.count <= Int(FANOUT_MAX_BACKENDS) else {
            throw ConfigError("\(path).downstream", "\(listener.downstreams.count) downstreams: tc_ebpf serves at most \(FANOUT_MAX_BACKENDS) per listener")
        }
        for (position, downstream) in listener.downstreams.enumerated() {
            let key = "\(path).downstream[\(position)].address"
            let ip = downstream.address.ip
            guard ip.family == listener.bind.ip.family else {
                throw ConfigError(key, "\(downstream.address) is not of the listener's address family (\(listener.bind)): tc_ebpf rewrites the destination in place and cannot translate between IPv4 and IPv6")
            }
            if isUnspecified(ip) || downstream.address.port == 0 {
                throw ConfigError(key, "\(downstream.address): tc_ebpf needs a concrete address and port")
            }
            if local.contains(ip) || ip.bytes.first == 127 || ip == IPAddress("::1")! {
                throw ConfigError(key, "\(downstream.address) is an address of this host: tc_ebpf forwards to other hosts (routed through the kernel's fib); use mode userspace for local downstreams")
            }
        }
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
