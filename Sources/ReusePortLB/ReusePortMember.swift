// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import CLibBPF
import CSystemShim
import Synchronization
import BPFSupport
import SystemCalls

/// One socket in a SO_REUSEPORT UDP group, steered by the group's policy.
///
/// A *group* is every UDP socket bound with SO_REUSEPORT to one address and port, in any number
/// of processes. With eBPF steering its first member loads an sk_reuseport program and pins it,
/// with a REUSEPORT_SOCKARRAY of members, a config map and a Maglev lookup table, under
/// `/sys/fs/bpf/reuseportlb/<group>/`; later members open the pins and put their socket in a slot.
/// When a member's socket closes (even by a crash) the kernel empties its slot and its sources
/// fail over to live members; the last member to leave removes the pins.
///
/// ```swift
/// let member = try ReusePortMember(joining: SocketAddress("127.0.0.1:2055")!, slot: .index(0),
///                                  options: GroupOptions(policy: .sourceIP, capacity: 3))
/// // receive on member.socket ...
/// member.leave()
/// ```
public final class ReusePortMember: @unchecked Sendable {
    /// The largest capacity a group can have.
    public static let maximumCapacity = Int(RPLB_MAX_MEMBERS)

    /// The group's address and port.
    public let address: SocketAddress
    /// This member's slot. With classic BPF or the kernel hash it is the requested index, kept
    /// for reporting: those steerings address sockets by join order, not by slot.
    public let slot: Int
    /// The bound UDP socket to receive on (SO_REUSEPORT, SO_RXQ_OVFL, close-on-exec).
    public let socket: Int32
    /// The steering in force.
    public let steering: Steering
    /// Why the steering in force is not the one asked for (e.g. no CAP_BPF); nil otherwise.
    public let steeringNote: String?
    /// The group's settings as used.
    public let options: GroupOptions
    /// The socket's SO_COOKIE.
    public let cookie: UInt64

    private let objects: GroupObjects?
    /// The abstract unix socket telling non-eBPF joiners that this group's eBPF program runs
    /// (``EBPFMarker``); -1 without eBPF or in a process-private group.
    private let marker: Int32
    /// The bpffs the group is pinned in; nil for a member of a process-private ``ReusePortGroup``,
    /// whose leave touches no pin.
    private let filesystem: BPFFilesystem?
    private let state = Mutex<(left: Bool, table: MaglevTable?)>((false, nil))
    private let sealed = Atomic<Bool>(false)

    /// Joins the group at `address`.
    /// - Parameters:
    ///   - address: the group's address and port (IPv4 or IPv6).
    ///   - request: which slot to take (lowest free, a given index, or a takeover for handover).
    ///   - options: the group's policy, capacity and seed (must match an existing group's) and
    ///     this member's steering preference.
    /// - Throws: ``ReusePortError``: port 0, capacity or slot out of range, slot in use, group full,
    ///   settings that differ from the group's, the address in use without SO_REUSEPORT, bpffs
    ///   missing and not mountable, or a failed system call (named, with errno).
    public init(joining address: SocketAddress, slot request: SlotRequest = .lowestFree, options: GroupOptions) throws(ReusePortError) {
        let capacity = options.capacity
        guard address.port != 0 else { throw .invalidAddress(address, reason: ReusePortError.portZeroReason) }
        guard (1...Self.maximumCapacity).contains(capacity) else { throw .invalidCapacity(capacity) }
        switch request {
        case .index(let slot), .takeover(let slot):
            guard (0..<capacity).contains(slot) else { throw .slotOutOfRange(slot: slot, capacity: capacity) }
        case .lowestFree:
            break
        }
        if let problem = options.quicProblem { throw .connectionIDRouting(problem, errno: EOPNOTSUPP) }
        self.address = address
        self.options = options
        let filesystem = BPFFilesystem(root: options.bpffsRoot)
        self.filesystem = filesystem

        let (steering, note) = try Self.chooseSteering(options)
        if case .takeover = request, steering != .ebpf { throw .takeoverNeedsEBPF(steering) }
        var note_ = note
        var objects: GroupObjects?
        var socket: Int32 = -1
        var slot = 0
        if steering == .ebpf {
            do {
                (objects, socket, slot) = try Self.joinWithEBPF(address, request, options, filesystem)
            } catch .ebpfUnavailable(let reason) where options.steering == .automatic && options.quic == nil {
                note_ = "eBPF refused (\(reason)); using \(Self.unprivilegedSteering(options.policy))"
            } catch .bpffsUnavailable(let path, let reason) where options.steering == .automatic && options.quic == nil {
                // No shared pins, no shared group: classic BPF still steers without them.
                note_ = "bpffs at \(path) cannot be used (\(reason)); using \(Self.unprivilegedSteering(options.policy))"
            }
        }
        self.objects = objects
        marker = objects != nil ? EBPFMarker.hold(address) : -1
        if let objects {
            self.steering = .ebpf
            self.socket = socket
            self.slot = slot
            _ = objects
        } else {
            let fallback = steering == .ebpf ? Self.unprivilegedSteering(options.policy) : steering
            if case .takeover = request { throw .takeoverNeedsEBPF(fallback) }
            let running = try Self.runningEBPFGroup(address, fallback, options, filesystem)
            defer { running?.closeDescriptors() }
            if running == nil && !options.force && EBPFMarker.present(address) {
                // An eBPF member runs here, but its pins are not in this bpffs (`ip netns exec`
                // mounts its own) or not readable: joining would replace its program unseen.
                throw .steeringConflict(
                    group: address,
                    running: "its members' pins are not in \(filesystem.root) (another bpffs mount: share it with nsenter --net instead of ip netns exec, or a bind mount)",
                    requested: fallback)
            }
            self.steering = fallback
            let socket = try UDPSocket.makeReusePort(bound: address, receiveBufferSize: options.receiveBufferSize)
            self.socket = socket
            switch request {
            case .index(let index), .takeover(let index): self.slot = index
            case .lowestFree: self.slot = 0
            }
            do throws(SystemCallError) {
                if fallback == .classicBPF {
                    try ClassicSteering.attach(socket: socket, policy: options.policy, capacity: capacity)
                } else if running != nil {
                    // Forced kernel hash: the running program would keep steering past this
                    // socket, so take it off the group.
                    try Syscall.setsockopt(socket, SOL_SOCKET, SO_DETACH_REUSEPORT_BPF, Int32(0), call: "setsockopt SO_DETACH_REUSEPORT_BPF")
                }
                try running?.setSteeringOverride(
                    UInt32(fallback == .classicBPF ? RPLB_OVERRIDE_CLASSIC_BPF.rawValue : RPLB_OVERRIDE_KERNEL_HASH.rawValue))
            } catch {
                close(socket)
                throw .system(error)
            }
            if running != nil {
                note_ = [note_, "forced: replaced the group's eBPF steering with \(fallback) for every member"]
                    .compactMap { $0 }.joined(separator: "; ")
            }
        }
        steeringNote = note_
        do {
            cookie = try UDPSocket.cookie(self.socket)
        } catch {
            close(self.socket)
            objects?.closeDescriptors()
            throw .system(error)
        }
    }

    /// A member of a process-private ``ReusePortGroup``: its socket is bound and, with eBPF, in
    /// `slot` of the group's map already. Closes the socket if its cookie cannot be read.
    init(
        privateSocket socket: Int32, slot: Int, address: SocketAddress, options: GroupOptions,
        steering: Steering, steeringNote: String?, objects: GroupObjects?
    ) throws(ReusePortError) {
        do {
            cookie = try UDPSocket.cookie(socket)
        } catch {
            close(socket)
            throw .system(error)
        }
        self.socket = socket
        self.slot = slot
        self.address = address
        self.options = options
        self.steering = steering
        self.steeringNote = steeringNote
        self.objects = objects
        filesystem = nil
        marker = -1
    }

    /// A socket another process bound and handed over (the service manager's descriptor store),
    /// to read what it holds and then ``leave()``: it is in no slot of this process's groups.
    /// - Throws: ``ReusePortError/handedOverMismatch(_:reason:)`` (the socket is closed) if it is
    ///   not a UDP socket bound to `address`.
    package convenience init(handedOver socket: Int32, address: SocketAddress, options: GroupOptions) throws(ReusePortError) {
        let type = try? Syscall.getsockopt(socket, SOL_SOCKET, SO_TYPE, initial: Int32(0))
        let bound = UDPSocket.localAddress(socket)
        guard type == Int32(SOCK_DGRAM.rawValue), bound == address else {
            close(socket)
            let what = type == Int32(SOCK_DGRAM.rawValue) ? "bound to \(bound.map { "\($0)" } ?? "nothing")" : "not a datagram socket"
            throw .handedOverMismatch(address, reason: what)
        }
        try self.init(privateSocket: socket, slot: -1, address: address, options: options, steering: .kernelHash, steeringNote: nil, objects: nil)
    }

    /// True once ``leave()`` ran.
    public var hasLeft: Bool { state.withLock { $0.left } }

    /// The group's pin directory and bpffs, for an eBPF member of a pinned group.
    var pinnedGroup: (directory: String, filesystem: BPFFilesystem)? {
        guard let directory = objects?.directory, let filesystem else { return nil }
        return (directory, filesystem)
    }

    /// Runs `body` with the socket while the member has not left (holding off a concurrent
    /// ``leave()``, so the descriptor cannot be closed and reused meanwhile); nil once it left.
    func withOpenSocket<R>(_ body: (Int32) -> R) -> R? {
        state.withLock { state in state.left ? nil : body(socket) }
    }

    static func unprivilegedSteering(_ policy: BalancePolicy) -> Steering {
        policy == .fiveTuple ? .kernelHash : .classicBPF
    }

    static func chooseSteering(_ options: GroupOptions) throws(ReusePortError) -> (Steering, String?) {
        switch options.steering {
        case .ebpf:
            guard Capabilities.current().canLoadBPF else {
                throw .ebpfUnavailable(reason: "the process has neither CAP_BPF nor CAP_SYS_ADMIN")
            }
            return (.ebpf, nil)
        case .automatic:
            if Capabilities.current().canLoadBPF { return (.ebpf, nil) }
            if options.quic != nil {
                throw .connectionIDRouting("it needs eBPF steering and the process has neither CAP_BPF nor CAP_SYS_ADMIN: grant CAP_BPF", errno: EOPNOTSUPP)
            }
            let fallback = unprivilegedSteering(options.policy)
            return (fallback, "no CAP_BPF: using \(fallback) steering")
        case .classicBPF:
            guard options.policy != .fiveTuple else { throw .policyNeedsEBPF(options.policy, options.steering) }
            return (.classicBPF, nil)
        case .kernelHash:
            return (.kernelHash, nil)
        }
    }

    private static func joinWithEBPF(
        _ address: SocketAddress, _ request: SlotRequest, _ options: GroupOptions, _ filesystem: BPFFilesystem
    ) throws(ReusePortError) -> (GroupObjects, Int32, Int) {
        try filesystem.ensureMounted()
        let lock = try filesystem.lock()
        defer { close(lock) }
        let config = options.kernelConfig
        let directory = filesystem.groupDirectory(for: address)
        // Bind first: a socket without SO_REUSEPORT on the address is `addressInUse`, whatever
        // the pins say. Until it is in the map and the program attached, the socket is a plain
        // member of the kernel's group.
        let socket = try UDPSocket.makeReusePort(bound: address, receiveBufferSize: options.receiveBufferSize)
        if !options.force && !BPFFilesystem.exists(directory + "/config") {
            // Nothing pinned here, yet other sockets on the address: their group's program and
            // map live in another bpffs (or they use no eBPF). Creating a group would replace
            // their steering while both sides believe they own the group.
            var status = stat()
            let mine = fstat(socket, &status) == 0 ? UInt64(status.st_ino) : 0
            let others = BoundSockets.bound(on: address).filter { $0 != mine }
            if !others.isEmpty {
                close(socket)
                throw .bpffsNotShared(address, bpffs: filesystem.root, sockets: others.count)
            }
        }
        let objects: GroupObjects
        do {
            objects = try GroupObjects.openOrCreate(
                directory: directory, config: config, quic: options.kernelQUICConfig, table: slotTable(capacity: options.capacity, seed: config.seed))
        } catch {
            close(socket)
            throw error
        }
        do throws(ReusePortError) {
            let slot = try place(socket, request, objects)
            do {
                try Syscall.setsockopt(socket, SOL_SOCKET, SO_ATTACH_REUSEPORT_EBPF, objects.program, call: "setsockopt SO_ATTACH_REUSEPORT_EBPF")
                // A member that joins an empty slot (not a takeover) does not inherit the server
                // IDs its last holder registered: their connections are that server's, not its.
                var takesOver = false
                if case .takeover = request { takesOver = true }
                if options.quic != nil && !takesOver {
                    objects.clearStaleServerIDs(slot: slot, cookie: try UDPSocket.cookie(socket))
                }
            } catch {
                throw ReusePortError.system(error)
            }
            // This group's program is in force again (a forced member may have replaced it).
            if objects.steeringOverride() != UInt32(RPLB_OVERRIDE_NONE.rawValue) {
                do {
                    try objects.setSteeringOverride(UInt32(RPLB_OVERRIDE_NONE.rawValue))
                } catch {
                    throw .system(error)
                }
            }
            return (objects, socket, slot)
        } catch {
            close(socket)
            Self.release(objects)
            throw error
        }
    }

    /// Refuses a member without eBPF where the group's eBPF program runs (live members in the
    /// pinned map): its classic program, or the kernel hash, would replace it for every member.
    /// Returns the running group when `force` lets it join, so it can mark the override.
    private static func runningEBPFGroup(
        _ address: SocketAddress, _ steering: Steering, _ options: GroupOptions, _ filesystem: BPFFilesystem
    ) throws(ReusePortError) -> GroupObjects? {
        let directory = filesystem.groupDirectory(for: address)
        guard BPFFilesystem.exists(directory + "/config") else { return nil }
        let group: GroupObjects
        do {
            group = try GroupObjects.open(directory: directory)
        } catch {
            // Pins exist but cannot be opened (e.g. EPERM without CAP_BPF where unprivileged
            // bpf() is disabled): an eBPF group may run there; joining would silently replace it.
            guard options.force else {
                throw .steeringConflict(
                    group: address, running: "an eBPF group whose pins this process cannot open (\(error))",
                    requested: steering)
            }
            return nil
        }
        let live = group.liveSlots()
        guard !live.isEmpty else {
            group.closeDescriptors()
            return nil
        }
        guard options.force else {
            group.closeDescriptors()
            throw .steeringConflict(
                group: address, running: "\(GroupObjects.describe(group.config)), \(live.count) live member(s)",
                requested: steering)
        }
        return group
    }

    private static func place(_ socket: Int32, _ request: SlotRequest, _ objects: GroupObjects) throws(ReusePortError) -> Int {
        /// false when `onlyIfFree` and a live socket holds the slot.
        func put(_ slot: Int, onlyIfFree: Bool) throws(ReusePortError) -> Bool {
            do {
                try objects.place(socket: socket, slot: slot, onlyIfFree: onlyIfFree)
                return true
            } catch {
                if onlyIfFree && error.errno == EEXIST { return false }
                throw .system(error)
            }
        }
        switch request {
        case .takeover(let slot):
            _ = try put(slot, onlyIfFree: false)
            return slot
        case .index(let slot):
            guard try put(slot, onlyIfFree: true) else { throw .slotInUse(slot: slot) }
            return slot
        case .lowestFree:
            for slot in 0..<Int(objects.config.capacity) where try put(slot, onlyIfFree: true) {
                return slot
            }
            throw .groupFull(capacity: Int(objects.config.capacity))
        }
    }

    /// Closes the group's descriptors and, if no live member is left, removes its pins.
    private static func release(_ objects: GroupObjects) {
        if let directory = objects.directory, objects.liveSlots().isEmpty, objects.isPinned() {
            GroupObjects.removePins(directory: directory)
        }
        objects.closeDescriptors()
    }

    /// The Maglev table over a group's slots: a pure function of capacity and seed, so every
    /// member can rebuild the table the creator wrote.
    static func slotTable(capacity: Int, seed: UInt32) -> MaglevTable {
        MaglevTable(
            backends: (0..<capacity).map { .init(name: "slot-\($0)") }, size: Int(RPLB_TABLE_SIZE), seed: seed)!
    }

    deinit { leave() }

    /// Leaves the group: closes the socket (the kernel empties the slot at once) and, if this
    /// was the last live member, removes the group's pins. Idempotent.
    public func leave() {
        let first = state.withLock { state in
            guard !state.left else { return false }
            state.left = true
            close(socket)
            if marker >= 0 { close(marker) }
            return true
        }
        guard first, let objects, let filesystem else { return }
        if let lock = try? filesystem.lock() {
            Self.release(objects)
            close(lock)
        } else {
            objects.closeDescriptors()
        }
    }

    /// Takes this member's slot out of the group's selection, for a leave that loses nothing:
    /// the slot's entry is deleted if it still holds this socket (under the bpffs lock, so a
    /// concurrent takeover is not undone), its sources fail over to live members at once, and
    /// what is already queued stays on the socket. It returns after a grace period of the kernel
    /// (``KernelGracePeriod``: a datagram the kernel steered here just before the delete is
    /// queued by then). Then read until ``socketStatistics()`` shows 0 queued bytes (the
    /// collector also waits until nothing arrived for 100 ms), ``seal()``, read once more, and
    /// ``leave()``. (A member that sends nothing from its socket can seal right away.)
    ///
    /// The last live member has nobody to fail over to: the kernel's hash keeps delivering to
    /// the sockets still bound, so its drain ends only when it stops reading (or seals: from
    /// then on the kernel counts the datagrams as Udp NoPorts).
    /// - Returns: true if the slot is out of selection (or was already: replaced, withdrawn);
    ///   false with classic BPF or the kernel hash, which address sockets by position or hash
    ///   and cannot take one out, and false while a member forced in without eBPF serves the
    ///   group (its program ignores the map): there the member keeps its share until
    ///   ``seal()`` takes the socket out of the kernel's group.
    /// - Throws: ``ReusePortError`` if the bpffs lock or the map delete fails.
    public func withdraw() throws(ReusePortError) -> Bool {
        guard let objects else { return false }
        let withdrawn = try withdrawLocked(objects)
        // After the lock is released (others' joins and withdrawals do not wait for it): whether
        // this call deleted the slot or a takeover replaced it, a selection made just before is
        // queued here once a grace period has passed.
        if withdrawn { KernelGracePeriod.wait() }
        return withdrawn
    }

    /// Stops the kernel from delivering any new datagram to this socket, for a leave that loses
    /// nothing at the close itself. Call it once the socket is out of selection (after
    /// ``withdraw()``, once ``isReplaced``, or once a successor ``ReusePortGroup`` activated),
    /// then read until the queue is empty, then ``leave()``. A member still in its slot leaves
    /// selection with the seal (the kernel deletes its map entry, its sources fail over), and
    /// with classic BPF or the kernel hash its share goes to the group's other sockets.
    ///
    /// Why: a close takes the socket out of the kernel's reuseport group before it takes it out
    /// of the UDP hash. A datagram whose lookup meets the socket in between goes to it, whatever
    /// the group's program says, and the close then frees it with no counter. Measured on a
    /// loopback group at 100,000 datagrams/s, its newest socket closing: one close in 30 to 40
    /// lost a datagram.
    ///
    /// How: the socket is bound to an interface index no device has (`SO_BINDTOIFINDEX`
    /// 2147483647). The kernel then matches it to no arriving datagram, and takes it out of the
    /// reuseport group; what is queued stays. It returns after a grace period of the kernel
    /// (``KernelGracePeriod``), when a datagram whose lookup met the socket just before is queued.
    /// Sends from a sealed socket fail (`ENODEV` for IPv4, `ENETUNREACH` for IPv6): send what
    /// must go first. Idempotent.
    /// - Throws: ``ReusePortError/system(_:)`` if the kernel refuses (`EPERM`: the socket is
    ///   bound to a device already and the process lacks `CAP_NET_RAW`), or the member left.
    public func seal() throws(ReusePortError) {
        if try sealWithoutWaiting() { KernelGracePeriod.wait() }
    }

    /// Seals every member of `members` (``seal()``) with one grace period for all, after the
    /// last. Those that left are skipped.
    /// - Throws: the first refusal; the others are sealed all the same, and the grace period
    ///   passes before it is thrown.
    public static func seal(_ members: [ReusePortMember]) throws(ReusePortError) {
        var firstError: ReusePortError?
        var sealedAny = false
        for member in members where !member.hasLeft {
            do {
                sealedAny = try member.sealWithoutWaiting() || sealedAny
            } catch where !member.hasLeft {
                firstError = firstError ?? error
            } catch {
                // Left meanwhile: skipped.
            }
        }
        if sealedAny { KernelGracePeriod.wait() }
        if let firstError { throw firstError }
    }

    /// ``seal()`` without its grace period (sealing several sockets, one wait after the last):
    /// true if this call sealed the socket, false if it was sealed already (by this member, or
    /// by a process that handed it over).
    func sealWithoutWaiting() throws(ReusePortError) -> Bool {
        let result: Result<Bool, SystemCallError>? = withOpenSocket { socket in
            guard !sealed.load(ordering: .relaxed) else { return .success(false) }
            let first: Bool
            do throws(SystemCallError) {
                first = try SocketSeal.sealWithoutWaiting(socket)
            } catch {
                return .failure(error)
            }
            sealed.store(true, ordering: .relaxed)
            return .success(first)
        }
        switch result {
        case .success(let first): return first
        case .failure(let error): throw .system(error)
        case .none: throw .system(SystemCallError(call: "setsockopt SO_BINDTOIFINDEX (the member left)", errno: EBADF))
        }
    }

    /// True once ``seal()`` succeeded.
    public var isSealed: Bool { sealed.load(ordering: .relaxed) }

    /// ``withdraw()``'s part under the bpffs lock: true if the slot is out of selection now.
    private func withdrawLocked(_ objects: GroupObjects) throws(ReusePortError) -> Bool {
        let lock = try filesystem?.lock()
        defer { if let lock { close(lock) } }
        // A member forced in without eBPF replaced the program: the map steers nothing now.
        guard objects.steeringOverride() == UInt32(RPLB_OVERRIDE_NONE.rawValue) else { return false }
        // Replaced by a takeover: out of selection, but perhaps only just.
        guard objects.cookie(inSlot: slot) == cookie else { return true }
        do {
            try objects.remove(slot: slot)
        } catch {
            throw .system(error)
        }
        return true
    }

    /// The steering that really serves the group now. For an eBPF member it is ``steering``
    /// unless a member was forced in without eBPF (``GroupOptions/force``) and replaced the
    /// group's program; then it is that member's `classicBPF` or `kernelHash`, until an eBPF
    /// member joins and attaches the program again. Other members report ``steering``.
    public var steeringInForce: Steering {
        guard let objects else { return steering }
        switch objects.steeringOverride() {
        case UInt32(RPLB_OVERRIDE_CLASSIC_BPF.rawValue): return .classicBPF
        case UInt32(RPLB_OVERRIDE_KERNEL_HASH.rawValue): return .kernelHash
        default: return steering
        }
    }

    /// True once another socket took this member's slot over (see ``SlotRequest/takeover(_:)``):
    /// from then on no new datagram reaches this socket, and the member should drain what it
    /// has queued (``socketStatistics()`` shows 0 queued bytes, and stays there) and leave.
    /// Always false without eBPF steering.
    public var isReplaced: Bool {
        guard let objects else { return false }
        guard let holder = objects.cookie(inSlot: slot) else { return false }
        return holder != cookie
    }

    /// QUIC-LB groups (``GroupOptions/quic``): datagrams whose QUIC destination connection ID
    /// carries `serverID` come to this member's slot from now on, whatever their source. A
    /// member may register several. A registration outlives its member until
    /// ``withdrawServerID(_:)``, the group's end, or another member joining the empty slot: a
    /// member that takes the slot over (``SlotRequest/takeover(_:)``) gets its connections, and
    /// while the slot is empty the policy chooses (counted `quicUnknownServerID`).
    /// - Throws: ``ReusePortError/connectionIDRouting(_:errno:)`` if the group does not route by
    ///   connection ID, the ID is not the configuration's length, or another live member holds it.
    public func registerServerID(_ serverID: [UInt8]) throws(ReusePortError) {
        let objects = try quicObjects(serverID)
        // Under the bpffs lock: two members registering one ID cannot both see it free.
        let lock = try filesystem?.lock()
        defer { if let lock { close(lock) } }
        do {
            try objects.registerServerID(serverID, slot: slot, cookie: cookie)
        } catch {
            if error.errno == EEXIST {
                throw .connectionIDRouting("server ID \(Self.hex(serverID)) is registered by slot \(objects.owner(ofServerID: serverID).map { String($0.slot) } ?? "?"), whose member is live: each server ID names one member", errno: EEXIST)
            }
            throw .system(error)
        }
    }

    /// Takes `serverID` back: its datagrams go to the policy. False if this member did not
    /// register it, or was replaced (its successor in the slot serves the ID's connections now).
    @discardableResult
    public func withdrawServerID(_ serverID: [UInt8]) throws(ReusePortError) -> Bool {
        let objects = try quicObjects(serverID)
        guard !isReplaced else { return false }
        let lock = try filesystem?.lock()
        defer { if let lock { close(lock) } }
        return objects.withdrawServerID(serverID, cookie: cookie)
    }

    private func quicObjects(_ serverID: [UInt8]) throws(ReusePortError) -> GroupObjects {
        guard let quic = options.quic, let objects else {
            throw .connectionIDRouting("this group does not route by connection ID: create it with GroupOptions.quic (eBPF steering)", errno: EINVAL)
        }
        guard serverID.count == quic.serverIDLength else {
            throw .connectionIDRouting("server ID \(Self.hex(serverID)) is \(serverID.count) octet(s); the group's configuration takes \(quic.serverIDLength)", errno: EINVAL)
        }
        return objects
    }

    private static func hex(_ bytes: [UInt8]) -> String { bytes.map { ($0 < 16 ? "0" : "") + String($0, radix: 16) }.joined() }

    /// The slots that a live socket holds now. Throws without eBPF steering.
    public func liveSlots() throws(ReusePortError) -> [Int] {
        guard let objects else { throw .countersUnavailable(steering) }
        return objects.liveSlots()
    }

    /// The kernel program's counters for the whole group. Throws without eBPF steering.
    public func counters() throws(ReusePortError) -> GroupCounters {
        guard let objects else { throw .countersUnavailable(steering) }
        do {
            let outcomes = try objects.perCPUSums(objects.outcomes, count: Int(RPLB_OUTCOME_COUNT.rawValue))
            let delivered = try objects.perCPUSums(objects.delivered, count: 2 * options.capacity)
            return GroupCounters(outcomes: outcomes, delivered: delivered)
        } catch {
            throw .system(error)
        }
    }

    /// Which slot receives the datagrams of `source` now (with `port` for the five-tuple
    /// policy): the same computation as the kernel program, on the same live slots. nil when no
    /// slot is live. Throws without eBPF steering, and for `roundRobin` (no owner).
    public func owner(of source: IPAddress, port: UInt16 = 0) throws(ReusePortError) -> Int? {
        guard let objects else { throw .countersUnavailable(steering) }
        guard options.policy != .roundRobin else { throw .policyNeedsEBPF(.roundRobin, options.steering) }
        let live = Set(objects.liveSlots())
        guard !live.isEmpty else { return nil }
        let table = state.withLock { state in
            if let table = state.table { return table }
            let table = Self.slotTable(capacity: Int(objects.config.capacity), seed: objects.config.seed)
            state.table = table
            return table
        }
        return SourceSelection.slot(
            for: source, port: options.policy == .fiveTuple ? port : 0, seed: objects.config.seed,
            table: table.entries, capacity: Int(objects.config.capacity), isLive: live.contains)
    }

    /// Bytes queued on the socket for reading, and datagrams the socket dropped because its
    /// receive buffer was full (SO_MEMINFO; the same counter SO_RXQ_OVFL reports per datagram).
    /// - Throws: ``ReusePortError/system(_:)``: the call failed, or the member left (EBADF).
    public func socketStatistics() throws(ReusePortError) -> (queuedBytes: Int, drops: UInt32) {
        let read = withOpenSocket { socket in Result { () throws(SystemCallError) in try UDPSocket.memoryInfo(socket) } }
        switch read {
        case .success(let statistics): return statistics
        case .failure(let error): throw .system(error)
        case .none: throw .system(SystemCallError(call: "getsockopt SO_MEMINFO (the member left)", errno: EBADF))
        }
    }
}

/// The kernel program's counters for one group.
public struct GroupCounters: Sendable, Equatable {
    /// Datagrams delivered to the member their policy chose first.
    public var selected: UInt64
    /// Datagrams whose member's slot was empty, delivered to another live member.
    public var failedOver: UInt64
    /// Datagrams with no live member in the map, left to the kernel's hash (still delivered).
    public var fallback: UInt64
    /// Datagrams whose source address could not be read, left to the kernel's hash.
    public var unparsed: UInt64
    /// Datagrams seen while the group's config was missing, left to the kernel's hash.
    public var noConfig: UInt64
    /// Datagrams the program steered to each slot (first choice and failovers).
    public var deliveredBySlot: [UInt64]
    /// QUIC-LB groups, besides the delivery outcomes above: datagrams whose connection ID named
    /// a registered member (delivered there, or by the policy's failover when its slot is empty).
    public var quicRouted: UInt64
    /// Initial and 0-RTT packets whose client-chosen ID named no member: the policy chose.
    public var quicFallback: UInt64
    /// Server-chosen IDs whose server ID no member registered: the policy chose.
    public var quicUnknownServerID: UInt64
    /// Not QUIC packets of the group's config ID, or too short: the policy chose.
    public var quicUndecodable: UInt64
    /// Of those, the failovers: datagrams each slot received for a dead member's sources.
    public var failedOverBySlot: [UInt64]

    /// - Parameters:
    ///   - outcomes: the outcomes map, indexed by `enum rplb_outcome`.
    ///   - delivered: the delivered map, indexed by `RPLB_DELIVERED_KEY(slot, outcome)`.
    init(outcomes: [UInt64], delivered: [UInt64]) {
        let slots = delivered.count / 2
        let selectedKey = Int(RPLB_OUTCOME_SELECTED.rawValue)
        let failedOverKey = Int(RPLB_OUTCOME_FAILED_OVER.rawValue)
        failedOverBySlot = (0..<slots).map { delivered[2 * $0 + failedOverKey] }
        deliveredBySlot = (0..<slots).map { delivered[2 * $0 + selectedKey] + delivered[2 * $0 + failedOverKey] }
        failedOver = failedOverBySlot.reduce(0, +)
        selected = deliveredBySlot.reduce(0, +) - failedOver
        fallback = outcomes[Int(RPLB_OUTCOME_FALLBACK.rawValue)]
        unparsed = outcomes[Int(RPLB_OUTCOME_UNPARSED.rawValue)]
        noConfig = outcomes[Int(RPLB_OUTCOME_NO_CONFIG.rawValue)]
        quicRouted = outcomes[Int(RPLB_OUTCOME_QUIC_ROUTED.rawValue)]
        quicFallback = outcomes[Int(RPLB_OUTCOME_QUIC_FALLBACK.rawValue)]
        quicUnknownServerID = outcomes[Int(RPLB_OUTCOME_QUIC_UNKNOWN.rawValue)]
        quicUndecodable = outcomes[Int(RPLB_OUTCOME_QUIC_UNDECODABLE.rawValue)]
    }

    /// Every outcome by its name, as the collector and metrics print them.
    public var outcomes: [(name: String, count: UInt64)] {
        [("selected", selected), ("failed_over", failedOver), ("fallback", fallback),
         ("unparsed", unparsed), ("no_config", noConfig)]
    }
}

/// The userspace mirror of the kernel program's choice for one source (the hash itself is the
/// shared header's `rplb_source_hash`).
enum SourceSelection {
    static func slot(
        for source: IPAddress, port: UInt16, seed: UInt32, table: [UInt32], capacity: Int, isLive: (Int) -> Bool
    ) -> Int? {
        let bytes = source.bytes
        var words: [UInt32] = [0, 0, 0, 0]
        words.withUnsafeMutableBytes { $0.copyBytes(from: bytes) }
        let count = UInt32(bytes.count / 4)
        var hash: UInt32 = 0
        for probe in 0..<UInt32(RPLB_MAX_PROBES) {
            hash = rplb_source_hash(words, count, UInt32(port), seed, probe)
            let slot = Int(table[Int(rplb_reduce(hash, UInt32(table.count)))])
            if isLive(slot) { return slot }
        }
        let start = Int(rplb_reduce(hash, UInt32(capacity)))
        for offset in 0..<capacity where isLive((start + offset) % capacity) {
            return (start + offset) % capacity
        }
        return nil
    }
}
