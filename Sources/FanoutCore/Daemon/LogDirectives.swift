// SPDX-License-Identifier: Apache-2.0
import Logging

/// The log level from `UDP_FANOUT_LOG`/`RUST_LOG` or `--log-level`, read as the reference's
/// tracing `EnvFilter` reads its directives: a comma-separated list of `level` or
/// `target=level` (level: trace, debug, info, warn, error, off); directives for other targets
/// (`hyper=info`) do not concern this program; a directive for `udp_fanout` wins over a bare
/// level. An empty variable counts as unset.
public enum LogDirectives {
    /// What to log: nothing, or from a level up.
    public enum Filter: Equatable, Sendable {
        case off
        case level(Logger.Level)
    }

    /// A directive that names no level this program knows.
    public struct Invalid: Error, CustomStringConvertible {
        public let directive: String
        public var description: String {
            "unknown log level in '\(directive)': use trace, debug, info, warn, error or off, or target=level directives separated by commas (e.g. udp_fanout=debug,info)"
        }
    }

    /// - Parameters:
    ///   - environment: the variable's value, if set.
    ///   - flag: `--log-level`.
    public static func filter(environment: String?, flag: String) throws(Invalid) -> Filter {
        if let text = environment?.trimmingCharacters(in: " \t"), !text.isEmpty {
            var global: Filter?
            var ours: Filter?
            for directive in text.split(separator: ",") {
                let part = directive.trimmingCharacters(in: " \t")
                if part.isEmpty { continue }
                let pieces = part.split(separator: "=", maxSplits: 1).map(String.init)
                if pieces.count == 1 {
                    // A bare word is a level, or a target enabled at every level (tracing's rule).
                    if let level = Self.level(pieces[0]) {
                        global = level
                    } else if Self.isOurs(pieces[0]) {
                        ours = .level(.trace)
                    }
                    continue
                }
                // Another target's directive does not concern this program, even a bad one
                // (tracing ignores directives it cannot read).
                guard Self.isOurs(pieces[0]) else { continue }
                guard let level = Self.level(pieces[1]) else { throw Invalid(directive: part) }
                ours = level
            }
            if let chosen = ours ?? global { return chosen }
            // Only other targets named: this program logs at the flag's level.
        }
        guard let level = Self.level(flag) else { throw Invalid(directive: flag) }
        return level
    }

    static func level(_ text: String) -> Filter? {
        switch text.lowercased() {
        case "trace": return .level(.trace)
        case "debug": return .level(.debug)
        case "info": return .level(.info)
        case "warn", "warning": return .level(.warning)
        case "error": return .level(.error)
        case "off": return .off
        default: return nil
        }
    }

    /// `udp_fanout`, `udp-fanout` or one of their modules (`udp_fanout::tc`), spans stripped.
    static func isOurs(_ target: String) -> Bool {
        let name = target.split(separator: "[", maxSplits: 1).first.map(String.init) ?? target
        let crate = name.split(separator: ":", maxSplits: 1).first.map(String.init) ?? name
        return crate == "udp_fanout" || crate == "udp-fanout"
    }
}

extension String {
    fileprivate func trimmingCharacters(in set: String) -> String {
        let characters = Set(set)
        var slice = Substring(self)
        while let first = slice.first, characters.contains(first) { slice = slice.dropFirst() }
        while let last = slice.last, characters.contains(last) { slice = slice.dropLast() }
        return String(slice)
    }
}

extension Substring {
    fileprivate func trimmingCharacters(in set: String) -> String { String(self).trimmingCharacters(in: set) }
}
