// SPDX-License-Identifier: Apache-2.0
/// Renders the counters in the Prometheus text format (version 0.0.4), with the reference
/// documents' metric names and our per-downstream and per-reason additions.
enum PrometheusText {
    /// The listeners' families and the reloads'; a kind's own families follow
    /// (``ListenerKinds/metricsText()``).
    static func render(_ listeners: [ListenerCounters], reloads: (ok: UInt64, rejected: UInt64)) -> String {
        var out = ""
        let snapshots = listeners.map { ($0, $0.snapshot()) }
        func family(_ name: String, _ help: String, type: String = "counter", rows: [(String, UInt64)]) {
            out += Self.family(name, help, type: type, rows: rows)
        }
        func perListener(_ value: (ListenerCounters.Snapshot) -> UInt64) -> [(String, UInt64)] {
            snapshots.map { (labels($0.0), value($0.1)) }
        }
        family("udp_fanout_packets_received_total", "Total packets received per listener", rows: perListener(\.received))
        family("udp_fanout_packets_forwarded_total", "Total packets forwarded (one per successfully forwarded packet)", rows: perListener(\.forwarded))
        family("udp_fanout_packets_dropped_total", "Total packets dropped (send failures and packets above max_packet_size)", rows: perListener(\.droppedTotal))
        family("udp_fanout_packets_no_healthy_total", "Total packets dropped due to no ready downstreams", rows: perListener(\.noHealthy))
        family("udp_fanout_bytes_received_total", "Total bytes received", rows: perListener(\.bytesReceived))
        family("udp_fanout_bytes_forwarded_total", "Total bytes forwarded", rows: perListener(\.bytesForwarded))
        family("udp_fanout_packets_dropped_by_reason_total", "Packets dropped, by reason",
               rows: snapshots.flatMap { listener, snapshot in
                   DropReason.allCases.map { (labels(listener) + ",reason=\"\($0.rawValue)\"", snapshot.dropped[$0] ?? 0) }
               })
        family("udp_fanout_receive_queue_drops_total", "Packets the listener sockets dropped before they were read (receive buffer full)",
               rows: perListener(\.receiveQueueDrops))
        let downstreamRows = snapshots.flatMap { listener, snapshot in
            snapshot.downstreams.sorted { $0.key < $1.key }.map { (name, values) in (labels(listener) + ",downstream=\"\(escape(name))\"", values) }
        }
        family("udp_fanout_downstream_packets_forwarded_total", "Packets forwarded per downstream", rows: downstreamRows.map { ($0.0, $0.1.forwarded) })
        family("udp_fanout_downstream_bytes_forwarded_total", "Bytes forwarded per downstream", rows: downstreamRows.map { ($0.0, $0.1.bytes) })
        family("udp_fanout_downstream_packets_dropped_total", "Packets dropped on send per downstream", rows: downstreamRows.map { ($0.0, $0.1.dropped) })
        let downstreamDropRows = snapshots.flatMap { listener, snapshot in
            snapshot.downstreamDropped.sorted { $0.key < $1.key }.flatMap { name, reasons in
                reasons.sorted { $0.key.rawValue < $1.key.rawValue }.map { reason, value in
                    (labels(listener) + ",downstream=\"\(escape(name))\",reason=\"\(reason.rawValue)\"", value)
                }
            }
        }
        if !downstreamDropRows.isEmpty {
            family("udp_fanout_downstream_packets_dropped_by_reason_total", "Packets dropped per downstream, by reason (tc_ebpf: no_route, too_large)",
                   rows: downstreamDropRows)
        }
        let pools = snapshots.flatMap { listener, _ in
            listener.pools.withLock { $0 }.sorted { $0.key < $1.key }.map { (labels(listener) + ",pool=\"\(escape($0.key))\"", $0.value.snapshot()) }
        }
        if !pools.isEmpty {
            family("udp_fanout_pool_datagrams_total", "Datagrams offered to each replication pool (every one its listener received) by outcome: forwarded, dropped, sampled_out (its sample), filtered_out (its sources); the four add up to the listener's received",
                   rows: pools.flatMap { pool, values in
                       [("forwarded", values.forwarded), ("dropped", values.dropped), ("sampled_out", values.sampledOut), ("filtered_out", values.filteredOut)]
                           .map { (pool + ",outcome=\"\($0.0)\"", $0.1) }
                   })
            family("udp_fanout_pool_dropped_total", "Drops of each replication pool by reason: datagrams with no member in rotation (no_healthy) or too large, and copies a send dropped",
                   rows: pools.flatMap { pool, values in
                       PoolPlan.dropReasons.map { (pool + ",reason=\"\($0)\"", values.drops[$0] ?? 0) }
                   })
            let members = pools.flatMap { pool, values in
                values.members.sorted { $0.key < $1.key }.map { (pool + ",downstream=\"\(escape($0.key))\"", $0.value) }
            }
            family("udp_fanout_pool_member_copies_total", "Copies sent to each member of a replication pool", rows: members.map { ($0.0, $0.1[0]) })
            family("udp_fanout_pool_member_bytes_total", "Bytes sent to each member of a replication pool", rows: members.map { ($0.0, $0.1[1]) })
            family("udp_fanout_pool_member_dropped_total", "Copies dropped on send to each member of a replication pool", rows: members.map { ($0.0, $0.1[2]) })
            let memberDropRows = pools.flatMap { pool, values in
                values.memberDrops.sorted { $0.key < $1.key }.flatMap { member, reasons in
                    reasons.sorted { $0.key < $1.key }.map { (pool + ",downstream=\"\(escape(member))\",reason=\"\($0.key)\"", $0.value) }
                }
            }
            if !memberDropRows.isEmpty {
                family("udp_fanout_pool_member_dropped_by_reason_total", "Copies dropped on send to each member of a replication pool, by reason (reasons seen)",
                       rows: memberDropRows)
            }
        }
        let quic = snapshots.filter { !$0.1.quic.isEmpty }
        if !quic.isEmpty {
            family("udp_fanout_quic_lb_datagrams_total", "Datagrams of quic_lb listeners by what their QUIC connection ID said: routed (to the downstream whose server ID it carries), fallback (an Initial or 0-RTT packet with a client-chosen ID: the listener's balancing chose), unknown_server_id (a server ID no downstream has: balancing chose), undecodable (not a QUIC packet of a configured config ID: balancing chose)",
                   rows: quic.flatMap { listener, snapshot in
                       QUICOutcome.allCases.map { (labels(listener) + ",outcome=\"\($0.rawValue)\"", snapshot.quic[$0] ?? 0) }
                   })
        }
        let twoWay = snapshots.compactMap { listener, snapshot in snapshot.twoWay.map { (listener, $0) } }
        if !twoWay.isEmpty {
            family("udp_fanout_replies_total", "Replies of two-way listeners sent on to clients from the listener's address",
                   rows: twoWay.map { (labels($0.0), $0.1.replies) })
            family("udp_fanout_reply_bytes_total", "Bytes of the replies sent on to clients", rows: twoWay.map { (labels($0.0), $0.1.replyBytes) })
            family("udp_fanout_replies_dropped_total", "Replies not sent on to the client, by reason",
                   rows: twoWay.flatMap { listener, values in
                       ReplyDropReason.allCases.map { (labels(listener) + ",reason=\"\($0.rawValue)\"", values.replyDropped[$0] ?? 0) }
                   })
            family("udp_fanout_associations", "Client associations (replies nat) or sessions (replies relay) present now", type: "gauge",
                   rows: twoWay.map { (labels($0.0), $0.1.associations) })
            family("udp_fanout_association_events_total", "Associations or sessions made, moved, forgotten or refused, by event",
                   rows: twoWay.flatMap { listener, values in
                       AssociationEvent.allCases.map { (labels(listener) + ",event=\"\($0.rawValue)\"", values.events[$0] ?? 0) }
                   })
            family("udp_fanout_downstream_replies_total", "Replies sent on per downstream",
                   rows: twoWay.flatMap { listener, values in
                       values.downstreamReplies.sorted { $0.key < $1.key }.map { (labels(listener) + ",downstream=\"\(escape($0.key))\"", $0.value) }
                   })
        }
        let templates = snapshots.compactMap { listener, _ in listener.flowTemplateState.withLock { $0 }.map { $0.metricsRows(labels(listener)) } }
        if !templates.isEmpty {
            family("udp_fanout_flow_templates_total", "NetFlow v9 / IPFIX templates (settings.flow_templates), by event: template_packets seen, templates defined, redefined, withdrawn, template packets copied to the other downstreams and replayed to one that took an exporter over, malformed packets, copies and replays a send dropped, exporters evicted, templates refused",
                   rows: templates.flatMap(\.events))
            family("udp_fanout_flow_template_exporters", "Exporters whose templates are kept", type: "gauge", rows: templates.map(\.exporters))
            family("udp_fanout_flow_templates", "Templates kept, of every exporter", type: "gauge", rows: templates.map(\.templates))
        }
        let spinning = listeners.filter { $0.busyWait.shown.load(ordering: .relaxed) }
        if !spinning.isEmpty {
            family("udp_fanout_busy_wait_total", "Polls of settings.busy_wait_us by outcome: found (something came within the window: a wake-up saved), slept (the window passed empty and the worker slept)",
                   rows: spinning.flatMap { listener in
                       [("found", listener.busyWait.found.load(ordering: .relaxed)), ("slept", listener.busyWait.slept.load(ordering: .relaxed))]
                           .map { (labels(listener) + ",outcome=\"\($0.0)\"", $0.1) }
                   })
            out += "# HELP udp_fanout_busy_wait_seconds_total CPU time the workers spent polling for settings.busy_wait_us (their own, not what they yielded to other threads)\n# TYPE udp_fanout_busy_wait_seconds_total counter\n"
            for listener in spinning {
                out += "udp_fanout_busy_wait_seconds_total{\(labels(listener))} \(Double(listener.busyWait.nanoseconds.load(ordering: .relaxed)) / 1e9)\n"
            }
        }
        let keeping = listeners.filter { $0.clientSocketsShown.load(ordering: .relaxed) }
        if !keeping.isEmpty {
            out += "# HELP udp_fanout_preserve_source_client_sockets UDP sockets bound to clients' addresses and ports that output: preserve_source copies go through (clients whose address is not the host's); the other copies go through the raw socket\n# TYPE udp_fanout_preserve_source_client_sockets gauge\n"
            for listener in keeping {
                out += "udp_fanout_preserve_source_client_sockets{\(labels(listener))} \(listener.clientSockets.load(ordering: .relaxed))\n"
            }
        }
        family("udp_fanout_config_reloads_total", "Configuration reloads by result",
               rows: [("result=\"ok\"", reloads.ok), ("result=\"rejected\"", reloads.rejected)])
        return out
    }

    /// One family: its HELP and TYPE lines, then a sample per row (labels, value).
    static func family(_ name: String, _ help: String, type: String = "counter", rows: [(String, UInt64)]) -> String {
        var out = "# HELP \(name) \(help)\n# TYPE \(name) \(type)\n"
        for (labels, value) in rows { out += "\(name){\(labels)} \(value)\n" }
        return out
    }

    /// Joins several components' exposition texts so each family has one HELP and TYPE and its
    /// samples together (the format forbids a family twice), families in first-seen order.
    static func merge(_ texts: [String]) -> String {
        var order: [String] = []
        var headers: [String: [Substring]] = [:]
        var samples: [String: [Substring]] = [:]
        for text in texts {
            var family = ""
            for line in text.split(separator: "\n") {
                if line.hasPrefix("# HELP ") || line.hasPrefix("# TYPE ") {
                    let name = String(line.dropFirst(7).prefix { $0 != " " })
                    family = name
                    if headers[name] == nil { order.append(name) }
                    if !(headers[name] ?? []).contains(where: { $0.prefix(7) == line.prefix(7) }) { headers[name, default: []].append(line) }
                } else if !line.hasPrefix("#") {
                    if headers[family] == nil && samples[family] == nil { order.append(family) }
                    samples[family, default: []].append(line)
                }
            }
        }
        return order.map { name in (headers[name, default: []] + samples[name, default: []]).map { "\($0)\n" }.joined() }.joined()
    }

    /// `text` with `name="value"` added first to every sample's labels (a component that does
    /// not know which listener it serves).
    static func adding(label name: String, _ value: String, to text: String) -> String {
        let label = "\(name)=\"\(escape(value))\""
        return text.split(separator: "\n", omittingEmptySubsequences: false).map { line -> String in
            guard !line.hasPrefix("#"), !line.isEmpty else { return String(line) }
            if let brace = line.firstIndex(of: "{") {
                let rest = line[line.index(after: brace)...]
                return String(line[...brace]) + label + (rest.hasPrefix("}") ? "" : ",") + rest
            }
            guard let space = line.firstIndex(of: " ") else { return String(line) }
            return "\(line[..<space]){\(label)}\(line[space...])"
        }.joined(separator: "\n")
    }

    static func labels(_ listener: ListenerCounters) -> String {
        "listener=\"\(escape(listener.name))\",mode=\"\(listener.mode)\""
    }

    static func escape(_ text: String) -> String {
        var out = ""
        for character in text {
            switch character {
            case "\\": out += "\\\\"
            case "\"": out += "\\\""
            case "\n": out += "\\n"
            default: out.append(character)
            }
        }
        return out
    }
}
