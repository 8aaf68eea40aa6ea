// SPDX-License-Identifier: Apache-2.0
import CLibBPF
import CSystemShim
import Testing
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// Another party's tc program placed after udp-fanout's on an interface, as a firewall or Cilium
/// would be: it counts every packet it sees and returns TC_ACT_UNSPEC. Built from raw
/// instructions, so the test needs no second object file and no tc action module.
///
/// `.clsact` adds it as a cls_bpf filter at priority 2 (after ours at 1); `.tcx` appends a TCX
/// link after ours. Made and removed from a thread inside the namespace.
final class TCChainCounter {
    enum Kind { case clsact, tcx }

    let kind: Kind
    let handle: UInt32
    let priority: UInt32
    let namespace: String
    let interface: String
    private let map: Int32
    private let program: Int32
    private var link: Int32 = -1

    /// - Parameters:
    ///   - handle, priority: of the clsact filter (by default after ours).
    init(_ kind: Kind, namespace: String, interface: String, handle: UInt32 = 2, priority: UInt32 = 2) throws {
        self.kind = kind
        self.handle = handle
        self.priority = priority
        self.namespace = namespace
        self.interface = interface
        map = bpf_map_create(BPF_MAP_TYPE_ARRAY, "chain_count", 4, 8, 1, nil)
        try #require(map >= 0, "bpf_map_create: errno \(errno)")
        var code: [UInt8] = []
        func insn(_ op: UInt8, dst: UInt8 = 0, src: UInt8 = 0, off: Int16 = 0, imm: Int32 = 0) {
            code += [op, dst | src << 4]
            withUnsafeBytes(of: off.littleEndian) { code += $0 }
            withUnsafeBytes(of: imm.littleEndian) { code += $0 }
        }
        insn(0x62, dst: 10, off: -4)                 // *(u32 *)(r10 - 4) = 0
        insn(0x18, dst: 1, src: 1, imm: map)         // r1 = map (BPF_PSEUDO_MAP_FD)
        insn(0)
        insn(0xbf, dst: 2, src: 10)                  // r2 = r10
        insn(0x07, dst: 2, imm: -4)                  // r2 += -4
        insn(0x85, imm: 1)                           // call bpf_map_lookup_elem
        insn(0x15, dst: 0, off: 2)                   // if r0 == 0 goto +2
        insn(0xb7, dst: 1, imm: 1)                   // r1 = 1
        insn(0xdb, dst: 0, src: 1)                   // lock *(u64 *)(r0 + 0) += r1
        insn(0xb7, dst: 0, imm: -1)                  // r0 = TC_ACT_UNSPEC
        insn(0x95)                                   // exit
        let count = code.count / 8
        program = code.withUnsafeBytes { raw in
            bpf_prog_load(BPF_PROG_TYPE_SCHED_CLS, "chain_count", "GPL", raw.baseAddress!.assumingMemoryBound(to: bpf_insn.self), count, nil)
        }
        try #require(program >= 0, "bpf_prog_load: errno \(errno)")
        let failure = inNamespace { [kind, program, handle, priority] ifindex -> String? in
            switch kind {
            case .tcx:
                let link = bpf_link_create(program, ifindex, TCAttachment.tcxIngress, nil)
                return link >= 0 ? "link \(link)" : "bpf_link_create: errno \(errno)"
            case .clsact:
                var hook = TCAttachment.hook(ifindex)
                _ = bpf_tc_hook_create(&hook)  // EEXIST: udp-fanout's qdisc
                var options = TCAttachment.filterOptions(program: program)
                options.handle = handle
                options.priority = priority
                let result = bpf_tc_attach(&hook, &options)
                return result == 0 ? nil : "bpf_tc_attach: \(result)"
            }
        }
        if let failure, failure.hasPrefix("link ") {
            link = Int32(failure.dropFirst(5))!
        } else {
            try #require(failure == nil, "\(failure ?? "")")
        }
    }

    /// Packets the program has seen.
    var count: UInt64 {
        var key: UInt32 = 0
        var value: UInt64 = 0
        return bpf_map_lookup_elem(map, &key, &value) == 0 ? value : UInt64.max
    }

    /// Removes the filter or link, frees the program and map.
    func remove() {
        if link >= 0 {
            close(link)
            link = -1
        } else if kind == .clsact {
            _ = inNamespace { [handle, priority] ifindex -> String? in
                var hook = TCAttachment.hook(ifindex)
                var options = TCAttachment.filterOptions()
                options.handle = handle
                options.priority = priority
                bpf_tc_detach(&hook, &options)
                return nil
            }
        }
        close(program)
        close(map)
    }

    /// Runs `body` with the interface's index from a thread inside the namespace.
    func inNamespace(_ body: @escaping @Sendable (Int32) -> String?) -> String? {
        let interface = self.interface
        return inNetworkNamespace(namespace) { body(Int32(if_nametoindex(interface))) } ?? "setns failed"
    }
}
