// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import BPFObjects
import BPFSupport
import CLibBPF
import CSystemShim
import Foundation
import Testing
import TestSupport
@testable import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif
import SystemCalls

/// Least privilege: eBPF steering as a non-root user with only CAP_BPF, and
/// the fallback to classic BPF on every bpffs problem.
@Suite("Least privilege", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct LeastPrivilegeTests {
    /// uid/gid nobody keeping only CAP_BPF (ambient, so it survives the exec): the whole set
    /// eBPF steering needs (CAP_NET_ADMIN only adds SO_RCVBUFFORCE).
    static let bpfOnly = ["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          "--inh-caps=-all,+bpf", "--ambient-caps=-all,+bpf", "--bounding-set=-all,+bpf"]

    /// A scratch directory with a copy of the collector that nobody can execute, and a mount
    /// point; everything is removed (and unmounted) by `close()`.
    final class Scratch {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("rplb-lp-\(UUID().uuidString)")
        var collector: String { directory.appendingPathComponent("collector").path }
        var mountPoint: String { directory.appendingPathComponent("bpffs").path }
        var mounted = false

        init(bpffs: Bool, mode: mode_t) throws {
            try FileManager.default.createDirectory(atPath: mountPoint, withIntermediateDirectories: true)
            try FileManager.default.copyItem(atPath: binaryDirectory.appendingPathComponent("collector").path, toPath: collector)
            chmod(directory.path, 0o755)
            chmod(collector, 0o755)
            if bpffs {
                try #require(mount("bpf", mountPoint, "bpf", 0, nil) == 0, "mount bpffs: errno \(errno)")
                mounted = true
            }
            chmod(mountPoint, mode)
        }

        deinit {
            if mounted { umount2(mountPoint, Int32(MNT_DETACH)) }
            try? FileManager.default.removeItem(at: directory)
        }
    }

    @Test("uid nobody with only CAP_BPF: eBPF steering loads and steers")
    func capBPFOnly() throws {
        let scratch = try Scratch(bpffs: true, mode: 0o777)
        let port = freePort()
        let children = try (0..<2).map { index in
            let child = try Child(scratch.collector, ["127.0.0.1", String(port), String(index), "2", "--steering", "ebpf",
                                                      "--bpffs", scratch.mountPoint], prefix: Self.bpfOnly)
            try child.waitFor("ready")
            return child
        }
        let publisher = try Child("publisher", ["127.0.0.1", String(port), "400", "--sources", "127.0.7.10-127.0.7.49", "--rate", "20000"])
        #expect(publisher.wait(seconds: 20) == 0)
        usleep(200_000)
        let reports = try children.map { try $0.stop() }
        #expect(reports.allSatisfy { $0["steering"] as? String == "ebpf" }, "\(reports)")
        #expect(reports.map { $0.int("received") }.reduce(0, +) == 400)
        var owner: [String: Int] = [:]
        for report in reports {
            for source in report.object("sources").keys {
                #expect(owner[source] == nil, "\(source) reached two collectors")
                owner[source] = report.int("slot")
            }
        }
        #expect(owner.count == 40)
        #expect(reports[0].object("kernel").int("selected") == 400)
    }

    @Test("Same user, no CAP_BPF: refused by the user's eBPF group; with --force the eBPF collector reports classicBPF")
    func noCapabilityRefused() throws {
        let scratch = try Scratch(bpffs: true, mode: 0o777)
        let port = freePort()
        let noCapabilities = ["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              "--inh-caps=-all", "--bounding-set=-all"]
        let arguments = { (slot: Int) in ["127.0.0.1", String(port), String(slot), "2", "--bpffs", scratch.mountPoint] }
        let ebpf = try Child(scratch.collector, arguments(0), prefix: Self.bpfOnly)
        try ebpf.waitFor("steering=ebpf")
        let refused = try Child(scratch.collector, arguments(1), prefix: noCapabilities)
        #expect(refused.wait(seconds: 10) == 2)
        #expect(refused.stderr.contains("runs eBPF steering") && refused.stderr.contains("CAP_BPF"), "\(refused.stderr)")
        let forced = try Child(scratch.collector, arguments(1) + ["--force"], prefix: noCapabilities)
        try forced.waitFor("ready")
        try ebpf.waitFor("steering changed from ebpf to classicBPF")
        #expect(try ebpf.stop()["steering"] as? String == "classicBPF")
        #expect(try forced.stop()["steering"] as? String == "classicBPF")
    }

    /// A collector with CAP_BPF alone and steering automatic on `scratch`'s bpffs path: it must
    /// run with classic BPF and say why, naming the path and `reason`.
    func expectClassicFallback(_ scratch: Scratch, reason: String) throws {
        let child = try Child(scratch.collector, ["127.0.0.1", String(freePort()), "0", "1", "--bpffs", scratch.mountPoint],
                              prefix: Self.bpfOnly)
        try child.waitFor("ready")
        let report = try child.stop()
        #expect(report["steering"] as? String == "classicBPF")
        let note = report["steering_note"] as? String ?? ""
        #expect(note.contains(scratch.mountPoint) && note.contains(reason), "\(note)")
    }

    @Test("automatic, CAP_BPF, bpffs not writable for the user (EACCES): classic BPF, saying why")
    func bpffsNotWritable() throws {
        try expectClassicFallback(Scratch(bpffs: true, mode: 0o755), reason: "Permission denied")
    }

    @Test("automatic, CAP_BPF, bpffs not mounted and not mountable (no CAP_SYS_ADMIN): classic BPF, saying why")
    func bpffsNotMountable() throws {
        try expectClassicFallback(Scratch(bpffs: false, mode: 0o755), reason: "not mounted")
    }

    @Test("A program the verifier refuses: the error carries the verifier's log, not only errno 22")
    func verifierLog() throws {
        do throws(SystemCallError) {
            _ = try loadEmbeddedObject(.reuseportSelect, program: RPLB_PROG_SELECT_NAME, maps: []) { object throws(SystemCallError) in
                // The program's first instruction (after a 16-byte load, if that comes first)
                // becomes a read of r5, which nothing initialised: same length, so the BTF
                // line info stays valid and only the verifier objects.
                let program = bpf_object__find_program_by_name(object, RPLB_PROG_SELECT_NAME)
                let count = Int(bpf_program__insn_cnt(program))
                var instructions = Array(UnsafeBufferPointer(start: bpf_program__insns(program), count: count))
                let first = instructions[0].code == UInt8(BPF_LD | BPF_IMM | BPF_DW) ? 2 : 0
                instructions[first] = bpf_insn()
                instructions[first].code = UInt8(BPF_ALU64 | BPF_MOV | BPF_X)
                instructions[first].dst_reg = 0
                instructions[first].src_reg = 5
                try libbpfCall("bpf_program__set_insns") { bpf_program__set_insns(program, &instructions, count) }
            }
            Issue.record("the verifier accepted a program it must refuse")
        } catch {
            #expect(error.errno == EACCES || error.errno == EINVAL)
            #expect(error.description.contains("verifier:") && error.description.contains("R5 !read_ok"), "\(error)")
        }
    }
}
