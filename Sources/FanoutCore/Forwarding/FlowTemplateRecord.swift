// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB

/// The record a restart hands the next process for one `flow_templates` listener
/// (``TemplateHandOver``): each exporter's templates as the packets a replay sends, its source
/// port where the kernel kinds learnt it, and the set the kernel kinds' program reads.
///
/// Layout (integers big endian): ``magic``; the set in force (a byte: 0 none, 1 one follows, as
/// ``KernelTemplateFollower/Plan``'s ``encode(_:)`` writes it); then per exporter its address
/// (a family byte, 4 or 6, and 16 bytes), port and packet count (16 bits each), then each
/// packet's length (16 bits) and bytes.
extension FlowTemplateState {
    static let recordMagic: [UInt8] = Array("UFTPL1\n\u{0}".utf8)

    /// The record of what this state holds now. The cache is copied under its lock and encoded
    /// outside it: forwarding threads are not held up by the encoding.
    func record() -> [UInt8] {
        let (ports, plan) = kernelFollowing.withLock { ($0.ports, $0.plan) }
        let snapshot = cache.withLock { $0 }
        var out = RecordWriter(Self.recordMagic)
        if let plan {
            out.u8(1)
            plan.encode(&out)
        } else {
            out.u8(0)
        }
        for exporter in snapshot.allExporters {
            let packets = snapshot.replay(exporter)
            guard !packets.isEmpty else { continue }
            out.address(exporter.address)
            out.u16(ports[exporter.address] ?? 0)
            out.u16(UInt16(packets.count))
            for packet in packets {
                out.u16(UInt16(packet.count))
                out.bytes += packet
            }
        }
        return out.bytes
    }

    /// Takes in what a previous process's ``record()`` wrote: its templates count as known,
    /// not as defined here; the exporters' ports join the kernel kinds' map, and, with
    /// `setInForce` (a tc_ebpf or xdp listener, whose program kept reading it), its set in force
    /// becomes the one the next change is compared with (when this state has none yet).
    /// Returns the exporters and templates kept now, or nil when `bytes` is not a whole record
    /// (nothing is taken then).
    func restore(_ bytes: [UInt8], setInForce: Bool = true) -> (exporters: Int, templates: Int)? {
        var input = RecordReader(bytes)
        guard input.take(Self.recordMagic), let hasPlan = input.u8(), hasPlan <= 1 else { return nil }
        var plan: KernelTemplateFollower.Plan?
        if hasPlan == 1 {
            guard let decoded = KernelTemplateFollower.Plan.decode(&input) else { return nil }
            plan = decoded
        }
        var records: [(IPAddress, UInt16, [FlowExport.Packet])] = []
        while !input.atEnd {
            guard let address = input.address(), let port = input.u16(), let count = input.u16() else { return nil }
            var packets: [FlowExport.Packet] = []
            for _ in 0..<count {
                guard let size = input.u16(), let body = input.bytes(Int(size)) else { return nil }
                guard case .packet(let packet) = body.withUnsafeBytes({ FlowExport.parse($0) }) else { return nil }
                packets.append(packet)
            }
            records.append((address, port, packets))
        }
        let taken = cache.withLock { cache in
            for (address, _, packets) in records {
                for packet in packets { cache.restore(packet, from: address) }
            }
            return (cache.exporterCount, cache.templateCount)
        }
        kernelFollowing.withLock { following in
            for (address, port, _) in records where port != 0 && following.ports[address] == nil { following.ports[address] = port }
            if setInForce && following.plan == nil { following.plan = plan }
        }
        generation.wrappingAdd(1, ordering: .releasing)
        handOverVersion.wrappingAdd(1, ordering: .releasing)
        return taken
    }
}

extension KernelTemplateFollower.Plan {
    /// Writes the set: its downstreams, policy, seed and table, and each pool's set, sample and
    /// sources.
    func encode(_ out: inout RecordWriter) {
        encodeSet(&out)
        out.u16(UInt16(pools.count))
        for pool in pools {
            pool.set.encodeSet(&out)
            out.u32(pool.sample)
            out.u16(UInt16(pool.prefixes.count))
            for prefix in pool.prefixes {
                out.address(prefix.address)
                out.u8(UInt8(prefix.length))
            }
        }
    }

    private func encodeSet(_ out: inout RecordWriter) {
        out.u16(UInt16(downstreams.count))
        for downstream in downstreams {
            out.address(downstream.ip)
            out.u16(downstream.port)
        }
        out.u8(sourceIP ? 1 : 0)
        out.u32(seed)
        out.u32(UInt32(table.count))
        for slot in table { out.u16(slot) }
    }

    static func decode(_ input: inout RecordReader) -> Self? {
        guard var plan = decodeSet(&input), let count = input.u16() else { return nil }
        for _ in 0..<count {
            guard let set = decodeSet(&input), let sample = input.u32(), let prefixCount = input.u16() else { return nil }
            var prefixes: [SourcePrefix] = []
            for _ in 0..<prefixCount {
                guard let address = input.address(), let length = input.u8(),
                      let prefix = SourcePrefix("\(address)/\(length)") else { return nil }
                prefixes.append(prefix)
            }
            plan.pools.append(Pool(set: set, sample: sample, prefixes: prefixes))
        }
        return plan
    }

    private static func decodeSet(_ input: inout RecordReader) -> Self? {
        guard let count = input.u16() else { return nil }
        var plan = Self()
        for _ in 0..<count {
            guard let address = input.address(), let port = input.u16() else { return nil }
            plan.downstreams.append(SocketAddress(ip: address, port: port))
        }
        guard let sourceIP = input.u8(), let seed = input.u32(), let slots = input.u32(), Int(slots) <= input.remaining / 2 else { return nil }
        plan.sourceIP = sourceIP == 1
        plan.seed = seed
        plan.table = (0..<Int(slots)).compactMap { _ in input.u16() }
        return plan
    }
}

/// Appends big-endian integers and addresses to a byte array.
struct RecordWriter {
    var bytes: [UInt8]

    init(_ start: [UInt8] = []) { bytes = start }

    mutating func u8(_ value: UInt8) { bytes.append(value) }
    mutating func u16(_ value: UInt16) { bytes += [UInt8(value >> 8), UInt8(value & 0xff)] }
    mutating func u32(_ value: UInt32) {
        u16(UInt16(value >> 16))
        u16(UInt16(value & 0xffff))
    }

    /// A family byte (4 or 6) and 16 bytes (an IPv4 address zero-padded).
    mutating func address(_ address: IPAddress) {
        let raw = address.bytes
        bytes.append(address.family == AF_INET ? 4 : 6)
        bytes += raw + [UInt8](repeating: 0, count: 16 - raw.count)
    }
}

/// Reads what ``RecordWriter`` wrote; every read is nil past the end.
struct RecordReader {
    private let bytes: [UInt8]
    private var offset = 0

    init(_ bytes: [UInt8]) { self.bytes = bytes }

    var atEnd: Bool { offset >= bytes.count }
    var remaining: Int { bytes.count - offset }

    mutating func take(_ prefix: [UInt8]) -> Bool {
        guard bytes.count - offset >= prefix.count, Array(bytes[offset..<(offset + prefix.count)]) == prefix else { return false }
        offset += prefix.count
        return true
    }

    mutating func bytes(_ count: Int) -> ArraySlice<UInt8>? {
        guard count >= 0, bytes.count - offset >= count else { return nil }
        defer { offset += count }
        return bytes[offset..<(offset + count)]
    }

    mutating func u8() -> UInt8? { bytes(1)?.first }
    mutating func u16() -> UInt16? { bytes(2).map { UInt16($0[$0.startIndex]) << 8 | UInt16($0[$0.startIndex + 1]) } }
    mutating func u32() -> UInt32? {
        guard let high = u16(), let low = u16() else { return nil }
        return UInt32(high) << 16 | UInt32(low)
    }

    mutating func address() -> IPAddress? {
        guard let family = u8(), family == 4 || family == 6, let raw = bytes(16) else { return nil }
        return IPAddress(bytes: family == 4 ? raw.prefix(4) : raw)
    }
}
