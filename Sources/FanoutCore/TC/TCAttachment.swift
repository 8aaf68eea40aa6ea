// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import BPFSupport
import CLibBPF
import CSystemShim
import Logging
import ReusePortLB
import SystemCalls

/// The program attached at one interface's ingress: a TCX bpf_link (the kernel detaches it when
/// the descriptor closes, so a crash leaves nothing), or a cls_bpf filter on clsact.
///
/// A lock file per interface and network namespace (`/run/udp-fanout/tc-net<inode>-<ifname>.lock`)
/// is held while attached: a second daemon on the same interface is refused, and a filter of
/// ours found while we hold the lock is a crashed run's leftover, removed before attaching.
final class TCAttachment: @unchecked Sendable {  // owned and closed by TCDataplane under its lock
    enum Kind: Equatable {
        case tcx(link: Int32)
        case clsact(createdQdisc: Bool)
    }

    let interface: String
    let ifindex: Int32
    let kind: Kind
    private let lock: Int32
    private let lockPath: String
    private let logger: Logger

    /// Filter handle and priority of our clsact filter: how a later run recognizes it.
    static let filterHandle: UInt32 = 0xFA27
    static let filterPriority: UInt32 = 1
    static let lockDirectory = "/run/udp-fanout"
    /// BPF_TCX_INGRESS: the kernel's value (6.6+); not in this system's libbpf headers.
    static let tcxIngress = bpf_attach_type(rawValue: 46)

    init(interface: String, program: TCProgram, mode: TCAttach, logger: Logger) throws(TCError) {
        self.interface = interface
        self.logger = logger
        ifindex = Int32(if_nametoindex(interface))
        guard ifindex > 0 else { throw .interfaceNotFound(interface) }
        (lock, lockPath) = try Self.takeLock(interface: interface)
        let created: Bool
        do {
            created = try Self.removeLeftovers(ifindex: ifindex, interface: interface, lockPath: lockPath)
        } catch {
            Self.release(lock: lock, path: lockPath)
            throw error
        }
        if mode != .clsact {
            let link = bpf_link_create(program.program, ifindex, Self.tcxIngress, nil)
            if link >= 0 {
                kind = .tcx(link: link)
                // A clsact qdisc a crashed clsact run created is a leftover too.
                if created { Self.destroyQdiscIfUnused(ifindex, interface: interface, logger: logger) }
                Self.writeState(lockPath, createdQdisc: false)
                return
            }
            let error = errno
            if mode == .tcx || (error != EINVAL && error != EOPNOTSUPP) {
                Self.release(lock: lock, path: lockPath)
                throw .attach(interface: interface, SystemCallError(call: "bpf_link_create BPF_TCX_INGRESS", errno: error))
            }
        }
        do {
            kind = .clsact(createdQdisc: try Self.attachFilter(ifindex: ifindex, interface: interface, program: program.program, lockPath: lockPath,
                                                               createdBefore: created, logger: logger))
        } catch {
            Self.release(lock: lock, path: lockPath)
            throw .attach(interface: interface, error)
        }
    }

    /// Takes over the TCX link a previous process attached at `interface` (handed over by the
    /// service manager, ``DescriptorStore``): it keeps running the previous program, on the
    /// previous plan, until ``swap(to:)``, so no datagram meets an empty hook meanwhile.
    /// - Throws: `.adoption` (the link is left to the caller to close) if it is not a TCX ingress
    ///   link at this interface; the lock's errors.
    init(adopting link: Int32, interface: String, logger: Logger) throws(TCError) {
        self.interface = interface
        self.logger = logger
        ifindex = Int32(if_nametoindex(interface))
        guard ifindex > 0 else { throw .interfaceNotFound(interface) }
        guard let info = Self.linkInfo(link) else {
            throw .adoption(interface: interface, reason: "the descriptor handed over is not a BPF link (\(String(cString: strerror(errno))))")
        }
        guard info.type == Self.tcxLinkType, info.ifindex == UInt32(ifindex), info.attachType == Self.tcxIngress.rawValue else {
            throw .adoption(interface: interface, reason: "the link handed over is of type \(info.type) at ifindex \(info.ifindex) (attach type \(info.attachType)), not TCX ingress at ifindex \(ifindex): the interface was recreated, or the link is another program's")
        }
        (lock, lockPath) = try Self.takeLock(interface: interface)
        kind = .tcx(link: link)
        Self.writeState(lockPath, createdQdisc: false)
    }

    /// BPF_LINK_TYPE_TCX: the kernel's value (6.6+); not in this system's headers.
    static let tcxLinkType: UInt32 = 11

    /// A link's type, its interface and attach type (struct bpf_link_info's `tcx` or `xdp`
    /// member, read raw: this system's headers predate TCX); nil if it is not a link.
    static func linkInfo(_ fd: Int32) -> (type: UInt32, programID: UInt32, ifindex: UInt32, attachType: UInt32)? {
        var words = [UInt32](repeating: 0, count: 64)
        var length = UInt32(words.count * 4)
        guard bpf_obj_get_info_by_fd(fd, &words, &length) == 0, length >= 24 else { return nil }
        // type, id, prog_id, then the union at offset 16 (8-byte aligned): ifindex, attach_type.
        return (words[0], words[2], words[4], words[5])
    }

    /// Makes the link run `program` in place of the one it runs (bpf_link_update: atomic, every
    /// packet sees one program or the other).
    func swap(to program: TCProgram) throws(TCError) {
        guard case .tcx(let link) = kind else { return }
        do {
            try libbpfCall("bpf_link_update (TCX ingress at \(interface))") { bpf_link_update(link, program.program, nil) }
        } catch {
            throw .attach(interface: interface, error)
        }
    }

    /// The TCX link's descriptor (nil for a clsact filter, which the service manager cannot keep).
    var link: Int32? {
        if case .tcx(let link) = kind { return link }
        return nil
    }

    var kindName: String {
        switch kind {
        case .tcx: return "tcx"
        case .clsact: return "clsact"
        }
    }

    /// Detaches, removes the clsact qdisc if we created it and no other filter is on it,
    /// releases the lock.
    func detach() {
        switch kind {
        case .tcx(let link):
            close(link)
        case .clsact(let createdQdisc):
            var hook = Self.hook(ifindex)
            var options = Self.filterOptions()
            let detached = bpf_tc_detach(&hook, &options)
            var queryHook = Self.hook(ifindex)
            var query = Self.filterOptions()
            if detached != 0 && detached != -ENOENT && [-ENOENT, -EINVAL, -ENODEV].contains(bpf_tc_query(&queryHook, &query)) {
                // EINVAL or ENODEV, and no filter in our slot: the qdisc or the interface was
                // deleted under us, taking the filter with it. Nothing is left to remove.
                logger.notice("the tc_ebpf filter was already gone (its clsact qdisc or interface was removed)", metadata: [
                    "interface": "\(interface)", "error": "\(SystemCallError(call: "bpf_tc_detach", errno: -detached))",
                ])
            } else if detached != 0 && detached != -ENOENT {
                // Our filter stays on the interface: say so, with the command that removes it.
                logger.error("could not detach the tc_ebpf filter; remove it by hand", metadata: [
                    "interface": "\(interface)", "error": "\(SystemCallError(call: "bpf_tc_detach", errno: -detached))",
                    "command": "tc filter del dev \(interface) ingress handle 0x\(String(options.handle, radix: 16)) prio \(options.priority) bpf",
                ])
            } else if createdQdisc {
                Self.destroyQdiscIfUnused(ifindex, interface: interface, logger: logger)
            }
        }
        Self.release(lock: lock, path: lockPath)
    }

    /// Nil while our program is still attached at the interface's ingress, else what the kernel
    /// says instead (the interface was deleted, the qdisc or filter removed, another program in
    /// our place): the systemd watchdog's check of the tc_ebpf path, one syscall or netlink dump.
    /// - Parameter programID: the kernel's id of our loaded program.
    func attachmentProblem(programID: UInt32) -> String? {
        switch kind {
        case .tcx:
            // BPF_PROG_QUERY on the interface's TCX ingress (the kernel detaches the link when the
            // interface goes away).
            var ids = [UInt32](repeating: 0, count: 64)
            var count = UInt32(ids.count)
            var flags: UInt32 = 0
            let result = bpf_prog_query(ifindex, Self.tcxIngress, 0, &flags, &ids, &count)
            if result != 0 { return "\(SystemCallError(call: "bpf_prog_query BPF_TCX_INGRESS ifindex \(ifindex)", errno: errno))" }
            return ids.prefix(Int(count)).contains(programID) ? nil : "program id \(programID) is not among the \(count) TCX ingress program(s)"
        case .clsact:
            var hook = Self.hook(ifindex)
            var options = Self.filterOptions()
            options.prog_fd = 0
            let result = bpf_tc_query(&hook, &options)
            if result != 0 { return "\(SystemCallError(call: "bpf_tc_query ingress handle 0x\(String(Self.filterHandle, radix: 16))", errno: -result))" }
            return options.prog_id == programID ? nil : "the filter runs program id \(options.prog_id), not ours (\(programID))"
        }
    }

    // MARK: clsact

    static func hook(_ ifindex: Int32) -> bpf_tc_hook {
        var hook = bpf_tc_hook()
        // sz ends at the last field: libbpf rejects nonzero bytes past it, and Swift does not
        // promise zeroed tail padding.
        hook.sz = MemoryLayout<bpf_tc_hook>.offset(of: \.parent)! + MemoryLayout<UInt32>.size
        hook.ifindex = ifindex
        hook.attach_point = BPF_TC_INGRESS
        return hook
    }

    /// Deletes the clsact qdisc we created, unless another party added a filter to it since
    /// (deleting the qdisc deletes every filter on it): then it stays, and the log says so.
    static func destroyQdiscIfUnused(_ ifindex: Int32, interface: String, logger: Logger) {
        let others: Int
        do {
            others = try filterCount(ifindex)
        } catch {
            logger.warning("kept the clsact qdisc udp-fanout created: cannot list its filters to know it is unused", metadata: [
                "interface": "\(interface)", "error": "\(error)", "remove_with": "tc qdisc del dev \(interface) clsact",
            ])
            return
        }
        guard others == 0 else {
            logger.notice("kept the clsact qdisc udp-fanout created: other filters are on it now", metadata: [
                "interface": "\(interface)", "filters": "\(others)",
            ])
            return
        }
        destroyQdisc(ifindex)
    }

    /// Filters on the clsact qdisc's ingress and egress hooks (RTM_GETTFILTER dumps; each
    /// priority's head and each filter are one message, so any message is a filter).
    static func filterCount(_ ifindex: Int32) throws(SystemCallError) -> Int {
        var count = 0
        for parent: UInt32 in [0xFFFF_FFF2, 0xFFFF_FFF3] {  // TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS / _EGRESS)
            // tcmsg: family, pad, pad, ifindex, handle, parent, info.
            var body: [UInt8] = [0, 0, 0, 0]
            Rtnetlink.append32(&body, UInt32(bitPattern: ifindex))
            Rtnetlink.append32(&body, 0)
            Rtnetlink.append32(&body, parent)
            Rtnetlink.append32(&body, 0)
            for message in try Rtnetlink.request(type: 46, flags: 0x300, body: body) {  // RTM_GETTFILTER, NLM_F_DUMP
                if message.type == Rtnetlink.error {
                    let code = Rtnetlink.errorCode(message)
                    if code != 0 { throw SystemCallError(call: "RTM_GETTFILTER dump", errno: code) }
                } else if message.type == 44 {  // RTM_NEWTFILTER
                    count += 1
                }
            }
        }
        return count
    }

    /// Deletes the clsact qdisc (with every filter on it).
    private static func destroyQdisc(_ ifindex: Int32) {
        var hook = hook(ifindex)
        hook.attach_point = bpf_tc_attach_point(BPF_TC_INGRESS.rawValue | BPF_TC_EGRESS.rawValue)
        bpf_tc_hook_destroy(&hook)
    }

    static func filterOptions(program: Int32 = 0) -> bpf_tc_opts {
        var options = bpf_tc_opts()
        options.sz = MemoryLayout<bpf_tc_opts>.offset(of: \.priority)! + MemoryLayout<UInt32>.size
        options.handle = filterHandle
        options.priority = filterPriority
        options.prog_fd = program
        return options
    }

    /// Creates clsact unless present, adds our filter. Returns whether the qdisc is ours.
    private static func attachFilter(ifindex: Int32, interface: String, program: Int32, lockPath: String, createdBefore: Bool,
                                     logger: Logger) throws(SystemCallError) -> Bool {
        var hook = hook(ifindex)
        let result = bpf_tc_hook_create(&hook)
        let created: Bool
        if result == -EEXIST {
            created = createdBefore
        } else {
            try libbpfCall("bpf_tc_hook_create clsact") { result }
            created = true
        }
        // Recorded before the filter exists: a crash right after still lets the next run
        // remove the qdisc it made.
        writeState(lockPath, createdQdisc: created)
        // No replace: a crashed run's filter is gone (removeLeftovers), and anything holding our
        // handle and priority now is refused with EEXIST rather than overwritten.
        var options = filterOptions(program: program)
        do {
            try libbpfCall("bpf_tc_attach ingress handle 0x\(String(filterHandle, radix: 16)) pref \(filterPriority)") { bpf_tc_attach(&hook, &options) }
        } catch {
            if created { destroyQdiscIfUnused(ifindex, interface: interface, logger: logger) }
            throw error
        }
        return created
    }

    /// Removes a filter of ours that a crashed run left (our handle and priority, and a program
    /// named like ours). Returns whether that run recorded creating the clsact qdisc.
    private static func removeLeftovers(ifindex: Int32, interface: String, lockPath: String) throws(TCError) -> Bool {
        let createdBefore = readState(lockPath)
        var hook = hook(ifindex)
        var query = filterOptions()
        guard bpf_tc_query(&hook, &query) == 0, query.prog_id != 0 else { return createdBefore }
        let fd = bpf_prog_get_fd_by_id(query.prog_id)
        guard fd >= 0 else { return createdBefore }
        defer { close(fd) }
        var info = bpf_prog_info()
        var length = UInt32(MemoryLayout<bpf_prog_info>.size)
        guard bpf_obj_get_info_by_fd(fd, &info, &length) == 0 else { return createdBefore }
        let name = withUnsafeBytes(of: info.name) { String(decoding: $0.prefix(while: { $0 != 0 }), as: UTF8.self) }
        guard name == FANOUT_PROG_TC_NAME else { throw .filterSlotTaken(interface: interface, program: name) }
        var options = filterOptions()
        do {
            try libbpfCall("bpf_tc_detach leftover filter") { bpf_tc_detach(&hook, &options) }
        } catch {
            throw .attach(interface: interface, error)
        }
        return createdBefore
    }

    // MARK: lock file

    private static func takeLock(interface: String) throws(TCError) -> (Int32, String) {
        mkdir(lockDirectory, 0o755)
        let path = "\(lockDirectory)/tc-net\(networkNamespaceInode())-\(interface).lock"
        let fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0o644)
        guard fd >= 0 else { throw .lockFile(path: path, SystemCallError(call: "open \(path)", errno: errno)) }
        if flock(fd, LOCK_EX | LOCK_NB) != 0 {
            close(fd)
            throw .interfaceBusy(interface, lockPath: path)
        }
        return (fd, path)
    }

    private static func release(lock: Int32, path: String) {
        unlink(path)
        close(lock)
    }

    private static func writeState(_ path: String, createdQdisc: Bool) {
        let text = "created_clsact=\(createdQdisc ? 1 : 0)\npid=\(getpid())\n"
        let fd = open(path, O_WRONLY | O_TRUNC | O_CLOEXEC)
        guard fd >= 0 else { return }
        _ = text.utf8CString.withUnsafeBytes { write(fd, $0.baseAddress, $0.count - 1) }
        close(fd)
    }

    private static func readState(_ path: String) -> Bool {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return false }
        defer { close(fd) }
        var buffer = [UInt8](repeating: 0, count: 256)
        let count = read(fd, &buffer, buffer.count)
        return count > 0 && String(decoding: buffer[0..<count], as: UTF8.self).contains("created_clsact=1")
    }
}

/// Why a tc_ebpf listener could not start.
package enum TCError: Error, CustomStringConvertible, Sendable {
    /// `flowTemplates`: the listener follows flow templates, which needs CAP_NET_RAW too.
    case privileges(missing: [String], flowTemplates: Bool = false)
    case interfaceNotFound(String)
    case interfaceBusy(String, lockPath: String)
    case forwardingDisabled(interface: String, sysctl: String)
    case load(SystemCallError)
    case attach(interface: String, SystemCallError)
    case maps(SystemCallError)
    case filterSlotTaken(interface: String, program: String)
    case tooManyListeners
    case lockFile(path: String, SystemCallError)
    /// A `settings.reply_interfaces` entry of a nat listener that names no interface.
    case replyInterfaceNotFound(listener: String, interface: String)
    /// The xdp kind's XDP program in front of the tc program: it could not load or attach.
    case xdpLoad(SystemCallError)
    case xdpAttach(XDPError)
    /// A link handed over by the previous process that cannot be taken over (why).
    case adoption(interface: String, reason: String)

    package var description: String {
        switch self {
        case .privileges(let missing, let flowTemplates):
            let list = missing.count > 1 ? missing.dropLast().joined(separator: ", ") + " and " + missing.last! : missing.joined()
            // settings.flow_templates adds CAP_NET_RAW to the kind's three: every fix named grants it.
            let raw = flowTemplates || missing.contains { $0.hasPrefix("CAP_NET_RAW") }
            let needed = ["CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON"] + (raw ? ["CAP_NET_RAW"] : [])
            let all = missing.count < needed.count ? " (it needs \(needed.dropLast().joined(separator: ", ")) and \(needed.last!))" : ""
            let kubernetes = needed.map { $0.dropFirst(4) }.joined(separator: ", ")
            let setcap = needed.map { $0.lowercased() }.joined(separator: ",")
            return "tc_ebpf needs \(list)\(all): run as root, or grant them: systemd AmbientCapabilities=\(needed.joined(separator: " ")) (systemd/udp-fanout.service); Kubernetes runAsUser: 0 with capabilities.add [\(kubernetes)] (k8s/daemonset-tc-ebpf.yaml); or setcap \(setcap)+ep on the binary"
        case .interfaceNotFound(let name):
            return "interface not found: '\(name)' (ip link show lists this namespace's interfaces)"
        case .interfaceBusy(let name, let path):
            return "interface '\(name)' is in use by another udp-fanout tc_ebpf daemon (it holds \(path)); stop it first"
        case .forwardingDisabled(let name, let sysctl):
            return "IP forwarding is disabled for '\(name)': the kernel's fib lookup refuses to route for tc_ebpf. Enable it: sysctl -w \(sysctl)=1"
        case .load(let error) where error.errno == EPERM:
            // The capabilities were checked before loading: EPERM now is a seccomp filter (or an LSM).
            return "cannot load the tc_ebpf program: \(error): this process holds CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON, so most likely a seccomp filter forbids bpf(): container runtimes' default profiles (CRI-O, podman, buildah) allow bpf() only with CAP_SYS_ADMIN; give the container a seccomp profile that allows bpf, or Unconfined (docs/deployment.md, seccomp). Other causes: an LSM policy, capabilities held only inside a user namespace (rootless containers), or RLIMIT_MEMLOCK on kernels before 5.11"
        case .load(let error):
            return "cannot load the tc_ebpf program: \(error)"
        case .attach(let name, let error):
            return "cannot attach the tc_ebpf program to '\(name)': \(error)"
        case .maps(let error):
            return "cannot write the tc_ebpf maps: \(error)"
        case .filterSlotTaken(let name, let program):
            return "the clsact ingress filter slot udp-fanout uses on '\(name)' (pref \(TCAttachment.filterPriority) handle 0x\(String(TCAttachment.filterHandle, radix: 16))) holds another program, '\(program)': remove it (tc filter del dev \(name) ingress pref \(TCAttachment.filterPriority) handle 0x\(String(TCAttachment.filterHandle, radix: 16)) bpf) or use tc_attach: tcx"
        case .lockFile(let path, let error):
            return "cannot create the tc_ebpf lock file \(path): \(error): \(TCAttachment.lockDirectory) must exist and be writable by this user (systemd: RuntimeDirectory=udp-fanout, as in systemd/udp-fanout.service; Kubernetes: the /run/udp-fanout hostPath of k8s/daemonset-tc-ebpf.yaml; else create it: install -d -o <user> \(TCAttachment.lockDirectory))"
        case .replyInterfaceNotFound(let listener, let name):
            return "listener '\(listener)': settings.reply_interfaces names '\(name)', which is not an interface here (ip link show lists this namespace's interfaces): name the interfaces the downstreams' replies arrive on, or leave reply_interfaces empty to use the interfaces the kernel routes the downstreams through"
        case .xdpLoad(let error):
            return "cannot load the xdp program (bpf/xdp_fanout.bpf.c) with the tc program's maps: \(error)"
        case .xdpAttach(let error):
            return "\(error)"
        case .adoption(let name, let reason):
            return "cannot take over the tc_ebpf link the previous process left at '\(name)': \(reason)"
        case .tooManyListeners:
            return "more than \(FANOUT_MAX_LISTENERS) tc_ebpf listeners and replication pools together (each pool takes a listener's slot in the program's maps)"
        }
    }
}
