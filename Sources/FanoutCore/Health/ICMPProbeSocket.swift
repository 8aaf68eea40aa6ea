// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim
import ReusePortLB
import SystemCalls

/// One ICMP (IPv4) or ICMPv6 socket sending echo requests and reading replies, without spawning
/// `ping`. An ICMP datagram socket is tried first: it needs no privilege where the sysctl
/// net.ipv4.ping_group_range holds the process's group, and the kernel sets the echo identifier
/// to the socket's own and delivers only replies carrying it. Otherwise a raw socket
/// (CAP_NET_RAW), which sees every ICMP message of the host, so replies are filtered here by
/// type, identifier and the probe's token.
final class ICMPProbeSocket {
    enum Kind: String, Sendable, CaseIterable {
        case datagram, raw
    }

    let fd: Int32
    let family: Int32
    let kind: Kind
    /// The echo identifier replies must carry.
    let identifier: UInt16
    /// Carried in every request's payload: a reply without it is not ours (raw sockets see every
    /// process's echoes).
    let token: UInt64

    private init(fd: Int32, family: Int32, kind: Kind, identifier: UInt16) {
        self.fd = fd
        self.family = family
        self.kind = kind
        self.identifier = identifier
        token = UInt64.random(in: 1...UInt64.max)
    }

    deinit { Syscall.close(fd) }

    /// Opens a socket for `family` (AF_INET or AF_INET6), trying the kinds in order.
    /// - Throws: ``HealthError/icmpUnavailable(family:datagram:raw:)`` naming both failures and the fix.
    static func open(family: Int32, kinds: [Kind] = Kind.allCases) throws(HealthError) -> ICMPProbeSocket {
        var failures: [Kind: SystemCallError] = [:]
        for kind in kinds {
            do {
                return try open(family: family, kind: kind)
            } catch {
                failures[kind] = error
            }
        }
        let untried = SystemCallError(call: "not tried", errno: 0)
        throw .icmpUnavailable(family: family == AF_INET6 ? "IPv6" : "IPv4",
                               datagram: failures[.datagram] ?? untried, raw: failures[.raw] ?? untried)
    }

    static func open(family: Int32, kind: Kind) throws(SystemCallError) -> ICMPProbeSocket {
        let proto = family == AF_INET6 ? Int32(IPPROTO_ICMPV6) : Int32(IPPROTO_ICMP)
        let type = (kind == .datagram ? Socket.datagram : Socket.raw) | Socket.nonBlocking | Socket.closeOnExec
        let call = "socket(\(family == AF_INET6 ? "AF_INET6" : "AF_INET"), \(kind == .datagram ? "SOCK_DGRAM" : "SOCK_RAW"), \(family == AF_INET6 ? "IPPROTO_ICMPV6" : "IPPROTO_ICMP"))"
        let fd = try Syscall.socket(family, type, proto, call: call)
        guard kind == .datagram else {
            return ICMPProbeSocket(fd: fd, family: family, kind: kind, identifier: UInt16.random(in: 1...UInt16.max))
        }
        // Bound to "port" 0, a ping socket gets a free identifier of its own; it is the port
        // getsockname reports.
        let any = SocketAddress(ip: family == AF_INET6 ? IPAddress("::")! : IPAddress("0.0.0.0")!, port: 0)
        do {
            try Syscall.bind(fd, any, call: "bind(ICMP datagram socket)")
        } catch {
            Syscall.close(fd)
            throw error
        }
        var storage = sockaddr_storage()
        let naming = "getsockname(ICMP datagram socket)"
        do {
            try Syscall.getsockname(fd, &storage, call: naming)
        } catch {
            Syscall.close(fd)
            throw error
        }
        // Without its identifier no reply could be matched: every probe would time out.
        guard let port = withUnsafeBytes(of: &storage, { SocketAddress(storage: $0.baseAddress!)?.port }) else {
            Syscall.close(fd)
            throw SystemCallError(call: naming, errno: EAFNOSUPPORT)
        }
        return ICMPProbeSocket(fd: fd, family: family, kind: kind, identifier: port)
    }

    /// Sends one echo request to `ip` with `sequence`; the payload is the token and 8 bytes of
    /// the sequence, 16 bytes in all (the size `ping -s 16` sends).
    /// - Throws: the `sendto` error (e.g. ENETUNREACH).
    func sendEcho(to ip: IPAddress, sequence: UInt16) throws(SystemCallError) {
        let packet = Self.echoRequest(family: family, identifier: identifier, sequence: sequence, token: token)
        let call = "sendto(ICMP echo to \(ip))"
        // A full send buffer fails this probe like any other send error.
        if case .wouldBlock = try Syscall.sendto(fd, packet, packet.count, Socket.dontWait, SocketAddress(ip: ip, port: 0), call: call) {
            throw SystemCallError(call: call, errno: EAGAIN)
        }
    }

    /// Reads every queued message; returns the echo replies carrying our identifier and token,
    /// with the address each came from.
    func receiveReplies() -> [(source: IPAddress, sequence: UInt16)] {
        var replies: [(IPAddress, UInt16)] = []
        var buffer = [UInt8](repeating: 0, count: 2048)
        while true {
            var storage = sockaddr_storage()
            let count: Int
            do {
                // Would block: all read.
                guard case .processed(let received) = try Syscall.recvfrom(fd, &buffer, buffer.count, Socket.dontWait, &storage) else { break }
                count = received
            } catch {
                // A queued ICMP error: left to the timeout.
                continue
            }
            guard let source = withUnsafeBytes(of: &storage, { SocketAddress(storage: $0.baseAddress!) })?.ip else { continue }
            if let sequence = Self.matchReply(buffer[0..<count], family: family, hasIPHeader: kind == .raw && family == AF_INET,
                                               identifier: identifier, token: token) {
                replies.append((source, sequence))
            }
        }
        return replies
    }

    /// The echo request's bytes: type, code, checksum, identifier, sequence, then the token and
    /// the sequence again. The IPv4 checksum is computed here (raw sockets send it as given); the
    /// kernel fills the ICMPv6 one (it covers a pseudo-header only the kernel knows for sure).
    static func echoRequest(family: Int32, identifier: UInt16, sequence: UInt16, token: UInt64) -> [UInt8] {
        var packet: [UInt8] = [family == AF_INET6 ? 128 : 8, 0, 0, 0]
        packet += [UInt8(identifier >> 8), UInt8(identifier & 0xff), UInt8(sequence >> 8), UInt8(sequence & 0xff)]
        packet += withUnsafeBytes(of: token.bigEndian) { Array($0) }
        packet += withUnsafeBytes(of: UInt64(sequence).bigEndian) { Array($0) }
        if family == AF_INET {
            let sum = internetChecksum(packet)
            packet[2] = UInt8(sum >> 8)
            packet[3] = UInt8(sum & 0xff)
        }
        return packet
    }

    /// The sequence of an echo reply that is ours (type echo reply, our identifier, our token),
    /// or nil. `hasIPHeader`: IPv4 raw sockets deliver the IP header first.
    static func matchReply(_ bytes: ArraySlice<UInt8>, family: Int32, hasIPHeader: Bool, identifier: UInt16, token: UInt64) -> UInt16? {
        var icmp = bytes
        if hasIPHeader {
            guard let first = icmp.first else { return nil }
            let headerLength = Int(first & 0x0f) * 4
            guard headerLength >= 20, icmp.count >= headerLength else { return nil }
            icmp = icmp.dropFirst(headerLength)
        }
        let start = icmp.startIndex
        guard icmp.count >= 16 else { return nil }
        let replyType: UInt8 = family == AF_INET6 ? 129 : 0
        guard icmp[start] == replyType, icmp[start + 1] == 0 else { return nil }
        let replyIdentifier = UInt16(icmp[start + 4]) << 8 | UInt16(icmp[start + 5])
        let sequence = UInt16(icmp[start + 6]) << 8 | UInt16(icmp[start + 7])
        let replyToken = icmp[(start + 8)..<(start + 16)].reduce(UInt64(0)) { $0 << 8 | UInt64($1) }
        guard replyIdentifier == identifier, replyToken == token else { return nil }
        return sequence
    }

    /// RFC 1071 checksum.
    static func internetChecksum(_ bytes: [UInt8]) -> UInt16 {
        var sum: UInt32 = 0
        var index = 0
        while index + 1 < bytes.count {
            sum += UInt32(bytes[index]) << 8 | UInt32(bytes[index + 1])
            index += 2
        }
        if index < bytes.count { sum += UInt32(bytes[index]) << 8 }
        while sum >> 16 != 0 { sum = (sum & 0xffff) + (sum >> 16) }
        return ~UInt16(sum)
    }
}
