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
/// The programs keep, per CPU and backend slot, what bpf_fib_lookup answered toward a listener's
/// backend (a client's datagram), and use it for the next datagram to the same destination from
/// the same interface while the route generation written here is the one they looked it up at,
/// and its deadline has not passed. This watch:
/// - listens to the kernel's routing notifications (links, addresses, neighbours, routes, rules,
///   next-hop objects, forwarding settings; both families) and writes a new generation after each
///   batch of them, so the next datagram is looked up again;
/// - writes a new generation once a second anyway, for what the kernel does not notify (a path
///   MTU learned), each time with a deadline 3 seconds on: a daemon that stopped or hangs leaves
///   the cache off;
/// - keeps the cache off (generation 0: every datagram looked up, as without the cache) while one
///   answer cannot serve every datagram to a destination: policy routing rules other than the
///   kernel's defaults (they may choose by source, port, mark or interface), or a route in the
///   tables those defaults look up that spreads over several next hops (the kernel hashes each
///   flow to one: a multipath route or a next-hop group) or is chosen by source. It reads the
///   rules, routes and next-hop objects whole at start and when notifications were lost, then
///   follows them from the notifications (the rules, small, are read again on each change);
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
    /// Batches that changed a path (links, addresses, routes, rules, next-hop objects, or lost
    /// notifications; not neighbours or forwarding settings): the listeners look their
    /// downstreams' routes up again at the next heartbeat (the xdp device map, the pools'
    /// neighbour entries).
    let pathChanges = Atomic<Int>(0)

    /// How long a generation holds without being written again, and how often it is.
    static let validity: UInt64 = 3_000_000_000
    static let renewal: UInt64 = 1_000_000_000

    /// The notification groups (RTNLGRP_*): link, neighbour, IPv4 address, route and rule, IPv6
    /// address, route and rule, IPv4 and IPv6 netconf (forwarding turned off), next-hop objects.
    static let groups: [Int32] = [1, 3, 5, 7, 8, 9, 11, 19, 24, 25, 32]

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
        thread.withLock { thread in
            defer { thread = nil }
            return thread
        }?.join()
        write(generation: 0, validUntil: 0)
    }

    /// Whether the programs use the cache now: a generation written, not 0, before its deadline.
    var on: Bool { Self.coarseNow() < validUntil.load(ordering: .relaxed) }
    /// The deadline written with the generation in force (0: off).
    private let validUntil = Atomic<UInt64>(0)

    /// Why the cache is off now (nil: on, or not known yet).
    var problem: String? { current.withLock { $0 } }
    private let current = Mutex<String?>(nil)

    // MARK: The routing policy

    /// What of the kernel's routing decides whether one answer per destination serves every
    /// datagram: the rules, and the routes of the tables the default rules look up (local, main,
    /// default) that spread over several next hops or are chosen by source. Read whole at start
    /// (and when notifications were lost), then kept from the notifications.
    struct Policy {
        /// A route as the kernel keys it.
        struct RouteKey: Hashable {
            var family: UInt8, table: UInt32, destination: [UInt8], length: UInt8, source: [UInt8], sourceLength: UInt8, tos: UInt8, metric: UInt32
        }

        /// The first rule that is not one of the kernel's defaults, described.
        var rule: String?
        /// The routes that make the cache wrong, each described.
        var routes: [RouteKey: String] = [:]
        /// The next-hop objects that are groups (their type never changes while they exist).
        var groups: Set<UInt32> = []
        /// A notification that the model cannot follow by itself: the routes of these families
        /// are read again (a route of a described key deleted or replaced: IPv6 deletes a
        /// spread's next hops one by one, IPv4 keeps several routes under one key; a group
        /// deleted with the routes using it).
        var reread: Set<UInt8> = []
        var mustReread: Bool { !reread.isEmpty }

        /// Why the cache cannot serve, or nil.
        var problem: String? { rule ?? routes.values.min() }

        /// The tables the kernel's default rules look up: IPv4 local, main, default; IPv6 local, main.
        static func looksUp(family: UInt8, table: UInt32) -> Bool {
            family == UInt8(AF_INET6) ? (254...255).contains(table) : (253...255).contains(table)
        }

        /// Reads rules, next-hop objects and routes of both families.
        mutating func readAll() throws(SystemCallError) {
            try readRules()
            groups = []
            var failed: Int32 = 0
            // nhmsg (family, scope, protocol, resvd, flags u32).
            try Rtnetlink.request(type: 106, flags: 0x300, body: [UInt8](repeating: 0, count: 8), failedDone: true) { message in  // RTM_GETNEXTHOP, dump
                if message.type == Rtnetlink.error { failed = Rtnetlink.errorCode(message) }
                if message.type == 104 { _ = noteNexthop(message.payload, deleted: false) }  // RTM_NEWNEXTHOP
            }
            // A kernel without next-hop objects has none.
            if failed != 0 && failed != EOPNOTSUPP && failed != EAFNOSUPPORT {
                throw SystemCallError(call: "dump the next-hop objects (RTM_GETNEXTHOP)", errno: failed)
            }
            try readRoutes(families: [UInt8(AF_INET), UInt8(AF_INET6)])
        }

        mutating func readRules() throws(SystemCallError) {
            rule = nil
            for family in [AF_INET, AF_INET6] {
                var failed: Int32 = 0
                var found: String?
                // fib_rule_hdr (family, dst_len, src_len, tos, table, res1, res2, action, flags u32).
                try Rtnetlink.request(type: 34, flags: 0x300, body: [UInt8(family)] + [UInt8](repeating: 0, count: 11), failedDone: true) { message in  // RTM_GETRULE, dump
                    if message.type == Rtnetlink.error { failed = Rtnetlink.errorCode(message) }
                    if found == nil, message.type == 32 { found = TCRouteWatch.ruleProblem(message.payload) }  // RTM_NEWRULE
                }
                // A family off in this kernel, or a kernel without policy routing: no rules.
                if failed != 0 && failed != EAFNOSUPPORT && failed != EOPNOTSUPP {
                    throw SystemCallError(call: "dump the routing rules (RTM_GETRULE)", errno: failed)
                }
                if rule == nil { rule = found }
            }
        }

        /// Reads the routes of `families` again (the others' descriptions stay).
        mutating func readRoutes(families: Set<UInt8>) throws(SystemCallError) {
            routes = routes.filter { !families.contains($0.key.family) }
            reread.subtract(families)
            for family in families.sorted() {
                var failed: Int32 = 0
                // rtmsg (family, dst_len, src_len, tos, table, protocol, scope, type, flags u32).
                try Rtnetlink.request(type: 26, flags: 0x300, body: [family] + [UInt8](repeating: 0, count: 11), failedDone: true) { message in  // RTM_GETROUTE, dump
                    if message.type == Rtnetlink.error { failed = Rtnetlink.errorCode(message) }
                    if message.type == 24 { _ = noteRoute(message.payload, flags: 0, deleted: false, dumped: true) }  // RTM_NEWROUTE
                }
                if failed != 0 && !(family == UInt8(AF_INET6) && failed == EAFNOSUPPORT) {
                    throw SystemCallError(call: "dump the routes (RTM_GETROUTE)", errno: failed)
                }
            }
        }

        /// Follows a route notification, or a route of a dump (`dumped`: one of several under
        /// its key, read whole: it describes or not, and asks nothing to be read again): whether
        /// it is of the tables looked up.
        mutating func noteRoute(_ payload: [UInt8], flags: UInt16, deleted: Bool, dumped: Bool = false) -> Bool {
            guard payload.count >= 12 else {
                reread = [UInt8(AF_INET), UInt8(AF_INET6)]
                return true
            }
            var key = RouteKey(family: payload[0], table: UInt32(payload[4]), destination: [], length: payload[1], source: [],
                               sourceLength: payload[2], tos: payload[3], metric: 0)
            var spread = false
            var nexthop: UInt32?
            for (type, value) in NextHopResolver.attributes(payload, from: 12) {
                switch type {
                case 1: key.destination = value                                          // RTA_DST
                case 2: key.source = value                                               // RTA_SRC
                case 6 where value.count == 4: key.metric = Rtnetlink.load32(value, 0)  // RTA_PRIORITY
                case 15 where value.count == 4: key.table = Rtnetlink.load32(value, 0)  // RTA_TABLE
                case 9: spread = true                                                    // RTA_MULTIPATH
                case 30 where value.count == 4: nexthop = Rtnetlink.load32(value, 0)    // RTA_NH_ID
                default: break
                }
            }
            guard Self.looksUp(family: key.family, table: key.table) else { return false }
            // A described key deleted, or added or replaced without a spread: what is left under
            // it is read again (IPv6 deletes a spread's next hops one by one; IPv4 keeps several
            // routes under one key, and uses the first whose next hop is alive).
            let described = routes[key] != nil
            if deleted {
                if described { reread.insert(key.family) }
                return true
            }
            let prefix = "\(IPAddress(bytes: key.destination).map { "\($0)" } ?? (key.family == UInt8(AF_INET6) ? "::" : "0.0.0.0"))/\(key.length)"
            if spread || (key.family == UInt8(AF_INET6) && flags & 0x800 != 0) {  // NLM_F_APPEND: IPv6 adds a next hop to a spread
                routes[key] = "the route to \(prefix) goes over several next hops"
            } else if let nexthop, groups.contains(nexthop) {
                routes[key] = "the route to \(prefix) goes over next-hop group \(nexthop)"
            } else if key.sourceLength != 0 {
                routes[key] = "the route to \(prefix) is chosen by source (from a /\(key.sourceLength))"
            } else if described && !dumped {
                reread.insert(key.family)
            }
            return true
        }

        /// Follows a next-hop object notification (or a dumped one).
        mutating func noteNexthop(_ payload: [UInt8], deleted: Bool) -> Bool {
            guard payload.count >= 8 else { return false }
            var id: UInt32?
            var group = false
            for (type, value) in NextHopResolver.attributes(payload, from: 8) {
                if type == 1, value.count == 4 { id = Rtnetlink.load32(value, 0) }  // NHA_ID
                if type == 2 { group = true }                                        // NHA_GROUP
            }
            guard let id else { return false }
            if deleted || !group {
                // A group goes with the routes that use it, unannounced: read them again.
                if groups.remove(id) != nil { reread = [UInt8(AF_INET), UInt8(AF_INET6)] }
            } else {
                groups.insert(id)
            }
            return true
        }
    }

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

    /// The kernel's own rules (family, priority, table): IPv4 local, main, default; IPv6 local, main.
    static let defaultRules: Set<[UInt32]> = [[UInt32(AF_INET), 0, 255], [UInt32(AF_INET), 32766, 254], [UInt32(AF_INET), 32767, 253],
                                              [UInt32(AF_INET6), 0, 255], [UInt32(AF_INET6), 32766, 254]]

    // MARK: The thread

    private func write(generation: UInt32, validUntil: UInt64) {
        do throws(SystemCallError) {
            try program.setRoute(generation: generation, validUntil: validUntil)
            self.validUntil.store(generation != 0 ? validUntil : 0, ordering: .relaxed)
        } catch {
            logger.error("the next-hop cache's route generation could not be written: \(error)")
        }
    }

    /// CLOCK_MONOTONIC_COARSE in nanoseconds: the programs' bpf_ktime_get_coarse_ns.
    static func coarseNow() -> UInt64 {
        var time = timespec()
        clock_gettime(CLOCK_MONOTONIC_COARSE, &time)
        return UInt64(time.tv_sec) * 1_000_000_000 + UInt64(time.tv_nsec)
    }

    /// Off for good (this process): said, and kept as the reason.
    private func refuse(_ reason: String) {
        write(generation: 0, validUntil: 0)
        current.withLock { $0 = reason }
        logger.error("next-hop cache off: \(reason); every datagram's route is looked up until the daemon restarts")
    }

    private func run() {
        let fd: Int32
        do throws(SystemCallError) {
            fd = try Syscall.socket(AF_NETLINK, Socket.raw | Socket.closeOnExec | Socket.nonBlocking, 0, call: "socket AF_NETLINK NETLINK_ROUTE")
        } catch {
            refuse("the routing notifications cannot be followed (\(error))")
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
        } catch {
            refuse("the routing notifications cannot be followed (\(error))")
            return
        }
        // Room for a burst of notifications (a routing daemon installing routes): past
        // net.core.rmem_max with CAP_NET_ADMIN; lost ones make the policy be read again.
        if (try? Syscall.setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, Int32(4 << 20), call: "setsockopt SO_RCVBUFFORCE")) == nil {
            try? Syscall.setsockopt(fd, SOL_SOCKET, SO_RCVBUF, Int32(4 << 20), call: "setsockopt SO_RCVBUF")
        }
        // Subscribed before the policy is read: a change meanwhile is a notification read next.
        var policy = Policy()
        var (readAll, readRules, changed, pathChanged) = (true, false, false, false)
        var written: UInt32 = 0
        var generation: UInt32 = 0
        var (told, shown): (Bool, String?) = (false, nil)
        var renewed: UInt64 = 0
        var readAgainAt: UInt64 = 0
        // A path change said again a second after a link or address event (its routes may be
        // flushed after the announcement): the listeners look their routes up once more.
        var pathAgainAt: UInt64 = 0
        var buffer = [UInt8](repeating: 0, count: 65536)
        while !stopping.load(ordering: .acquiring) {
            if readAgainAt != 0 && Self.coarseNow() >= readAgainAt {
                (readAll, readAgainAt) = (true, 0)
            }
            if pathAgainAt != 0 && Self.coarseNow() >= pathAgainAt {
                (pathChanged, pathAgainAt) = (true, 0)
            }
            if readAll || readRules || policy.mustReread {
                write(generation: 0, validUntil: 0)  // off while the policy is read
                written = 0
                do throws(SystemCallError) {
                    if readAll {
                        try policy.readAll()
                    } else {
                        if readRules { try policy.readRules() }
                        if policy.mustReread { try policy.readRoutes(families: policy.reread) }
                    }
                } catch {
                    // Off, said once, and read again whole a second later.
                    let reason = "reading the routing rules, routes and next-hop objects failed (\(error))"
                    if shown != reason {
                        logger.warning("next-hop cache off: \(reason): every datagram's route is looked up; read again each second")
                        (told, shown) = (true, reason)
                        current.withLock { $0 = reason }
                    }
                    (readAll, readRules) = (true, false)
                    for _ in 0..<5 where !stopping.load(ordering: .acquiring) { usleep(200_000) }
                    continue
                }
                (readAll, readRules) = (false, false)
            }
            let found = policy.problem
            if !told || found != shown {
                if let found {
                    logger.notice("next-hop cache off: \(found): every datagram's route is looked up")
                } else {
                    logger.info("next-hop cache on: the route toward each downstream is looked up once and kept until the routing state changes (routes, rules, next hops, neighbours, links, addresses, forwarding), checked every second")
                }
                (told, shown) = (true, found)
                current.withLock { $0 = found }
            }
            if changed { notifications.add(1, ordering: .relaxed) }
            if pathChanged { pathChanges.add(1, ordering: .relaxed) }
            let now = Self.coarseNow()
            if found != nil {
                if written != 0 {
                    write(generation: 0, validUntil: 0)
                    written = 0
                }
            } else if changed || written == 0 || now &- renewed >= Self.renewal {
                // A new generation after notifications, and once a second.
                generation = generation == UInt32.max ? 1 : generation + 1
                write(generation: generation, validUntil: now + Self.validity)
                (written, renewed) = (generation, now)
            }
            (changed, pathChanged) = (false, false)
            var descriptor = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
            do throws(SystemCallError) {
                guard try Syscall.poll(&descriptor, 1, 200) > 0 else { continue }
                // A bounded batch: the generation is written before more are read.
                for _ in 0..<16 {
                    guard case .processed(let count) = try Syscall.recv(fd, &buffer, buffer.count, 0, call: "recv routing notifications") else { break }
                    var offset = 0
                    while offset + 16 <= count {
                        let length = Int(Rtnetlink.load32(buffer, offset))
                        guard length >= 16, offset + length <= count else { break }
                        let type = Rtnetlink.load16(buffer, offset + 4), flags = Rtnetlink.load16(buffer, offset + 6)
                        let payload = Array(buffer[(offset + 16)..<(offset + length)])
                        switch type {
                        case 16, 17, 21:                                                        // RTM_NEWLINK, RTM_DELLINK, RTM_DELADDR
                            // A link down or gone, an address removed: the kernel flushes their
                            // routes and next hops unannounced. Only a described route matters (a
                            // group left alone is harmless: its id comes back announced).
                            // The kernel may announce it before the flush: read again a second later too.
                            if !policy.routes.isEmpty { (readAll, readAgainAt) = (true, Self.coarseNow() + Self.renewal) }
                            pathAgainAt = Self.coarseNow() + Self.renewal
                        case 32, 33: readRules = true                                          // RTM_NEWRULE, RTM_DELRULE
                        case 24, 25: _ = policy.noteRoute(payload, flags: flags, deleted: type == 25)  // RTM_NEWROUTE, RTM_DELROUTE
                        case 104, 105: _ = policy.noteNexthop(payload, deleted: type == 105)     // RTM_NEWNEXTHOP, RTM_DELNEXTHOP
                        default: break                                                          // links, addresses, neighbours, netconf
                        }
                        changed = true
                        if !(28...30).contains(type) && !(80...82).contains(type) { pathChanged = true }  // not RTM_*NEIGH, RTM_*NETCONF
                        offset += (length + 3) & ~3
                    }
                }
            } catch where error.errno == ENOBUFS {
                // Notifications were lost: whatever they said, everything is read again.
                (readAll, changed, pathChanged) = (true, true, true)
            } catch {
                refuse("reading the routing notifications failed (\(error))")
                return
            }
        }
    }
}
