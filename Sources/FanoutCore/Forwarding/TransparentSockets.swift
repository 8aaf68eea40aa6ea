// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import Logging
import SystemCalls
import CSystemShim
import ReusePortLB
import Synchronization

/// `output: preserve_source` through UDP sockets where it can: one socket per client endpoint
/// (address and port) a forwarding thread copies from, bound to that endpoint with
/// IP_TRANSPARENT / IPV6_TRANSPARENT (the address is not the host's), so the kernel sends the
/// copies with the client's address and port as it sends any UDP datagram: a client's
/// consecutive copies of one size to one downstream go as one GSO message (UDP_SEGMENT), routed
/// and passed down the stack once, and the checksum is left to the device. The raw socket
/// (``SharedRawSender``) has none of that: each copy is routed, built and passed down alone
/// (docs/benchmarks.md, Replication, measures both ways).
///
/// Part of the thread's ``SharedRawSender``: ``send(_:_:_:family:)`` takes the staged messages
/// (each one datagram, its IP and UDP headers as ``SourcePreservingOutbox`` built them in
/// `msg_iov[0]`, the payload in `msg_iov[1]`), sends those it has a socket for, and leaves the
/// others to the raw socket. A copy goes the raw way when:
/// - its client's address is the host's own (a bind without IP_TRANSPARENT succeeds, or finds the
///   port in use): holding that port would take it, or its datagrams, from a local program;
/// - its client's port is outside the namespace's ephemeral range (net.ipv4.ip_local_port_range)
///   or one of its reserved ports (ip_local_reserved_ports): a bound client endpoint makes a
///   later bind of the wildcard address to that port fail, so only ports that programs take
///   from the kernel (which skips ports in use) are held, not the ones services bind by number;
/// - IP_TRANSPARENT is refused (neither CAP_NET_RAW nor CAP_NET_ADMIN): said once per process,
///   and the thread stops trying;
/// - the thread holds ``maximumSockets`` sockets already, every thread together a quarter of the
///   open-files limit (``budget``: the rest stays for listeners, downstreams, probes and the HTTP
///   endpoint; said once per process), or the socket could not be made;
/// - its TTL / hop limit is not ``SourcePreservingOutbox/ttl`` (af_xdp's copies carry the
///   received one less one; the sockets send with that default).
/// An endpoint that went the raw way is tried again after ``retryInterval``; a socket unused for
/// ``idleLimit`` is closed.
///
/// What a socket sends matches the raw way's headers: TTL / hop limit 64, DF clear (IPv4:
/// IP_PMTUDISC_DONT), the UDP checksum computed (by the device or the kernel), the kernel's IPv4
/// id. Two differences: the route is looked up with the client's address as the source (policy
/// rules `from` the client apply; the raw way looks up without a source), and an IPv6 copy may
/// carry the kernel's automatic flow label. The sockets are SO_REUSEADDR and SO_REUSEPORT (two
/// threads, or a reload's old and new ones, may hold one client at once) and read nothing: a
/// filter drops whatever arrives (a datagram to a client's address is routed toward the client,
/// not delivered here, unless that address is the host's, which is never bound, or a TPROXY rule
/// sends it here).
final class TransparentSockets {
    private struct Entry {
        /// The socket, or -1: the endpoint goes the raw way until `stamp + retryInterval`.
        var fd: Int32
        /// Seconds (CLOCK_MONOTONIC_COARSE): a socket's last use, or when the endpoint was refused.
        var stamp: Int
    }

    /// Sockets one thread holds at most (each client endpoint it copies from is one).
    static let maximumSockets = 4096
    /// A socket unused this long (seconds) is closed (tests shorten it).
    static let idleLimit = 60
    @exclusivity(unchecked) var idleLimit = TransparentSockets.idleLimit
    /// An endpoint refused a socket is tried again after this long (seconds).
    static let retryInterval = 60

    private let capacity: Int
    private let sendBuffer: Int32
    private let logger: Logger
    /// The listener's counters: its gauge of these sockets (nil: none, as in tests).
    private let counters: ListenerCounters?
    private static let refusalSaid = Atomic<Bool>(false)
    private static let budgetSaid = Atomic<Bool>(false)
    /// Sockets every thread's instance holds together.
    private static let held = Atomic<Int>(0)
    /// What they may hold together: a quarter of RLIMIT_NOFILE's soft limit at first use
    /// (udp-fanout.service sets 1,048,576; a shell's default 1,024 gives 256).
    static let budget: Int = {
        guard let limit = try? Syscall.getrlimit(Syscall.Resource.openFiles) else { return 256 }
        return Int(clamping: limit.rlim_cur) / 4
    }()
    @exclusivity(unchecked) private var entries: [SocketAddress: Entry] = [:]
    @exclusivity(unchecked) private(set) var sockets = 0
    /// IP_TRANSPARENT was refused: this thread sends every copy the raw way.
    @exclusivity(unchecked) private(set) var refused = false
    @exclusivity(unchecked) private var nextSweep = 0
    /// The ports a client endpoint may be bound at: the ephemeral range less the reserved ports.
    private let ephemeral: ClosedRange<UInt16>
    private let reserved: Set<UInt16>
    private static let nonlocalBindSaid = Atomic<Bool>(false)
    /// GSO was refused (EINVAL/EIO/EMSGSIZE on a GSO message): one copy per message until then.
    @exclusivity(unchecked) private var gsoOffUntil = 0
    /// System calls that sent, messages sent (a GSO run is one) and copies sent through these sockets (tests).
    @exclusivity(unchecked) private(set) var sendCalls = 0
    @exclusivity(unchecked) private(set) var messagesSent = 0
    @exclusivity(unchecked) private(set) var copiesSent = 0

    // Room for one send's worth of staged messages (``capacity``).
    /// Per staged message: its socket, or -1 (the raw way).
    private let fds: UnsafeMutablePointer<Int32>
    /// The staged messages that have a socket, by socket (stable).
    private let order: UnsafeMutablePointer<Int>
    /// The UDP messages built from them, with their destinations, payload iovecs (one per copy,
    /// in `order`'s order), GSO control messages and first copy (a position in `order`).
    private let messages: UnsafeMutablePointer<shim_mmsghdr>
    private let names: UnsafeMutablePointer<sockaddr_storage>
    private let payloads: UnsafeMutablePointer<iovec>
    private let controls: UnsafeMutableRawPointer
    private let controlSpace: Int
    private let firsts: UnsafeMutablePointer<Int>

    /// - Parameters:
    ///   - capacity: staged messages per send, at most.
    ///   - sendBuffer: each socket's send buffer (SO_SNDBUFFORCE where allowed, else SO_SNDBUF).
    ///   - counters: the listener's, whose `udp_fanout_preserve_source_client_sockets` these sockets count.
    init(capacity: Int, sendBuffer: Int32, logger: Logger, counters: ListenerCounters? = nil) {
        self.capacity = capacity
        self.sendBuffer = sendBuffer
        self.logger = logger
        self.counters = counters
        counters?.clientSocketsShown.store(true, ordering: .relaxed)
        (ephemeral, reserved) = Self.ephemeralPorts()
        if Self.sysctl("net/ipv4/ip_nonlocal_bind") == "1" || Self.sysctl("net/ipv6/ip_nonlocal_bind") == "1",
           !Self.nonlocalBindSaid.exchange(true, ordering: .relaxed) {
            logger.notice("output preserve_source: net.ipv4.ip_nonlocal_bind (or net.ipv6's) is 1, so a bind cannot tell the host's addresses from others: every copy goes through the raw socket, one routed and built at a time; set it to 0 in the daemon's network namespace to send copies through UDP sockets bound to the clients")
        }
        fds = .allocate(capacity: capacity)
        order = .allocate(capacity: capacity)
        messages = .allocate(capacity: capacity)
        messages.initialize(repeating: shim_mmsghdr(), count: capacity)
        names = .allocate(capacity: capacity)
        names.initialize(repeating: sockaddr_storage(), count: capacity)
        payloads = .allocate(capacity: capacity)
        controlSpace = Int(shim_udp_segment_space())
        controls = .allocate(byteCount: capacity * controlSpace, alignment: 16)
        firsts = .allocate(capacity: capacity)
    }

    deinit {
        for entry in entries.values where entry.fd >= 0 { close(entry.fd) }
        Self.held.subtract(sockets, ordering: .relaxed)
        counters?.clientSockets.subtract(sockets, ordering: .relaxed)
        fds.deallocate()
        order.deallocate()
        messages.deallocate()
        names.deallocate()
        payloads.deallocate()
        controls.deallocate()
        firsts.deallocate()
    }

    /// Seconds of CLOCK_MONOTONIC_COARSE.
    private static func seconds() -> Int {
        var now = timespec()
        clock_gettime(CLOCK_MONOTONIC_COARSE, &now)
        return now.tv_sec
    }

    // MARK: Sending

    /// Sends the messages of `headers[0..<count]` (`family`'s lane of the thread's raw sender)
    /// whose client endpoint has a socket here, telling each owner what became of its message;
    /// moves the others, in their order, to the front of `headers` and `owners` and returns how
    /// many they are: the raw socket sends those.
    func send(_ headers: UnsafeMutablePointer<shim_mmsghdr>, _ owners: UnsafeMutablePointer<Unmanaged<SourcePreservingOutbox>>,
              _ count: Int, family: Int32) -> Int {
        guard !refused, count <= capacity else { return count }
        let now = Self.seconds()
        if now >= nextSweep { sweep(now) }
        var taken = 0
        var previous: (client: SocketAddress, fd: Int32)?
        for index in 0..<count {
            let fd = socket(for: headers[index].msg_hdr, family: family, now: now, previous: &previous)
            fds[index] = fd
            if fd >= 0 {
                order[taken] = index
                taken += 1
            }
        }
        guard taken > 0 else { return count }
        let fds = self.fds
        var sorted = UnsafeMutableBufferPointer(start: order, count: taken)
        sorted.sort { fds[$0] != fds[$1] ? fds[$0] < fds[$1] : $0 < $1 }
        let built = build(headers, taken, family: family, gso: now >= gsoOffUntil)
        var message = 0
        while message < built {
            let fd = fds[order[firsts[message]]]
            var end = message + 1
            while end < built && fds[order[firsts[end]]] == fd { end += 1 }
            transmit(fd, from: message, to: end, headers, owners, now: now)
            message = end
        }
        var rest = 0
        for index in 0..<count where fds[index] < 0 {
            headers[rest] = headers[index]
            owners[rest] = owners[index]
            rest += 1
        }
        return rest
    }

    /// Builds the UDP messages for the `taken` staged messages in ``order``: a copy joins the
    /// message before it when it has the same socket and destination and the message is a GSO run
    /// that can take it (one size, the last may be shorter, up to DownstreamOutbox's limits).
    /// Returns how many messages.
    private func build(_ headers: UnsafeMutablePointer<shim_mmsghdr>, _ taken: Int, family: Int32, gso: Bool) -> Int {
        var built = 0
        var previous: (fd: Int32, destination: SocketAddress, size: Int, last: Int, segments: Int)?
        for position in 0..<taken {
            let index = order[position]
            let header = headers[index].msg_hdr
            let payload = header.msg_iov[1]
            payloads[position] = payload
            let destination = Self.destination(header, family: family)
            // Empty copies are never in a run: UDP_SEGMENT 0 would send a run of them as one
            // datagram, and an empty last segment is no datagram at all.
            if gso, let run = previous, run.size > 0, payload.iov_len > 0, run.fd == fds[index], run.destination == destination,
               run.last == run.size, payload.iov_len <= run.size, run.segments < DownstreamOutbox.maximumSegments,
               (run.segments + 1) * run.size <= DownstreamOutbox.maximumGSOBytes {
                messages[built - 1].msg_hdr.msg_iovlen += 1
                previous = (run.fd, destination, run.size, payload.iov_len, run.segments + 1)
                continue
            }
            let length = destination.write(to: &names[built])
            messages[built] = shim_mmsghdr()
            messages[built].msg_hdr.msg_name = UnsafeMutableRawPointer(names + built)
            messages[built].msg_hdr.msg_namelen = length
            messages[built].msg_hdr.msg_iov = payloads + position
            messages[built].msg_hdr.msg_iovlen = 1
            firsts[built] = position
            built += 1
            previous = (fds[index], destination, payload.iov_len, payload.iov_len, 1)
        }
        for message in 0..<built where messages[message].msg_hdr.msg_iovlen > 1 {
            shim_set_udp_segment(&messages[message].msg_hdr, controls + message * controlSpace, UInt16(payloads[firsts[message]].iov_len))
        }
        return built
    }

    /// Sends messages `first..<end` (one socket's) and tells the owners of their copies.
    private func transmit(_ fd: Int32, from first: Int, to end: Int, _ headers: UnsafeMutablePointer<shim_mmsghdr>,
                          _ owners: UnsafeMutablePointer<Unmanaged<SourcePreservingOutbox>>, now: Int) {
        var message = first
        while message < end {
            let error: Int32
            do throws(SystemCallError) {
                sendCalls += 1
                if case .processed(let sent) = try Syscall.sendmmsg(fd, messages + message, end - message, Socket.dontWait), sent > 0 {
                    for done in message..<(message + sent) { tell(done, headers, owners, error: 0) }
                    messagesSent += sent
                    message += sent
                    continue
                }
                error = EAGAIN
            } catch let failure {
                error = failure.errno
            }
            if messages[message].msg_hdr.msg_iovlen > 1 && (error == EINVAL || error == EIO || error == EMSGSIZE) {
                // GSO refused here (no checksum offload toward this downstream, a segment above its
                // MTU): this run one copy per message, and no GSO for a while.
                gsoOffUntil = now + Self.retryInterval
                sendSingly(fd, message, headers, owners)
                message += 1
                continue
            }
            if error == EAGAIN {
                // The socket's send buffer is full: the rest of its messages fail at once.
                for failed in message..<end { tell(failed, headers, owners, error: EAGAIN) }
                return
            }
            tell(message, headers, owners, error: error)
            message += 1
        }
    }

    /// Sends message `message`'s copies one per sendmsg (a GSO run the kernel refused).
    private func sendSingly(_ fd: Int32, _ message: Int, _ headers: UnsafeMutablePointer<shim_mmsghdr>,
                            _ owners: UnsafeMutablePointer<Unmanaged<SourcePreservingOutbox>>) {
        let first = firsts[message]
        for position in first..<(first + messages[message].msg_hdr.msg_iovlen) {
            var single = msghdr()
            single.msg_name = messages[message].msg_hdr.msg_name
            single.msg_namelen = messages[message].msg_hdr.msg_namelen
            single.msg_iov = payloads + position
            single.msg_iovlen = 1
            var failure: Int32 = 0
            do throws(SystemCallError) {
                sendCalls += 1
                if case .processed = try Syscall.sendmsg(fd, &single, Socket.dontWait) {} else { failure = EAGAIN }
            } catch {
                failure = error.errno
            }
            let index = order[position]
            owners[index]._withUnsafeGuaranteedRef { owner in
                if failure == 0 {
                    copiesSent += 1
                    messagesSent += 1
                    owner.delivered(headers[index].msg_hdr)
                } else {
                    owner.failed(headers[index].msg_hdr, failure)
                }
            }
        }
    }

    /// Tells the owners of message `message`'s copies that it was sent (`error` 0) or failed.
    @inline(__always)
    private func tell(_ message: Int, _ headers: UnsafeMutablePointer<shim_mmsghdr>,
                      _ owners: UnsafeMutablePointer<Unmanaged<SourcePreservingOutbox>>, error: Int32) {
        let first = firsts[message]
        for position in first..<(first + messages[message].msg_hdr.msg_iovlen) {
            let index = order[position]
            owners[index]._withUnsafeGuaranteedRef { owner in
                if error == 0 {
                    copiesSent += 1
                    owner.delivered(headers[index].msg_hdr)
                } else {
                    owner.failed(headers[index].msg_hdr, error)
                }
            }
        }
    }

    // MARK: Headers

    /// The staged message's client (its IP source and UDP source port) and TTL / hop limit.
    @inline(__always)
    static func client(_ header: msghdr, family: Int32) -> (client: SocketAddress, ttl: UInt8) {
        let base = UnsafeRawPointer(header.msg_iov[0].iov_base!)
        if family == AF_INET6 {
            return (SocketAddress(ip: .v6(base.loadUnaligned(fromByteOffset: 8, as: in6_addr.self)),
                                  port: UInt16(bigEndian: base.loadUnaligned(fromByteOffset: 40, as: UInt16.self))),
                    base.load(fromByteOffset: 7, as: UInt8.self))
        }
        return (SocketAddress(ip: .v4(base.loadUnaligned(fromByteOffset: 12, as: in_addr_t.self)),
                              port: UInt16(bigEndian: base.loadUnaligned(fromByteOffset: 20, as: UInt16.self))),
                base.load(fromByteOffset: 8, as: UInt8.self))
    }

    /// The staged message's destination: its IP destination and UDP destination port.
    @inline(__always)
    static func destination(_ header: msghdr, family: Int32) -> SocketAddress {
        let base = UnsafeRawPointer(header.msg_iov[0].iov_base!)
        if family == AF_INET6 {
            return SocketAddress(ip: .v6(base.loadUnaligned(fromByteOffset: 24, as: in6_addr.self)),
                                 port: UInt16(bigEndian: base.loadUnaligned(fromByteOffset: 42, as: UInt16.self)))
        }
        return SocketAddress(ip: .v4(base.loadUnaligned(fromByteOffset: 16, as: in_addr_t.self)),
                             port: UInt16(bigEndian: base.loadUnaligned(fromByteOffset: 22, as: UInt16.self)))
    }

    // MARK: Sockets

    /// The socket for the staged message's client endpoint (made on first use), or -1: the raw way.
    @inline(__always)
    private func socket(for header: msghdr, family: Int32, now: Int, previous: inout (client: SocketAddress, fd: Int32)?) -> Int32 {
        let (client, ttl) = Self.client(header, family: family)
        guard ttl == SourcePreservingOutbox.ttl else { return -1 }
        if let previous, previous.client == client { return previous.fd }
        guard ephemeral.contains(client.port), !reserved.contains(client.port) else { return -1 }
        let fd: Int32
        if let index = entries.index(forKey: client) {
            let entry = entries.values[index]
            if entry.fd >= 0 {
                entries.values[index].stamp = now
                fd = entry.fd
            } else if now - entry.stamp < Self.retryInterval {
                fd = -1
            } else {
                fd = make(client, now: now)
            }
        } else {
            fd = make(client, now: now)
        }
        previous = (client, fd)
        return fd
    }

    /// Makes the socket for `client` and records it, or records that the endpoint goes the raw way.
    private func make(_ client: SocketAddress, now: Int) -> Int32 {
        // Refused endpoints are remembered too, up to as many again.
        guard sockets < Self.maximumSockets else {
            if entries.count < 2 * Self.maximumSockets { entries[client] = Entry(fd: -1, stamp: now) }
            return -1
        }
        if Self.held.add(1, ordering: .relaxed).newValue > Self.budget {
            Self.held.subtract(1, ordering: .relaxed)
            if !Self.budgetSaid.exchange(true, ordering: .relaxed) {
                logger.notice("output preserve_source: the UDP sockets bound to clients reached a quarter of the open-files limit (\(Self.budget)): further clients' copies go through the raw socket, one routed and built at a time; raise the limit (LimitNOFILE=, ulimit -n) to send them through their own sockets")
            }
            if entries.count < 2 * Self.maximumSockets { entries[client] = Entry(fd: -1, stamp: now) }
            return -1
        }
        let fd: Int32
        switch Self.open(client, sendBuffer: sendBuffer) {
        case .socket(let made):
            fd = made
            sockets += 1
            counters?.clientSockets.add(1, ordering: .relaxed)
        case .refused(let errno):
            Self.held.subtract(1, ordering: .relaxed)
            refused = true
            if !Self.refusalSaid.exchange(true, ordering: .relaxed) {
                logger.notice("output preserve_source: IP_TRANSPARENT is refused (\(String(cString: strerror(errno)))): copies go through the raw socket, one routed and built at a time, without GSO; grant CAP_NET_RAW or CAP_NET_ADMIN to the process (it already needs CAP_NET_RAW for the raw socket) to send through UDP sockets bound to each client's address and port")
            }
            fd = -1
        case .rawWay:
            Self.held.subtract(1, ordering: .relaxed)
            fd = -1
        }
        if fd >= 0 || entries.count < 2 * Self.maximumSockets { entries[client] = Entry(fd: fd, stamp: now) }
        return fd
    }

    private enum Opened {
        case socket(Int32)
        /// IP_TRANSPARENT refused (EPERM): no socket for any endpoint.
        case refused(Int32)
        /// This endpoint goes the raw way (its address is local, or a call failed).
        case rawWay
    }

    /// A UDP socket bound to `client` with IP_TRANSPARENT / IPV6_TRANSPARENT, when its address
    /// is not one of the host's.
    private static func open(_ client: SocketAddress, sendBuffer: Int32) -> Opened {
        let family = client.ip.family
        guard let fd = try? Syscall.socket(family, Socket.datagram | Socket.nonBlocking | Socket.closeOnExec) else { return .rawWay }
        var kept = false
        defer { if !kept { close(fd) } }
        if family == AF_INET6 { try? Syscall.setsockopt(fd, Int32(IPPROTO_IPV6), IPV6_V6ONLY, Int32(1)) }
        // Without IP_TRANSPARENT only a local address binds (or is in use): such a client goes
        // the raw way, its port left to it.
        do throws(SystemCallError) {
            try Syscall.bind(fd, client)
            return .rawWay
        } catch {
            guard error.errno == EADDRNOTAVAIL else { return .rawWay }
        }
        let level = family == AF_INET6 ? Int32(IPPROTO_IPV6) : Int32(IPPROTO_IP)
        do throws(SystemCallError) {
            try Syscall.setsockopt(fd, level, family == AF_INET6 ? IPV6_TRANSPARENT : IP_TRANSPARENT, Int32(1))
        } catch {
            return error.errno == EPERM ? .refused(error.errno) : .rawWay
        }
        try? Syscall.setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, Int32(1))
        try? Syscall.setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, Int32(1))
        guard shim_drop_all_input(fd) == 0, (try? Syscall.bind(fd, client)) != nil else { return .rawWay }
        if family == AF_INET {
            try? Syscall.setsockopt(fd, level, IP_MTU_DISCOVER, Int32(IP_PMTUDISC_DONT))
            try? Syscall.setsockopt(fd, level, IP_TTL, Int32(SourcePreservingOutbox.ttl))
        } else {
            try? Syscall.setsockopt(fd, level, IPV6_MTU_DISCOVER, Int32(IPV6_PMTUDISC_DONT))
            try? Syscall.setsockopt(fd, level, IPV6_UNICAST_HOPS, Int32(SourcePreservingOutbox.ttl))
        }
        if (try? Syscall.setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, sendBuffer)) == nil {
            try? Syscall.setsockopt(fd, SOL_SOCKET, SO_SNDBUF, sendBuffer)
        }
        kept = true
        return .socket(fd)
    }

    /// ``sweep(_:)`` when a second has passed since the last: the forwarding thread calls it every
    /// second, with traffic or without, so an idle thread closes its sockets too.
    func sweepIfDue() {
        let now = Self.seconds()
        if now >= nextSweep { sweep(now) }
    }

    /// Closes sockets unused for ``idleLimit`` seconds and those whose address became the host's
    /// (``releaseLocal(_:)``), and forgets refusals older than ``retryInterval``; once a second at most.
    private func sweep(_ now: Int) {
        nextSweep = now + 1
        guard !entries.isEmpty else { return }
        if sockets > 0 { releaseLocal(now) }
        var stale: [SocketAddress] = []
        for (client, entry) in entries where now - entry.stamp >= (entry.fd >= 0 ? idleLimit : Self.retryInterval) {
            stale.append(client)
        }
        for client in stale {
            if let entry = entries.removeValue(forKey: client), entry.fd >= 0 {
                close(entry.fd)
                sockets -= 1
                Self.held.subtract(1, ordering: .relaxed)
                counters?.clientSockets.subtract(1, ordering: .relaxed)
            }
        }
    }

    /// Closes the sockets whose client address became one of the host's since it was bound (an
    /// address added to an interface, a virtual address that moved here): held, such a socket
    /// would take that port from a local program (its bind fails without SO_REUSEADDR) and drop
    /// what arrives for it. The endpoint goes the raw way (a later try finds the address local);
    /// said each time. An address made local by a local route alone (AnyIP) is not an interface's
    /// address and is not seen here.
    private func releaseLocal(_ now: Int) {
        let local = Self.localAddresses(now)
        var became: [SocketAddress] = []
        for (client, entry) in entries where entry.fd >= 0 && local.contains(client.ip) { became.append(client) }
        guard !became.isEmpty else { return }
        for client in became {
            guard let entry = entries[client] else { continue }
            close(entry.fd)
            sockets -= 1
            Self.held.subtract(1, ordering: .relaxed)
            counters?.clientSockets.subtract(1, ordering: .relaxed)
            entries[client] = Entry(fd: -1, stamp: now)
        }
        let named = became.prefix(8).map { "\($0)" }.joined(separator: ", ") + (became.count > 8 ? " and \(became.count - 8) more" : "")
        logger.notice("output preserve_source: a client's address became one of this host's: its UDP sockets are closed, leaving the ports to local programs, and its copies go through the raw socket (tried again after \(Self.retryInterval) s)",
                      metadata: ["clients": "\(named)", "sockets_closed": "\(became.count)"])
    }

    /// The host's interface addresses as of second `now`, read once a second for every thread of
    /// the process in one network namespace (a host with many interfaces takes a while to list;
    /// threads of another namespace, as in tests, read their own).
    private static func localAddresses(_ now: Int) -> Set<IPAddress> {
        var status = stat()
        let namespace = stat("/proc/thread-self/ns/net", &status) == 0 ? UInt64(status.st_ino) : 0
        // Read under the lock: threads that sweep in the same second wait for one reading.
        return localCache.withLock { cache in
            if cache.stamp != now || cache.namespace != namespace { cache = (now, namespace, LocalAddresses.current()) }
            return cache.addresses
        }
    }

    private static let localCache = Mutex<(stamp: Int, namespace: UInt64, addresses: Set<IPAddress>)>((-1, 0, []))

    // MARK: The namespace's ports

    /// The first line of /proc/sys/`path` (the calling thread's network namespace), without its
    /// newline and outer spaces.
    static func sysctl(_ path: String) -> String? {
        guard let file = fopen("/proc/sys/" + path, "r") else { return nil }
        defer { fclose(file) }
        var line = [CChar](repeating: 0, count: 4096)
        guard fgets(&line, Int32(line.count), file) != nil else { return nil }
        let text = String(decoding: line.prefix { $0 != 0 && $0 != 10 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
        return String(text.drop { $0 == " " }.reversed().drop { $0 == " " }.reversed())
    }

    /// net.ipv4.ip_local_port_range (it covers IPv6 too) and ip_local_reserved_ports ("1,5-9");
    /// the kernel's defaults when they cannot be read.
    static func ephemeralPorts() -> (ClosedRange<UInt16>, Set<UInt16>) {
        var range: ClosedRange<UInt16> = 32768...60999
        if let text = sysctl("net/ipv4/ip_local_port_range") {
            let bounds = text.split(whereSeparator: { $0 == " " || $0 == "\t" }).compactMap { UInt16($0) }
            if bounds.count == 2, bounds[0] <= bounds[1] { range = bounds[0]...bounds[1] }
        }
        var reserved = Set<UInt16>()
        for part in (sysctl("net/ipv4/ip_local_reserved_ports") ?? "").split(separator: ",") {
            let ends = part.split(separator: "-").compactMap { UInt16($0) }
            if ends.count == 1 { reserved.insert(ends[0]) }
            if ends.count == 2, ends[0] <= ends[1], ends[1] - ends[0] < 65535 { reserved.formUnion(ends[0]...ends[1]) }
        }
        return (range, reserved)
    }
}
