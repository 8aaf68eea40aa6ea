// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim
import BPFSupport
import SystemCalls

/// The unprivileged steering: a classic BPF program attached with SO_ATTACH_REUSEPORT_CBPF,
/// which returns a socket's position in the group (join order). An index past the group's
/// size makes the kernel fall back to its hash, so no datagram is lost.
enum ClassicSteering {
    /// `sourceIP`: ((source address, IPv6 folded by XOR) × golden ratio) >> 16, modulo the
    /// capacity. `roundRobin`: a random position, modulo the capacity.
    static func program(policy: BalancePolicy, capacity: Int) -> [sock_filter] {
        let net = UInt32(bitPattern: shim_skf_net_off())
        func statement(_ code: Int32, _ k: UInt32) -> sock_filter {
            sock_filter(code: UInt16(code), jt: 0, jf: 0, k: k)
        }
        func jump(_ code: Int32, _ k: UInt32, _ jt: UInt8, _ jf: UInt8) -> sock_filter {
            sock_filter(code: UInt16(code), jt: jt, jf: jf, k: k)
        }
        let modulo = statement(BPF_ALU | BPF_MOD | BPF_K, UInt32(capacity))
        let returnA = statement(BPF_RET | BPF_A, 0)
        switch policy {
        case .roundRobin:
            return [statement(BPF_LD | BPF_W | BPF_ABS, UInt32(bitPattern: shim_skf_ad_random())), modulo, returnA]
        case .sourceIP, .fiveTuple:
            return [
                statement(BPF_LD | BPF_B | BPF_ABS, net),       // 0: version and IHL
                statement(BPF_ALU | BPF_RSH | BPF_K, 4),         // 1: version
                jump(BPF_JMP | BPF_JEQ | BPF_K, 6, 2, 0),        // 2: IPv6 → 5
                statement(BPF_LD | BPF_W | BPF_ABS, net &+ 12),  // 3: IPv4 source
                statement(BPF_JMP | BPF_JA, 10),                 // 4: → 15
                statement(BPF_LD | BPF_W | BPF_ABS, net &+ 8),   // 5: IPv6 source, word 0
                statement(BPF_MISC | BPF_TAX, 0),
                statement(BPF_LD | BPF_W | BPF_ABS, net &+ 12),
                statement(BPF_ALU | BPF_XOR | BPF_X, 0),
                statement(BPF_MISC | BPF_TAX, 0),
                statement(BPF_LD | BPF_W | BPF_ABS, net &+ 16),
                statement(BPF_ALU | BPF_XOR | BPF_X, 0),
                statement(BPF_MISC | BPF_TAX, 0),
                statement(BPF_LD | BPF_W | BPF_ABS, net &+ 20),
                statement(BPF_ALU | BPF_XOR | BPF_X, 0),         // 14
                statement(BPF_ALU | BPF_MUL | BPF_K, 0x9e37_79b1), // 15: hash
                statement(BPF_ALU | BPF_RSH | BPF_K, 16),
                modulo,
                returnA,
            ]
        }
    }

    static func attach(socket: Int32, policy: BalancePolicy, capacity: Int) throws(SystemCallError) {
        let filter = program(policy: policy, capacity: capacity)
        try filter.withUnsafeBufferPointer { (buffer) throws(SystemCallError) in
            _ = try systemCall("setsockopt SO_ATTACH_REUSEPORT_CBPF") {
                shim_attach_reuseport_cbpf(socket, buffer.baseAddress, UInt16(buffer.count))
            }
        }
    }
}
