#if canImport(Glibc)
import Glibc
#endif
import AsyncHTTPClient
import NIOCore
import ReusePortLB

/// Why `udp-fanout status` could not show the daemon, each with the fix.
package enum StatusClientError: Error, CustomStringConvertible {
    case endpointDisabled(config: String)
    case unreachable(url: String, problem: String)
    case httpStatus(url: String, status: Int, body: String)
    case notStatus(url: String, problem: String)

    package var description: String {
        switch self {
        case .endpointDisabled(let config):
            return "\(config) has no HTTP endpoint (metrics.enabled is false): /status is served there; set metrics.enabled: true and reload, or pass --endpoint http://HOST:PORT"
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

    /// One report from `endpoint` (`http://HOST:PORT`, with or without a trailing `/status`).
    package static func fetch(_ endpoint: String, timeout: Duration = .seconds(3)) async throws(StatusClientError) -> StatusReport {
        var base = endpoint
        while base.hasSuffix("/") { base.removeLast() }
        let url = base.hasSuffix("/status") ? base : base + "/status"
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
            throw .unreachable(url: url, problem: "\(error)")
        }
        guard code == 200 else {
            throw .httpStatus(url: url, status: code, body: String(decoding: body.prefix(300), as: UTF8.self).trimmingTrailingNewlines)
        }
        do {
            return try StatusReport.decode(body)
        } catch {
            throw .notStatus(url: url, problem: "\(error)")
        }
    }
}

extension String {
    fileprivate var trimmingTrailingNewlines: String {
        var text = self
        while text.hasSuffix("\n") { text.removeLast() }
        return text
    }
}
