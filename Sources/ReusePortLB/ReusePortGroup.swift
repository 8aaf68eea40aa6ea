// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CLibBPF
import CSystemShim
import Synchronization
import BPFSupport
import SystemCalls

/// A SO_REUSEPORT group served by one process alone, whose program and maps that process holds
/// (nothing is pinned in bpffs, so no bpffs is needed), with explicit succession: a new group
/// on the same address takes every new datagram from the previous one at ``activate()``, while
/// the previous group's members read what is queued and leave. This is how a daemon changes its
/// workers (count, buffers) without losing a datagram.
///
/// ```swift
/// let next = try ReusePortGroup(privateTo: address, options: GroupOptions(policy: .fiveTuple, capacity: 4))
/// let members = try (0..<4).map { try next.join(slot: $0) }   // receive nothing yet
/// try next.activate()                                         // from now on only these receive
/// // old members: read until socketStatistics().queuedBytes == 0 (nothing new arrives), then leave()
/// ```
///
/// The kernel groups every SO_REUSEPORT socket of one user on one address and port, whatever
/// the process: so the group refuses an address that another process already serves
/// (``ReusePortError/addressServedByAnotherProcess(_:pid:command:)``).
///
/// Succession is exact with eBPF steering only: the program selects sockets from its own
/// group's map. Classic BPF addresses sockets by their position among all sockets on the
/// address and the kernel hash spreads over all of them, so until the previous group's members
/// leave, they still receive a share of new datagrams.
public final class ReusePortGroup: @unchecked Sendable {
    /// The group's address and port.
    public let address: SocketAddress
    /// The group's settings as used.
    public let options: GroupOptions
    /// The steering in force for the group's members.
    public let steering: Steering
    /// Why the steering in force is not the one asked for (e.g. no CAP_BPF); nil otherwise.
    public let steeringNote: String?

    private let objects: GroupObjects?
    /// The members joined so far (weakly: a member the caller dropped has left).
    private let members = Mutex<[WeakMember]>([])

    private struct WeakMember {
        weak var member: ReusePortMember?
    }

    /// Makes a group on `address` for this process: loads the program and maps (eBPF), or
    /// prepares the fallback steering.
    ///
    /// With `options.steering` `.automatic`, a process without CAP_BPF, or whose program load
    /// is refused, falls back like ``ReusePortMember`` (classic BPF for `sourceIP` and
    /// `roundRobin`, the kernel hash for `fiveTuple`) and ``steeringNote`` says why.
    /// - Parameters:
    ///   - address: the address and port every member binds.
    ///   - options: policy, capacity, seed, steering preference and receive buffer size
    ///     (`bpffsRoot` is not used).
    /// - Throws: ``ReusePortError``: port 0; invalid capacity; the address bound by a socket of another
    ///   process (`addressServedByAnotherProcess`, naming it); eBPF unavailable with
    ///   `steering: .ebpf`; `fiveTuple` with `classicBPF`; a failed load (named, with errno).
    public init(privateTo address: SocketAddress, options: GroupOptions) throws(ReusePortError) {
        guard address.port != 0 else { throw .invalidAddress(address, reason: ReusePortError.portZeroReason) }
        guard (1...ReusePortMember.maximumCapacity).contains(options.capacity) else {
            throw .invalidCapacity(options.capacity)
        }
        if let other = BoundSockets.foreign(on: address).first {
            throw .addressServedByAnotherProcess(address, pid: other.pid, command: other.command)
        }
        if let problem = options.quicProblem { throw .connectionIDRouting(problem, errno: EOPNOTSUPP) }
        self.address = address
        self.options = options
        var (steering, note) = try ReusePortMember.chooseSteering(options)
        var objects: GroupObjects?
        if steering == .ebpf {
            let config = options.kernelConfig
            do {
                objects = try GroupObjects.load(
                    config: config, quic: options.kernelQUICConfig, table: ReusePortMember.slotTable(capacity: options.capacity, seed: config.seed))
            } catch .ebpfUnavailable(let reason) where options.steering == .automatic && options.quic == nil {
                steering = ReusePortMember.unprivilegedSteering(options.policy)
                note = "eBPF refused (\(reason)); using \(steering)"
            }
        }
        self.steering = steering
        steeringNote = note
        self.objects = objects
    }

    /// Binds a new SO_REUSEPORT socket on the address and, with eBPF, puts it in `slot` of this
    /// group's map. It receives nothing of this group's steering until ``activate()`` (with
    /// the kernel hash, and with classic BPF by position, it may receive at once).
    /// - Parameter slot: 0..<capacity, not held by a live member of this group.
    /// - Returns: the member; its ``ReusePortMember/leave()`` closes the socket (the kernel
    ///   empties the slot) and touches no pin.
    /// - Throws: ``ReusePortError``: `slotOutOfRange`, `slotInUse`, `addressInUse` (a socket
    ///   without SO_REUSEPORT or of another user), or a failed call.
    public func join(slot: Int) throws(ReusePortError) -> ReusePortMember {
        guard (0..<options.capacity).contains(slot) else {
            throw .slotOutOfRange(slot: slot, capacity: options.capacity)
        }
        return try members.withLock { (members) throws(ReusePortError) -> ReusePortMember in
            members.removeAll { $0.member?.hasLeft ?? true }
            if objects == nil, members.contains(where: { $0.member?.slot == slot }) {
                // Without a map the group itself keeps slots unique.
                throw .slotInUse(slot: slot)
            }
            let socket = try UDPSocket.makeReusePort(bound: address, receiveBufferSize: options.receiveBufferSize)
            if let objects {
                do throws(SystemCallError) {
                    try objects.place(socket: socket, slot: slot, onlyIfFree: true)
                } catch {
                    close(socket)
                    throw error.errno == EEXIST ? .slotInUse(slot: slot) : .system(error)
                }
            }
            let member = try ReusePortMember(
                privateSocket: socket, slot: slot, address: address, options: options, steering: steering,
                steeringNote: steeringNote, objects: objects)
            members.append(WeakMember(member: member))
            return member
        }
    }

    /// Makes this group's steering the one in force on the address.
    ///
    /// eBPF: attaches this group's program to the kernel's reuseport group (setsockopt
    /// SO_ATTACH_REUSEPORT_EBPF through one of this group's members), replacing the program a
    /// previous group of this process attached: from then on only this group's members get new
    /// datagrams (a datagram whose slot is empty fails over to a live member of this group); the
    /// previous group's members keep what is queued. It returns after a grace period of the kernel
    /// (``KernelGracePeriod``), so a datagram the replaced program steered to a previous member
    /// is on that member's queue by then: reading the previous members until they are empty
    /// after this returns loses nothing. Classic BPF: attaches the classic program
    /// (SO_ATTACH_REUSEPORT_CBPF). Kernel hash: detaches any program a previous group attached
    /// (SO_DETACH_REUSEPORT_BPF), so the kernel's hash spreads over every socket on the address.
    /// Every kind returns after the grace period, when other sockets are bound on the address
    /// (a first group on it has no predecessor to wait for: it returns at once).
    /// - Throws: ``ReusePortError/noLiveMember(_:)`` before any ``join(slot:)``, or the failed
    ///   setsockopt.
    public func activate() throws(ReusePortError) {
        let candidates = members.withLock { $0.compactMap(\.member) }
        // Sockets on the address besides this group's: a previous group's members, which the
        // replaced steering may have chosen a moment ago. None (a first start): nothing to wait for.
        let others = BoundSockets.bound(on: address).count > candidates.filter { !$0.hasLeft }.count
        for member in candidates {
            let result: Result<Void, SystemCallError>? = member.withOpenSocket { socket in
                do throws(SystemCallError) {
                    try attach(through: socket)
                    return .success(())
                } catch {
                    return .failure(error)
                }
            }
            switch result {
            case .none: continue  // left meanwhile: try another member
            case .success:
                // Whatever the steering: the program replaced (or the kernel's hash restored) is
                // swapped under RCU like the eBPF one.
                if others { KernelGracePeriod.wait() }
                return
            case .failure(let error): throw .system(error)
            }
        }
        throw .noLiveMember(address)
    }

    private func attach(through socket: Int32) throws(SystemCallError) {
        switch steering {
        case .ebpf:
            try Syscall.setsockopt(socket, SOL_SOCKET, SO_ATTACH_REUSEPORT_EBPF, objects!.program, call: "setsockopt SO_ATTACH_REUSEPORT_EBPF")
        case .classicBPF:
            try ClassicSteering.attach(socket: socket, policy: options.policy, capacity: options.capacity)
        case .kernelHash:
            do {
                try Syscall.setsockopt(socket, SOL_SOCKET, SO_DETACH_REUSEPORT_BPF, Int32(0), call: "setsockopt SO_DETACH_REUSEPORT_BPF")
            } catch where error.errno == ENOENT {
                // No program was attached: nothing to undo.
            }
        }
    }
}
