// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import BPFSupport
import CLibBPF
import ReusePortLB
import SystemCalls

/// Why the xdp kind's program passed a datagram of its listener to the tc program: the mirror
/// of `enum fanout_xfwd_pass`, with the metric's `reason` label.
enum XDPPassReason: Int, CaseIterable, Sendable {
    case noNeighbour = 0, tooLarge, fragment, pools, noXDPTransmit, checksumPartial

    var label: String {
        switch self {
        case .noNeighbour: return "no_neighbour"
        case .tooLarge: return "too_large"
        case .fragment: return "fragment"
        case .pools: return "pools"
        case .noXDPTransmit: return "no_xdp_xmit"
        case .checksumPartial: return "checksum_partial"
        }
    }
}

/// The xdp kind's XDP program (bpf/xdp_fanout.bpf.c), loaded with the descriptors of a loaded
/// ``TCProgram``'s maps, so both programs read one set of listeners, backends, associations and
/// counters; its own maps are the listener ids it serves, the interfaces it may redirect to and
/// what it passed to tc. Nothing is pinned: closing the descriptors frees it.
final class XDPForwardProgram: LoadedXDPProgram, @unchecked Sendable {  // descriptors only; TCDataplane serializes writes
    let program: Int32
    let served: Int32
    let devices: Int32
    let passed: Int32

    /// Loads the embedded object, each of `tc`'s maps reused under its name.
    init(sharing tc: TCProgram) throws(SystemCallError) {
        let shared: [(String, Int32)] = [
            (FANOUT_MAP_LISTENERS_NAME, tc.listeners), (FANOUT_MAP_SETS_NAME, tc.sets), (FANOUT_MAP_RR_NAME, tc.roundRobin),
            (FANOUT_MAP_FRAGMENTS_NAME, tc.fragments), (FANOUT_MAP_STATS_NAME, tc.stats), (FANOUT_MAP_BACKEND_STATS_NAME, tc.backendStats),
            (FANOUT_MAP_ASSOCIATIONS_NAME, tc.associations), (FANOUT_MAP_LIVE_NAME, tc.liveBackends), (FANOUT_MAP_NAT_NAME, tc.nat),
            (FANOUT_MAP_POOL_SOURCES_NAME, tc.poolSources),
            (FANOUT_MAP_TEMPLATES_NAME, tc.templates), (FANOUT_MAP_TEMPLATE_STATS_NAME, tc.templateStats),
            (FANOUT_MAP_QUIC_CONFIGS_NAME, tc.quicConfigs), (FANOUT_MAP_QUIC_IDS_NAME, tc.quicIDs), (FANOUT_MAP_QUIC_STATS_NAME, tc.quicStats),
            (FANOUT_MAP_RATE_CONFIGS_NAME, tc.rateConfigs), (FANOUT_MAP_RATE_BUCKETS_NAME, tc.rateBuckets),
            (FANOUT_MAP_RATE_ALLOW_NAME, tc.rateAllow), (FANOUT_MAP_RATE_STATS_NAME, tc.rateStats),
            (FANOUT_MAP_AMP_CONFIGS_NAME, tc.ampConfigs), (FANOUT_MAP_AMP_CLIENTS_NAME, tc.ampClients),
            (FANOUT_MAP_CAPTURE_NAME, tc.capture), (FANOUT_MAP_CAPTURE_CONFIGS_NAME, tc.captureConfigs),
            (FANOUT_MAP_CAPTURE_STATS_NAME, tc.captureStats),
            (FANOUT_MAP_ROUTE_STATE_NAME, tc.routeState), (FANOUT_MAP_HOPS_NAME, tc.hops),
        ] + (tc.crypto ? [(FANOUT_MAP_QUIC_KEYS_NAME, tc.quicKeys)] : [])
        // The same build as the tc program's: with the BPF crypto kfuncs, or plain.
        let owned = try loadEmbeddedObject(
            tc.crypto ? .xdpFanout : .xdpFanoutPlain, program: FANOUT_PROG_XFWD_NAME,
            maps: [FANOUT_MAP_XFWD_IDS_NAME, FANOUT_MAP_XFWD_DEVICES_NAME, FANOUT_MAP_XFWD_PASSED_NAME],
            prepare: { object throws(SystemCallError) in
                for (name, fd) in shared {
                    guard let map = bpf_object__find_map_by_name(object, name) else {
                        throw SystemCallError(call: "xdp_fanout has no map \(name)", errno: ENOENT)
                    }
                    _ = try libbpfCall("bpf_map__reuse_fd \(name)") { bpf_map__reuse_fd(map, fd) }
                }
            })
        (program, served, devices, passed) = (owned[0], owned[1], owned[2], owned[3])
    }

    func closeDescriptors() {
        for fd in [program, served, devices, passed] { close(fd) }
    }


    /// Marks listener `id` served at XDP (its counters of passes zeroed first) or not.
    func serve(id: UInt32, _ serving: Bool) throws(SystemCallError) {
        if serving {
            var zeros = [UInt64](repeating: 0, count: Int(FANOUT_XFWD_PASS_COUNT.rawValue) * max(1, Int(libbpf_num_possible_cpus())))
            var key = id
            _ = try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_XFWD_PASSED_NAME)") { bpf_map_update_elem(passed, &key, &zeros, UInt64(BPF_ANY)) }
        }
        var key = id
        var value: UInt32 = serving ? 1 : 0
        _ = try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_XFWD_IDS_NAME)") { bpf_map_update_elem(served, &key, &value, UInt64(BPF_ANY)) }
    }

    /// What the program passed to tc for listener `id` (FANOUT_UNMATCHED_STATS: a later fragment
    /// no listener could be known for), by ``XDPPassReason``; nil if the map cannot be read.
    func passedCounts(id: UInt32) -> [UInt64]? {
        try? perCPUSum(passed, key: id, words: Int(FANOUT_XFWD_PASS_COUNT.rawValue))
    }

    /// Lets the program redirect to interface `ifindex` (or no longer).
    func setDevice(_ ifindex: UInt32, present: Bool) throws(SystemCallError) {
        var key = ifindex
        if present {
            var value = ifindex
            _ = try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_XFWD_DEVICES_NAME)") { bpf_map_update_elem(devices, &key, &value, UInt64(BPF_ANY)) }
        } else {
            bpf_map_delete_elem(devices, &key)
        }
    }
}
