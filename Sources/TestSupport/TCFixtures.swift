// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// End-to-end fixtures on a ``Topology``: a tc_ebpf listener's config and the daemon in the proxy
/// namespace, the check that nothing of tc_ebpf is left attached, and what every mode's end-to-end
/// tests use (config files, collectors on the backends, metrics, who received which source).
public enum TCFixtures {
    public static let port = 6000

    /// A config with one tc_ebpf (or `mode`: xdp) listener on the proxy's client-facing interface.
    public static func config(_ topology: Topology, backends: [Int], balancing: String = "round_robin", attach: String = "auto",
                              ipv6: Bool = false, metricsPort: Int = 9464, mode: String = "tc_ebpf") -> String {
        let downstreams = backends.map { n in
            let address = ipv6 ? "[\(Topology.backendIPv6(n))]:\(port)" : "\(Topology.backendIPv4(n)):\(port)"
            return "      - {name: b\(n), address: \"\(address)\"}"
        }.joined(separator: "\n")
        return """
            listeners:
              - name: tc
                bind: "\(ipv6 ? "[2001:db8::1]" : "198.18.0.1"):5514"
                interface: \(topology.proxyInterface)
                mode: \(mode)
                balancing: \(balancing)
                settings: {tc_attach: \(attach)}
                downstream:
            \(downstreams)
            metrics: {enabled: true, bind: "127.0.0.1:\(metricsPort)"}
            """
    }

    /// Writes `config`, starts udp-fanout in the proxy namespace and waits until the listener
    /// is in the maps. The caller removes the returned file.
    public static func start(_ topology: Topology, _ config: String, _ name: String) throws -> (daemon: Child, file: URL) {
        let file = try write(config, name)
        let daemon = try Child("udp-fanout", ["-c", file.path], prefix: topology.prefix(topology.proxy))
        try daemon.waitFor("registered listener in eBPF map")
        return (daemon, file)
    }

    public static func write(_ text: String, _ name: String) throws -> URL {
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("\(name)-\(UUID().uuidString).yaml")
        try text.write(to: file, atomically: true, encoding: .utf8)
        return file
    }

    /// 64 more client addresses, 198.18.0.10 to 198.18.0.73 (`publisher --sources`), for tests
    /// that follow each source.
    public static let clientSources = "198.18.0.10-198.18.0.73"

    public static func addClientSources(_ topology: Topology) throws {
        let device = "cp\(topology.suffix.prefix(8))"
        for n in 10..<74 { try topology.exec(topology.client, ["/usr/sbin/ip", "addr", "add", "198.18.0.\(n)/24", "dev", device]) }
    }

    /// One collector per backend namespace on the backend's address.
    public static func collectors(_ topology: Topology, ipv6: Bool = false) throws -> [Child] {
        try topology.backends.enumerated().map { index, namespace in
            let address = ipv6 ? Topology.backendIPv6(index + 1) : Topology.backendIPv4(index + 1)
            let child = try Child("collector", [address, "\(port)", "0", "1", "--rcvbuf", "8388608"], prefix: topology.prefix(namespace))
            try child.waitFor("ready")
            return child
        }
    }

    public static func metrics(_ topology: Topology, port: Int = 9464) throws -> String {
        try topology.exec(topology.proxy, ["curl", "-s", "http://127.0.0.1:\(port)/metrics"])
    }

    /// xdp: the backends' veth ends with GRO (a veth transmits XDP frames only then, so the
    /// proxy's ends take redirects) and, with `checksums`, the client's UDP checksums computed at
    /// send (tx off), as datagrams from a NIC arrive (an offloaded one XDP passes to tc).
    public static func prepareXDP(_ topology: Topology, gro: Bool = true, checksums: Bool = true) throws {
        if gro {
            for (index, backend) in topology.backends.enumerated() {
                _ = try topology.exec(backend, ["/usr/sbin/ethtool", "-K", "b\(index + 1)\(topology.suffix.prefix(8))", "gro", "on"])
            }
        }
        if checksums {
            _ = try topology.exec(topology.client, ["/usr/sbin/ethtool", "-K", "cp\(topology.suffix.prefix(8))", "tx", "off"])
        }
    }

    /// How many of `datagrams` finished checksums the xdp program may take for offloaded ones
    /// (`checksum_partial`): a finished UDP checksum equals the pseudo-header's sum about once
    /// in 65,536 datagrams, and such a datagram is rightly passed to tc. Far above that rate, a
    /// real fault shows.
    public static func coincidentalPartials(_ datagrams: Int) -> Int { max(3, datagrams / 5000) }

    /// Nothing of ours is left: no program named fanout_tc or fanout_xfwd loaded, no filter,
    /// tcx link or XDP program on the interface, no lock file.
    public static func expectNothingLeft(_ topology: Topology) throws {
        let programs = try programsAfterRelease()
        #expect(!programs.contains("fanout_tc"), "a fanout_tc program is still loaded: \(programs)")
        #expect(!programs.contains("fanout_xfwd"), "a fanout_xfwd program is still loaded: \(programs)")
        let link = try topology.exec(topology.proxy, ["/usr/sbin/ip", "link", "show", "dev", topology.proxyInterface])
        #expect(!link.contains("xdp"), "ip link show: \(link)")
        let filters = try topology.exec(topology.proxy, ["tc", "filter", "show", "dev", topology.proxyInterface, "ingress"])
        #expect(filters.isEmpty, "tc filter show: \(filters)")
        let net = try topology.exec(topology.proxy, ["/usr/sbin/bpftool", "net", "show", "dev", topology.proxyInterface])
        #expect(!net.contains("fanout_tc"), "bpftool net show: \(net)")
        let locks = (try? FileManager.default.contentsOfDirectory(atPath: "/run/udp-fanout")) ?? []
        #expect(!locks.contains { $0.contains(topology.proxyInterface) }, "lock files: \(locks)")
    }

    public static func forwardedCounts(_ topology: Topology) throws -> (total: Int, b1: Int, b2: Int, b3: Int) {
        let text = try metrics(topology)
        func value(_ prefix: String, _ filter: String) -> Int {
            let line = text.split(separator: "\n").first { $0.hasPrefix(prefix) && $0.contains(filter) }
            return line.flatMap { $0.split(separator: " ").last }.flatMap { Int($0) } ?? -1
        }
        let series = "udp_fanout_downstream_packets_forwarded_total"
        return (value("udp_fanout_packets_forwarded_total", "listener=\"tc\""),
                value(series, "downstream=\"b1\""), value(series, "downstream=\"b2\""), value(series, "downstream=\"b3\""))
    }

    /// `bpftool prog show`, waiting up to 1 s for fanout_tc (and fanout_xfwd) to go: the kernel frees a program
    /// after an RCU grace period once its last link or descriptor is closed.
    public static func programsAfterRelease() throws -> String {
        var programs = ""
        for _ in 0..<50 {
            programs = try run("/usr/sbin/bpftool", ["prog", "show"]).output
            if !programs.contains("fanout_tc") && !programs.contains("fanout_xfwd") { break }
            usleep(20_000)
        }
        return programs
    }

    public static func received(_ reports: [[String: Any]]) -> [Int] { reports.map { $0.int("received") } }

    /// Which backend (index) saw each source address; an issue for a source seen at two.
    public static func observedOwners(_ reports: [[String: Any]]) -> [String: Int] {
        var owner: [String: Int] = [:]
        for (index, report) in reports.enumerated() {
            for source in report.object("sources").keys {
                #expect(owner[source] == nil, "source \(source) reached two backends")
                owner[source] = index
            }
        }
        return owner
    }
}
