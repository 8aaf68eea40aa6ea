// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import BPFSupport
import CLibBPF
import SystemCalls

/// Counts the entries of nat listeners' association maps without walking them: the map
/// iterator of `bpf/map_count.bpf.c` writes each association map's id and the kernel's own count
/// of its entries (Linux 6.6's per-CPU element counts, which LRU evictions keep right), so a
/// count costs the same at 1,048,576 associations as at 10. The program and its iterator link
/// are made once; each count is one `bpf_iter_create` and a read.
final class AssociationCounter: Sendable {
    private let program: Int32
    private let link: Int32

    /// Loads the iterator and makes its link. - Throws: the failing call (an older kernel has no
    /// `bpf_map_sum_elem_count`, a kernel without BTF cannot relocate the program): the caller
    /// then counts with batched lookups.
    /// The iterator program's name in bpf/map_count.bpf.c.
    static let programName = "fanout_map_count"

    init() throws(SystemCallError) {
        let owned = try loadEmbeddedObject(.mapCount, program: Self.programName, maps: [])
        program = owned[0]
        do {
            link = try libbpfCall("bpf_link_create fanout_map_count (BPF_TRACE_ITER)") { bpf_link_create(owned[0], 0, BPF_TRACE_ITER, nil) }
        } catch {
            close(owned[0])
            throw error
        }
    }

    deinit {
        close(link)
        close(program)
    }

    /// Entries per association map id, as the kernel counts them now. - Throws: the failing call.
    func counts() throws(SystemCallError) -> [UInt32: Int] {
        let iterator = try libbpfCall("bpf_iter_create fanout_map_count") { bpf_iter_create(link) }
        defer { close(iterator) }
        let record = MemoryLayout<fanout_map_count>.size
        var bytes: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 64 * record)
        while true {
            let count = chunk.withUnsafeMutableBytes { read(iterator, $0.baseAddress, $0.count) }
            if count < 0 {
                if errno == EINTR { continue }
                throw SystemCallError(call: "read fanout_map_count iterator", errno: errno)
            }
            if count == 0 { break }
            bytes += chunk[0..<count]
        }
        var counts: [UInt32: Int] = [:]
        bytes.withUnsafeBytes { raw in
            for offset in stride(from: 0, to: raw.count - record + 1, by: record) {
                let entry = raw.loadUnaligned(fromByteOffset: offset, as: fanout_map_count.self)
                counts[entry.id] = Int(max(0, entry.entries))
            }
        }
        return counts
    }

    /// The kernel's id of the map behind `fd`. - Throws: the failing call.
    static func mapID(_ fd: Int32) throws(SystemCallError) -> UInt32 {
        var info = bpf_map_info()
        var length = UInt32(MemoryLayout<bpf_map_info>.size)
        try libbpfCall("bpf_obj_get_info_by_fd (map)") { bpf_obj_get_info_by_fd(fd, &info, &length) }
        return info.id
    }
}
