// SPDX-License-Identifier: Apache-2.0
/// The BPF objects compiled from `bpf/*.bpf.c` by the BPFObjectCompiler plugin, one static
/// base64 string per program (`reuseport_select.bpf.c` becomes `reuseportSelect`).
public enum EmbeddedBPF {}

/// A BPF program object shipped inside the binary.
public enum BPFObject: Sendable, CaseIterable {
    /// `bpf/reuseport_select.bpf.c`: the sk_reuseport program of ReusePortLB.
    case reuseportSelect
    /// `bpf/tc_fanout.bpf.c`: the tc ingress program of udp-fanout's tc_ebpf mode.
    case tcFanout
    /// `bpf/xdp_steer.bpf.c`: the XDP program of udp-fanout's af_xdp mode.
    case xdpSteer
    /// `bpf/xdp_fanout.bpf.c`: the XDP program of udp-fanout's xdp mode (loaded with tc_fanout's maps).
    case xdpFanout
    /// `bpf/map_count.bpf.c`: a map iterator that counts the entries of nat listeners' association maps.
    case mapCount
    /// `bpf/fanout_quic_keys.bpf.c`: the syscall program that puts quic_lb keys into tc_fanout's key map.
    case quicKeys
    /// `bpf/tc_fanout_plain.bpf.c`, `bpf/xdp_fanout_plain.bpf.c`: the tc and xdp programs without
    /// the BPF crypto kfuncs (kernels before 6.10: plaintext quic_lb server IDs only).
    case tcFanoutPlain
    case xdpFanoutPlain

    /// The name of the object file the plugin compiles (`tc_fanout.bpf.o`).
    public var fileName: String {
        switch self {
        case .reuseportSelect: return "reuseport_select.bpf.o"
        case .tcFanout: return "tc_fanout.bpf.o"
        case .xdpSteer: return "xdp_steer.bpf.o"
        case .xdpFanout: return "xdp_fanout.bpf.o"
        case .mapCount: return "map_count.bpf.o"
        case .quicKeys: return "fanout_quic_keys.bpf.o"
        case .tcFanoutPlain: return "tc_fanout_plain.bpf.o"
        case .xdpFanoutPlain: return "xdp_fanout_plain.bpf.o"
        }
    }

    /// The ELF object's bytes, decoded from the embedded base64 text.
    public var elfBytes: [UInt8] {
        switch self {
        case .reuseportSelect: return Base64.decode(EmbeddedBPF.reuseportSelect)
        case .tcFanout: return Base64.decode(EmbeddedBPF.tcFanout)
        case .xdpSteer: return Base64.decode(EmbeddedBPF.xdpSteer)
        case .xdpFanout: return Base64.decode(EmbeddedBPF.xdpFanout)
        case .mapCount: return Base64.decode(EmbeddedBPF.mapCount)
        case .quicKeys: return Base64.decode(EmbeddedBPF.fanoutQuicKeys)
        case .tcFanoutPlain: return Base64.decode(EmbeddedBPF.tcFanoutPlain)
        case .xdpFanoutPlain: return Base64.decode(EmbeddedBPF.xdpFanoutPlain)
        }
    }
}

/// Decodes standard base64 (RFC 4648, with padding) as the plugin writes it.
enum Base64 {
    static func decode(_ text: StaticString) -> [UInt8] {
        text.withUTF8Buffer { decode($0) }
    }

    static func decode(_ input: UnsafeBufferPointer<UInt8>) -> [UInt8] {
        var output: [UInt8] = []
        output.reserveCapacity(input.count / 4 * 3)
        var accumulator: UInt32 = 0
        var bits = 0
        for character in input {
            let value: UInt8
            switch character {
            case UInt8(ascii: "A")...UInt8(ascii: "Z"): value = character - UInt8(ascii: "A")
            case UInt8(ascii: "a")...UInt8(ascii: "z"): value = character - UInt8(ascii: "a") + 26
            case UInt8(ascii: "0")...UInt8(ascii: "9"): value = character - UInt8(ascii: "0") + 52
            case UInt8(ascii: "+"): value = 62
            case UInt8(ascii: "/"): value = 63
            default: continue  // padding
            }
            accumulator = accumulator << 6 | UInt32(value)
            bits += 6
            if bits >= 8 {
                bits -= 8
                output.append(UInt8(truncatingIfNeeded: accumulator >> UInt32(bits)))
            }
        }
        return output
    }
}
