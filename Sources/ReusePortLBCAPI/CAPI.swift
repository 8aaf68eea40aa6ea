// SPDX-License-Identifier: Apache-2.0
// The C API of include/reuseportlb.h, exported from libreuseportlb.so.
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB

private func member(_ handle: OpaquePointer) -> ReusePortMember {
    Unmanaged<ReusePortMember>.fromOpaque(UnsafeRawPointer(handle)).takeUnretainedValue()
}

/// Every accessor takes a nullable handle: NULL returns -EINVAL instead of crashing the caller.
private func withMember<R>(_ handle: OpaquePointer?, orElse fallback: R, _ body: (ReusePortMember) -> R) -> R {
    guard let handle else { return fallback }
    return body(member(handle))
}

private func writeMessage(_ text: String, _ buffer: UnsafeMutablePointer<CChar>?, _ size: Int) {
    guard let buffer, size > 0 else { return }
    let bytes = Array(text.utf8.prefix(size - 1))
    for (index, byte) in bytes.enumerated() { buffer[index] = CChar(bitPattern: byte) }
    buffer[bytes.count] = 0
}

/// The negative errno-style code of an error (EINVAL for bad input).
private func code(of error: ReusePortError) -> Int32 {
    switch error {
    case .system(let failure): return -failure.errno
    case .slotInUse, .addressInUse, .addressServedByAnotherProcess, .steeringConflict, .bpffsNotShared: return -EADDRINUSE
    case .groupFull: return -ENOSPC
    case .bpffsUnavailable, .ebpfUnavailable: return -EPERM
    case .countersUnavailable, .policyNeedsEBPF, .takeoverNeedsEBPF, .templateStoreUnavailable: return -EOPNOTSUPP
    case .connectionIDRouting(_, let errno): return -errno
    case .groupSettingsMismatch: return -EEXIST
    case .invalidCapacity, .slotOutOfRange, .noLiveMember, .invalidAddress, .handedOverMismatch: return -EINVAL
    }
}

private func join(
    _ ip: UnsafePointer<CChar>?, _ port: UInt16, _ slot: SlotRequest?, _ capacity: UInt32, _ policy: Int32,
    _ out: UnsafeMutablePointer<OpaquePointer?>?, _ errorBuffer: UnsafeMutablePointer<CChar>?, _ errorSize: Int,
    quic: QUICLBConfiguration? = nil, serverID: [UInt8]? = nil
) -> Int32 {
    guard let ip, let out else {
        writeMessage("ip and member must not be NULL", errorBuffer, errorSize)
        return -EINVAL
    }
    let text = String(cString: ip)
    guard let address = IPAddress(text) else {
        writeMessage(IPAddress.problem(parsing: text) ?? "", errorBuffer, errorSize)
        return -EINVAL
    }
    let policies: [Int32: BalancePolicy] = [0: .sourceIP, 1: .roundRobin, 2: .fiveTuple]
    guard let balance = policies[policy] else {
        writeMessage("unknown policy \(policy): use REUSEPORTLB_SOURCE_IP, REUSEPORTLB_ROUND_ROBIN or REUSEPORTLB_FIVE_TUPLE", errorBuffer, errorSize)
        return -EINVAL
    }
    guard let slot else {
        writeMessage("slot must be 0 or more (or REUSEPORTLB_ANY_SLOT to join)", errorBuffer, errorSize)
        return -EINVAL
    }
    do throws(ReusePortError) {
        let joined = try ReusePortMember(
            joining: SocketAddress(ip: address, port: port), slot: slot,
            options: GroupOptions(policy: balance, capacity: Int(capacity), quic: quic))
        if let serverID {
            do throws(ReusePortError) {
                try joined.registerServerID(serverID)
            } catch {
                joined.leave()
                throw error
            }
        }
        out.pointee = OpaquePointer(Unmanaged.passRetained(joined).toOpaque())
        return 0
    } catch {
        writeMessage(error.description, errorBuffer, errorSize)
        return code(of: error)
    }
}

@_cdecl("reuseportlb_join")
public func reuseportlb_join(
    _ ip: UnsafePointer<CChar>?, _ port: UInt16, _ slot: Int32, _ capacity: UInt32, _ policy: Int32,
    _ out: UnsafeMutablePointer<OpaquePointer?>?, _ error: UnsafeMutablePointer<CChar>?, _ errorSize: Int
) -> Int32 {
    let request: SlotRequest? = slot == -1 ? .lowestFree : slot >= 0 ? .index(Int(slot)) : nil
    return join(ip, port, request, capacity, policy, out, error, errorSize)
}

@_cdecl("reuseportlb_takeover")
public func reuseportlb_takeover(
    _ ip: UnsafePointer<CChar>?, _ port: UInt16, _ slot: Int32, _ capacity: UInt32, _ policy: Int32,
    _ out: UnsafeMutablePointer<OpaquePointer?>?, _ error: UnsafeMutablePointer<CChar>?, _ errorSize: Int
) -> Int32 {
    join(ip, port, slot >= 0 ? .takeover(Int(slot)) : nil, capacity, policy, out, error, errorSize)
}

/// Reads `struct reuseportlb_quic_lb` (three octets, then the key pointer at offset 8 on LP64).
private func quicConfiguration(_ raw: UnsafeRawPointer?) -> Result<QUICLBConfiguration, QUICLBError> {
    guard let raw else { return .failure(.invalid("quic must not be NULL")) }
    let configID = raw.load(fromByteOffset: 0, as: UInt8.self)
    let serverIDLength = Int(raw.load(fromByteOffset: 1, as: UInt8.self))
    let nonceLength = Int(raw.load(fromByteOffset: 2, as: UInt8.self))
    let keyPointer = raw.load(fromByteOffset: MemoryLayout<UnsafeRawPointer?>.stride, as: UnsafePointer<UInt8>?.self)
    let key = keyPointer.map { Array(UnsafeBufferPointer(start: $0, count: 16)) }
    do throws(QUICLBError) {
        return .success(try QUICLBConfiguration(configID: configID, serverIDLength: serverIDLength, nonceLength: nonceLength, key: key))
    } catch {
        return .failure(error)
    }
}

/// A QUIC-LB join or takeover: the configuration read, then `join`.
private func joinQUIC(
    _ ip: UnsafePointer<CChar>?, _ port: UInt16, _ request: SlotRequest?, _ capacity: UInt32, _ policy: Int32,
    _ quic: UnsafeRawPointer?, _ serverID: UnsafePointer<UInt8>?,
    _ out: UnsafeMutablePointer<OpaquePointer?>?, _ error: UnsafeMutablePointer<CChar>?, _ errorSize: Int
) -> Int32 {
    let configuration: QUICLBConfiguration
    switch quicConfiguration(quic) {
    case .success(let value): configuration = value
    case .failure(let problem):
        writeMessage(problem.description, error, errorSize)
        return -EINVAL
    }
    let id = serverID.map { Array(UnsafeBufferPointer(start: $0, count: configuration.serverIDLength)) }
    return join(ip, port, request, capacity, policy, out, error, errorSize, quic: configuration, serverID: id)
}

@_cdecl("reuseportlb_join_quic")
public func reuseportlb_join_quic(
    _ ip: UnsafePointer<CChar>?, _ port: UInt16, _ slot: Int32, _ capacity: UInt32, _ policy: Int32,
    _ quic: UnsafeRawPointer?, _ serverID: UnsafePointer<UInt8>?,
    _ out: UnsafeMutablePointer<OpaquePointer?>?, _ error: UnsafeMutablePointer<CChar>?, _ errorSize: Int
) -> Int32 {
    let request: SlotRequest? = slot == -1 ? .lowestFree : slot >= 0 ? .index(Int(slot)) : nil
    return joinQUIC(ip, port, request, capacity, policy, quic, serverID, out, error, errorSize)
}

@_cdecl("reuseportlb_takeover_quic")
public func reuseportlb_takeover_quic(
    _ ip: UnsafePointer<CChar>?, _ port: UInt16, _ slot: Int32, _ capacity: UInt32, _ policy: Int32,
    _ quic: UnsafeRawPointer?, _ serverID: UnsafePointer<UInt8>?,
    _ out: UnsafeMutablePointer<OpaquePointer?>?, _ error: UnsafeMutablePointer<CChar>?, _ errorSize: Int
) -> Int32 {
    joinQUIC(ip, port, slot >= 0 ? .takeover(Int(slot)) : nil, capacity, policy, quic, serverID, out, error, errorSize)
}

@_cdecl("reuseportlb_quic_withdraw")
public func reuseportlb_quic_withdraw(_ handle: OpaquePointer?, _ serverID: UnsafePointer<UInt8>?, _ length: Int) -> Int32 {
    guard let handle, let serverID, length > 0 else { return -EINVAL }
    do {
        return try member(handle).withdrawServerID(Array(UnsafeBufferPointer(start: serverID, count: length))) ? 0 : -ENOENT
    } catch {
        return code(of: error)
    }
}

@_cdecl("reuseportlb_quic_register")
public func reuseportlb_quic_register(
    _ handle: OpaquePointer?, _ serverID: UnsafePointer<UInt8>?, _ length: Int,
    _ errorBuffer: UnsafeMutablePointer<CChar>?, _ errorSize: Int
) -> Int32 {
    guard let handle, let serverID, length > 0 else {
        writeMessage("member and server_id must not be NULL, and length at least 1", errorBuffer, errorSize)
        return -EINVAL
    }
    do {
        try member(handle).registerServerID(Array(UnsafeBufferPointer(start: serverID, count: length)))
        return 0
    } catch {
        writeMessage(error.description, errorBuffer, errorSize)
        return code(of: error)
    }
}

@_cdecl("reuseportlb_quic_encode")
public func reuseportlb_quic_encode(
    _ quic: UnsafeRawPointer?, _ serverID: UnsafePointer<UInt8>?, _ nonce: UnsafePointer<UInt8>?,
    _ connectionID: UnsafeMutablePointer<UInt8>?, _ size: Int, _ errorBuffer: UnsafeMutablePointer<CChar>?, _ errorSize: Int
) -> Int32 {
    let configuration: QUICLBConfiguration
    switch quicConfiguration(quic) {
    case .success(let value): configuration = value
    case .failure(let problem):
        writeMessage(problem.description, errorBuffer, errorSize)
        return -EINVAL
    }
    guard let serverID, let nonce, let connectionID else {
        writeMessage("server_id, nonce and connection_id must not be NULL", errorBuffer, errorSize)
        return -EINVAL
    }
    guard size >= configuration.connectionIDLength else {
        writeMessage("connection_id holds \(size) octets; this configuration's IDs are \(configuration.connectionIDLength)", errorBuffer, errorSize)
        return -ENOSPC
    }
    do throws(QUICLBError) {
        let id = try QUICLBCodec(configuration).encode(
            serverID: Array(UnsafeBufferPointer(start: serverID, count: configuration.serverIDLength)),
            nonce: Array(UnsafeBufferPointer(start: nonce, count: configuration.nonceLength)))
        for (index, byte) in id.enumerated() { connectionID[index] = byte }
        return Int32(id.count)
    } catch {
        writeMessage(error.description, errorBuffer, errorSize)
        return -EINVAL
    }
}

@_cdecl("reuseportlb_quic_decode")
public func reuseportlb_quic_decode(
    _ quic: UnsafeRawPointer?, _ connectionID: UnsafePointer<UInt8>?, _ length: Int,
    _ serverID: UnsafeMutablePointer<UInt8>?, _ size: Int
) -> Int32 {
    guard case .success(let configuration) = quicConfiguration(quic), let connectionID, let serverID, length >= 0 else { return -EINVAL }
    guard size >= configuration.serverIDLength else { return -ENOSPC }
    guard let decoded = QUICLBCodec(configuration).decode(Array(UnsafeBufferPointer(start: connectionID, count: length))) else { return -ENOENT }
    for (index, byte) in decoded.serverID.enumerated() { serverID[index] = byte }
    return Int32(decoded.serverID.count)
}

/// Mirrors `struct reuseportlb_quic_counters`.
public struct CQUICCounters {
    var routed, fallback, unknownServerID, undecodable: UInt64
}

@_cdecl("reuseportlb_quic_counters")
public func reuseportlb_quic_counters(_ handle: OpaquePointer?, _ out: UnsafeMutableRawPointer?) -> Int32 {
    guard let handle, let out else { return -EINVAL }
    do {
        let counters = try member(handle).counters()
        out.storeBytes(
            of: CQUICCounters(routed: counters.quicRouted, fallback: counters.quicFallback,
                              unknownServerID: counters.quicUnknownServerID, undecodable: counters.quicUndecodable),
            as: CQUICCounters.self)
        return 0
    } catch {
        return code(of: error)
    }
}

@_cdecl("reuseportlb_socket")
public func reuseportlb_socket(_ handle: OpaquePointer?) -> Int32 { withMember(handle, orElse: -EINVAL) { $0.socket } }

@_cdecl("reuseportlb_slot")
public func reuseportlb_slot(_ handle: OpaquePointer?) -> Int32 { withMember(handle, orElse: -EINVAL) { Int32($0.slot) } }

private let steeringNames: [Steering: StaticString] = [.ebpf: "ebpf", .classicBPF: "classicBPF", .kernelHash: "kernelHash"]

@_cdecl("reuseportlb_steering")
public func reuseportlb_steering(_ handle: OpaquePointer?) -> UnsafePointer<CChar>? {
    withMember(handle, orElse: nil) { member in
        // The steering really in force: a member forced in without eBPF may have replaced it.
        UnsafeRawPointer(steeringNames[member.steeringInForce]!.utf8Start).assumingMemoryBound(to: CChar.self)
    }
}

@_cdecl("reuseportlb_is_replaced")
public func reuseportlb_is_replaced(_ handle: OpaquePointer?) -> Int32 {
    withMember(handle, orElse: -EINVAL) { $0.isReplaced ? 1 : 0 }
}

@_cdecl("reuseportlb_queued_bytes")
public func reuseportlb_queued_bytes(_ handle: OpaquePointer?) -> Int64 {
    withMember(handle, orElse: Int64(-EINVAL)) { member in
        do throws(ReusePortError) {
            return Int64(try member.socketStatistics().queuedBytes)
        } catch {
            return Int64(code(of: error))
        }
    }
}

/// Mirrors `struct reuseportlb_counters`.
public struct CCounters {
    var selected, failedOver, fallback, unparsed, noConfig: UInt64
}

@_cdecl("reuseportlb_counters")
public func reuseportlb_counters(_ handle: OpaquePointer?, _ out: UnsafeMutableRawPointer?) -> Int32 {
    guard let handle, let out else { return -EINVAL }
    do {
        let counters = try member(handle).counters()
        out.storeBytes(
            of: CCounters(
                selected: counters.selected, failedOver: counters.failedOver, fallback: counters.fallback,
                unparsed: counters.unparsed, noConfig: counters.noConfig),
            as: CCounters.self)
        return 0
    } catch {
        return code(of: error)
    }
}

@_cdecl("reuseportlb_owner")
public func reuseportlb_owner(
    _ handle: OpaquePointer?, _ source: UnsafePointer<CChar>?, _ port: UInt16, _ slot: UnsafeMutablePointer<Int32>?
) -> Int32 {
    guard let handle, let source, let slot, let address = IPAddress(String(cString: source)) else { return -EINVAL }
    do {
        // The port matters for fiveTuple only (owner(of:port:) ignores it otherwise).
        guard let owner = try member(handle).owner(of: address, port: port) else { return -ENOENT }
        slot.pointee = Int32(owner)
        return 0
    } catch {
        return code(of: error)
    }
}

@_cdecl("reuseportlb_withdraw")
public func reuseportlb_withdraw(_ handle: OpaquePointer?) -> Int32 {
    guard let handle else { return -EINVAL }
    do {
        return try member(handle).withdraw() ? 0 : -EOPNOTSUPP
    } catch {
        return code(of: error)
    }
}

@_cdecl("reuseportlb_seal")
public func reuseportlb_seal(_ handle: OpaquePointer?) -> Int32 {
    guard let handle else { return -EINVAL }
    do {
        try member(handle).seal()
        return 0
    } catch {
        return code(of: error)
    }
}

@_cdecl("reuseportlb_leave")
public func reuseportlb_leave(_ handle: OpaquePointer?) {
    guard let handle else { return }
    let unmanaged = Unmanaged<ReusePortMember>.fromOpaque(UnsafeRawPointer(handle))
    unmanaged.takeUnretainedValue().leave()
    unmanaged.release()
}

// MARK: The group's flow template store

private func store(_ handle: OpaquePointer) -> FlowTemplateStore {
    Unmanaged<FlowTemplateStore>.fromOpaque(UnsafeRawPointer(handle)).takeUnretainedValue()
}

/// The exporter's address in a sockaddr_in or sockaddr_in6; nil for another family.
private func exporterAddress(_ address: UnsafeRawPointer?) -> IPAddress? {
    guard let address else { return nil }
    let family = Int32(address.loadUnaligned(fromByteOffset: MemoryLayout<sockaddr>.offset(of: \.sa_family)!, as: sa_family_t.self))
    guard family == AF_INET || family == AF_INET6 else { return nil }
    return SocketAddress(storage: address)?.ip
}

@_cdecl("reuseportlb_templates_open")
public func reuseportlb_templates_open(
    _ handle: OpaquePointer?, _ out: UnsafeMutablePointer<OpaquePointer?>?, _ errorBuffer: UnsafeMutablePointer<CChar>?, _ errorSize: Int
) -> Int32 {
    guard let handle, let out else {
        writeMessage("member and store must not be NULL", errorBuffer, errorSize)
        return -EINVAL
    }
    do {
        let opened = try FlowTemplateStore(member: member(handle))
        out.pointee = OpaquePointer(Unmanaged.passRetained(opened).toOpaque())
        return 0
    } catch {
        writeMessage(error.description, errorBuffer, errorSize)
        return code(of: error)
    }
}

@_cdecl("reuseportlb_templates_learn")
public func reuseportlb_templates_learn(
    _ handle: OpaquePointer?, _ datagram: UnsafeRawPointer?, _ length: Int, _ exporter: UnsafeRawPointer?
) -> Int32 {
    guard let handle, datagram != nil || length == 0, length >= 0, let address = exporterAddress(exporter) else { return -EINVAL }
    return Int32(store(handle).learn(UnsafeRawBufferPointer(start: datagram, count: length), from: address))
}

@_cdecl("reuseportlb_templates_lookup")
public func reuseportlb_templates_lookup(
    _ handle: OpaquePointer?, _ exporter: UnsafeRawPointer?, _ version: UInt16, _ domain: UInt32, _ id: UInt16,
    _ record: UnsafeMutableRawPointer?, _ recordSize: Int, _ options: UnsafeMutablePointer<Int32>?
) -> Int32 {
    guard let handle, let address = exporterAddress(exporter), version == 9 || version == 10, let record, recordSize >= 0 else { return -EINVAL }
    guard let template = store(handle).template(exporter: address, version: version, domain: domain, id: id) else { return -ENOENT }
    guard recordSize >= template.record.count else { return -ENOSPC }
    template.record.withUnsafeBytes { record.copyMemory(from: $0.baseAddress!, byteCount: $0.count) }
    options?.pointee = template.options ? 1 : 0
    return Int32(template.record.count)
}

/// Mirrors `struct reuseportlb_template_counters`.
public struct CTemplateCounters {
    var written, withdrawn, refusedTooLarge, refusedFull, failed, malformed, found, missing: UInt64
}

@_cdecl("reuseportlb_templates_counters")
public func reuseportlb_templates_counters(_ handle: OpaquePointer?, _ out: UnsafeMutableRawPointer?) -> Int32 {
    guard let handle, let out else { return -EINVAL }
    let counters = store(handle).counters
    out.storeBytes(
        of: CTemplateCounters(
            written: counters.written, withdrawn: counters.withdrawn, refusedTooLarge: counters.refusedTooLarge,
            refusedFull: counters.refusedFull, failed: counters.failed, malformed: counters.malformed,
            found: counters.found, missing: counters.missing),
        as: CTemplateCounters.self)
    return 0
}

@_cdecl("reuseportlb_templates_close")
public func reuseportlb_templates_close(_ handle: OpaquePointer?) {
    guard let handle else { return }
    let unmanaged = Unmanaged<FlowTemplateStore>.fromOpaque(UnsafeRawPointer(handle))
    unmanaged.takeUnretainedValue().close()
    unmanaged.release()
}
