// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
import CSystemShim
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// Packets whose headers are not in the skb's linear area, as real NICs deliver them (page
/// fragments with a short copied head). BPF_PROG_TEST_RUN on this kernel always builds a
/// linear skb (a ctx `data_end` is refused with EINVAL), so these come from a tap device with
/// IFF_NAPI_FRAGS: every iovec after the first of a write becomes a page fragment, and with
/// GRO off nothing pulls the headers into the head before tc ingress.
@Suite("tc_ebpf with headers outside the linear area", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct TCNonLinearTests {
    /// A tap in the proxy namespace (198.19.0.1/24) whose frames the test writes.
    final class FragmentTap {
        let name: String
        let fd: Int32
        let mac: [UInt8]

        init(_ topology: Topology) throws {
            name = "tf\(topology.suffix.prefix(8))"
            let name = self.name
            let opened: (fd: Int32, failure: String)? = inNetworkNamespace(topology.proxy) {
                let fd = open("/dev/net/tun", O_RDWR | O_CLOEXEC)
                guard fd >= 0 else { return (-1, "open /dev/net/tun: errno \(errno)") }
                // struct ifreq: name[16], then ifr_flags (IFF_TAP | IFF_NO_PI | IFF_NAPI | IFF_NAPI_FRAGS).
                var request = [UInt8](repeating: 0, count: 40)
                for (index, byte) in name.utf8.enumerated() { request[index] = byte }
                let flags: UInt16 = 0x0002 | 0x1000 | 0x0010 | 0x0020
                request[16] = UInt8(flags & 0xff)
                request[17] = UInt8(flags >> 8)
                guard ioctl(fd, 0x4004_54ca, &request) == 0 else {  // TUNSETIFF
                    defer { close(fd) }
                    return (-1, "TUNSETIFF: errno \(errno)")
                }
                // GRO would pull the headers it parses into the head: turn it off
                // (SIOCETHTOOL ETHTOOL_SGRO, data 0).
                let socketFD = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
                defer { close(socketFD) }
                var value: (UInt32, UInt32) = (0x2c, 0)
                var ethtool = [UInt8](repeating: 0, count: 40)
                for (index, byte) in name.utf8.enumerated() { ethtool[index] = byte }
                let result = withUnsafeMutablePointer(to: &value) { pointer in
                    withUnsafeBytes(of: UInt(bitPattern: pointer)) { for (index, byte) in $0.enumerated() { ethtool[16 + index] = byte } }
                    return ioctl(socketFD, 0x8946, &ethtool)
                }
                guard result == 0 else {
                    defer { close(fd) }
                    return (-1, "SIOCETHTOOL ETHTOOL_SGRO: errno \(errno)")
                }
                return (fd, "")
            }
            try #require((opened?.fd ?? -1) >= 0, "\(opened?.failure ?? "setns failed")")
            fd = opened!.fd
            try topology.exec(topology.proxy, ["/usr/sbin/ip", "addr", "add", "198.19.0.1/24", "dev", name])
            try topology.exec(topology.proxy, ["/usr/sbin/ip", "link", "set", name, "up"])
            let json = try topology.exec(topology.proxy, ["/usr/sbin/ip", "-j", "link", "show", name])
            let link = try #require((JSONSerialization.jsonObject(with: Data(json.utf8)) as? [[String: Any]])?.first)
            mac = try #require(link["address"] as? String).split(separator: ":").map { UInt8($0, radix: 16)! }
        }

        deinit { close(fd) }

        /// Writes one frame as two iovecs: the first `head` bytes become the skb's head, the rest
        /// a page fragment.
        func write(_ frame: [UInt8], head: Int) throws {
            var frame = frame
            let written = frame.withUnsafeMutableBytes { bytes -> Int in
                var vectors = [iovec(iov_base: bytes.baseAddress, iov_len: head),
                               iovec(iov_base: bytes.baseAddress! + head, iov_len: bytes.count - head)]
                return writev(fd, &vectors, 2)
            }
            try #require(written == frame.count, "writev to the tap: \(written), errno \(errno)")
        }
    }

    @Test("Headers in a page fragment (split after Ethernet, inside IPv4, inside UDP): pulled, forwarded, none counted malformed")
    func pulled() throws {
        let topology = try Topology(backends: 1)
        let tap = try FragmentTap(topology)
        let collectors = try TCFixtures.collectors(topology)
        let config = """
            listeners:
              - name: tc
                bind: "198.19.0.1:5514"
                interface: \(tap.name)
                mode: tc_ebpf
                downstream:
                  - {name: b1, address: "\(Topology.backendIPv4(1)):\(TCFixtures.port)"}
            metrics: {enabled: true, bind: "127.0.0.1:9464"}
            """
        let (daemon, file) = try TCFixtures.start(topology, config, "tc-nonlinear")
        defer { try? FileManager.default.removeItem(at: file) }
        let source: [UInt8] = [198, 19, 0, 2]
        var sent = 0
        for head in [14, 14 + 10, 14 + 20 + 4] {
            for sequence in 0..<50 {
                let payload = Array("nonlinear \(head) \(sequence)".utf8) + [UInt8](repeating: 0x5a, count: 200)
                let udp = Packet.udp(source: source, destination: [198, 19, 0, 1], port: 5514, payload: payload)
                let frame = tap.mac + [2, 0, 0, 0, 0, 0x33, 0x08, 0x00]
                    + Packet.ipv4Header(source: source, destination: [198, 19, 0, 1], length: udp.count) + udp
                try tap.write(frame, head: head)
                sent += 1
            }
        }
        usleep(300_000)
        let metrics = try TCFixtures.metrics(topology)
        #expect(metrics.contains("udp_fanout_packets_forwarded_total{listener=\"tc\",mode=\"tc_ebpf\"} \(sent)"), "\(metrics)")
        #expect(metrics.contains("udp_fanout_tc_unmatched_packets_total{reason=\"malformed\"} 0"), "\(metrics)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        #expect(try collectors[0].stop().int("received") == sent)
    }
}
