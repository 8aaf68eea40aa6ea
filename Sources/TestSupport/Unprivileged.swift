// SPDX-License-Identifier: Apache-2.0
import Foundation

#if canImport(Glibc)
import Glibc
#endif

/// udp-fanout run as uid nobody with chosen capabilities (setpriv).
public enum Unprivileged {
    /// setpriv's arguments that run a command as uid nobody with exactly `capabilities`.
    public static func asNobody(_ capabilities: [String]) -> [String] {
        let list = (["-all"] + capabilities.map { "+\($0)" }).joined(separator: ",")
        return ["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                "--inh-caps=\(list)", "--ambient-caps=\(list)", "--bounding-set=\(list)", "--"]
    }

    /// A copy of udp-fanout and its configuration that uid nobody can read and run.
    public final class Scratch {
        public let directory = URL(fileURLWithPath: "/tmp").appendingPathComponent("fanout-caps-\(UUID().uuidString)")
        public var binary: String { directory.appendingPathComponent("udp-fanout").path }
        public var config: String { directory.appendingPathComponent("config.yaml").path }

        public init(_ yaml: String) throws {
            try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
            try FileManager.default.copyItem(atPath: binaryDirectory.appendingPathComponent("udp-fanout").path, toPath: binary)
            try yaml.write(toFile: config, atomically: true, encoding: .utf8)
            chmod(directory.path, 0o755)
            chmod(binary, 0o755)
            chmod(config, 0o644)
        }

        deinit { try? FileManager.default.removeItem(at: directory) }
    }
}
