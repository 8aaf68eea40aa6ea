// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif

/// A listener's `rate_limit`: token buckets per source prefix (docs/abuse.md). Each source prefix
/// (`ipv4_prefix`, `ipv6_prefix`; IPv4-mapped IPv6 clients count as IPv4) may send
/// `datagrams_per_second` and `bytes_per_second`, with bursts of `burst_datagrams` and
/// `burst_bytes`; what is above is dropped and counted `rate_limited`. Sources in `allow` are
/// never limited. `new_sources_per_second` caps how many sources the listener starts tracking
/// per second (a spoofed flood of fresh addresses); `max_sources` bounds the state.
public struct RateLimit: Equatable, Sendable, CustomStringConvertible {
    /// nil: no datagram limit.
    public var datagramsPerSecond: UInt64?
    public var burstDatagrams: UInt64
    /// nil: no byte limit.
    public var bytesPerSecond: UInt64?
    public var burstBytes: UInt64
    /// Bits of a source address that make its bucket's key.
    public var ipv4PrefixLength: Int
    public var ipv6PrefixLength: Int
    /// Sources never limited (nor counted against `new_sources_per_second`).
    public var allow: [SourcePrefix]
    /// nil: no ceiling on new sources.
    public var newSourcesPerSecond: UInt64?
    public var burstNewSources: UInt64
    /// Sources tracked at once: a userspace listener's table, a kernel listener's LRU map.
    public var maxSources: Int

    public static let defaultMaxSources = 65_536

    public init(datagramsPerSecond: UInt64? = nil, burstDatagrams: UInt64? = nil, bytesPerSecond: UInt64? = nil, burstBytes: UInt64? = nil,
                ipv4PrefixLength: Int = 32, ipv6PrefixLength: Int = 64, allow: [SourcePrefix] = [],
                newSourcesPerSecond: UInt64? = nil, burstNewSources: UInt64? = nil, maxSources: Int = Self.defaultMaxSources) {
        self.datagramsPerSecond = datagramsPerSecond
        self.burstDatagrams = burstDatagrams ?? Self.defaultBurst(datagramsPerSecond ?? 0)
        self.bytesPerSecond = bytesPerSecond
        // A datagram larger than the byte burst could never pass: at least 64 KiB by default.
        self.burstBytes = burstBytes ?? max((bytesPerSecond ?? 0) / 10, 65_535)
        self.ipv4PrefixLength = ipv4PrefixLength
        self.ipv6PrefixLength = ipv6PrefixLength
        self.allow = allow
        self.newSourcesPerSecond = newSourcesPerSecond
        self.burstNewSources = burstNewSources ?? Self.defaultBurst(newSourcesPerSecond ?? 0)
        self.maxSources = maxSources
    }

    /// A tenth of a second's worth, at least 5 (nftables' and hashlimit's default burst): a
    /// batch of datagrams a source sent close together is not cut by its own arrival.
    static func defaultBurst(_ rate: UInt64) -> UInt64 { max(rate / 10, 5) }

    public var description: String {
        var parts: [String] = []
        if let rate = datagramsPerSecond { parts.append("\(rate) datagrams/s (burst \(burstDatagrams))") }
        if let rate = bytesPerSecond { parts.append("\(rate) bytes/s (burst \(burstBytes))") }
        parts.append("per /\(ipv4PrefixLength) and /\(ipv6PrefixLength), \(maxSources) sources")
        if let rate = newSourcesPerSecond { parts.append("\(rate) new sources/s (burst \(burstNewSources))") }
        if !allow.isEmpty { parts.append("allow \(allow.map(\.description).joined(separator: " "))") }
        return parts.joined(separator: ", ")
    }
}

extension ConfigParser {
    /// A listener's `rate_limit` (nil when absent).
    static func rateLimit(_ fields: Fields, path: String) throws(ConfigError) -> RateLimit? {
        guard let node = fields["rate_limit"] else { return nil }
        let entry = try Fields(node, path: "\(path).rate_limit")
        try entry.allow([
            "datagrams_per_second", "burst_datagrams", "bytes_per_second", "burst_bytes", "ipv4_prefix", "ipv6_prefix", "allow",
            "new_sources_per_second", "burst_new_sources", "max_sources",
        ])
        func count(_ name: String, _ range: ClosedRange<Int>) throws(ConfigError) -> UInt64? {
            try entry.int(name, in: range).map { UInt64($0) }
        }
        let datagrams = try count("datagrams_per_second", 1...1_000_000_000)
        let bytes = try count("bytes_per_second", 1...1_000_000_000_000)
        let newSources = try count("new_sources_per_second", 1...100_000_000)
        // A burst without its rate is named first: it is the key the file has.
        let burstDatagrams = try count("burst_datagrams", 1...1_000_000_000)
        if burstDatagrams != nil && datagrams == nil {
            throw entry.error("burst_datagrams", "a burst of datagrams_per_second, which is not set: set datagrams_per_second, or remove burst_datagrams")
        }
        let burstBytes = try count("burst_bytes", 1...1_000_000_000_000)
        if burstBytes != nil && bytes == nil {
            throw entry.error("burst_bytes", "a burst of bytes_per_second, which is not set: set bytes_per_second, or remove burst_bytes")
        }
        let burstNewSources = try count("burst_new_sources", 1...100_000_000)
        if burstNewSources != nil && newSources == nil {
            throw entry.error("burst_new_sources", "a burst of new_sources_per_second, which is not set: set new_sources_per_second, or remove burst_new_sources")
        }
        guard datagrams != nil || bytes != nil || newSources != nil else {
            throw ConfigError("\(path).rate_limit", "limits nothing: give datagrams_per_second, bytes_per_second or new_sources_per_second (or leave rate_limit out)", line: node.mark.line)
        }
        var allow: [SourcePrefix] = []
        for (position, item) in try entry.sequence("allow", required: false).enumerated() {
            guard case .scalar(let scalar) = item, let prefix = SourcePrefix(scalar.string) else {
                let given = if case .scalar(let scalar) = item { "'\(scalar.string)': " } else { "" }
                throw ConfigError("\(path).rate_limit.allow[\(position)]", "\(given)expected a client prefix such as 198.18.0.0/16 or 2001:db8::/32 (an address and a length within the family's bits, no bits set past the length: 198.18.0.1/16 is 198.18.0.0/16)", line: item.mark.line)
            }
            // An IPv6 prefix reaching into ::ffff:0:0/96 would allow IPv4 clients in the kernel
            // kinds (their lookup is IPv4-mapped) and not in the others: one meaning only.
            if prefix.address.family == AF_INET6 {
                let overlap = min(prefix.length, 96)
                let mapped = [UInt8](repeating: 0, count: 10) + [0xff, 0xff, 0, 0, 0, 0]
                if SourcePrefix.masked(prefix.address.bytes, overlap) == SourcePrefix.masked(mapped, overlap) {
                    throw ConfigError("\(path).rate_limit.allow[\(position)]", "\(prefix) covers IPv4-mapped addresses (::ffff:0:0/96): give IPv4 clients as IPv4 prefixes (198.18.0.0/16) and IPv6 ones by their own prefixes", line: item.mark.line)
                }
            }
            allow.append(prefix)
        }
        guard allow.count <= RateLimit.maxAllowPrefixes else {
            throw entry.error("allow", "\(allow.count) prefixes; at most \(RateLimit.maxAllowPrefixes) (summarise them into shorter prefixes)")
        }
        return RateLimit(
            datagramsPerSecond: datagrams, burstDatagrams: burstDatagrams, bytesPerSecond: bytes, burstBytes: burstBytes,
            ipv4PrefixLength: try entry.int("ipv4_prefix", in: 8...32) ?? 32, ipv6PrefixLength: try entry.int("ipv6_prefix", in: 16...128) ?? 64,
            allow: allow, newSourcesPerSecond: newSources, burstNewSources: burstNewSources,
            maxSources: try entry.int("max_sources", in: 1024...16_777_216) ?? RateLimit.defaultMaxSources)
    }
}

extension RateLimit {
    /// `allow` prefixes per listener (the kernel kinds keep them in an LPM trie shared by every listener).
    public static let maxAllowPrefixes = 256
}

/// A two-way listener's `amplification`: until a client is validated, the bytes sent back to it
/// (its session's or association's replies) are at most `factor` times the bytes received from
/// it; replies beyond are dropped and counted `amplification_capped` (docs/abuse.md). A client is
/// validated once it completed `validated_after` exchanges (a datagram of its own after a reply
/// was sent to it); 0: never, the cap holds for the session's life. A server that starts a
/// conversation with a client who sent nothing is not capped.
public struct Amplification: Equatable, Sendable, CustomStringConvertible {
    public var factor: Int
    public var validatedAfter: Int

    public static let defaultFactor = 3

    public init(factor: Int = Self.defaultFactor, validatedAfter: Int = 0) {
        self.factor = factor
        self.validatedAfter = validatedAfter
    }

    public var description: String {
        "replies at most \(factor)x the bytes received" + (validatedAfter > 0 ? " until \(validatedAfter) exchange(s)" : "")
    }
}

extension ConfigParser {
    /// A listener's `amplification` (nil when absent).
    static func amplification(_ fields: Fields, path: String) throws(ConfigError) -> Amplification? {
        guard let node = fields["amplification"] else { return nil }
        let entry = try Fields(node, path: "\(path).amplification")
        try entry.allow(["factor", "validated_after"])
        return Amplification(factor: try entry.int("factor", in: 1...1000) ?? Amplification.defaultFactor,
                             validatedAfter: try entry.int("validated_after", in: 0...1_000_000) ?? 0)
    }
}
