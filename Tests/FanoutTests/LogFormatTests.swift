// SPDX-License-Identifier: Apache-2.0
import Foundation
import Logging
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// `--log-format json`: one JSON object per line, stable keys first, for log shippers.
@Suite("log format")
struct LogFormatTests {
    static func object(_ line: String) throws -> [String: Any] {
        try #require(JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: Any], "not a JSON object: \(line)")
    }

    @Test("A line: time, level, message and label first; quotes, newlines and control characters escaped; metadata at the top level, nested values kept, a key named like a stable one prefixed with _")
    func line() throws {
        let text = JSONLogHandler.line(time: "2026-11-24T21:00:00.123Z", level: .warning, message: "a \"quoted\"\nline\u{1}", label: "udp-fanout", metadata: [
            "listener": "syslog", "message": "shadow", "addresses": .array(["198.18.0.1", "198.18.0.2"]), "counts": .dictionary(["a": "1"]),
        ])
        #expect(!text.contains("\n"), "one line: \(text)")
        #expect(text.hasPrefix("{\"time\":\"2026-11-24T21:00:00.123Z\",\"level\":\"warning\",\"message\":"), "\(text)")
        let object = try Self.object(text)
        #expect(object["message"] as? String == "a \"quoted\"\nline\u{1}")
        #expect(object["label"] as? String == "udp-fanout" && object["listener"] as? String == "syslog" && object["_message"] as? String == "shadow")
        #expect(object["addresses"] as? [String] == ["198.18.0.1", "198.18.0.2"] && (object["counts"] as? [String: String]) == ["a": "1"])
        let now = JSONLogHandler.now()
        #expect(now.count == 24 && now.hasSuffix("Z") && now.dropFirst(10).first == "T", "\(now)")
    }

    @Test("udp-fanout --log-format json: every line it writes is a JSON object with time, level and message, the listener's lines name it; a format it does not know is refused naming the flag")
    func daemon() throws {
        let port = freePort()
        let file = try TCFixtures.write("""
            listeners:
              - name: lj
                bind: "127.0.0.1:\(port)"
                downstream:
                  - address: "127.0.0.1:9"
            """, "log-json")
        defer { try? FileManager.default.removeItem(at: file) }
        let daemon = try Child("udp-fanout", ["-c", file.path, "--log-format", "json"])
        try daemon.waitFor("entering receive loop")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let lines = daemon.stderr.split(separator: "\n").map(String.init)
        #expect(lines.count >= 3, "\(daemon.stderr)")
        var named = 0
        for line in lines {
            let object = try Self.object(line)
            #expect(object["time"] is String && object["level"] is String && object["message"] is String, "\(line)")
            if object["listener"] as? String == "lj" { named += 1 }
        }
        #expect(named > 0, "the listener's lines carry its name: \(daemon.stderr)")
        let refused = try Child("udp-fanout", ["-c", file.path, "--log-format", "yaml"])
        #expect(refused.wait() == 64)
        #expect(refused.stderr.contains("--log-format 'yaml' is not one of text, json"), "\(refused.stderr)")
    }
}
