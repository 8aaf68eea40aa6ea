// SPDX-License-Identifier: Apache-2.0
import ReusePortLB

/// A list of source addresses written as `A`, `A-B` (inclusive, same family, at most 65536
/// addresses) or several of those separated by commas.
public enum AddressRange {
    public enum ParseError: Error, CustomStringConvertible {
        case invalid(String)
        public var description: String {
            switch self {
            case .invalid(let text):
                return "invalid address range '\(text)': expected A, A-B or A-B,C (e.g. 127.0.0.10-127.0.0.250 or 2001:db8::10-2001:db8::ff)"
            }
        }
    }

    public static func parse(_ text: String) throws(ParseError) -> [IPAddress] {
        var result: [IPAddress] = []
        for part in text.split(separator: ",") {
            let ends = part.split(separator: "-", maxSplits: 1).map(String.init)
            guard let first = IPAddress(ends[0]) else { throw .invalid(String(part)) }
            guard ends.count == 2 else {
                result.append(first)
                continue
            }
            guard let last = IPAddress(ends[1]), first.family == last.family else { throw .invalid(String(part)) }
            var current = first.bytes
            let end = last.bytes
            guard current.lexicographicallyPrecedes(end) || current == end else { throw .invalid(String(part)) }
            while true {
                result.append(IPAddress(bytes: current)!)
                if current == end { break }
                guard result.count < 65536 else { throw .invalid(String(part)) }
                var index = current.count - 1
                while current[index] == 255 {
                    current[index] = 0
                    index -= 1
                }
                current[index] += 1
            }
        }
        guard !result.isEmpty else { throw .invalid(text) }
        return result
    }
}
