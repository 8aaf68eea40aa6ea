// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFSupport
import CLibBPF
import SystemCalls
import Synchronization

/// A NetFlow v9 or IPFIX template or options template record, byte for byte as its exporter
/// sent it (ID, field count, field specifiers; for options templates the scope too).
public struct FlowTemplate: Equatable, Sendable {
    /// The template ID (256 and up): data sets with this set ID use it.
    public var id: UInt16
    /// An options template (v9 set ID 1, IPFIX set ID 3) rather than a template.
    public var options: Bool
    /// The record as sent, from its template ID on.
    public var record: [UInt8]

    public init(id: UInt16, options: Bool, record: [UInt8]) {
        self.id = id
        self.options = options
        self.record = record
    }
}

/// The NetFlow v9 and IPFIX templates of a group's exporters, shared by its members: collectors
/// that share a port through eBPF steering keep one store, so a member that takes an exporter
/// over (a member died or withdrew, one was added) decodes its data at once instead of dropping
/// it until the exporter sends its templates again.
///
/// Every member passes each datagram it receives to ``learn(_:from:)`` (a datagram without a
/// template set costs a walk over its set headers); a member that meets a data set whose template
/// it does not know asks ``template(exporter:version:domain:id:)``. The store is a BPF hash map
/// pinned beside the group's other objects (`<bpffs>/reuseportlb/<group>/templates`), created by
/// the first member that opens it; the last member to leave the group removes it with the group.
///
/// Keys are (exporter address, version, observation domain or source ID, template ID): a template
/// and an options template share the ID space, so the latest definition of an ID wins, as for
/// the exporter. IPFIX withdrawals delete. At most ``capacity`` templates, each at most
/// ``maximumRecordSize`` bytes: a template beyond either is refused and counted.
public final class FlowTemplateStore: @unchecked Sendable {
    /// The largest template record the store holds (a v9 template of 254 fields, an IPFIX one
    /// of 127 enterprise fields).
    public static let maximumRecordSize = 1020
    /// How many templates a group's store holds.
    public static let capacity = 65_536

    static let keySize = 24
    static let valueSize = 4 + maximumRecordSize
    static let pinName = "templates"

    /// What the store did, for this process.
    public struct Counters: Equatable, Sendable {
        /// Templates and options templates written (each definition seen, also a repeat).
        public var written: UInt64 = 0
        /// Templates deleted by an IPFIX withdrawal.
        public var withdrawn: UInt64 = 0
        /// Templates not stored: larger than ``FlowTemplateStore/maximumRecordSize``.
        public var refusedTooLarge: UInt64 = 0
        /// Templates not stored: the store holds ``FlowTemplateStore/capacity`` already.
        public var refusedFull: UInt64 = 0
        /// Writes or deletes the kernel refused otherwise (see ``lastFailure``).
        public var failed: UInt64 = 0
        /// Version 9 or 10 datagrams whose sets do not add up (nothing learned from them).
        public var malformed: UInt64 = 0
        /// Lookups answered, and lookups that found nothing.
        public var found: UInt64 = 0
        public var missing: UInt64 = 0
    }

    /// The map's pin.
    public let path: String
    /// The map's descriptor, -1 once closed: every call on it holds this lock, so a close never
    /// races a call (whose descriptor number could be reused meanwhile).
    private let descriptor: Mutex<Int32>
    private let state = Mutex<(counters: Counters, lastFailure: String?)>((Counters(), nil))

    /// Opens the store of `member`'s group, creating and pinning it if no member did yet.
    /// - Throws: ``ReusePortError/templateStoreUnavailable(reason:)`` when the member does not
    ///   use eBPF steering with pins in bpffs (classic BPF, the kernel hash, a process-private
    ///   group: there is no group directory to share), or has left; a pinned map of another shape
    ///   (another version of the library), or a failed system call.
    public init(member: ReusePortMember) throws(ReusePortError) {
        guard let (directory, filesystem) = member.pinnedGroup else {
            throw .templateStoreUnavailable(reason: "this member uses \(member.steering) steering\(member.steering == .ebpf ? " in a process-private group" : ""): the store lives in the pinned eBPF group's directory; join with eBPF steering and bpffs (CAP_BPF)")
        }
        guard !member.hasLeft else { throw .templateStoreUnavailable(reason: "the member has left the group") }
        path = directory + "/" + Self.pinName
        let lock = try filesystem.lock()
        defer { Glibc.close(lock) }
        // The group may have been removed since the join (every member left): not recreated here.
        guard BPFFilesystem.exists(directory + "/members") else {
            throw .templateStoreUnavailable(reason: "the group's pins at \(directory) are gone (every member left)")
        }
        let pinned = bpf_obj_get(path)
        if pinned >= 0 {
            if let problem = Self.misfit(pinned) {
                Glibc.close(pinned)
                throw .templateStoreUnavailable(reason: "\(path) is \(problem): a member of another version created it; stop every member of the group to recreate it")
            }
            descriptor = Mutex(pinned)
            return
        }
        guard errno == ENOENT else {
            throw BPFFilesystem.failure(SystemCallError(call: "bpf_obj_get \(path)", errno: errno), path: directory)
        }
        let created = withLibbpfOptions(bpf_map_create_opts.self) { options in
            // Memory as templates arrive, not the whole capacity at the start.
            options.pointee.map_flags = UInt32(BPF_F_NO_PREALLOC)
            return bpf_map_create(BPF_MAP_TYPE_HASH, "rplb_templates", UInt32(Self.keySize), UInt32(Self.valueSize), UInt32(Self.capacity), options)
        }
        guard created >= 0 else {
            let error = SystemCallError(call: "bpf_map_create rplb_templates", errno: -created)
            if error.errno == EPERM || error.errno == EACCES { throw .ebpfUnavailable(reason: error.description) }
            throw .system(error)
        }
        guard bpf_obj_pin(created, path) == 0 else {
            let error = SystemCallError(call: "bpf_obj_pin \(path)", errno: errno)
            Glibc.close(created)
            throw BPFFilesystem.failure(error, path: directory)
        }
        descriptor = Mutex(created)
    }

    deinit { close() }


    /// Closes this process's descriptor (the pinned store stays with the group). Idempotent;
    /// afterwards ``learn(_:from:)`` learns nothing and lookups find nothing.
    public func close() {
        descriptor.withLock { fd in
            if fd >= 0 { _ = Glibc.close(fd) }
            fd = -1
        }
    }

    /// Runs `body` with the open descriptor; nil once closed.
    private func withDescriptor<R>(_ body: (Int32) -> R) -> R? {
        descriptor.withLock { fd in fd >= 0 ? body(fd) : nil }
    }

    /// What a pinned map differs in from the store's shape; nil when it fits.
    static func misfit(_ fd: Int32) -> String? {
        var info = bpf_map_info()
        var length = UInt32(MemoryLayout<bpf_map_info>.size)
        guard bpf_obj_get_info_by_fd(fd, &info, &length) == 0 else { return "unreadable (\(String(cString: strerror(errno))))" }
        if info.type != BPF_MAP_TYPE_HASH.rawValue { return "a map of type \(info.type), not a hash" }
        if info.key_size != keySize || info.value_size != valueSize {
            return "a map of key size \(info.key_size) and value size \(info.value_size), not \(keySize) and \(valueSize)"
        }
        return nil
    }

    /// This process's counters.
    public var counters: Counters { state.withLock { $0.counters } }

    /// The last write or delete the kernel refused (other than a full store), with its errno.
    public var lastFailure: String? { state.withLock { $0.lastFailure } }

    /// Stores the templates and options templates `datagram` defines and deletes those it
    /// withdraws (IPFIX). Datagrams that are not NetFlow v9 or IPFIX, or carry data alone, change
    /// nothing.
    /// - Parameters:
    ///   - datagram: the UDP payload as received.
    ///   - exporter: the datagram's source address.
    /// - Returns: how many templates were written or deleted.
    @discardableResult
    public func learn(_ datagram: UnsafeRawBufferPointer, from exporter: IPAddress) -> Int {
        guard FlowExport.needsParsing(datagram) else { return 0 }
        let packet: FlowExport.Packet
        switch FlowExport.parse(datagram) {
        case .notFlowExport: return 0
        case .malformed:
            state.withLock { $0.counters.malformed += 1 }
            return 0
        case .packet(let parsed): packet = parsed
        }
        return learn(packet, from: exporter)
    }

    /// ``learn(_:from:)`` for a datagram the caller parsed already (``FlowDecoder``).
    @discardableResult
    package func learn(_ packet: FlowExport.Packet, from exporter: IPAddress) -> Int {
        var changed = 0
        for change in packet.changes {
            switch change {
            case .defined(let template):
                changed += write(FlowTemplate(id: template.id, options: template.options, record: template.record),
                                 exporter: exporter, version: packet.version, domain: packet.domain) ? 1 : 0
            case .withdrawn(let id, let options):
                let key = Self.key(exporter, packet.version.rawValue, packet.domain, id)
                if let stored = lookup(key), stored.options == options {
                    changed += delete(key) ? 1 : 0
                }
            case .withdrawnAll(let options):
                for key in keys(of: exporter, version: packet.version.rawValue, domain: packet.domain) {
                    if let stored = lookup(key), stored.options == options {
                        changed += delete(key) ? 1 : 0
                    }
                }
            }
        }
        return changed
    }

    /// The template `id` of the exporter (address, version 9 or 10, observation domain or source
    /// ID) as last defined by any member's exporter packet; nil when none is stored.
    public func template(exporter: IPAddress, version: UInt16, domain: UInt32, id: UInt16) -> FlowTemplate? {
        let found = lookup(Self.key(exporter, version, domain, id))
        state.withLock { found == nil ? ($0.counters.missing += 1) : ($0.counters.found += 1) }
        return found
    }

    /// Every template stored for the exporter, by ID.
    public func templates(exporter: IPAddress, version: UInt16, domain: UInt32) -> [FlowTemplate] {
        keys(of: exporter, version: version, domain: domain).compactMap(lookup).sorted { $0.id < $1.id }
    }

    /// Writes one template; false (counted) when refused.
    func write(_ template: FlowTemplate, exporter: IPAddress, version: FlowExport.Version, domain: UInt32) -> Bool {
        guard template.record.count <= Self.maximumRecordSize else {
            state.withLock { $0.counters.refusedTooLarge += 1 }
            return false
        }
        var key = Self.key(exporter, version.rawValue, domain, template.id)
        var value = [UInt8](repeating: 0, count: Self.valueSize)
        value[0] = UInt8(template.record.count >> 8)
        value[1] = UInt8(template.record.count & 0xff)
        value[2] = template.options ? 1 : 0
        value.replaceSubrange(4..<(4 + template.record.count), with: template.record)
        guard let result = withDescriptor({ bpf_map_update_elem($0, &key, &value, UInt64(BPF_ANY)) }) else { return false }
        let error = result == 0 ? 0 : (result == -1 ? errno : -result)
        state.withLock { state in
            switch error {
            case 0: state.counters.written += 1
            case E2BIG, ENOSPC, ENOMEM: state.counters.refusedFull += 1
            default:
                state.counters.failed += 1
                state.lastFailure = SystemCallError(call: "bpf_map_update_elem \(path)", errno: error).description
            }
        }
        return error == 0
    }

    private func delete(_ key: [UInt8]) -> Bool {
        var key = key
        guard let result = withDescriptor({ bpf_map_delete_elem($0, &key) }) else { return false }
        let error = result == 0 ? 0 : (result == -1 ? errno : -result)
        state.withLock { state in
            switch error {
            case 0: state.counters.withdrawn += 1
            case ENOENT: break  // another member withdrew it first
            default:
                state.counters.failed += 1
                state.lastFailure = SystemCallError(call: "bpf_map_delete_elem \(path)", errno: error).description
            }
        }
        return error == 0
    }

    private func lookup(_ key: [UInt8]) -> FlowTemplate? {
        var key = key
        var value = [UInt8](repeating: 0, count: Self.valueSize)
        guard withDescriptor({ bpf_map_lookup_elem($0, &key, &value) }) == 0 else { return nil }
        let length = Int(value[0]) << 8 | Int(value[1])
        guard length >= 4, length <= Self.maximumRecordSize else { return nil }
        let id = UInt16(key[18]) << 8 | UInt16(key[19])
        return FlowTemplate(id: id, options: value[2] != 0, record: Array(value[4..<(4 + length)]))
    }

    /// The stored keys of one exporter (a walk over the whole map: for withdrawals and listing).
    private func keys(of exporter: IPAddress, version: UInt16, domain: UInt32) -> [[UInt8]] {
        let prefix = Array(Self.key(exporter, version, domain, 0)[0..<18]) + Array(Self.key(exporter, version, domain, 0)[20..<24])
        var found: [[UInt8]] = []
        var seen = Set<[UInt8]>()
        var previous: [UInt8]? = nil
        var next = [UInt8](repeating: 0, count: Self.keySize)
        // Bounded: a walk restarts from the first key when its previous one was deleted meanwhile
        // (a key met twice is listed once).
        for _ in 0...Self.capacity {
            let result: Int32? = withDescriptor { fd in
                if var previous { bpf_map_get_next_key(fd, &previous, &next) } else { bpf_map_get_next_key(fd, nil, &next) }
            }
            guard result == 0 else { break }
            if Array(next[0..<18]) + Array(next[20..<24]) == prefix, seen.insert(next).inserted { found.append(next) }
            previous = next
        }
        return found
    }

    /// The map key: the address as 16 bytes (IPv4 as ::ffff:a.b.c.d), then version, template ID
    /// and domain, in network byte order.
    static func key(_ exporter: IPAddress, _ version: UInt16, _ domain: UInt32, _ id: UInt16) -> [UInt8] {
        var key = exporter.bytes.count == 4 ? [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff] + exporter.bytes : exporter.bytes
        key += [UInt8(version >> 8), UInt8(version & 0xff), UInt8(id >> 8), UInt8(id & 0xff)]
        key += [UInt8(domain >> 24), UInt8((domain >> 16) & 0xff), UInt8((domain >> 8) & 0xff), UInt8(domain & 0xff)]
        return key
    }
}
