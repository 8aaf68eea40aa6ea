// SPDX-License-Identifier: Apache-2.0
import AsyncHTTPClient
import FoundationEssentials
import Logging
import NIOCore
import NIOSSL
import ServiceLifecycle
import Synchronization

/// Lists and watches the `discovery.k8s.io/v1` EndpointSlices of one Service (label selector
/// `kubernetes.io/service-name=<service>`) and hands the service's complete endpoint set to
/// `onUpdate`: once after the first complete list (even when empty) and after every change
/// that alters the set (never for bookmarks or modifications that leave it as it was).
///
/// Protocol: a paginated list gives the slices and a resourceVersion; a watch from there
/// streams newline-delimited JSON events. When a watch ends (its timeoutSeconds, or the
/// connection drops) it is opened again from the last resourceVersion seen, without a list;
/// `410 Gone` (an ERROR event or the HTTP status) means that version is no longer kept: list
/// again, at once for the first 410 after a healthy watch, after the backoff for a repeat.
/// Failures are logged, counted, and retried after a capped exponential backoff with jitter,
/// which starts over only after a healthy watch (not after a list: a server that answers every
/// watch with 410 or an error would otherwise be asked again at once, forever). A 401 makes the
/// next attempt read the credentials' files again (a fixed inline kubeconfig token). A malformed
/// event or object is logged, counted and skipped.
final class EndpointSliceWatcher: Service, Sendable {
    /// Delays and bounds; tests shorten them.
    struct Timing: Sendable {
        /// First retry delay after a failure; doubles up to `maximumBackoff`, each delay
        /// jittered down to half so many watchers do not retry in step (client-go's reflector:
        /// 0.8 s to 30 s).
        var initialBackoff: Duration = .milliseconds(800)
        var maximumBackoff: Duration = .seconds(30)
        /// The watch's `timeoutSeconds`, drawn from this range per watch (client-go draws 5 to 10
        /// minutes) so the API server's load of re-watches is spread.
        var watchTimeoutSeconds: ClosedRange<Int> = 300...600
        /// Bound on a list request and on receiving a watch's response head.
        var requestTimeout: Duration = .seconds(30)
        /// A watch silent for its timeout plus this is taken as a dead connection.
        var stallMargin: Duration = .seconds(30)
        /// `limit` of each list page.
        var pageSize = 500
        /// A watch open at least this long (from its response head to its end, however it
        /// ends) was healthy: the backoff starts over, and a 410 at its end relists at once.
        /// One that ends sooner is retried after the backoff, not at once (a clean end), or its
        /// 410 counts as a repeat, so a server that ends every watch at once is not hammered.
        var minimumWatchDuration: Duration = .seconds(10)
    }

    let source: Kubernetes
    /// `kubernetes.namespace`, else the credentials' default namespace (as first loaded: a
    /// reload that changes it starts a new watcher).
    let namespace: String
    /// The credentials in use: replaced when they are read again after a 401 and changed.
    private let current: Mutex<KubernetesCredentials>
    /// The credentials the next request uses.
    var credentials: KubernetesCredentials { current.withLock { $0 } }
    let httpClient: HTTPClient
    let logger: Logger
    let onUpdate: @Sendable ([DiscoveredEndpoint]) -> Void
    /// Told each failure that is retried (the daemon shows the last one on /readyz until the first list).
    let onFailure: (@Sendable (String) -> Void)?
    let timing: Timing
    private let counters = Mutex(Counters())

    /// A watch event line longer than this ends the watch (a slice of 1000 endpoints is far below).
    static let maximumLineBytes = 16 << 20

    /// - Parameters:
    ///   - source: the listener's `kubernetes` block (namespace, service, port).
    ///   - credentials: where the API server is and how to authenticate.
    ///   - httpClient: any client; each request carries the credentials' TLS configuration.
    ///   - onUpdate: called with the complete endpoint set, on the watcher's task, in order.
    init(
        source: Kubernetes, credentials: KubernetesCredentials, httpClient: HTTPClient, logger: Logger,
        timing: Timing = Timing(), onFailure: (@Sendable (String) -> Void)? = nil,
        onUpdate: @escaping @Sendable ([DiscoveredEndpoint]) -> Void
    ) {
        self.onFailure = onFailure
        self.source = source
        self.namespace = source.namespace ?? credentials.defaultNamespace
        self.current = Mutex(credentials)
        self.httpClient = httpClient
        self.logger = logger
        self.timing = timing
        self.onUpdate = onUpdate
    }

    /// Lists and watches until graceful shutdown or cancellation; never throws for API
    /// failures (they are logged, counted and retried).
    func run() async throws {
        logger.info("starting EndpointSlice watch", metadata: ["namespace": "\(namespace)", "service": "\(source.service)", "api": "\(credentials.server)", "credentials": "\(credentials.origin)"])
        if credentials.skipsTLSVerification {
            logger.warning("k8s discovery: insecure-skip-tls-verify is set: the API server's certificate is not verified; give the cluster's certificate-authority instead", metadata: ["credentials": "\(credentials.origin)"])
        }
        await cancelWhenGracefulShutdown { await self.watchLoop() }
    }

    // MARK: The loop

    /// What the loop knows between requests.
    private struct State {
        var slices: [String: EndpointSlice] = [:]
        /// nil: list first.
        var resourceVersion: String?
        /// What onUpdate got last (nil: nothing yet).
        var published: [DiscoveredEndpoint]?
        /// When the current watch's response head arrived (nil: no watch open).
        var watchOpened: ContinuousClock.Instant?
        /// A 410 came since the last healthy watch: another one is a repeat and waits the backoff.
        var goneSinceHealthyWatch = false
    }

    private enum WatchEnd {
        /// The server closed the stream cleanly (its timeoutSeconds).
        case closed
        /// ERROR 410 or HTTP 410: relist.
        case gone(String)
    }

    private func watchLoop() async {
        var state = State()
        var backoff = Backoff(initial: timing.initialBackoff, maximum: timing.maximumBackoff)
        var rereadCredentials = false
        while !Task.isCancelled {
            if rereadCredentials {
                // Read after the backoff, right before the retry: a fix made meanwhile is used.
                rereadCredentials = false
                await rereadAfterUnauthorized()
            }
            do {
                // No reset after a list: a server that lists fine and fails every watch (410
                // or an error) must meet a growing backoff. Only a healthy watch resets it.
                if state.resourceVersion == nil { try await list(into: &state) }
                let end = try await watch(&state)
                let healthy = watchEnded(&state, &backoff)
                switch end {
                case .closed:
                    countRestart("closed")
                    logger.debug("k8s discovery: watch ended; watching again from the last resourceVersion", metadata: metadata(["resourceVersion": "\(state.resourceVersion ?? "")"]))
                    if !healthy { try await Task.sleep(for: backoff.next()) }
                case .gone(let message):
                    try await relist(after: message, &state, &backoff)
                }
            } catch let error as DiscoveryError {
                watchEnded(&state, &backoff)
                if case .gone(let message) = error {
                    do { try await relist(after: message, &state, &backoff) } catch { return }
                    continue
                }
                if Task.isCancelled { return }
                if case .unauthorized = error { rereadCredentials = true }
                countError(error.reason)
                countRestart("error")
                let delay = backoff.next()
                logger.error("k8s discovery: \(error)", metadata: metadata(["retry_in": "\(delay)", "reason": "\(error.reason)"]))
                onFailure?("\(error)")
                do { try await Task.sleep(for: delay) } catch { return }
            } catch {
                // Cancellation (graceful shutdown) is the only other error here.
                return
            }
        }
    }

    /// Notes that the open watch (if any) ended: one that was open for `minimumWatchDuration`
    /// was healthy, and the backoff and the 410 streak start over.
    /// - Returns: whether it was healthy (false when no watch was open).
    @discardableResult
    private func watchEnded(_ state: inout State, _ backoff: inout Backoff) -> Bool {
        guard let opened = state.watchOpened else { return false }
        state.watchOpened = nil
        guard ContinuousClock.now - opened >= timing.minimumWatchDuration else { return false }
        backoff.reset()
        state.goneSinceHealthyWatch = false
        return true
    }

    /// 410 Gone (to a watch or a list's continue): the version is no longer kept; list again.
    /// The first 410 since a healthy watch lists at once (an info line: compaction is normal);
    /// a repeat (the watch from a fresh list's own version refused again, a list refused
    /// again) is a failure: logged as an error with retry_in, counted, told to onFailure, and
    /// retried after the backoff, as client-go's reflector does.
    private func relist(after message: String, _ state: inout State, _ backoff: inout Backoff) async throws {
        countRestart("gone")
        state.resourceVersion = nil
        guard state.goneSinceHealthyWatch else {
            state.goneSinceHealthyWatch = true
            logger.info("k8s discovery: resourceVersion expired (410 Gone); listing again", metadata: metadata(["message": "\(message)"]))
            return
        }
        let error = DiscoveryError.gone(message: message)
        countError(error.reason)
        let delay = backoff.next()
        logger.error("k8s discovery: \(error) after the backoff: 410 Gone again without a healthy watch since the last one", metadata: metadata(["retry_in": "\(delay)", "reason": "\(error.reason)"]))
        onFailure?("\(error)")
        try await Task.sleep(for: delay)
    }

    /// After a 401, reads the credentials' files again (as client-go refreshes a credential
    /// plugin's token on 401): a fixed inline kubeconfig `token` or client certificate is used
    /// by the next request. Credentials now naming another server or namespace are not taken
    /// here (the watch's state belongs to the old one): a reload starts a watcher with them.
    private func rereadAfterUnauthorized() async {
        let old = credentials
        let result = await offCooperativePool("k8s-credentials") {
            Result { () throws(DiscoveryError) in try old.reread() }
        }
        let new: KubernetesCredentials
        switch result {
        case .failure(let error):
            countError(error.reason)
            logger.error("k8s discovery: after HTTP 401 the credentials could not be read again: \(error); keeping the ones in use", metadata: metadata(["reason": "\(error.reason)"]))
            return
        case .success(let value): new = value
        }
        if new.isSame(as: old) { return }
        guard new.server == old.server, new.defaultNamespace == old.defaultNamespace else {
            logger.warning("k8s discovery: after HTTP 401 the credentials read again name another API server or namespace; a reload (SIGHUP) switches to them, until then the ones in use stay",
                metadata: metadata(["api": "\(new.server)", "credentials": "\(new.origin)"]))
            return
        }
        current.withLock { $0 = new }
        logger.info("k8s discovery: credentials read again after HTTP 401 changed; the next request uses them", metadata: metadata(["credentials": "\(new.origin)"]))
    }

    // MARK: List

    private var collectionURL: String {
        "\(credentials.server)/apis/discovery.k8s.io/v1/namespaces/\(Self.encode(namespace))/endpointslices?labelSelector=\(Self.encode("kubernetes.io/service-name=\(source.service)"))"
    }

    private func list(into state: inout State) async throws {
        var slices: [String: EndpointSlice] = [:]
        var continueToken: String?
        var resourceVersion: String?
        repeat {
            var url = collectionURL + "&limit=\(timing.pageSize)"
            if let token = continueToken { url += "&continue=\(Self.encode(token))" }
            let response = try await send(url)
            let body: ByteBuffer
            do {
                body = try await response.body.collect(upTo: 256 << 20)
            } catch {
                if Task.isCancelled { throw CancellationError() }
                throw DiscoveryError.transport(url: url, problem: "the list answer broke off: \(error)")
            }
            let page: EndpointSliceList
            do {
                page = try JSONDecoder().decode(EndpointSliceList.self, from: Data(Array(buffer: body)))
            } catch {
                throw DiscoveryError.malformedList(url: url, problem: "\(error)")
            }
            for slice in page.items ?? [] {
                guard let name = slice.metadata?.name else {
                    malformed("malformed_object", "an EndpointSlice without metadata.name in a list; skipped", Array(buffer: body))
                    continue
                }
                inspect(slice, name: name)
                slices[name] = slice
            }
            resourceVersion = page.metadata?.resourceVersion
            continueToken = page.metadata?.continue.flatMap { $0.isEmpty ? nil : $0 }
        } while continueToken != nil
        guard let resourceVersion, !resourceVersion.isEmpty else {
            throw DiscoveryError.malformedList(url: collectionURL, problem: "metadata.resourceVersion is missing, so no watch can follow")
        }
        counters.withLock { $0.lists += 1 }
        state.slices = slices
        state.resourceVersion = resourceVersion
        publish(&state)
    }

    // MARK: Watch

    private func watch(_ state: inout State) async throws -> WatchEnd {
        let seconds = Int.random(in: timing.watchTimeoutSeconds)
        let url = collectionURL + "&watch=1&resourceVersion=\(Self.encode(state.resourceVersion ?? "0"))&allowWatchBookmarks=true&timeoutSeconds=\(seconds)"
        let response = try await send(url)
        // Open from here: how long it stays open tells a healthy watch (see watchEnded).
        state.watchOpened = .now
        let (lines, sink) = AsyncThrowingStream.makeStream(of: [UInt8].self)
        let stall = Duration.seconds(seconds) + timing.stallMargin
        return try await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask {
                var splitter = LineSplitter(limit: Self.maximumLineBytes)
                do {
                    for try await chunk in response.body {
                        for line in try splitter.append(chunk) { sink.yield(line) }
                    }
                    if let rest = splitter.remainder { sink.yield(rest) }
                    sink.finish()
                } catch {
                    sink.finish(throwing: error)
                }
            }
            group.addTask {
                // The server ends the watch after `seconds`; silence well past that is a dead
                // connection that no TCP error has reported yet.
                do { try await Task.sleep(for: stall) } catch { return }
                sink.finish(throwing: DiscoveryError.watchStalled(seconds: Int(stall.components.seconds)))
            }
            defer { group.cancelAll() }
            do {
                for try await line in lines {
                    if let end = try handle(line, &state) { return end }
                }
            } catch let error as DiscoveryError {
                throw error
            } catch {
                if Task.isCancelled { throw CancellationError() }
                throw DiscoveryError.transport(url: url, problem: "the watch stream broke off: \(error)")
            }
            if Task.isCancelled { throw CancellationError() }
            return .closed
        }
    }

    /// Applies one watch event line. Returns how the watch ends, or nil to go on.
    private func handle(_ line: [UInt8], _ state: inout State) throws -> WatchEnd? {
        guard line.contains(where: { $0 != UInt8(ascii: " ") && $0 != UInt8(ascii: "\r") && $0 != UInt8(ascii: "\t") }) else { return nil }
        let decoder = JSONDecoder()
        let data = Data(line)
        guard let type = (try? decoder.decode(WatchEventHeader.self, from: data))?.type else {
            malformed("malformed_event", "a watch event that is not JSON with a type; skipped", line)
            return nil
        }
        switch type {
        case "ADDED", "MODIFIED", "DELETED":
            guard let slice = (try? decoder.decode(WatchEvent<EndpointSlice>.self, from: data))?.object, let name = slice.metadata?.name else {
                malformed("malformed_object", "a \(type) event whose object is not an EndpointSlice with a name; skipped", line)
                return nil
            }
            if let version = slice.metadata?.resourceVersion, !version.isEmpty { state.resourceVersion = version }
            if type == "DELETED" {
                state.slices[name] = nil
            } else {
                inspect(slice, name: name)
                state.slices[name] = slice
            }
            publish(&state)
        case "BOOKMARK":
            // Only the resourceVersion is meaningful in a bookmark's object.
            if let version = (try? decoder.decode(WatchEvent<EndpointSlice>.self, from: data))?.object?.metadata?.resourceVersion, !version.isEmpty {
                state.resourceVersion = version
            }
        case "ERROR":
            let status = (try? decoder.decode(WatchEvent<APIStatus>.self, from: data))?.object
            if status?.code == 410 { return .gone(status?.message ?? "Gone") }
            throw DiscoveryError.httpStatus(url: collectionURL, status: UInt(status?.code ?? 0), message: "watch ERROR event: \(status?.reason ?? "") \(status?.message ?? String(decoding: line.prefix(300), as: UTF8.self))")
        default:
            malformed("malformed_event", "a watch event of unknown type \(type); skipped", line)
        }
        return nil
    }

    // MARK: Requests

    /// Sends a GET with the current credentials; returns the response when it is 200.
    private func send(_ url: String) async throws -> HTTPClientResponse {
        let credentials = self.credentials
        // The token file is re-read per request (bound tokens rotate): a file read, off the pool.
        let authorization = try await offCooperativePool("k8s-token") {
            Result { () throws(DiscoveryError) in try credentials.authorization() }
        }.get()
        var request = HTTPClientRequest(url: url)
        request.tlsConfiguration = Self.requestTLS(credentials.tlsConfiguration)
        request.headers.add(name: "Accept", value: "application/json")
        request.headers.add(name: "User-Agent", value: "udp-fanout")
        if let authorization { request.headers.add(name: "Authorization", value: authorization) }
        let response: HTTPClientResponse
        do {
            response = try await httpClient.execute(request, timeout: .nanoseconds(timing.requestTimeout.wholeNanoseconds))
        } catch {
            if Task.isCancelled { throw CancellationError() }
            throw DiscoveryError.transport(url: url, problem: "\(error)")
        }
        let code = response.status.code
        if code == 200 { return response }
        let body = (try? await response.body.collect(upTo: 64 << 10)).map { Array(buffer: $0) } ?? []
        let status = try? JSONDecoder().decode(APIStatus.self, from: Data(body))
        let message = status?.message ?? String(decoding: body.prefix(300), as: UTF8.self)
        switch code {
        case 401: throw DiscoveryError.unauthorized(url: url, message: message)
        case 403: throw DiscoveryError.forbidden(url: url, message: message)
        case 410: throw DiscoveryError.gone(message: message)
        default: throw DiscoveryError.httpStatus(url: url, status: code, message: message)
        }
    }

    /// The TLS configuration of every request: the credentials' one, closing without waiting
    /// for the API server's close_notify.
    ///
    /// A watch ends (graceful shutdown, a reload, a stall) by closing its connection. NIOSSL
    /// then sends close_notify and by default waits 5 s for the server's before it closes the
    /// socket; a server that keeps streaming the watch instead (an HTTP/1.1 server that allows
    /// half-closure, as the tests' one does) holds the connection that long, and with it
    /// `HTTPClient.shutdown()`: the daemon's exit on SIGTERM. Nothing more is read from a
    /// connection being closed, so the wait buys nothing; Go's crypto/tls (client-go) does not
    /// wait either.
    /// - Parameter tls: the credentials' configuration (CA, client certificate, verification).
    static func requestTLS(_ tls: TLSConfiguration) -> TLSConfiguration {
        var tls = tls
        tls.shutdownTimeout = .zero
        return tls
    }

    // MARK: Publishing

    private func publish(_ state: inout State) {
        let outcome = EndpointSelection.endpoints(of: state.slices, port: source.port)
        let endpoints = outcome.endpoints
        if let previous = state.published, previous == endpoints { return }
        let before = Set(state.published ?? [])
        let after = Set(endpoints)
        state.published = endpoints
        counters.withLock { $0.endpoints = endpoints.count }
        if endpoints.isEmpty {
            logger.warning("k8s discovery: 0 ready endpoints", metadata: metadata(["slices": "\(state.slices.count)", "removed": "\(before.subtracting(after).count)"]))
        } else {
            logger.info("k8s discovery: endpoint set changed", metadata: metadata([
                "added": "\(after.subtracting(before).count)", "removed": "\(before.subtracting(after).count)", "endpoints": "\(endpoints.count)",
                "serving_terminating_only": "\(outcome.usedTerminating)",
            ]))
        }
        onUpdate(endpoints)
    }

    /// Logs what a slice holds that cannot become a downstream, once per arrival of the slice.
    private func inspect(_ slice: EndpointSlice, name: String) {
        let outcome = EndpointSelection.endpoints(of: [name: slice], port: source.port)
        if !outcome.fqdnSlices.isEmpty {
            logger.debug("k8s discovery: EndpointSlice of addressType \(slice.addressType ?? "(none)") ignored (only IPv4 and IPv6 become downstreams)", metadata: metadata(["slice": "\(name)"]))
        }
        for address in outcome.malformedAddresses {
            malformed("malformed_object", "EndpointSlice \(name): endpoint address '\(address)' is not an \(slice.addressType ?? "IP") address; skipped", [])
        }
    }

    private func malformed(_ reason: String, _ message: String, _ text: [UInt8]) {
        countError(reason)
        var extra: Logger.Metadata = [:]
        if !text.isEmpty { extra["text"] = "\(String(decoding: text.prefix(300), as: UTF8.self))" }
        logger.warning("k8s discovery: \(message)", metadata: metadata(extra))
    }

    private func metadata(_ extra: Logger.Metadata = [:]) -> Logger.Metadata {
        extra.merging(["namespace": "\(namespace)", "service": "\(source.service)"]) { a, _ in a }
    }

    // MARK: Metrics

    private struct Counters {
        var endpoints = 0
        var lists: UInt64 = 0
        var restarts: [String: UInt64] = ["closed": 0, "gone": 0, "error": 0]
        var errors: [String: UInt64] = [:]
    }

    private func countRestart(_ reason: String) { counters.withLock { $0.restarts[reason, default: 0] += 1 } }
    private func countError(_ reason: String) { counters.withLock { $0.errors[reason, default: 0] += 1 } }

    /// Error counts by reason (tests and the daemon's logs).
    func errorCount(_ reason: String) -> UInt64 { counters.withLock { $0.errors[reason] ?? 0 } }
    /// Watch restarts by reason: `closed` (stream ended), `gone` (410: relist), `error`.
    func restartCount(_ reason: String) -> UInt64 { counters.withLock { $0.restarts[reason] ?? 0 } }

    /// Prometheus text of this watcher's families, labelled with namespace and service.
    func metricsText() -> String {
        let snapshot = counters.withLock { $0 }
        let labels = "source=\"kubernetes\",namespace=\"\(PrometheusText.escape(namespace))\",service=\"\(PrometheusText.escape(source.service))\""
        var out = "# HELP udp_fanout_discovered_endpoints Endpoints discovery handed on as the downstream set\n# TYPE udp_fanout_discovered_endpoints gauge\n"
        out += "udp_fanout_discovered_endpoints{\(labels)} \(snapshot.endpoints)\n"
        out += "# HELP udp_fanout_discovery_watch_restarts_total EndpointSlice watches opened again, by reason (closed: the stream ended; gone: 410, listed again; error: after a failure)\n# TYPE udp_fanout_discovery_watch_restarts_total counter\n"
        for (reason, value) in snapshot.restarts.sorted(by: { $0.key < $1.key }) {
            out += "udp_fanout_discovery_watch_restarts_total{\(labels),reason=\"\(PrometheusText.escape(reason))\"} \(value)\n"
        }
        out += "# HELP udp_fanout_discovery_errors_total Discovery failures and skipped objects, by reason\n# TYPE udp_fanout_discovery_errors_total counter\n"
        for (reason, value) in snapshot.errors.sorted(by: { $0.key < $1.key }) {
            out += "udp_fanout_discovery_errors_total{\(labels),reason=\"\(PrometheusText.escape(reason))\"} \(value)\n"
        }
        return out
    }

    // MARK: Helpers

    /// Percent-encodes a query value (RFC 3986 unreserved characters pass).
    static func encode(_ text: String) -> String {
        var out = ""
        for byte in text.utf8 {
            switch byte {
            case UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "A")...UInt8(ascii: "Z"), UInt8(ascii: "0")...UInt8(ascii: "9"),
                UInt8(ascii: "-"), UInt8(ascii: "."), UInt8(ascii: "_"), UInt8(ascii: "~"):
                out.append(Character(Unicode.Scalar(byte)))
            default:
                out += "%" + String(byte, radix: 16, uppercase: true).leftPadded(to: 2)
            }
        }
        return out
    }
}

extension EndpointSliceWatcher {
    /// Splits a byte stream into lines on `\n`; a line may span chunks.
    struct LineSplitter {
        let limit: Int
        private var pending: [UInt8] = []

        init(limit: Int) { self.limit = limit }

        /// The complete lines this chunk finishes.
        /// - Throws: ``DiscoveryError/eventTooLarge(bytes:)`` when a line grows past the limit.
        mutating func append(_ chunk: ByteBuffer) throws(DiscoveryError) -> [[UInt8]] {
            var lines: [[UInt8]] = []
            chunk.withUnsafeReadableBytes { bytes in
                var start = 0
                for index in 0..<bytes.count where bytes[index] == UInt8(ascii: "\n") {
                    pending.append(contentsOf: bytes[start..<index])
                    lines.append(pending)
                    pending.removeAll(keepingCapacity: true)
                    start = index + 1
                }
                pending.append(contentsOf: bytes[start..<bytes.count])
            }
            if pending.count > limit { throw .eventTooLarge(bytes: limit) }
            return lines
        }

        /// What is left after the stream ended without a final newline.
        var remainder: [UInt8]? { pending.isEmpty ? nil : pending }
    }

    /// Capped exponential backoff with jitter.
    struct Backoff {
        let initial: Duration
        let maximum: Duration
        private var current: Duration

        init(initial: Duration, maximum: Duration) {
            self.initial = initial
            self.maximum = maximum
            current = initial
        }

        /// The next delay: between half and all of the current step; the step then doubles.
        mutating func next() -> Duration {
            let step = current
            current = min(current * 2, maximum)
            return .nanoseconds(Int64(Double(step.wholeNanoseconds) * Double.random(in: 0.5...1.0)))
        }

        mutating func reset() { current = initial }
    }
}

extension Duration {
    /// Whole nanoseconds, for NIO's `TimeAmount`.
    fileprivate var wholeNanoseconds: Int64 { components.seconds * 1_000_000_000 + components.attoseconds / 1_000_000_000 }
}

extension String {
    fileprivate func leftPadded(to width: Int) -> String { String(repeating: "0", count: max(0, width - count)) + self }
}
