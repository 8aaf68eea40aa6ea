// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import SystemCalls

/// Sealing any UDP socket, so that closing it loses nothing the kernel still delivers: a member
/// of a reuseport group (``ReusePortMember/seal()``), or a connected socket of a relay's session.
///
/// A sealed socket is bound to an interface index no device has (`SO_BINDTOIFINDEX`
/// 2147483647): the kernel's lookup matches it to no arriving datagram (one for it is refused:
/// ICMP port unreachable, counted in the kernel's Udp `NoPorts`), and what is queued stays. Once
/// a grace period of the kernel has passed (``KernelGracePeriod``), a datagram whose lookup met
/// the socket just before the seal is queued too, so a last read finds everything the socket
/// will ever hold. Sends from a sealed socket fail (`ENODEV` for IPv4, `ENETUNREACH` for IPv6).
public enum SocketSeal {
    /// The interface index a sealed socket is bound to: the largest the kernel can allocate,
    /// which no device has unless one is created with that index on purpose.
    public static let interfaceIndex = Int32.max

    /// Seals every socket of `sockets`, then waits one grace period of the kernel for all of
    /// them (none if none was sealed by this call). A socket sealed already is left as it is.
    /// - Returns: the sockets the kernel refused to seal, with its error (`EPERM`: bound to a
    ///   device already, and the process lacks `CAP_NET_RAW`); those take datagrams as before.
    @discardableResult
    public static func seal(_ sockets: some Sequence<Int32>) -> [(socket: Int32, error: SystemCallError)] {
        var refused: [(socket: Int32, error: SystemCallError)] = []
        var sealedAny = false
        for socket in sockets {
            do throws(SystemCallError) {
                sealedAny = try sealWithoutWaiting(socket) || sealedAny
            } catch {
                refused.append((socket, error))
            }
        }
        if sealedAny { KernelGracePeriod.wait() }
        return refused
    }

    /// Seals `socket` without the grace period (several sockets: one wait after the last, or a
    /// caller that reads the socket only after a grace period surely passed).
    /// - Returns: true if this call sealed the socket, false if it was sealed already.
    public static func sealWithoutWaiting(_ socket: Int32) throws(SystemCallError) -> Bool {
        if isSealed(socket) { return false }
        try Syscall.setsockopt(socket, SOL_SOCKET, SO_BINDTOIFINDEX, interfaceIndex, call: "setsockopt SO_BINDTOIFINDEX")
        return true
    }

    /// Returns once a grace period of the kernel has passed (``KernelGracePeriod``): after
    /// ``sealWithoutWaiting(_:)``, every datagram whose lookup met the socket before the seal is
    /// queued on it by then.
    public static func waitForGracePeriod() {
        KernelGracePeriod.wait()
    }

    /// Whether `socket` is sealed (by this process, or by one that handed it over).
    public static func isSealed(_ socket: Int32) -> Bool {
        (try? Syscall.getsockopt(socket, SOL_SOCKET, SO_BINDTOIFINDEX, initial: Int32(0))) == interfaceIndex
    }
}
