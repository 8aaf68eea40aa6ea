// SPDX-License-Identifier: Apache-2.0
import Foundation
import Logging
import Testing
import TestSupport
// SOCK_DGRAM/SOCK_STREAM: when a file of the same compile batch imports CSystemShim, sys/socket.h belongs to that module and Glibc alone no longer names them.
import CSystemShim
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// A UDP receiver standing in for a downstream: collects every datagram's bytes.
final class Sink: Sendable {
    let fd: Int32
    let address: SocketAddress

    init(ip: String = "127.0.0.1", port: UInt16 = freePort()) throws {
        let address = SocketAddress(ip: IPAddress(ip)!, port: port)
        let fd = socket(address.ip.family, Int32(SOCK_DGRAM.rawValue), 0)
        var size: Int32 = 16 << 20
        setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &size, 4)
        let bound = address.withSockAddr { bind(fd, $0, $1) }
        self.fd = fd
        self.address = address
        try #require(bound == 0, "bind \(address): errno \(errno)")
    }

    deinit { close(fd) }

    /// Reads until nothing arrives for `quiet`.
    func drain(quiet: Duration = .milliseconds(300)) -> [[UInt8]] {
        var received: [[UInt8]] = []
        var buffer = [UInt8](repeating: 0, count: 65536)
        var descriptor = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
        while poll(&descriptor, 1, Int32(quiet.components.seconds * 1000 + quiet.components.attoseconds / 1_000_000_000_000_000)) > 0 {
            let count = recv(fd, &buffer, buffer.count, Int32(MSG_DONTWAIT))
            if count >= 0 { received.append(Array(buffer[0..<count])) }
        }
        return received
    }
}

/// Sends datagrams "<tag>-<i>" (or `size` bytes) from `source` to `destination`.
func sendNumbered(to destination: SocketAddress, count: Int, tag: String = "pkt", from source: String? = nil, size: Int? = nil) throws {
    let fd = socket(destination.ip.family, Int32(SOCK_DGRAM.rawValue), 0)
    defer { close(fd) }
    if let source {
        try #require(SocketAddress(ip: IPAddress(source)!, port: 0).withSockAddr { bind(fd, $0, $1) } == 0)
    }
    for index in 0..<count {
        var payload = Array("\(tag)-\(index)".utf8)
        if let size { payload += [UInt8](repeating: UInt8(index % 251), count: max(0, size - payload.count)) }
        let sent = destination.withSockAddr { sendto(fd, &payload, payload.count, 0, $0, $1) }
        try #require(sent == payload.count, "sendto: errno \(errno)")
    }
}

/// GET over plain TCP: (status code, body). `Connection: close` asks an HTTP/1.1 server to
/// close after the response, so reading to the end of the stream ends.
func httpGet(_ address: SocketAddress, _ path: String) throws -> (Int, String) {
    let fd = socket(address.ip.family, Int32(SOCK_STREAM.rawValue), 0)
    defer { close(fd) }
    try #require(address.withSockAddr { connect(fd, $0, $1) } == 0, "connect \(address): errno \(errno)")
    var request = Array("GET \(path) HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".utf8)
    _ = send(fd, &request, request.count, 0)
    var response: [UInt8] = []
    var buffer = [UInt8](repeating: 0, count: 65536)
    while true {
        let count = recv(fd, &buffer, buffer.count, 0)
        if count <= 0 { break }
        response += buffer[0..<count]
    }
    let text = String(decoding: response, as: UTF8.self)
    let status = Int(text.split(separator: " ").dropFirst().first ?? "") ?? 0
    let body = text.components(separatedBy: "\r\n\r\n").dropFirst().joined(separator: "\r\n\r\n")
    return (status, body)
}

/// The value of one sample of the Prometheus text, e.g. `udp_fanout_packets_received_total{listener="a",mode="userspace"}`.
func metric(_ text: String, _ name: String, _ labels: String) -> Int? {
    let prefix = "\(name){\(labels)} "
    return text.split(separator: "\n").first { $0.hasPrefix(prefix) }.flatMap { Int($0.dropFirst(prefix.count)) }
}

/// Starts the engine in-process on a YAML configuration and (unless told not to: a listener
/// waiting for its first discovery is not ready) waits until it is ready. `logger` (default: a
/// warning-level one to stderr) lets a test read the lines the daemon writes.
func startDaemon(_ yaml: String, waitReady: Bool = true, logger: Logger? = nil) throws -> FanoutDaemon {
    let config = try ConfigParser.parse(yaml)
    try config.validate()
    let logger = logger ?? {
        var logger = Logger(label: "udp-fanout-test")
        logger.logLevel = .warning
        return logger
    }()
    let daemon = FanoutDaemon(config: config, configPath: nil, logger: logger)
    try daemon.start()
    guard waitReady else { return daemon }
    let deadline = ContinuousClock.now + .seconds(5)
    while !daemon.isReady && ContinuousClock.now < deadline { usleep(10_000) }
    try #require(daemon.isReady)
    return daemon
}

/// A listener's YAML with the given downstream sinks.
func listenerYAML(_ name: String, bind: SocketAddress, _ sinks: [Sink], extra: String = "", weights: [Int]? = nil, workers: Int = 1) -> String {
    var yaml = "  - name: \(name)\n    bind: \"\(bind)\"\n    mode: userspace\n\(extra)    settings:\n      workers: \(workers)\n      recv_buf_size: 8388608\n    downstream:\n"
    for (index, sink) in sinks.enumerated() {
        yaml += "      - name: \(name)-sink-\(index + 1)\n        address: \"\(sink.address)\"\n"
        if let weights { yaml += "        weight: \(weights[index])\n" }
    }
    return yaml
}

/// A loopback address whose port a plain socket (no SO_REUSEPORT) holds, so a listener bound
/// there cannot start: a reload naming it is rolled back. Close `socket` when done.
func squattedAddress() throws -> (address: SocketAddress, socket: Int32) {
    let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
    let squatter = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
    guard address.withSockAddr({ Glibc.bind(squatter, $0, $1) }) == 0 else {
        close(squatter)
        throw CancellationError()
    }
    return (address, squatter)
}

/// Every SIGHUP the daemon took is answered (applied or rejected) in its log.
func reloadsAnswered(_ log: String) -> Bool {
    let taken = log.components(separatedBy: "SIGHUP: reloading").count - 1
    let done = log.components(separatedBy: "reload=true").count - 1 + log.components(separatedBy: "configuration reload rejected").count - 1
    return taken == done
}

/// Waits (at most 5 s) until every SIGHUP `daemon` took is answered and the listener of `labels`
/// counts `sent` datagrams received or dropped by its sockets' full receive buffers; returns the
/// last /metrics text and those two counts (-1 where missing).
func countsAfterReloads(_ daemon: Child, metrics: SocketAddress, labels: String, sent: Int) throws -> (text: String, received: Int, drops: Int) {
    var text = ""
    for _ in 0..<100 {
        text = try httpGet(metrics, "/metrics").1
        let counted = (metric(text, "udp_fanout_packets_received_total", labels) ?? 0) + (metric(text, "udp_fanout_receive_queue_drops_total", labels) ?? 0)
        if reloadsAnswered(daemon.stderr) && counted >= sent { break }
        usleep(50_000)
    }
    return (text, metric(text, "udp_fanout_packets_received_total", labels) ?? -1, metric(text, "udp_fanout_receive_queue_drops_total", labels) ?? -1)
}
