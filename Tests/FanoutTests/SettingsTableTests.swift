// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
@testable import FanoutCore

/// The listener settings are declared once, each beside the kind that owns it (``SettingKey``);
/// the parser and the warnings read that table, and what is written from it cannot drift from it:
/// schema/settings-table.json is its dump, the JSON Schema is generated from that dump, and the
/// reference table of docs/configuration.md has its rows.
@Suite("Settings table")
struct SettingsTableTests {
    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent()
        .deletingLastPathComponent().deletingLastPathComponent()

    static func text(_ path: String) throws -> String {
        try String(contentsOf: root.appendingPathComponent(path), encoding: .utf8)
    }

    @Test("Every setting is declared once, in one kind's table, with kinds that exist; the parser knows exactly the table's keys")
    func declarations() throws {
        let declared = ListenerKinds.settingTables.flatMap { $0 }.map(\.name)
        #expect(Set(declared).count == declared.count, "\(declared)")
        #expect(Set(declared) == Set(SettingsTable.names))
        #expect(SettingsTable.names == ListenerKinds.settingsOrder)
        for key in SettingsTable.keys {
            #expect(!key.kinds.isEmpty, "settings.\(key.name) applies to no kind")
            #expect(!key.doc.isEmpty && !key.doc.contains("\n"), "settings.\(key.name): one line of doc")
        }
        // An unknown key's error lists the table's keys, in its order.
        let yaml = "listeners:\n  - name: a\n    bind: \"127.0.0.1:7001\"\n    settings: {no_such_key: 1}\n    downstream: [{address: \"127.0.0.1:7002\"}]\n"
        #expect(throws: ConfigError("listeners[0].settings.no_such_key", "unknown key (known here: \(SettingsTable.names.joined(separator: ", ")))", line: 4)) {
            try ConfigParser.parse(yaml)
        }
    }

    @Test("Each key is warned about exactly where its kinds (or its replies) say it has no effect")
    func warningsFollowKinds() throws {
        let kinds: [(kind: any ListenerKind.Type, yaml: String)] = [
            (UserspaceKind.self, "mode: userspace"), (RelayKind.self, "mode: userspace\n    replies: relay"),
            (TCKind.self, "mode: tc_ebpf\n    interface: eth0"), (XDPKind.self, "mode: xdp\n    interface: eth0"),
            (AFXDPKind.self, "mode: af_xdp\n    interface: eth0"),
        ]
        for (kind, shape) in kinds {
            for key in SettingsTable.keys where key.scope == .modes || key.scope == .workers {
                // The default value, written out: valid in every kind.
                let value = key.json(Settings())
                let yaml = "listeners:\n  - name: a\n    bind: \"198.18.0.1:7001\"\n    \(shape)\n    settings: {\(key.name): \(value)}\n    downstream: [{address: \"198.18.1.2:7002\"}]\n"
                let config = try ConfigParser.parse(yaml)
                #expect(ListenerKinds.type(for: config.listeners[0]).map(ObjectIdentifier.init) == ObjectIdentifier(kind))
                let warned = config.warnings().contains { $0.key == "listeners[0].settings.\(key.name)" }
                #expect(warned == !key.applies(to: kind), "settings.\(key.name) in \(kind.name): \(config.warnings())")
            }
        }
    }

    @Test("The warnings' texts, order and lines are the ones the kinds wrote before the table (each kind, the replies and DNS keys)")
    func warningTexts() throws {
        // Written from the texts of the kinds' and the validation's own warnings before the
        // settings moved into tables (b752ec6): the table assembles them from its data now.
        let yaml = """
            listeners:
              - name: one
                bind: "127.0.0.1:7500"
                settings: {max_sessions: 10, tc_attach: tcx, queues: 2, max_associations: 100, drain_secs: 5}
                downstream:
                  - address: "127.0.0.1:7501"
              - name: k
                bind: "198.18.0.1:5514"
                interface: eth0
                mode: tc_ebpf
                settings: {workers: 2, batch_size: 64, umem_frames: 8192, io_uring: true}
                downstream:
                  - address: "198.18.0.2:5514"
              - name: x
                bind: "198.18.0.1:5515"
                interface: eth1
                mode: af_xdp
                settings: {workers: 2, worker_steering: round_robin, tc_attach: tcx, resolve_interval_secs: 5}
                downstream:
                  - address: "198.18.0.2:5514"
              - name: d
                bind: "198.18.0.1:5516"
                interface: eth2
                mode: xdp
                settings: {pin_cpus: true, xdp_mode: native, session_idle_secs: 30}
                downstream:
                  - address: "198.18.0.2:5514"
            """
        let config = try ConfigParser.parse(yaml)
        try config.validate(localAddresses: [])
        #expect(config.warnings().map(\.description) == [
            "configuration warning: listeners[0].settings.tc_attach (line 4): applies to modes tc_ebpf and xdp only",
            "configuration warning: listeners[0].settings.queues (line 4): applies to mode af_xdp only",
            "configuration warning: listeners[0].settings.max_associations (line 4): applies to replies: nat only",
            "configuration warning: listeners[0].settings.max_sessions (line 4): applies to replies: relay only",
            "configuration warning: listeners[0].settings.drain_secs (line 4): applies to two-way listeners (replies: nat or relay) only",
            "configuration warning: listeners[1].settings.umem_frames (line 11): applies to mode af_xdp only",
            "configuration warning: listeners[1].settings.workers (line 11): not used in mode tc_ebpf (it sets userspace workers; the kernel forwards here)",
            "configuration warning: listeners[1].settings.batch_size (line 11): not used in mode tc_ebpf (it sets userspace workers; the kernel forwards here)",
            "configuration warning: listeners[1].settings.io_uring (line 11): applies to replies: relay only",
            "configuration warning: listeners[2].settings.tc_attach (line 18): applies to modes tc_ebpf and xdp only",
            "configuration warning: listeners[2].settings.workers (line 18): not used in mode af_xdp (one forwarder per RX queue: settings.queues)",
            "configuration warning: listeners[2].settings.worker_steering (line 18): not used in mode af_xdp (one forwarder per RX queue: settings.queues)",
            "configuration warning: listeners[2].settings.resolve_interval_secs (line 18): not used: no downstream of this listener is given by DNS name",
            "configuration warning: listeners[3].settings.pin_cpus (line 25): not used in mode xdp (it sets userspace workers; the kernel forwards here)",
            "configuration warning: listeners[3].settings.session_idle_secs (line 25): applies to replies: relay only",
        ])
    }

    @Test("flow_templates where it does nothing: a relay listener (mode userspace) is told so, not 'applies to mode userspace'; a nat listener too; a replication pool whose copies leave from this host's address is warned about, one that keeps sources is not")
    func flowTemplatesWarnings() throws {
        let yaml = """
            listeners:
              - name: r
                bind: "127.0.0.1:7600"
                replies: relay
                settings: {flow_templates: true}
                downstream:
                  - address: "127.0.0.1:7601"
              - name: n
                bind: "198.18.0.1:5514"
                interface: eth0
                mode: tc_ebpf
                replies: nat
                settings: {flow_templates: true}
                downstream:
                  - address: "198.18.0.2:5514"
              - name: p
                bind: "127.0.0.1:7602"
                settings: {flow_templates: true, output: preserve_source}
                downstream:
                  - address: "127.0.0.1:7603"
                pools:
                  - name: copies
                    output: socket
                    downstream:
                      - address: "127.0.0.1:7604"
                  - name: kept
                    downstream:
                      - address: "127.0.0.1:7605"
            """
        let config = try ConfigParser.parse(yaml)
        try config.validate(localAddresses: [])
        #expect(config.warnings().map(\.description) == [
            "configuration warning: listeners[0].settings.flow_templates (line 5): no effect on a relay listener (mode userspace with replies: relay)",
            "configuration warning: listeners[1].settings.flow_templates (line 13): no effect on a two-way listener (replies: nat): flow export is one-way; templates are followed on one-way listeners only",
            "configuration warning: listeners[2].pools[0].output (line 23): with output: socket this pool's copies, and the templates sent to its members, leave from this host's address: collectors that tell exporters apart by source address (nfcapd, nfacctd) mix their templates up; set output: preserve_source",
        ], "\(config.warnings())")
    }

    @Test("schema/settings-table.json is the daemon's table (regenerate: udp-fanout --print-settings-table > schema/settings-table.json)")
    func committedDump() throws {
        #expect(try Self.text("schema/settings-table.json") == SettingsTable.json())
        let object = try #require(try JSONSerialization.jsonObject(with: Data(SettingsTable.json().utf8)) as? [String: Any])
        let keys = try #require(object["settings"] as? [[String: Any]])
        #expect(keys.compactMap { $0["name"] as? String } == SettingsTable.names)
    }

    @Test("schema/udp-fanout-config.schema.json is what schema/generate-schema.py writes (its settings from the table)")
    func schemaGenerated() throws {
        let out = FileManager.default.temporaryDirectory.appendingPathComponent("fanout-schema-\(UUID().uuidString).json")
        defer { try? FileManager.default.removeItem(at: out) }
        let generated = try run("/usr/bin/env", ["python3", Self.root.appendingPathComponent("schema/generate-schema.py").path, out.path])
        try #require(generated.status == 0, "\(generated.output)")
        #expect(try String(contentsOf: out, encoding: .utf8) == Self.text("schema/udp-fanout-config.schema.json"),
                "the committed schema is not the generator's output: run python3 schema/generate-schema.py")
        let schema = try #require(try JSONSerialization.jsonObject(with: Data(contentsOf: out)) as? [String: Any])
        let listener = try #require(((schema["properties"] as? [String: Any])?["listeners"] as? [String: Any])?["items"] as? [String: Any])
        let settings = try #require(((listener["properties"] as? [String: Any])?["settings"] as? [String: Any])?["properties"] as? [String: Any])
        #expect(Set(settings.keys) == Set(SettingsTable.names))
        for key in SettingsTable.keys {
            #expect((settings[key.name] as? [String: Any])?["description"] as? String == key.doc, "settings.\(key.name)")
        }
    }

    /// The second column of the reference table for `key`: its type or range, and its default.
    static func reference(_ key: SettingKey) -> String {
        let initial = key.json(Settings())
        switch key.value {
        case .integer(let range, let ipv4Maximum, let only):
            switch only {
            case .values(let values, _)?: return values.map(String.init).joined(separator: " or ") + ", default \(initial)"
            case .powersOfTwo?: return "power of two \(range.lowerBound)…\(range.upperBound), default \(initial)"
            case nil:
                guard let ipv4Maximum else { return "\(range.lowerBound)…\(range.upperBound), default \(initial)" }
                return "\(range.lowerBound)…\(ipv4Maximum) (\(range.upperBound) IPv6), default \(initial)"
            }
        case .boolean:
            return "bool, default \(initial)"
        case .choice(let words):
            return words.map { "`\($0)`" + ("\"\($0)\"" == initial ? " (default)" : "") }.joined(separator: ", ")
        case .interfaceNames:
            return "list of interface names, default: " + (initial == "[]" ? "empty" : initial)
        }
    }

    @Test("docs/configuration.md has one row per setting, with the table's range and default")
    func referenceDocs() throws {
        var rows: [String: String] = [:]
        for line in try Self.text("docs/configuration.md").split(separator: "\n") where line.hasPrefix("| `listeners[].settings.") {
            let cells = line.split(separator: "|", omittingEmptySubsequences: false).map { $0.trimmingCharacters(in: .whitespaces) }
            let name = String(cells[1].dropFirst("`listeners[].settings.".count).dropLast())
            #expect(rows.updateValue(cells[2], forKey: name) == nil, "settings.\(name) has two rows")
        }
        #expect(Set(rows.keys) == Set(SettingsTable.names), "docs/configuration.md's settings rows")
        for key in SettingsTable.keys {
            #expect(rows[key.name] == Self.reference(key), "docs/configuration.md, settings.\(key.name)")
        }
    }
}
