// SPDX-License-Identifier: Apache-2.0
/// The line of every key of a parsed configuration, by key path (`listeners[0].bind`,
/// `listeners[1].downstream[2].address`): errors found after parsing, across fields
/// (duplicate names, overlapping binds, loops), name the line too, and warnings can tell a key
/// the file sets from a default.
public struct KeyLines: Sendable {
    private var lines: [String: Int] = [:]

    public init() {}

    /// Records every mapping key and sequence item of `root`. The depth is bounded by
    /// ``ConfigLimits`` before parsing, so the recursion is too.
    init(_ root: YAMLNode) {
        var budget = Self.maximumNodes
        record(root, path: "", budget: &budget)
    }

    /// Nodes visited at most. Aliases share their anchor's node, so a small file can stand for
    /// an exponential tree ("billion laughs"): past this many nodes, later keys have no line.
    static let maximumNodes = 1_000_000

    private mutating func record(_ node: YAMLNode, path: String, budget: inout Int) {
        guard budget > 0 else { return }
        budget -= 1
        switch node {
        case .mapping(let mapping):
            for (key, value) in mapping {
                guard let name = key.string else { continue }
                let child = path.isEmpty ? name : "\(path).\(name)"
                lines[child] = key.mark.line
                record(value, path: child, budget: &budget)
            }
        case .sequence(let sequence):
            for (index, item) in sequence.enumerated() {
                let child = "\(path)[\(index)]"
                lines[child] = item.mark.line
                record(item, path: child, budget: &budget)
            }
        default:
            break
        }
    }

    /// The line of `path`, or of its nearest enclosing key the file has.
    public func line(of path: String) -> Int? {
        var current = Substring(path)
        while !current.isEmpty {
            if let line = lines[String(current)] { return line }
            guard let cut = current.lastIndex(where: { $0 == "." || $0 == "[" }) else { break }
            current = current[..<cut]
        }
        return nil
    }

    /// True when the file sets `path` itself (not a default).
    public func isSet(_ path: String) -> Bool { lines[path] != nil }
}
