// SPDX-License-Identifier: Apache-2.0
import CSystemShim
import Foundation
import ReusePortLB
import Testing
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// The two-way test tools on loopback, with no load balancer in between: `collector --echo`
/// (and `--initiate`) and `publisher --exchange` count what they must, so the end-to-end
/// tests' figures mean what they say.
@Suite("TwoWay tools on loopback", .serialized)
struct TwoWayToolsTests {
    static func echo(_ ip: String, _ port: UInt16, index: Int, count: Int, extra: [String] = []) throws -> Child {
        let child = try Child("collector", [ip, "\(port)", "\(index)", "\(count)", "--echo"] + extra)
        try child.waitFor("ready")
        return child
    }

    @Test("publisher --exchange against two echo collectors: every exchange answered from the destination, each client by one collector (default tags)")
    func exchangeCounts() throws {
        let port = freePort()
        let collectors = try (0..<2).map { try Self.echo("127.0.0.1", port, index: $0, count: 2) }
        let publisher = try Child("publisher", ["127.0.0.1", "\(port)", "50", "--exchange", "--clients", "20", "--sources", "127.0.7.1-127.0.7.10",
                                                "--window", "2", "--per-client", "--duration", "30"])
        #expect(publisher.wait(seconds: 40) == 0, "\(publisher.stderr)")
        let report = try publisher.json()
        print("publisher --exchange on loopback: \(publisher.stdout.trimmingCharacters(in: .whitespacesAndNewlines))")
        #expect(report.int("clients") == 20 && report.int("requests") == 1000 && report.int("exchanges") == 1000)
        #expect(report.int("replies") == 1000 && report.int("lost") == 0 && report.int("wrong_source") == 0, "\(report)")
        #expect(report.int("servers_per_client") == 1 && report.int("clients_with_one_server") == 20, "\(report)")
        let tags = report.object("clients_by_tag")
        #expect(Set(tags.keys).isSubset(of: ["127.0.0.1:\(port)/0", "127.0.0.1:\(port)/1"]) && !tags.isEmpty, "default tags: \(tags)")
        #expect(tags.values.compactMap { ($0 as? NSNumber)?.intValue }.reduce(0, +) == 20)
        #expect(report.object("client_tags").count == 20, "one entry per client: \(report)")
        #expect(report.int("rtt_p50_us") > 0 && report.int("rtt_p99_us") >= report.int("rtt_p50_us"))
        let reports = try collectors.map { try $0.stop() }
        #expect(reports.map { $0.int("echoed") }.reduce(0, +) == 1000, "\(reports)")
        #expect(reports.allSatisfy { $0.int("echo_failed") == 0 })
    }

    @Test("publisher --exchange counts a reply from another address as wrong_source, and requests nobody answers as lost")
    func wrongSourceAndLost() throws {
        let port = freePort()
        // Bound to the wildcard, the collector answers 127.0.0.2 from 127.0.0.1 (the loopback route's source).
        let collector = try Self.echo("0.0.0.0", port, index: 0, count: 1)
        let wrong = try Child("publisher", ["127.0.0.2", "\(port)", "5", "--exchange", "--clients", "4", "--sources", "127.0.7.20"])
        #expect(wrong.wait() == 0, "\(wrong.stderr)")
        let report = try wrong.json()
        #expect(report.int("replies") == 20 && report.int("wrong_source") == 20, "\(report)")
        _ = try collector.stop()

        let silent = try Child("publisher", ["127.0.0.1", "\(freePort())", "3", "--exchange", "--clients", "2", "--reply-timeout-ms", "100"])
        #expect(silent.wait() == 0, "\(silent.stderr)")
        let lost = try silent.json()
        #expect(lost.int("replies") == 0 && lost.int("lost") == 6 && lost.int("exchanges") == 6, "\(lost)")
    }

    @Test("collector --initiate sends its tag to the client once ready; the client's datagrams are echoed with it")
    func initiate() throws {
        let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
        defer { close(fd) }
        let client = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        try #require(client.withSockAddr { bind(fd, $0, $1) } == 0)
        let port = freePort()
        let collector = try Self.echo("127.0.0.1", port, index: 0, count: 1, extra: ["--tag", "server-a", "--initiate", "\(client)"])
        let first = try #require(Datagrams.receive(fd), "the initiated datagram")
        #expect(first.source == SocketAddress(ip: IPAddress("127.0.0.1")!, port: port) && first.payload == "server-a", "\(first)")
        try Datagrams.send(fd, "ping", to: first.source)
        let reply = try #require(Datagrams.receive(fd), "the echo")
        #expect(reply.payload == "pingserver-a")
        let report = try collector.stop()
        #expect(report.int("initiated") == 1 && report.int("echoed") == 1 && report["tag"] as? String == "server-a", "\(report)")
    }

    @Test("--initiate without --echo, and an --initiate address of the other family, are refused naming the fix")
    func refused() throws {
        let port = "\(freePort())"
        let noEcho = try Child("collector", ["127.0.0.1", port, "0", "1", "--initiate", "127.0.0.1:4000"])
        #expect(noEcho.wait() != 0)
        #expect(noEcho.stderr.contains("--initiate needs --echo"), "\(noEcho.stderr)")
        let family = try Child("collector", ["127.0.0.1", port, "0", "1", "--echo", "--initiate", "[::1]:4000"])
        #expect(family.wait() != 0)
        #expect(family.stderr.contains("is not of the family"), "\(family.stderr)")
        let options = try Child("publisher", ["127.0.0.1", port, "3", "--clients", "4"])
        #expect(options.wait() != 0)
        #expect(options.stderr.contains("need --exchange"), "\(options.stderr)")
    }
}
