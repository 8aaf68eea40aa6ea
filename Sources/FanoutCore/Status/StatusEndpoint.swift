// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import Hummingbird
import HummingbirdCore
import Logging
import ReusePortLB
import SystemCalls
import ServiceLifecycle

/// Deadlines and limits of the HTTP endpoint. Each one keeps a slow, idle or abusive client from
/// holding what other clients or the daemon need.
public struct EndpointLimits: Sendable {
    /// A connection that completes no request head for this long (since it connected, or since
    /// its last request or response) is closed: a slowloris client cannot hold a connection.
    public var idleTimeout: Duration
    /// A request whose body has not arrived whole this long after its head is cut off (the
    /// connection is closed): a client that drips a body cannot hold a connection either.
    public var requestTimeout: Duration
    /// How long connections that are mid-request get to finish once the endpoint stops (graceful
    /// shutdown, or a reload that moves it); then they are closed. Idle ones close at once.
    public var shutdownGrace: Duration
    /// Open connections at most. Past it the server stops accepting until one closes, so a
    /// connection flood cannot take the file descriptors the listeners need.
    public var maximumConnections: Int

    /// - Parameters:
    ///   - idleTimeout: default 10 s.
    ///   - requestTimeout: default 10 s.
    ///   - shutdownGrace: default 1 s.
    ///   - maximumConnections: default 1,000, or half of RLIMIT_NOFILE's soft limit if lower.
    public init(
        idleTimeout: Duration = .seconds(10), requestTimeout: Duration = .seconds(10), shutdownGrace: Duration = .seconds(1),
        maximumConnections: Int? = nil
    ) {
        self.idleTimeout = idleTimeout
        self.requestTimeout = requestTimeout
        self.shutdownGrace = shutdownGrace
        self.maximumConnections = maximumConnections ?? Self.defaultMaximumConnections()
    }

    private static func defaultMaximumConnections() -> Int {
        // RLIM_INFINITY is the largest value, so it gives 1,000 too.
        guard let limit = try? Syscall.getrlimit(Syscall.Resource.openFiles) else { return 1000 }
        return max(64, min(1000, Int(clamping: limit.rlim_cur / 2)))
    }
}

/// The HTTP endpoint as a `Service`: GET/HEAD `metrics.path` (Prometheus text), `/status`
/// (JSON: every listener and downstream now, `StatusReport`; what `udp-fanout status` reads), `/healthz`
/// (`ok` while running), `/readyz` (200 once every listener is receiving, has finished its first discovery and has an available
/// downstream; else 503 with one line per reason), `/capture` (pcapng of what a listener drops,
/// streamed, as `udp-fanout capture` reads it), 404 for
/// other paths, 405 for other methods. A Hummingbird (SwiftNIO) server: connections are served
/// concurrently, so no client can delay another, and each connection has the deadlines of
/// ``EndpointLimits``.
///
/// Run it in the daemon's `ServiceGroup`; graceful shutdown closes idle connections at once and
/// gives requests in flight ``EndpointLimits/shutdownGrace``. Without a `ServiceGroup` (tests),
/// run it in a task and cancel the task to stop it.
///
/// A reload whose `metrics` section changes reaches the service through the daemon: the new
/// server is bound before the old one stops; if the new bind fails, the old server keeps serving
/// and the log says so (`metrics server error ... keeping the running endpoint`). A change of
/// `path` alone is served by the running server at once.
public struct StatusEndpointService: Service, CustomStringConvertible {
    let daemon: FanoutDaemon
    let limits: EndpointLimits

    /// - Parameters:
    ///   - daemon: the engine whose metrics and readiness are served, and whose reloads move
    ///     the endpoint.
    ///   - limits: per-connection deadlines and the connection limit.
    public init(daemon: FanoutDaemon, limits: EndpointLimits = EndpointLimits()) {
        self.daemon = daemon
        self.limits = limits
    }

    public var description: String { "StatusEndpointService" }

    /// Serves until graceful shutdown or cancellation.
    /// - Throws: `DaemonError/metrics(_:_:)` when the configured address cannot be bound at
    ///   start (the daemon exits 1 with `metrics server error`).
    public func run() async throws {
        let (changes, continuation) = AsyncStream.makeStream(of: Metrics.self, bufferingPolicy: .bufferingNewest(1))
        let initial = daemon.attachEndpoint(continuation)
        let logger = daemon.logger
        try await withThrowingDiscardingTaskGroup { group in
            var current: RunningServer?
            if initial.enabled {
                do {
                    current = try await start(initial.bind, in: &group)
                } catch {
                    // Cancelled while starting (the forwarding service failed and the group
                    // stops): not an endpoint problem, so no error that names a wrong fix.
                    if !Task.isCancelled {
                        logger.error("metrics server error", metadata: ["bind": "\(initial.bind)", "error": "\(error)"])
                    }
                    throw error
                }
            }
            for await metrics in changes.cancelOnGracefulShutdown() {
                guard metrics.enabled else {
                    if let current { logger.info("metrics endpoint disabled by reload", metadata: ["bind": "\(current.bind)"]) }
                    await current?.stop()
                    current = nil
                    continue
                }
                // Same address: the running server already serves the new path (read per request).
                if current?.bind == metrics.bind { continue }
                do {
                    let replacement = try await start(metrics.bind, in: &group)
                    await current?.stop()
                    current = replacement
                } catch {
                    if let running = current, running.bind.port == metrics.bind.port {
                        current = await move(running, to: metrics.bind, in: &group)
                    } else {
                        logger.error(
                            "metrics server error on reload; keeping the running endpoint",
                            metadata: ["bind": "\(metrics.bind)", "running": "\(current.map { "\($0.bind)" } ?? "none")", "error": "\(error)"])
                    }
                }
            }
            await current?.stop()
        }
    }

    /// Same port, overlapping address (0.0.0.0:9090 and 127.0.0.1:9090): the new server cannot
    /// listen beside the old one, so the old one stops first, and comes back if the new one
    /// cannot listen either.
    /// - Returns: the server now running, nil if neither could listen.
    private func move(_ running: RunningServer, to bind: SocketAddress, in group: inout ThrowingDiscardingTaskGroup<any Error>) async -> RunningServer? {
        let logger = daemon.logger
        await running.stopAndWait()
        do {
            return try await start(bind, in: &group)
        } catch {
            logger.error(
                "metrics server error on reload; keeping the running endpoint",
                metadata: ["bind": "\(bind)", "running": "\(running.bind)", "error": "\(error)"])
            do {
                return try await start(running.bind, in: &group)
            } catch {
                logger.error(
                    "metrics server error: the previous endpoint could not listen again; no endpoint until a reload",
                    metadata: ["bind": "\(running.bind)", "error": "\(error)"])
                return nil
            }
        }
    }

    /// A bound server and the group that runs it.
    private struct RunningServer {
        let bind: SocketAddress
        let group: ServiceGroup
        /// Finishes when the server has stopped and closed its socket.
        let stopped: AsyncStream<Void>

        /// Graceful: idle connections close now, requests in flight get the grace period.
        func stop() async { await group.triggerGracefulShutdown() }

        func stopAndWait() async {
            await stop()
            for await _ in stopped {}
        }
    }

    /// Binds a server on `bind` and runs it in a child task of `group`.
    /// - Returns: once the server is listening.
    /// - Throws: `DaemonError/metrics(_:_:)` when it cannot listen there.
    private func start(_ bind: SocketAddress, in group: inout ThrowingDiscardingTaskGroup<any Error>) async throws(DaemonError) -> RunningServer {
        let logger = daemon.logger
        let (outcome, report) = AsyncStream.makeStream(of: (any Error)?.self, bufferingPolicy: .bufferingOldest(1))
        let listening = StopSignal()
        let (stopped, finish) = AsyncStream.makeStream(of: Void.self)
        let application = Application(
            responder: StatusResponder(daemon: daemon),
            server: .http1(
                configuration: .init(
                    additionalChannelHandlers: [RequestDeadlineHandler(limit: .nanoseconds(limits.requestTimeout.nanoseconds))],
                    idleTimeout: .nanoseconds(limits.idleTimeout.nanoseconds))),
            configuration: ApplicationConfiguration(
                address: .hostname(bind.ip.description, port: Int(bind.port)),
                reuseAddress: true,
                availableConnectionsDelegate: MaximumAvailableConnections(limits.maximumConnections, logger: logger)),
            onServerRunning: { _ in
                listening.set()
                report.yield(nil)
            },
            logger: logger)
        var configuration = ServiceGroupConfiguration(services: [application], logger: logger)
        // Past the grace period the server is cancelled, which closes every connection.
        configuration.maximumGracefulShutdownDuration = limits.shutdownGrace
        let server = ServiceGroup(configuration: configuration)
        group.addTask {
            do {
                try await server.run()
            } catch {
                // Before it listened, the caller reports the failed start; after, the endpoint
                // is gone while the daemon runs, which nobody else would notice.
                report.yield(error)
                if listening.isSet {
                    logger.error("metrics server error: the endpoint stopped", metadata: ["bind": "\(bind)", "error": "\(error)"])
                }
            }
            report.finish()
            finish.finish()
        }
        for await result in outcome {
            if let error = result { throw .metrics(bind, error) }
            logger.info("metrics endpoint listening", metadata: ["bind": "\(bind)"])
            return RunningServer(bind: bind, group: server, stopped: stopped)
        }
        throw .metrics(bind, CancellationError())
    }
}

/// Answers every request from the daemon's state; nothing here blocks.
struct StatusResponder: HTTPResponder {
    typealias Context = BasicRequestContext
    let daemon: FanoutDaemon

    func respond(to request: Request, context: BasicRequestContext) async throws -> Response {
        // A stream of what a listener drops, as pcapng (`udp-fanout capture`).
        if request.uri.path == "/capture" { return await CaptureEndpoint.response(request, daemon: daemon) }
        let plain = "text/plain; charset=utf-8"
        var headers: HTTPFields = [:]
        let (status, body, type): (HTTPResponse.Status, String, String)
        if request.method != .get && request.method != .head {
            headers[.allow] = "GET, HEAD"
            (status, body, type) = (.methodNotAllowed, "only GET\n", plain)
        } else {
            switch request.uri.path {
            case daemon.metricsPath: (status, body, type) = (.ok, daemon.metricsText(), "text/plain; version=0.0.4; charset=utf-8")
            case "/healthz":
                // Liveness: 503 while a worker makes no progress, a tc program is gone or a
                // listener is lost (the path check's last verdict); a restart is the recovery.
                let problems = daemon.path.problems
                (status, body, type) = problems.isEmpty
                    ? (.ok, "ok\n", plain) : (.serviceUnavailable, "unhealthy\n" + problems.map { "- \($0)\n" }.joined(), plain)
            case "/readyz":
                let reasons = daemon.readiness
                (status, body, type) = reasons.isEmpty
                    ? (.ok, "ready\n", plain) : (.serviceUnavailable, "not ready\n" + reasons.map { "- \($0)\n" }.joined(), plain)
            case "/status":
                (status, body, type) = (.ok, daemon.statusReport().json() + "\n", "application/json")
            case "/associations":
                // Reading a large association map takes a while: off the event loop.
                let query = request.uri.queryParameters
                let listener = query["listener"].map(String.init)
                let limit = query["limit"].map { Int(String($0)) } ?? 1000
                let daemon = self.daemon
                let answer = await offCooperativePool("associations") { daemon.associationsText(listener: listener, limit: limit) }
                (status, body, type) = (HTTPResponse.Status(code: answer.status), answer.body, plain)
            default: (status, body, type) = (.notFound, "not found\n", plain)
            }
        }
        headers[.contentType] = type
        headers[.contentLength] = "\(body.utf8.count)"
        return Response(
            status: status, headers: headers,
            body: request.method == .head ? ResponseBody() : ResponseBody(byteBuffer: ByteBuffer(string: body)))
    }
}

extension Duration {
    /// Whole nanoseconds, for NIO's `TimeAmount`.
    fileprivate var nanoseconds: Int64 { components.seconds * 1_000_000_000 + components.attoseconds / 1_000_000_000 }
}
