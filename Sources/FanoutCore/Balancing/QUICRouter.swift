// SPDX-License-Identifier: Apache-2.0
import ReusePortLB

/// What QUIC-LB routing made of one datagram (the `outcome` label of
/// `udp_fanout_quic_lb_datagrams_total`): one per datagram of a one-way `quic_lb` listener; a
/// relay counts those that choose (or change) a session's downstream.
package enum QUICOutcome: String, CaseIterable, Sendable {
    /// Its destination connection ID names a downstream's server ID: sent there.
    case routed
    /// An Initial or 0-RTT packet (or a long header of another QUIC version) whose client-chosen
    /// ID names no downstream: the listener's balancing chose (a new connection; expected).
    case fallback
    /// A server-chosen ID whose server ID no downstream has (its server left the set, or is not
    /// configured here): the listener's balancing chose, and the connection likely breaks.
    case unknownServerID = "unknown_server_id"
    /// Not readable as a QUIC packet of a configuration here (too short, a config ID with no
    /// configuration, version negotiation): the listener's balancing chose.
    case undecodable
}

/// QUIC-LB routing for one plan: the listener's configurations by config ID and the plan's
/// downstreams by server ID. Built once per plan and shared by every worker; routing a datagram
/// reads it only and allocates nothing.
final class QUICRouter: Sendable {
    /// Codecs by config ID (0...6; 7 is never routable).
    private let codecs: [QUICLBCodec?]
    /// Downstream index by server ID (zero-padded to 16 octets).
    private let owners: [ServerIDKey: Int]

    struct ServerIDKey: Hashable {
        var high: UInt64
        var low: UInt64

        init(_ bytes: UnsafeRawPointer) {
            high = bytes.loadUnaligned(as: UInt64.self)
            low = bytes.loadUnaligned(fromByteOffset: 8, as: UInt64.self)
        }

        init(_ bytes: [UInt8]) {
            let padded = bytes + [UInt8](repeating: 0, count: 16 - bytes.count)
            self = padded.withUnsafeBytes { ServerIDKey($0.baseAddress!) }
        }
    }

    /// nil when `configurations` is empty (the listener does not route by connection ID).
    init?(configurations: [QUICLBConfiguration], downstreams: [Downstream]) {
        guard !configurations.isEmpty else { return nil }
        var codecs = [QUICLBCodec?](repeating: nil, count: 8)
        for configuration in configurations { codecs[Int(configuration.configID)] = QUICLBCodec(configuration) }
        self.codecs = codecs
        var owners: [ServerIDKey: Int] = [:]
        // Validation refuses other lengths and duplicates; a weight-0 downstream still owns its
        // connections.
        let length = configurations[0].serverIDLength
        for (index, downstream) in downstreams.enumerated() {
            if let serverID = downstream.serverID, serverID.count == length, owners[ServerIDKey(serverID)] == nil {
                owners[ServerIDKey(serverID)] = index
            }
        }
        self.owners = owners
    }

    /// The downstream a datagram's connection ID names, and the outcome (nil index: the caller
    /// falls back to the listener's balancing).
    @inline(__always)
    func route(_ payload: UnsafeRawBufferPointer) -> (Int?, QUICOutcome) {
        // A short header's ID has no length in the packet: its config ID (the ID's first octet,
        // the datagram's second) says which configuration, and so how long it is.
        guard payload.count >= 2 else { return (nil, .undecodable) }
        let shortCodec = codecs[Int(payload[1] >> 5)]
        let header = QUICHeader.destinationID(payload, shortLength: shortCodec?.configuration.connectionIDLength ?? 0)
        guard case .id(let offset, let length, let clientChosen) = header, length > 0 else { return (nil, .undecodable) }
        let id = payload.baseAddress! + offset
        guard let codec = codecs[Int(id.load(as: UInt8.self) >> 5)], length >= codec.configuration.connectionIDLength else {
            return (nil, clientChosen ? .fallback : .undecodable)
        }
        let owner = withUnsafeTemporaryAllocation(byteCount: 16, alignment: 8) { buffer -> Int? in
            buffer.initializeMemory(as: UInt8.self, repeating: 0)
            codec.decodeServerID(id, into: buffer.baseAddress!)
            return owners[ServerIDKey(UnsafeRawPointer(buffer.baseAddress!))]
        }
        if let owner { return (owner, .routed) }
        return (nil, clientChosen ? .fallback : .unknownServerID)
    }
}

/// Per-thread tallies of ``QUICOutcome``s, added to the listener's counters at each flush.
struct QUICTally {
    var counts: (UInt64, UInt64, UInt64, UInt64) = (0, 0, 0, 0)

    @inline(__always)
    mutating func note(_ outcome: QUICOutcome) {
        switch outcome {
        case .routed: counts.0 += 1
        case .fallback: counts.1 += 1
        case .unknownServerID: counts.2 += 1
        case .undecodable: counts.3 += 1
        }
    }

    var isEmpty: Bool { counts == (0, 0, 0, 0) }
}
