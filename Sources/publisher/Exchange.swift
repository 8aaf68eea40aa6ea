// SPDX-License-Identifier: Apache-2.0
import ArgumentParser
import CSystemShim
import ReusePortLB
import TrafficModel

#if canImport(Glibc)
import Glibc
#endif
import SystemCalls

/// `publisher --exchange`: request/response clients of a two-way load balancer. Each client is
/// one socket (a source address and port); it sends a numbered request, waits for the reply
/// (whose tail after the request's bytes is the answering server's tag, `collector --echo`),
/// and sends the next, `window` at a time, until `exchanges` per client or the deadline. Sockets
/// are nonblocking, polled together, and not connected, so a reply from any source reaches them and a wrong one is counted.
struct Exchange {
    let destination: SocketAddress
    let sources: [IPAddress]?
    let clients: Int
    let exchanges: Int
    let size: Int
    let window: Int
    let replyTimeout: Duration
    let duration: Double
    let clientPortBase: UInt16
    let perClient: Bool

    /// One client's state.
    struct Client {
        let fd: Int32
        var address = ""
        /// Requests sent.
        var sent = 0
        /// Sequence number → send time (CLOCK_MONOTONIC ns) of the requests awaiting a reply.
        var outstanding: [UInt64: UInt64] = [:]
        /// Tags of the servers that answered, in first-seen order.
        var tags: [String] = []
    }

    func run() throws {
        var states: [Client] = []
        defer { for state in states { close(state.fd) } }
        // poll over every client's socket: Glibc's Swift module has no epoll (that would need a
        // shim header), and at a few thousand sockets poll's scan costs little next to the I/O.
        var descriptors: [pollfd] = []
        for index in 0..<clients {
            let fd: Int32
            do {
                fd = try Syscall.socket(destination.ip.family, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue) | Int32(SOCK_NONBLOCK.rawValue))
            } catch {
                throw failure("socket", error.errno)
            }
            states.append(Client(fd: fd))
            let source = sources.map { $0[index % $0.count] }
                ?? (destination.ip.family == AF_INET6 ? IPAddress("::")! : IPAddress("0.0.0.0")!)
            let port = clientPortBase == 0 ? 0 : clientPortBase + UInt16(index)
            do {
                try Syscall.bind(fd, SocketAddress(ip: source, port: port))
            } catch {
                throw failure("bind \(SocketAddress(ip: source, port: port))", error.errno)
            }
            var storage = sockaddr_storage()
            try? Syscall.getsockname(fd, &storage)
            states[index].address = withUnsafePointer(to: &storage) { SocketAddress(storage: UnsafeRawPointer($0))?.description } ?? "?"
            descriptors.append(pollfd(fd: fd, events: Int16(POLLIN), revents: 0))
        }

        let request = UnsafeMutableRawPointer.allocate(byteCount: size, alignment: 16)
        defer { request.deallocate() }
        memset(request, 0x2e, size)
        var name = sockaddr_storage()
        let nameLength = destination.write(to: &name)
        var sendErrors: UInt64 = 0
        var lastSendError: Int32 = 0
        func send(_ index: Int, at now: UInt64) {
            let sequence = UInt64(states[index].sent)
            Payload.write(into: request, capacity: size, source: UInt32(index), sequence: sequence)
            let sent = withUnsafePointer(to: &name) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { address in
                    Result { () throws(SystemCallError) in try Syscall.sendto(states[index].fd, request, size, 0, address, nameLength) }
                }
            }
            states[index].sent += 1
            // A request that did not leave is awaited all the same: it ends as lost, counted.
            switch sent {
            case .success(.processed(size)): break
            case .success:
                sendErrors += 1
                lastSendError = EAGAIN
            case .failure(let error):
                sendErrors += 1
                lastSendError = error.errno
            }
            states[index].outstanding[sequence] = now
        }

        let receiver = BatchReceiver(batchSize: 64, maximumDatagramSize: 65535)
        var rtt = LatencyHistogram()
        var replies: UInt64 = 0
        var lost: UInt64 = 0
        var late: UInt64 = 0
        var wrongSource: UInt64 = 0
        var unsolicited: UInt64 = 0
        let timeoutNanoseconds = UInt64(replyTimeout.components.seconds) * 1_000_000_000 + UInt64(replyTimeout.components.attoseconds / 1_000_000_000)
        let started = Payload.monotonicNanoseconds()
        let deadline = duration > 0 ? started + UInt64(duration * 1e9) : UInt64.max
        for index in 0..<clients {
            for _ in 0..<min(window, exchanges) { send(index, at: started) }
        }
        var lastScan = started
        // The longest pause between two replies (a restart of what answers shows as one).
        var lastReply: UInt64?
        var longestGap: UInt64 = 0
        while shim_stop_requested() == 0 {
            let now = Payload.monotonicNanoseconds()
            if now >= deadline { break }
            if states.allSatisfy({ $0.sent >= exchanges && $0.outstanding.isEmpty }) { break }
            // Requests past their timeout are lost; each frees its slot for the next request.
            if now >= lastScan + 5_000_000 {
                lastScan = now
                for index in 0..<clients {
                    for (sequence, sentAt) in states[index].outstanding where sentAt + timeoutNanoseconds <= now {
                        states[index].outstanding[sequence] = nil
                        lost += 1
                        if states[index].sent < exchanges { send(index, at: now) }
                    }
                }
            }
            let ready: Int
            do {
                ready = try Syscall.poll(&descriptors, descriptors.count, 5)
            } catch {
                throw failure("poll", error.errno)
            }
            for index in descriptors.indices where ready > 0 && descriptors[index].revents != 0 {
                while true {
                    let count: Int
                    do {
                        count = try receiver.receive(from: states[index].fd)
                    } catch {
                        printError("publisher: \(error)")
                        throw ExitCode(2)
                    }
                    if count == 0 { break }
                    let at = Payload.monotonicNanoseconds()
                    for datagram in 0..<count {
                        let payload = receiver.payload(datagram)
                        guard payload.count >= size, let header = Payload.read(payload), header.source == UInt32(index) else {
                            unsolicited += 1
                            continue
                        }
                        guard let sentAt = states[index].outstanding.removeValue(forKey: header.sequence) else {
                            late += 1  // its request already counted as lost (or a duplicate)
                            continue
                        }
                        replies += 1
                        if let last = lastReply, at > last, at - last > longestGap { longestGap = at - last }
                        lastReply = at
                        rtt.record(nanoseconds: at > sentAt ? at - sentAt : 0)
                        if receiver.source(datagram) != destination {
                            // Counted, and its tag left out: servers_per_client judges only real replies.
                            wrongSource += 1
                        } else {
                            let tag = String(decoding: UnsafeRawBufferPointer(rebasing: payload[size...]), as: UTF8.self)
                            if !states[index].tags.contains(tag) { states[index].tags.append(tag) }
                        }
                        if states[index].sent < exchanges { send(index, at: at) }
                    }
                }
            }
        }
        let seconds = Double(Payload.monotonicNanoseconds() - started) / 1e9
        // What is still outstanding at the deadline was neither answered nor timed out.
        let unanswered = states.reduce(0) { $0 + $1.outstanding.count }

        var json = JSONObject()
        json.add("destination", destination.description)
        json.add("clients", clients)
        json.add("requests", states.reduce(0) { $0 + $1.sent })
        json.add("exchanges", replies + lost)
        json.add("replies", replies)
        json.add("lost", lost)
        json.add("unanswered", unanswered)
        json.add("late", late)
        json.add("unsolicited", unsolicited)
        json.add("wrong_source", wrongSource)
        json.add("send_errors", sendErrors)
        if sendErrors > 0 { json.add("last_send_error", SystemCallError(call: "sendto", errno: lastSendError).description) }
        json.add("servers_per_client", states.map(\.tags.count).max() ?? 0)
        json.add("clients_with_one_server", states.filter { $0.tags.count == 1 }.count)
        json.add("seconds", seconds)
        json.add("round_trips_per_sec", seconds > 0 ? Double(replies) / seconds : 0)
        json.add("rtt_p50_us", rtt.percentile(0.50) ?? 0)
        json.add("rtt_p99_us", rtt.percentile(0.99) ?? 0)
        json.add("longest_gap_ms", Double(longestGap / 100_000) / 10)
        var byTag: [String: Int] = [:]
        for state in states { for tag in state.tags { byTag[tag, default: 0] += 1 } }
        var tags = JSONObject()
        for (tag, count) in byTag.sorted(by: { $0.key < $1.key }) { tags.add(tag, count) }
        json.add("clients_by_tag", tags)
        if perClient {
            var each = JSONObject()
            for state in states { each.add(state.address, state.tags.joined(separator: ",")) }
            json.add("client_tags", each)
        }
        print(json.text)
    }

    func failure(_ call: String, _ error: Int32) -> Error {
        printError("publisher: \(SystemCallError(call: call, errno: error))")
        return ExitCode(2)
    }
}
