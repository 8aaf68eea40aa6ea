// SPDX-License-Identifier: Apache-2.0
import CSystemShim
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// Resolves a downstream name to its A and AAAA addresses with the answer's TTL, through
/// glibc's resolver (res_nmkquery + res_nsend; getaddrinfo gives no TTL). The name is queried as
/// given: search domains are not applied, so a typo is NXDOMAIN rather than a lookup in some
/// other domain. Blocking: call it off the cooperative pool.
struct DNSResolver: Sendable {
    /// The servers asked, in order; nil: the `nameserver` lines of /etc/resolv.conf (read at each
    /// resolution, so a file changed at run time, or the one `ip netns exec` mounts, is used).
    let nameservers: [SocketAddress]?
    /// How long one attempt waits for an answer (whole seconds: glibc's `timeout` option).
    let timeout: Duration
    /// Tries per server (glibc's `attempts` option).
    let attempts: Int

    /// - Parameters:
    ///   - nameservers: servers with their ports (glibc uses at most 3); nil for /etc/resolv.conf's.
    ///   - timeout: per attempt, rounded up to whole seconds, at least 1 s.
    ///   - attempts: tries per server, at least 1.
    init(nameservers: [SocketAddress]? = nil, timeout: Duration = .seconds(2), attempts: Int = 2) {
        self.nameservers = nameservers
        self.timeout = timeout
        self.attempts = max(1, attempts)
    }

    /// What the servers are called in error messages.
    var serversDescription: String {
        guard let nameservers, !nameservers.isEmpty else { return "the nameservers of /etc/resolv.conf" }
        return nameservers.map(\.description).joined(separator: ", ")
    }

    private var timeoutSeconds: Int {
        let (seconds, attoseconds) = timeout.components
        return max(1, Int(seconds) + (attoseconds > 0 ? 1 : 0))
    }

    /// Asks for A and AAAA records of `host` and returns every address (sorted, no duplicates)
    /// with the smallest TTL among the records that gave them (CNAMEs followed included).
    /// A name with no address is an error, never an empty set: an operator's typo or a zone
    /// emptied by mistake must not take every downstream away (the watcher keeps the last good set).
    /// - Throws: ``DNSError``: `.nameNotFound` for NXDOMAIN, `.noAddresses` when neither type has a
    ///   record, and timeout, unreachable, SERVFAIL, REFUSED or a malformed answer, each naming
    ///   the host and the servers. One type failing fails the whole resolution: half an answer
    ///   would drop the other family's downstreams.
    func resolve(_ host: String) throws(DNSError) -> (addresses: [IPAddress], ttl: Duration) {
        var found: Set<IPAddress> = []
        var ttl: UInt32?
        var notFound = false
        var negativeTTLs: [UInt32] = []
        for type in [DNSMessage.RecordType.a, .aaaa] {
            let message = try query(host, type)
            if message.rcode == DNSMessage.ResponseCode.nameError.rawValue {
                notFound = true
                negativeTTLs += message.negativeTTL.map { [$0] } ?? []
                continue
            }
            let answer = message.addresses(of: type, for: host)
            if let answerTTL = answer.ttl {
                found.formUnion(answer.addresses)
                ttl = min(ttl ?? answerTTL, answerTTL)
            } else {
                negativeTTLs += message.negativeTTL.map { [$0] } ?? []
            }
        }
        guard let ttl, !found.isEmpty else {
            let negativeTTL = negativeTTLs.min()
            throw notFound ? .nameNotFound(host: host, negativeTTL: negativeTTL) : .noAddresses(host: host, negativeTTL: negativeTTL)
        }
        return (found.sorted(by: Self.precedes), .seconds(Int64(ttl)))
    }

    /// One question: a NOERROR or NXDOMAIN message, or the error the failure means.
    func query(_ host: String, _ type: DNSMessage.RecordType) throws(DNSError) -> DNSMessage {
        var servers = (nameservers ?? []).map { address in
            var storage = sockaddr_storage()
            _ = address.write(to: &storage)
            return storage
        }
        // 64 KiB: glibc retries over TCP when the UDP answer is truncated and needs the room.
        var answer = [UInt8](repeating: 0, count: 65535)
        var queryID: UInt16 = 0
        var error: Int32 = 0
        let length = servers.withUnsafeMutableBufferPointer { servers in
            answer.withUnsafeMutableBufferPointer { answer in
                shim_dns_send(host, Int32(type.rawValue), servers.baseAddress, Int32(servers.count),
                              Int32(timeoutSeconds), Int32(attempts), answer.baseAddress, Int32(answer.count), &queryID, &error)
            }
        }
        switch length {
        case -2:
            throw .resolverUnavailable(host: host, errno: error)
        case -3:
            throw .invalidName(host: host)
        case ..<0:
            // res_nsend moves on from SERVFAIL/REFUSED/NOTIMP; the last such reply is still in
            // the buffer when its ID is this query's.
            if let header = DNSMessage.responseHeader(answer), header.id == queryID {
                throw Self.failure(rcode: header.rcode, host: host, servers: serversDescription)
            }
            switch error {
            case ETIMEDOUT: throw .timeout(host: host, servers: serversDescription, seconds: timeoutSeconds, attempts: attempts)
            case ECONNREFUSED: throw .unreachable(host: host, servers: serversDescription)
            default: throw .system(host: host, servers: serversDescription, errno: error)
            }
        default:
            let message: DNSMessage
            do {
                message = try DNSMessage(parsing: Array(answer.prefix(Int(length))))
            } catch {
                throw .malformedAnswer(host: host, servers: serversDescription, reason: error.reason)
            }
            guard message.isResponse, message.id == queryID else {
                throw .malformedAnswer(host: host, servers: serversDescription, reason: "not a response to this query (ID \(message.id), expected \(queryID))")
            }
            switch message.rcode {
            case DNSMessage.ResponseCode.noError.rawValue, DNSMessage.ResponseCode.nameError.rawValue:
                return message
            default:
                throw Self.failure(rcode: message.rcode, host: host, servers: serversDescription)
            }
        }
    }

    /// The order of a resolved set: IPv4 before IPv6, then by bytes, so equal sets compare equal.
    static func precedes(_ a: IPAddress, _ b: IPAddress) -> Bool {
        a.family != b.family ? a.family == AF_INET : a.bytes.lexicographicallyPrecedes(b.bytes)
    }

    private static func failure(rcode: UInt8, host: String, servers: String) -> DNSError {
        switch DNSMessage.ResponseCode(rawValue: rcode) {
        case .serverFailure?: return .serverFailure(host: host, servers: servers)
        case .refused?: return .refused(host: host, servers: servers)
        default: return .unexpectedCode(host: host, servers: servers, rcode: rcode)
        }
    }
}
