// SPDX-License-Identifier: Apache-2.0
/// JSON string literals without Foundation, for the package's one-line JSON writers (the
/// collector's and publisher's reports, udp-fanout's `--log-format json`).
package enum JSONText {
    /// `text` as a JSON string: quotes, backslashes and control characters escaped.
    package static func quote(_ text: String) -> String {
        var out = "\""
        for scalar in text.unicodeScalars {
            switch scalar {
            case "\"": out += "\\\""
            case "\\": out += "\\\\"
            case "\n": out += "\\n"
            case _ where scalar.value < 0x20:
                let hex = String(scalar.value, radix: 16)
                out += "\\u" + String(repeating: "0", count: 4 - hex.count) + hex
            default: out.unicodeScalars.append(scalar)
            }
        }
        return out + "\""
    }
}
