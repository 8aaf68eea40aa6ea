// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFSupport
import CLibBPF
import CSystemShim

/// What the running kernel's tc helpers accept, found by running a tiny probe program once
/// before the tc_ebpf program is loaded.
struct TCKernelFeatures: Sendable, Equatable {
    /// `bpf_l4_csum_replace` accepts `BPF_F_IPV6` (kernel 6.15+; older kernels refuse unknown
    /// flags with EINVAL, so the program must not pass it there).
    var ipv6ChecksumFlag: Bool

    /// Loads a program that calls `bpf_l4_csum_replace(skb, 0, 0, 0, BPF_F_IPV6)` (a zero
    /// difference: nothing changes) and runs it once under BPF_PROG_TEST_RUN: 0 means the flag
    /// is known. A probe that cannot run says no: the program then works as on older kernels.
    static func probe() -> TCKernelFeatures {
        var code: [UInt8] = []
        func insn(_ op: UInt8, dst: UInt8 = 0, imm: Int32 = 0) {
            code += [op, dst, 0, 0]
            withUnsafeBytes(of: imm.littleEndian) { code += $0 }
        }
        insn(0xb7, dst: 2)                                  // r2 = 0: offset
        insn(0xb7, dst: 3)                                  // r3 = 0: from
        insn(0xb7, dst: 4)                                  // r4 = 0: to
        insn(0xb7, dst: 5, imm: Int32(BPF_F_IPV6)) // r5 = BPF_F_IPV6, size 0: a difference
        insn(0x85, imm: Int32(BPF_FUNC_l4_csum_replace.rawValue))
        insn(0x95)                                          // exit with the helper's result
        let program = code.withUnsafeBytes { raw in
            bpf_prog_load(BPF_PROG_TYPE_SCHED_CLS, "fanout_probe", "GPL", raw.baseAddress!.assumingMemoryBound(to: bpf_insn.self), code.count / 8, nil)
        }
        guard program >= 0 else { return TCKernelFeatures(ipv6ChecksumFlag: false) }
        defer { close(program) }
        var packet = [UInt8](repeating: 0, count: 64)
        let (result, retval) = packet.withUnsafeMutableBytes { bytes in
            withLibbpfOptions(bpf_test_run_opts.self) { options in
                options.pointee.data_in = UnsafeRawPointer(bytes.baseAddress)
                options.pointee.data_size_in = UInt32(bytes.count)
                options.pointee.repeat = 1
                return (bpf_prog_test_run_opts(program, options), options.pointee.retval)
            }
        }
        return TCKernelFeatures(ipv6ChecksumFlag: result == 0 && retval == 0)
    }
}
