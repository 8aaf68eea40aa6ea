// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
// SOCK_DGRAM/SOCK_STREAM: when a file of the same compile batch imports CSystemShim, sys/socket.h belongs to that module and Glibc alone no longer names them.
import CSystemShim
@testable import FanoutCore
import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// One flow's datagrams keep their order through several workers (nginx and the reference
/// keep flow order); round robin over workers is there only when asked for.
@Suite("udp-fanout per-flow order", .serialized)
struct FlowOrderTests {
    /// Sends `count` numbered datagrams from one socket in paced bursts and returns the
    /// numbers in the order the sink received them.
    func sendAndCollect(bind: SocketAddress, sink: Sink, count: Int) throws -> [Int] {
        final class Received: @unchecked Sendable {
            let lock = NSLock()
            var numbers: [Int] = []
            var done = false
        }
        let received = Received()
        let fd = sink.fd
        let reader = Thread {
            var buffer = [UInt8](repeating: 0, count: 2048)
            var descriptor = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
            var quietSince = ContinuousClock.now
            while ContinuousClock.now - quietSince < .milliseconds(500) || !received.lock.withLock({ received.done }) {
                guard poll(&descriptor, 1, 50) > 0 else { continue }
                while true {
                    let length = recv(fd, &buffer, buffer.count, Int32(MSG_DONTWAIT))
                    if length <= 0 { break }
                    let text = String(decoding: buffer[0..<length], as: UTF8.self)
                    if let number = Int(text.split(separator: "-").last ?? "") { received.lock.withLock { received.numbers.append(number) } }
                }
                quietSince = ContinuousClock.now
            }
        }
        reader.start()
        let sender = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
        defer { close(sender) }
        for index in 0..<count {
            var payload = Array("flow-\(index)".utf8)
            let sent = bind.withSockAddr { sendto(sender, &payload, payload.count, 0, $0, $1) }
            try #require(sent == payload.count)
            if index % 500 == 499 { usleep(5_000) }  // about 100k/s in bursts: bounded, no overflow
        }
        received.lock.withLock { received.done = true }
        while !reader.isFinished { usleep(20_000) }
        return received.lock.withLock { received.numbers }
    }

    func inversions(_ numbers: [Int]) -> Int {
        zip(numbers, numbers.dropFirst()).filter { $0 > $1 }.count
    }

    @Test("20,000 datagrams of one flow through 4 workers arrive in order (five_tuple, the default)")
    func inOrder() throws {
        let sink = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let daemon = try startDaemon("listeners:\n" + listenerYAML("order", bind: bind, [sink], workers: 4))
        defer { daemon.shutdown() }
        let numbers = try sendAndCollect(bind: bind, sink: sink, count: 20_000)
        #expect(numbers.count == 20_000, "nothing lost")
        #expect(inversions(numbers) == 0, "in order")
    }

    @Test("worker_steering: round_robin spreads one flow over the workers (and may reorder it), as documented")
    func roundRobinWhenAsked() throws {
        let sink = try Sink()
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let daemon = try startDaemon("listeners:\n" + listenerYAML("spread", bind: bind, [sink], extra: "", workers: 4)
            .replacingOccurrences(of: "      workers: 4\n", with: "      workers: 4\n      worker_steering: round_robin\n"))
        defer { daemon.shutdown() }
        let numbers = try sendAndCollect(bind: bind, sink: sink, count: 4_000)
        #expect(numbers.count == 4_000, "nothing lost")
        #expect(inversions(numbers) > 0, "the flow was spread over several workers")
        let config = try ConfigParser.parse("listeners:\n" + listenerYAML("x", bind: bind, [sink]).replacingOccurrences(of: "      workers: 1\n", with: "      workers: 1\n      worker_steering: source_ip\n"))
        #expect(config.listeners[0].settings.workerSteering == .sourceIP)
    }
}
