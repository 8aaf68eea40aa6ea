// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import Logging
import ReusePortLB
import Synchronization
import SystemCalls

/// The xdp kind's XDP program in front of the tc program: loaded with the tc program's maps on
/// first use, attached (a BPF link) at each interface where an xdp listener matches or a nat
/// listener's replies arrive, and closed with its last user. The tc program stays attached at the
/// same interfaces (``TCDataplane``) and finishes what XDP passes.
final class XDPFront: Sendable {
    private struct State {
        var program: XDPForwardProgram?
        var attachments: [String: (attachment: XDPAttachment, users: Int)] = [:]
        /// The listener ids served, by name (metrics), and what closed ids passed, by listener
        /// name (counters must not go backwards when a reload gives the listener a new id).
        var served: [UInt32: String] = [:]
        var passedBefore: [String: [UInt64]] = [:]
        /// Each served id's counts as last read: a read that fails uses them, so no counter goes back.
        var lastRead: [UInt32: [UInt64]] = [:]
        /// Interfaces in the device map, and those found unable to transmit XDP frames (warned once).
        var devices: Set<UInt32> = []
        var refused: Set<UInt32> = []
        /// Interfaces whose XDP features the kernel could not tell (no netdev family before 6.3,
        /// or a failed query): warned once; left as they are in the device map.
        var unknown: Set<UInt32> = []
    }

    private let state = Mutex(State())
    private let logger: Logger
    /// Where the XDP links go when a service manager keeps them (docs/restarts.md): the next
    /// process takes each over and swaps its program in, so the hook is never empty.
    private let descriptors: DescriptorStore

    init(logger: Logger, descriptors: DescriptorStore? = nil) {
        self.logger = logger
        self.descriptors = descriptors ?? .none(logger: logger)
    }

    /// Attaches at `interface` in `mode` (loaded with `tc`'s maps on first use), or counts one
    /// more user of the attachment there. A second listener asking for another mode at an
    /// interface shares the first one's attachment (validation keeps xdp_mode the same per interface).
    func attach(interface: String, mode: XDPMode, sharing tc: TCProgram) throws(TCError) {
        try state.withLock { state throws(TCError) in
            if let existing = state.attachments[interface] {
                state.attachments[interface] = (existing.attachment, existing.users + 1)
                return
            }
            let program: XDPForwardProgram
            if let loaded = state.program {
                program = loaded
            } else {
                do throws(SystemCallError) { program = try XDPForwardProgram(sharing: tc) } catch { throw .xdpLoad(error) }
                state.program = program
            }
            let attachment: XDPAttachment
            if let adopted = adopt(interface: interface, program, mode: mode) {
                attachment = adopted
            } else {
                do throws(XDPError) {
                    attachment = try XDPAttachment.attach(program, interface: interface, mode: mode, logger: logger)
                } catch {
                    if state.attachments.isEmpty { close(&state) }
                    throw .xdpAttach(error)
                }
            }
            // The link outlives this process in the service manager's store.
            descriptors.replace(DescriptorStore.xdpLinkName(interface), with: [attachment.linkDescriptor])
            if attachment.attachedMode == .generic {
                logger.warning("xdp runs in generic (SKB) mode here: the kernel builds a socket buffer before the program runs, so it costs about what tc_ebpf does; a driver with native XDP (virtio_net, mlx5, ice, i40e, ixgbe, veth) avoids that", metadata: ["interface": "\(interface)"])
            }
            state.attachments[interface] = (attachment, 1)
            let ifindex = attachment.ifindex
            refreshDevice(ifindex, in: &state)
        }
    }

    /// The XDP link the previous process left at `interface`, taken over with `program` swapped
    /// in; nil when there is none or it cannot be (closed: detached; counted rejected).
    private func adopt(interface: String, _ program: XDPForwardProgram, mode: XDPMode) -> XDPAttachment? {
        let name = DescriptorStore.xdpLinkName(interface)
        var links = descriptors.take(name)
        guard !links.isEmpty else { return nil }
        let link = links.removeFirst()
        for extra in links { Glibc.close(extra) }
        do throws(XDPError) {
            let (attachment, previous) = try XDPAttachment.adopt(link: link, program, interface: interface, mode: mode, logger: logger)
            descriptors.count(Mode.xdp.rawValue, .adopted, note: "xdp at \(interface): took over the XDP link of the previous process (program id \(previous)) and replaced its program in place")
            logger.info("took over the XDP link the previous process left and replaced its program in place", metadata: [
                "interface": "\(interface)", "previous_program_id": "\(previous)", "program_id": "\(program.programID)", "mode": "\(attachment.attachedMode.rawValue)",
            ])
            return attachment
        } catch {
            // Detached now: the program attached anew next must not meet it on the hook while
            // the service manager still holds its copy.
            XDPAttachment.detach(link: link)
            descriptors.remove(name)
            descriptors.count(Mode.xdp.rawValue, .rejected, note: "\(error)")
            logger.warning("\(error)", metadata: ["interface": "\(interface)"])
            return nil
        }
    }

    /// One user fewer at `interface` (detached where it was the last; closed with the last
    /// attachment). Handing over (a stop under a service manager): the store's copy of the link
    /// keeps the program attached, forwarding on the last plan, for the next process.
    func detach(interface: String) {
        state.withLock { state in
            guard let entry = state.attachments[interface] else { return }
            if entry.users > 1 {
                state.attachments[interface] = (entry.attachment, entry.users - 1)
                return
            }
            let name = DescriptorStore.xdpLinkName(interface)
            if !descriptors.handingOver { descriptors.remove(name) }
            let kept = descriptors.handingOver && descriptors.isStored(name)
            entry.attachment.detach(quietly: kept)
            if kept {
                logger.info("left the XDP program attached for the next process: its link is in the service manager's store, forwarding on the last plan", metadata: ["interface": "\(interface)"])
            }
            state.attachments[interface] = nil
            if state.attachments.isEmpty { close(&state) }
        }
    }

    private func close(_ state: inout State) {
        guard let program = state.program else { return }
        for (id, name) in state.served { retire(id: id, name: name, program, &state) }
        program.closeDescriptors()
        state.program = nil
        state.served = [:]
        state.devices = []
    }

    private func retire(id: UInt32, name: String, _ program: XDPForwardProgram, _ state: inout State) {
        let counts = read(id: id, program, &state)
        state.passedBefore[name] = zip(state.passedBefore[name] ?? counts.map { _ in 0 }, counts).map { $0 &+ $1 }
        state.lastRead[id] = nil
    }

    /// Listener `id`'s passes now, or as last read when the map cannot be read.
    private func read(id: UInt32, _ program: XDPForwardProgram, _ state: inout State) -> [UInt64] {
        if let counts = program.passedCounts(id: id) {
            state.lastRead[id] = counts
            return counts
        }
        return state.lastRead[id] ?? [UInt64](repeating: 0, count: XDPPassReason.allCases.count)
    }

    /// Marks listener `id` (named `name`) served at XDP; call after ``attach(interface:mode:sharing:)``.
    func serve(id: UInt32, name: String) throws(TCError) {
        try state.withLock { state throws(TCError) in
            guard let program = state.program else { throw .xdpLoad(SystemCallError(call: "xdp_fanout not loaded", errno: ENOENT)) }
            do throws(SystemCallError) { try program.serve(id: id, true) } catch { throw .maps(error) }
            state.served[id] = name
        }
    }

    /// Listener `id` is no longer served at XDP (its passes kept under its name).
    func stopServing(id: UInt32) {
        state.withLock { state in
            guard let program = state.program, let name = state.served[id] else { return }
            retire(id: id, name: name, program, &state)
            // Handing over: the program stays attached through the store and goes on serving
            // the listener on the last plan.
            if !descriptors.handingOver { try? program.serve(id: id, false) }
            state.served[id] = nil
        }
    }

    /// Lets XDP redirect toward `downstreams` where the interface their route leaves through
    /// transmits XDP frames (NETDEV_XDP_ACT_NDO_XMIT); where it does not, the tc program finishes
    /// those datagrams (counted `no_xdp_xmit`) and a warning says why, once per interface.
    func route(toward downstreams: [Downstream]) {
        let egress = Set(Set(downstreams.map { $0.address.ip }).compactMap { TCRoute.nextHop(to: $0)?.ifindex })
        state.withLock { state in
            for ifindex in egress { refreshDevice(ifindex, in: &state) }
        }
    }

    /// Checks again each interface in the device map (a veth's peer may have lost its XDP
    /// program or GRO: it leaves the map, so its datagrams go through tc rather than being dropped
    /// by the driver) and each one refused before (it joins the map once it transmits XDP frames).
    func recheckDevices() {
        state.withLock { state in
            for ifindex in state.devices.union(state.refused) { refreshDevice(ifindex, in: &state) }
        }
    }

    private func refreshDevice(_ ifindex: UInt32, in state: inout State) {
        guard let program = state.program else { return }
        guard let transmits = NetdevFeatures.transmitsXDP(ifindex: ifindex) else {
            // Unknown: the map stays as it is (an interface not in it goes through tc, counted).
            if !state.unknown.contains(ifindex) {
                state.unknown.insert(ifindex)
                logger.warning("the kernel could not tell whether this interface transmits XDP frames (its netdev netlink family, kernel 6.3+): until it can, datagrams routed through it that are not in the xdp device map yet are finished by the tc program (counted udp_fanout_xdp_passed_total{reason=\"no_xdp_xmit\"})", metadata: ["interface": "\(TCRoute.interfaceName(ifindex))"])
            }
            return
        }
        state.unknown.remove(ifindex)
        let present = state.devices.contains(ifindex)
        if transmits && !present {
            do throws(SystemCallError) {
                try program.setDevice(ifindex, present: true)
                state.devices.insert(ifindex)
                state.refused.remove(ifindex)
                logger.info("interface transmits XDP frames: in the xdp device map, datagrams routed through it leave at XDP", metadata: ["interface": "\(TCRoute.interfaceName(ifindex))"])
            } catch {
                logger.warning("could not add an interface to the xdp device map: datagrams routed through it are finished by the tc program (counted udp_fanout_xdp_passed_total{reason=\"no_xdp_xmit\"})", metadata: ["interface": "\(TCRoute.interfaceName(ifindex))", "error": "\(error)"])
            }
        } else if !transmits {
            if present {
                try? program.setDevice(ifindex, present: false)
                state.devices.remove(ifindex)
            }
            if !state.refused.contains(ifindex) {
                state.refused.insert(ifindex)
                logger.warning("interface cannot transmit XDP frames (its driver does not offer XDP transmit now, NETDEV_XDP_ACT_NDO_XMIT; a veth offers it only while its peer runs an XDP program or has GRO on: ethtool -K <peer> gro on): datagrams routed through it are finished by the tc program, counted udp_fanout_xdp_passed_total{reason=\"no_xdp_xmit\"}", metadata: ["interface": "\(TCRoute.interfaceName(ifindex))"])
            }
        }
    }

    /// Nil while the XDP program is attached at `interface`, else why not.
    func attachmentProblem(interface: String) -> String? {
        state.withLock { state in
            guard let attachment = state.attachments[interface]?.attachment else { return "udp-fanout holds no XDP attachment at \(interface)" }
            return attachment.isAttached ? nil : "the xdp program's BPF link at \(interface) was detached (the interface went away, or bpftool link detach)"
        }
    }

    /// What XDP passed to tc, by listener name and reason label (totals since the daemon started;
    /// a later fragment no listener could be known for is tc's to count, fragment_untracked).
    func passed() -> [(listener: String, reason: String, count: UInt64)]? {
        state.withLock { state in
            guard state.program != nil || !state.passedBefore.isEmpty else { return nil }
            var totals = state.passedBefore
            if let program = state.program {
                for (id, name) in state.served {
                    let counts = read(id: id, program, &state)
                    totals[name] = zip(totals[name] ?? counts.map { _ in 0 }, counts).map { $0 &+ $1 }
                }
            }
            var rows: [(String, String, UInt64)] = []
            for name in totals.keys.sorted() {
                for reason in XDPPassReason.allCases { rows.append((name, reason.label, totals[name]![reason.rawValue])) }
            }
            return rows
        }
    }
}
