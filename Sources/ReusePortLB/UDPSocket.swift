// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFSupport
import CSystemShim
import SystemCalls

/// Socket calls the library makes, each through the SystemCalls layer (``Syscall``).
package enum UDPSocket {
    /// A UDP socket with SO_REUSEPORT and SO_RXQ_OVFL, bound to `address`.
    static func makeReusePort(bound address: SocketAddress, receiveBufferSize: Int?) throws(ReusePortError) -> Int32 {
        let fd: Int32
        do {
            fd = try Syscall.socket(address.ip.family, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue))
        } catch {
            throw .system(error)
        }
        do {
            try setOption(fd, SOL_SOCKET, SO_REUSEPORT, 1, "SO_REUSEPORT")
            try setOption(fd, SOL_SOCKET, SO_RXQ_OVFL, 1, "SO_RXQ_OVFL")
            if let size = receiveBufferSize { try setReceiveBuffer(fd, size) }
            try Syscall.bind(fd, address, call: "bind \(address)")
            return fd
        } catch {
            Syscall.close(fd)
            // Only bind fails with EADDRINUSE.
            if error.errno == EADDRINUSE { throw .addressInUse(address) }
            throw .system(error)
        }
    }

    /// SO_RCVBUFFORCE (past net.core.rmem_max, needs CAP_NET_ADMIN), else SO_RCVBUF, which the
    /// kernel caps at rmem_max.
    static func setReceiveBuffer(_ fd: Int32, _ size: Int) throws(SystemCallError) {
        let value = Int32(clamping: size)
        if (try? Syscall.setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, value)) != nil { return }
        try setOption(fd, SOL_SOCKET, SO_RCVBUF, value, "SO_RCVBUF")
    }

    static func setOption(_ fd: Int32, _ level: Int32, _ name: Int32, _ value: Int32, _ label: String) throws(SystemCallError) {
        try Syscall.setsockopt(fd, level, name, value, call: "setsockopt \(label)")
    }

    /// SO_COOKIE: the socket's kernel-wide identity, which a REUSEPORT_SOCKARRAY lookup returns.
    static func cookie(_ fd: Int32) throws(SystemCallError) -> UInt64 {
        try Syscall.getsockopt(fd, SOL_SOCKET, SO_COOKIE, initial: UInt64(0), call: "getsockopt SO_COOKIE")
    }

    /// SO_MEMINFO: (bytes queued for reading, datagrams dropped by the socket).
    package static func memoryInfo(_ fd: Int32) throws(SystemCallError) -> (queuedBytes: Int, drops: UInt32) {
        let info = UnsafeMutableBufferPointer<UInt32>.allocate(capacity: Int(SK_MEMINFO_VARS))
        defer { info.deallocate() }
        info.initialize(repeating: 0)
        try Syscall.getsockopt(fd, SOL_SOCKET, SO_MEMINFO, info.baseAddress!, socklen_t(info.count * 4), call: "getsockopt SO_MEMINFO")
        return (Int(info[Int(SK_MEMINFO_RMEM_ALLOC)]), info[Int(SK_MEMINFO_DROPS)])
    }

    static func localAddress(_ fd: Int32) -> SocketAddress? {
        var storage = sockaddr_storage()
        guard (try? Syscall.getsockname(fd, &storage)) != nil else { return nil }
        return withUnsafeBytes(of: &storage) { SocketAddress(storage: $0.baseAddress!) }
    }
}

extension Syscall {
    /// bind(2) to `address`.
    package static func bind(_ fd: Int32, _ address: SocketAddress, call: @autoclosure () -> String = "bind") throws(SystemCallError) {
        try address.withSockAddr { (pointer, length) throws(SystemCallError) in try bind(fd, pointer, length, call: call()) }
    }

    /// connect(2) to `address`.
    package static func connect(_ fd: Int32, _ address: SocketAddress, call: @autoclosure () -> String = "connect") throws(SystemCallError) {
        try address.withSockAddr { (pointer, length) throws(SystemCallError) in try connect(fd, pointer, length, call: call()) }
    }

    /// sendto(2) to `address`.
    @inlinable
    package static func sendto(_ fd: Int32, _ buffer: UnsafeRawPointer?, _ count: Int, _ flags: Int32, _ address: SocketAddress, call: @autoclosure () -> String = "sendto") throws(SystemCallError) -> IOResult<Int> {
        try address.withSockAddr { (pointer, length) throws(SystemCallError) in try sendto(fd, buffer, count, flags, pointer, length, call: call()) }
    }
}
