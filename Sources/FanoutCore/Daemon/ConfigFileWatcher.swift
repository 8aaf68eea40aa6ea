// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif

/// `--watch-config`: notices that the configuration file changed (as sbulb polls its file each
/// second), so a reload needs no SIGHUP. A change is a new inode, size, modification or status
/// change time (an editor's rename, a Kubernetes ConfigMap's symlink swap, an in-place write)
/// whose content differs from the last content seen: touching the file reloads nothing. A file
/// still being written is not read: its fingerprint must stay the same for one poll first. The
/// reload parses exactly the bytes compared here (``Look/changed(_:)``), so what is loaded is
/// what the baseline becomes.
struct ConfigFileWatcher {
    let path: String
    private var fingerprint: Fingerprint?
    /// A new fingerprint seen at the last look, waiting to hold still for one poll.
    private var settling: Fingerprint?
    private var content: [UInt8]?
    /// Why the file could not be read at the last look (logged once per problem, not per poll).
    private(set) var problem: String?

    struct Fingerprint: Equatable {
        var device: UInt64, inode: UInt64, size: Int64
        var modified: Int64, changed: Int64
    }

    init(path: String) {
        self.path = path
        rebase()
    }

    /// Takes the file as it is now as the baseline (at start, and after any reload).
    mutating func rebase() {
        fingerprint = Self.fingerprint(path)
        content = Self.read(path)
    }

    enum Look: Equatable {
        /// Nothing new.
        case unchanged
        /// The content differs from the baseline: reload this text (the baseline is now it).
        case changed(String)
        /// The file cannot be read (the problem is new since the last look): say so once.
        case unreadable(String)
    }

    /// One poll: the file's fingerprint, and its content only when the fingerprint moved.
    mutating func look() -> Look {
        guard let now = Self.fingerprint(path) else {
            let reason = "cannot stat \(path): \(String(cString: strerror(errno)))"
            defer { problem = reason }
            return problem == reason ? .unchanged : .unreadable(reason)
        }
        guard now != fingerprint || problem != nil else {
            settling = nil
            return .unchanged
        }
        // Changed since the baseline: read it only once it held still for one poll.
        guard now == settling else {
            settling = now
            return .unchanged
        }
        settling = nil
        fingerprint = now
        guard let bytes = Self.read(path) else {
            let reason = "cannot read \(path): \(String(cString: strerror(errno)))"
            defer { problem = reason }
            return problem == reason ? .unchanged : .unreadable(reason)
        }
        problem = nil
        guard bytes != content else { return .unchanged }
        content = bytes
        return .changed(String(decoding: bytes, as: UTF8.self))
    }

    static func fingerprint(_ path: String) -> Fingerprint? {
        var info = stat()
        guard stat(path, &info) == 0 else { return nil }
        return Fingerprint(
            device: UInt64(info.st_dev), inode: UInt64(info.st_ino), size: Int64(info.st_size),
            modified: Int64(info.st_mtim.tv_sec) * 1_000_000_000 + Int64(info.st_mtim.tv_nsec),
            changed: Int64(info.st_ctim.tv_sec) * 1_000_000_000 + Int64(info.st_ctim.tv_nsec))
    }

    /// The whole file, or nil (errno says why). Configuration files are small (ConfigLimits).
    static func read(_ path: String) -> [UInt8]? {
        guard let file = fopen(path, "rb") else { return nil }
        defer { fclose(file) }
        var bytes: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 65536)
        while true {
            let count = fread(&chunk, 1, chunk.count, file)
            bytes.append(contentsOf: chunk[0..<count])
            if count < chunk.count { return ferror(file) != 0 ? nil : bytes }
        }
    }
}
