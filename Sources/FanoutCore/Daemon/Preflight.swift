import ReusePortLB

/// What `--check` verifies beyond the file itself, without binding, loading or attaching
/// anything: tc_ebpf interfaces, forwarding and routes (``TCPreflight``), and that no other
/// process already serves a userspace listener's bind.
public enum Preflight {
    /// Problems (each naming the key and the fix; the file cannot start as it is) and notes
    /// (worth knowing, not in the way).
    public static func check(_ config: FanoutConfig) -> (problems: [String], notes: [String]) {
        var problems = TCPreflight.preflight(config)
        var notes: [String] = []
        for (index, listener) in config.listeners.enumerated() where listener.mode == .userspace {
            guard let other = BoundSockets.foreign(on: listener.bind).first else { continue }
            let owner = other.pid.map { "pid \($0)\(other.command.map { ", \($0)" } ?? "")" } ?? "another user or namespace"
            let text = "listeners[\(index)].bind: \(listener.bind) is already served by another process (\(owner))"
            if other.command == "udp-fanout" {
                // Most likely the daemon this file is about to reload (`--check` before SIGHUP).
                notes.append(text + ": fine if that is the daemon this file reloads; a second daemon on this bind would be refused")
            } else {
                problems.append(text + ": stop it or use another bind")
            }
        }
        return (problems, notes)
    }
}
