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

    static func quote(_ text: String) -> String {
        var out = "\""
        for scalar in text.unicodeScalars {
            switch scalar {
            case "\"": out += "\\\""
            case "\\": out += "\\\\"
            case "\n": out += "\\n"
            case _ where scalar.value < 0x20: out += "\\u" + String(scalar.value, radix: 16).leftPadded(4)
            default: out.unicodeScalars.append(scalar)
            }
        }
        return out + "\""
    }
}

extension String {
    func leftPadded(_ width: Int) -> String { String(repeating: "0", count: max(0, width - count)) + self }
}
