// SPDX-License-Identifier: Apache-2.0
import SystemCalls
import Foundation
import ReusePortLB
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// Ports that tests bind later (a daemon's listener, a metrics endpoint, a dnsmasq), handed out
/// from outside the kernel's ephemeral range.
///
/// A port picked inside the ephemeral range (`net.ipv4.ip_local_port_range`), checked free and
/// closed can be taken before the test binds it by anything the kernel gives an ephemeral port:
/// a relay session socket, a probe, a client's unbound send or a TCP connect. A daemon then
/// failed with EADDRINUSE on a fresh clone. Outside that range only an explicit bind takes a
/// port, and within one test process each port is handed out at most once, so two tests never
/// race for the same one.
public final class TestPortAllocator: Sendable {
    /// The ports this allocator hands out, in order from `start`.
    public let pool: [ClosedRange<UInt16>]
    /// How many ports `pool` holds.
    public let count: Int
    let start: Int
    let taken = Atomic<Int>(0)

    /// - Parameters:
    ///   - pool: disjoint port ranges to hand out.
    ///   - start: where in the pool (modulo its size) the first port is; processes started at
    ///     different offsets rarely hand out the same port at the same time.
    public init(pool: [ClosedRange<UInt16>], start: Int) {
        self.pool = pool
        count = pool.reduce(0) { $0 + $1.count }
        precondition(count > 0, "test ports: the pool \(pool) holds no port")
        self.start = ((start % count) + count) % count
    }

    /// The next port of the pool that `isFree` accepts; ports it refuses are skipped and not
    /// offered again.
    /// - Precondition: the pool is not exhausted (every port handed out or refused).
    public func next(isFree: (UInt16) -> Bool = TestPortAllocator.isFree) -> UInt16 {
        while true {
            let index = taken.wrappingAdd(1, ordering: .relaxed).oldValue
            precondition(index < count, "test ports: all \(count) ports of \(pool) handed out or in use; a test asks for too many or leaks them")
            let port = port(at: (start + index) % count)
            if isFree(port) { return port }
        }
    }

    func port(at position: Int) -> UInt16 {
        var rest = position
        for range in pool {
            if rest < range.count { return range.lowerBound + UInt16(rest) }
            rest -= range.count
        }
        preconditionFailure("test ports: position \(position) past the pool \(pool)")
    }

    /// Whether `port` can be bound now on 127.0.0.1 for both UDP and TCP (dnsmasq and the HTTP
    /// endpoint take TCP; listeners take UDP).
    public static func isFree(_ port: UInt16) -> Bool {
        [SOCK_DGRAM, SOCK_STREAM].allSatisfy { type in
            guard let fd = try? Syscall.socket(AF_INET, Int32(type.rawValue)) else { return false }
            defer { Syscall.close(fd) }
            return (try? Syscall.bind(fd, SocketAddress(ip: IPAddress("127.0.0.1")!, port: port))) != nil
        }
    }

    /// The lowest port handed out: below it are well-known and registered ports services on
    /// the host are likely to hold.
    public static let lowest: UInt16 = 10000
    /// Fewer free ports than this outside the ephemeral range is a host the tests cannot run on.
    static let minimumPool = 1000

    /// The ports outside the ephemeral range from `lowest` up: below its low end and above its
    /// high end.
    /// - Parameter ephemeral: the kernel's `ip_local_port_range`.
    public static func pool(outside ephemeral: ClosedRange<Int>) -> [ClosedRange<UInt16>] {
        var ranges: [ClosedRange<UInt16>] = []
        if ephemeral.lowerBound > Int(lowest) { ranges.append(lowest...UInt16(ephemeral.lowerBound - 1)) }
        let above = max(ephemeral.upperBound + 1, Int(lowest))
        if above <= Int(UInt16.max) { ranges.append(UInt16(above)...UInt16.max) }
        return ranges
    }

    /// The kernel's ephemeral range, from /proc/sys/net/ipv4/ip_local_port_range.
    public static func ephemeralRange() -> ClosedRange<Int> {
        let path = "/proc/sys/net/ipv4/ip_local_port_range"
        let text = (try? String(contentsOfFile: path, encoding: .utf8)) ?? ""
        let bounds = text.split(whereSeparator: \.isWhitespace).compactMap { Int($0) }
        precondition(bounds.count == 2 && bounds[0] <= bounds[1], "test ports: cannot read the ephemeral range from \(path): '\(text)'")
        return bounds[0]...bounds[1]
    }

    /// The allocator `freePort()` uses: the ports outside this host's ephemeral range, starting
    /// at an offset derived from the process id.
    public static let shared: TestPortAllocator = {
        let ephemeral = ephemeralRange()
        let ports = TestPortAllocator.pool(outside: ephemeral)
        let count = ports.reduce(0) { $0 + $1.count }
        precondition(count >= minimumPool, """
            test ports: the ephemeral range \(ephemeral.lowerBound)-\(ephemeral.upperBound) \
            (net.ipv4.ip_local_port_range) leaves \(count) ports from \(lowest) up outside it, \
            fewer than \(minimumPool); narrow it, e.g. sysctl -w net.ipv4.ip_local_port_range="32768 60999"
            """)
        // A large odd stride spreads consecutive pids over the pool.
        return TestPortAllocator(pool: ports, start: Int(getpid()) &* 7919)
    }()
}

/// A port free now on 127.0.0.1 (UDP and TCP) that the test binds later: outside the kernel's
/// ephemeral range, so nothing takes it in between, and never handed out twice in one test
/// process (`TestPortAllocator`).
public func freePort() -> UInt16 {
    TestPortAllocator.shared.next()
}
