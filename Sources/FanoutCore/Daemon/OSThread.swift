#if canImport(Glibc)
import Glibc
#endif
import CSystemShim

/// A plain OS thread for loops that block in system calls (workers, the HTTP endpoint): they
/// must not occupy Swift concurrency's cooperative pool.
final class OSThread: Sendable {
    private let handle: pthread_t

    private final class Box {
        let body: @Sendable () -> Void
        init(_ body: @escaping @Sendable () -> Void) { self.body = body }
    }

    init(name: String, _ body: @escaping @Sendable () -> Void) {
        let box = Unmanaged.passRetained(Box(body)).toOpaque()
        var thread = pthread_t()
        let result = pthread_create(&thread, nil, { argument in
            let box = Unmanaged<Box>.fromOpaque(argument!).takeRetainedValue()
            box.body()
            return nil
        }, box)
        precondition(result == 0, "pthread_create failed: \(result)")
        shim_set_thread_name(thread, String(name.prefix(15)))
        handle = thread
    }

    /// Waits for the thread to return.
    func join() {
        pthread_join(handle, nil)
    }
}
