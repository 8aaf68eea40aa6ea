// SPDX-License-Identifier: Apache-2.0
import ReusePortLB

/// tc_ebpf's settings (xdp's too: the same tc program finishes what XDP passes), in the order
/// their warnings come (``SettingsTable``).
enum TCSettings {
    static let keys: [SettingKey] = [
        .choice("tc_attach", TCAttach.self, kinds: [TCKind.self, XDPKind.self], scope: .modes,
                doc: "tc_ebpf and xdp: a TCX link where the kernel has one (6.6+), else a clsact filter; or force one. Listeners on one interface must agree.",
                get: { $0.tcAttach }, set: { $0.tcAttach = $1 }),
        .integer("max_associations", 16...(1 << 26), kinds: [TCKind.self, XDPKind.self], scope: .replies([.nat]),
                 doc: "replies: nat only: clients remembered at once (LRU; when full the least recently used association is forgotten, counted evicted).",
                 get: { $0.maxAssociations }, set: { $0.maxAssociations = $1 }),
        SettingKey(name: "reply_interfaces", value: .interfaceNames,
                   doc: "replies: nat only: interfaces the downstreams' replies arrive on, where the program is attached too. Empty (default): the interfaces the kernel routes the downstreams through.",
                   kinds: [TCKind.self, XDPKind.self], scope: .replies([.nat]), read: { fields, settings, _ throws(ConfigError) in
                       for (position, item) in try fields.sequence("reply_interfaces", required: false).enumerated() {
                           guard case .scalar(let scalar) = item, !scalar.string.isEmpty, scalar.string.utf8.count < 16,
                               !scalar.string.contains(where: { $0 == "/" || $0 == " " || $0.asciiValue.map { $0 < 0x20 || $0 == 0x7f } ?? true })
                           else {
                               throw ConfigError("\(fields.path).reply_interfaces[\(position)]", "expected an interface name (1 to 15 characters, no '/' or spaces)", line: item.mark.line)
                           }
                           settings.replyInterfaces.append(scalar.string)
                       }
                   }, json: { "[" + $0.replyInterfaces.map(JSONText.quote).joined(separator: ", ") + "]" }),
    ]
}
