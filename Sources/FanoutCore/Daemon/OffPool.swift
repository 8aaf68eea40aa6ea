// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif

/// Runs blocking work (BPF loads, socket joins, file reads, thread joins) on a thread of its
/// own and suspends the caller until it is done. Swift concurrency has one cooperative thread per
/// core (two here): a blocking call on one of them stalls every task scheduled there, the
/// ServiceGroup's signal handling and the HTTP endpoint included.
/// - Parameters:
///   - name: the thread's name (at most 15 characters are kept), as `ps -L` and `top -H` show it.
///   - body: the work; its result is handed back to the caller.
package func offCooperativePool<T: Sendable>(_ name: String, _ body: @escaping @Sendable () -> T) async -> T {
    await withCheckedContinuation { continuation in
        OSThread.detached(name: name) { continuation.resume(returning: body()) }
    }
}
