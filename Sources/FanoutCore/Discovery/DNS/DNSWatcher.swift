// SPDX-License-Identifier: Apache-2.0
import Logging
import ReusePortLB
import ServiceLifecycle
import Synchronization

/// Keeps one downstream name's address set current: resolves it at once, then again when the
/// answer's TTL runs out (at least 1 s, at most `maximumInterval`). A failed resolution keeps the
/// last good set, is logged (warning, with the error) and counted, and is retried with
/// exponential backoff from 1 s, capped at `maximumInterval`. NXDOMAIN and "no address" are
/// failures too: a typo or a zone emptied by mistake must not empty a listener.
final class DNSWatcher: Service, Sendable {
    let host: String
    let port: UInt16
    let maximumInterval: Duration
    let resolver: DNSResolver
    let logger: Logger
    private let onUpdate: @Sendable ([SocketAddress]) -> Void
    private let onFailure: (@Sendable (DNSError) -> Void)?
    private let state = Mutex(State())

    private struct State {
        var addresses: [SocketAddress]?
        var ttl: Duration?
        var lastError: DNSError?
        var results: [String: UInt64] = [:]
    }

    /// - Parameters:
    ///   - host: the name as written in the downstream address (queried as given).
    ///   - port: the port every resolved address gets.
    ///   - maximumInterval: the longest wait between resolutions, and the cap of the backoff
    ///     (`settings.resolve_interval_secs`).
    ///   - resolver: the resolver (its nameservers and timeouts).
    ///   - onUpdate: called with the sorted, deduplicated set after the first successful
    ///     resolution and after every change; never with an empty set. Called from the watcher's
    ///     task, one call at a time.
    ///   - onFailure: called with the error of every failed resolution (the set is kept), so the
    ///     daemon's `/readyz` can say why a first resolution is still pending.
    init(host: String, port: UInt16, maximumInterval: Duration, resolver: DNSResolver, logger: Logger,
         onFailure: (@Sendable (DNSError) -> Void)? = nil,
         onUpdate: @escaping @Sendable ([SocketAddress]) -> Void) {
        self.host = host
        self.port = port
        self.maximumInterval = max(maximumInterval, .seconds(1))
        self.resolver = resolver
        self.logger = logger
        self.onUpdate = onUpdate
        self.onFailure = onFailure
    }

    /// The last good set; nil until the first resolution succeeded.
    var addresses: [SocketAddress]? { state.withLock { $0.addresses } }

    /// Why the last resolution failed (nil after a success): what `/readyz` shows while the
    /// first resolution has not succeeded.
    var lastError: String? { state.withLock { $0.lastError?.description } }

    /// Resolves until graceful shutdown or cancellation, then returns (never throws for either).
    func run() async throws {
        do {
            try await cancelWhenGracefulShutdown { try await self.loop() }
        } catch is CancellationError {
            return
        }
    }

    private func loop() async throws {
        var backoff = Duration.seconds(1)
        while true {
            guard let outcome = await resolveOffPool() else { throw CancellationError() }
            let delay: Duration
            switch outcome {
            case .success(let answer):
                backoff = .seconds(1)
                delay = min(max(answer.ttl, .seconds(1)), maximumInterval)
                apply(answer.addresses, ttl: answer.ttl)
            case .failure(let error):
                delay = backoff
                backoff = min(backoff * 2, maximumInterval)
                let kept = state.withLock { state in
                    state.lastError = error
                    state.results[error.result, default: 0] += 1
                    return state.addresses?.count
                }
                logger.warning("DNS resolution failed, keeping the last good set", metadata: [
                    "name": "\(host)", "error": "\(error)", "kept": "\(kept.map(String.init) ?? "none yet")",
                    "retry_in": "\(delay)",
                ])
                onFailure?(error)
            }
            try await Task.sleep(for: delay)
        }
    }

    /// Records a good answer; calls `onUpdate` when it is the first or differs from the last.
    private func apply(_ ips: [IPAddress], ttl: Duration) {
        let addresses = Array(Set(ips.map { SocketAddress(ip: $0, port: port) }))
            .sorted { DNSResolver.precedes($0.ip, $1.ip) }
        let previous = state.withLock { state in
            defer {
                state.addresses = addresses
                state.ttl = ttl
                state.lastError = nil
                state.results["ok", default: 0] += 1
            }
            return state.addresses
        }
        guard previous != addresses else { return }
        if let previous {
            let added = addresses.filter { !previous.contains($0) }, removed = previous.filter { !addresses.contains($0) }
            logger.info("DNS downstream set changed", metadata: [
                "name": "\(host)", "added": "\(added)", "removed": "\(removed)", "count": "\(addresses.count)",
            ])
        } else {
            logger.info("DNS downstream set resolved", metadata: ["name": "\(host)", "addresses": "\(addresses)", "ttl": "\(ttl)"])
        }
        onUpdate(addresses)
    }

    /// Runs the blocking resolution on a thread of its own. Returns nil as soon as the task is
    /// cancelled (shutdown must not wait for a nameserver's timeout); the thread then finishes
    /// on its own and its answer is dropped.
    private func resolveOffPool() async -> Result<(addresses: [IPAddress], ttl: Duration), DNSError>? {
        let gate = ResolutionGate()
        let resolver = resolver, host = host
        return await withTaskCancellationHandler {
            await withCheckedContinuation { continuation in
                guard gate.install(continuation) else { return }
                OSThread.detached(name: "dns-resolve") {
                    gate.finish(Result { () throws(DNSError) in try resolver.resolve(host) })
                }
            }
        } onCancel: {
            gate.finish(nil)
        }
    }

    /// Prometheus text for this watcher alone; with several watchers use ``metricsText(_:)``,
    /// which writes each family's HELP and TYPE once.
    func metricsText() -> String { Self.metricsText([self]) }

    /// `udp_fanout_dns_resolutions_total{name,result}` (every result listed from zero),
    /// `udp_fanout_dns_addresses{name}` (the set in use) and `udp_fanout_dns_ttl_seconds{name}`
    /// (the last good answer's TTL; absent before the first).
    static func metricsText(_ watchers: [DNSWatcher]) -> String {
        let snapshots = watchers.map { watcher in (PrometheusText.escape(watcher.host), watcher.state.withLock { $0 }) }
        var out = "# HELP udp_fanout_dns_resolutions_total DNS resolutions of downstream names, by result\n"
        out += "# TYPE udp_fanout_dns_resolutions_total counter\n"
        for (name, state) in snapshots {
            for result in ["ok"] + DNSError.results {
                out += "udp_fanout_dns_resolutions_total{name=\"\(name)\",result=\"\(result)\"} \(state.results[result] ?? 0)\n"
            }
        }
        out += "# HELP udp_fanout_dns_addresses Addresses a downstream name currently contributes (the last good answer)\n"
        out += "# TYPE udp_fanout_dns_addresses gauge\n"
        for (name, state) in snapshots {
            out += "udp_fanout_dns_addresses{name=\"\(name)\"} \(state.addresses?.count ?? 0)\n"
        }
        out += "# HELP udp_fanout_dns_ttl_seconds TTL of the last good answer for a downstream name\n"
        out += "# TYPE udp_fanout_dns_ttl_seconds gauge\n"
        for (name, state) in snapshots {
            if let ttl = state.ttl { out += "udp_fanout_dns_ttl_seconds{name=\"\(name)\"} \(ttl.components.seconds)\n" }
        }
        return out
    }
}

/// Hands one resolution's result to the waiting task exactly once: either the resolving thread
/// or the cancellation handler resumes it, whichever comes first.
private final class ResolutionGate: Sendable {
    typealias Outcome = Result<(addresses: [IPAddress], ttl: Duration), DNSError>?
    private let slot = Mutex<(continuation: CheckedContinuation<Outcome, Never>?, finished: Bool)>((nil, false))

    /// Stores the continuation; false (and resumed with nil) when cancellation came first.
    func install(_ continuation: CheckedContinuation<Outcome, Never>) -> Bool {
        let cancelled = slot.withLock { slot in
            if slot.finished { return true }
            slot.continuation = continuation
            return false
        }
        if cancelled { continuation.resume(returning: nil) }
        return !cancelled
    }

    func finish(_ outcome: sending Outcome) {
        let continuation = slot.withLock { slot in
            defer { slot.continuation = nil; slot.finished = true }
            return slot.finished ? nil : slot.continuation
        }
        continuation?.resume(returning: outcome)
    }
}
