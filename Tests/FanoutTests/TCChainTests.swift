// SPDX-License-Identifier: Apache-2.0
import CLibBPF
import Foundation
import Logging
import ReusePortLB
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// tc_ebpf shares the ingress hook with other parties' filters and programs (firewalls,
/// Cilium): what is not ours continues down the chain, and what we remove is only ours.
@Suite("tc_ebpf in a chain with other filters", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct TCChainTests {
    @Test("Traffic that is not ours reaches a later filter or TCX program; ours does not", arguments: ["clsact", "tcx"])
    func notOursContinues(attach: String) throws {
        let topology = try Topology(backends: 1)
        let collectors = try TCFixtures.collectors(topology)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1], attach: attach), "tc-chain")
        defer { try? FileManager.default.removeItem(at: file) }
        #expect(daemon.stderr.contains("attach=\(attach)"), "\(daemon.stderr)")
        let counter = try TCChainCounter(attach == "tcx" ? .tcx : .clsact, namespace: topology.proxy, interface: topology.proxyInterface)
        // 200 datagrams to a port no listener has: not ours, for a socket of the proxy's own.
        let local = try Child("collector", ["198.18.0.1", "5599", "0", "1"], prefix: topology.prefix(topology.proxy))
        try local.waitFor("ready")
        #expect(try Child("publisher", ["198.18.0.1", "5599", "200"], prefix: topology.prefix(topology.client)).wait() == 0)
        usleep(200_000)
        #expect(try local.stop().int("received") == 200, "not ours still reaches the local stack")
        let afterOthers = counter.count
        #expect(afterOthers >= 200, "the later \(attach) program saw \(afterOthers) packets of 200 not ours")
        // Ours are redirected: the later program does not see them.
        #expect(try Child("publisher", ["198.18.0.1", "5514", "300"], prefix: topology.prefix(topology.client)).wait() == 0)
        usleep(200_000)
        #expect(counter.count - afterOthers < 50, "forwarded datagrams do not continue: \(counter.count - afterOthers) seen")
        counter.remove()
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        try TCFixtures.expectNothingLeft(topology)
        #expect(try collectors[0].stop().int("received") == 300)
    }

    @Test("A clsact qdisc we created is kept, with its filters, while another party's filter is on it; ours alone goes")
    func foreignFilterKeepsQdisc() throws {
        let topology = try Topology(backends: 1)
        let (daemon, file) = try TCFixtures.start(topology, TCFixtures.config(topology, backends: [1], attach: "clsact"), "tc-foreign")
        defer { try? FileManager.default.removeItem(at: file) }
        // Added after our start, on the qdisc udp-fanout created.
        let counter = try TCChainCounter(.clsact, namespace: topology.proxy, interface: topology.proxyInterface)
        defer { counter.remove() }
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        #expect(daemon.stderr.contains("kept the clsact qdisc"), "says why the qdisc stays: \(daemon.stderr)")
        let filters = try topology.exec(topology.proxy, ["tc", "filter", "show", "dev", topology.proxyInterface, "ingress"])
        #expect(filters.contains("chain_count"), "the other party's filter survives our exit: \(filters)")
        #expect(!filters.contains("fanout_tc"), "ours is gone: \(filters)")
        let qdiscs = try topology.exec(topology.proxy, ["tc", "qdisc", "show", "dev", topology.proxyInterface])
        #expect(qdiscs.contains("clsact"), "\(qdiscs)")
        let programs = try TCFixtures.programsAfterRelease()
        #expect(!programs.contains("fanout_tc"), "\(programs)")
    }

    /// Ids of the BPF programs this process holds a descriptor to, with their names.
    static func heldPrograms() -> [UInt32: String] {
        var held: [UInt32: String] = [:]
        for entry in (try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/fdinfo")) ?? [] {
            guard let text = try? String(contentsOfFile: "/proc/self/fdinfo/\(entry)", encoding: .utf8),
                  let line = text.split(separator: "\n").first(where: { $0.hasPrefix("prog_id:") }),
                  let id = UInt32(line.split(separator: "\t").last ?? "") else { continue }
            let fd = bpf_prog_get_fd_by_id(id)
            guard fd >= 0 else { continue }
            defer { close(fd) }
            var info = bpf_prog_info()
            var length = UInt32(MemoryLayout<bpf_prog_info>.size)
            guard bpf_obj_get_info_by_fd(fd, &info, &length) == 0 else { continue }
            held[id] = withUnsafeBytes(of: info.name) { String(decoding: $0.prefix(while: { $0 != 0 }), as: UTF8.self) }
        }
        return held
    }

    @Test("An attach that fails releases the program it loaded")
    func failedAttachReleasesProgram() throws {
        let topology = try Topology(backends: 1)
        // Another program in udp-fanout's clsact slot: the attach is refused.
        let squatter = try TCChainCounter(.clsact, namespace: topology.proxy, interface: topology.proxyInterface,
                                          handle: TCAttachment.filterHandle, priority: TCAttachment.filterPriority)
        defer { squatter.remove() }
        var settings = Settings()
        settings.tcAttach = .clsact
        let listener = Listener(name: "tc", bind: SocketAddress("198.18.0.1:5514")!, interface: topology.proxyInterface, mode: .tcEBPF,
                                downstreams: [Downstream(name: "b1", address: SocketAddress("198.18.1.2:6000")!)], settings: settings)
        let dataplane = TCDataplane(logger: Logger(label: "test"))
        let before = Self.heldPrograms()
        let outcome = squatter.inNamespace { _ in
            do {
                _ = try dataplane.register(listener)
                return "registered"
            } catch {
                return "\(error)"
            }
        }
        #expect(outcome?.contains("holds another program, 'chain_count'") == true, "\(outcome ?? "")")
        let leaked = Self.heldPrograms().filter { before[$0.key] == nil && $0.value == "fanout_tc" }
        #expect(leaked.isEmpty, "fanout_tc still loaded after the failed attach: \(leaked)")
    }
}
