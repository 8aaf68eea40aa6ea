// SPDX-License-Identifier: Apache-2.0
/// How downstreams are probed: the config's `health:` keys {enabled, protocol: icmp|udp_echo,
/// interval_secs, timeout_secs} plus ours {rise, fall}. The reference's rule is the default: a
/// downstream is out after 3 consecutive failures and back after 1 success.
struct HealthPolicy: Equatable, Sendable {
    /// What a probe is.
    enum ProbeProtocol: String, Sendable, CaseIterable {
        /// ICMP echo (ICMPv6 for IPv6 targets); the target's port is not used.
        case icmp
        /// A UDP datagram with a random payload to the target's address and port; only a reply
        /// echoing exactly that payload is a success.
        case udpEcho = "udp_echo"
    }

    var proto: ProbeProtocol
    /// Time between the starts of two probes of one target.
    var interval: Duration
    /// How long a probe waits for its reply.
    var timeout: Duration
    /// Consecutive successes that bring a down target back up (at least 1).
    var rise: Int
    /// Consecutive failures that take an up target down (at least 1).
    var fall: Int

    init(proto: ProbeProtocol = .icmp, interval: Duration = .seconds(5), timeout: Duration = .seconds(2), rise: Int = 1, fall: Int = 3) {
        self.proto = proto
        self.interval = interval
        self.timeout = timeout
        self.rise = rise
        self.fall = fall
    }
}

/// The outcome of one probe; each is a `result` label value.
enum ProbeResult: String, Sendable, CaseIterable {
    /// The reply came from the target, matching the probe (ICMP: identifier, sequence and
    /// payload; udp_echo: the exact payload).
    case ok
    /// No reply within `timeout`.
    case timeout
    /// ICMP port unreachable (ECONNREFUSED): nothing listens on the target's port. Passive
    /// reports from the forwarding path count under this reason too.
    case refused
    /// No route, or ICMP host/network unreachable (EHOSTUNREACH, ENETUNREACH).
    case unreachable
    /// A reply that is not the probe's: another payload (udp_echo), or the probe's echo from
    /// another address (ICMP).
    case mismatch
    /// The probe could not be sent for another reason (the error is logged).
    case error
}

/// One target's up/down state: down after `fall` consecutive failures, up again after `rise`
/// consecutive successes. A success resets the failure run and a failure the success run, so
/// only consecutive outcomes count. New targets start up (as the reference does).
struct HealthState: Equatable, Sendable {
    enum Transition: String, Sendable {
        case up, down
    }

    private(set) var isUp = true
    private(set) var consecutiveFailures = 0
    private(set) var consecutiveSuccesses = 0

    /// Records one outcome; returns the transition it caused, if any (at most one per call, so
    /// each transition is reported once).
    mutating func record(success: Bool, rise: Int, fall: Int) -> Transition? {
        if success {
            consecutiveFailures = 0
            consecutiveSuccesses += 1
            if !isUp && consecutiveSuccesses >= max(1, rise) {
                isUp = true
                return .up
            }
        } else {
            consecutiveSuccesses = 0
            consecutiveFailures += 1
            if isUp && consecutiveFailures >= max(1, fall) {
                isUp = false
                return .down
            }
        }
        return nil
    }
}
