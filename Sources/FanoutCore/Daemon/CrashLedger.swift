// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim
import Logging
import ReusePortLB
import Synchronization
import SystemCalls

/// What a crash takes with it, counted. Every forwarding thread (userspace and relay workers,
/// af_xdp queue forwarders and their companion's workers) notes in shared memory how many
/// datagrams it holds: from its receive (before an AF_XDP RX ring's entries are released) until
/// they are handed to a send call (noted just before each call, which a kill cannot stop half
/// way), and a relay worker also the replies it has staged for its clients. The memory is a memfd
/// in the service manager's store (`udp-fanout.ledger`): after a crash (kill -9, a fatal signal,
/// the watchdog's abort) the next process reads what each thread held when it died, counts it
/// dropped with reason `crash` on the listener of the same name (replies: reply drop reason
/// `crash`), and logs it. A thread killed inside a receive system call (recvmmsg returns what it
/// took as the kill lands) cannot have noted it: its slot says a receive was under way, and the
/// next process logs that up to a batch may have been lost uncounted. A clean stop leaves every
/// slot empty: the threads finish their batches before they end.
///
/// Layout: a header slot (magic, slot count), then ``slotCount`` slots of ``slotBytes`` bytes,
/// each its own cache lines: requests held, replies held, the FNV-1a hash of the listener's name
/// (0: a free slot), the name's length, a receive under way (1) or not (0), and the name's first
/// ``nameBytes`` bytes.
package final class CrashLedger: @unchecked Sendable {
    package static let storeName = "udp-fanout.ledger"
    /// "UFLEDG02", little endian.
    static let magic: UInt64 = 0x3230_4744_454c_4655
    static let slotBytes = 128
    /// Threads one process can note at once: more (1,024 workers and queues) run without a slot,
    /// said once.
    static let slotCount = 1024
    static let nameBytes = slotBytes - 40
    static var totalBytes: Int { slotBytes * (slotCount + 1) }

    /// What the previous process's threads of one listener held when it ended.
    package struct Held: Equatable, Sendable {
        package var requests: UInt64 = 0
        package var replies: UInt64 = 0
        /// Threads that were inside a receive system call: what it took is unknown.
        package var receiving: UInt64 = 0
    }

    /// One thread's place in the ledger, from ``claim(listener:)`` to ``release()``.
    package final class Slot: @unchecked Sendable {
        private let words: UnsafeMutablePointer<UInt64>
        private let index: Int
        private let ledger: CrashLedger
        private let released = Atomic<Bool>(false)
        /// What the slot says is held now (the owning thread's copy; only it writes the slot).
        private var pending = 0

        fileprivate init(words: UnsafeMutablePointer<UInt64>, index: Int, ledger: CrashLedger) {
            self.words = words
            self.index = index
            self.ledger = ledger
        }

        /// The thread holds `count` datagrams it received and has not yet handed to a send call.
        @inline(__always)
        package func holding(_ count: Int) {
            pending = count
            shim_store_shared_u64(words, UInt64(truncatingIfNeeded: count))
        }

        /// The next send call carries `count` of the datagrams held: noted just before the call
        /// (the kernel completes a send call it entered, whatever signal comes: what it carries
        /// goes out, or is dropped and counted by the thread).
        @inline(__always)
        package func handing(_ count: Int) {
            guard count > 0 else { return }
            holding(max(0, pending - count))
        }

        /// The thread enters a receive system call: what it takes is noted only once it returns.
        @inline(__always)
        package func receiving() { shim_store_shared_u64(words + 4, 1) }

        /// A receive that is not a batch of requests (a relay's replies) is over: what it read is
        /// noted as replies staged.
        @inline(__always)
        package func receiveDone() { shim_store_shared_u64(words + 4, 0) }

        /// The receive call returned `count` datagrams: held from now on.
        @inline(__always)
        package func received(_ count: Int) {
            holding(count)
            shim_store_shared_u64(words + 4, 0)
        }

        /// The thread holds `count` replies staged for its clients (relay).
        @inline(__always)
        package func holdingReplies(_ count: Int) { shim_store_shared_u64(words + 1, UInt64(truncatingIfNeeded: count)) }

        /// The thread ends: the slot is empty and free for another. Idempotent.
        package func release() {
            guard !released.exchange(true, ordering: .relaxed) else { return }
            ledger.free(index, words)
        }

        deinit { release() }
    }

    private let fd: Int32
    private let base: UnsafeMutableRawPointer
    private let logger: Logger
    private weak var descriptors: DescriptorStore?
    private let freeSlots: Mutex<[Int]>
    /// What the previous process's threads held, by listener, with the slots it is in: they stay
    /// as they are until ``commit()`` (a process that crashes before it started leaves them to
    /// the next one).
    private let inherited: Mutex<[String: (held: Held, slots: [Int])]>
    private let fullSaid = Atomic<Bool>(false)

    private init(fd: Int32, base: UnsafeMutableRawPointer, inherited: [String: (held: Held, slots: [Int])], logger: Logger) {
        self.fd = fd
        self.base = base
        self.logger = logger
        self.inherited = Mutex(inherited)
        let reserved = Set(inherited.values.flatMap(\.slots))
        freeSlots = Mutex((1...Self.slotCount).reversed().filter { !reserved.contains($0) })
    }

    deinit {
        munmap(base, Self.totalBytes)
        close(fd)
    }

    /// The ledger of this process: the previous process's, taken over from the store (what its
    /// threads held is read out first; its slots are emptied by ``commit()``), else a new one stored there.
    /// nil when no service manager keeps descriptors (nothing would outlive a crash) or the
    /// memory cannot be had (logged: crash losses go uncounted).
    package static func open(descriptors: DescriptorStore, logger: Logger) -> CrashLedger? {
        guard descriptors.stores else { return nil }
        var handed = descriptors.take(storeName)
        while !handed.isEmpty {
            let fd = handed.removeFirst()
            if let base = map(fd, checking: true) {
                for extra in handed { close(extra) }
                let held = readOut(base)
                if !held.isEmpty { descriptors.count("ledger", .adopted, note: "\(storeName): the previous process ended without a stop; its threads held datagrams of \(held.keys.sorted().joined(separator: ", ")): counted at those listeners' start") }
                let ledger = CrashLedger(fd: fd, base: base, inherited: held, logger: logger)
                ledger.descriptors = descriptors
                return ledger
            }
            close(fd)
            descriptors.remove(storeName)
            descriptors.count("ledger", .rejected, note: "\(storeName): not a ledger this version reads (another size or layout): a crash of the previous process went uncounted, if it crashed")
            logger.warning("the previous process's crash ledger is not one this version reads: if it crashed, what its threads held goes uncounted")
        }
        let fd = shim_memfd(storeName)
        guard fd >= 0 else {
            logger.warning("memfd_create failed: datagrams a crash takes with it will not be counted by the next process", metadata: ["errno": "\(-fd)"])
            return nil
        }
        guard ftruncate(fd, off_t(totalBytes)) == 0, let base = map(fd, checking: false) else {
            logger.warning("the crash ledger could not be sized or mapped: datagrams a crash takes with it will not be counted by the next process", metadata: ["errno": "\(errno)"])
            close(fd)
            return nil
        }
        base.storeBytes(of: magic, as: UInt64.self)
        base.storeBytes(of: UInt64(slotCount), toByteOffset: 8, as: UInt64.self)
        _ = descriptors.replace(storeName, with: [fd])
        return CrashLedger(fd: fd, base: base, inherited: [:], logger: logger)
    }

    /// Maps the ledger in `fd`; with `checking`, only one of this layout.
    private static func map(_ fd: Int32, checking: Bool) -> UnsafeMutableRawPointer? {
        if checking {
            var status = stat()
            guard fstat(fd, &status) == 0, Int(status.st_size) == totalBytes else { return nil }
        }
        guard let base = mmap(nil, totalBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), base != MAP_FAILED else { return nil }
        if checking {
            let words = base.assumingMemoryBound(to: UInt64.self)
            guard shim_load_shared_u64(words) == magic, shim_load_shared_u64(words + 1) == UInt64(slotCount) else {
                munmap(base, totalBytes)
                return nil
            }
        }
        return base
    }

    /// What each listener's threads held, by name, and the slots it is in; the other slots are
    /// emptied (threads of the previous process that held nothing).
    private static func readOut(_ base: UnsafeMutableRawPointer) -> [String: (held: Held, slots: [Int])] {
        var held: [String: (held: Held, slots: [Int])] = [:]
        for index in 1...slotCount {
            let words = (base + index * slotBytes).assumingMemoryBound(to: UInt64.self)
            let hash = shim_load_shared_u64(words + 2)
            let requests = shim_load_shared_u64(words)
            let replies = shim_load_shared_u64(words + 1)
            let receiving = shim_load_shared_u64(words + 4)
            if hash != 0 && (requests > 0 || replies > 0 || receiving != 0) {
                let length = Int(clamping: min(shim_load_shared_u64(words + 3), UInt64(nameBytes)))
                let name = String(decoding: UnsafeRawBufferPointer(start: UnsafeRawPointer(words + 5), count: length), as: UTF8.self)
                var entry = held[name] ?? (Held(), [])
                entry.held.requests &+= requests
                entry.held.replies &+= replies
                entry.held.receiving &+= receiving != 0 ? 1 : 0
                entry.slots.append(index)
                held[name] = entry
            } else {
                empty(words)
            }
        }
        return held
    }

    private static func empty(_ words: UnsafeMutablePointer<UInt64>) {
        for word in 0..<5 { shim_store_shared_u64(words + word, 0) }
    }

    /// A slot for a thread of `listener`; nil when every slot is taken (said once).
    package func claim(listener: String) -> Slot? {
        guard let index = freeSlots.withLock({ $0.popLast() }) else {
            if !fullSaid.exchange(true, ordering: .relaxed) {
                logger.warning("more forwarding threads than the crash ledger's \(Self.slotCount) slots: what the others hold at a crash goes uncounted", metadata: ["listener": "\(listener)"])
            }
            return nil
        }
        let words = (base + index * Self.slotBytes).assumingMemoryBound(to: UInt64.self)
        let name = Array(listener.utf8.prefix(Self.nameBytes))
        shim_store_shared_u64(words, 0)
        shim_store_shared_u64(words + 1, 0)
        shim_store_shared_u64(words + 4, 0)
        shim_store_shared_u64(words + 3, UInt64(name.count))
        UnsafeMutableRawPointer(words + 5).copyMemory(from: name, byteCount: name.count)
        // Last: a slot counts as a thread's once its name is whole.
        shim_store_shared_u64(words + 2, Self.hash(listener))
        return Slot(words: words, index: index, ledger: self)
    }

    fileprivate func free(_ index: Int, _ words: UnsafeMutablePointer<UInt64>) {
        shim_store_shared_u64(words + 2, 0)
        Self.empty(words)
        freeSlots.withLock { $0.append(index) }
    }

    /// What the previous process's threads of `listener` held when it ended, once (the
    /// listener's first start counts it); logged when anything.
    /// - Parameter countsReplies: the listener relays now, so replies held are counted (else only logged).
    package func takeInherited(_ listener: String, countsReplies: Bool = true) -> Held? {
        let key = String(decoding: listener.utf8.prefix(Self.nameBytes), as: UTF8.self)
        let held: Held? = inherited.withLock { inherited in
            guard let entry = inherited[key], entry.held != Held() else { return nil }
            // Taken: the slots stay (a crash before the start completes leaves them to the next
            // process) and are emptied by commit().
            inherited[key] = (Held(), entry.slots)
            return entry.held
        }
        guard let held else { return nil }
        Self.log(logger, listener: listener, held, counted: true, countsReplies: countsReplies)
        if held.receiving > 0 {
            descriptors?.count("ledger", .adopted, 0, note: "listener '\(listener)': \(held.receiving) thread(s) of the previous process were inside a receive call when it ended: what they took (up to settings.batch_size datagrams each) was lost uncounted")
        }
        return held
    }

    private static func log(_ logger: Logger, listener: String, _ held: Held, counted: Bool, countsReplies: Bool = true) {
        if held.requests > 0 || held.replies > 0 {
            let message: Logger.Message = !counted
                ? "the previous process ended without a stop holding datagrams of a listener this configuration does not have: lost, counted nowhere else"
                : countsReplies || held.replies == 0
                ? "the previous process ended without a stop holding datagrams it had read and not yet sent: counted dropped, reason crash"
                : "the previous process ended without a stop holding datagrams it had read and not yet sent: counted dropped, reason crash (its replies only logged: the listener no longer relays)"
            logger.warning(message, metadata: ["listener": "\(listener)", "datagrams": "\(held.requests)", "replies": "\(held.replies)"])
        }
        if held.receiving > 0 {
            logger.warning("the previous process ended without a stop while a thread was inside a receive call: what that call may have taken (up to settings.batch_size datagrams) was lost uncounted", metadata: [
                "listener": "\(listener)", "threads": "\(held.receiving)",
            ])
        }
    }

    /// After the first start: what the previous process held for listeners this configuration
    /// does not have is logged (no listener to count it on), and every slot of the previous
    /// process is emptied and free for this one's threads.
    package func commit() {
        let left = inherited.withLock { left in
            defer { left = [:] }
            return left
        }
        var slots: [Int] = []
        for (listener, entry) in left.sorted(by: { $0.key < $1.key }) {
            if entry.held != Held() { Self.log(logger, listener: listener, entry.held, counted: false) }
            slots += entry.slots
        }
        for index in slots { Self.empty((base + index * Self.slotBytes).assumingMemoryBound(to: UInt64.self)) }
        freeSlots.withLock { $0.append(contentsOf: slots) }
    }

    /// FNV-1a of the name, never 0 (0 marks a free slot).
    static func hash(_ name: String) -> UInt64 {
        var hash: UInt64 = 0xcbf2_9ce4_8422_2325
        for byte in name.utf8 { hash = (hash ^ UInt64(byte)) &* 0x100_0000_01b3 }
        return hash == 0 ? 1 : hash
    }

    /// The slots in use now (tests).
    package var claimedSlots: Int { Self.slotCount - freeSlots.withLock { $0.count } }
}

extension BatchReceiver {
    /// ``receive(from:flags:)`` noted in the thread's crash ledger slot: a receive under way
    /// before the call, what it took once it returned.
    @inline(__always)
    func receiveNoting(_ slot: CrashLedger.Slot?, from socket: Int32, flags: Int32) throws(SystemCallError) -> Int {
        guard let slot else { return try receive(from: socket, flags: flags) }
        slot.receiving()
        let count: Int
        do {
            count = try receive(from: socket, flags: flags)
        } catch {
            slot.received(0)
            throw error
        }
        slot.received(count)
        return count
    }
}
