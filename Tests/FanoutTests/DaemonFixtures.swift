// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import Foundation
import Logging
import Testing
import TestSupport
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// Fixtures of the engine that several suites use: running it inside a ``Topology``'s proxy
/// namespace, and the downstream the source table gives each source.
enum DaemonFixtures {
    /// Starts the engine in-process inside the topology's proxy namespace (its tc_ebpf
    /// listeners attach there); the caller stops it with ``stopInProxy(_:_:)``.
    static func startInProxy(_ topology: Topology, _ yaml: String) throws -> FanoutDaemon {
        let config = try ConfigParser.parse(yaml)
        try config.validate(localAddresses: [])
        var logger = Logger(label: "fanout-in-proxy")
        logger.logLevel = .warning
        let daemon = FanoutDaemon(config: config, configPath: nil, logger: logger)
        let started = inNetworkNamespace(topology.proxy) { () -> String? in
            do { try daemon.start(); return nil } catch { return "\(error)" }
        }
        try #require(started == .some(nil), "start in \(topology.proxy): \(String(describing: started))")
        return daemon
    }

    static func stopInProxy(_ topology: Topology, _ daemon: FanoutDaemon) {
        _ = inNetworkNamespace(topology.proxy) { daemon.shutdown() }
    }

    /// The downstream each source gets from a table over `downstreams` (what every mode computes).
    static func owners(_ sources: [String], _ downstreams: [Downstream]) -> [String: SocketAddress] {
        let table = SourceTable.entries(downstreams, size: DownstreamSelector.tableSize)
        var result: [String: SocketAddress] = [:]
        for source in sources {
            var storage = sockaddr_storage()
            _ = SocketAddress(ip: IPAddress(source)!, port: 0).withSockAddr { address, length in
                withUnsafeMutableBytes(of: &storage) { $0.copyMemory(from: UnsafeRawBufferPointer(start: address, count: Int(length))) }
            }
            let hash = withUnsafePointer(to: &storage) { DownstreamSelector.sourceHash($0) }
            result[source] = downstreams[Int(table[Int(rplb_reduce(hash, UInt32(table.count)))])].address
        }
        return result
    }
}
