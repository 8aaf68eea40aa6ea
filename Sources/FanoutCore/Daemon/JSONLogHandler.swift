// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import Logging
import ReusePortLB

/// `--log-format json`: one JSON object per line on standard error, for log shippers. Stable keys
/// first (`time`, RFC 3339 in UTC with milliseconds; `level`; `message`; `label`), then the
/// line's metadata (`listener`, `downstream`, `pool`, `error`, …) as top-level keys; a metadata
/// key that is one of the four is written with a leading underscore.
package struct JSONLogHandler: LogHandler {
    package var metadata: Logger.Metadata = [:]
    package var logLevel: Logger.Level = .info
    private let label: String

    package init(label: String) {
        self.label = label
    }

    package subscript(metadataKey key: String) -> Logger.Metadata.Value? {
        get { metadata[key] }
        set { metadata[key] = newValue }
    }

    static let reserved: Set<String> = ["time", "level", "message", "label"]

    package func log(event: LogEvent) {
        var merged = metadata
        if let extra = event.metadata { merged.merge(extra) { _, new in new } }
        print(Self.line(time: Self.now(), level: event.level, message: "\(event.message)", label: label, metadata: merged))
    }

    /// One log line (without its newline).
    static func line(time: String, level: Logger.Level, message: String, label: String, metadata: Logger.Metadata) -> String {
        var fields = ["\"time\":" + JSONText.quote(time), "\"level\":" + JSONText.quote(level.rawValue),
                      "\"message\":" + JSONText.quote(message), "\"label\":" + JSONText.quote(label)]
        for (key, value) in metadata.sorted(by: { $0.key < $1.key }) {
            fields.append(JSONText.quote(reserved.contains(key) ? "_" + key : key) + ":" + json(value))
        }
        return "{" + fields.joined(separator: ",") + "}"
    }

    static func json(_ value: Logger.Metadata.Value) -> String {
        switch value {
        case .string(let text): return JSONText.quote(text)
        case .stringConvertible(let convertible): return JSONText.quote(convertible.description)
        case .array(let values): return "[" + values.map(json).joined(separator: ",") + "]"
        case .dictionary(let values):
            return "{" + values.sorted { $0.key < $1.key }.map { JSONText.quote($0.key) + ":" + json($0.value) }.joined(separator: ",") + "}"
        }
    }

    /// Now, as 2026-11-24T21:00:00.123Z.
    static func now() -> String {
        let spec = WallClock.now()
        var seconds = spec.tv_sec
        var parts = tm()
        gmtime_r(&seconds, &parts)
        func two(_ value: Int32) -> String { value < 10 ? "0\(value)" : "\(value)" }
        let milliseconds = Int(spec.tv_nsec / 1_000_000)
        let fraction = milliseconds < 10 ? "00\(milliseconds)" : milliseconds < 100 ? "0\(milliseconds)" : "\(milliseconds)"
        return "\(parts.tm_year + 1900)-\(two(parts.tm_mon + 1))-\(two(parts.tm_mday))T\(two(parts.tm_hour)):\(two(parts.tm_min)):\(two(parts.tm_sec)).\(fraction)Z"
    }

    /// A whole line in one write, so lines from several threads never mix.
    private func print(_ line: String) {
        var text = line + "\n"
        text.withUTF8 { _ = write(2, $0.baseAddress, $0.count) }
    }
}

/// The wall clock (CLOCK_REALTIME): log times and the times `/status` reports.
enum WallClock {
    static func now() -> timespec {
        var spec = timespec()
        clock_gettime(CLOCK_REALTIME, &spec)
        return spec
    }

    /// Seconds since the epoch.
    static func seconds() -> Double {
        let spec = now()
        return Double(spec.tv_sec) + Double(spec.tv_nsec) / 1e9
    }
}
