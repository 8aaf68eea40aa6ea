// SPDX-License-Identifier: Apache-2.0
import Foundation
import Synchronization
import Testing
import TestSupport
@testable import ReusePortLB
// SOCK_DGRAM: see docs/development.md (test files that use Glibc's socket constants).
import CSystemShim
import SystemCalls

#if canImport(Glibc)
import Glibc
#endif

/// Process-private groups (ReusePortGroup): succession under traffic, nothing pinned, and the
/// refusal of an address another process serves.
@Suite("Process-private groups", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct PrivateGroupTests {
    /// What the sender thread has done so far.
    final class SenderProgress: Sendable {
        let sent = Atomic<Int>(0)
        let failures = Atomic<Int>(0)
    }

    /// Sends `count` datagrams (payload: the 8-byte sequence number) round robin from `sources`
    /// at about `rate` per second, on its own thread; bounded by `count` and 30 s.
    func startSender(to address: SocketAddress, sources: [String], count: Int, rate: Int) -> (SenderProgress, Thread) {
        let progress = SenderProgress()
        let thread = Thread {
            let sockets = sources.map { source in
                let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
                _ = SocketAddress(ip: IPAddress(source)!, port: 0).withSockAddr { bind(fd, $0, $1) }
                return fd
            }
            defer { for fd in sockets { close(fd) } }
            let start = ContinuousClock.now
            for sequence in 0..<count {
                if ContinuousClock.now - start > .seconds(30) { break }
                if sequence % 50 == 0 {
                    let due = start + .microseconds(Int64(sequence) * 1_000_000 / Int64(rate))
                    let now = ContinuousClock.now
                    if due > now { Thread.sleep(forTimeInterval: (due - now).seconds) }
                }
                var value = UInt64(sequence)
                let sent = address.withSockAddr { sendto(sockets[sequence % sockets.count], &value, 8, 0, $0, $1) }
                if sent != 8 { progress.failures.add(1, ordering: .relaxed) }
                progress.sent.store(sequence + 1, ordering: .sequentiallyConsistent)
            }
        }
        thread.start()
        return (progress, thread)
    }

    @Test("The kernel grace period activate() and withdraw() wait for is membarrier's, not the 50 ms fallback, on this kernel kind")
    func gracePeriod() {
        #expect(KernelGracePeriod.isAvailable, "membarrier(MEMBARRIER_CMD_QUERY) lists MEMBARRIER_CMD_GLOBAL")
        let clock = ContinuousClock()
        var waited = true
        let elapsed = clock.measure { waited = KernelGracePeriod.wait() }
        #expect(waited, "membarrier(MEMBARRIER_CMD_GLOBAL) returned 0, took \(elapsed)")
    }

    @Test("Succession: group B joins and activates under traffic, group A drains and leaves: every datagram once, none new to A, nothing pinned")
    func succession() throws {
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let pinned = BPFFilesystem(root: "/sys/fs/bpf").groupDirectory(for: address)
        let options = GroupOptions(policy: .sourceIP, capacity: 3, steering: .ebpf, receiveBufferSize: 4 << 20)
        let groupA = try ReusePortGroup(privateTo: address, options: options)
        #expect(groupA.steering == .ebpf && groupA.steeringNote == nil)
        var membersA = try (0..<3).map { try groupA.join(slot: $0) }
        try groupA.activate()
        #expect(!BPFFilesystem.exists(pinned), "nothing pinned")

        let total = 40_000
        let (progress, _) = startSender(to: address, sources: (10..<42).map { "127.0.8.\($0)" }, count: total, rate: 20_000)
        let receiver = BatchReceiver(batchSize: 64, maximumDatagramSize: 64)
        var receivedBy = [UInt8](repeating: 0, count: total)  // 1: A, 2: B, 3+: duplicates
        var duplicates = 0
        var countA = 0, countB = 0
        var membersB: [ReusePortMember] = []
        var sentAtActivate: Int?
        var activatedAt: ContinuousClock.Instant?
        var quietSince = ContinuousClock.now
        let deadline = ContinuousClock.now + .seconds(40)

        func read(_ member: ReusePortMember, group: UInt8) -> Int {
            var got = 0
            while let count = try? receiver.receive(from: member.socket), count > 0 {
                got += count
                for index in 0..<count {
                    let sequence = Int(receiver.payload(index).loadUnaligned(as: UInt64.self))
                    if receivedBy[sequence] != 0 { duplicates += 1 }
                    receivedBy[sequence] = receivedBy[sequence] == 0 ? group : 3
                    if group == 1 { countA += 1 } else { countB += 1 }
                }
            }
            return got
        }

        while ContinuousClock.now < deadline {
            var got = 0
            for member in membersA { got += read(member, group: 1) }
            for member in membersB { got += read(member, group: 2) }
            let sent = progress.sent.load(ordering: .sequentiallyConsistent)
            if membersB.isEmpty && sent >= total / 4 {
                // Group B: join while A still gets everything, then take over.
                let groupB = try ReusePortGroup(privateTo: address, options: options)
                membersB = try (0..<3).map { try groupB.join(slot: $0) }
                try groupB.activate()
                sentAtActivate = progress.sent.load(ordering: .sequentiallyConsistent)
                activatedAt = .now
                #expect(!BPFFilesystem.exists(pinned), "nothing pinned")
            }
            // A drains: 50 ms after B took over, with its queues empty, it leaves.
            if let activatedAt, !membersA.isEmpty, ContinuousClock.now - activatedAt > .milliseconds(50),
                membersA.allSatisfy({ (try? $0.socketStatistics().queuedBytes) == 0 })
            {
                for member in membersA { member.leave() }
                membersA = []
            }
            if got > 0 { quietSince = .now }
            if sent == total && membersA.isEmpty && ContinuousClock.now - quietSince > .milliseconds(300) { break }
            if got == 0 { usleep(1000) }
        }
        #expect(progress.failures.load(ordering: .relaxed) == 0)
        #expect(progress.sent.load(ordering: .relaxed) == total)
        let missing = receivedBy.indices.filter { receivedBy[$0] == 0 }
        #expect(missing.count == 0, "\(missing.count) never received, first \(missing.prefix(5))")
        #expect(duplicates == 0)
        let boundary = try #require(sentAtActivate)
        let lateToA = receivedBy.indices.filter { $0 > boundary && receivedBy[$0] == 1 }
        #expect(lateToA.count == 0, "sent after activate() yet received by A: \(lateToA.prefix(5)) (boundary \(boundary))")
        #expect(countA > 0 && countB > 0 && countA + countB == total, "A \(countA), B \(countB)")
        #expect(try membersB[0].counters().selected == UInt64(countB), "B's program steered exactly what B received")
        for member in membersB { member.leave() }
        #expect(!BPFFilesystem.exists(pinned))
    }

    /// Group A (one member, active) receives; group B is never activated and its members, the
    /// newest sockets on the address (first in the kernel's IPv4 hash chain, as a rolled-back
    /// reload's), join and leave 16 at a time, over and over, while a sender runs at 100,000
    /// datagrams/s.
    /// Returns how many datagrams were sent, reached A (read, or dropped by its full receive
    /// buffer: counted), were read from B's members, and closes.
    func churn(sealing: Bool, count: Int) throws -> (sent: Int, toA: Int, toB: Int, closes: Int) {
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let options = GroupOptions(policy: .sourceIP, capacity: 16, steering: .ebpf, receiveBufferSize: 8 << 20)
        let groupA = try ReusePortGroup(privateTo: address, options: GroupOptions(policy: .sourceIP, capacity: 1, steering: .ebpf, receiveBufferSize: 8 << 20))
        let memberA = try groupA.join(slot: 0)
        defer { memberA.leave() }
        try groupA.activate()
        let groupB = try ReusePortGroup(privateTo: address, options: options)
        let toA = Atomic<Int>(0)
        let stopReading = Atomic<Bool>(false)
        let reader = Thread {
            let receiver = BatchReceiver(batchSize: 64, maximumDatagramSize: 64)
            var descriptor = pollfd(fd: memberA.socket, events: Int16(POLLIN), revents: 0)
            var quietSince = ContinuousClock.now
            while true {
                if let got = try? receiver.receive(from: memberA.socket), got > 0 {
                    toA.add(got, ordering: .relaxed)
                    quietSince = .now
                    continue
                }
                if stopReading.load(ordering: .relaxed) && ContinuousClock.now - quietSince > .milliseconds(300) { return }
                _ = poll(&descriptor, 1, 20)
            }
        }
        reader.start()
        let (progress, _) = startSender(to: address, sources: ["127.0.0.1"], count: count, rate: 100_000)
        let receiver = BatchReceiver(batchSize: 64, maximumDatagramSize: 64)
        var toB = 0, closes = 0
        let deadline = ContinuousClock.now + .seconds(30)
        while progress.sent.load(ordering: .sequentiallyConsistent) < count && ContinuousClock.now < deadline {
            // 16 at a time, each newer than the one before; sealed, one grace period for all.
            let members = try (0..<16).map { try groupB.join(slot: $0) }
            if sealing {
                for member in members { _ = try member.sealWithoutWaiting() }
                KernelGracePeriod.wait()
            }
            for member in members.reversed() {
                while let got = try? receiver.receive(from: member.socket), got > 0 { toB += got }
                member.leave()
                closes += 1
            }
        }
        stopReading.store(true, ordering: .relaxed)
        while !reader.isFinished { usleep(10_000) }
        #expect(progress.failures.load(ordering: .relaxed) == 0)
        // What A's full receive buffer dropped is counted by the kernel, not lost in a close.
        let dropsA = Int((try? memberA.socketStatistics().drops) ?? 0)
        return (progress.sent.load(ordering: .relaxed), toA.load(ordering: .relaxed) + dropsA, toB, closes)
    }

    @Test("A member sealed before it leaves loses nothing at its close, also as the newest socket on the address under 100,000 datagrams/s (unsealed, the kernel delivers some to the closing socket)")
    func sealedLeave() throws {
        let sealed = try churn(sealing: true, count: 200_000)
        #expect(sealed.sent == 200_000)
        #expect(sealed.closes > 100, "the churn ran: \(sealed.closes) closes")
        #expect(sealed.toA + sealed.toB == sealed.sent,
                "sealed: sent \(sealed.sent), to A \(sealed.toA), read from the sealed members \(sealed.toB), lost \(sealed.sent - sealed.toA - sealed.toB) in \(sealed.closes) closes")
        // The same without the seal, for the record (the kernel's race; not asserted).
        let plain = try churn(sealing: false, count: 200_000)
        print("sealed leave: sealed members lost \(sealed.sent - sealed.toA - sealed.toB) of \(sealed.sent) in \(sealed.closes) closes; unsealed lost \(plain.sent - plain.toA - plain.toB) of \(plain.sent) in \(plain.closes) closes")
    }

    @Test("seal(): idempotent, sends fail after it, and a member that left throws EBADF")
    func sealRules() throws {
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let group = try ReusePortGroup(privateTo: address, options: GroupOptions(capacity: 1, steering: .ebpf))
        let member = try group.join(slot: 0)
        try group.activate()
        #expect(!member.isSealed)
        try member.seal()
        try member.seal()
        #expect(member.isSealed)
        var byte: UInt8 = 1
        let sent = address.withSockAddr { sendto(member.socket, &byte, 1, 0, $0, $1) }
        let failure = errno
        #expect(sent == -1 && failure == ENODEV, "a sealed socket sends nothing (IPv4: ENODEV): \(sent), errno \(failure)")
        // Nothing on the address receives now: the kernel counts a datagram to it as Udp NoPorts.
        let probe = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
        defer { close(probe) }
        _ = address.withSockAddr { sendto(probe, &byte, 1, 0, $0, $1) }
        usleep(50_000)
        #expect((try? member.socketStatistics().queuedBytes) == 0, "a sealed socket gets nothing new")
        member.leave()
        #expect(throws: ReusePortError.system(SystemCallError(call: "setsockopt SO_BINDTOIFINDEX (the member left)", errno: EBADF))) { try member.seal() }
    }

    @Test("seal(_:) seals several members with one grace period, skips those that left; a socket another member object sealed (a handed-over descriptor) counts as sealed")
    func sealSeveral() throws {
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let group = try ReusePortGroup(privateTo: address, options: GroupOptions(capacity: 3, steering: .ebpf))
        let members = try (0..<3).map { try group.join(slot: $0) }
        try group.activate()
        members[2].leave()
        try ReusePortMember.seal(members)
        #expect(members[0].isSealed && members[1].isSealed && !members[2].isSealed)
        #expect(try Syscall.getsockopt(members[0].socket, SOL_SOCKET, SO_BINDTOIFINDEX, initial: Int32(0)) == Int32.max)
        // The same socket through another descriptor, as a process that adopts it sees it.
        let other = try ReusePortMember(handedOver: dup(members[0].socket), address: address, options: GroupOptions(capacity: 1))
        defer { other.leave() }
        #expect(try other.sealWithoutWaiting() == false, "sealed already: nothing to do, no grace period")
        #expect(other.isSealed)
        for member in members { member.leave() }
    }

    @Test("SocketSeal on connected sockets (a relay's sessions), IPv4 and IPv6: what was queued stays readable, what comes after reaches no socket, and a socket sealed already is left as it is",
          arguments: ["127.0.0.1", "::1"])
    func sealConnected(loopback: String) throws {
        let family = loopback.contains(":") ? AF_INET6 : AF_INET
        // A "downstream" and a session socket connected to it, each bound to its own port.
        let downstream = SocketAddress(ip: IPAddress(loopback)!, port: freePort())
        let session = SocketAddress(ip: IPAddress(loopback)!, port: freePort())
        let server = socket(family, Int32(SOCK_DGRAM.rawValue), 0)
        let client = socket(family, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_NONBLOCK.rawValue), 0)
        defer { close(server); close(client) }
        try Syscall.bind(server, downstream)
        try Syscall.bind(client, session)
        #expect(session.withSockAddr { Glibc.connect(server, $0, $1) } == 0)
        #expect(downstream.withSockAddr { Glibc.connect(client, $0, $1) } == 0)
        var byte: UInt8 = 7
        #expect(send(server, &byte, 1, 0) == 1)
        usleep(20_000)
        let refused = SocketSeal.seal([client, client])
        #expect(refused.isEmpty && SocketSeal.isSealed(client))
        #expect(try SocketSeal.sealWithoutWaiting(client) == false, "sealed already")
        // After the seal: the reply reaches no socket (the server hears ICMP port unreachable).
        byte = 8
        _ = send(server, &byte, 1, 0)
        usleep(50_000)
        var buffer = [UInt8](repeating: 0, count: 4)
        #expect(recv(client, &buffer, 4, 0) == 1 && buffer[0] == 7, "the datagram queued before the seal is read")
        #expect(recv(client, &buffer, 4, 0) == -1 && errno == EAGAIN, "nothing came after the seal")
        #expect(recv(server, &buffer, 4, Int32(MSG_DONTWAIT)) == -1 && errno == ECONNREFUSED, "the later one was refused: port unreachable")
    }

    @Test("A second group in the same process on an address this process serves is allowed; slot rules hold")
    func sameProcess() throws {
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let options = GroupOptions(capacity: 2, steering: .ebpf)
        let first = try ReusePortGroup(privateTo: address, options: options)
        let member = try first.join(slot: 0)
        #expect(throws: ReusePortError.slotInUse(slot: 0)) { try first.join(slot: 0) }
        #expect(throws: ReusePortError.slotOutOfRange(slot: 2, capacity: 2)) { try first.join(slot: 2) }
        #expect(throws: ReusePortError.invalidCapacity(0)) { try ReusePortGroup(privateTo: address, options: .init(capacity: 0)) }
        let second = try ReusePortGroup(privateTo: address, options: options)
        #expect(throws: ReusePortError.noLiveMember(address)) { try second.activate() }
        let successor = try second.join(slot: 0)
        try second.activate()
        #expect(try successor.withdraw() == true)
        #expect(try successor.liveSlots() == [], "a private member withdraws from its group's map")
        member.leave()
        successor.leave()
    }

    @Test("Without eBPF: a classic private group steers by source at activate(); a kernel-hash one detaches that program")
    func withoutEBPF() throws {
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let classic = try ReusePortGroup(privateTo: address, options: .init(capacity: 2, steering: .classicBPF))
        #expect(classic.steering == .classicBPF)
        let classicMembers = try (0..<2).map { try classic.join(slot: $0) }
        #expect(throws: ReusePortError.slotInUse(slot: 1)) { try classic.join(slot: 1) }
        try classic.activate()
        let sources = loopbackSources(40)
        for source in sources { try send(from: source, to: address, count: 2) }
        let received = drain(classicMembers)
        #expect(received.flatMap(\.values).reduce(0, +) == 80)
        #expect(ownerBySource(received).count == 40, "each source on one member")
        #expect(received.allSatisfy { !$0.isEmpty }, "both members used")
        // The classic program belongs to the kernel's group, which lives while any socket of it
        // does: the successor joins before the classic members leave. With three sockets left,
        // the classic program (modulo 2) would never pick the third.
        let hashed = try ReusePortGroup(privateTo: address, options: .init(capacity: 3, steering: .kernelHash))
        let hashedMembers = try (0..<3).map { try hashed.join(slot: $0) }
        try hashed.activate()
        for member in classicMembers { member.leave() }
        for source in sources { try send(from: source, to: address) }
        let spread = drain(hashedMembers)
        #expect(spread.flatMap(\.values).reduce(0, +) == 40)
        #expect(spread.allSatisfy { !$0.isEmpty }, "the kernel hash reaches all three: \(spread.map(\.count))")
        #expect(throws: ReusePortError.countersUnavailable(.kernelHash)) { try hashedMembers[0].counters() }
        for member in hashedMembers { member.leave() }
    }

    @Test("An address another process (a child) already serves: the error names its pid and command")
    func anotherProcess() throws {
        let port = freePort()
        let child = try Child("collector", ["127.0.0.1", String(port), "0", "1", "--steering", "kernelHash"])
        try child.waitFor("ready")
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: port)
        #expect(throws: ReusePortError.addressServedByAnotherProcess(address, pid: child.process.processIdentifier, command: "collector")) {
            try ReusePortGroup(privateTo: address, options: .init(capacity: 2))
        }
        let error = ReusePortError.addressServedByAnotherProcess(address, pid: 4242, command: "udp-fanout")
        #expect(error.description == "127.0.0.1:\(port) is already served by another process (pid 4242, udp-fanout): stop it or use another bind")
        _ = try child.stop()
        // Once the other process is gone the address is free for a private group.
        let group = try ReusePortGroup(privateTo: address, options: .init(capacity: 1))
        _ = try group.join(slot: 0).leave()
    }
}
