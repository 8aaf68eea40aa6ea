// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim
import ReusePortLB
import SystemCalls

/// The probe thread of a ``HealthChecker``: one poll(2) over the wake pipe, the ICMP sockets
/// and each udp_echo target's connected socket. Each target has its own schedule and at most
/// one probe in flight; the next starts `interval` after the previous one started (or when it
/// ended, if it took longer). Owned by that one thread: nothing here is shared.
final class ProbeLoop {
    private struct InFlight {
        var sequence: UInt64
        var sentAt: ContinuousClock.Instant
        var deadline: ContinuousClock.Instant
        /// udp_echo: the payload the reply must echo.
        var payload: [UInt8]
    }

    private final class Slot {
        let target: SocketAddress
        var nextProbe: ContinuousClock.Instant
        var inFlight: InFlight?
        /// udp_echo: the socket connected to the target (-1 until the first probe).
        var udp: Int32 = -1
        /// udp_echo: a per-target token heading every payload, so a late echo of an earlier
        /// probe is told apart from a wrong one.
        let token = UInt64.random(in: 1...UInt64.max)

        init(target: SocketAddress, nextProbe: ContinuousClock.Instant) {
            self.target = target
            self.nextProbe = nextProbe
        }

        func closeSocket() {
            if udp >= 0 { close(udp) }
            udp = -1
        }

        deinit { closeSocket() }
    }

    private let checker: HealthChecker
    private let clock = ContinuousClock()
    private var slots: [SocketAddress: Slot] = [:]
    private var policy: HealthPolicy
    private var targetsVersion = -1
    private var policyVersion: Int
    private var icmp: [Int32: ICMPProbeSocket] = [:]
    /// Families whose ICMP socket could not be opened after another one was (see ensureICMPSockets).
    private var icmpUnavailable: [Int32: HealthError] = [:]
    /// ICMP probes in flight, by socket family and 16-bit sequence.
    private var icmpInFlight: [Int32: [UInt16: SocketAddress]] = [:]
    private var sequence: UInt64 = 0

    init(checker: HealthChecker) {
        self.checker = checker
        (policy, policyVersion) = checker.shared.withLock { ($0.policy, $0.policyVersion) }
    }

    func run() throws(HealthError) {
        if checker.probingAtStart {
            checker.logger.info("health checker started", metadata: [
                "protocol": "\(policy.proto.rawValue)", "interval": "\(policy.interval)", "timeout": "\(policy.timeout)",
                "rise": "\(policy.rise)", "fall": "\(policy.fall)",
            ])
        } else {
            checker.logger.info("health checks off (health.enabled: false): no downstream is taken out for not answering")
        }
        while true {
            let (stopped, passive) = syncWithChecker()
            if stopped { break }
            for target in passive { checker.record(target, .refused, passive: true) }
            try ensureICMPSockets()
            let now = clock.now
            for slot in slots.values {
                if let probe = slot.inFlight, probe.deadline <= now {
                    finish(slot, .timeout)
                }
                if slot.inFlight == nil && slot.nextProbe <= now { send(slot, now: now) }
            }
            try wait()
        }
        for slot in slots.values { slot.closeSocket() }
        checker.logger.info("health checker stopped")
    }

    /// Picks up target, policy and stop changes and the passive reports to apply.
    private func syncWithChecker() -> (stopped: Bool, passive: [SocketAddress]) {
        let (stopped, targets, newPolicy, passive) = checker.shared.withLock { shared -> (Bool, Set<SocketAddress>?, (HealthPolicy, Int)?, [SocketAddress]) in
            var passive: [SocketAddress] = []
            for (target, record) in shared.records where record.pendingPassive > 0 {
                passive += Array(repeating: target, count: record.pendingPassive)
                shared.records[target]!.pendingPassive = 0
            }
            let targets = shared.targetsVersion != targetsVersion ? Set(shared.records.keys) : nil
            targetsVersion = shared.targetsVersion
            let policy = shared.policyVersion != policyVersion ? (shared.policy, shared.policyVersion) : nil
            return (shared.stopped, targets, policy, passive)
        }
        let now = clock.now
        if let (newPolicy, version) = newPolicy {
            policyVersion = version
            let protocolChanged = newPolicy.proto != policy.proto
            policy = newPolicy
            for slot in slots.values {
                if protocolChanged {
                    abandon(slot)
                    slot.closeSocket()
                    slot.nextProbe = now + jitter()
                } else {
                    slot.nextProbe = min(slot.nextProbe, now + policy.interval)
                }
            }
            checker.logger.info("health policy changed", metadata: [
                "protocol": "\(policy.proto.rawValue)", "interval": "\(policy.interval)", "timeout": "\(policy.timeout)",
                "rise": "\(policy.rise)", "fall": "\(policy.fall)",
            ])
        }
        if let targets {
            for (target, slot) in slots where !targets.contains(target) {
                abandon(slot)
                slots[target] = nil
            }
            for target in targets where slots[target] == nil {
                slots[target] = Slot(target: target, nextProbe: now + jitter())
            }
        }
        return (stopped, passive)
    }

    /// A new target's first probe: at once, spread over up to a second (or the interval, if
    /// shorter) so a long list does not probe in one burst.
    private func jitter() -> Duration {
        let spread = min(policy.interval, .seconds(1))
        let nanoseconds = spread.components.seconds * 1_000_000_000 + spread.components.attoseconds / 1_000_000_000
        return nanoseconds > 0 ? .nanoseconds(Int64.random(in: 0..<nanoseconds)) : .zero
    }

    /// Opens the ICMP socket of each family a target needs; without one ICMP cannot probe at all.
    private func ensureICMPSockets() throws(HealthError) {
        guard policy.proto == .icmp else {
            icmp.removeAll()
            icmpUnavailable.removeAll()
            icmpInFlight.removeAll()
            return
        }
        // IPv4 first: if it cannot open, the checker stops whatever IPv6 could do.
        for family in Set(slots.keys.map(\.ip.family)).sorted() where icmp[family] == nil && icmpUnavailable[family] == nil {
            let socket: ICMPProbeSocket
            do {
                socket = try ICMPProbeSocket.open(family: family, kinds: checker.icmpKinds)
            } catch {
                // With no ICMP socket at all the checker stops (it never runs without probing).
                // A family that appears later (an IPv6 endpoint discovered where IPv6 ICMP is not
                // allowed) fails loudly instead: its probes count as errors, so its targets go
                // down and /readyz and udp_fanout_downstream_up show it.
                guard !icmp.isEmpty else { throw error }
                icmpUnavailable[family] = error
                checker.logger.critical("ICMP probe socket cannot be opened for this family: its downstreams fail every probe", metadata: ["error": "\(error)"])
                continue
            }
            icmp[family] = socket
            checker.logger.info("ICMP probe socket opened", metadata: [
                "family": "\(family == AF_INET6 ? "IPv6" : "IPv4")", "kind": "\(socket.kind.rawValue)", "identifier": "\(socket.identifier)",
            ])
        }
    }

    private func send(_ slot: Slot, now: ContinuousClock.Instant) {
        sequence &+= 1
        slot.nextProbe = now + policy.interval
        var probe = InFlight(sequence: sequence, sentAt: now, deadline: now + policy.timeout, payload: [])
        switch policy.proto {
        case .icmp:
            let family = slot.target.ip.family
            guard let socket = icmp[family] else {
                slot.inFlight = probe
                finish(slot, .error)
                return
            }
            let short = UInt16(truncatingIfNeeded: sequence)
            do {
                try socket.sendEcho(to: slot.target.ip, sequence: short)
            } catch {
                slot.inFlight = probe
                finish(slot, Self.result(of: error.errno), error: error)
                return
            }
            icmpInFlight[family, default: [:]][short] = slot.target
        case .udpEcho:
            probe.payload = withUnsafeBytes(of: slot.token.bigEndian) { Array($0) } + withUnsafeBytes(of: sequence.bigEndian) { Array($0) }
            do throws(SystemCallError) {
                if slot.udp < 0 { slot.udp = try Self.connectedSocket(to: slot.target) }
                let call = "send(udp_echo probe to \(slot.target))"
                // A full send buffer fails this probe like any other send error.
                if case .wouldBlock = try Syscall.send(slot.udp, probe.payload, probe.payload.count, Socket.dontWait, call: call) {
                    throw SystemCallError(call: call, errno: EAGAIN)
                }
            } catch {
                slot.inFlight = probe
                finish(slot, Self.result(of: error.errno), error: error)
                return
            }
        }
        slot.inFlight = probe
    }

    private static func connectedSocket(to target: SocketAddress) throws(SystemCallError) -> Int32 {
        let fd = try Syscall.socket(target.ip.family, Socket.datagram | Socket.nonBlocking | Socket.closeOnExec, call: "socket(udp_echo)")
        do {
            // Connected, so the kernel delivers only the target's datagrams and reports its ICMP
            // port unreachable as ECONNREFUSED.
            try Syscall.connect(fd, target, call: "connect(udp_echo to \(target))")
        } catch {
            Syscall.close(fd)
            throw error
        }
        return fd
    }

    private static func result(of error: Int32) -> ProbeResult {
        switch error {
        case ECONNREFUSED: return .refused
        // EACCES: a prohibit route (or ICMPv6 administratively prohibited), as forwarding counts it.
        case EHOSTUNREACH, ENETUNREACH, EHOSTDOWN, EACCES: return .unreachable
        default: return .error
        }
    }

    /// Ends the slot's probe with `result` and counts it.
    private func finish(_ slot: Slot, _ result: ProbeResult, error: SystemCallError? = nil) {
        guard let probe = slot.inFlight else { return }
        abandon(slot)
        let now = clock.now
        // A probe that outlasted the interval: the next starts now, not in the past.
        if slot.nextProbe < now { slot.nextProbe = now }
        if let error, result == .error {
            checker.logger.warning("health probe could not be sent", metadata: ["target": "\(slot.target)", "error": "\(error)"])
        }
        checker.record(slot.target, result, duration: result == .ok ? now - probe.sentAt : nil)
    }

    /// Forgets the slot's probe without counting it.
    private func abandon(_ slot: Slot) {
        guard let probe = slot.inFlight else { return }
        slot.inFlight = nil
        if policy.proto == .icmp {
            icmpInFlight[slot.target.ip.family]?[UInt16(truncatingIfNeeded: probe.sequence)] = nil
        }
    }

    /// Polls until a reply, a wake, or the next deadline; handles what arrived.
    private func wait() throws(HealthError) {
        let now = clock.now
        var next = now + .seconds(1)
        for slot in slots.values {
            next = min(next, slot.inFlight?.deadline ?? slot.nextProbe)
        }
        if checker.wakeRead < 0 { next = min(next, now + .milliseconds(100)) }
        let remaining = next - now
        let milliseconds = remaining <= .zero ? 0 : Int32(remaining.components.seconds * 1000 + remaining.components.attoseconds / 1_000_000_000_000_000 + 1)
        var descriptors: [pollfd] = []
        if checker.wakeRead >= 0 { descriptors.append(pollfd(fd: checker.wakeRead, events: Int16(POLLIN), revents: 0)) }
        let families = Array(icmp.keys)
        for family in families { descriptors.append(pollfd(fd: icmp[family]!.fd, events: Int16(POLLIN), revents: 0)) }
        let udpSlots = slots.values.filter { $0.udp >= 0 }
        for slot in udpSlots { descriptors.append(pollfd(fd: slot.udp, events: Int16(POLLIN), revents: 0)) }
        let ready: Int
        do {
            ready = try Syscall.poll(&descriptors, descriptors.count, milliseconds, call: "poll(health probe sockets)")
        } catch {
            throw .probeLoop(error)
        }
        guard ready > 0 else { return }
        var index = 0
        if checker.wakeRead >= 0 {
            if descriptors[0].revents != 0 { drainWake() }
            index = 1
        }
        for family in families {
            if descriptors[index].revents != 0 { readICMP(family) }
            index += 1
        }
        for slot in udpSlots {
            if descriptors[index].revents != 0 { readUDP(slot) }
            index += 1
        }
    }

    private func drainWake() {
        var buffer = [UInt8](repeating: 0, count: 64)
        while read(checker.wakeRead, &buffer, buffer.count) > 0 {}
    }

    private func readICMP(_ family: Int32) {
        guard let socket = icmp[family] else { return }
        for (source, short) in socket.receiveReplies() {
            guard let (target, result) = Self.icmpOutcome(inFlight: icmpInFlight[family] ?? [:], source: source, sequence: short),
                  let slot = slots[target], slot.inFlight != nil else { continue }
            finish(slot, result)
        }
    }

    /// Which waiting probe an echo reply (already matched on identifier and token) answers:
    /// none for a sequence no probe waits for (one that timed out, or never ours); `mismatch`
    /// when the probe's echo comes from another address than its target's.
    static func icmpOutcome(inFlight: [UInt16: SocketAddress], source: IPAddress, sequence: UInt16) -> (SocketAddress, ProbeResult)? {
        guard let target = inFlight[sequence] else { return nil }
        return (target, source == target.ip ? .ok : .mismatch)
    }

    private func readUDP(_ slot: Slot) {
        var buffer = [UInt8](repeating: 0, count: 2048)
        while slot.udp >= 0 {
            let count: Int
            do {
                guard case .processed(let received) = try Syscall.recv(slot.udp, &buffer, buffer.count, Socket.dontWait, call: "recv(udp_echo reply from \(slot.target))") else { return }
                count = received
            } catch {
                // ICMP port/host unreachable for a probe of this socket: an immediate failure.
                if slot.inFlight != nil { finish(slot, Self.result(of: error.errno), error: error) }
                continue
            }
            guard let probe = slot.inFlight else { continue }
            let reply = Array(buffer[0..<count])
            if reply == probe.payload {
                finish(slot, .ok)
            } else if reply.count == 16 && Array(reply[0..<8]) == Array(probe.payload[0..<8])
                        && reply[8..<16].reduce(UInt64(0), { $0 << 8 | UInt64($1) }) < probe.sequence {
                // The late echo of an earlier probe of ours (already counted as a timeout).
                continue
            } else {
                finish(slot, .mismatch)
            }
        }
    }
}
