// SPDX-License-Identifier: Apache-2.0
import CLibBPF
import CSystemShim
import Foundation
import Logging
import ReusePortLB
import SystemCalls
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// Attaching the XDP program through a BPF link, in namespaces this test creates: veth (native
/// XDP), a bridge (no native XDP: generic only), a foreign program in the way.
@Suite("XDP attach", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct XDPAttachTests {
    final class Namespace {
        let name = "xdpa-\(String(UInt32.random(in: 0...UInt32.max), radix: 16))"

        init() throws {
            for arguments in [
                ["netns", "add", name],
                ["-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                ["-n", name, "link", "add", "d0", "type", "bridge"],
                ["-n", name, "link", "set", "v0", "up"],
                ["-n", name, "link", "set", "v1", "up"],
                ["-n", name, "link", "set", "d0", "up"],
            ] {
                let result = try run("/usr/sbin/ip", arguments)
                try #require(result.status == 0, "ip \(arguments.joined(separator: " ")): \(result.output)")
            }
        }

        deinit { _ = try? run("/usr/sbin/ip", ["netns", "delete", name]) }

        /// `ip -d link show dev` of the interface (iproute2 6.1: "prog/xdp id N" in either mode, "xdpgeneric" among the flags in SKB mode).
        func link(_ interface: String) throws -> String {
            try run("/usr/sbin/ip", ["-n", name, "-d", "link", "show", "dev", interface]).output
        }

        /// `bpftool -j net show dev` of the interface, run inside the namespace.
        func bpftool(_ interface: String) throws -> String {
            try run("/usr/sbin/ip", ["netns", "exec", name, "/usr/sbin/bpftool", "-j", "net", "show", "dev", interface]).output
        }

        func attach(_ program: XDPProgram, _ interface: String, _ mode: XDPMode, _ logger: Logger) throws -> Result<XDPAttachment, XDPError> {
            try #require(inNetworkNamespace(name) {
                Result { () throws(XDPError) in try XDPAttachment.attach(program, interface: interface, mode: mode, logger: logger) }
            }, "namespace thread")
        }
    }

    @Test("auto on a veth: native; ip link shows our program; detach removes it")
    func autoNative() throws {
        let namespace = try Namespace()
        let program = try XDPProgram(maxFrameLength: 2048)
        defer { program.closeDescriptors() }
        let log = LogStore()
        let attachment = try namespace.attach(program, "v1", .auto, log.logger).get()
        #expect(attachment.attachedMode == .native)
        #expect(attachment.interface == "v1")
        #expect(attachment.isAttached)
        do {
            let linkText = try namespace.link("v1")
            #expect(linkText.contains("prog/xdp id \(program.programID) ") && !linkText.contains("xdpgeneric"), "\(linkText)")
        }
        #expect(log.contains("attached XDP program", key: "mode", value: "native"))
        #expect(log.contains("attached XDP program", key: "interface", value: "v1"))
        #expect(!log.contains("native XDP attach failed, trying SKB mode"))
        // The same program again on the same interface: refused by name, the first stays.
        switch try namespace.attach(program, "v1", .auto, log.logger) {
        case .success(let second):
            second.detach()
            Issue.record("attached twice")
        case .failure(let error):
            guard case .alreadyAttached("v1", program.programID) = error else { Issue.record("\(error)"); break }
            #expect(error.description.contains("attach once per interface"))
        }
        #expect(attachment.isAttached)
        do {
            let bpftoolText = try namespace.bpftool("v1")
            #expect(bpftoolText.contains("\"mode\":\"driver\"") && bpftoolText.contains("\"id\":\(program.programID)"), "bpftool net: \(bpftoolText)")
        }
        attachment.detach()
        #expect(!attachment.isAttached)
        do {
            let linkText = try namespace.link("v1")
            #expect(!linkText.contains("prog/xdp"), "\(linkText)")
        }
        do {
            let bpftoolText = try namespace.bpftool("v1")
            #expect(bpftoolText.contains("\"xdp\":[]"), "bpftool net: \(bpftoolText)")
        }
        attachment.detach()  // idempotent
    }

    @Test("generic on a veth: SKB mode; ip link shows xdpgeneric")
    func generic() throws {
        let namespace = try Namespace()
        let program = try XDPProgram(maxFrameLength: 2048)
        defer { program.closeDescriptors() }
        let log = LogStore()
        let attachment = try namespace.attach(program, "v1", .generic, log.logger).get()
        defer { attachment.detach() }
        #expect(attachment.attachedMode == .generic)
        do {
            let linkText = try namespace.link("v1")
            // iproute2 prints "xdpgeneric" among the flags and "prog/xdp id N" in either mode.
            #expect(linkText.contains(" xdpgeneric ") && linkText.contains("prog/xdp id \(program.programID) "), "\(linkText)")
        }
        #expect(log.contains("attached XDP program", key: "mode", value: "generic"))
    }

    @Test("A driver without native XDP: native fails naming xdp_mode; auto warns and falls back to generic")
    func fallback() throws {
        let namespace = try Namespace()
        let program = try XDPProgram(maxFrameLength: 2048)
        defer { program.closeDescriptors() }
        let log = LogStore()
        switch try namespace.attach(program, "d0", .native, log.logger) {
        case .success(let attachment):
            attachment.detach()
            Issue.record("native XDP attached on a bridge")
        case .failure(let error):
            guard case .attach(let interface, let mode, _) = error else { Issue.record("\(error)"); return }
            #expect(interface == "d0" && mode == .native)
            #expect(error.description.contains("xdp_mode: generic"), "\(error)")
        }
        let attachment = try namespace.attach(program, "d0", .auto, log.logger).get()
        defer { attachment.detach() }
        #expect(attachment.attachedMode == .generic)
        #expect(log.contains("native XDP attach failed, trying SKB mode", key: "interface", value: "d0"))
        #expect(log.contains("attached XDP program", key: "mode", value: "generic"))
        let bridgeText = try namespace.link("d0")
        #expect(bridgeText.contains(" xdpgeneric ") && bridgeText.contains("prog/xdp id \(program.programID) "), "\(bridgeText)")
    }

    @Test("A foreign XDP program on the interface: the error names its id, name and the fix; it stays attached")
    func foreignProgram() throws {
        let namespace = try Namespace()
        let (foreign, info) = try Self.attachForeignProgram(namespace, "v1")
        defer { close(foreign) }

        let program = try XDPProgram(maxFrameLength: 2048)
        defer { program.closeDescriptors() }
        for mode in XDPMode.allCases {
            switch try namespace.attach(program, "v1", mode, LogStore().logger) {
            case .success(let attachment):
                attachment.detach()
                Issue.record("\(mode): attached over a foreign program")
            case .failure(let error):
                guard case .foreignProgram(let interface, let id, let name, _) = error else { Issue.record("\(mode): \(error)"); continue }
                #expect(interface == "v1" && id == info.id && name == "other_xdp")
                let text = error.description
                // Attached in generic mode: `xdp off` would not remove it, `xdpgeneric off` does.
                for part in ["id \(info.id)", "'other_xdp'", "ip link set dev v1 xdpgeneric off", "bpftool link detach id N", "another interface"] {
                    #expect(text.contains(part), "\(mode): \(text) names \(part)")
                }
            }
        }
        do {
            let linkText = try namespace.link("v1")
            #expect(linkText.contains(" xdpgeneric ") && linkText.contains("prog/xdp id \(info.id) "), "the foreign program is left alone: \(linkText)")
        }
    }

    /// Loads a program of another tool ("other_xdp": XDP_PASS) and attaches it to `interface`
    /// through netlink in generic mode, as `ip link set dev X xdpgeneric` would: it stays until
    /// detached or the namespace goes. Returns its descriptor (the caller closes it) and info.
    static func attachForeignProgram(_ namespace: Namespace, _ interface: String) throws -> (Int32, bpf_prog_info) {
        // r0 = XDP_PASS (2); exit
        var instructions = [bpf_insn](repeating: bpf_insn(), count: 2)
        instructions[0].code = 0xb7  // BPF_ALU64 | BPF_MOV | BPF_K
        instructions[0].imm = 2
        instructions[1].code = 0x95  // BPF_JMP | BPF_EXIT
        let foreign = bpf_prog_load(BPF_PROG_TYPE_XDP, "other_xdp", "GPL", &instructions, 2, nil)
        try #require(foreign >= 0, "bpf_prog_load: errno \(errno)")
        var info = bpf_prog_info()
        var length = UInt32(MemoryLayout<bpf_prog_info>.size)
        let attached = inNetworkNamespace(namespace.name) { bpf_xdp_attach(Int32(if_nametoindex(interface)), foreign, XDPAttachment.skbMode, nil) }
        guard bpf_obj_get_info_by_fd(foreign, &info, &length) == 0, attached == 0 else {
            close(foreign)
            Issue.record("foreign program: info or bpf_xdp_attach (\(String(describing: attached))) failed: errno \(errno)")
            throw CancellationError()
        }
        return (foreign, info)
    }

    @Test("--check: an af_xdp listener's interface with a foreign XDP program is an error naming the program and the fix, as the start would be; OK once it is gone")
    func checkForeignProgram() throws {
        let namespace = try Namespace()
        let (foreign, info) = try Self.attachForeignProgram(namespace, "v1")
        defer { close(foreign) }
        let (check, file) = try Self.afXDPCheck(namespace, bind: "198.18.0.1:9000")
        defer { try? FileManager.default.removeItem(at: file) }
        try Self.expectRefused(check, key: "listeners[0].interface",
                               naming: ["listener 'x'", "id \(info.id)", "'other_xdp'", "ip link set dev v1 xdpgeneric off", "another interface"])
        // Attached in generic mode: `xdp off` alone would ask the driver mode and leave it there.
        let detached = try run("/usr/sbin/ip", ["-n", namespace.name, "link", "set", "dev", "v1", "xdpgeneric", "off"])
        try #require(detached.status == 0, "\(detached.output)")
        let accepted = try run("/usr/sbin/ip", check)
        #expect(accepted.status == 0 && accepted.output.contains("configuration OK"), "\(accepted.status): \(accepted.output)")
    }

    @Test("--check: an af_xdp listener whose bind another process holds is an error naming it, as the start's companion socket would be (operator finding)")
    func checkHeldBind() throws {
        let namespace = try Namespace()
        // This test process holds the bind inside the namespace, as another program would.
        let holder = try #require(inNetworkNamespace(namespace.name) { () -> Int32? in
            guard let fd = try? Syscall.socket(AF_INET, Socket.datagram | Socket.closeOnExec) else { return nil }
            guard (try? Syscall.bind(fd, SocketAddress("0.0.0.0:9000")!)) != nil else {
                Syscall.close(fd)
                return nil
            }
            return fd
        } ?? nil, "hold 0.0.0.0:9000 in \(namespace.name)")
        defer { Syscall.close(holder) }
        let (check, file) = try Self.afXDPCheck(namespace, bind: "0.0.0.0:9000")
        defer { try? FileManager.default.removeItem(at: file) }
        try Self.expectRefused(check, key: "listeners[0].bind",
                               naming: ["0.0.0.0:9000 is already served by another process", "pid \(getpid())", "stop it or use another bind"])
    }

    /// `ip netns exec <namespace> udp-fanout --check` of a file with one af_xdp listener `x` on
    /// `bind` at v1 (the caller removes the file).
    static func afXDPCheck(_ namespace: Namespace, bind: String) throws -> (command: [String], file: URL) {
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("xdp-check-\(UUID().uuidString).yaml")
        try """
            listeners:
              - name: x
                bind: "\(bind)"
                interface: v1
                mode: af_xdp
                settings: {xdp_mode: generic}
                downstream: [{address: "198.18.1.2:9000"}]
            """.write(to: file, atomically: true, encoding: .utf8)
        return (["netns", "exec", namespace.name, binaryDirectory.appendingPathComponent("udp-fanout").path, "--check", "-c", file.path], file)
    }

    /// The check exits 2, does not say OK, and its line for `key` names every part.
    static func expectRefused(_ check: [String], key: String, naming parts: [String]) throws {
        let refused = try run("/usr/sbin/ip", check)
        #expect(refused.status == 2, "exit \(refused.status): \(refused.output)")
        #expect(!refused.output.contains("configuration OK"), "\(refused.output)")
        let line = refused.output.split(separator: "\n").first { $0.contains(key) } ?? ""
        for part in parts {
            #expect(line.contains(part), "names \(part): \(refused.output)")
        }
    }

    @Test("Unknown interface: the error names it")
    func unknownInterface() throws {
        let namespace = try Namespace()
        let program = try XDPProgram(maxFrameLength: 2048)
        defer { program.closeDescriptors() }
        guard case .failure(let error) = try namespace.attach(program, "nosuch0", .auto, LogStore().logger),
              case .interfaceNotFound("nosuch0") = error else {
            Issue.record("attached to a missing interface")
            return
        }
        #expect(error.description.contains("'nosuch0'"))
    }

    @Test("The interface deleted under the link: isAttached turns false (the watchdog's check)")
    func interfaceDeleted() throws {
        let namespace = try Namespace()
        let program = try XDPProgram(maxFrameLength: 2048)
        defer { program.closeDescriptors() }
        let attachment = try namespace.attach(program, "v1", .auto, LogStore().logger).get()
        defer { attachment.detach() }
        #expect(attachment.isAttached)
        let deleted = try run("/usr/sbin/ip", ["-n", namespace.name, "link", "delete", "v1"])
        try #require(deleted.status == 0, "\(deleted.output)")
        #expect(!attachment.isAttached)
    }

    @Test("kill -9 of the process holding the link leaves nothing attached")
    func killedHolder() throws {
        let namespace = try Namespace()
        let program = try XDPProgram(maxFrameLength: 2048)
        defer { program.closeDescriptors() }
        let attachment = try namespace.attach(program, "v1", .auto, LogStore().logger).get()
        defer { attachment.detach() }
        // A child (sleep) holds a copy of the link as its descriptor 3; this process lets go of
        // its own. The link then lives exactly as long as the child, as it would in a daemon.
        let linkFD = attachment.link.withLock { $0 }
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        posix_spawn_file_actions_adddup2(&actions, linkFD, 3)
        var pid: pid_t = 0
        let argv: [UnsafeMutablePointer<CChar>?] = [strdup("/bin/sleep"), strdup("30"), nil]
        defer { for argument in argv { free(argument) } }
        let spawned = posix_spawn(&pid, "/bin/sleep", &actions, nil, argv, environ)
        try #require(spawned == 0, "posix_spawn: \(spawned)")
        var reaped = false
        defer {
            if !reaped {
                kill(pid, SIGKILL)
                var status: Int32 = 0
                waitpid(pid, &status, 0)
            }
        }
        // Let go of our copy only, as a stop that hands over does (`detach()` would take the
        // program off the hook whoever holds the link: BPF_LINK_DETACH).
        attachment.detach(quietly: true)
        do {
            let linkText = try namespace.link("v1")
            #expect(linkText.contains("prog/xdp id \(program.programID) "), "the child's copy keeps it attached")
        }
        kill(pid, SIGKILL)
        var status: Int32 = 0
        #expect(waitpid(pid, &status, 0) == pid)
        reaped = true
        // The kernel releases the link when the killed process's descriptors are closed, which
        // is done by the time waitpid returns; a short bounded wait covers deferred release.
        var output = try namespace.link("v1")
        for _ in 0..<50 where output.contains("prog/xdp") {
            usleep(20_000)
            output = try namespace.link("v1")
        }
        #expect(!output.contains("prog/xdp"), "nothing attached after kill -9: \(output)")
        do {
            let bpftoolText = try namespace.bpftool("v1")
            #expect(bpftoolText.contains("\"xdp\":[]"), "bpftool net: \(bpftoolText)")
        }
    }
}
