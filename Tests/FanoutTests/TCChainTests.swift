import Foundation
import Testing
import TestSupport

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
        let collectors = try TCEndToEndTests.collectors(topology)
        let (daemon, file) = try TCEndToEndTests.start(topology, TCEndToEndTests.config(topology, backends: [1], attach: attach), "tc-chain")
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
        try TCEndToEndTests.expectNothingLeft(topology)
        #expect(try collectors[0].stop().int("received") == 300)
    }
}
