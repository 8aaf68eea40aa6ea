// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB
import SystemCalls

/// The standard process series every Prometheus client library exports (`process_*`, read from
/// /proc/self at each scrape) and `udp_fanout_build_info`, so the dashboards and alerts written
/// for any exporter work here too.
package enum ProcessMetrics {
    /// The exposition text: CPU seconds, resident and virtual memory, open and maximum file
    /// descriptors, start time, and the build's version (a series of value 1).
    static func text() -> String {
        var out = ""
        func gauge(_ name: String, _ help: String, _ value: String, type: String = "gauge") {
            out += "# HELP \(name) \(help)\n# TYPE \(name) \(type)\n\(name) \(value)\n"
        }
        let ticks = Double(sysconf(Int32(_SC_CLK_TCK)))
        if let stat = statFields() {
            // After the command: state(0) … utime(11) stime(12) … starttime(19) vsize(20) rss(21).
            if let utime = Double(stat[11]), let stime = Double(stat[12]) {
                gauge("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", format((utime + stime) / ticks), type: "counter")
            }
            if let vsize = UInt64(stat[20]) { gauge("process_virtual_memory_bytes", "Virtual memory size in bytes.", "\(vsize)") }
            if let pages = UInt64(stat[21]) { gauge("process_resident_memory_bytes", "Resident memory size in bytes.", "\(pages * UInt64(sysconf(Int32(_SC_PAGESIZE))))") }
            if let start = startTime(stat) {
                gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.", format(start))
            }
        }
        if let open = openDescriptors() { gauge("process_open_fds", "Number of open file descriptors.", "\(open)") }
        if let limit = try? Syscall.getrlimit(Syscall.Resource.openFiles) {
            gauge("process_max_fds", "Maximum number of open file descriptors.", "\(limit.rlim_cur)")
        }
        out += "# HELP udp_fanout_build_info The udp-fanout build: its version (value 1).\n# TYPE udp_fanout_build_info gauge\n"
        out += "udp_fanout_build_info{version=\"\(ProjectVersion.string)\"} 1\n"
        return out
    }

    /// When the process started, in seconds since the epoch (from /proc/self/stat and btime).
    static func startTime(_ fields: [String]? = statFields()) -> Double? {
        guard let fields, let start = Double(fields[19]), let boot = bootTime() else { return nil }
        return boot + start / Double(sysconf(Int32(_SC_CLK_TCK)))
    }

    private static func format(_ value: Double) -> String {
        var text = String(value)
        if text.hasSuffix(".0") { text.removeLast(2) }
        return text
    }

    /// When process `pid` of this pid namespace started, seconds since the epoch (nil: no such process).
    package static func startTime(pid: Int32) -> Double? {
        startTime(statFields("/proc/\(pid)/stat"))
    }

    /// /proc/self/stat's fields after the command (which may hold spaces and parentheses).
    private static func statFields(_ path: String = "/proc/self/stat") -> [String]? {
        guard let text = read(path), let close = text.lastIndex(of: ")") else { return nil }
        let fields = text[text.index(after: close)...].split(separator: " ").map(String.init)
        return fields.count > 21 ? fields : nil
    }

    /// The boot time (btime of /proc/stat), in seconds since the epoch.
    private static func bootTime() -> Double? {
        guard let text = read("/proc/stat") else { return nil }
        for line in text.split(separator: "\n") where line.hasPrefix("btime ") {
            return Double(String(line.dropFirst(6).filter { $0 != " " }))
        }
        return nil
    }

    private static func openDescriptors() -> Int? {
        guard let directory = opendir("/proc/self/fd") else { return nil }
        defer { closedir(directory) }
        var count = 0
        while let entry = readdir(directory) {
            let name = withUnsafeBytes(of: entry.pointee.d_name) { String(decoding: $0.prefix(while: { $0 != 0 }), as: UTF8.self) }
            if name != "." && name != ".." { count += 1 }
        }
        // The directory stream's own descriptor is not the process's.
        return count - 1
    }

    private static func read(_ path: String) -> String? {
        ConfigFileWatcher.read(path).map { String(decoding: $0, as: UTF8.self) }
    }
}
