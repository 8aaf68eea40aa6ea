// SPDX-License-Identifier: Apache-2.0
import Foundation
import Hummingbird
import HummingbirdTLS
import Logging
import NIOCore
import NIOSSL
import ServiceLifecycle
import Synchronization
import Testing
import TestSupport
@testable import FanoutCore

/// A Kubernetes API server for tests, speaking the real wire format over HTTPS on 127.0.0.1:
/// `GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices?labelSelector=kubernetes.io/service-name=S`
/// lists (paginated with `limit`/`continue`) and, with `watch=1&resourceVersion=RV`, streams
/// newline-delimited JSON events (chunked) from that version: ADDED, MODIFIED, DELETED, BOOKMARK
/// (with `allowWatchBookmarks=true`) and ERROR. It keeps EndpointSlices in memory under a
/// resourceVersion counter and the history of changes, so a watch from an older version replays
/// what it missed; a version older than the kept history gets 410 Gone (as an ERROR event, like
/// the real server, or as the HTTP status). It checks `Authorization: Bearer <token>` (401 with a
/// Status body otherwise), or, in client-certificate mode, requires a client certificate signed
/// by its CA in the TLS handshake.
///
/// The CA, server and client certificates are made with the openssl CLI in a temporary
/// directory (server SAN IP:127.0.0.1), removed when ``with(token:clientCertificates:_:)`` returns.
final class KubernetesAPIServer: Sendable {
    /// A test-side EndpointSlice: what the server renders to JSON (with fields the client must
    /// ignore, as a real server sends them).
    struct Slice: Sendable {
        var name: String
        var namespace = "default"
        var service: String
        var addressType = "IPv4"
        var endpoints: [Endpoint]
    }

    struct Endpoint: Sendable {
        var address: String
        /// nil leaves the condition out (the API allows it; nil ready means ready).
        var ready: Bool? = true
        var serving: Bool? = nil
        var terminating: Bool? = nil
        var pod: String? = nil
    }

    /// How a watch from a version older than the history is refused.
    enum GoneStyle: Sendable {
        /// 200, then `{"type":"ERROR","object":{"kind":"Status","code":410,...}}` (what kube-apiserver does).
        case errorEvent
        /// HTTP 410 with a Status body.
        case httpStatus
    }

    private enum WatchMessage: Sendable {
        case line(String)
        /// Close the connection without ending the chunked body.
        case drop
        /// End the body cleanly (what the server's timeoutSeconds does).
        case end
    }

    private struct Watch {
        var namespace: String
        var service: String
        var bookmarks: Bool
        var sink: AsyncStream<WatchMessage>.Continuation
    }

    private struct State {
        var token: String
        var slices: [String: (slice: Slice, version: Int)] = [:]
        var version = 1000
        var history: [(version: Int, type: String, slice: Slice)] = []
        /// A watch from a version below this gets 410.
        var oldestKept = 0
        var goneStyle = GoneStyle.errorEvent
        var watches: [Int: Watch] = [:]
        var nextWatch = 0
        var listsServed = 0
        var watchesServed = 0
        var unauthorizedServed = 0
        var goneServed = 0
        /// Answer 403 (RBAC) to every request.
        var forbidden = false
        /// Answer 410 to every list (as for an expired continue token).
        var listsGone = false
        var listsRefused = 0
        /// Answer every watch with 410 in this style, whatever its resourceVersion (nil: only
        /// versions older than the history).
        var watchesGone: GoneStyle?
        /// When each request arrived (401s included), and each first list page.
        var requestTimes: [ContinuousClock.Instant] = []
        var listTimes: [ContinuousClock.Instant] = []
        /// Set when the server stops: a watch that arrives afterwards (its request was on the
        /// wire when the client went away) ends at once instead of holding the connection, and
        /// with it the server's graceful shutdown, open forever.
        var closed = false
    }

    /// Files the test can hand to credentials.
    let directory: String
    var caPath: String { directory + "/ca.crt" }
    var clientCertificatePath: String { directory + "/client.crt" }
    var clientKeyPath: String { directory + "/client.key" }
    let port: Int
    var url: String { "https://127.0.0.1:\(port)" }
    private let store: Store

    /// Holds the state by reference (a Mutex cannot be copied into the responder).
    private final class Store: Sendable {
        let state: Mutex<State>
        init(_ state: State) { self.state = Mutex(state) }
    }

    private init(directory: String, port: Int, store: Store) {
        self.directory = directory
        self.port = port
        self.store = store
    }

    /// Runs a server for the duration of `body`, then stops it and removes its files.
    /// - Parameters:
    ///   - token: the bearer token requests must carry.
    ///   - clientCertificates: require a client certificate signed by the CA instead of a token.
    static func with<T: Sendable>(
        token: String = "test-token-\(UInt32.random(in: 0...UInt32.max))", clientCertificates: Bool = false,
        _ body: @Sendable (KubernetesAPIServer) async throws -> T
    ) async throws -> T {
        let directory = NSTemporaryDirectory() + "k8s-api-\(UInt64.random(in: 0...UInt64.max))"
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        try await offCooperativePool("k8s-test-certs") { Result { try makeCertificates(in: directory) } }.get()

        var tls = TLSConfiguration.makeServerConfiguration(
            certificateChain: try NIOSSLCertificate.fromPEMFile(directory + "/server.crt").map { .certificate($0) },
            privateKey: .privateKey(try NIOSSLPrivateKey(file: directory + "/server.key", format: .pem)))
        if clientCertificates {
            tls.certificateVerification = .noHostnameVerification
            tls.trustRoots = .file(directory + "/ca.crt")
        }
        let shared = Store(State(token: token))
        let (running, report) = AsyncStream.makeStream(of: Int.self)
        var logger = Logger(label: "k8s-api-test-server")
        logger.logLevel = .warning
        let application = Application(
            responder: Responder(store: shared, clientCertificates: clientCertificates),
            server: try .tls(.http1(), tlsConfiguration: tls),
            configuration: ApplicationConfiguration(address: .hostname("127.0.0.1", port: 0)),
            onServerRunning: { channel in
                report.yield(channel.localAddress?.port ?? 0)
                report.finish()
            },
            logger: logger)
        let group = ServiceGroup(configuration: .init(services: [application], logger: logger))
        return try await withThrowingTaskGroup(of: Void.self) { tasks in
            tasks.addTask {
                // A server that cannot start must not leave the caller waiting for its port.
                defer { report.finish() }
                try await group.run()
            }
            var port = 0
            for await value in running { port = value }
            let server = KubernetesAPIServer(directory: directory, port: port, store: shared)
            do {
                #expect(port > 0, "the test API server did not start")
                let result = try await body(server)
                try await server.stop(group, &tasks)
                return result
            } catch {
                try? await server.stop(group, &tasks)
                throw error
            }
        }
    }

    /// Ends every watch (and any that arrives later), shuts the server down gracefully and
    /// waits at most 15 s for it; past that the server is cancelled and the test fails, so a
    /// connection that never closes shows up as a failure naming it rather than a hung run.
    private func stop(_ group: ServiceGroup, _ tasks: inout ThrowingTaskGroup<Void, any Error>) async throws {
        store.state.withLock { $0.closed = true }
        finishWatches(.end)
        await group.triggerGracefulShutdown()
        struct ShutdownTimedOut: Error {}
        tasks.addTask {
            try await Task.sleep(for: .seconds(15))
            throw ShutdownTimedOut()
        }
        do {
            try await tasks.next()
            tasks.cancelAll()
        } catch is ShutdownTimedOut {
            Issue.record("the test API server did not shut down within 15 s of the graceful shutdown (a connection stayed open); cancelled it")
            tasks.cancelAll()
        }
        while (try? await tasks.next()) != nil {}
    }

    // MARK: Test API

    /// Adds the slice (ADDED) or replaces the one of the same name (MODIFIED).
    func apply(_ slice: Slice) {
        store.state.withLock { state in
            let type = state.slices[slice.name] == nil ? "ADDED" : "MODIFIED"
            record(&state, type: type, slice: slice)
        }
    }

    /// Deletes a slice (DELETED).
    func delete(_ name: String) {
        store.state.withLock { state in
            guard let old = state.slices[name] else { return }
            record(&state, type: "DELETED", slice: old.slice)
        }
    }

    /// Sets `ready` of the endpoint with this address (MODIFIED).
    func setReady(slice name: String, address: String, _ ready: Bool?, serving: Bool? = nil, terminating: Bool? = nil) {
        store.state.withLock { state in
            guard var slice = state.slices[name]?.slice else { return }
            for index in slice.endpoints.indices where slice.endpoints[index].address == address {
                slice.endpoints[index].ready = ready
                slice.endpoints[index].serving = serving
                slice.endpoints[index].terminating = terminating
            }
            record(&state, type: "MODIFIED", slice: slice)
        }
    }

    /// Forgets the history: a watch from any version seen so far gets 410 Gone.
    func expireHistory(style: GoneStyle = .errorEvent) {
        store.state.withLock { state in
            state.version += 1
            state.oldestKept = state.version
            state.history.removeAll()
            state.goneStyle = style
        }
    }

    /// Sends an ERROR 410 event to every open watch (the watch cache was reset).
    func sendGoneToWatches() { broadcast { _ in Self.goneLine(0, 0) } }

    /// Sends a BOOKMARK with the current version to every watch that allowed bookmarks.
    func sendBookmark() {
        let version = store.state.withLock { state in
            state.version += 1
            return state.version
        }
        broadcast { $0.bookmarks ? Self.bookmarkLine(version) : nil }
    }

    /// Sends a raw line (garbage, for instance) to every open watch.
    func sendRaw(_ line: String) { broadcast { _ in line } }

    /// Closes every open watch's connection mid-stream (no final chunk).
    func dropWatches() { finishWatches(.drop) }

    /// Ends every open watch cleanly, as its timeoutSeconds would.
    func endWatches() { finishWatches(.end) }

    /// The bearer token requests must carry from now on.
    func setToken(_ token: String) { store.state.withLock { $0.token = token } }
    var token: String { store.state.withLock { $0.token } }

    /// Refuses every request with 403, as the API server does for a service account without
    /// the RBAC rule.
    func setForbidden(_ forbidden: Bool) { store.state.withLock { $0.forbidden = forbidden } }

    /// Answers every watch with 410 Gone in `style` while set (nil: stop), even one from the
    /// version the last list gave: a server whose watch cache keeps failing.
    func setWatchesGone(_ style: GoneStyle?) { store.state.withLock { $0.watchesGone = style } }

    /// When each request arrived, 401s and 410s included.
    var requestTimes: [ContinuousClock.Instant] { store.state.withLock { $0.requestTimes } }
    /// When each list (its first page) was served.
    var listTimes: [ContinuousClock.Instant] { store.state.withLock { $0.listTimes } }

    /// Answers every list with 410 Gone while set.
    func setListsGone(_ gone: Bool) { store.state.withLock { $0.listsGone = gone } }
    var listsRefused: Int { store.state.withLock { $0.listsRefused } }

    var listsServed: Int { store.state.withLock { $0.listsServed } }
    var watchesServed: Int { store.state.withLock { $0.watchesServed } }
    var activeWatches: Int { store.state.withLock { $0.watches.count } }
    var unauthorizedServed: Int { store.state.withLock { $0.unauthorizedServed } }
    var goneServed: Int { store.state.withLock { $0.goneServed } }

    /// Waits until `condition` holds, polling every 10 ms for at most `seconds`.
    func eventually(_ seconds: Double = 10, _ condition: @Sendable () -> Bool) async -> Bool {
        let end = ContinuousClock.now + .milliseconds(Int(seconds * 1000))
        while ContinuousClock.now < end {
            if condition() { return true }
            try? await Task.sleep(for: .milliseconds(10))
        }
        return condition()
    }

    /// Writes a kubeconfig that reaches this server (its CA, `token` inline or else the current
    /// token, `namespace`), for a daemon started with `KUBECONFIG=path`. Returns the path.
    @discardableResult
    func writeKubeconfig(namespace: String = "default", token: String? = nil, to path: String? = nil) throws -> String {
        let file = path ?? directory + "/kubeconfig"
        let token = token ?? self.token
        try """
            apiVersion: v1
            kind: Config
            current-context: test
            clusters: [{name: test, cluster: {server: "\(url)", certificate-authority: "\(caPath)"}}]
            contexts: [{name: test, context: {cluster: test, user: test, namespace: "\(namespace)"}}]
            users: [{name: test, user: {token: "\(token)"}}]
            """.write(toFile: file, atomically: true, encoding: .utf8)
        return file
    }

    // MARK: Internals

    private func record(_ state: inout State, type: String, slice: Slice) {
        state.version += 1
        let version = state.version
        if type == "DELETED" { state.slices[slice.name] = nil } else { state.slices[slice.name] = (slice, version) }
        state.history.append((version, type, slice))
        let line = Self.eventLine(type, slice, version)
        for watch in state.watches.values where watch.namespace == slice.namespace && watch.service == slice.service {
            watch.sink.yield(.line(line))
        }
    }

    private func broadcast(_ line: (Watch) -> String?) {
        store.state.withLock { state in
            for watch in state.watches.values { if let text = line(watch) { watch.sink.yield(.line(text)) } }
        }
    }

    private func finishWatches(_ message: WatchMessage) {
        // Finished outside the lock: finish() runs onTermination, which takes it.
        let sinks = store.state.withLock { state in
            defer { state.watches.removeAll() }
            return state.watches.values.map(\.sink)
        }
        for sink in sinks {
            sink.yield(message)
            sink.finish()
        }
    }

    private struct Responder: HTTPResponder {
        typealias Context = BasicRequestContext
        let store: Store
        let clientCertificates: Bool

        func respond(to request: Request, context: BasicRequestContext) async throws -> Response {
            let token = store.state.withLock { state in
                state.requestTimes.append(.now)
                return state.token
            }
            if !clientCertificates && request.headers[.authorization] != "Bearer \(token)" {
                store.state.withLock { $0.unauthorizedServed += 1 }
                return KubernetesAPIServer.status(401, "Unauthorized", "Unauthorized")
            }
            if store.state.withLock({ $0.forbidden }) {
                return KubernetesAPIServer.status(403, "Forbidden",
                    "endpointslices.discovery.k8s.io is forbidden: User \"system:serviceaccount:default:udp-fanout\" cannot list resource \"endpointslices\" in API group \"discovery.k8s.io\"")
            }
            let parts = request.uri.path.split(separator: "/")
            // apis/discovery.k8s.io/v1/namespaces/NS/endpointslices
            guard request.method == .get, parts.count == 6, parts[0] == "apis", parts[1] == "discovery.k8s.io", parts[2] == "v1",
                parts[3] == "namespaces", parts[5] == "endpointslices"
            else {
                return KubernetesAPIServer.status(404, "NotFound", "the server could not find the requested resource")
            }
            let namespace = String(parts[4])
            let query = request.uri.queryParameters
            let selector = query["labelSelector"].map(String.init) ?? ""
            let prefix = "kubernetes.io/service-name="
            guard selector.hasPrefix(prefix) else {
                return KubernetesAPIServer.status(400, "BadRequest", "this test server needs labelSelector=kubernetes.io/service-name=NAME")
            }
            let service = String(selector.dropFirst(prefix.count))
            if query["watch"] == "1" || query["watch"] == "true" {
                return watch(namespace: namespace, service: service, from: Int(query["resourceVersion"] ?? "") ?? 0, bookmarks: query["allowWatchBookmarks"] == "true")
            }
            return list(namespace: namespace, service: service, limit: Int(query["limit"] ?? ""), continueToken: query["continue"].map(String.init))
        }

        private func list(namespace: String, service: String, limit: Int?, continueToken: String?) -> Response {
            store.state.withLock { state in
                if state.listsGone {
                    state.listsRefused += 1
                    return KubernetesAPIServer.status(410, "Expired", "The provided continue parameter is too old to display a consistent list result")
                }
                var offset = 0
                var version = state.version
                if let token = continueToken {
                    let fields = token.split(separator: "/")
                    guard fields.count == 2, let tokenVersion = Int(fields[0]), let tokenOffset = Int(fields[1]) else {
                        return KubernetesAPIServer.status(400, "BadRequest", "bad continue token")
                    }
                    if tokenVersion < state.oldestKept {
                        state.goneServed += 1
                        return KubernetesAPIServer.status(410, "Expired", "The provided continue parameter is too old")
                    }
                    (offset, version) = (tokenOffset, tokenVersion)
                }
                state.listsServed += continueToken == nil ? 1 : 0
                if continueToken == nil { state.listTimes.append(.now) }
                let matching = state.slices.values.filter { $0.slice.namespace == namespace && $0.slice.service == service }
                    .sorted { $0.slice.name < $1.slice.name }
                let end = limit.map { min(matching.count, offset + max(1, $0)) } ?? matching.count
                let page = offset < end ? Array(matching[offset..<end]) : []
                var metadata: [String: Any] = ["resourceVersion": "\(version)"]
                if end < matching.count { metadata["continue"] = "\(version)/\(end)" }
                let object: [String: Any] = [
                    "kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1", "metadata": metadata,
                    "items": page.map { KubernetesAPIServer.object($0.slice, $0.version) },
                ]
                return KubernetesAPIServer.json(200, object)
            }
        }

        private func watch(namespace: String, service: String, from version: Int, bookmarks: Bool) -> Response {
            let (messages, sink) = AsyncStream.makeStream(of: WatchMessage.self)
            let outcome: Response? = store.state.withLock { state in
                state.watchesServed += 1
                if state.closed {
                    sink.yield(.end)
                    sink.finish()
                    return nil
                }
                if version < state.oldestKept || state.watchesGone != nil {
                    state.goneServed += 1
                    switch state.watchesGone ?? state.goneStyle {
                    case .httpStatus:
                        return KubernetesAPIServer.status(410, "Expired", "too old resource version: \(version) (\(state.oldestKept))")
                    case .errorEvent:
                        sink.yield(.line(KubernetesAPIServer.goneLine(version, state.oldestKept)))
                        sink.yield(.end)
                        sink.finish()
                        return nil
                    }
                }
                for event in state.history where event.version > version && event.slice.namespace == namespace && event.slice.service == service {
                    sink.yield(.line(KubernetesAPIServer.eventLine(event.type, event.slice, event.version)))
                }
                let id = state.nextWatch
                state.nextWatch += 1
                state.watches[id] = Watch(namespace: namespace, service: service, bookmarks: bookmarks, sink: sink)
                let shared = self.store
                sink.onTermination = { _ in _ = shared.state.withLock { $0.watches.removeValue(forKey: id) } }
                return nil
            }
            if let outcome { return outcome }
            var headers: HTTPFields = [:]
            headers[.contentType] = "application/json"
            return Response(status: .ok, headers: headers, body: ResponseBody { writer in
                for await message in messages {
                    switch message {
                    case .line(let text): try await writer.write(ByteBuffer(string: text + "\n"))
                    case .drop: throw CancellationError()
                    case .end:
                        try await writer.finish(nil)
                        return
                    }
                }
                try await writer.finish(nil)
            })
        }
    }

    // MARK: Wire format

    static func object(_ slice: Slice, _ version: Int) -> [String: Any] {
        [
            "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
            "metadata": [
                "name": slice.name, "namespace": slice.namespace, "resourceVersion": "\(version)", "generation": 1,
                "uid": "uid-\(slice.name)",
                "labels": ["kubernetes.io/service-name": slice.service, "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"],
                "managedFields": [["manager": "kube-controller-manager", "operation": "Update"]],
            ] as [String: Any],
            "addressType": slice.addressType,
            "endpoints": slice.endpoints.map { endpoint -> [String: Any] in
                var conditions: [String: Any] = [:]
                if let ready = endpoint.ready { conditions["ready"] = ready }
                if let serving = endpoint.serving { conditions["serving"] = serving }
                if let terminating = endpoint.terminating { conditions["terminating"] = terminating }
                var object: [String: Any] = ["addresses": [endpoint.address], "conditions": conditions, "nodeName": "node-a", "zone": "zone-a"]
                if let pod = endpoint.pod { object["targetRef"] = ["kind": "Pod", "name": pod, "namespace": slice.namespace] }
                return object
            },
            "ports": [["name": "udp", "port": 5514, "protocol": "UDP"]],
        ]
    }

    static func eventLine(_ type: String, _ slice: Slice, _ version: Int) -> String {
        line(["type": type, "object": object(slice, version)])
    }

    static func bookmarkLine(_ version: Int) -> String {
        line(["type": "BOOKMARK", "object": [
            "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
            "metadata": ["resourceVersion": "\(version)", "creationTimestamp": NSNull()] as [String: Any],
        ] as [String: Any]])
    }

    static func goneLine(_ version: Int, _ oldest: Int) -> String {
        line(["type": "ERROR", "object": statusObject(410, "Expired", "too old resource version: \(version) (\(oldest))")])
    }

    static func statusObject(_ code: Int, _ reason: String, _ message: String) -> [String: Any] {
        ["kind": "Status", "apiVersion": "v1", "metadata": [String: Any](), "status": "Failure", "message": message, "reason": reason, "code": code]
    }

    static func status(_ code: Int, _ reason: String, _ message: String) -> Response {
        json(code, statusObject(code, reason, message))
    }

    static func json(_ code: Int, _ object: [String: Any]) -> Response {
        var headers: HTTPFields = [:]
        headers[.contentType] = "application/json"
        let data = (try? JSONSerialization.data(withJSONObject: object, options: [.sortedKeys])) ?? Data()
        return Response(status: .init(code: code), headers: headers, body: ResponseBody(byteBuffer: ByteBuffer(bytes: data)))
    }

    static func line(_ object: [String: Any]) -> String {
        String(decoding: (try? JSONSerialization.data(withJSONObject: object, options: [.sortedKeys])) ?? Data(), as: UTF8.self)
    }

    // MARK: Certificates

    /// A CA, a server certificate for 127.0.0.1 and ::1, and a client certificate, all P-256.
    private static func makeCertificates(in directory: String) throws {
        let openssl = "/usr/bin/openssl"
        func check(_ arguments: [String]) throws {
            let (status, output) = try run(openssl, arguments)
            guard status == 0 else { throw CertificateError(message: "openssl \(arguments.joined(separator: " ")): \(output)") }
        }
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        try check(["req", "-x509"] + ec + ["-keyout", "\(directory)/ca.key", "-out", "\(directory)/ca.crt", "-days", "2",
            "-subj", "/CN=udp-fanout-test-ca", "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
        for (name, subject, extensions) in [
            ("server", "/CN=kube-apiserver", "subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
            ("client", "/CN=system:serviceaccount:default:udp-fanout", "extendedKeyUsage=clientAuth\n"),
        ] {
            try check(["req"] + ec + ["-keyout", "\(directory)/\(name).key", "-out", "\(directory)/\(name).csr", "-subj", subject])
            try extensions.write(toFile: "\(directory)/\(name).ext", atomically: true, encoding: .utf8)
            try check(["x509", "-req", "-in", "\(directory)/\(name).csr", "-CA", "\(directory)/ca.crt", "-CAkey", "\(directory)/ca.key",
                "-CAcreateserial", "-out", "\(directory)/\(name).crt", "-days", "2", "-extfile", "\(directory)/\(name).ext"])
        }
    }

    struct CertificateError: Error, CustomStringConvertible {
        var message: String
        var description: String { message }
    }
}

/// Keeps every log record, so tests can check the lines an operator would see.
final class CapturedLog: Sendable {
    struct Record: Sendable {
        var level: Logger.Level
        var message: String
        var metadata: [String: String]
    }
    private let records = Mutex<[Record]>([])

    /// A logger that records here (at `level` and above).
    func logger(_ label: String = "test", level: Logger.Level = .debug) -> Logger {
        var logger = Logger(label: label) { _ in Handler(log: self) }
        logger.logLevel = level
        return logger
    }

    var all: [Record] { records.withLock { $0 } }
    func count(_ level: Logger.Level, containing text: String) -> Int {
        records.withLock { $0.filter { $0.level == level && $0.message.contains(text) }.count }
    }

    fileprivate func append(_ record: Record) { records.withLock { $0.append(record) } }

    private struct Handler: LogHandler {
        let log: CapturedLog
        var metadata: Logger.Metadata = [:]
        var logLevel: Logger.Level = .trace
        subscript(metadataKey key: String) -> Logger.Metadata.Value? {
            get { metadata[key] }
            set { metadata[key] = newValue }
        }
        func log(event: LogEvent) {
            var merged: [String: String] = [:]
            for (key, value) in metadata.merging(event.metadata ?? [:], uniquingKeysWith: { $1 }) { merged[key] = "\(value)" }
            log.append(Record(level: event.level, message: "\(event.message)", metadata: merged))
        }
    }
}
