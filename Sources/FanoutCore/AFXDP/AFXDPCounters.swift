// SPDX-License-Identifier: Apache-2.0
import Synchronization

/// The af_xdp counters of one listener beyond ``ListenerCounters``: the reference's AF_XDP
/// families, each queue's socket statistics (XDP_STATISTICS) and the XDP program's verdicts.
/// Kept across reloads with the listener's name: a restarted socket or program adds its
/// final values to the base, so every family only grows.
final class AFXDPCounters: Sendable {
    let listener: String
    let parseErrors = Atomic<UInt64>(0)
    /// Frames that came without the XDP program's parse in their metadata (the driver has no
    /// metadata area), whose headers the forwarder walked itself.
    let framesWalked = Atomic<UInt64>(0)
    /// xdp_tx datagrams sent as preserve_source, by reason (no_route, other_interface, no_neighbour, rewrite_refused).
    private let fallbacks = Mutex<[String: UInt64]>([:])

    /// Adds a forwarder's xdp_tx fallbacks of one batch (counted locally per datagram, added here
    /// once per batch, and only when there are any).
    func addFallbacks(noRoute: UInt64, otherInterface: UInt64, noNeighbour: UInt64, refused: UInt64) {
        guard noRoute | otherInterface | noNeighbour | refused != 0 else { return }
        fallbacks.withLock { table in
            for (reason, count) in [(NextHopProblem.noRoute.rawValue, noRoute), (NextHopProblem.otherInterface.rawValue, otherInterface),
                                    (NextHopProblem.noNeighbour.rawValue, noNeighbour), ("rewrite_refused", refused)] where count > 0 {
                table[reason, default: 0] += count
            }
        }
    }
    private let state = Mutex<State>(State())

    struct State {
        /// Totals of stopped instances.
        var base = Totals()
        /// Each running instance's live reader, by instance (two run side by side while a
        /// reload starts the new one on another interface or a failed change restarts the old).
        var live: [UInt64: @Sendable () -> Totals] = [:]
    }

    /// What one instance counted: ring events, per-queue socket statistics, program verdicts.
    struct Totals: Sendable {
        var rxRingEmpty: UInt64 = 0
        var fillRingFull: UInt64 = 0
        /// Per queue: rx_dropped, rx_invalid_descs, tx_invalid_descs, rx_ring_full, rx_fill_ring_empty_descs, tx_ring_empty_descs.
        var queues: [UInt32: [String: UInt64]] = [:]
        /// XDP program verdicts by reason label, of the listener's frames.
        var verdicts: [String: UInt64] = [:]
        /// Frames on the interface no listener could be known for (later fragments, other traffic), by reason.
        var unmatched: [String: UInt64] = [:]
        /// Frames each queue's forwarder took off its RX ring.
        var received: [UInt32: UInt64] = [:]

        static func + (a: Totals, b: Totals) -> Totals {
            var sum = a
            sum.rxRingEmpty &+= b.rxRingEmpty
            sum.fillRingFull &+= b.fillRingFull
            for (queue, values) in b.queues { sum.queues[queue] = sum.queues[queue, default: [:]].merging(values, uniquingKeysWith: &+) }
            sum.verdicts.merge(b.verdicts, uniquingKeysWith: &+)
            sum.unmatched.merge(b.unmatched, uniquingKeysWith: &+)
            sum.received.merge(b.received, uniquingKeysWith: &+)
            return sum
        }
    }

    init(listener: String) { self.listener = listener }

    /// Instance `instance`'s counters are read from `source` while it runs.
    func setLive(_ instance: UInt64, _ source: @escaping @Sendable () -> Totals) {
        state.withLock { $0.live[instance] = source }
    }

    /// A previous process's socket of `queue`, read out: the kernel's events on it (XDP_STATISTICS)
    /// join the base.
    func addReadOut(queue: UInt32, _ kinds: [String: UInt64]) {
        var totals = Totals()
        totals.queues[queue] = kinds
        state.withLock { $0.base = $0.base + totals }
    }

    /// Instance `instance` stops: its last values join the base.
    func retire(_ instance: UInt64) {
        state.withLock { state in
            if let live = state.live.removeValue(forKey: instance) { state.base = state.base + live() }
        }
    }

    var totals: Totals {
        state.withLock { state in state.live.values.reduce(state.base) { $0 + $1() } }
    }

    /// The af_xdp families in the Prometheus text format.
    func metricsText(mode: String) -> String {
        let totals = totals
        let labels = "listener=\"\(PrometheusText.escape(listener))\",mode=\"\(mode)\""
        var out = ""
        func family(_ name: String, _ help: String, _ rows: [(String, UInt64)]) {
            out += "# HELP \(name) \(help)\n# TYPE \(name) counter\n"
            for (extra, value) in rows { out += "\(name){\(labels)\(extra)} \(value)\n" }
        }
        family("udp_fanout_afxdp_rx_ring_empty_total", "Receive calls that found the AF_XDP RX ring empty", [("", totals.rxRingEmpty)])
        family("udp_fanout_afxdp_fill_ring_full_total", "Frames that could not go back to the fill ring at once (kept on a free list, not lost)", [("", totals.fillRingFull)])
        family("udp_fanout_afxdp_frames_parsed_in_userspace_total", "Frames from the RX ring without the XDP program's parse in their metadata (a driver with no metadata area), whose headers the forwarder parsed itself (more CPU per datagram)", [("", framesWalked.load(ordering: .relaxed))])
        family("udp_fanout_afxdp_parse_errors_total", "Frames from the RX ring whose Ethernet/IP/UDP headers did not parse (dropped)", [("", parseErrors.load(ordering: .relaxed))])
        family("udp_fanout_afxdp_queue_frames_total", "Frames each RX queue's forwarder took off its AF_XDP socket",
               totals.received.sorted { $0.key < $1.key }.map { (",queue=\"\($0.key)\"", $0.value) })
        let statistics = ["rx_dropped", "rx_invalid_descs", "tx_invalid_descs", "rx_ring_full", "rx_fill_ring_empty_descs", "tx_ring_empty_descs", "tx_kick_failures"]
        family("udp_fanout_afxdp_socket_events_total", "AF_XDP socket statistics per queue (XDP_STATISTICS), by kind, and TX kicks that failed",
               totals.queues.sorted { $0.key < $1.key }.flatMap { queue, values in
                   statistics.map { (",queue=\"\(queue)\",kind=\"\($0)\"", values[$0] ?? 0) }
               })
        family("udp_fanout_xdp_verdicts_total", "What the XDP program did with each frame on the interface, by reason",
               totals.verdicts.sorted { $0.key < $1.key }.map { (",reason=\"\($0.key)\"", $0.value) })
        family("udp_fanout_xdp_unmatched_frames_total", "Frames on the listener's interface that the XDP program passed to the kernel without knowing a listener (later fragments, whose UDP header is in the first; ARP, TCP, other ports), by reason",
               totals.unmatched.sorted { $0.key < $1.key }.map { (",reason=\"\($0.key)\"", $0.value) })
        family("udp_fanout_afxdp_xdp_tx_fallback_total", "xdp_tx datagrams sent as preserve_source instead, by reason",
               fallbacks.withLock { $0 }.sorted { $0.key < $1.key }.map { (",reason=\"\($0.key)\"", $0.value) })
        return out
    }
}
