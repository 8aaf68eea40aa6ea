// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif

/// Why a downstream name did not resolve to addresses. Each case names the host, the servers
/// asked, and what to check; ``result`` is the `result` label of `udp_fanout_dns_resolutions_total`.
enum DNSError: Error, Equatable, CustomStringConvertible {
    /// No server answered within the timeout, after every attempt.
    case timeout(host: String, servers: String, seconds: Int, attempts: Int)
    /// Every server refused the connection (ICMP port unreachable: nothing listens there).
    case unreachable(host: String, servers: String)
    /// The server answered SERVFAIL: it could not get an answer from the name's authority.
    case serverFailure(host: String, servers: String)
    /// The server answered REFUSED: it does not serve this name or this client.
    case refused(host: String, servers: String)
    /// The server answered with another error code (FORMERR, NOTIMP, ...).
    case unexpectedCode(host: String, servers: String, rcode: UInt8)
    /// NXDOMAIN: the name does not exist. `negativeTTL` is how long the server says that holds.
    case nameNotFound(host: String, negativeTTL: UInt32?)
    /// The name exists but has neither A nor AAAA records.
    case noAddresses(host: String, negativeTTL: UInt32?)
    /// The answer could not be read (truncated, malformed, hostile).
    case malformedAnswer(host: String, servers: String, reason: String)
    /// The name cannot be put in a DNS query (a label over 63 bytes, over 255 in all, empty label).
    case invalidName(host: String)
    /// glibc's resolver could not be initialised (res_ninit).
    case resolverUnavailable(host: String, errno: Int32)
    /// A system call failed while sending or receiving.
    case system(host: String, servers: String, errno: Int32)

    /// The `result` label value counted for this failure.
    var result: String {
        switch self {
        case .timeout: return "timeout"
        case .unreachable: return "unreachable"
        case .serverFailure: return "servfail"
        case .refused: return "refused"
        case .unexpectedCode: return "error_code"
        case .nameNotFound: return "nxdomain"
        case .noAddresses: return "nodata"
        case .malformedAnswer: return "malformed"
        case .invalidName: return "invalid_name"
        case .resolverUnavailable, .system: return "system_error"
        }
    }

    /// Every `result` label value a failure can have, for metrics that list each one from zero.
    static let results = ["timeout", "unreachable", "servfail", "refused", "error_code", "nxdomain", "nodata", "malformed", "invalid_name", "system_error"]

    var description: String {
        switch self {
        case let .timeout(host, servers, seconds, attempts):
            return "resolving '\(host)': no answer from \(servers) in \(attempts) attempt(s) of \(seconds) s: check that the nameserver runs and that this host can reach it (firewall, route, network namespace)"
        case let .unreachable(host, servers):
            return "resolving '\(host)': \(servers) refused the query (nothing listens there): start the nameserver or fix the nameserver address"
        case let .serverFailure(host, servers):
            return "resolving '\(host)': \(servers) answered SERVFAIL (it could not reach the name's authority): check the nameserver's upstreams and the zone"
        case let .refused(host, servers):
            return "resolving '\(host)': \(servers) answered REFUSED: the nameserver does not serve this name or this client; use a resolver that does (e.g. the cluster DNS) or allow this client"
        case let .unexpectedCode(host, servers, rcode):
            return "resolving '\(host)': \(servers) answered with error code \(rcode): check the nameserver's log"
        case let .nameNotFound(host, _):
            return "resolving '\(host)': no such name (NXDOMAIN): check the spelling of the downstream address, and give the fully qualified name (search domains are not applied)"
        case let .noAddresses(host, _):
            return "resolving '\(host)': the name has no A or AAAA record: point it at the downstreams' addresses (a headless Service, A/AAAA records)"
        case let .malformedAnswer(host, servers, reason):
            return "resolving '\(host)': the answer from \(servers) cannot be read (\(reason)): check what answers on that address"
        case let .invalidName(host):
            return "'\(host)' is not a DNS name (labels of 1 to 63 bytes, 255 in all): fix the downstream address"
        case let .resolverUnavailable(host, code):
            return "resolving '\(host)': glibc's resolver could not start (res_ninit: \(String(cString: strerror(code)))): check /etc/resolv.conf"
        case let .system(host, servers, code):
            return "resolving '\(host)' with \(servers): \(String(cString: strerror(code))) (errno \(code))"
        }
    }
}
