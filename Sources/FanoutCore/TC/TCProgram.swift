// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import BPFSupport
import CLibBPF
import CSystemShim
import ReusePortLB
import Synchronization
import SystemCalls

/// The loaded tc_ebpf program and its maps: one per daemon, shared by every tc_ebpf listener
/// and interface. Nothing is pinned: closing the descriptors (or the process ending) frees it.
final class TCProgram: @unchecked Sendable {  // descriptors only; callers serialize writes
    let program: Int32
    let listeners: Int32
    let sets: Int32
    let roundRobin: Int32
    let fragments: Int32
    let stats: Int32
    let backendStats: Int32
    /// Two-way (`replies: nat`) maps: the array of per-listener association maps, the live
    /// backends, and each listener's address (the source of its replies).
    let associations: Int32
    let liveBackends: Int32
    let nat: Int32
    /// Replication pools' `sources` (an LPM trie keyed by pool id * 2 + generation and address).
    let poolSources: Int32
    /// flow_templates: the ring buffer of template-bearing datagrams and their per-CPU counters
    /// by listener id (not handed to the next process).
    let templates: Int32
    let templateStats: Int32
    /// quic_lb (bpf/include/fanout_quic.h): configurations by set key, the sets' server IDs, the
    /// keys (kernel crypto contexts), and the outcomes by listener id (not handed over).
    let quicConfigs: Int32
    let quicIDs: Int32
    let quicKeys: Int32
    let quicStats: Int32
    /// The syscall program that puts keys into ``quicKeys`` (bpf/fanout_quic_keys.bpf.c).
    /// Both -1 in the build without crypto (``crypto`` false).
    let quicKeyProgram: Int32
    /// rate_limit (bpf/include/fanout_rate.h): configurations by listener id, the array of
    /// per-listener bucket maps, the `allow` prefixes and the per-CPU counters (this process's
    /// own: not handed over).
    let rateConfigs: Int32
    let rateBuckets: Int32
    let rateAllow: Int32
    let rateStats: Int32
    /// amplification (nat listeners): configurations by listener id and the array of
    /// per-listener client maps (this process's own too).
    let ampConfigs: Int32
    let ampClients: Int32
    /// `udp-fanout capture` (bpf/include/fanout_capture.h): the ring buffer of dropped packets,
    /// each listener's capture filter and sampling, and per-CPU counters (this process's own).
    let capture: Int32
    let captureConfigs: Int32
    let captureStats: Int32
    /// The next-hop cache (bpf/include/fanout_hops.h): the route generation the daemon writes
    /// (``TCRouteWatch``) and the per-CPU answers (this process's own: each starts with it off).
    let routeState: Int32
    let hops: Int32
    /// The program decrypts QUIC-LB connection IDs with the kernel's BPF crypto kfuncs: the
    /// build with them (tc_fanout.bpf.c) where the kernel has them, else the plain one
    /// (tc_fanout_plain.bpf.c: its key map's kptr type would not exist in the kernel).
    let crypto: Bool
    let cpus: Int
    /// What the kernel's helpers accept, as handed to the program (its read-only options).
    let features: TCKernelFeatures

    private var descriptors: [Int32] { [program, listeners, sets, roundRobin, fragments, stats, backendStats, associations, liveBackends, nat, poolSources, quicConfigs, quicIDs, quicKeys, templates, templateStats, quicStats, rateConfigs, rateBuckets, rateAllow, rateStats, ampConfigs, ampClients, capture, captureConfigs, captureStats, routeState, hops, quicKeyProgram].filter { $0 >= 0 } }

    /// The maps a restarted daemon takes over (every map but the per-CPU scratch), in the order
    /// of ``mapDescriptors``.
    static let mapNames = [FANOUT_MAP_LISTENERS_NAME, FANOUT_MAP_SETS_NAME, FANOUT_MAP_RR_NAME, FANOUT_MAP_FRAGMENTS_NAME,
                           FANOUT_MAP_STATS_NAME, FANOUT_MAP_BACKEND_STATS_NAME, FANOUT_MAP_ASSOCIATIONS_NAME, FANOUT_MAP_LIVE_NAME,
                           FANOUT_MAP_NAT_NAME, FANOUT_MAP_POOL_SOURCES_NAME]

    /// The maps' descriptors, in ``mapNames`` order.
    var mapDescriptors: [Int32] { Array(descriptors[1...Self.mapNames.count]) }

    /// Maps handed over with ``mapNames`` when the previous process had them, made anew when it
    /// did not (a release before quic_lb in the kernel had no quic_lb listener there): the
    /// layout of the others stays, so such an upgrade keeps them.
    static let optionalMapNames = [FANOUT_MAP_QUIC_CONFIGS_NAME, FANOUT_MAP_QUIC_IDS_NAME, FANOUT_MAP_QUIC_KEYS_NAME]

    /// The maps handed to the next process: ``mapNames`` and those of ``optionalMapNames`` this
    /// build has, by name.
    var handedOverMaps: [(name: String, fd: Int32)] {
        Array(zip(Self.mapNames, mapDescriptors)) + [(FANOUT_MAP_QUIC_CONFIGS_NAME, quicConfigs), (FANOUT_MAP_QUIC_IDS_NAME, quicIDs)]
            + (crypto ? [(FANOUT_MAP_QUIC_KEYS_NAME, quicKeys)] : [])
    }

    /// The maps that start anew with each process: flow_templates' ring buffer and counters,
    /// quic_lb's outcomes, and rate_limit's state (a restart starts every source with a full
    /// bucket; the listener entries' FANOUT_LISTENER_RATE finds no configuration until the new
    /// process wrote it, and limits nothing meanwhile).
    static let ownMapNames = [FANOUT_MAP_TEMPLATES_NAME, FANOUT_MAP_TEMPLATE_STATS_NAME, FANOUT_MAP_QUIC_STATS_NAME,
                              FANOUT_MAP_RATE_CONFIGS_NAME, FANOUT_MAP_RATE_BUCKETS_NAME, FANOUT_MAP_RATE_ALLOW_NAME, FANOUT_MAP_RATE_STATS_NAME,
                              FANOUT_MAP_AMP_CONFIGS_NAME, FANOUT_MAP_AMP_CLIENTS_NAME,
                              FANOUT_MAP_CAPTURE_NAME, FANOUT_MAP_CAPTURE_CONFIGS_NAME, FANOUT_MAP_CAPTURE_STATS_NAME,
                              FANOUT_MAP_ROUTE_STATE_NAME, FANOUT_MAP_HOPS_NAME]

    /// Loads the embedded object with its read-only options set for `features` (probed on this
    /// kernel unless given). Errors name the failing call and errno.
    /// - Parameter reusing: maps of a previous process's program by name (``mapNames``), used
    ///   instead of new ones (bpf_map__reuse_fd; the load fails if one does not fit: type, key,
    ///   value or size). The caller still owns and closes these descriptors.
    /// - Parameter crypto: load the build with the BPF crypto kfuncs (the default where the
    ///   kernel has them).
    init(features: TCKernelFeatures = .probe(), reusing: [String: Int32] = [:],
         crypto: Bool = TCKernelFeatures.quicCryptoProblem == nil) throws(SystemCallError) {
        self.features = features
        self.crypto = crypto
        var options = fanout_tc_options()
        options.ipv6_csum_flags = features.ipv6ChecksumFlag ? UInt64(BPF_F_IPV6) : 0
        let optional = crypto ? Self.optionalMapNames : Self.optionalMapNames.filter { $0 != FANOUT_MAP_QUIC_KEYS_NAME }
        let owned = try loadEmbeddedObject(
            crypto ? .tcFanout : .tcFanoutPlain, program: FANOUT_PROG_TC_NAME,
            maps: Self.mapNames + optional + Self.ownMapNames,
            prepare: { object throws(SystemCallError) in
                try setReadOnlyGlobal(object, options, objectName: "tc_fanout", global: FANOUT_OPTIONS_NAME, type: "struct fanout_tc_options")
                for (name, fd) in reusing.sorted(by: { $0.key < $1.key }) {
                    guard let map = bpf_object__find_map_by_name(object, name) else {
                        // The key map of a build with crypto: this one has none (no key in force
                        // can be used here; validation refuses keys on this kernel).
                        if Self.optionalMapNames.contains(name) { continue }
                        throw SystemCallError(call: "bpf_object__find_map_by_name \(name) (a map handed over that this program does not have)", errno: ENOENT)
                    }
                    if let misfit = Self.misfit(map, fd) {
                        throw SystemCallError(call: "map \(name) handed over: \(misfit)", errno: EINVAL)
                    }
                    try libbpfCall("bpf_map__reuse_fd \(name)") { bpf_map__reuse_fd(map, fd) }
                }
            })
        (program, listeners, sets, roundRobin, fragments, stats, backendStats) = (owned[0], owned[1], owned[2], owned[3], owned[4], owned[5], owned[6])
        (associations, liveBackends, nat, poolSources) = (owned[7], owned[8], owned[9], owned[10])
        (quicConfigs, quicIDs) = (owned[11], owned[12])
        let own = crypto ? 14 : 13
        (templates, templateStats, quicStats) = (owned[own], owned[own + 1], owned[own + 2])
        (rateConfigs, rateBuckets, rateAllow, rateStats) = (owned[own + 3], owned[own + 4], owned[own + 5], owned[own + 6])
        (ampConfigs, ampClients) = (owned[own + 7], owned[own + 8])
        (capture, captureConfigs, captureStats) = (owned[own + 9], owned[own + 10], owned[own + 11])
        (routeState, hops) = (owned[own + 12], owned[own + 13])
        guard crypto else {
            (quicKeys, quicKeyProgram) = (-1, -1)
            cpus = max(1, Int(libbpf_num_possible_cpus()))
            return
        }
        quicKeys = owned[13]
        let keyMap = owned[13]
        do throws(SystemCallError) {
            let keys = try loadEmbeddedObject(.quicKeys, program: FANOUT_PROG_QUIC_KEYS_NAME, maps: [], prepare: { object throws(SystemCallError) in
                guard let map = bpf_object__find_map_by_name(object, FANOUT_MAP_QUIC_KEYS_NAME) else {
                    throw SystemCallError(call: "fanout_quic_keys has no map \(FANOUT_MAP_QUIC_KEYS_NAME)", errno: ENOENT)
                }
                try libbpfCall("bpf_map__reuse_fd \(FANOUT_MAP_QUIC_KEYS_NAME)") { bpf_map__reuse_fd(map, keyMap) }
            })
            quicKeyProgram = keys[0]
        } catch {
            for fd in owned { close(fd) }
            throw error
        }
        cpus = max(1, Int(libbpf_num_possible_cpus()))
    }

    /// How a handed-over map differs from the object's definition of it (type, key and value
    /// size, entries, flags), nil when it fits. bpf_map__reuse_fd takes the handed-over map's
    /// definition as it is, so a program whose map changed without `FANOUT_MAPS_LAYOUT` raised
    /// would otherwise run on a map of another shape.
    static func misfit(_ map: OpaquePointer, _ fd: Int32) -> String? {
        var info = bpf_map_info()
        var length = UInt32(MemoryLayout<bpf_map_info>.size)
        guard bpf_obj_get_info_by_fd(fd, &info, &length) == 0 else { return "its information cannot be read (errno \(errno))" }
        let pairs: [(String, UInt32, UInt32)] = [
            ("type", info.type, bpf_map__type(map).rawValue), ("key size", info.key_size, bpf_map__key_size(map)),
            ("value size", info.value_size, bpf_map__value_size(map)), ("entries", info.max_entries, bpf_map__max_entries(map)),
            ("flags", info.map_flags, bpf_map__map_flags(map)),
        ]
        let differences = pairs.filter { $0.1 != $0.2 }.map { "\($0.0) \($0.1), this program's \($0.2)" }
        return differences.isEmpty ? nil : differences.joined(separator: "; ")
    }

    func closeDescriptors() {
        for fd in descriptors { close(fd) }
        counter.withLock { $0 = .closed }  // the iterator's program and link close with it
    }

    /// The kernel's id of the loaded program (what `bpftool prog` and `tc filter show` print).
    var programID: UInt32 {
        var info = bpf_prog_info()
        var length = UInt32(MemoryLayout<bpf_prog_info>.size)
        return bpf_obj_get_info_by_fd(program, &info, &length) == 0 ? info.id : 0
    }

    // MARK: listeners and backend sets

    /// The listeners map key: a bind matches only on its listener's interface.
    static func listenerKey(_ bind: SocketAddress, ifindex: UInt32) -> fanout_listener_key {
        var key = fanout_listener_key()
        key.ifindex = ifindex
        key.family = UInt8(bind.ip.family)
        key.port = bind.port.bigEndian
        key.addr = bind.ip.words
        return key
    }

    func putListener(_ bind: SocketAddress, ifindex: UInt32, _ value: fanout_listener) throws(SystemCallError) {
        var key = Self.listenerKey(bind, ifindex: ifindex)
        var value = value
        try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_LISTENERS_NAME)") { bpf_map_update_elem(listeners, &key, &value, UInt64(BPF_ANY)) }
    }

    /// Deletes listener `id`'s entry for `bind` at `ifindex`; an entry another listener wrote
    /// over it (a reload's successor on the same bind) is left alone.
    func removeListener(_ bind: SocketAddress, ifindex: UInt32, id: UInt32) {
        var key = Self.listenerKey(bind, ifindex: ifindex)
        var value = fanout_listener()
        guard bpf_map_lookup_elem(listeners, &key, &value) == 0, value.id == id else { return }
        bpf_map_delete_elem(listeners, &key)
    }

    /// Writes one generation of a listener's backend set.
    func writeSet(id: UInt32, generation: UInt32, _ set: BackendSet) throws(SystemCallError) {
        var key = id * 2 + generation
        let size = MemoryLayout<fanout_set>.size
        let buffer = UnsafeMutableRawPointer.allocate(byteCount: size, alignment: 8)
        defer { buffer.deallocate() }
        buffer.initializeMemory(as: UInt8.self, repeating: 0, count: size)
        buffer.storeBytes(of: UInt32(set.backends.count), toByteOffset: MemoryLayout<fanout_set>.offset(of: \.count)!, as: UInt32.self)
        buffer.storeBytes(of: UInt32(set.rotation.count), toByteOffset: MemoryLayout<fanout_set>.offset(of: \.rotation_len)!, as: UInt32.self)
        buffer.storeBytes(of: UInt32(set.table.count), toByteOffset: MemoryLayout<fanout_set>.offset(of: \.table_size)!, as: UInt32.self)
        buffer.storeBytes(of: set.seed, toByteOffset: MemoryLayout<fanout_set>.offset(of: \.seed)!, as: UInt32.self)
        let backends = MemoryLayout<fanout_set>.offset(of: \.backends)!
        for (index, backend) in set.backends.enumerated() {
            buffer.storeBytes(of: backend, toByteOffset: backends + index * MemoryLayout<fanout_backend>.stride, as: fanout_backend.self)
        }
        let rotation = MemoryLayout<fanout_set>.offset(of: \.rotation)!
        for (index, entry) in set.rotation.enumerated() {
            buffer.storeBytes(of: entry, toByteOffset: rotation + index * 2, as: UInt16.self)
        }
        // Swift does not import an array this long as a tuple: the table follows the rotation.
        let table = rotation + Int(FANOUT_ROTATION_MAX) * 2
        precondition(table + Int(FANOUT_TABLE_SIZE) * 2 <= size, "fanout_set layout")
        for (index, entry) in set.table.enumerated() {
            buffer.storeBytes(of: entry, toByteOffset: table + index * 2, as: UInt16.self)
        }
        try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_SETS_NAME)") { bpf_map_update_elem(sets, &key, buffer, UInt64(BPF_ANY)) }
    }

    // MARK: quic_lb

    /// Writes the quic_lb configurations of set `setKey` (id * 2 + generation): each one's
    /// layout under its config ID, the others empty.
    func writeQUICConfigs(setKey: UInt32, _ configurations: [QUICLBConfiguration]) throws(SystemCallError) {
        var value = fanout_quic_configs()
        withUnsafeMutableBytes(of: &value.configs) { raw in
            for configuration in configurations {
                var entry = fanout_quic_config()
                entry.server_id_length = UInt8(configuration.serverIDLength)
                entry.nonce_length = UInt8(configuration.nonceLength)
                entry.cipher = UInt8(!configuration.isEncrypted ? FANOUT_QUIC_PLAINTEXT : configuration.plaintextLength == 16 ? FANOUT_QUIC_SINGLE_PASS : FANOUT_QUIC_FOUR_PASS)
                raw.storeBytes(of: entry, toByteOffset: Int(configuration.configID) * MemoryLayout<fanout_quic_config>.stride, as: fanout_quic_config.self)
            }
        }
        var key = setKey
        try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_QUIC_CONFIGS_NAME)") { bpf_map_update_elem(quicConfigs, &key, &value, UInt64(BPF_ANY)) }
    }

    static func quicIDKey(setKey: UInt32, _ serverID: [UInt8]) -> fanout_quic_id_key {
        var key = fanout_quic_id_key()
        key.set = setKey
        withUnsafeMutableBytes(of: &key.server_id) { raw in
            for (index, octet) in serverID.prefix(16).enumerated() { raw[index] = octet }
        }
        return key
    }

    /// Server ID `serverID` belongs to the backend at `index` in set `setKey`.
    func putQUICID(setKey: UInt32, _ serverID: [UInt8], index: UInt32) throws(SystemCallError) {
        var key = Self.quicIDKey(setKey: setKey, serverID)
        var value = index
        try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_QUIC_IDS_NAME)") { bpf_map_update_elem(quicIDs, &key, &value, UInt64(BPF_ANY)) }
    }

    /// Takes server ID `serverID` of set `setKey` out.
    func deleteQUICID(setKey: UInt32, _ serverID: [UInt8]) {
        var key = Self.quicIDKey(setKey: setKey, serverID)
        bpf_map_delete_elem(quicIDs, &key)
    }

    /// Takes every server ID of set `setKey` out (what an earlier change wrote there).
    func clearQUICIDs(setKey: UInt32) {
        var doomed: [fanout_quic_id_key] = []
        var current: fanout_quic_id_key?
        while true {
            var next = fanout_quic_id_key()
            let found: Int32
            if var previous = current {
                found = bpf_map_get_next_key(quicIDs, &previous, &next)
            } else {
                found = bpf_map_get_next_key(quicIDs, nil, &next)
            }
            guard found == 0 else { break }
            if next.set == setKey { doomed.append(next) }
            current = next
        }
        for var entry in doomed { bpf_map_delete_elem(quicIDs, &entry) }
    }

    /// Puts `key` (16 octets; nil: none) under `slot` (set key * FANOUT_QUIC_CONFIGS + config ID)
    /// through the key program: the kernel makes an ecb(aes) context of it. Fails with the
    /// kernel's errno (no BPF crypto kfuncs: EOPNOTSUPP; no ecb(aes): ENOENT).
    func setQUICKey(slot: UInt32, _ key: [UInt8]?) throws(SystemCallError) {
        guard crypto else {
            if key == nil { return }
            throw SystemCallError(call: "a quic_lb key in the kernel (the program without BPF crypto kfuncs is loaded: \(TCKernelFeatures.quicCryptoProblem ?? "the one with them did not load"))", errno: EOPNOTSUPP)
        }
        var args = fanout_quic_key_args()
        args.slot = slot
        args.clear = key == nil ? 1 : 0
        if let key {
            withUnsafeMutableBytes(of: &args.key) { raw in
                for (index, octet) in key.prefix(16).enumerated() { raw[index] = octet }
            }
        }
        let (result, retval) = withUnsafeMutableBytes(of: &args) { raw in
            withLibbpfOptions(bpf_test_run_opts.self) { options in
                options.pointee.ctx_in = UnsafeRawPointer(raw.baseAddress)
                options.pointee.ctx_size_in = UInt32(raw.count)
                return (bpf_prog_test_run_opts(quicKeyProgram, options), Int32(bitPattern: options.pointee.retval))
            }
        }
        if result != 0 { throw SystemCallError(call: "BPF_PROG_TEST_RUN \(FANOUT_PROG_QUIC_KEYS_NAME)", errno: result == -1 ? errno : -result) }
        if retval != 0 { throw SystemCallError(call: "bpf_crypto_ctx_create ecb(aes) for a quic_lb key", errno: -retval) }
    }

    /// Takes set `setKey`'s quic_lb state out: its configurations, server IDs, and the keys in
    /// `keySlots` (nil: every config ID's; a kernel without the crypto kfuncs has none to take).
    func clearQUIC(setKey: UInt32, keySlots: [UInt32]?) {
        var key = setKey
        var empty = fanout_quic_configs()
        bpf_map_update_elem(quicConfigs, &key, &empty, UInt64(BPF_ANY))
        clearQUICIDs(setKey: setKey)
        for slot in keySlots ?? (0..<UInt32(FANOUT_QUIC_CONFIGS)).map({ setKey * UInt32(FANOUT_QUIC_CONFIGS) + $0 }) {
            try? setQUICKey(slot: slot, nil)
        }
    }

    /// Listener `id`'s quic_lb outcomes (routed, fallback, unknown server ID, undecodable) as the
    /// program counted them, summed over the CPUs.
    func quicCounts(id: UInt32) -> [UInt64] {
        perCPUSum(quicStats, key: id, as: fanout_quic_stats.self)
    }

    // MARK: rate_limit

    /// Puts listener `id`'s `rate_limit` in force: its bucket map (an LRU hash of `max_sources`,
    /// made here and put in the array), its `allow` prefixes, then its configuration. Returns
    /// the bucket map's descriptor (the caller reads /status's top sources with it and closes it).
    func putRateLimit(id: UInt32, _ limit: RateLimit) throws(SystemCallError) -> Int32 {
        let name = FANOUT_RATE_BUCKETS_PREFIX + "\(id)"
        let fd = try libbpfCall("bpf_map_create \(name) (rate_limit.max_sources \(limit.maxSources))") {
            bpf_map_create(BPF_MAP_TYPE_LRU_HASH, name, UInt32(MemoryLayout<fanout_rate_key>.size),
                           UInt32(MemoryLayout<fanout_rate_bucket>.size), UInt32(limit.maxSources), nil)
        }
        do throws(SystemCallError) {
            var key = id
            var value = UInt32(fd)
            try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_RATE_BUCKETS_NAME)") { bpf_map_update_elem(rateBuckets, &key, &value, UInt64(BPF_ANY)) }
            for prefix in limit.allow {
                var allow = Self.allowKey(id: id, prefix)
                var present: UInt8 = 1
                try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_RATE_ALLOW_NAME) \(prefix)") { bpf_map_update_elem(rateAllow, &allow, &present, UInt64(BPF_ANY)) }
            }
            var config = Self.rateConfig(limit)
            try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_RATE_CONFIGS_NAME)") { bpf_map_update_elem(rateConfigs, &key, &config, UInt64(BPF_ANY)) }
        } catch {
            clearRateLimit(id: id, allow: limit.allow)
            close(fd)
            throw error
        }
        return fd
    }

    /// Takes listener `id`'s rate_limit out: its configuration (the program then limits nothing
    /// for it), its bucket map from the array, and its `allow` prefixes.
    func clearRateLimit(id: UInt32, allow: [SourcePrefix]) {
        var key = id
        var empty = fanout_rate_config()
        bpf_map_update_elem(rateConfigs, &key, &empty, UInt64(BPF_ANY))
        bpf_map_delete_elem(rateBuckets, &key)
        for prefix in allow {
            var allowKey = Self.allowKey(id: id, prefix)
            bpf_map_delete_elem(rateAllow, &allowKey)
        }
    }

    static func allowKey(id: UInt32, _ prefix: SourcePrefix) -> fanout_rate_allow_key {
        var key = fanout_rate_allow_key()
        key.listener = id
        var bytes = prefix.address.bytes
        var length = prefix.length
        if bytes.count == 4 {
            bytes = [UInt8](repeating: 0, count: 10) + [0xff, 0xff] + bytes
            length += 96
        }
        key.prefixlen = UInt32(32 + length)
        withUnsafeMutableBytes(of: &key.addr) { $0.copyBytes(from: bytes) }
        return key
    }

    /// The program's form of `limit` (fanout_rate_config: GCRA intervals and tolerances in
    /// nanoseconds, prefix masks in network order).
    static func rateConfig(_ limit: RateLimit) -> fanout_rate_config {
        var config = fanout_rate_config()
        // As SourceRateLimiter's: intervals rounded up (never a faster rate than configured), and
        // tolerances that hold exactly the burst at that cost.
        if let rate = limit.datagramsPerSecond {
            (config.datagram_interval, config.datagram_tolerance) = SourceRateLimiter.Limit.tolerance(perSecond: rate, burst: limit.burstDatagrams, bytes: false)
        }
        if let rate = limit.bytesPerSecond {
            config.bytes_per_second = rate
            config.byte_tolerance = SourceRateLimiter.Limit.tolerance(perSecond: rate, burst: limit.burstBytes, bytes: true).nanoseconds
        }
        if let rate = limit.newSourcesPerSecond {
            (config.new_source_interval, config.new_source_tolerance) = SourceRateLimiter.Limit.tolerance(perSecond: rate, burst: limit.burstNewSources, bytes: false)
        }
        config.ipv4_mask = (UInt32.max << (32 - limit.ipv4PrefixLength)).bigEndian
        var words: [UInt32] = []
        for word in 0..<4 {
            let bits = min(max(limit.ipv6PrefixLength - 32 * word, 0), 32)
            words.append(bits == 0 ? 0 : (UInt32.max << (32 - bits)).bigEndian)
        }
        config.ipv6_mask = (words[0], words[1], words[2], words[3])
        config.has_allow = limit.allow.isEmpty ? 0 : 1
        return config
    }

    /// Listener `id`'s rate_limit drops as the program counted them (summed over the CPUs):
    /// above a source's rates, their bytes, and new sources above the ceiling; and the replies
    /// amplification dropped, with their bytes.
    func rateCounts(id: UInt32) -> (limited: UInt64, bytes: UInt64, newSources: UInt64, capped: UInt64, cappedBytes: UInt64) {
        let sums = perCPUSum(rateStats, key: id, as: fanout_rate_stats.self)
        guard sums.count >= 5 else { return (0, 0, 0, 0, 0) }
        return (sums[0], sums[1], sums[2], sums[3], sums[4])
    }

    /// Listener `id`'s capture counts as the programs counted them (summed over the CPUs): taken,
    /// above the capture's sampling rate, lost to a full ring buffer, unreadable.
    func captureCounts(id: UInt32) -> (captured: UInt64, sampledOut: UInt64, ringFull: UInt64, unreadable: UInt64) {
        let sums = perCPUSum(captureStats, key: id, as: fanout_capture_stats.self)
        guard sums.count >= 4 else { return (0, 0, 0, 0) }
        return (sums[0], sums[1], sums[2], sums[3])
    }

    /// Puts nat listener `id`'s `amplification` in force: its client map (an LRU hash of
    /// `maxEntries`, made here and put in the array), then its configuration. Returns the map's
    /// descriptor (the caller closes it).
    func putAmplification(id: UInt32, _ cap: Amplification, maxEntries: Int) throws(SystemCallError) -> Int32 {
        let name = FANOUT_AMP_CLIENTS_PREFIX + "\(id)"
        let fd = try libbpfCall("bpf_map_create \(name) (settings.max_associations \(maxEntries))") {
            bpf_map_create(BPF_MAP_TYPE_LRU_HASH, name, UInt32(MemoryLayout<fanout_amp_key>.size),
                           UInt32(MemoryLayout<fanout_amp_client>.size), UInt32(maxEntries), nil)
        }
        do throws(SystemCallError) {
            var key = id
            var value = UInt32(fd)
            try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_AMP_CLIENTS_NAME)") { bpf_map_update_elem(ampClients, &key, &value, UInt64(BPF_ANY)) }
            var config = fanout_amp_config(factor: UInt32(cap.factor), validated_after: UInt32(cap.validatedAfter))
            try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_AMP_CONFIGS_NAME)") { bpf_map_update_elem(ampConfigs, &key, &config, UInt64(BPF_ANY)) }
        } catch {
            clearAmplification(id: id)
            close(fd)
            throw error
        }
        return fd
    }

    /// Takes listener `id`'s amplification cap out (its configuration, then its client map).
    func clearAmplification(id: UInt32) {
        var key = id
        var empty = fanout_amp_config()
        bpf_map_update_elem(ampConfigs, &key, &empty, UInt64(BPF_ANY))
        bpf_map_delete_elem(ampClients, &key)
    }

    /// The sources of bucket map `fd` with the most datagrams dropped, most first (at most `count`).
    /// At most `maxEntries` × 2 steps, and never more than ``topLimitedSteps``: under a flood the
    /// LRU map evicts the key a walk stands on, and the kernel then starts the walk again from the
    /// first key (the top is then of what the walk saw).
    static func topLimited(_ fd: Int32, ipv4Length: Int, ipv6Length: Int, count: Int, maxEntries: Int) -> [LimitedSource] {
        let maxEntries = min(maxEntries, topLimitedSteps / 2)
        var found: [(fanout_rate_key, UInt64)] = []
        var key = fanout_rate_key()
        var next = fanout_rate_key()
        var first = true
        var steps = 0
        while steps < 2 * maxEntries,
              withUnsafeMutablePointer(to: &key, { current in bpf_map_get_next_key(fd, first ? nil : UnsafeRawPointer(current), &next) }) == 0 {
            first = false
            steps += 1
            key = next
            var bucket = fanout_rate_bucket()
            guard bpf_map_lookup_elem(fd, &key, &bucket) == 0, bucket.limited > 0 else { continue }
            // Only the top `count` are kept (a walk restarted meets a key twice: kept once).
            if let seen = found.firstIndex(where: { Self.sameKey($0.0, key) }) {
                found[seen].1 = max(found[seen].1, bucket.limited)
            } else if found.count < count {
                found.append((key, bucket.limited))
            } else if let least = found.indices.min(by: { found[$0].1 < found[$1].1 }), found[least].1 < bucket.limited {
                found[least] = (key, bucket.limited)
            }
        }
        found.sort { $0.1 > $1.1 }
        return found.map { key, limited in
            var words = key.addr
            let octets = withUnsafeBytes(of: &words) { Array($0) }
            return LimitedSource(prefix: SourceRateLimiter.prefix(octets, ipv4Length: ipv4Length, ipv6Length: ipv6Length), limited: limited)
        }
    }

    /// The most map steps one /status reading takes (two system calls each: about 0.1 s).
    static let topLimitedSteps = 100_000

    static func sameKey(_ a: fanout_rate_key, _ b: fanout_rate_key) -> Bool {
        a.addr.0 == b.addr.0 && a.addr.1 == b.addr.1 && a.addr.2 == b.addr.2 && a.addr.3 == b.addr.3
    }

    // MARK: counters

    /// Sums a per-CPU entry of `type` (all fields u64) over the CPUs, field by field; zeros if
    /// the entry cannot be read.
    func perCPUSum<T>(_ fd: Int32, key: UInt32, as type: T.Type) -> [UInt64] {
        let words = MemoryLayout<T>.stride / 8
        return (try? BPFSupport.perCPUSum(fd, key: key, words: words)) ?? [UInt64](repeating: 0, count: words)
    }

    /// Zeroes a per-CPU entry (a listener id or backend slot about to be reused).
    func zeroPerCPU<T>(_ fd: Int32, key: UInt32, as type: T.Type) {
        var values = [UInt64](repeating: 0, count: MemoryLayout<T>.stride / 8 * cpus)
        var key = key
        bpf_map_update_elem(fd, &key, &values, UInt64(BPF_ANY))
    }

    /// One listener's counters: received, bytes received, bytes forwarded, then each verdict.
    /// flow_templates: listener `id`'s template-bearing datagrams as the program counted them
    /// (struct fanout_template_stats, summed over the CPUs).
    func templateCounts(id: UInt32) -> (captured: UInt64, tooLarge: UInt64, ringFull: UInt64, fragmented: UInt64, setsUnread: UInt64) {
        let sums = perCPUSum(templateStats, key: id, as: fanout_template_stats.self)
        guard sums.count >= 5 else { return (0, 0, 0, 0, 0) }
        return (sums[0], sums[1], sums[2], sums[3], sums[4])
    }

    func listenerStats(id: UInt32) -> (received: UInt64, bytesReceived: UInt64, bytesForwarded: UInt64, verdicts: [UInt64]) {
        let words = perCPUSum(stats, key: id, as: fanout_stats.self)
        return (words[0], words[1], words[2], Array(words[3..<(3 + Int(FANOUT_VERDICT_COUNT.rawValue))]))
    }

    /// One backend slot's counters: forwarded packets and bytes, its drops by reason, and (nat
    /// listeners) its replies.
    func backendStats(id: UInt32, slot: UInt16) -> (packets: UInt64, bytes: UInt64, noRoute: UInt64, tooLarge: UInt64, replies: UInt64, replyBytes: UInt64) {
        let words = perCPUSum(backendStats, key: id * UInt32(FANOUT_MAX_BACKENDS) + UInt32(slot), as: fanout_backend_stats.self)
        return (words[0], words[1], words[2], words[3], words[4], words[5])
    }

    /// A replication pool's counters at its id (see struct fanout_stats and fanout_pools.h): the
    /// datagrams offered, each verdict, sampled out and filtered out.
    func poolStats(id: UInt32) -> (received: UInt64, verdicts: [UInt64], sampledOut: UInt64, filteredOut: UInt64) {
        let words = perCPUSum(stats, key: id, as: fanout_stats.self)
        let count = Int(FANOUT_VERDICT_COUNT.rawValue)
        let after = 3 + 2 * count + 4
        return (words[0], Array(words[3..<(3 + count)]), words[after], words[after + 1])
    }

    /// A pool member's counters: copies sent and their bytes, and copies dropped by reason
    /// (`no_route`, `too_large`, `no_neighbour`, `rewrite_failed`).
    func memberStats(id: UInt32, slot: UInt16) -> (copies: UInt64, bytes: UInt64, dropped: [String: UInt64]) {
        let words = perCPUSum(backendStats, key: id * UInt32(FANOUT_MAX_BACKENDS) + UInt32(slot), as: fanout_backend_stats.self)
        return (words[0], words[1], ["no_route": words[2], "too_large": words[3], "no_neighbour": words[6], "rewrite_failed": words[7]])
    }

    /// Takes every prefix under `key` (a pool's id * 2 + generation) out of the sources map,
    /// whatever wrote it (a change that failed half way included).
    func clearPoolSources(key: UInt32) {
        var stale: [fanout_pool_source_key] = []
        var current = fanout_pool_source_key()
        var next = fanout_pool_source_key()
        var first = true
        while (first ? bpf_map_get_next_key(poolSources, nil, &next) : bpf_map_get_next_key(poolSources, &current, &next)) == 0 {
            first = false
            if next.pool_id == key { stale.append(next) }
            current = next
        }
        for var entry in stale { bpf_map_delete_elem(poolSources, &entry) }
    }

    /// Puts a pool's `sources` under `key` (its id * 2 + generation).
    func writePoolSources(key: UInt32, _ prefixes: [SourcePrefix]) throws(SystemCallError) {
        for prefix in prefixes {
            var entry = fanout_pool_source_key()
            entry.pool_id = key
            var bytes = [UInt8](repeating: 0, count: 16)
            if prefix.address.family == AF_INET {
                bytes[10] = 0xff
                bytes[11] = 0xff
                bytes.replaceSubrange(12..<16, with: prefix.address.bytes)
                entry.prefixlen = UInt32(32 + 96 + prefix.length)
            } else {
                bytes = prefix.address.bytes
                entry.prefixlen = UInt32(32 + prefix.length)
            }
            withUnsafeMutableBytes(of: &entry.addr) { $0.copyBytes(from: bytes) }
            var value: UInt8 = 1
            try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_POOL_SOURCES_NAME)") { bpf_map_update_elem(poolSources, &entry, &value, UInt64(BPF_ANY)) }
        }
    }

    /// A nat listener's reply-direction counters (see struct fanout_stats).
    struct NATStats {
        /// The reply direction's share of each verdict.
        var replyVerdicts: [UInt64]
        var replyBytes: UInt64
        var created: UInt64
        var serverInitiated: UInt64
        var moved: UInt64

        func verdict(_ value: fanout_verdict) -> UInt64 { replyVerdicts[Int(value.rawValue)] }
    }

    func natStats(id: UInt32) -> NATStats {
        let words = perCPUSum(stats, key: id, as: fanout_stats.self)
        let count = Int(FANOUT_VERDICT_COUNT.rawValue)
        let base = 3 + count
        return NATStats(replyVerdicts: Array(words[base..<(base + count)]), replyBytes: words[base + count],
                        created: words[base + count + 1], serverInitiated: words[base + count + 2], moved: words[base + count + 3])
    }

    // MARK: two-way (replies: nat)

    /// Every entry of hash map `fd` (a get_next_key walk; an entry deleted meanwhile is skipped).
    static func walk<Key, Value>(_ fd: Int32, keys: Key, values: Value) -> [(key: Key, value: Value)] {
        var result: [(Key, Value)] = []
        var current = keys
        var next = keys
        var first = true
        while withUnsafeMutablePointer(to: &current, { bpf_map_get_next_key(fd, first ? nil : $0, &next) }) == 0 {
            first = false
            current = next
            var value = values
            guard bpf_map_lookup_elem(fd, &current, &value) == 0 else { continue }
            result.append((current, value))
        }
        return result
    }

    /// Every listener entry in the maps, by bind and interface index (a previous process's, when
    /// the maps were taken over).
    func listenerEntries() -> [(bind: SocketAddress, ifindex: UInt32, entry: fanout_listener)] {
        Self.walk(listeners, keys: fanout_listener_key(), values: fanout_listener()).map { key, value in
            (Self.socketAddress(key.addr, port: key.port, family: Int32(key.family)), key.ifindex, value)
        }
    }

    /// The counter slot of each backend of generation `generation` of set `id`, by
    /// ``backendKey(_:port:)``.
    func setSlots(id: UInt32, generation: UInt32) -> [String: UInt16] {
        var key = id * 2 + generation
        let size = MemoryLayout<fanout_set>.size
        let buffer = UnsafeMutableRawPointer.allocate(byteCount: size, alignment: 8)
        defer { buffer.deallocate() }
        guard bpf_map_lookup_elem(sets, &key, buffer) == 0 else { return [:] }
        let count = Int(buffer.load(fromByteOffset: MemoryLayout<fanout_set>.offset(of: \.count)!, as: UInt32.self))
        let backends = MemoryLayout<fanout_set>.offset(of: \.backends)!
        var slots: [String: UInt16] = [:]
        for index in 0..<min(count, Int(FANOUT_MAX_BACKENDS)) {
            let backend = buffer.load(fromByteOffset: backends + index * MemoryLayout<fanout_backend>.stride, as: fanout_backend.self)
            slots[Self.backendKey(backend.addr, port: backend.port)] = backend.counter_slot
        }
        return slots
    }

    /// A backend's address words and port (network order) as one key.
    static func backendKey(_ words: (UInt32, UInt32, UInt32, UInt32), port: UInt16) -> String {
        "\(words.0).\(words.1).\(words.2).\(words.3)/\(port)"
    }

    /// Puts an association map a previous process made (handed over) at `id` in the
    /// associations array (where it is already, when the maps were taken over too).
    func putAssociations(id: UInt32, fd: Int32) throws(SystemCallError) {
        var key = id
        var value = UInt32(fd)
        try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_ASSOCIATIONS_NAME)") { bpf_map_update_elem(associations, &key, &value, UInt64(BPF_ANY)) }
    }

    /// Creates a listener's association map (an LRU hash of `maxEntries` clients) and puts it
    /// at `id` in the associations array. Returns its descriptor (the caller closes it).
    func createAssociations(id: UInt32, maxEntries: UInt32) throws(SystemCallError) -> Int32 {
        // The name bpf/map_count.bpf.c counts by.
        let name = FANOUT_ASSOCIATION_MAP_PREFIX + "\(id)"
        let fd = try libbpfCall("bpf_map_create \(name) (max_associations \(maxEntries))") {
            bpf_map_create(BPF_MAP_TYPE_LRU_HASH, name, UInt32(MemoryLayout<fanout_association_key>.size),
                           UInt32(MemoryLayout<fanout_association>.size), maxEntries, nil)
        }
        var key = id
        var value = UInt32(fd)
        do throws(SystemCallError) {
            try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_ASSOCIATIONS_NAME)") { bpf_map_update_elem(associations, &key, &value, UInt64(BPF_ANY)) }
        } catch {
            close(fd)
            throw error
        }
        return fd
    }

    /// Takes a listener's association map out of the array (the kernel frees it once the
    /// caller's descriptor is closed too).
    func removeAssociations(id: UInt32) {
        var key = id
        bpf_map_delete_elem(associations, &key)
    }

    /// Writes (or, with nil, clears) the address a nat listener's replies leave from.
    /// - Parameter quic: the listener routes by QUIC connection ID (FANOUT_NAT_QUIC: a backend
    ///   may answer a client associated with another).
    func putNAT(id: UInt32, bind: SocketAddress?, quic: Bool = false) throws(SystemCallError) {
        var key = id
        var value = fanout_nat()
        if let bind {
            value.addr = bind.ip.words
            value.port = bind.port.bigEndian
            value.family = UInt8(bind.ip.family)
            value.enabled = UInt8(FANOUT_NAT_ENABLED | (quic ? FANOUT_NAT_QUIC : 0))
        }
        try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_NAT_NAME)") { bpf_map_update_elem(nat, &key, &value, UInt64(BPF_ANY)) }
    }

    static func liveKey(_ address: SocketAddress) -> fanout_live_key {
        var key = fanout_live_key()
        key.addr = address.ip.words
        key.port = address.port.bigEndian
        key.family = UInt8(address.ip.family)
        return key
    }

    /// Marks a backend live for a nat listener: its replies are the listener's, its clients stay.
    /// - Parameter state: `FANOUT_LIVE_ACTIVE` (a member of the set), `FANOUT_LIVE_DRAINING` (left
    ///   it: its replies to its clients still leave from the listener's address) or
    ///   `FANOUT_LIVE_GONE` (its drain ended: its datagrams are dropped, counted `drained`).
    func putLive(_ address: SocketAddress, id: UInt32, slot: UInt16, state: Int32 = FANOUT_LIVE_ACTIVE) throws(SystemCallError) {
        try liveWrites.withLock { _ throws(SystemCallError) in try writeLive(address, id: id, slot: slot, state: state) }
    }

    private func writeLive(_ address: SocketAddress, id: UInt32, slot: UInt16, state: Int32) throws(SystemCallError) {
        var key = Self.liveKey(address)
        var value = fanout_live()
        value.listener_id = id
        value.counter_slot = slot
        value.state = UInt8(state)
        try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_LIVE_NAME)") { bpf_map_update_elem(liveBackends, &key, &value, UInt64(BPF_ANY)) }
    }

    /// Serialises the live map's writes: a check of an entry's owner and the write after it
    /// (setLiveState, removeLive) are one step for every listener, whichever thread (a reload, a
    /// drain timer) makes them.
    private let liveWrites = Mutex<Void>(())

    /// Sets the state of a backend listener `id` has in the live map (draining, gone).
    /// - Returns: false if the entry is not listener `id`'s (another listener owns it now, or it
    ///   is not there): nothing written.
    func setLiveState(_ address: SocketAddress, id: UInt32, slot: UInt16, state: Int32) throws(SystemCallError) -> Bool {
        try liveWrites.withLock { _ throws(SystemCallError) in
            var key = Self.liveKey(address)
            var value = fanout_live()
            guard bpf_map_lookup_elem(liveBackends, &key, &value) == 0, value.listener_id == id else { return false }
            try writeLive(address, id: id, slot: slot, state: state)
            return true
        }
    }

    /// A backend no longer live for listener `id`: its clients move on their next datagram. An
    /// entry another listener owns now (a reload that renamed the listener registers the
    /// successor before the predecessor goes) is left alone.
    func removeLive(_ address: SocketAddress, id: UInt32) {
        liveWrites.withLock { _ in
            var key = Self.liveKey(address)
            var value = fanout_live()
            guard bpf_map_lookup_elem(liveBackends, &key, &value) == 0, value.listener_id == id else { return }
            bpf_map_delete_elem(liveBackends, &key)
        }
    }

    /// The backends listener `id` has in the live map, with their counter slots and states.
    func liveEntries(id: UInt32) -> [(address: SocketAddress, slot: UInt16, state: UInt8)] {
        liveWrites.withLock { _ in
            Self.walk(liveBackends, keys: fanout_live_key(), values: fanout_live()).filter { $0.value.listener_id == id }.map { key, value in
                (Self.socketAddress(key.addr, port: key.port, family: Int32(key.family)), value.counter_slot, value.state)
            }
        }
    }

    /// Takes out every live map entry of the listeners `ids` (ids a previous process used that
    /// nothing uses now).
    func removeLive(ids: Set<UInt32>) {
        liveWrites.withLock { _ in
            for (key, value) in Self.walk(liveBackends, keys: fanout_live_key(), values: fanout_live()) where ids.contains(value.listener_id) {
                var key = key
                bpf_map_delete_elem(liveBackends, &key)
            }
        }
    }

    /// How many entries association map `fd` holds: the kernel's own count through
    /// ``AssociationCounter`` (made at the first count; Linux 6.6 and later), else counted with
    /// batched lookups (``associationEntries(_:limit:maximum:)``), never more than `maximum`.
    /// After ``closeDescriptors()`` it makes no counter again.
    func countAssociations(_ fd: Int32, maximum: Int) -> Int {
        let counted: Int? = counter.withLock { state in
            if case .untried = state {
                do throws(SystemCallError) {
                    state = .ready(try AssociationCounter())
                } catch {
                    state = .refused(error)
                }
            }
            guard case .ready(let counter) = state else { return nil }
            do throws(SystemCallError) {
                let id = try AssociationCounter.mapID(fd)
                return try counter.counts()[id]
            } catch {
                // Made, but this count failed (no descriptor left for the iterator, say): counted
                // in batches this time; the first such failure is logged.
                counterFailure.withLock { if $0 == nil { $0 = (error, false) } }
                return nil
            }
        }
        if let counted { return min(counted, maximum) }
        return Self.associationEntries(fd, limit: 0, maximum: maximum).total
    }

    /// ``countAssociations(_:maximum:)``'s iterator: not tried yet, made, refused by the kernel
    /// (why), or the program's descriptors closed.
    enum CounterState {
        case untried, ready(AssociationCounter), refused(SystemCallError), closed
    }
    private let counter = Mutex<CounterState>(.untried)
    private let counterRefusalSaid = Atomic<Bool>(false)
    /// The first count the made iterator failed (error, and whether it was said).
    private let counterFailure = Mutex<(error: SystemCallError, said: Bool)?>(nil)

    /// Whether counts come from the kernel's own count (tests; false before the first count).
    var countsFromKernel: Bool { counter.withLock { if case .ready = $0 { true } else { false } } }

    /// Why the kernel refused the counting iterator, the first time it is asked after the refusal
    /// (the caller logs it once); nil otherwise.
    func takeCounterRefusal() -> SystemCallError? {
        guard case .refused(let error) = counter.withLock({ $0 }) else { return nil }
        return counterRefusalSaid.exchange(true, ordering: .relaxed) ? nil : error
    }

    /// Why a count of the made iterator failed (and was counted in batches instead), the first
    /// time it is asked after the first such failure (the caller logs it once); nil otherwise.
    func takeCounterFailure() -> SystemCallError? {
        counterFailure.withLock { failure in
            guard let current = failure, !current.said else { return nil }
            failure = (current.error, true)
            return current.error
        }
    }

    /// The entries of an association map: each client and its backend, up to `limit`, and the
    /// number present. Read in batches (BPF_MAP_LOOKUP_BATCH, ``associationBatch`` entries a
    /// system call: a full 1,048,576-entry map costs about a third of a second of CPU, where a
    /// walk with get_next_key, a system call per entry, took 0.7 s); a kernel that refuses
    /// batches is walked instead (``walkAssociations(_:limit:maximum:)``).
    /// - Parameter maximum: counting stops there (a walk that restarts never counts more than the
    ///   map can hold).
    static func associationEntries(_ fd: Int32, limit: Int, maximum: Int = .max) -> (entries: [(client: SocketAddress, backend: SocketAddress)], total: Int) {
        var entries: [(client: SocketAddress, backend: SocketAddress)] = []
        var total = 0
        let keys = UnsafeMutablePointer<fanout_association_key>.allocate(capacity: associationBatch)
        let values = UnsafeMutablePointer<fanout_association>.allocate(capacity: associationBatch)
        defer {
            keys.deallocate()
            values.deallocate()
        }
        // The position between calls: a bucket index for hash maps, room for a key to be safe.
        var position = fanout_association_key()
        var next = fanout_association_key()
        var first = true
        // Options in zeroed storage (libbpf refuses non-zero padding; see withLibbpfOptions).
        let refused = withLibbpfOptions(bpf_map_batch_opts.self) { options -> Bool in
            while total < maximum {
                var count = UInt32(associationBatch)
                let result = withUnsafeMutablePointer(to: &position) { inBatch in
                    bpf_map_lookup_batch(fd, first ? nil : UnsafeMutableRawPointer(inBatch), &next, keys, values, &count, options)
                }
                let failure = result < 0 ? errno : 0
                // No batch lookup (EINVAL, or the kernel's ENOTSUPP, 524), a position the kernel no
                // longer knows, or anything else: walk from the start rather than count short.
                if failure != 0 && failure != ENOENT { return true }
                first = false
                for index in 0..<Int(count) where total < maximum {
                    total += 1
                    guard entries.count < limit else { continue }
                    let family = Int32(keys[index].family)
                    entries.append((socketAddress(keys[index].addr, port: keys[index].port, family: family),
                                    socketAddress(values[index].addr, port: values[index].port, family: family)))
                }
                // ENOENT: the last entries were in this batch.
                if failure == ENOENT { break }
                position = next
            }
            return false
        }
        if refused {
            batchRefusals.wrappingAdd(1, ordering: .relaxed)
            return walkAssociations(fd, limit: limit, maximum: maximum)
        }
        return (entries, total)
    }

    /// Entries read per BPF_MAP_LOOKUP_BATCH call (40 bytes each: 160 KiB of buffers).
    static let associationBatch = 4096
    /// How often the kernel refused a batch lookup and the map was walked instead (tests).
    static let batchRefusals = Atomic<Int>(0)

    /// ``associationEntries(_:limit:maximum:)`` with get_next_key, a system call per entry: for
    /// kernels without batch lookup on LRU hash maps.
    static func walkAssociations(_ fd: Int32, limit: Int, maximum: Int) -> (entries: [(client: SocketAddress, backend: SocketAddress)], total: Int) {
        var entries: [(client: SocketAddress, backend: SocketAddress)] = []
        var total = 0
        var key = fanout_association_key()
        var next = fanout_association_key()
        var first = true
        while withUnsafeMutablePointer(to: &key, { current in bpf_map_get_next_key(fd, first ? nil : current, &next) }) == 0 {
            first = false
            key = next
            total += 1
            if total >= maximum { break }
            guard entries.count < limit else { continue }
            var value = fanout_association()
            // Evicted between the two calls: counted, not listed.
            guard bpf_map_lookup_elem(fd, &key, &value) == 0 else { continue }
            let family = Int32(key.family)
            entries.append((socketAddress(key.addr, port: key.port, family: family), socketAddress(value.addr, port: value.port, family: family)))
        }
        return (entries, total)
    }

    static func socketAddress(_ words: (UInt32, UInt32, UInt32, UInt32), port: UInt16, family: Int32) -> SocketAddress {
        var words = words
        let bytes = withUnsafeBytes(of: &words) { Array($0.prefix(family == AF_INET ? 4 : 16)) }
        return SocketAddress(ip: IPAddress(bytes: bytes)!, port: UInt16(bigEndian: port))
    }

    /// Writes the next-hop cache's route generation (0: off) and its deadline, a
    /// CLOCK_MONOTONIC_COARSE time in nanoseconds (bpf/include/fanout_hops_shared.h).
    func setRoute(generation: UInt32, validUntil: UInt64) throws(SystemCallError) {
        var key: UInt32 = 0
        var value = fanout_route_state()
        value.generation = generation
        value.valid_until = validUntil
        try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_ROUTE_STATE_NAME)") { bpf_map_update_elem(routeState, &key, &value, UInt64(BPF_ANY)) }
    }

    /// The next-hop cache's route state as the program reads it.
    var route: fanout_route_state {
        var key: UInt32 = 0
        var value = fanout_route_state()
        _ = bpf_map_lookup_elem(routeState, &key, &value)
        return value
    }

    /// Zeroes a listener id's counters and rotation positions before it is (re)used; backend
    /// slots are zeroed as downstreams are given them.
    func resetListener(id: UInt32) {
        zeroPerCPU(stats, key: id, as: fanout_stats.self)
        zeroPerCPU(templateStats, key: id, as: fanout_template_stats.self)
        zeroPerCPU(quicStats, key: id, as: fanout_quic_stats.self)
        zeroPerCPU(rateStats, key: id, as: fanout_rate_stats.self)
        for generation: UInt32 in 0...1 { clearQUIC(setKey: id * 2 + generation, keySlots: nil) }
        // A per-CPU value takes 8 bytes per CPU in userspace even when it is a u32.
        zeroPerCPU(roundRobin, key: id, as: UInt64.self)
        try? putNAT(id: id, bind: nil)
        removeAssociations(id: id)
    }
}

/// One generation of a listener's backends, as the program reads it.
struct BackendSet {
    var backends: [fanout_backend]
    var rotation: [UInt16]
    var table: [UInt16]
    var seed: UInt32

    /// - Parameters:
    ///   - slots: each downstream's counter slot, by downstream name.
    init(downstreams: [Downstream], balancing: Balancing, slots: [String: UInt16]) {
        backends = downstreams.map { downstream in
            var backend = fanout_backend()
            backend.addr = downstream.address.ip.words
            backend.port = downstream.address.port.bigEndian
            backend.counter_slot = slots[downstream.name] ?? UInt16(FANOUT_MAX_BACKENDS)
            return backend
        }
        seed = DownstreamSelector.seed
        switch balancing {
        case .roundRobin:
            rotation = DownstreamSelector.rotation(weights: downstreams.map(\.weight), limit: Int(FANOUT_ROTATION_MAX - FANOUT_MAX_BACKENDS)).map { UInt16($0) }
            table = []
        case .sourceIP:
            rotation = []
            table = SourceTable.entries(downstreams, size: DownstreamSelector.tableSize).map { UInt16($0) }
        }
    }
}
