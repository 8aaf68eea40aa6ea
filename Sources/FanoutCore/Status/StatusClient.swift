// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import AsyncHTTPClient
import NIOCore
import ReusePortLB

/// Why `udp-fanout status` could not show the daemon, each with the fix.
package enum StatusClientError: Error, CustomStringConvertible {
    case endpointDisabled(config: String)
    case badEndpoint(String, problem: String)
    case config(path: String, ConfigError)
    case unreachable(url: String, problem: String)
    case httpStatus(url: String, status: Int, body: String)
    case notStatus(url: String, problem: String)

    package var description: String {
        switch self {
        case .endpointDisabled(let config):
            return "\(config) has no HTTP endpoint (metrics.enabled is false): /status is served there; set metrics.enabled: true and reload, or pass --endpoint http://HOST:PORT"
        case .badEndpoint(let endpoint, let problem):
            return "--endpoint '\(endpoint)': \(problem); give the daemon's HTTP endpoint as http://HOST:PORT (its metrics.bind)"
        case .config(let path, let error):
            return "cannot find the endpoint in \(path): \(error); pass -c with the file the daemon runs with (e.g. /etc/udp-fanout/config.yaml), or --endpoint http://HOST:PORT"
        case .unreachable(let url, let problem):
            return "cannot reach udp-fanout at \(url): \(problem); is udp-fanout running with this configuration? (or pass --endpoint http://HOST:PORT)"
        case .httpStatus(let url, let status, let body):
            return "\(url) answered HTTP \(status)\(body.isEmpty ? "" : ": \(body)")\(status == 404 ? " (a udp-fanout older than /status, or another server on that port)" : "")"
        case .notStatus(let url, let problem):
            return "\(url) did not answer with udp-fanout's status: \(problem)"
        }
    }
}

/// Reads `GET /status` from a running daemon.
package enum StatusClient {
    /// The endpoint a daemon running `config` serves: its metrics.bind, with a wildcard address
    /// read as loopback.
    package static func endpoint(of config: FanoutConfig, path: String) throws(StatusClientError) -> String {
        guard config.metrics.enabled else { throw .endpointDisabled(config: path) }
        let bind = config.metrics.bind
        let wildcard = bind.ip.bytes.allSatisfy { $0 == 0 }
        switch (bind.ip.family == AF_INET6, wildcard) {
        case (false, true): return "http://127.0.0.1:\(bind.port)"
        case (false, false): return "http://\(bind.ip):\(bind.port)"
        case (true, true): return "http://[::1]:\(bind.port)"
        case (true, false): return "http://[\(bind.ip)]:\(bind.port)"
        }
    }

    /// The status URL of `endpoint`: `http://HOST:PORT` (or `HOST:PORT`), with or without `/status`.
    package static func statusURL(_ endpoint: String) throws(StatusClientError) -> String {
        var rest = Substring(endpoint)
        if let scheme = endpoint.firstRange(of: "://") {
            guard endpoint[..<scheme.lowerBound].lowercased() == "http" else {
                throw .badEndpoint(endpoint, problem: "only http:// is served (the endpoint has no TLS)")
            }
            rest = endpoint[scheme.upperBound...]
        }
        let host = rest.prefix { $0 != "/" }
        var path = rest.dropFirst(host.count)
        while path.hasSuffix("/") { path.removeLast() }
        guard !host.isEmpty, !host.contains(where: { $0 == " " || $0 == "@" || $0 == "?" || $0 == "#" }) else {
            throw .badEndpoint(endpoint, problem: "no HOST:PORT in it")
        }
        guard path.isEmpty || path == "/status" else {
            throw .badEndpoint(endpoint, problem: "'\(path)' is a path; /status is read from the endpoint's root")
        }
        return "http://\(host)/status"
    }

    /// The endpoint of the configuration file at `path` (see ``endpoint(of:path:)``).
    package static func endpoint(configFile path: String) throws(StatusClientError) -> String {
        let config: FanoutConfig
        do {
            config = try ConfigParser.parse(readFile(path))
        } catch {
            throw .config(path: path, error)
        }
        return try endpoint(of: config, path: path)
    }

    /// One report from `endpoint` (``statusURL(_:)``).
    package static func fetch(_ endpoint: String, timeout: Duration = .seconds(3)) async throws(StatusClientError) -> StatusReport {
        let url = try statusURL(endpoint)
        var request = HTTPClientRequest(url: url)
        request.headers.add(name: "Accept", value: "application/json")
        request.headers.add(name: "User-Agent", value: "udp-fanout status")
        let nanoseconds = timeout.components.seconds * 1_000_000_000 + timeout.components.attoseconds / 1_000_000_000
        let body: [UInt8]
        let code: Int
        do {
            let response = try await HTTPClient.shared.execute(request, timeout: .nanoseconds(nanoseconds))
            code = Int(response.status.code)
            body = Array(buffer: try await response.body.collect(upTo: 64 << 20))
        } catch {
            // NIO's text for a refused connect reads "connection reset (error set): Connection refused) (errno: 111)".
            let text = "\(error)"
            throw .unreachable(url: url, problem: text.contains("Connection refused") ? "connection refused" : text)
        }
        guard code == 200 else {
            throw .httpStatus(url: url, status: code, body: Self.excerpt(body))
        }
        do {
            return try StatusReport.decode(body)
        } catch let error as DecodingError {
            // The path and what was missing or wrong, not the decoder's whole dump.
            let context: DecodingError.Context? = switch error {
            case .keyNotFound(_, let context), .typeMismatch(_, let context), .valueNotFound(_, let context), .dataCorrupted(let context): context
            @unknown default: nil
            }
            let path = context.map { $0.codingPath.map { key in key.intValue.map { "[\($0)]" } ?? key.stringValue }.joined(separator: ".") } ?? ""
            throw .notStatus(url: url, problem: "\(context?.debugDescription ?? "not JSON")\(path.isEmpty ? "" : " at \(path)"); answered: \(Self.excerpt(body))")
        } catch {
            throw .notStatus(url: url, problem: "\(error); answered: \(Self.excerpt(body))")
        }
    }

    /// What a server answered, for an error line: one line of at most 120 characters, or "an
    /// HTML page".
    static func excerpt(_ body: [UInt8]) -> String {
        // Control characters (a terminal's escape sequences) shown as "?".
        let text = String(String(decoding: body.prefix(2000), as: UTF8.self).split(whereSeparator: \.isWhitespace).joined(separator: " ")
            .map { $0.isASCII && $0.asciiValue! < 0x20 || $0 == "\u{7f}" ? "?" : $0 })
        if text.hasPrefix("<") { return "an HTML page" }
        return text.count > 120 ? String(text.prefix(120)) + "…" : text
    }
}
