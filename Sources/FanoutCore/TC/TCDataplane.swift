// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import Dispatch
import BPFSupport
import CLibBPF
import CSystemShim
import Logging
import ReusePortLB
import Synchronization
import SystemCalls

/// The daemon's tc_ebpf side: one loaded program, attached once per interface that has a
/// tc_ebpf listener, and the listener ids and counter slots of the shared maps.
final class TCDataplane: Sendable {
    private struct State {
        var program: TCProgram?
        var attachments: [String: (attachment: TCAttachment, users: Int)] = [:]
        var freeIDs = Array((0..<UInt32(FANOUT_MAX_LISTENERS)).reversed())
        /// What closed programs counted as unmatched (``TCDataplane/unmatchedReasons`` order):
        /// a program loaded again (a tc_attach change) starts its maps at 0, and the counters
        /// must not go backwards.
        var unmatchedBefore = [UInt64](repeating: 0, count: TCDataplane.unmatchedReasons.count)
        /// Managed neighbour entries this process made for replication pools' next hops, with how
        /// many pool members need each (deleted when none does).
        var neighbours: [Neighbour: Int] = [:]
        /// Interfaces whose TCX link was taken over from the previous process and still runs its
        /// program (on its plan) until ``TCDataplane/completeAdoptions()``.
        var pendingSwaps: [String] = []
        /// The previous process's listener entries, when its maps were taken over at this start,
        /// that no listener of this start has claimed yet (by bind and interface index); and the
        /// ids its entries and pools hold, kept off the free list until ``TCDataplane/completeAdoptions()``.
        var adoptedEntries: [AdoptedKey: fanout_listener] = [:]
        var reservedIDs: Set<UInt32> = []
        var claimedIDs: Set<UInt32> = []
        /// Managed neighbour entries the previous process made for its pools' next hops (handed
        /// over with its data path): this process's once a pool needs one, removed at
        /// ``TCDataplane/completeAdoptions()`` otherwise.
        var inheritedNeighbours: Set<Neighbour> = []
        /// flow_templates: the program's ring buffer of template-bearing datagrams, read while a
        /// listener follows templates.
        var templateTap: TCTemplateTap?
        /// `udp-fanout capture`: the programs' ring buffer of dropped packets, read while a
        /// capture of a listener runs.
        var captureTap: KernelCaptureTap?
        /// The next-hop cache's watch of the kernel's routing (``TCRouteWatch``), while the
        /// program is attached somewhere.
        var routeWatch: TCRouteWatch?
    }

    /// How many batches of routing notifications that may move a path the next-hop cache's watch
    /// has seen (``TCRouteWatch/pathChanges``), nil without a watch.
    var routeChanges: Int? {
        state.withLock { $0.routeWatch?.pathChanges.load(ordering: .relaxed) }
    }

    /// A listener entry's key: its bind at an interface.
    struct AdoptedKey: Hashable {
        let bind: SocketAddress
        let ifindex: UInt32
    }

    /// A next hop's neighbour entry: interface index and address.
    struct Neighbour: Hashable, Sendable {
        let ifindex: UInt32
        let address: IPAddress
    }

    private let state = Mutex(State())
    let logger: Logger
    /// The service manager's store: the TCX links go there, and the previous process's come
    /// from there (docs/restarts.md).
    let descriptors: DescriptorStore

    init(logger: Logger, descriptors: DescriptorStore? = nil) {
        self.logger = logger
        self.descriptors = descriptors ?? .none(logger: logger)
    }

    /// The process is stopping and hands its data path to the next one: listeners leave the maps
    /// as they are (the program keeps forwarding on the last plan through the stored links).
    var handingOver: Bool { descriptors.handingOver }

    /// The listeners that are entries in this program's maps: tc_ebpf's, and xdp's (its XDP
    /// program reads the same maps, with the tc program behind it).
    static func serves(_ listener: Listener) -> Bool {
        TCKind.serves(listener) || XDPKind.serves(listener)
    }

    /// Checks privileges and sysctls, loads the program on first use, attaches to the
    /// listener's interface (once per interface), and returns a listener id and the interface's
    /// index (part of the listener's map key): the id of the previous process's entry for the
    /// same bind and interface, with that entry, when its maps were taken over (its counters,
    /// rotation and associations go on), else a fresh one.
    func register(_ listener: Listener) throws(TCError) -> (program: TCProgram, id: UInt32, ifindex: UInt32, adopted: fanout_listener?) {
        let capabilities = Capabilities.current()
        var missing: [String] = []
        if !capabilities.canLoadBPF { missing.append("CAP_BPF") }
        if !capabilities.has(Capabilities.netAdmin) { missing.append("CAP_NET_ADMIN") }
        // The program rewrites packets through computed pointers: the verifier wants CAP_PERFMON.
        if !capabilities.canUsePointerArithmetic { missing.append("CAP_PERFMON") }
        // flow_templates sends copies and replays from the exporters' addresses (a raw socket).
        if ListenerCounters.followsTemplates(listener) && !capabilities.has(Capabilities.netRaw) { missing.append("CAP_NET_RAW (settings.flow_templates)") }
        guard missing.isEmpty else { throw .privileges(missing: missing, flowTemplates: ListenerCounters.followsTemplates(listener)) }
        let interface = listener.interface ?? ""
        guard if_nametoindex(interface) > 0 else { throw .interfaceNotFound(interface) }
        // The fib lookup refuses to route unless forwarding is on (per interface for IPv4).
        let (sysctl, path) = TCPreflight.forwardingSetting(interface: interface, family: listener.bind.ip.family)
        guard Self.readFirstLine(path) == "1" else { throw .forwardingDisabled(interface: interface, sysctl: sysctl) }

        return try state.withLock { state throws(TCError) in
            let program: TCProgram
            if let loaded = state.program {
                program = loaded
            } else {
                program = try load(in: &state)
                state.program = program
                logger.info("eBPF fast path initialized", metadata: [
                    "program_id": "\(program.programID)", "ipv6_csum_flag": "\(program.features.ipv6ChecksumFlag ? "BPF_F_IPV6" : "unsupported by this kernel")",
                ])
            }
            let attachment = try acquire(interface: interface, mode: listener.settings.tcAttach, in: &state)
            if state.routeWatch == nil {
                let watch = TCRouteWatch(program: program, logger: logger)
                watch.start()
                state.routeWatch = watch
            }
            let key = AdoptedKey(bind: listener.bind, ifindex: UInt32(attachment.ifindex))
            // The previous process's entry for this bind, if of the same direction (nat or not).
            if let entry = state.adoptedEntries[key], (entry.reserved & FANOUT_LISTENER_NAT != 0) == (listener.replies == .nat) {
                state.adoptedEntries[key] = nil
                state.claimedIDs.insert(entry.id)
                return (program, entry.id, key.ifindex, entry)
            }
            guard let id = state.freeIDs.popLast() else {
                release(interface: interface, in: &state)
                throw .tooManyListeners
            }
            program.resetListener(id: id)
            return (program, id, key.ifindex, nil)
        }
    }

    /// Loads the program: on the previous process's maps when they were handed over and fit
    /// (same layout: `FANOUT_MAPS_LAYOUT`), noting its listener entries for ``register(_:)``;
    /// else on new maps, saying what was lost. Its maps go to the service manager's store.
    private func load(in state: inout State) throws(TCError) -> TCProgram {
        state.inheritedNeighbours = takeHandedOverNeighbours()
        let (handed, problem) = handedOverMaps()
        defer { for fd in handed.values { close(fd) } }
        if let problem {
            descriptors.count(Mode.tcEBPF.rawValue, .rejected, note: problem)
            logger.warning("\(problem)")
        }
        var loaded: TCProgram?
        if !handed.isEmpty {
            do throws(SystemCallError) {
                let program = try newProgram(reusing: handed)
                for (bind, ifindex, entry) in program.listenerEntries() {
                    state.adoptedEntries[AdoptedKey(bind: bind, ifindex: ifindex)] = entry
                    state.reservedIDs.insert(entry.id)
                    withUnsafeBytes(of: entry.pools) { raw in
                        for index in 0..<Int(min(entry.pool_count, UInt32(FANOUT_MAX_POOLS))) {
                            state.reservedIDs.insert(raw.load(fromByteOffset: index * MemoryLayout<fanout_pool>.stride, as: fanout_pool.self).id)
                        }
                    }
                }
                state.freeIDs.removeAll { state.reservedIDs.contains($0) }
                let note = "tc_ebpf: took over the previous process's maps (\(state.adoptedEntries.count) listener entries): counters, rotations, fragment state and nat associations go on"
                descriptors.count(Mode.tcEBPF.rawValue, .adopted, note: note)
                logger.info("took over the tc_ebpf maps of the previous process: counters, rotations, fragment state and associations go on", metadata: [
                    "listener_entries": "\(state.adoptedEntries.count)",
                ])
                loaded = program
            } catch {
                // On new maps: when that fails too, the program itself is the problem (said as
                // the start's error), not the maps.
                do throws(SystemCallError) { loaded = try newProgram() } catch { throw .load(error) }
                let note = "tc_ebpf: the previous process's maps do not fit this program (\(error)): counters, rotations, fragment state and nat associations start anew"
                descriptors.count(Mode.tcEBPF.rawValue, .rejected, note: note)
                logger.warning("\(note)")
            }
        }
        let program: TCProgram
        if let loaded {
            program = loaded
        } else {
            do throws(SystemCallError) { program = try newProgram() } catch { throw .load(error) }
        }
        for (name, fd) in program.handedOverMaps {
            descriptors.replace(DescriptorStore.tcMapName(name), with: [fd])
        }
        // A map of the other build (the key map of a program with crypto) goes out of the store.
        let handing = Set(program.handedOverMaps.map(\.name))
        for name in TCProgram.optionalMapNames where !handing.contains(name) { descriptors.remove(DescriptorStore.tcMapName(name)) }
        return program
    }

    /// The tc program: the build with the BPF crypto kfuncs where the kernel has them, else (or
    /// when that one does not load: said) the plain one, which routes plaintext QUIC-LB IDs only
    /// and updates UDP checksums with bpf_l4_csum_replace (no bpf_cast_to_kern_ctx, no CO-RE).
    private func newProgram(reusing handed: [String: Int32] = [:]) throws(SystemCallError) -> TCProgram {
        guard TCKernelFeatures.quicCryptoProblem == nil else { return try TCProgram(reusing: handed, crypto: false) }
        do throws(SystemCallError) {
            return try TCProgram(reusing: handed, crypto: true)
        } catch let first {
            // The same failure (a map that does not fit, say) is said as the first build's.
            guard let plain = try? TCProgram(reusing: handed, crypto: false) else { throw first }
            logger.warning("the tc program with the BPF kfuncs (crypto, the skb's checksum state) did not load, so the one without them runs: quic_lb routes plaintext server IDs only here, a key is refused when written, and UDP checksums are updated by the kernel's helper (slower)", metadata: ["error": "\(first)"])
            return plain
        }
    }

    /// The previous process's maps handed over (of this layout, every one of them), and what
    /// could not be used: another layout, or some maps missing.
    private func handedOverMaps() -> (maps: [String: Int32], problem: String?) {
        var maps: [String: Int32] = [:]
        for name in TCProgram.mapNames + TCProgram.optionalMapNames {
            var fds = descriptors.take(DescriptorStore.tcMapName(name))
            guard !fds.isEmpty else { continue }
            maps[name] = fds.removeFirst()
            for extra in fds { close(extra) }
        }
        let others = descriptors.takeAll(prefix: DescriptorStore.tcMapPrefix)
        for (name, fds) in others {
            for fd in fds { close(fd) }
            descriptors.remove(name)
        }
        if !others.isEmpty {
            for fd in maps.values { close(fd) }
            let layouts = Set(others.keys.compactMap { $0.dropFirst(DescriptorStore.tcMapPrefix.count).split(separator: ".").first }).sorted()
            return ([:], "tc_ebpf: the previous process's maps have layout \(layouts.joined(separator: ", ")), this program \(FANOUT_MAPS_LAYOUT): counters, rotations, fragment state and nat associations start anew (the link is still taken over: no datagram meets an empty hook)")
        }
        if !maps.isEmpty && TCProgram.mapNames.contains(where: { maps[$0] == nil }) {
            for (name, fd) in maps {
                close(fd)
                descriptors.remove(DescriptorStore.tcMapName(name))
            }
            let missing = TCProgram.mapNames.filter { maps[$0] == nil }
            return ([:], "tc_ebpf: the previous process handed over only some of its maps (missing: \(missing.joined(separator: ", "))): counters, rotations, fragment state and nat associations start anew")
        }
        return (maps, nil)
    }

    /// The managed neighbour entries the previous process made (a memfd of "ifindex address"
    /// lines, `udp-fanout.tcneigh`).
    private func takeHandedOverNeighbours() -> Set<Neighbour> {
        var found: Set<Neighbour> = []
        let handed = descriptors.take(DescriptorStore.tcNeighboursName)
        // This process hands its own over when it stops; the previous record goes now.
        if !handed.isEmpty { descriptors.remove(DescriptorStore.tcNeighboursName) }
        for fd in handed {
            defer { close(fd) }
            var bytes = [UInt8](repeating: 0, count: 65536)
            let count = pread(fd, &bytes, bytes.count, 0)
            guard count > 0 else { continue }
            for line in String(decoding: bytes[0..<count], as: UTF8.self).split(separator: "\n") {
                let fields = line.split(separator: " ")
                guard fields.count == 2, let ifindex = UInt32(fields[0]), let address = IPAddress(String(fields[1])) else { continue }
                found.insert(Neighbour(ifindex: ifindex, address: address))
            }
        }
        return found
    }

    /// Hands the managed neighbour entries this process made to the next one (the process stops
    /// and hands its data path over: the pools' copies still need them).
    private func handOverNeighbours(_ neighbours: [Neighbour]) {
        guard !neighbours.isEmpty else { return }
        let problem = "could not hand the pools' managed neighbour entries to the next process: it keeps them but will not remove them when no pool needs them (ip neigh del <address> dev <interface>)"
        let fd = shim_memfd(DescriptorStore.tcNeighboursName)
        guard fd >= 0 else {
            logger.warning("\(problem)", metadata: ["error": "memfd_create: \(String(cString: strerror(-fd)))"])
            return
        }
        defer { close(fd) }
        let text = Array(neighbours.map { "\($0.ifindex) \($0.address)\n" }.joined().utf8)
        guard pwrite(fd, text, text.count, 0) == text.count else {
            logger.warning("\(problem)", metadata: ["error": "pwrite: \(String(cString: strerror(errno)))"])
            return
        }
        descriptors.replace(DescriptorStore.tcNeighboursName, with: [fd])
    }

    /// A nat listener's association map: the previous process's for `id` when its maps were
    /// taken over and `adopted` (if it holds as many entries as configured now), else a new one;
    /// put at `id` in the associations array and handed to the service manager's store.
    func associationMap(id: UInt32, listener: Listener, program: TCProgram, adopted: Bool) throws(SystemCallError) -> Int32 {
        let name = DescriptorStore.tcAssociationsName(id)
        let maxEntries = UInt32(clamping: listener.settings.maxAssociations)
        var handed = descriptors.take(name)
        if adopted, !handed.isEmpty {
            let fd = handed.removeFirst()
            for extra in handed { close(extra) }
            var info = bpf_map_info()
            var length = UInt32(MemoryLayout<bpf_map_info>.size)
            if bpf_obj_get_info_by_fd(fd, &info, &length) == 0, info.max_entries == maxEntries,
               info.key_size == UInt32(MemoryLayout<fanout_association_key>.size) {
                do throws(SystemCallError) {
                    try program.putAssociations(id: id, fd: fd)
                    descriptors.replace(name, with: [fd])
                    return fd
                } catch {
                    close(fd)
                    throw error
                }
            }
            let note = "listener '\(listener.name)': the previous process's association map holds \(info.max_entries) entries, max_associations is \(maxEntries) now: its clients are associated anew"
            descriptors.count(Mode.tcEBPF.rawValue, .rejected, note: note)
            logger.warning("\(note)")
            close(fd)
        } else {
            for fd in handed { close(fd) }
        }
        let fd = try program.createAssociations(id: id, maxEntries: maxEntries)
        descriptors.replace(name, with: [fd])
        return fd
    }

    /// A nat listener's association map leaves the store (its listener stops for good).
    func forgetAssociations(id: UInt32) {
        if !handingOver { descriptors.remove(DescriptorStore.tcAssociationsName(id)) }
    }

    /// A fresh id for a replication pool of a registered listener (its sets, rotation and counters
    /// are a listener's), with its counters and rotation zeroed.
    func poolID() throws(TCError) -> UInt32 {
        try state.withLock { state throws(TCError) in
            guard let program = state.program, let id = state.freeIDs.popLast() else { throw .tooManyListeners }
            program.resetListener(id: id)
            return id
        }
    }

    /// Keeps the neighbour entries of `members`' next hops resolved (managed entries, made where
    /// none exists): a pool's copies are cloned with the fib lookup's MACs and cannot wait for a
    /// neighbour (bpf/include/fanout_pools.h). Returns the entries held for them, to give back
    /// with ``releaseNeighbours(_:)``. A failure is logged (the copies are counted no_neighbour
    /// until something else resolves the next hop).
    func holdNeighbours(for members: [Downstream]) -> [Neighbour] {
        var held: [Neighbour] = []
        for member in members where member.weight > 0 {
            guard let hop = TCRoute.nextHop(to: member.address.ip) else { continue }
            let neighbour = Neighbour(ifindex: hop.ifindex, address: hop.address)
            guard !held.contains(neighbour) else { continue }
            state.withLock { state in
                do throws(SystemCallError) {
                    if let users = state.neighbours[neighbour] {
                        state.neighbours[neighbour] = users + 1
                        held.append(neighbour)
                        // Held already, but the kernel flushes a managed entry when its link goes
                        // down (6.18 keeps it through a loss of carrier): made again if it is gone
                        // (one that exists is left as it is, and still counted: see docs/replication.md).
                        if try TCRoute.addManagedNeighbour(hop.address, ifindex: hop.ifindex) {
                            logger.info("added a managed neighbour entry for a pool member's next hop again (the kernel had flushed it): the kernel keeps it resolved for the copies", metadata: [
                                "downstream": "\(member.name)", "next_hop": "\(hop.address)", "interface": "\(TCRoute.interfaceName(hop.ifindex))",
                            ])
                        }
                        return
                    }
                    // Not made here (it exists): not ours to delete, nothing to count; unless the
                    // previous process made it and handed it over.
                    let inherited = state.inheritedNeighbours.remove(neighbour) != nil
                    let made = try TCRoute.addManagedNeighbour(hop.address, ifindex: hop.ifindex)
                    guard made || inherited else { return }
                    state.neighbours[neighbour] = 1
                    held.append(neighbour)
                    if made {
                        logger.info("added a managed neighbour entry for a pool member's next hop: the kernel keeps it resolved for the copies (deleted when no pool needs it)", metadata: [
                            "downstream": "\(member.name)", "next_hop": "\(hop.address)", "interface": "\(TCRoute.interfaceName(hop.ifindex))",
                        ])
                    }
                } catch {
                    let interface = TCRoute.interfaceName(hop.ifindex)
                    logger.warning("could not add a managed neighbour entry for a pool member's next hop: its copies are dropped and counted no_neighbour until the kernel resolves it otherwise (ip neigh add \(hop.address) dev \(interface) managed)", metadata: [
                        "downstream": "\(member.name)", "next_hop": "\(hop.address)", "interface": "\(interface)", "error": "\(error)",
                    ])
                }
            }
        }
        return held
    }

    /// Gives neighbour entries back: the last user deletes the entry this process made.
    func releaseNeighbours(_ neighbours: [Neighbour]) {
        state.withLock { state in
            for neighbour in neighbours {
                guard let users = state.neighbours[neighbour] else { continue }
                if users > 1 {
                    state.neighbours[neighbour] = users - 1
                } else {
                    state.neighbours[neighbour] = nil
                    TCRoute.removeNeighbour(neighbour.address, ifindex: neighbour.ifindex)
                    logger.info("deleted the managed neighbour entry made for a pool member's next hop: no pool member's route goes through it now", metadata: [
                        "next_hop": "\(neighbour.address)", "interface": "\(TCRoute.interfaceName(neighbour.ifindex))",
                    ])
                }
            }
        }
    }

    /// Ids of the previous process's pools that a listener taken over keeps (not freed at
    /// ``completeAdoptions()``).
    func claim(ids: [UInt32]) {
        state.withLock { state in
            for id in ids where state.reservedIDs.contains(id) { state.claimedIDs.insert(id) }
        }
    }

    /// Gives a pool's id back (its listener entry no longer names it).
    func releasePoolID(_ id: UInt32) {
        state.withLock { $0.freeIDs.append(id) }
    }

    /// Attaches the program at `interface` (or counts one more user of an attachment there);
    /// closes a program that was loaded for nothing when the attach fails.
    private func acquire(interface: String, mode: TCAttach, in state: inout State) throws(TCError) -> TCAttachment {
        guard let program = state.program else { throw .load(SystemCallError(call: "tc_fanout not loaded", errno: ENOENT)) }
        if let existing = state.attachments[interface] {
            state.attachments[interface] = (existing.attachment, existing.users + 1)
            return existing.attachment
        }
        if mode != .clsact, let adopted = adopt(interface: interface) {
            state.attachments[interface] = (adopted, 1)
            state.pendingSwaps.append(interface)
            return adopted
        }
        let attachment: TCAttachment
        do throws(TCError) {
            attachment = try TCAttachment(interface: interface, program: program, mode: mode, logger: logger)
        } catch {
            // The program loaded for this attach would otherwise stay loaded with nothing attached.
            if state.attachments.isEmpty {
                state.routeWatch?.stop()
                state.routeWatch = nil
                program.closeDescriptors()
                state.program = nil
            }
            throw error
        }
        state.attachments[interface] = (attachment, 1)
        logger.info("attached tc_ebpf program", metadata: [
            "interface": "\(interface)", "attach": "\(attachment.kindName)", "program_id": "\(program.programID)",
        ])
        // A TCX link outlives this process in the service manager's store (a clsact filter cannot).
        if let link = attachment.link { descriptors.replace(DescriptorStore.tcLinkName(interface), with: [link]) }
        return attachment
    }

    /// The TCX link the previous process left at `interface` (handed over by the service
    /// manager), taken over; nil when there is none or it cannot be (closed, counted rejected).
    private func adopt(interface: String) -> TCAttachment? {
        let name = DescriptorStore.tcLinkName(interface)
        var links = descriptors.take(name)
        guard !links.isEmpty else { return nil }
        let link = links.removeFirst()
        for extra in links { close(extra) }
        do throws(TCError) {
            let attachment = try TCAttachment(adopting: link, interface: interface, logger: logger)
            let previous = TCAttachment.linkInfo(link)?.programID ?? 0
            let note = "tc_ebpf at \(interface): took over the TCX link of the previous process (program id \(previous)); it forwarded on the previous plan until this start replaced its program"
            descriptors.count(Mode.tcEBPF.rawValue, .adopted, note: note)
            logger.info("took over the tc_ebpf link the previous process left: it forwards on the previous plan until this start replaces the program in place", metadata: [
                "interface": "\(interface)", "previous_program_id": "\(previous)",
            ])
            descriptors.replace(name, with: [link])
            return attachment
        } catch {
            close(link)
            descriptors.remove(name)
            descriptors.count(Mode.tcEBPF.rawValue, .rejected, note: "\(error)")
            logger.warning("\(error): attaching anew", metadata: ["interface": "\(interface)"])
            return nil
        }
    }

    /// Once every listener of a start is in the maps: each link taken over from the previous
    /// process runs this process's program from now on (bpf_link_update, atomic). A link that
    /// refuses is detached and the program attached anew (a gap, logged).
    func completeAdoptions() {
        state.withLock { state in
            guard let program = state.program else {
                // No tc_ebpf or xdp listener now: the previous process's neighbour entries go.
                for neighbour in takeHandedOverNeighbours() { TCRoute.removeNeighbour(neighbour.address, ifindex: neighbour.ifindex) }
                return
            }
            // The previous process's listeners that this configuration no longer has: their
            // entries go, and every id its entries and pools held that nothing claimed is free
            // again (zeroed, its nat entries taken out).
            for (key, entry) in state.adoptedEntries {
                program.removeListener(key.bind, ifindex: key.ifindex, id: entry.id)
                logger.info("removed a listener entry of the previous process that this configuration does not have", metadata: [
                    "bind": "\(key.bind)", "ifindex": "\(key.ifindex)", "id": "\(entry.id)",
                ])
            }
            let unclaimed = state.reservedIDs.subtracting(state.claimedIDs)
            if !unclaimed.isEmpty {
                program.removeLive(ids: unclaimed)
                for id in unclaimed.sorted() {
                    program.resetListener(id: id)
                    program.clearPoolSources(key: id * 2)
                    program.clearPoolSources(key: id * 2 + 1)
                    descriptors.remove(DescriptorStore.tcAssociationsName(id))
                    state.freeIDs.append(id)
                }
            }
            state.adoptedEntries = [:]
            state.reservedIDs = []
            state.claimedIDs = []
            // The previous process's managed neighbour entries that no pool of this start needs.
            for neighbour in state.inheritedNeighbours { TCRoute.removeNeighbour(neighbour.address, ifindex: neighbour.ifindex) }
            state.inheritedNeighbours = []
            for interface in state.pendingSwaps {
                guard let entry = state.attachments[interface] else { continue }
                do throws(TCError) {
                    try entry.attachment.swap(to: program)
                    logger.info("replaced the previous process's tc_ebpf program in place", metadata: [
                        "interface": "\(interface)", "program_id": "\(program.programID)",
                    ])
                } catch {
                    logger.error("\(error): detaching it and attaching anew (datagrams arriving meanwhile are not forwarded)", metadata: ["interface": "\(interface)"])
                    descriptors.remove(DescriptorStore.tcLinkName(interface))
                    entry.attachment.detach()
                    do throws(TCError) {
                        let fresh = try TCAttachment(interface: interface, program: program, mode: .tcx, logger: logger)
                        state.attachments[interface] = (fresh, entry.users)
                        if let link = fresh.link { descriptors.replace(DescriptorStore.tcLinkName(interface), with: [link]) }
                    } catch {
                        state.attachments[interface] = nil
                        logger.error("\(error)", metadata: ["interface": "\(interface)"])
                    }
                }
            }
            state.pendingSwaps = []
        }
    }

    /// Attaches the program where a nat listener's replies arrive (one more user of each
    /// interface, like a listener's own): checks each exists and forwards. On an error none of
    /// `interfaces` is held.
    func acquireReplyInterfaces(_ interfaces: [String], for listener: Listener) throws(TCError) {
        for interface in interfaces {
            guard if_nametoindex(interface) > 0 else { throw .replyInterfaceNotFound(listener: listener.name, interface: interface) }
            let (sysctl, path) = TCPreflight.forwardingSetting(interface: interface, family: listener.bind.ip.family)
            guard Self.readFirstLine(path) == "1" else { throw .forwardingDisabled(interface: interface, sysctl: sysctl) }
        }
        try state.withLock { state throws(TCError) in
            var held: [String] = []
            for interface in interfaces {
                do throws(TCError) {
                    _ = try acquire(interface: interface, mode: listener.settings.tcAttach, in: &state)
                    held.append(interface)
                } catch {
                    for done in held { release(interface: done, in: &state) }
                    throw error
                }
            }
        }
    }

    /// One user fewer at each interface (detached where it was the last).
    func releaseReplyInterfaces(_ interfaces: [String]) {
        state.withLock { state in
            for interface in interfaces { release(interface: interface, in: &state) }
        }
    }

    /// flow_templates: hands listener `id`'s template-bearing datagrams to `follower` (the ring
    /// buffer is read from the first such listener on).
    func followTemplates(id: UInt32, _ follower: KernelTemplateFollower) throws(TCError) {
        try state.withLock { state throws(TCError) in
            guard let program = state.program else { return }
            if state.templateTap == nil {
                do throws(SystemCallError) { state.templateTap = try TCTemplateTap(ringBuffer: program.templates, logger: logger) } catch { throw .maps(error) }
            }
            state.templateTap?.register(id: id, follower)
        }
    }

    func stopFollowingTemplates(id: UInt32) {
        state.withLock { state in
            guard let tap = state.templateTap else { return }
            tap.unregister(id: id)
            guard tap.isEmpty else { return }
            // The last one: the reader reads what is left (still delivered to this id's
            // follower) and stops. Under the lock, so no second reader of the ring starts meanwhile.
            tap.stop()
            state.templateTap = nil
        }
    }

    /// `udp-fanout capture`: listener `id`'s capture filter into the programs' map (nil: none),
    /// and its dropped packets from the ring buffer to `capture` meanwhile (the ring is read
    /// while any listener has a capture). A filter for an id no listener holds (it stopped
    /// meanwhile) is not written.
    func capture(id: UInt32, _ capture: DropCapture, _ filter: DropCapture.Filter?) {
        state.withLock { state in
            guard let program = state.program else { return }
            var key = id
            var config = KernelCaptureTap.config(filter)
            guard filter != nil, !state.freeIDs.contains(id) else {
                var empty = fanout_capture_config()
                if bpf_map_update_elem(program.captureConfigs, &key, &empty, UInt64(BPF_ANY)) != 0 {
                    // Not expected (an array entry in range): the program would go on sampling
                    // this id's drops into the ring (counted ring_full once nobody reads it).
                    logger.warning("capture: the program's capture entry could not be cleared; it may go on sampling this listener's drops", metadata: [
                        "id": "\(id)", "error": "\(SystemCallError(call: "bpf_map_update_elem \(FANOUT_MAP_CAPTURE_CONFIGS_NAME)", errno: errno))",
                    ])
                }
                guard let tap = state.captureTap, tap.unregister(id: id) else { return }
                // The last one: its reader stops (within its 100 ms poll) under the lock, so a
                // capture starting meanwhile waits and then makes the ring's only reader. The
                // reader takes none of this lock (a delivery only queues the packet).
                tap.stop()
                state.captureTap = nil
                return
            }
            do throws(SystemCallError) {
                if state.captureTap == nil { state.captureTap = try KernelCaptureTap(ringBuffer: program.capture, logger: logger) }
                state.captureTap?.register(id: id, capture)
                // The sampling's time carries on from the entry's while its rate stays (another
                // filter of the same rate); another rate starts with a whole burst.
                var previous = fanout_capture_config()
                if bpf_map_lookup_elem(program.captureConfigs, &key, &previous) == 0, previous.interval == config.interval { config.tat = previous.tat }
                try libbpfCall("bpf_map_update_elem \(FANOUT_MAP_CAPTURE_CONFIGS_NAME)") { bpf_map_update_elem(program.captureConfigs, &key, &config, UInt64(BPF_ANY)) }
            } catch {
                logger.error("capture: the program cannot be told to capture this listener's drops; the capture gets none from it", metadata: [
                    "id": "\(id)", "error": "\(error)",
                ])
            }
        }
    }

    /// Listener `id`'s capture counts (what its program did not capture), read under the lock
    /// that keeps the program's descriptors open.
    func captureCounts(id: UInt32) -> DropCapture.Counts {
        state.withLock { state in
            guard let program = state.program, !state.freeIDs.contains(id) else { return DropCapture.Counts() }
            let counted = program.captureCounts(id: id)
            return DropCapture.Counts(sampledOut: counted.sampledOut, kernelLost: counted.ringFull &+ counted.unreadable)
        }
    }

    /// Returns a listener's id and detaches from its interface if it was the last user there;
    /// closes the program when no listener is left.
    func unregister(interface: String, id: UInt32) {
        state.withLock { state in
            state.freeIDs.append(id)
            release(interface: interface, in: &state)
        }
    }

    private func release(interface: String, in state: inout State) {
        if let entry = state.attachments[interface] {
            if entry.users <= 1 {
                // Handing over: the store's copy keeps the link attached for the next process.
                // Otherwise it must not: out of the store first, then closed (detached).
                if !handingOver { descriptors.remove(DescriptorStore.tcLinkName(interface)) }
                state.pendingSwaps.removeAll { $0 == interface }
                entry.attachment.detach()
                state.attachments[interface] = nil
                if handingOver, entry.attachment.link != nil, descriptors.isStored(DescriptorStore.tcLinkName(interface)) {
                    logger.info("left the tc_ebpf program attached for the next process: its link is in the service manager's store, forwarding on the last plan", metadata: ["interface": "\(interface)"])
                } else {
                    logger.info("detached tc_ebpf program", metadata: ["interface": "\(interface)"])
                }
            } else {
                state.attachments[interface] = (entry.attachment, entry.users - 1)
            }
        }
        if state.attachments.isEmpty, let program = state.program {
            if handingOver {
                handOverNeighbours(Array(Set(state.neighbours.keys).union(state.inheritedNeighbours)))
            } else {
                for name in TCProgram.mapNames + TCProgram.optionalMapNames { descriptors.remove(DescriptorStore.tcMapName(name)) }
                descriptors.remove(DescriptorStore.tcNeighboursName)
            }
            state.unmatchedBefore = zip(state.unmatchedBefore, Self.unmatchedCounts(program)).map(+)
            state.templateTap?.stop()
            state.templateTap = nil
            state.captureTap?.stop()
            state.captureTap = nil
            // Off before the program can outlive this process (handed over) or its maps close.
            state.routeWatch?.stop()
            state.routeWatch = nil
            program.closeDescriptors()
            state.program = nil
        }
    }

    /// Nil while the program is attached at `interface` (``TCAttachment/attachmentProblem(programID:)``),
    /// else why not.
    func attachmentProblem(interface: String) -> String? {
        state.withLock { state in
            guard let attachment = state.attachments[interface]?.attachment, let program = state.program else {
                return "udp-fanout holds no attachment at \(interface)"
            }
            return attachment.attachmentProblem(programID: program.programID)
        }
    }

    /// Whether the next-hop cache is on (``TCRouteWatch``); nil while no program is loaded.
    func nextHopCacheOn() -> Bool? {
        state.withLock { $0.routeWatch?.on }
    }

    /// Packets counted before any listener could be known, by verdict name.
    /// Totals since the daemon started (programs loaded before this one included); empty while
    /// no program is loaded.
    func unmatched() -> [(String, UInt64)] {
        state.withLock { state in
            guard let program = state.program else { return [] }
            return Array(zip(Self.unmatchedReasons.map(\.label), zip(state.unmatchedBefore, Self.unmatchedCounts(program)).map(+)))
        }
    }

    /// The unmatched verdicts, by label, in the order `unmatchedCounts` returns them.
    static let unmatchedReasons: [(label: String, verdict: fanout_verdict)] = [
        ("malformed", FANOUT_VERDICT_MALFORMED), ("fragment_untracked", FANOUT_VERDICT_FRAGMENT_UNTRACKED), ("not_ours", FANOUT_VERDICT_NOT_OURS),
    ]

    /// What `program` has counted as unmatched, in ``unmatchedReasons`` order.
    private static func unmatchedCounts(_ program: TCProgram) -> [UInt64] {
        let stats = program.listenerStats(id: UInt32(FANOUT_UNMATCHED_STATS))
        return unmatchedReasons.map { stats.verdicts[Int($0.verdict.rawValue)] }
    }

    static func readFirstLine(_ path: String) -> String? {
        guard let file = fopen(path, "r") else { return nil }
        defer { fclose(file) }
        var line = [CChar](repeating: 0, count: 64)
        guard fgets(&line, Int32(line.count), file) != nil else { return nil }
        return String(decoding: line.prefix(while: { $0 != 0 && $0 != 10 }).map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }
}

/// A tc_ebpf listener: an entry in the listeners map and its backend sets. Reloads write the
/// inactive set generation and then flip the listener entry, so no packet sees a half-written set.
final class TCListener: RunningListener {
    let config: Listener
    let counters: ListenerCounters
    private let dataplane: TCDataplane
    private let front: (program: XDPFront, mode: XDPMode)?
    private let program: TCProgram
    private let id: UInt32
    /// The configured interface's index: the listener matches only packets arriving there.
    private let ifindex: UInt32
    private struct Live {
        /// The set generation the listener entry points at; nil before the first write.
        var generation: UInt32?
        /// The listener entry last written (``TCListener/activate()`` writes it again).
        var entry: fanout_listener?
        /// Each downstream's counter slot, kept across reloads while its name stays.
        var slots: [String: UInt16] = [:]
        /// nat: the backends in the live map (weighted members of the current set; with quic_lb
        /// every member), with slots.
        var liveBackends: [SocketAddress: UInt16] = [:]
        /// nat: each current downstream's name by address (the associations listing).
        var names: [SocketAddress: String] = [:]
        /// nat: the reply interfaces this listener holds an attachment at.
        var replyInterfaces: [String] = []
        /// nat: backends that left the set and drain until their time is up (their replies to
        /// their clients still leave from the listener's address), by address.
        var draining: [SocketAddress: Draining] = [:]
        /// nat: backends whose drain ended, oldest first: what they send toward clients is dropped
        /// and counted `drained` until they are in the set again or the listener stops (at most
        /// ``TCListener/goneLimit``).
        var gone: [SocketAddress] = []
        /// The totals of downstreams whose counter slots were given up: they go on under the
        /// name when it comes back (a downstream's counters live as long as the process).
        var retired: [String: BackendTotals] = [:]
        /// Replication pools by name (fanout_pools.h).
        var pools: [String: PoolLive] = [:]
        /// The managed neighbour entries held for the pools' members (``TCDataplane/holdNeighbours(for:)``).
        var neighbours: [TCDataplane.Neighbour] = []
        /// The listener's own downstreams (xdp: their egress interfaces are in the device map),
        /// the pools' members (their next hops' neighbour entries are held), and the route
        /// watch's count of path changes when their routes were last looked up
        /// (``TCDataplane/routeChanges``): a heartbeat after a change looks them up again.
        var routed: [Downstream] = []
        var poolMembers: [Downstream] = []
        var routeChangesSeen: Int?
        /// Counts the updates of `poolMembers`: a heartbeat's neighbour entries for an older
        /// list are given back rather than kept.
        var membersVersion = 0
        /// The neighbour entries were given back (stop) or handed over: none is held again.
        var released = false
        /// quic_lb: the key slots holding a key, by set generation (taken out when that
        /// generation is written again without them, or the listener stops), and the key each
        /// holds; the server IDs written, by generation. nil for a generation: not known (a
        /// listener taken over at a restart: the previous process's may be there).
        var quicKeySlots: [UInt32: [UInt32]] = [:]
        /// quic_lb's configurations as last written.
        var quicLB: [QUICLBConfiguration] = []
        var quicKeyValues: [UInt32: [UInt8]] = [:]
        var quicIDs: [UInt32: [[UInt8]]] = [:]
        /// quic_lb was on in some plan of this listener: its outcomes are shown.
        var quicShown = false
        /// nat: whether the nat entry says quic_lb (FANOUT_NAT_QUIC); nil before the first change.
        var quicNAT: Bool?
    }
    /// A replication pool in the program's maps: its own id (sets, rotation, counters), the set
    /// generation the listener entry points at (its `sources` are under id * 2 + generation), its
    /// members' counter slots, and what its counters were when last added to the pool's metrics (the metrics are the
    /// process's totals, so each instance adds what its maps counted since).
    private struct PoolLive {
        let id: UInt32
        var generation: UInt32?
        var slots: [String: UInt16] = [:]
        var seen = PoolTally()
        var seenMembers: [String: MemberTally] = [:]
    }
    /// A pool's datagram outcomes as its counters have them.
    private struct PoolTally: Equatable {
        var forwarded: UInt64 = 0, dropped: UInt64 = 0, sampledOut: UInt64 = 0, filteredOut: UInt64 = 0
        var noHealthy: UInt64 = 0, ttlExpired: UInt64 = 0, rateLimited: UInt64 = 0
    }
    /// A pool member's copies as its counter slot has them.
    private struct MemberTally {
        var copies: UInt64 = 0, bytes: UInt64 = 0
        var dropped: [String: UInt64] = [:]
    }
    private struct Draining {
        var slot: UInt16
        var name: String
        var until: ContinuousClock.Instant
    }
    /// One downstream's counts in the backend stats map (see struct fanout_backend_stats).
    struct BackendTotals {
        var packets: UInt64 = 0, bytes: UInt64 = 0, noRoute: UInt64 = 0, tooLarge: UInt64 = 0, replies: UInt64 = 0

        mutating func add(_ other: BackendTotals) {
            packets &+= other.packets
            bytes &+= other.bytes
            noRoute &+= other.noRoute
            tooLarge &+= other.tooLarge
            replies &+= other.replies
        }
    }
    /// nat: backends kept marked gone at once per listener (the oldest leaves the map first), and
    /// draining at once (the oldest drain ends first): with the live ones, every nat listener's
    /// entries fit in the shared live map (FANOUT_LIVE_ENTRIES).
    static let goneLimit = Int(FANOUT_MAX_BACKENDS)
    static let drainingLimit = Int(FANOUT_MAX_BACKENDS)
    /// nat: the listener's association map (its descriptor; the program's array holds it at `id`).
    private let associationMap: Int32?
    /// rate_limit: the listener's bucket map (its descriptor; the program's array holds it at `id`).
    private let rateBuckets: Int32?
    private let rateBucketsOpen = Mutex(true)
    /// amplification (nat): the listener's client map (its descriptor; the program's array holds it at `id`).
    private let ampClients: Int32?
    /// nat: the last count of the association map (at most one count per `countInterval`).
    private struct AssociationCount {
        var at: ContinuousClock.Instant?
        var present: Int = 0
        /// created + server_initiated − present, never decreasing (LRU evictions are not counted by
        /// the kernel: this is derived).
        var evicted: UInt64 = 0
    }
    private let associationCount = Mutex(AssociationCount())
    static let countInterval: Duration = .seconds(2)
    private let live = Mutex(Live())
    /// flow_templates: the follower of the program's template-bearing datagrams (nil: off), and
    /// the program's counts of those it did not pass up, as last added to the metrics.
    private let templates: KernelTemplateFollower?
    private let templateCountsSeen: Mutex<TemplateCounts>
    private let logger: Logger
    private let instance = ListenerInstance.next()
    /// Set by shutdown(): a listener being replaced in a reload is no longer judged by the path check.
    private let stopped = Atomic<Bool>(false)

    /// - Parameter front: the xdp kind's XDP program to put in front of the tc program at the
    ///   listener's interfaces (its own and, nat, where replies arrive), in that XDP mode; nil for tc_ebpf.
    init(_ config: Listener, counters: ListenerCounters, dataplane: TCDataplane, front: (program: XDPFront, mode: XDPMode)? = nil, logger: Logger) throws(TCError) {
        self.config = config
        self.counters = counters
        self.dataplane = dataplane
        self.front = front
        self.logger = logger
        let registered = try dataplane.register(config)
        (program, id, ifindex) = (registered.program, registered.id, registered.ifindex)
        if let state = counters.flowTemplates(config) {
            templates = KernelTemplateFollower(listener: config.name, state: state, logger: logger)
        } else {
            templates = nil
        }
        // The program's template counters of this id as they are now (0: a new id is reset, and
        // they are not handed over from a previous process); later counts are added from here.
        templateCountsSeen = Mutex(registered.program.templateCounts(id: registered.id))
        if registered.adopted == nil {
            // A fresh id: resetListener emptied both generations' quic_lb state.
            live.withLock { live in
                (live.quicKeySlots, live.quicIDs) = ([0: [], 1: []], [0: [], 1: []])
            }
        }
        if let adopted = registered.adopted {
            // The previous process's entry: the next set goes to the other generation, and each
            // downstream at the same address keeps its counter slot (its counters go on).
            let slots = Self.slotsByAddress(config.downstreams, previous: program.setSlots(id: id, generation: adopted.generation))
            live.withLock { live in
                live.generation = adopted.generation
                live.slots = slots
            }
        }
        if let front {
            do throws(TCError) {
                try front.program.attach(interface: config.interface ?? "", mode: front.mode, sharing: program)
                do throws(TCError) { try front.program.serve(id: id, name: config.name) } catch {
                    front.program.detach(interface: config.interface ?? "")
                    throw error
                }
            } catch {
                // An id taken over keeps the previous process's state: its plan still forwards.
                if registered.adopted == nil { program.resetListener(id: id) }
                dataplane.unregister(interface: config.interface ?? "", id: id)
                throw error
            }
        }
        // A map step below failed: what the steps before it made goes (the rate_limit maps, the
        // nat association map), then the registration and the XDP front. An id taken over keeps
        // the previous process's state: its plan still forwards.
        let (program, id, adopted, dataplane) = (registered.program, registered.id, registered.adopted != nil, dataplane)
        func undo(rateBuckets: Int32?, associationMap: Int32?) {
            if let rateBuckets, let limit = config.rateLimit {
                program.clearRateLimit(id: id, allow: limit.allow)
                close(rateBuckets)
            }
            if !adopted {
                program.resetListener(id: id)
                if associationMap != nil { dataplane.forgetAssociations(id: id) }
            }
            if let associationMap { close(associationMap) }
            if let front {
                front.program.stopServing(id: id)
                front.program.detach(interface: config.interface ?? "")
            }
            dataplane.unregister(interface: config.interface ?? "", id: id)
        }
        var buckets: Int32?
        if let limit = config.rateLimit {
            do throws(SystemCallError) {
                buckets = try program.putRateLimit(id: id, limit)
            } catch {
                undo(rateBuckets: nil, associationMap: nil)
                throw .maps(error)
            }
        }
        rateBuckets = buckets
        var associations: Int32?
        if config.replies == .nat {
            do throws(SystemCallError) {
                associations = try dataplane.associationMap(id: id, listener: config, program: program, adopted: adopted)
                try program.putNAT(id: id, bind: config.bind, quic: !config.quicLB.isEmpty)
            } catch {
                undo(rateBuckets: buckets, associationMap: associations)
                throw .maps(error)
            }
        }
        associationMap = associations
        var clients: Int32?
        if let cap = config.amplification, config.replies == .nat {
            do throws(SystemCallError) {
                clients = try program.putAmplification(id: id, cap, maxEntries: config.settings.maxAssociations)
            } catch {
                undo(rateBuckets: buckets, associationMap: associations)
                throw .maps(error)
            }
        }
        ampClients = clients
        if config.replies == .nat, registered.adopted != nil {
            // Backends the previous process had live for this listener that this configuration
            // does not have: they drain (or are gone) as if a reload had removed them, keeping
            // their counter slots meanwhile (no new downstream is given one).
            let wanted = Set(config.downstreams.filter { Self.keepsClients($0, quic: !config.quicLB.isEmpty) }.map(\.address))
            let now = ContinuousClock.now
            let previous = program.liveEntries(id: id).filter { !wanted.contains($0.address) }
            live.withLock { live in
                for (address, slot, state) in previous {
                    if state == UInt8(FANOUT_LIVE_GONE) {
                        // Its drain had ended: it stays gone (taken out when the listener stops).
                        if live.gone.count < Self.goneLimit { live.gone.append(address) } else { program.removeLive(address, id: id) }
                    } else if !live.slots.values.contains(slot) {
                        live.slots["\(address)"] = slot
                        startDrain(address, slot: slot, name: "\(address)", now: now, in: &live)
                    } else {
                        program.removeLive(address, id: id)
                    }
                }
            }
        }
        do throws(TCError) {
            if let templates { try dataplane.followTemplates(id: id, templates) }
            try pools(adopting: registered.adopted)
            try apply(downstreams: config.downstreams, balancing: config.balancing, quicLB: config.quicLB, pools: config.pools.map { ($0, $0.downstreams) })
        } catch {
            if templates != nil { dataplane.stopFollowingTemplates(id: id) }
            if registered.adopted == nil {
                program.removeListener(config.bind, ifindex: ifindex, id: id)
                releaseNAT()
                releaseQUIC()
                releaseRateLimit()
            } else {
                // The previous process's entry, sets and associations stay: its plan still forwards.
                if let associationMap { close(associationMap) }
                releaseRateLimit()
            }
            releaseFront()
            dataplane.unregister(interface: config.interface ?? "", id: id)
            throw error
        }
        if config.replies == .nat {
            logger.info("two-way nat listener", metadata: [
                "listener": "\(config.name)", "bind": "\(config.bind)", "max_associations": "\(config.settings.maxAssociations)",
                "reply_interfaces": "\(live.withLock { $0.replyInterfaces }.joined(separator: ","))",
            ])
        }
        var registration: Logger.Metadata = [
            "listener": "\(config.name)", "bind": "\(config.bind)", "interface": "\(config.interface ?? "")",
            "id": "\(id)", "downstreams": "\(config.downstreams.count)", "balancing": "\(config.balancing.rawValue)",
        ]
        if !config.quicLB.isEmpty { registration["quic_lb"] = "\(Self.describe(config.quicLB))" }
        if let limit = config.rateLimit { registration["rate_limit"] = "\(limit)" }
        if let cap = config.amplification { registration["amplification"] = "\(cap)" }
        logger.info("registered listener in eBPF map", metadata: registration)
        counters.setSource(for: ObjectIdentifier(self)) { [weak self] in self?.snapshot() ?? .zero }
        if rateBuckets != nil, let limit = config.rateLimit {
            counters.showRateLimit { @Sendable [weak self] in
                RateLimitStatus(limit: "\(limit)", evicted: nil, topLimited: self?.topLimited(limit) ?? [])
            }
        } else {
            counters.showRateLimit(nil as SourceRateLimiter?)
        }
        // `udp-fanout capture`: a capture running now (or started later) is told to the program.
        let capture = counters.capture
        capture.watch(self, counts: { [weak self] in
            guard let self else { return DropCapture.Counts() }
            return self.dataplane.captureCounts(id: self.id)
        }) { [weak self] filter in
            guard let self, !self.stopped.load(ordering: .relaxed) else { return }
            self.dataplane.capture(id: self.id, capture, filter)
        }
    }

    /// A listener taken over from the previous process keeps its pools' ids (in the order of the
    /// configuration: the previous entry's first pool is the first configured one), their set
    /// generation, rotation, counters and members' counter slots (by address). Pools beyond the
    /// previous entry's get new ids.
    private func pools(adopting entry: fanout_listener?) throws(TCError) {
        guard let entry else { return }
        let previous: [fanout_pool] = withUnsafeBytes(of: entry.pools) { raw in
            (0..<Int(min(entry.pool_count, UInt32(FANOUT_MAX_POOLS)))).map { raw.load(fromByteOffset: $0 * MemoryLayout<fanout_pool>.stride, as: fanout_pool.self) }
        }
        let count = min(previous.count, config.pools.count)
        guard count > 0 else { return }
        dataplane.claim(ids: previous.prefix(count).map(\.id))
        live.withLock { live in
            for (pool, record) in zip(config.pools.prefix(count), previous.prefix(count)) {
                var state = PoolLive(id: record.id)
                state.generation = record.generation
                state.slots = Self.slotsByAddress(pool.downstreams, previous: program.setSlots(id: record.id, generation: record.generation))
                for member in state.slots.keys { state.seenMembers[member] = MemberTally() }
                live.pools[pool.name] = state
            }
        }
    }

    /// The counter slot each of `members` keeps from a previous process's set (`previous`, by
    /// ``TCProgram/backendKey(_:port:)``): a member at an address the set had keeps its slot
    /// (each slot once), so its counters go on.
    private static func slotsByAddress(_ members: [Downstream], previous: [String: UInt16]) -> [String: UInt16] {
        var slots: [String: UInt16] = [:]
        for member in members {
            guard let slot = previous[TCProgram.backendKey(member.address.ip.words, port: member.address.port.bigEndian)],
                  !slots.values.contains(slot) else { continue }
            slots[member.name] = slot
        }
        return slots
    }

    /// Writes the inactive generation, then points the listener entry at it. nat: attaches at
    /// the reply interfaces first, marks new backends live before the flip and takes gone ones
    /// out after it (their clients move on their next datagram), then detaches where no longer needed.
    /// - Parameter keeping: names whose counter slots stay although they get no datagram now
    ///   (members health took out: their counters go on when they come back).
    /// - Parameter pools: the replication pools with their available members: each gets its sets
    ///   and `sources` written under the inactive generation, flipped with the listener's entry.
    /// - Parameter quicLB: the listener's QUIC-LB configurations (empty: off), written for the
    ///   inactive generation with the server IDs of `downstreams` and flipped with the entry.
    private func apply(downstreams: [Downstream], balancing: Balancing, quicLB: [QUICLBConfiguration], pools: [(Pool, [Downstream])], keeping: Set<String> = []) throws(TCError) {
        let nat = config.replies == .nat
        let (held, leaving) = live.withLock { ($0.replyInterfaces, Array($0.liveBackends.keys) + Array($0.draining.keys) + $0.gone) }
        // Also where the draining and gone backends' datagrams arrive: relayed, or counted.
        let wantedInterfaces = nat ? replyInterfaces(for: downstreams, leaving: leaving, quic: !quicLB.isEmpty) : []
        let added = wantedInterfaces.filter { !held.contains($0) }
        try acquireReplyInterfaces(added)
        // Backends marked live by this call: taken out again if the change fails, so a failed
        // change leaves no entry behind that a later listener with this id would inherit.
        var markedLive: [SocketAddress] = []
        // Pools new in this call: their ids go back if the change fails.
        var newPoolIDs: [UInt32] = []
        do throws(SystemCallError) {
            try live.withLock { live throws(SystemCallError) in
                let wanted = Set(downstreams.map(\.name))
                // A draining downstream keeps its slot: its replies are counted there (so do the
                // ones that start to drain now).
                var drainingNames = Set(live.draining.values.map(\.name))
                if nat && config.settings.drainSecs > 0 { drainingNames.formUnion(live.liveBackends.keys.compactMap { live.names[$0] }) }
                var slots = live.slots.filter { wanted.contains($0.key) || keeping.contains($0.key) || drainingNames.contains($0.key) }
                // Slots given up: their totals go on under the name, read once the flip below took
                // every new datagram away from them (or now, for one reused at once), and kept only
                // if the change succeeds.
                var given = live.slots.filter { slots[$0.key] == nil }
                var retiredNow: [(String, BackendTotals)] = []
                var free = (0..<UInt16(FANOUT_MAX_BACKENDS)).filter { slot in !slots.values.contains(slot) && !given.values.contains(slot) }.reversed().map { $0 }
                for downstream in downstreams where slots[downstream.name] == nil {
                    if free.isEmpty, let (name, slot) = given.first {
                        // Slots run short: a given-up one is reused at once.
                        retiredNow.append((name, totals(slot: slot)))
                        given[name] = nil
                        free.append(slot)
                    } else if free.isEmpty, let kept = slots.first(where: { !wanted.contains($0.key) && !drainingNames.contains($0.key) }) {
                        // Then a kept one (health took it out) gives way; a draining one never does.
                        retiredNow.append((kept.key, totals(slot: kept.value)))
                        slots[kept.key] = nil
                        free.append(kept.value)
                    }
                    guard let slot = free.popLast() else { break }
                    program.zeroPerCPU(program.backendStats, key: id * UInt32(FANOUT_MAX_BACKENDS) + UInt32(slot), as: fanout_backend_stats.self)
                    slots[downstream.name] = slot
                }
                var liveBackends: [SocketAddress: UInt16] = [:]
                if nat {
                    // Only weighted members are chosen, so only they keep their clients; with
                    // quic_lb a weight-0 one keeps them too (routed by their IDs).
                    for downstream in downstreams where Self.keepsClients(downstream, quic: !quicLB.isEmpty) {
                        guard let slot = slots[downstream.name] else { continue }
                        liveBackends[downstream.address] = slot
                        if live.liveBackends[downstream.address] == nil { markedLive.append(downstream.address) }
                        try program.putLive(downstream.address, id: id, slot: slot)
                    }
                }
                let generation = live.generation.map { $0 ^ 1 } ?? 0
                let set = BackendSet(downstreams: downstreams, balancing: balancing, slots: slots)
                try program.writeSet(id: id, generation: generation, set)
                try writeQUIC(generation: generation, quicLB: quicLB, downstreams: downstreams, in: &live)
                var entry = fanout_listener()
                entry.id = id
                entry.generation = generation
                entry.policy = balancing == .sourceIP ? FANOUT_POLICY_SOURCE_IP.rawValue : FANOUT_POLICY_ROUND_ROBIN.rawValue
                entry.reserved = (nat ? FANOUT_LISTENER_NAT : 0) | (templates != nil ? FANOUT_LISTENER_TEMPLATES : 0) | (quicLB.isEmpty ? 0 : FANOUT_LISTENER_QUIC)
                    | (rateBuckets != nil ? FANOUT_LISTENER_RATE : 0) | (ampClients != nil ? FANOUT_LISTENER_AMP : 0)
                let prepared = try preparePools(pools, keeping: keeping, newIDs: &newPoolIDs, in: &live)
                entry.pool_count = UInt32(prepared.count)
                withUnsafeMutableBytes(of: &entry.pools) { raw in
                    for (index, pool) in prepared.enumerated() { raw.storeBytes(of: pool.record, toByteOffset: index * MemoryLayout<fanout_pool>.stride, as: fanout_pool.self) }
                }
                // flow_templates: the downstreams that become an exporter's are sent its templates
                // before the flip below puts the set in force.
                let previousPlan = templates?.switchPlan(to: .init(set, downstreams: downstreams.map(\.address), sourceIP: balancing == .sourceIP,
                                                                   pools: prepared.map(\.following)))
                // The entry replaces a previous instance's on the same bind at once (a reload's
                // successor takes over here; that one's shutdown leaves this entry alone).
                do throws(SystemCallError) { try program.putListener(config.bind, ifindex: ifindex, entry) } catch {
                    if let templates { templates.restore(previousPlan ?? nil) }
                    throw error
                }
                live.entry = entry
                live.quicLB = quicLB
                // quic_lb turned on or off by this change: replies follow (after the flip, so a
                // backend answers a client of another only once datagrams are routed by ID).
                if nat, (live.quicNAT ?? !config.quicLB.isEmpty) != !quicLB.isEmpty {
                    do throws(SystemCallError) {
                        try program.putNAT(id: id, bind: config.bind, quic: !quicLB.isEmpty)
                        live.quicNAT = !quicLB.isEmpty
                    } catch {
                        logger.warning("could not mark the nat entry for quic_lb: a backend's datagram to a client associated with another backend is counted wrong_server and dropped until a later change succeeds in marking it", metadata: ["listener": "\(config.name)", "error": "\(error)"])
                    }
                } else if live.quicNAT == nil {
                    live.quicNAT = !config.quicLB.isEmpty
                }
                commitPools(prepared, in: &live)
                for (name, slot) in given { retiredNow.append((name, totals(slot: slot))) }
                for (name, counted) in retiredNow { live.retired[name, default: BackendTotals()].add(counted) }
                // Gone from the set: they drain (no new client; their replies in flight still
                // reach their clients from the listener's address), then are gone.
                let now = ContinuousClock.now
                for (address, slot) in live.liveBackends where liveBackends[address] == nil {
                    startDrain(address, slot: slot, name: live.names[address] ?? "\(address)", now: now, in: &live)
                }
                for address in liveBackends.keys {
                    live.draining[address] = nil
                    live.gone.removeAll { $0 == address }
                }
                live.generation = generation
                live.slots = slots
                live.liveBackends = liveBackends
                live.names = Dictionary(downstreams.map { ($0.address, $0.name) }, uniquingKeysWith: { first, _ in first })
                live.replyInterfaces = wantedInterfaces
            }
        } catch {
            // Back as they were: a backend that was draining or gone is marked so again; new
            // pools' ids go back (nothing points at them).
            for id in newPoolIDs { dataplane.releasePoolID(id) }
            live.withLock { live in
                for address in markedLive {
                    if let draining = live.draining[address] {
                        _ = mark(address, slot: draining.slot, FANOUT_LIVE_DRAINING, taking: true)
                    } else if live.gone.contains(address) {
                        _ = mark(address, slot: 0, FANOUT_LIVE_GONE, taking: true)
                    } else {
                        program.removeLive(address, id: id)
                    }
                }
            }
            releaseReplyInterfaces(added)
            throw .maps(error)
        }
        releaseReplyInterfaces(held.filter { !wantedInterfaces.contains($0) })
        // Looked up again at the heartbeat after the kernel's routing changed (heartbeats()).
        let members = pools.flatMap { $0.1 }
        let changes = dataplane.routeChanges
        live.withLock { live in
            live.routed = downstreams
            live.poolMembers = members
            live.membersVersion += 1
            live.routeChangesSeen = changes
        }
        // xdp: the interfaces toward the downstreams that take XDP frames (not the pools'
        // members: XDP passes a listener's datagrams to tc when it has pools, which copies them).
        front?.program.route(toward: downstreams)
        // The pools' next hops resolved from now on; those no longer needed given back after.
        let neighbours = dataplane.holdNeighbours(for: members)
        dataplane.releaseNeighbours(live.withLock { live in
            defer { live.neighbours = neighbours }
            return live.neighbours
        })
        warnUnroutable(downstreams + pools.flatMap { $0.1 })
    }

    /// quic_lb for set generation `generation` (not in force yet): its configurations, each
    /// downstream's server ID at its index in the set, and the keys (made by the kernel; a key
    /// slot this generation no longer uses is emptied, one that keeps its key is left as it is).
    /// What an earlier change left under this generation is taken out first.
    private func writeQUIC(generation: UInt32, quicLB: [QUICLBConfiguration], downstreams: [Downstream], in live: inout Live) throws(SystemCallError) {
        let setKey = id * 2 + generation
        // Not written by this process yet (a listener taken over at a restart): any slot of this
        // generation may hold the previous process's key, and any server ID be there.
        let held = live.quicKeySlots[generation] ?? (0..<UInt32(FANOUT_QUIC_CONFIGS)).map { setKey * UInt32(FANOUT_QUIC_CONFIGS) + $0 }
        if let written = live.quicIDs[generation] {
            for serverID in written { program.deleteQUICID(setKey: setKey, serverID) }
        } else {
            program.clearQUICIDs(setKey: setKey)
        }
        live.quicIDs[generation] = []
        try program.writeQUICConfigs(setKey: setKey, quicLB)
        var keySlots: [UInt32] = []
        for configuration in quicLB {
            guard let key = configuration.key else { continue }
            let slot = setKey * UInt32(FANOUT_QUIC_CONFIGS) + UInt32(configuration.configID)
            keySlots.append(slot)
            // The kernel's context of this very key is there already (health and discovery
            // changes write the set again, not the keys).
            if held.contains(slot), live.quicKeyValues[slot] == key { continue }
            live.quicKeyValues[slot] = nil
            do throws(SystemCallError) { try program.setQUICKey(slot: slot, key) } catch {
                live.quicKeySlots[generation] = Array(Set(held + keySlots))
                let hint = error.errno == EOPNOTSUPP ? "use plaintext server IDs here, or Linux 6.10 or later" : "check that the kernel has ecb(aes) (/proc/crypto, module aes), or use plaintext server IDs"
                throw SystemCallError(call: "listener \(config.name): quic_lb config \(configuration.configID)'s key into the kernel (\(error.call)); \(hint)", errno: error.errno)
            }
            live.quicKeyValues[slot] = key
        }
        // Slots this generation no longer uses give their key back; one that cannot stays
        // tracked (emptied again at the next change or the listener's stop), said.
        var kept = keySlots
        for slot in held where !keySlots.contains(slot) {
            live.quicKeyValues[slot] = nil
            do throws(SystemCallError) { try program.setQUICKey(slot: slot, nil) } catch {
                kept.append(slot)
                logger.warning("could not take a quic_lb key no longer configured out of the kernel; tried again at the next change and at the listener's stop", metadata: ["listener": "\(config.name)", "error": "\(error)"])
            }
        }
        live.quicKeySlots[generation] = kept
        guard !quicLB.isEmpty else { return }
        for (index, downstream) in downstreams.enumerated() {
            guard let serverID = downstream.serverID else { continue }
            try program.putQUICID(setKey: setKey, serverID, index: UInt32(index))
            live.quicIDs[generation, default: []].append(serverID)
        }
        live.quicShown = true
    }

    /// A pool made ready for the flip: its record in the listener entry, and its state after it.
    private struct PreparedPool {
        let name: String
        let record: fanout_pool
        let state: PoolLive
        /// The pool as flow_templates' follower sees it (its set, `sample` and `sources`).
        let following: KernelTemplateFollower.Plan.Pool
        /// Members this change takes out, with their counter slots: the set in force sends them
        /// copies until the flip, so their last counts are read after it (and the slots are not
        /// given to a new member in the same change).
        let leaving: [String: UInt16]
    }

    /// Writes each pool's members (the inactive generation of its set, with counter slots) and
    /// `sources` (under the inactive generation's key); a pool new to this listener gets an id
    /// (appended to `newIDs`). Nothing the program reads changes until the listener entry flips.
    private func preparePools(_ pools: [(Pool, [Downstream])], keeping: Set<String>, newIDs: inout [UInt32], in live: inout Live) throws(SystemCallError) -> [PreparedPool] {
        var prepared: [PreparedPool] = []
        for (pool, members) in pools {
            var state: PoolLive
            if live.pools[pool.name] != nil {
                // What its counters hold now goes to the metrics first (a member slot may be reused below).
                pumpPool(pool.name, &live.pools[pool.name]!)
                state = live.pools[pool.name]!
            } else {
                do throws(TCError) {
                    state = PoolLive(id: try dataplane.poolID())
                } catch {
                    throw SystemCallError(call: "tc_ebpf pool '\(pool.name)': \(error)", errno: ENOSPC)
                }
                newIDs.append(state.id)
            }
            let everyMember = pool.balancing == .all
            // An `all` pool copies to each member with a weight: only those are in its set.
            let inSet = everyMember ? members.filter { $0.weight > 0 } : members
            let wanted = Set(members.map(\.name))
            var slots = state.slots.filter { wanted.contains($0.key) || keeping.contains($0.key) }
            let leaving = state.slots.filter { slots[$0.key] == nil }
            var free = (0..<UInt16(FANOUT_MAX_BACKENDS)).filter { !slots.values.contains($0) && !leaving.values.contains($0) }.reversed().map { $0 }
            for member in members where slots[member.name] == nil {
                guard let slot = free.popLast() else { break }
                program.zeroPerCPU(program.backendStats, key: state.id * UInt32(FANOUT_MAX_BACKENDS) + UInt32(slot), as: fanout_backend_stats.self)
                slots[member.name] = slot
                state.seenMembers[member.name] = MemberTally()
            }
            let generation = state.generation.map { $0 ^ 1 } ?? 0
            let balancing: Balancing = pool.balancing.single ?? .roundRobin
            let set = BackendSet(downstreams: inSet, balancing: balancing, slots: slots)
            try program.writeSet(id: state.id, generation: generation, set)
            let key = state.id * 2 + generation
            // Whatever an earlier change left under this generation's key (one that failed half way
            // too), then the new prefixes.
            program.clearPoolSources(key: key)
            try program.writePoolSources(key: key, pool.sources)
            var record = fanout_pool()
            record.id = state.id
            record.generation = generation
            record.policy = everyMember ? FANOUT_POLICY_ALL.rawValue : balancing == .sourceIP ? FANOUT_POLICY_SOURCE_IP.rawValue : FANOUT_POLICY_ROUND_ROBIN.rawValue
            record.sample = UInt32(pool.sample)
            record.flags = pool.sources.isEmpty ? 0 : FANOUT_POOL_SOURCES
            state.slots = slots
            state.generation = generation
            let following = KernelTemplateFollower.Plan.Pool(
                set: .init(set, downstreams: inSet.map(\.address), sourceIP: !everyMember && balancing == .sourceIP),
                sample: UInt32(pool.sample), prefixes: pool.sources)
            prepared.append(PreparedPool(name: pool.name, record: record, state: state, following: following, leaving: leaving))
        }
        return prepared
    }

    /// After the flip: the pools' new state; the previous generation's `sources` of each pool
    /// taken out; pools no longer configured give their id back (their counts added first).
    private func commitPools(_ prepared: [PreparedPool], in live: inout Live) {
        var kept: [String: PoolLive] = [:]
        for pool in prepared {
            if let previous = live.pools[pool.name], let generation = previous.generation {
                program.clearPoolSources(key: previous.id * 2 + generation)
            }
            var state = pool.state
            // What the members taken out were sent until the flip, to their counters.
            pumpMembers(pool.name, pool.leaving, &state)
            for name in pool.leaving.keys { state.seenMembers[name] = nil }
            kept[pool.name] = state
        }
        for (name, var gone) in live.pools where kept[name] == nil {
            releasePool(name, &gone)
        }
        live.pools = kept
    }

    /// A pool leaves the program: its last counts to the metrics, its `sources` out, its id back.
    private func releasePool(_ name: String, _ pool: inout PoolLive) {
        pumpPool(name, &pool)
        // Both generations: a change that failed half way may have written the other.
        program.clearPoolSources(key: pool.id * 2)
        program.clearPoolSources(key: pool.id * 2 + 1)
        dataplane.releasePoolID(pool.id)
    }

    /// Adds what a pool's counters (and its members' slots) counted since the last time to the
    /// pool's metrics: datagrams by outcome, drops by reason (datagrams with no member or whose TTL
    /// ran out, and copies dropped: fanout_pools.h), and each member's copies.
    private func pumpPool(_ name: String, _ pool: inout PoolLive) {
        let counters = self.counters.pool(name)
        let read = program.poolStats(id: pool.id)
        func verdict(_ value: fanout_verdict) -> UInt64 { read.verdicts[Int(value.rawValue)] }
        let forwarded = verdict(FANOUT_VERDICT_FORWARDED) &+ verdict(FANOUT_VERDICT_FORWARDED_NEIGH)
        // rate_limit: the listener's limited datagrams, counted offered and dropped at the pool's id.
        let limited = config.rateLimit == nil ? 0 : program.rateCounts(id: pool.id).limited
        let now = PoolTally(
            forwarded: forwarded, dropped: (read.verdicts.reduce(0, &+) &- forwarded) &+ limited,
            sampledOut: read.sampledOut, filteredOut: read.filteredOut,
            noHealthy: verdict(FANOUT_VERDICT_NO_BACKEND), ttlExpired: verdict(FANOUT_VERDICT_TTL_EXPIRED), rateLimited: limited)
        // A counter below what was seen was zeroed in between (a slot reused): all it holds is new.
        func since(_ now: UInt64, _ before: UInt64) -> UInt64 { now >= before ? now - before : now }
        let before = pool.seen
        self.counters.add(counters.forwarded, since(now.forwarded, before.forwarded))
        self.counters.add(counters.dropped, since(now.dropped, before.dropped))
        self.counters.add(counters.sampledOut, since(now.sampledOut, before.sampledOut))
        self.counters.add(counters.filteredOut, since(now.filteredOut, before.filteredOut))
        counters.addDrops("no_healthy", since(now.noHealthy, before.noHealthy))
        counters.addDrops(DropReason.ttlExpired.rawValue, since(now.ttlExpired, before.ttlExpired))
        counters.addDrops(DropReason.rateLimited.rawValue, since(now.rateLimited, before.rateLimited))
        pool.seen = now
        pumpMembers(name, pool.slots, &pool)
    }

    /// Adds what `members`' counter slots counted since the last time to their metrics.
    private func pumpMembers(_ name: String, _ members: [String: UInt16], _ pool: inout PoolLive) {
        let counters = self.counters.pool(name)
        func since(_ now: UInt64, _ before: UInt64) -> UInt64 { now >= before ? now - before : now }
        for (member, slot) in members {
            let counted = program.memberStats(id: pool.id, slot: slot)
            let seen = pool.seenMembers[member] ?? MemberTally()
            let memberCounters = counters.member(member)
            memberCounters.forwarded.wrappingAdd(since(counted.copies, seen.copies), ordering: .relaxed)
            memberCounters.bytes.wrappingAdd(since(counted.bytes, seen.bytes), ordering: .relaxed)
            var copiesDropped: UInt64 = 0
            for (reason, count) in counted.dropped {
                let delta = since(count, seen.dropped[reason] ?? 0)
                counters.addMemberDrops(member, reason, delta)
                copiesDropped &+= delta
            }
            memberCounters.dropped.wrappingAdd(copiesDropped, ordering: .relaxed)
            pool.seenMembers[member] = MemberTally(copies: counted.copies, bytes: counted.bytes, dropped: counted.dropped)
        }
    }

    /// Every pool's counts since the last time, to the metrics (a scrape, a stop).
    private func pumpPools() {
        live.withLock { live in
            for name in Array(live.pools.keys) { pumpPool(name, &live.pools[name]!) }
        }
    }

    /// Where the downstreams' replies arrive: `settings.reply_interfaces`, else the interfaces the
    /// kernel routes the weighted downstreams through (a downstream without a route is warned
    /// about by warnUnroutable), and the backends that left the set (`leaving`: draining, gone).
    private func replyInterfaces(for downstreams: [Downstream], leaving: [SocketAddress], quic: Bool) -> [String] {
        if !config.settings.replyInterfaces.isEmpty { return config.settings.replyInterfaces }
        var names: [String] = []
        let current = Set(downstreams.filter { Self.keepsClients($0, quic: quic) }.map(\.address))
        for address in leaving where !current.contains(address) {
            if let name = TCRoute.interface(to: address.ip), !names.contains(name) { names.append(name) }
        }
        for downstream in downstreams where Self.keepsClients(downstream, quic: quic) {
            guard let name = TCRoute.interface(to: downstream.address.ip) else {
                logger.warning("replies nat: no interface routes to this downstream, so its replies are not watched (they would leave with its own address); add a route or set settings.reply_interfaces", metadata: [
                    "listener": "\(config.name)", "downstream": "\(downstream.name)", "address": "\(downstream.address)",
                ])
                continue
            }
            if !names.contains(name) { names.append(name) }
        }
        return names
    }

    /// What a counter slot has counted.
    private func totals(slot: UInt16) -> BackendTotals {
        let counted = program.backendStats(id: id, slot: slot)
        return BackendTotals(packets: counted.packets, bytes: counted.bytes, noRoute: counted.noRoute, tooLarge: counted.tooLarge, replies: counted.replies)
    }

    /// A backend left the set: it drains for `settings.drain_secs`, then is gone. An entry
    /// another listener owns now (the downstream moved to it in the same reload) is left alone.
    private func startDrain(_ address: SocketAddress, slot: UInt16, name: String, now: ContinuousClock.Instant, in live: inout Live) {
        let drain = Duration.seconds(config.settings.drainSecs)
        guard drain > .zero else {
            logger.info("downstream left the set (settings.drain_secs 0): what it still sends toward clients is dropped and counted drained", metadata: [
                "listener": "\(config.name)", "downstream": "\(name)", "address": "\(address)",
            ])
            return markGone(address, slot: slot, in: &live)
        }
        // Bounded (the live map is shared by every nat listener): the oldest drain ends first.
        if live.draining.count >= Self.drainingLimit, let oldest = live.draining.min(by: { $0.value.until < $1.value.until }) {
            live.draining[oldest.key] = nil
            markGone(oldest.key, slot: oldest.value.slot, in: &live)
            logger.warning("more downstreams draining than settings allow at once: the oldest drain ended early", metadata: [
                "listener": "\(config.name)", "downstream": "\(oldest.value.name)", "limit": "\(Self.drainingLimit)",
            ])
        }
        guard mark(address, slot: slot, FANOUT_LIVE_DRAINING) else { return }
        live.draining[address] = Draining(slot: slot, name: name, until: now + drain)
        logger.info("downstream draining: no new clients; its replies to its clients are relayed until settings.drain_secs passes", metadata: [
            "listener": "\(config.name)", "downstream": "\(name)", "address": "\(address)", "drain_secs": "\(config.settings.drainSecs)",
        ])
        scheduleDrainEnd(after: drain)
    }

    /// A timer per removal (not per datagram); a stopped listener's fires and does nothing.
    private func scheduleDrainEnd(after delay: Duration) {
        let milliseconds = Int(delay.components.seconds * 1000 + delay.components.attoseconds / 1_000_000_000_000_000) + 1
        DispatchQueue.global().asyncAfter(deadline: .now() + .milliseconds(milliseconds)) { [weak self] in
            self?.endDrains()
        }
    }

    /// Marks the drains whose time is up gone.
    private func endDrains() {
        live.withLock { live in
            // Checked under the lock: a stopping listener's releaseNAT takes every entry out after.
            guard !stopped.load(ordering: .relaxed) else { return }
            let now = ContinuousClock.now
            for (address, draining) in live.draining where draining.until <= now {
                live.draining[address] = nil
                markGone(address, slot: draining.slot, in: &live)
                logger.info("downstream drained: what it still sends toward clients is dropped and counted (replies_dropped_total reason drained)", metadata: [
                    "listener": "\(config.name)", "downstream": "\(draining.name)", "address": "\(address)",
                ])
            }
            // A timer that fired early (its clock and ours differ) leaves none behind.
            if let next = live.draining.values.map(\.until).min() { scheduleDrainEnd(after: next - now) }
        }
    }

    /// The backend's drain ended: its datagrams toward clients are dropped and counted.
    private func markGone(_ address: SocketAddress, slot: UInt16, in live: inout Live) {
        guard mark(address, slot: slot, FANOUT_LIVE_GONE) else { return }
        live.gone.removeAll { $0 == address }
        live.gone.append(address)
        if live.gone.count > Self.goneLimit { program.removeLive(live.gone.removeFirst(), id: id) }
    }

    /// Marks a backend that left the set draining or gone. - Returns: false if its entry is
    /// another listener's now (nothing written), or could not be written: then it is taken out,
    /// said in a warning (what it sends then passes with its own address, uncounted).
    /// - Parameter taking: write the entry even where it is not this listener's (a failed change
    ///   puts back what it overwrote).
    private func mark(_ address: SocketAddress, slot: UInt16, _ state: Int32, taking: Bool = false) -> Bool {
        do throws(SystemCallError) {
            if taking {
                try program.putLive(address, id: id, slot: slot, state: state)
                return true
            }
            return try program.setLiveState(address, id: id, slot: slot, state: state)
        } catch {
            program.removeLive(address, id: id)
            logger.warning("could not mark a downstream that left the set \(state == FANOUT_LIVE_DRAINING ? "draining" : "gone"): what it still sends leaves with its own address and is not counted", metadata: [
                "listener": "\(config.name)", "address": "\(address)", "error": "\(error)",
            ])
            return false
        }
    }

    /// quic_lb: the keys out of the kernel, and the configurations and server IDs out of the
    /// maps (both generations: the entry naming them is gone).
    private func releaseQUIC() {
        let keySlots = live.withLock { live in
            defer { (live.quicKeySlots, live.quicKeyValues, live.quicIDs) = ([:], [:], [:]) }
            return live.quicKeySlots
        }
        // A generation this process never wrote (taken over at a restart) may hold the previous
        // process's keys in any slot.
        for generation: UInt32 in 0...1 { program.clearQUIC(setKey: id * 2 + generation, keySlots: keySlots[generation]) }
    }

    /// rate_limit: the listener's configuration, buckets and allow prefixes out of the maps
    /// (the program limits nothing for its id from then on), and the bucket map's descriptor closed.
    private func releaseRateLimit() {
        if let ampClients {
            program.clearAmplification(id: id)
            close(ampClients)
        }
        guard let rateBuckets, let limit = config.rateLimit else { return }
        program.clearRateLimit(id: id, allow: limit.allow)
        closeRateBuckets(rateBuckets)
    }

    /// Closes the bucket map's descriptor once (a /status reading duplicates it under the lock).
    private func closeRateBuckets(_ fd: Int32) {
        rateBucketsOpen.withLock { open in
            guard open else { return }
            open = false
            close(fd)
        }
    }

    /// /status's top limited sources, read from a duplicate of the bucket map's descriptor
    /// (taken while it is open: the walk does not hold up a stop).
    private func topLimited(_ limit: RateLimit) -> [LimitedSource] {
        guard let rateBuckets else { return [] }
        let fd = rateBucketsOpen.withLock { open in open ? fcntl(rateBuckets, F_DUPFD_CLOEXEC, 0) : -1 }
        guard fd >= 0 else { return [] }
        defer { close(fd) }
        return TCProgram.topLimited(fd, ipv4Length: limit.ipv4PrefixLength, ipv6Length: limit.ipv6PrefixLength,
                                    count: RateLimitStatus.topCount, maxEntries: limit.maxSources)
    }

    /// Takes the listener's nat state out of the maps: live, draining and gone backends, its
    /// address, its association map; detaches at its reply interfaces.
    private func releaseNAT() {
        guard let associationMap else { return }
        let (backends, interfaces) = live.withLock { live in
            defer { live.liveBackends = [:]; live.draining = [:]; live.gone = []; live.replyInterfaces = [] }
            return (Array(live.liveBackends.keys) + Array(live.draining.keys) + live.gone, live.replyInterfaces)
        }
        for address in backends { program.removeLive(address, id: id) }
        do throws(SystemCallError) {
            try program.putNAT(id: id, bind: nil)
        } catch {
            // The listener's live entries are gone already, so nothing is NATed for it any more.
            logger.warning("could not clear the nat listener's address from the map", metadata: ["listener": "\(config.name)", "error": "\(error)"])
        }
        program.removeAssociations(id: id)
        dataplane.forgetAssociations(id: id)
        close(associationMap)
        releaseReplyInterfaces(interfaces)
    }

    /// Attaches at a nat listener's reply interfaces: the tc program and (xdp) the XDP program in
    /// front of it. On an error none of `interfaces` is held.
    private func acquireReplyInterfaces(_ interfaces: [String]) throws(TCError) {
        try dataplane.acquireReplyInterfaces(interfaces, for: config)
        guard let front else { return }
        var held: [String] = []
        for interface in interfaces {
            do throws(TCError) {
                try front.program.attach(interface: interface, mode: front.mode, sharing: program)
                held.append(interface)
            } catch {
                for done in held { front.program.detach(interface: done) }
                dataplane.releaseReplyInterfaces(interfaces)
                throw error
            }
        }
    }

    /// One user fewer at each reply interface, XDP first (it passes to tc, never the reverse).
    private func releaseReplyInterfaces(_ interfaces: [String]) {
        if let front {
            for interface in interfaces { front.program.detach(interface: interface) }
        }
        dataplane.releaseReplyInterfaces(interfaces)
    }

    /// xdp: no longer served at XDP, and one user fewer of the XDP attachment at the interface.
    private func releaseFront() {
        guard let front else { return }
        front.program.stopServing(id: id)
        front.program.detach(interface: config.interface ?? "")
    }

    /// quic_lb's configurations as logs show them (layouts and algorithms, never a key).
    static func describe(_ quicLB: [QUICLBConfiguration]) -> String { quicLB.map(\.description).joined(separator: "; ") }

    /// nat: a downstream that keeps its clients (live in the kernel): a weighted one, or with
    /// quic_lb any (a weight-0 one gets no new client, but its connections reach it by ID, and
    /// its replies leave from the listener's address).
    static func keepsClients(_ downstream: Downstream, quic: Bool) -> Bool { downstream.weight > 0 || quic }

    /// A downstream the kernel has no route to loses every datagram sent its way (counted
    /// no_route): say so at start and at each reload, not only in a counter.
    private func warnUnroutable(_ downstreams: [Downstream]) {
        for downstream in downstreams where TCListener.keepsClients(downstream, quic: !config.quicLB.isEmpty) {
            guard let problem = TCRoute.problem(to: downstream.address.ip) else { continue }
            logger.warning("no route to downstream: its datagrams are dropped and counted no_route until a route exists (ip route get \(downstream.address.ip))", metadata: [
                "listener": "\(config.name)", "downstream": "\(downstream.name)", "address": "\(downstream.address)", "problem": "\(problem)",
            ])
        }
    }

    var isReceiving: Bool { true }

    /// Takes the bind back after a failed change whose new instance had taken it over: writes
    /// this instance's listener entry and (nat) its backends' live, draining and gone entries
    /// again, before that instance stops (its stop then leaves them alone).
    func activate() throws(DaemonError) {
        do throws(SystemCallError) {
            try live.withLock { live throws(SystemCallError) in
                guard let entry = live.entry else { return }
                // flow_templates: the set this instance had is the program's again.
                templates?.reassert()
                try program.putListener(config.bind, ifindex: ifindex, entry)
                for (address, slot) in live.liveBackends { try program.putLive(address, id: id, slot: slot) }
                for (address, draining) in live.draining { try program.putLive(address, id: id, slot: draining.slot, state: FANOUT_LIVE_DRAINING) }
                for address in live.gone { try program.putLive(address, id: id, slot: 0, state: FANOUT_LIVE_GONE) }
            }
        } catch {
            throw .listener(name: config.name, TCError.maps(error))
        }
    }

    /// A reload's successor writes its entry over this one's: a handover with no gap.
    var takesOverExactly: Bool { true }

    /// The pools' next hops after a path changed: a member whose route moved gets a managed
    /// neighbour entry at its new next hop (a copy cannot wait for the kernel to resolve one:
    /// no_neighbour), and the entries no longer needed are given back. What was held for an
    /// older member list (a reload meanwhile), or once the listener stopped, is given back.
    private func holdNeighboursAgain(for members: [Downstream], version: Int) {
        let held = dataplane.holdNeighbours(for: members)
        let giveBack = live.withLock { live -> [TCDataplane.Neighbour] in
            guard !live.released, live.membersVersion == version else { return held }
            defer { live.neighbours = held }
            return live.neighbours
        }
        dataplane.releaseNeighbours(giveBack)
    }

    /// The kernel forwards; the watchdog checks that our program is still attached.
    func heartbeats() -> [PathHeartbeat] {
        guard !stopped.load(ordering: .relaxed) else { return [] }
        let interface = config.interface ?? ""
        // Routes that may have moved since: look them up again.
        let changes = dataplane.routeChanges
        let moved = live.withLock { live -> (routed: [Downstream], members: [Downstream], version: Int)? in
            guard changes != live.routeChangesSeen else { return nil }
            live.routeChangesSeen = changes
            return (live.routed, live.poolMembers, live.membersVersion)
        }
        if let moved {
            // xdp: an interface a route moved to joins the device map if it takes XDP frames
            // (until then its datagrams go through tc, counted no_xdp_xmit).
            front?.program.route(toward: moved.routed)
            if !moved.members.isEmpty { holdNeighboursAgain(for: moved.members, version: moved.version) }
        }
        front?.program.recheckDevices()
        let problem = dataplane.attachmentProblem(interface: interface) ?? front?.program.attachmentProblem(interface: interface)
        // A reload may have stopped it (and detached) during the query: not a stall.
        guard !stopped.load(ordering: .relaxed) else { return [] }
        return [PathHeartbeat(listener: config.name, instance: instance, beat: .kernel(interface: interface, problem: problem))]
    }

    func update(downstreams: [Downstream], balancing: Balancing, quicLB: [QUICLBConfiguration], pools: [Pool], keeping: Set<String>) -> Bool {
        do throws(TCError) {
            let own = downstreams.filter { $0.pool == nil }
            let before = live.withLock { $0.quicLB }
            try apply(downstreams: own, balancing: balancing, quicLB: quicLB, pools: pools.map { pool in (pool, downstreams.filter { $0.pool == pool.name }) }, keeping: keeping)
            var metadata: Logger.Metadata = ["listener": "\(config.name)", "downstreams": "\(downstreams.count)"]
            // A change of quic_lb (a key rotation, another layout) is said, never the key.
            if Set(before) != Set(quicLB) {
                metadata["quic_lb"] = "\(quicLB.isEmpty ? "off" : Self.describe(quicLB))"
                if before.count == quicLB.count, zip(before, quicLB).allSatisfy({ $0.description == $1.description }) { metadata["quic_lb_keys"] = "changed" }
            }
            logger.info("updated \(config.mode.rawValue) downstream set", metadata: metadata)
            return true
        } catch {
            logger.error("could not update the \(config.mode.rawValue) downstream set; the previous set stays (counted in udp_fanout_membership_update_failures_total; the next change tries again)", metadata: ["listener": "\(config.name)", "error": "\(error)"])
            return false
        }
    }

    func shutdown() {
        stopped.store(true, ordering: .relaxed)
        counters.capture.unwatch(self)
        dataplane.capture(id: id, counters.capture, nil)
        if templates != nil {
            dataplane.stopFollowingTemplates(id: id)
            pumpTemplateCounts()
        }
        if dataplane.handingOver {
            handOverToNextProcess()
            return
        }
        // Only this instance's entry: a successor on the same bind has overwritten it already.
        program.removeListener(config.bind, ifindex: ifindex, id: id)
        releaseNAT()
        releaseQUIC()
        releaseRateLimit()
        // Its pools' last counts, and their ids back (no entry names them now).
        let neighbours = live.withLock { live in
            for (name, var pool) in live.pools { releasePool(name, &pool) }
            live.pools = [:]
            live.released = true
            defer { live.neighbours = [] }
            return live.neighbours
        }
        dataplane.releaseNeighbours(neighbours)
        // Its last counts, once nothing new reaches it, and before its id (and stats slot) is free.
        counters.freeze(ObjectIdentifier(self))
        releaseFront()
        dataplane.unregister(interface: config.interface ?? "", id: id)
    }

    /// The process stops and hands its data path over (docs/restarts.md): the maps keep this
    /// listener's entry, sets, associations and neighbour entries, so the program, held attached
    /// by the service manager's copy of its link, forwards on this plan until the next process
    /// replaces it; only this process's descriptors close.
    private func handOverToNextProcess() {
        counters.freeze(ObjectIdentifier(self))
        if let associationMap { close(associationMap) }
        // The program this process loaded keeps its own rate_limit maps until the next process's
        // replaces it; only the descriptor closes.
        if let rateBuckets { closeRateBuckets(rateBuckets) }
        if let ampClients { close(ampClients) }
        let interfaces = live.withLock { live in
            live.released = true
            defer { live.replyInterfaces = []; live.neighbours = [] }
            return live.replyInterfaces
        }
        releaseReplyInterfaces(interfaces)
        releaseFront()
        dataplane.unregister(interface: config.interface ?? "", id: id)
    }

    /// flow_templates: the program's counts of listener `id` (struct fanout_template_stats).
    typealias TemplateCounts = (captured: UInt64, tooLarge: UInt64, ringFull: UInt64, fragmented: UInt64, setsUnread: UInt64)

    /// Adds what the program counted since the last call to the listener's template metrics
    /// (which live as long as the process; this instance's id counts from its start).
    private func pumpTemplateCounts() {
        guard let state = templates?.state else { return }
        let now = program.templateCounts(id: id)
        templateCountsSeen.withLock { seen in
            func since(_ now: UInt64, _ before: UInt64) -> UInt64 { now >= before ? now - before : now }
            state.kernelPassedUp.add(since(now.captured, seen.captured), ordering: .relaxed)
            state.kernelTooLarge.add(since(now.tooLarge, seen.tooLarge), ordering: .relaxed)
            state.kernelRingFull.add(since(now.ringFull, seen.ringFull), ordering: .relaxed)
            state.kernelFragmented.add(since(now.fragmented, seen.fragmented), ordering: .relaxed)
            state.kernelSetsUnread.add(since(now.setsUnread, seen.setsUnread), ordering: .relaxed)
            seen = now
        }
    }

    /// nat: the clients in the association map (at most `limit`) with their downstream's name,
    /// or its address when it is no longer in the set, and how many there are.
    func associations(limit: Int) -> (entries: [AssociationEntry], total: Int)? {
        guard let associationMap, !stopped.load(ordering: .relaxed) else { return nil }
        // The first `limit` entries only; the total is the kernel's count, not a read of the whole map.
        let listed = TCProgram.associationEntries(associationMap, limit: limit, maximum: limit)
        let total = program.countAssociations(associationMap, maximum: config.settings.maxAssociations)
        let names = live.withLock { live in live.names.merging(live.draining.mapValues(\.name)) { current, _ in current } }
        return (listed.entries.map { AssociationEntry(client: $0.client, downstream: names[$0.backend] ?? "\($0.backend)") }, max(total, listed.entries.count))
    }

    /// nat: the reply direction's counters, the association events and the number present.
    private func twoWaySnapshot(slots: [String: UInt16], retired: [String: BackendTotals]) -> TwoWaySnapshot {
        let nat = program.natStats(id: id)
        var snapshot = TwoWaySnapshot()
        snapshot.replies = nat.verdict(FANOUT_VERDICT_REPLIED)
        snapshot.replyBytes = nat.replyBytes
        snapshot.replyDropped = [
            .wrongServer: nat.verdict(FANOUT_VERDICT_WRONG_SERVER), .noRoute: nat.verdict(FANOUT_VERDICT_NO_ROUTE),
            .ttlExpired: nat.verdict(FANOUT_VERDICT_TTL_EXPIRED), .tooLarge: nat.verdict(FANOUT_VERDICT_TOO_LARGE),
            .rewriteFailed: nat.verdict(FANOUT_VERDICT_REWRITE_FAILED), .drained: nat.verdict(FANOUT_VERDICT_DRAINED),
        ]
        let made = nat.created + nat.serverInitiated
        let counted = associationCount.withLock { count in
            let now = ContinuousClock.now
            if let associationMap, !stopped.load(ordering: .relaxed), count.at.map({ now - $0 >= Self.countInterval }) ?? true {
                count.present = program.countAssociations(associationMap, maximum: config.settings.maxAssociations)
                if let refusal = program.takeCounterRefusal() {
                    logger.notice("nat associations are counted by reading the association map in batches (about a third of a second of CPU per 1,048,576, at most once every 2 s), as the kernel refused the counting iterator (bpf/map_count.bpf.c needs Linux 6.6 or later with BTF, and CAP_BPF with CAP_PERFMON)",
                                  metadata: ["listener": "\(config.name)", "error": "\(refusal)"])
                }
                if let failure = program.takeCounterFailure() {
                    logger.warning("a count of nat associations by the kernel's iterator failed: that count (and any other that fails, of any nat listener) reads the association map in batches instead (about a third of a second of CPU per 1,048,576); said once per process",
                                   metadata: ["error": "\(failure)"])
                }
                count.at = now
                // Made and present read together: evicted is what was made and is gone.
                count.evicted = max(count.evicted, made > UInt64(count.present) ? made - UInt64(count.present) : 0)
            }
            return count
        }
        snapshot.associations = UInt64(counted.present)
        snapshot.events = [.created: nat.created, .serverInitiated: nat.serverInitiated, .moved: nat.moved, .evicted: counted.evicted]
        for (name, totals) in retired { snapshot.downstreamReplies[name] = totals.replies }
        for (name, slot) in slots {
            snapshot.downstreamReplies[name, default: 0] &+= program.backendStats(id: id, slot: slot).replies
        }
        return snapshot
    }

    /// The listener's counters, read from the per-CPU maps.
    func snapshot() -> ListenerCounters.Snapshot {
        // Read when the listener's metrics are: its pools' are rendered after it.
        pumpPools()
        if templates != nil { pumpTemplateCounts() }
        let stats = program.listenerStats(id: id)
        // The client direction's verdicts: a nat listener's verdicts count its replies too.
        let replyShare = config.replies == .nat ? program.natStats(id: id).replyVerdicts : nil
        func verdict(_ value: fanout_verdict) -> UInt64 {
            let all = stats.verdicts[Int(value.rawValue)]
            return all - min(all, replyShare?[Int(value.rawValue)] ?? 0)
        }
        let (slots, retired) = live.withLock { ($0.slots, $0.retired) }
        var downstreams: [String: (forwarded: UInt64, bytes: UInt64, dropped: UInt64)] = [:]
        var downstreamDropped: [String: [DropReason: UInt64]] = [:]
        // A downstream's counts go on across removals: what its given-up slots counted, plus its slot now.
        var totals = retired
        for (name, slot) in slots {
            let counted = program.backendStats(id: id, slot: slot)
            totals[name, default: BackendTotals()].add(BackendTotals(
                packets: counted.packets, bytes: counted.bytes, noRoute: counted.noRoute, tooLarge: counted.tooLarge, replies: counted.replies))
        }
        for (name, counted) in totals {
            downstreams[name] = (counted.packets, counted.bytes, counted.noRoute &+ counted.tooLarge)
            downstreamDropped[name] = [.noRoute: counted.noRoute, .tooLarge: counted.tooLarge]
        }
        var snapshot = ListenerCounters.Snapshot(
            received: stats.received, bytesReceived: stats.bytesReceived,
            forwarded: verdict(FANOUT_VERDICT_FORWARDED) + verdict(FANOUT_VERDICT_FORWARDED_NEIGH),
            bytesForwarded: stats.bytesForwarded, noHealthy: verdict(FANOUT_VERDICT_NO_BACKEND), receiveQueueDrops: 0,
            dropped: [
                .tooLarge: verdict(FANOUT_VERDICT_TOO_LARGE), .sendBufferFull: 0, .unreachable: 0, .sendError: 0,
                .noRoute: verdict(FANOUT_VERDICT_NO_ROUTE), .ttlExpired: verdict(FANOUT_VERDICT_TTL_EXPIRED),
                .rewriteFailed: verdict(FANOUT_VERDICT_REWRITE_FAILED),
            ],
            downstreams: downstreams, downstreamDropped: downstreamDropped,
            twoWay: config.replies == .nat ? twoWaySnapshot(slots: slots, retired: retired) : nil)
        if rateBuckets != nil || ampClients != nil {
            let counts = program.rateCounts(id: id)
            if rateBuckets != nil { snapshot.dropped[.rateLimited] = counts.limited &+ counts.newSources }
            if ampClients != nil { snapshot.twoWay?.replyDropped[.amplificationCapped] = counts.capped }
        }
        if live.withLock({ $0.quicShown }) {
            let counts = program.quicCounts(id: id)
            for (outcome, count) in zip(QUICOutcome.allCases, counts) { snapshot.quic[outcome] = count }
        }
        return snapshot
    }
}
