// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
@testable import ReusePortLB
// SOCK_DGRAM: see docs/development.md (test files that use Glibc's socket constants).
import CSystemShim

#if canImport(Glibc)
import Glibc
#endif

/// sk_reuseport steering with real sockets on loopback, sending from chosen 127.0.0.0/8 sources.
@Suite("eBPF steering on loopback", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct SteeringTests {
    func group(_ count: Int, capacity: Int? = nil, policy: BalancePolicy = .sourceIP, port: UInt16 = freePort(),
               ip: String = "127.0.0.1") throws -> (SocketAddress, [ReusePortMember]) {
        let address = SocketAddress(ip: IPAddress(ip)!, port: port)
        let options = GroupOptions(policy: policy, capacity: capacity ?? count, steering: .ebpf, receiveBufferSize: 4 << 20)
        let members = try (0..<count).map { try ReusePortMember(joining: address, slot: .index($0), options: options) }
        for member in members { #expect(member.steering == .ebpf) }
        return (address, members)
    }

    @Test("Stickiness: every source on exactly one member, the one owner(of:) names")
    func stickiness() throws {
        let (address, members) = try group(3)
        let sources = loopbackSources(60)
        for source in sources { try send(from: source, to: address, count: 5) }
        let received = drain(members)
        let owner = ownerBySource(received)
        #expect(owner.count == 60)
        #expect(received.flatMap(\.values).reduce(0, +) == 300)
        for source in sources {
            #expect(try members[0].owner(of: IPAddress(source)!) == owner[source], "owner of \(source)")
        }
        let counters = try members[0].counters()
        #expect(counters.selected == 300 && counters.failedOver == 0 && counters.fallback == 0)
        #expect(counters.deliveredBySlot.reduce(0, +) == 300)
    }

    @Test("Balance: 300 sources over 3 members, each within 25 % of 100")
    func balance() throws {
        let (address, members) = try group(3)
        for source in loopbackSources(300) { try send(from: source, to: address) }
        let received = drain(members)
        _ = ownerBySource(received)
        for sources in received { #expect((75...125).contains(sources.count), "\(received.map(\.count))") }
    }

    @Test("Membership change: a fourth member takes about 1/4 of the sources; leaving gives them back")
    func membershipChange() throws {
        let (address, members) = try group(3, capacity: 4)
        let sources = loopbackSources(300)
        func owners(_ group: [ReusePortMember]) throws -> [String: Int] {
            for source in sources { try send(from: source, to: address) }
            return ownerBySource(drain(group)).mapValues { group[$0].slot }
        }
        let before = try owners(members)
        let fourth = try ReusePortMember(joining: address, slot: .index(3), options: members[0].options)
        let after = try owners(members + [fourth])
        let moved = sources.filter { before[$0] != after[$0] }
        #expect(Double(moved.count) / 300 <= 0.25 + 0.05, "moved \(moved.count) of 300")
        #expect(moved.allSatisfy { after[$0] == 3 }, "only moves to the new member")
        fourth.leave()
        #expect(try owners(members) == before)
    }

    @Test("A member that goes away: its sources fail over, still sticky; they return when the slot is filled")
    func failover() throws {
        let (address, members) = try group(3)
        let sources = loopbackSources(90)
        for source in sources { try send(from: source, to: address, count: 2) }
        let original = ownerBySource(drain(members))
        members[1].leave()
        for source in sources { try send(from: source, to: address, count: 2) }
        let survivors = [members[0], members[2]]
        let afterLeave = drain(survivors)
        #expect(afterLeave.flatMap(\.values).reduce(0, +) == 180, "nothing lost")
        let failedOver = ownerBySource(afterLeave).mapValues { survivors[$0].slot }
        for source in sources where original[source] != 1 {
            #expect(failedOver[source] == original[source], "\(source) stays put")
        }
        let counters = try members[0].counters()
        #expect(counters.failedOver == UInt64(2 * original.values.filter { $0 == 1 }.count))
        #expect(counters.fallback == 0)
        let replacement = try ReusePortMember(joining: address, slot: .index(1), options: members[0].options)
        for source in sources { try send(from: source, to: address) }
        let back = ownerBySource(drain([members[0], replacement, members[2]]))
        #expect(back == original)
    }

    @Test("Round robin spreads one heavy sender over every member")
    func roundRobin() throws {
        let (address, members) = try group(3, policy: .roundRobin)
        try send(from: "127.0.0.9", to: address, count: 300)
        let counts = drain(members).map { $0.values.reduce(0, +) }
        #expect(counts.reduce(0, +) == 300)
        for count in counts { #expect((60...140).contains(count), "\(counts)") }
    }

    @Test("Five-tuple: one address with many ports spreads; one port stays on one member")
    func fiveTuple() throws {
        let (address, members) = try group(3, policy: .fiveTuple)
        var used = Set<Int>()
        for port in UInt16(41000)..<41030 {
            try send(from: "127.0.0.9", to: address, count: 3, sourcePort: port)
            let counts = drain(members).map { $0.values.reduce(0, +) }
            #expect(counts.filter { $0 > 0 }.count == 1, "port \(port): \(counts)")
            if let index = counts.firstIndex(where: { $0 > 0 }) {
                used.insert(index)
                #expect(try members[0].owner(of: IPAddress("127.0.0.9")!, port: port) == members[index].slot)
            }
        }
        #expect(used.count == 3)
    }

    @Test("Two groups on two ports never affect each other; the last member out removes the pins")
    func twoGroups() throws {
        let (addressA, membersA) = try group(2)
        let (addressB, membersB) = try group(3, policy: .roundRobin)
        let directoryA = BPFFilesystem(root: "/sys/fs/bpf").groupDirectory(for: addressA)
        let directoryB = BPFFilesystem(root: "/sys/fs/bpf").groupDirectory(for: addressB)
        #expect(directoryA != directoryB)
        #expect(BPFFilesystem.exists(directoryA + "/prog") && BPFFilesystem.exists(directoryB + "/prog"))
        for member in membersA { member.leave() }
        #expect(!BPFFilesystem.exists(directoryA), "pins of A removed")
        try send(from: "127.0.0.9", to: addressB, count: 30)
        #expect(drain(membersB).map { $0.values.reduce(0, +) } == [10, 10, 10])
        #expect(try membersB[0].counters().selected == 30)
        membersB[0].leave()
        #expect(BPFFilesystem.exists(directoryB + "/prog"), "B kept while members live")
        membersB[1].leave()
        membersB[2].leave()
        #expect(!BPFFilesystem.exists(directoryB))
    }

    @Test("IPv6 group on ::1 with failover")
    func ipv6() throws {
        let (address, members) = try group(2, ip: "::1")
        try send(from: "::1", to: address, count: 10)
        let received = drain(members)
        #expect(ownerBySource(received)["::1"] == (try members[0].owner(of: IPAddress("::1")!)))
        let owner = try members[0].owner(of: IPAddress("::1")!)
        members[try #require(owner)].leave()
        try send(from: "::1", to: address, count: 10)
        #expect(drain(members).flatMap(\.values).reduce(0, +) == 10)
    }

    @Test("Withdraw: the slot leaves selection at once, its sources fail over, what was queued stays to be read")
    func withdraw() throws {
        let (address, members) = try group(3)
        let sources = loopbackSources(60)
        for source in sources { try send(from: source, to: address) }
        // Queued, not yet read: member 1's share stays on its socket after the withdraw.
        let queuedOnOne = try sources.filter { try members[0].owner(of: IPAddress($0)!) == 1 }.count
        #expect(queuedOnOne > 0)
        #expect(try members[1].withdraw() == true)
        #expect(try members[0].liveSlots() == [0, 2])
        #expect(try members[1].withdraw() == true, "withdrawing twice is fine")
        for source in sources { try send(from: source, to: address) }
        let received = drain(members)
        #expect(received[1].values.reduce(0, +) == queuedOnOne, "only what was queued before the withdraw")
        #expect(received.flatMap(\.values).reduce(0, +) == 120, "nothing lost")
        #expect(try members[0].counters().failedOver == UInt64(queuedOnOne))
        let classic = try ReusePortMember(
            joining: SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort()), options: .init(capacity: 1, steering: .classicBPF))
        #expect(try classic.withdraw() == false, "classic BPF cannot take a socket out")
    }

    @Test("Every member withdrawn, a new member recreates the group: the old members' leave keeps the new pins")
    func withdrawnThenRecreated() throws {
        let (address, members) = try group(2)
        for member in members { #expect(try member.withdraw()) }
        let directory = BPFFilesystem(root: "/sys/fs/bpf").groupDirectory(for: address)
        let successor = try ReusePortMember(joining: address, slot: .index(0), options: members[0].options)
        for member in members { member.leave() }
        #expect(BPFFilesystem.exists(directory + "/members"), "the successor's pins stay")
        try send(from: "127.0.0.9", to: address, count: 3)
        #expect(drain([successor])[0]["127.0.0.9"] == 3)
        let counters = try successor.counters()
        #expect(counters.deliveredBySlot[0] == 3 && counters.fallback == 0, "the new program steered them: \(counters)")
        successor.leave()
        #expect(!BPFFilesystem.exists(directory))
    }

    @Test("Handover in process: the new socket gets new datagrams, the old one keeps what it queued")
    func handover() throws {
        let (address, members) = try group(2)
        let owners = try loopbackSources(40).map { ($0, try members[0].owner(of: IPAddress($0)!)) }
        let source = try #require(owners.first { $0.1 == 1 }?.0)
        try send(from: source, to: address, count: 5)
        let successor = try ReusePortMember(joining: address, slot: .takeover(1), options: members[0].options)
        #expect(members[1].isReplaced && !successor.isReplaced)
        try send(from: source, to: address, count: 7)
        let received = drain([members[1], successor])
        #expect(received[0][source] == 5 && received[1][source] == 7)
    }
}

@Suite("Bad input gives typed errors", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct BadInputTests {
    let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())

    @Test("Capacity 0 and capacity above the maximum")
    func capacity() {
        #expect(throws: ReusePortError.invalidCapacity(0)) { try ReusePortMember(joining: address, options: .init(capacity: 0)) }
        #expect(throws: ReusePortError.invalidCapacity(257)) { try ReusePortMember(joining: address, options: .init(capacity: 257)) }
    }

    @Test("Slot index out of range")
    func slotRange() {
        #expect(throws: ReusePortError.slotOutOfRange(slot: 3, capacity: 3)) {
            try ReusePortMember(joining: address, slot: .index(3), options: .init(capacity: 3))
        }
        #expect(throws: ReusePortError.slotOutOfRange(slot: -1, capacity: 3)) {
            try ReusePortMember(joining: address, slot: .takeover(-1), options: .init(capacity: 3))
        }
    }

    @Test("Slot in use, and a full group")
    func slotInUse() throws {
        let first = try ReusePortMember(joining: address, slot: .index(0), options: .init(capacity: 1))
        #expect(throws: ReusePortError.slotInUse(slot: 0)) {
            try ReusePortMember(joining: address, slot: .index(0), options: .init(capacity: 1))
        }
        #expect(throws: ReusePortError.groupFull(capacity: 1)) {
            try ReusePortMember(joining: address, options: .init(capacity: 1))
        }
        first.leave()
    }

    @Test("A group with another policy or capacity: the error names both")
    func mismatch() throws {
        let first = try ReusePortMember(joining: address, options: .init(policy: .sourceIP, capacity: 2))
        do {
            _ = try ReusePortMember(joining: address, options: .init(policy: .roundRobin, capacity: 2))
            Issue.record("joined a group with another policy")
        } catch {
            #expect(error.description.contains("policy sourceIP, capacity 2") && error.description.contains("policy roundRobin"))
        }
        #expect(throws: ReusePortError.self) { try ReusePortMember(joining: address, options: .init(capacity: 3)) }
        first.leave()
    }

    @Test("Address in use by a socket without SO_REUSEPORT")
    func addressInUse() throws {
        let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
        defer { close(fd) }
        #expect(address.withSockAddr { bind(fd, $0, $1) } == 0)
        #expect(throws: ReusePortError.addressInUse(address)) {
            try ReusePortMember(joining: address, options: .init(capacity: 2))
        }
        #expect(throws: ReusePortError.addressInUse(address)) {
            try ReusePortMember(joining: address, options: .init(capacity: 2, steering: .classicBPF))
        }
        // Nothing was left pinned by the failed join.
        #expect(!BPFFilesystem.exists(BPFFilesystem(root: "/sys/fs/bpf").groupDirectory(for: address)))
    }

    @Test("Five-tuple cannot be served by classic BPF")
    func fiveTupleClassic() {
        #expect(throws: ReusePortError.policyNeedsEBPF(.fiveTuple, .classicBPF)) {
            try ReusePortMember(joining: address, options: .init(policy: .fiveTuple, capacity: 2, steering: .classicBPF))
        }
    }

    @Test("Counters and ownership without eBPF are typed errors, not crashes")
    func countersWithoutEBPF() throws {
        let member = try ReusePortMember(joining: address, options: .init(capacity: 2, steering: .kernelHash))
        #expect(throws: ReusePortError.countersUnavailable(.kernelHash)) { try member.counters() }
        #expect(throws: ReusePortError.countersUnavailable(.kernelHash)) { try member.owner(of: IPAddress("127.0.0.1")!) }
        #expect(member.isReplaced == false)
    }
}
