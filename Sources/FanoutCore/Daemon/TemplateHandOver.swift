// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim
import Logging
import Synchronization

/// `settings.flow_templates` across a restart, an upgrade or a crash: each listener's templates
/// (with, in the kernel kinds, its exporters' source ports and the set its program reads) live
/// in a memfd of the service manager's store (docs/restarts.md), written anew once they have
/// been still for 100 ms after a change (at least a second after the first change not written)
/// and at the stop; the next process takes them in when the listener starts, so a change of
/// collector after the restart is repaired as before it. Two names per listener,
/// `udp-fanout.tpl.<listener>.0` and `.1`, written in turn, each record numbered: a crash
/// between storing one and taking the other out leaves both, and the next process takes the
/// newer. Nothing is written when no service manager keeps descriptors.
final class TemplateHandOver: Sendable {
    static let prefix = "udp-fanout.tpl."
    /// The record's header: this, then its number (64 bits, big endian), then the state's record.
    static let magic: [UInt8] = Array("UFTHO1\n\u{0}".utf8)

    private let descriptors: DescriptorStore
    private let logger: Logger
    /// What this process stored, by listener: which state (a listener started anew has another),
    /// its hand-over version then, and the name it is under.
    private struct Written {
        var state: UInt64
        var version: UInt64
        var slot: Int
    }
    private let written = Mutex<[String: Written]>([:])
    /// The slot of the record taken in at a listener's start: its first write goes to the other
    /// one, so the record taken in stays whole until the new one is stored.
    private let adopted = Mutex<[String: Int]>([:])
    /// When storing a listener's record last failed: tried again a second later at the earliest.
    private let failed = Mutex<[String: ContinuousClock.Instant]>([:])
    /// The next record's number: above every record taken in.
    private let sequence = Atomic<UInt64>(1)
    private let stop = StopSignal()
    private let thread = Mutex<OSThread?>(nil)

    init(descriptors: DescriptorStore, logger: Logger) {
        self.descriptors = descriptors
        self.logger = logger
    }

    /// The store names of `listener`'s records (slots 0 and 1): printable ASCII without `:`,
    /// others escaped (`%` and two hex digits); a name past systemd's 255 characters keeps its
    /// first 200 and a hash of the whole listener name (FNV-1a, the same in every process).
    static func names(_ listener: String) -> [String] {
        var escaped = ""
        for byte in listener.utf8 {
            if (0x30...0x39).contains(byte) || (0x41...0x5a).contains(byte) || (0x61...0x7a).contains(byte) || byte == 0x2d || byte == 0x5f || byte == 0x2e {
                escaped.append(Character(UnicodeScalar(byte)))
            } else {
                let hex = String(byte, radix: 16, uppercase: true)
                escaped += "%" + (hex.count < 2 ? "0" + hex : hex)
            }
        }
        var base = prefix + escaped
        if base.utf8.count > 253 {
            var hash: UInt64 = 0xcbf2_9ce4_8422_2325
            for byte in listener.utf8 { hash = (hash ^ UInt64(byte)) &* 0x100_0000_01b3 }
            base = String(base.prefix(200)) + "~" + String(hash, radix: 16)
        }
        return [base + ".0", base + ".1"]
    }

    /// At `listener`'s start: the previous process's templates for it, taken in once (a reload's
    /// successor instance shares the state already): the newer of its two records that reads
    /// whole. Logged and counted (`udp_fanout_adoptions_total{kind="flow_templates"}`).
    /// - Parameter setInForce: the listener is tc_ebpf or xdp, whose program kept reading the set
    ///   the record holds.
    func adopt(_ listener: String, into state: FlowTemplateState, setInForce: Bool) {
        var records: [(number: UInt64, slot: Int, body: [UInt8])] = []
        var unreadable = 0
        for (slot, name) in Self.names(listener).enumerated() {
            for fd in descriptors.take(name) {
                let bytes = Self.read(fd)
                close(fd)
                var input = RecordReader(bytes)
                if input.take(Self.magic), let high = input.u32(), let low = input.u32(), let body = input.bytes(input.remaining) {
                    records.append((UInt64(high) << 32 | UInt64(low), slot, Array(body)))
                } else {
                    unreadable += 1
                }
            }
        }
        guard !records.isEmpty || unreadable > 0 else { return }
        // This process's records are numbered above every one it was handed, read or not.
        if let highest = records.map(\.number).max() { raiseSequence(above: highest) }
        for record in records.sorted(by: { $0.number > $1.number }) {
            guard let (exporters, templates) = state.restore(record.body, setInForce: setInForce) else {
                unreadable += 1
                logger.warning("flow_templates: a record of the previous process's templates this version does not read: the older one is tried", metadata: [
                    "listener": "\(listener)", "record": "\(record.number)",
                ])
                continue
            }
            adopted.withLock { $0[listener] = record.slot }
            let note = "listener '\(listener)': the previous process's flow templates taken in: \(exporters) exporter(s), \(templates) template(s)"
            descriptors.count("flow_templates", .adopted, note: note)
            logger.info("flow_templates: the previous process's templates taken in: an exporter that changes collector before its next template is replayed to as before the restart", metadata: [
                "listener": "\(listener)", "exporters": "\(exporters)", "templates": "\(templates)", "record": "\(record.number)",
            ])
            return
        }
        let note = "listener '\(listener)': no record of the previous process's flow templates this version reads (\(unreadable) unreadable): the exporters' next templates are learnt"
        descriptors.count("flow_templates", .rejected, unreadable, note: note)
        logger.warning("\(note)")
    }

    private func raiseSequence(above number: UInt64) {
        var current = sequence.load(ordering: .relaxed)
        while current <= number {
            let (exchanged, original) = sequence.compareExchange(expected: current, desired: number &+ 1, ordering: .relaxed)
            if exchanged { return }
            current = original
        }
    }

    /// Starts the writer (only under a service manager): a listener's templates go to the store
    /// once they have been still for 100 ms after a change, and at least a second after the first
    /// change not yet written (a crash loses at most that much of what the exporters changed).
    func start(states: @escaping @Sendable () -> [String: FlowTemplateState]) {
        guard descriptors.stores else { return }
        let stop = self.stop
        thread.withLock { thread in
            guard thread == nil else { return }
            thread = OSThread(name: "templates-store") { [weak self] in
                let clock = ContinuousClock()
                // Per listener: the state and version last seen, when it last moved, and since
                // when a change has waited.
                var seen: [String: (state: UInt64, version: UInt64, moved: ContinuousClock.Instant, waiting: ContinuousClock.Instant?)] = [:]
                while !stop.isSet {
                    usleep(50_000)
                    guard let self else { return }
                    let current = states()
                    let now = clock.now
                    var due = false
                    for (listener, state) in current {
                        let identity = state.serial, version = state.handOverVersion.load(ordering: .acquiring)
                        var entry = seen[listener] ?? (identity, version, now, nil)
                        if entry.state != identity || entry.version != version { entry = (identity, version, now, entry.waiting ?? now) }
                        if self.isWritten(listener, identity, version) {
                            entry.waiting = nil
                        } else {
                            let waiting = entry.waiting ?? now
                            entry.waiting = waiting
                            if now - entry.moved >= .milliseconds(100) || now - waiting >= .seconds(1) { due = true }
                        }
                        seen[listener] = entry
                    }
                    seen = seen.filter { current[$0.key] != nil }
                    if due || self.hasGone(current) { self.write(current) }
                }
            }
        }
    }

    /// Stops the writer and writes what changed once more (the stop: a reader of the kernel
    /// kinds consumed its ring buffer first).
    func finish(states: [String: FlowTemplateState]) {
        stop.set()
        thread.withLock { thread in
            defer { thread = nil }
            return thread
        }?.join()
        write(states)
    }

    private func isWritten(_ listener: String, _ state: UInt64, _ version: UInt64) -> Bool {
        written.withLock { $0[listener].map { $0.state == state && $0.version == version } ?? false }
    }

    /// Some listener this process stored a record for is no longer in `states`.
    private func hasGone(_ states: [String: FlowTemplateState]) -> Bool {
        written.withLock { $0.keys.contains { states[$0] == nil } }
    }

    /// Writes the record of each listener in `states` whose templates changed since written (or
    /// that is another state, started anew), and takes those of listeners no longer in `states`
    /// (removed, or the option turned off) out of the store. Returns whether it wrote any.
    @discardableResult
    func write(_ states: [String: FlowTemplateState]) -> Bool {
        guard descriptors.stores else { return false }
        var wrote = false
        let now = ContinuousClock.now
        for (listener, state) in states.sorted(by: { $0.key < $1.key }) {
            let identity = state.serial
            let version = state.handOverVersion.load(ordering: .acquiring)
            let last = written.withLock { $0[listener] }
            if let last, last.state == identity, last.version == version { continue }
            if let at = failed.withLock({ $0[listener] }), now - at < .seconds(1) { continue }
            var bytes = Self.magic
            let number = sequence.wrappingAdd(1, ordering: .relaxed).oldValue
            bytes += (0..<8).map { UInt8(truncatingIfNeeded: number >> (56 - 8 * $0)) }
            bytes += state.record()
            let fd = shim_memfd("udp-fanout.tpl")
            guard fd >= 0 else {
                failed.withLock { $0[listener] = now }
                logger.warning("flow_templates: memfd_create failed: the next process does not get this listener's latest templates (tried again in a second)", metadata: ["listener": "\(listener)", "errno": "\(-fd)"])
                continue
            }
            defer { close(fd) }
            guard Self.write(bytes, to: fd) else {
                failed.withLock { $0[listener] = now }
                logger.warning("flow_templates: could not write the templates for the next process (tried again in a second)", metadata: ["listener": "\(listener)", "errno": "\(errno)"])
                continue
            }
            // The other slot than the record stored (this process's last, or the one taken in)
            // takes the new record; that one stays whole until the new one is stored.
            let names = Self.names(listener)
            let slot = last.map { 1 - $0.slot } ?? adopted.withLock({ $0[listener] }).map { 1 - $0 } ?? (descriptors.isStored(names[0]) ? 1 : 0)
            guard descriptors.replace(names[slot], with: [fd]) else {
                // Said by the store; the record stored before, if any, stays.
                failed.withLock { $0[listener] = now }
                continue
            }
            failed.withLock { $0[listener] = nil }
            if descriptors.isStored(names[1 - slot]) { descriptors.remove(names[1 - slot]) }
            written.withLock { $0[listener] = Written(state: identity, version: version, slot: slot) }
            wrote = true
        }
        let gone = written.withLock { written in
            let gone = written.keys.filter { states[$0] == nil }
            for name in gone { written[name] = nil }
            return gone
        }
        for listener in gone {
            adopted.withLock { $0[listener] = nil }
            for name in Self.names(listener) where descriptors.isStored(name) { descriptors.remove(name) }
        }
        // Taken over from the previous process but no longer following templates here.
        let kept = Set(states.keys.flatMap(Self.names))
        for name in descriptors.storedNames(prefix: Self.prefix) where !kept.contains(name) {
            descriptors.remove(name)
        }
        return wrote
    }

    private static func write(_ bytes: [UInt8], to fd: Int32) -> Bool {
        var offset = 0
        while offset < bytes.count {
            let count = bytes[offset...].withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, off_t(offset)) }
            if count < 0 && errno == EINTR { continue }
            guard count > 0 else { return false }
            offset += count
        }
        return true
    }

    private static func read(_ fd: Int32) -> [UInt8] {
        var bytes: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 1 << 16)
        while true {
            let count = pread(fd, &buffer, buffer.count, off_t(bytes.count))
            if count < 0 && errno == EINTR { continue }
            guard count > 0 else { break }
            bytes += buffer[0..<count]
        }
        return bytes
    }
}
