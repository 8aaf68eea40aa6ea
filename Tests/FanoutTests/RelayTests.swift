// SPDX-License-Identifier: Apache-2.0
import Foundation
import Logging
import Testing
import TestSupport
import CSystemShim
@testable import FanoutCore
import ReusePortLB
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// A downstream that answers every datagram with "<name>|<payload>" to its sender, on its own
/// thread; with `repeats` > 1, with that many replies "<name>|<payload>#<k>" (a server that streams).
final class RelayEcho: @unchecked Sendable {
    let name: String
    let repeats: Int
    let fd: Int32
    let address: SocketAddress
    private let stopFlag = NSLock()
    private var stopped = false
    private var thread: Thread?
    private let done = DispatchSemaphore(value: 0)

    init(name: String, repeats: Int = 1) throws {
        self.name = name
        self.repeats = repeats
        address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
        let bound = address.withSockAddr { bind(fd, $0, $1) }
        try #require(bound == 0, "bind \(address): errno \(errno)")
        let thread = Thread { [self] in serve() }
        self.thread = thread
        thread.start()
    }

    private var isStopped: Bool { stopFlag.lock(); defer { stopFlag.unlock() }; return stopped }

    private func serve() {
        var buffer = [UInt8](repeating: 0, count: 65536)
        var descriptor = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
        let prefix = Array("\(name)|".utf8)
        while !isStopped {
            guard poll(&descriptor, 1, 50) > 0 else { continue }
            var peer = sockaddr_storage()
            var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
            let count = withUnsafeMutablePointer(to: &peer) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { recvfrom(fd, &buffer, buffer.count, Int32(MSG_DONTWAIT), $0, &length) }
            }
            guard count >= 0 else { continue }
            for index in 0..<repeats {
                var reply = prefix + buffer[0..<count] + (repeats > 1 ? Array("#\(index)".utf8) : [])
                _ = withUnsafePointer(to: &peer) {
                    $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { sendto(fd, &reply, reply.count, 0, $0, length) }
                }
            }
        }
        done.signal()
    }

    /// Stops the thread and closes the socket (a downstream that went away: ICMP port unreachable).
    func stop() {
        stopFlag.lock()
        let first = !stopped
        stopped = true
        stopFlag.unlock()
        if first {
            done.wait()
            close(fd)
        }
    }

    deinit { stop() }
}

/// A downstream that answers each datagram late: one reply per entry of `delays` (milliseconds
/// after the request), "<name>|<payload>" for the first and "<name>|<payload>#late<k>" for the
/// others, on its own thread (a server that takes its time, or answers again much later). Counts
/// the replies it sent.
final class DelayedEcho: @unchecked Sendable {
    let name: String
    let fd: Int32
    let address: SocketAddress
    private let lock = NSLock()
    private var stopped = false
    private var delays: [Int]
    private var sentReplies = 0
    private let done = DispatchSemaphore(value: 0)

    init(name: String, delays: [Int]) throws {
        self.name = name
        self.delays = delays
        address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_NONBLOCK.rawValue), 0)
        let bound = address.withSockAddr { bind(fd, $0, $1) }
        try #require(bound == 0, "bind \(address): errno \(errno)")
        Thread { [self] in serve() }.start()
    }

    /// The delays of the replies to requests from now on.
    func answer(after delays: [Int]) { lock.withLock { self.delays = delays } }

    /// Replies sent so far.
    var sent: Int { lock.withLock { sentReplies } }

    private func serve() {
        var pending: [(due: Int64, peer: sockaddr_storage, length: socklen_t, reply: [UInt8])] = []
        var buffer = [UInt8](repeating: 0, count: 65536)
        while !lock.withLock({ stopped }) {
            let now = monotonicMilliseconds()
            let wait = pending.map(\.due).min().map { max(0, min(50, $0 - now)) } ?? 50
            var descriptor = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
            if poll(&descriptor, 1, Int32(wait)) > 0 {
                let delays = lock.withLock { self.delays }
                while true {
                    var peer = sockaddr_storage()
                    var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
                    let count = withUnsafeMutablePointer(to: &peer) {
                        $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { recvfrom(fd, &buffer, buffer.count, 0, $0, &length) }
                    }
                    guard count >= 0 else { break }
                    let received = monotonicMilliseconds()
                    for (index, delay) in delays.enumerated() {
                        let reply = Array("\(name)|".utf8) + buffer[0..<count] + (index > 0 ? Array("#late\(index)".utf8) : [])
                        pending.append((received + Int64(delay), peer, length, reply))
                    }
                }
            }
            let due = monotonicMilliseconds()
            var sent = 0
            pending.removeAll { entry in
                guard entry.due <= due else { return false }
                var peer = entry.peer
                var reply = entry.reply
                let result = withUnsafePointer(to: &peer) {
                    $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { sendto(fd, &reply, reply.count, 0, $0, entry.length) }
                }
                if result >= 0 { sent += 1 }
                return true
            }
            if sent > 0 { lock.withLock { sentReplies += sent } }
        }
        done.signal()
    }

    func stop() {
        let first = lock.withLock { () -> Bool in
            defer { stopped = true }
            return !stopped
        }
        if first {
            done.wait()
            close(fd)
        }
    }

    deinit { stop() }
}

/// A client on one loopback source: sends a request and waits for the reply.
final class RelayClient {
    let fd: Int32
    let source: String

    init(source: String) throws {
        self.source = source
        fd = socket(IPAddress(source)!.family, Int32(SOCK_DGRAM.rawValue), 0)
        try #require(SocketAddress(ip: IPAddress(source)!, port: 0).withSockAddr { bind(fd, $0, $1) } == 0, "bind \(source): errno \(errno)")
    }

    deinit { close(fd) }

    func send(_ text: String, to destination: SocketAddress) throws {
        var payload = Array(text.utf8)
        let sent = destination.withSockAddr { sendto(fd, &payload, payload.count, 0, $0, $1) }
        try #require(sent == payload.count, "sendto: errno \(errno)")
    }

    /// The next reply and its source, or nil when nothing came within `timeout` milliseconds.
    func receive(timeout: Int32 = 1000) -> (text: String, from: SocketAddress)? {
        var descriptor = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
        guard poll(&descriptor, 1, timeout) > 0 else { return nil }
        var buffer = [UInt8](repeating: 0, count: 65536)
        var peer = sockaddr_storage()
        var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
        let count = withUnsafeMutablePointer(to: &peer) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { recvfrom(fd, &buffer, buffer.count, Int32(MSG_DONTWAIT), $0, &length) }
        }
        guard count >= 0, let from = withUnsafePointer(to: &peer, { SocketAddress(storage: UnsafeRawPointer($0)) }) else { return nil }
        return (String(decoding: buffer[0..<count], as: UTF8.self), from)
    }

    /// One round trip: the downstream's name that answered, after checking the reply's source and payload.
    func exchange(_ text: String, with listener: SocketAddress, timeout: Int32 = 1000) throws -> String? {
        try send(text, to: listener)
        guard let reply = receive(timeout: timeout) else { return nil }
        #expect(reply.from == listener, "reply source \(reply.from), expected the listener \(listener)")
        let parts = reply.text.split(separator: "|", maxSplits: 1).map(String.init)
        #expect(parts.count == 2 && parts[1] == text, "reply \(reply.text) to \(text)")
        return parts.first
    }
}

func relayYAML(_ name: String, bind: SocketAddress, _ servers: [RelayEcho], workers: Int = 2, settings: String = "") -> String {
    relayYAML(name, bind: bind, downstreams: servers.map { ($0.name, $0.address) }, workers: workers, settings: settings)
}

func drainYAML(_ name: String, bind: SocketAddress, _ servers: [DelayedEcho], workers: Int = 2, settings: String = "") -> String {
    relayYAML(name, bind: bind, downstreams: servers.map { ($0.name, $0.address) }, workers: workers, settings: settings)
}

func relayYAML(_ name: String, bind: SocketAddress, downstreams: [(name: String, address: SocketAddress)], workers: Int, settings: String) -> String {
    var yaml = "listeners:\n  - name: \(name)\n    bind: \"\(bind)\"\n    mode: userspace\n    replies: relay\n"
    // An 8 MiB receive buffer per worker, as the other loopback tests have: the exact counts these
    // tests assert must not depend on a worker getting a CPU within a few ms on a busy machine
    // (a default buffer overflowed there: 135 of 2,400 requests dropped, counted receive_queue_drops).
    yaml += "    settings:\n      workers: \(workers)\n      worker_steering: five_tuple\n      recv_buf_size: 8388608\n\(settings)    downstream:\n"
    for server in downstreams { yaml += "      - name: \(server.name)\n        address: \"\(server.address)\"\n" }
    return yaml
}

/// The sockets this process has open (/proc/self/fd links "socket:[inode]"), by descriptor. Sockets
/// only: the daemon's first start in a process makes pipes that live on (not the listener's).
func openSockets() -> Set<String> {
    Set(((try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/fd")) ?? []).compactMap { fd in
        guard let target = try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/fd/\(fd)"), target.hasPrefix("socket:") else { return nil }
        return "\(fd)=\(target)"
    })
}

/// ``openSockets()`` limited to UDP sockets whose local or remote port is one of `ports`
/// (/proc/self/net/udp and udp6): a test's listener and session sockets, not the sockets of
/// tests running beside it.
func openSockets(_ ports: Set<UInt16>) -> Set<String> {
    var inodes = Set<String>()
    for table in ["/proc/self/net/udp", "/proc/self/net/udp6"] {
        // fread to the end: procfs gives a page per read (String(contentsOfFile:) would stop there).
        let text = (try? readFile(table)) ?? ""
        for line in text.split(separator: "\n").dropFirst() {
            let fields = line.split(separator: " ")
            guard fields.count > 9 else { continue }
            let local = fields[1].split(separator: ":").last.flatMap { UInt16($0, radix: 16) }
            let remote = fields[2].split(separator: ":").last.flatMap { UInt16($0, radix: 16) }
            if local.map(ports.contains) == true || remote.map(ports.contains) == true { inodes.insert(String(fields[9])) }
        }
    }
    return openSockets().filter { entry in inodes.contains(String(entry.split(separator: "[").last?.dropLast() ?? "")) }
}

/// How many io_uring instances this process has open (/proc/self/fd links "anon_inode:[io_uring]"):
/// one per relay worker that uses its ring.
func openRings() -> Int {
    ((try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/fd")) ?? []).filter { fd in
        (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/fd/\(fd)")) == "anon_inode:[io_uring]"
    }.count
}

/// Every client sends a request every 10 ms for `rounds` rounds; at round 20 `reload` runs on
/// another thread (each client then has about 3 requests in flight at 30 ms servers). Then
/// every client collects its replies (1 s each: plenty on loopback).
/// - Returns: whether the reload was applied, the replies that never came, and those that came
///   from another address than `bind`.
func exchangeAcrossReload(_ clients: [RelayClient], bind: SocketAddress, rounds: Int,
                          reload: @escaping @Sendable () -> Bool) throws -> (applied: Bool, lost: Int, fromElsewhere: Int) {
    let reloaded = DispatchSemaphore(value: 0)
    let accepted = Mutex(false)
    for round in 0..<rounds {
        for client in clients { try client.send("\(client.source)-\(round)", to: bind) }
        if round == 20 {
            Thread {
                let result = reload()
                accepted.withLock { $0 = result }
                reloaded.signal()
            }.start()
        }
        usleep(10_000)
    }
    let finished = reloaded.wait(timeout: .now() + 10) == .success
    var lost = 0
    var fromElsewhere = 0
    for client in clients {
        var expected = Set((0..<rounds).map { "\(client.source)-\($0)" })
        while !expected.isEmpty, let reply = client.receive(timeout: 1000) {
            if reply.from != bind { fromElsewhere += 1 }
            let parts = reply.text.split(separator: "|", maxSplits: 1).map(String.init)
            if parts.count == 2 { expected.remove(parts[1]) }
        }
        lost += expected.count
    }
    return (finished && accepted.withLock { $0 }, lost, fromElsewhere)
}

/// Waits (at most 2 s) until `condition` holds: counters are added after each batch is sent, so
/// a client can hold its reply an instant before the counter has it.
func settle(_ condition: () -> Bool) {
    let deadline = ContinuousClock.now + .seconds(2)
    while !condition() && ContinuousClock.now < deadline { usleep(10_000) }
}

@Suite("replies: relay (userspace)", .serialized)
struct RelayTests {
    @Test("50 clients × 20 exchanges over 3 echo downstreams: every reply from the listener's address, one downstream per client")
    func relayRoundTrips() throws {
        let servers = try (1...3).map { try RelayEcho(name: "echo-\($0)") }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let daemon = try startDaemon(relayYAML("relay", bind: bind, servers))
        defer { daemon.shutdown() }
        let clients = try loopbackSources(50, base: 60).map { try RelayClient(source: $0) }
        var owners: [String: Set<String>] = [:]
        var answered = 0
        for round in 0..<20 {
            for client in clients {
                if let server = try client.exchange("\(client.source)-\(round)", with: bind) {
                    answered += 1
                    owners[client.source, default: []].insert(server)
                }
            }
        }
        #expect(answered == 1000)
        settle { daemon.counters(of: "relay")?.twoWay?.replies == 1000 }
        #expect(owners.count == 50 && owners.values.allSatisfy { $0.count == 1 }, "each client answered by one downstream: \(owners.filter { $0.value.count != 1 })")
        let perServer = Dictionary(grouping: owners.values.compactMap(\.first), by: { $0 }).mapValues(\.count)
        #expect(perServer.count == 3, "round robin spreads the sessions: \(perServer)")
        let snapshot = try #require(daemon.counters(of: "relay"))
        let twoWay = try #require(snapshot.twoWay)
        #expect(snapshot.received == 1000 && snapshot.forwarded == 1000)
        #expect(twoWay.replies == 1000)
        #expect(twoWay.associations == 50)
        #expect(twoWay.events[.created] == 50)
        #expect(twoWay.downstreamReplies.values.reduce(0, +) == 1000)
        #expect(twoWay.replyBytes > 0)
        let metrics = daemon.metricsText()
        #expect(metric(metrics, "udp_fanout_associations", "listener=\"relay\",mode=\"userspace\"") == 50, "\(metrics)")
    }

    @Test("Replies gathered from many sessions into one send: each reaches its own client once; a too-large one among them is counted, the others still go out",
          arguments: [true, false])
    func gatheredReplies(ioUring: Bool) throws {
        let servers = try (1...2).map { try RelayEcho(name: "echo-\($0)") }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let rings = openRings()
        // One worker and a batch of 8: 40 clients' replies fill the stage several times over.
        // max_packet_size 64: a 60-byte request fits, its echo ("echo-N|" + 60 bytes) does not.
        let daemon = try startDaemon(relayYAML("gather", bind: bind, servers, workers: 1,
                                               settings: "      batch_size: 8\n      max_packet_size: 64\n      io_uring: \(ioUring)\n"))
        defer { daemon.shutdown() }
        // io_uring: the worker's sends and receives on session sockets go through its ring.
        settle { openRings() == rings + (ioUring ? 1 : 0) }
        #expect(openRings() == rings + (ioUring ? 1 : 0), "io_uring: \(ioUring)")
        let clients = try loopbackSources(40, base: 120).map { try RelayClient(source: $0) }
        for round in 0..<5 {
            // Every client's request out first, then every reply read: the replies wait on 40
            // session sockets together, so one wakeup gathers many of them.
            for (index, client) in clients.enumerated() {
                let text = index == 7 && round == 2 ? String(repeating: "x", count: 60) : "\(client.source)-\(round)"
                try client.send(text, to: bind)
            }
            for (index, client) in clients.enumerated() {
                if index == 7 && round == 2 {
                    #expect(client.receive(timeout: 300) == nil, "the too-large reply is not sent (cut)")
                    continue
                }
                let reply = try #require(client.receive(), "\(client.source) round \(round): no reply")
                #expect(reply.from == bind)
                #expect(reply.text.hasSuffix("|\(client.source)-\(round)"), "\(client.source) got \(reply.text)")
            }
        }
        for client in clients { #expect(client.receive(timeout: 0) == nil, "\(client.source): a reply more than once") }
        settle { daemon.counters(of: "gather")?.twoWay?.replies == 199 }
        let twoWay = try #require(daemon.counters(of: "gather")?.twoWay)
        #expect(twoWay.replies == 199)
        #expect(twoWay.replyDropped[.tooLarge] == 1)
        #expect(twoWay.downstreamReplies.values.reduce(0, +) == 199, "\(twoWay.downstreamReplies)")
        #expect(twoWay.downstreamReplies.count == 2 && twoWay.downstreamReplies.values.allSatisfy { $0 > 0 })
        if ioUring {
            #expect(twoWay.ringSends == 200 && twoWay.ringReceives >= 199, "every request sent through the ring: \(twoWay.ringSends), receives \(twoWay.ringReceives)")
        } else {
            #expect(twoWay.ringSends == 0 && twoWay.ringReceives == 0)
        }
    }

    @Test("A downstream that streams (50 replies per request) to a few clients: every reply arrives once, in order, from the listener",
          arguments: [true, false])
    func streamingReplies(ioUring: Bool) throws {
        let server = try RelayEcho(name: "stream", repeats: 50)
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let rings = openRings()
        let daemon = try startDaemon(relayYAML("stream", bind: bind, [server], workers: 1, settings: "      batch_size: 16\n      io_uring: \(ioUring)\n"))
        defer { daemon.shutdown() }
        settle { openRings() == rings + (ioUring ? 1 : 0) }
        #expect(openRings() == rings + (ioUring ? 1 : 0), "io_uring: \(ioUring)")
        // A session readable wakeup after wakeup is busy: it is read in batches, and the ring
        // still takes the others' single replies.
        let clients = try loopbackSources(3, base: 180).map { try RelayClient(source: $0) }
        for round in 0..<4 {
            for client in clients { try client.send("\(client.source)-\(round)", to: bind) }
            for client in clients {
                for index in 0..<50 {
                    let reply = try #require(client.receive(), "\(client.source) round \(round): reply \(index) missing")
                    #expect(reply.from == bind)
                    #expect(reply.text == "stream|\(client.source)-\(round)#\(index)", "\(client.source) expected #\(index), got \(reply.text)")
                }
            }
        }
        for client in clients { #expect(client.receive(timeout: 100) == nil, "\(client.source): more replies than sent") }
        settle { daemon.counters(of: "stream")?.twoWay?.replies == 600 }
        let snapshot = try #require(daemon.counters(of: "stream"))
        #expect(snapshot.forwarded == 12 && snapshot.twoWay?.replies == 600)
        #expect(snapshot.twoWay?.downstreamReplies["stream"] == 600)
        #expect(ioUring ? snapshot.twoWay?.ringSends == 12 : snapshot.twoWay?.ringSends == 0)
    }

    @Test("A failed io_uring submit (sends, or receives): the worker leaves its ring and finishes by system calls; nothing is lost",
          arguments: [true, false])
    func ringSubmitFails(sending: Bool) throws {
        let servers = try (1...2).map { try RelayEcho(name: "echo-\($0)") }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let rings = openRings()
        let daemon = try startDaemon(relayYAML("fails", bind: bind, servers, workers: 1, settings: "      batch_size: 8\n"))
        defer { daemon.shutdown() }
        settle { openRings() == rings + 1 }
        let clients = try loopbackSources(30, base: 150).map { try RelayClient(source: $0) }
        func round(_ number: Int) throws {
            // All requests first: the sends and the replies' receives come in batches.
            for client in clients { try client.send("\(client.source)-\(number)", to: bind) }
            for client in clients {
                let reply = try #require(client.receive(), "\(client.source) round \(number): no reply")
                #expect(reply.from == bind && reply.text.hasSuffix("|\(client.source)-\(number)"), "\(reply.text)")
            }
        }
        try round(0)
        let before = try #require(daemon.counters(of: "fails")?.twoWay)
        #expect(before.ringSends == 30)
        if sending { RelayWorker.injectedSendFailure.store(EIO, ordering: .relaxed) } else { RelayWorker.injectedReceiveFailure.store(EIO, ordering: .relaxed) }
        for number in 1...3 { try round(number) }
        #expect(RelayWorker.injectedSendFailure.load(ordering: .relaxed) == 0 && RelayWorker.injectedReceiveFailure.load(ordering: .relaxed) == 0, "the failure was used")
        #expect(openRings() == rings, "the ring is closed after the failure")
        settle { daemon.counters(of: "fails")?.twoWay?.replies == 120 }
        let snapshot = try #require(daemon.counters(of: "fails"))
        #expect(snapshot.received == 120 && snapshot.forwarded == 120 && snapshot.droppedTotal == 0)
        #expect(snapshot.twoWay?.replies == 120)
        // After the failure nothing more goes through a ring (at most the batch that failed had results).
        #expect((snapshot.twoWay?.ringSends ?? 0) <= 60, "\(snapshot.twoWay?.ringSends ?? 0)")
    }

    @Test("max_sessions 10 with 20 clients: 10 served, the other datagrams dropped and counted table_full")
    func tableFull() throws {
        let servers = try (1...2).map { try RelayEcho(name: "echo-\($0)") }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let log = LogStore()
        let daemon = try startDaemon(relayYAML("full", bind: bind, servers, settings: "      max_sessions: 10\n"), logger: log.logger)
        defer { daemon.shutdown() }
        let clients = try loopbackSources(20, base: 120).map { try RelayClient(source: $0) }
        var served = 0
        var unanswered = 0
        let warning = "relay session table full"
        func warnings() -> [LogStore.Line] { log.lines.withLock { $0.filter { $0.message.hasPrefix(warning) } } }
        for round in 0..<3 {
            for client in clients {
                // A turned-away client waits for nothing: 500 ms is plenty on loopback.
                if try client.exchange("\(client.source)-\(round)", with: bind, timeout: 500) != nil { served += 1 } else { unanswered += 1 }
            }
            if round == 0 {
                // 10 refusals in about 5 s: said once, at the first, naming the setting and its value.
                let lines = warnings()
                #expect(lines.count == 1, "\(lines)")
                #expect(lines.first?.message.contains("settings.max_sessions") == true, "\(lines)")
                #expect(lines.first?.metadata["max_sessions"] == "10" && lines.first?.metadata["listener"] == "full", "\(lines)")
                #expect(lines.first?.metadata["refused_since_last_line"] == "1", "\(lines)")
            }
        }
        #expect(served == 30 && unanswered == 30)
        // 30 refusals over about 15 s: at most one more line, 10 s after the first.
        #expect((1...2).contains(warnings().count), "\(warnings())")
        settle { daemon.counters(of: "full")?.twoWay?.replies == 30 }
        let snapshot = try #require(daemon.counters(of: "full"))
        let twoWay = try #require(snapshot.twoWay)
        #expect(snapshot.received == 60)
        #expect(snapshot.dropped[.tableFull] == 30)
        #expect(snapshot.forwarded == 30)
        #expect(twoWay.events[.tableFull] == 30)
        #expect(twoWay.associations == 10)
        #expect(twoWay.replies == 30)
    }

    @Test("The table_full warning: the first refusal at once, then at most one line per 10 s with the refusals since")
    func tableFullWarningRate() {
        let warning = SessionTableFullWarning(maxSessions: 10)
        #expect(warning.due(1, now: 50_000) == 1)
        #expect(warning.due(3, now: 55_000) == nil)
        #expect(warning.due(2, now: 59_999) == nil)
        #expect(warning.due(1, now: 60_000) == 6)
        #expect(warning.due(4, now: 60_001) == nil)
        #expect(warning.due(1, now: 70_001) == 5)
    }

    @Test("session_idle_secs 1: idle sessions expire (gauge 0, expired == clients); a new datagram makes a new session")
    func idleExpiry() throws {
        let servers = try (1...2).map { try RelayEcho(name: "echo-\($0)") }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let daemon = try startDaemon(relayYAML("idle", bind: bind, servers, settings: "      session_idle_secs: 1\n"))
        defer { daemon.shutdown() }
        let clients = try loopbackSources(8, base: 150).map { try RelayClient(source: $0) }
        for client in clients { #expect(try client.exchange("\(client.source)-first", with: bind) != nil) }
        #expect(daemon.counters(of: "idle")?.twoWay?.associations == 8)
        let deadline = ContinuousClock.now + .seconds(4)
        while daemon.counters(of: "idle")?.twoWay?.associations != 0 && ContinuousClock.now < deadline { usleep(100_000) }
        let idle = try #require(daemon.counters(of: "idle")?.twoWay)
        #expect(idle.associations == 0)
        #expect(idle.events[.expired] == 8)
        #expect(try clients[0].exchange("again", with: bind) != nil)
        let after = try #require(daemon.counters(of: "idle")?.twoWay)
        #expect(after.associations == 1)
        #expect(after.events[.created] == 9)
    }

    @Test("Reload removing one downstream: only its clients move; after stop no session socket is left open")
    func reloadMovesOnlyRemovedClients() throws {
        let servers = try (1...3).map { try RelayEcho(name: "echo-\($0)") }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let clients = try loopbackSources(30, base: 170).map { try RelayClient(source: $0) }
        // Only this test's sockets (others run in parallel): the listener's and those toward its servers.
        let scope = Set([bind.port] + servers.map(\.address.port))
        let before = openSockets(scope)
        let daemon = try startDaemon(relayYAML("move", bind: bind, servers))
        var owner: [String: String] = [:]
        for client in clients { owner[client.source] = try client.exchange("\(client.source)-1", with: bind) }
        #expect(owner.count == 30)
        let removed = owner.values.filter { $0 == "echo-2" }.count
        #expect(removed > 0)
        #expect(daemon.reload(text: relayYAML("move", bind: bind, [servers[0], servers[2]])))
        for client in clients {
            let now = try client.exchange("\(client.source)-2", with: bind)
            if owner[client.source] == "echo-2" {
                #expect(now != nil && now != "echo-2", "\(client.source) moved off the removed downstream: \(String(describing: now))")
            } else {
                #expect(now == owner[client.source], "\(client.source) kept its downstream")
            }
        }
        let twoWay = try #require(daemon.counters(of: "move")?.twoWay)
        #expect(twoWay.events[.moved] == UInt64(removed))
        #expect(twoWay.events[.created] == 30)
        #expect(twoWay.associations == 30)
        #expect(openSockets(scope).subtracting(before).count >= 30, "one session socket per client while running")
        daemon.shutdown()
        #expect(openSockets(scope) == before, "every session socket closed after stop; still open: \(openSockets(scope).subtracting(before))")
    }

    @Test("A reload that restarts the listener (settings changed): its relay totals go on from where they were")
    func restartKeepsTotals() throws {
        let servers = try (1...2).map { try RelayEcho(name: "echo-\($0)") }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let daemon = try startDaemon(relayYAML("restart", bind: bind, servers))
        defer { daemon.shutdown() }
        let clients = try loopbackSources(5, base: 250).map { try RelayClient(source: $0) }
        for client in clients { #expect(try client.exchange("\(client.source)-1", with: bind) != nil) }
        settle { daemon.counters(of: "restart")?.twoWay?.replies == 5 }
        #expect(daemon.reload(text: relayYAML("restart", bind: bind, servers, settings: "      session_idle_secs: 300\n")))
        for client in clients { #expect(try client.exchange("\(client.source)-2", with: bind) != nil) }
        settle { daemon.counters(of: "restart")?.twoWay?.replies == 10 }
        let twoWay = try #require(daemon.counters(of: "restart")?.twoWay)
        #expect(twoWay.replies == 10)
        #expect(twoWay.downstreamReplies.values.reduce(0, +) == 10)
        // The restarted listener's sessions are new ones.
        #expect(twoWay.events[.created] == 10)
        #expect(twoWay.associations == 5)
    }

    @Test("A listener restart counts every reply: also those the old instance relays after the new one was made, before it takes the bind over")
    func restartCountsEveryReply() throws {
        let server = try RelayEcho(name: "echo-1")
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let config = try ConfigParser.parse(relayYAML("swap", bind: bind, [server], workers: 1))
        try config.validate()
        // As the daemon restarts a listener: the counters stay, the new instance is made beside
        // the old one, takes the bind over, and only then the old one stops.
        let counters = ListenerCounters(name: "swap", mode: "userspace")
        let old = try RelayListener(config.listeners[0], counters: counters, logger: Logger(label: "relay-test"))
        try old.activate()
        let clients = try loopbackSources(10, base: 100).map { try RelayClient(source: $0) }
        func round(_ number: Int) throws {
            for client in clients { #expect(try client.exchange("\(client.source)-\(number)", with: bind) != nil, "\(client.source) round \(number)") }
        }
        try round(0)
        var changed = config.listeners[0]
        changed.settings.sessionIdleSecs = 300
        let new = try RelayListener(changed, counters: counters, logger: Logger(label: "relay-test"))
        defer { new.shutdown() }
        try round(1)  // still the old instance's: the new one has not taken the bind over
        try new.activate()
        old.shutdown()
        try round(2)
        settle { counters.snapshot().twoWay?.replies == 30 }
        let twoWay = try #require(counters.snapshot().twoWay)
        #expect(twoWay.replies == 30, "replies relayed by either instance: \(twoWay.replies)")
        #expect(twoWay.downstreamReplies["echo-1"] == 30)
        #expect(twoWay.events[.created] == 20, "10 sessions in each instance")
        #expect(twoWay.associations == 10, "the running instance's sessions")
    }

    @Test("A downstream that is down (ICMP port unreachable on the session socket): counted, the others still served",
          arguments: [true, false])
    func downstreamDown(ioUring: Bool) throws {
        let servers = try (1...2).map { try RelayEcho(name: "echo-\($0)") }
        servers[1].stop()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        // One worker: its round robin alternates the clients exactly over the two downstreams.
        let daemon = try startDaemon(relayYAML("down", bind: bind, servers, workers: 1, settings: "      io_uring: \(ioUring)\n"))
        defer { daemon.shutdown() }
        let clients = try loopbackSources(10, base: 210).map { try RelayClient(source: $0) }
        var answered = 0
        for round in 0..<3 {
            for client in clients where try client.exchange("\(client.source)-\(round)", with: bind, timeout: 500) != nil { answered += 1 }
        }
        // Round robin: half the clients' sessions go to the closed port.
        #expect(answered == 15)
        settle { daemon.counters(of: "down")?.twoWay?.replies == 15 }
        let snapshot = try #require(daemon.counters(of: "down"))
        // The ICMP error read on a session socket belongs to a request that was sent (forwarded):
        // it is counted on the reply side, and the one-way balance stays exact.
        let refused = snapshot.twoWay?.replyDropped[.downstreamUnreachable] ?? 0
        #expect(refused > 0, "\(String(describing: snapshot.twoWay?.replyDropped))")
        #expect(refused + snapshot.dropped[.unreachable, default: 0] <= 15, "at most one refusal per request to the closed port")
        #expect(snapshot.received == snapshot.forwarded + snapshot.droppedTotal + snapshot.noHealthy,
                "received \(snapshot.received) = forwarded \(snapshot.forwarded) + dropped \(snapshot.droppedTotal) + no_healthy \(snapshot.noHealthy)")
        #expect(snapshot.twoWay?.replies == 15)
    }

    @Test("Reload removing a downstream that answers in 30 ms, under continuous traffic: its clients' in-flight replies still reach them from the listener (drain), counted for it by name")
    func removedDownstreamDrains() throws {
        let servers = try (1...2).map { try DelayedEcho(name: "slow-\($0)", delays: [30]) }
        defer { for server in servers { server.stop() } }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let daemon = try startDaemon(drainYAML("drain", bind: bind, servers))
        defer { daemon.shutdown() }
        let clients = try loopbackSources(40, base: 20).map { try RelayClient(source: $0) }
        // The reload removing slow-2 while slow-2 still owes each of its clients about 3 replies.
        let rounds = 60
        let text = drainYAML("drain", bind: bind, [servers[0]])
        let (applied, lost, fromElsewhere) = try exchangeAcrossReload(clients, bind: bind, rounds: rounds) { daemon.reload(text: text) }
        #expect(applied, "the reload was applied")
        // Every request gets its reply, from the listener's address.
        #expect(lost == 0, "replies lost: \(lost) of \(rounds * clients.count)")
        #expect(fromElsewhere == 0)
        let total = servers.map(\.sent).reduce(0, +)
        #expect(total == rounds * clients.count, "the servers answered every request: \(total)")
        settle { daemon.counters(of: "drain")?.twoWay?.replies == UInt64(total) }
        let snapshot = try #require(daemon.counters(of: "drain"))
        let twoWay = try #require(snapshot.twoWay)
        #expect(twoWay.replies == UInt64(total))
        #expect(twoWay.downstreamReplies["slow-2"] == UInt64(servers[1].sent), "the removed downstream's replies, by name: \(twoWay.downstreamReplies), it sent \(servers[1].sent)")
        #expect(twoWay.downstreamReplies["slow-1"] == UInt64(servers[0].sent))
        #expect(twoWay.replyDropped[.drained, default: 0] == 0)
        #expect(twoWay.events[.moved, default: 0] > 0)
        #expect(snapshot.received == UInt64(rounds * clients.count))
        #expect(snapshot.received == snapshot.forwarded + snapshot.droppedTotal + snapshot.noHealthy,
                "received \(snapshot.received) = forwarded \(snapshot.forwarded) + dropped \(snapshot.droppedTotal) + no_healthy \(snapshot.noHealthy)")
    }

    @Test("A reload that hands the listener to a successor on its bind (renamed, or restarted by a settings change) under traffic, downstreams answering in 30 ms: the old instance's in-flight replies still reach their clients from the listener (its sessions drain for the successor's drain_secs; with 0 they are counted drained), every one counted; it stops once they are silent",
          arguments: ["rename", "restart", "rename, drain_secs 0"])
    func handOverDrains(change: String) throws {
        let servers = try (1...2).map { try DelayedEcho(name: "hand-\($0)", delays: [30]) }
        defer { for server in servers { server.stop() } }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let log = CapturedLog()
        let settings = "      drain_secs: 5\n      session_idle_secs: 1\n"
        let clients = try loopbackSources(40, base: 70).map { try RelayClient(source: $0) }
        // Only this test's sockets (others run in parallel): the listener's and those toward its servers.
        let scope = Set([bind.port] + servers.map(\.address.port))
        let before = openSockets(scope)
        let daemon = try startDaemon(drainYAML("hand", bind: bind, servers, settings: settings), logger: log.logger(level: .info))
        defer { daemon.shutdown() }
        let drains = change != "rename, drain_secs 0"
        let renamed = change != "restart"
        // The successor's drain_secs governs the handover (0: the old sessions' replies are counted, not relayed).
        let (successor, successorSettings) = renamed ? ("hand-renamed", drains ? settings : "      drain_secs: 0\n      session_idle_secs: 1\n")
                                                     : ("hand", "      drain_secs: 5\n      session_idle_secs: 2\n")
        // The reload while each client still has about 3 requests in flight at the old instance's sessions.
        let rounds = 60
        let text = drainYAML(successor, bind: bind, servers, settings: successorSettings)
        let drainingSeries = Mutex(false)
        let (applied, lost, fromElsewhere) = try exchangeAcrossReload(clients, bind: bind, rounds: rounds) {
            // drain_secs 0: replies to the requests just before the reload come 300 ms late, after the
            // old workers stopped (they relay only what is queued then), so the old sessions get some.
            if !drains { for server in servers { server.answer(after: [300]) } }
            let applied = daemon.reload(text: text)
            // Read at once: the old instance drains for 5 s from here.
            drainingSeries.withLock { $0 = daemon.metricsText().contains("udp_fanout_replies_total{listener=\"hand\"") }
            return applied
        }
        #expect(applied, "the reload was applied")
        #expect(log.count(.info, containing: "listener handed over") == 1, "\(log.all.map(\.message))")
        if renamed {
            #expect(drainingSeries.withLock { $0 }, "the old name's series stay while it drains")
        }
        #expect(fromElsewhere == 0)
        let total = servers.map(\.sent).reduce(0, +)
        #expect(total == rounds * clients.count, "the servers answered every request: \(total)")
        let names = renamed ? ["hand", "hand-renamed"] : ["hand"]
        func replies() -> UInt64 { names.compactMap { daemon.counters(of: $0)?.twoWay?.replies }.reduce(0, +) }
        func drained() -> UInt64 { daemon.counters(of: "hand")?.twoWay?.replyDropped[.drained, default: 0] ?? 0 }
        settle { replies() + drained() == UInt64(total) }
        if drains {
            #expect(lost == 0, "replies lost: \(lost) of \(rounds * clients.count)")
            #expect(replies() == UInt64(total), "every reply counted, by either instance")
        } else {
            // Not relayed, but every one the old sessions got is counted: nothing reaches a closed socket.
            #expect(lost > 0 && UInt64(lost) == drained(), "\(lost) replies not relayed, \(drained()) counted drained")
            #expect(replies() + drained() == UInt64(total), "every reply relayed or counted: \(replies()) + \(drained()) of \(total)")
        }
        // Each client's session at the old instance was handed over (one session per client).
        #expect(daemon.counters(of: "hand")?.twoWay?.events[.handedOver] == UInt64(clients.count))
        // The old instance stops by itself once its sessions are silent (drain_secs 5, then 1 s idle).
        let deadline = ContinuousClock.now + .seconds(15)
        while log.count(.info, containing: "handed-over listener stopped") == 0 && ContinuousClock.now < deadline { usleep(50_000) }
        #expect(log.count(.info, containing: "handed-over listener stopped: its sessions drained") == 1)
        if renamed {
            #expect(!daemon.metricsText().contains("listener=\"hand\""), "gone with the old instance")
        }
        for name in names {
            let twoWay = try #require(daemon.counters(of: name)?.twoWay)
            #expect(twoWay.replyDropped.filter { $0.key != .drained }.values.reduce(0, +) == 0, "\(name): \(twoWay.replyDropped)")
        }
        // The old instance's sockets are all closed: once the successor's sessions expire too
        // (session_idle_secs), only its two workers' listener sockets are left.
        let deadline2 = ContinuousClock.now + .seconds(6)
        while openSockets(scope).subtracting(before).count != 2 && ContinuousClock.now < deadline2 { usleep(50_000) }
        #expect(openSockets(scope).subtracting(before).count == 2, "\(openSockets(scope).subtracting(before))")
    }

    @Test("A handover ends or never starts where draining cannot work: the daemon stops (drain cut short at once), the successor is removed (cut short), the bind handed over again (the first drain cut short), another address on the port (a wildcard is another kernel group: no handover); an unrelated reload does not end it; every socket closed after",
          arguments: ["stop", "successor removed", "handed over again", "unrelated reload", "wildcard"])
    func handOverEnds(change: String) throws {
        let server = try RelayEcho(name: "end-1")
        let second = try RelayEcho(name: "end-2")
        let port = freePort()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: port)
        let clients = try loopbackSources(10, base: 120).map { try RelayClient(source: $0) }
        // Only this test's sockets (others run in parallel): the listener's and those toward its servers.
        let scope = Set([bind.port] + [server.address.port, second.address.port])
        let before = openSockets(scope)
        let log = CapturedLog()
        let settings = "      drain_secs: 60\n"
        let daemon = try startDaemon(relayYAML("end", bind: bind, [server], settings: settings), logger: log.logger(level: .info))
        var stopped = false
        defer { if !stopped { daemon.shutdown() } }
        for client in clients { #expect(try client.exchange("\(client.source)-0", with: bind) != nil) }
        var successor = relayYAML("end-renamed", bind: bind, [server], settings: settings)
        if change == "wildcard" { successor = successor.replacingOccurrences(of: "\"\(bind)\"", with: "\"0.0.0.0:\(port)\"") }
        #expect(daemon.reload(text: successor))
        let handedOver = log.count(.info, containing: "listener handed over")
        #expect(handedOver == (change == "wildcard" ? 0 : 1), "\(log.all.map(\.message))")
        switch change {
        case "stop":
            let clock = ContinuousClock()
            let started = clock.now
            daemon.shutdown()
            stopped = true
            #expect(clock.now - started < .seconds(2), "the stop did not wait for the drain: \(clock.now - started)")
        case "successor removed":
            // Its bind goes: the old instance's sockets would get the kernel's hash over them.
            #expect(daemon.reload(text: relayYAML("other", bind: SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort()), [server], settings: settings)))
            #expect(log.count(.info, containing: "handed-over listener stopped: its drain was cut short") == 1, "\(log.all.map(\.message))")
            daemon.shutdown()
            stopped = true
        case "handed over again":
            // The successor gets sessions of its own (else, handed over with nothing to drain, it
            // would stop by itself at once); then one drain per bind: the first ends when the second starts.
            for client in clients { #expect(try client.exchange("\(client.source)-1", with: bind) != nil) }
            #expect(daemon.reload(text: relayYAML("end-again", bind: bind, [server], settings: settings)))
            #expect(log.count(.info, containing: "listener handed over") == 2)
            #expect(log.count(.info, containing: "handed-over listener stopped: its drain was cut short") == 1, "\(log.all.map(\.message))")
            daemon.shutdown()
            stopped = true
            #expect(log.count(.info, containing: "handed-over listener stopped: its drain was cut short") == 2, "\(log.all.map(\.message))")
        case "unrelated reload":
            // Another listener added, the successor's downstreams changed in place: its bind is still steered.
            let extra = relayYAML("extra", bind: SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort()), [server], settings: settings)
                .replacingOccurrences(of: "listeners:\n", with: "")
            #expect(daemon.reload(text: relayYAML("end-renamed", bind: bind, [server, second], settings: settings) + extra))
            usleep(300_000)
            #expect(log.count(.info, containing: "handed-over listener stopped") == 0, "the drain goes on: \(log.all.map(\.message))")
            daemon.shutdown()
            stopped = true
        default:
            daemon.shutdown()
            stopped = true
        }
        if handedOver == 1 && change != "handed over again" {
            #expect(log.count(.info, containing: "handed-over listener stopped: its drain was cut short") == 1, "\(log.all.map(\.message))")
        }
        settle { openSockets(scope) == before }
        #expect(openSockets(scope) == before, "every socket of both instances closed: \(openSockets(scope).subtracting(before))")
    }

    @Test("drain_secs 1: a removed downstream's reply 2.5 s late is dropped and counted drained, not relayed; its socket closes once silent for session_idle_secs; nothing open after stop")
    func lateRepliesDrained() throws {
        let servers = try (1...2).map { try DelayedEcho(name: "late-\($0)", delays: [30]) }
        defer { for server in servers { server.stop() } }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let clients = try loopbackSources(10, base: 90).map { try RelayClient(source: $0) }
        // Only this test's sockets (others run in parallel): the listener's and those toward its servers.
        let scope = Set([bind.port] + servers.map(\.address.port))
        let before = openSockets(scope)
        let settings = "      drain_secs: 1\n      session_idle_secs: 2\n"
        // One worker: its round robin gives each server half the clients.
        let daemon = try startDaemon(drainYAML("late", bind: bind, servers, workers: 1, settings: settings))
        var owner: [String: String] = [:]
        for client in clients { owner[client.source] = try client.exchange("\(client.source)-1", with: bind) }
        let moving = clients.filter { owner[$0.source] == "late-2" }
        #expect(moving.count == 5 && owner.count == 10, "\(owner)")
        // late-2 answers in 30 ms and once more 2.5 s later: long after its drain time.
        servers[1].answer(after: [30, 2500])
        let running = openSockets(scope)
        for client in moving { try client.send("\(client.source)-2", to: bind) }
        // On their way to late-2 before it leaves (the worker takes a new plan before its next batch).
        settle { daemon.counters(of: "late")?.forwarded == UInt64(clients.count + moving.count) }
        #expect(daemon.reload(text: drainYAML("late", bind: bind, [servers[0]], workers: 1, settings: settings)))
        for client in clients { try client.send("\(client.source)-3", to: bind) }
        for client in clients {
            var expected: Set<String> = ["\(client.source)-3"]
            if owner[client.source] == "late-2" { expected.insert("\(client.source)-2") }
            while !expected.isEmpty, let reply = client.receive(timeout: 1000) {
                #expect(reply.from == bind)
                let parts = reply.text.split(separator: "|", maxSplits: 1).map(String.init)
                #expect(parts.count == 2 && expected.remove(parts[1]) != nil, "\(client.source): unexpected \(reply.text)")
            }
            #expect(expected.isEmpty, "\(client.source): no reply to \(expected)")
        }
        // The moved clients' new sockets are open beside their old ones, which drain.
        #expect(openSockets(scope).count == running.count + moving.count, "\(openSockets(scope).subtracting(running))")
        // Every client keeps its session (session_idle_secs 2) with a round trip every 300 ms, now
        // all on late-1, while the draining sockets count the late replies and, silent for
        // session_idle_secs after them (checked once a second), close. A late reply relayed would
        // show in a round trip as an unexpected reply.
        var exchanges = 0
        let deadline = ContinuousClock.now + .seconds(12)
        func drained() -> UInt64 { daemon.counters(of: "late")?.twoWay?.replyDropped[.drained, default: 0] ?? 0 }
        while (drained() < UInt64(moving.count) || openSockets(scope).count > running.count) && ContinuousClock.now < deadline {
            for client in clients {
                #expect(try client.exchange("\(client.source)-keep-\(exchanges)", with: bind) == "late-1")
            }
            exchanges += 1
            usleep(300_000)
        }
        let after = openSockets(scope)
        let kept = try #require(daemon.counters(of: "late")?.twoWay)
        #expect(kept.associations == UInt64(clients.count) && kept.events[.expired, default: 0] == 0, "the sessions stayed: \(kept.associations), \(kept.events)")
        #expect(after.count == running.count, "\(after.subtracting(running))")
        #expect(running.subtracting(after).count == moving.count, "the moved clients' old sockets closed")
        for client in clients { #expect(client.receive(timeout: 200) == nil, "\(client.source): a late reply reached the client") }
        settle { daemon.counters(of: "late")?.twoWay?.replies == UInt64(clients.count * (2 + exchanges) + moving.count) }
        let twoWay = try #require(daemon.counters(of: "late")?.twoWay)
        #expect(twoWay.replyDropped[.drained] == UInt64(moving.count), "\(twoWay.replyDropped)")
        #expect(servers[1].sent == 3 * moving.count)
        #expect(twoWay.replies == UInt64(clients.count * (2 + exchanges) + moving.count))
        #expect(twoWay.downstreamReplies["late-2"] == UInt64(2 * moving.count), "\(twoWay.downstreamReplies)")
        daemon.shutdown()
        #expect(openSockets(scope) == before, "nothing left open after stop: \(openSockets(scope).subtracting(before))")
    }

    @Test("Stop while sockets drain (drain_secs 30): every session and draining socket is closed")
    func stopClosesDrainingSockets() throws {
        let servers = try (1...2).map { try RelayEcho(name: "echo-\($0)") }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let clients = try loopbackSources(10, base: 110).map { try RelayClient(source: $0) }
        // Only this test's sockets (others run in parallel): the listener's and those toward its servers.
        let scope = Set([bind.port] + servers.map(\.address.port))
        let before = openSockets(scope)
        let daemon = try startDaemon(relayYAML("stopdrain", bind: bind, servers))
        for client in clients { #expect(try client.exchange("\(client.source)-1", with: bind) != nil) }
        let running = openSockets(scope)
        #expect(daemon.reload(text: relayYAML("stopdrain", bind: bind, [servers[0]])))
        for client in clients {
            #expect(try client.exchange("\(client.source)-2", with: bind) == "echo-1")
        }
        let moved = Int(daemon.counters(of: "stopdrain")?.twoWay?.events[.moved] ?? 0)
        #expect(moved > 0)
        #expect(openSockets(scope).count == running.count + moved, "old sockets drain beside the new ones")
        daemon.shutdown()
        #expect(openSockets(scope) == before, "nothing left open after stop: \(openSockets(scope).subtracting(before))")
    }

    @Test("IPv6 clients on ::1: replies come from the listener's IPv6 address, one session per client port")
    func ipv6Clients() throws {
        let servers = try (1...2).map { try RelayEcho(name: "echo-\($0)") }
        let bind = SocketAddress(ip: IPAddress("::1")!, port: freePort())
        let daemon = try startDaemon(relayYAML("six", bind: bind, servers))
        defer { daemon.shutdown() }
        // Four clients on one address, told apart by their ports.
        let clients = try (0..<4).map { _ in try RelayClient(source: "::1") }
        for round in 0..<3 {
            for client in clients { #expect(try client.exchange("six-\(round)", with: bind) != nil) }
        }
        settle { daemon.counters(of: "six")?.twoWay?.replies == 12 }
        let twoWay = try #require(daemon.counters(of: "six")?.twoWay)
        #expect(twoWay.replies == 12)
        #expect(twoWay.associations == 4 && twoWay.events[.created] == 4)
    }

    @Test("associations(limit:): each client with its downstream's name and idle seconds, from every worker")
    func associationsList() throws {
        let servers = try (1...2).map { try RelayEcho(name: "echo-\($0)") }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let config = try ConfigParser.parse(relayYAML("list", bind: bind, servers))
        try config.validate()
        let listener = try RelayListener(config.listeners[0], counters: ListenerCounters(name: "list", mode: "userspace"), logger: Logger(label: "relay-test"))
        defer { listener.shutdown() }
        try listener.activate()
        let clients = try loopbackSources(6, base: 230).map { try RelayClient(source: $0) }
        var owner: [String: String] = [:]
        for client in clients { owner[client.source] = try client.exchange("hello", with: bind) }
        let listed = try #require(listener.associations(limit: 100))
        #expect(listed.total == 6)
        #expect(Dictionary(uniqueKeysWithValues: listed.entries.map { ($0.client.ip.description, $0.downstream) }) == owner)
        #expect(listed.entries.allSatisfy { ($0.idleSeconds ?? -1) >= 0 && ($0.idleSeconds ?? 99) <= 2 })
        let limited = try #require(listener.associations(limit: 4))
        #expect(limited.entries.count == 4 && limited.total == 6)
    }

    @Test("io_uring refused by the kernel (kernel.io_uring_disabled=2): a warning names the fix, and the relay serves every client by system calls (the real binary)",
          .enabled(if: Privileges.enabled, Privileges.reason),
          .enabled(if: FileManager.default.fileExists(atPath: "/proc/sys/kernel/io_uring_disabled") || ProcessInfo.processInfo.environment["CI"] == "true",
                   "kernel.io_uring_disabled is Linux 6.6 and later"))
    func ioUringRefused() throws {
        let sysctl = "/proc/sys/kernel/io_uring_disabled"
        let previous = try String(contentsOfFile: sysctl, encoding: .utf8).trimmingCharacters(in: .whitespacesAndNewlines)
        try "2".write(toFile: sysctl, atomically: false, encoding: .utf8)
        defer { try? previous.write(toFile: sysctl, atomically: false, encoding: .utf8) }
        let servers = try (1...2).map { try RelayEcho(name: "echo-\($0)") }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("relay-refused-\(UUID().uuidString).yaml")
        try relayYAML("refused", bind: bind, servers).write(to: file, atomically: true, encoding: .utf8)
        defer { try? FileManager.default.removeItem(at: file) }
        let daemon = try Child("udp-fanout", ["-c", file.path])
        try daemon.waitFor("entering receive loop")
        let clients = try loopbackSources(10, base: 240).map { try RelayClient(source: $0) }
        var answered = 0
        for round in 0..<5 {
            for client in clients where try client.exchange("\(client.source)-\(round)", with: bind) != nil { answered += 1 }
        }
        #expect(answered == 50)
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let log = daemon.stderr
        #expect(log.components(separatedBy: "io_uring refused").count - 1 == 2, "one warning per worker: \(log)")
        #expect(log.contains("kernel.io_uring_disabled=0") && log.contains("settings.io_uring: false") && log.contains("Operation not permitted"), "\(log)")
        #expect(log.contains("io_uring=false") && !log.contains("io_uring=true"), "\(log)")
    }

    @Test("Limits a session table needs, at start (the real binary under prlimit): the soft open-files limit is raised for max_sessions as far as the hard one allows; a hard limit too low is warned about, and so are more sessions than local ports (net.ipv4.ip_local_port_range)")
    func sessionLimits() throws {
        var limit = rlimit()
        try #require(getrlimit(__rlimit_resource_t(RLIMIT_NOFILE.rawValue), &limit) == 0)
        let hard = min(Int(limit.rlim_max), 4000)
        try #require(hard >= 2300, "this test needs a hard open-files limit of 2,300 or more (it is \(limit.rlim_max))")
        let ports = try #require(RelayListener.ephemeralPorts())
        let servers = try (1...2).map { try RelayEcho(name: "echo-\($0)") }
        func run(soft: Int, hard: Int, maxSessions: Int) throws -> (limits: String, log: String) {
            let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
            let file = FileManager.default.temporaryDirectory.appendingPathComponent("relay-limits-\(UUID().uuidString).yaml")
            try relayYAML("limits", bind: bind, servers, settings: "      max_sessions: \(maxSessions)\n").write(to: file, atomically: true, encoding: .utf8)
            defer { try? FileManager.default.removeItem(at: file) }
            let daemon = try Child("udp-fanout", ["-c", file.path], prefix: ["/usr/bin/prlimit", "--nofile=\(soft):\(hard)"])
            try daemon.waitFor("entering receive loop")
            let limits = (try? String(contentsOfFile: "/proc/\(daemon.process.processIdentifier)/limits", encoding: .utf8)) ?? ""
            daemon.signal(SIGTERM)
            #expect(daemon.wait() == 0)
            return (limits.split(separator: "\n").first { $0.hasPrefix("Max open files") }.map(String.init) ?? "", daemon.stderr)
        }
        func words(_ line: String) -> [String] { line.split(separator: " ").map(String.init) }
        // Room enough: raised to max_sessions + 256, nothing said.
        let roomy = try run(soft: 1024, hard: hard, maxSessions: 2000)
        #expect(Array(words(roomy.limits).suffix(3).prefix(2)) == ["2256", "\(hard)"], "\(roomy.limits)")
        #expect(!roomy.log.contains("open-files limit") && !roomy.log.contains("ip_local_port_range"), "\(roomy.log)")
        // A hard limit below what max_sessions needs, and more sessions than local ports: both said.
        let short = try run(soft: 512, hard: 1024, maxSessions: ports + 1)
        #expect(Array(words(short.limits).suffix(3).prefix(2)) == ["1024", "1024"], "raised to the hard limit: \(short.limits)")
        #expect(short.log.contains("open-files limit") && short.log.contains("open_files_limit=1024"), "\(short.log)")
        #expect(short.log.contains("net.ipv4.ip_local_port_range") && short.log.contains("local_ports=\(ports)"), "\(short.log)")
    }

    @Test("Limits a session table needs, at a reload (the real binary under prlimit): a reload that replaces or renames a relay listener (the old instance draining beside the new) raises the soft limit for both but judges the configuration's max_sessions alone, saying a limit again only with other figures; what a replaced instance still holds is said when it leaves the configuration too little room; a limit that holds again is said once; a reload without relay listeners says nothing",
          .enabled(if: Privileges.enabled, Privileges.reason))
    func sessionLimitsAtReload() throws {
        let ports = try #require(RelayListener.ephemeralPorts())
        // One instance fits the local ports and the open-files limit, two together would not.
        let maxSessions = ports / 2 + 1
        let hard = maxSessions + 256 + 64
        let servers = try (1...2).map { try RelayEcho(name: "echo-\($0)") }
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let oneWay = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("relay-reload-limits-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        // name nil: no relay listener (a one-way one instead, a configuration needs one).
        func write(_ name: String?, maxSessions: Int, batchSize: Int) throws {
            guard let name else {
                try "listeners:\n  - name: one-way\n    bind: \"\(oneWay)\"\n    downstream:\n      - name: d\n        address: \"\(servers[0].address)\"\n"
                    .write(to: file, atomically: true, encoding: .utf8)
                return
            }
            try relayYAML(name, bind: bind, servers, settings: "      max_sessions: \(maxSessions)\n      batch_size: \(batchSize)\n")
                .write(to: file, atomically: true, encoding: .utf8)
        }
        try write("limits", maxSessions: maxSessions, batchSize: 32)
        let daemon = try Child("udp-fanout", ["-c", file.path], prefix: ["/usr/bin/prlimit", "--nofile=1024:\(hard)"])
        defer { daemon.stopIfRunning() }
        try daemon.waitFor("entering receive loop")
        func said(_ text: String) -> Int { daemon.stderr.components(separatedBy: text).count - 1 }
        // The warning, the notice, the lines that say each holds again, and the replaced instances'.
        let (files, localPorts) = ("what the open-files limit leaves for sessions", "above the local ports a session socket can take")
        let (filesHold, portsHold) = ("the open-files limit now holds", "(net.ipv4.ip_local_port_range) now hold")
        let replaced = "replaced by a reload (this one or an earlier one) still hold session sockets"
        func softLimit() -> String {
            let limits = (try? String(contentsOfFile: "/proc/\(daemon.process.processIdentifier)/limits", encoding: .utf8)) ?? ""
            return limits.split(separator: "\n").first { $0.hasPrefix("Max open files") }?.split(separator: " ").dropFirst(3).first.map(String.init) ?? ""
        }
        var reloads = 0
        func reload(_ name: String?, maxSessions: Int, batchSize: Int) throws {
            try write(name, maxSessions: maxSessions, batchSize: batchSize)
            daemon.signal(SIGHUP)
            reloads += 1
            let expected = reloads
            try #require(Probe.waitFor(seconds: 10) { said("reload=true") >= expected }, "reload \(expected) applied: \(daemon.stderr)")
        }
        #expect(said(files) == 0 && said(localPorts) == 0, "\(daemon.stderr)")
        #expect(Probe.waitFor(seconds: 5) { softLimit() == "\(maxSessions + 256)" }, "raised for one instance: \(softLimit())")
        // 100 clients with a session each: more than the 64 descriptors the hard limit leaves
        // beside the configuration's max_sessions once the listener is replaced.
        let clients = try (0..<100).map { _ in try RelayClient(source: "127.0.0.1") }
        for (index, client) in clients.enumerated() {
            #expect(try client.exchange("c\(index)", with: bind, timeout: 5000) != nil, "client \(index) answered")
        }
        // batch_size: the listener is replaced; its old instance drains beside the new one with
        // its 100 sessions (drain_secs 30), and the soft limit is raised for both (up to the hard
        // limit). The configuration alone fits: neither warning; the replaced instance's sockets
        // are said.
        try reload("limits", maxSessions: maxSessions, batchSize: 16)
        #expect(said("listener handed over") == 1, "\(daemon.stderr)")
        #expect(Probe.waitFor(seconds: 5) { softLimit() == "\(hard)" }, "raised for both instances, up to the hard limit: \(softLimit())")
        #expect(said(files) == 0 && said(localPorts) == 0, "counted once: \(daemon.stderr)")
        #expect(said(replaced) == 1 && said("held_by_replaced=100 ") == 1 && said("sessions_that_fit_now=\(hard - 256 - 100) ") == 1
                && said("short_limits=open_files ") == 1, "\(daemon.stderr)")
        // Renamed on the same bind: handed over too, the first drain cut short; the replaced
        // instance holds no session: nothing said.
        try reload("renamed", maxSessions: maxSessions, batchSize: 16)
        #expect(said("listener handed over") == 2, "\(daemon.stderr)")
        #expect(said(files) == 0 && said(localPorts) == 0 && said(replaced) == 1, "\(daemon.stderr)")
        // Too many sessions for both: said once, with the configuration's figures.
        try reload("renamed", maxSessions: ports + 1, batchSize: 16)
        #expect(said(files) == 1 && said("all_relay_max_sessions=\(ports + 1) ") == 2, "\(daemon.stderr)")
        #expect(said(localPorts) == 1 && said("local_ports=\(ports) relay_listeners=renamed") == 1, "\(daemon.stderr)")
        // The same figures again (the listener replaced once more): not said again.
        try reload("renamed", maxSessions: ports + 1, batchSize: 32)
        #expect(said(files) == 1 && said(localPorts) == 1, "\(daemon.stderr)")
        // New figures: said again.
        try reload("renamed", maxSessions: ports + 2, batchSize: 32)
        #expect(said(files) == 2 && said(localPorts) == 2 && said("all_relay_max_sessions=\(ports + 2) ") == 2, "\(daemon.stderr)")
        // Back to what fits: each limit said to hold, once.
        #expect(said(filesHold) == 0 && said(portsHold) == 0, "\(daemon.stderr)")
        try reload("renamed", maxSessions: maxSessions, batchSize: 32)
        #expect(said(filesHold) == 1 && said(portsHold) == 1 && said(files) == 2 && said(localPorts) == 2, "\(daemon.stderr)")
        // Too many again, then no relay listener (nothing said), then the same one back: said
        // again, with the same figures.
        try reload("renamed", maxSessions: ports + 2, batchSize: 32)
        #expect(said(files) == 3 && said(localPorts) == 3, "\(daemon.stderr)")
        try reload(nil, maxSessions: 0, batchSize: 0)
        #expect(said(files) == 3 && said(localPorts) == 3 && said(filesHold) == 1 && said(portsHold) == 1, "\(daemon.stderr)")
        try reload("renamed", maxSessions: ports + 2, batchSize: 32)
        #expect(said(files) == 4 && said(localPorts) == 4, "\(daemon.stderr)")
        #expect(said(replaced) == 1, "\(daemon.stderr)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
    }

    @Test("The limits' warnings: said the first time a limit is short, again only with other figures or after it held (said once, first); the configuration judged alone, then beside what replaced instances hold; nothing without relay listeners; every instance's max_sessions counted for the soft limit")
    func relayLimitWarnings() {
        var reservations = SessionReservations()
        // Both hold sockets; only the one handed over counts as held by a replaced instance (the
        // other's are the configuration's own, in its max_sessions).
        let heldByFirst = RelaySessionCount(maxSessions: 100)
        heldByFirst.open.store(50, ordering: .relaxed)
        heldByFirst.draining.store(5, ordering: .relaxed)
        let first = reservations.add(maxSessions: 100, held: heldByFirst)
        let heldBySecond = RelaySessionCount(maxSessions: 10)
        heldBySecond.open.store(7, ordering: .relaxed)
        heldBySecond.draining.store(2, ordering: .relaxed)
        let second = reservations.add(maxSessions: 10, held: heldBySecond)
        #expect(reservations.everyInstance == 110 && reservations.heldByHandedOver == 0)
        reservations.handedOver(second)
        #expect(reservations.heldByHandedOver == 9)
        reservations.remove(first)
        #expect(reservations.everyInstance == 10 && reservations.heldByHandedOver == 9)
        reservations.remove(second)
        #expect(reservations.everyInstance == 0 && reservations.instances.isEmpty)

        var warnings = RelayLimitWarnings()
        var said: [RelayLimitWarnings.Change] = []
        said.append(warnings.change(.openFiles, false, figures: [1, 2]))
        said.append(warnings.change(.openFiles, true, figures: [1, 2]))
        said.append(warnings.change(.openFiles, true, figures: [1, 2]))
        said.append(warnings.change(.localPorts, true, figures: [1, 2]))  // each limit on its own
        said.append(warnings.change(.openFiles, true, figures: [1, 3]))
        said.append(warnings.change(.openFiles, false, figures: [1, 3]))
        said.append(warnings.change(.openFiles, false, figures: [1, 3]))
        said.append(warnings.change(.openFiles, true, figures: [1, 3]))  // short again after it held
        #expect(said == [.unchanged, .short, .unchanged, .short, .short, .holds, .unchanged, .short])

        let log = LogStore()
        var limits = RelayLimitWarnings()
        func relays(_ sessions: [Int]) -> FanoutConfig {
            FanoutConfig(listeners: sessions.enumerated().map { index, maxSessions in
                var settings = Settings()
                settings.maxSessions = maxSessions
                return Listener(name: "r\(index)", bind: SocketAddress("127.0.0.1:\(5000 + index)")!, downstreams: [], settings: settings, replies: .relay)
            })
        }
        func files(_ current: Int) -> rlimit { rlimit(rlim_cur: rlim_t(current), rlim_max: rlim_t(current)) }
        // Each line by the figures that tell them apart: which limit, what is needed, what fits.
        func lines() -> [String] {
            defer { log.lines.withLock { $0.removeAll() } }
            return log.lines.withLock {
                $0.map { line in
                    ["all_relay_max_sessions", "open_files_limit", "sessions_that_fit", "local_ports", "short_limits", "held_by_replaced", "sessions_that_fit_now"]
                        .compactMap { key in line.metadata[key].map { "\(key)=\($0)" } }.joined(separator: " ") + (line.message.contains("now hold") ? " holds" : "")
                }
            }
        }
        // Short on files only (1,000 + 256 > 1,200; ports 5,000).
        limits.say(for: relays([600, 400]), openFiles: files(1200), ports: 5000, heldByHandedOver: 0, logger: log.logger)
        #expect(lines() == ["all_relay_max_sessions=1000 open_files_limit=1200 sessions_that_fit=944"])
        // Short on both; what replaced instances hold is not said while the configuration is short.
        limits.say(for: relays([6000]), openFiles: files(1200), ports: 5000, heldByHandedOver: 900, logger: log.logger)
        #expect(lines() == ["all_relay_max_sessions=6000 open_files_limit=1200 sessions_that_fit=944", "all_relay_max_sessions=6000 local_ports=5000"])
        // Fits alone (600 + 256 <= 1,200: room 344), not beside 400 held: both hold (said first).
        limits.say(for: relays([600]), openFiles: files(1200), ports: 5000, heldByHandedOver: 400, logger: log.logger)
        #expect(lines() == ["all_relay_max_sessions=600 open_files_limit=1200 holds", "all_relay_max_sessions=600 local_ports=5000 holds",
                            "all_relay_max_sessions=600 open_files_limit=1200 local_ports=5000 short_limits=open_files held_by_replaced=400 sessions_that_fit_now=544"])
        // The same held count: not again; no more than the room: nothing; unknown limits: nothing.
        limits.say(for: relays([600]), openFiles: files(1200), ports: 5000, heldByHandedOver: 400, logger: log.logger)
        limits.say(for: relays([600]), openFiles: files(1200), ports: 5000, heldByHandedOver: 344, logger: log.logger)
        limits.say(for: relays([60000]), openFiles: nil, ports: nil, heldByHandedOver: 10000, logger: log.logger)
        #expect(lines().isEmpty)
        // Room on both limits short beside 4,500 held (ports: 5,000 - 600; files: 10,000 - 256 - 600
        // holds them): only the ports named, and what fits now by them.
        limits.say(for: relays([600]), openFiles: files(10000), ports: 5000, heldByHandedOver: 4500, logger: log.logger)
        #expect(lines() == ["all_relay_max_sessions=600 open_files_limit=10000 local_ports=5000 short_limits=local_ports held_by_replaced=4500 sessions_that_fit_now=500"])
        // Ports short alone.
        limits.say(for: relays([6000]), openFiles: files(10000), ports: 5000, heldByHandedOver: 0, logger: log.logger)
        #expect(lines() == ["all_relay_max_sessions=6000 local_ports=5000"])
        // No relay listener: nothing said, and the next one is judged afresh.
        limits.say(for: FanoutConfig(listeners: [Listener(name: "one-way", bind: SocketAddress("127.0.0.1:5100")!, downstreams: [])]),
                   openFiles: files(10000), ports: 5000, heldByHandedOver: 0, logger: log.logger)
        #expect(lines().isEmpty)
        limits.say(for: relays([6000]), openFiles: files(10000), ports: 5000, heldByHandedOver: 0, logger: log.logger)
        #expect(lines() == ["all_relay_max_sessions=6000 local_ports=5000"])
    }

    @Test("Replies of kept sessions (read through the ring) and of a draining socket in one wakeup, more than a batch of slots: each reaches its own client, none another's (the real binary, stopped while they queue)",
          arguments: [true, false])
    func drainingBesideRingReplies(ioUring: Bool) throws {
        // The downstreams are plain sockets of this test: they answer when told, to the session
        // socket each request came from.
        let downstreams = try (0..<2).map { _ in try RelayClient(source: "127.0.0.1") }
        func address(_ client: RelayClient) -> SocketAddress {
            var storage = sockaddr_storage()
            var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
            _ = withUnsafeMutablePointer(to: &storage) { $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(client.fd, $0, &length) } }
            return withUnsafePointer(to: &storage) { SocketAddress(storage: UnsafeRawPointer($0)) }!
        }
        let names = ["x", "y"]
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let settings = "      batch_size: 4\n      drain_secs: 30\n      io_uring: \(ioUring)\n"
        let file = FileManager.default.temporaryDirectory.appendingPathComponent("relay-mixed-\(UUID().uuidString).yaml")
        defer { try? FileManager.default.removeItem(at: file) }
        try relayYAML("mixed", bind: bind, downstreams: zip(names, downstreams.map(address)).map { ($0, $1) }, workers: 1, settings: settings)
            .write(to: file, atomically: true, encoding: .utf8)
        let daemon = try Child("udp-fanout", ["-c", file.path])
        defer { daemon.signal(SIGCONT) }
        try daemon.waitFor("entering receive loop")
        // The worker uses the ring (or not) as asked: a ring the kernel refused would make the
        // first case test the system calls twice.
        #expect(daemon.stderr.contains("io_uring=\(ioUring)"), "\(daemon.stderr)")
        // Three clients: round robin puts two on one downstream (kept) and one on the other (removed).
        let clients = try (0..<3).map { _ in try RelayClient(source: "127.0.0.1") }
        var sessionOf: [Int: (downstream: Int, session: SocketAddress)] = [:]
        for (index, client) in clients.enumerated() {
            try client.send("c\(index)-0", to: bind)
            // Either downstream, within 5 s (a busy machine).
            let deadline = ContinuousClock.now + .seconds(5)
            while sessionOf[index] == nil && ContinuousClock.now < deadline {
                for (server, downstream) in downstreams.enumerated() {
                    guard let request = downstream.receive(timeout: 50) else { continue }
                    sessionOf[Int(request.text.dropFirst().prefix { $0 != "-" })!] = (server, request.from)
                    try downstream.send("r\(index)-0", to: request.from)
                }
            }
            #expect(client.receive(timeout: 2000)?.text == "r\(index)-0")
        }
        try #require(sessionOf.count == 3, "each client's first request reached a downstream: \(sessionOf)")
        let counts = (0..<2).map { server in sessionOf.values.filter { $0.downstream == server }.count }
        let kept = counts[0] == 2 ? 0 : 1
        try #require(counts[kept] == 2, "two sessions on one downstream: \(counts)")
        let removed = 1 - kept
        let keptClients = sessionOf.filter { $0.value.downstream == kept }.map(\.key).sorted()
        let drainingClient = sessionOf.first { $0.value.downstream == removed }!.key
        // The reload removes the downstream of one session: its socket drains (drain_secs 30).
        try relayYAML("mixed", bind: bind, downstreams: [(names[kept], address(downstreams[kept]))], workers: 1, settings: settings)
            .write(to: file, atomically: true, encoding: .utf8)
        daemon.signal(SIGHUP)
        try daemon.waitFor("reload=true")
        // A new client's exchange: the worker takes the new plan at this wakeup.
        let probe = try RelayClient(source: "127.0.0.1")
        try probe.send("probe", to: bind)
        let probed = try #require(downstreams[kept].receive(timeout: 2000))
        try downstreams[kept].send("probe-reply", to: probed.from)
        #expect(probe.receive(timeout: 2000)?.text == "probe-reply")
        // Stopped, the daemon cannot read: the kept sessions' replies queue first, then four on
        // the draining socket, so one wakeup sees them all, in that order (6 > batch_size 4).
        daemon.signal(SIGSTOP)
        // Every thread stopped (the worker too, not only the main thread).
        let tasks = "/proc/\(daemon.process.processIdentifier)/task"
        var stopped = false
        for _ in 0..<400 where !stopped {
            let threads = (try? FileManager.default.contentsOfDirectory(atPath: tasks)) ?? []
            stopped = !threads.isEmpty && threads.allSatisfy { thread in
                let stat = (try? String(contentsOfFile: "\(tasks)/\(thread)/stat", encoding: .utf8)) ?? ""
                return stat.split(separator: ")").last?.split(separator: " ").first == "T"
            }
            if !stopped { usleep(5_000) }
        }
        try #require(stopped, "every thread of the daemon stopped")
        for client in keptClients { try downstreams[kept].send("late-c\(client)", to: sessionOf[client]!.session) }
        for reply in 1...4 { try downstreams[removed].send("drain-c\(drainingClient)-\(reply)", to: sessionOf[drainingClient]!.session) }
        usleep(20_000)
        daemon.signal(SIGCONT)
        var received: [Int: [String]] = [:]
        for (index, client) in clients.enumerated() {
            while let reply = client.receive(timeout: 1000) {
                #expect(reply.from == bind)
                received[index, default: []].append(reply.text)
            }
        }
        for client in keptClients { #expect(received[client] == ["late-c\(client)"], "client \(client): \(received)") }
        #expect(received[drainingClient]?.sorted() == (1...4).map { "drain-c\(drainingClient)-\($0)" }, "the draining client: \(received)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
    }
}
