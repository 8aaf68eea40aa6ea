// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim
import ReusePortLB
import SystemCalls

/// Requests to the kernel's routing netlink (NETLINK_ROUTE) in the calling thread's network
/// namespace: a route lookup and a filter dump, the two questions libbpf does not answer.
enum Rtnetlink {
    /// One reply message: its type and its payload after the 16-byte nlmsghdr.
    struct Message {
        var type: UInt16
        var payload: [UInt8]
    }

    static let done: UInt16 = 3, error: UInt16 = 2  // NLMSG_DONE, NLMSG_ERROR

    /// Sends one request (`type`, `flags`, `body` after the nlmsghdr) and returns the replies:
    /// one message, or every message up to NLMSG_DONE for a dump.
    /// `family`: the netlink protocol (0, NETLINK_ROUTE; 16, NETLINK_GENERIC).
    static func request(type: UInt16, flags: UInt16, body: [UInt8], family: Int32 = 0) throws(SystemCallError) -> [Message] {
        var messages: [Message] = []
        try request(type: type, flags: flags, body: body, family: family) { messages.append($0) }
        return messages
    }

    /// The same, each reply handed to `each` as it is read and not kept (a dump of a large
    /// routing table). `failedDone`: a dump the kernel ended with an error (carried by its
    /// NLMSG_DONE) throws it, rather than passing for complete.
    static func request(type: UInt16, flags: UInt16, body: [UInt8], family: Int32 = 0, failedDone: Bool = false,
                        each: (Message) -> Void) throws(SystemCallError) {
        let fd = try Syscall.socket(AF_NETLINK, Socket.raw | Socket.closeOnExec, family, call: "socket AF_NETLINK \(family == 0 ? "NETLINK_ROUTE" : "NETLINK_GENERIC")")
        defer { Syscall.close(fd) }
        var request = [UInt8]()
        append32(&request, UInt32(16 + body.count))
        append16(&request, type)
        append16(&request, flags | 1)  // NLM_F_REQUEST
        append32(&request, 1)          // sequence
        append32(&request, 0)          // port id: the kernel's
        request += body
        // A blocking socket: would-block cannot happen, and would be a failure like any other.
        guard case .processed = try Syscall.send(fd, request, request.count, 0, call: "send rtnetlink \(type)") else {
            throw SystemCallError(call: "send rtnetlink \(type)", errno: EAGAIN)
        }
        let dump = flags & 0x300 != 0
        var buffer = [UInt8](repeating: 0, count: 32768)
        while true {
            guard case .processed(let count) = try Syscall.recv(fd, &buffer, buffer.count, 0, call: "recv rtnetlink \(type)") else {
                throw SystemCallError(call: "recv rtnetlink \(type)", errno: EAGAIN)
            }
            var offset = 0
            while offset + 16 <= count {
                let length = Int(load32(buffer, offset))
                guard length >= 16, offset + length <= count else { break }
                let message = Message(type: load16(buffer, offset + 4), payload: Array(buffer[(offset + 16)..<(offset + length)]))
                if message.type == done {
                    if failedDone, message.payload.count >= 4, case let code = -Int32(bitPattern: load32(message.payload, 0)), code > 0 {
                        throw SystemCallError(call: "rtnetlink dump \(type)", errno: code)
                    }
                    return
                }
                each(message)
                if !dump || message.type == error { return }
                offset += (length + 3) & ~3
            }
            if count == 0 { return }
        }
    }

    static func append16(_ bytes: inout [UInt8], _ value: UInt16) { withUnsafeBytes(of: value) { bytes += $0 } }
    static func append32(_ bytes: inout [UInt8], _ value: UInt32) { withUnsafeBytes(of: value) { bytes += $0 } }
    static func load16(_ bytes: [UInt8], _ offset: Int) -> UInt16 { bytes.withUnsafeBytes { $0.loadUnaligned(fromByteOffset: offset, as: UInt16.self) } }
    static func load32(_ bytes: [UInt8], _ offset: Int) -> UInt32 { bytes.withUnsafeBytes { $0.loadUnaligned(fromByteOffset: offset, as: UInt32.self) } }

    /// The errno of an NLMSG_ERROR reply (0: an acknowledgement).
    static func errorCode(_ message: Message) -> Int32 {
        message.payload.count >= 4 ? -Int32(bitPattern: load32(message.payload, 0)) : EPROTO
    }
}
