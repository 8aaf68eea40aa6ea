// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB
import Synchronization

/// A listener's `rate_limit` in the userspace kinds (userspace, relay, af_xdp): one token bucket
/// per source prefix, shared by the listener's forwarding threads. Shared, not one table per
/// thread: worker steering spreads one source's flows (its ports) over the workers, so a table
/// per worker would let a source send the limit once per worker.
///
/// Each bucket is a GCRA (the generic cell rate algorithm, a token bucket kept as one "theoretical
/// arrival time" per limit): a datagram conforms when the time its cost pushes the bucket to is
/// at most the burst's worth ahead of now. The table is set-associative (sets of 8 slots, the
/// set chosen by a seeded hash of the prefix, so a sender cannot aim its addresses at one set)
/// and striped over 64 locks, each held for one lookup. A new source takes an unused slot, else
/// the slot whose buckets have been full again longest (as good as empty), else the source
/// closest to full is forgotten (counted ``evicted``). Nothing is allocated per datagram.
final class SourceRateLimiter: Sendable {
    /// The key of a source prefix: the address masked to the prefix, as 16 octets in two words
    /// (IPv4 as its IPv4-mapped IPv6 form).
    struct Key: Equatable {
        var high: UInt64
        var low: UInt64
    }

    struct Slot {
        var key = Key(high: 0, low: 0)
        var used = false
        /// The theoretical arrival times (CLOCK_MONOTONIC nanoseconds) of the datagram and the
        /// byte bucket: the bucket is full when it is at or before now.
        var datagramTAT: Int64 = 0
        var byteTAT: Int64 = 0
        /// Datagrams this source had dropped while it held the slot (for /status's top sources).
        var limited: UInt64 = 0
    }

    /// One GCRA limit: nanoseconds per unit, and how far ahead of now the bucket may run.
    struct Limit {
        let nanosecondsPerUnit: Int64
        let tolerance: Int64
        /// Bytes are charged `bytes * 1e9 / rate` (the per-unit time may be under a nanosecond).
        let bytesPerSecond: Int64

        /// Intervals and costs are rounded up (as the kernel programs' are): at high rates a
        /// datagram costs what it should, or a nanosecond more, never less.
        /// The tolerance holds exactly `burst` units at their rounded cost (a burst of 1 at 3/s
        /// is one datagram, not none).
        init(perSecond rate: UInt64, burst: UInt64, bytes: Bool) {
            let tolerance = Self.tolerance(perSecond: rate, burst: burst, bytes: bytes)
            bytesPerSecond = bytes ? Int64(rate) : 0
            nanosecondsPerUnit = bytes ? 0 : Int64(tolerance.interval)
            self.tolerance = Int64(tolerance.nanoseconds)
        }

        /// A limit's interval (ns per datagram, rounded up; 0 for bytes) and tolerance (ns): the
        /// kernel programs' configuration is computed here too (TCProgram.rateConfig).
        static func tolerance(perSecond rate: UInt64, burst: UInt64, bytes: Bool) -> (interval: UInt64, nanoseconds: UInt64) {
            let ceiling = UInt64(Int64.max / 4)
            if bytes {
                // burst bytes at `rate`, rounded up: a datagram of exactly burst_bytes fits.
                let exact = (Double(burst) * 1e9 / Double(rate)).rounded(.up)
                return (0, exact >= Double(ceiling) ? ceiling : UInt64(exact))
            }
            let interval = (1_000_000_000 + rate - 1) / rate
            let (product, overflow) = burst.multipliedReportingOverflow(by: interval)
            return (interval, overflow || product > ceiling ? ceiling : product)
        }

        @inline(__always)
        func cost(_ units: Int) -> Int64 {
            bytesPerSecond > 0 ? (Int64(units) * 1_000_000_000 + bytesPerSecond - 1) / bytesPerSecond : nanosecondsPerUnit
        }

        /// The bucket's new TAT when `cost` conforms at `now`, else nil.
        @inline(__always)
        func charge(_ tat: Int64, _ cost: Int64, now: Int64) -> Int64? {
            let next = max(tat, now) &+ cost
            return next &- now <= tolerance ? next : nil
        }
    }

    final class Stripe: Sendable {
        let slots: Mutex<[Slot]>
        init(slots: Int) { self.slots = Mutex([Slot](repeating: Slot(), count: slots)) }
    }

    static let ways = 8
    static let stripeCount = 64

    let limit: RateLimit
    private let datagrams: Limit?
    private let bytes: Limit?
    private let newSources: Limit?
    private let allow: SourceFilter
    private let ipv4Mask: UInt64
    private let ipv6Masks: (high: UInt64, low: UInt64)
    private let setMask: Int
    private let seed: UInt64
    private let stripes: [Stripe]
    /// The listener-wide TAT of `new_sources_per_second`.
    private let newSourceTAT = Atomic<Int64>(0)
    /// Sources forgotten while their buckets were not full (the table was too small for the
    /// sources at once: they start again with a full burst).
    let evicted = Atomic<UInt64>(0)

    init(_ limit: RateLimit) {
        self.limit = limit
        datagrams = limit.datagramsPerSecond.map { Limit(perSecond: $0, burst: limit.burstDatagrams, bytes: false) }
        bytes = limit.bytesPerSecond.map { Limit(perSecond: $0, burst: limit.burstBytes, bytes: true) }
        newSources = limit.newSourcesPerSecond.map { Limit(perSecond: $0, burst: limit.burstNewSources, bytes: false) }
        allow = SourceFilter(limit.allow)
        ipv4Mask = limit.ipv4PrefixLength == 0 ? 0 : UInt64(UInt32.max << (32 - limit.ipv4PrefixLength))
        let v6 = limit.ipv6PrefixLength
        ipv6Masks = (v6 >= 64 ? .max : (v6 == 0 ? 0 : UInt64.max << (64 - v6)), v6 <= 64 ? 0 : (v6 == 128 ? .max : UInt64.max << (128 - v6)))
        var sets = 1
        while sets * Self.ways < limit.maxSources { sets <<= 1 }
        sets = max(sets, Self.stripeCount)
        setMask = sets - 1
        var generator = SystemRandomNumberGenerator()
        seed = generator.next() | 1
        stripes = (0..<Self.stripeCount).map { _ in Stripe(slots: sets / Self.stripeCount * Self.ways) }
    }

    /// CLOCK_MONOTONIC in nanoseconds (the kernel programs' bpf_ktime_get_ns clock): taken once per batch.
    static func now() -> Int64 {
        var time = timespec()
        clock_gettime(CLOCK_MONOTONIC, &time)
        return Int64(time.tv_sec) * 1_000_000_000 + Int64(time.tv_nsec)
    }

    /// The bucket key of `source`, nil for an address family that is neither.
    @inline(__always)
    func key(_ source: UnsafePointer<sockaddr_storage>) -> Key? {
        let raw = UnsafeRawPointer(source)
        switch Int32(source.pointee.ss_family) {
        case AF_INET:
            let address = UInt32(bigEndian: raw.loadUnaligned(fromByteOffset: MemoryLayout<sockaddr_in>.offset(of: \.sin_addr)!, as: UInt32.self))
            return Key(high: 0, low: 0xffff_0000_0000 | (UInt64(address) & ipv4Mask))
        case AF_INET6:
            let offset = MemoryLayout<sockaddr_in6>.offset(of: \.sin6_addr)!
            let high = UInt64(bigEndian: raw.loadUnaligned(fromByteOffset: offset, as: UInt64.self))
            let low = UInt64(bigEndian: raw.loadUnaligned(fromByteOffset: offset + 8, as: UInt64.self))
            if high == 0 && low >> 32 == 0xffff { return Key(high: 0, low: 0xffff_0000_0000 | (low & 0xffff_ffff & ipv4Mask)) }
            return Key(high: high & ipv6Masks.high, low: low & ipv6Masks.low)
        default:
            return nil
        }
    }

    /// Whether a datagram of `length` bytes from `source` conforms at `now` (``now()``); charges
    /// the source's buckets when it does.
    @inline(__always)
    func admits(_ source: UnsafePointer<sockaddr_storage>, length: Int, now: Int64) -> Bool {
        guard let key = key(source) else { return true }
        if !allow.isEmpty && allow.admits(source) { return true }
        return admits(key, length: length, now: now)
    }

    func admits(_ key: Key, length: Int, now: Int64) -> Bool {
        var hash = (key.high ^ seed) &* 0x9e37_79b9_7f4a_7c15
        hash = (hash ^ key.low ^ (hash >> 29)) &* 0xbf58_476d_1ce4_e5b9
        hash ^= hash >> 32
        let set = Int(truncatingIfNeeded: hash) & setMask
        let stripe = stripes[set & (Self.stripeCount - 1)]
        let base = (set / Self.stripeCount) * Self.ways
        return stripe.slots.withLock { slots in
            slots.withUnsafeMutableBufferPointer { slots in
                // Room for a new source: an unused slot first, else the idle one (its buckets full
                // again: as good as empty) idle longest, else the one closest to full (evicted).
                var unused = -1
                var closest = base
                var closestTAT = Int64.max
                for index in base..<(base + Self.ways) {
                    let slot = slots[index]
                    if slot.used && slot.key == key { return charge(&slots[index], length: length, now: now) }
                    if !slot.used {
                        if unused < 0 { unused = index }
                        continue
                    }
                    let tat = max(slot.datagramTAT, slot.byteTAT)
                    if tat < closestTAT {
                        closestTAT = tat
                        closest = index
                    }
                }
                var free = unused
                if free < 0 && closestTAT <= now { free = closest }
                // A source not tracked: the ceiling on new sources first.
                if let newSources, !chargeNewSource(newSources, now: now) { return false }
                if free < 0 {
                    free = closest
                    evicted.wrappingAdd(1, ordering: .relaxed)
                }
                slots[free] = Slot(key: key, used: true)
                return charge(&slots[free], length: length, now: now)
            }
        }
    }

    @inline(__always)
    private func charge(_ slot: inout Slot, length: Int, now: Int64) -> Bool {
        var datagramTAT = slot.datagramTAT
        var byteTAT = slot.byteTAT
        if let datagrams {
            guard let next = datagrams.charge(datagramTAT, datagrams.nanosecondsPerUnit, now: now) else { return refuse(&slot) }
            datagramTAT = next
        }
        if let bytes {
            guard let next = bytes.charge(byteTAT, bytes.cost(length), now: now) else { return refuse(&slot) }
            byteTAT = next
        }
        slot.datagramTAT = datagramTAT
        slot.byteTAT = byteTAT
        return true
    }

    @inline(__always)
    private func refuse(_ slot: inout Slot) -> Bool {
        slot.limited &+= 1
        return false
    }

    private func chargeNewSource(_ newSources: Limit, now: Int64) -> Bool {
        var tat = newSourceTAT.load(ordering: .relaxed)
        while true {
            guard let next = newSources.charge(tat, newSources.nanosecondsPerUnit, now: now) else { return false }
            let (exchanged, original) = newSourceTAT.compareExchange(expected: tat, desired: next, ordering: .relaxed)
            if exchanged { return true }
            tat = original
        }
    }

    /// The sources with the most datagrams dropped while tracked, most first (at most `count`):
    /// /status's top limited sources.
    func topLimited(_ count: Int) -> [(prefix: String, limited: UInt64)] {
        var found: [(Key, UInt64)] = []
        for stripe in stripes {
            stripe.slots.withLock { slots in
                for slot in slots where slot.used && slot.limited > 0 { found.append((slot.key, slot.limited)) }
            }
        }
        found.sort { $0.1 > $1.1 }
        return found.prefix(count).map { (describe($0.0), $0.1) }
    }

    /// A key as its prefix (`198.18.0.7/32`, `2001:db8:1:2::/64`).
    func describe(_ key: Key) -> String {
        var octets = [UInt8](repeating: 0, count: 16)
        for index in 0..<8 {
            octets[index] = UInt8(truncatingIfNeeded: key.high >> (56 - 8 * UInt64(index)))
            octets[8 + index] = UInt8(truncatingIfNeeded: key.low >> (56 - 8 * UInt64(index)))
        }
        return Self.prefix(octets, ipv4Length: limit.ipv4PrefixLength, ipv6Length: limit.ipv6PrefixLength)
    }

    /// A bucket key's 16 octets (an IPv4 source as ::ffff:a.b.c.d, as the kernel kinds key it
    /// too) as the prefix it stands for.
    static func prefix(_ octets: [UInt8], ipv4Length: Int, ipv6Length: Int) -> String {
        let mapped = octets[0..<10].allSatisfy { $0 == 0 } && octets[10] == 0xff && octets[11] == 0xff
        let address = IPAddress(bytes: mapped ? Array(octets[12...]) : octets).map { "\($0)" } ?? "?"
        return "\(address)/\(mapped ? ipv4Length : ipv6Length)"
    }
}
