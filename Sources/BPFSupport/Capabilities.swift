// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif

/// The calling process's effective capabilities, read from /proc/self/status.
package struct Capabilities: Sendable {
    package let effective: UInt64

    package static let sysAdmin = 21
    package static let netAdmin = 12
    package static let netRaw = 13
    package static let ipcLock = 14
    package static let bpf = 39
    package static let perfmon = 38

    package static func current() -> Capabilities {
        guard let file = fopen("/proc/self/status", "r") else { return Capabilities(effective: 0) }
        defer { fclose(file) }
        var line = [CChar](repeating: 0, count: 512)
        while fgets(&line, Int32(line.count), file) != nil {
            let text = String(decoding: line.prefix(while: { $0 != 0 }).map { UInt8(bitPattern: $0) }, as: UTF8.self)
            if text.hasPrefix("CapEff:") {
                let hex = text.dropFirst("CapEff:".count).trimmingCharacters(in: " \t\n")
                return Capabilities(effective: UInt64(hex, radix: 16) ?? 0)
            }
        }
        return Capabilities(effective: 0)
    }

    package func has(_ bit: Int) -> Bool { effective & (1 << UInt64(bit)) != 0 }

    /// CAP_BPF, or CAP_SYS_ADMIN which implies it on older kernels.
    package var canLoadBPF: Bool { has(Self.bpf) || has(Self.sysAdmin) }

    /// CAP_PERFMON (or CAP_SYS_ADMIN): the verifier allows pointer arithmetic on packet and
    /// map-value pointers only with it ("pointer arithmetic ... prohibited for !root").
    package var canUsePointerArithmetic: Bool { has(Self.perfmon) || has(Self.sysAdmin) }
}

extension StringProtocol {
    func trimmingCharacters(in set: String) -> String {
        let characters = Set(set)
        var slice = Substring(self)
        while let first = slice.first, characters.contains(first) { slice = slice.dropFirst() }
        while let last = slice.last, characters.contains(last) { slice = slice.dropLast() }
        return String(slice)
    }
}
