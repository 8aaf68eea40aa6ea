// SPDX-License-Identifier: Apache-2.0
import ReusePortLB
import SystemCalls

/// Why the health checker cannot probe: each case names the problem and the fix.
enum HealthError: Error, CustomStringConvertible, Sendable, Equatable {
    /// Neither an ICMP datagram socket nor a raw socket could be opened for `family` ("IPv4" or
    /// "IPv6"): with neither, ICMP probes cannot run at all.
    case icmpUnavailable(family: String, datagram: SystemCallError, raw: SystemCallError)
    /// A system call the probe loop itself needs (poll) failed.
    case probeLoop(SystemCallError)

    var description: String {
        switch self {
        case .icmpUnavailable(let family, let datagram, let raw):
            let sysctl = family == "IPv6" ? "net.ipv4.ping_group_range (it governs ICMPv6 datagram sockets too)" : "net.ipv4.ping_group_range"
            return "health.protocol icmp: cannot open an \(family) ICMP socket (datagram socket: \(datagram); raw socket: \(raw)). "
                + "Allow ICMP datagram sockets for the daemon's group with the sysctl \(sysctl), e.g. '0 2147483647' "
                + "(Kubernetes: a pod securityContext sysctl), or grant CAP_NET_RAW (systemd AmbientCapabilities=CAP_NET_RAW; "
                + "Kubernetes capabilities.add: [NET_RAW]), or use health.protocol: udp_echo"
        case .probeLoop(let error):
            return "health checker: \(error)"
        }
    }
}
