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

    /// Whether the running configuration still has listener `name` with this capture (a reload
    /// that removed it, or changed its kind, made another or none).
    func runsListener(_ name: String, capturing capture: DropCapture) -> Bool {
        state.withLock { state in state.config.listeners.contains { $0.name == name } && state.counters[name]?.capture === capture }
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

    static func response(_ request: Request, daemon: FanoutDaemon) async -> Response {
        guard request.method == .get else {
            return text(.methodNotAllowed, "only GET: the capture is a stream\n", allow: true)
        }
        var parameters: [String: String] = [:]
        for (key, value) in request.uri.queryParameters { parameters[String(key)] = String(value) }
        let query = parameters
        let capture: DropCapture
        let session: CaptureSession
        let linkType: UInt16
        // Off the cooperative pool: a kernel listener's start writes its program's maps and may
        // start the ring's reader; its end may wait for that reader (within 100 ms).
        let started = await offCooperativePool("capture-start") { () -> Result<(DropCapture, CaptureSession, UInt16), CaptureRequestError> in
            do throws(CaptureRequestError) { return .success(try daemon.startCapture(query)) } catch { return .failure(error) }
        }
        switch started {
        case .success(let value): (capture, session, linkType) = value
        case .failure(let error): return text(HTTPResponse.Status(code: error.status), "\(error)\n")
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
            do {
                try await stream()
            } catch {
                await offCooperativePool("capture-end") { capture.end(session) }
                logger.info("capture ended", metadata: ["listener": "\(listener)", "packets": "\(written)", "ended": "its reader went (\(error))"])
                throw error
            }
            await offCooperativePool("capture-end") { capture.end(session) }
            logger.info("capture ended", metadata: [
                "listener": "\(listener)", "packets": "\(written)", "lost": "\(lost)", "sampled_out": "\(sampled)", "ended": "\(ending)",
            ])
            try await writer.finish(nil)

            /// Writes the stream until it ends, then its last statistics.
            func stream() async throws {
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
            func statistics(_ note: String?) async -> ByteBuffer {
                // The programs' counts are read off the cooperative pool (a lock and map reads).
                let (missed, rate) = await offCooperativePool("capture-counts") { (capture.counts().since(session.baseline), capture.filter?.rate) }
                sampled = missed.sampledOut
                return ByteBuffer(bytes: Pcapng.statistics(nanoseconds: DropCapture.wallNanoseconds(), lost: lost &+ missed.kernelLost,
                                                           comment: note.map { "ended: \($0); \(written) captured, \(lost &+ missed.kernelLost) lost "
                                                               + "(the capture fell behind: \(missed.kernelLost) in the kernel), \(missed.sampledOut) sampled out "
                                                               + "(above \(rate ?? session.request.rate)/s, the sampling of every capture of the listener)" }))
            }
            while true {
                let taken = session.take()
                lost = taken.lost
                if !taken.packets.isEmpty {
                    var buffer = ByteBuffer()
                    for packet in taken.packets {
                        let (data, length) = packet.data(for: linkType)
                        // A frame as it arrived (af_xdp) is cut at the snap length asked; a packet
                        // given an Ethernet header keeps the snap length of the packet.
                        let cut = packet.ethernet ? session.request.snaplen : snaplen
                        buffer.writeBytes(Pcapng.packet(nanoseconds: packet.nanoseconds, data: Array(data.prefix(cut)), originalLength: length,
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
                    if !daemon.runsListener(listener, capturing: capture) {
                        ending = "the listener left the configuration (a reload)"
                        break
                    }
                }
                if clock.now - lastWrite >= keepAlive {
                    try await writer.write(await statistics(nil))
                    lastWrite = clock.now
                }
                try await Task.sleep(for: interval)
            }
            // The last block says why it ended and what was not captured.
            try await writer.write(await statistics(ending))
            }
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
