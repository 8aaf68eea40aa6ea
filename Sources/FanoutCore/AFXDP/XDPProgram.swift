// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CLibBPF
import BPFKernelABI
import BPFObjects
import CSystemShim
import BPFSupport
import ReusePortLB
import SystemCalls

/// What the XDP program did with a frame: the mirror of `enum fanout_xdp_verdict`. Every frame
/// gets exactly one; only `redirected` reaches the AF_XDP socket, the rest pass to the kernel.
package enum XDPVerdict: Int, Sendable, CaseIterable {
    case redirected = 0
    case noSocket = 1
    case fragment = 2
    case tooLarge = 3
    case malformed = 4
    case notOurs = 5

    /// The C enum's value.
    var raw: fanout_xdp_verdict { fanout_xdp_verdict(rawValue: UInt32(rawValue)) }

    /// The metric's `reason` label.
    package var label: String {
        switch self {
        case .redirected: return "redirected"
        case .noSocket: return "no_socket"
        case .fragment: return "fragment"
        case .tooLarge: return "too_large"
        case .malformed: return "malformed"
        case .notOurs: return "not_ours"
        }
    }
}

/// The loaded XDP steering program and its maps: one per daemon, shared by every af_xdp
/// listener and interface. Nothing is pinned: closing the descriptors (or the process ending)
/// frees it.
final class XDPProgram: LoadedXDPProgram, @unchecked Sendable {  // descriptors only; callers serialize writes
    let program: Int32
    let listeners: Int32
    let sockets: Int32
    let stats: Int32
    /// The longest frame the program redirects (its read-only `max_frame_len`).
    let maxFrameLength: UInt32

    /// The stats key of frames no listener could be known for.
    static let unmatched = UInt32(FANOUT_XDP_UNMATCHED_STATS)

    /// Loads the embedded .xdpSteer object with max_frame_len (bytes of a frame the socket takes).
    init(maxFrameLength: UInt32) throws(SystemCallError) {
        self.maxFrameLength = maxFrameLength
        var options = fanout_xdp_options()
        options.max_frame_len = maxFrameLength
        let owned = try loadEmbeddedObject(
            .xdpSteer, program: FANOUT_PROG_XDP_NAME,
            maps: [FANOUT_MAP_XDP_LISTENERS_NAME, FANOUT_MAP_XDP_SOCKETS_NAME, FANOUT_MAP_XDP_STATS_NAME],
            prepare: { object throws(SystemCallError) in
                try setReadOnlyGlobal(object, options, objectName: "xdp_steer", global: FANOUT_XDP_OPTIONS_NAME, type: "struct fanout_xdp_options")
            })
        (program, listeners, sockets, stats) = (owned[0], owned[1], owned[2], owned[3])
    }

    func closeDescriptors() {
        for fd in [program, listeners, sockets, stats] { close(fd) }
    }


    // MARK: listeners and sockets

    /// The listeners map key: a bind matches only on its listener's interface.
    static func listenerKey(_ bind: SocketAddress, ifindex: UInt32) -> fanout_xdp_listener_key {
        var key = fanout_xdp_listener_key()
        key.ifindex = ifindex
        key.family = UInt8(bind.ip.family)
        key.port = bind.port.bigEndian
        key.addr = bind.ip.words
        return key
    }

    /// Steers `bind` (an unspecified address: every address of its family) arriving on
    /// `ifindex` to the sockets, counted under `id` (< FANOUT_MAX_LISTENERS).
    func putListener(_ bind: SocketAddress, ifindex: UInt32, id: UInt32) throws(SystemCallError) {
        guard id < UInt32(FANOUT_MAX_LISTENERS) else {
            throw SystemCallError(call: "af_xdp listener id \(id) (at most \(FANOUT_MAX_LISTENERS) listeners)", errno: E2BIG)
        }
        var key = Self.listenerKey(bind, ifindex: ifindex)
        var value = fanout_xdp_listener()
        value.id = id
        try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_XDP_LISTENERS_NAME)") { bpf_map_update_elem(listeners, &key, &value, UInt64(BPF_ANY)) }
    }

    func removeListener(_ bind: SocketAddress, ifindex: UInt32) {
        var key = Self.listenerKey(bind, ifindex: ifindex)
        bpf_map_delete_elem(listeners, &key)
    }

    /// Puts the AF_XDP socket `fd` (bound to `queue`) in the XSKMAP: frames of that receive
    /// queue are redirected to it.
    func setSocket(queue: UInt32, fd: Int32) throws(SystemCallError) {
        guard queue < UInt32(FANOUT_XDP_MAX_QUEUES) else {
            throw SystemCallError(call: "af_xdp queue \(queue) (the XSKMAP holds queues 0..<\(FANOUT_XDP_MAX_QUEUES))", errno: E2BIG)
        }
        var key = queue
        var value = UInt32(bitPattern: fd)
        try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_XDP_SOCKETS_NAME) queue \(queue)") { bpf_map_update_elem(sockets, &key, &value, UInt64(BPF_ANY)) }
    }

    /// Removes the socket of `queue`: its frames pass to the kernel (counted no_socket).
    func clearSocket(queue: UInt32) {
        var key = queue
        bpf_map_delete_elem(sockets, &key)
    }

    // MARK: counters

    /// Per-CPU summed counters of listener `id` (or the unmatched slot); zeros if the entry
    /// cannot be read.
    func stats(listener id: UInt32) -> (received: UInt64, bytes: UInt64, verdicts: [XDPVerdict: UInt64]) {
        let words = MemoryLayout<fanout_xdp_stats>.stride / 8
        let sums = (try? BPFSupport.perCPUSum(stats, key: id, words: words)) ?? [UInt64](repeating: 0, count: words)
        var verdicts: [XDPVerdict: UInt64] = [:]
        for verdict in XDPVerdict.allCases { verdicts[verdict] = sums[2 + verdict.rawValue] }
        return (sums[0], sums[1], verdicts)
    }

    /// Zeroes a listener id's counters before it is (re)used.
    func resetListener(id: UInt32) {
        let cpus = max(1, Int(libbpf_num_possible_cpus()))
        var values = [UInt64](repeating: 0, count: MemoryLayout<fanout_xdp_stats>.stride / 8 * cpus)
        var key = id
        bpf_map_update_elem(stats, &key, &values, UInt64(BPF_ANY))
    }
}
