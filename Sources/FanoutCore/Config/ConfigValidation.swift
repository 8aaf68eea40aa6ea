#if canImport(Glibc)
import Glibc
#endif
import CSystemShim
import ReusePortLB

extension FanoutConfig {
    /// Checks what the parser cannot see key by key. Throws the first problem, naming its key.
    /// - Parameter localAddresses: this host's addresses, to find downstreams that would loop
    ///   back into a wildcard listener.
    public func validate(localAddresses: Set<IPAddress> = LocalAddresses.current()) throws(ConfigError) {
        guard !listeners.isEmpty else { throw ConfigError("listeners", "empty: configure at least one listener") }
        var names = Set<String>()
        for (index, listener) in listeners.enumerated() {
            let path = "listeners[\(index)]"
            guard names.insert(listener.name).inserted else {
                throw ConfigError("\(path).name", "duplicate listener name '\(listener.name)'")
            }
            for (other, earlier) in listeners[..<index].enumerated() where Self.overlaps(earlier.bind, listener.bind) {
                throw ConfigError("\(path).bind", "\(listener.bind) overlaps listeners[\(other)].bind \(earlier.bind)")
            }
            if listener.mode != .userspace && (listener.interface ?? "").isEmpty {
                throw ConfigError("\(path).interface", "mode \(listener.mode.rawValue) attaches to a network interface: set interface (e.g. eth0)")
            }
            guard Mode.implemented.contains(listener.mode) else {
                throw ConfigError("\(path).mode", "\(listener.mode.rawValue) is not implemented in this release (implemented: \(Mode.allCases.filter { Mode.implemented.contains($0) }.map(\.rawValue).joined(separator: ", "))); it is never served by another mode")
            }
            if listener.kubernetes != nil {
                throw ConfigError("\(path).kubernetes", "Kubernetes EndpointSlice discovery is not implemented in this release: list the downstreams under downstream")
            }
            guard !listener.downstreams.isEmpty else {
                throw ConfigError("\(path).downstream", "empty, and no kubernetes discovery: add at least one downstream")
            }
            var downstreamNames = Set<String>()
            for (position, downstream) in listener.downstreams.enumerated() {
                let key = "\(path).downstream[\(position)]"
                guard downstreamNames.insert(downstream.name).inserted else {
                    throw ConfigError("\(key).name", "duplicate downstream name '\(downstream.name)' in listener '\(listener.name)'")
                }
                for target in listeners where Self.loops(downstream.address, into: target.bind, localAddresses) {
                    throw ConfigError("\(key).address", "\(downstream.address) is listener '\(target.name)' (\(target.bind)): forwarding loop")
                }
            }
            guard listener.downstreams.contains(where: { $0.weight > 0 }) else {
                throw ConfigError("\(path).downstream", "every downstream has weight 0: nothing could be forwarded")
            }
            if listener.mode == .tcEBPF { try Self.validateTC(listener, path: path, localAddresses) }
        }
        let tcListeners = listeners.filter { $0.mode == .tcEBPF }
        if tcListeners.count > Int(FANOUT_MAX_LISTENERS) {
            throw ConfigError("listeners", "\(tcListeners.count) tc_ebpf listeners: at most \(FANOUT_MAX_LISTENERS)")
        }
        for (index, listener) in listeners.enumerated() where listener.mode == .tcEBPF {
            if let other = tcListeners.first(where: { $0.interface == listener.interface && $0.settings.tcAttach != listener.settings.tcAttach }) {
                throw ConfigError("listeners[\(index)].settings.tc_attach", "\(listener.settings.tcAttach.rawValue) differs from listener '\(other.name)' on the same interface \(listener.interface ?? ""): one program per interface, set the same tc_attach")
            }
        }
        if health.enabled {
            throw ConfigError("health.enabled", "health probes are not implemented in this release: set enabled: false (every downstream is then always in rotation)")
        }
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
        guard a.port == b.port, a.ip.family == b.ip.family else { return false }
        return a.ip == b.ip || isUnspecified(a.ip) || isUnspecified(b.ip)
    }

    /// A datagram sent to `destination` would arrive at a listener bound to `bind`.
    static func loops(_ destination: SocketAddress, into bind: SocketAddress, _ local: Set<IPAddress>) -> Bool {
        guard destination.port == bind.port else { return false }
        if destination.ip == bind.ip { return true }
        guard isUnspecified(bind.ip) else { return false }
        return isUnspecified(destination.ip) || local.contains(destination.ip)
            || destination.ip.bytes.first == 127 && bind.ip.family == destination.ip.family
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
