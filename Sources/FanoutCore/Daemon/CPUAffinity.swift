// SPDX-License-Identifier: Apache-2.0
import CSystemShim
#if canImport(Glibc)
import Glibc
#endif

/// The CPUs the process may run on now (its main thread's affinity): what taskset, systemd's
/// CPUAffinity= or a container's cpuset allow. Read each time a listener sizes or pins its
/// workers, so a reload after `taskset -p` or a cpuset change follows the new set. All online
/// CPUs if the mask cannot be read.
func allowedCPUs() -> [Int32] {
    var cpus = [Int32](repeating: 0, count: 4096)
    let count = Int(shim_allowed_cpus(&cpus, Int32(cpus.count)))
    if count > 0 { return Array(cpus.prefix(min(count, cpus.count))) }
    return (0..<Int32(max(1, sysconf(Int32(_SC_NPROCESSORS_ONLN))))).map { $0 }
}

/// Pins the calling thread to the `index`-th allowed CPU (modulo their count): worker i of a
/// daemon started with `taskset -c 2,3` runs on CPU 2 or 3, never outside what it was given.
/// Returns the CPU on success, or the CPU tried and errno on failure.
func pinCurrentThread(toAllowedCPU index: Int) -> (cpu: Int32, error: Int32?) {
    let allowed = allowedCPUs()
    let cpu = allowed[index % allowed.count]
    return shim_pin_current_thread(cpu) == 0 ? (cpu, nil) : (cpu, errno)
}
