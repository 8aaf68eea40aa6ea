#if canImport(Glibc)
import Glibc
#endif
import BPFSupport
import CSystemShim

/// Socket calls the library makes, each through ``systemCall(_:_:)``.
enum UDPSocket {
    /// A UDP socket with SO_REUSEPORT and SO_RXQ_OVFL, bound to `address`.
    static func makeReusePort(bound address: SocketAddress, receiveBufferSize: Int?) throws(ReusePortError) -> Int32 {
        do {
            let fd = try systemCall("socket") { socket(address.ip.family, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0) }
            do {
                try setOption(fd, SOL_SOCKET, SO_REUSEPORT, 1, "SO_REUSEPORT")
                try setOption(fd, SOL_SOCKET, SO_RXQ_OVFL, 1, "SO_RXQ_OVFL")
                if let size = receiveBufferSize { try setReceiveBuffer(fd, size) }
                let result = address.withSockAddr { bind(fd, $0, $1) }
                if result != 0 {
                    let error = errno
                    if error == EADDRINUSE { throw ReusePortError.addressInUse(address) }
                    throw ReusePortError.system(SystemCallError(call: "bind \(address)", errno: error))
                }
                return fd
            } catch {
                close(fd)
                throw error
            }
        } catch let error as ReusePortError {
            throw error
        } catch let error as SystemCallError {
            throw .system(error)
        } catch {
            preconditionFailure("unexpected error \(error)")
        }
    }

    /// SO_RCVBUFFORCE (past net.core.rmem_max, needs CAP_NET_ADMIN), else SO_RCVBUF, which the
    /// kernel caps at rmem_max.
    static func setReceiveBuffer(_ fd: Int32, _ size: Int) throws(SystemCallError) {
        var value = Int32(clamping: size)
        if setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &value, socklen_t(MemoryLayout<Int32>.size)) == 0 { return }
        try setOption(fd, SOL_SOCKET, SO_RCVBUF, value, "SO_RCVBUF")
    }

    static func setOption(_ fd: Int32, _ level: Int32, _ name: Int32, _ value: Int32, _ label: String) throws(SystemCallError) {
        var value = value
        try systemCall("setsockopt \(label)") {
            setsockopt(fd, level, name, &value, socklen_t(MemoryLayout<Int32>.size))
        }
    }

    /// SO_COOKIE: the socket's kernel-wide identity, which a REUSEPORT_SOCKARRAY lookup returns.
    static func cookie(_ fd: Int32) throws(SystemCallError) -> UInt64 {
        var cookie: UInt64 = 0
        var length = socklen_t(MemoryLayout<UInt64>.size)
        try systemCall("getsockopt SO_COOKIE") { getsockopt(fd, SOL_SOCKET, SO_COOKIE, &cookie, &length) }
        return cookie
    }

    /// SO_MEMINFO: (bytes queued for reading, datagrams dropped by the socket).
    static func memoryInfo(_ fd: Int32) throws(SystemCallError) -> (queuedBytes: Int, drops: UInt32) {
        var info = [UInt32](repeating: 0, count: Int(SK_MEMINFO_VARS))
        var length = socklen_t(info.count * 4)
        try systemCall("getsockopt SO_MEMINFO") { getsockopt(fd, SOL_SOCKET, SO_MEMINFO, &info, &length) }
        return (Int(info[Int(SK_MEMINFO_RMEM_ALLOC)]), info[Int(SK_MEMINFO_DROPS)])
    }

    static func localAddress(_ fd: Int32) -> SocketAddress? {
        var storage = sockaddr_storage()
        var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
        let result = withUnsafeMutablePointer(to: &storage) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &length) }
        }
        guard result == 0 else { return nil }
        return withUnsafeBytes(of: &storage) { SocketAddress(storage: $0.baseAddress!) }
    }
}
