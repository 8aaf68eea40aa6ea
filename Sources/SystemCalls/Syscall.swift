// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim

/// What a non-blocking send or receive did: `processed` with its count (bytes, or messages for
/// the batch calls), or `wouldBlock` (EAGAIN: nothing waiting, or the socket's buffer is full).
/// Would-block is an outcome the hot paths expect every batch, so it is a value, not an error.
public enum IOResult<Value: Sendable>: Sendable {
    case processed(Value)
    case wouldBlock
}

extension IOResult: Equatable where Value: Equatable {}

/// Socket types and flags as Swift constants. Glibc declares these as enum members
/// (bits/socket_type.h, bits/socket.h), and which Clang module owns those headers depends on
/// which modules a target loads (libxdp's headers include them too): a file that does not import
/// that module cannot see them in a whole-module (release) build. Read here, in a target that
/// loads no other C library, they are always visible.
public enum Socket {
    public static let datagram = Int32(SOCK_DGRAM.rawValue)
    public static let raw = Int32(SOCK_RAW.rawValue)
    public static let nonBlocking = Int32(SOCK_NONBLOCK.rawValue)
    public static let closeOnExec = Int32(SOCK_CLOEXEC.rawValue)
    public static let dontWait = Int32(MSG_DONTWAIT)
    public static let noSignal = Int32(MSG_NOSIGNAL)
    public static let truncate = Int32(MSG_TRUNC)
}

/// The package's system calls. Each retries EINTR and throws ``SystemCallError`` (the call's
/// name, its errno and the fix where the cause is outside the call); the sends and receives
/// return ``IOResult/wouldBlock`` for EAGAIN. Every wrapper is inlinable: the hot paths pay
/// nothing for going through it. `call` names the call in the error when the caller knows
/// more than the call's name (`setsockopt SO_RCVBUF`, `sendto(ICMP echo to 198.18.0.2)`).
public enum Syscall {
    // MARK: Descriptors

    /// socket(2).
    @inlinable
    public static func socket(_ domain: Int32, _ type: Int32, _ proto: Int32 = 0, call: @autoclosure () -> String = "socket") throws(SystemCallError) -> Int32 {
        try retrying(call()) { Glibc.socket(domain, type, proto) }
    }

    /// close(2). Not retried on EINTR: Linux has released the descriptor either way.
    @inlinable
    public static func close(_ fd: Int32) {
        _ = Glibc.close(fd)
    }

    // MARK: Addresses and options

    /// bind(2).
    @inlinable
    public static func bind(_ fd: Int32, _ address: UnsafePointer<sockaddr>, _ length: socklen_t, call: @autoclosure () -> String = "bind") throws(SystemCallError) {
        try retrying(call()) { Glibc.bind(fd, address, length) }
    }

    /// connect(2) (a datagram socket: sets its peer).
    @inlinable
    public static func connect(_ fd: Int32, _ address: UnsafePointer<sockaddr>, _ length: socklen_t, call: @autoclosure () -> String = "connect") throws(SystemCallError) {
        try retrying(call()) { Glibc.connect(fd, address, length) }
    }

    /// getsockname(2) into `storage`.
    @inlinable
    public static func getsockname(_ fd: Int32, _ storage: UnsafeMutablePointer<sockaddr_storage>, call: @autoclosure () -> String = "getsockname") throws(SystemCallError) {
        var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
        try retrying(call()) { storage.withMemoryRebound(to: sockaddr.self, capacity: 1) { Glibc.getsockname(fd, $0, &length) } }
    }

    /// setsockopt(2) with `value` (an integer or a struct).
    @inlinable
    public static func setsockopt<Value>(_ fd: Int32, _ level: Int32, _ option: Int32, _ value: Value, call: @autoclosure () -> String = "setsockopt") throws(SystemCallError) {
        var value = value
        try retrying(call()) { Glibc.setsockopt(fd, level, option, &value, socklen_t(MemoryLayout<Value>.size)) }
    }

    /// getsockopt(2) of a fixed-size value (an integer or a struct).
    @inlinable
    public static func getsockopt<Value>(_ fd: Int32, _ level: Int32, _ option: Int32, initial value: Value, call: @autoclosure () -> String = "getsockopt") throws(SystemCallError) -> Value {
        var value = value
        var length = socklen_t(MemoryLayout<Value>.size)
        try retrying(call()) { Glibc.getsockopt(fd, level, option, &value, &length) }
        return value
    }

    /// getsockopt(2) into `length` bytes at `buffer`; returns the length the kernel wrote.
    @inlinable
    @discardableResult
    public static func getsockopt(_ fd: Int32, _ level: Int32, _ option: Int32, _ buffer: UnsafeMutableRawPointer, _ length: socklen_t, call: @autoclosure () -> String = "getsockopt") throws(SystemCallError) -> socklen_t {
        var length = length
        try retrying(call()) { Glibc.getsockopt(fd, level, option, buffer, &length) }
        return length
    }

    // MARK: Waiting

    /// poll(2): how many descriptors are ready (0: the timeout passed).
    @inlinable
    public static func poll(_ descriptors: UnsafeMutablePointer<pollfd>, _ count: Int, _ milliseconds: Int32, call: @autoclosure () -> String = "poll") throws(SystemCallError) -> Int {
        Int(try retrying(call()) { Glibc.poll(descriptors, nfds_t(count), milliseconds) })
    }

    /// epoll_create1(2) with EPOLL_CLOEXEC.
    @inlinable
    public static func epollCreate(call: @autoclosure () -> String = "epoll_create1") throws(SystemCallError) -> Int32 {
        try retrying(call()) { epoll_create1(Int32(EPOLL_CLOEXEC)) }
    }

    /// epoll_ctl(2).
    @inlinable
    public static func epollControl(_ epoll: Int32, _ operation: Int32, _ fd: Int32, _ event: UnsafeMutablePointer<epoll_event>?, call: @autoclosure () -> String = "epoll_ctl") throws(SystemCallError) {
        try retrying(call()) { epoll_ctl(epoll, operation, fd, event) }
    }

    /// epoll_wait(2): how many events were written (0: the timeout passed).
    @inlinable
    public static func epollWait(_ epoll: Int32, _ events: UnsafeMutablePointer<epoll_event>, _ capacity: Int32, _ milliseconds: Int32, call: @autoclosure () -> String = "epoll_wait") throws(SystemCallError) -> Int {
        Int(try retrying(call()) { epoll_wait(epoll, events, capacity, milliseconds) })
    }

    // MARK: Sending and receiving

    /// send(2).
    @inlinable
    public static func send(_ fd: Int32, _ buffer: UnsafeRawPointer?, _ count: Int, _ flags: Int32, call: @autoclosure () -> String = "send") throws(SystemCallError) -> IOResult<Int> {
        try io(call()) { Glibc.send(fd, buffer, count, flags) }
    }

    /// sendto(2).
    @inlinable
    public static func sendto(_ fd: Int32, _ buffer: UnsafeRawPointer?, _ count: Int, _ flags: Int32, _ address: UnsafePointer<sockaddr>?, _ length: socklen_t, call: @autoclosure () -> String = "sendto") throws(SystemCallError) -> IOResult<Int> {
        try io(call()) { Glibc.sendto(fd, buffer, count, flags, address, length) }
    }

    /// sendmsg(2).
    @inlinable
    public static func sendmsg(_ fd: Int32, _ message: UnsafePointer<msghdr>, _ flags: Int32, call: @autoclosure () -> String = "sendmsg") throws(SystemCallError) -> IOResult<Int> {
        try io(call()) { Glibc.sendmsg(fd, message, flags) }
    }

    /// sendmmsg(2): how many messages left.
    @inlinable
    public static func sendmmsg(_ fd: Int32, _ vector: UnsafeMutablePointer<shim_mmsghdr>, _ count: Int, _ flags: Int32, call: @autoclosure () -> String = "sendmmsg") throws(SystemCallError) -> IOResult<Int> {
        try io(call()) { shim_sendmmsg(fd, vector, UInt32(count), flags) }
    }

    /// recv(2).
    @inlinable
    public static func recv(_ fd: Int32, _ buffer: UnsafeMutableRawPointer?, _ count: Int, _ flags: Int32, call: @autoclosure () -> String = "recv") throws(SystemCallError) -> IOResult<Int> {
        try io(call()) { Glibc.recv(fd, buffer, count, flags) }
    }

    /// recvfrom(2), the sender's address into `storage` (nil: not wanted).
    @inlinable
    public static func recvfrom(_ fd: Int32, _ buffer: UnsafeMutableRawPointer?, _ count: Int, _ flags: Int32, _ storage: UnsafeMutablePointer<sockaddr_storage>?, call: @autoclosure () -> String = "recvfrom") throws(SystemCallError) -> IOResult<Int> {
        guard let storage else { return try io(call()) { Glibc.recvfrom(fd, buffer, count, flags, nil, nil) } }
        var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
        return try io(call()) { storage.withMemoryRebound(to: sockaddr.self, capacity: 1) { Glibc.recvfrom(fd, buffer, count, flags, $0, &length) } }
    }

    /// recvmmsg(2): how many messages arrived.
    @inlinable
    public static func recvmmsg(_ fd: Int32, _ vector: UnsafeMutablePointer<shim_mmsghdr>, _ count: Int, _ flags: Int32, call: @autoclosure () -> String = "recvmmsg") throws(SystemCallError) -> IOResult<Int> {
        try io(call()) { shim_recvmmsg(fd, vector, UInt32(count), flags) }
    }

    // MARK: Pipes and limits

    /// pipe(2) whose two ends are non-blocking and close-on-exec (fcntl(2) F_SETFL and F_SETFD:
    /// pipe2 is a GNU extension Glibc's module does not show). Both ends are closed when a
    /// step fails.
    /// - Returns: the read and the write end.
    public static func pipe(call: @autoclosure () -> String = "pipe") throws(SystemCallError) -> (read: Int32, write: Int32) {
        var fds: [Int32] = [-1, -1]
        try retrying(call()) { Glibc.pipe(&fds) }
        do {
            for fd in fds {
                let flags = try retrying("fcntl F_GETFL") { fcntl(fd, F_GETFL) }
                try retrying("fcntl F_SETFL O_NONBLOCK") { fcntl(fd, F_SETFL, flags | O_NONBLOCK) }
                try retrying("fcntl F_SETFD FD_CLOEXEC") { fcntl(fd, F_SETFD, FD_CLOEXEC) }
            }
        } catch {
            for fd in fds { close(fd) }
            throw error
        }
        return (fds[0], fds[1])
    }

    /// The resources ``getrlimit(_:call:)`` and ``setrlimit(_:_:call:)`` take. Glibc declares
    /// them as enum members whose Swift type differs from the calls' parameter type.
    public enum Resource {
        /// RLIMIT_NOFILE: open file descriptors.
        public static let openFiles = Int32(RLIMIT_NOFILE.rawValue)
        /// RLIMIT_MEMLOCK: bytes of locked memory (an AF_XDP UMEM is charged to it).
        public static let lockedMemory = Int32(__RLIMIT_MEMLOCK.rawValue)
    }

    /// getrlimit(2): the soft (`rlim_cur`) and hard (`rlim_max`) limit of `resource`.
    public static func getrlimit(_ resource: Int32, call: @autoclosure () -> String = "getrlimit") throws(SystemCallError) -> rlimit {
        var limit = rlimit()
        try retrying(call()) { Glibc.getrlimit(resource, &limit) }
        return limit
    }

    /// setrlimit(2): sets the soft and hard limit of `resource` (raising the hard one needs
    /// CAP_SYS_RESOURCE).
    public static func setrlimit(_ resource: Int32, _ limit: rlimit, call: @autoclosure () -> String = "setrlimit") throws(SystemCallError) {
        var limit = limit
        try retrying(call()) { Glibc.setrlimit(resource, &limit) }
    }

    // MARK: The two shapes

    /// Retries EINTR; any other failure is thrown. EBADF and EFAULT are programmer errors and
    /// stop the process (as ``systemCall(_:_:)`` does).
    @inlinable
    @usableFromInline
    @discardableResult
    static func retrying<T: BinaryInteger>(_ name: @autoclosure () -> String, _ body: () -> T) throws(SystemCallError) -> T {
        while true {
            let result = body()
            if result >= 0 { return result }
            let error = Glibc.errno
            if error == EINTR { continue }
            precondition(error != EBADF && error != EFAULT, "\(name()) misused a descriptor or pointer: errno \(error)")
            throw SystemCallError(call: name(), errno: error)
        }
    }

    /// Retries EINTR; EAGAIN is ``IOResult/wouldBlock``; any other failure is thrown, EBADF
    /// included: the forwarding paths count every failed send by its errno (ECONNREFUSED,
    /// ENOBUFS, EMSGSIZE are outcomes there), and a send must never stop the process.
    @inlinable
    @usableFromInline
    static func io<T: BinaryInteger>(_ name: @autoclosure () -> String, _ body: () -> T) throws(SystemCallError) -> IOResult<Int> {
        while true {
            let result = body()
            if result >= 0 { return .processed(Int(result)) }
            let error = Glibc.errno
            if error == EINTR { continue }
            if error == EAGAIN || error == EWOULDBLOCK { return .wouldBlock }
            throw SystemCallError(call: name(), errno: error)
        }
    }
}
