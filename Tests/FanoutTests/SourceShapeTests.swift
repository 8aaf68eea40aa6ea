// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing

/// The shape docs/development.md promises, checked on the sources themselves: system calls go
/// through the SystemCalls layer, libxdp is the AF_XDP code's alone, and no listener kind's
/// folder names another kind's types.
@Suite("Source shape")
struct SourceShapeTests {
    static let sources = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
        .appendingPathComponent("Sources")

    /// Every Swift file under `Sources/<folder>`, with its text (string literals and comments
    /// blanked, so a call's name in a message or a doc comment does not count).
    static func code(under folder: String = "") throws -> [(path: String, lines: [String])] {
        let root = sources.appendingPathComponent(folder)
        let files = try #require(FileManager.default.enumerator(at: root, includingPropertiesForKeys: nil)?.compactMap { $0 as? URL })
        let literal = try Regex(#""(\\.|[^"\\])*""#)
        return try files.filter { $0.pathExtension == "swift" }.map { file in
            let text = try String(contentsOf: file, encoding: .utf8)
            let lines = text.split(separator: "\n", omittingEmptySubsequences: false).map { line -> String in
                var code = String(line).replacing(literal, with: "\"\"")
                if let comment = code.range(of: "//") { code = String(code[..<comment.lowerBound]) }
                return code
            }
            return (String(file.path.dropFirst(sources.path.count + 1)), lines)
        }
    }

    @Test("No socket, option, send/receive, poll or epoll call outside Sources/SystemCalls calls the C function by name")
    func systemCallsThroughTheLayer() throws {
        let names = "socket|setsockopt|getsockopt|getsockname|sendto|recvfrom|sendmsg|recvmsg|sendmmsg|recvmmsg|poll|ppoll|epoll_create1|epoll_ctl|epoll_wait|ioctl|bind|connect|send|recv|shim_recvmmsg|shim_sendmmsg"
        let call = try Regex("(?:^|[^A-Za-z0-9_.]|Glibc\\.)(\(names))\\(")
        let files = try Self.code().filter { !$0.path.hasPrefix("SystemCalls/") }
        var found: [String] = []
        for file in files {
            let text = file.lines.joined(separator: "\n")
            // Swift functions, stored closures and parameters of the same name are not the C call.
            var own = Set<String>()
            for pattern in ["func (\(names))\\b", "\\b(?:let|var)\\s+(\(names))\\b", "[(,]\\s*(?:_\\s+)?(\(names))\\s*:\\s*(?:@escaping|@Sendable|\\()"] {
                for match in text.matches(of: try Regex(pattern)) { if let name = match.output[1].substring { own.insert(String(name)) } }
            }
            for (number, line) in file.lines.enumerated() {
                for match in line.matches(of: call) {
                    guard let called = match.output[1].substring else { continue }
                    let name = String(called)
                    let before = line[..<called.startIndex]
                    let viaGlibc = before.hasSuffix("Glibc.")
                    if own.contains(name) && !viaGlibc { continue }
                    if before.range(of: #"\b(func|case)\s+$"#, options: .regularExpression) != nil { continue }
                    found.append("\(file.path):\(number + 1): \(line.trimmingCharacters(in: .whitespaces))")
                }
            }
        }
        #expect(found.isEmpty, "call these through Syscall (Sources/SystemCalls/Syscall.swift): \(found)")
        #expect(files.count > 100, "the sources were found: \(files.count) files")
    }

    @Test("Only the AF_XDP code imports CLibXDP")
    func libxdpOnlyInAFXDP() throws {
        let importers = try Self.code().filter { $0.lines.contains("import CLibXDP") }.map(\.path)
        #expect(!importers.isEmpty, "the AF_XDP code imports it")
        #expect(importers.allSatisfy { $0.hasPrefix("FanoutCore/AFXDP/") }, "\(importers)")
    }

    @Test("No listener kind's folder names a type another kind's folder declares")
    func kindsStandAlone() throws {
        let kinds = ["TC", "AFXDP", "Userspace", "Relay"]
        let declaration = try Regex(#"^\s*(?:public |package |private |fileprivate )?(?:final )?(?:class|struct|enum|protocol|actor)\s+([A-Z][A-Za-z0-9]*)"#)
        var declared: [String: Set<String>] = [:]
        var code: [String: [(path: String, lines: [String])]] = [:]
        for kind in kinds {
            code[kind] = try Self.code(under: "FanoutCore/\(kind)")
            for file in code[kind]! {
                for line in file.lines {
                    // Top-level declarations only: nested names (State, Plan) are each type's own.
                    guard !line.hasPrefix(" "), let match = line.firstMatch(of: declaration), let name = match.output[1].substring else { continue }
                    declared[kind, default: []].insert(String(name))
                }
            }
        }
        #expect(declared.values.allSatisfy { !$0.isEmpty }, "\(declared)")
        var found: [String] = []
        for kind in kinds {
            for other in kinds where other != kind {
                for name in declared[other] ?? [] {
                    let word = try Regex("\\b\(name)\\b")
                    for file in code[kind]! where file.lines.contains(where: { $0.contains(word) }) {
                        found.append("\(file.path) names \(other)/\(name)")
                    }
                }
            }
        }
        #expect(found.isEmpty, "shared code belongs in Forwarding/, Netlink/ or Daemon/ (ListenerKind.swift): \(found)")
    }
}
