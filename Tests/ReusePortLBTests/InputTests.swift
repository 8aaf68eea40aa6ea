// SPDX-License-Identifier: Apache-2.0
import BPFKernelABI
import BPFSupport
import Foundation
import Testing
import TestSupport
@testable import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif
import SystemCalls

/// Input checks of the collector, the publisher and the library: each bad input one clear
/// message naming it, never a parse error about options.
@Suite("Input checks", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct InputTests {
    struct Case: CustomTestStringConvertible, Sendable {
        let tool: String
        let arguments: [String]
        let message: String
        var testDescription: String { "\(tool) \(arguments.joined(separator: " "))" }
    }

    static let cases: [Case] = [
        Case(tool: "collector", arguments: ["127.0.0.1", "0", "0", "1"], message: "port 0"),
        Case(tool: "collector", arguments: ["127.0.0.1", "-5", "0", "1"], message: "<port> must not be negative (got -5)"),
        Case(tool: "collector", arguments: ["127.0.0.1", "5000", "-1", "3"], message: "<index> must not be negative (got -1)"),
        Case(tool: "collector", arguments: ["127.0.0.1", "5000", "0", "-3"], message: "<count> must not be negative (got -3)"),
        Case(tool: "collector", arguments: ["127.0.0.1", "5000", "0", "1", "--batch", "-5"], message: "--batch must be 1...1024"),
        Case(tool: "collector", arguments: ["127.0.0.1", "5000", "0", "1", "--rcvbuf", "-1"], message: "--rcvbuf must not be negative"),
        Case(tool: "collector", arguments: ["127.0.0.1", "5000", "0", "1", "--duration", "-1"], message: "--duration must not be negative"),
        Case(tool: "collector", arguments: ["127.0.0.1", "5000", "0", "1", "--max-sources", "-1"], message: "--max-sources must be 0...1000000"),
        Case(tool: "collector", arguments: ["fe80::1%lo", "5000", "0", "1"], message: "scoped IPv6"),
        Case(tool: "publisher", arguments: ["127.0.0.1", "0", "10"], message: "port 0"),
        Case(tool: "publisher", arguments: ["127.0.0.1", "5000", "-10"], message: "<count> must not be negative (got -10)"),
        Case(tool: "publisher", arguments: ["127.0.0.1", "5000", "10", "--rate", "-5"], message: "--rate and --duration must not be negative"),
        Case(tool: "publisher", arguments: ["127.0.0.1", "5000", "10", "--duration=-5"], message: "--rate and --duration must not be negative"),
        Case(tool: "publisher", arguments: ["fe80::1%lo", "5000", "10"], message: "scoped IPv6"),
        Case(tool: "publisher", arguments: ["::1", "5000", "10", "--sources", "fe80::1%lo"], message: "scoped IPv6"),
    ]

    @Test("Bad arguments: exit 64 with one message naming the argument", arguments: cases)
    func badArguments(_ entry: Case) throws {
        let result = try run(binaryDirectory.appendingPathComponent(entry.tool).path, entry.arguments)
        #expect(result.status == 64, "\(result.output)")
        #expect(result.output.contains(entry.message), "\(result.output)")
        #expect(!result.output.contains("Missing value") && !result.output.contains("Unknown option")
                && !result.output.contains("Missing expected argument"), "\(result.output)")
    }

    @Test("A persistent send error (no route: loopback down in a fresh namespace) ends the publisher with the error")
    func publisherGivesUp() throws {
        let namespace = "rplb-input-\(UInt32.random(in: 0...UInt32.max))"
        try #require(try run("/usr/sbin/ip", ["netns", "add", namespace]).status == 0)
        defer { _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace]) }
        let publisher = try Child("publisher", ["127.0.0.1", "5000", "1000000"], prefix: ["/usr/bin/nsenter", "--net=/run/netns/\(namespace)", "--"])
        #expect(publisher.wait(seconds: 15) == 1, "exits non-zero instead of retrying forever")
        #expect(publisher.stderr.contains("Network is unreachable"), "\(publisher.stderr)")
    }

    @Test("The library refuses port 0 (each member would get its own random port)")
    func libraryPortZero() {
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: 0)
        #expect(throws: ReusePortError.invalidAddress(address, reason: ReusePortError.portZeroReason)) {
            try ReusePortMember(joining: address, options: .init(capacity: 1))
        }
        #expect(throws: ReusePortError.invalidAddress(address, reason: ReusePortError.portZeroReason)) {
            try ReusePortGroup(privateTo: address, options: .init(capacity: 1))
        }
    }

    @Test("Every error message fits the C API's REUSEPORTLB_ERROR_MAX buffer")
    func errorLength() throws {
        let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
        let header = try String(contentsOf: root.appendingPathComponent("include/reuseportlb.h"), encoding: .utf8)
        let line = try #require(header.split(separator: "\n").first { $0.hasPrefix("#define REUSEPORTLB_ERROR_MAX ") })
        let maximum = try #require(Int(line.split(separator: " ").last!))
        let address = SocketAddress(ip: IPAddress("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff")!, port: 65535)
        let long = String(repeating: "x", count: 100)
        let group = "/sys/fs/bpf/reuseportlb/udp6-ffff_ffff_ffff_ffff_ffff_ffff_ffff_ffff-65535-net4026531833"
        let settings = "policy fiveTuple, capacity 256, seed 4294967295, layout v5"
        let errors: [ReusePortError] = [
            .invalidCapacity(Int.min), .slotOutOfRange(slot: Int.min, capacity: Int.max), .slotInUse(slot: Int.max),
            .groupFull(capacity: Int.max), .groupSettingsMismatch(group: group, existing: settings, requested: settings),
            .addressInUse(address), .bpffsUnavailable(path: "/sys/fs/bpf", reason: long),
            .ebpfUnavailable(reason: "bpf_object__load rplb_select failed: Operation not permitted (errno 1)"),
            .countersUnavailable(.classicBPF), .policyNeedsEBPF(.roundRobin, .classicBPF),
            .system(SystemCallError(call: "bpf_map_update_elem members[255]", errno: EOPNOTSUPP)),
            .addressServedByAnotherProcess(address, pid: Int32.max, command: "123456789abcdef"),
            .steeringConflict(group: address, running: settings + ", 256 live member(s)", requested: .classicBPF),
            .takeoverNeedsEBPF(.classicBPF), .bpffsNotShared(address, bpffs: "/sys/fs/bpf", sockets: Int.max),
            .noLiveMember(address), .invalidAddress(address, reason: ReusePortError.portZeroReason),
            .templateStoreUnavailable(reason: "\(group)/templates is a map of key size 4294967295 and value size 4294967295, not 24 and 1024: a member of another version created it; stop every member of the group to recreate it"),
            .templateStoreUnavailable(reason: "this member uses classicBPF steering in a process-private group: the store lives in the pinned eBPF group's directory; join with eBPF steering and bpffs (CAP_BPF)"),
        ]
        for error in errors {
            #expect(error.description.utf8.count < maximum, "\(error.description.utf8.count) bytes: \(error)")
        }
    }
}
