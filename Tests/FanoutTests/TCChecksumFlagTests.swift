// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import CLibBPF
import CSystemShim
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// IPv6 UDP checksum updates pass BPF_F_IPV6 to bpf_l4_csum_replace where the kernel has the
/// flag: without it the kernel adjusts skb->csum of a CHECKSUM_COMPLETE packet as for IPv4,
/// which is wrong once IPv6 addresses change. Older kernels refuse the flag (EINVAL), so it is
/// probed at start and handed to the program as a read-only global.
@Suite("tc program: BPF_F_IPV6 probe", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct TCChecksumFlagTests {
    /// The loaded program's read-only data, read back from the kernel by the program's map ids.
    static func rodata(of program: Int32) throws -> [UInt8] {
        var ids = [UInt32](repeating: 0, count: 16)
        var info = bpf_prog_info()
        var length = UInt32(MemoryLayout<bpf_prog_info>.size)
        info.nr_map_ids = UInt32(ids.count)
        try ids.withUnsafeMutableBufferPointer { buffer in
            info.map_ids = UInt64(UInt(bitPattern: buffer.baseAddress))
            try #require(bpf_obj_get_info_by_fd(program, &info, &length) == 0)
        }
        for id in ids.prefix(Int(info.nr_map_ids)) {
            let fd = bpf_map_get_fd_by_id(id)
            try #require(fd >= 0)
            defer { close(fd) }
            var mapInfo = bpf_map_info()
            var mapLength = UInt32(MemoryLayout<bpf_map_info>.size)
            try #require(bpf_obj_get_info_by_fd(fd, &mapInfo, &mapLength) == 0)
            let name = withUnsafeBytes(of: mapInfo.name) { String(decoding: $0.prefix(while: { $0 != 0 }), as: UTF8.self) }
            guard name.hasSuffix(".rodata") else { continue }
            var key: UInt32 = 0
            var value = [UInt8](repeating: 0, count: Int(mapInfo.value_size))
            try #require(bpf_map_lookup_elem(fd, &key, &value) == 0)
            return value
        }
        Issue.record("the program has no .rodata map: nothing configures its checksum flags")
        return []
    }

    @Test("This kernel (6.18) has BPF_F_IPV6: the probe says so, and the loaded program carries the flag in its read-only options")
    func flagSet() throws {
        #expect(TCKernelFeatures.probe().ipv6ChecksumFlag, "bpf_l4_csum_replace accepts BPF_F_IPV6 since 6.15")
        let program = try TCProgram()
        defer { program.closeDescriptors() }
        let rodata = try Self.rodata(of: program.program)
        try #require(rodata.count >= MemoryLayout<fanout_tc_options>.size)
        let options = rodata.withUnsafeBytes { $0.loadUnaligned(as: fanout_tc_options.self) }
        #expect(options.ipv6_csum_flags == UInt64(BPF_F_IPV6))
    }

    @Test("A kernel without the flag gets a program without it (the option is what the probe found)")
    func flagFromProbe() throws {
        let program = try TCProgram(features: TCKernelFeatures(ipv6ChecksumFlag: false))
        defer { program.closeDescriptors() }
        let options = try Self.rodata(of: program.program).withUnsafeBytes { $0.loadUnaligned(as: fanout_tc_options.self) }
        #expect(options.ipv6_csum_flags == 0)
    }
}
