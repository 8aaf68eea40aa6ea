// SPDX-License-Identifier: Apache-2.0
import Foundation
import Logging
import ReusePortLB
import Synchronization
import Testing
import TestSupport
import CSystemShim
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// DNS discovery: the response parser on crafted bytes, then the resolver and the watcher against
/// a real dnsmasq (Debian dnsmasq-base) serving a hosts file the test edits.
@Suite("DNSDiscovery")
struct DNSDiscoveryTests {
    // MARK: parser

    /// A response to `a.fanout.test` type A: two A records, the second owner a compression
    /// pointer to the question's name, as dnsmasq sends it.
    static let twoRecords: [UInt8] = hex(
        "1234 8580 0001 0002 0000 0000"
            + "01 61 06 66616e6f7574 04 74657374 00 0001 0001"
            + "c00c 0001 0001 00000007 0004 c6120501"
            + "c00c 0001 0001 00000009 0004 c6120502")

    @Test func parsesAddressesAndTheSmallestTTL() throws {
        let message = try DNSMessage(parsing: Self.twoRecords)
        #expect(message.id == 0x1234 && message.isResponse && message.rcode == 0 && !message.isTruncated)
        let answer = message.addresses(of: .a, for: "A.Fanout.Test.")
        #expect(answer.addresses == [IPAddress("198.18.5.1")!, IPAddress("198.18.5.2")!])
        #expect(answer.ttl == 7)
        #expect(message.addresses(of: .aaaa, for: "a.fanout.test").addresses.isEmpty)
        #expect(message.addresses(of: .a, for: "b.fanout.test").addresses.isEmpty, "records of another owner are not this name's")
    }

    @Test func followsCNAMEsAndTakesTheChainsTTL() throws {
        // www.t CNAME a.t (TTL 3); a.t A 198.18.5.1 (TTL 60); an unrelated A record is ignored.
        let bytes = Self.hex(
            "0001 8180 0001 0003 0001 0000"
                + "03 777777 01 74 00 0001 0001"  // question www.t at offset 12
                + "c00c 0005 0001 00000003 0004 01 61 c010"  // CNAME a.t (pointer to "t" at 16)
                + "01 61 c010 0001 0001 0000003c 0004 c6120501"
                + "01 7a c010 0001 0001 0000003c 0004 c6120563"
                + "c010 0006 0001 00000005 0016 00 00 00000001 00000002 00000003 00000004 00000004")
        let message = try DNSMessage(parsing: bytes)
        let answer = message.addresses(of: .a, for: "www.t")
        #expect(answer.addresses == [IPAddress("198.18.5.1")!])
        #expect(answer.ttl == 3)
        #expect(message.negativeTTL == 4, "min(SOA TTL 5, MINIMUM 4)")
    }

    @Test func everyTruncationOfAnAnswerIsAnErrorNotACrash() {
        for length in 0..<Self.twoRecords.count {
            #expect(throws: DNSMessage.FormatError.self, "prefix of \(length) bytes") {
                try DNSMessage(parsing: Array(Self.twoRecords.prefix(length)))
            }
        }
    }

    @Test(arguments: [
        ("a pointer to itself", "0000 8180 0000 0001 0000 0000 c00c 0001 0001 00000001 0004 01020304", "points forward"),
        ("a pointer forward", "0000 8180 0000 0001 0000 0000 c00e 00 0001 0001 00000001 0004 01020304", "points forward"),
        ("an undefined label type", "0000 8180 0000 0001 0000 0000 4100 0001 0001 00000001 0004 01020304", "label type"),
        ("an A record of 5 bytes", "0000 8180 0000 0001 0000 0000 00 0001 0001 00000001 0005 0102030405", "not 4"),
        ("an AAAA record of 4 bytes", "0000 8180 0000 0001 0000 0000 00 001c 0001 00000001 0004 01020304", "not 16"),
        ("a short SOA", "0000 8183 0000 0000 0001 0000 00 0006 0001 00000001 0004 00000000", "fewer than the 22"),
        ("an ANCOUNT with no records", "0000 8180 0000 ffff 0000 0000", "truncated"),
        ("RDLENGTH past the end", "0000 8180 0000 0001 0000 0000 00 0001 0001 00000001 ffff 01020304", "truncated"),
        ("a CNAME longer than its RDLENGTH", "0000 8180 0000 0001 0000 0000 00 0005 0001 00000001 0001 01 61 00", "past its RDLENGTH"),
    ])
    func craftedAnswersAreRefusedWithTheReason(_ what: String, _ bytes: String, _ reason: String) {
        do {
            _ = try DNSMessage(parsing: Self.hex(bytes))
            Issue.record("\(what) was accepted")
        } catch {
            #expect(error.reason.contains(reason), "\(what): \(error.reason)")
        }
    }

    @Test func aNameOfLabelsBeyond255BytesIsRefused() {
        // 5 labels of 63 bytes, then a record header: the name alone is over 255 bytes.
        let label = "3f" + String(repeating: "61", count: 63)
        let bytes = Self.hex("0000 8180 0000 0001 0000 0000" + String(repeating: label, count: 5) + "00 0001 0001 00000001 0004 01020304")
        #expect(throws: DNSMessage.FormatError.self) { try DNSMessage(parsing: bytes) }
    }

    @Test func randomBytesNeverCrashTheParser() {
        var generator = SystemRandomNumberGenerator()
        var accepted = 0
        for _ in 0..<20_000 {
            var bytes = Self.twoRecords
            // Flip a few bytes of a valid answer, or cut it, so the parser goes deep before failing.
            for _ in 0..<Int.random(in: 1...4, using: &generator) {
                bytes[Int.random(in: 0..<bytes.count, using: &generator)] = UInt8.random(in: 0...255, using: &generator)
            }
            bytes = Array(bytes.prefix(Int.random(in: 0...bytes.count, using: &generator)))
            if (try? DNSMessage(parsing: bytes)) != nil { accepted += 1 }
        }
        #expect(accepted < 20_000, "some mutations must be refused")
    }

    // MARK: resolver against dnsmasq

    @Test func resolvesAAndAAAAWithTheirTTL() throws {
        let server = try DNSServer(ttl: 7, hosts: [
            "198.18.5.2 multi.fanout.test", "198.18.5.1 multi.fanout.test", "2001:db8::5 multi.fanout.test",
            "198.18.5.3 v4only.fanout.test",
        ])
        let answer = try server.resolver.resolve("multi.fanout.test")
        #expect(answer.addresses == [IPAddress("198.18.5.1")!, IPAddress("198.18.5.2")!, IPAddress("2001:db8::5")!])
        #expect(answer.ttl == .seconds(7))
        let v4 = try server.resolver.resolve("V4ONLY.fanout.test.")
        #expect(v4.addresses == [IPAddress("198.18.5.3")!], "AAAA's no data is fine when A has records")
    }

    @Test func aNameWithoutAddressesIsATypedErrorNeverAnEmptySet() throws {
        let server = try DNSServer(ttl: 7, hosts: ["198.18.5.3 v4only.fanout.test"])
        #expect(throws: DNSError.nameNotFound(host: "typo.fanout.test", negativeTTL: nil)) {
            try server.resolver.resolve("typo.fanout.test")
        }
        // dnsmasq serves only fanout.test: any other name is REFUSED.
        #expect(throws: DNSError.refused(host: "collector.example.com", servers: server.address.description)) {
            try server.resolver.resolve("collector.example.com")
        }
        #expect(throws: DNSError.invalidName(host: String(repeating: "a", count: 64) + ".fanout.test")) {
            try server.resolver.resolve(String(repeating: "a", count: 64) + ".fanout.test")
        }
        let text = DNSError.nameNotFound(host: "typo.fanout.test", negativeTTL: nil).description
        #expect(text.contains("typo.fanout.test") && text.contains("check the spelling"))
    }

    @Test func aStoppedServerIsUnreachableAndASilentOneTimesOut() throws {
        let server = try DNSServer(ttl: 7, hosts: ["198.18.5.3 v4only.fanout.test"])
        server.stop()
        #expect(throws: DNSError.unreachable(host: "v4only.fanout.test", servers: server.address.description)) {
            try server.resolver.resolve("v4only.fanout.test")
        }
        // A bound socket that never answers: the query times out (one attempt of 1 s).
        let silent = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
        defer { close(silent) }
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        try #require(address.withSockAddr { bind(silent, $0, $1) } == 0)
        let resolver = DNSResolver(nameservers: [address], timeout: .seconds(1), attempts: 1)
        #expect(throws: DNSError.timeout(host: "x.fanout.test", servers: address.description, seconds: 1, attempts: 1)) {
            try resolver.resolve("x.fanout.test")
        }
    }

    // MARK: watcher

    @Test func watcherSeesChangedRecordsWithinTheTTL() async throws {
        let server = try DNSServer(ttl: 2, hosts: ["198.18.6.1 pool.fanout.test", "198.18.6.2 pool.fanout.test"])
        let updates = Updates()
        let watcher = DNSWatcher(host: "pool.fanout.test", port: 2055, maximumInterval: .seconds(60), resolver: server.resolver,
                                 logger: Logger(label: "dns-test"), onUpdate: updates.append)
        let running = Task { try await watcher.run() }
        defer { running.cancel() }
        let first = try await updates.wait(count: 1, seconds: 10)
        #expect(first == [SocketAddress("198.18.6.1:2055")!, SocketAddress("198.18.6.2:2055")!])
        try server.replaceHosts(["198.18.6.2 pool.fanout.test", "2001:db8:6::3 pool.fanout.test"])
        let changedAt = ContinuousClock.now
        let second = try await updates.wait(count: 2, seconds: 10)
        #expect(second == [SocketAddress("198.18.6.2:2055")!, SocketAddress("[2001:db8:6::3]:2055")!])
        // TTL 2 s, maximum interval 60 s: the change is seen on the TTL (plus one resolution).
        #expect(ContinuousClock.now - changedAt < .seconds(5), "seen after \(ContinuousClock.now - changedAt)")
        let text = watcher.metricsText()
        #expect(text.contains("udp_fanout_dns_addresses{name=\"pool.fanout.test\"} 2"))
        #expect(text.contains("udp_fanout_dns_ttl_seconds{name=\"pool.fanout.test\"} 2"))
        #expect(watcher.lastError == nil)
        running.cancel()
        try await running.value
    }

    @Test func watcherCapsALongTTLAtTheMaximumInterval() async throws {
        let server = try DNSServer(ttl: 3600, hosts: ["198.18.7.1 long.fanout.test"])
        let updates = Updates()
        let watcher = DNSWatcher(host: "long.fanout.test", port: 53000, maximumInterval: .seconds(1), resolver: server.resolver,
                                 logger: Logger(label: "dns-test"), onUpdate: updates.append)
        let running = Task { try await watcher.run() }
        defer { running.cancel() }
        _ = try await updates.wait(count: 1, seconds: 10)
        try server.replaceHosts(["198.18.7.2 long.fanout.test"])
        #expect(try await updates.wait(count: 2, seconds: 10) == [SocketAddress("198.18.7.2:53000")!])
        running.cancel()
        try await running.value
    }

    @Test func watcherKeepsTheLastGoodSetWhenTheServerStopsOrTheNameGoes() async throws {
        let server = try DNSServer(ttl: 1, hosts: ["198.18.8.1 kept.fanout.test"])
        let updates = Updates()
        let logs = CapturedLog()
        let watcher = DNSWatcher(host: "kept.fanout.test", port: 2055, maximumInterval: .seconds(2), resolver: server.resolver,
                                 logger: logs.logger("dns-test", level: .trace), onUpdate: updates.append)
        let running = Task { try await watcher.run() }
        defer { running.cancel() }
        let good = try await updates.wait(count: 1, seconds: 10)

        // The name removed from the zone: NXDOMAIN is a failure, the set stays.
        try server.replaceHosts(["198.18.8.9 other.fanout.test"])
        try await waitUntil(seconds: 10) { watcher.metricsText().contains("result=\"nxdomain\"} 0") == false }
        #expect(watcher.addresses == good)
        #expect(watcher.lastError?.contains("NXDOMAIN") == true)

        // The server gone: unreachable, logged with the error, the set stays, nothing sent to onUpdate.
        server.stop()
        try await waitUntil(seconds: 10) { watcher.metricsText().contains("result=\"unreachable\"} 0") == false }
        #expect(watcher.addresses == good)
        #expect(updates.all.count == 1, "no update while failing: \(updates.all)")
        #expect(watcher.lastError?.contains("refused the query") == true)
        let warning = try #require(logs.all.first { $0.message.contains("keeping the last good set") && $0.metadata.values.contains { $0.contains("refused the query") } })
        #expect(warning.level == .warning && warning.metadata["kept"] == "1")
        let text = watcher.metricsText()
        #expect(text.contains("udp_fanout_dns_resolutions_total{name=\"kept.fanout.test\",result=\"ok\"}"))
        #expect(text.contains("udp_fanout_dns_addresses{name=\"kept.fanout.test\"} 1"))
        running.cancel()
        try await running.value
    }

    @Test func watcherWhoseFirstResolutionFailsRetriesAndSaysWhy() async throws {
        let server = try DNSServer(ttl: 1, hosts: ["198.18.9.9 other.fanout.test"])
        let updates = Updates()
        let watcher = DNSWatcher(host: "late.fanout.test", port: 2055, maximumInterval: .seconds(1), resolver: server.resolver,
                                 logger: Logger(label: "dns-test"), onUpdate: updates.append)
        let running = Task { try await watcher.run() }
        defer { running.cancel() }
        try await waitUntil(seconds: 10) { watcher.lastError != nil }
        #expect(watcher.lastError?.contains("late.fanout.test") == true)
        #expect(watcher.addresses == nil && updates.all.isEmpty)
        try server.replaceHosts(["198.18.9.1 late.fanout.test"])
        #expect(try await updates.wait(count: 1, seconds: 10) == [SocketAddress("198.18.9.1:2055")!])
        #expect(watcher.lastError == nil)
        running.cancel()
        try await running.value
    }

    @Test func shutdownDoesNotWaitForANameserversTimeout() async throws {
        let silent = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
        defer { close(silent) }
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        try #require(address.withSockAddr { bind(silent, $0, $1) } == 0)
        let watcher = DNSWatcher(host: "x.fanout.test", port: 1, maximumInterval: .seconds(1),
                                 resolver: DNSResolver(nameservers: [address], timeout: .seconds(5), attempts: 3),
                                 logger: Logger(label: "dns-test"), onUpdate: { _ in })
        let running = Task { try await watcher.run() }
        try await Task.sleep(for: .milliseconds(300))
        let cancelledAt = ContinuousClock.now
        running.cancel()
        try await running.value
        // The query would block 15 s; run() returns without it.
        #expect(ContinuousClock.now - cancelledAt < .seconds(5))
    }

    /// Without nameservers the resolver reads /etc/resolv.conf at each resolution, so under
    /// `ip netns exec` it uses /etc/netns/<ns>/resolv.conf. The test does what `ip netns exec`
    /// does, on a thread of its own: enter the namespace, unshare the mount namespace, bind
    /// the namespace's resolv.conf over /etc/resolv.conf.
    @Test(.enabled(if: Privileges.enabled, Privileges.reason))
    func withoutNameserversTheNamespacesResolvConfIsUsed() throws {
        let namespace = "fdns\(UInt32.random(in: 0...UInt32.max))"
        let ip = "/usr/sbin/ip"
        try #require(try run(ip, ["netns", "add", namespace]).status == 0)
        defer { _ = try? run(ip, ["netns", "delete", namespace]) }
        try #require(try run(ip, ["-n", namespace, "link", "set", "lo", "up"]).status == 0)
        let configDirectory = URL(fileURLWithPath: "/etc/netns/\(namespace)")
        try FileManager.default.createDirectory(at: configDirectory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: configDirectory) }
        let resolvConf = configDirectory.appendingPathComponent("resolv.conf")
        try "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n".write(to: resolvConf, atomically: true, encoding: .utf8)
        let server = try DNSServer(ttl: 9, hosts: ["198.18.10.1 ns.fanout.test", "2001:db8:10::1 ns.fanout.test"], namespace: namespace)
        defer { server.stop() }

        let outcome = try #require(inNamespaceWithResolvConf(namespace, resolvConf.path) {
            Result { () throws(DNSError) in try DNSResolver().resolve("ns.fanout.test") }
        })
        let answer = try outcome.get()
        #expect(answer.addresses == [IPAddress("198.18.10.1")!, IPAddress("2001:db8:10::1")!])
        #expect(answer.ttl == .seconds(9))
    }

    // MARK: helpers

    static func hex(_ text: String) -> [UInt8] {
        let digits = Array(text.filter { !$0.isWhitespace })
        return stride(from: 0, to: digits.count, by: 2).map { UInt8(String(digits[$0...$0 + 1]), radix: 16)! }
    }
}

/// Runs `body` on a thread of its own inside the network namespace `namespace`, with `resolvConf`
/// bind-mounted over /etc/resolv.conf in a private mount namespace (what `ip netns exec` does);
/// nil if any step failed (recorded as an issue).
private func inNamespaceWithResolvConf<T: Sendable>(_ namespace: String, _ resolvConf: String, _ body: @escaping @Sendable () -> T) -> T? {
    let result = HandOff<T?>(nil)
    let failure = HandOff<String?>(nil)
    OSThread(name: "dns-netns") {
        let fd = open("/run/netns/\(namespace)", O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return failure.withLock { $0 = "open netns: errno \(errno)" } }
        defer { close(fd) }
        guard shim_setns(fd, 0x4000_0000) == 0 else { return failure.withLock { $0 = "setns: errno \(errno)" } }  // CLONE_NEWNET
        // CLONE_NEWNS: the mounts below stay on this thread (it also gets its own fs_struct).
        guard shim_unshare(0x0002_0000) == 0 else { return failure.withLock { $0 = "unshare: errno \(errno)" } }
        // MS_REC | MS_SLAVE, so the bind mount does not propagate back to the host; then MS_BIND.
        // (Numbers: naming sys/mount.h's constants hides SOCK_DGRAM from this test module.)
        guard mount("none", "/", nil, 0x4000 | 0x8_0000, nil) == 0,
            mount(resolvConf, "/etc/resolv.conf", "none", 0x1000, nil) == 0
        else { return failure.withLock { $0 = "mount: errno \(errno)" } }
        let value = body()
        result.withLock { $0 = value }
    }.join()
    if let reason = failure.withLock({ $0 }) { Issue.record("entering \(namespace): \(reason)") }
    return result.withLock { $0.take() }
}

/// A value a thread hands back, behind a lock.
private final class HandOff<Value: Sendable>: Sendable {
    private let mutex: Mutex<Value>
    init(_ value: sending Value) { mutex = Mutex(value) }
    func withLock<R>(_ body: (inout sending Value) -> sending R) -> sending R { mutex.withLock(body) }
}

/// Waits (bounded) until `condition` holds.
private func waitUntil(seconds: Int, _ condition: () -> Bool) async throws {
    let deadline = ContinuousClock.now + .seconds(seconds)
    while !condition() {
        guard ContinuousClock.now < deadline else {
            Issue.record("condition not met in \(seconds) s")
            throw CancellationError()
        }
        try await Task.sleep(for: .milliseconds(50))
    }
}

/// The sets a watcher handed to onUpdate, in order.
private final class Updates: Sendable {
    private let sets = Mutex<[[SocketAddress]]>([])
    var all: [[SocketAddress]] { sets.withLock { $0 } }
    @Sendable func append(_ set: [SocketAddress]) { sets.withLock { $0.append(set) } }

    /// The `count`th set, waiting at most `seconds` for it.
    func wait(count: Int, seconds: Int) async throws -> [SocketAddress] {
        try await waitUntil(seconds: seconds) { all.count >= count }
        return all[count - 1]
    }
}

/// dnsmasq serving a hosts file for the zone fanout.test (names outside it are REFUSED, unknown
/// names in it NXDOMAIN) on 127.0.0.1 at a free port, with every record's TTL `ttl`. Started
/// as a ``SpawnedProcess`` (dnsmasq closes the descriptors it inherits, which stalls Foundation's
/// Process). Stopped by its PID; its directory removed.
final class DNSServer {
    let directory: URL
    let hostsFile: URL
    let address: SocketAddress
    private let logFile: URL
    private var process: SpawnedProcess?

    /// - Parameter namespace: run inside this network namespace on 127.0.0.1:53 (a port
    ///   resolv.conf can name) instead of at a free port in the test's own namespace.
    init(ttl: Int, hosts: [String], namespace: String? = nil) throws {
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("fanout-dns-\(UInt32.random(in: 0...UInt32.max))")
        // dnsmasq run as root reads the file as its own user after SIGHUP: world-readable.
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: false, attributes: [.posixPermissions: 0o755])
        hostsFile = directory.appendingPathComponent("hosts")
        logFile = directory.appendingPathComponent("log")
        address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: namespace == nil ? freePort() : 53)
        try writeHosts(hosts)
        var arguments = [
            "/usr/sbin/dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts", "--addn-hosts=\(hostsFile.path)",
            "--local-ttl=\(ttl)", "--local=/fanout.test/", "--listen-address=127.0.0.1", "--bind-interfaces",
            "--port=\(address.port)", "--pid-file=\(directory.appendingPathComponent("pid").path)", "--log-facility=-",
        ]
        if Privileges.isRoot { arguments.append("--user=root") }
        // ip netns exec execs dnsmasq in place: the spawned PID is dnsmasq's.
        if let namespace { arguments = ["/usr/sbin/ip", "netns", "exec", namespace] + arguments }
        process = try SpawnedProcess(arguments, log: logFile.path)
        try waitForLog(reads: 1)
    }

    deinit {
        stop()
        try? FileManager.default.removeItem(at: directory)
    }

    /// Asks this server only, one attempt of 1 s (it is local: more would only slow failures).
    var resolver: DNSResolver { DNSResolver(nameservers: [address], timeout: .seconds(1), attempts: 1) }

    var log: String { (try? String(contentsOf: logFile, encoding: .utf8)) ?? "" }

    func writeHosts(_ hosts: [String]) throws {
        try (hosts.joined(separator: "\n") + "\n").write(to: hostsFile, atomically: true, encoding: .utf8)
        try FileManager.default.setAttributes([.posixPermissions: 0o644], ofItemAtPath: hostsFile.path)
    }

    /// New records: rewrites the file and sends SIGHUP (dnsmasq rereads addn-hosts and clears its cache).
    func replaceHosts(_ hosts: [String]) throws {
        let before = log.components(separatedBy: "read \(hostsFile.path)").count - 1
        try writeHosts(hosts)
        process?.signal(SIGHUP)
        try waitForLog(reads: before + 1)
    }

    /// Waits (at most 5 s) until dnsmasq logged reading the hosts file `reads` times.
    private func waitForLog(reads: Int) throws {
        let deadline = ContinuousClock.now + .seconds(5)
        while log.components(separatedBy: "read \(hostsFile.path)").count - 1 < reads {
            guard ContinuousClock.now < deadline else { throw DNSServerError.notReady(log) }
            usleep(20_000)
        }
    }

    /// Stops dnsmasq by its PID (SIGTERM, SIGKILL after 2 s) and reaps it.
    func stop() {
        process?.stop()
        process = nil
    }

    enum DNSServerError: Error { case notReady(String) }
}
