// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import CSystemShim

/// A plain OS thread for loops that block in system calls (workers, the HTTP endpoint): they
/// must not occupy Swift concurrency's cooperative pool.
final class OSThread: Sendable {
    private let handle: pthread_t

    private final class Box {
        let name: String
        let body: @Sendable () -> Void
        init(_ name: String, _ body: @escaping @Sendable () -> Void) {
            self.name = name
            self.body = body
        }
    }

    init(name: String, _ body: @escaping @Sendable () -> Void) {
        let box = Unmanaged.passRetained(Box(String(name.prefix(15)), body)).toOpaque()
        var thread = pthread_t()
        let result = pthread_create(&thread, nil, { argument in
            let box = Unmanaged<Box>.fromOpaque(argument!).takeRetainedValue()
            // Named by itself before its work starts (naming it from the creator races the body).
            shim_set_thread_name(pthread_self(), box.name)
            box.body()
            return nil
        }, box)
        precondition(result == 0, "pthread_create failed: \(result)")
        handle = thread
    }

    /// Starts a thread nobody joins: its resources go back to the system when it returns.
    static func detached(name: String, _ body: @escaping @Sendable () -> Void) {
        let thread = OSThread(name: name, body)
        pthread_detach(thread.handle)
    }

    /// Waits for the thread to return.
    func join() {
        pthread_join(handle, nil)
    }
}
