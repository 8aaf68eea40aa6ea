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
    /// The group's QUIC-LB configuration (zero: none, or a group of an older layout).
    let quic: rplb_quic_config
    let program: Int32
    let members: Int32
    let configMap: Int32
    let outcomes: Int32
    let delivered: Int32
    let table: Int32
    let roundRobin: Int32
    /// QUIC-LB server IDs registered by the members (server ID to slot and socket cookie), and
    /// the group's QUIC-LB configuration; -1 in a group of an older layout, which the layout
    /// check refuses.
    let quicIDs: Int32
    let quicConfig: Int32

    private static let pinNames = ["prog", "members", "config", "table", "outcomes", "delivered", "rr", "quic_ids", "quic_config"]
    /// Pins a group of an older layout lacks: opened as -1, so its config is read and refused
    /// by its layout version.
    private static let newerPins: Set<String> = ["quic_ids", "quic_config"]

    private let closesOnDeinit: Bool

    private init(directory: String?, config: rplb_config, quic: rplb_quic_config, descriptors: [Int32]) {
        self.directory = directory
        closesOnDeinit = directory == nil
        self.config = config
        self.quic = quic
        program = descriptors[0]
        members = descriptors[1]
        configMap = descriptors[2]
        table = descriptors[3]
        outcomes = descriptors[4]
        delivered = descriptors[5]
        roundRobin = descriptors[6]
        quicIDs = descriptors[7]
        quicConfig = descriptors[8]
    }

    var descriptors: [Int32] { [program, members, configMap, table, outcomes, delivered, roundRobin, quicIDs, quicConfig] }

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
    static func openOrCreate(directory: String, config wanted: rplb_config, quic wantedQUIC: rplb_quic_config,
                             table: MaglevTable) throws(ReusePortError) -> GroupObjects {
        if BPFFilesystem.exists(directory + "/config") {
            let existing = try open(directory: directory)
            if existing.liveSlots().isEmpty {
                existing.closeDescriptors()
                removePins(directory: directory)
            } else {
                let have = existing.config
                if have.layout_version != wanted.layout_version || have.policy != wanted.policy
                    || have.capacity != wanted.capacity || have.seed != wanted.seed
                    || existing.quic.server_id_length != wantedQUIC.server_id_length || existing.quic.nonce_length != wantedQUIC.nonce_length
                    || existing.quic.config_id != wantedQUIC.config_id
                {
                    existing.closeDescriptors()
                    throw .groupSettingsMismatch(
                        group: directory, existing: describe(have, existing.quic), requested: describe(wanted, wantedQUIC))
                }
                return existing
            }
        }
        return try create(directory: directory, config: wanted, quic: wantedQUIC, table: table)
    }

    static func describe(_ config: rplb_config, _ quic: rplb_quic_config = rplb_quic_config()) -> String {
        let policy = BalancePolicy(kernelValue: config.policy)?.rawValue ?? "policy #\(config.policy)"
        let routing = quic.server_id_length == 0 ? ""
            : ", QUIC-LB config \(quic.config_id) (\(quic.server_id_length)-octet server ID, \(quic.nonce_length)-octet nonce)"
        return "policy \(policy), capacity \(config.capacity), seed \(config.seed)\(routing), layout v\(config.layout_version)"
    }

    static func open(directory: String) throws(ReusePortError) -> GroupObjects {
        var descriptors: [Int32] = []
        for name in pinNames {
            let fd = bpf_obj_get(directory + "/" + name)
            // A group of an older layout lacks the newer pins: its config says which layout it is.
            if fd < 0 && newerPins.contains(name) && errno == ENOENT {
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
        var quic = rplb_quic_config()
        do {
            // The value is read only into a buffer of its size: a group of another layout may
            // have a larger one.
            try checkValueSize(descriptors[2], MemoryLayout<rplb_config>.size, name: "config")
            try libbpfCall("bpf_map_lookup_elem config") { bpf_map_lookup_elem(descriptors[2], &key, &config) }
            if descriptors[8] >= 0 {
                try checkValueSize(descriptors[8], MemoryLayout<rplb_quic_config>.size, name: "quic_config")
                try libbpfCall("bpf_map_lookup_elem quic_config") { bpf_map_lookup_elem(descriptors[8], &key, &quic) }
            }
        } catch {
            for open in descriptors where open >= 0 { close(open) }
            throw .system(error)
        }
        return GroupObjects(directory: directory, config: config, quic: quic, descriptors: descriptors)
    }

    /// Throws unless the map's values are `size` bytes.
    private static func checkValueSize(_ fd: Int32, _ size: Int, name: String) throws(SystemCallError) {
        var info = bpf_map_info()
        var length = UInt32(MemoryLayout<bpf_map_info>.size)
        try libbpfCall("bpf_obj_get_info_by_fd \(name)") { bpf_obj_get_info_by_fd(fd, &info, &length) }
        guard info.value_size == UInt32(size) else {
            throw SystemCallError(call: "the group's \(name) map has \(info.value_size)-byte values, this layout \(size) (another version's group)", errno: EPROTO)
        }
    }

    private static func create(directory: String, config: rplb_config, quic: rplb_quic_config, table: MaglevTable) throws(ReusePortError) -> GroupObjects {
        let descriptors = try loadDescriptors(config: config, quic: quic, table: table)
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
        return GroupObjects(directory: directory, config: config, quic: quic, descriptors: descriptors)
    }

    /// Loads the program and its maps with the group's settings and fills the config map and
    /// the lookup table, pinning nothing: the result belongs to this process alone (its
    /// descriptors close when it is released).
    static func load(config: rplb_config, quic: rplb_quic_config, table: MaglevTable) throws(ReusePortError) -> GroupObjects {
        GroupObjects(directory: nil, config: config, quic: quic, descriptors: try loadDescriptors(config: config, quic: quic, table: table))
    }

    /// The loaded program and maps (in ``pinNames`` order), config and table written.
    private static func loadDescriptors(config: rplb_config, quic: rplb_quic_config, table: MaglevTable) throws(ReusePortError) -> [Int32] {
        var descriptors: [Int32] = []
        do {
            descriptors = try loadEmbeddedObject(
                .reuseportSelect, program: RPLB_PROG_SELECT_NAME,
                maps: [RPLB_MAP_MEMBERS_NAME, RPLB_MAP_CONFIG_NAME, RPLB_MAP_TABLE_NAME,
                       RPLB_MAP_OUTCOMES_NAME, RPLB_MAP_DELIVERED_NAME, RPLB_MAP_RR_NAME, RPLB_MAP_QUIC_IDS_NAME, RPLB_MAP_QUIC_CONFIG_NAME]
            ) { object throws(SystemCallError) in
                let membersMap = bpf_object__find_map_by_name(object, RPLB_MAP_MEMBERS_NAME)
                try libbpfCall("bpf_map__set_max_entries") { bpf_map__set_max_entries(membersMap, config.capacity) }
                try setReadOnlyGlobal(object, rplb_program_settings(config: config, quic: quic), objectName: "reuseport_select",
                                      global: "rplb_settings", type: "struct rplb_program_settings")
            }
            var key: UInt32 = 0
            var value = config
            try libbpfCall("bpf_map_update_elem config") { bpf_map_update_elem(descriptors[2], &key, &value, UInt64(BPF_ANY)) }
            var quicValue = quic
            try libbpfCall("bpf_map_update_elem quic_config") { bpf_map_update_elem(descriptors[8], &key, &quicValue, UInt64(BPF_ANY)) }
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

    /// Registers QUIC-LB `serverID` for `slot`, held by the socket `cookie`; fails with EEXIST
    /// where another live registration holds it (its socket still in its slot).
    func registerServerID(_ serverID: [UInt8], slot: Int, cookie mine: UInt64) throws(SystemCallError) {
        var key = Self.serverIDKey(serverID)
        if let owner = owner(ofServerID: serverID), owner.cookie != mine, cookie(inSlot: Int(owner.slot)) == owner.cookie {
            throw SystemCallError(call: "register server ID (held by slot \(owner.slot))", errno: EEXIST)
        }
        var value = rplb_server_owner(slot: UInt32(slot), reserved: 0, cookie: mine)
        try libbpfCall("bpf_map_update_elem quic_ids") { bpf_map_update_elem(quicIDs, &key, &value, UInt64(BPF_ANY)) }
    }

    /// Removes `serverID` if the socket `cookie` registered it; true if it did.
    func withdrawServerID(_ serverID: [UInt8], cookie mine: UInt64) -> Bool {
        var key = Self.serverIDKey(serverID)
        guard owner(ofServerID: serverID)?.cookie == mine else { return false }
        return bpf_map_delete_elem(quicIDs, &key) == 0
    }

    /// Who registered `serverID`, if anyone.
    func owner(ofServerID serverID: [UInt8]) -> rplb_server_owner? {
        var key = Self.serverIDKey(serverID)
        var owner = rplb_server_owner()
        return bpf_map_lookup_elem(quicIDs, &key, &owner) == 0 ? owner : nil
    }

    /// Removes the registrations for `slot` that a socket other than `cookie` made: a member
    /// that joins an empty slot does not inherit its last holder's connections (one that takes
    /// the slot over does, and keeps them).
    func clearStaleServerIDs(slot: Int, cookie mine: UInt64) {
        guard quicIDs >= 0 else { return }
        var stale: [rplb_server_id] = []
        var key = rplb_server_id()
        var next = rplb_server_id()
        var first = true
        while (first ? bpf_map_get_next_key(quicIDs, nil, &next) : bpf_map_get_next_key(quicIDs, &key, &next)) == 0 {
            first = false
            var owner = rplb_server_owner()
            if bpf_map_lookup_elem(quicIDs, &next, &owner) == 0, Int(owner.slot) == slot, owner.cookie != mine { stale.append(next) }
            key = next
            if stale.count + 1 > Int(RPLB_MAX_SERVER_IDS) { break }
        }
        for var id in stale { _ = bpf_map_delete_elem(quicIDs, &id) }
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
