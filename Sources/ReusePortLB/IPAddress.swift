// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif

/// An IPv4 or IPv6 address, stored in network byte order.
public enum IPAddress: Hashable, Sendable, CustomStringConvertible {
    case v4(in_addr_t)
    case v6(in6_addr)

    /// Parses dotted-quad IPv4 or RFC 4291 IPv6 text (`inet_pton(3)`); nil if neither.
    public init?(_ text: String) {
        var v4 = in_addr()
        if inet_pton(AF_INET, text, &v4) == 1 {
            self = .v4(v4.s_addr)
            return
        }
        var v6 = in6_addr()
        if inet_pton(AF_INET6, text, &v6) == 1 {
            self = .v6(v6)
            return
        }
        return nil
    }

    /// The address family, `AF_INET` or `AF_INET6`.
    public var family: Int32 {
        switch self {
        case .v4: return AF_INET
        case .v6: return AF_INET6
        }
    }

    /// The address's bytes in network order (4 or 16).
    public var bytes: [UInt8] {
        switch self {
        case .v4(var raw): return withUnsafeBytes(of: &raw) { Array($0) }
        case .v6(var raw): return withUnsafeBytes(of: &raw) { Array($0) }
        }
    }

    /// Builds an address from 4 or 16 network-order bytes.
    public init?(bytes: some Collection<UInt8>) {
        let array = Array(bytes)
        switch array.count {
        case 4:
            var raw: in_addr_t = 0
            withUnsafeMutableBytes(of: &raw) { $0.copyBytes(from: array) }
            self = .v4(raw)
        case 16:
            var raw = in6_addr()
            withUnsafeMutableBytes(of: &raw) { $0.copyBytes(from: array) }
            self = .v6(raw)
        default:
            return nil
        }
    }

    public var description: String {
        var buffer = [CChar](repeating: 0, count: Int(INET6_ADDRSTRLEN))
        switch self {
        case .v4(let raw):
            var address = in_addr(s_addr: raw)
            inet_ntop(AF_INET, &address, &buffer, socklen_t(buffer.count))
        case .v6(var raw):
            inet_ntop(AF_INET6, &raw, &buffer, socklen_t(buffer.count))
        }
        return String(decoding: buffer.prefix(while: { $0 != 0 }).map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }

    // Equality and hashing read the address in place: no array of its bytes (a forwarding
    // thread compares and hashes client addresses per datagram).
    public static func == (lhs: IPAddress, rhs: IPAddress) -> Bool {
        switch (lhs, rhs) {
        case (.v4(let a), .v4(let b)):
            return a == b
        case (.v6(let a), .v6(let b)):
            return Self.halves(a) == Self.halves(b)
        default:
            return false
        }
    }

    public func hash(into hasher: inout Hasher) {
        switch self {
        case .v4(let raw):
            hasher.combine(UInt8(4))
            hasher.combine(raw)
        case .v6(let raw):
            let (high, low) = Self.halves(raw)
            hasher.combine(UInt8(6))
            hasher.combine(high)
            hasher.combine(low)
        }
    }

    @inline(__always)
    private static func halves(_ raw: in6_addr) -> (UInt64, UInt64) {
        withUnsafeBytes(of: raw) { ($0.loadUnaligned(fromByteOffset: 0, as: UInt64.self), $0.loadUnaligned(fromByteOffset: 8, as: UInt64.self)) }
    }
}

/// An address and UDP port.
public struct SocketAddress: Hashable, Sendable, CustomStringConvertible {
    public var ip: IPAddress
    public var port: UInt16

    public init(ip: IPAddress, port: UInt16) {
        self.ip = ip
        self.port = port
    }

    /// Parses `1.2.3.4:5`, `[2001:db8::1]:5`; nil if it is not an address with a port.
    public init?(_ text: String) {
        let host: Substring
        let portText: Substring
        if text.hasPrefix("[") {
            guard let close = text.firstIndex(of: "]"),
                text[text.index(after: close)...].hasPrefix(":")
            else { return nil }
            host = text[text.index(after: text.startIndex)..<close]
            portText = text[text.index(close, offsetBy: 2)...]
        } else {
            guard let colon = text.lastIndex(of: ":"), !text[..<colon].contains(":") else { return nil }
            host = text[..<colon]
            portText = text[text.index(after: colon)...]
        }
        guard let ip = IPAddress(String(host)), let port = UInt16(portText) else { return nil }
        self.init(ip: ip, port: port)
    }

    public var description: String {
        switch ip {
        case .v4: return "\(ip):\(port)"
        case .v6: return "[\(ip)]:\(port)"
        }
    }

    /// Calls `body` with this address as a `sockaddr` and its length.
    public func withSockAddr<R, E: Error>(_ body: (UnsafePointer<sockaddr>, socklen_t) throws(E) -> R) throws(E) -> R {
        var storage = sockaddr_storage()
        let length = write(to: &storage)
        return try withUnsafePointer(to: &storage) { (pointer) throws(E) -> R in
            try pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { (address) throws(E) -> R in try body(address, length) }
        }
    }

    /// Writes this address into `storage`; returns its length.
    public func write(to storage: inout sockaddr_storage) -> socklen_t {
        withUnsafeMutableBytes(of: &storage) { raw in
            switch ip {
            case .v4(let address):
                var sin = sockaddr_in()
                sin.sin_family = sa_family_t(AF_INET)
                sin.sin_port = port.bigEndian
                sin.sin_addr = in_addr(s_addr: address)
                withUnsafeBytes(of: &sin) { raw.copyMemory(from: $0) }
                return socklen_t(MemoryLayout<sockaddr_in>.size)
            case .v6(let address):
                var sin6 = sockaddr_in6()
                sin6.sin6_family = sa_family_t(AF_INET6)
                sin6.sin6_port = port.bigEndian
                sin6.sin6_addr = address
                withUnsafeBytes(of: &sin6) { raw.copyMemory(from: $0) }
                return socklen_t(MemoryLayout<sockaddr_in6>.size)
            }
        }
    }

    /// Reads an AF_INET or AF_INET6 address; nil for any other family.
    public init?(storage: UnsafeRawPointer) {
        let family = storage.load(as: sa_family_t.self)
        switch Int32(family) {
        case AF_INET:
            let sin = storage.loadUnaligned(as: sockaddr_in.self)
            self.init(ip: .v4(sin.sin_addr.s_addr), port: UInt16(bigEndian: sin.sin_port))
        case AF_INET6:
            let sin6 = storage.loadUnaligned(as: sockaddr_in6.self)
            self.init(ip: .v6(sin6.sin6_addr), port: UInt16(bigEndian: sin6.sin6_port))
        default:
            return nil
        }
    }
}

extension IPAddress {
    /// Why `text` is not an address the tools take, naming the fix; nil when it parses. Scoped
    /// IPv6 addresses (`fe80::1%eth0`) are refused with a hint: a group or a downstream needs
    /// an address that means the same on every interface.
    public static func problem(parsing text: String) -> String? {
        if IPAddress(text) != nil { return nil }
        if text.contains("%") {
            return "'\(text)': scoped IPv6 addresses (fe80::1%eth0) are not supported: use a global or unique-local address (ip -6 addr show), or ::"
        }
        return "'\(text)' is not an IPv4 or IPv6 address"
    }
}

extension IPAddress {
    /// The address's bytes (4 or 16) in four 32-bit words, network order, the rest zero: how the
    /// BPF programs' map keys and values hold an address.
    package var words: (UInt32, UInt32, UInt32, UInt32) {
        var words: (UInt32, UInt32, UInt32, UInt32) = (0, 0, 0, 0)
        withUnsafeMutableBytes(of: &words) { raw in
            for (index, byte) in bytes.enumerated() { raw[index] = byte }
        }
        return words
    }
}
