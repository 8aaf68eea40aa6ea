// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim
import Logging
import Synchronization

/// `settings.flow_templates` across a restart, an upgrade or a crash: each listener's templates
/// (and, in the kernel kinds, its exporters' source ports) live in a memfd of the service
/// manager's store, `udp-fanout.tpl.<listener>` (docs/restarts.md), written anew within a second
/// of a change and once more at the stop; the next process takes them in when the listener
/// starts, so a change of collector after the restart is repaired as before it. Nothing is
/// written when no service manager keeps descriptors.
final class TemplateHandOver: Sendable {
    static let prefix = "udp-fanout.tpl."

    private let descriptors: DescriptorStore
    private let logger: Logger
    /// What this process stored, by listener: the memfd and what it held when written.
    private struct Written {
        var fd: Int32
        var generation: UInt64
        var ports: Int
    }
    private let written = Mutex<[String: Written]>([:])
    private let stop = StopSignal()
    private let thread = Mutex<OSThread?>(nil)

    init(descriptors: DescriptorStore, logger: Logger) {
        self.descriptors = descriptors
        self.logger = logger
    }

    /// The store name of `listener`'s templates: printable ASCII without `:`, others escaped
    /// (`%` and two hex digits); a name past systemd's 255 characters keeps its first 200 and
    /// a hash of the whole (FNV-1a, the same in every process).
    static func name(_ listener: String) -> String {
        let full = escapedName(listener)
        guard full.utf8.count > 255 else { return full }
        var hash: UInt64 = 0xcbf2_9ce4_8422_2325
        for byte in listener.utf8 { hash = (hash ^ UInt64(byte)) &* 0x100_0000_01b3 }
        return String(full.prefix(200)) + "~" + String(hash, radix: 16)
    }

    private static func escapedName(_ listener: String) -> String {
        var escaped = ""
        for byte in listener.utf8 {
            if (0x30...0x39).contains(byte) || (0x41...0x5a).contains(byte) || (0x61...0x7a).contains(byte) || byte == 0x2d || byte == 0x5f || byte == 0x2e {
                escaped.append(Character(UnicodeScalar(byte)))
            } else {
                escaped += "%" + String(byte, radix: 16, uppercase: true).leftPadded(to: 2)
            }
        }
        return prefix + escaped
    }

    /// At `listener`'s start: the previous process's templates for it, taken in once (a reload's
    /// successor instance shares the state already). Logged and counted (`udp_fanout_adoptions_total{kind="flow_templates"}`).
    func adopt(_ listener: String, into state: FlowTemplateState) {
        let name = Self.name(listener)
        for fd in descriptors.take(name) {
            defer { close(fd) }
            let bytes = Self.read(fd)
            if let (exporters, templates) = state.restore(bytes) {
                let note = "listener '\(listener)': the previous process's flow templates taken in: \(exporters) exporter(s), \(templates) template(s)"
                descriptors.count("flow_templates", .adopted, note: note)
                logger.info("flow_templates: the previous process's templates taken in: an exporter that changes collector before its next template is replayed to as before the restart", metadata: [
                    "listener": "\(listener)", "exporters": "\(exporters)", "templates": "\(templates)",
                ])
            } else {
                let note = "listener '\(listener)': \(name) holds no flow templates this version reads (\(bytes.count) bytes): not taken, the exporters' next templates are learnt"
                descriptors.count("flow_templates", .rejected, note: note)
                logger.warning("\(note)")
            }
        }
    }

    /// Starts the writer: what changed goes to the store once the templates have been still
    /// for 100 ms, and at least a second after the first change not written (a crash loses at
    /// most that much of what the exporters changed); only under a service manager.
    func start(states: @escaping @Sendable () -> [String: FlowTemplateState]) {
        guard descriptors.stores else { return }
        let stop = self.stop
        thread.withLock { thread in
            guard thread == nil else { return }
            thread = OSThread(name: "templates-store") { [weak self] in
                let clock = ContinuousClock()
                var written: UInt64 = 0
                var seen: (value: UInt64, at: ContinuousClock.Instant)?
                var pendingSince: ContinuousClock.Instant?
                while !stop.isSet {
                    usleep(50_000)
                    let current = states()
                    // Every change moves the generation of its listener, or adds an exporter's port.
                    let value = current.values.reduce(UInt64(current.count)) { sum, state in
                        sum &+ state.generation.load(ordering: .acquiring) &+ UInt64(state.kernelFollowing.withLock { $0.ports.count })
                    }
                    let now = clock.now
                    if value != seen?.value { seen = (value, now) }
                    guard value != written else {
                        pendingSince = nil
                        continue
                    }
                    let since = pendingSince ?? now
                    pendingSince = since
                    guard now - seen!.at >= .milliseconds(100) || now - since >= .seconds(1) else { continue }
                    self?.write(current)
                    written = value
                    pendingSince = nil
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

    /// Writes the templates of each listener in `states` that changed since last written, and
    /// takes those of listeners no longer in `states` (removed, or the option turned off) out of
    /// the store. Returns whether it wrote any.
    @discardableResult
    func write(_ states: [String: FlowTemplateState]) -> Bool {
        guard descriptors.stores else { return false }
        var wrote = false
        for (listener, state) in states.sorted(by: { $0.key < $1.key }) {
            let generation = state.generation.load(ordering: .acquiring)
            let ports = state.kernelFollowing.withLock { $0.ports.count }
            if let last = written.withLock({ $0[listener] }), last.generation == generation, last.ports == ports { continue }
            let bytes = state.handOverBytes()
            let name = Self.name(listener)
            let fd = shim_memfd(name)
            guard fd >= 0 else {
                logger.warning("flow_templates: memfd_create failed: the next process does not get this listener's templates", metadata: ["listener": "\(listener)", "errno": "\(-fd)"])
                continue
            }
            guard Self.write(bytes, to: fd) else {
                logger.warning("flow_templates: could not write the templates for the next process", metadata: ["listener": "\(listener)", "errno": "\(errno)"])
                close(fd)
                continue
            }
            // A new memfd each time: the one stored stays whole until this one replaces it.
            descriptors.replace(name, with: [fd])
            wrote = true
            let previous = written.withLock { written in
                defer { written[listener] = Written(fd: fd, generation: generation, ports: ports) }
                return written[listener]?.fd
            }
            if let previous { close(previous) }
        }
        let gone = written.withLock { written in
            let gone = written.filter { states[$0.key] == nil }
            for name in gone.keys { written[name] = nil }
            return gone
        }
        for (listener, entry) in gone {
            descriptors.remove(Self.name(listener))
            close(entry.fd)
        }
        // Taken over from the previous process but no longer following templates here.
        for name in descriptors.storedNames(prefix: Self.prefix) where !states.keys.contains(where: { Self.name($0) == name }) {
            descriptors.remove(name)
        }
        return wrote
    }

    private static func write(_ bytes: [UInt8], to fd: Int32) -> Bool {
        var offset = 0
        while offset < bytes.count {
            let count = bytes[offset...].withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, off_t(offset)) }
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
            guard count > 0 else { break }
            bytes += buffer[0..<count]
        }
        return bytes
    }
}

extension String {
    fileprivate func leftPadded(to width: Int) -> String {
        count >= width ? self : String(repeating: "0", count: width - count) + self
    }
}
