// SPDX-License-Identifier: Apache-2.0
import CLibBPF
import Foundation
import Testing
@testable import BPFSupport

/// Issue 21: libbpf refuses an options struct with a non-zero byte between its last field and
/// `sz`, and Swift's `bpf_*_opts()` initialiser sets fields, not padding; only an optimised build
/// leaves stack bytes there, so the debug test build cannot show the failure itself. These tests
/// keep every options struct the sources pass in zeroed storage (``withLibbpfOptions``).
@Suite("libbpf options structs")
struct LibbpfOptionsTests {
    @Test("withLibbpfOptions hands out zeroed storage with sz set, padding included")
    func zeroed() {
        let size = MemoryLayout<bpf_xdp_query_opts>.size
        // Dirty a heap block of the same size first, so a helper that did not zero would likely show it.
        let dirty = UnsafeMutableRawPointer.allocate(byteCount: size, alignment: MemoryLayout<bpf_xdp_query_opts>.alignment)
        dirty.initializeMemory(as: UInt8.self, repeating: 0xAB, count: size)
        dirty.deallocate()
        let bytes = withLibbpfOptions(bpf_xdp_query_opts.self) { Array(UnsafeRawBufferPointer(start: $0, count: size)) }
        #expect(size > MemoryLayout<bpf_xdp_query_opts>.offset(of: \.attach_mode)!, "the struct has bytes after attach_mode for libbpf to check")
        #expect(bytes.prefix(8).withUnsafeBytes { $0.loadUnaligned(as: Int.self) } == size, "sz is the struct's size")
        #expect(bytes.dropFirst(8).allSatisfy { $0 == 0 }, "every other byte is zero: \(bytes)")
    }

    @Test("No source makes a libbpf options struct with Swift's initialiser unless it sets sz to the end of the field it uses")
    func noBareInitialiser() throws {
        let sources = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
            .appendingPathComponent("Sources")
        let files = try #require(FileManager.default.enumerator(at: sources, includingPropertiesForKeys: nil)?.compactMap { $0 as? URL })
        let initialiser = try Regex(#"bpf_[a-z_]+_(opts|hook)\(\)"#)
        var found: [String] = []
        for file in files where file.pathExtension == "swift" {
            let lines = try String(contentsOf: file, encoding: .utf8).split(separator: "\n", omittingEmptySubsequences: false)
            for (number, line) in lines.enumerated() where line.contains(initialiser) && !line.trimmingCharacters(in: .whitespaces).hasPrefix("//") {
                // Allowed: a struct whose sz ends at the last field it sets (libbpf checks nothing past sz).
                let next = lines[(number + 1)..<min(lines.count, number + 4)].joined(separator: "\n")
                if !(next.contains(".sz = MemoryLayout<") && next.contains("offset(of:")) {
                    found.append("\(file.lastPathComponent):\(number + 1): \(line.trimmingCharacters(in: .whitespaces))")
                }
            }
        }
        #expect(found.isEmpty, "use withLibbpfOptions (BPFSupport) for: \(found)")
        #expect(files.count > 50, "the sources were found: \(files.count) files")
    }
}
