// SPDX-License-Identifier: Apache-2.0
import CLibBPF

/// BPF_PROG_TEST_RUN, the one harness the tc and XDP program tests share.
public enum ProgramTestRun {
    /// Runs `program` once on `frame` with `context` (`__sk_buff` for tc, `xdp_md` for XDP), from
    /// the calling thread (which must be in the namespace of the interfaces the context names).
    /// `flags`: BPF_PROG_TEST_RUN's (BPF_F_TEST_SKB_CHECKSUM_COMPLETE, kernel 6.11: the skb
    /// arrives CHECKSUM_COMPLETE, and the kernel refuses the run with -EBADMSG if the program
    /// left its `skb->csum` wrong; older kernels refuse the flag, EINVAL).
    /// - Returns: libbpf's result (0 or -errno), the program's return value, and the length of
    ///   the frame as the program left it in `output`.
    public static func run<Context>(_ program: Int32, _ frame: [UInt8], context: Context, output: inout [UInt8],
                                flags: UInt32 = 0) -> (result: Int32, retval: UInt32, size: Int) {
        var input = frame
        var context = context
        var options = bpf_test_run_opts()
        options.sz = MemoryLayout<bpf_test_run_opts>.offset(of: \.batch_size)! + 4
        let result = input.withUnsafeMutableBytes { inBytes in
            output.withUnsafeMutableBytes { outBytes in
                withUnsafeMutablePointer(to: &context) { contextPointer in
                    options.data_in = UnsafeRawPointer(inBytes.baseAddress)
                    options.data_size_in = UInt32(inBytes.count)
                    options.data_out = outBytes.baseAddress
                    options.data_size_out = UInt32(outBytes.count)
                    options.ctx_in = UnsafeRawPointer(contextPointer)
                    options.ctx_size_in = UInt32(MemoryLayout<Context>.size)
                    options.repeat = 1
                    options.flags = flags
                    return bpf_prog_test_run_opts(program, &options)
                }
            }
        }
        return (result, options.retval, Int(options.data_size_out))
    }
}
