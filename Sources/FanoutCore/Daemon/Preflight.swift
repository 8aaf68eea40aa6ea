import ReusePortLB

/// What `--check` verifies beyond the file itself, without binding, loading or attaching
/// anything: tc_ebpf interfaces, forwarding and routes (``TCPreflight``), and that no other
/// process already serves a userspace listener's bind.
public enum Preflight {
    /// Problems found, each naming the key and the fix; empty when the configuration can start.
    public static func problems(_ config: FanoutConfig) -> [String] {
        var problems = TCPreflight.preflight(config)
        for (index, listener) in config.listeners.enumerated() where listener.mode == .userspace {
            guard let other = BoundSockets.foreign(on: listener.bind).first else { continue }
            let owner = other.pid.map { "pid \($0)\(other.command.map { ", \($0)" } ?? "")" } ?? "another user or namespace"
            problems.append("listeners[\(index)].bind: \(listener.bind) is already served by another process (\(owner)): stop it or use another bind")
        }
        return problems
    }
}
