// SPDX-License-Identifier: Apache-2.0
import CSystemShim
@testable import FanoutCore

#if canImport(Glibc)
import Glibc
#endif

/// Runs `body` on a dedicated thread that has entered the named network namespace (setns
/// only on a thread of its own, never on one the test runner reuses); nil if it could not.
func inNetworkNamespace<T: Sendable>(_ namespace: String, _ body: @escaping @Sendable () -> T) -> T? {
    let box = NamespaceResult<T>()
    let path = "/run/netns/\(namespace)"
    OSThread(name: "in-netns") {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return }
        defer { close(fd) }
        guard shim_setns(fd, 0x4000_0000) == 0 else { return }  // CLONE_NEWNET
        box.value = body()
    }.join()
    return box.value
}

/// The value a namespace thread hands back; written once before `join` returns.
private final class NamespaceResult<T>: @unchecked Sendable {
    var value: T?
}
