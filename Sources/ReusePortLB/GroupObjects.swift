// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import BPFObjects
import CLibBPF
import CSystemShim
import BPFSupport
import SystemCalls

/// The program and maps of one eBPF-steered group: pinned under `directory` and opened by one
/// member, or (directory nil) loaded for one process alone by a ``ReusePortGroup``.
final class GroupObjects {
    /// The pin directory; nil for a process-private group, whose descriptors are all that holds
    /// the objects (and are closed when the last reference goes).
    let directory: String?
    let config: rplb_config
    let program: Int32
    let members: Int32
    let configMap: Int32
    let outcomes: Int32
    let delivered: Int32
    let table: Int32
    let roundRobin: Int32
    /// QUIC-LB server IDs registered by the members (server ID to slot); -1 in a group of an
    /// older layout, which the layout check refuses.
    let quicIDs: Int32

    private static let pinNames = ["prog", "members", "config", "table", "outcomes", "delivered", "rr", "quic_ids"]

    private let closesOnDeinit: Bool

    private init(directory: String?, config: rplb_config, descriptors: [Int32]) {
        self.directory = directory
        closesOnDeinit = directory == nil
        self.config = config
        program = descriptors[0]
        members = descriptors[1]
        configMap = descriptors[2]
        table = descriptors[3]
        outcomes = descriptors[4]
        delivered = descriptors[5]
        roundRobin = descriptors[6]
        quicIDs = descriptors[7]
    }

    var descriptors: [Int32] { [program, members, configMap, table, outcomes, delivered, roundRobin, quicIDs] }

    func closeDescriptors() {
        for fd in descriptors where fd >= 0 { close(fd) }
    }

    deinit {
        // Pinned objects are closed explicitly under the bpffs lock (see ReusePortMember.leave);
        // a private group's are shared by the group and its members and go with the last one.
        if closesOnDeinit { closeDescriptors() }
    }

    /// Opens the group's pinned objects, or creates and pins them. Must hold the bpffs lock.
    ///
    /// A group whose pins exist but whose members map holds no live socket is a crashed run's
    /// leftover: it is removed and created anew with this member's settings.
    static func openOrCreate(directory: String, config wanted: rplb_config, table: MaglevTable) throws(ReusePortError) -> GroupObjects {
        if BPFFilesystem.exists(directory + "/config") {
            let existing = try open(directory: directory)
            if existing.liveSlots().isEmpty {
                existing.closeDescriptors()
                removePins(directory: directory)
            } else {
                let have = existing.config
                if have.layout_version != wanted.layout_version || have.policy != wanted.policy
                    || have.capacity != wanted.capacity || have.seed != wanted.seed
                    || have.quic_server_id_length != wanted.quic_server_id_length || have.quic_nonce_length != wanted.quic_nonce_length
                    || have.quic_config_id != wanted.quic_config_id
                {
                    existing.closeDescriptors()
                    throw .groupSettingsMismatch(
                        group: directory, existing: describe(have), requested: describe(wanted))
                }
                return existing
            }
        }
        return try create(directory: directory, config: wanted, table: table)
    }

    static func describe(_ config: rplb_config) -> String {
        let policy = BalancePolicy(kernelValue: config.policy)?.rawValue ?? "policy #\(config.policy)"
        let quic = config.quic_server_id_length == 0 ? ""
            : ", QUIC-LB config \(config.quic_config_id) (\(config.quic_server_id_length)-octet server ID, \(config.quic_nonce_length)-octet nonce)"
        return "policy \(policy), capacity \(config.capacity), seed \(config.seed)\(quic), layout v\(config.layout_version)"
    }

    static func open(directory: String) throws(ReusePortError) -> GroupObjects {
        var descriptors: [Int32] = []
        for name in pinNames {
            let fd = bpf_obj_get(directory + "/" + name)
            // A group of an older layout has no quic_ids pin: its config says which layout it is.
            if fd < 0 && name == "quic_ids" && errno == ENOENT {
                descriptors.append(-1)
                continue
            }
            if fd < 0 {
                let error = errno
                for open in descriptors { close(open) }
                throw BPFFilesystem.failure(SystemCallError(call: "bpf_obj_get \(directory)/\(name)", errno: error), path: directory)
            }
            descriptors.append(fd)
        }
        var key: UInt32 = 0
        var config = rplb_config()
        do {
            try libbpfCall("bpf_map_lookup_elem config") { bpf_map_lookup_elem(descriptors[2], &key, &config) }
        } catch {
            for open in descriptors { close(open) }
            throw .system(error)
        }
        return GroupObjects(directory: directory, config: config, descriptors: descriptors)
    }

    private static func create(directory: String, config: rplb_config, table: MaglevTable) throws(ReusePortError) -> GroupObjects {
        let descriptors = try loadDescriptors(config: config, table: table)
        do {
            try systemCall("mkdir \(directory)") { mkdir(directory, 0o700) == 0 || errno == EEXIST ? 0 : -1 }
            for (name, fd) in zip(pinNames, descriptors) where fd >= 0 {
                try libbpfCall("bpf_obj_pin \(directory)/\(name)") { bpf_obj_pin(fd, directory + "/" + name) }
            }
        } catch {
            for fd in descriptors { close(fd) }
            removePins(directory: directory)
            throw BPFFilesystem.failure(error, path: directory)
        }
        return GroupObjects(directory: directory, config: config, descriptors: descriptors)
    }

    /// Loads the program and its maps with the group's settings and fills the config map and
    /// the lookup table, pinning nothing: the result belongs to this process alone (its
    /// descriptors close when it is released).
    static func load(config: rplb_config, table: MaglevTable) throws(ReusePortError) -> GroupObjects {
        GroupObjects(directory: nil, config: config, descriptors: try loadDescriptors(config: config, table: table))
    }

    /// The loaded program and maps (in ``pinNames`` order), config and table written.
    private static func loadDescriptors(config: rplb_config, table: MaglevTable) throws(ReusePortError) -> [Int32] {
        var descriptors: [Int32] = []
        do {
            descriptors = try loadEmbeddedObject(
                .reuseportSelect, program: RPLB_PROG_SELECT_NAME,
                maps: [RPLB_MAP_MEMBERS_NAME, RPLB_MAP_CONFIG_NAME, RPLB_MAP_TABLE_NAME,
                       RPLB_MAP_OUTCOMES_NAME, RPLB_MAP_DELIVERED_NAME, RPLB_MAP_RR_NAME, RPLB_MAP_QUIC_IDS_NAME]
            ) { object throws(SystemCallError) in
                let membersMap = bpf_object__find_map_by_name(object, RPLB_MAP_MEMBERS_NAME)
                try libbpfCall("bpf_map__set_max_entries") { bpf_map__set_max_entries(membersMap, config.capacity) }
                try setReadOnlyGlobal(object, config, objectName: "reuseport_select", global: "rplb_settings", type: "struct rplb_config")
            }
            var key: UInt32 = 0
            var value = config
            try libbpfCall("bpf_map_update_elem config") { bpf_map_update_elem(descriptors[2], &key, &value, UInt64(BPF_ANY)) }
            try writeTable(table, fd: descriptors[3])
        } catch {
            for fd in descriptors { close(fd) }
            if error.errno == EPERM || error.errno == EACCES {
                throw .ebpfUnavailable(reason: error.description)
            }
            throw .system(error)
        }
        return descriptors
    }

    /// Writes the whole lookup table in one batch call when the kernel has it.
    private static func writeTable(_ table: MaglevTable, fd: Int32) throws(SystemCallError) {
        var keys = (0..<UInt32(table.entries.count)).map { $0 }
        var values = table.entries
        var count = UInt32(keys.count)
        let written = withLibbpfOptions(bpf_map_batch_opts.self) { options in
            options.pointee.elem_flags = UInt64(BPF_ANY)
            return bpf_map_update_batch(fd, &keys, &values, &count, options)
        }
        if written == 0 { return }
        for index in keys.indices {
            try libbpfCall("bpf_map_update_elem table") { bpf_map_update_elem(fd, &keys[index], &values[index], UInt64(BPF_ANY)) }
        }
    }

    static func removePins(directory: String) {
        // The group's template store (FlowTemplateStore) goes with the group.
        for name in pinNames + [FlowTemplateStore.pinName] { unlink(directory + "/" + name) }
        rmdir(directory)
    }

    /// The socket cookie in `slot`, or nil if no live socket holds it.
    func cookie(inSlot slot: Int) -> UInt64? {
        var key = UInt32(slot)
        var cookie: UInt64 = 0
        return bpf_map_lookup_elem(members, &key, &cookie) == 0 ? cookie : nil
    }

    func liveSlots() -> [Int] {
        (0..<Int(config.capacity)).filter { cookie(inSlot: $0) != nil }
    }

    /// Puts the socket in `slot`: `onlyIfFree` fails with EEXIST when a live socket holds it.
    func place(socket: Int32, slot: Int, onlyIfFree: Bool) throws(SystemCallError) {
        var key = UInt32(slot)
        var value = UInt64(socket)
        let flags = UInt64(onlyIfFree ? BPF_NOEXIST : BPF_ANY)
        try libbpfCall("bpf_map_update_elem members[\(slot)]") { bpf_map_update_elem(members, &key, &value, flags) }
    }

    /// The config map's `steering_override` (`enum rplb_override`); 0 if unreadable.
    func steeringOverride() -> UInt32 {
        var key: UInt32 = 0
        var value = rplb_config()
        return bpf_map_lookup_elem(configMap, &key, &value) == 0 ? value.steering_override : 0
    }

    /// Records which steering replaced the group's program (`RPLB_OVERRIDE_NONE` when a member
    /// attached it again).
    func setSteeringOverride(_ override: UInt32) throws(SystemCallError) {
        var key: UInt32 = 0
        var value = config
        try libbpfCall("bpf_map_lookup_elem config") { bpf_map_lookup_elem(configMap, &key, &value) }
        value.steering_override = override
        try libbpfCall("bpf_map_update_elem config") { bpf_map_update_elem(configMap, &key, &value, UInt64(BPF_ANY)) }
    }

    /// Empties `slot` (the kernel stops selecting its socket); an already empty slot is fine.
    func remove(slot: Int) throws(SystemCallError) {
        var key = UInt32(slot)
        let result = bpf_map_delete_elem(members, &key)
        if result < 0 && result != -ENOENT && !(result == -1 && errno == ENOENT) {
            throw SystemCallError(call: "bpf_map_delete_elem members[\(slot)]", errno: result == -1 ? errno : -result)
        }
    }

    /// True if the members map pinned in `directory` is this one (not a group created anew
    /// since, e.g. after every member withdrew and a new member took the pins for leftovers).
    func isPinned() -> Bool {
        guard let directory else { return false }
        let pinned = bpf_obj_get(directory + "/members")
        guard pinned >= 0 else { return false }
        defer { close(pinned) }
        return Self.mapID(pinned) == Self.mapID(members)
    }

    private static func mapID(_ fd: Int32) -> UInt32? {
        var info = bpf_map_info()
        var length = UInt32(MemoryLayout<bpf_map_info>.size)
        return bpf_obj_get_info_by_fd(fd, &info, &length) == 0 ? info.id : nil
    }

    /// Registers QUIC-LB `serverID` for `slot`; fails with EEXIST where another slot whose
    /// socket is live holds it.
    func registerServerID(_ serverID: [UInt8], slot: Int) throws(SystemCallError) {
        var key = Self.serverIDKey(serverID)
        var holder: UInt32 = 0
        if bpf_map_lookup_elem(quicIDs, &key, &holder) == 0, Int(holder) != slot, cookie(inSlot: Int(holder)) != nil {
            throw SystemCallError(call: "register server ID (held by slot \(holder))", errno: EEXIST)
        }
        var value = UInt32(slot)
        try libbpfCall("bpf_map_update_elem quic_ids") { bpf_map_update_elem(quicIDs, &key, &value, UInt64(BPF_ANY)) }
    }

    /// Removes `serverID` if `slot` holds it; true if it did.
    func withdrawServerID(_ serverID: [UInt8], slot: Int) -> Bool {
        var key = Self.serverIDKey(serverID)
        var holder: UInt32 = 0
        guard bpf_map_lookup_elem(quicIDs, &key, &holder) == 0, Int(holder) == slot else { return false }
        return bpf_map_delete_elem(quicIDs, &key) == 0
    }

    /// The slot `serverID` is registered for, if any.
    func slot(ofServerID serverID: [UInt8]) -> Int? {
        var key = Self.serverIDKey(serverID)
        var holder: UInt32 = 0
        return bpf_map_lookup_elem(quicIDs, &key, &holder) == 0 ? Int(holder) : nil
    }

    private static func serverIDKey(_ serverID: [UInt8]) -> rplb_server_id {
        var key = rplb_server_id()
        withUnsafeMutableBytes(of: &key.bytes) { bytes in
            for (index, byte) in serverID.prefix(16).enumerated() { bytes[index] = byte }
        }
        return key
    }

    /// Sums a per-CPU u64 array map, entry by entry.
    func perCPUSums(_ fd: Int32, count: Int) throws(SystemCallError) -> [UInt64] {
        var sums = [UInt64](repeating: 0, count: count)
        for index in 0..<count { sums[index] = try perCPUSum(fd, key: UInt32(index), words: 1)[0] }
        return sums
    }
}
