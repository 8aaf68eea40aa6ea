// SPDX-License-Identifier: Apache-2.0
import ArgumentParser
import AsyncHTTPClient
import FanoutCore
import NIOCore
import Synchronization
import UnixSignals

#if canImport(Glibc)
import Glibc
#endif

/// `udp-fanout capture`: a pcapng file of what a running daemon's listener drops, from its
/// `GET /capture`.
struct Capture: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Write a pcapng file of the datagrams a listener of a running udp-fanout drops, each with its reason as the packet comment.",
        discussion: """
            Reads GET /capture from the daemon's HTTP endpoint (metrics.bind of --config, or \
            --endpoint) and writes what it streams to -w FILE (- for standard output, e.g. \
            piped into tshark -r -). Each packet is a datagram the listener dropped, from its IP \
            header (af_xdp: its Ethernet frame; userspace and relay: the headers are made from \
            the addresses the socket saw), with the drop reason as the packet comment \
            (rate_limited, amplification_capped, too_large, ...). Sampled: at most --rate packets \
            a second are taken, so a flood of drops costs the data path little. Ends after -c \
            packets, after --seconds, or at Ctrl-C; the file holds whole blocks either way. As \
            with tcpdump, -c is the count here: the configuration file is --config. Exit status: \
            0 written (also when the reader of -w - goes), 1 no daemon answered or it refused the \
            capture, 2 the file cannot be \
            written or the configuration read, 64 usage.
            """)

    @Option(help: "The listener whose drops are captured (its name in the configuration).")
    var listener: String

    @Option(help: ArgumentHelp("Capture only this drop reason (repeat for several): \(DropCapture.reasons.joined(separator: ", ")).", valueName: "reason"))
    var reason: [String] = []

    @Option(name: .customShort("c"), help: ArgumentHelp("Stop after this many packets (default: until --seconds or Ctrl-C).", valueName: "count"))
    var count: Int?

    @Option(name: .customShort("w"), help: ArgumentHelp("The pcapng file to write (- for standard output).", valueName: "file"))
    var file: String

    @Option(help: "Stop after this many seconds.")
    var seconds: Double?

    @Option(help: "Packets a second at most, 1 to 10000 (the rest of the drops are counted sampled out). Captures of one listener share one sampling, at the highest rate any asks for.")
    var rate = 1000

    @Option(help: "Bytes kept of each packet (64 to 2048).")
    var snaplen = 2048

    @Option(help: "The configuration file the daemon runs with: its metrics.bind is the endpoint.")
    var config = "config.yaml"

    @Option(help: "The daemon's HTTP endpoint, http://HOST:PORT or HOST:PORT (instead of reading --config).")
    var endpoint: String?

    func validate() throws {
        for name in reason where !DropCapture.reasons.contains(name) {
            throw ValidationError("--reason \(name) is not a drop reason; give one of: \(DropCapture.reasons.joined(separator: ", "))")
        }
        if let count, count < 1 || count > 10_000_000 { throw ValidationError("-c \(count) is out of range: give 1 to 10000000 packets") }
        if let seconds, !(seconds > 0 && seconds <= 86_400) { throw ValidationError("--seconds \(seconds) is out of range: give more than 0, at most 86400") }
        guard (1...DropCapture.rateMax).contains(rate) else { throw ValidationError("--rate \(rate) is out of range: give 1 to \(DropCapture.rateMax) packets a second") }
        guard (64...DropCapture.snaplenMax).contains(snaplen) else { throw ValidationError("--snaplen \(snaplen) is out of range: give 64 to \(DropCapture.snaplenMax) bytes") }
        if let endpoint {
            do { _ = try StatusClient.statusURL(endpoint) } catch { throw ValidationError("\(error)") }
        }
    }

    func run() async throws {
        let base: String
        do throws(StatusClientError) {
            let given: String
            if let endpoint { given = endpoint } else { given = try StatusClient.endpoint(configFile: config) }
            base = try StatusClient.statusURL(given)
        } catch .config(let path, let problem) {
            printError("udp-fanout capture: cannot find the endpoint in \(path): \(problem); pass --config with the file the daemon runs with (e.g. /etc/udp-fanout/config.yaml), or --endpoint http://HOST:PORT")
            throw ExitCode(2)
        } catch .endpointDisabled(let path) {
            printError("udp-fanout capture: \(path) has no HTTP endpoint (metrics.enabled is false): /capture is served there; set metrics.enabled: true and reload, or pass --endpoint http://HOST:PORT")
            throw ExitCode(2)
        } catch {
            printError("udp-fanout capture: \(error)")
            throw ExitCode(2)
        }
        // A write to standard output whose reader went returns EPIPE (said, not a signal's death).
        signal(SIGPIPE, SIG_IGN)
        // Whether the file can be written, before asking the daemon for anything; it is opened
        // (and emptied) only once the daemon accepted the capture, so a refused one leaves an
        // existing file as it was and makes none.
        if let problem = Output.problem(writing: file) {
            printError("udp-fanout capture: cannot write \(file): \(problem); give a file in a directory you can write (or -w - for standard output)")
            throw ExitCode(2)
        }
        let output = Output(path: file)
        defer { output.close() }
        // First whether a udp-fanout answers there, within seconds (the stream's request waits
        // as long as the capture runs, and its connection attempts would go on meanwhile).
        do {
            _ = try await StatusClient.fetch(base)
        } catch {
            printError("udp-fanout capture: \(error)")
            throw ExitCode(1)
        }
        var query = ["listener=\(Self.escape(listener))", "rate=\(rate)", "snaplen=\(snaplen)"]
        if !reason.isEmpty { query.append("reason=\(reason.joined(separator: ","))") }
        if let count { query.append("count=\(count)") }
        if let seconds { query.append("seconds=\(seconds)") }
        let url = String(base.dropLast("/status".count)) + "/capture?" + query.joined(separator: "&")

        // Ctrl-C (or SIGTERM) ends the capture: what was written stays a whole file.
        let outcome = try await withThrowingTaskGroup(of: Outcome?.self) { group in
            group.addTask { try await Self.stream(url, to: output) }
            group.addTask {
                for await _ in await UnixSignalsSequence(trapping: .sigint, .sigterm) {
                    // What the daemon already sent is still read (and written) for a moment.
                    try? await Task.sleep(for: .milliseconds(300))
                    return nil
                }
                return nil
            }
            let first = try await group.next() ?? nil
            group.cancelAll()
            return first
        }
        let target = file == "-" ? "standard output" : file
        switch outcome {
        case .refused(let status, let body):
            printError("udp-fanout capture: \(url) answered HTTP \(status): \(body)")
            throw ExitCode(1)
        case .readerGone:
            let summary = Self.lastSummary.withLock { $0 }
            printError("udp-fanout capture: the reader of \(target) went; \(Self.written.withLock { $0 }) packet(s) written to it"
                       + (summary.map { "; the daemon's last statistics: \($0)" } ?? ""))
        case .unreachable(let problem):
            printError("udp-fanout capture: cannot reach udp-fanout at \(base.dropLast("/status".count)): \(problem); is udp-fanout running with this configuration? (or pass --endpoint http://HOST:PORT)")
            throw ExitCode(1)
        case .writeFailed(let problem):
            printError("udp-fanout capture: writing \(target) failed: \(problem)")
            throw ExitCode(2)
        case .openFailed(let problem):
            printError("udp-fanout capture: cannot write \(file): \(problem); give a file in a directory you can write (or -w - for standard output)")
            throw ExitCode(2)
        case .streamed(let packets, let complete, let summary):
            printError("udp-fanout capture: \(packets) packet(s) written to \(target)\(complete ? "" : " (the daemon ended the stream: it stopped, or its endpoint moved)")"
                       + (summary.map { "; the daemon: \($0)" } ?? ""))
        case nil where !output.accepted.load(ordering: .relaxed):
            printError("udp-fanout capture: interrupted before the daemon accepted the capture; nothing written")
        case nil:
            let summary = Self.lastSummary.withLock { $0 }
            printError("udp-fanout capture: interrupted; \(Self.written.withLock { $0 }) packet(s) written to \(target)"
                       + (summary.map { "; the daemon's last statistics: \($0)" } ?? ""))
        }
    }

    enum Outcome: Sendable {
        case refused(status: Int, body: String)
        case unreachable(String)
        case writeFailed(String)
        case openFailed(String)
        /// The program reading the pipe written to ended (`-w -` into a pipe, a FIFO).
        case readerGone
        /// `complete`: the daemon finished the stream (count or seconds reached); `summary`: its
        /// last statistics' comment (what was not captured).
        case streamed(packets: Int, complete: Bool, summary: String?)
    }

    /// Packets written so far, and the comment of the last statistics block (said on Ctrl-C).
    static let written = Mutex<Int>(0)
    static let lastSummary = Mutex<String?>(nil)

    /// Where the stream goes: standard output, or a file opened (created, emptied: a pipe or a
    /// device as it is) once the daemon accepted the capture.
    final class Output: Sendable {
        let path: String
        private let descriptor = Mutex<Int32>(-1)

        init(path: String) { self.path = path }

        /// Why `path` cannot be written, nil when it can be (or is standard output): a
        /// directory, or a file or directory without write permission.
        static func problem(writing path: String) -> String? {
            guard path != "-" else { return nil }
            var info = stat()
            if stat(path, &info) == 0 {
                if info.st_mode & S_IFMT == S_IFDIR { return String(cString: strerror(EISDIR)) }
                return access(path, W_OK) == 0 ? nil : String(cString: strerror(errno))
            }
            let directory = path.contains("/") ? String(path[..<path.lastIndex(of: "/")!]) : "."
            return access(directory.isEmpty ? "/" : directory, W_OK | X_OK) == 0 ? nil : String(cString: strerror(errno))
        }

        /// The descriptor, the file opened (created, emptied) if it was not yet; or why not.
        func open() -> Result<Int32, OpenError> {
            if path == "-" {
                accepted.store(true, ordering: .relaxed)
                return .success(1)
            }
            return descriptor.withLock { fd in
                if fd >= 0 { return .success(fd) }
                fd = Glibc.open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0o644)
                guard fd >= 0 else { return .failure(OpenError(problem: String(cString: strerror(errno)))) }
                accepted.store(true, ordering: .relaxed)
                return .success(fd)
            }
        }

        /// Whether the daemon accepted the capture (the file was opened for it).
        let accepted = Atomic<Bool>(false)

        func close() {
            descriptor.withLock { fd in
                if fd >= 0 { _ = Glibc.close(fd) }
                fd = -1
            }
        }

        struct OpenError: Error { let problem: String }
    }

    /// Writes the stream to `output`, whole blocks only.
    static func stream(_ url: String, to output: Output) async throws -> Outcome {
        var request = HTTPClientRequest(url: url)
        request.headers.add(name: "User-Agent", value: "udp-fanout capture")
        let response: HTTPClientResponse
        do {
            response = try await HTTPClient.shared.execute(request, timeout: .hours(24 * 366))
        } catch {
            let text = "\(error)"
            return .unreachable(text.contains("Connection refused") ? "connection refused" : text)
        }
        guard response.status.code == 200 else {
            let body = (try? await response.body.collect(upTo: 1 << 16)).map { String(buffer: $0) } ?? ""
            return .refused(status: Int(response.status.code), body: body.split(whereSeparator: \.isNewline).joined(separator: " "))
        }
        let fd: Int32
        switch output.open() {
        case .success(let opened): fd = opened
        case .failure(let error): return .openFailed(error.problem)
        }
        var pending: [UInt8] = []
        var complete = true
        var summary: String?
        do {
            for try await chunk in response.body {
                pending += chunk.readableBytesView
                guard let (end, packets, statistics) = Pcapng.wholeBlocks(pending[...]) else {
                    return .refused(status: 200, body: "the stream is not pcapng")
                }
                if end > 0 {
                    if let problem = writeAll(fd, pending[..<end]) {
                        return problem == EPIPE ? .readerGone : .writeFailed(String(cString: strerror(problem)))
                    }
                    pending.removeFirst(end)
                    written.withLock { $0 += packets }
                    if let statistics {
                        summary = statistics
                        lastSummary.withLock { $0 = statistics }
                    }
                }
            }
        } catch is CancellationError {
            throw CancellationError()
        } catch {
            // The connection closed without the stream's end: what came whole is written.
            complete = false
        }
        return .streamed(packets: written.withLock { $0 }, complete: complete && pending.isEmpty, summary: summary)
    }

    /// nil, or the errno of the failed write.
    private static func writeAll(_ fd: Int32, _ bytes: ArraySlice<UInt8>) -> Int32? {
        var offset = bytes.startIndex
        while offset < bytes.endIndex {
            let result = bytes[offset...].withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
            if result < 0 {
                if errno == EINTR { continue }
                return errno
            }
            offset += result
        }
        return nil
    }

    /// `text` as a query value (RFC 3986: unreserved characters as they are, the rest %XX).
    static func escape(_ text: String) -> String {
        var escaped = ""
        for byte in text.utf8 {
            switch byte {
            case UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "A")...UInt8(ascii: "Z"), UInt8(ascii: "0")...UInt8(ascii: "9"),
                 UInt8(ascii: "-"), UInt8(ascii: "."), UInt8(ascii: "_"), UInt8(ascii: "~"):
                escaped.append(Character(Unicode.Scalar(byte)))
            default:
                escaped += (byte < 16 ? "%0" : "%") + String(byte, radix: 16, uppercase: true)
            }
        }
        return escaped
    }
}
