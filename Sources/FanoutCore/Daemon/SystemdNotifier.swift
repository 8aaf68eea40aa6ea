// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim
import Logging
import ReusePortLB
import Synchronization
import SystemCalls

/// sd_notify(3) without libsystemd: one datagram to $NOTIFY_SOCKET when run under systemd
/// (Type=notify); nothing otherwise. A message that cannot be sent is logged (the first failure
/// only: watchdog pings would repeat it every few seconds), since systemd then times the start
/// out or kills the daemon for a missed watchdog ping.
public final class SystemdNotifier: Sendable {
    let path: String?
    private let logger: Logger?
    private let failureLogged = Atomic<Bool>(false)

    /// - Parameters:
    ///   - environment: the socket's path (`@` first: abstract namespace); nil or empty: not
    ///     under systemd, messages go nowhere.
    ///   - logger: where the first failed send is reported.
    public init(environment: String? = getenv("NOTIFY_SOCKET").map { String(cString: $0) }, logger: Logger? = nil) {
        path = environment
        self.logger = logger
    }

    /// Sends `state` (newline-separated `KEY=value` assignments) in one datagram.
    /// - Returns: nil when sent or not under systemd, else what failed.
    @discardableResult
    package func send(_ state: String) -> String? {
        send(state, descriptors: [])
    }

    /// Sends `state` with `descriptors` in one SCM_RIGHTS message (sd_pid_notify_with_fds(3):
    /// `FDSTORE=1`), at most 253.
    /// - Returns: nil when sent or not under systemd, else what failed.
    @discardableResult
    /// - Parameter waiting: false: fails at once (EAGAIN) when the service manager's queue is
    ///   full, instead of waiting for it (a forwarding thread must not wait on PID 1).
    package func send(_ state: String, descriptors: [Int32], waiting: Bool = true) -> String? {
        sendReporting(state, descriptors: descriptors, waiting: waiting).problem
    }

    /// ``send(_:descriptors:waiting:)``, also with the errno that failed (0 when none did or the
    /// problem was not a system call's).
    package func sendReporting(_ state: String, descriptors: [Int32], waiting: Bool = true) -> (problem: String?, errno: Int32) {
        guard let path, !path.isEmpty else { return (nil, 0) }
        let (problem, error) = deliver(state, descriptors: descriptors, to: path, waiting: waiting)
        // Without waiting, the caller says what failed (a full queue is expected under load).
        if let problem, waiting, !failureLogged.exchange(true, ordering: .relaxed) {
            logger?.error("sd_notify failed; later failures are not logged", metadata: [
                "NOTIFY_SOCKET": "\(path)", "message": "\(state.split(separator: "\n").first ?? "")", "error": "\(problem)",
            ])
        }
        return (problem, error)
    }

    private func deliver(_ state: String, descriptors: [Int32], to path: String, waiting: Bool) -> (String?, Int32) {
        let fd: Int32
        do {
            fd = try Syscall.socket(AF_UNIX, Socket.datagram | Socket.closeOnExec | (waiting ? 0 : Socket.nonBlocking), call: "socket AF_UNIX")
        } catch {
            return ("\(error)", error.errno)
        }
        defer { Syscall.close(fd) }
        // Waiting, but not for ever: a stalled service manager must not hang a stop or a reload.
        if waiting { _ = try? Syscall.setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, timeval(tv_sec: 2, tv_usec: 0), call: "setsockopt SO_SNDTIMEO") }
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        var bytes = Array(path.utf8)
        if bytes.first == UInt8(ascii: "@") { bytes[0] = 0 }  // abstract namespace
        let capacity = MemoryLayout.size(ofValue: address.sun_path)
        guard bytes.count < capacity else { return ("the path is longer than \(capacity - 1) bytes", 0) }
        withUnsafeMutableBytes(of: &address.sun_path) { $0.copyBytes(from: bytes) }
        let length = socklen_t(MemoryLayout<sa_family_t>.size + bytes.count)
        let message = Array(state.utf8)
        if !descriptors.isEmpty {
            let sent = withUnsafePointer(to: &address) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { name in
                    shim_send_with_descriptors(fd, message, message.count, name, length, descriptors, Int32(descriptors.count))
                }
            }
            if sent < 0 { return ("sendmsg \(path) with \(descriptors.count) descriptor(s): \(String(cString: strerror(Int32(-sent))))", Int32(-sent)) }
            return (sent == message.count ? nil : "sendmsg \(path): the socket took part of the message", 0)
        }
        let sent = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { name in
                Result { () throws(SystemCallError) in try Syscall.sendto(fd, message, message.count, Socket.noSignal, name, length, call: "sendto \(path)") }
            }
        }
        switch sent {
        case .success(.processed(message.count)): return (nil, 0)
        case .success: return ("sendto \(path): the socket took part of the message or none (its buffer is full)", EAGAIN)
        case .failure(let error): return ("\(error)", error.errno)
        }
    }

    /// CLOCK_MONOTONIC in microseconds: the `MONOTONIC_USEC=` that must accompany `RELOADING=1`
    /// (systemd 253+ with Type=notify-reload uses it to tell this reload from an earlier one).
    package static func monotonicMicroseconds() -> UInt64 {
        var now = timespec()
        clock_gettime(CLOCK_MONOTONIC, &now)
        return UInt64(now.tv_sec) * 1_000_000 + UInt64(now.tv_nsec) / 1_000
    }
}
