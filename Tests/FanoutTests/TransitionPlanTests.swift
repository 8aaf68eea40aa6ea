// SPDX-License-Identifier: Apache-2.0
import Logging
import Testing
@testable import FanoutCore

/// The reload's plan (``TransitionPlan``), table by table, without a socket: what a change of
/// configuration starts, stops first, releases, activates, updates in place, retires or hands
/// over, and how each phase rolls back, from the old and new configurations and the kinds'
/// policies. (The reload matrix runs the same plans on running listeners.)
@Suite("reload transition plan")
struct TransitionPlanTests {
    /// One case: the configurations, what runs (nil: every listener of `old`), the listeners
    /// whose available set changed, and the plan, one line per phase (``render(_:)``).
    struct Row: CustomTestStringConvertible, Sendable {
        let name: String
        let old: [String]
        let new: [String]
        var running: Set<String>? = nil
        var resized: Set<String> = []
        var oldHead = ""
        var newHead = ""
        let plan: [String]
        var testDescription: String { name }
    }

    /// One listener's YAML item.
    static func item(_ name: String, _ port: Int, mode: String = "userspace", interface: String? = nil, address: String = "198.18.0.1",
                     replies: String? = nil, settings: String? = nil, downstream: Int = 9000) -> String {
        var yaml = "  - name: \(name)\n    bind: \"\(address):\(port)\"\n    mode: \(mode)\n"
        if let interface { yaml += "    interface: \(interface)\n" }
        if let replies { yaml += "    replies: \(replies)\n" }
        if let settings { yaml += "    settings: {\(settings)}\n" }
        return yaml + "    downstream: [{name: d, address: \"198.18.1.2:\(downstream)\"}]\n"
    }

    static func relay(_ name: String, _ port: Int, address: String = "198.18.0.1", workers: Int = 1) -> String {
        item(name, port, address: address, replies: "relay", settings: "workers: \(workers)")
    }

    static func tc(_ name: String, _ port: Int, _ interface: String = "eth0", attach: String = "tcx", extra: String = "") -> String {
        item(name, port, mode: "tc_ebpf", interface: interface, settings: "tc_attach: \(attach)\(extra)")
    }

    static func xdp(_ name: String, _ port: Int, _ interface: String = "eth0", attach: String = "tcx", xdpMode: String = "native") -> String {
        item(name, port, mode: "xdp", interface: interface, settings: "tc_attach: \(attach), xdp_mode: \(xdpMode)")
    }

    static func afXDP(_ name: String, _ port: Int, _ interface: String = "eth0", queues: Int = 1) -> String {
        item(name, port, mode: "af_xdp", interface: interface, settings: "queues: \(queues)")
    }

    static let rows: [Row] = [
        Row(name: "unchanged: kept, nothing to undo", old: [item("a", 7000)], new: [item("a", 7000)],
            plan: ["keep: a"]),
        Row(name: "downstreams changed only: updated in place", old: [item("a", 7000)], new: [item("a", 7000, downstream: 9001)],
            plan: ["update: a"]),
        Row(name: "only the available set changed (health, discovery): updated in place", old: [item("a", 7000)], new: [item("a", 7000)], resized: ["a"],
            plan: ["update: a"]),
        Row(name: "userspace settings changed: started beside the old one, which stops after", old: [item("a", 7000, settings: "workers: 1")], new: [item("a", 7000, settings: "workers: 2")],
            plan: ["start: a", "activate: a (predecessor on its bind)", "retire: a (seals)",
                   "undo before making way: take back a", "undo after making way: take back a"]),
        Row(name: "settings and available set changed: restarted, not updated", old: [item("a", 7000, settings: "workers: 1")], new: [item("a", 7000, settings: "workers: 2", downstream: 9001)], resized: ["a"],
            plan: ["start: a", "activate: a (predecessor on its bind)", "retire: a (seals)",
                   "undo before making way: take back a", "undo after making way: take back a"]),
        Row(name: "tc_ebpf settings changed (not tc_attach): its successor writes its entry over the old one's", old: [tc("a", 7000, extra: ", max_associations: 1000")], new: [tc("a", 7000, extra: ", max_associations: 2000")],
            plan: ["start: a", "activate: a", "retire: a",
                   "undo before making way: take back a (lost if refused)", "undo after making way: take back a (lost if refused)"]),
        Row(name: "tc_ebpf tc_attach changed: stopped first, started after, started again in a rollback", old: [tc("a", 7000, attach: "tcx")], new: [tc("a", 7000, attach: "clsact")],
            plan: ["stop first: a on eth0 (tc_attach changes)", "start after: a", "activate: a",
                   "undo before making way: take back a (lost if refused)", "undo after making way: restart stopped a"]),
        Row(name: "tc_attach changed on one interface: every tc_ebpf listener there stops first, one elsewhere is kept, a userspace one starts beside",
            old: [tc("a", 7000, attach: "tcx"), tc("b", 7001, attach: "tcx"), tc("c", 7002, "eth1"), item("d", 7003, settings: "workers: 1")],
            new: [tc("a", 7000, attach: "clsact"), tc("b", 7001, attach: "clsact"), tc("c", 7002, "eth1"), item("d", 7003, settings: "workers: 2")],
            plan: ["keep: c", "start: d", "stop first: a on eth0 (tc_attach changes), b on eth0 (tc_attach changes)", "start after: a, b",
                   "activate: a, b, d (predecessor on its bind)", "retire: d (seals)",
                   "undo before making way: take back a (lost if refused), b (lost if refused), d", "undo after making way: take back d; restart stopped a, b"]),
        Row(name: "xdp xdp_mode changed: stopped first", old: [xdp("a", 7000, xdpMode: "native")], new: [xdp("a", 7000, xdpMode: "generic")],
            plan: ["stop first: a on eth0 (tc_attach or xdp_mode changes)", "start after: a", "activate: a",
                   "undo before making way: take back a (lost if refused)", "undo after making way: restart stopped a"]),
        Row(name: "tc_attach changed where xdp and tc_ebpf share the interface: both stop first, each waits for its own kind",
            old: [xdp("x", 7000), tc("t", 7001)], new: [xdp("x", 7000, attach: "clsact"), tc("t", 7001, attach: "clsact")],
            plan: ["stop first: x on eth0 (tc_attach or xdp_mode changes), t on eth0 (tc_attach changes)", "start after: x, t", "activate: x, t",
                   "undo before making way: take back x (lost if refused), t (lost if refused)", "undo after making way: restart stopped x, t"]),
        Row(name: "xdp_mode changed beside a new tc_ebpf listener on that interface: only the xdp one waits for the stop (another kind)",
            old: [xdp("x", 7000, xdpMode: "native")], new: [xdp("x", 7000, xdpMode: "generic"), tc("t", 7001)],
            plan: ["start: t", "stop first: x on eth0 (tc_attach or xdp_mode changes)", "start after: x", "activate: x, t",
                   "undo before making way: take back x (lost if refused)", "undo after making way: restart stopped x"]),
        Row(name: "af_xdp released on an interface where a new tc_ebpf listener starts: that one starts beside", old: [afXDP("a", 7000, queues: 1)], new: [afXDP("a", 7000, queues: 2), tc("t", 7001)],
            plan: ["start: t", "release: a", "start after: a", "activate: a (predecessor on its bind), t", "retire: a (seals)",
                   "undo before making way: take back a", "undo after making way: take back a; restart released a"]),
        Row(name: "mode userspace to tc_ebpf on the same bind: beside, the old socket group is a predecessor", old: [item("a", 7000)], new: [tc("a", 7000)],
            plan: ["start: a", "activate: a (predecessor on its bind)", "retire: a",
                   "undo before making way: take back a", "undo after making way: take back a"]),
        Row(name: "mode tc_ebpf to xdp: beside (another kind's entry), no socket group on the bind", old: [tc("a", 7000)], new: [xdp("a", 7000)],
            plan: ["start: a", "activate: a", "retire: a",
                   "undo before making way: take back a (lost if refused)", "undo after making way: take back a (lost if refused)"]),
        Row(name: "af_xdp settings changed: the old one releases its interface first, the new one waits for it", old: [afXDP("a", 7000, queues: 1)], new: [afXDP("a", 7000, queues: 2)],
            plan: ["release: a", "start after: a", "activate: a (predecessor on its bind)", "retire: a (seals)",
                   "undo before making way: take back a", "undo after making way: take back a; restart released a"]),
        Row(name: "af_xdp moved to another interface: nothing to release, beside", old: [afXDP("a", 7000, "eth0")], new: [afXDP("a", 7000, "eth1")],
            plan: ["start: a", "activate: a (predecessor on its bind)", "retire: a (seals)",
                   "undo before making way: take back a", "undo after making way: take back a"]),
        Row(name: "af_xdp renamed on its interface: the old name releases it and is removed after", old: [afXDP("a", 7000)], new: [afXDP("b", 7000)],
            plan: ["release: a", "start after: b", "activate: b (predecessor on its bind)", "retire: a (removed, seals)",
                   "undo before making way: take back a", "undo after making way: take back a; restart released a"]),
        Row(name: "listener added: started, nothing retires", old: [item("a", 7000)], new: [item("a", 7000), item("b", 7001)],
            plan: ["keep: a", "start: b", "activate: b"]),
        Row(name: "listener removed: stopped after the change, taken back in a rollback", old: [item("a", 7000), item("b", 7001)], new: [item("a", 7000)],
            plan: ["keep: a", "retire: b (removed)", "undo before making way: take back b", "undo after making way: take back b"]),
        Row(name: "listener renamed: the new name starts beside the old one's group", old: [item("a", 7000)], new: [item("b", 7000)],
            plan: ["start: b", "activate: b (predecessor on its bind)", "retire: a (removed, seals)",
                   "undo before making way: take back a", "undo after making way: take back a"]),
        Row(name: "bind changed: no predecessor on the new bind", old: [item("a", 7000)], new: [item("a", 7001)],
            plan: ["start: a", "activate: a", "retire: a", "undo before making way: take back a", "undo after making way: take back a"]),
        Row(name: "bind moved to another listener: its new owner has the predecessor", old: [item("a", 7000)], new: [item("a", 7001), item("b", 7000)],
            plan: ["start: a, b", "activate: a, b (predecessor on its bind)", "retire: a (seals)",
                   "undo before making way: take back a", "undo after making way: take back a"]),
        Row(name: "relay settings changed: handed over to its successor on the bind, to drain", old: [relay("r", 7000, workers: 1)], new: [relay("r", 7000, workers: 2)],
            plan: ["start: r", "activate: r (predecessor on its bind)", "retire: r (hand over to r, seals)",
                   "undo before making way: take back r", "undo after making way: take back r"]),
        Row(name: "relay renamed on its bind: handed over to the new name", old: [relay("r", 7000)], new: [relay("s", 7000)],
            plan: ["start: s", "activate: s (predecessor on its bind)", "retire: r (removed, hand over to s, seals)",
                   "undo before making way: take back r", "undo after making way: take back r"]),
        Row(name: "relay moved to another bind: nobody to hand over to", old: [relay("r", 7000)], new: [relay("r", 7001)],
            plan: ["start: r", "activate: r", "retire: r", "undo before making way: take back r", "undo after making way: take back r"]),
        Row(name: "relay replaced by a one-way userspace listener: stopped (that kind does not drain)", old: [relay("r", 7000)], new: [item("r", 7000)],
            plan: ["start: r", "activate: r (predecessor on its bind)", "retire: r (seals)", "undo before making way: take back r", "undo after making way: take back r"]),
        Row(name: "relay moved to the wildcard of its port: another kernel group, so no handover, but a predecessor", old: [relay("r", 7000)], new: [relay("r", 7000, address: "0.0.0.0")],
            plan: ["start: r", "activate: r (predecessor on its bind)", "retire: r", "undo before making way: take back r", "undo after making way: take back r"]),
        Row(name: "userspace moved to the wildcard of its port: another kernel group, so its workers do not seal first", old: [item("a", 7000)], new: [item("a", 7000, address: "0.0.0.0")],
            plan: ["start: a", "activate: a (predecessor on its bind)", "retire: a", "undo before making way: take back a", "undo after making way: take back a"]),
        Row(name: "one-way userspace replaced by relay on its bind: the old workers seal first (relay receives there)", old: [item("a", 7000)], new: [relay("a", 7000)],
            plan: ["start: a", "activate: a (predecessor on its bind)", "retire: a (seals)", "undo before making way: take back a", "undo after making way: take back a"]),
        Row(name: "metrics section changed only: listeners kept", old: [item("a", 7000)], new: [item("a", 7000)],
            oldHead: "metrics:\n  bind: \"127.0.0.1:9090\"\n", newHead: "metrics:\n  bind: \"127.0.0.1:9091\"\n  path: /m\n",
            plan: ["keep: a"]),
        Row(name: "a lost listener starts again even unchanged", old: [item("a", 7000), item("b", 7001)], new: [item("a", 7000), item("b", 7001)], running: ["a"],
            plan: ["keep: a", "start: b", "activate: b (predecessor on its bind)", "retire: b (seals)",
                   "undo before making way: take back b", "undo after making way: take back b"]),
        Row(name: "a lost listener with new downstreams starts again, not updated in place", old: [item("a", 7000), item("b", 7001)], new: [item("a", 7000, downstream: 9001), item("b", 7001, downstream: 9001)], running: ["a"],
            plan: ["update: a", "start: b", "activate: b (predecessor on its bind)", "retire: b (seals)",
                   "undo before making way: take back b", "undo after making way: take back b"]),
        Row(name: "the daemon's start: every listener starts, nothing to take back", old: [], new: [item("u", 7000), tc("t", 7001), afXDP("x", 7002)],
            plan: ["start: u, t, x", "activate: u, t, x"]),
        Row(name: "several listeners at once, with every policy",
            old: [item("u", 7000, settings: "workers: 1"), tc("t", 7100), afXDP("x", 7200, "eth1", queues: 1), relay("r", 7300, workers: 1),
                  item("k", 7400), item("d", 7500), item("gone", 7600)],
            new: [item("u", 7000, settings: "workers: 2"), tc("t", 7100, attach: "clsact"), afXDP("x", 7200, "eth1", queues: 2), relay("r", 7300, workers: 2),
                  item("k", 7400), item("d", 7500, downstream: 9001), item("n", 7700)],
            plan: ["keep: k", "update: d", "start: u, r, n", "stop first: t on eth0 (tc_attach changes)", "release: x", "start after: t, x",
                   "activate: u (predecessor on its bind), t, x (predecessor on its bind), r (predecessor on its bind), n",
                   "retire: u (seals), x (seals), r (hand over to r, seals), gone (removed)",
                   "undo before making way: take back u, t (lost if refused), x, r, gone",
                   "undo after making way: take back u, x, r, gone; restart released x; restart stopped t"]),
    ]

    /// The plan, one line per phase that does something (what the rows state).
    static func render(_ plan: TransitionPlan) -> [String] {
        var lines: [String] = []
        func add(_ label: String, _ items: [String]) {
            if !items.isEmpty { lines.append("\(label): \(items.joined(separator: ", "))") }
        }
        add("keep", plan.kept)
        add("update", plan.inPlace)
        add("start", plan.startBeside)
        // The kind's warning up to its first colon: what changes.
        add("stop first", plan.stopFirst.map { "\($0.name) on \($0.interface) (\($0.warning.description.prefix { $0 != ":" }))" })
        add("release", plan.release)
        add("start after", plan.startAfter)
        add("activate", plan.activate.map { $0.predecessorOnBind ? "\($0.name) (predecessor on its bind)" : $0.name })
        add("retire", plan.retire.map { retirement in
            let notes = (retirement.removed ? ["removed"] : []) + (retirement.successors.isEmpty ? [] : ["hand over to \(retirement.successors.joined(separator: " or "))"])
                + (retirement.receiverOnBind ? ["seals"] : [])
            return notes.isEmpty ? retirement.name : "\(retirement.name) (\(notes.joined(separator: ", ")))"
        })
        for (label, rollback) in [("undo before making way", plan.rollbackBeforeMakingWay), ("undo after making way", plan.rollbackAfterMakingWay)] {
            var parts: [String] = []
            if !rollback.takeBack.isEmpty {
                parts.append("take back " + rollback.takeBack.map { $0.stopIfRefused ? "\($0.name) (lost if refused)" : $0.name }.joined(separator: ", "))
            }
            if !rollback.restartReleased.isEmpty { parts.append("restart released " + rollback.restartReleased.joined(separator: ", ")) }
            if !rollback.restartStopped.isEmpty { parts.append("restart stopped " + rollback.restartStopped.joined(separator: ", ")) }
            if !parts.isEmpty { lines.append("\(label): \(parts.joined(separator: "; "))") }
        }
        return lines
    }

    static func config(_ head: String, _ listeners: [String]) throws -> FanoutConfig {
        // No listener: the configuration the daemon's start moves from.
        listeners.isEmpty ? FanoutConfig(listeners: []) : try ConfigParser.parse(head + "listeners:\n" + listeners.joined())
    }

    @Test("The plan of a change, from the configurations and the kinds' policies alone", arguments: rows)
    func plan(_ row: Row) throws {
        let old = try Self.config(row.oldHead, row.old)
        let new = try Self.config(row.newHead, row.new)
        let kinds = ListenerKinds(logger: Logger(label: "transition-plan"))
        let plan = TransitionPlan.make(old: old, new: new, running: row.running ?? Set(old.listeners.map(\.name)), resized: row.resized, kinds: kinds)
        #expect(Self.render(plan) == row.plan)
        // Every old listener not kept or updated leaves the running set (the executor's commit).
        #expect(Set(plan.retiring) == Set(old.listeners.map(\.name)).subtracting(plan.kept + plan.inPlace))
    }

    @Test("The stop-first warning is the kind's own, logged as it says")
    func stopFirstWarning() throws {
        let plan = TransitionPlan.make(old: try Self.config("", [Self.tc("a", 7000, attach: "tcx")]), new: try Self.config("", [Self.tc("a", 7000, attach: "clsact")]),
                                       running: ["a"], resized: [], kinds: ListenerKinds(logger: Logger(label: "transition-plan")))
        #expect(plan.stopFirst.map(\.warning) == ["tc_attach changes: the program is attached again at this interface, so the old tc_ebpf listener stops before its successor starts; datagrams arriving in between pass to the host's stack (its Udp NoPorts counts them)"])
    }
}
