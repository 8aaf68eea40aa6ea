// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import SystemCalls
import CSystemShim
import ReusePortLB

/// Why a downstream's way out could not be made, naming the fix.
package struct OutboxError: Error, CustomStringConvertible, Equatable, Sendable {
    /// The downstream the outbox was for.
    package var downstream: SocketAddress
    /// The C call that failed.
    package var call: String
    package var errno: Int32

    package var description: String {
        let base = "downstream \(downstream): \(call) failed: \(String(cString: strerror(errno))) (errno \(errno))"
        guard errno == EPERM || errno == EACCES else { return base }
        return base + ": output preserve_source sends through a raw IP socket, which needs CAP_NET_RAW: run as root, or grant it "
            + "(systemd AmbientCapabilities=CAP_NET_RAW; Kubernetes securityContext.capabilities.add: [NET_RAW]; "
            + "setcap cap_net_raw+ep on the binary), or use output: socket"
    }
}

/// Sends datagrams to one downstream with the client's source address and port (what samplicator's
/// `-S` does): the IP and UDP headers are built here and the datagram goes out through a raw IP
/// socket (IPv4: IPPROTO_RAW, which implies IP_HDRINCL; IPv6: IPPROTO_RAW, which implies header
/// inclusion on Linux), so the kernel routes it and fills in the Ethernet header. Needs CAP_NET_RAW.
///
/// No payload copy: each message is two iovecs, a header this outbox owns per slot and the
/// payload in the receiver's buffer. Made by a forwarding thread (``Outboxes/factory(output:capacity:)``)
/// it sends through the thread's raw socket (``SharedRawSender``): the batch is staged there and
/// goes out in one sendmmsg with every other preserve_source downstream's (``stage()``), or, when
/// not staged (a batch to fragment, the flow template relay's copies and replays), by its own
/// sendmmsg on that socket. Made alone (the kernel kinds' template replays, the start check) it
/// opens a raw socket of its own. MSG_DONTWAIT throughout.
///
/// The headers: the UDP checksum of every copy that goes through the raw socket (IPv4 too:
/// collectors may check it), summed just before it goes (``fillChecksum(_:)``), not at append: a
/// copy through a client's UDP socket (``TransparentSockets``) leaves it to the kernel or the
/// device; TTL/hop limit 64;
/// IPv4 id 0 (the kernel picks one) and DF clear: the source is the client's, so an ICMP
/// "fragmentation needed" from a router on the way would go to the client and path MTU discovery
/// cannot work for us; without DF a smaller MTU downstream fragments instead of dropping.
///
/// Fragments: the kernel refuses (EMSGSIZE) and never fragments a raw datagram that carries its
/// own header and is larger than the outgoing MTU, so such a datagram is fragmented here, as a
/// router would (``sendFragments(header:headerLength:payload:mtu:identification:scratch:iovecs:send:)``):
/// one sendmsg per fragment, the payload not copied (a batch holding one is not staged, so the
/// batch keeps its order). The MTU is the route's toward the downstream, read through a UDP
/// socket connected to it for the purpose (IP_MTU / IPV6_MTU, then closed) at init and again on
/// EMSGSIZE (a route whose MTU shrank). Only a datagram whose IP length would pass 65,535 is `too_large`.
///
/// A client of the other address family than the downstream cannot keep its source (an
/// IPv4-mapped IPv6 client to an IPv4 downstream is the same family and is unmapped): such a
/// datagram is dropped and counted `family_mismatch`, never sent with another source.
final class SourcePreservingOutbox: Outbox {
    /// Room for the largest headers: IPv6 (40) + UDP (8).
    static let maximumHeaderSize = 48
    static let ttl: UInt8 = 64
    /// Room for a fragment's headers: IPv6 (40) + Fragment (8); IPv4 needs 20.
    static let maximumFragmentHeaderSize = 48
    /// The MTU used while the route's cannot be read (no route yet): the least every link of the
    /// family carries whole (IPv4: 576, what every host must reassemble; IPv6: 1280).
    static func minimumMTU(family: Int32) -> Int { family == AF_INET ? 576 : 1280 }

    /// The raw socket: the thread's shared one (``shared``), or this outbox's own.
    let socket: Int32
    /// The forwarding thread's raw sockets, which own ``socket``; nil: this outbox owns it.
    private let shared: SharedRawSender?
    private let address: SocketAddress
    private let capacity: Int
    private let messages: UnsafeMutablePointer<shim_mmsghdr>
    private let iovecs: UnsafeMutablePointer<iovec>
    private let headerSpace: UnsafeMutableRawPointer
    /// The downstream as msg_name (port 0: raw sockets route by address only).
    private let destination: UnsafeMutablePointer<sockaddr_storage>
    private let destinationLength: socklen_t
    /// Datagrams appended since the last flush, sendable or not.
    @exclusivity(unchecked) private(set) var count = 0
    @exclusivity(unchecked) var ledger: CrashLedger.Slot?
    /// Messages built (sendable datagrams) since the last flush.
    @exclusivity(unchecked) private var built = 0
    /// Built messages to send as fragments since the last flush.
    @exclusivity(unchecked) private var fragments = 0
    @exclusivity(unchecked) private var mismatched: UInt64 = 0
    @exclusivity(unchecked) private var oversized: UInt64 = 0
    /// Per built message: larger than ``mtu`` when appended, sent as fragments.
    private let fragmented: UnsafeMutablePointer<Bool>
    /// The route's MTU toward the downstream (``minimumMTU(family:)`` while it cannot be read).
    @exclusivity(unchecked) private(set) var mtu: Int
    /// This batch went to the shared sender; its outcome is in ``pending`` until the flush.
    @exclusivity(unchecked) private var staged = false
    /// The MTU was read again in this flush (an EMSGSIZE): not again until the next one.
    @exclusivity(unchecked) private var mtuReread = false
    @exclusivity(unchecked) private var pending: FlushResult = (0, 0, DropTally())
    /// The last fragment identification used; the next is one more (never 0).
    private var identification = UInt32.random(in: 1...UInt32.max)
    private let fragmentScratch: UnsafeMutableRawPointer
    private let fragmentIovecs: UnsafeMutablePointer<iovec>
    /// Raw sockets do not report ICMP port unreachable to the sender: never true (passive health
    /// is not fed by this way out).
    let refused = false

    /// A raw IP socket of `family` for datagrams that carry their own IP header (IPv4:
    /// IPPROTO_RAW and IP_HDRINCL; IPv6: IPPROTO_RAW), non-blocking, with `sendBuffer` bytes of
    /// send buffer (SO_SNDBUFFORCE where allowed, else SO_SNDBUF up to wmem_max).
    /// - Throws: the call that failed (EPERM without CAP_NET_RAW).
    static func openRawSocket(family: Int32, sendBuffer: Int32) throws(SystemCallError) -> Int32 {
        let fd: Int32
        do {
            fd = try Syscall.socket(family, Socket.raw | Socket.nonBlocking | Socket.closeOnExec, Int32(IPPROTO_RAW))
        } catch {
            throw SystemCallError(call: "socket(\(family == AF_INET ? "AF_INET" : "AF_INET6"), SOCK_RAW, IPPROTO_RAW)", errno: error.errno)
        }
        if family == AF_INET {
            do {
                try Syscall.setsockopt(fd, Int32(IPPROTO_IP), IP_HDRINCL, Int32(1))
            } catch {
                Syscall.close(fd)
                throw SystemCallError(call: "setsockopt IP_HDRINCL", errno: error.errno)
            }
        }
        if (try? Syscall.setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, sendBuffer)) == nil {
            try? Syscall.setsockopt(fd, SOL_SOCKET, SO_SNDBUF, sendBuffer)
        }
        return fd
    }

    /// Sends through `shared`'s raw socket of the downstream's family (made now if it is not yet),
    /// or, when `shared` is nil, opens its own.
    /// - Throws: `OutboxError` from socket(2)/setsockopt(2); EPERM names CAP_NET_RAW and how to grant it.
    init(address: SocketAddress, capacity: Int, shared: SharedRawSender? = nil) throws(OutboxError) {
        let family = address.ip.family
        let fd: Int32
        do throws(SystemCallError) {
            if let shared {
                fd = try shared.socket(family: family)
            } else {
                fd = try Self.openRawSocket(family: family, sendBuffer: 4 << 20)
            }
        } catch {
            throw OutboxError(downstream: address, call: error.call, errno: error.errno)
        }
        mtu = Self.minimumMTU(family: family)
        socket = fd
        self.shared = shared
        self.address = address
        self.capacity = capacity
        messages = .allocate(capacity: capacity)
        iovecs = .allocate(capacity: 2 * capacity)
        headerSpace = .allocate(byteCount: capacity * Self.maximumHeaderSize, alignment: 8)
        destination = .allocate(capacity: 1)
        destination.initialize(to: sockaddr_storage())
        fragmented = .allocate(capacity: capacity)
        fragmented.initialize(repeating: false, count: capacity)
        fragmentScratch = .allocate(byteCount: Self.maximumFragmentHeaderSize, alignment: 8)
        fragmentIovecs = .allocate(capacity: 3)
        destinationLength = SocketAddress(ip: address.ip, port: 0).write(to: &destination.pointee)
        for index in 0..<capacity {
            messages[index] = shim_mmsghdr()
            messages[index].msg_hdr.msg_name = UnsafeMutableRawPointer(destination)
            messages[index].msg_hdr.msg_namelen = destinationLength
            messages[index].msg_hdr.msg_iov = iovecs + 2 * index
            messages[index].msg_hdr.msg_iovlen = 2
            iovecs[2 * index] = iovec(iov_base: headerSpace + index * Self.maximumHeaderSize, iov_len: 0)
        }
        refreshMTU()
    }

    /// ``refreshMTU()`` at most once per flush: each EMSGSIZE of a batch asks, the first reads (a
    /// read is four system calls; a route whose MTU is above its device's fails every large
    /// datagram of the batch alike).
    private func rereadMTUOnce() {
        guard !mtuReread else { return }
        mtuReread = true
        refreshMTU()
    }

    /// Reads the route's MTU toward the downstream again through a UDP socket connected to it for
    /// the purpose (a new connect sees the route as it is now), IP_MTU / IPV6_MTU. Without a
    /// route it stays as it was (the send fails with the route's own errno anyway).
    func refreshMTU() {
        guard let probe = try? Syscall.socket(address.ip.family, Socket.datagram | Socket.closeOnExec) else { return }
        defer { Syscall.close(probe) }
        guard (try? Syscall.connect(probe, address)) != nil else { return }
        let value = address.ip.family == AF_INET
            ? try? Syscall.getsockopt(probe, Int32(IPPROTO_IP), IP_MTU, initial: Int32(0))
            : try? Syscall.getsockopt(probe, Int32(IPPROTO_IPV6), IPV6_MTU, initial: Int32(0))
        if let value, value > 0 { mtu = Int(value) }
    }

    deinit {
        if shared == nil { close(socket) }
        fragmented.deallocate()
        fragmentScratch.deallocate()
        fragmentIovecs.deallocate()
        messages.deallocate()
        iovecs.deallocate()
        headerSpace.deallocate()
        destination.deallocate()
    }

    /// Queues `payload` from the client at `source` (as recvmmsg gave it). The payload stays in
    /// place until `flush`. At most `capacity` datagrams between flushes.
    /// - Parameter hopLimit: the TTL/hop limit to send with (af_xdp: the received one less one,
    ///   so a forwarding loop ends); 0: ``ttl`` (userspace mode, where the socket does not say).
    func append(_ payload: UnsafeRawBufferPointer, source: UnsafePointer<sockaddr_storage>, hopLimit: UInt8) {
        precondition(count < capacity, "SourcePreservingOutbox: more than \(capacity) datagrams before a flush")
        count += 1
        guard let client = Self.source(source, family: address.ip.family) else {
            mismatched += 1
            return
        }
        let header = UnsafeMutableRawBufferPointer(start: headerSpace + built * Self.maximumHeaderSize, count: Self.maximumHeaderSize)
        guard let length = Self.writeHeaders(into: header, source: client, destination: address, payload: payload,
                                                 ttl: hopLimit == 0 ? Self.ttl : hopLimit, checksum: false) else {
            oversized += 1
            return
        }
        iovecs[2 * built].iov_len = length
        fragmented[built] = length + payload.count > mtu
        if fragmented[built] { fragments += 1 }
        iovecs[2 * built + 1] = iovec(iov_base: UnsafeMutableRawPointer(mutating: payload.baseAddress), iov_len: payload.count)
        built += 1
    }

    /// Sends the batch. A datagram that fails is dropped and counted with its reason; the rest
    /// go on. Drops decided at append (`family_mismatch`, `too_large`) are counted here.
    func flush(_ result: inout FlushResult) {
        defer {
            count = 0
            built = 0
            fragments = 0
            mismatched = 0
            oversized = 0
            mtuReread = false
        }
        if mismatched > 0 { result.dropped[.familyMismatch, default: 0] += mismatched }
        if oversized > 0 { result.dropped[.tooLarge, default: 0] += oversized }
        ledger?.handing(Int(mismatched + oversized))
        if staged {
            staged = false
            result.sent += pending.sent
            result.bytes += pending.bytes
            for (reason, dropped) in pending.dropped { result.dropped[reason, default: 0] += dropped }
            pending = (0, 0, DropTally())
            return
        }
        // Sent here, through the raw socket: the UDP checksums (a datagram to fragment gets its own
        // when it is).
        for index in 0..<built where !fragmented[index] { Self.fillChecksum(messages[index].msg_hdr) }
        var message = 0
        // The crash ledger: messages before this one were noted handed (one datagram each).
        var noted = 0
        while message < built {
            if fragmented[message] {
                if message >= noted {
                    ledger?.handing(1)
                    noted = message + 1
                }
                sendFragmented(message, &result)
                message += 1
                continue
            }
            // A run of whole datagrams up to the next one to fragment: one sendmmsg.
            var end = message + 1
            while end < built && !fragmented[end] { end += 1 }
            if end > noted {
                ledger?.handing(end - max(noted, message))
                noted = end
            }
            let error: Int32
            do throws(SystemCallError) {
                if case .processed(let sent) = try Syscall.sendmmsg(socket, messages + message, end - message, Socket.dontWait), sent > 0 {
                    for index in message..<(message + sent) { result.bytes += UInt64(iovecs[2 * index + 1].iov_len) }
                    result.sent += UInt64(sent)
                    message += sent
                    continue
                }
                error = EAGAIN
            } catch let failure {
                error = failure.errno
            }
            if error == EMSGSIZE {
                // The MTU shrank since it was read: read it again and fragment. Still within it
                // (a route MTU above the device's): nothing smaller to cut to, too_large.
                rereadMTUOnce()
                if iovecs[2 * message].iov_len + iovecs[2 * message + 1].iov_len > mtu {
                    sendFragmented(message, &result)
                    message += 1
                    continue
                }
            }
            result.dropped[Self.reason(error), default: 0] += 1
            message += 1
        }
    }

    // MARK: The shared sender

    /// Puts this batch's messages into the thread's ``SharedRawSender``, one sendmmsg with every
    /// other preserve_source downstream's; the outcome is what the next ``flush(_:)`` returns. A
    /// batch with a datagram to fragment is not staged (the flush sends it in order, itself).
    func stage() {
        guard built > 0, fragments == 0, let shared else { return }
        let family = address.ip.family
        guard shared.reserve(built, family: family) else { return }
        for index in 0..<built { shared.stage(messages[index].msg_hdr, family: family, owner: self) }
        staged = true
    }

    /// The shared sender sent `message` (one of this outbox's, one datagram).
    @inline(__always)
    func delivered(_ message: msghdr) {
        pending.sent += 1
        pending.bytes += UInt64(message.msg_iov[1].iov_len)
    }

    /// The shared sender could not send `message`: EMSGSIZE (the route's MTU shrank since it was
    /// read) reads the MTU again and sends it as fragments when it is now above it; any other
    /// error drops it with its reason.
    func failed(_ message: msghdr, _ error: Int32) {
        let index = (message.msg_iov - iovecs) / 2
        if error == EMSGSIZE {
            rereadMTUOnce()
            if iovecs[2 * index].iov_len + iovecs[2 * index + 1].iov_len > mtu {
                sendFragmented(index, &pending)
                return
            }
        }
        pending.dropped[Self.reason(error), default: 0] += 1
    }

    /// Sends built message `index` as fragments of at most ``mtu`` bytes; counts it sent, or
    /// dropped once with the failing fragment's reason. EMSGSIZE (the MTU shrank again) reads the
    /// MTU once more and starts over with a new identification when it did shrink.
    private func sendFragmented(_ index: Int, _ result: inout FlushResult) {
        // The UDP header, in the first fragment, carries the whole datagram's checksum.
        Self.fillChecksum(messages[index].msg_hdr)
        let header = UnsafeRawPointer(iovecs[2 * index].iov_base!)
        let headerLength = iovecs[2 * index].iov_len
        let payload = UnsafeRawBufferPointer(start: iovecs[2 * index + 1].iov_base, count: iovecs[2 * index + 1].iov_len)
        var error: Int32 = 0
        for attempt in 0..<2 {
            identification = identification &+ 1
            // IPv4 carries the low 16 bits: none of the ids may be 0 there or in IPv6.
            if identification & 0xffff == 0 { identification = identification &+ 1 }
            error = Self.sendFragments(header: header, headerLength: headerLength, payload: payload, mtu: mtu,
                                       identification: identification, scratch: fragmentScratch, iovecs: fragmentIovecs) { vectors, count in
                var message = msghdr()
                message.msg_name = UnsafeMutableRawPointer(destination)
                message.msg_namelen = destinationLength
                message.msg_iov = vectors
                message.msg_iovlen = count
                do throws(SystemCallError) {
                    if case .processed = try Syscall.sendmsg(socket, &message, Socket.dontWait) { return 0 }
                    return EAGAIN
                } catch {
                    return error.errno
                }
            }
            guard error == EMSGSIZE && attempt == 0 else { break }
            let before = mtu
            rereadMTUOnce()
            guard mtu < before else { break }
        }
        if error == 0 {
            result.sent += 1
            result.bytes += UInt64(payload.count)
        } else {
            result.dropped[Self.reason(error), default: 0] += 1
        }
    }

    /// Sends the datagram whose IP and UDP headers (`headerLength`: 28 or 48, as ``writeHeaders``
    /// built them, UDP checksum over the whole datagram) are at `header` as IP fragments of at most
    /// `mtu` bytes, calling `send` with each fragment's iovecs (its headers in `scratch`, then
    /// slices of the UDP header and `payload`: nothing copied). Returns 0, the first errno `send`
    /// returned (the rest are not sent), or EMSGSIZE when `mtu` leaves no room for 8 bytes of data.
    ///
    /// IPv4: the header again with total length per fragment, `identification`'s low 16 bits, MF on
    /// all but the last and the offset in 8-byte units; checksum left 0 (the kernel fills it).
    /// IPv6: the header with next header 44 (Fragment) and payload length per fragment, then the
    /// Fragment header: next header UDP, offset | M, `identification`. Every fragment but the last
    /// carries a multiple of 8 bytes; the UDP header is whole in the first.
    /// - Parameters:
    ///   - scratch: ``maximumFragmentHeaderSize`` bytes.
    ///   - iovecs: room for 3.
    static func sendFragments(header: UnsafeRawPointer, headerLength: Int, payload: UnsafeRawBufferPointer, mtu: Int, identification: UInt32,
                              scratch: UnsafeMutableRawPointer, iovecs: UnsafeMutablePointer<iovec>,
                              send: (UnsafeMutablePointer<iovec>, Int) -> Int32) -> Int32 {
        let ipLength = headerLength - 8
        let v6 = ipLength == 40
        let fragmentHeaderLength = v6 ? 48 : 20
        let step = (mtu - fragmentHeaderLength) / 8 * 8
        guard step >= 8 else { return EMSGSIZE }
        scratch.copyMemory(from: header, byteCount: ipLength)
        if v6 {
            scratch.storeBytes(of: UInt8(44), toByteOffset: 6, as: UInt8.self)
            scratch.storeBytes(of: UInt16(UInt16(IPPROTO_UDP) << 8).bigEndian, toByteOffset: 40, as: UInt16.self)
            scratch.storeBytes(of: identification.bigEndian, toByteOffset: 44, as: UInt32.self)
        } else {
            scratch.storeBytes(of: UInt16(truncatingIfNeeded: identification).bigEndian, toByteOffset: 4, as: UInt16.self)
            scratch.storeBytes(of: 0, toByteOffset: 10, as: UInt16.self)
        }
        let total = 8 + payload.count
        var offset = 0
        while offset < total {
            let length = min(step, total - offset)
            let more = offset + length < total
            if v6 {
                scratch.storeBytes(of: UInt16(8 + length).bigEndian, toByteOffset: 4, as: UInt16.self)
                scratch.storeBytes(of: UInt16(offset | (more ? 1 : 0)).bigEndian, toByteOffset: 42, as: UInt16.self)
            } else {
                scratch.storeBytes(of: UInt16(20 + length).bigEndian, toByteOffset: 2, as: UInt16.self)
                scratch.storeBytes(of: UInt16((more ? 0x2000 : 0) | offset / 8).bigEndian, toByteOffset: 6, as: UInt16.self)
            }
            iovecs[0] = iovec(iov_base: scratch, iov_len: fragmentHeaderLength)
            var count = 1
            var dataStart = offset
            if offset == 0 {
                // step >= 8: the whole UDP header is in the first fragment.
                iovecs[1] = iovec(iov_base: UnsafeMutableRawPointer(mutating: header + ipLength), iov_len: 8)
                count = 2
                dataStart = 8
            }
            let payloadEnd = offset + length - 8
            if payloadEnd > dataStart - 8 {
                iovecs[count] = iovec(iov_base: UnsafeMutableRawPointer(mutating: payload.baseAddress! + (dataStart - 8)), iov_len: payloadEnd - (dataStart - 8))
                count += 1
            }
            let error = send(iovecs, count)
            if error != 0 { return error }
            offset += length
        }
        return 0
    }

    /// The raw socket is made at init or the outbox does not exist (``UnavailableOutbox``).
    var unavailable: String? { nil }
    func reconnectIfDue() -> Bool { false }

    /// The drop reason of a failed send: EMSGSIZE (a fragment still above the outgoing MTU) is
    /// `too_large`; the rest as the socket way out maps them.
    static func reason(_ error: Int32) -> DropReason {
        error == EMSGSIZE ? .tooLarge : DownstreamOutbox.reason(error)
    }

    /// The client's address as a source for a downstream of `family`: an IPv4-mapped IPv6 client
    /// unmapped for IPv4; nil when the families differ.
    static func source(_ storage: UnsafePointer<sockaddr_storage>, family: Int32) -> SocketAddress? {
        guard let client = SocketAddress(storage: UnsafeRawPointer(storage)) else { return nil }
        switch (client.ip, family) {
        case (.v4, AF_INET), (.v6, AF_INET6) where !isMapped(client.ip):
            return client
        case (.v6(let raw), AF_INET) where isMapped(client.ip):
            let v4 = withUnsafeBytes(of: raw) { $0.loadUnaligned(fromByteOffset: 12, as: in_addr_t.self) }
            return SocketAddress(ip: .v4(v4), port: client.port)
        default:
            return nil
        }
    }

    /// ::ffff:a.b.c.d
    static func isMapped(_ ip: IPAddress) -> Bool {
        guard case .v6(let raw) = ip else { return false }
        return withUnsafeBytes(of: raw) { bytes in
            bytes.loadUnaligned(fromByteOffset: 0, as: UInt64.self) == 0
                && bytes.loadUnaligned(fromByteOffset: 8, as: UInt32.self) == UInt32(0xffff).bigEndian
        }
    }

    /// Writes the IP and UDP headers of `payload` from `source` to `destination` (one family)
    /// into `header`; returns their length (28 or 48), or nil when the IP length would pass
    /// 65535. The IPv4 header checksum is left 0: the kernel always computes it for IP_HDRINCL.
    /// - Parameter checksum: false leaves the UDP checksum 0 for ``fillChecksum(_:)`` to compute
    ///   if the copy goes the raw way (a client's UDP socket leaves it to the device).
    static func writeHeaders(into header: UnsafeMutableRawBufferPointer, source: SocketAddress, destination: SocketAddress,
                             payload: UnsafeRawBufferPointer, ttl: UInt8 = SourcePreservingOutbox.ttl, checksum: Bool = true) -> Int? {
        let udpLength = 8 + payload.count
        let base = header.baseAddress!
        let ipLength: Int
        switch (source.ip, destination.ip) {
        case (.v4(let from), .v4(let to)):
            guard 20 + udpLength <= 65535 else { return nil }
            ipLength = 20
            base.storeBytes(of: UInt32(0x4500_0000 | (20 + udpLength)).bigEndian, toByteOffset: 0, as: UInt32.self)
            base.storeBytes(of: 0, toByteOffset: 4, as: UInt32.self)  // id 0, DF clear, offset 0
            base.storeBytes(of: UInt32(UInt32(ttl) << 24 | UInt32(IPPROTO_UDP) << 16).bigEndian, toByteOffset: 8, as: UInt32.self)
            base.storeBytes(of: from, toByteOffset: 12, as: UInt32.self)
            base.storeBytes(of: to, toByteOffset: 16, as: UInt32.self)
        case (.v6(let from), .v6(let to)):
            guard udpLength <= 65535 else { return nil }
            ipLength = 40
            base.storeBytes(of: UInt32(0x6000_0000).bigEndian, toByteOffset: 0, as: UInt32.self)
            base.storeBytes(of: UInt32(UInt32(udpLength) << 16 | UInt32(IPPROTO_UDP) << 8 | UInt32(ttl)).bigEndian, toByteOffset: 4, as: UInt32.self)
            base.storeBytes(of: from, toByteOffset: 8, as: in6_addr.self)
            base.storeBytes(of: to, toByteOffset: 24, as: in6_addr.self)
        default:
            preconditionFailure("writeHeaders: \(source) and \(destination) differ in family")
        }
        let udp = base + ipLength
        udp.storeBytes(of: source.port.bigEndian, toByteOffset: 0, as: UInt16.self)
        udp.storeBytes(of: destination.port.bigEndian, toByteOffset: 2, as: UInt16.self)
        udp.storeBytes(of: UInt16(udpLength).bigEndian, toByteOffset: 4, as: UInt16.self)
        udp.storeBytes(of: 0, toByteOffset: 6, as: UInt16.self)
        if checksum { fillChecksum(header: base, payload: payload) }
        return ipLength + 8
    }

    /// Computes and stores the UDP checksum of the datagram whose IP and UDP headers, as
    /// ``writeHeaders(into:source:destination:payload:ttl:checksum:)`` wrote them, are at `header`
    /// (whatever its checksum field holds is replaced).
    static func fillChecksum(header: UnsafeMutableRawPointer, payload: UnsafeRawBufferPointer) {
        let v6 = header.load(as: UInt8.self) >> 4 == 6
        let udp = header + (v6 ? 40 : 20)
        // Pseudo-header: the addresses, the UDP length (IPv6: in 32 bits, its high half zero) and
        // the protocol; then the UDP header with its checksum field 0, then the payload.
        var sum = IPChecksum.add(UnsafeRawBufferPointer(start: header + (v6 ? 8 : 12), count: v6 ? 32 : 8), to: 0)
        sum &+= UInt64(udp.loadUnaligned(fromByteOffset: 4, as: UInt16.self)) &+ UInt64(UInt16(IPPROTO_UDP).bigEndian)
        udp.storeBytes(of: 0, toByteOffset: 6, as: UInt16.self)
        sum = IPChecksum.add(UnsafeRawBufferPointer(start: udp, count: 8), to: sum)
        let checksum = IPChecksum.finish(IPChecksum.add(payload, to: sum))
        // 0 means "no checksum" in UDP: a computed 0 is sent as its other form, 0xffff (RFC 768).
        udp.storeBytes(of: checksum == 0 ? 0xffff : checksum, toByteOffset: 6, as: UInt16.self)
    }

    /// ``fillChecksum(header:payload:)`` for a built message: its headers in `msg_iov[0]`, the payload in `msg_iov[1]`.
    @inline(__always)
    static func fillChecksum(_ message: msghdr) {
        fillChecksum(header: message.msg_iov[0].iov_base!,
                     payload: UnsafeRawBufferPointer(start: message.msg_iov[1].iov_base, count: message.msg_iov[1].iov_len))
    }
}
