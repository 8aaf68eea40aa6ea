// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
import CSystemShim
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

@Suite("the crash ledger: what a crash takes is counted by the next process")
struct CrashLedgerTests {
    /// The descriptors stored under `name` since last asked (the rest closed).
    static func stored(_ notify: NotifySocket, _ name: String) -> [Int32] {
        var kept: [Int32] = []
        var buffer = [UInt8](repeating: 0, count: 4096)
        var received = [Int32](repeating: -1, count: 253)
        var descriptor = pollfd(fd: notify.fd, events: Int16(POLLIN), revents: 0)
        while poll(&descriptor, 1, 50) > 0 {
            var count: Int32 = 0
            let length = shim_receive_with_descriptors(notify.fd, &buffer, buffer.count, &received, Int32(received.count), &count)
            guard length > 0 else { break }
            let fields = NotifySocket.fields(String(decoding: buffer[0..<Int(length)], as: UTF8.self))
            for fd in received[0..<Int(count)] {
                if fields["FDSTORE"] == "1" && fields["FDNAME"] == name { kept.append(fd) } else { close(fd) }
            }
        }
        return kept
    }

    /// Every line logged, with its metadata.
    static func text(_ log: LogStore) -> String {
        log.lines.withLock { lines in lines.map { "\($0.message) \($0.metadata.sorted { $0.key < $1.key })" }.joined(separator: "\n") }
    }

    @Test("Held at a crash, read by the next process: by listener (requests and replies), once; a thread that finished its batch or ended leaves nothing; the next process's own threads start from empty slots")
    func crashReadOut() throws {
        let notify = try NotifySocket()
        let log = LogStore()
        let first = DescriptorStore(inherited: [:], notifier: SystemdNotifier(environment: notify.path), logger: log.logger)
        let ledger = try #require(CrashLedger.open(descriptors: first, logger: log.logger))
        let fd = try #require(Self.stored(notify, CrashLedger.storeName).first, "the ledger is stored")
        defer { close(fd) }
        // Two userspace workers of "a", one holding a batch; a relay worker of "b" with replies
        // staged; a worker of "c" whose batch went out; a worker of "d" that ended.
        let a1 = try #require(ledger.claim(listener: "a")), a2 = try #require(ledger.claim(listener: "a"))
        a1.holding(17)
        a2.holding(3)
        let b = try #require(ledger.claim(listener: "b"))
        b.holding(2)
        b.holdingReplies(5)
        let c = try #require(ledger.claim(listener: "c"))
        c.holding(9)
        c.holding(0)
        let d = try #require(ledger.claim(listener: "d"))
        d.holding(4)
        d.holding(0)
        d.release()
        #expect(ledger.claimedSlots == 4)
        // The process ends without a stop: the next one is handed the memfd.
        let second = DescriptorStore(inherited: [CrashLedger.storeName: [dup(fd)]], notifier: SystemdNotifier(environment: notify.path), logger: log.logger)
        let next = try #require(CrashLedger.open(descriptors: second, logger: log.logger))
        #expect(next.takeInherited("a") == CrashLedger.Held(requests: 20, replies: 0))
        #expect(next.takeInherited("b") == CrashLedger.Held(requests: 2, replies: 5))
        #expect(next.takeInherited("c") == nil && next.takeInherited("d") == nil, "nothing held")
        #expect(next.takeInherited("a") == nil, "counted once")
        #expect(Self.text(log).contains("counted dropped, reason crash"), "\(Self.text(log))")
        #expect(Self.stored(notify, CrashLedger.storeName).isEmpty, "taken over in place: not stored again")
        // Its slots were emptied: a third process reads nothing, and a new claim starts at 0.
        let fresh = try #require(next.claim(listener: "a"))
        let third = try #require(CrashLedger.open(descriptors: DescriptorStore(inherited: [CrashLedger.storeName: [dup(fd)]], notifier: SystemdNotifier(environment: notify.path), logger: log.logger), logger: log.logger))
        #expect(third.takeInherited("a") == nil && third.takeInherited("b") == nil)
        fresh.release()
        _ = (a1, a2, b, c)
    }

    @Test("A listener the next configuration does not have: logged as lost; a ledger of another layout is refused (counted rejected) and a new one stored; no service manager: no ledger")
    func unclaimedAndRefused() throws {
        let notify = try NotifySocket()
        let log = LogStore()
        let first = DescriptorStore(inherited: [:], notifier: SystemdNotifier(environment: notify.path), logger: log.logger)
        let ledger = try #require(CrashLedger.open(descriptors: first, logger: log.logger))
        let fd = try #require(Self.stored(notify, CrashLedger.storeName).first)
        defer { close(fd) }
        let gone = try #require(ledger.claim(listener: "gone"))
        gone.holding(8)
        let next = try #require(CrashLedger.open(descriptors: DescriptorStore(inherited: [CrashLedger.storeName: [dup(fd)]], notifier: SystemdNotifier(environment: notify.path), logger: log.logger), logger: log.logger))
        next.reportUnclaimed()
        #expect(Self.text(log).contains("a listener this configuration does not have") && Self.text(log).contains("gone"), "\(Self.text(log))")

        let junk = shim_memfd("junk")
        #expect(ftruncate(junk, 4096) == 0)
        let refusing = DescriptorStore(inherited: [CrashLedger.storeName: [junk]], notifier: SystemdNotifier(environment: notify.path), logger: log.logger)
        #expect(CrashLedger.open(descriptors: refusing, logger: log.logger) != nil)
        #expect(refusing.outcomes["ledger"]?[.rejected] == 1, "\(refusing.outcomes)")
        let renewed = Self.stored(notify, CrashLedger.storeName)
        #expect(renewed.count == 1, "a new ledger is stored in its place")
        for fd in renewed { close(fd) }
        #expect(CrashLedger.open(descriptors: .none(logger: log.logger), logger: log.logger) == nil)
        _ = gone
    }
}
