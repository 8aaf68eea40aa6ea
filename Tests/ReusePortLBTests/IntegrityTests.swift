// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
@testable import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// Steering integrity: no member silently replaces or bypasses the group's steering.
@Suite("Steering integrity", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct IntegrityTests {
    func ebpfGroup(_ count: Int, capacity: Int) throws -> (SocketAddress, [ReusePortMember]) {
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let options = GroupOptions(capacity: capacity, steering: .ebpf, receiveBufferSize: 1 << 20)
        return (address, try (0..<count).map { try ReusePortMember(joining: address, slot: .index($0), options: options) })
    }

    @Test("A member without eBPF is refused where the eBPF program runs; forced, every member reports the change")
    func noEBPFMemberRefused() throws {
        let (address, members) = try ebpfGroup(2, capacity: 3)
        for steering in [SteeringPreference.classicBPF, .kernelHash] {
            do {
                _ = try ReusePortMember(joining: address, slot: .index(2), options: .init(capacity: 3, steering: steering))
                Issue.record("\(steering) joined an eBPF group")
            } catch {
                guard case .steeringConflict(address, _, _) = error else { Issue.record("\(error)"); continue }
                #expect(error.description.contains("runs eBPF steering") && error.description.contains("CAP_BPF")
                        && error.description.contains("--force"), "\(error)")
            }
            #expect(members[0].steeringInForce == .ebpf)
        }
        // Forced classic BPF: its program now serves every member, and they say so.
        let classic = try ReusePortMember(
            joining: address, slot: .index(2), options: .init(capacity: 3, steering: .classicBPF, force: true))
        #expect(classic.steering == .classicBPF && classic.steeringNote?.contains("forced") == true)
        #expect(members.allSatisfy { $0.steeringInForce == .classicBPF })
        classic.leave()
        // An eBPF member attaches the program again.
        let again = try ReusePortMember(joining: address, slot: .index(2), options: members[0].options)
        #expect(members.allSatisfy { $0.steeringInForce == .ebpf })
        again.leave()
        // Forced kernel hash detaches the program: the kernel hash spreads over all three sockets.
        let hashed = try ReusePortMember(
            joining: address, slot: .index(2), options: .init(capacity: 3, steering: .kernelHash, receiveBufferSize: 1 << 20, force: true))
        #expect(members.allSatisfy { $0.steeringInForce == .kernelHash })
        let before = try members[0].counters().selected
        for source in loopbackSources(90) { try send(from: source, to: address) }
        let received = drain(members + [hashed])
        #expect(received.flatMap(\.values).reduce(0, +) == 90)
        #expect(received[2].count > 0, "the kernel hash reaches the forced member")
        #expect(try members[0].counters().selected == before, "the eBPF program no longer runs")
        hashed.leave()
    }

    @Test("Takeover where handover cannot work (classic BPF, kernel hash) is an error")
    func takeoverNeedsEBPF() throws {
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        #expect(throws: ReusePortError.takeoverNeedsEBPF(.classicBPF)) {
            try ReusePortMember(joining: address, slot: .takeover(0), options: .init(capacity: 2, steering: .classicBPF))
        }
        #expect(throws: ReusePortError.takeoverNeedsEBPF(.kernelHash)) {
            try ReusePortMember(joining: address, slot: .takeover(0), options: .init(capacity: 2, steering: .kernelHash))
        }
        let collector = try Child("collector", ["127.0.0.1", String(address.port), "0", "2", "--takeover", "--steering", "classicBPF"])
        #expect(collector.wait(seconds: 10) == 2, "exits with an error instead of saying ready")
        #expect(collector.stderr.contains("takeover needs eBPF steering") && !collector.stderr.contains("ready"), "\(collector.stderr)")
    }

    @Test("Collectors: a classicBPF collector is refused by an eBPF group; with --force the others log and report classicBPF")
    func collectorsForced() throws {
        let port = freePort()
        let children = try (0..<2).map { index in
            let child = try Child("collector", ["127.0.0.1", String(port), String(index), "3"])
            try child.waitFor("ready")
            return child
        }
        let refused = try Child("collector", ["127.0.0.1", String(port), "2", "3", "--steering", "classicBPF"])
        #expect(refused.wait(seconds: 10) == 2)
        #expect(refused.stderr.contains("runs eBPF steering"), "\(refused.stderr)")
        let forced = try Child("collector", ["127.0.0.1", String(port), "2", "3", "--steering", "classicBPF", "--force"])
        try forced.waitFor("ready")
        try children[0].waitFor("steering changed from ebpf to classicBPF")
        let reports = try children.map { try $0.stop() } + [forced.stop()]
        #expect(reports.allSatisfy { $0["steering"] as? String == "classicBPF" }, "\(reports.map { $0["steering"] ?? "nil" })")
    }

    /// A child in its own mount namespace with its own bpffs on /sys/fs/bpf, as `ip netns exec` makes.
    let privateBPFFS = ["/usr/bin/unshare", "-m", "--propagation", "private", "/bin/sh", "-c",
                        "mount -t bpf bpf /sys/fs/bpf && exec \"$0\" \"$@\""]

    @Test("A member without eBPF in another bpffs mount (or unable to read the pins) is refused by a running eBPF group it cannot see")
    func fallbackInOtherBPFFS() throws {
        let port = freePort()
        let host = try Child("collector", ["127.0.0.1", String(port), "0", "2"])
        try host.waitFor("steering=ebpf")
        for steering in ["classicBPF", "kernelHash"] {
            let isolated = try Child("collector", ["127.0.0.1", String(port), "1", "2", "--steering", steering], prefix: privateBPFFS)
            #expect(isolated.wait(seconds: 10) == 2, "refused: \(isolated.stderr)")
            #expect(isolated.stderr.contains("runs eBPF steering") && isolated.stderr.contains("nsenter --net"), "\(isolated.stderr)")
        }
        let report = try host.stop()
        #expect(report["steering"] as? String == "ebpf", "the host member's steering was never replaced")
    }

    @Test("Members in one netns but different bpffs mounts: the second to come is refused, naming the fix")
    func differentBPFFS() throws {
        // Host first, then a private-bpffs collector.
        let port = freePort()
        let host = try Child("collector", ["127.0.0.1", String(port), "0", "2"])
        try host.waitFor("ready")
        let isolated = try Child("collector", ["127.0.0.1", String(port), "1", "2"], prefix: privateBPFFS)
        #expect(isolated.wait(seconds: 10) == 2, "refused: \(isolated.stderr)")
        #expect(isolated.stderr.contains("another bpffs") && isolated.stderr.contains("nsenter --net"), "\(isolated.stderr)")
        _ = try host.stop()

        // A private-bpffs collector first, then a member in the host's bpffs.
        let otherPort = freePort()
        let first = try Child("collector", ["127.0.0.1", String(otherPort), "0", "2"], prefix: privateBPFFS)
        try first.waitFor("ready")
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: otherPort)
        #expect(throws: ReusePortError.bpffsNotShared(address, bpffs: "/sys/fs/bpf", sockets: 1)) {
            try ReusePortMember(joining: address, slot: .index(1), options: .init(capacity: 2))
        }
        #expect(!BPFFilesystem.exists(BPFFilesystem(root: "/sys/fs/bpf").groupDirectory(for: address)), "nothing pinned by the refused join")
        _ = try first.stop()
    }
}
