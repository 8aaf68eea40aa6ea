#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import ReusePortLB

/// What `--check` verifies beyond the file itself, without binding, loading or attaching
/// anything: tc_ebpf interfaces, forwarding and routes (``TCPreflight``), that an af_xdp
/// listener's interface exists and carries no other tool's XDP program, and that no other
/// process already serves a userspace listener's bind.
public enum Preflight {
    /// Problems (each naming the key and the fix; the file cannot start as it is) and notes
    /// (worth knowing, not in the way).
    public static func check(_ config: FanoutConfig) -> (problems: [String], notes: [String]) {
        var problems = TCPreflight.preflight(config)
        var notes: [String] = []
        for (index, listener) in config.listeners.enumerated() where listener.mode == .afXDP {
            let interface = listener.interface ?? ""
            let ifindex = if_nametoindex(interface)
            guard ifindex > 0 else {
                problems.append("listeners[\(index)].interface: listener '\(listener.name)': interface '\(interface)' not found in this network namespace: fix the name (ip link show lists them) or create the interface first")
                continue
            }
            // The start's own check: another tool's XDP program on the interface refuses it.
            do throws(XDPError) {
                try XDPAttachment.checkNoForeignProgram(ifindex: ifindex, interface: interface, ours: nil)
            } catch .foreignProgram(_, _, let name, _) where name == FANOUT_PROG_XDP_NAME {
                // Most likely the daemon this file is about to reload (`--check` before SIGHUP).
                notes.append("listeners[\(index)].interface: listener '\(listener.name)': \(interface) already runs udp-fanout's XDP program: fine if that is the daemon this file reloads; a second af_xdp daemon on it would be refused")
            } catch .foreignProgram(_, let id, "?", _) {
                // Its name could not be read (bpf_prog_get_fd_by_id needs CAP_SYS_ADMIN): it may be
                // the running daemon's own, so not a problem for an unprivileged check.
                notes.append("listeners[\(index)].interface: listener '\(listener.name)': \(interface) already runs an XDP program (id \(id)) whose name this process cannot read: fine if it is the udp-fanout this file reloads; another program refuses the start (check as root, or bpftool prog show id \(id))")
            } catch .query(_, let error) {
                notes.append("listeners[\(index)].interface: listener '\(listener.name)': the XDP programs of \(interface) could not be read (\(error)); the start checks them again")
            } catch {
                problems.append("listeners[\(index)].interface: listener '\(listener.name)': \(error)")
            }
            if listener.settings.queues > 0, let available = try? RXQueues.count(interface: interface), listener.settings.queues > available {
                problems.append("listeners[\(index)].settings.queues: listener '\(listener.name)': \(listener.settings.queues) but \(interface) has \(available) RX queue(s): lower it (0 serves them all)")
            }
        }
        for (index, listener) in config.listeners.enumerated() where listener.replies == .nat {
            problems += replyInterfaceProblems(listener, path: "listeners[\(index)]")
        }
        for (index, listener) in config.listeners.enumerated() where listener.mode == .userspace {
            for overlap in SocketOverlap.warnings(listener.bind) { notes.append("listeners[\(index)].bind: \(overlap)") }
            guard let other = BoundSockets.foreign(on: listener.bind).first else { continue }
            let text = "listeners[\(index)].bind: \(listener.bind) is already served by another process (\(other.owner))"
            if other.command == "udp-fanout" {
                // Most likely the daemon this file is about to reload (`--check` before SIGHUP).
                notes.append(text + ": fine if that is the daemon this file reloads; a second daemon on this bind would be refused")
            } else {
                problems.append(text + ": stop it or use another bind")
            }
        }
        notes += discoveryNotes(config)
        return (problems, notes)
    }

    /// replies nat: the interfaces the replies arrive on (configured, or those the kernel routes
    /// the downstreams through) exist and forward, as the start requires of them.
    static func replyInterfaceProblems(_ listener: Listener, path: String) -> [String] {
        var problems: [String] = []
        var interfaces: [(name: String, key: String)] = listener.settings.replyInterfaces.enumerated().map { ($0.element, "\(path).settings.reply_interfaces[\($0.offset)]") }
        if interfaces.isEmpty {
            for (position, downstream) in listener.downstreams.enumerated() where downstream.weight > 0 {
                guard let name = TCRoute.interface(to: downstream.address.ip) else { continue }  // the route check says so
                if !interfaces.contains(where: { $0.name == name }) { interfaces.append((name, "\(path).downstream[\(position)].address")) }
            }
        }
        for (name, key) in interfaces {
            guard if_nametoindex(name) > 0 else {
                problems.append("\(key): listener '\(listener.name)': reply interface '\(name)' not found in this network namespace: fix settings.reply_interfaces (ip link show lists them) or create the interface first")
                continue
            }
            let (sysctl, file) = TCPreflight.forwardingSetting(interface: name, family: listener.bind.ip.family)
            if TCDataplane.readFirstLine(file) != "1" {
                problems.append("\(key): listener '\(listener.name)': IP forwarding is disabled for reply interface '\(name)': replies arriving there could not be routed to the clients; enable it (sysctl -w \(sysctl)=1)")
            }
        }
        return problems
    }

    /// Where Kubernetes credentials come from. A note, not a problem: a token may appear after
    /// start, and the daemon keeps trying (its `/readyz` says what it waits for). DNS names are
    /// not resolved here: `--check` sends nothing to the network.
    static func discoveryNotes(_ config: FanoutConfig, environment: [String: String] = ProcessEnvironment.current()) -> [String] {
        var notes: [String] = []
        for (index, listener) in config.listeners.enumerated() {
            if listener.kubernetes != nil {
                do {
                    let credentials = try KubernetesCredentials.load(environment: environment)
                    notes.append("listeners[\(index)].kubernetes: API server \(credentials.server) with credentials from \(credentials.origin) (not contacted by --check)")
                } catch {
                    notes.append("listeners[\(index)].kubernetes: \(error); the listener stays not ready until credentials are found")
                }
            }
        }
        return notes
    }
}

/// Another process's socket on a bind that overlaps a listener's (wildcard against specific):
/// the kernel gives each datagram to the most specific bind, so one of the two silently gets
/// nothing for that address. Said at start and by `--check`.
enum SocketOverlap {
    static func warnings(_ bind: SocketAddress) -> [String] {
        BoundSockets.foreign(overlapping: bind).map { other in
            FanoutConfig.isUnspecified(bind.ip)
                ? "\(other.bound) is bound by another process (\(other.owner.owner)): datagrams to \(other.bound) go to it, not to this listener"
                : "another process (\(other.owner.owner)) listens on \(other.bound): this listener takes the datagrams to \(bind) from it"
        }
    }
}
