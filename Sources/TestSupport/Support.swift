// SPDX-License-Identifier: Apache-2.0
import SystemCalls
import Foundation
import Testing
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// Shared by the test targets: privilege gating, free ports, loopback senders, child processes.

/// Privileged tests run when root; without root they are skipped with this reason, except under
/// CI=true, where they run (and fail) so a missing privilege is never mistaken for a pass.
public enum Privileges {
    public static let isRoot = geteuid() == 0
    public static let isCI = ProcessInfo.processInfo.environment["CI"] == "true"
    public static let enabled = isRoot || isCI
    public static let reason: Comment = "needs root (CAP_BPF, CAP_NET_ADMIN, bpffs); run as root or under CI=true"
}

/// Sends `count` datagrams from `source` (bound first) to `destination`; payload `tag`.
public func send(from source: String, to destination: SocketAddress, count: Int = 1, sourcePort: UInt16 = 0) throws {
    let fd = try Syscall.socket(destination.ip.family, Int32(SOCK_DGRAM.rawValue))
    defer { Syscall.close(fd) }
    try Syscall.setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, Int32(1), call: "setsockopt SO_REUSEADDR")
    try Syscall.bind(fd, SocketAddress(ip: IPAddress(source)!, port: sourcePort), call: "bind \(source)")
    let payload = Array("probe from \(source)".utf8)
    for _ in 0..<count {
        let sent = try Syscall.sendto(fd, payload, payload.count, 0, destination)
        try #require(sent == .processed(payload.count), "sendto: \(sent)")
    }
}

/// Reads everything queued on each member's socket until 100 ms pass with nothing new;
/// returns per member the count of datagrams by source address.
public func drain(_ members: [ReusePortMember]) -> [[String: Int]] {
    var result = [[String: Int]](repeating: [:], count: members.count)
    let receiver = BatchReceiver(batchSize: 64, maximumDatagramSize: 2048)
    var quietSince = ContinuousClock.now
    while ContinuousClock.now - quietSince < .milliseconds(100) {
        var any = false
        for (index, member) in members.enumerated() {
            while let count = try? receiver.receive(from: member.socket), count > 0 {
                any = true
                for datagram in 0..<count {
                    result[index][receiver.source(datagram)!.ip.description, default: 0] += 1
                }
            }
        }
        if any { quietSince = ContinuousClock.now } else { usleep(5000) }
    }
    return result
}

/// Source addresses 127.0.N.M for N sources, avoiding 127.0.0.1.
public func loopbackSources(_ count: Int, base: Int = 2) -> [String] {
    (0..<count).map { "127.0.\((base + $0) / 250).\((base + $0) % 250 + 2)" }
}

/// Which member received each source; records an issue if a source reached more than one.
public func ownerBySource(_ received: [[String: Int]]) -> [String: Int] {
    var owner: [String: Int] = [:]
    for (member, sources) in received.enumerated() {
        for source in sources.keys {
            if let other = owner[source] {
                Issue.record("source \(source) reached members \(other) and \(member)")
            }
            owner[source] = member
        }
    }
    return owner
}

/// The directory of the test binary, where SwiftPM puts collector and publisher too.
public let binaryDirectory: URL = {
    let path = (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/exe")) ?? CommandLine.arguments[0]
    var url = URL(fileURLWithPath: path).deletingLastPathComponent()
    // swift test runs <bin>/ReusePortLBPackageTests.xctest; the executables are beside it.
    while !FileManager.default.fileExists(atPath: url.appendingPathComponent("collector").path) && url.path != "/" {
        url = url.deletingLastPathComponent()
    }
    return url
}()

/// A child process (collector, publisher, or a command) with its stdout and stderr in files.
public final class Child {
    public let process = Process()
    let stdoutURL: URL
    let stderrURL: URL

    public init(_ executable: String, _ arguments: [String], prefix: [String] = []) throws {
        let base = FileManager.default.temporaryDirectory.appendingPathComponent("rplb-\(UUID().uuidString)")
        stdoutURL = base.appendingPathExtension("out")
        stderrURL = base.appendingPathExtension("err")
        _ = FileManager.default.createFile(atPath: stdoutURL.path, contents: nil)
        _ = FileManager.default.createFile(atPath: stderrURL.path, contents: nil)
        let binary = executable.hasPrefix("/") ? executable : binaryDirectory.appendingPathComponent(executable).path
        if prefix.isEmpty {
            process.executableURL = URL(fileURLWithPath: binary)
            process.arguments = arguments
        } else {
            process.executableURL = URL(fileURLWithPath: prefix[0])
            process.arguments = Array(prefix.dropFirst()) + [binary] + arguments
        }
        process.standardOutput = try FileHandle(forWritingTo: stdoutURL)
        process.standardError = try FileHandle(forWritingTo: stderrURL)
        try process.run()
    }

    /// A program that does not set its own signal mask (dnsmasq, nfcapd, dig), started with
    /// every signal unblocked: the test process blocks the signals its daemon threads wait for,
    /// and a child inherits the mask, so SIGTERM would stay pending in it forever.
    public static func unblocked(_ executable: String, _ arguments: [String], prefix: [String] = []) throws -> Child {
        try Child("/usr/bin/python3", ["-c", "import os, signal, sys; signal.pthread_sigmask(signal.SIG_SETMASK, []); os.execv(sys.argv[1], sys.argv[1:])",
                                       executable] + arguments, prefix: prefix)
    }

    deinit {
        // A failed test still stops its children cleanly, so they remove their pins.
        if process.isRunning {
            kill(process.processIdentifier, SIGTERM)
            for _ in 0..<100 where process.isRunning { usleep(10_000) }
            if process.isRunning { kill(process.processIdentifier, SIGKILL) }
        }
        try? FileManager.default.removeItem(at: stdoutURL)
        try? FileManager.default.removeItem(at: stderrURL)
    }

    public var stdout: String { (try? String(contentsOf: stdoutURL, encoding: .utf8)) ?? "" }
    public var stderr: String { (try? String(contentsOf: stderrURL, encoding: .utf8)) ?? "" }

    /// Waits (at most `seconds`) until stderr contains `text`.
    public func waitFor(_ text: String, seconds: Double = 10) throws {
        let deadline = Date().addingTimeInterval(seconds)
        while Date() < deadline {
            if stderr.contains(text) { return }
            if !process.isRunning { break }
            usleep(20_000)
        }
        Issue.record("'\(text)' not seen; stderr: \(stderr)")
        throw CancellationError()
    }

    /// Waits for the process to exit (killing it after `seconds`) and returns its exit status.
    @discardableResult
    public func wait(seconds: Double = 20) -> Int32 {
        let deadline = Date().addingTimeInterval(seconds)
        while process.isRunning && Date() < deadline { usleep(20_000) }
        if process.isRunning {
            Issue.record("process did not exit in \(seconds) s: \(process.arguments ?? [])")
            kill(process.processIdentifier, SIGKILL)
        }
        process.waitUntilExit()
        return process.terminationStatus
    }

    public func signal(_ signal: Int32) { kill(process.processIdentifier, signal) }

    /// Stops the process with SIGTERM and waits, unless it ended already: a `defer` that cleans
    /// up after a test that may have stopped it itself (no signal to a PID reused since).
    public func stopIfRunning() {
        guard process.isRunning else { return }
        signal(SIGTERM)
        wait()
    }

    /// Stops with SIGTERM and returns the JSON line it printed.
    public func stop() throws -> [String: Any] {
        signal(SIGTERM)
        wait()
        return try json()
    }

    public func json() throws -> [String: Any] {
        let line = try #require(stdout.split(separator: "\n").last, "no output; stderr: \(stderr)")
        return try #require(JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: Any])
    }
}

/// Runs a command to completion; returns (status, output).
@discardableResult
public func run(_ command: String, _ arguments: [String]) throws -> (status: Int32, output: String) {
    let process = Process()
    process.executableURL = URL(fileURLWithPath: command)
    process.arguments = arguments
    let pipe = Pipe()
    process.standardOutput = pipe
    process.standardError = pipe
    try process.run()
    let data = pipe.fileHandleForReading.readDataToEndOfFile()
    process.waitUntilExit()
    return (process.terminationStatus, String(decoding: data, as: UTF8.self))
}

extension Dictionary where Key == String, Value == Any {
    public func int(_ key: String) -> Int { (self[key] as? NSNumber)?.intValue ?? -1 }
    public func double(_ key: String) -> Double { (self[key] as? NSNumber)?.doubleValue ?? -1 }
    public func object(_ key: String) -> [String: Any] { self[key] as? [String: Any] ?? [:] }
}

/// A process started with posix_spawn rather than Foundation's Process, for programs that close
/// the descriptors they inherit (dnsmasq): Foundation takes that for the child's exit and blocks
/// in waitpid, which stalls every other Process of the run. The spawn resets the signal mask
/// (the runner's threads block SIGHUP and SIGTERM, and the child would inherit that) and the
/// dispositions; stdout and stderr go to `log`. Stopped by its PID (``stop()``), also on deinit.
public final class SpawnedProcess {
    public private(set) var pid: pid_t?
    public let log: String

    /// - Parameters:
    ///   - descriptors: given to the child as descriptors 3, 4, ... (a service manager's
    ///     LISTEN_FDS), in order.
    ///   - environment: set in the child's environment besides the test process's.
    public init(_ arguments: [String], log: String, descriptors: [Int32] = [], environment: [String: String] = [:]) throws {
        self.log = log
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        posix_spawn_file_actions_addopen(&actions, 2, log, O_WRONLY | O_CREAT | O_TRUNC, 0o644)
        posix_spawn_file_actions_adddup2(&actions, 2, 1)
        // Copies above any target first, so no dup2 overwrites a descriptor still to be given.
        let high = descriptors.map { fcntl($0, F_DUPFD_CLOEXEC, 1000) }
        defer { for fd in high where fd >= 0 { close(fd) } }
        for (index, fd) in high.enumerated() { posix_spawn_file_actions_adddup2(&actions, fd, Int32(3 + index)) }
        var attributes = posix_spawnattr_t()
        posix_spawnattr_init(&attributes)
        defer { posix_spawnattr_destroy(&attributes) }
        var empty = sigset_t()
        sigemptyset(&empty)
        var all = sigset_t()
        sigfillset(&all)
        posix_spawnattr_setsigmask(&attributes, &empty)
        posix_spawnattr_setsigdefault(&attributes, &all)
        posix_spawnattr_setflags(&attributes, Int16(POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF))
        let argv = arguments.map { strdup($0) } + [nil]
        defer { argv.forEach { free($0) } }
        var variables = ProcessInfo.processInfo.environment
        for (key, value) in environment { variables[key] = value }
        let envp = variables.map { strdup("\($0.key)=\($0.value)") } + [nil]
        defer { envp.forEach { free($0) } }
        var pid: pid_t = 0
        let result = posix_spawn(&pid, arguments[0], &actions, &attributes, argv, envp)
        guard result == 0 else { throw SpawnError(program: arguments[0], errno: result) }
        self.pid = pid
    }

    public struct SpawnError: Error, CustomStringConvertible {
        public let program: String
        public let errno: Int32
        public var description: String { "posix_spawn \(program): \(String(cString: strerror(errno)))" }
    }

    /// What it wrote so far.
    public var output: String { (try? String(contentsOfFile: log, encoding: .utf8)) ?? "" }

    public func signal(_ signal: Int32) {
        if let pid { kill(pid, signal) }
    }

    /// Waits at most `seconds` for it to exit and reaps it: its exit status, or nil if it is
    /// still running (then ``stop()`` ends it).
    public func wait(seconds: Double) -> Int32? {
        guard let pid else { return nil }
        var status: Int32 = 0
        for _ in 0..<max(1, Int(seconds * 50)) {
            if waitpid(pid, &status, WNOHANG) == pid {
                self.pid = nil
                return (status & 0x7f) == 0 ? (status >> 8) & 0xff : 128 + (status & 0x7f)
            }
            usleep(20_000)
        }
        return nil
    }

    /// Stops it (SIGTERM, SIGKILL after 2 s) and reaps it.
    public func stop() {
        guard let pid else { return }
        self.pid = nil
        kill(pid, SIGTERM)
        var status: Int32 = 0
        for _ in 0..<100 {
            if waitpid(pid, &status, WNOHANG) == pid { return }
            usleep(20_000)
        }
        kill(pid, SIGKILL)
        waitpid(pid, &status, 0)
    }

    deinit { stop() }
}
