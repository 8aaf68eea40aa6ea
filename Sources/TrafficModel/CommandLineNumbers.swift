// SPDX-License-Identifier: Apache-2.0
/// ArgumentParser reads a token such as `-5` as an option, so `--rate -5` ends in "Missing value
/// for '--rate'" and a negative positional in "Missing expected argument": messages about options,
/// not about the number. This rewrites the command line before ArgumentParser sees it: a
/// negative number after an option that takes a value becomes `--option=-5` (so the tool's own
/// validation names the problem), and a negative positional gives one clear message.
public enum CommandLineNumbers {
    /// - Parameters:
    ///   - arguments: the arguments without the executable.
    ///   - positionals: the positional arguments' names in order, e.g. `["ip", "port", "count"]`.
    ///   - flags: the options that take no value (`--gso`), which never consume the next token.
    /// - Returns: the rewritten arguments, or the message for a negative positional.
    public static func rewrite(_ arguments: [String], positionals: [String], flags: Set<String>) -> Result<[String], Message> {
        var result: [String] = []
        var position = 0
        var index = 0
        while index < arguments.count {
            let token = arguments[index]
            if token == "--" {
                result += arguments[index...]
                break
            }
            if token.hasPrefix("--") && !token.contains("=") && !flags.contains(token) && token != "--help" {
                // An option with its value in the next token, whatever that looks like.
                if index + 1 < arguments.count, isNegativeNumber(arguments[index + 1]) {
                    result.append(token + "=" + arguments[index + 1])
                    index += 2
                    continue
                }
                result.append(token)
                if index + 1 < arguments.count {
                    result.append(arguments[index + 1])
                }
                index += 2
                continue
            }
            if isNegativeNumber(token) {
                let name = position < positionals.count ? positionals[position] : "argument \(position + 1)"
                return .failure(Message(text: "<\(name)> must not be negative (got \(token))"))
            }
            if !token.hasPrefix("-") { position += 1 }
            result.append(token)
            index += 1
        }
        return .success(result)
    }

    /// The text of a refused command line.
    public struct Message: Error, Equatable {
        public let text: String
        public init(text: String) { self.text = text }
    }

    static func isNegativeNumber(_ token: String) -> Bool {
        guard token.hasPrefix("-"), token.count > 1 else { return false }
        return Double(token) != nil
    }
}
