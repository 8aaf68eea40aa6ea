// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim
import BPFSupport
import SystemCalls

/// bpffs: where a group's program and maps are pinned so separate processes share them.
///
/// Layout: `<root>/reuseportlb/<group>/{prog,members,config,table,outcomes,delivered,rr}` (and
/// `templates` once a member opens the group's ``FlowTemplateStore``) where
/// `<group>` is `udp4-127_0_0_1-9000-net4026531833` or `udp6-2001_db8__1-9000-net…`: the
/// address (bpffs refuses names with a dot, so dots and colons become underscores), the port,
/// and the network namespace's inode, since the same address and port in two namespaces are
/// two groups. Joins and leaves of every
/// group serialise on an flock of `<root>/reuseportlb`.
struct BPFFilesystem {
    let root: String

    var base: String { root + "/reuseportlb" }

    func groupDirectory(for address: SocketAddress) -> String {
        let family = address.ip.family == AF_INET ? "udp4" : "udp6"
        let host = address.ip.description.bpffsSafe
        return "\(base)/\(family)-\(host)-\(address.port)-net\(networkNamespaceInode())"
    }

    /// Mounts bpffs at `root` if it is not mounted there (needs CAP_SYS_ADMIN).
    func ensureMounted() throws(ReusePortError) {
        if shim_is_bpffs(root) == 1 { return }
        mkdir(root, 0o755)
        if mount("bpf", root, "bpf", 0, nil) != 0 {
            throw .bpffsUnavailable(path: root, reason: "not mounted, and mounting it failed: \(String(cString: strerror(errno)))")
        }
    }

    /// Takes the exclusive lock every join and leave holds; released by closing the result.
    /// - Throws: ``ReusePortError/bpffsUnavailable(path:reason:)`` when this user may not
    ///   create or open the directory (EACCES, EPERM, EROFS), else the failed call.
    func lock() throws(ReusePortError) -> Int32 {
        if mkdir(base, 0o755) != 0 && errno != EEXIST {
            throw Self.failure(SystemCallError(call: "mkdir \(base)", errno: errno), path: root)
        }
        let fd: Int32
        do {
            fd = try systemCall("open \(base)") { open(base, O_RDONLY | O_DIRECTORY | O_CLOEXEC) }
        } catch {
            throw Self.failure(error, path: root)
        }
        do {
            try systemCall("flock \(base)") { flock(fd, LOCK_EX) }
        } catch {
            close(fd)
            throw .system(error)
        }
        return fd
    }

    /// A bpffs call that failed: a permission problem is `bpffsUnavailable` (which steering
    /// `automatic` falls back from), anything else the call's own error.
    static func failure(_ error: SystemCallError, path: String) -> ReusePortError {
        switch error.errno {
        case EACCES, EPERM, EROFS: return .bpffsUnavailable(path: path, reason: error.description)
        default: return .system(error)
        }
    }

    static func exists(_ path: String) -> Bool { access(path, F_OK) == 0 }
}

extension String {
    var bpffsSafe: String { String(map { $0 == ":" || $0 == "." ? "_" : $0 }) }
}

/// The inode of this process's network namespace (0 if unreadable): names what belongs to one
/// namespace (bpffs group directories, tc_ebpf lock files).
package func networkNamespaceInode() -> UInt {
    var namespace = stat()
    return stat("/proc/self/ns/net", &namespace) == 0 ? UInt(namespace.st_ino) : 0
}
