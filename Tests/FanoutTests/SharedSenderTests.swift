// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import Logging
import TestSupport
import CSystemShim
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// `output: socket` through the thread's shared unconnected socket: one sendmmsg per batch
/// whatever the number of downstreams, GSO runs kept, ICMP errors attributed to the downstream
/// they were about (passive health), nothing of a healthy downstream lost to another's error.
@Suite("udp-fanout: the shared way out (one sendmmsg per batch)", .serialized)
struct SharedSenderTests {
    /// `perOutbox` datagrams "<tag>-<outbox>-<copy>" (padded to `size` bytes) per outbox, staged,
    /// sent once, flushed: what each flush returned.
    private static func send(_ outboxes: [DownstreamOutbox], _ sender: SharedSender, tag: String, perOutbox: Int = 1, size: Int = 0) -> [FlushResult] {
        send(outboxes, sender, payloads: outboxes.indices.map { index in
            (0..<perOutbox).map { copy in
                let payload = Array("\(tag)-\(index)-\(copy)".utf8)
                return payload + [UInt8](repeating: UInt8(copy % 251), count: max(0, size - payload.count))
            }
        })
    }

    /// Appends `payloads[i]` to outbox i, stages every outbox, sends once, flushes: each flush's result.
    private static func send(_ outboxes: [DownstreamOutbox], _ sender: SharedSender, payloads: [[[UInt8]]]) -> [FlushResult] {
        let flat = payloads.flatMap { $0 }
        var source = sockaddr_storage()
        return flat.withUnsafeBufferPointer { all in
            var next = 0
            for (outbox, datagrams) in zip(outboxes, payloads) {
                for _ in datagrams {
                    all[next].withUnsafeBytes { outbox.append($0, source: &source, hopLimit: 0) }
                    next += 1
                }
            }
            for outbox in outboxes { outbox.stage() }
            sender.send()
            return outboxes.map { outbox in
                var result: FlushResult = (0, 0, [:])
                outbox.flush(&result)
                return result
            }
        }
    }

    /// A namespace of the test's (`prefix` and a random number) with, per link, a veth pair
    /// `<device>0`/`<device>1`, 198.18.<subnet>.1/24 on `<device>0` and 198.18.<subnet>.2 a
    /// permanent neighbour there (what is sent to it leaves by `<device>0` and ends at `<device>1`).
    /// Deleted again if a step fails; the caller deletes it after use.
    static func vethNamespace(_ prefix: String, _ links: [(device: String, subnet: Int)]) throws -> String {
        let namespace = "\(prefix)-\(UInt32.random(in: 0...UInt32.max))"
        try #require(try run("/usr/sbin/ip", ["netns", "add", namespace]).status == 0)
        do {
            for (device, subnet) in links {
                for arguments in [
                    ["-n", namespace, "link", "add", "\(device)0", "type", "veth", "peer", "name", "\(device)1"],
                    ["-n", namespace, "addr", "add", "198.18.\(subnet).1/24", "dev", "\(device)0"],
                    ["-n", namespace, "link", "set", "\(device)0", "up"],
                    ["-n", namespace, "link", "set", "\(device)1", "up"],
                    ["-n", namespace, "neigh", "add", "198.18.\(subnet).2", "lladdr", "02:00:00:00:\(subnet):02", "dev", "\(device)0", "nud", "permanent"],
                ] {
                    let result = try run("/usr/sbin/ip", arguments)
                    try #require(result.status == 0, "ip \(arguments.joined(separator: " ")): \(result.output)")
                }
            }
        } catch {
            _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace])
            throw error
        }
        return namespace
    }

    /// A tbf qdisc of 8 kbit/s on `device` in `namespace`, queueing at most `limit` bytes: a large
    /// limit keeps nearly every datagram queued, charged to the sending socket (its buffer fills);
    /// 1 drops nearly every one (ENOBUFS).
    static func shape(_ namespace: String, _ device: String, limit: Int) throws {
        let shaped = try run("/usr/sbin/tc", ["-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", "8kbit", "burst", "1600", "limit", "\(limit)"])
        try #require(shaped.status == 0, "tc qdisc add tbf: \(shaped.output)")
    }

    @Test("a flush's drops by reason (DropTally): every reason kept apart, added, read back, iterated in order, compared; none is empty")
    func dropTally() {
        #expect(DropReason.allCases.enumerated().allSatisfy { $0.offset == $0.element.ordinal }, "each reason's ordinal is its place in allCases")
        #expect(DropReason.allCases.count <= DropTally.capacity, "a new reason needs room in DropTally's storage")
        var tally = DropTally()
        #expect(tally.isEmpty && tally[.sendBufferFull] == nil && tally[.sendBufferFull, default: 7] == 7 && tally.total == 0)
        for (offset, reason) in DropReason.allCases.reversed().enumerated() { tally[reason, default: 0] += UInt64(offset + 1) }
        tally[.unreachable, default: 0] += 100
        let count = UInt64(DropReason.allCases.count)
        #expect(!tally.isEmpty && tally.total == count * (count + 1) / 2 + 100)
        #expect(tally.map(\.0) == DropReason.allCases, "iterated in DropReason's order, every reason with drops")
        #expect(tally[.closing] == 1 && tally[.rateLimited] == 2 && tally[.tooLarge] == count && tally[.unreachable] == count - 2 + 100)
        tally[.unreachable, default: 0] = 0
        #expect(tally[.unreachable] == nil && !tally.map(\.0).contains(.unreachable), "a reason set back to 0 has no drops")
        let literal: DropTally = [.tooLarge: 1, .familyMismatch: 2]
        #expect(literal == [DropReason.familyMismatch: 2, .tooLarge: 1] && literal != [DropReason.tooLarge: 1] && literal != [.tooLarge: 1, .familyMismatch: 3])
        #expect(literal.description == "[too_large: 1, family_mismatch: 2]")
    }

    @Test("a batch spread over 300 downstreams is one sendmmsg, each downstream gets its datagram and its count")
    func oneCallForManyDownstreams() throws {
        let sinks = try (0..<300).map { _ in try Sink() }
        let sender = SharedSender(capacity: 512)
        let outboxes = sinks.map { DownstreamOutbox(address: $0.address, capacity: 4, shared: sender) }
        let results = Self.send(outboxes, sender, tag: "wide")
        #expect(sender.sendCalls == 1, "one system call for the batch, not one per downstream: \(sender.sendCalls)")
        for (index, sink) in sinks.enumerated() {
            let received = sink.drain(quiet: .milliseconds(index == 0 ? 300 : 5))
            #expect(received.map { String(decoding: $0, as: UTF8.self) } == ["wide-\(index)-0"], "downstream \(index)")
            #expect(results[index].sent == 1 && results[index].bytes == UInt64("wide-\(index)-0".utf8.count) && results[index].dropped.isEmpty)
        }
    }

    @Test("a batch above the sender's room goes in as few calls as the room allows, nothing lost")
    func overflowSendsEarly() throws {
        let sinks = try (0..<10).map { _ in try Sink() }
        let sender = SharedSender(capacity: 64)
        let outboxes = sinks.map { DownstreamOutbox(address: $0.address, capacity: 64, shared: sender) }
        // 10 × 20 datagrams of different sizes (no GSO run): 200 messages through room for 64.
        let payloads = (0..<10).map { index in (0..<20).map { copy in Array("o-\(index)-\(copy)-".utf8) + [UInt8](repeating: 1, count: copy) } }
        let results = Self.send(outboxes, sender, payloads: payloads)
        #expect(sender.sendCalls == 4, "200 messages in calls of at most 64: \(sender.sendCalls)")
        #expect(results.allSatisfy { $0.sent == 20 && $0.dropped.isEmpty })
        for (index, sink) in sinks.enumerated() {
            #expect(sink.drain(quiet: .milliseconds(index == 0 ? 300 : 20)).count == 20)
        }
    }

    @Test("a run of datagrams to one downstream is one GSO message: one call, every datagram separate and whole")
    func gsoRunsKept() throws {
        let sink = try Sink()
        let sender = SharedSender(capacity: 64)
        let outbox = DownstreamOutbox(address: sink.address, capacity: 64, shared: sender)
        let results = Self.send([outbox], sender, tag: "run", perOutbox: 40, size: 1000)
        #expect(sender.sendCalls == 1 && sender.messagesSent == 1, "one GSO message: \(sender.messagesSent) messages in \(sender.sendCalls) calls")
        #expect(results[0].sent == 40 && results[0].bytes == 40_000)
        #expect(outbox.gsoEnabled, "the kernel took the GSO message")
        let received = sink.drain()
        #expect(received.count == 40)
        for (copy, payload) in received.enumerated() {
            var expected = Array("run-0-\(copy)".utf8)
            expected += [UInt8](repeating: UInt8(copy % 251), count: 1000 - expected.count)
            #expect(payload == expected, "datagram \(copy) byte for byte, in order")
        }
    }

    @Test("ICMP port unreachable through the shared socket: named by the error queue, the dead downstream then counts its drops on its own socket, the live one loses nothing",
          arguments: ["127.0.0.1", "::1", "::ffff:127.0.0.1"])
    func icmpAttributed(ip: String) throws {
        let alive = try Sink(ip: ip)
        // Nobody listens there: the kernel answers ICMP port unreachable (ICMPv4 for the mapped address).
        let dead = SocketAddress(ip: IPAddress(ip)!, port: freePort())
        let sender = SharedSender(capacity: 64)
        let outboxes = [DownstreamOutbox(address: dead, capacity: 8, shared: sender), DownstreamOutbox(address: alive.address, capacity: 8, shared: sender)]
        var namedByQueue = 0
        var refusedOnOwnSocket = 0
        var droppedDead: UInt64 = 0
        var aliveSent: UInt64 = 0
        for round in 0..<20 {
            let results = Self.send(outboxes, sender, tag: "r\(round)")
            aliveSent += results[1].sent
            #expect(results[1].dropped.isEmpty, "round \(round): the live downstream never pays for the dead one's error: \(results[1].dropped)")
            droppedDead += results[0].dropped[.unreachable, default: 0]
            if outboxes[0].refused { refusedOnOwnSocket += 1 }
            #expect(!outboxes[1].refused)
            for (address, error) in sender.takeErrors() {
                #expect(address == dead && error == ECONNREFUSED, "\(address) \(error)")
                for outbox in outboxes { outbox.drewError(at: address) }
                namedByQueue += 1
            }
            usleep(5_000)  // the ICMP comes back before the next round
        }
        #expect(aliveSent == 20 && alive.drain().count == 20)
        #expect(namedByQueue > 0, "the shared socket's error queue named the dead downstream")
        #expect(refusedOnOwnSocket > 0, "on its connected socket, the dead downstream's ECONNREFUSED is seen (passive health's report)")
        #expect(droppedDead > 0, "once named, the dead downstream's datagrams are counted unreachable on its connected socket")
    }

    @Test("a full send buffer fails the rest of the batch at once, each datagram counted send_buffer_full by its own downstream, not a system call each (a veth whose tbf qdisc holds what it was given, in a namespace of the test's)",
          .enabled(if: Privileges.enabled, Privileges.reason))
    func sendBufferFull() throws {
        let namespace = try Self.vethNamespace("rplb-sndbuf", [("sb", 77)])
        defer { _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace]) }
        // 8 kbit/s: the qdisc keeps nearly every datagram queued, charged to the sending socket.
        try Self.shape(namespace, "sb0", limit: 10_000_000)
        let outcome = inNetworkNamespace(namespace) { () -> (calls: Int, full: Int, results: [FlushResult]) in
            // Room for a few 1,000-byte datagrams only (the kernel doubles SO_SNDBUF, up to its minimum).
            let sender = SharedSender(capacity: 64, sendBuffer: 4096)
            let outboxes = (0..<64).map { DownstreamOutbox(address: SocketAddress(ip: IPAddress("198.18.77.2")!, port: UInt16(7000 + $0)), capacity: 4, shared: sender) }
            let results = Self.send(outboxes, sender, tag: "full", size: 1000)
            return (sender.sendCalls, sender.sendBufferFullCalls, results)
        }
        let (calls, full, results) = try #require(outcome, "entered \(namespace)")
        let sent = results.reduce(0) { $0 + $1.sent }
        let dropped = results.reduce(0) { $0 + ($1.dropped[.sendBufferFull] ?? 0) }
        #expect(sent > 0 && sent < 64, "a few went before the buffer filled: \(sent)")
        #expect(sent + dropped == 64 && results.allSatisfy { $0.sent + ($0.dropped[.sendBufferFull] ?? 0) == 1 }, "each datagram sent or counted send_buffer_full by its own downstream: \(results.map(\.dropped))")
        #expect(full == 1 && calls <= 3, "the rest failed at once: \(calls) sendmmsg calls for \(dropped) datagrams that could not go")
    }

    @Test("an egress queue's drop (ENOBUFS) costs that datagram alone: the other downstreams' datagrams of the batch still go (two veths in a namespace of the test's, one with a tbf qdisc that queues nothing)",
          .enabled(if: Privileges.enabled, Privileges.reason))
    func egressDropIsOneDatagram() throws {
        let namespace = try Self.vethNamespace("rplb-enobufs", [("nb", 77), ("nc", 78)])
        defer { _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace]) }
        // nb0's tbf queues at most 1 byte: it drops (nearly) every datagram; nc0 passes all.
        try Self.shape(namespace, "nb0", limit: 1)
        let outcome = inNetworkNamespace(namespace) { () -> (full: Int, results: [FlushResult]) in
            let sender = SharedSender(capacity: 64)
            // Interleaved: shaped, free, shaped, free, ...
            let outboxes = (0..<32).map { index in
                DownstreamOutbox(address: SocketAddress(ip: IPAddress(index % 2 == 0 ? "198.18.77.2" : "198.18.78.2")!, port: UInt16(7000 + index)),
                                 capacity: 4, shared: sender)
            }
            let results = Self.send(outboxes, sender, tag: "egress", size: 1000)
            return (sender.sendBufferFullCalls, results)
        }
        let (full, results) = try #require(outcome, "entered \(namespace)")
        let shapedResults = results.enumerated().filter { $0.offset % 2 == 0 }.map(\.element)
        let freeResults = results.enumerated().filter { $0.offset % 2 == 1 }.map(\.element)
        #expect(freeResults.allSatisfy { $0.sent == 1 && $0.dropped.isEmpty }, "every datagram through the free device went: \(freeResults.map { ($0.sent, $0.dropped) })")
        let shapedDropped = shapedResults.reduce(0) { $0 + ($1.dropped[.sendBufferFull] ?? 0) }
        #expect(shapedResults.allSatisfy { $0.sent + ($0.dropped[.sendBufferFull] ?? 0) == 1 }, "each shaped datagram sent or counted send_buffer_full: \(shapedResults.map(\.dropped))")
        #expect(shapedDropped >= 14, "the qdisc dropped nearly all of the shaped device's: \(shapedDropped)")
        #expect(full == 0, "no drop failed the rest of the batch")
    }

    @Test("a forwarder's batch, interleaved over its downstreams, is gathered in arrival order and handed out grouped by downstream: each gets its datagrams whole and in order, one GSO message per run of one size, one system call, its counts; again after a plan with more downstreams and after one with fewer")
    func gatheredBatchGroupedByDownstream() throws {
        let sinks = try (0..<12).map { _ in try Sink() }
        let downstreams = sinks.enumerated().map { Downstream(name: "d\($0.offset)", address: $0.element.address) }
        let counters = ListenerCounters(name: "gather", mode: "userspace")
        let plans = PlanHolder(ForwardingPlan(downstreams: Array(downstreams[0..<5]), balancing: .roundRobin, quicLB: [], pools: [], counters: counters))
        let forwarder = BatchForwarder(listener: "gather", counters: counters, plans: plans, logger: Logger(label: "gather-test"), output: .socket,
                                       capacity: 64) { downstream, sender in
            DownstreamOutbox(address: downstream.address, capacity: 64, shared: sender)
        }
        var source = storage("127.0.0.1:40000")
        var expectedForwarded = [UInt64](repeating: 0, count: sinks.count)
        for (round, width) in [5, 12, 12, 3].enumerated() {
            if round > 0 {
                plans.replace(with: ForwardingPlan(downstreams: Array(downstreams[0..<width]), balancing: .roundRobin, quicLB: [], pools: [], counters: counters))
            }
            forwarder.adoptPlanIfChanged()
            // 64 datagrams: target i * 7 % width, so every downstream's datagrams are interleaved
            // with the others'; each downstream's are of one size (a GSO run once grouped) but
            // for downstream 1, whose sizes differ (one message each).
            let targets = (0..<64).map { $0 * 7 % width }
            let payloads = targets.enumerated().map { index, target in
                let text = Array("r\(round)-t\(target)-n\(index)-".utf8)
                let size = target == 1 ? 40 + index : 100
                return text + [UInt8](repeating: UInt8(target), count: max(0, size - text.count))
            }
            let callsBefore = forwarder.sender.sendCalls
            let messagesBefore = forwarder.sender.messagesSent
            payloads.withUnsafeBufferPointer { all in
                for (index, target) in targets.enumerated() {
                    all[index].withUnsafeBytes { forwarder.append(target, $0, source: &source) }
                }
                forwarder.flush(received: 64, bytesReceived: 0)
            }
            #expect(forwarder.sender.sendCalls - callsBefore == 1, "round \(round): one sendmmsg for the batch")
            let growing = targets.filter { $0 == 1 }.count
            #expect(forwarder.sender.messagesSent - messagesBefore == width - 1 + growing,
                    "round \(round): one GSO message per downstream of one size, one message per datagram of downstream 1")
            for target in 0..<width {
                let expected = targets.indices.filter { targets[$0] == target }.map { payloads[$0] }
                expectedForwarded[target] += UInt64(expected.count)
                let received = sinks[target].drain(quiet: .milliseconds(target == 0 ? 300 : 20))
                #expect(received == expected, "round \(round), downstream \(target): \(received.count) of \(expected.count), whole and in arrival order")
            }
            for target in width..<sinks.count {
                #expect(sinks[target].drain(quiet: .milliseconds(5)).isEmpty, "round \(round): nothing for downstream \(target), not in the plan")
            }
        }
        // As a worker does at the end of its turn.
        forwarder.publishCounts()
        let plan = try #require(forwarder.plan)
        for (index, counted) in plan.counters.enumerated() {
            #expect(counted.forwarded.load(ordering: .relaxed) == expectedForwarded[index], "downstream \(index)'s count")
        }
        #expect(counters.forwarded.load(ordering: .relaxed) == 64 * 4)
        #expect(forwarder.runsStagedFromTable == 5 + 12 + 12 + 3, "every run was staged from the thread's table, no outbox staging it")
    }

    @Test("a forwarder's batch into a full send buffer (runs staged from the thread's table): a few datagrams go, the rest fail at once, each counted send_buffer_full by its own downstream's counters and the listener's, nothing uncounted (a veth whose tbf qdisc holds what it was given, in a namespace of the test's)",
          .enabled(if: Privileges.enabled, Privileges.reason))
    func forwarderFullSendBuffer() throws {
        let namespace = try Self.vethNamespace("rplb-fwdbuf", [("fb", 77)])
        defer { _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace]) }
        try Self.shape(namespace, "fb0", limit: 10_000_000)
        let counters = ListenerCounters(name: "full", mode: "userspace")
        let downstreams = (0..<64).map { Downstream(name: "d\($0)", address: SocketAddress(ip: IPAddress("198.18.77.2")!, port: UInt16(7000 + $0))) }
        let plan = ForwardingPlan(downstreams: downstreams, balancing: .roundRobin, quicLB: [], pools: [], counters: counters)
        let outcome = inNetworkNamespace(namespace) { () -> (staged: Int, full: Int) in
            let forwarder = BatchForwarder(listener: "full", counters: counters, plans: PlanHolder(plan), logger: Logger(label: "full-test"), output: .socket,
                                           capacity: 64, sendBuffer: 4096) { downstream, sender in
                DownstreamOutbox(address: downstream.address, capacity: 64, shared: sender)
            }
            forwarder.adoptPlanIfChanged()
            var source = storage("198.18.77.1:40000")
            let payload = [UInt8](repeating: 7, count: 1000)
            payload.withUnsafeBytes { bytes in
                for target in 0..<64 { forwarder.append(target, bytes, source: &source) }
                forwarder.flush(received: 64, bytesReceived: 64_000)
            }
            forwarder.publishCounts()
            return (forwarder.runsStagedFromTable, forwarder.sender.sendBufferFullCalls)
        }
        let (staged, full) = try #require(outcome, "entered \(namespace)")
        #expect(staged == 64, "each downstream's run staged from the table")
        let sent = plan.counters.reduce(0) { $0 + $1.forwarded.load(ordering: .relaxed) }
        let dropped = plan.counters.reduce(0) { $0 + $1.dropped.load(ordering: .relaxed) }
        #expect(sent > 0 && sent < 64, "a few went before the buffer filled: \(sent)")
        #expect(full == 1, "the rest failed at once")
        #expect(plan.counters.allSatisfy { $0.forwarded.load(ordering: .relaxed) + $0.dropped.load(ordering: .relaxed) == 1 },
                "each downstream's datagram sent or dropped, in its own counters")
        #expect(sent + dropped == 64 && counters.forwarded.load(ordering: .relaxed) == sent, "the listener's forwarded count is the downstreams'")
        #expect(counters.snapshot().dropped[.sendBufferFull] == dropped, "the listener counts them send_buffer_full: \(counters.snapshot().dropped)")
    }

    @Test("a forwarder's GSO run the kernel refuses (segments above the device's MTU: EINVAL), staged from the thread's table: sent again one datagram per message and counted sent, and that downstream's next runs go one per message from the start while the other's stay GSO (a veth of MTU 1000 in a namespace of the test's)",
          .enabled(if: Privileges.enabled, Privileges.reason))
    func forwarderGSORefused() throws {
        let namespace = try Self.vethNamespace("rplb-fwdgso", [("gs", 77), ("gt", 78)])
        defer { _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace]) }
        let mtu = try run("/usr/sbin/ip", ["-n", namespace, "link", "set", "gs0", "mtu", "1000"])
        try #require(mtu.status == 0, "ip link set mtu: \(mtu.output)")
        let counters = ListenerCounters(name: "gso", mode: "userspace")
        let downstreams = [Downstream(name: "small", address: SocketAddress(ip: IPAddress("198.18.77.2")!, port: 7000)),
                           Downstream(name: "large", address: SocketAddress(ip: IPAddress("198.18.78.2")!, port: 7000))]
        let plan = ForwardingPlan(downstreams: downstreams, balancing: .roundRobin, quicLB: [], pools: [], counters: counters)
        let outcome = inNetworkNamespace(namespace) { () -> (first: Int, second: Int, staged: Int) in
            let forwarder = BatchForwarder(listener: "gso", counters: counters, plans: PlanHolder(plan), logger: Logger(label: "gso-test"), output: .socket,
                                           capacity: 16) { downstream, sender in
                DownstreamOutbox(address: downstream.address, capacity: 16, shared: sender)
            }
            forwarder.adoptPlanIfChanged()
            var source = storage("198.18.77.1:40000")
            let payload = [UInt8](repeating: 9, count: 1200)
            var messages: [Int] = []
            payload.withUnsafeBytes { bytes in
                for _ in 0..<2 {
                    let before = forwarder.sender.messagesSent
                    for index in 0..<16 { forwarder.append(index % 2, bytes, source: &source) }
                    forwarder.flush(received: 16, bytesReceived: 16 * 1200)
                    messages.append(forwarder.sender.messagesSent - before)
                }
            }
            forwarder.publishCounts()
            return (messages[0], messages[1], forwarder.runsStagedFromTable)
        }
        let (first, second, staged) = try #require(outcome, "entered \(namespace)")
        #expect(staged == 4, "both batches' runs staged from the table")
        #expect(first == 1 + 8, "first batch: the large-MTU downstream's GSO message, the other's 8 datagrams one by one after the refusal: \(first)")
        #expect(second == 1 + 8, "second batch: GSO stays off for the refused downstream only: \(second)")
        for (index, counted) in plan.counters.enumerated() {
            #expect(counted.forwarded.load(ordering: .relaxed) == 16 && counted.dropped.load(ordering: .relaxed) == 0, "downstream \(index): all 16 sent, none dropped")
        }
        #expect(counters.forwarded.load(ordering: .relaxed) == 32)
    }

    @Test("a forwarder's gathered run sent through a downstream's own socket (its direct period after an ICMP port unreachable): the live downstream's datagrams all arrive in order, the dead one's are counted unreachable on its own socket, nothing uncounted")
    func gatheredRunThroughOwnSocket() throws {
        let alive = try Sink()
        // Nobody listens there: the kernel answers ICMP port unreachable.
        let dead = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let counters = ListenerCounters(name: "direct", mode: "userspace")
        let plan = ForwardingPlan(downstreams: [Downstream(name: "dead", address: dead), Downstream(name: "alive", address: alive.address)],
                                  balancing: .roundRobin, quicLB: [], pools: [], counters: counters)
        let forwarder = BatchForwarder(listener: "direct", counters: counters, plans: PlanHolder(plan), logger: Logger(label: "direct-test"), output: .socket,
                                       capacity: 16) { downstream, sender in
            DownstreamOutbox(address: downstream.address, capacity: 16, shared: sender)
        }
        forwarder.adoptPlanIfChanged()
        var source = storage("127.0.0.1:40000")
        let rounds = 20
        // 16 datagrams a batch, alternating dead, alive: each downstream's run is interleaved with the other's.
        let payloads = (0..<rounds * 16).map { Array("d-\($0 % 2)-\($0)".utf8) + [UInt8](repeating: 5, count: 100) }
        payloads.withUnsafeBufferPointer { all in
            for round in 0..<rounds {
                for index in (round * 16)..<((round + 1) * 16) {
                    all[index].withUnsafeBytes { forwarder.append(index % 2, $0, source: &source) }
                }
                forwarder.flush(received: 16, bytesReceived: 0)
                forwarder.publishCounts()
                usleep(5_000)  // the ICMP comes back before the next round
            }
        }
        let expected = payloads.indices.filter { $0 % 2 == 1 }.map { payloads[$0] }
        #expect(alive.drain() == expected, "the live downstream: every datagram, in order")
        let deadCounters = try #require(forwarder.plan?.counters[0])
        let aliveCounters = try #require(forwarder.plan?.counters[1])
        #expect(aliveCounters.forwarded.load(ordering: .relaxed) == UInt64(expected.count) && aliveCounters.dropped.load(ordering: .relaxed) == 0)
        let deadDropped = deadCounters.dropped.load(ordering: .relaxed)
        #expect(deadDropped > 0, "once named by the error queue, the dead downstream's runs go through its own socket, where ECONNREFUSED drops them counted")
        #expect(deadCounters.forwarded.load(ordering: .relaxed) + deadDropped == UInt64(rounds * 8), "each of the dead downstream's datagrams sent or counted")
    }

    @Test("a downstream's counts of runs staged from the thread's table reach its counters when the worker's turn ends (publishCounts), within a turn once the interval passed, and before a plan change; the listener's count is the batch's at once; nothing counted twice")
    func tableCountsPublished() throws {
        let sinks = try (0..<3).map { _ in try Sink() }
        let downstreams = sinks.enumerated().map { Downstream(name: "d\($0.offset)", address: $0.element.address) }
        var source = storage("127.0.0.1:40000")
        let payload = [UInt8](repeating: 3, count: 100)
        func batch(_ forwarder: BatchForwarder, _ targets: [Int]) {
            payload.withUnsafeBytes { bytes in
                for target in targets { forwarder.append(target, bytes, source: &source) }
                forwarder.flush(received: targets.count, bytesReceived: UInt64(targets.count * 100))
            }
        }
        func forwarded(_ plan: ForwardingPlan) -> [UInt64] { plan.counters.map { $0.forwarded.load(ordering: .relaxed) } }
        func bytes(_ plan: ForwardingPlan) -> [UInt64] { plan.counters.map { $0.bytes.load(ordering: .relaxed) } }

        // An interval no test outlasts: only the end of a turn or a plan change publishes.
        let counters = ListenerCounters(name: "publish", mode: "userspace")
        let first = ForwardingPlan(downstreams: downstreams, balancing: .roundRobin, quicLB: [], pools: [], counters: counters)
        let plans = PlanHolder(first)
        let forwarder = BatchForwarder(listener: "publish", counters: counters, plans: plans, logger: Logger(label: "publish-test"), output: .socket,
                                       capacity: 16, publishInterval: 3_600_000) { downstream, sender in
            DownstreamOutbox(address: downstream.address, capacity: 16, shared: sender)
        }
        forwarder.adoptPlanIfChanged()
        batch(forwarder, [0, 1, 0, 2, 0])
        batch(forwarder, [1, 1])
        #expect(counters.forwarded.load(ordering: .relaxed) == 7, "the listener's count is each batch's, at once")
        #expect(forwarded(first) == [0, 0, 0], "within the turn the downstreams' counts wait in the table")
        forwarder.publishCounts()
        #expect(forwarded(first) == [3, 3, 1] && bytes(first) == [300, 300, 100], "the end of the turn publishes them")
        forwarder.publishCounts()
        #expect(forwarded(first) == [3, 3, 1], "published once")
        batch(forwarder, [2, 2])
        // A plan change (d1 leaves): what was counted under the first plan goes to its counters first.
        let second = ForwardingPlan(downstreams: [downstreams[0], downstreams[2]], balancing: .roundRobin, quicLB: [], pools: [], counters: counters)
        plans.replace(with: second)
        forwarder.adoptPlanIfChanged()
        #expect(forwarded(first) == [3, 3, 3], "published before the new plan was taken")
        batch(forwarder, [0, 1, 1])
        forwarder.publishCounts()
        #expect(forwarded(second) == [4, 5], "the new plan's targets count into their downstreams' counters (kept by name): d0 +1, d2 +2")

        // Interval 0: every batch publishes (as a long turn does once the interval passed).
        let eager = ListenerCounters(name: "eager", mode: "userspace")
        let third = ForwardingPlan(downstreams: downstreams, balancing: .roundRobin, quicLB: [], pools: [], counters: eager)
        let eagerForwarder = BatchForwarder(listener: "eager", counters: eager, plans: PlanHolder(third), logger: Logger(label: "publish-test"), output: .socket,
                                            capacity: 16, publishInterval: 0) { downstream, sender in
            DownstreamOutbox(address: downstream.address, capacity: 16, shared: sender)
        }
        eagerForwarder.adoptPlanIfChanged()
        batch(eagerForwarder, [2, 0, 2])
        #expect(forwarded(third) == [1, 0, 2], "published by the batch once the interval passed")
        #expect(eagerForwarder.runsStagedFromTable == 2)
        let received = sinks.map { $0.drain(quiet: .milliseconds(50)).count }
        #expect(received == [5, 3, 7], "every datagram arrived: \(received)")
    }

    @Test("a plan change that drops outboxes the shelf does not keep (no route: connect failed) lets go of the thread's table before they are released (an outbox released while the table names it stops the process), and the next plan's table serves: its reachable downstream's run is staged from the table and arrives, the unreachable one's is dropped counted",
          .enabled(if: Privileges.enabled, Privileges.reason))
    func tableReleasedBeforeOutboxes() throws {
        // A namespace of the test's with only loopback up: a connect to 198.18.5.x fails (ENETUNREACH).
        let namespace = try Self.vethNamespace("rplb-table", [])
        defer { _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace]) }
        try #require(try run("/usr/sbin/ip", ["-n", namespace, "link", "set", "lo", "up"]).status == 0)
        let outcome = inNetworkNamespace(namespace) { () -> (unavailable: Int, staged: Int, dropped: UInt64, forwarded: [UInt64], received: Int)? in
            guard let sink = try? Sink() else { return nil }
            let counters = ListenerCounters(name: "table", mode: "userspace")
            let unreachable = (0..<3).map { Downstream(name: "d\($0)", address: SocketAddress(ip: IPAddress("198.18.5.\($0 + 1)")!, port: 7000)) }
            let reachable = Downstream(name: "live", address: sink.address)
            let plans = PlanHolder(ForwardingPlan(downstreams: Array(unreachable[0..<2]), balancing: .roundRobin, quicLB: [], pools: [], counters: counters))
            let forwarder = BatchForwarder(listener: "table", counters: counters, plans: plans, logger: Logger(label: "table-test"), output: .socket,
                                           capacity: 8) { downstream, sender in
                DownstreamOutbox(address: downstream.address, capacity: 8, shared: sender)
            }
            forwarder.adoptPlanIfChanged()
            let unavailable = forwarder.outboxes.filter { $0.unavailable != nil }.count
            plans.replace(with: ForwardingPlan(downstreams: [unreachable[2], reachable], balancing: .roundRobin, quicLB: [], pools: [], counters: counters))
            forwarder.adoptPlanIfChanged()
            var source = storage("127.0.0.1:40000")
            let payload = [UInt8](repeating: 1, count: 10)
            payload.withUnsafeBytes { bytes in
                forwarder.append(0, bytes, source: &source)
                forwarder.append(1, bytes, source: &source)
                forwarder.flush(received: 2, bytesReceived: 20)
            }
            forwarder.publishCounts()
            guard let plan = forwarder.plan else { return nil }
            return (unavailable, forwarder.runsStagedFromTable, plan.counters[0].dropped.load(ordering: .relaxed),
                    plan.counters.map { $0.forwarded.load(ordering: .relaxed) }, sink.drain().count)
        }
        let result = try #require(outcome ?? nil, "entered \(namespace), made a sink and a plan")
        #expect(result.unavailable == 2, "both first outboxes could not connect, so the shelf kept neither")
        #expect(result.staged == 1, "the reachable downstream's run was staged from the new table")
        #expect(result.forwarded == [0, 1] && result.received == 1, "it arrived and was counted: \(result.forwarded), \(result.received)")
        #expect(result.dropped == 1, "the unreachable one's datagram was dropped counted, through its outbox")
    }

    @Test("a membership change keeps the outboxes (sockets, state) of the downstreams that stay and makes only the new one's")
    func membershipKeepsOutboxes() throws {
        let addresses = (0..<4).map { _ in SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort()) }
        let downstreams = addresses.enumerated().map { Downstream(name: "d\($0.offset)", address: $0.element) }
        let counters = ListenerCounters(name: "shelf", mode: "userspace")
        let plans = PlanHolder(ForwardingPlan(downstreams: Array(downstreams[0..<3]), balancing: .roundRobin, quicLB: [], pools: [], counters: counters))
        var made: [SocketAddress] = []
        let forwarder = BatchForwarder(listener: "shelf", counters: counters, plans: plans, logger: Logger(label: "shelf-test"), output: .socket,
                                       capacity: 8) { downstream, sender in
            made.append(downstream.address)
            return DownstreamOutbox(address: downstream.address, capacity: 8, shared: sender)
        }
        forwarder.adoptPlanIfChanged()
        let before = forwarder.outboxes
        #expect(made == Array(addresses[0..<3]))
        // d1 leaves, d3 comes: d0 and d2 keep theirs, d3 gets a new one.
        plans.replace(with: ForwardingPlan(downstreams: [downstreams[0], downstreams[2], downstreams[3]], balancing: .roundRobin, quicLB: [], pools: [], counters: counters))
        forwarder.adoptPlanIfChanged()
        #expect(made == Array(addresses[0..<3]) + [addresses[3]], "only the new downstream's outbox is made: \(made)")
        #expect(forwarder.outboxes.count == 3)
        #expect(forwarder.outboxes[0] === before[0] && forwarder.outboxes[1] === before[2])
        #expect(forwarder.outboxes[2] !== before[1])
    }

    @Test("an outbox that could not be made (no route, no raw socket) is not kept: the next plan makes it again, which retries")
    func unavailableOutboxIsRemade() throws {
        let addresses = (0..<2).map { _ in SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort()) }
        let downstreams = addresses.enumerated().map { Downstream(name: "d\($0.offset)", address: $0.element) }
        let counters = ListenerCounters(name: "shelf", mode: "userspace")
        let plans = PlanHolder(ForwardingPlan(downstreams: downstreams, balancing: .roundRobin, quicLB: [], pools: [], counters: counters))
        var made: [SocketAddress] = []
        let forwarder = BatchForwarder(listener: "shelf", counters: counters, plans: plans, logger: Logger(label: "shelf-test"), output: .socket,
                                       capacity: 8) { downstream, sender -> any Outbox in
            made.append(downstream.address)
            // d0's first outbox cannot be made (as when its capability or route is missing).
            if downstream.address == addresses[0] && made.filter({ $0 == addresses[0] }).count == 1 {
                return UnavailableOutbox(problem: "test: no way out yet")
            }
            return DownstreamOutbox(address: downstream.address, capacity: 8, shared: sender)
        }
        forwarder.adoptPlanIfChanged()
        #expect(forwarder.outboxes[0].unavailable != nil)
        let kept = forwarder.outboxes[1]
        plans.replace(with: ForwardingPlan(downstreams: downstreams, balancing: .roundRobin, quicLB: [], pools: [], counters: counters))
        forwarder.adoptPlanIfChanged()
        #expect(made == addresses + [addresses[0]], "the unavailable outbox is made again, the working one kept: \(made)")
        #expect(forwarder.outboxes[0].unavailable == nil, "the second try works")
        #expect(forwarder.outboxes[1] === kept)
    }
}
