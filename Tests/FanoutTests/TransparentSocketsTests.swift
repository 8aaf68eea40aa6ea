// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
import ReusePortLB
@testable import FanoutCore
import CSystemShim
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// `output: preserve_source` through UDP sockets bound to the clients' endpoints
/// (``TransparentSockets``), in namespaces of the test's: client (the sender) -> proxy -> backend 1.
@Suite("preserve_source: UDP sockets bound to the clients", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct TransparentSocketsTests {
    /// What one run of batches through a thread's shared sender did.
    struct Outcome: Sendable {
        var total: FlushResult
        var rawCalls: Int
        var udpCalls: Int
        var udpMessages: Int
        var udpCopies: Int
        var sockets: Int
    }

    /// Sends `batches` (each a list of (payload index, client, hop limit)) to `downstream` through
    /// an outbox of a shared sender made in `namespace`; `between` runs after each batch (in the namespace).
    static func send(in namespace: String, to downstream: SocketAddress, _ payloads: [[UInt8]], _ batches: [[(Int, String, UInt8)]],
                     between: @escaping @Sendable (Int, SharedSender) -> Void = { _, _ in }) throws -> Outcome {
        let result = inNetworkNamespace(namespace) { () -> Result<Outcome, OutboxError> in
            let sender = SharedSender(capacity: 64)
            let outbox: SourcePreservingOutbox
            do throws(OutboxError) { outbox = try SourcePreservingOutbox(address: downstream, capacity: 64, shared: sender.raw) } catch { return .failure(error) }
            var total: FlushResult = (0, 0, [:])
            for (number, batch) in batches.enumerated() {
                for (index, client, hopLimit) in batch {
                    var source = storage(client)
                    payloads[index].withUnsafeBytes { outbox.append($0, source: &source, hopLimit: hopLimit) }
                }
                outbox.stage()
                sender.send()
                outbox.flush(&total)
                between(number, sender)
            }
            let udp = sender.raw.transparent
            return .success(Outcome(total: total, rawCalls: sender.raw.sendCalls, udpCalls: udp?.sendCalls ?? 0, udpMessages: udp?.messagesSent ?? 0,
                                    udpCopies: udp?.copiesSent ?? 0, sockets: udp?.sockets ?? 0))
        }
        return try #require(result, "entered \(namespace)").get()
    }

    @Test("IPv4 and IPv6 through a router: copies of clients whose address is not the host's go through a UDP socket per client endpoint, none through the raw socket; each arrives once, whole and intact, from the client's address and port; a run of one size to the downstream is one GSO message; two clients, two sockets, one sendmmsg each per batch")
    func throughARouter() throws {
        let topology = try Topology(backends: 1)
        defer { topology.destroy() }
        let port = freePort()
        for (downstreamText, clients, maximum) in [
            ("198.18.1.2:\(port)", ["198.18.0.77:40001", "198.18.0.78:40001"], 1472),
            ("[2001:db8:1::2]:\(port)", ["[2001:db8::77]:40002", "[2001:db8::78]:40002"], 1452),
        ] {
            let downstream = SocketAddress(downstreamText)!
            let receiver = try boundSocket(in: topology.backends[0], downstream)
            defer { close(receiver) }
            // 10 batches: per client 20 copies of 1000 bytes (a GSO run), then 10 of mixed sizes up to the MTU.
            var payloads: [[UInt8]] = []
            var batches: [[(Int, String, UInt8)]] = []
            for _ in 0..<10 {
                var batch: [(Int, String, UInt8)] = []
                for client in clients {
                    for position in 0..<30 {
                        let length = position < 20 ? 1000 : Int.random(in: 1...maximum)
                        payloads.append(numberedPayload(payloads.count, length: max(4, length)))
                        batch.append((payloads.count - 1, client, 0))
                    }
                }
                batches.append(batch)
            }
            let outcome = try Self.send(in: topology.client, to: downstream, payloads, batches)
            #expect(outcome.total.sent == UInt64(payloads.count) && outcome.total.dropped.isEmpty, "\(downstream): \(outcome.total)")
            #expect(outcome.total.bytes == UInt64(payloads.reduce(0) { $0 + $1.count }), "payload bytes")
            #expect(outcome.rawCalls == 0, "\(downstream): nothing through the raw socket")
            #expect(outcome.sockets == 2 && outcome.udpCalls == 2 * batches.count, "\(downstream): a socket per client, one sendmmsg per client per batch: \(outcome)")
            #expect(outcome.udpCopies == payloads.count)
            // Per client and batch the 20 equal copies are one message, the mixed ones at most 10.
            #expect(outcome.udpMessages <= 2 * batches.count * 11, "\(downstream): runs of one size as GSO messages: \(outcome.udpMessages) messages")
            let received = receiveAll(receiver, expected: payloads.count + 1)
            #expect(received.count == payloads.count, "\(downstream): every copy once, nothing else")
            var seen = Set<Int>()
            for (source, payload) in received {
                let index = Int(payload.prefix(4).reduce(UInt32(0)) { $0 << 8 | UInt32($1) })
                #expect(index < payloads.count && seen.insert(index).inserted, "copy \(index) once")
                guard index < payloads.count else { continue }
                #expect(payload == payloads[index], "copy \(index) whole and intact")
                let batch = batches.first { $0.contains { $0.0 == index } }!
                #expect(source == SocketAddress(batch.first { $0.0 == index }!.1)!, "copy \(index) from its client's address and port")
            }
        }
    }

    @Test("A client whose address is the host's goes through the raw socket and its port stays free; a copy whose hop limit is not the default (af_xdp's) too, and a client port outside the ephemeral range (2055, a service's), each with its UDP checksum (left by the outbox, summed for the raw socket); another client of the same batch still goes through its UDP socket")
    func localClientsAndHopLimits() throws {
        let topology = try Topology(backends: 1)
        defer { topology.destroy() }
        let downstream = SocketAddress("198.18.1.2:\(freePort())")!
        let receiver = try boundSocket(in: topology.backends[0], downstream)
        defer { close(receiver) }
        let watcher = try rawUDPSocket(in: topology.backends[0], family: AF_INET)
        defer { close(watcher) }
        let payloads = (0..<4).map { numberedPayload($0, length: 300) }
        // 198.18.0.2 is the client namespace's own address.
        let clients = ["198.18.0.2:40010", "198.18.0.79:40011", "198.18.0.80:40012", "198.18.0.83:2055"]
        let outcome = try Self.send(in: topology.client, to: downstream, payloads,
                                    [[(0, clients[0], 0), (1, clients[1], 5), (2, clients[2], 0), (3, clients[3], 0)]])
        #expect(outcome.total.sent == 4 && outcome.total.dropped.isEmpty, "\(outcome.total)")
        #expect(outcome.rawCalls == 1 && outcome.udpCopies == 1 && outcome.sockets == 1, "the local client, the hop limit 5 and port 2055 raw, the other through its socket: \(outcome)")
        let received = receiveAll(receiver, expected: 5)
        #expect(Set(received.map(\.source)) == Set(clients.map { SocketAddress($0)! }), "every copy from its client's address and port: \(received.map(\.source))")
        // The three that went the raw way, as sent (the client socket's copy may carry a checksum
        // the veth left for a device to finish: not read).
        let raw = udpChecksums(watcher, to: downstream).filter { [40010, 40011, 2055].contains($0.sourcePort) }
        #expect(raw.count == 3 && raw.allSatisfy { $0.stored != 0 && $0.stored == $0.computed }, "the raw way's UDP checksums: \(raw)")
        let free = inNetworkNamespace(topology.client) { () -> Int32 in
            let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
            defer { close(fd) }
            return SocketAddress("198.18.0.2:40010")!.withSockAddr { bind(fd, $0, $1) } == 0 ? 0 : errno
        }
        #expect(free == 0, "the local client's port was not taken (bind: errno \(String(describing: free)))")
    }

    @Test("A socket unused for the idle limit is closed on the next send and made again when its client comes back")
    func idleSocketsClose() throws {
        let topology = try Topology(backends: 1)
        defer { topology.destroy() }
        let downstream = SocketAddress("198.18.1.2:\(freePort())")!
        let receiver = try boundSocket(in: topology.backends[0], downstream)
        defer { close(receiver) }
        let payloads = (0..<3).map { numberedPayload($0, length: 100) }
        let counts = Mutex<[Int]>([])
        let outcome = try Self.send(in: topology.client, to: downstream, payloads,
                                    [[(0, "198.18.0.81:40020", 0)], [(1, "198.18.0.82:40021", 0)], [(2, "198.18.0.81:40020", 0)]],
                                    between: { number, sender in
                                        counts.withLock { $0.append(sender.raw.transparent?.sockets ?? -1) }
                                        // The coarse clock's whole seconds: 3 at least, past a limit of 2 (and batch 2,
                                        // right after batch 1, at most a second later: the second client's stays).
                                        // (The sockets are made with the first raw socket: set it once they exist.)
                                        if number == 0 {
                                            sender.raw.transparent?.idleLimit = 2
                                            usleep(3_100_000)
                                        }
                                    })
        // After batch 1 the first client's socket was closed (idle 3 s) and the second's made; batch 2 made the first's again.
        #expect(counts.withLock { $0 } == [1, 1, 2], "sockets after each batch")
        #expect(outcome.total.sent == 3 && outcome.udpCopies == 3 && outcome.rawCalls == 0, "\(outcome)")
        #expect(receiveAll(receiver, expected: 4).count == 3)
    }

    @Test("A client whose address becomes the host's (added to an interface) while its socket is held: the next sweep closes the socket, its copies go through the raw socket, and a program binds its port without SO_REUSEADDR")
    func clientAddressBecomesLocal() throws {
        let topology = try Topology(backends: 1)
        defer { topology.destroy() }
        let downstream = SocketAddress("198.18.1.2:\(freePort())")!
        let receiver = try boundSocket(in: topology.backends[0], downstream)
        defer { close(receiver) }
        let client = "198.18.0.84:40030"
        let payloads = (0..<2).map { numberedPayload($0, length: 200) }
        let namespace = topology.client
        let counts = Mutex<[Int]>([])
        // The second batch after the sweep: the copy is made while the program holds the port (the raw way needs no bind).
        let outcome = try Self.send(in: namespace, to: downstream, payloads, [[(0, client, 0)], [(1, client, 0)]],
                                    between: { number, sender in
                                        guard number == 0 else { return }
                                        counts.withLock { $0.append(sender.raw.transparent?.sockets ?? -1) }
                                        let added = (try? run("/usr/sbin/ip", ["-n", namespace, "addr", "add", "198.18.0.84/32", "dev", "lo"]))?.status == 0
                                        counts.withLock { $0.append(added ? 1 : -1) }
                                        // The sweep runs once a second of the coarse clock at most.
                                        usleep(1_100_000)
                                        sender.raw.transparent?.sweepIfDue()
                                        counts.withLock { $0.append(sender.raw.transparent?.sockets ?? -1) }
                                        // While the sender lives (its sockets with it): a local program's bind, no SO_REUSEADDR.
                                        let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
                                        defer { close(fd) }
                                        let bound = SocketAddress(client)!.withSockAddr { bind(fd, $0, $1) } == 0 ? 0 : errno
                                        counts.withLock { $0.append(Int(bound)) }
                                    })
        #expect(counts.withLock { $0 } == [1, 1, 0, 0], "a socket, the address added, the socket closed by the sweep, the port bound by a local program (errno 0)")
        #expect(outcome.total.sent == 2 && outcome.total.dropped.isEmpty, "\(outcome.total)")
        #expect(outcome.udpCopies == 1 && outcome.rawCalls == 1 && outcome.sockets == 0, "the second copy through the raw socket: \(outcome)")
        let received = receiveAll(receiver, expected: 3)
        #expect(received.count == 2 && received.allSatisfy { $0.source == SocketAddress(client)! }, "\(received.map(\.source))")
    }

    @Test("A GSO run the kernel refuses (its segments above an MTU that shrank after the outbox read it: EINVAL) is sent one copy per message, which the kernel fragments (DF clear); every copy arrives once, whole, from its client")
    func gsoRefused() throws {
        let topology = try Topology(backends: 1)
        defer { topology.destroy() }
        let interface = "cp\(topology.suffix.prefix(8))"
        let client = topology.client
        let downstream = SocketAddress("198.18.1.2:\(freePort())")!
        let receiver = try boundSocket(in: topology.backends[0], downstream)
        defer { close(receiver) }
        let payloads = (0..<21).map { numberedPayload($0, length: $0 == 0 ? 100 : 1400) }
        let batches = [[(0, "198.18.0.84:40030", UInt8(0))], (1..<21).map { ($0, "198.18.0.84:40030", UInt8(0)) }]
        let shrunk = Mutex(false)
        let outcome = try Self.send(in: client, to: downstream, payloads, batches, between: { number, _ in
            // After the first batch the outbox has read the MTU (1500): 1400-byte copies are staged whole.
            if number == 0 { shrunk.withLock { $0 = (try? run("/usr/sbin/ip", ["-n", client, "link", "set", interface, "mtu", "1280"]))?.status == 0 } }
        })
        #expect(shrunk.withLock { $0 }, "ip link set mtu 1280")
        #expect(outcome.total.sent == 21 && outcome.total.dropped.isEmpty, "\(outcome.total)")
        #expect(outcome.udpCopies == 21 && outcome.udpMessages == 21 && outcome.rawCalls == 0, "the refused run one copy per message through the client's socket: \(outcome)")
        let received = receiveAll(receiver, expected: 22)
        #expect(received.map(\.payload).sorted { $0.lexicographicallyPrecedes($1) } == payloads.sorted { $0.lexicographicallyPrecedes($1) }, "every copy once, whole (\(received.count))")
        #expect(received.allSatisfy { $0.source == SocketAddress("198.18.0.84:40030")! })
    }

    @Test("Empty datagrams are never in a GSO run (UDP_SEGMENT 0 would send a run of them as one; an empty last segment is no datagram): five empty, one of 100 bytes and one empty after it arrive as seven, through a client's socket and through a downstream's socket way out")
    func emptyDatagrams() throws {
        let topology = try Topology(backends: 1)
        defer { topology.destroy() }
        let downstream = SocketAddress("198.18.1.2:\(freePort())")!
        let receiver = try boundSocket(in: topology.backends[0], downstream)
        defer { close(receiver) }
        // Five empty, one of 100 bytes, then an empty one after it (not a run's shorter last segment).
        let payloads: [[UInt8]] = Array(repeating: [], count: 5) + [numberedPayload(5, length: 100), []]
        let outcome = try Self.send(in: topology.client, to: downstream, payloads, [(0..<7).map { ($0, "198.18.0.85:40040", UInt8(0)) }])
        #expect(outcome.total.sent == 7 && outcome.udpCopies == 7, "\(outcome)")
        let received = receiveAll(receiver, expected: 8)
        #expect(received.filter { $0.payload.isEmpty }.count == 6 && received.count == 7, "six empty and one of 100 bytes: \(received.map(\.payload.count))")
        // The socket way out (output: socket) runs its GSO runs the same way.
        let sent = inNetworkNamespace(topology.client) { () -> UInt64 in
            let outbox = DownstreamOutbox(address: downstream, capacity: 8, shared: nil)
            var source = storage("198.18.0.2:40041")
            let empty = [UInt8]()
            let full = [UInt8](repeating: 1, count: 100)
            for _ in 0..<5 { empty.withUnsafeBytes { outbox.append($0, source: &source, hopLimit: 0) } }
            full.withUnsafeBytes { outbox.append($0, source: &source, hopLimit: 0) }
            empty.withUnsafeBytes { outbox.append($0, source: &source, hopLimit: 0) }
            var result: FlushResult = (0, 0, [:])
            outbox.flush(&result)
            return result.sent
        }
        #expect(sent == 7)
        let viaSocket = receiveAll(receiver, expected: 8)
        #expect(viaSocket.count == 7 && viaSocket.filter { $0.payload.isEmpty }.count == 6, "six empty datagrams and one of 100 bytes: \(viaSocket.map(\.payload.count))")
    }
}
