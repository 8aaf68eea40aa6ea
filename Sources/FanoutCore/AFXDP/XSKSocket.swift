// SPDX-License-Identifier: Apache-2.0
import CLibXDP
import CSystemShim
import Synchronization

#if canImport(Glibc)
import Glibc
#endif
import SystemCalls

/// A received frame: where its packet lies in the UMEM and how long it is.
struct XSKFrame: Equatable, Sendable {
    /// The UMEM address of the packet's first byte (the frame's base plus the kernel's headroom).
    var address: UInt64
    /// The packet's length in bytes.
    var length: UInt32
}

/// The socket's XDP_STATISTICS: what the kernel dropped or could not do, since the socket opened.
struct XSKStatistics: Equatable, Sendable {
    /// Frames dropped for other reasons than a full RX ring (e.g. too long for a frame).
    var rxDropped: UInt64 = 0
    /// Invalid descriptors on the fill ring.
    var rxInvalidDescriptors: UInt64 = 0
    /// Invalid descriptors on the TX ring.
    var txInvalidDescriptors: UInt64 = 0
    /// Frames dropped because the RX ring was full (the forwarder fell behind).
    var rxRingFull: UInt64 = 0
    /// Times the kernel found the fill ring empty (no frame to receive into).
    var fillRingEmpty: UInt64 = 0
    /// Times the kernel found the TX ring empty when kicked.
    var txRingEmpty: UInt64 = 0

    /// The values by the `kind` label of udp_fanout_afxdp_socket_events_total.
    var byKind: [String: UInt64] {
        ["rx_dropped": rxDropped, "rx_invalid_descs": rxInvalidDescriptors, "tx_invalid_descs": txInvalidDescriptors,
         "rx_ring_full": rxRingFull, "rx_fill_ring_empty_descs": fillRingEmpty, "tx_ring_empty_descs": txRingEmpty]
    }
}

/// One AF_XDP socket bound to one RX queue, with its own UMEM and four rings (libxdp's xsk
/// API). The XDP program that redirects frames into it, and the XSKMAP entry pointing at
/// `fd`, are someone else's: libxdp is told not to load its own program.
///
/// Frames: every UMEM frame is at all times in exactly one place: the free list, the fill ring
/// (the kernel's to receive into), the RX ring, the caller's hands (between `receive` and
/// `recycle`/`transmit`), or the TX/completion rings (between `transmit` and the reaping in the
/// next `receive`/`transmit`). Nothing here loses one.
///
/// Not thread safe, and needs no lock: one forwarder thread uses it at a time (it may be created
/// on another thread and handed over, hence `@unchecked Sendable`).
final class XSKSocket: @unchecked Sendable {
    /// The AF_XDP socket, for the XSKMAP and poll.
    let fd: Int32
    let interface: String
    let queue: UInt32
    let config: XSKConfig
    /// Whether the socket is bound in zero-copy mode (else copy mode).
    let zeroCopyInUse: Bool
    /// Whether the kernel sets need_wakeup flags (XDP_USE_NEED_WAKEUP): the rings are kicked
    /// only when it asks.
    let needWakeup: Bool
    /// `receive` calls that found the RX ring empty. Atomics: the forwarder writes them, the
    /// metrics endpoint reads them.
    let rxRingEmptyCount = Atomic<UInt64>(0)
    var rxRingEmpty: UInt64 { rxRingEmptyCount.load(ordering: .relaxed) }
    /// Frames `recycle` parked on the free list because the fill ring had no room (they return
    /// to the fill ring later; a high count means frame count or ring size is too small).
    let fillRingFullCount = Atomic<UInt64>(0)
    var fillRingFull: UInt64 { fillRingFullCount.load(ordering: .relaxed) }
    /// TX kicks (sendto) that failed with a transient error; the frames stay queued for the next kick.
    let transmitKickFailureCount = Atomic<UInt64>(0)
    var transmitKickFailures: UInt64 { transmitKickFailureCount.load(ordering: .relaxed) }

    private let area: UnsafeMutableRawPointer
    private let fill: UnsafeMutablePointer<xsk_ring_prod>
    private let completion: UnsafeMutablePointer<xsk_ring_cons>
    private let rx: UnsafeMutablePointer<xsk_ring_cons>
    private let tx: UnsafeMutablePointer<xsk_ring_prod>
    /// libxdp's UMEM and socket; nil for a socket taken over from a previous process (its rings
    /// are mapped here, without libxdp).
    private let umem: OpaquePointer?
    private let socket: OpaquePointer?
    /// The memfd the UMEM lives in (shared memory: a successor maps the same frames), with a
    /// header page after the frames saying their layout (``UMEMHeader``).
    let umemFD: Int32
    /// The rings this process mapped itself (a socket taken over): unmapped at close.
    private let ringMappings: [(UnsafeMutableRawPointer, Int)]
    /// A socket taken over from a previous process, read out and closed: nothing goes to the fill
    /// ring any more, frames given back wait on the free list.
    let drainOnly: Bool
    /// Frames in no ring and not the caller's: a stack of frame base addresses.
    private let freeFrames: UnsafeMutablePointer<UInt64>
    private var freeCount = 0
    /// Frames on the TX or completion ring.
    private var transmitting = 0
    private let frameBaseMask: UInt64
    /// The fill ring level `receive` restores from the free list: room is left for one batch,
    /// so recycling what one receive returned finds space.
    private let fillTarget: UInt32
    /// Set once by `close` (the owning thread); read by `statistics` from the metrics endpoint.
    private let closedFlag = Atomic<Bool>(false)
    private var closed: Bool { closedFlag.load(ordering: .acquiring) }

    /// What one attempt to open the socket built.
    private struct Parts {
        let area: UnsafeMutableRawPointer
        let fill: UnsafeMutablePointer<xsk_ring_prod>
        let completion: UnsafeMutablePointer<xsk_ring_cons>
        let rx: UnsafeMutablePointer<xsk_ring_cons>
        let tx: UnsafeMutablePointer<xsk_ring_prod>
        let umem: OpaquePointer?
        let socket: OpaquePointer?
        let umemFD: Int32
        var ringMappings: [(UnsafeMutableRawPointer, Int)] = []
    }

    /// Creates the UMEM (mmap, XDP_UMEM_REG), the socket bound to `queue` of `interface` with
    /// need_wakeup, and primes the fill ring.
    /// - Parameters:
    ///   - interface: the interface's name in the calling thread's network namespace.
    ///   - queue: the RX queue (0 ..< `RXQueues.count`).
    ///   - config: UMEM and ring sizes, zero-copy and busy polling. `.auto` tries zero-copy and
    ///     falls back to copy mode on EOPNOTSUPP or EINVAL, from a fresh UMEM.
    /// - Throws: `XSKError` naming the call, errno and fix: CAP_NET_RAW, RLIMIT_MEMLOCK, a queue
    ///   already taken (EBUSY), a queue out of range (with the count), zero-copy unsupported.
    init(interface: String, queue: UInt32, config: XSKConfig) throws(XSKError) {
        try config.validate()
        var parts: Parts
        var zeroCopy: Bool
        switch config.zeroCopy {
        case .on, .off:
            zeroCopy = config.zeroCopy == .on
            parts = try Self.openRetryingBusy(interface: interface, queue: queue, config: config, zeroCopy: zeroCopy)
        case .auto:
            do {
                zeroCopy = true
                parts = try Self.openRetryingBusy(interface: interface, queue: queue, config: config, zeroCopy: true)
            } catch .socket(_, _, _, let error, _, _) where error == EOPNOTSUPP || error == EINVAL {
                // Retried from scratch: libxdp's state after a failed bind is not reusable.
                zeroCopy = false
                parts = try Self.openRetryingBusy(interface: interface, queue: queue, config: config, zeroCopy: false)
            }
        }
        self.interface = interface
        self.queue = queue
        self.config = config
        zeroCopyInUse = zeroCopy
        needWakeup = true
        area = parts.area
        fill = parts.fill
        completion = parts.completion
        rx = parts.rx
        tx = parts.tx
        umem = parts.umem
        socket = parts.socket
        umemFD = parts.umemFD
        ringMappings = []
        drainOnly = false
        fd = xsk_socket__fd(parts.socket)
        frameBaseMask = ~UInt64(config.frameSize - 1)
        fillTarget = config.ringSize - UInt32(config.batchSize)
        freeFrames = .allocate(capacity: Int(config.frameCount))
        for index in 0..<Int(config.frameCount) {
            // Reversed, so the stack hands out frame 0 first (easier to read in a debugger).
            freeFrames[index] = UInt64(Int(config.frameCount) - 1 - index) * UInt64(config.frameSize)
        }
        freeCount = Int(config.frameCount)
        if config.busyPoll {
            do throws(XSKError) {
                try setOption(SO_PREFER_BUSY_POLL, 1, name: "SO_PREFER_BUSY_POLL")
                try setOption(SO_BUSY_POLL, 20, name: "SO_BUSY_POLL")
                try setOption(SO_BUSY_POLL_BUDGET, Int32(config.batchSize), name: "SO_BUSY_POLL_BUDGET")
            } catch {
                close()
                throw error
            }
        }
        refillFromFreeList()
    }

    deinit { close() }

    /// Takes over a socket a previous process left in the service manager's store (it crashed
    /// holding it): its UMEM memfd says the layout, its rings are mapped here. Only to be read
    /// out: what its RX ring holds is received as from any socket, what its TX ring holds is
    /// sent, and frames given back stay off the fill ring (``drainOnly``); then it is closed.
    /// - Throws: `.invalidConfig` when the memfd is not a UMEM this version wrote, `.umem` or
    ///   `.socket` naming the call that failed.
    init(adopting fd: Int32, umem umemFD: Int32, interface: String, queue: UInt32) throws(XSKError) {
        guard let header = UMEMHeader.read(umemFD) else {
            throw .invalidConfig("the UMEM handed over for \(interface) queue \(queue) is not one this version wrote")
        }
        var config = XSKConfig()
        config.frameSize = header.frameSize
        config.frameCount = header.frameCount
        config.ringSize = header.ringSize
        config.batchSize = 1
        let bytes = config.umemBytes
        guard let area = mmap(nil, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, umemFD, 0), area != MAP_FAILED else {
            throw .umem(interface: interface, queue: queue, call: "mmap", errno: errno, bytes: bytes)
        }
        var mappings: [(UnsafeMutableRawPointer, Int)] = []
        func unmapAll() {
            for (address, length) in mappings { munmap(address, length) }
            munmap(area, bytes)
        }
        let offsets: xdp_mmap_offsets
        do {
            offsets = try Syscall.getsockopt(fd, SOL_XDP, XDP_MMAP_OFFSETS, initial: xdp_mmap_offsets(), call: "getsockopt XDP_MMAP_OFFSETS")
        } catch {
            unmapAll()
            throw .socket(interface: interface, queue: queue, call: "getsockopt XDP_MMAP_OFFSETS", errno: error.errno, zeroCopy: false, queueCount: nil)
        }
        // Maps one ring: its producer, consumer, flags and descriptors, as libxdp does.
        func ring(_ offset: xdp_ring_offset, page: UInt64, entry: Int) throws(XSKError) -> (UnsafeMutableRawPointer, xdp_ring_offset) {
            let length = Int(offset.desc) + Int(header.ringSize) * entry
            guard let mapped = mmap(nil, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, off_t(Int64(bitPattern: page))), mapped != MAP_FAILED else {
                let error = errno
                unmapAll()
                throw .socket(interface: interface, queue: queue, call: "mmap of a ring", errno: error, zeroCopy: false, queueCount: nil)
            }
            mappings.append((mapped, length))
            return (mapped, offset)
        }
        let rxMap = try ring(offsets.rx, page: UInt64(XDP_PGOFF_RX_RING), entry: MemoryLayout<xdp_desc>.stride)
        let txMap = try ring(offsets.tx, page: UInt64(XDP_PGOFF_TX_RING), entry: MemoryLayout<xdp_desc>.stride)
        let fillMap = try ring(offsets.fr, page: XDP_UMEM_PGOFF_FILL_RING, entry: MemoryLayout<UInt64>.stride)
        let completionMap = try ring(offsets.cr, page: XDP_UMEM_PGOFF_COMPLETION_RING, entry: MemoryLayout<UInt64>.stride)
        func pointers(_ map: (UnsafeMutableRawPointer, xdp_ring_offset)) -> (producer: UnsafeMutablePointer<UInt32>, consumer: UnsafeMutablePointer<UInt32>, ring: UnsafeMutableRawPointer, flags: UnsafeMutablePointer<UInt32>) {
            ((map.0 + Int(map.1.producer)).assumingMemoryBound(to: UInt32.self), (map.0 + Int(map.1.consumer)).assumingMemoryBound(to: UInt32.self),
             map.0 + Int(map.1.desc), (map.0 + Int(map.1.flags)).assumingMemoryBound(to: UInt32.self))
        }
        let size = header.ringSize
        func consumerRing(_ map: (UnsafeMutableRawPointer, xdp_ring_offset)) -> UnsafeMutablePointer<xsk_ring_cons> {
            let (producer, consumer, ring, flags) = pointers(map)
            let made = UnsafeMutablePointer<xsk_ring_cons>.allocate(capacity: 1)
            made.initialize(to: xsk_ring_cons(cached_prod: producer.pointee, cached_cons: consumer.pointee, mask: size - 1, size: size,
                                              producer: producer, consumer: consumer, ring: ring, flags: flags))
            return made
        }
        func producerRing(_ map: (UnsafeMutableRawPointer, xdp_ring_offset)) -> UnsafeMutablePointer<xsk_ring_prod> {
            let (producer, consumer, ring, flags) = pointers(map)
            let made = UnsafeMutablePointer<xsk_ring_prod>.allocate(capacity: 1)
            // libxdp's convention: a producer ring's cached consumer is one ring ahead.
            made.initialize(to: xsk_ring_prod(cached_prod: producer.pointee, cached_cons: consumer.pointee &+ size, mask: size - 1, size: size,
                                              producer: producer, consumer: consumer, ring: ring, flags: flags))
            return made
        }
        self.interface = interface
        self.queue = queue
        self.config = config
        self.fd = fd
        self.umemFD = umemFD
        zeroCopyInUse = false
        needWakeup = true
        drainOnly = true
        self.area = area
        rx = consumerRing(rxMap)
        tx = producerRing(txMap)
        fill = producerRing(fillMap)
        completion = consumerRing(completionMap)
        umem = nil
        socket = nil
        ringMappings = mappings
        frameBaseMask = ~UInt64(config.frameSize - 1)
        fillTarget = 0
        freeFrames = .allocate(capacity: Int(config.frameCount))
        freeCount = 0
        // What the TX ring still holds goes out at the next kick; the completion ring's come back.
        transmitting = Int(tx.pointee.producer.pointee &- tx.pointee.consumer.pointee)
            + Int(completion.pointee.producer.pointee &- completion.pointee.consumer.pointee)
    }

    /// Frames on the RX ring, not yet received.
    var rxRingLevel: Int { Int(rx.pointee.producer.pointee &- rx.pointee.consumer.pointee) }

    /// Frames on the TX ring the kernel has not taken yet.
    var txRingLevel: Int { Int(tx.pointee.producer.pointee &- tx.pointee.consumer.pointee) }

    /// Kicks the TX ring until the kernel took every frame on it (at most `milliseconds`): a
    /// socket being read out is closed after, and what its ring still holds then is lost.
    /// - Returns: the frames it did not take.
    func finishTransmitting(milliseconds: Int) -> Int {
        var waited = 0
        while txRingLevel > 0 && waited < milliseconds {
            // The kernel takes a TX entry only with room on the completion ring.
            let done = Int(completion.pointee.producer.pointee &- completion.pointee.consumer.pointee)
            if done > 0 { xsk_ring_cons__release(completion, UInt32(done)) }
            _ = try? Syscall.sendto(fd, nil, 0, Socket.dontWait, nil, 0)
            if txRingLevel > 0 { usleep(1_000) }
            waited += 1
        }
        return txRingLevel
    }

    /// Takes up to `frames.count` received frames off the RX ring; they are the caller's until
    /// recycled or transmitted. Also reaps the completion ring and tops up the fill ring.
    /// - Parameter ledger: the thread's crash ledger slot: the frames taken are noted held before
    ///   the ring lets them go.
    /// - Returns: the number of frames written to `frames`; 0 when the RX ring was empty
    ///   (counted in `rxRingEmpty`).
    func receive(into frames: UnsafeMutableBufferPointer<XSKFrame>, ledger: CrashLedger.Slot? = nil) -> Int {
        precondition(!closed, "receive on a closed AF_XDP socket")
        reapCompletions()
        var index: UInt32 = 0
        let count = xsk_ring_cons__peek(rx, UInt32(truncatingIfNeeded: frames.count), &index)
        if count > 0 {
            for offset in 0..<count {
                let descriptor = xsk_ring_cons__rx_desc(rx, index &+ offset)!.pointee
                frames[Int(offset)] = XSKFrame(address: descriptor.addr, length: descriptor.len)
            }
            // Noted before the ring lets them go: a kill in between leaves them both on the ring
            // (forwarded by the next process) and noted (counted by it), never neither.
            ledger?.holding(Int(count))
            xsk_ring_cons__release(rx, count)
        } else {
            rxRingEmptyCount.wrappingAdd(1, ordering: .relaxed)
            // Busy polling is driven by syscalls, and a zero-copy driver that set need_wakeup on
            // the fill ring waits for one: recvfrom with nothing to read is the cheapest.
            if config.busyPoll || xsk_ring_prod__needs_wakeup(fill) != 0 {
                _ = try? Syscall.recvfrom(fd, nil, 0, Socket.dontWait, nil)
            }
        }
        refillFromFreeList()
        return Int(count)
    }

    /// The frame's packet bytes, in the UMEM (valid until the frame is recycled or transmitted).
    @inline(__always)
    func bytes(_ frame: XSKFrame) -> UnsafeMutableRawBufferPointer {
        UnsafeMutableRawBufferPointer(start: area + Int(frame.address), count: Int(frame.length))
    }

    /// Gives frames back to the fill ring once the caller is done with them (its sends that
    /// point into the UMEM have returned). What the fill ring has no room for waits on the free
    /// list (counted in `fillRingFull`).
    func recycle(_ frames: UnsafeBufferPointer<XSKFrame>) {
        precondition(!closed, "recycle on a closed AF_XDP socket")
        guard !frames.isEmpty else { return }
        if drainOnly {
            for frame in frames { pushFree(frame.address) }
            return
        }
        let wanted = UInt32(truncatingIfNeeded: frames.count)
        let room = min(wanted, xsk_prod_nb_free(fill, wanted))
        var index: UInt32 = 0
        if room > 0, xsk_ring_prod__reserve(fill, room, &index) == room {
            for offset in 0..<room {
                xsk_ring_prod__fill_addr(fill, index &+ offset)!.pointee = frames[Int(offset)].address & frameBaseMask
            }
            xsk_ring_prod__submit(fill, room)
        }
        let placed = Int(room)
        if placed < frames.count {
            for frame in frames[placed...] { pushFree(frame.address) }
            fillRingFullCount.wrappingAdd(UInt64(frames.count - placed), ordering: .relaxed)
        }
    }

    /// Queues frames (rewritten in place by the caller) on the TX ring and kicks the kernel
    /// (sendto) when it asks for it. The frames come back through the completion ring.
    /// - Parameter ledger: the thread's crash ledger slot, told the frames are handed just before
    ///   the ring takes them (on the ring they outlive a crash: the next process sends them).
    /// - Returns: how many were queued, from the first; the rest stay the caller's, who recycles
    ///   them and counts the drop.
    func transmit(_ frames: UnsafeBufferPointer<XSKFrame>, ledger: CrashLedger.Slot? = nil) -> Int {
        precondition(!closed, "transmit on a closed AF_XDP socket")
        reapCompletions()
        let wanted = UInt32(truncatingIfNeeded: frames.count)
        let count = min(wanted, xsk_prod_nb_free(tx, wanted))
        var index: UInt32 = 0
        if count > 0, xsk_ring_prod__reserve(tx, count, &index) == count {
            for offset in 0..<count {
                let descriptor = xsk_ring_prod__tx_desc(tx, index &+ offset)!
                descriptor.pointee.addr = frames[Int(offset)].address
                descriptor.pointee.len = frames[Int(offset)].length
                descriptor.pointee.options = 0
            }
            ledger?.handing(Int(count))
            xsk_ring_prod__submit(tx, count)
            transmitting += Int(count)
        } else if count > 0 {
            return 0
        }
        kickTransmit()
        return Int(count)
    }

    /// Waits for frames on the RX ring: poll(2) on the socket, which also wakes a driver that
    /// set need_wakeup. Tops up the fill ring first and re-kicks a pending TX.
    /// - Returns: true when frames are ready, false on timeout (or a signal).
    func wait(milliseconds: Int32) -> Bool {
        precondition(!closed, "wait on a closed AF_XDP socket")
        refillFromFreeList()
        if transmitting > 0 { reapCompletions(); kickTransmit() }
        if xsk_cons_nb_avail(rx, 1) > 0 { return true }
        var request = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
        let ready = (try? Syscall.poll(&request, 1, milliseconds)) ?? 0
        return ready > 0 && request.revents & Int16(POLLIN) != 0
    }

    /// The kernel's XDP_STATISTICS for this socket (getsockopt SOL_XDP); zero once closed.
    func statistics() -> XSKStatistics {
        guard !closed else { return XSKStatistics() }
        let raw: xdp_statistics
        do {
            raw = try Syscall.getsockopt(fd, SOL_XDP, XDP_STATISTICS, initial: xdp_statistics(), call: "getsockopt XDP_STATISTICS")
        } catch {
            // Only a bad descriptor or buffer fails here: programmer errors.
            preconditionFailure("\(error)")
        }
        return XSKStatistics(rxDropped: raw.rx_dropped, rxInvalidDescriptors: raw.rx_invalid_descs,
                             txInvalidDescriptors: raw.tx_invalid_descs, rxRingFull: raw.rx_ring_full,
                             fillRingEmpty: raw.rx_fill_ring_empty_descs, txRingEmpty: raw.tx_ring_empty_descs)
    }

    /// Closes the socket (which leaves the XSKMAP: the kernel removes it) and frees the UMEM.
    /// Idempotent; deinit calls it.
    func close() {
        guard !closedFlag.exchange(true, ordering: .acquiringAndReleasing) else { return }
        var parts = Parts(area: area, fill: fill, completion: completion, rx: rx, tx: tx, umem: umem, socket: socket, umemFD: umemFD)
        parts.ringMappings = ringMappings
        if socket == nil { Glibc.close(fd) }
        Self.release(parts, bytes: config.umemBytes)
        freeFrames.deallocate()
    }

    /// Where every frame is now (tests: nothing leaks, nothing is in two places). Valid when
    /// the kernel is not receiving into the socket at the same time.
    func frameInventory() -> (free: [UInt64], fill: [UInt64], rxRing: Int, transmitting: Int) {
        let free = (0..<freeCount).map { freeFrames[$0] }
        let consumer = fill.pointee.consumer.pointee
        let filled = (0..<(fill.pointee.cached_prod &- consumer)).map { xsk_ring_prod__fill_addr(fill, consumer &+ $0)!.pointee }
        let rxRing = Int(rx.pointee.producer.pointee &- rx.pointee.consumer.pointee)
        return (free, filled, rxRing, transmitting)
    }

    // MARK: - Rings

    private func pushFree(_ address: UInt64) {
        precondition(freeCount < Int(config.frameCount), "AF_XDP frame \(address) given back twice")
        freeFrames[freeCount] = address & frameBaseMask
        freeCount += 1
    }

    /// Moves frames from the free list to the fill ring, up to `fillTarget` frames on it.
    private func refillFromFreeList() {
        guard freeCount > 0, !drainOnly else { return }
        let free = xsk_prod_nb_free(fill, config.ringSize)
        let level = config.ringSize &- min(free, config.ringSize)
        guard level < fillTarget else { return }
        let count = min(fillTarget - level, UInt32(freeCount))
        var index: UInt32 = 0
        guard xsk_ring_prod__reserve(fill, count, &index) == count else { return }
        for offset in 0..<count {
            freeCount -= 1
            xsk_ring_prod__fill_addr(fill, index &+ offset)!.pointee = freeFrames[freeCount]
        }
        xsk_ring_prod__submit(fill, count)
    }

    /// Frames the kernel finished sending go back on the free list.
    private func reapCompletions() {
        guard transmitting > 0 else { return }
        var index: UInt32 = 0
        let count = xsk_ring_cons__peek(completion, UInt32(transmitting), &index)
        guard count > 0 else { return }
        for offset in 0..<count { pushFree(xsk_ring_cons__comp_addr(completion, index &+ offset)!.pointee) }
        xsk_ring_cons__release(completion, count)
        transmitting -= Int(count)
    }

    /// Copy mode sends only inside sendto (or poll), zero-copy drivers when woken: kick when the
    /// kernel asks through the TX ring's need_wakeup flag (set in copy mode whenever frames
    /// wait). EAGAIN, EBUSY, ENOBUFS and ENETDOWN are transient (the frames stay on the ring for
    /// the next kick) and counted.
    /// Asks the kernel to send what the TX ring holds. In copy mode one sendto sends at most 32
    /// frames (the kernel's TX_BATCH_SIZE) and answers EAGAIN while more wait, so it is repeated
    /// until the ring is consumed (bounded by the frames queued); only other errors are counted.
    private func kickTransmit() {
        guard transmitting > 0, !needWakeup || xsk_ring_prod__needs_wakeup(tx) != 0 else { return }
        var attempts = transmitting / 32 + 2
        while attempts > 0 {
            attempts -= 1
            let code: Int32
            do {
                guard case .wouldBlock = try Syscall.sendto(fd, nil, 0, Socket.dontWait, nil, 0) else { return }
                code = EAGAIN
            } catch {
                precondition(error.errno != EBADF && error.errno != EFAULT, "sendto on an AF_XDP socket misused: errno \(error.errno)")
                code = error.errno
            }
            if code == EAGAIN || code == EBUSY {
                // More than one batch queued: the kernel consumed one; go on while it still lags.
                if xsk_prod_nb_free(tx, UInt32(truncatingIfNeeded: Int(tx.pointee.size))) >= tx.pointee.size { return }
                continue
            }
            transmitKickFailureCount.wrappingAdd(1, ordering: .relaxed)
            return
        }
    }

    private func setOption(_ option: Int32, _ value: Int32, name: String) throws(XSKError) {
        do {
            try Syscall.setsockopt(fd, SOL_SOCKET, option, value, call: "setsockopt \(name)")
        } catch {
            throw .socketOption(interface: interface, queue: queue, option: name, errno: error.errno)
        }
    }

    // MARK: - Setup

    /// How long a queue may stay busy after its previous socket closed: the kernel frees the
    /// queue in deferred work (xp_release_deferred), so a socket closed just before (a
    /// restart, a reload, the previous process) can still hold it for a moment.
    static let busyQueueGrace = 0.5

    /// `open`, tried again every 10 ms while the queue is busy (EBUSY), for `busyQueueGrace`
    /// seconds; after that the EBUSY error stands.
    private static func openRetryingBusy(interface: String, queue: UInt32, config: XSKConfig, zeroCopy: Bool) throws(XSKError) -> Parts {
        var waited = 0.0
        while true {
            do {
                return try open(interface: interface, queue: queue, config: config, zeroCopy: zeroCopy)
            } catch .socket(_, _, _, let error, _, _) where error == EBUSY && waited < busyQueueGrace {
                usleep(10_000)
                waited += 0.01
            } catch .umem(_, _, _, let error, _) where error == ENOBUFS && waited < busyQueueGrace {
                // The locked memory of a UMEM just closed (a previous process's, read out) is
                // given back in deferred work too.
                usleep(10_000)
                waited += 0.01
            }
        }
    }

    private static func open(interface: String, queue: UInt32, config: XSKConfig, zeroCopy: Bool) throws(XSKError) -> Parts {
        let bytes = config.umemBytes
        // xsk_umem__create opens the socket and registers the UMEM and reports either failure
        // as one errno: an EPERM there would not say whether a capability or locked memory is
        // missing. Opening one here first names the capability case.
        do {
            Syscall.close(try Syscall.socket(AF_XDP, Socket.raw | Socket.closeOnExec))
        } catch {
            throw .umem(interface: interface, queue: queue, call: "socket", errno: error.errno, bytes: bytes)
        }
        // Shared memory, so a successor can map the same frames (a crash: ``init(adopting:umem:interface:queue:)``),
        // with a page after the frames saying their layout.
        let umemFD = shim_memfd("udp-fanout.umem")
        guard umemFD >= 0 else {
            throw .umem(interface: interface, queue: queue, call: "memfd_create", errno: -umemFD, bytes: bytes)
        }
        guard ftruncate(umemFD, off_t(bytes + UMEMHeader.bytes)) == 0 else {
            let error = errno
            Glibc.close(umemFD)
            throw .umem(interface: interface, queue: queue, call: "ftruncate", errno: error, bytes: bytes)
        }
        UMEMHeader(frameSize: config.frameSize, frameCount: config.frameCount, ringSize: config.ringSize).write(umemFD, at: bytes)
        guard let area = mmap(nil, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, umemFD, 0), area != MAP_FAILED else {
            let error = errno
            Glibc.close(umemFD)
            throw .umem(interface: interface, queue: queue, call: "mmap", errno: error, bytes: bytes)
        }
        // libxdp keeps pointers to these four structs for the socket's life: heap, not stack.
        let fill = UnsafeMutablePointer<xsk_ring_prod>.allocate(capacity: 1)
        let completion = UnsafeMutablePointer<xsk_ring_cons>.allocate(capacity: 1)
        let rx = UnsafeMutablePointer<xsk_ring_cons>.allocate(capacity: 1)
        let tx = UnsafeMutablePointer<xsk_ring_prod>.allocate(capacity: 1)
        fill.initialize(to: xsk_ring_prod())
        completion.initialize(to: xsk_ring_cons())
        rx.initialize(to: xsk_ring_cons())
        tx.initialize(to: xsk_ring_prod())
        func freeRings() {
            fill.deallocate()
            completion.deallocate()
            rx.deallocate()
            tx.deallocate()
            munmap(area, bytes)
            Glibc.close(umemFD)
        }
        var umemConfig = xsk_umem_config(fill_size: config.ringSize, comp_size: config.ringSize, frame_size: config.frameSize,
                                         frame_headroom: 0, flags: 0)
        var umem: OpaquePointer?
        let created = xsk_umem__create(&umem, area, UInt64(bytes), fill, completion, &umemConfig)
        guard created == 0, let umem else {
            freeRings()
            throw .umem(interface: interface, queue: queue, call: "xsk_umem__create", errno: -created, bytes: bytes)
        }
        var socketConfig = xsk_socket_config()
        socketConfig.rx_size = config.ringSize
        socketConfig.tx_size = config.ringSize
        // The XDP program and its XSKMAP are udp-fanout's own (and libxdp's dispatcher fails here).
        socketConfig.libxdp_flags = UInt32(XSK_LIBXDP_FLAGS__INHIBIT_PROG_LOAD)
        socketConfig.xdp_flags = 0
        socketConfig.bind_flags = UInt16(XDP_USE_NEED_WAKEUP) | UInt16(zeroCopy ? XDP_ZEROCOPY : XDP_COPY)
        var socket: OpaquePointer?
        let bound = xsk_socket__create(&socket, interface, queue, umem, rx, tx, &socketConfig)
        guard bound == 0, let socket else {
            xsk_umem__delete(umem)
            freeRings()
            let error = -bound
            // EINVAL is also what a queue beyond the interface's count gets: count them to say so.
            let queueCount = error == EINVAL ? try? RXQueues.count(interface: interface) : nil
            throw .socket(interface: interface, queue: queue, call: "xsk_socket__create", errno: error, zeroCopy: zeroCopy,
                          queueCount: queueCount)
        }
        return Parts(area: area, fill: fill, completion: completion, rx: rx, tx: tx, umem: umem, socket: socket, umemFD: umemFD)
    }

    private static func release(_ parts: Parts, bytes: Int) {
        if let socket = parts.socket { xsk_socket__delete(socket) }
        if let umem = parts.umem { xsk_umem__delete(umem) }
        for (address, length) in parts.ringMappings { munmap(address, length) }
        Glibc.close(parts.umemFD)
        parts.fill.deallocate()
        parts.completion.deallocate()
        parts.rx.deallocate()
        parts.tx.deallocate()
        munmap(parts.area, bytes)
    }
}

/// The page after a UMEM's frames in its memfd: the layout a successor needs to map them and the
/// rings (``XSKSocket/init(adopting:umem:interface:queue:)``).
struct UMEMHeader: Equatable {
    static let bytes = 4096
    /// "UFUMEM01", little endian.
    static let magic: UInt64 = 0x3130_4d45_4d55_4655
    var frameSize: UInt32
    var frameCount: UInt32
    var ringSize: UInt32

    func write(_ fd: Int32, at offset: Int) {
        var words: [UInt64] = [Self.magic, UInt64(frameSize), UInt64(frameCount), UInt64(ringSize)]
        _ = pwrite(fd, &words, words.count * 8, off_t(offset))
    }

    /// The header of the UMEM in `fd` (at its end), nil when it is not one.
    static func read(_ fd: Int32) -> UMEMHeader? {
        var status = stat()
        guard fstat(fd, &status) == 0, Int(status.st_size) > bytes else { return nil }
        var words = [UInt64](repeating: 0, count: 4)
        guard pread(fd, &words, words.count * 8, off_t(Int(status.st_size) - bytes)) == 32, words[0] == magic else { return nil }
        let header = UMEMHeader(frameSize: UInt32(truncatingIfNeeded: words[1]), frameCount: UInt32(truncatingIfNeeded: words[2]),
                                ringSize: UInt32(truncatingIfNeeded: words[3]))
        var config = XSKConfig()
        config.frameSize = header.frameSize
        config.frameCount = header.frameCount
        config.ringSize = header.ringSize
        guard (try? config.validate()) != nil, config.umemBytes + bytes == Int(status.st_size) else { return nil }
        return header
    }
}
