// SPDX-License-Identifier: Apache-2.0
import ReusePortLB

/// One key of a listener's `settings:`, declared once beside the kind that owns it: its name,
/// value (type and range), one line of doc, the kinds it applies to, and how it is warned about
/// where it does not apply. Its default is ``Settings``'s. The parser reads it through this
/// declaration, ``FanoutConfig/warnings()`` warns from it, and ``SettingsTable/json()`` prints it
/// for schema/generate-schema.py and the reference table of docs/configuration.md (checked by
/// SettingsTableTests).
struct SettingKey: Sendable {
    /// What the key holds.
    enum Value: Sendable, Equatable {
        /// A whole number in `range` (`ipv4Maximum`: a lower maximum for an IPv4 bind), and, when
        /// `only` is set, one of its values only.
        case integer(ClosedRange<Int>, ipv4Maximum: Int? = nil, only: Only? = nil)
        case boolean
        /// One of these words.
        case choice([String])
        /// A list of network interface names.
        case interfaceNames
    }

    /// The values of an integer key's range it takes.
    enum Only: Sendable, Equatable {
        /// These values; `reason` ends the error.
        case values([Int], reason: String)
        /// The powers of two.
        case powersOfTwo
    }

    /// Where the key has no effect, and what the warning says there.
    enum Scope: Sendable, Equatable {
        /// Only in its kinds: elsewhere "applies to mode(s) … only", warned with the kind's own keys.
        case modes
        /// Only in its kinds, which run workers: elsewhere "not used in mode M (why)", the kind
        /// saying why (``ListenerKind/withoutWorkers``).
        case workers
        /// Only with these `replies` (warned after the downstreams' keys).
        case replies(Set<Replies>)
        /// Only when a downstream is given by DNS name.
        case dnsDownstreams
        /// Wherever it is set (a kind that refuses a value says so at validation).
        case everywhere
    }

    let name: String
    let value: Value
    /// One line, the schema's description.
    let doc: String
    /// The kinds it applies to.
    let kinds: [any ListenerKind.Type]
    let scope: Scope
    /// Reads the key of the mapping into `settings`; the bind's address decides an IPv4 maximum.
    let read: @Sendable (Fields, inout Settings, SocketAddress) throws(ConfigError) -> Void
    /// Its value in `settings`, as JSON.
    let json: @Sendable (Settings) -> String

    /// A whole number.
    static func integer(_ name: String, _ range: ClosedRange<Int>, ipv4Maximum: Int? = nil, only: Only? = nil, kinds: [any ListenerKind.Type], scope: Scope,
                        doc: String, get: @escaping @Sendable (Settings) -> Int, set: @escaping @Sendable (inout Settings, Int) -> Void) -> SettingKey {
        SettingKey(name: name, value: .integer(range, ipv4Maximum: ipv4Maximum, only: only), doc: doc, kinds: kinds, scope: scope, read: { fields, settings, bind throws(ConfigError) in
            var bounds = range
            if let ipv4Maximum, case .v4 = bind.ip { bounds = range.lowerBound...ipv4Maximum }
            guard let number = try fields.int(name, in: bounds) else { return }
            switch only {
            case .values(let values, let reason)? where !values.contains(number):
                throw fields.error(name, "\(number): must be \(values.map(String.init).joined(separator: " or ")) (\(reason))")
            case .powersOfTwo? where number & (number - 1) != 0:
                throw fields.error(name, "\(number): must be a power of two (\(range.lowerBound) to \(range.upperBound))")
            default:
                set(&settings, number)
            }
        }, json: { String(get($0)) })
    }

    /// true or false.
    static func boolean(_ name: String, kinds: [any ListenerKind.Type], scope: Scope, doc: String,
                        get: @escaping @Sendable (Settings) -> Bool, set: @escaping @Sendable (inout Settings, Bool) -> Void) -> SettingKey {
        SettingKey(name: name, value: .boolean, doc: doc, kinds: kinds, scope: scope, read: { fields, settings, _ throws(ConfigError) in
            if let flag = try fields.bool(name) { set(&settings, flag) }
        }, json: { String(get($0)) })
    }

    /// One of the cases of `T`, by raw value.
    static func choice<T: RawRepresentable & CaseIterable & Sendable>(_ name: String, _ type: T.Type, kinds: [any ListenerKind.Type], scope: Scope, doc: String,
                                                                       get: @escaping @Sendable (Settings) -> T, set: @escaping @Sendable (inout Settings, T) -> Void) -> SettingKey where T.RawValue == String {
        let words = T.allCases.map(\.rawValue)
        return SettingKey(name: name, value: .choice(words), doc: doc, kinds: kinds, scope: scope, read: { fields, settings, _ throws(ConfigError) in
            if let word = try fields.choice(name, words) { set(&settings, T(rawValue: word)!) }
        }, json: { JSONText.quote(get($0).rawValue) })
    }

    /// Whether `kind` is one of its kinds.
    func applies(to kind: any ListenerKind.Type) -> Bool {
        kinds.contains { ObjectIdentifier($0) == ObjectIdentifier(kind) }
    }

    /// The warning for this key set on `listener` (of `kind`), nil where it applies.
    func unused(on listener: Listener, of kind: any ListenerKind.Type) -> String? {
        switch scope {
        case .modes:
            guard !applies(to: kind) else { return nil }
            let names = kinds.map { $0.name }
            // A relay listener is of mode userspace: "applies to mode userspace" would read as if it did.
            if listener.mode.rawValue != kind.name && names.contains(listener.mode.rawValue) {
                return "no effect on a \(kind.name) listener (mode \(listener.mode.rawValue) with replies: \(listener.replies.rawValue))"
            }
            return names.count == 1 ? "applies to mode \(names[0]) only" : "applies to modes \(names.dropLast().joined(separator: ", ")) and \(names.last!) only"
        case .workers:
            guard !applies(to: kind) else { return nil }
            return "not used in mode \(listener.mode.rawValue)\(kind.withoutWorkers.map { " (\($0))" } ?? "")"
        case .replies(let replies):
            guard !replies.contains(listener.replies) else { return nil }
            return replies == [.nat, .relay] ? "applies to two-way listeners (replies: nat or relay) only" : "applies to replies: \(replies.map(\.rawValue).sorted().joined(separator: " or ")) only"
        case .dnsDownstreams:
            guard listener.memberGroups.allSatisfy({ $0.dnsDownstreams.isEmpty }) else { return nil }
            return "not used: no downstream of this listener is given by DNS name"
        case .everywhere:
            return nil
        }
    }

    /// The declaration as one JSON object (schema/settings-table.json).
    var jsonObject: String {
        var fields = [("name", JSONText.quote(name))]
        switch value {
        case .integer(let range, let ipv4Maximum, let only):
            fields += [("type", "\"integer\""), ("minimum", String(range.lowerBound)), ("maximum", String(range.upperBound))]
            if let ipv4Maximum { fields.append(("ipv4_maximum", String(ipv4Maximum))) }
            switch only {
            case .values(let values, _)?: fields.append(("values", "[" + values.map(String.init).joined(separator: ", ") + "]"))
            case .powersOfTwo?: fields.append(("power_of_two", "true"))
            case nil: break
            }
        case .boolean:
            fields.append(("type", "\"boolean\""))
        case .choice(let words):
            fields += [("type", "\"choice\""), ("values", "[" + words.map(JSONText.quote).joined(separator: ", ") + "]")]
        case .interfaceNames:
            fields.append(("type", "\"interface_names\""))
        }
        fields.append(("default", json(Settings())))
        fields.append(("kinds", "[" + kinds.map { JSONText.quote($0.name) }.joined(separator: ", ") + "]"))
        if case .replies(let replies) = scope {
            fields.append(("replies", "[" + Replies.allCases.filter(replies.contains).map { JSONText.quote($0.rawValue) }.joined(separator: ", ") + "]"))
        }
        fields.append(("doc", JSONText.quote(doc)))
        return "{" + fields.map { "\"\($0.0)\": \($0.1)" }.joined(separator: ", ") + "}"
    }
}

/// Every listener setting: the union of the kinds' tables (`ListenerKinds.settingTables`), in
/// the order of the reference (the order the parser reads them and its errors list them).
public enum SettingsTable {
    /// The keys, in the reference's order.
    static let keys: [SettingKey] = {
        let declared = ListenerKinds.settingTables.flatMap { $0 }
        let keys = ListenerKinds.settingsOrder.map { name in
            guard let key = declared.first(where: { $0.name == name }) else { preconditionFailure("settings.\(name) is in ListenerKinds.settingsOrder but no kind declares it") }
            return key
        }
        precondition(keys.count == declared.count && Set(keys.map(\.name)).count == keys.count, "every declared setting once in ListenerKinds.settingsOrder")
        return keys
    }()

    /// Their names, in that order.
    static let names = keys.map(\.name)

    /// Reads `settings:` (the mapping at `path`) of a listener bound to `bind`.
    static func parse(_ node: YAMLNode, path: String, bind: SocketAddress) throws(ConfigError) -> Settings {
        let entry = try Fields(node, path: path)
        try entry.allow(names)
        var settings = Settings()
        for key in keys { try key.read(entry, &settings, bind) }
        return settings
    }

    /// The warnings for the keys `listener` (at `path`, of `kind`) sets where they have no
    /// effect, for the scopes in `scopes` (a kind's own keys come first, the listener's shape's
    /// after its downstreams'), in the order of the kinds' tables.
    static func warnings(_ listener: Listener, of kind: any ListenerKind.Type, path: String, config: FanoutConfig, where scopes: (SettingKey.Scope) -> Bool) -> [ConfigWarning] {
        ListenerKinds.settingTables.joined().filter { scopes($0.scope) }.compactMap { key in
            let full = "\(path).settings.\(key.name)"
            guard config.lines.isSet(full), let message = key.unused(on: listener, of: kind) else { return nil }
            return config.configWarning(full, message)
        }
    }

    /// The table as JSON, one key a line: what `udp-fanout --print-settings-table` prints
    /// (schema/settings-table.json).
    public static func json() -> String {
        "{\"settings\": [\n" + keys.map { "  " + $0.jsonObject }.joined(separator: ",\n") + "\n]}\n"
    }
}
