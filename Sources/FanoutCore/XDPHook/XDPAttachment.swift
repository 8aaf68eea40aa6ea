// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CLibBPF
import BPFKernelABI
import CSystemShim
import Logging
import BPFSupport
import ReusePortLB
import Synchronization
import SystemCalls

/// A loaded XDP program an ``XDPAttachment`` attaches: af_xdp's steering program
/// (``XDPProgram``) or the xdp kind's forwarding program (``XDPForwardProgram``).
protocol LoadedXDPProgram: Sendable {
    /// The program's descriptor.
    var program: Int32 { get }
}

extension LoadedXDPProgram {
    /// The kernel's id of the loaded program (what `bpftool prog` and `ip link` print).
    var programID: UInt32 {
        var info = bpf_prog_info()
        var length = UInt32(MemoryLayout<bpf_prog_info>.size)
        return bpf_obj_get_info_by_fd(program, &info, &length) == 0 ? info.id : 0
    }
}

/// The XDP program attached to one interface through a BPF link: the kernel detaches it when
/// the link's last descriptor closes, so a crash (even kill -9) leaves nothing attached, unless
/// the service manager's store holds a copy (the xdp kind's link, for the next process).
final class XDPAttachment: @unchecked Sendable {  // the link descriptor is guarded by `link`
    let ifindex: UInt32
    let interface: String
    /// `.native` or `.generic`: how the program actually runs.
    let attachedMode: XDPMode
    /// The BPF link's descriptor (-1 once detached). Internal so a test can hand a copy to a
    /// child process it then kills.
    let link: Mutex<Int32>
    /// XDP_FLAGS_DRV_MODE and XDP_FLAGS_SKB_MODE of linux/if_link.h (not imported by libbpf's headers).
    static let driverMode: UInt32 = 1 << 2
    static let skbMode: UInt32 = 1 << 1
    private let logger: Logger

    private init(ifindex: UInt32, interface: String, mode: XDPMode, link: Int32, logger: Logger) {
        self.ifindex = ifindex
        self.interface = interface
        self.attachedMode = mode
        self.link = Mutex(link)
        self.logger = logger
    }

    /// Attaches through a BPF link (bpf_link_create BPF_XDP with XDP_FLAGS_DRV_MODE /
    /// XDP_FLAGS_SKB_MODE). auto: native first; on failure a warning "native XDP attach failed,
    /// trying SKB mode" and generic. Logs info "attached XDP program" (interface, mode).
    /// A program already attached to the interface that is not ours is an error naming it; ours
    /// already attached is `.alreadyAttached` (attach once per interface).
    static func attach(_ program: some LoadedXDPProgram, interface: String, mode: XDPMode, logger: Logger) throws(XDPError) -> XDPAttachment {
        let capabilities = Capabilities.current()
        var missing: [String] = []
        if !capabilities.canLoadBPF { missing.append("CAP_BPF") }
        if !capabilities.has(Capabilities.netAdmin) { missing.append("CAP_NET_ADMIN") }
        guard missing.isEmpty else { throw .privileges(missing: missing) }
        let ifindex = if_nametoindex(interface)
        guard ifindex > 0 else { throw .interfaceNotFound(interface) }
        try checkNoForeignProgram(ifindex: ifindex, interface: interface, ours: program.programID)

        func create(_ mode: XDPMode) -> Result<Int32, SystemCallError> {
            let fd = withLibbpfOptions(bpf_link_create_opts.self) { options in
                options.pointee.flags = mode == .native ? Self.driverMode : Self.skbMode
                return bpf_link_create(program.program, Int32(ifindex), BPF_XDP, options)
            }
            if fd >= 0 { return .success(fd) }
            let error = fd == -1 ? errno : -fd
            return .failure(SystemCallError(call: "bpf_link_create BPF_XDP \(mode == .native ? "XDP_FLAGS_DRV_MODE" : "XDP_FLAGS_SKB_MODE")", errno: error))
        }

        let attempts: [XDPMode] = mode == .auto ? [.native, .generic] : [mode]
        var lastError = SystemCallError(call: "bpf_link_create BPF_XDP", errno: EINVAL)
        for attempt in attempts {
            switch create(attempt) {
            case .success(let fd):
                logger.info("attached XDP program", metadata: [
                    "interface": "\(interface)", "mode": "\(attempt.rawValue)", "program_id": "\(program.programID)",
                ])
                return XDPAttachment(ifindex: ifindex, interface: interface, mode: attempt, link: fd, logger: logger)
            case .failure(let error):
                lastError = error
                if mode == .auto && attempt == .native {
                    logger.warning("native XDP attach failed, trying SKB mode", metadata: [
                        "interface": "\(interface)", "error": "\(error)",
                    ])
                }
            }
        }
        // A program attached between the check and the link (another tool) shows as EBUSY/EEXIST:
        // name it if it is there now.
        if lastError.errno == EBUSY || lastError.errno == EEXIST {
            try checkNoForeignProgram(ifindex: ifindex, interface: interface, ours: program.programID)
        }
        throw .attach(interface: interface, mode: mode, lastError)
    }

    /// BPF_LINK_TYPE_XDP (uapi/linux/bpf.h).
    static let xdpLinkType: UInt32 = 6

    /// Takes over the XDP link the previous process left at `interface` (handed over by the
    /// service manager) and makes it run `program` in its place (bpf_link_update, atomic: the
    /// hook is never empty). Refused when the descriptor is not an XDP link there, or runs in
    /// another mode than `mode` asks for (the caller closes it: detached, then attached anew).
    static func adopt(link: Int32, _ program: some LoadedXDPProgram, interface: String, mode: XDPMode, logger: Logger) throws(XDPError) -> (attachment: XDPAttachment, previous: UInt32) {
        let ifindex = if_nametoindex(interface)
        guard ifindex > 0 else { throw .interfaceNotFound(interface) }
        var info = bpf_link_info()
        var length = UInt32(MemoryLayout<bpf_link_info>.size)
        guard bpf_obj_get_info_by_fd(link, &info, &length) == 0, info.type == xdpLinkType, info.xdp.ifindex == ifindex else {
            throw .handedOver(interface: interface, "the descriptor is not an XDP link at this interface")
        }
        // Zeroed storage (issue 21), as in checkNoForeignProgram.
        let (result, ids) = withLibbpfOptions(bpf_xdp_query_opts.self) { query in
            (bpf_xdp_query(Int32(ifindex), 0, query), (driver: query.pointee.drv_prog_id, generic: query.pointee.skb_prog_id, offloaded: query.pointee.hw_prog_id))
        }
        guard result == 0 else { throw .query(interface: interface, SystemCallError(call: "bpf_xdp_query", errno: -result)) }
        let attached: XDPMode
        switch info.prog_id {
        case ids.driver where ids.generic == 0 && ids.offloaded == 0: attached = .native
        case ids.generic where ids.driver == 0 && ids.offloaded == 0: attached = .generic
        default:
            // Another program beside it (attached by another tool while no process ran).
            throw .handedOver(interface: interface, "another XDP program is attached beside it (driver \(ids.driver), generic \(ids.generic), offloaded \(ids.offloaded))")
        }
        guard mode == .auto || mode == attached else {
            throw .handedOver(interface: interface, "it runs in \(attached.rawValue) mode, xdp_mode asks for \(mode.rawValue)")
        }
        let previous = info.prog_id
        let updated = bpf_link_update(link, program.program, nil)
        guard updated == 0 else {
            throw .handedOver(interface: interface, "bpf_link_update failed: \(SystemCallError(call: "bpf_link_update", errno: updated == -1 ? errno : -updated))")
        }
        return (XDPAttachment(ifindex: ifindex, interface: interface, mode: attached, link: link, logger: logger), previous)
    }

    /// The link's descriptor (-1 once detached), for the service manager's store.
    var linkDescriptor: Int32 { link.withLock { $0 } }

    /// Throws `.foreignProgram` if an XDP program other than `ours` is attached to the interface
    /// in any mode (bpf_xdp_query: driver, generic or offloaded). The start asks before it
    /// attaches; `--check` (``Preflight``) asks with `ours` nil, having loaded nothing, so that it
    /// refuses what the start would.
    static func checkNoForeignProgram(ifindex: UInt32, interface: String, ours: UInt32?) throws(XDPError) {
        // Zeroed storage: a Swift-initialised query leaves its padding as the stack had it (issue 21).
        let (result, ids) = withLibbpfOptions(bpf_xdp_query_opts.self) { query in
            let result = bpf_xdp_query(Int32(ifindex), 0, query)
            return (result, [query.pointee.prog_id, query.pointee.drv_prog_id, query.pointee.skb_prog_id, query.pointee.hw_prog_id])
        }
        guard result == 0 else { throw .query(interface: interface, SystemCallError(call: "bpf_xdp_query", errno: -result)) }
        for id in ids where id != 0 {
            // Ours already there: one attachment per interface serves every listener on it.
            if id == ours { throw .alreadyAttached(interface: interface, id: id) }
            // `ip link` detaches each mode by its own keyword: `xdp off` leaves a generic one.
            let keyword = id == ids[2] ? "xdpgeneric" : id == ids[3] ? "xdpoffload" : "xdp"
            throw .foreignProgram(interface: interface, id: id, name: programName(id: id), ipKeyword: keyword)
        }
    }

    /// What `--check` says about the XDP programs on `listener`'s interface (`ifindex`), asking
    /// as the start would: udp-fanout's own program named `ours` (most likely the daemon this
    /// file is about to reload) and one whose name cannot be read are notes; another tool's
    /// program is a problem. `kind` names who would be refused ("af_xdp daemon").
    static func preflight(_ listener: Listener, index: Int, ifindex: UInt32, ours: String, kind: String) -> (problems: [String], notes: [String]) {
        let interface = listener.interface ?? ""
        let at = "listeners[\(index)].interface: listener '\(listener.name)'"
        do throws(XDPError) {
            try checkNoForeignProgram(ifindex: ifindex, interface: interface, ours: nil)
        } catch .foreignProgram(_, _, let name, _) where name == ours {
            return ([], ["\(at): \(interface) already runs udp-fanout's XDP program: fine if that is the daemon this file reloads; a second \(kind) on it would be refused"])
        } catch .foreignProgram(_, _, let name, _) where name == FANOUT_PROG_XFWD_NAME || name == FANOUT_PROG_XDP_NAME {
            // The other kind's program of udp-fanout: the previous process's, left in the
            // service manager's store, is closed by the start (docs/restarts.md).
            return ([], ["\(at): \(interface) runs udp-fanout's \(name == FANOUT_PROG_XFWD_NAME ? "xdp" : "af_xdp") program: fine if the previous process of this unit left it (a restart closes it first); another running udp-fanout refuses the start"])
        } catch .foreignProgram(_, let id, "?", _) {
            // Its name could not be read (bpf_prog_get_fd_by_id needs CAP_SYS_ADMIN): it may be
            // the running daemon's own, so not a problem for an unprivileged check.
            return ([], ["\(at): \(interface) already runs an XDP program (id \(id)) whose name this process cannot read: fine if it is the udp-fanout this file reloads; another program refuses the start (check as root, or bpftool prog show id \(id))"])
        } catch .query(_, let error) {
            return ([], ["\(at): the XDP programs of \(interface) could not be read (\(error)); the start checks them again"])
        } catch {
            return (["\(at): \(error)"], [])
        }
        return ([], [])
    }

    /// The name of the loaded program `id` ("?" if it cannot be read).
    static func programName(id: UInt32) -> String {
        let fd = bpf_prog_get_fd_by_id(id)
        guard fd >= 0 else { return "?" }
        defer { close(fd) }
        var info = bpf_prog_info()
        var length = UInt32(MemoryLayout<bpf_prog_info>.size)
        guard bpf_obj_get_info_by_fd(fd, &info, &length) == 0 else { return "?" }
        return withUnsafeBytes(of: info.name) { String(decoding: $0.prefix(while: { $0 != 0 }), as: UTF8.self) }
    }

    /// Whether the link is still attached to the interface (the watchdog heartbeat): the kernel
    /// detaches it when the interface goes away (or `bpftool link detach` does), leaving
    /// ifindex 0 in its info.
    var isAttached: Bool {
        link.withLock { fd in
            guard fd >= 0 else { return false }
            var info = bpf_link_info()
            var length = UInt32(MemoryLayout<bpf_link_info>.size)
            // bpf_obj_get_info_by_fd: libbpf 1.1 (Debian 12) has no bpf_link_get_info_by_fd.
            guard bpf_obj_get_info_by_fd(fd, &info, &length) == 0 else { return false }
            return info.xdp.ifindex == ifindex
        }
    }

    /// Detaches (closes the link; `quietly`: another copy keeps it attached, no log line). Idempotent.
    /// - Parameter quietly: the service manager's store keeps a copy of the link for the next
    ///   process (a stop that hands over): only this descriptor closes. Otherwise the link is
    ///   detached first (BPF_LINK_DETACH): the program leaves the hook now, even while the store
    ///   still holds a copy it was told to drop (it closes it when it reads that), so another XDP
    ///   program can be attached at once.
    func detach(quietly: Bool = false) {
        let closed = link.withLock { fd -> Bool in
            guard fd >= 0 else { return false }
            if !quietly { _ = bpf_link_detach(fd) }
            close(fd)
            fd = -1
            return true
        }
        if closed && !quietly { logger.info("detached XDP program", metadata: ["interface": "\(interface)"]) }
    }

    /// Detaches the XDP link `fd` (a handed-over one this process does not keep) and closes it:
    /// its program leaves the hook now, whoever else still holds the link.
    static func detach(link fd: Int32) {
        _ = bpf_link_detach(fd)
        close(fd)
    }

    deinit { detach() }
}

/// Why the af_xdp program could not be attached: every case names the problem and the fix.
package enum XDPError: Error, CustomStringConvertible, Sendable {
    case privileges(missing: [String])
    case interfaceNotFound(String)
    /// `ipKeyword`: how `ip link set dev X <keyword> off` detaches it (xdp, xdpgeneric, xdpoffload).
    case foreignProgram(interface: String, id: UInt32, name: String, ipKeyword: String)
    case alreadyAttached(interface: String, id: UInt32)
    case query(interface: String, SystemCallError)
    case attach(interface: String, mode: XDPMode, SystemCallError)
    /// The link the previous process left could not be taken over (it is closed, and the
    /// program attached anew).
    case handedOver(interface: String, String)

    package var description: String {
        switch self {
        case .privileges(let missing):
            let list = missing.joined(separator: " and ")
            let all = missing.count < 2 ? " (it needs CAP_BPF and CAP_NET_ADMIN)" : ""
            return "af_xdp needs \(list)\(all) to attach its XDP program: run as root, or grant them: systemd AmbientCapabilities=CAP_BPF CAP_NET_ADMIN; Kubernetes capabilities.add [BPF, NET_ADMIN]; or setcap cap_bpf,cap_net_admin+ep on the binary"
        case .interfaceNotFound(let name):
            return "interface not found: '\(name)' (ip link show lists this namespace's interfaces)"
        case .foreignProgram(let name, let id, let program, let keyword):
            if program == FANOUT_PROG_XFWD_NAME {
                return "interface '\(name)' already runs udp-fanout's xdp forwarding program (id \(id)) for another udp-fanout process (one daemon's XDP program per interface): stop that daemon, or choose another interface. Its program is held by a BPF link, which goes when that process exits (`bpftool link` lists it)"
            }
            if program == FANOUT_PROG_XDP_NAME {
                return "interface '\(name)' already runs udp-fanout's XDP program (id \(id)) for another udp-fanout process (one af_xdp daemon per interface): stop that daemon, or choose another interface for af_xdp. Its program is held by a BPF link, which goes when that process exits (`bpftool link` lists it; `ip link set dev \(name) xdp off` cannot remove a link)"
            }
            return "interface '\(name)' already has an XDP program attached (id \(id), name '\(program)'); an interface runs one XDP program: if it is not needed, remove it (`ip link set dev \(name) \(keyword) off` for a netlink attachment; for a BPF link, stop the process holding it, or `bpftool link detach id N` with the id `bpftool link` shows), or choose another interface for af_xdp"
        case .alreadyAttached(let name, let id):
            return "this daemon's XDP program (id \(id)) is already attached to '\(name)': one attachment serves every af_xdp listener on an interface; attach once per interface"
        case .query(let name, let error):
            return "cannot query the XDP programs of '\(name)': \(error): check the interface exists in this network namespace and this process holds CAP_NET_ADMIN"
        case .handedOver(let name, let why):
            return "the XDP link the previous process left at '\(name)' cannot be taken over (\(why)): detaching it and attaching anew (datagrams arriving meanwhile reach the tc program)"
        case .attach(let name, let mode, let error):
            switch mode {
            case .native:
                return "cannot attach the XDP program to '\(name)' in native mode: \(error): the driver may not support XDP; set xdp_mode: generic (or auto)"
            case .generic, .auto:
                return "cannot attach the XDP program to '\(name)' (\(mode == .auto ? "native, then generic" : "generic") mode): \(error): check the interface is up and not a bond/team member, and that its MTU fits (generic XDP needs a linear skb)"
            }
        }
    }
}
