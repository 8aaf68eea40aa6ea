// SPDX-License-Identifier: Apache-2.0
// SOCK_DGRAM: through CSystemShim when a file of the same compile batch imports it (development.md).
import CSystemShim
import Foundation
import ReusePortLB
import Testing
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// A start that fails says why once and exits non-zero; the teardown after it (the HTTP
/// endpoint, the service group) adds no error lines of its own, which would read as more failures.
@Suite("Failed start", .serialized)
struct FailedStartTests {
    @Test("A listener whose bind another process holds: one line naming it, exit non-zero, no teardown errors (Waiting on child channel, Server shutdown error)")
    func bindTaken() throws {
        let port = freePort()
        let holder = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
        defer { close(holder) }
        try #require(SocketAddress(ip: IPAddress("127.0.0.1")!, port: port).withSockAddr { bind(holder, $0, $1) } == 0, "hold the bind: errno \(errno)")
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("failed-start-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        try """
            listeners:
              - name: u
                bind: "127.0.0.1:\(port)"
                mode: userspace
                downstream: [{address: "127.0.0.1:\(freePort())"}]
            metrics: {enabled: true, bind: "127.0.0.1:\(freePort())"}
            """.write(to: file, atomically: true, encoding: .utf8)
        let daemon = try Child("udp-fanout", ["-c", file.path])
        let status = daemon.wait(seconds: 20)
        let stderr = daemon.stderr
        #expect(status != 0, "\(stderr)")
        let lines = stderr.split(separator: "\n")
        #expect(lines.filter { $0.contains("listener 'u' could not start") && $0.contains("127.0.0.1:\(port)") }.count == 1, "the real error, once: \(stderr)")
        for noise in ["Waiting on child channel", "Server shutdown error"] {
            #expect(!stderr.contains(noise), "teardown noise '\(noise)': \(stderr)")
        }
        #expect(lines.filter { $0.contains(" error ") || $0.contains(" critical ") }.isEmpty, "no other error-level line: \(stderr)")
    }
}
