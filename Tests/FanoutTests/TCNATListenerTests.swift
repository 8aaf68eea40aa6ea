// SPDX-License-Identifier: Apache-2.0
import Foundation
import Logging
import ReusePortLB
import Testing
import TestSupport
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// A `replies: nat` TCListener in a namespace topology (client — proxy — backends, the backends'
/// default route through the proxy): reply interfaces attached and detached, a real round trip
/// through the kernel, the two-way snapshot and the associations listing.
@Suite("tc_ebpf nat listener", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct TCNATListenerTests {
    static let vip = SocketAddress("198.18.0.1:5683")!

    static func listener(_ topology: Topology, backends: [Int], replyInterfaces: [String] = []) -> Listener {
        var settings = Settings()
        settings.replyInterfaces = replyInterfaces
        settings.maxAssociations = 1000
        return Listener(name: "nat", bind: vip, interface: topology.proxyInterface, mode: .tcEBPF,
                        downstreams: backends.map { Downstream(name: "b\($0)", address: SocketAddress("198.18.\($0).2:6000")!) },
                        settings: settings, replies: .nat)
    }

    /// Why the program is not attached at `interface` of the proxy (asked from inside its namespace), or nil.
    static func problem(_ dataplane: TCDataplane, _ topology: Topology, _ interface: String) -> String? {
        inNetworkNamespace(topology.proxy) { dataplane.attachmentProblem(interface: interface) } ?? "could not enter \(topology.proxy)"
    }

    /// The listener started in the proxy's namespace.
    static func start(_ config: Listener, _ topology: Topology, _ dataplane: TCDataplane, _ counters: ListenerCounters) throws -> TCListener {
        let started = inNetworkNamespace(topology.proxy) { () -> Result<TCListener, TCError> in
            do throws(TCError) {
                return .success(try TCListener(config, counters: counters, dataplane: dataplane, logger: Logger(label: "test")))
            } catch {
                return .failure(error)
            }
        }
        return try #require(try started?.get())
    }

    /// `script` (Python) running in each backend's namespace.
    static func servers(_ topology: Topology, _ script: String) throws -> [Process] {
        try topology.backends.map { namespace in
            let process = Process()
            process.executableURL = URL(fileURLWithPath: "/usr/sbin/ip")
            process.arguments = ["netns", "exec", namespace, "python3", "-c", script]
            try process.run()
            return process
        }
    }

    /// The proxy's interface toward backend n (Topology's naming).
    static func backendSide(_ topology: Topology, _ n: Int) -> String { "pb\(n)\(topology.suffix.prefix(7))" }

    @Test("A reply interface that does not exist: one clear error naming reply_interfaces, nothing left attached")
    func unknownReplyInterface() throws {
        let topology = try Topology(backends: 1)
        let dataplane = TCDataplane(logger: Logger(label: "test"))
        let config = Self.listener(topology, backends: [1], replyInterfaces: ["nosuch0"])
        let outcome = inNetworkNamespace(topology.proxy) { () -> String in
            do {
                let running = try TCListener(config, counters: ListenerCounters(name: "nat", mode: "tc_ebpf"), dataplane: dataplane, logger: Logger(label: "test"))
                running.shutdown()
                return "started"
            } catch {
                return "\(error)"
            }
        }
        #expect(outcome?.contains("settings.reply_interfaces names 'nosuch0'") == true, "\(outcome ?? "")")
        #expect(Self.problem(dataplane, topology, topology.proxyInterface) != nil, "nothing attached after the failed start")
    }

    @Test("Reply interfaces from the routes: attached with the listener, re-resolved on update, detached at shutdown; a round trip leaves from the VIP and is counted")
    func roundTrip() throws {
        let topology = try Topology(backends: 2)
        let dataplane = TCDataplane(logger: Logger(label: "test"))
        let counters = ListenerCounters(name: "nat", mode: "tc_ebpf")
        let config = Self.listener(topology, backends: [1, 2])
        let running = try Self.start(config, topology, dataplane, counters)
        for n in [1, 2] {
            #expect(Self.problem(dataplane, topology, Self.backendSide(topology, n)) == nil, "attached where backend \(n)'s replies arrive")
        }
        // Both backends echo (once per datagram, for 8 s at most); the client sends 3 datagrams from one port.
        let echo = """
        import socket,sys
        s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.bind(("0.0.0.0",6000)); s.settimeout(8)
        try:
            while True:
                d,a=s.recvfrom(2048); s.sendto(d,a)
        except socket.timeout: pass
        """
        let echoes = try Self.servers(topology, echo)
        defer { for process in echoes where process.isRunning { process.terminate() } }
        usleep(500_000)
        let client = """
        import socket
        s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.bind(("198.18.0.2",47000)); s.settimeout(2)
        for i in range(3):
            s.sendto(b"ping%d"%i,("198.18.0.1",5683))
            d,a=s.recvfrom(2048); print(d.decode(),a[0],a[1])
        """
        let result = try run("/usr/sbin/ip", ["netns", "exec", topology.client, "timeout", "10", "python3", "-c", client])
        #expect(result.status == 0, "\(result.output)")
        let lines = result.output.split(separator: "\n").map(String.init)
        #expect(lines == ["ping0 198.18.0.1 5683", "ping1 198.18.0.1 5683", "ping2 198.18.0.1 5683"], "every reply from the VIP: \(lines)")

        let snapshot = counters.snapshot()
        let twoWay = try #require(snapshot.twoWay, "a nat listener reports two-way counters")
        #expect(twoWay.replies == 3 && snapshot.forwarded == 3 && snapshot.received == 3, "\(twoWay) \(snapshot.forwarded)")
        #expect(twoWay.events[.created] == 1 && twoWay.events[.moved] == 0 && twoWay.events[.evicted] == 0)
        #expect(twoWay.associations == 1)
        #expect(twoWay.downstreamReplies.values.reduce(0, +) == 3 && twoWay.downstreamReplies.values.contains(3), "one downstream answered all: \(twoWay.downstreamReplies)")
        let listed = try #require(running.associations(limit: 10))
        #expect(listed.total == 1 && listed.entries.count == 1)
        #expect(listed.entries.first?.client == SocketAddress("198.18.0.2:47000")!)
        let served = try #require(listed.entries.first?.downstream)
        #expect(twoWay.downstreamReplies[served] == 3, "listed downstream \(served) is the one that replied")

        // The serving backend leaves the set: the reply interface toward it is detached.
        let remaining = served == "b1" ? 2 : 1
        let updated = inNetworkNamespace(topology.proxy) {
            running.update(downstreams: [Downstream(name: "b\(remaining)", address: SocketAddress("198.18.\(remaining).2:6000")!)], balancing: .roundRobin, quicLB: [], pools: [], keeping: [])
        }
        #expect(updated == true)
        // The gone backend's side stays attached while it drains and after (its late replies are
        // relayed, then counted drained); detached at shutdown (below).
        #expect(Self.problem(dataplane, topology, Self.backendSide(topology, 3 - remaining)) == nil, "still attached at the removed backend's side")
        #expect(Self.problem(dataplane, topology, Self.backendSide(topology, remaining)) == nil)
        // Its client moves on its next datagram.
        let again = try run("/usr/sbin/ip", ["netns", "exec", topology.client, "timeout", "10", "python3", "-c", client])
        #expect(again.status == 0, "\(again.output)")
        let afterMove = try #require(counters.snapshot().twoWay)
        #expect(afterMove.events[.moved] == 1 && afterMove.replies == 6)
        #expect(running.associations(limit: 10)?.entries.first?.downstream == "b\(remaining)")

        _ = inNetworkNamespace(topology.proxy) { running.shutdown() }
        for interface in [topology.proxyInterface, Self.backendSide(topology, 1), Self.backendSide(topology, 2)] {
            #expect(Self.problem(dataplane, topology, interface)?.contains("holds no attachment") == true, "\(interface) detached at shutdown")
            let filters = try run("/usr/sbin/ip", ["netns", "exec", topology.proxy, "/usr/sbin/bpftool", "net", "show", "dev", interface]).output
            #expect(!filters.contains("fanout_tc"), "nothing of ours left at \(interface): \(filters)")
        }
    }
    @Test("A downstream removed from a nat listener drains: its in-flight reply reaches the client from the VIP within settings.drain_secs, a reply after it is dropped and counted drained")
    func drain() throws {
        let topology = try Topology(backends: 2)
        let dataplane = TCDataplane(logger: Logger(label: "test"))
        let counters = ListenerCounters(name: "nat", mode: "tc_ebpf")
        var drained = Self.listener(topology, backends: [1, 2])
        drained.settings.drainSecs = 3
        let config = drained
        let running = try Self.start(config, topology, dataplane, counters)
        defer { _ = inNetworkNamespace(topology.proxy) { running.shutdown() } }
        // Each backend answers a request twice: after 1 s (within the drain time) and after 6 s
        // (past it). It serves for 12 s at most.
        let echo = """
        import socket,time
        s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.bind(("0.0.0.0",6000)); s.settimeout(12)
        try:
            d,a=s.recvfrom(2048); time.sleep(1); s.sendto(b"in-time",a); time.sleep(5); s.sendto(b"late",a)
        except socket.timeout: pass
        """
        let echoes = try Self.servers(topology, echo)
        defer { for process in echoes where process.isRunning { process.terminate() } }
        usleep(500_000)
        // The client prints every datagram it receives within 9 s, with its source.
        let clientScript = """
        import socket,time
        s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.bind(("198.18.0.2",47100))
        s.sendto(b"request",("198.18.0.1",5683)); end=time.time()+9
        while time.time()<end:
            s.settimeout(max(0.01,end-time.time()))
            try:
                d,a=s.recvfrom(2048); print(d.decode(),a[0],a[1],flush=True)
            except socket.timeout: break
        """
        let client = Process()
        client.executableURL = URL(fileURLWithPath: "/usr/sbin/ip")
        client.arguments = ["netns", "exec", topology.client, "timeout", "15", "python3", "-c", clientScript]
        let output = Pipe()
        client.standardOutput = output
        try client.run()
        defer { if client.isRunning { client.terminate() } }
        // The request is on its way to its backend (which answers in 1 s): that backend leaves the set.
        var served: String?
        for _ in 0..<50 where served == nil {
            usleep(20_000)
            served = running.associations(limit: 10)?.entries.first?.downstream
        }
        let removed = try #require(served, "the client's request made an association")
        let remaining = removed == "b1" ? 2 : 1
        let updated = inNetworkNamespace(topology.proxy) {
            running.update(downstreams: [Downstream(name: "b\(remaining)", address: SocketAddress("198.18.\(remaining).2:6000")!)], balancing: .roundRobin, quicLB: [], pools: [], keeping: [])
        }
        #expect(updated == true)
        client.waitUntilExit()
        let lines = String(decoding: output.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self).split(separator: "\n").map(String.init)
        #expect(lines == ["in-time 198.18.0.1 5683"], "the reply within the drain time reaches the client from the VIP, the late one does not reach it: \(lines)")
        let twoWay = try #require(counters.snapshot().twoWay)
        #expect(twoWay.replies == 1 && twoWay.downstreamReplies[removed] == 1, "the drained reply is counted for its downstream: \(twoWay)")
        #expect(twoWay.replyDropped[.drained] == 1, "the reply after the drain time is counted: \(twoWay.replyDropped)")
    }
}
