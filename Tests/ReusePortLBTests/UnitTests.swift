// SPDX-License-Identifier: Apache-2.0
import Testing
import TestSupport
@testable import BPFObjects
@testable import ReusePortLB
import TrafficModel

@Suite("Pure logic")
struct UnitTests {
    @Test("Maglev: every backend owns about 1/N of the table")
    func maglevBalance() throws {
        let table = try #require(MaglevTable(backends: (0..<7).map { .init(name: "b\($0)") }, size: 65537, seed: 1))
        var counts = [Int](repeating: 0, count: 7)
        for entry in table.entries { counts[Int(entry)] += 1 }
        for count in counts { #expect(abs(Double(count) / 65537 - 1.0 / 7) < 0.01) }
    }

    @Test("Maglev: weights give proportional shares; weight 0 leaves a backend out")
    func maglevWeights() throws {
        let table = try #require(MaglevTable(
            backends: [.init(name: "a", weight: 1), .init(name: "b", weight: 3), .init(name: "c", weight: 0)],
            size: 65537, seed: 7))
        let b = table.entries.filter { $0 == 1 }.count
        #expect(abs(Double(b) / 65537 - 0.75) < 0.01)
        #expect(!table.entries.contains(2))
        #expect(MaglevTable(backends: [.init(name: "x", weight: 0)], size: 13, seed: 0) == nil)
    }

    @Test("Maglev: removing one of N backends changes about 1/N of the entries")
    func maglevDisruption() throws {
        let names = (0..<5).map { MaglevTable.Backend(name: "10.0.0.\($0):514") }
        let before = try #require(MaglevTable(backends: names, size: 65537, seed: 3))
        var without = names
        without[2].weight = 0
        let after = try #require(MaglevTable(backends: without, size: 65537, seed: 3))
        let changed = zip(before.entries, after.entries).filter { $0 != $1 }.count
        #expect(Double(changed) / 65537 < 0.2 + 0.05)
        // Same inputs, same table: nodes with the same backend set agree.
        #expect(MaglevTable(backends: names, size: 65537, seed: 3) == before)
    }

    @Test("Source ranges", arguments: [
        ("127.0.0.10-127.0.0.250", 241), ("127.0.0.255-127.0.1.1", 3), ("2001:db8::fe-2001:db8::101", 4),
        ("127.0.0.1,127.0.0.5-127.0.0.6", 3),
    ])
    func ranges(text: String, count: Int) throws {
        #expect(try AddressRange.parse(text).count == count)
    }

    @Test("Bad source ranges are refused", arguments: ["", "127.0.0.9-127.0.0.1", "127.0.0.1-::1", "nonsense", "10.0.0.0-10.2.0.0"])
    func badRanges(text: String) {
        #expect(throws: AddressRange.ParseError.self) { try AddressRange.parse(text) }
    }

    @Test("Payload header round trip, and foreign datagrams are recognised")
    func payload() {
        var buffer = [UInt8](repeating: 0, count: 64)
        buffer.withUnsafeMutableBytes { Payload.write(into: $0.baseAddress!, capacity: 64, source: 7, sequence: 1 << 40) }
        let header = buffer.withUnsafeBytes { Payload.read($0) }
        #expect(header?.source == 7 && header?.sequence == 1 << 40)
        #expect(header?.sentAt.map { $0 <= Payload.monotonicNanoseconds() } == true, "24 bytes and more carry the send time")
        var small = [UInt8](repeating: 0, count: 16)
        small.withUnsafeMutableBytes { Payload.write(into: $0.baseAddress!, capacity: 16, source: 1, sequence: 2) }
        #expect(small.withUnsafeBytes { Payload.read($0) }.map { $0.sentAt == nil && $0.sequence == 2 } == true)
        #expect(Array("hello world, not ours".utf8).withUnsafeBytes { Payload.read($0) } == nil)
    }

    @Test("Latency percentiles from the histogram")
    func latency() {
        var histogram = LatencyHistogram()
        #expect(histogram.percentile(0.5) == nil)
        for micros in 1...100 { histogram.record(nanoseconds: UInt64(micros) * 1000 - 500) }
        histogram.record(nanoseconds: 50_000_000)
        #expect(histogram.percentile(0.5) == 51)
        #expect(histogram.percentile(0.99) == 100)
        #expect(histogram.percentile(1.0) == 50_100)
    }

    @Test("Loss and reordering from sequence numbers")
    func tally() {
        var tally = SourceTally()
        for sequence: UInt64 in [0, 1, 3, 2, 6] { tally.record(sequence: sequence) }
        #expect(tally.packets == 5 && tally.lost == 2 && tally.reordered == 1)
        tally.recordUnsequenced()
        #expect(tally.packets == 6 && tally.sequenced == 5 && tally.lost == 2, "a datagram without a sequence is counted, not checked")
    }

    @Test("Negative numbers on a command line: option values joined with '=', positionals named")
    func commandLineNumbers() {
        let names = ["ip", "port", "count"]
        let flags: Set<String> = ["--gso"]
        func rewrite(_ arguments: [String]) -> Result<[String], CommandLineNumbers.Message> {
            CommandLineNumbers.rewrite(arguments, positionals: names, flags: flags)
        }
        #expect(rewrite(["::1", "5", "10", "--rate", "-5"]) == .success(["::1", "5", "10", "--rate=-5"]))
        #expect(rewrite(["--rate", "-0.5", "::1", "5", "10"]) == .success(["--rate=-0.5", "::1", "5", "10"]))
        #expect(rewrite(["::1", "--gso", "-3", "10"]) == .failure(.init(text: "<port> must not be negative (got -3)")))
        #expect(rewrite(["::1", "5", "-10"]) == .failure(.init(text: "<count> must not be negative (got -10)")))
        #expect(rewrite(["::1", "5", "10", "-h"]) == .success(["::1", "5", "10", "-h"]), "a short option is not a number")
        #expect(rewrite(["--", "-1"]) == .success(["--", "-1"]), "after -- everything is left alone")
    }

    @Test("Source table: exact for the first `limit` sources, the rest in one other count")
    func sourceTable() {
        var table = SourceTable<String>(limit: 2)
        for (source, sequence) in [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("d", 0), ("c", 1)] {
            table.record(source, sequence: UInt64(sequence))
        }
        table.record("b", sequence: nil)
        #expect(table.tallies.keys.sorted() == ["a", "b"])
        #expect(table.tallies["a"]?.packets == 2 && table.tallies["b"]?.packets == 2)
        #expect(table.otherPackets == 3)
        var none = SourceTable<String>(limit: 0)
        none.record("a", sequence: nil)
        #expect(none.tallies.isEmpty && none.otherPackets == 1)
    }

    @Test("Two senders' sequences behind one address are marked mixed, not reported as lost 0")
    func mixedSequences() {
        var one = SourceTally()
        for sequence in [0, 1, 3, 2] { one.record(sequence: UInt64(sequence)) }
        #expect(!one.isMixed && one.lost == 0 && one.reordered == 1)
        var gap = SourceTally()
        for sequence in [0, 1, 4] { gap.record(sequence: UInt64(sequence)) }
        #expect(!gap.isMixed && gap.lost == 2)
        // Two publishers through a proxy, each from 0, one of them losing 2 of 5.
        var two = SourceTally()
        for sequence in [0, 0, 1, 1, 2, 3, 4] { two.record(sequence: UInt64(sequence)) }
        #expect(two.isMixed, "7 datagrams in a span of 5: more than one sender")
    }

    @Test("Socket addresses parse and print", arguments: ["127.0.0.1:9000", "[2001:db8::1]:514", "[::1]:1"])
    func socketAddress(text: String) throws {
        #expect(try #require(SocketAddress(text)).description == text)
    }

    @Test("Malformed socket addresses are refused", arguments: ["127.0.0.1", "::1:5", "[::1]5", "1.2.3.4:70000", "host:1"])
    func badSocketAddress(text: String) {
        #expect(SocketAddress(text) == nil)
    }

    @Test("Address equality and hashing: by family and every byte; 0.0.0.0 is not ::, an IPv4-mapped address is not its IPv4 one; equal addresses hash equal and find each other in a set")
    func addressEquality() throws {
        let texts = ["0.0.0.0", "::", "198.18.0.1", "198.18.0.2", "1.0.0.198", "::ffff:198.18.0.1", "2001:db8::1", "2001:db8::2",
                     "2001:db8:0:0:1::1", "::1", "::1:0:0:0:0", "fe80::1"]
        let addresses = try texts.map { try #require(IPAddress($0)) }
        for (i, a) in addresses.enumerated() {
            for (j, b) in addresses.enumerated() {
                #expect((a == b) == (i == j), "\(a) == \(b)")
                #expect((a == b) == (a.bytes == b.bytes && a.family == b.family))
            }
            // A copy made from the text again, or from the bytes: equal, same hash, found.
            let again = try #require(IPAddress(texts[i]))
            let fromBytes = try #require(IPAddress(bytes: a.bytes))
            #expect(again == a && fromBytes == a && again.hashValue == a.hashValue && fromBytes.hashValue == a.hashValue)
        }
        #expect(Set(addresses).count == addresses.count)
        let table = Dictionary(uniqueKeysWithValues: addresses.enumerated().map { (SocketAddress(ip: $1, port: 514), $0) })
        for (index, text) in texts.enumerated() {
            #expect(table[SocketAddress(ip: IPAddress(text)!, port: 514)] == index, "\(text) finds itself")
            #expect(table[SocketAddress(ip: IPAddress(text)!, port: 515)] == nil, "\(text) on another port finds nothing")
        }
    }

    @Test("The embedded BPF object is an ELF file for the BPF machine")
    func embeddedObject() {
        let bytes = BPFObject.reuseportSelect.elfBytes
        #expect(Array(bytes.prefix(4)) == [0x7f, 0x45, 0x4c, 0x46])
        #expect(bytes[18] == 247)  // e_machine EM_BPF
    }

    @Test("Classic BPF program: IPv4 and IPv6 branches land on the hash step")
    func classicProgram() {
        let program = ClassicSteering.program(policy: .sourceIP, capacity: 3)
        #expect(program.count == 19)
        #expect(3 + Int(program[2].jt) == 5)            // IPv6 branch
        #expect(5 + Int(program[4].k) == 15)            // IPv4 jumps to the hash
        #expect(program[17].k == 3)                     // modulo capacity
        #expect(ClassicSteering.program(policy: .roundRobin, capacity: 4).count == 3)
    }
}
