// SPDX-License-Identifier: Apache-2.0
/// `udp-fanout status`: the rates between two ``StatusReport``s, and the screen it prints.
package enum StatusView {
    /// `current` with the per-second rates since `previous` filled in (listeners and downstreams
    /// matched by name; a counter that went back, as after a restart, gets no rate).
    package static func rates(from previous: StatusReport, to current: StatusReport) -> StatusReport {
        var report = current
        let seconds = current.monotonic - previous.monotonic
        guard seconds > 0, previous.pid == current.pid, previous.startedAt == current.startedAt else { return report }
        report.intervalSeconds = seconds
        func rate(_ now: UInt64?, _ before: UInt64?) -> Double? {
            guard let now, let before, now >= before else { return nil }
            return Double(now - before) / seconds
        }
        func byReason(_ now: [String: UInt64]?, _ before: [String: UInt64]?) -> [String: Double]? {
            guard let now else { return nil }
            return now.reduce(into: [:]) { out, entry in out[entry.key] = rate(entry.value, before?[entry.key] ?? 0) }
        }
        func downstreams(_ now: [DownstreamStatus], _ before: [DownstreamStatus]) -> [DownstreamStatus] {
            now.map { downstream in
                var downstream = downstream
                guard let old = before.first(where: { $0.name == downstream.name }) else { return downstream }
                var rates = Rates()
                rates.forwarded = rate(downstream.forwarded, old.forwarded)
                rates.bytesForwarded = rate(downstream.bytes, old.bytes)
                rates.dropped = rate(downstream.dropped, old.dropped)
                rates.replies = rate(downstream.replySent, old.replySent)
                downstream.rates = rates
                return downstream
            }
        }
        for index in report.listeners.indices {
            let listener = report.listeners[index]
            guard let old = previous.listeners.first(where: { $0.name == listener.name }) else { continue }
            var rates = Rates()
            rates.received = rate(listener.received, old.received)
            rates.bytesReceived = rate(listener.bytesReceived, old.bytesReceived)
            rates.forwarded = rate(listener.forwarded, old.forwarded)
            rates.bytesForwarded = rate(listener.bytesForwarded, old.bytesForwarded)
            rates.dropped = rate(listener.dropped.values.reduce(0, +), old.dropped.values.reduce(0, +))
            rates.noHealthy = rate(listener.noHealthy, old.noHealthy)
            rates.receiveQueueDrops = rate(listener.receiveQueueDrops, old.receiveQueueDrops)
            rates.replies = rate(listener.replySent, old.replySent)
            rates.droppedByReason = byReason(listener.dropped, old.dropped)
            report.listeners[index].rates = rates
            report.listeners[index].downstreams = downstreams(listener.downstreams, old.downstreams)
            for pool in report.listeners[index].pools.indices {
                let name = report.listeners[index].pools[pool].name
                let before = old.pools.first { $0.name == name }?.members ?? []
                report.listeners[index].pools[pool].members = downstreams(report.listeners[index].pools[pool].members, before)
            }
        }
        return report
    }

    /// The screen: a header line for the daemon, then per listener its rates, drops by reason
    /// and a table of its downstreams. Rates come from ``rates(from:to:)``; `-` where there are none.
    package static func render(_ report: StatusReport, endpoint: String) -> String {
        var lines: [String] = []
        let state = report.ready ? "ready" : "NOT READY"
        lines.append(
            "udp-fanout \(report.version) at \(endpoint)  pid \(report.pid)  up \(duration(report.time - report.startedAt))  \(state)"
                + "  reloads \(report.reloads.ok) ok, \(report.reloads.rejected) rejected  \(clock(report.time))")
        for reason in report.notReady { lines.append("  not ready: \(reason)") }
        for problem in report.problems { lines.append("  UNHEALTHY: \(problem)") }
        lines.append(report.healthProtocol.map { "health: \($0) probes every \(report.healthIntervalSecs ?? 0) s" } ?? "health: off")
        if let takeover = report.takeover {
            let from = takeover.previousPid.map { "pid \($0)\(takeover.previousVersion.map { ", version \($0)" } ?? "")" } ?? "a process that left no record"
            let how = switch takeover.previousStoppedCleanly {
            case true?: ", which began a clean stop"
            case false?: ", which ended without a stop (crash); its data path ran unattended \(((takeover.unattendedSeconds ?? 0) * 10).rounded() / 10) s"
            case nil: ""
            }
            lines.append("took over from \(from)\(how)")
            for note in takeover.notes { lines.append("  \(note)") }
        }
        if let announce = report.announce {
            lines.append("announce: table \(announce.table) protocol \(announce.protocolNumber), drain \(announce.drainSecs) s\(announce.draining ? "  DRAINING" : "")")
            for address in announce.addresses {
                let state = address.announced ? "announced" : "WITHDRAWN"
                let age = address.since > 0 ? " for \(duration(report.time - address.since))" : ""
                lines.append("  \(address.address)  \(state)\(age)\(address.reason.map { ": \($0)" } ?? "")")
            }
        }
        for listener in report.listeners {
            lines.append("")
            let twoWay = listener.replies == "none" ? "" : "  replies \(listener.replies)"
            lines.append("LISTENER \(listener.name)  \(listener.mode)  \(listener.bind)  \(listener.balancing)\(twoWay)" + (listener.running ? "" : "  NOT RUNNING"))
            let rates = listener.rates
            lines.append(
                "  in  \(count(rates?.received)) dgram/s  \(bytes(rates?.bytesReceived))/s"
                    + "   out \(count(rates?.forwarded)) dgram/s  \(bytes(rates?.bytesForwarded))/s"
                    + "   dropped \(count(rates?.dropped))/s   no healthy \(count(rates?.noHealthy))/s   queue drops \(count(rates?.receiveQueueDrops))/s")
            lines.append(
                "  total in \(grouped(listener.received)) (\(grouped(listener.bytesReceived)) B), out \(grouped(listener.forwarded)) (\(grouped(listener.bytesForwarded)) B), receive queue drops \(grouped(listener.receiveQueueDrops))")
            if !listener.dropped.isEmpty {
                let reasons = listener.dropped.sorted { $0.key < $1.key }.map { reason, total in
                    "\(reason) \(count(rates?.droppedByReason?[reason]))/s (\(grouped(total)) total)"
                }
                lines.append("  drops: " + reasons.joined(separator: ", "))
            }
            if listener.replies != "none" {
                let noun = listener.replies == "relay" ? "sessions" : "associations"
                var line = "  \(noun) \(grouped(listener.associations ?? 0))   replies \(count(rates?.replies))/s (\(grouped(listener.replySent ?? 0)) total)"
                if let dropped = listener.repliesDropped, !dropped.isEmpty {
                    line += "   replies dropped: " + dropped.sorted { $0.key < $1.key }.map { "\($0.key) \($0.value)" }.joined(separator: ", ")
                }
                lines.append(line)
            }
            if let cap = listener.amplification { lines.append("  amplification: \(cap)") }
            if let limit = listener.rateLimit {
                lines.append("  rate_limit \(limit.limit)" + (limit.evicted.map { "   evicted \(grouped($0))" } ?? ""))
                if !limit.topLimited.isEmpty {
                    lines.append("  most limited: " + limit.topLimited.map { "\($0.prefix) \(grouped($0.limited))" }.joined(separator: ", "))
                }
            }
            lines += table(listener.downstreams, twoWay: listener.replies != "none", now: report.time, indent: "  ")
            for pool in listener.pools {
                let outcomes = pool.datagrams.sorted { $0.key < $1.key }.map { "\($0.key) \($0.value)" }.joined(separator: ", ")
                lines.append("  POOL \(pool.name)  \(pool.balancing)  \(outcomes)")
                lines += table(pool.members, twoWay: false, now: report.time, indent: "    ")
            }
        }
        return lines.joined(separator: "\n") + "\n"
    }

    private static func table(_ downstreams: [DownstreamStatus], twoWay: Bool, now: Double, indent: String) -> [String] {
        guard !downstreams.isEmpty else { return ["\(indent)(no downstream)"] }
        var rows = [["DOWNSTREAM", "ADDRESS", "SOURCE", "STATE", "OUT/s", "BYTES/s", "DROPS/s", "DROPPED"] + (twoWay ? ["REPLIES/s"] : [])]
        for downstream in downstreams {
            var state = downstream.inRotation ? "in" : "out"
            if let health = downstream.health {
                state = health + (downstream.healthSince.map { " " + duration(now - $0) } ?? "")
                if health == "up" && !downstream.inRotation { state += " (out)" }
            } else if downstream.weight == 0 {
                state = "weight 0"
            }
            rows.append(
                [downstream.name, downstream.address, downstream.source, state,
                 count(downstream.rates?.forwarded), bytes(downstream.rates?.bytesForwarded), count(downstream.rates?.dropped), grouped(downstream.dropped)]
                    + (twoWay ? [count(downstream.rates?.replies)] : []))
        }
        let widths = rows[0].indices.map { column in rows.map { $0[column].count }.max() ?? 0 }
        return rows.map { row in
            indent + row.enumerated().map { column, cell in
                // Names and words left, numbers right.
                let pad = String(repeating: " ", count: widths[column] - cell.count)
                return column < 4 ? cell + pad : pad + cell
            }.joined(separator: "  ")
        }
    }

    /// 12, 1.2k, 3.4M; `-` for none.
    static func count(_ value: Double?) -> String {
        guard let value else { return "-" }
        if value < 1000 { return value < 10 && value != value.rounded() ? one(value) : "\(Int(value.rounded()))" }
        if value < 1_000_000 { return one(value / 1000) + "k" }
        return one(value / 1_000_000) + "M"
    }

    /// 1,234,567.
    static func grouped(_ value: UInt64) -> String {
        let digits = Array(String(value))
        return String(digits.enumerated().flatMap { index, digit in
            index > 0 && (digits.count - index) % 3 == 0 ? [",", digit] : [digit]
        })
    }

    /// 512 B, 1.5 kB, 2.0 MB, 1.1 GB; `-` for none.
    static func bytes(_ value: Double?) -> String {
        guard let value else { return "-" }
        if value < 1000 { return "\(Int(value.rounded())) B" }
        if value < 1_000_000 { return one(value / 1000) + " kB" }
        if value < 1_000_000_000 { return one(value / 1_000_000) + " MB" }
        return one(value / 1_000_000_000) + " GB"
    }

    /// One decimal.
    private static func one(_ value: Double) -> String {
        let tenths = Int((value * 10).rounded())
        return "\(tenths / 10).\(tenths % 10)"
    }

    /// 45s, 12m03s, 5h02m, 3d04h.
    static func duration(_ seconds: Double) -> String {
        let total = max(0, Int(seconds))
        func two(_ value: Int) -> String { value < 10 ? "0\(value)" : "\(value)" }
        switch total {
        case ..<60: return "\(total)s"
        case ..<3600: return "\(total / 60)m\(two(total % 60))s"
        case ..<86400: return "\(total / 3600)h\(two(total % 3600 / 60))m"
        default: return "\(total / 86400)d\(two(total % 86400 / 3600))h"
        }
    }

    /// The report's time of day, UTC (HH:MM:SS).
    private static func clock(_ time: Double) -> String {
        let seconds = Int(time) % 86400
        func two(_ value: Int) -> String { value < 10 ? "0\(value)" : "\(value)" }
        return "\(two(seconds / 3600)):\(two(seconds % 3600 / 60)):\(two(seconds % 60)) UTC"
    }
}
