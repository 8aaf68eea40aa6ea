// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import SystemCalls

/// What an interface's driver can do with XDP frames, from the kernel's `netdev` generic netlink
/// family (kernel 6.3+; what `ynl --family netdev --do dev-get` prints): whether it transmits
/// frames another interface's XDP program redirects to it (NETDEV_XDP_ACT_NDO_XMIT). A veth has
/// it only while its peer runs an XDP program or has GRO on.
enum NetdevFeatures {
    /// netdev family attributes and flags (linux/netdev.h, not in Debian 12's headers).
    private static let commandDevGet: UInt8 = 1, attributeIfindex: UInt16 = 1, attributeXDPFeatures: UInt16 = 3
    static let ndoXmit: UInt64 = 4

    /// The interface's XDP feature flags (NETDEV_XDP_ACT_*), or nil when the kernel cannot say
    /// (no netdev family: before 6.3, or no such interface).
    static func xdpFeatures(ifindex: UInt32) -> UInt64? {
        guard let family = familyID("netdev") else { return nil }
        var body: [UInt8] = [commandDevGet, 1, 0, 0]  // genlmsghdr: cmd, version, reserved
        appendAttribute(&body, attributeIfindex, withUnsafeBytes(of: ifindex) { Array($0) })
        guard let reply = try? Rtnetlink.request(type: family, flags: 0, body: body, family: 16).first,
              reply.type == family else { return nil }
        var features: UInt64?
        forEachAttribute(reply.payload, from: 4) { type, value in
            if type == attributeXDPFeatures, value.count >= 8 {
                features = value.withUnsafeBytes { $0.loadUnaligned(as: UInt64.self) }
            }
        }
        return features
    }

    /// Whether frames redirected by XDP can leave through the interface (nil: the kernel cannot say).
    static func transmitsXDP(ifindex: UInt32) -> Bool? {
        xdpFeatures(ifindex: ifindex).map { $0 & ndoXmit != 0 }
    }

    /// A generic netlink family's id (CTRL_CMD_GETFAMILY to GENL_ID_CTRL), nil if unknown.
    private static func familyID(_ name: String) -> UInt16? {
        var body: [UInt8] = [3, 1, 0, 0]  // CTRL_CMD_GETFAMILY, version 1
        appendAttribute(&body, 2, Array(name.utf8) + [0])  // CTRL_ATTR_FAMILY_NAME
        guard let reply = try? Rtnetlink.request(type: 0x10, flags: 0, body: body, family: 16).first, reply.type == 0x10 else { return nil }
        var id: UInt16?
        forEachAttribute(reply.payload, from: 4) { type, value in
            if type == 1, value.count >= 2 { id = Rtnetlink.load16(value, 0) }  // CTRL_ATTR_FAMILY_ID
        }
        return id
    }

    private static func appendAttribute(_ bytes: inout [UInt8], _ type: UInt16, _ value: [UInt8]) {
        Rtnetlink.append16(&bytes, UInt16(4 + value.count))
        Rtnetlink.append16(&bytes, type)
        bytes += value
        bytes += [UInt8](repeating: 0, count: (4 - value.count % 4) % 4)
    }

    private static func forEachAttribute(_ payload: [UInt8], from start: Int, _ body: (UInt16, [UInt8]) -> Void) {
        var offset = start
        while offset + 4 <= payload.count {
            let length = Int(Rtnetlink.load16(payload, offset))
            guard length >= 4, offset + length <= payload.count else { return }
            body(Rtnetlink.load16(payload, offset + 2) & 0x3fff, Array(payload[(offset + 4)..<(offset + length)]))
            offset += (length + 3) & ~3
        }
    }
}
