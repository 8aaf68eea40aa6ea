#if canImport(Glibc)
import Glibc
#endif

/// What `udp-fanout --check` can know about tc_ebpf listeners without loading or attaching
/// anything: the interface exists, IP forwarding is on for it, and the kernel has a route to
/// each downstream. Read in the calling process's network namespace.
public enum TCPreflight {
    /// The problems found, one sentence each naming the configuration key and the fix; empty
    /// when every tc_ebpf listener can start here. Listeners of other modes are not looked at.
    /// - Parameter config: a configuration that has passed `validate()`.
    public static func preflight(_ config: FanoutConfig) -> [String] {
        var problems: [String] = []
        for (index, listener) in config.listeners.enumerated() where listener.mode == .tcEBPF {
            let (key, name) = ("listeners[\(index)]", "listener '\(listener.name)'")
            let interface = listener.interface ?? ""
            guard if_nametoindex(interface) > 0 else {
                problems.append("\(key).interface: \(name): interface '\(interface)' not found in this network namespace: fix the name (ip link show lists them) or create the interface first")
                continue
            }
            let forwarding = forwardingSetting(interface: interface, family: listener.bind.ip.family)
            if TCDataplane.readFirstLine(forwarding.path) != "1" {
                problems.append("\(key).interface: \(name): IP forwarding is disabled for '\(interface)', so the kernel's fib lookup refuses to route: enable it with sysctl -w \(forwarding.sysctl)=1")
            }
            for (position, downstream) in listener.downstreams.enumerated() {
                guard let problem = TCRoute.problem(to: downstream.address.ip) else { continue }
                problems.append("\(key).downstream[\(position)]: \(name), downstream '\(downstream.name)' \(downstream.address): no route from this host (\(problem)): add one (ip route add \(downstream.address.ip) via <gateway>) or fix the address; until then its datagrams are dropped and counted no_route")
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
