// SPDX-License-Identifier: Apache-2.0
import SystemCalls
import Foundation
import Testing
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// HTTP probes of a daemon's endpoint (curl, so they run inside a namespace too) and polling.
public enum Probe {
    /// GET `path` on 127.0.0.1:`port` with curl run through `prefix` (a namespace's nsenter, or
    /// nothing); nil when nothing answers.
    public static func curl(_ prefix: [String], _ port: Int, _ path: String) -> (status: Int, body: String)? {
        let command = prefix + ["/usr/bin/curl", "-s", "-w", "\n%{http_code}", "http://127.0.0.1:\(port)\(path)"]
        guard let result = try? run(command[0], Array(command.dropFirst())), result.status == 0 else { return nil }
        var lines = result.output.split(separator: "\n", omittingEmptySubsequences: false)
        let status = Int(lines.removeLast()) ?? 0
        return (status, lines.joined(separator: "\n"))
    }

    public static func curl(_ prefix: [String], _ port: UInt16, _ path: String) -> (status: Int, body: String)? { curl(prefix, Int(port), path) }

    /// Polls `condition` every 50 ms for at most `seconds`.
    public static func waitFor(seconds: Double, _ condition: () -> Bool) -> Bool {
        let deadline = ContinuousClock.now + .milliseconds(Int(seconds * 1000))
        while ContinuousClock.now < deadline {
            if condition() { return true }
            usleep(50_000)
        }
        return condition()
    }
}

/// One datagram at a time on a UDP socket, with its source.
public enum Datagrams {
    /// The next datagram on `fd` within `milliseconds`: (source, payload), nil if none came.
    public static func receive(_ fd: Int32, milliseconds: Int32 = 2000) -> (source: SocketAddress, payload: String)? {
        var descriptor = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
        guard (try? Syscall.poll(&descriptor, 1, milliseconds)) == 1 else { return nil }
        var buffer = [UInt8](repeating: 0, count: 2048)
        var storage = sockaddr_storage()
        guard case .processed(let count)? = try? Syscall.recvfrom(fd, &buffer, 2048, Int32(MSG_DONTWAIT), &storage),
              let source = withUnsafePointer(to: &storage, { SocketAddress(storage: UnsafeRawPointer($0)) }) else { return nil }
        return (source, String(decoding: buffer[0..<count], as: UTF8.self))
    }

    public static func send(_ fd: Int32, _ text: String, to destination: SocketAddress) throws {
        let bytes = Array(text.utf8)
        let sent = try Syscall.sendto(fd, bytes, bytes.count, 0, destination, call: "sendto \(destination)")
        try #require(sent == .processed(bytes.count), "sendto \(destination): \(sent)")
    }
}

/// The Prometheus text of a daemon's endpoint, read with curl where the daemon runs.
public enum Scrape {
    /// The metrics port the af_xdp and preserve_source end-to-end tests' daemons serve on inside
    /// their namespaces (each namespace has a loopback of its own; tc_ebpf's use 9464).
    public static let metricsPort = 9474

    /// /metrics from `namespace` once `prefix`'s value is `expected` (polled up to 10 s: a loaded CI
    /// machine may still be forwarding), or the last scrape.
    public static func metrics(_ exec: ([String]) throws -> String, port: Int = metricsPort, host: String = "127.0.0.1",
                               until prefix: String, is expected: Int) throws -> String {
        var text = ""
        for _ in 0..<100 {
            text = try exec(["curl", "-s", "http://\(host):\(port)/metrics"])
            if value(text, prefix) == expected { break }
            usleep(100_000)
        }
        return text
    }

    public static func value(_ metrics: String, _ prefix: String) -> Int {
        let line = metrics.split(separator: "\n").first { $0.hasPrefix(prefix) }
        return line.flatMap { $0.split(separator: " ").last }.flatMap { Int($0) } ?? -1
    }
}
