// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// schema/udp-fanout-config.schema.json, the JSON Schema of the configuration that editors
/// (yaml-language-server) validate with, checked with check-jsonschema (PyPI, installed by
/// scripts/setup.sh): the documented examples pass it and the daemon's own validation; it never
/// refuses a file the daemon accepts (the reliability suite's mutated files); it is not vacuous
/// (hand-written invalid files are refused by both).
@Suite("Configuration schema", .serialized)
struct ConfigSchemaTests {
    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent()
        .deletingLastPathComponent().deletingLastPathComponent()
    static let schema = root.appendingPathComponent("schema/udp-fanout-config.schema.json")
    /// The modeline at the top of config.example.yaml (relative to the file, as yaml-language-server resolves it).
    static let modeline = "# yaml-language-server: $schema=schema/udp-fanout-config.schema.json"

    /// Whether check-jsonschema can run. Without it the tests are skipped, except under CI=true,
    /// where they run and fail: a missing tool is never mistaken for a pass.
    static let checkerInstalled = ((try? run("/usr/bin/env", ["python3", "-c", "import check_jsonschema"]))?.status ?? -1) == 0
    static let missing: Comment = "check-jsonschema is missing: run scripts/setup.sh (pip install check-jsonschema)"

    /// One line of figures, on stderr.
    static func report(_ line: String) {
        FileHandle.standardError.write(Data("config schema: \(line)\n".utf8))
    }

    /// A scratch directory, removed by the caller.
    static func scratch(_ name: String) throws -> URL {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("fanout-schema-\(name)-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        return directory
    }

    /// What one check-jsonschema run over some files found.
    struct Verdict {
        var status: Int32 = 0
        /// Files the schema refuses, with its messages (`$.path: message`).
        var refused: [String: [String]] = [:]
        /// Files check-jsonschema could not load as YAML (its loader is ruamel.yaml, YAML 1.2).
        var unloadable: Set<String> = []
        /// Every file it named, refused or unloadable.
        var named: Set<String> { Set(refused.keys).union(unloadable) }
    }

    /// Runs check-jsonschema once over `files` with the schema; its JSON report, by file path.
    static func check(_ files: [URL]) throws -> Verdict {
        try #require(!files.isEmpty)
        let child = try Child("/usr/bin/env", ["python3", "-m", "check_jsonschema", "--output-format", "json", "--schemafile", schema.path] + files.map(\.path))
        let status = child.wait(seconds: 600)
        let output = child.stdout
        let object = try #require((try? JSONSerialization.jsonObject(with: Data(output.utf8))) as? [String: Any],
                                  "check-jsonschema exited \(status) without a JSON report: \(output.prefix(2000)) \(child.stderr.prefix(2000))")
        var verdict = Verdict(status: status)
        for error in object["errors"] as? [[String: Any]] ?? [] {
            let file = error["filename"] as? String ?? "?"
            verdict.refused[file, default: []].append("\(error["path"] as? String ?? "$"): \(error["message"] as? String ?? "")")
        }
        for error in object["parse_errors"] as? [[String: Any]] ?? [] {
            verdict.unloadable.insert(error["filename"] as? String ?? "?")
        }
        // Exit 0 exactly when nothing was found (the report and the status agree).
        #expect((status == 0) == verdict.named.isEmpty, "check-jsonschema exited \(status): \(output.prefix(2000)) \(child.stderr.prefix(2000))")
        return verdict
    }

    /// The daemon's verdict, as the reliability suite takes it: parsed and validated (no local
    /// addresses, so no loop through this host's own addresses is assumed).
    static func daemonRefusal(_ text: String) -> ConfigError? {
        do {
            try ConfigParser.parse(text).validate(localAddresses: [])
            return nil
        } catch {
            return error
        }
    }

    /// The fenced ```yaml blocks of a Markdown text, each with the line its first line is on.
    static func yamlBlocks(_ markdown: String) -> [(line: Int, text: String)] {
        var blocks: [(line: Int, text: String)] = []
        var current: [Substring]? = nil
        var start = 0
        for (index, line) in markdown.split(separator: "\n", omittingEmptySubsequences: false).enumerated() {
            if let lines = current {
                if line.trimmingCharacters(in: .whitespaces) == "```" {
                    blocks.append((line: start, text: lines.joined(separator: "\n") + "\n"))
                    current = nil
                } else {
                    current = lines + [line]
                }
            } else if line.hasPrefix("```yaml") || line.hasPrefix("```yml") {
                current = []
                start = index + 2
            }
        }
        return blocks
    }

    /// Whether `text` has U+FEFF past its first character: at the very start it is the file's
    /// byte-order mark, which both loaders skip; anywhere else the daemon's YAML library drops
    /// it from the start of a scalar and ruamel.yaml keeps it.
    static func hasInnerByteOrderMark(_ text: String) -> Bool {
        text.unicodeScalars.dropFirst().contains("\u{feff}")
    }

    /// Whether `text` may have an explicit YAML tag: a `!` where a token starts.
    static func hasTag(_ text: String) -> Bool {
        var previous: Unicode.Scalar = "\n"
        for scalar in text.unicodeScalars {
            if scalar == "!" && " \t\n[{,".unicodeScalars.contains(previous) { return true }
            previous = scalar
        }
        return false
    }

    /// A whole configuration file, not a fragment: it has the top-level `listeners:` key
    /// (fragments, such as a Kubernetes manifest next to a configuration, are skipped).
    static func isConfiguration(_ block: String) -> Bool {
        block.split(separator: "\n").contains { $0.hasPrefix("listeners:") }
    }

    @Test("The schema is a valid draft-07 schema; config.example.yaml names it in its yaml-language-server modeline",
          .enabled(if: checkerInstalled || Privileges.isCI, missing))
    func schemaAndModeline() throws {
        try #require(Self.checkerInstalled, Self.missing)
        let metaschema = try run("/usr/bin/env", ["python3", "-m", "check_jsonschema", "--check-metaschema", Self.schema.path])
        #expect(metaschema.status == 0, "\(metaschema.output)")
        let object = try #require((try? JSONSerialization.jsonObject(with: Data(contentsOf: Self.schema))) as? [String: Any], "\(Self.schema.path) is not a JSON object")
        #expect(object["$schema"] as? String == "http://json-schema.org/draft-07/schema#")
        let example = try String(contentsOf: Self.root.appendingPathComponent("config.example.yaml"), encoding: .utf8)
        #expect(example.split(separator: "\n").first.map(String.init) == Self.modeline, "config.example.yaml starts with \(Self.modeline)")
    }

    @Test("config.example.yaml and every configuration in docs/*.md and README.md (```yaml blocks with listeners:) pass the schema and the daemon's validation",
          .enabled(if: checkerInstalled || Privileges.isCI, missing))
    func documentedExamples() throws {
        try #require(Self.checkerInstalled, Self.missing)
        let directory = try Self.scratch("docs")
        defer { try? FileManager.default.removeItem(at: directory) }
        let docs = Self.root.appendingPathComponent("docs")
        let markdown = try FileManager.default.contentsOfDirectory(at: docs, includingPropertiesForKeys: nil)
            .filter { $0.pathExtension == "md" }.sorted { $0.path < $1.path } + [Self.root.appendingPathComponent("README.md")]
        let example = try String(contentsOf: Self.root.appendingPathComponent("config.example.yaml"), encoding: .utf8)
        var examples: [(name: String, text: String)] = [(name: "config.example.yaml", text: example)]
        var skipped: [String] = []
        for file in markdown {
            let relative = file.deletingLastPathComponent().lastPathComponent == "docs" ? "docs/\(file.lastPathComponent)" : file.lastPathComponent
            let text = try String(contentsOf: file, encoding: .utf8)
            for block in Self.yamlBlocks(text) {
                if Self.isConfiguration(block.text) {
                    examples.append((name: "\(relative):\(block.line)", text: block.text))
                } else {
                    skipped.append("\(relative):\(block.line)")
                }
            }
        }
        // docs/ and README.md hold 11 configurations today; fewer means the blocks were not found.
        #expect(examples.count >= 12, "\(examples.map { $0.name })")
        var files: [URL] = []
        var names: [String: String] = [:]
        for (index, example) in examples.enumerated() {
            if let error = Self.daemonRefusal(example.text) {
                Issue.record("\(example.name): the daemon refuses it: \(error)")
            }
            let file = directory.appendingPathComponent("example-\(index).yaml")
            try Data(example.text.utf8).write(to: file)
            files.append(file)
            names[file.path] = example.name
        }
        let verdict = try Self.check(files)
        for (file, errors) in verdict.refused.sorted(by: { $0.key < $1.key }) {
            Issue.record("\(names[file] ?? file): refused by the schema: \(errors.joined(separator: "; "))")
        }
        for file in verdict.unloadable.sorted() {
            Issue.record("\(names[file] ?? file): check-jsonschema cannot load it as YAML")
        }
        Self.report("documented examples: \(examples.count) configurations checked (config.example.yaml and \(examples.count - 1) blocks), \(verdict.named.count) refused; \(skipped.count) fragments skipped: \(skipped.joined(separator: ", "))")
    }

    @Test("Mutated configurations (the reliability suite's ConfigMutator): every one the daemon accepts passes the schema, in one check-jsonschema run; how many refused ones the schema refuses too is reported",
          .enabled(if: checkerInstalled || Privileges.isCI, missing))
    func mutatedConfigurations() throws {
        try #require(Self.checkerInstalled, Self.missing)
        let count = Reliability.scale(3_000, 20_000)
        /// Refused files checked for the strictness figure (all of them in the short run).
        let strictnessSample = 3_000
        var mutator = ConfigMutator(random: SeededRandom(state: 0x5EED_0004))
        let directory = try Self.scratch("mutated")
        defer { try? FileManager.default.removeItem(at: directory) }
        var accepted: [URL] = []
        var refused: [URL] = []
        var texts: [String: String] = [:]
        for (index, seed) in ConfigMutator.seeds.enumerated() {
            if let error = Self.daemonRefusal(seed) { Issue.record("seed \(index) is refused by the daemon: \(error)") }
            let file = directory.appendingPathComponent("seed-\(index).yaml")
            try Data(seed.utf8).write(to: file)
            accepted.append(file)
            texts[file.path] = seed
        }
        let started = ContinuousClock.now
        for index in 0..<count {
            // The text the parser sees (invalid UTF-8 repaired), written as it is.
            let text = String(decoding: mutator.mutate(), as: UTF8.self)
            if Self.daemonRefusal(text) == nil {
                let file = directory.appendingPathComponent("accepted-\(index).yaml")
                try Data(text.utf8).write(to: file)
                accepted.append(file)
                texts[file.path] = text
            } else if refused.count < strictnessSample {
                let file = directory.appendingPathComponent("refused-\(index).yaml")
                try Data(text.utf8).write(to: file)
                refused.append(file)
            }
        }
        let verdict = try Self.check(accepted)
        // Where the two YAML loaders differ, no schema can help; such files are counted, not
        // failed: a scalar beginning with U+FEFF (the daemon's YAML library drops it, ruamel.yaml
        // keeps it), and an explicit tag ruamel.yaml applies and the daemon ignores (`!!str` on a
        // mapping, `!!binary` on text that is not base64: the file does not load). Any other
        // file the schema refuses, or that does not load, fails the test.
        var excused: [String: String] = [:]
        for file in verdict.named {
            let text = texts[file] ?? ""
            if Self.hasInnerByteOrderMark(text) {
                excused[file] = "U+FEFF"
            } else if verdict.unloadable.contains(file) && Self.hasTag(text) {
                excused[file] = "tag"
            }
        }
        for (file, errors) in verdict.refused.sorted(by: { $0.key < $1.key }) where excused[file] == nil {
            Issue.record("\(file): the daemon accepts it, the schema refuses it: \(errors.prefix(3).joined(separator: "; "))\n--- the file:\n\(texts[file]?.prefix(3000) ?? "")")
        }
        for file in verdict.unloadable.sorted() where excused[file] == nil {
            Issue.record("\(file): the daemon accepts it, check-jsonschema cannot load it as YAML\n--- the file:\n\(texts[file]?.prefix(3000) ?? "")")
        }
        let strict = try Self.check(refused)
        Self.report("mutated files: \(count) generated (seed 0x5EED0004), \(accepted.count - ConfigMutator.seeds.count) accepted by the daemon, \(accepted.count) checked with the \(ConfigMutator.seeds.count) seeds: \(verdict.named.count - excused.count) refused by the schema or not loadable, \(excused.count) excused (loader differences: \(excused.values.filter { $0 == "tag" }.count) tags, \(excused.values.filter { $0 == "U+FEFF" }.count) U+FEFF); strictness: \(strict.named.count) of \(refused.count) refused files refused too (\(strict.refused.count) by the schema, \(strict.unloadable.count) not YAML that check-jsonschema loads); in \(ContinuousClock.now - started)")
    }

    /// A valid file, and the ways the invalid ones below break it.
    static let base = """
        listeners:
          - name: a
            bind: "127.0.0.1:7001"
            downstream:
              - address: "127.0.0.1:7002"

        """

    /// The valid file with `lines` after it.
    static func plus(_ lines: String) -> String { base + lines }

    /// Files the daemon refuses and the schema must refuse too, by what is wrong.
    static let invalid: [(problem: String, text: String)] = [
        ("a word for a number", plus("    settings: {workers: many}\n")),
        ("an unknown mode", base.replacingOccurrences(of: "    downstream:", with: "    mode: kernel\n    downstream:")),
        ("a bind port out of range", base.replacingOccurrences(of: "127.0.0.1:7001", with: "127.0.0.1:70000")),
        ("a bind without a port", base.replacingOccurrences(of: "127.0.0.1:7001", with: "127.0.0.1")),
        ("an unknown key", plus("    bogus: 1\n")),
        ("an unknown top-level key", plus("logging: {level: info}\n")),
        ("no listeners", "metrics: {enabled: true}\n"),
        ("an empty listener list", "listeners: []\n"),
        ("a listener without a name", base.replacingOccurrences(of: "  - name: a\n    bind:", with: "  - bind:")),
        ("a multicast downstream", base.replacingOccurrences(of: "127.0.0.1:7002", with: "224.0.0.1:7002")),
        ("a downstream on port 0", base.replacingOccurrences(of: "127.0.0.1:7002", with: "127.0.0.1:0")),
        ("a negative weight", plus("        weight: -1\n")),
        ("a list where a mapping goes", plus("    settings: [workers, 2]\n")),
        ("a string where a list goes", "listeners:\n  - name: a\n    bind: \"127.0.0.1:7001\"\n    downstream: \"127.0.0.1:7002\"\n"),
        ("no downstream and no kubernetes", "listeners:\n  - name: a\n    bind: \"127.0.0.1:7001\"\n"),
        ("tc_ebpf without an interface", base.replacingOccurrences(of: "    downstream:", with: "    mode: tc_ebpf\n    downstream:")),
        ("replies relay in tc_ebpf", base.replacingOccurrences(of: "    downstream:", with: "    mode: tc_ebpf\n    interface: eth0\n    replies: relay\n    downstream:")),
        ("replies nat on a wildcard bind", base.replacingOccurrences(of: "127.0.0.1:7001", with: "0.0.0.0:7001")
            .replacingOccurrences(of: "    downstream:", with: "    mode: tc_ebpf\n    interface: eth0\n    replies: nat\n    downstream:")),
        ("output xdp_tx in userspace", plus("    settings: {output: xdp_tx}\n")),
        ("a pool named default", plus("    pools: [{name: default, downstream: [{address: \"127.0.0.1:7003\"}]}]\n")),
        ("a MAC with a DNS name", base.replacingOccurrences(of: "127.0.0.1:7002\"", with: "collector.example:7002\"\n        mac: \"02:00:00:00:00:01\"")),
        ("a Service name in capitals", "listeners:\n  - name: a\n    bind: \"127.0.0.1:7001\"\n    kubernetes: {service: Receivers, port: 5514}\n"),
        ("a ring size that is not a power of two", base.replacingOccurrences(of: "    downstream:", with: "    mode: af_xdp\n    interface: eth0\n    settings: {ring_size: 3000}\n    downstream:")),
        ("health rise 0", plus("health: {enabled: true, rise: 0}\n")),
        ("a timeout longer than the interval", plus("health: {enabled: true, interval_secs: 2, timeout_secs: 3}\n")),
        ("an unknown health protocol", plus("health: {enabled: true, protocol: tcp}\n")),
        ("a boolean that is none", plus("health: {enabled: maybe}\n")),
        ("a metrics path without /", plus("metrics: {enabled: true, path: metrics}\n")),
    ]

    /// Files the daemon accepts in spellings a YAML 1.2 tool reads otherwise (YAML 1.1 octal,
    /// booleans, sexagesimal numbers, tags, anchors): the schema must accept them too.
    static let spellings: [(spelling: String, text: String)] = [
        ("yes, on, off and quoted booleans", plus("    settings: {pin_cpus: \"Yes\", busy_poll: off}\nhealth: {enabled: on, protocol: udp_echo}\nmetrics: {enabled: NO}\n")),
        ("hexadecimal, binary, underscores, a + sign", plus("    settings: {workers: 0x10, batch_size: 1_024, queues: 0b11, max_packet_size: +9000}\n")),
        ("0-prefixed octal (0144 is 100, 0177777 is 65535)", plus("        weight: 0144\n        health_port: 0177777\nhealth: {enabled: true, rise: 0144, interval_secs: 010, timeout_secs: 010}\n")),
        ("sexagesimal and !!str numbers", plus("    settings: {recv_buf_size: 1:30, workers: !!str 2}\n")),
        ("a name that is a number, null, or an alias", base.replacingOccurrences(of: "  - name: a", with: "  - name: &n 123")
            .replacingOccurrences(of: "      - address:", with: "      - name: ~\n        address:")
            .appending("    pools: [{name: *n, downstream: [{address: \"127.0.0.1:7004\"}]}]\n")),
        ("ports with a + sign and leading zeros, a DNS name with a trailing dot", base.replacingOccurrences(of: "127.0.0.1:7001", with: "127.0.0.1:+07001")
            .replacingOccurrences(of: "127.0.0.1:7002", with: "Collector.Example.:07002")),
        ("af_xdp with octal sizes, zero_copy on", "listeners:\n  - name: x\n    bind: \"[::1]:9000\"\n    interface: eth0\n    mode: af_xdp\n    settings: {zero_copy: on, umem_frame_size: 04000, ring_size: 0100, umem_frames: 0200}\n    downstream: [{address: \"[2001:db8::2]:9000\"}]\n"),
        ("a %YAML 1.1 directive: zero_copy off is a boolean there, a MAC of decimal pairs a number", "%YAML 1.1\n---\n\(base.replacingOccurrences(of: "    downstream:", with: "    mode: af_xdp\n    interface: eth0\n    settings: {zero_copy: off, xdp_mode: generic}\n    downstream:"))        mac: 11:22:33:44:55:06\n"),
        ("!!binary scalars (bytes to a YAML loader, text to the daemon)", plus("    interface: !!binary \n    settings: {xdp_mode: !!binary auto, workers: !!binary 0x10}\n")),
    ]

    @Test("The schema is not vacuous: hand-written invalid files (wrong type, unknown mode, port out of range...) are refused by the daemon and by the schema; spellings the daemon accepts pass",
          .enabled(if: checkerInstalled || Privileges.isCI, missing))
    func handWritten() throws {
        try #require(Self.checkerInstalled, Self.missing)
        let directory = try Self.scratch("hand")
        defer { try? FileManager.default.removeItem(at: directory) }
        var invalidFiles: [String: String] = [:]
        var validFiles: [String: String] = [:]
        var files: [URL] = []
        for (index, (problem, text)) in Self.invalid.enumerated() {
            #expect(Self.daemonRefusal(text) != nil, "the daemon accepts \(problem):\n\(text)")
            let file = directory.appendingPathComponent("invalid-\(index).yaml")
            try Data(text.utf8).write(to: file)
            files.append(file)
            invalidFiles[file.path] = problem
        }
        let accepted: [(spelling: String, text: String)] = [(spelling: "the base file", text: Self.base)] + Self.spellings
        for (index, (spelling, text)) in accepted.enumerated() {
            if let error = Self.daemonRefusal(text) { Issue.record("the daemon refuses \(spelling): \(error)\n\(text)") }
            let file = directory.appendingPathComponent("valid-\(index).yaml")
            try Data(text.utf8).write(to: file)
            files.append(file)
            validFiles[file.path] = spelling
        }
        let verdict = try Self.check(files)
        for (file, problem) in invalidFiles.sorted(by: { $0.key < $1.key }) {
            #expect(verdict.refused[file] != nil, "the schema accepts \(problem)\(verdict.unloadable.contains(file) ? " (it is not even YAML check-jsonschema loads)" : "")")
        }
        for (file, spelling) in validFiles.sorted(by: { $0.key < $1.key }) {
            #expect(!verdict.named.contains(file), "the schema refuses \(spelling): \(verdict.refused[file] ?? ["not loadable as YAML"])")
        }
        Self.report("hand-written: \(invalidFiles.count) invalid files, \(verdict.refused.keys.filter { invalidFiles[$0] != nil }.count) refused by the schema; \(validFiles.count) unusual spellings the daemon accepts, \(validFiles.keys.filter { !verdict.named.contains($0) }.count) accepted")
    }
}
