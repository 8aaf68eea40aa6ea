// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import CSystemShim
import Logging
import ReusePortLB
import Synchronization
import SystemCalls

/// The service manager's file descriptor store: what lets a restart, an upgrade or a crash under
/// systemd lose nothing (docs/restarts.md).
///
/// The daemon hands the descriptors its data path lives in to the service manager
/// (`FDSTORE=1`, sd_pid_notify_with_fds(3)), by name. systemd keeps them while the unit is
/// restarted, also automatically after a crash (`Restart=on-failure`), and gives them back to the
/// next process (`LISTEN_FDS`, `LISTEN_FDNAMES`, sd_listen_fds_with_names(3)); a UDP socket it
/// holds stays bound and queues what arrives meanwhile. It closes them when the unit is stopped
/// with no job queued for it (`systemctl stop`): so systemd itself tells a stop from a restart,
/// with the same SIGTERM for both. The unit needs `FileDescriptorStoreMax=`.
///
/// Names (at most 255 printable characters, no `:`):
/// - `udp-fanout.socket.<bind>.<slot>`: a userspace or relay listener's socket of worker `<slot>` on
///   `<bind>` (`:` written `_`);
/// - `udp-fanout.r.<bind hash>.<worker>.<inode>.<client>`: a relay session's socket (connected to
///   its downstream), one name each, so a closed session leaves the store alone; within a budget
///   (`sessionNameBudget`), since systemd passes every name back in one environment string;
/// - `udp-fanout.tcx.<interface>`: the TCX link of the tc_ebpf program (tc_ebpf and xdp listeners)
///   at an interface: it keeps forwarding on the last plan while no process runs;
/// - `udp-fanout.xdp.<interface>`: the xdp kind's XDP link at an interface, kept the same way and
///   swapped to the next process's program;
/// - `udp-fanout.tcmap.<layout>.<map>` and `udp-fanout.tcassoc.<layout>.<id>`: the tc program's
///   maps and nat listeners' association maps, taken over by a program of the same layout;
/// - `udp-fanout.xsk.<interface>.<queue>` and `udp-fanout.umem.<interface>.<queue>`: an af_xdp
///   listener's AF_XDP socket and its UMEM's memfd: after a crash, the next process reads out
///   what their rings hold before it binds the queue anew;
/// - `udp-fanout.ledger`: a memfd where the forwarding threads note what they hold (`CrashLedger`);
/// - `udp-fanout.tpl.<listener>`: a memfd with a `flow_templates` listener's templates
///   (`TemplateHandOver`);
/// - `udp-fanout.process`: a memfd saying which process stored them, its version, and when it
///   last ran or stopped, for the successor's log line and `/status`.
public final class DescriptorStore: Sendable {
    /// An adoption's outcome, for `udp_fanout_adoptions_total{kind,outcome}`.
    package enum Outcome: String, Sendable, CaseIterable {
        /// Taken over and used.
        case adopted
        /// Handed over but not usable (another bind, type or family): closed.
        case rejected
        /// Handed over for a bind this configuration does not have: closed.
        case unused
    }

    /// What the previous process left in its record.
    package struct Predecessor: Sendable, Equatable {
        package var pid: Int32
        package var version: String
        package var startedAt: Double
        /// Wall-clock seconds of its last heartbeat (once a second while it ran).
        package var lastSeenAt: Double
        /// Wall-clock seconds when its clean stop began; nil: it ended without one (a crash).
        package var stoppedAt: Double?
        /// Its start failed (it stopped with its error, handing over what it took over).
        package var startFailed = false
    }

    private struct State {
        var inherited: [String: [Int32]]
        var stored: Set<String> = []
        /// How many descriptors each stored name holds (the store's size, against the unit's
        /// `FileDescriptorStoreMax=`), and whether the warning about it was said.
        var storedCounts: [String: Int] = [:]
        var storedTotal = 0
        var storedNameBytes = 0
        var overLimitSaid = false
        var outcomes: [String: [Outcome: UInt64]] = [:]
        /// Lines for `/status`: what was adopted, rejected or left unused, and why.
        var report: [String] = []
        var record: Int32 = -1
    }

    private let state: Mutex<State>
    private let notifier: SystemdNotifier?
    private let logger: Logger
    /// The previous process's record, when one was handed over.
    package let predecessor: Predecessor?
    private let heartbeat = StopSignal()
    /// When this store was made (wall clock): the predecessor's unattended time ends here.
    package let startedAt = WallClock.seconds()

    package static let processName = "udp-fanout.process"

    /// - Parameters:
    ///   - inherited: descriptors handed over at start, by name.
    ///   - notifier: where `FDSTORE=1` goes; nil (or not under systemd): nothing is stored.
    package init(inherited: [String: [Int32]], notifier: SystemdNotifier?, logger: Logger) {
        self.logger = logger
        self.notifier = notifier?.path.map { $0.isEmpty ? nil : notifier } ?? nil
        var inherited = inherited
        var predecessor: Predecessor?
        for fd in inherited.removeValue(forKey: Self.processName) ?? [] {
            predecessor = predecessor ?? Self.readRecord(fd)
            close(fd)
        }
        self.predecessor = predecessor
        state = Mutex(State(inherited: inherited))
    }

    /// Nothing handed over, nothing stored (tests, in-process use).
    package static func none(logger: Logger) -> DescriptorStore {
        DescriptorStore(inherited: [:], notifier: nil, logger: logger)
    }

    /// The descriptors systemd handed to this process (`LISTEN_PID` is this process), by name;
    /// the variables are unset so that no child takes them, and each descriptor is made
    /// close-on-exec. Stores through `notifier` when run under systemd.
    public static func fromEnvironment(notifier: SystemdNotifier, logger: Logger) -> DescriptorStore {
        var environment: [String: String] = [:]
        for key in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
            if let value = getenv(key) { environment[key] = String(cString: value) }
            unsetenv(key)
        }
        let (named, problem) = parse(environment: environment, pid: getpid())
        if let problem { logger.warning("\(problem)") }
        if named.isEmpty, environment["LISTEN_FDS"] != nil {
            // Handed over but not for this process (LISTEN_PID of another: a wrapper that forked
            // instead of exec'ing, sudo, a shell without exec) or not countable: nothing is used,
            // and what this process inherited is closed, so nothing it holds (a previous
            // process's tc link forwarding on its old plan) stays alive through this process.
            let closed = closeInherited()
            logger.warning("descriptors handed over by the service manager are not for this process (LISTEN_PID=\(environment["LISTEN_PID"] ?? "unset"), this one is \(getpid()); LISTEN_FDS=\(environment["LISTEN_FDS"] ?? "")): none is used, \(closed) inherited descriptor(s) closed; start udp-fanout with exec (not through a wrapper that forks) to take the previous process's data path over")
        }
        var inherited: [String: [Int32]] = [:]
        for (name, fd) in named {
            guard fcntl(fd, F_SETFD, FD_CLOEXEC) == 0 else {
                logger.warning("a descriptor handed over by the service manager is not open: ignored", metadata: ["fd": "\(fd)", "name": "\(name)"])
                continue
            }
            inherited[name, default: []].append(fd)
        }
        return DescriptorStore(inherited: inherited, notifier: notifier, logger: logger)
    }

    /// Closes every descriptor above 2 without close-on-exec: at the start of the process these
    /// are only the ones it inherited (everything this process opens is close-on-exec).
    /// - Returns: how many were closed.
    private static func closeInherited() -> Int {
        guard let directory = opendir("/proc/self/fd") else { return 0 }
        var inherited: [Int32] = []
        while let entry = readdir(directory) {
            let name = withUnsafeBytes(of: entry.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            guard let fd = Int32(name), fd > 2, fd != dirfd(directory) else { continue }
            let flags = fcntl(fd, F_GETFD)
            if flags >= 0 && flags & FD_CLOEXEC == 0 { inherited.append(fd) }
        }
        closedir(directory)
        for fd in inherited { close(fd) }
        return inherited.count
    }

    /// sd_listen_fds_with_names(3): descriptors 3..<3+LISTEN_FDS with the names of
    /// LISTEN_FDNAMES (`unknown` where missing), when LISTEN_PID is `pid`.
    /// - Returns: the named descriptors, and a problem to log (values that do not parse).
    package static func parse(environment: [String: String], pid: Int32) -> (named: [(String, Int32)], problem: String?) {
        guard let count = environment["LISTEN_FDS"] else { return ([], nil) }
        guard let owner = environment["LISTEN_PID"], Int32(owner) == pid else {
            // Meant for another process (a parent that did not unset them): not ours to take.
            return ([], nil)
        }
        guard let total = Int(count), (0...65_536).contains(total) else {
            return ([], "LISTEN_FDS=\(count) is not a count of descriptors: fix the service manager's environment")
        }
        let names = environment["LISTEN_FDNAMES"].map { $0.split(separator: ":", omittingEmptySubsequences: false).map(String.init) } ?? []
        var problem: String?
        if !names.isEmpty && names.count != total {
            problem = "LISTEN_FDNAMES has \(names.count) name(s) for LISTEN_FDS=\(total): the descriptors without one are named unknown"
        }
        return ((0..<total).map { index in (index < names.count ? names[index] : "unknown", Int32(3 + index)) }, problem)
    }

    static let socketPrefix = "udp-fanout.socket."
    static let tcLinkPrefix = "udp-fanout.tcx."
    package static let relayPrefix = "udp-fanout.r."

    /// An address as a name part: systemd's names hold no `:`.
    static func escaped(_ address: SocketAddress) -> String {
        String("\(address)".map { $0 == ":" ? "_" : $0 })
    }

    /// What the listener sockets on `bind` are stored under: this, a dot and the worker's slot.
    package static func socketName(_ bind: SocketAddress) -> String {
        socketPrefix + escaped(bind)
    }

    /// The name of the listener socket of worker `slot` on `bind`.
    package static func socketName(_ bind: SocketAddress, slot: Int) -> String {
        socketName(bind) + ".\(slot)"
    }

    /// What every relay session socket of a listener on `bind` is stored under starts with this
    /// (the bind as 8 hex digits of its hash: the names are short, see `sessionNameBudget`).
    package static func relaySessionPrefix(_ bind: SocketAddress) -> String {
        let hash = UInt32(truncatingIfNeeded: MaglevTable.fnv1a64("\(bind)", seed: 0))
        let hex = String(hash, radix: 16)
        return relayPrefix + String(repeating: "0", count: 8 - hex.count) + hex + "."
    }

    /// The name of a relay session socket: its worker, the socket's inode (hex; unique while it
    /// is open: a successor's session for the same client never shares the name) and its client.
    package static func relaySessionName(_ bind: SocketAddress, worker: Int, inode: UInt64, client: SocketAddress) -> String {
        relaySessionPrefix(bind) + "\(worker).\(String(inode, radix: 16)).\(escaped(client))"
    }

    /// The worker and client in a relay session's name (from ``relaySessionName(_:worker:inode:client:)``).
    package static func parseRelaySession(_ name: String, bind: SocketAddress) -> (worker: Int, client: SocketAddress)? {
        let prefix = relaySessionPrefix(bind)
        guard name.hasPrefix(prefix) else { return nil }
        let parts = name.dropFirst(prefix.count).split(separator: ".", maxSplits: 2, omittingEmptySubsequences: false)
        guard parts.count == 3, let worker = Int(parts[0]), worker >= 0, UInt64(parts[1], radix: 16) != nil,
              let client = SocketAddress(String(parts[2].map { $0 == "_" ? ":" : $0 }))
        else { return nil }
        return (worker, client)
    }

    static let tcMapPrefix = "udp-fanout.tcmap."

    /// The name under which the tc program's map `map` is stored: with the maps' layout, so a
    /// program of another layout never takes them (`FANOUT_MAPS_LAYOUT` in fanout_shared.h).
    package static func tcMapName(_ map: String) -> String {
        "\(tcMapPrefix)\(FANOUT_MAPS_LAYOUT).\(map)"
    }

    /// The name of the memfd listing the managed neighbour entries the tc program's pools need
    /// (made by the process that stored it).
    package static let tcNeighboursName = "udp-fanout.tcneigh"

    /// The name under which a nat listener's association map (listener id `id`) is stored.
    package static func tcAssociationsName(_ id: UInt32) -> String {
        "udp-fanout.tcassoc.\(FANOUT_MAPS_LAYOUT).\(id)"
    }

    /// Takes every name handed over that starts with `prefix` and whose rest `accepts`.
    /// (What is taken stays in the service manager's store, as this process's: it is replaced or
    /// removed like what this process stored itself.)
    package func takeAll(prefix: String, where accepts: (String) -> Bool = { _ in true }) -> [String: [Int32]] {
        state.withLock { state in
            let taken = state.inherited.filter { $0.key.hasPrefix(prefix) && accepts(String($0.key.dropFirst(prefix.count))) }
            for (name, fds) in taken { Self.taken(name, fds, &state) }
            return taken
        }
    }

    private static func taken(_ name: String, _ fds: [Int32], _ state: inout State) {
        state.inherited[name] = nil
        state.stored.insert(name)
        state.storedNameBytes += (fds.count - (state.storedCounts[name] ?? 0)) * (name.utf8.count + 1)
        state.storedTotal += fds.count - (state.storedCounts[name] ?? 0)
        state.storedCounts[name] = fds.count
    }

    /// The name under which the tc_ebpf program's TCX link at `interface` is stored.
    package static func tcLinkName(_ interface: String) -> String {
        tcLinkPrefix + escaped(interface: interface)
    }

    static let xdpLinkPrefix = "udp-fanout.xdp."

    /// The name under which the xdp kind's XDP link at `interface` is stored.
    package static func xdpLinkName(_ interface: String) -> String {
        xdpLinkPrefix + escaped(interface: interface)
    }

    static let xskPrefix = "udp-fanout.xsk."
    static let umemPrefix = "udp-fanout.umem."

    /// The names under which an af_xdp listener's AF_XDP socket of `queue` at `interface` and its
    /// UMEM's memfd are stored: a crash leaves what their rings hold to the next process.
    package static func xskNames(_ interface: String, queue: UInt32) -> (socket: String, umem: String) {
        let part = escaped(interface: interface) + ".\(queue)"
        return (xskPrefix + part, umemPrefix + part)
    }

    private static func escaped(interface: String) -> String {
        // systemd accepts printable ASCII without ':' (an interface name may hold other bytes).
        interface.utf8.map { byte in
            (0x21..<0x7f).contains(byte) && byte != UInt8(ascii: ":") && byte != UInt8(ascii: "%")
                ? String(UnicodeScalar(byte)) : "%" + (byte < 16 ? "0" : "") + String(byte, radix: 16)
        }.joined()
    }

    /// Set by ``stopping(version:startedAt:)`` when descriptors go to a service manager: the
    /// process is stopping and hands its data path over (fail static): kernel kinds leave their
    /// maps as they are and only close their own descriptors.
    package var handingOver: Bool { handingOverFlag.load(ordering: .relaxed) }
    private let handingOverFlag = Atomic<Bool>(false)

    /// While the first start runs (under a service manager): a listener it rolls back hands
    /// over instead of tearing down, so a failed start leaves the data path forwarding.
    package func handingOverWhile(starting: Bool) {
        if notifier != nil { handingOverFlag.store(starting, ordering: .relaxed) }
    }

    /// Whether descriptors go to a service manager (`NOTIFY_SOCKET` set).
    package var stores: Bool { notifier != nil }

    /// Takes the descriptors handed over under `name` (each once).
    package func take(_ name: String) -> [Int32] {
        state.withLock { state in
            guard let fds = state.inherited[name] else { return [] }
            Self.taken(name, fds, &state)
            return fds
        }
    }

    /// Takes the listener sockets handed over on `bind`: by worker slot, and nil for sockets
    /// stored without one (one name for all of a listener's sockets, before slots were named).
    package func takeSockets(_ bind: SocketAddress) -> [(slot: Int?, socket: Int32)] {
        let prefix = Self.socketName(bind) + "."
        var sockets: [(slot: Int?, socket: Int32)] = []
        for (name, fds) in takeAll(prefix: prefix).sorted(by: { $0.key < $1.key }) {
            let slot = Int(name.dropFirst(prefix.count))
            sockets += fds.map { (slot, $0) }
        }
        return sockets + take(Self.socketName(bind)).map { (nil, $0) }
    }

    /// Counts an adoption's outcome for `kind` and notes it for `/status`.
    package func count(_ kind: String, _ outcome: Outcome, _ amount: Int = 1, note: String) {
        state.withLock { state in
            state.outcomes[kind, default: [:]][outcome, default: 0] += UInt64(amount)
            state.report.append(note)
        }
    }

    /// Stores `descriptors` under `name` in place of what was stored under it before: the
    /// service manager holds them from now on (a failure is logged: the next restart then loses
    /// what arrives while no process runs). Nothing happens when not under a service manager.
    /// - Returns: whether the service manager took them all (false when not under one).
    @discardableResult
    package func replace(_ name: String, with descriptors: [Int32]) -> Bool {
        guard let notifier else { return false }
        notifier.send("FDSTOREREMOVE=1\nFDNAME=\(name)")
        let bytes = state.withLock { state in
            state.storedNameBytes - (state.storedCounts[name] ?? 0) * (name.utf8.count + 1) + descriptors.count * (name.utf8.count + 1)
        }
        guard bytes <= Self.nameBytesLimit else {
            noteStored(name, count: 0)
            logger.error("not handed to the service manager: systemd gives every stored name back in one environment variable (LISTEN_FDNAMES), which the kernel limits to 128 KiB, and the next start would fail to execute; a restart loses what arrives for these while no process runs (fewer listeners' workers, or fewer relay sessions: settings.max_sessions)", metadata: [
                "name": "\(name)", "descriptors": "\(descriptors.count)", "name_bytes": "\(bytes)",
            ])
            return false
        }
        var problem: String?
        // SCM_RIGHTS carries at most 253 descriptors per message.
        var start = 0
        while start < descriptors.count, problem == nil {
            let chunk = Array(descriptors[start..<min(start + 253, descriptors.count)])
            // FDPOLL=0: a socket error (POLLERR) must not make systemd drop a listener's socket.
            problem = notifier.send("FDSTORE=1\nFDNAME=\(name)\nFDPOLL=0", descriptors: chunk)
            start += chunk.count
        }
        noteStored(name, count: descriptors.count)
        if let problem {
            logger.warning("could not hand descriptors to the service manager: a restart loses what arrives while no process runs", metadata: [
                "name": "\(name)", "error": "\(problem)",
            ])
        }
        return problem == nil
    }

    /// The shipped unit's `FileDescriptorStoreMax=` (systemd/udp-fanout.service).
    static let storeLimit = 4096

    /// systemd hands every stored name back in one environment string, `LISTEN_FDNAMES` (each
    /// name and a `:`), and the kernel refuses a string over 128 KiB (MAX_ARG_STRLEN): the next
    /// start would fail to execute, again at every automatic restart. Nothing is stored past this.
    static let nameBytesLimit = 126_000
    /// Relay sessions are stored only while all names take at most this, and the store holds at
    /// most ``storeLimit`` less `sessionReserve` descriptors: the rest is kept for listener
    /// sockets, links and maps, which a restart needs more.
    static let sessionNameBudget = 100_000
    static let sessionReserve = 256

    /// What became of a store request.
    package enum StoreOutcome: Equatable {
        case stored
        /// The service manager's queue was full (EAGAIN): worth sending again soon.
        case busy
        /// Past the budget for relay sessions (`sessionNameBudget`, `sessionReserve`).
        case overBudget
        /// Not under a service manager, or it failed otherwise: not worth sending again.
        case failed(String)
    }

    /// The names starting with `prefix` this process keeps in the service manager's store
    /// (stored, or taken over from the previous process).
    package func storedNames(prefix: String) -> [String] {
        state.withLock { $0.stored.filter { $0.hasPrefix(prefix) }.sorted() }
    }

    /// Whether this process keeps `name` in the service manager's store.
    package func isStored(_ name: String) -> Bool { state.withLock { $0.stored.contains(name) } }

    /// Name bytes `LISTEN_FDNAMES` would take for what this process keeps stored now.
    package var storedNameBytes: Int { state.withLock { $0.storedNameBytes } }

    /// Descriptors this process keeps in the service manager's store now.
    package var storedDescriptors: Int { state.withLock { $0.storedTotal } }

    /// Records `count` descriptors stored under `name` (0: none), and says once when the store
    /// holds more than the shipped unit allows (again after falling below and crossing again).
    private func noteStored(_ name: String, count: Int) {
        let total = state.withLock { state -> Int? in
            state.storedNameBytes += (count - (state.storedCounts[name] ?? 0)) * (name.utf8.count + 1)
            state.storedTotal += count - (state.storedCounts[name] ?? 0)
            if count > 0 {
                state.stored.insert(name)
                state.storedCounts[name] = count
            } else {
                state.stored.remove(name)
                state.storedCounts[name] = nil
            }
            let total = state.storedTotal
            defer { state.overLimitSaid = total > Self.storeLimit }
            return state.overLimitSaid ? nil : total
        }
        if let total, total > Self.storeLimit {
            logger.warning("more descriptors are in the service manager's store than the shipped unit's FileDescriptorStoreMax=\(Self.storeLimit) allows: systemd keeps no more than its maximum, and a restart loses the share of the sockets it did not keep; raise it in a drop-in (systemctl edit udp-fanout: [Service] FileDescriptorStoreMax=\(total * 2))", metadata: [
                "descriptors": "\(total)",
            ])
        }
    }

    /// Takes `name` out of the service manager's store now (what it names is released: a tc_ebpf
    /// link must not stay attached through the store's copy).
    /// - Parameter waiting: false: not waiting for a service manager whose queue is full (a
    ///   forwarding thread): the caller tries again later.
    /// - Returns: `.stored` when the service manager took the request (the name is out), `.busy`
    ///   when its full queue refused it (not waiting, or waiting past the send timeout), else
    ///   `.failed`.
    @discardableResult
    package func remove(_ name: String, waiting: Bool = true) -> StoreOutcome {
        guard let notifier else { return .stored }
        let (problem, error) = notifier.sendReporting("FDSTOREREMOVE=1\nFDNAME=\(name)", descriptors: [], waiting: waiting)
        guard let problem else {
            noteStored(name, count: 0)
            return .stored
        }
        return error == EAGAIN ? .busy : .failed(problem)
    }

    /// Stores one descriptor under a name of its own (a relay session's socket), by default
    /// without waiting for the service manager: false when it did not take it (its queue is
    /// full, or it failed).
    package func store(_ name: String, _ descriptor: Int32, waiting: Bool = false) -> StoreOutcome {
        guard let notifier else { return .failed("not under a service manager") }
        let fits = state.withLock { state in
            state.storedTotal < Self.storeLimit - Self.sessionReserve && state.storedNameBytes + name.utf8.count + 1 <= Self.sessionNameBudget
        }
        guard fits else { return .overBudget }
        let (problem, error) = notifier.sendReporting("FDSTORE=1\nFDNAME=\(name)\nFDPOLL=0", descriptors: [descriptor], waiting: waiting)
        guard let problem else {
            noteStored(name, count: 1)
            return .stored
        }
        return error == EAGAIN ? .busy : .failed(problem)
    }

    /// Stores a listener's sockets on `bind`, one name per worker slot, in place of what was
    /// stored for the bind before (slots a smaller group no longer has are taken out).
    package func replaceSockets(_ bind: SocketAddress, with sockets: [Int32]) {
        guard notifier != nil else { return }
        let prefix = Self.socketName(bind) + "."
        let stale = state.withLock { state in
            state.stored.filter { name in
                name == Self.socketName(bind) || (name.hasPrefix(prefix) && Int(name.dropFirst(prefix.count)).map { $0 >= sockets.count } ?? true)
            }
        }
        for name in stale.sorted() { remove(name) }
        for (slot, socket) in sockets.enumerated() { replace(Self.socketName(bind, slot: slot), with: [socket]) }
    }

    /// Takes every listener socket stored by this process for a bind not in `binds` (names from
    /// ``socketName(_:)``) out of the service manager's store (a listener removed by a reload:
    /// its sockets must not outlive it).
    package func forgetSockets(except binds: Set<String>) {
        let gone = state.withLock { state in
            state.stored.filter { name in
                name.hasPrefix(Self.socketPrefix) && !binds.contains { name == $0 || name.hasPrefix($0 + ".") }
            }
        }
        for name in gone.sorted() { remove(name) }
    }

    /// After the first start: closes what was handed over and not taken (a bind the
    /// configuration no longer has), counted `unused`, and takes it out of the store.
    package func closeUnused() {
        let unused = state.withLock { state in
            let unused = state.inherited
            state.inherited = [:]
            return unused
        }
        // Relay sessions: one line per listener's bind (there may be thousands).
        let sessions = unused.filter { $0.key.hasPrefix(Self.relayPrefix) }
        for (prefix, names) in Dictionary(grouping: sessions.keys, by: { String($0.prefix(Self.relayPrefix.count + 9)) }).sorted(by: { $0.key < $1.key }) {
            let fds = names.flatMap { sessions[$0] ?? [] }
            for fd in fds { close(fd) }
            for name in names { notifier?.send("FDSTOREREMOVE=1\nFDNAME=\(name)") }
            let note = "\(prefix)*: \(fds.count) relay session socket(s) handed over for a bind no relay listener of this configuration has: closed, those clients start anew"
            count(Replies.relay.rawValue, .unused, fds.count, note: note)
            logger.warning("\(note)")
        }
        for (name, fds) in unused.sorted(by: { $0.key < $1.key }) where !name.hasPrefix(Self.relayPrefix) {
            let socket = name.hasPrefix(Self.socketPrefix)
            let queued = socket ? " (\(fds.reduce(0) { $0 + Self.queuedBytes($1) }) bytes were queued in them)" : ""
            for fd in fds { close(fd) }
            notifier?.send("FDSTOREREMOVE=1\nFDNAME=\(name)")
            let kind = socket ? Mode.userspace.rawValue : name.hasPrefix("udp-fanout.tc") ? Mode.tcEBPF.rawValue
                : name.hasPrefix(Self.xskPrefix) || name.hasPrefix(Self.umemPrefix) ? Mode.afXDP.rawValue
                : name.hasPrefix(Self.xdpLinkPrefix) ? Mode.xdp.rawValue : name.hasPrefix(TemplateHandOver.prefix) ? "flow_templates" : "unknown"
            let note = "\(name): \(fds.count) descriptor(s) handed over that no listener of this configuration uses: closed\(queued)"
            count(kind, .unused, fds.count, note: note)
            logger.warning("\(note)")
        }
    }

    /// Closes what was handed over under `name` and takes it out of the store (counted unused,
    /// logged with `why`): a previous process's descriptor this one must not keep.
    /// - Parameter close: how each descriptor goes (a link: detached first, so it is gone at
    ///   once, not when the service manager reads the removal and drops its copy).
    package func closeHandedOver(_ name: String, kind: String, why: String, close closing: (Int32) -> Void = { _ = close($0) }) {
        let fds = take(name)
        guard !fds.isEmpty else { return }
        for fd in fds { closing(fd) }
        remove(name)
        let note = "\(name): \(why): closed"
        count(kind, .unused, fds.count, note: note)
        logger.notice("\(note)")
    }

    /// Bytes a socket's receive queue holds (SO_MEMINFO); 0 if it cannot be read.
    static func queuedBytes(_ fd: Int32) -> Int {
        (try? UDPSocket.memoryInfo(fd))?.queuedBytes ?? 0
    }

    /// Adoption outcomes by kind, for /metrics.
    package var outcomes: [String: [Outcome: UInt64]] { state.withLock { $0.outcomes } }

    /// `udp_fanout_adoptions_total{kind,outcome}`: every outcome of the kinds that hand over,
    /// 0 included, and of any other kind something was counted for.
    package func metrics() -> String {
        let counted = outcomes
        var out = "# HELP udp_fanout_adoptions_total Descriptors handed over by the previous process (the service manager's store) at this start, by kind and outcome: adopted, rejected (not usable: closed), unused (no listener of this configuration: closed)\n# TYPE udp_fanout_adoptions_total counter\n"
        for kind in Set(counted.keys).union([Mode.userspace.rawValue, Replies.relay.rawValue, Mode.tcEBPF.rawValue, Mode.xdp.rawValue, Mode.afXDP.rawValue]).sorted() {
            for outcome in Outcome.allCases {
                out += "udp_fanout_adoptions_total{kind=\"\(PrometheusText.escape(kind))\",outcome=\"\(outcome.rawValue)\"} \(counted[kind]?[outcome] ?? 0)\n"
            }
        }
        return out
    }

    /// What was adopted, rejected or left unused at this start, for /status.
    package var report: [String] { state.withLock { $0.report } }

    // MARK: The process record

    /// Logs what the previous process left (how long the data path ran unattended after a crash)
    /// and stores this process's record, refreshed every 100 ms until ``stopping(version:startedAt:)``.
    package func announce(version: String, startedAt: Double) {
        if let previous = predecessor {
            let now = self.startedAt
            var metadata: Logger.Metadata = [
                "previous_pid": "\(previous.pid)", "previous_version": "\(previous.version)",
            ]
            if let stopped = previous.stoppedAt, previous.startFailed {
                metadata["stopped_seconds_ago"] = "\(Self.rounded(now - stopped))"
                logger.notice("taking over from the previous process, whose start failed (its log says why): what it took over forwarded on meanwhile", metadata: metadata)
            } else if let stopped = previous.stoppedAt {
                metadata["stopped_seconds_ago"] = "\(Self.rounded(now - stopped))"
                logger.info("taking over from the previous process, which began a clean stop", metadata: metadata)
            } else {
                metadata["unattended_seconds"] = "\(Self.rounded(now - previous.lastSeenAt))"
                logger.warning("the previous process ended without a stop (a crash or kill -9): its data path ran unattended on its last plan until this start", metadata: metadata)
            }
        }
        guard let notifier else { return }
        let fd = shim_memfd(Self.processName)
        guard fd >= 0 else {
            logger.warning("memfd_create failed: the next process will not know which process it takes over from", metadata: ["errno": "\(-fd)"])
            return
        }
        state.withLock { $0.record = fd }
        writeRecord(version: version, startedAt: startedAt, stoppedAt: nil)
        notifier.send("FDSTOREREMOVE=1\nFDNAME=\(Self.processName)")
        if notifier.send("FDSTORE=1\nFDNAME=\(Self.processName)\nFDPOLL=0", descriptors: [fd]) == nil {
            noteStored(Self.processName, count: 1)
        }
        let signal = heartbeat
        OSThread.detached(name: "fdstore-heartbeat") { [weak self] in
            while !signal.isSet {
                usleep(100_000)
                guard let self, !signal.isSet else { return }
                self.writeRecord(version: version, startedAt: startedAt, stoppedAt: nil)
            }
        }
    }

    /// The clean stop begins: the record says so (the successor logs a stop, not a crash).
    package func stopping(version: String, startedAt: Double) {
        if notifier != nil { handingOverFlag.store(true, ordering: .relaxed) }
        heartbeat.set()
        writeRecord(version: version, startedAt: startedAt, stoppedAt: WallClock.seconds())
    }

    /// The start failed and the process stops with its error: the record says so (the successor
    /// logs a failed start, not a crash).
    package func startFailed(version: String, startedAt: Double) {
        heartbeat.set()
        writeRecord(version: version, startedAt: startedAt, stoppedAt: WallClock.seconds(), failed: true)
    }

    private func writeRecord(version: String, startedAt: Double, stoppedAt: Double?, failed: Bool = false) {
        var text = "pid=\(getpid())\nversion=\(version)\nstarted=\(startedAt)\nseen=\(WallClock.seconds())\n"
        if let stoppedAt { text += "stopped=\(stoppedAt)\n" }
        if failed { text += "start_failed=1\n" }
        // Fixed size: a reader never sees the tail of a longer earlier record.
        var bytes = Array(text.utf8.prefix(511))
        bytes += [UInt8](repeating: 0, count: 512 - bytes.count)
        state.withLock { state in
            guard state.record >= 0 else { return }
            _ = pwrite(state.record, bytes, bytes.count, 0)
        }
    }

    static func readRecord(_ fd: Int32) -> Predecessor? {
        var bytes = [UInt8](repeating: 0, count: 512)
        let count = pread(fd, &bytes, bytes.count, 0)
        guard count > 0 else { return nil }
        let text = String(decoding: bytes[0..<count].prefix { $0 != 0 }, as: UTF8.self)
        return parseRecord(text)
    }

    package static func parseRecord(_ text: String) -> Predecessor? {
        var fields: [String: String] = [:]
        for line in text.split(separator: "\n") {
            guard let equals = line.firstIndex(of: "=") else { continue }
            fields[String(line[..<equals])] = String(line[line.index(after: equals)...])
        }
        guard let pid = fields["pid"].flatMap({ Int32($0) }), let version = fields["version"],
              let started = fields["started"].flatMap({ Double($0) }), let seen = fields["seen"].flatMap({ Double($0) })
        else { return nil }
        return Predecessor(pid: pid, version: version, startedAt: started, lastSeenAt: seen, stoppedAt: fields["stopped"].flatMap { Double($0) },
                           startFailed: fields["start_failed"] == "1")
    }

    private static func rounded(_ seconds: Double) -> String {
        String(Double(Int((seconds * 1000).rounded())) / 1000)
    }
}
