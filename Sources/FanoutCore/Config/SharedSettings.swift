// SPDX-License-Identifier: Apache-2.0

/// Settings of several kinds, declared once with their kinds, in the order their warnings come
/// (``SettingsTable``).
enum SharedSettings {
    static let keys: [SettingKey] = [
        .integer("drain_secs", 0...3600, kinds: [RelayKind.self, TCKind.self, XDPKind.self], scope: .replies([.nat, .relay]),
                 doc: "Two-way listeners (replies: nat or relay): how long a removed or unhealthy downstream keeps relaying its clients' replies; 0: it goes at once.",
                 get: { $0.drainSecs }, set: { $0.drainSecs = $1 }),
        .integer("resolve_interval_secs", 1...86400, kinds: ListenerKinds.types, scope: .dnsDownstreams,
                 doc: "The longest time between two resolutions of a DNS downstream; a shorter record TTL wins.",
                 get: { $0.resolveIntervalSecs }, set: { $0.resolveIntervalSecs = $1 }),
        .choice("output", Output.self, kinds: ListenerKinds.types, scope: .everywhere,
                doc: "userspace and af_xdp: how datagrams leave. socket: the payload through a UDP socket of this host; preserve_source: the whole datagram with the client's source address and port (CAP_NET_RAW); xdp_tx (af_xdp only): sent on the RX queue's TX ring when the next hop is on the same interface. tc_ebpf and xdp always keep the client's source: socket and xdp_tx are refused there.",
                get: { $0.output }, set: { $0.output = $1 }),
    ]
}
