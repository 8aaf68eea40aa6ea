// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
import ReusePortLB
// SOCK_DGRAM: see docs/development.md (test files that use Glibc's socket constants).
import CSystemShim

#if canImport(Glibc)
import Glibc
#endif

/// The ports tests bind later come from outside the kernel's ephemeral range: a port from inside
/// it, checked free and closed, could be taken by any connect or unbound send before the test
/// binds it (a daemon then failed with EADDRINUSE on a fresh clone).
@Suite("Test ports")
struct TestPortTests {
    /// The kernel's ephemeral range, read the way the test support reads it.
    static func ephemeralRange() throws -> ClosedRange<Int> {
        let text = try String(contentsOfFile: "/proc/sys/net/ipv4/ip_local_port_range", encoding: .utf8)
        let bounds = text.split(whereSeparator: { $0 == " " || $0 == "\t" || $0 == "\n" }).compactMap { Int($0) }
        try #require(bounds.count == 2, "ip_local_port_range: \(text)")
        return bounds[0]...bounds[1]
    }

    @Test("freePort hands out ports outside the ephemeral range, bindable, never the same twice")
    func outsideEphemeralAndUnique() throws {
        let ephemeral = try Self.ephemeralRange()
        var seen = Set<UInt16>()
        for _ in 0..<300 {
            let port = freePort()
            #expect(!ephemeral.contains(Int(port)), "port \(port) is in the ephemeral range \(ephemeral)")
            #expect(port >= 10000, "port \(port) is below 10000")
            #expect(seen.insert(port).inserted, "port \(port) handed out twice")
        }
        // What was handed out can still be bound for UDP and TCP (nothing holds it).
        let port = freePort()
        for type in [SOCK_DGRAM, SOCK_STREAM] {
            let fd = socket(AF_INET, Int32(type.rawValue), 0)
            defer { close(fd) }
            let bound = SocketAddress(ip: IPAddress("127.0.0.1")!, port: port).withSockAddr { bind(fd, $0, $1) }
            #expect(bound == 0, "bind \(port) (\(type)): errno \(errno)")
        }
    }

    @Test("The allocator skips ports in use, starts at its offset, wraps once and never repeats")
    func allocatorOrder() {
        let allocator = TestPortAllocator(pool: [10000...10004, 61000...61002], start: 5)
        let held: Set<UInt16> = [61001, 10002]
        var handed: [UInt16] = []
        for _ in 0..<6 { handed.append(allocator.next { !held.contains($0) }) }
        #expect(handed == [61000, 61002, 10000, 10001, 10003, 10004])
    }

    @Test("The pool is what lies outside the ephemeral range from 10000 up")
    func poolOutsideEphemeral() {
        #expect(TestPortAllocator.pool(outside: 32768...60999) == [10000...32767, 61000...65535])
        #expect(TestPortAllocator.pool(outside: 1024...65535) == [])
        #expect(TestPortAllocator.pool(outside: 5000...65000) == [65001...65535])
        #expect(TestPortAllocator.pool(outside: 40000...65535) == [10000...39999])
    }
}
