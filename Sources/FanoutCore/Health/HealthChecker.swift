// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import Logging
import ReusePortLB
import SystemCalls
import ServiceLifecycle
import Synchronization

/// Active health probes of downstreams (ICMP echo or UDP echo, see `HealthPolicy`) plus passive
/// reports from the forwarding path. Every target is probed on its own schedule, concurrently
/// (many probes in flight at once from one thread that polls every probe socket; a slow target
/// never delays another), with a jittered first probe so N targets do not probe in one burst.
/// A target goes down after `fall` consecutive failures and up after `rise` consecutive
/// successes; `onChange` hears each transition once, from the probe thread, with no lock held.
public final class HealthChecker: Service, Sendable {
    /// One target's state and counters, read by ``isUp(_:)`` and ``metricsText()``.
    struct Record: Sendable {
        var state = HealthState()
        var results: [ProbeResult: UInt64] = [:]
        var transitionsUp: UInt64 = 0
        var transitionsDown: UInt64 = 0
        var durationSum: Double = 0
        var durationCount: UInt64 = 0
        var passive: UInt64 = 0
        /// When the target became a target or last changed state (seconds since the epoch), for `/status`.
        var since = WallClock.seconds()
        /// Passive reports not yet applied to `state` by the probe thread.
        var pendingPassive = 0
    }

    struct Shared: Sendable {
        var policy: HealthPolicy
        var policyVersion = 0
        var records: [SocketAddress: Record] = [:]
        var targetsVersion = 0
        var passiveUnmatched: UInt64 = 0
        var stopped = false
    }

    let shared: Mutex<Shared>
    let logger: Logger
    let onChange: @Sendable (_ target: SocketAddress, _ up: Bool) -> Void
    /// Which ICMP socket kinds are tried, in order (tests force one).
    let icmpKinds: [ICMPProbeSocket.Kind]
    /// Whether the configuration at start turns active probes on (the start's log line says which).
    let probingAtStart: Bool
    /// Written to wake the probe thread (new targets, passive reports, policy, stop); -1 if the
    /// pipe could not be made, then the thread polls at least every 100 ms instead.
    let wakeRead: Int32
    let wakeWrite: Int32

    /// - Parameters:
    ///   - policy: protocol, interval, timeout, rise and fall.
    ///   - onChange: called on each transition (up→down after `fall` consecutive failures,
    ///     down→up after `rise` consecutive successes), from the probe thread.
    ///   - probing: the configuration's `health.enabled` at start.
    convenience init(policy: HealthPolicy, probing: Bool = true, logger: Logger, onChange: @escaping @Sendable (_ target: SocketAddress, _ up: Bool) -> Void) {
        self.init(policy: policy, probing: probing, logger: logger, icmpKinds: ICMPProbeSocket.Kind.allCases, onChange: onChange)
    }

    init(policy: HealthPolicy, probing: Bool = true, logger: Logger, icmpKinds: [ICMPProbeSocket.Kind], onChange: @escaping @Sendable (_ target: SocketAddress, _ up: Bool) -> Void) {
        probingAtStart = probing
        shared = Mutex(Shared(policy: policy))
        self.logger = logger
        self.onChange = onChange
        self.icmpKinds = icmpKinds
        do {
            (wakeRead, wakeWrite) = try Syscall.pipe(call: "pipe (health checker wake-up)")
        } catch {
            logger.warning("health checker: no wake-up pipe (polling every 100 ms instead)", metadata: ["errno": "\(error.errno)", "error": "\(error)"])
            (wakeRead, wakeWrite) = (-1, -1)
        }
    }

    deinit {
        if wakeRead >= 0 { close(wakeRead) }
        if wakeWrite >= 0 { close(wakeWrite) }
    }

    /// The addresses to probe (a downstream's IP with its health port, or its port). New targets
    /// start up and are probed at once (within a jitter of at most a second); targets no longer
    /// listed are forgotten with their counters. Called on every membership change.
    func setTargets(_ targets: Set<SocketAddress>) {
        let changed = shared.withLock { shared in
            let current = Set(shared.records.keys)
            guard current != targets else { return false }
            for gone in current.subtracting(targets) { shared.records[gone] = nil }
            for new in targets.subtracting(current) { shared.records[new] = Record() }
            shared.targetsVersion += 1
            return true
        }
        if changed { wake() }
    }

    /// A reload's new policy: targets keep their state and counters; in-flight probes of another
    /// protocol are abandoned (not counted) and every target is probed again soon.
    func setPolicy(_ policy: HealthPolicy) {
        let changed = shared.withLock { shared in
            guard shared.policy != policy else { return false }
            shared.policy = policy
            shared.policyVersion += 1
            return true
        }
        if changed { wake() }
    }

    /// Each target's state and since when (seconds since the epoch), for `/status`.
    func states() -> [SocketAddress: (up: Bool, since: Double)] {
        shared.withLock { $0.records.mapValues { ($0.state.isUp, $0.since) } }
    }

    /// The targets that are up and have passed at least one probe (a new target starts up
    /// before its first probe: this set waits for the probe).
    func provenUp() -> Set<SocketAddress> {
        shared.withLock { Set($0.records.filter { $0.value.state.isUp && ($0.value.results[.ok] ?? 0) > 0 }.keys) }
    }

    /// False only for a target that is down; an unknown target is not known to be down.
    func isUp(_ target: SocketAddress) -> Bool {
        shared.withLock { $0.records[target]?.state.isUp ?? true }
    }

    /// Passive health: a send to `target` got ICMP port unreachable (ECONNREFUSED). Counts as one
    /// failed probe (reason `refused`) toward `fall`, applied by the probe thread. Called from
    /// worker threads: takes one short lock and writes one byte to a non-blocking pipe. A report
    /// for an address that is not a target is counted in
    /// `udp_fanout_health_passive_unmatched_total` and otherwise ignored.
    func reportUnreachable(_ target: SocketAddress) {
        let known = shared.withLock { shared in
            guard shared.records[target] != nil else {
                shared.passiveUnmatched += 1
                return false
            }
            shared.records[target]!.passive += 1
            // More than `fall` pending failures change nothing: bounded however many batches fail.
            shared.records[target]!.pendingPassive = min(shared.records[target]!.pendingPassive + 1, shared.policy.fall)
            return true
        }
        if known { wake() }
    }

    /// The checker's counters in the Prometheus text format (appended to /metrics).
    func metricsText() -> String {
        let (records, unmatched) = shared.withLock { ($0.records, $0.passiveUnmatched) }
        let targets = records.keys.sorted { $0.description < $1.description }
        func label(_ target: SocketAddress) -> String { "target=\"\(PrometheusText.escape(target.description))\"" }
        var out = ""
        func header(_ name: String, _ type: String, _ help: String) { out += "# HELP \(name) \(help)\n# TYPE \(name) \(type)\n" }
        header("udp_fanout_health_target_up", "gauge", "1 while a health-checked target is up, 0 while it is down")
        for target in targets { out += "udp_fanout_health_target_up{\(label(target))} \(records[target]!.state.isUp ? 1 : 0)\n" }
        header("udp_fanout_health_probes_total", "counter", "Health probes by target and result (ok, timeout, refused, unreachable, mismatch, error)")
        for target in targets {
            for result in ProbeResult.allCases {
                out += "udp_fanout_health_probes_total{\(label(target)),result=\"\(result.rawValue)\"} \(records[target]!.results[result] ?? 0)\n"
            }
        }
        header("udp_fanout_health_transitions_total", "counter", "Health state changes by target and new state")
        for target in targets {
            out += "udp_fanout_health_transitions_total{\(label(target)),to=\"up\"} \(records[target]!.transitionsUp)\n"
            out += "udp_fanout_health_transitions_total{\(label(target)),to=\"down\"} \(records[target]!.transitionsDown)\n"
        }
        header("udp_fanout_health_probe_duration_seconds", "summary", "Round-trip time of successful health probes")
        for target in targets {
            out += "udp_fanout_health_probe_duration_seconds_sum{\(label(target))} \(records[target]!.durationSum)\n"
            out += "udp_fanout_health_probe_duration_seconds_count{\(label(target))} \(records[target]!.durationCount)\n"
        }
        header("udp_fanout_health_passive_failures_total", "counter", "Sends to a target that got ICMP port unreachable (userspace mode), each counted as a failed probe")
        for target in targets { out += "udp_fanout_health_passive_failures_total{\(label(target))} \(records[target]!.passive)\n" }
        header("udp_fanout_health_passive_unmatched_total", "counter", "Passive reports for an address that is not a health target (ignored)")
        out += "udp_fanout_health_passive_unmatched_total \(unmatched)\n"
        return out
    }

    /// Probes until graceful shutdown or cancellation, on a thread of its own.
    /// - Throws: `HealthError/icmpUnavailable(family:datagram:raw:)` when protocol icmp is in
    ///   force and no ICMP socket can be opened (logged too), `HealthError/probeLoop(_:)` if
    ///   poll fails.
    public func run() async throws {
        try await withTaskCancellationHandler {
            try await withGracefulShutdownHandler {
                let outcome = await offCooperativePool("fanout-health") { Result { () throws(HealthError) in try ProbeLoop(checker: self).run() } }
                if case .failure(let error) = outcome {
                    self.logger.critical("health checker stopped", metadata: ["error": "\(error)"])
                    throw error
                }
            } onGracefulShutdown: {
                self.stop()
            }
        } onCancel: {
            self.stop()
        }
    }

    /// Ends ``run()``: the probe thread sees the flag at its next wake.
    func stop() {
        shared.withLock { $0.stopped = true }
        wake()
    }

    func wake() {
        guard wakeWrite >= 0 else { return }
        var byte: UInt8 = 1
        // Full pipe (EAGAIN): a wake is already pending, which is all that is needed.
        _ = write(wakeWrite, &byte, 1)
    }

    /// Applies one outcome to `target` (if it is still a target) under the lock, then logs and
    /// reports a transition without it.
    func record(_ target: SocketAddress, _ result: ProbeResult, duration: Duration? = nil, passive: Bool = false) {
        let outcome: (HealthState.Transition, Int)? = shared.withLock { shared in
            guard var record = shared.records[target] else { return nil }
            if !passive { record.results[result, default: 0] += 1 }
            if let duration, result == .ok {
                record.durationSum += Double(duration.components.seconds) + Double(duration.components.attoseconds) / 1e18
                record.durationCount += 1
            }
            let transition = record.state.record(success: result == .ok, rise: shared.policy.rise, fall: shared.policy.fall)
            switch transition {
            case .up: record.transitionsUp += 1
            case .down: record.transitionsDown += 1
            case nil: break
            }
            if transition != nil { record.since = WallClock.seconds() }
            shared.records[target] = record
            return transition.map { ($0, $0 == .up ? record.state.consecutiveSuccesses : record.state.consecutiveFailures) }
        }
        if result != .ok {
            logger.debug("health probe failed", metadata: ["target": "\(target)", "reason": "\(result.rawValue)", "passive": "\(passive)"])
        }
        guard let (transition, consecutive) = outcome else { return }
        switch transition {
        case .down:
            logger.warning("downstream marked unhealthy, disabling", metadata: [
                "target": "\(target)", "reason": "\(passive ? "refused (passive)" : result.rawValue)", "consecutive": "\(consecutive)",
            ])
            onChange(target, false)
        case .up:
            logger.info("downstream is healthy", metadata: ["target": "\(target)", "reason": "ok", "consecutive": "\(consecutive)"])
            onChange(target, true)
        }
    }
}
