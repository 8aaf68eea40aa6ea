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

extension TCKernelFeatures {
    /// Why this kernel cannot decrypt QUIC-LB connection IDs in tc_ebpf and xdp, nil when it can:
    /// the programs use the BPF crypto kfuncs (`bpf_crypto_decrypt`, Linux 6.10+), found in the
    /// kernel's BTF. Looked up once.
    static let quicCryptoProblem: String? = cryptoProblem(functions: ["bpf_crypto_ctx_create", "bpf_crypto_encrypt", "bpf_crypto_decrypt"])

    /// The first of `functions` the kernel's BTF lacks, as the problem; nil when it has them all.
    static func cryptoProblem(functions: [String]) -> String? {
        guard let btf = btf__load_vmlinux_btf() else {
            return "this kernel's BTF (/sys/kernel/btf/vmlinux) cannot be read, so its BPF crypto kfuncs cannot be found"
        }
        defer { btf__free(btf) }
        let functionKind: UInt32 = 12  // BTF_KIND_FUNC (linux/btf.h; two modules import it)
        for function in functions
        where btf__find_by_name_kind(btf, function, functionKind) < 0 {
            return "this kernel has no BPF crypto kfunc \(function) (Linux 6.10 and later have them)"
        }
        return nil
    }
}
