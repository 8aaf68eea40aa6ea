// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB
import SystemCalls

/// Where announced addresses are kept: host routes in a kernel routing table. A protocol so the
/// announcer can be tested without a kernel (``KernelHostRoutes`` is the real one).
package protocol HostRoutes: Sendable {
    /// Adds (or replaces) the host route of `address` in `table`, marked `protocolNumber`.
    func add(_ address: IPAddress, table: UInt32, protocolNumber: UInt8) throws(SystemCallError)
    /// Removes it; a route already gone is not an error.
    func remove(_ address: IPAddress, table: UInt32, protocolNumber: UInt8) throws(SystemCallError)
    /// The host routes in `table` marked `protocolNumber`, of both families.
    func list(table: UInt32, protocolNumber: UInt8) throws(SystemCallError) -> Set<IPAddress>
}

/// Host routes through rtnetlink, in the calling thread's network namespace: type blackhole, so
/// the route never forwards anything even in a table a rule points to (the address itself is
/// local on the node: its `lo`, or the interface a kernel kind attaches to).
package struct KernelHostRoutes: HostRoutes {
    package init() {}

    static let newRoute: UInt16 = 24, deleteRoute: UInt16 = 25, getRoute: UInt16 = 26
    static let blackhole: UInt8 = 6  // RTN_BLACKHOLE
    static let attributeDestination: UInt16 = 1, attributeTable: UInt16 = 15  // RTA_DST, RTA_TABLE

    /// rtmsg (family, dst_len, src_len, tos, table, protocol, scope, type, flags) and RTA_DST,
    /// RTA_TABLE (a table above 255 does not fit rtm_table).
    static func message(_ address: IPAddress, table: UInt32, protocolNumber: UInt8) -> [UInt8] {
        let bytes = address.bytes
        // Above 255, rtm_table says RT_TABLE_COMPAT (252) and the attribute has the real one.
        var body: [UInt8] = [UInt8(address.family), UInt8(bytes.count * 8), 0, 0, table <= 255 ? UInt8(table) : 252,
                             protocolNumber, 0, blackhole, 0, 0, 0, 0]
        NextHopResolver.appendAttribute(&body, type: attributeDestination, bytes)
        var tableBytes: [UInt8] = []
        Rtnetlink.append32(&tableBytes, table)
        NextHopResolver.appendAttribute(&body, type: attributeTable, tableBytes)
        return body
    }

    package func add(_ address: IPAddress, table: UInt32, protocolNumber: UInt8) throws(SystemCallError) {
        // NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL: a replace would take over another program's
        // route of the address (the kernel matches on prefix and metric, not protocol).
        let call = "add route \(address) table \(table) proto \(protocolNumber)"
        do {
            try Self.acknowledged(Self.newRoute, flags: 0x4 | 0x400 | 0x200, Self.message(address, table: table, protocolNumber: protocolNumber), call: call)
        } catch where error.errno == EEXIST {
            // Ours already (a previous run's, or added twice): fine. Another program's: refused.
            guard try list(table: table, protocolNumber: protocolNumber).contains(address) else {
                throw SystemCallError(call: call + ": table \(table) has a route of another protocol for the address (ip route show table \(table) \(address)); it is left alone", errno: EEXIST)
            }
        }
    }

    package func remove(_ address: IPAddress, table: UInt32, protocolNumber: UInt8) throws(SystemCallError) {
        do {
            // The protocol is matched too: a route of the same address that another program
            // added (another protocol) is left alone.
            try Self.acknowledged(Self.deleteRoute, flags: 0x4, Self.message(address, table: table, protocolNumber: protocolNumber),
                                  call: "remove route \(address) table \(table) proto \(protocolNumber)")
        } catch where error.errno == ESRCH {
            return
        }
    }

    static func acknowledged(_ type: UInt16, flags: UInt16, _ body: [UInt8], call: String) throws(SystemCallError) {
        guard let reply = try Rtnetlink.request(type: type, flags: flags, body: body).first, reply.type == Rtnetlink.error else {
            throw SystemCallError(call: call, errno: EPROTO)
        }
        let code = Rtnetlink.errorCode(reply)
        guard code == 0 else { throw SystemCallError(call: call, errno: code) }
    }

    package func list(table: UInt32, protocolNumber: UInt8) throws(SystemCallError) -> Set<IPAddress> {
        var found = Set<IPAddress>()
        for family in [AF_INET, AF_INET6] {
            let body: [UInt8] = [UInt8(family), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
            let messages = try Rtnetlink.request(type: Self.getRoute, flags: 0x300, body: body)
            // An error inside the dump would leave the list partial: routes would look missing.
            if let failed = messages.first(where: { $0.type == Rtnetlink.error }), Rtnetlink.errorCode(failed) != 0 {
                throw SystemCallError(call: "dump routes", errno: Rtnetlink.errorCode(failed))
            }
            for message in messages where message.type == Self.newRoute {
                let payload = message.payload
                guard payload.count >= 12, payload[5] == protocolNumber, payload[1] == (family == AF_INET ? 32 : 128) else { continue }
                var routeTable = UInt32(payload[4])
                var destination: IPAddress?
                for (type, value) in NextHopResolver.attributes(payload, from: 12) {
                    if type == Self.attributeTable, value.count == 4 { routeTable = Rtnetlink.load32(value, 0) }
                    if type == Self.attributeDestination { destination = IPAddress(bytes: value) }
                }
                if routeTable == table, let destination { found.insert(destination) }
            }
        }
        return found
    }

    /// Whether the kernel delivers `address` locally here (an address of an interface, or a
    /// `local` route): what a socket listener needs to receive what is sent to it. Nil: the
    /// lookup failed.
    package static func isLocal(_ address: IPAddress) -> Bool? {
        let bytes = address.bytes
        var body: [UInt8] = [UInt8(address.family), UInt8(bytes.count * 8), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        NextHopResolver.appendAttribute(&body, type: attributeDestination, bytes)
        guard let reply = try? Rtnetlink.request(type: getRoute, flags: 0, body: body).first else { return nil }
        if reply.type == Rtnetlink.error { return false }  // unreachable: not local either
        guard reply.type == newRoute, reply.payload.count >= 12 else { return nil }
        return reply.payload[7] == 2  // RTN_LOCAL
    }
}
