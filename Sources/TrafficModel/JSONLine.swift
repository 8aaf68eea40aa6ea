// SPDX-License-Identifier: Apache-2.0
import ReusePortLB

/// Writes one line of JSON without Foundation: the collector's and publisher's reports.
public struct JSONObject {
    private var fields: [String] = []

    public init() {}

    public mutating func add(_ key: String, _ value: some BinaryInteger) {
        fields.append("\(Self.quote(key)):\(value)")
    }

    public mutating func add(_ key: String, _ value: Double) {
        fields.append("\(Self.quote(key)):\(value.isFinite ? "\((value * 1000).rounded() / 1000)" : "null")")
    }

    public mutating func add(_ key: String, _ value: String?) {
        fields.append("\(Self.quote(key)):\(value.map(Self.quote) ?? "null")")
    }

    public mutating func add(_ key: String, _ value: Bool) {
        fields.append("\(Self.quote(key)):\(value)")
    }

    public mutating func add(_ key: String, _ value: JSONObject) {
        fields.append("\(Self.quote(key)):\(value.text)")
    }

    public var text: String { "{" + fields.joined(separator: ",") + "}" }

    static func quote(_ text: String) -> String { JSONText.quote(text) }
}
