// SPDX-License-Identifier: Apache-2.0
import Testing
@testable import ReusePortLB
// SOCK_DGRAM: see docs/development.md (test files that use Glibc's socket constants).
import CSystemShim

#if canImport(Glibc)
import Glibc
#endif

/// BatchReceiver's slot ranges: datagrams from several sockets gathered into one batch (the
/// relay stages replies from every session socket of a wakeup this way, then sends them at once).
@Suite("BatchReceiver")
struct BatchReceiverTests {
    /// A UDP socket bound to 127.0.0.1 on a port the kernel picks, and that port.
    func boundSocket() throws -> (Int32, UInt16) {
        let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
        try #require(fd >= 0)
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        let bound = withUnsafeMutablePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, length) == 0 && getsockname(fd, $0, &length) == 0 }
        }
        try #require(bound)
        return (fd, UInt16(bigEndian: address.sin_port))
    }

    func send(_ fd: Int32, _ text: String, to port: UInt16) {
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        address.sin_port = port.bigEndian
        let bytes = Array(text.utf8)
        let sent = withUnsafePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { sendto(fd, bytes, bytes.count, 0, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        #expect(sent == bytes.count)
    }

    func text(_ receiver: BatchReceiver, _ slot: Int) -> String { String(decoding: receiver.payload(slot), as: UTF8.self) }

    @Test("Receiving into a slot range fills only those slots, at most as many as the range holds, and keeps the others")
    func slotRanges() throws {
        let (a, portA) = try boundSocket()
        let (b, portB) = try boundSocket()
        let (sender, senderPort) = try boundSocket()
        defer { close(a); close(b); close(sender) }
        for text in ["a0", "a1"] { send(sender, text, to: portA) }
        for text in ["b0", "b1", "b2"] { send(sender, text, to: portB) }
        let receiver = BatchReceiver(batchSize: 8, maximumDatagramSize: 64)
        #expect(try receiver.receive(from: a, slots: 0..<8) == 2)
        #expect(try receiver.receive(from: b, slots: 2..<4) == 2, "no more than the range holds")
        #expect(try receiver.receive(from: b, slots: 4..<8) == 1)
        #expect(try receiver.receive(from: b, slots: 5..<8) == 0, "empty: 0, not an error")
        #expect((0..<5).map { text(receiver, $0) } == ["a0", "a1", "b0", "b1", "b2"])
        #expect(receiver.source(3)?.port == senderPort)
        #expect(!receiver.isTruncated(4))
    }
}
