// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// Inputs that crashed or misled before: deep nesting, huge files, raw bytes in errors,
/// cross-field errors without a line, keys silently ignored, addresses that are not one host.
@Suite("Configuration hardening")
struct ConfigHardeningTests {
    static let base = "listeners:\n  - name: a\n    bind: \"127.0.0.1:7001\"\n    downstream: [{address: \"127.0.0.1:7002\"}]\n"

    func parseError(_ yaml: String) -> ConfigError? {
        do {
            try ConfigParser.parse(yaml).validate(localAddresses: [])
            return nil
        } catch {
            return error
        }
    }

    @Test("Nesting thousands deep (flow and block) is refused before parsing, no crash")
    func deepNesting() throws {
        let flow = "listeners: " + String(repeating: "[", count: 6000) + String(repeating: "]", count: 6000) + "\n"
        let block = "listeners:\n" + (0..<5000).map { String(repeating: " ", count: $0 + 1) + "- " }.joined(separator: "\n") + "x\n"
        let compact = "listeners:\n" + String(repeating: "- ", count: 5000) + "x\n"
        let mapping = "a:\n" + (1..<5000).map { String(repeating: " ", count: $0) + "k\($0):" }.joined(separator: "\n") + " 1\n"
        let quoted = "listeners: [a \"b, " + String(repeating: "[", count: 6000) + " # \"\n"
        for (name, text) in [("flow", flow), ("block", block), ("compact", compact), ("mapping", mapping), ("after a plain quote", quoted)] {
            let error = try #require(parseError(text), "\(name) accepted")
            #expect(error.key == "(document)", "\(name): \(error)")
            #expect(error.problem.contains("refused before parsing"), "\(name): \(error)")
            #expect(error.line != nil, "\(name): \(error)")
        }
        // Within the bounds: parsed (an error about the content, not a crash).
        let shallow = "listeners: " + String(repeating: "[", count: 60) + String(repeating: "]", count: 60) + "\n"
        #expect(parseError(shallow)?.problem.contains("refused before parsing") == false)
        let indented = "listeners:\n" + (0..<120).map { String(repeating: " ", count: 2 * $0 + 1) + "- " }.joined(separator: "\n") + "x\n"
        #expect(parseError(indented)?.problem.contains("refused before parsing") == false)
        // Brackets in quoted scalars and comments are not nesting.
        #expect(parseError(Self.base + "# " + String(repeating: "[", count: 500) + "\n") == nil)
        #expect(parseError(Self.base.replacingOccurrences(of: "name: a", with: "name: \"" + String(repeating: "[", count: 500) + "\"")) == nil)
    }

    @Test("YAML 1.1 sexagesimal numbers (1:30 is 90) are read without overflow: one too large for a number is refused as out of range, not a crash (SIGILL in the parser before)")
    func sexagesimal() throws {
        let settings = Self.base + "    settings:\n      workers: "
        #expect(parseError(settings + "1:30\n") == nil)
        #expect(try ConfigParser.parse(settings + "1:0\n").listeners[0].settings.workers == 60)
        #expect(try ConfigParser.parse(Self.base + "    settings:\n      max_packet_size: 1_0:00\n").listeners[0].settings.maxPacketSize == 600)
        for huge in ["1:2:3:4:5:6:7:8:9:10:11", "-1:2:3:4:5:6:7:8:9:10:11", "99999999999999999999:1", "1:" + String(repeating: "59:", count: 40) + "0"] {
            let error = try #require(parseError(settings + huge + "\n"), "\(huge) accepted")
            #expect(error.key == "listeners[0].settings.workers" && error.problem.contains("out of range"), "\(huge): \(error)")
        }
        let notNumber = try #require(parseError(settings + "1:60\n"))
        #expect(notNumber.problem.contains("expected a whole number"), "\(notNumber)")
        // Through the daemon's own check, as an operator runs it: exit 2 and the key, no signal.
        let file = try TCFixtures.write(settings + "1:2:3:4:5:6:7:8:9:10:11\n", "sexagesimal")
        defer { try? FileManager.default.removeItem(at: file) }
        let check = try Child("udp-fanout", ["--check", "-c", file.path])
        #expect(check.wait() == 2 && check.process.terminationReason == .exit, "\(check.stderr)")
        #expect(check.stderr.contains("listeners[0].settings.workers"), "\(check.stderr)")
    }

    @Test("The YAML loader refuses nesting beyond its own bound (a kubeconfig has no pre-scan) and merge keys that multiply, instead of exhausting the stack or memory")
    func loaderBounds() throws {
        let deep = "a: " + String(repeating: "[", count: 5000) + String(repeating: "]", count: 5000) + "\n"
        #expect {
            _ = try YAMLComposer.compose(deep)
        } throws: { error in
            "\(error)".contains("nested deeper than 512 levels")
        }
        #expect(try YAMLComposer.compose("a: " + String(repeating: "[", count: 500) + String(repeating: "]", count: 500) + "\n") != nil)
        // Each level merges the previous one ten times: 10^6 pairs at the last.
        var bomb = "l0: &l0 {k: v}\n"
        for level in 1...6 { bomb += "l\(level): &l\(level) {<<: [" + Array(repeating: "*l\(level - 1)", count: 10).joined(separator: ", ") + "]}\n" }
        bomb += "<<: *l6\nclusters: []\n"
        #expect {
            _ = try KubernetesCredentials.Kubeconfig(bomb)
        } throws: { error in
            "\(error)".contains("bring more than 100000 pairs")
        }
    }

    @Test("A file larger than the limit is refused with its size")
    func size() throws {
        let big = Self.base + "# " + String(repeating: "x", count: ConfigLimits.maximumBytes) + "\n"
        let error = try #require(parseError(big))
        #expect(error.problem.contains("at most \(ConfigLimits.maximumBytes)"), "\(error)")
    }

    @Test("Errors are one printable line: no raw bytes, no echo of the YAML line, cut when long")
    func printable() throws {
        let cases = [
            "listeners: [\n",
            "listeners:\n  - name: \"a\\x07\\x1b[31m\"\n    bind: \"127.0.0.1:1\"\n    downstream: [{address: \"127.0.0.1:2\"}]\n",
            "listeners:\n  - name: a\n    bind: \"" + String(repeating: "9", count: 100_000) + "\"\n",
            "\u{1b}[2J\u{7}: [\n",
            "listeners: {a: 1\n\u{0}\u{1}\u{2}",
            // A right-to-left override (U+202E, below U+D800) would reorder what a terminal shows.
            "listeners:\n  - name: a\n    bi\u{202E}nd: \"127.0.0.1:1\"\n    downstream: [{address: \"127.0.0.1:2\"}]\n",
        ]
        for text in cases {
            let error = try #require(parseError(text), "accepted: \(text.prefix(40))")
            let line = error.description
            #expect(!line.contains("\n"), "one line: \(line)")
            #expect(line.unicodeScalars.allSatisfy { $0.value >= 0x20 && $0.value != 0x7f && $0.properties.generalCategory != .format }, "printable: \(line)")
            #expect(line.count < 800, "cut: \(line.count) characters")
        }
    }

    @Test("Cross-field errors name the line")
    func crossFieldLines() throws {
        let yaml = """
            listeners:
              - name: a
                bind: "127.0.0.1:7001"
                downstream: [{address: "127.0.0.1:7002"}]
              - name: a
                bind: "127.0.0.1:7003"
                downstream: [{address: "127.0.0.1:7004"}]
            """
        let duplicate = try #require(parseError(yaml))
        #expect(duplicate.key == "listeners[1].name" && duplicate.line == 5, "\(duplicate)")
        let overlap = try #require(parseError(yaml.replacingOccurrences(of: "name: a\n    bind: \"127.0.0.1:7003\"", with: "name: b\n    bind: \"0.0.0.0:7001\"")))
        #expect(overlap.key == "listeners[1].bind" && overlap.line == 6, "\(overlap)")
        let loop = try #require(parseError(yaml.replacingOccurrences(of: "name: a\n    bind: \"127.0.0.1:7003\"", with: "name: b\n    bind: \"127.0.0.1:7003\"").replacingOccurrences(of: "7004", with: "7001")))
        #expect(loop.key == "listeners[1].downstream[0].address" && loop.line == 7, "\(loop)")
    }

    static let badAddresses: [(String, String, String)] = [
        ("bind: \"127.0.0.1:0\"", "listeners[0].bind", "port 0"),
        ("address: \"127.0.0.1:0\"", "listeners[0].downstream[0].address", "port 0"),
        ("address: \"0.0.0.0:7002\"", "listeners[0].downstream[0].address", "unspecified"),
        ("address: \"239.1.2.3:7002\"", "listeners[0].downstream[0].address", "multicast"),
        ("address: \"[ff02::1]:7002\"", "listeners[0].downstream[0].address", "multicast"),
        ("address: \"255.255.255.255:7002\"", "listeners[0].downstream[0].address", "broadcast"),
        ("address: \"[fe80::1%eth0]:7002\"", "listeners[0].downstream[0].address", "scoped IPv6"),
        ("address: \"127.0.0.1:7002\", mac: \"zz\"", "listeners[0].downstream[0].mac", "not a MAC address"),
        ("address: \"127.0.0.1:-5\"", "listeners[0].downstream[0].address", "not an address with a port"),
    ]

    @Test("Downstreams that are not one host, port 0, scoped IPv6 and bad MACs are refused with the reason", arguments: badAddresses)
    func addresses(replacement: String, key: String, problem: String) throws {
        let yaml = replacement.hasPrefix("bind")
            ? Self.base.replacingOccurrences(of: "bind: \"127.0.0.1:7001\"", with: replacement)
            : Self.base.replacingOccurrences(of: "address: \"127.0.0.1:7002\"", with: replacement)
        let error = try #require(parseError(yaml))
        #expect(error.key == key, "\(error)")
        #expect(error.problem.contains(problem), "\(error)")
    }

    @Test("Keys that do not apply where they stand are warned about, with their line")
    func warnings() throws {
        let yaml = """
            listeners:
              - name: u
                bind: "127.0.0.1:7001"
                interface: lo
                settings: {tc_attach: clsact}
                downstream: [{address: "127.0.0.1:7002", mac: "02:00:00:00:00:01"}]
              - name: t
                bind: "198.18.0.1:7001"
                interface: eth0
                mode: tc_ebpf
                settings: {workers: 4, batch_size: 8}
                downstream: [{address: "198.18.1.2:7002"}]
            """
        let config = try ConfigParser.parse(yaml)
        try config.validate(localAddresses: [])
        let warnings = config.warnings()
        #expect(warnings.map(\.key) == [
            "listeners[0].interface", "listeners[0].settings.tc_attach", "listeners[0].downstream[0].mac",
            "listeners[1].settings.workers", "listeners[1].settings.batch_size",
        ], "\(warnings)")
        #expect(warnings.first?.line == 4)
        #expect(try ConfigParser.parse(Self.base).warnings().isEmpty)
        // A health block without enabled: true probes nothing: each key it sets is named.
        let quiet = try ConfigParser.parse(Self.base + "\nhealth: {protocol: udp_echo, fall: 2}\n").warnings()
        #expect(quiet.map(\.key) == ["health.protocol", "health.fall"] && quiet.allSatisfy { $0.message.contains("enabled: true") }, "\(quiet)")
        #expect(try ConfigParser.parse(Self.base + "\nhealth: {enabled: true, protocol: udp_echo}\n").warnings().isEmpty)
    }

    @Test("tc_ebpf listeners may share a bind on two interfaces; not on one, and not with a socket listener")
    func bindScopes() throws {
        func tc(_ name: String, _ interface: String, bind: String = "198.18.0.1:7001") -> String {
            "  - {name: \(name), bind: \"\(bind)\", mode: tc_ebpf, interface: \(interface), downstream: [{address: \"198.18.1.2:7002\"}]}\n"
        }
        #expect(parseError("listeners:\n" + tc("a", "eth0") + tc("b", "eth1")) == nil)
        let same = try #require(parseError("listeners:\n" + tc("a", "eth0") + tc("b", "eth0", bind: "0.0.0.0:7001")))
        #expect(same.key == "listeners[1].bind" && same.problem.contains("overlaps listeners[0].bind 198.18.0.1:7001 on eth0"), "\(same)")
        let mixed = try #require(parseError("listeners:\n" + tc("a", "eth0") + "  - {name: u, bind: \"0.0.0.0:7001\", downstream: [{address: \"198.18.1.2:7002\"}]}\n"))
        #expect(mixed.key == "listeners[1].bind", "\(mixed)")
    }

    @Test("10,000 listeners validate: overlap and loop checks are linear")
    func manyListeners() throws {
        var yaml = "listeners:\n"
        for index in 0..<10_000 {
            yaml += "  - {name: l\(index), bind: \"127.0.\(index / 250).\(index % 250 + 1):9000\", downstream: [{address: \"127.1.\(index / 250).\(index % 250 + 1):9001\"}]}\n"
        }
        let config = try ConfigParser.parse(yaml)
        try config.validate(localAddresses: [])
        #expect(config.listeners.count == 10_000)
        var overlapping = config
        overlapping.listeners.append(Listener(name: "wild", bind: SocketAddress("0.0.0.0:9000")!, downstreams: config.listeners[0].downstreams))
        #expect(throws: ConfigError.self) { try overlapping.validate(localAddresses: []) }
    }

    @Test("--check: one error line on stderr, exit 2, for a file that crashed the daemon")
    func checkBinary() throws {
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("deep-\(UUID().uuidString).yaml")
        try ("listeners: " + String(repeating: "[", count: 10_000) + "\n").write(to: file, atomically: true, encoding: .utf8)
        defer { try? FileManager.default.removeItem(at: file) }
        let child = try Child("udp-fanout", ["--check", "-c", file.path, "-l", "error"])
        #expect(child.wait(seconds: 20) == 2)
        let lines = child.stderr.split(separator: "\n").filter { $0.contains("configuration error") }
        #expect(lines.count == 1, "printed once: \(child.stderr)")
    }

    @Test("RUST_LOG / UDP_FANOUT_LOG read as tracing's directives: off, empty, several directives")
    func logDirectives() throws {
        func filter(_ environment: String?, _ flag: String = "info") throws -> LogDirectives.Filter {
            try LogDirectives.filter(environment: environment, flag: flag)
        }
        #expect(try filter(nil) == .level(.info))
        #expect(try filter("", "debug") == .level(.debug))
        #expect(try filter("off") == .off)
        #expect(try filter("OFF") == .off)
        #expect(try filter("warn") == .level(.warning))
        #expect(try filter("udp_fanout=debug,hyper=info") == .level(.debug))
        #expect(try filter("info,udp_fanout=trace") == .level(.trace))
        #expect(try filter("udp_fanout::tc=error,debug") == .level(.error))
        #expect(try filter("hyper=info", "warn") == .level(.warning))
        #expect(try filter("udp_fanout") == .level(.trace))
        #expect(try filter("error, udp-fanout=off ") == .off)
        #expect(throws: LogDirectives.Invalid.self) { try filter("udp_fanout=loud") }
        #expect(try filter("hyper=bogus,warn") == .level(.warning), "another target's bad level is not ours")
        #expect(throws: LogDirectives.Invalid.self) { try filter(nil, "chatty") }
    }
}

@Suite("Blocking work off the cooperative pool")
struct OffPoolTests {
    @Test("offCooperativePool runs its body on a thread of its own, named, and hands the result back")
    func ownThread() async {
        let name = await offCooperativePool("fanout-test") { () -> String in
            (try? String(contentsOfFile: "/proc/thread-self/comm", encoding: .utf8))?.trimmingCharacters(in: .whitespacesAndNewlines) ?? ""
        }
        #expect(name == "fanout-test")
        let pool = (try? String(contentsOfFile: "/proc/thread-self/comm", encoding: .utf8)) ?? ""
        #expect(!pool.hasPrefix("fanout-test"), "the caller is not that thread")
    }
}
