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
        if let unknown = query.keys.sorted().first(where: { !CaptureRequest.keys.contains($0) }) {
            throw .badValue(key: unknown, value: query[unknown] ?? "", expected: "one of \(CaptureRequest.keys.joined(separator: ", ")) (not a key of /capture)")
        }
        guard let name = query["listener"], !name.isEmpty else { throw .noListenerNamed(known: listeners.map(\.name)) }
        guard let listener = listeners.first(where: { $0.name == name }), let counters else {
            throw .noListener(name, known: listeners.map(\.name))
        }
        let request = try CaptureRequest.parse(query)
        // A reason this listener's kind never drops for would capture nothing: said now.
        let possible = DropCapture.reasons(for: listener)
        if let never = request.reasons.sorted().first(where: { !possible.contains($0) }) {
            throw .neverDropped(listener: name, kind: listener.mode.rawValue + (listener.replies == .none ? "" : ", replies \(listener.replies.rawValue)"),
                                reason: never, possible: possible)
        }
        let session = CaptureSession(request)
        try counters.capture.start(session, listener: name)
        logger.info("capture started", metadata: [
            "listener": "\(name)", "reasons": "\(session.request.reasons.isEmpty ? "all" : session.request.reasons.sorted().joined(separator: ","))",
            "count": "\(session.request.count.map(String.init) ?? "unbounded")", "rate": "\(session.request.rate)",
        ])
        return (counters.capture, session, AFXDPKind.serves(listener) ? Pcapng.linkTypeEthernet : Pcapng.linkTypeRaw)
    }

    /// Why a running capture of listener `name` cannot go on, nil while it can: a reload removed
    /// the listener, or changed its kind (its drops now go to another capture).
    func captureGone(_ name: String, capturing capture: DropCapture) -> String? {
        state.withLock { state in
            guard state.config.listeners.contains(where: { $0.name == name }) else { return "the listener left the configuration (a reload)" }
            return state.counters[name]?.capture === capture ? nil : "a reload changed the listener's kind (start the capture again)"
        }
    }
}

/// The response of `GET /capture`: pcapng, streamed as packets are taken, until the capture's
/// count or seconds are reached, or the client goes (each block is written whole).
enum CaptureEndpoint {
    /// How often the stream takes what was captured.
    static let interval = Duration.milliseconds(50)
    /// A stream writes an interface statistics block this often: a client that went is noticed
    /// (the write fails) and its capture ends.
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
            /// Packets of a write under way (lost if it fails).
            var failed = 0
            var ending = "its reader went"
            /// What the file's statistics said last: lost in all (the stream's reader and the
            /// kernel), and sampled out.
            var reported: (lost: UInt64, sampledOut: UInt64) = (0, 0)
            do {
                try await stream()
            } catch {
                // The client went (a write failed): what it missed is in the log at least.
                let missed = await offCooperativePool("capture-end") { () -> DropCapture.Counts in
                    defer { capture.end(session) }
                    return capture.counts().since(session.baseline)
                }
                // What was taken but not written (the failed write's, and what waited) is lost too.
                let rest = session.take()
                logger.info("capture ended", metadata: [
                    "listener": "\(listener)", "packets": "\(written)", "lost": "\(rest.lost &+ UInt64(rest.packets.count + failed) &+ missed.kernelLost)",
                    "sampled_out": "\(missed.sampledOut)", "ended": "its reader went (\(error))",
                ])
                throw error
            }
            await offCooperativePool("capture-end") { capture.end(session) }
            logger.info("capture ended", metadata: [
                "listener": "\(listener)", "packets": "\(written)", "lost": "\(reported.lost)", "sampled_out": "\(reported.sampledOut)", "ended": "\(ending)",
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
            var lastStatistics = clock.now
            var lastCheck = clock.now
            /// The statistics so far: packets lost (this stream's reader, or the program's ring,
            /// fell behind) and sampled out.
            /// A statistics block: what was lost and sampled out so far, said in its comment
            /// (`ending`: the last block, and why the capture ended).
            func statistics(ending: String?) async -> ByteBuffer {
                // The programs' counts are read off the cooperative pool (a lock and map reads).
                let (missed, rate) = await offCooperativePool("capture-counts") { (capture.counts().since(session.baseline), capture.filter?.rate) }
                let allLost = lost &+ missed.kernelLost
                reported = (allLost, missed.sampledOut)
                let kernel = missed.kernelLost > 0 ? " (\(missed.kernelLost) of them in the kernel's ring)" : ""
                let counts = "\(written) captured, \(allLost) lost\(kernel), \(missed.sampledOut) sampled out "
                    + "(above \(rate ?? session.request.rate)/s, the sampling of every capture of the listener)"
                return ByteBuffer(bytes: Pcapng.statistics(nanoseconds: DropCapture.wallNanoseconds(), lost: allLost,
                                                           comment: ending.map { "ended: \($0); \(counts)" } ?? "so far: \(counts)"))
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
                    failed = taken.packets.count
                    try await writer.write(buffer)
                    failed = 0
                    written += taken.packets.count
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
                    if let gone = daemon.captureGone(listener, capturing: capture) {
                        ending = gone
                        break
                    }
                }
                // Statistics every 2 s (the last ones a reader saw say what was missed so far,
                // also when it is interrupted); a client that went is noticed by this write.
                if clock.now - lastStatistics >= keepAlive {
                    try await writer.write(await statistics(ending: nil))
                    lastStatistics = clock.now
                }
                try await Task.sleep(for: interval)
            }
            // The last block says why it ended and what was not captured.
            try await writer.write(await statistics(ending: ending))
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
