// SPDX-License-Identifier: Apache-2.0
/// Bounds checked on the raw text before the YAML parser sees it. The parser composes nodes
/// recursively: a document nested a few thousand levels deep overflows the stack and kills the
/// process (at start, and on SIGHUP the running daemon). A configuration is a few levels deep
/// and at most a few MiB (10,000 listeners take about 1.5 MiB), so anything beyond these bounds
/// is refused with a message before parsing.
enum ConfigLimits {
    /// Largest configuration file accepted.
    static let maximumBytes = 16 << 20
    /// Deepest nesting accepted (the reference files are 5 levels deep).
    static let maximumDepth = 64
    /// Longest line: a line's indentation bounds its block nesting.
    static let maximumIndentation = 256

    /// Refuses a text too large or too deeply nested for the parser.
    ///
    /// The depth is over-estimated, never under-estimated: flow brackets (`[`, `{`) outside
    /// quoted scalars and comments count one level each (at most ``maximumDepth``), and a
    /// line's block nesting is at most the column where its content starts, since each block
    /// level indents and compact forms such as `- - - x` indent by their indicators (at most
    /// ``maximumIndentation``). Brackets inside block scalars count too: no configuration key
    /// holds such text, so only an absurd file is refused by mistake, and with a message.
    static func check(_ text: String) throws(ConfigError) {
        let bytes = text.utf8
        guard bytes.count <= maximumBytes else {
            throw ConfigError("(document)", "the file is \(bytes.count) bytes: at most \(maximumBytes) are accepted")
        }
        var line = 1
        var column = 0
        var contentStarted = false
        var flowDepth = 0
        var quote: UInt8? = nil
        var escaped = false
        var inComment = false
        var last: UInt8 = 10  // the byte before this one
        var lastToken: UInt8 = 10  // the last byte that is not white space
        for byte in bytes {
            defer { last = byte }
            if byte == 10 {
                line += 1
                column = 0
                contentStarted = false
                inComment = false
                if quote == nil { lastToken = 10 }
                continue
            }
            column += 1
            if inComment { continue }
            if let open = quote {
                if escaped {
                    escaped = false
                } else if open == 34 && byte == 92 {  // a backslash escapes in double quotes
                    escaped = true
                } else if byte == open {
                    quote = nil
                    lastToken = byte
                }
                continue
            }
            if byte == 32 || byte == 9 { continue }
            if byte == 35 && (last == 32 || last == 9 || last == 10) {  // '#' after white space: a comment
                inComment = true
                continue
            }
            if !contentStarted && byte != 45 && byte != 63 && byte != 58 {  // content, not - ? :
                contentStarted = true
                if column > maximumIndentation {
                    throw ConfigError("(document)", "content starts at column \(column): nesting that deep is refused before parsing (at most \(maximumIndentation) columns)", line: line)
                }
            }
            switch byte {
            case 34, 39:  // " or '
                if Self.scalarMayStart(after: lastToken) { quote = byte }
            case 91, 123:  // [ {
                flowDepth += 1
                if flowDepth > maximumDepth {
                    throw ConfigError("(document)", "nested more than \(maximumDepth) levels deep: refused before parsing (a configuration is a few levels deep)", line: line)
                }
            case 93, 125:  // ] }
                flowDepth = max(0, flowDepth - 1)
            default:
                break
            }
            lastToken = byte
        }
    }

    /// A quote opens a quoted scalar only where a scalar may start: at the start of a line, or
    /// after an indicator (`[ { , : - ?`). Inside a plain scalar (`it's`, `a "b`) it is text.
    private static func scalarMayStart(after byte: UInt8) -> Bool {
        switch byte {
        case 10, 91, 123, 44, 58, 45, 63: return true
        default: return false
        }
    }
}

extension ConfigError {
    /// The problem with every control character and non-printable byte escaped and long echoes
    /// cut, so an error is one line that never writes raw input bytes to a terminal or a log.
    static func printable(_ text: String, limit: Int = 200) -> String {
        var out = ""
        var count = 0
        for scalar in text.unicodeScalars {
            if count >= limit {
                out += "…"
                break
            }
            switch scalar.value {
            case 0x20..<0x7f: out.unicodeScalars.append(scalar)
            // Format characters (bidirectional overrides such as U+202E, zero-width ones) are
            // escaped in both ranges: they would change what the terminal shows.
            case 0xa0...0xd7ff where scalar.properties.generalCategory != .format,
                 0xe000...0xfffd where scalar.properties.generalCategory != .format:
                out.unicodeScalars.append(scalar)
            default: out += "\\u{\(String(scalar.value, radix: 16))}"
            }
            count += 1
        }
        return out
    }
}
