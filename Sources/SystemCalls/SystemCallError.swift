// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif

// SystemCalls: the one layer every socket, setsockopt/getsockopt, send/receive, poll and epoll
// call of the package goes through (in the manner of swift-nio's NIOPosix/System.swift).
// EINTR is retried here; would-block is a value (IOResult.wouldBlock), not an error; every
// other failure is a SystemCallError naming the call, the errno and, where the cause lies
// outside the call, the fix.

/// A failed system or libbpf call: the call's name and the errno it left.
public struct SystemCallError: Error, CustomStringConvertible, Sendable, Equatable {
    /// The C call that failed, e.g. `bind` or `bpf_map_update_elem`.
    public let call: String
    /// The errno value.
    public let errno: Int32

    public init(call: String, errno: Int32) {
        self.call = call
        self.errno = errno
    }

    public var description: String {
        "\(call) failed: \(String(cString: strerror(errno))) (errno \(errno))\(hint)"
    }

    /// The fix, for errors whose cause is outside the call.
    private var hint: String {
        switch errno {
        case EMFILE: return ": the process's open-file limit is reached; raise it (ulimit -n, LimitNOFILE= in the systemd unit) or use fewer workers (with replies: relay, a lower max_sessions)"
        case ENFILE: return ": the system's open-file limit is reached; raise fs.file-max"
        default: return ""
        }
    }
}

/// The general form for calls the layer has no wrapper for (bpf, fcntl, a C shim's socket
/// calls): retries EINTR, throws the call's name and errno. EBADF and EFAULT are programmer
/// errors and stop the process.
@inline(__always)
@discardableResult
package func systemCall<T: BinaryInteger>(
    _ name: @autoclosure () -> String, _ body: () -> T
) throws(SystemCallError) -> T {
    try Syscall.retrying(name(), body)
}

/// The same for libbpf calls that return a negative errno instead of setting errno.
@inline(__always)
@discardableResult
package func libbpfCall(_ name: @autoclosure () -> String, _ body: () -> Int32) throws(SystemCallError) -> Int32 {
    let result = body()
    if result >= 0 { return result }
    let error = result == -1 ? Glibc.errno : -result
    throw SystemCallError(call: name(), errno: error)
}
