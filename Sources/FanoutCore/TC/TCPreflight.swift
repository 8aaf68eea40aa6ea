// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif

/// What `udp-fanout --check` can know about tc_ebpf listeners without loading or attaching
/// anything: the interface exists, IP forwarding is on for it, and the kernel has a route to
/// each downstream. Read in the calling process's network namespace.
enum TCPreflight {
    /// The problems found for tc_ebpf listener `listeners[index]` of a validated configuration,
    /// one sentence each naming the configuration key and the fix; empty when it can start here.
    static func problems(_ listener: Listener, index: Int) -> [String] {
        var problems: [String] = []
        let (key, name) = ("listeners[\(index)]", "listener '\(listener.name)'")
        let interface = listener.interface ?? ""
        guard if_nametoindex(interface) > 0 else {
            return ["\(key).interface: \(name): interface '\(interface)' not found in this network namespace: fix the name (ip link show lists them) or create the interface first"]
        }
        let forwarding = forwardingSetting(interface: interface, family: listener.bind.ip.family)
        if TCDataplane.readFirstLine(forwarding.path) != "1" {
            problems.append("\(key).interface: \(name): IP forwarding is disabled for '\(interface)', so the kernel's fib lookup refuses to route: enable it with sysctl -w \(forwarding.sysctl)=1")
        }
        let groups = [(key, listener.downstreams)] + listener.pools.enumerated().map { ("\(key).pools[\($0)]", $1.downstreams) }
        for (path, downstreams) in groups {
            for (position, downstream) in downstreams.enumerated() {
                guard let problem = TCRoute.problem(to: downstream.address.ip) else { continue }
                problems.append("\(path).downstream[\(position)]: \(name), downstream '\(downstream.name)' \(downstream.address): no route from this host (\(problem)): add one (ip route add \(downstream.address.ip) via <gateway>) or fix the address; until then its datagrams are dropped and counted no_route")
            }
        }
        return problems
    }

    /// replies nat: the interfaces the replies arrive on (configured, or those the kernel routes
    /// the downstreams through) exist and forward, as the start requires of them.
    static func replyInterfaceProblems(_ listener: Listener, path: String) -> [String] {
        var problems: [String] = []
        var interfaces: [(name: String, key: String)] = listener.settings.replyInterfaces.enumerated().map { ($0.element, "\(path).settings.reply_interfaces[\($0.offset)]") }
        if interfaces.isEmpty {
            for (position, downstream) in listener.downstreams.enumerated() where TCListener.keepsClients(downstream, quic: !listener.quicLB.isEmpty) {
                guard let name = TCRoute.interface(to: downstream.address.ip) else { continue }  // the route check says so
                if !interfaces.contains(where: { $0.name == name }) { interfaces.append((name, "\(path).downstream[\(position)].address")) }
            }
        }
        for (name, key) in interfaces {
            guard if_nametoindex(name) > 0 else {
                problems.append("\(key): listener '\(listener.name)': reply interface '\(name)' not found in this network namespace: fix settings.reply_interfaces (ip link show lists them) or create the interface first")
                continue
            }
            let (sysctl, file) = forwardingSetting(interface: name, family: listener.bind.ip.family)
            if TCDataplane.readFirstLine(file) != "1" {
                problems.append("\(key): listener '\(listener.name)': IP forwarding is disabled for reply interface '\(name)': replies arriving there could not be routed to the clients; enable it (sysctl -w \(sysctl)=1)")
            }
        }
        return problems
    }

    /// The sysctl that lets the fib lookup route packets arriving on `interface`: per interface
    /// for IPv4, the `all` switch for IPv6.
    static func forwardingSetting(interface: String, family: Int32) -> (sysctl: String, path: String) {
        family == AF_INET6
            ? ("net.ipv6.conf.all.forwarding", "/proc/sys/net/ipv6/conf/all/forwarding")
            : ("net.ipv4.conf.\(interface).forwarding", "/proc/sys/net/ipv4/conf/\(interface)/forwarding")
    }
}
