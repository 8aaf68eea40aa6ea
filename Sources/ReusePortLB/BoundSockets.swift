// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif

/// Which UDP sockets are bound to an address and port, and which process holds them: read from
/// /proc, so a process-private group can refuse an address another process already serves
/// (the kernel puts every SO_REUSEPORT socket of one user on one address and port in one group,
/// whatever the process, so that process would silently share or lose the traffic).
package enum BoundSockets {
    /// A socket bound to the address that this process does not hold.
    package struct Foreign: Equatable {
        package var inode: UInt64
        package var pid: Int32?
        package var command: String?
        /// The socket's owner uid (/proc/net/udp), when known.
        package var uid: UInt32? = nil

        package init(inode: UInt64, pid: Int32?, command: String?, uid: UInt32? = nil) {
            self.inode = inode
            self.pid = pid
            self.command = command
            self.uid = uid
        }

        /// "pid 4242, udp-fanout", or what is known.
        package var owner: String {
            pid.map { "pid \($0)\(command.map { ", \($0)" } ?? "")" } ?? "another user or namespace"
        }
    }

    /// The sockets bound to exactly `address` (the kernel's grouping key) in this thread's
    /// network namespace that are not open in this process, with their owner where /proc shows it.
    package static func foreign(on address: SocketAddress) -> [Foreign] {
        let bound = boundWithOwners(on: address)
        guard !bound.isEmpty else { return [] }
        let own = socketInodes(ofProcess: "self")
        let others = bound.filter { !own.contains($0.inode) }
        guard !others.isEmpty else { return [] }
        let owners = owners(of: Set(others.map(\.inode)))
        return others.map { socket in
            let pid = owners[socket.inode]
            return Foreign(inode: socket.inode, pid: pid, command: pid.flatMap(command(of:)), uid: socket.uid)
        }
    }

    /// Sockets of other processes on the same family and port whose address overlaps
    /// `address` without being it: the wildcard when `address` is specific (this bind takes
    /// their datagrams to `address`), or any specific address when `address` is the wildcard
    /// (they take the datagrams to theirs). The kernel delivers to the most specific bind.
    package static func foreign(overlapping address: SocketAddress) -> [(bound: SocketAddress, owner: Foreign)] {
        let isV4 = address.ip.family == AF_INET
        let port = ":" + hex(UInt32(address.port), width: 4)
        let oursIsWildcard = address.ip.bytes.allSatisfy { $0 == 0 }
        var candidates: [(SocketAddress, UInt64)] = []
        for line in lines(of: "/proc/thread-self/net/" + (isV4 ? "udp" : "udp6")).dropFirst() {
            let fields = line.split(separator: " ", omittingEmptySubsequences: true)
            guard fields.count > 9, fields[1].hasSuffix(port), let inode = UInt64(fields[9]), inode != 0 else { continue }
            let text = fields[1].dropLast(port.count)
            var bytes: [UInt8] = []
            var index = text.startIndex
            while index < text.endIndex, let end = text.index(index, offsetBy: 8, limitedBy: text.endIndex),
                var value = UInt32(text[index..<end], radix: 16)
            {
                withUnsafeBytes(of: &value) { bytes += $0 }
                index = end
            }
            guard let ip = IPAddress(bytes: bytes), ip != address.ip else { continue }
            guard oursIsWildcard != ip.bytes.allSatisfy({ $0 == 0 }) else { continue }
            candidates.append((SocketAddress(ip: ip, port: address.port), inode))
        }
        guard !candidates.isEmpty else { return [] }
        let own = socketInodes(ofProcess: "self")
        let others = candidates.filter { !own.contains($0.1) }
        let owners = owners(of: Set(others.map(\.1)))
        return others.map { bound, inode in
            let pid = owners[inode]
            return (bound, Foreign(inode: inode, pid: pid, command: pid.flatMap(command(of:))))
        }
    }

    /// Inodes of the sockets in /proc/thread-self/net/udp{,6} whose local address is `address`.
    static func bound(on address: SocketAddress) -> [UInt64] {
        boundWithOwners(on: address).map(\.inode)
    }

    /// The sockets in /proc/thread-self/net/udp{,6} whose local address is `address`: inode and
    /// owner uid.
    static func boundWithOwners(on address: SocketAddress) -> [(inode: UInt64, uid: UInt32?)] {
        let isV4 = address.ip.family == AF_INET
        // /proc/net/udp prints each 32-bit word of the address as the host-order value of its
        // network-order bytes, then the port in host order: "0100007F:1F90" on x86.
        let bytes = address.ip.bytes
        var wanted = ""
        for word in stride(from: 0, to: bytes.count, by: 4) {
            var value: UInt32 = 0
            withUnsafeMutableBytes(of: &value) { $0.copyBytes(from: bytes[word..<word + 4]) }
            wanted += hex(value, width: 8)
        }
        wanted += ":" + hex(UInt32(address.port), width: 4)
        var sockets: [(UInt64, UInt32?)] = []
        for line in lines(of: "/proc/thread-self/net/" + (isV4 ? "udp" : "udp6")).dropFirst() {
            let fields = line.split(separator: " ", omittingEmptySubsequences: true)
            guard fields.count > 9, fields[1] == wanted, let inode = UInt64(fields[9]), inode != 0 else { continue }
            sockets.append((inode, UInt32(fields[7])))
        }
        return sockets
    }

    private static func hex(_ value: UInt32, width: Int) -> String {
        let digits = String(value, radix: 16, uppercase: true)
        return String(repeating: "0", count: max(0, width - digits.count)) + digits
    }

    /// The socket inodes among `/proc/<process>/fd`.
    static func socketInodes(ofProcess process: String) -> Set<UInt64> {
        var inodes = Set<UInt64>()
        let directory = "/proc/\(process)/fd"
        guard let stream = opendir(directory) else { return inodes }
        defer { closedir(stream) }
        var target = [CChar](repeating: 0, count: 64)
        while let entry = readdir(stream) {
            let name = withUnsafeBytes(of: entry.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            let length = readlink(directory + "/" + name, &target, target.count - 1)
            guard length > 0 else { continue }
            let text = String(decoding: target[0..<length].map { UInt8(bitPattern: $0) }, as: UTF8.self)
            // "socket:[12345]"
            guard text.hasPrefix("socket:["), text.hasSuffix("]"),
                let inode = UInt64(text.dropFirst("socket:[".count).dropLast())
            else { continue }
            inodes.insert(inode)
        }
        return inodes
    }

    /// Which process holds each of `inodes`, scanning every /proc/<pid>/fd this process may read.
    static func owners(of inodes: Set<UInt64>) -> [UInt64: Int32] {
        var result: [UInt64: Int32] = [:]
        guard let stream = opendir("/proc") else { return result }
        defer { closedir(stream) }
        let me = getpid()
        while let entry = readdir(stream), result.count < inodes.count {
            let name = withUnsafeBytes(of: entry.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            guard let pid = Int32(name), pid != me else { continue }
            for inode in socketInodes(ofProcess: name) where inodes.contains(inode) && result[inode] == nil {
                result[inode] = pid
            }
        }
        return result
    }

    /// The process's command name (/proc/<pid>/comm).
    static func command(of pid: Int32) -> String? {
        lines(of: "/proc/\(pid)/comm").first.map { String($0) }
    }

    /// The lines of a small text file; empty if it cannot be read.
    static func lines(of path: String) -> [Substring] {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return [] }
        defer { close(fd) }
        var data: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 65536)
        while true {
            let count = read(fd, &chunk, chunk.count)
            if count < 0 && errno == EINTR { continue }
            guard count > 0 else { break }
            data += chunk[0..<count]
        }
        return String(decoding: data, as: UTF8.self).split(separator: "\n")
    }
}
