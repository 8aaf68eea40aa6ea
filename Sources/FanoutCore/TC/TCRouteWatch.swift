// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import BPFKernelABI
import Logging
import ReusePortLB
import Synchronization
import SystemCalls

/// Keeps the tc and xdp programs' next-hop cache (bpf/include/fanout_hops_shared.h) true to the
/// kernel's routing, from a thread of its own in the daemon's network namespace.
///
/// The programs keep, per CPU and backend slot, what bpf_fib_lookup answered toward a backend or
/// replication pool member, and use it for the next datagram to the same destination while the
/// route generation written here is the one they looked it up at, and its deadline has not
/// passed. This watch:
/// - listens to the kernel's routing notifications (links, addresses, neighbours, routes, rules,
///   next-hop objects, both families) and writes a new generation after each batch of them, so
///   the next datagram is looked up again;
/// - writes a new generation once a second anyway, for what the kernel does not notify (a path
///   MTU learned), each time with a deadline 3 seconds on: a daemon that stopped or hangs leaves
///   the cache off;
/// - keeps the cache off (generation 0: every datagram looked up, as without the cache) while one
///   answer cannot serve every datagram to a destination: policy routing rules other than the
///   kernel's defaults (they may choose by source, port, mark or interface), or a route in the
///   tables those defaults look up that spreads over several next hops (the kernel hashes each
///   flow to one), chooses by source or by TOS, or uses a next-hop object;
/// - writes 0 when it stops, before the program can outlive it (a data path handed over).
/// Between a change in the kernel and this watch's next write, a datagram may still take the way
/// looked up before the change (the notification's delay: well under a millisecond when the
/// thread is not starved).
final class TCRouteWatch: Sendable {
    private let program: TCProgram
    private let logger: Logger
    private let stopping = Atomic<Bool>(false)
    private let thread = Mutex<OSThread?>(nil)
    /// Batches of notifications read that changed something (tests: a change was seen).
    let notifications = Atomic<Int>(0)

    /// How long a generation holds without being written again, and how often it is.
    static let validity: UInt64 = 3_000_000_000
    static let renewal: UInt64 = 1_000_000_000

    /// The notification groups (RTNLGRP_*): link, neighbour, IPv4 address, route and rule, IPv6
    /// address, route and rule, next-hop objects.
    static let groups: [Int32] = [1, 3, 5, 7, 8, 9, 11, 19, 32]

    init(program: TCProgram, logger: Logger) {
        self.program = program
        self.logger = logger
    }

    /// Starts the watch (its thread in the calling thread's network namespace).
    func start() {
        thread.withLock { thread in
            guard thread == nil else { return }
            thread = OSThread(name: "udp-fanout-route") { [self] in run() }
        }
    }

    /// Stops the watch and turns the cache off. Idempotent.
    func stop() {
        stopping.store(true, ordering: .releasing)
        thread.withLock { $0 }?.join()
        write(generation: 0, validUntil: 0)
    }

    // MARK: The routing policy

    /// Why one answer per destination cannot serve every datagram here, or nil when it can:
    /// the rules and routes of both families, as the kernel lists them.
    static func policyProblem() -> String? {
        for family in [AF_INET, AF_INET6] {
            var problem: String?
            do throws(SystemCallError) {
                // fib_rule_hdr (family, dst_len, src_len, tos, table, res1, res2, action, flags u32).
                try Rtnetlink.request(type: 34, flags: 0x300, body: [UInt8(family)] + [UInt8](repeating: 0, count: 11)) { message in  // RTM_GETRULE, dump
                    if problem == nil, message.type == 32 { problem = ruleProblem(message.payload) }  // RTM_NEWRULE
                }
                if let problem { return problem }
                // rtmsg (family, dst_len, src_len, tos, table, protocol, scope, type, flags u32).
                try Rtnetlink.request(type: 26, flags: 0x300, body: [UInt8(family)] + [UInt8](repeating: 0, count: 11)) { message in  // RTM_GETROUTE, dump
                    if problem == nil, message.type == 24 { problem = routeProblem(message.payload) }  // RTM_NEWROUTE
                }
            } catch {
                return "the routing rules and routes could not be read (\(error))"
            }
            if let problem { return problem }
        }
        return nil
    }

    /// The kernel's own rules (priority, table): IPv4 local, main, default; IPv6 local, main.
    static let defaultRules: Set<[UInt32]> = [[UInt32(AF_INET), 0, 255], [UInt32(AF_INET), 32766, 254], [UInt32(AF_INET), 32767, 253],
                                              [UInt32(AF_INET6), 0, 255], [UInt32(AF_INET6), 32766, 254]]

    /// Why a rule (an RTM_NEWRULE payload) may route datagrams to one destination differently,
    /// or nil for one of the kernel's default rules: a lookup in a table, with no selector.
    static func ruleProblem(_ payload: [UInt8]) -> String? {
        guard payload.count >= 12 else { return "a routing rule the kernel listed unreadably" }
        var priority: UInt32 = 0
        var table = UInt32(payload[4])
        var selector = payload[1] != 0 || payload[2] != 0 || payload[3] != 0 || payload[7] != 1 || Rtnetlink.load32(payload, 8) != 0  // FR_ACT_TO_TBL
        for (type, value) in NextHopResolver.attributes(payload, from: 12) {
            switch type {
            case 6 where value.count == 4: priority = Rtnetlink.load32(value, 0)  // FRA_PRIORITY
            case 15 where value.count == 4: table = Rtnetlink.load32(value, 0)    // FRA_TABLE
            case 21: break                                                         // FRA_PROTOCOL
            case 13, 14: if value.count != 4 || Rtnetlink.load32(value, 0) != UInt32.max { selector = true }  // FRA_SUPPRESS_IFGROUP, _PREFIXLEN unset
            default: selector = true
            }
        }
        guard selector || !defaultRules.contains([UInt32(payload[0]), priority, table]) else { return nil }
        return "a policy routing rule (\(payload[0] == AF_INET6 ? "IPv6" : "IPv4") priority \(priority), table \(table); `ip rule` lists it)"
    }

    /// Why a route (an RTM_NEWROUTE payload) in a table the default rules look up (local, main,
    /// default) may route datagrams to one destination differently, or nil.
    static func routeProblem(_ payload: [UInt8]) -> String? {
        guard payload.count >= 12 else { return "a route the kernel listed unreadably" }
        var table = UInt32(payload[4])
        var destination: [UInt8] = []
        var spread = false
        for (type, value) in NextHopResolver.attributes(payload, from: 12) {
            switch type {
            case 1: destination = value                                            // RTA_DST
            case 15 where value.count == 4: table = Rtnetlink.load32(value, 0)    // RTA_TABLE
            case 9, 30: spread = true                                              // RTA_MULTIPATH, RTA_NH_ID
            default: break
            }
        }
        guard (253...255).contains(table) else { return nil }
        let prefix = "\(IPAddress(bytes: destination).map { "\($0)" } ?? (payload[0] == AF_INET6 ? "::" : "0.0.0.0"))/\(payload[1])"
        if spread { return "the route to \(prefix) goes over several next hops or a next-hop object" }
        if payload[2] != 0 { return "the route to \(prefix) is chosen by source (from a /\(payload[2]))" }
        if payload[3] != 0 { return "the route to \(prefix) is chosen by TOS" }
        return nil
    }

    // MARK: The thread

    private func write(generation: UInt32, validUntil: UInt64) {
        do throws(SystemCallError) {
            try program.setRoute(generation: generation, validUntil: validUntil)
        } catch {
            logger.error("the next-hop cache's route generation could not be written: \(error)")
        }
    }

    private static func coarseNow() -> UInt64 {
        var time = timespec()
        clock_gettime(CLOCK_MONOTONIC_COARSE, &time)
        return UInt64(time.tv_sec) * 1_000_000_000 + UInt64(time.tv_nsec)
    }

    /// What a batch of notifications asks: nothing, a new generation, or the policy read again.
    enum Change: Comparable { case none, generation, policy }

    /// The change one notification (its nlmsghdr type and payload) makes.
    static func change(type: UInt16, payload: [UInt8]) -> Change {
        switch type {
        case 32, 33: return .policy                         // RTM_NEWRULE, RTM_DELRULE
        case 24, 25:                                         // RTM_NEWROUTE, RTM_DELROUTE
            // A route of the tables looked up may make or end a spread, or (IPv6) add a next hop
            // to one that then spreads, which its own notification need not say: read again.
            guard payload.count >= 12 else { return .policy }
            let table = NextHopResolver.attributes(payload, from: 12).first { $0.type == 15 && $0.value.count == 4 }
                .map { Rtnetlink.load32($0.value, 0) } ?? UInt32(payload[4])
            return (253...255).contains(table) ? .policy : .generation
        default: return .generation                          // links, addresses, neighbours, next hops
        }
    }

    private func run() {
        let fd: Int32
        do throws(SystemCallError) {
            fd = try Syscall.socket(AF_NETLINK, Socket.raw | Socket.closeOnExec | Socket.nonBlocking, 0, call: "socket AF_NETLINK NETLINK_ROUTE")
        } catch {
            logger.warning("next-hop cache off: the routing notifications cannot be followed (\(error)); every datagram's route is looked up")
            return
        }
        defer { Syscall.close(fd) }
        do throws(SystemCallError) {
            // sockaddr_nl (family u16, pad u16, pid u32, groups u32), pid 0: the kernel assigns one
            // (a socket without one would not get the notifications of changes the kernel makes itself).
            var address = sockaddr_storage()
            address.ss_family = sa_family_t(AF_NETLINK)
            try withUnsafePointer(to: &address) { pointer throws(SystemCallError) in
                try pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { socketAddress throws(SystemCallError) in
                    try Syscall.bind(fd, socketAddress, 12, call: "bind AF_NETLINK")
                }
            }
            for group in Self.groups {
                try Syscall.setsockopt(fd, 270, 1, group, call: "setsockopt NETLINK_ADD_MEMBERSHIP \(group)")  // SOL_NETLINK
            }
            try? Syscall.setsockopt(fd, SOL_SOCKET, SO_RCVBUF, Int32(1 << 20), call: "setsockopt SO_RCVBUF")
        } catch {
            logger.warning("next-hop cache off: the routing notifications cannot be followed (\(error)); every datagram's route is looked up")
            return
        }
        // Subscribed before the policy is read: a change meanwhile is a notification read next.
        var generation: UInt32 = 0
        var problem: String?
        var told = false
        var renewed: UInt64 = 0
        var pending = Change.policy
        var buffer = [UInt8](repeating: 0, count: 65536)
        while !stopping.load(ordering: .acquiring) {
            if pending == .policy {
                write(generation: 0, validUntil: 0)  // off while the policy is read
                let found = Self.policyProblem()
                if !told || found != problem {
                    if let found {
                        logger.notice("next-hop cache off: \(found): every datagram's route is looked up")
                    } else {
                        logger.info("next-hop cache on: bpf_fib_lookup's answer toward each backend is kept until the kernel's routes, rules, neighbours or links change, or a second passes")
                    }
                }
                (problem, told) = (found, true)
            }
            if pending != .none { notifications.add(1, ordering: .relaxed) }
            // While the policy allows it: a new generation after notifications, and once a second.
            let now = Self.coarseNow()
            if problem == nil, pending != .none || now &- renewed >= Self.renewal {
                generation = generation == UInt32.max ? 1 : generation + 1
                write(generation: generation, validUntil: now + Self.validity)
                renewed = now
            }
            pending = .none
            var descriptor = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
            do throws(SystemCallError) {
                guard try Syscall.poll(&descriptor, 1, 200) > 0 else { continue }
                while true {
                    guard case .processed(let count) = try Syscall.recv(fd, &buffer, buffer.count, 0, call: "recv routing notifications") else { break }
                    var offset = 0
                    while offset + 16 <= count {
                        let length = Int(Rtnetlink.load32(buffer, offset))
                        guard length >= 16, offset + length <= count else { break }
                        let type = Rtnetlink.load16(buffer, offset + 4)
                        pending = max(pending, Self.change(type: type, payload: Array(buffer[(offset + 16)..<(offset + length)])))
                        offset += (length + 3) & ~3
                    }
                }
            } catch where error.errno == ENOBUFS {
                // Notifications were lost: whatever they said, the policy is read again.
                pending = .policy
            } catch {
                write(generation: 0, validUntil: 0)
                logger.error("next-hop cache off: reading the routing notifications failed (\(error)); every datagram's route is looked up until the daemon restarts")
                return
            }
        }
    }
}
