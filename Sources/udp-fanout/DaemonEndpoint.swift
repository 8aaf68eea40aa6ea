// SPDX-License-Identifier: Apache-2.0
import ArgumentParser
import FanoutCore

/// How `status` and `drain` find a running daemon: its HTTP endpoint, from its configuration
/// file's metrics.bind (-c) or given (--endpoint).
struct DaemonEndpoint: ParsableArguments {
    @Option(name: [.customShort("c"), .long], help: "The configuration file the daemon runs with: its metrics.bind is the endpoint.")
    var config = "config.yaml"

    @Option(help: "The daemon's HTTP endpoint, http://HOST:PORT or HOST:PORT, e.g. http://127.0.0.1:9090 (instead of reading -c).")
    var endpoint: String?

    func validate() throws {
        if let endpoint {
            do {
                _ = try StatusClient.statusURL(endpoint)
            } catch {
                throw ValidationError("\(error)")
            }
        }
    }

    /// The endpoint's URL; a file that cannot be read or has no endpoint exits 2, said as `command`.
    func url(_ command: String) throws -> String {
        do {
            return try endpoint ?? StatusClient.endpoint(configFile: config)
        } catch {
            printError("udp-fanout \(command): \(error)")
            throw ExitCode(2)
        }
    }
}
