// SPDX-License-Identifier: Apache-2.0
import ArgumentParser
import FanoutCore
import ReusePortLB

/// `udp-fanout withdraw`: remove the announce routes a process that is gone left behind.
struct Withdraw: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Remove the routes announcing a configuration's addresses (after the daemon is gone: the unit's ExecStopPost).",
        discussion: """
            A daemon that ends without a stop (kill -9, a crash, systemd's SIGKILL after \
            TimeoutStopSec=) leaves its announce routes in the kernel, and the routing daemon goes \
            on announcing the node (docs/fleet.md). This removes the routes of the file's \
            announce addresses, in its table with its protocol number, and nothing else; the \
            shipped unit runs it as ExecStopPost=, after every end of the daemon. Do not run it \
            while the daemon runs: it would withdraw a node that serves (use udp-fanout drain). \
            Exit status: 0 done (or nothing to remove), 1 the kernel refused, 2 the file cannot \
            be read or is invalid.
            """)

    @Option(name: [.customShort("c"), .long], help: "The configuration file the daemon ran with.")
    var config = "config.yaml"

    func run() throws {
        let parsed: FanoutConfig
        do {
            parsed = try ConfigParser.parse(try readFile(config))
        } catch {
            printError("udp-fanout withdraw: \(error)")
            throw ExitCode(2)
        }
        guard let announce = parsed.announce else { return }
        let routes = KernelHostRoutes()
        var failed = false
        for address in announce.addresses {
            do {
                guard try routes.list(table: announce.table, protocolNumber: announce.protocolNumber).contains(address) else { continue }
                try routes.remove(address, table: announce.table, protocolNumber: announce.protocolNumber)
                print("udp-fanout withdraw: removed the route announcing \(address) (table \(announce.table), protocol \(announce.protocolNumber))")
            } catch {
                printError("udp-fanout withdraw: \(address): \(error)")
                failed = true
            }
        }
        if failed { throw ExitCode(1) }
    }
}
