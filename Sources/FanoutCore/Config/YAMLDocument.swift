// SPDX-License-Identifier: Apache-2.0
import CYAML

// The configuration's YAML reader: Debian's libyaml (the parser Yams bundled, the same 0.2.5)
// through its event API, composed into a node tree here the way Yams composed it, so that the
// messages, lines and columns, anchors and aliases, and the scalar readings (true/yes/on, 0x1F,
// 0o17, 1_000) stay what they were. No Foundation: Yams needed all of it, with its ICU data
// (about 40 MB of the binary).

/// Where a node starts: line and column from 1 (libyaml counts from 0), the column in Unicode
/// scalars.
struct YAMLMark: Equatable, Sendable {
    var line: Int
    var column: Int
}

/// A node of a YAML document. An alias is the node of its anchor (shared, not copied).
indirect enum YAMLNode: Sendable {
    case scalar(YAMLScalar)
    case mapping(YAMLMapping)
    case sequence(YAMLSequence)
}

struct YAMLScalar: Sendable {
    enum Style: Sendable { case plain, singleQuoted, doubleQuoted, literal, folded }
    var string: String
    /// The tag the file gives (`tag:yaml.org,2002:str` for a quoted scalar); nil when implicit.
    var tag: String?
    var style: Style
    var mark: YAMLMark
}

/// A mapping's pairs in the file's order (duplicate keys kept: the reader reports them).
struct YAMLMapping: Sequence, Sendable {
    var pairs: [(key: YAMLNode, value: YAMLNode)]
    var tag: String?
    var mark: YAMLMark
    func makeIterator() -> IndexingIterator<[(key: YAMLNode, value: YAMLNode)]> { pairs.makeIterator() }
}

struct YAMLSequence: RandomAccessCollection, Sendable {
    var nodes: [YAMLNode]
    var tag: String?
    var mark: YAMLMark
    var startIndex: Int { nodes.startIndex }
    var endIndex: Int { nodes.endIndex }
    subscript(position: Int) -> YAMLNode { nodes[position] }
}

/// A document libyaml refused, with its own words and marks.
enum YAMLError: Error, Sendable {
    /// The input is not readable text (a control character, invalid UTF-8): the offset counts
    /// characters from the start, nil when it falls inside one.
    case reader(problem: String, offset: Int?)
    /// A scanner, parser or composer error: the problem at `mark`, and where the construct it
    /// belongs to started (`context`) when libyaml says.
    case syntax(context: Context?, problem: String, mark: YAMLMark)
    /// libyaml could not allocate memory.
    case memory

    struct Context: Sendable {
        var text: String
        var mark: YAMLMark
    }
}

/// How a plain scalar reads as an integer (``YAMLNode/integer``).
enum YAMLInteger: Equatable {
    case value(Int)
    /// Base 60 whose value does not fit an Int.
    case tooLarge
}

extension YAMLNode {
    var mark: YAMLMark {
        switch self {
        case .scalar(let scalar): return scalar.mark
        case .mapping(let mapping): return mapping.mark
        case .sequence(let sequence): return sequence.mark
        }
    }

    /// A scalar's text (any style or tag). A mapping with a `=` key (YAML's value key) reads as
    /// that key's value; a sequence has none.
    var string: String? {
        switch self {
        case .scalar(let scalar): return scalar.string
        case .mapping(let mapping):
            for (key, value) in mapping where key.isValueKey { return value.string }
            return nil
        case .sequence: return nil
        }
    }

    /// true, yes, on / false, no, off in any case (YAML 1.1), whatever the style.
    var bool: Bool? {
        guard case .scalar(let scalar) = self else { return nil }
        switch scalar.string.lowercased() {
        case "true", "yes", "on": return true
        case "false", "no", "off": return false
        default: return nil
        }
    }

    /// A plain scalar that is a YAML 1.1 integer: decimal with an optional sign, 0x hex, 0b
    /// binary, 0o or 0 octal, `_` anywhere ignored, base 60 (1:30, see ``sexagesimal(_:)``); nil
    /// otherwise, and nil for a value too large for an Int but in base 60, which says so.
    var integer: YAMLInteger? {
        guard case .scalar(let scalar) = self, scalar.style == .plain else { return nil }
        let withSign = scalar.string.filter { $0 != "_" }
        if withSign == "0" { return .value(0) }
        let negative = withSign.hasPrefix("-")
        let signPrefix = negative ? "-" : ""
        let digits = withSign.dropFirst(negative || withSign.hasPrefix("+") ? 1 : 0)
        for (prefix, radix) in [("0x", 16), ("0b", 2), ("0o", 8), ("0", 8)] where digits.hasPrefix(prefix) {
            return Int(signPrefix + digits.dropFirst(prefix.count), radix: radix).map(YAMLInteger.value)
        }
        if digits.contains(":") { return Self.sexagesimal(scalar.string) }
        return Int(withSign).map(YAMLInteger.value)
    }

    /// YAML 1.1 base 60, `[-+]?[1-9][0-9_]*(:[0-5]?[0-9])+` (1:30 is 90): nil if `text` is not
    /// one, ``YAMLInteger/tooLarge`` if its value does not fit an Int (Yams trapped there).
    private static func sexagesimal(_ text: String) -> YAMLInteger? {
        var parts = text.split(separator: ":", omittingEmptySubsequences: false).map(String.init)
        parts[0] = parts[0].filter { $0 != "_" }
        var negative = false
        if let sign = parts[0].first, sign == "-" || sign == "+" {
            negative = sign == "-"
            parts[0].removeFirst()
        }
        guard parts.count > 1, let first = parts[0].first, first != "0",
              parts.allSatisfy({ !$0.isEmpty && $0.allSatisfy(\.isASCII) && $0.allSatisfy(\.isNumber) }),
              parts.dropFirst().allSatisfy({ $0.count <= 2 && Int($0)! < 60 })
        else { return nil }
        var total = 0
        for part in parts {
            guard let digits = Int(part) else { return .tooLarge }
            let (shifted, over) = total.multipliedReportingOverflow(by: 60)
            let (sum, carry) = shifted.addingReportingOverflow(digits)
            guard !over && !carry else { return .tooLarge }
            total = sum
        }
        return .value(negative ? -total : total)
    }

    /// True for a null: an empty plain or quoted scalar, `~`, `null`, `Null`, `NULL`.
    var isNull: Bool {
        guard case .scalar(let scalar) = self else { return false }
        switch scalar.string {
        case "", "~", "null", "Null", "NULL": return true
        default: return false
        }
    }

    /// A key that YAML 1.1 resolves to `tag:yaml.org,2002:value`: a plain `=`, or that tag.
    private var isValueKey: Bool {
        switch self {
        case .scalar(let scalar): return scalar.tag == YAMLComposer.valueTag || (scalar.tag == nil && scalar.string == "=")
        case .mapping(let mapping): return mapping.tag == YAMLComposer.valueTag
        case .sequence(let sequence): return sequence.tag == YAMLComposer.valueTag
        }
    }
}

/// Composes the one document of a YAML text from libyaml's events: anchors are registered
/// when their node is complete (a later anchor of the same name replaces it), an alias to an
/// unknown anchor is an error, and a second document is an error.
enum YAMLComposer {
    static let stringTag = "tag:yaml.org,2002:str"
    static let valueTag = "tag:yaml.org,2002:value"

    /// The document's root node, nil when the text holds no document (empty, or comments only).
    /// The composition recurses once per nesting level: ``ConfigLimits`` bounds the depth first.
    static func compose(_ text: String) throws(YAMLError) -> YAMLNode? {
        var input = text  // withUTF8 may make the bytes contiguous: a copy, so `text` stays readable
        let result: Result<YAMLNode?, YAMLError> = input.withUTF8 { bytes in
            // No document (libyaml asserts on a null input pointer, which an empty buffer may have).
            guard let start = bytes.baseAddress, !bytes.isEmpty else { return .success(nil) }
            let parser = UnsafeMutablePointer<yaml_parser_t>.allocate(capacity: 1)
            defer { parser.deallocate() }
            guard yaml_parser_initialize(parser) == 1 else { return .failure(.memory) }
            defer { yaml_parser_delete(parser) }
            yaml_parser_set_encoding(parser, YAML_UTF8_ENCODING)
            yaml_parser_set_input_string(parser, start, bytes.count)
            var composer = Composition(parser: parser, text: text)
            do throws(YAMLError) {
                return .success(try composer.singleRoot())
            } catch {
                return .failure(error)
            }
        }
        return try result.get()
    }

    /// One event's contents, copied out of libyaml's memory.
    fileprivate struct Event {
        var type: yaml_event_type_t
        var anchor: String?
        var tag: String?
        var value = ""
        var style = YAMLScalar.Style.plain
        var mark: YAMLMark
    }

    fileprivate struct Composition {
        let parser: UnsafeMutablePointer<yaml_parser_t>
        let text: String
        var anchors: [String: YAMLNode] = [:]
        /// Collections open now: the composition recurses once per level, so a file nested
        /// deeper than ``maximumDepth`` (a kubeconfig, which no pre-scan bounds) is refused
        /// rather than exhausting the stack.
        var depth = 0
        static let maximumDepth = 512

        init(parser: UnsafeMutablePointer<yaml_parser_t>, text: String) {
            self.parser = parser
            self.text = text
        }

        mutating func singleRoot() throws(YAMLError) -> YAMLNode? {
            guard try next().type == YAML_STREAM_START_EVENT, try next().type != YAML_STREAM_END_EVENT else { return nil }
            // A document start: its root follows, then its end.
            let root = try node(from: next())
            _ = try next()
            let after = try next()
            guard after.type == YAML_STREAM_END_EVENT else {
                throw .syntax(
                    context: .init(text: "expected a single document in the stream", mark: YAMLMark(line: 1, column: 1)),
                    problem: "but found another document", mark: after.mark)
            }
            return root
        }

        mutating func node(from event: Event) throws(YAMLError) -> YAMLNode {
            let node: YAMLNode
            switch event.type {
            case YAML_ALIAS_EVENT:
                guard let anchor = event.anchor, let target = anchors[anchor] else {
                    throw .syntax(context: nil, problem: "found undefined alias", mark: event.mark)
                }
                return target
            case YAML_SCALAR_EVENT:
                node = .scalar(YAMLScalar(string: event.value, tag: event.tag, style: event.style, mark: event.mark))
            case YAML_SEQUENCE_START_EVENT where depth >= Self.maximumDepth, YAML_MAPPING_START_EVENT where depth >= Self.maximumDepth:
                throw .syntax(context: nil, problem: "nested deeper than \(Self.maximumDepth) levels", mark: event.mark)
            case YAML_SEQUENCE_START_EVENT:
                depth += 1
                defer { depth -= 1 }
                var items: [YAMLNode] = []
                var item = try next()
                while item.type != YAML_SEQUENCE_END_EVENT {
                    items.append(try self.node(from: item))
                    item = try next()
                }
                node = .sequence(YAMLSequence(nodes: items, tag: event.tag, mark: event.mark))
            case YAML_MAPPING_START_EVENT:
                depth += 1
                defer { depth -= 1 }
                var pairs: [(key: YAMLNode, value: YAMLNode)] = []
                var item = try next()
                while item.type != YAML_MAPPING_END_EVENT {
                    let key = try self.node(from: item)
                    let value = try self.node(from: next())
                    pairs.append((key, value))
                    item = try next()
                }
                node = .mapping(YAMLMapping(pairs: pairs, tag: event.tag, mark: event.mark))
            default:
                // libyaml's parser orders events by the grammar: nothing else starts a node.
                throw .syntax(context: nil, problem: "unexpected event \(event.type.rawValue)", mark: event.mark)
            }
            if let anchor = event.anchor { anchors[anchor] = node }
            return node
        }

        /// The next event, copied; libyaml's error as ``YAMLError`` when the text is not YAML.
        func next() throws(YAMLError) -> Event {
            var raw = yaml_event_t()
            guard yaml_parser_parse(parser, &raw) == 1 else { throw error() }
            defer { yaml_event_delete(&raw) }
            var event = Event(
                type: raw.type,
                mark: YAMLMark(line: Int(raw.start_mark.line) + 1, column: Int(raw.start_mark.column) + 1))
            switch raw.type {
            case YAML_ALIAS_EVENT:
                event.anchor = Self.string(raw.data.alias.anchor)
            case YAML_SCALAR_EVENT:
                let scalar = raw.data.scalar
                event.anchor = Self.string(scalar.anchor)
                event.tag = scalar.quoted_implicit == 1 ? YAMLComposer.stringTag : Self.string(scalar.tag)
                // A scalar may hold NUL: its length, not a C string.
                event.value = scalar.value.map { String(decoding: UnsafeBufferPointer(start: $0, count: scalar.length), as: UTF8.self) } ?? ""
                switch scalar.style {
                case YAML_SINGLE_QUOTED_SCALAR_STYLE: event.style = .singleQuoted
                case YAML_DOUBLE_QUOTED_SCALAR_STYLE: event.style = .doubleQuoted
                case YAML_LITERAL_SCALAR_STYLE: event.style = .literal
                case YAML_FOLDED_SCALAR_STYLE: event.style = .folded
                default: event.style = .plain
                }
            case YAML_SEQUENCE_START_EVENT:
                let start = raw.data.sequence_start
                event.anchor = Self.string(start.anchor)
                event.tag = start.implicit != 0 ? nil : Self.string(start.tag)
            case YAML_MAPPING_START_EVENT:
                let start = raw.data.mapping_start
                event.anchor = Self.string(start.anchor)
                event.tag = start.implicit != 0 ? nil : Self.string(start.tag)
            default:
                break
            }
            return event
        }

        /// The parser's error: its problem, mark and context, as libyaml wrote them.
        func error() -> YAMLError {
            let state = parser.pointee
            let problem = state.problem.map { String(cString: $0) } ?? "unknown problem"
            switch state.error {
            case YAML_MEMORY_ERROR:
                return .memory
            case YAML_READER_ERROR:
                // The byte offset, as libyaml counts and the message ("at byte N") says.
                return .reader(problem: problem, offset: Int(state.problem_offset))
            default:
                let context = state.context.map {
                    YAMLError.Context(
                        text: String(cString: $0),
                        mark: YAMLMark(line: Int(state.context_mark.line) + 1, column: Int(state.context_mark.column) + 1))
                }
                return .syntax(
                    context: context, problem: problem,
                    mark: YAMLMark(line: Int(state.problem_mark.line) + 1, column: Int(state.problem_mark.column) + 1))
            }
        }

        /// An anchor or tag: a C string, invalid UTF-8 repaired.
        static func string(_ pointer: UnsafeMutablePointer<yaml_char_t>?) -> String? {
            guard let pointer else { return nil }
            return String.decodeCString(pointer, as: UTF8.self, repairingInvalidCodeUnits: true)?.result
        }
    }
}
