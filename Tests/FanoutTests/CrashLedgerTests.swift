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
        TemplateHandOverTests.messages(notify).flatMap { fields, fds in
            guard fields["FDSTORE"] == "1" && fields["FDNAME"] == name else {
                for fd in fds { close(fd) }
                return [Int32]()
            }
            return fds
        }
    }

    /// Every line logged, with its metadata.
    static func text(_ log: LogStore) -> String {
        log.lines.withLock { lines in lines.map { "\($0.message) \($0.metadata.sorted { $0.key < $1.key })" }.joined(separator: "\n") }
    }

    @Test("Held at a crash, read by the next process: by listener (requests, replies, a receive under way), once; a thread that finished its batch or ended leaves nothing; a next process that crashes before its start completed leaves it to the one after; once committed, the slots are empty and free")
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
        // A worker of "e" inside a receive call; one of "a" whose receive returned 6.
        let e = try #require(ledger.claim(listener: "e"))
        e.receiving()
        let a3 = try #require(ledger.claim(listener: "a"))
        a3.receiving()
        a3.received(6)
        #expect(ledger.claimedSlots == 6)
        // The process ends without a stop: the next one is handed the memfd.
        let second = DescriptorStore(inherited: [CrashLedger.storeName: [dup(fd)]], notifier: SystemdNotifier(environment: notify.path), logger: log.logger)
        let next = try #require(CrashLedger.open(descriptors: second, logger: log.logger))
        #expect(next.takeInherited("a") == CrashLedger.Held(requests: 26, replies: 0))
        #expect(next.takeInherited("b") == CrashLedger.Held(requests: 2, replies: 5))
        #expect(next.takeInherited("e") == CrashLedger.Held(requests: 0, replies: 0, receiving: 1))
        #expect(next.takeInherited("c") == nil && next.takeInherited("d") == nil, "nothing held")
        #expect(next.takeInherited("a") == nil, "counted once")
        let text = Self.text(log)
        #expect(text.contains("counted dropped, reason crash") && text.contains("inside a receive call"), "\(text)")
        #expect(Self.stored(notify, CrashLedger.storeName).isEmpty, "taken over in place: not stored again")
        #expect(second.outcomes["ledger"]?[.adopted] == 1, "\(second.outcomes)")
        // Its own threads get other slots meanwhile.
        let fresh = try #require(next.claim(listener: "a"))
        fresh.holding(1)
        // It crashes before its start completed: the one after reads the same again (and its own thread's).
        let third = try #require(CrashLedger.open(descriptors: DescriptorStore(inherited: [CrashLedger.storeName: [dup(fd)]], notifier: SystemdNotifier(environment: notify.path), logger: log.logger), logger: log.logger))
        #expect(third.takeInherited("a") == CrashLedger.Held(requests: 27, replies: 0) && third.takeInherited("b") == CrashLedger.Held(requests: 2, replies: 5))
        fresh.holding(0)
        // Committed (the start completed): emptied; a fourth process reads nothing.
        third.commit()
        let fourth = try #require(CrashLedger.open(descriptors: DescriptorStore(inherited: [CrashLedger.storeName: [dup(fd)]], notifier: SystemdNotifier(environment: notify.path), logger: log.logger), logger: log.logger))
        #expect(fourth.takeInherited("a") == nil && fourth.takeInherited("b") == nil && fourth.takeInherited("e") == nil)
        #expect(fourth.claimedSlots == 0, "every slot free")
        fresh.release()
        _ = (a1, a2, b, c, e, a3)
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
        next.commit()
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
