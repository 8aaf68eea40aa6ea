// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFObjects
import CLibBPF
import SystemCalls
import Synchronization

/// Opens one of the embedded BPF objects, lets `prepare` adjust it before load (map sizes,
/// read-only globals), loads it, and returns our own close-on-exec descriptors: the program
/// named `program`, then the maps in the order of `maps`. libbpf's object is closed before
/// returning, so the descriptors are all that holds the program and maps.
package func loadEmbeddedObject(
    _ which: BPFObject, program: String, maps: [String],
    prepare: (OpaquePointer) throws(SystemCallError) -> Void = { _ in }
) throws(SystemCallError) -> [Int32] {
    libbpf_set_print(nil)  // errors come back as errno; libbpf's own log would go to stderr
    let elf = try BPFObjectOverride.bytes(which)
    // A replaced object's errors name its file and the way back.
    let origin = BPFObjectOverride.path(which).map { " of \($0) (\(BPFObjectOverride.variable): compile it from bpf/ as docs/development.md says, or unset the variable)" } ?? ""
    guard let object = elf.withUnsafeBytes({ bpf_object__open_mem($0.baseAddress, $0.count, nil) }) else {
        throw SystemCallError(call: "bpf_object__open_mem \(program)\(origin)", errno: errno)
    }
    defer { bpf_object__close(object) }
    try prepare(object)
    // libbpf loads without a log first and, on a failure, retries with log level 1 into this
    // buffer: a refused program's error then says what the verifier said, not only errno 22.
    let logSize = 1 << 20
    let log = UnsafeMutablePointer<CChar>.allocate(capacity: logSize)
    defer { log.deallocate() }
    log[0] = 0
    guard let handle = bpf_object__find_program_by_name(object, program) else {
        throw SystemCallError(call: "bpf_object__find_program_by_name \(program)\(origin)", errno: ENOENT)
    }
    bpf_program__set_log_buf(handle, log, logSize)
    let loaded = bpf_object__load(object)
    if loaded < 0 {
        let error = loaded == -1 ? errno : -loaded
        throw SystemCallError(call: "bpf_object__load \(program)\(origin)" + verifierExcerpt(String(cString: log)), errno: error)
    }
    var libbpfOwned = [bpf_program__fd(bpf_object__find_program_by_name(object, program))]
    for name in maps { libbpfOwned.append(bpf_map__fd(bpf_object__find_map_by_name(object, name))) }
    var descriptors: [Int32] = []
    for fd in libbpfOwned {
        do {
            descriptors.append(try systemCall("fcntl F_DUPFD_CLOEXEC") { fcntl(fd, F_DUPFD_CLOEXEC, 0) })
        } catch {
            for open in descriptors { close(open) }
            throw error
        }
    }
    return descriptors
}

/// What a verifier log says about why it refused the program, on one line (at most 400
/// characters), or nothing for an empty log. The verifier ends with statistics and, for some
/// errors, state dumps after its message: those, instruction traces ("12: (bf) r1 = r6") and
/// source lines ("; ...") are skipped, and the last two other lines kept.
func verifierExcerpt(_ log: String) -> String {
    let lines = log.split(separator: "\n").map { $0.trimmingCharacters(in: " \t") }.filter { !$0.isEmpty }
    guard !lines.isEmpty else { return "" }
    func isNoise(_ line: String) -> Bool {
        for prefix in ["processed ", "old state:", "cur state:", "verification time", "stack depth", "; ", "from "]
        where line.hasPrefix(prefix) {
            return true
        }
        let number = line.prefix { $0.isNumber }
        return !number.isEmpty && line.dropFirst(number.count).hasPrefix(":")
    }
    let messages = lines.filter { !isNoise($0) }
    let chosen = messages.isEmpty ? [lines.last!] : Array(messages.suffix(2))
    return " (verifier: \(String(chosen.joined(separator: " | ").suffix(400))))"
}

/// One entry of a per-CPU map whose value is `words` u64 counters, summed over the CPUs
/// counter by counter.
package func perCPUSum(_ fd: Int32, key: UInt32, words: Int) throws(SystemCallError) -> [UInt64] {
    let cpus = max(1, Int(libbpf_num_possible_cpus()))
    var values = [UInt64](repeating: 0, count: words * cpus)
    var key = key
    try libbpfCall("bpf_map_lookup_elem per-CPU counters") { bpf_map_lookup_elem(fd, &key, &values) }
    var sums = [UInt64](repeating: 0, count: words)
    for cpu in 0..<cpus {
        for word in 0..<words { sums[word] &+= values[cpu * words + word] }
    }
    return sums
}

/// Writes `value` as `object`'s .rodata before the load: the object's only read-only global,
/// `global` of C type `type`. The size check guards against a second const global appearing in
/// .rodata unnoticed. `objectName` names the object in errors.
package func setReadOnlyGlobal<Value>(_ object: OpaquePointer, _ value: Value, objectName: String, global: String, type: String) throws(SystemCallError) {
    var map = bpf_object__next_map(object, nil)
    while let current = map {
        if String(cString: bpf_map__name(current)).hasSuffix(".rodata") {
            var size = 0
            guard bpf_map__initial_value(current, &size) != nil, size == MemoryLayout<Value>.size else {
                throw SystemCallError(call: "\(objectName) .rodata is \(size) bytes, not \(type)", errno: EINVAL)
            }
            var value = value
            try libbpfCall("bpf_map__set_initial_value .rodata") { bpf_map__set_initial_value(current, &value, size) }
            return
        }
        map = bpf_object__next_map(object, current)
    }
    throw SystemCallError(call: "\(objectName) has no .rodata map for \(global)", errno: ENOENT)
}

/// udp-fanout's programs from a directory instead of the binary: `UDP_FANOUT_BPF_DIR` names a
/// directory of objects compiled from `bpf/` (`tc_fanout.bpf.o`, `xdp_fanout.bpf.o`,
/// `xdp_steer.bpf.o`, `map_count.bpf.o`, `fanout_quic_keys.bpf.o`, and the `_plain` builds a kernel
/// without BPF crypto kfuncs loads); each one found there is loaded instead of the embedded
/// one. For development (a changed program tried on a running node without rebuilding the binary:
/// a restart swaps it in on the same maps, as an upgrade does) and the tests of that upgrade.
/// ReusePortLB's own program is never replaced: a library does not read this process setting.
package enum BPFObjectOverride {
    package static let variable = "UDP_FANOUT_BPF_DIR"

    /// The directory, when the variable is set and not empty.
    package static var directory: String? {
        guard let value = getenv(variable), value.pointee != 0 else { return nil }
        return String(cString: value)
    }

    /// The objects the directory replaces (their paths), for the start's log line.
    package static func replaced() -> [String] {
        BPFObject.allCases.compactMap(path)
    }

    /// Whether the directory exists (a mistyped one is said at the start).
    package static var directoryExists: Bool {
        var status = stat()
        guard let directory else { return false }
        return stat(directory, &status) == 0 && (status.st_mode & S_IFMT) == S_IFDIR
    }

    /// The file that replaces `which`: any entry of its name in the directory (a dangling link
    /// or a directory there fails the load, naming it), nil when there is none.
    package static func path(_ which: BPFObject) -> String? {
        guard which != .reuseportSelect, let directory else { return nil }
        let path = directory + "/" + which.fileName
        var status = stat()
        return lstat(path, &status) == 0 ? path : nil
    }

    /// What is wrong with the objects the directory replaces (each opened, not loaded: not a
    /// BPF object, or without the program its loader takes, named in `programs`), for `--check`.
    package static func problems(programs: [BPFObject: String]) -> [String] {
        BPFObject.allCases.compactMap { which -> String? in
            guard let path = path(which) else { return nil }
            let bytes: [UInt8]
            do { bytes = try Self.bytes(which) } catch { return "\(error)" }
            libbpf_set_print(nil)
            guard let object = bytes.withUnsafeBytes({ bpf_object__open_mem($0.baseAddress, $0.count, nil) }) else {
                return "\(path) (\(variable)) is not a BPF object libbpf can open (errno \(errno)): compile it from bpf/ as docs/development.md says, or unset \(variable)"
            }
            defer { bpf_object__close(object) }
            guard let expected = programs[which] else { return nil }
            return bpf_object__find_program_by_name(object, expected) == nil
                ? "\(path) (\(variable)) has no program \(expected): it is not \(which.fileName) compiled from bpf/"
                : nil
        }
    }

    /// The files as first read (the start reads them, for its warning and `--check`): every
    /// later load (a reload, a first use) takes the same bytes, whatever the directory holds now.
    private static let kept = Mutex<[BPFObject: [UInt8]]>([:])

    /// The bytes to load for `which`: the directory's file when it has one (as first read),
    /// else the embedded object.
    static func bytes(_ which: BPFObject) throws(SystemCallError) -> [UInt8] {
        if let bytes = kept.withLock({ $0[which] }) { return bytes }
        guard let path = path(which) else { return which.elfBytes }
        let bytes = try readFile(path)
        kept.withLock { $0[which] = $0[which] ?? bytes }
        return kept.withLock { $0[which]! }
    }

    private static func readFile(_ path: String) throws(SystemCallError) -> [UInt8] {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { throw SystemCallError(call: "open \(path) (\(variable))", errno: errno) }
        defer { close(fd) }
        var bytes: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 65536)
        while true {
            let count = chunk.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
            if count < 0 {
                if errno == EINTR { continue }
                throw SystemCallError(call: "read \(path) (\(variable))", errno: errno)
            }
            if count == 0 { break }
            bytes += chunk[0..<count]
        }
        return bytes
    }
}
