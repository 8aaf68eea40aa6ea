// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import Foundation
import ReusePortLB
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// What the replication suites share (userspace, tc_ebpf, af_xdp): socket addresses as the
/// forwarding code sees them, which exporters a `sample` keeps, nfcapd as a collector, and pools
/// written straight into the tc program's maps.
enum ReplicationFixtures {
    static func storage(_ address: SocketAddress) -> sockaddr_storage {
        var storage = sockaddr_storage()
        address.withSockAddr { pointer, length in
            withUnsafeMutableBytes(of: &storage) { $0.copyMemory(from: UnsafeRawBufferPointer(start: pointer, count: Int(length))) }
        }
        return storage
    }

    /// The labels of pool `pool` of a listener (the loopback suites': `rep`, userspace).
    static func poolLabels(_ pool: String, listener: String = "rep", mode: String = "userspace") -> String {
        "listener=\"\(listener)\",mode=\"\(mode)\",pool=\"\(pool)\""
    }

    /// `udp_fanout_pool_datagrams_total` of `pool` by outcome (absent series left out).
    static func outcomes(_ text: String, _ pool: String, listener: String = "rep", mode: String = "userspace") -> [String: Int] {
        var values: [String: Int] = [:]
        for outcome in ["forwarded", "dropped", "sampled_out", "filtered_out"] {
            values[outcome] = metric(text, "udp_fanout_pool_datagrams_total", poolLabels(pool, listener: listener, mode: mode) + ",outcome=\"\(outcome)\"")
        }
        return values
    }

    /// The addresses of `exporters` a pool with `sample` keeps, as userspace decides it.
    static func sampled(_ exporters: [String], sample: UInt32) -> [String] {
        exporters.filter { exporter in
            var storage = storage(SocketAddress(ip: IPAddress(exporter)!, port: 1))
            return rplb_reduce(DownstreamSelector.sourceHash(&storage, seed: PoolPlan.sampleSeed), sample) == 0
        }
    }
}

/// An nfcapd on `port` of `address` (127.0.0.1 and a free port, or a backend namespace's
/// address: `prefix` runs it there), writing into a directory of its own.
final class NetFlowCollector {
    let port: UInt16
    let directory: URL
    let child: Child

    init(address: String = "127.0.0.1", port given: UInt16? = nil, prefix: [String] = []) throws {
        port = given ?? freePort()
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("nfcapd-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        // nfcapd writes its file when SIGTERM's handler runs: started with signals unblocked.
        child = try Child.unblocked("/usr/bin/nfcapd", ["-b", address, "-p", "\(port)", "-w", directory.path, "-t", "3600", "-B", "8388608"], prefix: prefix)
    }

    deinit { try? FileManager.default.removeItem(at: directory) }

    /// Stops it (it writes its file on SIGTERM) and returns the flows by exporter address.
    func flowsByExporter() throws -> [String: Int] {
        child.signal(SIGTERM)
        #expect(child.wait(seconds: 10) == 0, "nfcapd: \(child.stderr)")
        let decoded = try run("/usr/bin/nfdump", ["-R", directory.path, "-q", "-o", "fmt:%ra"])
        #expect(decoded.status == 0, "\(decoded.output)")
        var flows: [String: Int] = [:]
        for line in decoded.output.split(separator: "\n") {
            // Only addresses: an empty collection prints "No matching flows" (operator trial, issue 41).
            let exporter = line.trimmingCharacters(in: .whitespaces)
            if IPAddress(exporter) != nil { flows[exporter, default: 0] += 1 }
        }
        return flows
    }
}

/// A collector that decodes NetFlow v9 / IPFIX and tells the records it decoded by exporter.
protocol FlowCollector: AnyObject {
    var port: UInt16 { get }
    var child: Child { get }
    /// Stops it and returns the records it decoded, by exporter address.
    func flowsByExporter() throws -> [String: Int]
}

extension NetFlowCollector: FlowCollector {}

/// pmacct's nfacctd with a print plugin aggregating by exporter and the flow's addresses, ports
/// and protocol: the publisher's records each have their own source port, so each decoded record
/// is one line of its CSV output.
final class NFAcctCollector: FlowCollector {
    let port: UInt16
    let directory: URL
    let child: Child

    init(address: String = "127.0.0.1", port given: UInt16? = nil, prefix: [String] = []) throws {
        try #require(FileManager.default.isExecutableFile(atPath: "/usr/sbin/nfacctd"), "nfacctd missing: make test installs pmacct (scripts/setup.sh)")
        port = given ?? freePort()
        directory = FileManager.default.temporaryDirectory.appendingPathComponent("nfacctd-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        let config = directory.appendingPathComponent("nfacctd.conf")
        try """
            daemonize: false
            nfacctd_ip: \(address)
            nfacctd_port: \(port)
            nfacctd_pipe_size: 8388608
            plugins: print[p]
            aggregate[p]: peer_src_ip, src_host, dst_host, src_port, dst_port, proto
            print_output[p]: csv
            print_output_file[p]: \(directory.path)/out-%s.csv
            print_output_file_append[p]: true
            print_refresh_time[p]: 1
            print_history[p]: 1m

            """.write(to: config, atomically: true, encoding: .utf8)
        child = try Child.unblocked("/usr/sbin/nfacctd", ["-f", config.path], prefix: prefix)
    }

    deinit { try? FileManager.default.removeItem(at: directory) }

    /// Stops it (SIGINT: its print plugin writes what it holds) and counts its CSV lines by exporter.
    func flowsByExporter() throws -> [String: Int] {
        child.signal(SIGINT)
        _ = child.wait(seconds: 10)
        // The plugin process writes its last lines as it exits: read until the count holds still.
        var flows: [String: Int] = [:]
        var last = -1
        for _ in 0..<25 {
            flows = [:]
            let files = (try? FileManager.default.contentsOfDirectory(atPath: directory.path)) ?? []
            for file in files where file.hasSuffix(".csv") {
                let text = (try? String(contentsOfFile: directory.appendingPathComponent(file).path, encoding: .utf8)) ?? ""
                // Only lines that start with an address: titles and markers are not records.
                for line in text.split(separator: "\n") {
                    if let exporter = line.split(separator: ",").first.map(String.init), IPAddress(exporter) != nil { flows[exporter, default: 0] += 1 }
                }
            }
            let count = flows.values.reduce(0, +)
            if count == last { break }
            last = count
            usleep(200_000)
        }
        return flows
    }
}

/// Replication pools written straight into the tc program's maps (what TCListener does through
/// its reload transaction), for BPF_PROG_TEST_RUN.
extension TCProgramFixture {
    /// A pool of the listener: its own id in the program's listener id space.
    struct PoolSpec {
        var id: UInt32
        var policy: fanout_policy
        var members: [Downstream]
        var sample: UInt32 = 1
        var sources: [SourcePrefix] = []
    }

    static func member(_ name: String, _ address: String) -> Downstream { Downstream(name: name, address: SocketAddress(address)!) }

    /// Writes a listener with its own backends `own` and `pools` (counters and rotations zeroed).
    /// - Parameter reserved: the entry's flags (FANOUT_LISTENER_RATE, ...).
    func addListener(bind: SocketAddress, id: UInt32, own: [Downstream], pools: [PoolSpec], reserved: UInt32 = 0) throws {
        program.resetListener(id: id)
        try program.writeSet(id: id, generation: 0, BackendSet(downstreams: own, balancing: .roundRobin, slots: Dictionary(uniqueKeysWithValues: own.enumerated().map { ($1.name, UInt16($0)) })))
        var entry = fanout_listener()
        entry.id = id
        entry.policy = FANOUT_POLICY_ROUND_ROBIN.rawValue
        entry.reserved = reserved
        entry.pool_count = UInt32(pools.count)
        var records: [fanout_pool] = []
        for pool in pools {
            program.resetListener(id: pool.id)
            for slot in 0..<pool.members.count {
                program.zeroPerCPU(program.backendStats, key: pool.id * UInt32(FANOUT_MAX_BACKENDS) + UInt32(slot), as: fanout_backend_stats.self)
            }
            let slots = Dictionary(uniqueKeysWithValues: pool.members.enumerated().map { ($1.name, UInt16($0)) })
            try program.writeSet(id: pool.id, generation: 0, BackendSet(downstreams: pool.members, balancing: pool.policy == FANOUT_POLICY_SOURCE_IP ? .sourceIP : .roundRobin, slots: slots))
            try program.writePoolSources(key: pool.id * 2, pool.sources)
            var record = fanout_pool()
            record.id = pool.id
            record.policy = pool.policy.rawValue
            record.sample = pool.sample
            record.flags = pool.sources.isEmpty ? 0 : FANOUT_POOL_SOURCES
            records.append(record)
        }
        withUnsafeMutableBytes(of: &entry.pools) { raw in
            for (index, record) in records.enumerated() { raw.storeBytes(of: record, toByteOffset: index * MemoryLayout<fanout_pool>.stride, as: fanout_pool.self) }
        }
        try program.putListener(bind, ifindex: UInt32(ifindex), entry)
    }

    /// A pool's counters: offered, forwarded, dropped, sampled out, filtered out, and each verdict.
    func pool(_ id: UInt32) -> (received: UInt64, forwarded: UInt64, dropped: UInt64, sampledOut: UInt64, filteredOut: UInt64, verdicts: [UInt64]) {
        let read = program.poolStats(id: id)
        let forwarded = read.verdicts[Int(FANOUT_VERDICT_FORWARDED.rawValue)]
        return (read.received, forwarded, read.verdicts.reduce(0, +) - forwarded, read.sampledOut, read.filteredOut, read.verdicts)
    }
}
