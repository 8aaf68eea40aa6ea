// SPDX-License-Identifier: Apache-2.0
import Hummingbird
import HummingbirdCore
import NIOCore
import ServiceLifecycle

extension FanoutDaemon {
    /// `GET /capture?listener=NAME`: starts a capture of what that listener drops
    /// (``CaptureRequest/parse(_:)`` reads the rest of the query). - Throws: why not.
    /// - Returns: also the link type of its file (af_xdp: Ethernet, the frames as they arrived).
    func startCapture(_ query: [String: String]) throws(CaptureRequestError) -> (DropCapture, CaptureSession, linkType: UInt16) {
        let (listeners, counters) = state.withLock { state in
            (state.config.listeners, query["listener"].flatMap { state.counters[$0] })
        }
        guard let name = query["listener"], let listener = listeners.first(where: { $0.name == name }), let counters else {
            throw .noListener(query["listener"] ?? "", known: listeners.map(\.name))
        }
        let session = CaptureSession(try CaptureRequest.parse(query))
        try counters.capture.start(session, listener: name)
        logger.info("capture started", metadata: [
            "listener": "\(name)", "reasons": "\(session.request.reasons.isEmpty ? "all" : session.request.reasons.sorted().joined(separator: ","))",
            "count": "\(session.request.count.map(String.init) ?? "unbounded")", "rate": "\(session.request.rate)",
        ])
        return (counters.capture, session, AFXDPKind.serves(listener) ? Pcapng.linkTypeEthernet : Pcapng.linkTypeRaw)
    }

    /// Whether the running configuration has a listener named `name`.
    func runsListener(_ name: String) -> Bool {
        state.withLock { state in state.config.listeners.contains { $0.name == name } }
    }
}

/// The response of `GET /capture`: pcapng, streamed as packets are taken, until the capture's
/// count or seconds are reached, or the client goes (each block is written whole).
enum CaptureEndpoint {
    /// How often the stream takes what was captured.
    static let interval = Duration.milliseconds(50)
    /// An idle stream writes an interface statistics block this often: a client that went is
    /// noticed (the write fails) and its capture ends.
    static let keepAlive = Duration.seconds(2)

    static func response(_ request: Request, daemon: FanoutDaemon) -> Response {
        guard request.method == .get else {
            return text(.methodNotAllowed, "only GET: the capture is a stream\n", allow: true)
        }
        var query: [String: String] = [:]
        for (key, value) in request.uri.queryParameters { query[String(key)] = String(value) }
        let capture: DropCapture
        let session: CaptureSession
        let linkType: UInt16
        do {
            (capture, session, linkType) = try daemon.startCapture(query)
        } catch {
            return text(HTTPResponse.Status(code: error.status), "\(error)\n")
        }
        let listener = query["listener"] ?? ""
        let logger = daemon.logger
        var headers: HTTPFields = [:]
        headers[.contentType] = "application/x-pcapng"
        let body = ResponseBody { writer in
            var written = 0
            var lost: UInt64 = 0
            var sampled: UInt64 = 0
            var ending = "its reader went"
            defer {
                capture.end(session)
                logger.info("capture ended", metadata: [
                    "listener": "\(listener)", "packets": "\(written)", "lost": "\(lost)", "sampled_out": "\(sampled)", "ended": "\(ending)",
                ])
            }
            // Each packet at most this session's snap length (the listener's capture takes the
            // longest any of its sessions asks for).
            let snaplen = session.request.snaplen + (linkType == Pcapng.linkTypeEthernet ? 14 : 0)
            try await writer.write(ByteBuffer(bytes: Pcapng.header(linkType: linkType, snaplen: snaplen, listener: listener)))
            let clock = ContinuousClock()
            let deadline = session.request.seconds.map { clock.now + .milliseconds(Int64($0 * 1000)) }
            var lastWrite = clock.now
            var lastCheck = clock.now
            /// The statistics so far: packets lost (this stream's reader, or the program's ring,
            /// fell behind) and sampled out.
            func statistics(_ note: String?) -> ByteBuffer {
                let missed = capture.counts().since(session.baseline)
                sampled = missed.sampledOut
                return ByteBuffer(bytes: Pcapng.statistics(nanoseconds: DropCapture.wallNanoseconds(), lost: lost &+ missed.kernelLost,
                                                           comment: note.map { "ended: \($0); \(written) captured, \(lost &+ missed.kernelLost) lost "
                                                               + "(the capture fell behind: \(missed.kernelLost) in the kernel), \(missed.sampledOut) sampled out "
                                                               + "(above \(session.request.rate)/s, by every capture of the listener)" }))
            }
            while true {
                let taken = session.take()
                lost = taken.lost
                if !taken.packets.isEmpty {
                    var buffer = ByteBuffer()
                    for packet in taken.packets {
                        let (data, length) = packet.data(for: linkType)
                        buffer.writeBytes(Pcapng.packet(nanoseconds: packet.nanoseconds, data: Array(data.prefix(snaplen)), originalLength: length,
                                                        comment: packet.comment, inbound: !packet.reply))
                    }
                    try await writer.write(buffer)
                    written += taken.packets.count
                    lastWrite = clock.now
                }
                if taken.complete {
                    ending = "its count reached"
                    break
                }
                if let reason = taken.ended {
                    ending = reason
                    break
                }
                if let deadline, clock.now >= deadline {
                    ending = "its seconds passed"
                    break
                }
                // The endpoint stops (the daemon, or a reload that moves it): the stream ends
                // whole, within its grace period.
                if Task.isShuttingDownGracefully {
                    ending = "the daemon's endpoint stops"
                    break
                }
                // A reload took the listener out: nothing more will come.
                if clock.now - lastCheck >= .seconds(1) {
                    lastCheck = clock.now
                    if !daemon.runsListener(listener) {
                        ending = "the listener left the configuration (a reload)"
                        break
                    }
                }
                if clock.now - lastWrite >= keepAlive {
                    try await writer.write(statistics(nil))
                    lastWrite = clock.now
                }
                try await Task.sleep(for: interval)
            }
            // The last block says why it ended and what was not captured.
            try await writer.write(statistics(ending))
            try await writer.finish(nil)
        }
        return Response(status: .ok, headers: headers, body: body)
    }

    private static func text(_ status: HTTPResponse.Status, _ body: String, allow: Bool = false) -> Response {
        var headers: HTTPFields = [:]
        headers[.contentType] = "text/plain; charset=utf-8"
        headers[.contentLength] = "\(body.utf8.count)"
        if allow { headers[.allow] = "GET" }
        return Response(status: status, headers: headers, body: ResponseBody(byteBuffer: ByteBuffer(string: body)))
    }
}
