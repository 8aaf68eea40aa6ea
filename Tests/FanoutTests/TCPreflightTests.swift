// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// `udp-fanout --check` checks what it can for tc_ebpf listeners without side effects: the
/// interface exists, forwarding is enabled, a route to each downstream.
@Suite("udp-fanout --check for tc_ebpf", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct TCPreflightTests {
    static func config(interface: String, downstream: String) -> String {
        """
        listeners:
          - name: tc
            bind: "198.18.0.1:5514"
            interface: \(interface)
            mode: tc_ebpf
            downstream:
              - {name: b1, address: "\(Topology.backendIPv4(1)):6000"}
              - {name: far, address: "\(downstream):6000"}
        """
    }

    /// Runs `udp-fanout --check` on `text` in the proxy namespace.
    static func check(_ topology: Topology, _ text: String) throws -> (status: Int32, stdout: String, stderr: String) {
        let file = try TCFixtures.write(text, "tc-check")
        defer { try? FileManager.default.removeItem(at: file) }
        let child = try Child("udp-fanout", ["--check", "-c", file.path], prefix: topology.prefix(topology.proxy))
        let status = child.wait()
        return (status, child.stdout, child.stderr)
    }

    @Test("A missing interface, a downstream without a route, forwarding off: exit 2, one line each naming the key and the fix; nothing attached")
    func problems() throws {
        let topology = try Topology(backends: 1)
        let good = try Self.check(topology, Self.config(interface: topology.proxyInterface, downstream: Topology.backendIPv4(1)))
        #expect(good.status == 0, "a sound config passes: \(good.stderr)")

        let missing = try Self.check(topology, Self.config(interface: "nosuch0", downstream: Topology.backendIPv4(1)))
        #expect(missing.status == 2)
        let interfaceLine = missing.stderr.split(separator: "\n").first { $0.contains("nosuch0") }
        #expect(interfaceLine?.contains("listeners[0].interface") == true && interfaceLine?.contains("ip link") == true, "\(missing.stderr)")

        let unroutable = try Self.check(topology, Self.config(interface: topology.proxyInterface, downstream: "198.19.99.1"))
        #expect(unroutable.status == 2)
        let routeLines = unroutable.stderr.split(separator: "\n").filter { $0.contains("no route") }
        #expect(routeLines.count == 1, "one problem, for 'far' only: \(unroutable.stderr)")
        #expect(routeLines.first?.contains("listeners[0].downstream[1]") == true && routeLines.first?.contains("198.19.99.1") == true
                && routeLines.first?.contains("ip route") == true, "\(unroutable.stderr)")

        try topology.exec(topology.proxy, ["/usr/sbin/sysctl", "-q", "-w", "net.ipv4.conf.\(topology.proxyInterface).forwarding=0"])
        let forwarding = try Self.check(topology, Self.config(interface: topology.proxyInterface, downstream: Topology.backendIPv4(1)))
        #expect(forwarding.status == 2)
        #expect(forwarding.stderr.contains("sysctl -w net.ipv4.conf.\(topology.proxyInterface).forwarding=1"), "\(forwarding.stderr)")

        // No side effect: nothing attached, no qdisc, no lock file.
        let qdiscs = try topology.exec(topology.proxy, ["tc", "qdisc", "show", "dev", topology.proxyInterface])
        #expect(!qdiscs.contains("clsact"), "\(qdiscs)")
        let locks = (try? FileManager.default.contentsOfDirectory(atPath: "/run/udp-fanout")) ?? []
        #expect(!locks.contains { $0.contains(topology.proxyInterface) }, "\(locks)")
    }
}
