// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// `rate_limit`: its configuration, and the userspace kinds' buckets (SourceRateLimiter) on a
/// clock the test moves.
@Suite("rate_limit: configuration and the userspace buckets")
struct RateLimitTests {
    static func storage(_ address: String) -> sockaddr_storage {
        var storage = sockaddr_storage()
        _ = SocketAddress(ip: IPAddress(address)!, port: 4000).withSockAddr { address, length in
            withUnsafeMutableBytes(of: &storage) { $0.copyMemory(from: UnsafeRawBufferPointer(start: address, count: Int(length))) }
        }
        return storage
    }

    static func admits(_ limiter: SourceRateLimiter, _ address: String, length: Int = 100, at now: Int64) -> Bool {
        var source = storage(address)
        return withUnsafePointer(to: &source) { limiter.admits($0, length: length, now: now) }
    }

    static func parse(_ block: String) throws -> Listener {
        try ConfigParser.parse("""
            listeners:
              - name: l
                bind: "127.0.0.1:9000"
                downstream: [{name: a, address: "127.0.0.1:9001"}]
                rate_limit: \(block)
            """).listeners[0]
    }

    @Test("every key parsed; defaults: /32 and /64, a tenth of a second's burst (at least 5), 64 KiB of bytes, 65,536 sources")
    func parses() throws {
        let full = try Self.parse("""
            {datagrams_per_second: 100, burst_datagrams: 20, bytes_per_second: 50000, burst_bytes: 9000, ipv4_prefix: 24, ipv6_prefix: 48,
                             allow: [198.18.9.0/24, "2001:db8:9::/48"], new_sources_per_second: 1000, burst_new_sources: 50, max_sources: 4096}
            """).rateLimit
        #expect(full == RateLimit(datagramsPerSecond: 100, burstDatagrams: 20, bytesPerSecond: 50000, burstBytes: 9000, ipv4PrefixLength: 24,
                                  ipv6PrefixLength: 48, allow: [SourcePrefix("198.18.9.0/24")!, SourcePrefix("2001:db8:9::/48")!],
                                  newSourcesPerSecond: 1000, burstNewSources: 50, maxSources: 4096))
        let defaults = try #require(try Self.parse("{datagrams_per_second: 1000, bytes_per_second: 10000000}").rateLimit)
        #expect(defaults.burstDatagrams == 100 && defaults.burstBytes == 1_000_000)
        #expect(defaults.ipv4PrefixLength == 32 && defaults.ipv6PrefixLength == 64 && defaults.maxSources == 65_536)
        #expect(try Self.parse("{datagrams_per_second: 20}").rateLimit?.burstDatagrams == 5)
        #expect(try Self.parse("{bytes_per_second: 1000}").rateLimit?.burstBytes == 65_535)
        let config = try ConfigParser.parse("""
            listeners:
              - {name: l, bind: "127.0.0.1:9000", downstream: [{name: a, address: "127.0.0.1:9001"}], rate_limit: {datagrams_per_second: 50}}
            """)
        #expect(config.checkSummary.contains("rate_limit 50 datagrams/s (burst 5), per /32 and /64, 65536 sources"), "\(config.checkSummary)")
    }

    @Test("errors name the key and the fix", arguments: [
        ("{allow: [198.18.0.0/16]}", "rate_limit", "limits nothing"),
        ("{burst_datagrams: 10}", "rate_limit.burst_datagrams", "set datagrams_per_second, or remove burst_datagrams"),
        ("{datagrams_per_second: 0}", "rate_limit.datagrams_per_second", "out of range"),
        ("{datagrams_per_second: 10, burst_bytes: 100}", "rate_limit.burst_bytes", "set bytes_per_second, or remove burst_bytes"),
        ("{datagrams_per_second: 10, ipv4_prefix: 33}", "rate_limit.ipv4_prefix", "out of range"),
        ("{datagrams_per_second: 10, allow: [198.18.0.1/16]}", "rate_limit.allow[0]", "'198.18.0.1/16': expected a client prefix"),
        ("{datagrams_per_second: 10, max_sources: 10}", "rate_limit.max_sources", "out of range"),
        ("{datagrams_per_second: 10, allow: [\"::/0\"]}", "rate_limit.allow[0]", "IPv4-mapped"),
        ("{datagrams_per_second: 10, allow: [\"::ffff:198.18.0.0/112\"]}", "rate_limit.allow[0]", "IPv4-mapped"),
        ("{datagrams_per_second: 10, per_source: 1}", "rate_limit.per_source", "unknown key"),
    ])
    func errors(block: String, key: String, problem: String) {
        #expect {
            _ = try Self.parse(block)
        } throws: { error in
            let text = "\(error)"
            return text.contains(key) && text.contains(problem)
        }
    }

    @Test("a byte burst below max_packet_size is warned about")
    func smallByteBurst() throws {
        let config = try ConfigParser.parse("""
            listeners:
              - {name: l, bind: "127.0.0.1:9000", downstream: [{name: a, address: "127.0.0.1:9001"}],
                 rate_limit: {bytes_per_second: 1000, burst_bytes: 500}}
            """)
        #expect(config.warnings().map(\.key) == ["listeners[0].rate_limit.burst_bytes"], "\(config.warnings())")
    }

    @Test("a source gets its burst at once, then one datagram per interval; over 10 s of flooding, the burst plus the rate")
    func bucket() {
        let limiter = SourceRateLimiter(RateLimit(datagramsPerSecond: 100, burstDatagrams: 10))
        let start: Int64 = 5_000_000_000
        let burst = (0..<30).filter { _ in Self.admits(limiter, "198.18.1.1", at: start) }.count
        #expect(burst == 10)
        #expect(!Self.admits(limiter, "198.18.1.1", at: start + 9_000_000))
        #expect(Self.admits(limiter, "198.18.1.1", at: start + 10_000_000))
        // 1,000 datagrams/s offered for 10 s (after the burst above): 100/s accepted.
        var accepted = 0
        for step in 1...10_000 where Self.admits(limiter, "198.18.1.1", at: start + 10_000_000 + Int64(step) * 1_000_000) { accepted += 1 }
        #expect(accepted == 1000, "\(accepted)")
        // Another source is not touched by the first one's drops.
        #expect(Self.admits(limiter, "198.18.1.2", at: start + 10_010_000_000))
        #expect(limiter.topLimited(5).first?.prefix == "198.18.1.1/32")
    }

    @Test("rates that do not divide a second: the burst whole (3/s burst 1, 7/s burst 7, 30 new sources/s burst 1), then the rate")
    func roundedRates() {
        let now: Int64 = 1_000_000_000
        let three = SourceRateLimiter(RateLimit(datagramsPerSecond: 3, burstDatagrams: 1))
        #expect(Self.admits(three, "198.18.1.1", at: now) && !Self.admits(three, "198.18.1.1", at: now))
        #expect(!Self.admits(three, "198.18.1.1", at: now + 333_333_333) && Self.admits(three, "198.18.1.1", at: now + 333_333_334))
        let seven = SourceRateLimiter(RateLimit(datagramsPerSecond: 7, burstDatagrams: 7))
        #expect((0..<10).filter { _ in Self.admits(seven, "198.18.1.1", at: now) }.count == 7)
        let fresh = SourceRateLimiter(RateLimit(datagramsPerSecond: 10, newSourcesPerSecond: 30, burstNewSources: 1))
        #expect(Self.admits(fresh, "198.18.2.1", at: now) && !Self.admits(fresh, "198.18.2.2", at: now))
        // A datagram of exactly burst_bytes fits at any rate.
        let bytes = SourceRateLimiter(RateLimit(bytesPerSecond: 1_000_000_000_000, burstBytes: 65_535))
        #expect(Self.admits(bytes, "198.18.3.1", length: 65_535, at: now))
        #expect(TCProgram.rateConfig(RateLimit(datagramsPerSecond: 3, burstDatagrams: 1)).datagram_tolerance == 333_333_334)
    }

    @Test("sources share their prefix's bucket: IPv4 /24, IPv6 /64 (rotating inside it gains nothing), IPv4-mapped IPv6 as IPv4")
    func prefixes() {
        let limiter = SourceRateLimiter(RateLimit(datagramsPerSecond: 10, burstDatagrams: 5, ipv4PrefixLength: 24))
        let now: Int64 = 1_000_000_000
        #expect((1...20).filter { Self.admits(limiter, "198.18.7.\($0)", at: now) }.count == 5)
        #expect(Self.admits(limiter, "198.18.8.1", at: now))
        // The same IPv4 bucket through an IPv4-mapped IPv6 source (a dual-stack socket's view).
        #expect(!Self.admits(limiter, "::ffff:198.18.7.200", at: now))
        let six = SourceRateLimiter(RateLimit(datagramsPerSecond: 10, burstDatagrams: 5))
        #expect((1...200).filter { Self.admits(six, "2001:db8:77:1::\(String($0, radix: 16))", at: now) }.count == 5)
        #expect((1...200).filter { Self.admits(six, "2001:db8:77:1:\(String($0, radix: 16))::9", at: now) }.count == 0)
        #expect(Self.admits(six, "2001:db8:77:2::1", at: now))
        #expect(six.topLimited(1).first?.prefix == "2001:db8:77:1::/64", "\(six.topLimited(1))")
    }

    @Test("allow prefixes are never limited; bytes are limited by bytes_per_second; new sources by new_sources_per_second")
    func allowBytesAndNewSources() {
        let now: Int64 = 1_000_000_000
        let allowed = SourceRateLimiter(RateLimit(datagramsPerSecond: 1, burstDatagrams: 1, allow: [SourcePrefix("198.18.9.0/24")!]))
        #expect((0..<100).allSatisfy { _ in Self.admits(allowed, "198.18.9.4", at: now) })
        #expect((0..<3).filter { _ in Self.admits(allowed, "198.18.10.4", at: now) }.count == 1)
        // 1,000 bytes/s, burst 3,000: three 1,000-byte datagrams, then one per second; a datagram
        // refused by its bytes is not charged.
        let bytes = SourceRateLimiter(RateLimit(bytesPerSecond: 1000, burstBytes: 3000))
        #expect((0..<10).filter { _ in Self.admits(bytes, "198.18.1.1", length: 1000, at: now) }.count == 3)
        #expect(Self.admits(bytes, "198.18.1.1", length: 100, at: now + 100_000_000))
        #expect(!Self.admits(bytes, "198.18.1.1", length: 1000, at: now + 1_000_000_000))
        #expect(Self.admits(bytes, "198.18.1.1", length: 900, at: now + 1_000_000_000))
        // Both limits: a datagram over its bytes gives its datagram charge back.
        let both = SourceRateLimiter(RateLimit(datagramsPerSecond: 10, burstDatagrams: 2, bytesPerSecond: 1000, burstBytes: 1000))
        #expect(!Self.admits(both, "198.18.1.1", length: 2000, at: now))
        #expect((0..<4).filter { _ in Self.admits(both, "198.18.1.1", length: 10, at: now) }.count == 2)
        // 10 new sources a second, burst 5: five at once, then one per 100 ms; known ones go on.
        let fresh = SourceRateLimiter(RateLimit(datagramsPerSecond: 1000, newSourcesPerSecond: 10, burstNewSources: 5))
        #expect((1...20).filter { Self.admits(fresh, "198.18.2.\($0)", at: now) }.count == 5)
        #expect(Self.admits(fresh, "198.18.2.1", at: now))
        #expect(!Self.admits(fresh, "198.18.2.40", at: now + 50_000_000))
        #expect(Self.admits(fresh, "198.18.2.40", at: now + 100_000_000))
    }

    @Test("a table too small for the sources forgets the one closest to full, counted; idle sources leave no count")
    func eviction() {
        let limiter = SourceRateLimiter(RateLimit(datagramsPerSecond: 10, burstDatagrams: 5, maxSources: 1024))
        let now: Int64 = 1_000_000_000
        // 20,000 sources at once, each charged: the table (1,024 and up to the next set) forgets most.
        for index in 0..<20_000 { _ = Self.admits(limiter, "198.18.\(64 + index / 256).\(index % 256)", at: now) }
        #expect(limiter.evicted.load(ordering: .relaxed) > 15_000)
        // Ten seconds later every bucket is full again: new sources take those slots and forget
        // nothing that counts (100 sources over 128 sets of 8: none overflows its set).
        let before = limiter.evicted.load(ordering: .relaxed)
        for index in 0..<100 { #expect(Self.admits(limiter, "198.18.200.\(index)", at: now + 10_000_000_000)) }
        #expect(limiter.evicted.load(ordering: .relaxed) == before)
    }

    @Test("shared by the threads of a listener: four threads flooding one source get its burst once")
    func sharedByThreads() async {
        let limiter = SourceRateLimiter(RateLimit(datagramsPerSecond: 10, burstDatagrams: 100))
        let now: Int64 = 1_000_000_000
        let counts = await withTaskGroup(of: Int.self) { group in
            for _ in 0..<4 {
                group.addTask { (0..<1000).filter { _ in Self.admits(limiter, "198.18.3.3", at: now) }.count }
            }
            return await group.reduce(0, +)
        }
        #expect(counts == 100)
    }
}
