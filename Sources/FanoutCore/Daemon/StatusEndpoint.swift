#if canImport(Glibc)
import Glibc
#endif
import Logging
import ReusePortLB

/// The HTTP endpoint: GET metrics.path (Prometheus text), /healthz ("ok" while running),
/// /readyz (200 once every listener is receiving, else 503). HTTP/1.0-style: one request per
/// connection. Runs on its own thread; blocking accepts never touch the cooperative pool.
final class StatusEndpoint: Sendable {
    private let fd: Int32
    private let stop = StopSignal()
    private let thread: OSThread

    /// - Throws: ``SystemCallError`` when the address cannot be bound.
    init(bind address: SocketAddress, path: String, daemon: FanoutDaemon, logger: Logger) throws(SystemCallError) {
        let fd = socket(address.ip.family, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw SystemCallError(call: "socket", errno: errno) }
        var one: Int32 = 1
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, 4)
        guard address.withSockAddr({ bind(fd, $0, $1) }) == 0, listen(fd, 64) == 0 else {
            let error = errno
            close(fd)
            throw SystemCallError(call: "bind/listen \(address)", errno: error)
        }
        self.fd = fd
        let stop = self.stop
        thread = OSThread(name: "fanout-http") {
            var descriptor = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
            while !stop.isSet {
                guard poll(&descriptor, 1, 100) > 0 else { continue }
                let client = accept(fd, nil, nil)
                guard client >= 0 else { continue }
                Self.serve(client, path: path, daemon: daemon)
                close(client)
            }
        }
        logger.info("metrics endpoint listening", metadata: ["bind": "\(address)", "path": "\(path)"])
    }

    func shutdown() {
        stop.set()
        thread.join()
        close(fd)
    }

    private static func serve(_ client: Int32, path: String, daemon: FanoutDaemon) {
        var timeout = timeval(tv_sec: 2, tv_usec: 0)
        setsockopt(client, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
        var request = [UInt8]()
        var buffer = [UInt8](repeating: 0, count: 4096)
        while request.count < 16384 {
            let count = recv(client, &buffer, buffer.count, 0)
            guard count > 0 else { break }
            request += buffer[0..<count]
            if request.windows4ContainsEnd { break }
        }
        let line = String(decoding: request.prefix { $0 != 13 && $0 != 10 }, as: UTF8.self).split(separator: " ")
        let (status, body): (String, String)
        if line.count < 2 || line[0] != "GET" && line[0] != "HEAD" {
            (status, body) = ("405 Method Not Allowed", "only GET\n")
        } else {
            let target = line[1].split(separator: "?", maxSplits: 1).first.map(String.init) ?? ""
            switch target {
            case path: (status, body) = ("200 OK", daemon.metricsText())
            case "/healthz": (status, body) = ("200 OK", "ok\n")
            case "/readyz": (status, body) = daemon.isReady ? ("200 OK", "ready\n") : ("503 Service Unavailable", "not ready\n")
            default: (status, body) = ("404 Not Found", "not found\n")
            }
        }
        let contentType = body.hasPrefix("# HELP") ? "text/plain; version=0.0.4; charset=utf-8" : "text/plain; charset=utf-8"
        var response = "HTTP/1.1 \(status)\r\nContent-Type: \(contentType)\r\nContent-Length: \(body.utf8.count)\r\nConnection: close\r\n\r\n"
        if line.first != "HEAD" { response += body }
        response.withUTF8 { bytes in
            var offset = 0
            while offset < bytes.count {
                let sent = send(client, bytes.baseAddress! + offset, bytes.count - offset, Int32(MSG_NOSIGNAL))
                if sent <= 0 { break }
                offset += sent
            }
        }
    }
}

extension Array where Element == UInt8 {
    /// The request head is complete (CRLF CRLF, or LF LF).
    var windows4ContainsEnd: Bool {
        for index in indices.dropLast(1) {
            if self[index] == 10 && self[index + 1] == 10 { return true }
            if index + 3 < count && self[index] == 13 && self[index + 1] == 10 && self[index + 2] == 13 && self[index + 3] == 10 { return true }
        }
        return false
    }
}
