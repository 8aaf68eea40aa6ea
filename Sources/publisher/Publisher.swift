// SPDX-License-Identifier: Apache-2.0
import ArgumentParser
import CSystemShim
import ReusePortLB
import TrafficModel

#if canImport(Glibc)
import Glibc
#endif
import SystemCalls

/// Test-traffic generator: many source addresses, a rate, a payload size, sendmmsg batches.
@main
struct Publisher: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Send numbered UDP datagrams from many source addresses.",
        discussion: """
            Sends <count> datagrams in all, split evenly over the source addresses (each source \
            sends a batch in turn). Each payload starts with the source's id and its sequence \
            number (and, from 24 bytes, the send time), so collectors can count loss and \
            reordering and measure latency. Prints one JSON line: what was \
            sent, per source, and the rate achieved. Source addresses must exist on this host \
            (all of 127.0.0.0/8 does on loopback; IPv6 ones must be added to an interface). \
            With --exchange it is the client side of a two-way test instead: <count> request/response \
            exchanges per client (see --clients); the JSON line then counts replies, lost ones, \
            replies from a source other than the destination, and the servers (tags appended by \
            `collector --echo`) each client saw.
            """,
        version: ProjectVersion.string)

    @Argument(help: "Destination address (IPv4 or IPv6).") var ip: String
    @Argument(help: "Destination UDP port.") var port: UInt16
    @Argument(help: "Datagrams to send in all.") var count: Int

    @Option(help: "Source addresses: A, A-B or A-B,C (default: the system's choice).") var sources: String?
    @Option(help: "Datagrams per second in all (0: as fast as possible).") var rate: Double = 0
    @Option(help: "Payload bytes per datagram, 16...65507 (65527 for IPv6).") var size: Int = 64
    @Option(help: "Stop after this many seconds even if not all were sent (0: no limit).") var duration: Double = 0
    @Option(help: "Datagrams per sendmmsg call.") var batch: Int = 32
    @Flag(help: "Send each batch as one UDP GSO message (UDP_SEGMENT): the same datagrams at far less CPU, for saturating a receiver.")
    var gso = false
    @Flag(help: "Request/response mode: <count> exchanges per client, each request awaiting its reply.")
    var exchange = false
    @Option(help: "--exchange: client sockets, each bound to a source of --sources (round robin) and its own port.")
    var clients: Int = 1
    @Option(name: .customLong("reply-timeout-ms"), help: "--exchange: a request without a reply after this long is counted lost and the next is sent.")
    var replyTimeoutMs: Int = 1000
    @Option(help: "--exchange: requests each client keeps outstanding.")
    var window: Int = 1
    @Option(name: .customLong("client-port-base"), help: "--exchange: client i binds port BASE+i (0: ephemeral ports), so a later run is the same clients.")
    var clientPortBase: Int = 0
    @Option(help: "Send NetFlow export packets instead of numbered payloads: v9 or ipfix (one exporter per source address: template, then data records; sequence numbers per exporter). --size does not apply.")
    var netflow: NetFlowExporter.Version?
    @Option(help: "--netflow: data records per packet, 1...40.") var records: Int = 10
    @Option(name: .customLong("template-every"), help: "--netflow: an exporter sends its template in its first packet and again every N packets.")
    var templateEvery: Int = 20
    @Option(help: "Send QUIC short-header packets instead of numbered payloads, their destination connection IDs carrying the server IDs of --server-ids in turn under this QUIC-LB layout: SERVER_ID_LENGTH:NONCE_LENGTH[:CONFIG_ID[:KEY]] (KEY: 32 hexadecimal digits; none: plaintext), the rest of --size zero (docs/quic.md).")
    var quic: String?
    @Option(name: .customLong("server-ids"), help: "--quic: the server IDs, comma-separated hexadecimal digits (0a01,0a02).")
    var serverIDs: String?
    @Flag(name: .customLong("per-client"), help: "--exchange: add client_tags, each client's address:port and the tags it saw in order.")
    var perClient = false

    /// Negative numbers reach validation (or one clear message) instead of ArgumentParser's
    /// option errors.
    static func main() {
        switch CommandLineNumbers.rewrite(
            Array(CommandLine.arguments.dropFirst()), positionals: ["ip", "port", "count"], flags: ["--gso", "--exchange", "--per-client", "--help"])
        {
        case .failure(let message): exit(withError: ValidationError(message.text))
        case .success(let arguments): main(arguments)
        }
    }

    func validate() throws {
        if let text = sources, text.contains("%"), let problem = IPAddress.problem(parsing: text) { throw ValidationError(problem) }
        guard port != 0 else { throw ValidationError("destination port 0 is not valid: use 1...65535") }
        guard let destination = IPAddress(ip) else { throw ValidationError(IPAddress.problem(parsing: ip) ?? "") }
        let maximum = destination.family == AF_INET ? 65507 : 65527
        guard (Payload.headerSize...maximum).contains(size) else {
            throw ValidationError("--size must be \(Payload.headerSize)...\(maximum) for this address family")
        }
        guard count >= 0 else { throw ValidationError("count must not be negative") }
        guard (1...1024).contains(batch) else { throw ValidationError("--batch must be 1...1024") }
        if gso {
            guard batch <= 64, batch * size <= 65000 else {
                throw ValidationError("--gso sends a batch as one message: --batch must be <= 64 and --batch x --size <= 65000")
            }
        }
        guard rate >= 0, duration >= 0 else { throw ValidationError("--rate and --duration must not be negative") }
        if netflow != nil {
            guard (1...40).contains(records) else { throw ValidationError("--records must be 1...40") }
            guard (1...100_000).contains(templateEvery) else { throw ValidationError("--template-every must be 1...100000") }
            guard !gso, !exchange else { throw ValidationError("--netflow sends export packets one way: --gso and --exchange do not apply") }
            guard !CommandLine.arguments.contains(where: { $0 == "--size" || $0.hasPrefix("--size=") }) else {
                throw ValidationError("--netflow sizes each packet by its records: use --records instead of --size")
            }
        } else if records != 10 || templateEvery != 20 {
            throw ValidationError("--records and --template-every need --netflow")
        }
        if quic != nil || serverIDs != nil {
            let traffic = try QUICTraffic.parse(quic, serverIDs)
            guard netflow == nil, !exchange else { throw ValidationError("--quic sends QUIC packets one way: --netflow and --exchange do not apply") }
            guard size >= traffic.packetLength else { throw ValidationError("--quic: --size must be at least \(traffic.packetLength) (a short header and the connection ID)") }
        }
        if exchange {
            guard size >= Payload.timestampedSize else { throw ValidationError("--exchange: --size must be at least \(Payload.timestampedSize)") }
            guard (1...65536).contains(clients) else { throw ValidationError("--clients must be 1...65536") }
            guard (1...1024).contains(window) else { throw ValidationError("--window must be 1...1024") }
            guard (1...600_000).contains(replyTimeoutMs) else { throw ValidationError("--reply-timeout-ms must be 1...600000") }
            guard clientPortBase == 0 || (1024...65535).contains(clientPortBase) && clientPortBase + clients - 1 <= 65535 else {
                throw ValidationError("--client-port-base: BASE...BASE+clients-1 must lie in 1024...65535 (0: ephemeral ports)")
            }
            guard !gso, rate == 0 else { throw ValidationError("--exchange paces itself by the replies: --gso and --rate do not apply") }
        } else if clients != 1 || window != 1 || clientPortBase != 0 || perClient {
            throw ValidationError("--clients, --window, --client-port-base and --per-client need --exchange")
        }
        if let sources {
            do {
                let addresses = try AddressRange.parse(sources)
                guard addresses.allSatisfy({ $0.family == destination.family }) else {
                    throw ValidationError("source and destination addresses must be of the same family")
                }
            } catch let error as AddressRange.ParseError {
                throw ValidationError(error.description)
            }
        }
    }

    func run() throws {
        shim_install_signal_flags()
        let destination = SocketAddress(ip: IPAddress(ip)!, port: port)
        let addresses = try sources.map { try AddressRange.parse($0) }
        if exchange {
            try Exchange(destination: destination, sources: addresses, clients: clients, exchanges: count, size: size, window: window,
                         replyTimeout: .milliseconds(replyTimeoutMs), duration: duration, clientPortBase: UInt16(clientPortBase),
                         perClient: perClient).run()
            return
        }
        var senders: [Int32] = []
        defer { for fd in senders { close(fd) } }
        for source in addresses?.map(Optional.some) ?? [nil] {
            let fd: Int32
            do {
                fd = try Syscall.socket(destination.ip.family, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue))
            } catch {
                throw failure("socket", error.errno)
            }
            senders.append(fd)
            try? Syscall.setsockopt(fd, SOL_SOCKET, SO_SNDBUF, Int32(4 << 20))
            if let source {
                do {
                    try Syscall.bind(fd, SocketAddress(ip: source, port: 0))
                } catch {
                    throw failure("bind \(source)", error.errno)
                }
            }
        }
        var exporter = netflow.map {
            NetFlowExporter(version: $0, exporters: senders.count, recordsPerPacket: records, templateEvery: templateEvery, nowMilliseconds: Self.milliseconds())
        }
        let traffic = quic == nil ? nil : try QUICTraffic.parse(quic, serverIDs)
        var quicIndex = 0
        var sender = BatchSender(destination: destination, batch: batch, size: exporter?.maximumSize ?? size, gso: gso)
        var bytesSent: UInt64 = 0
        let clock = ContinuousClock()
        let start = clock.now
        let deadline = duration > 0 ? start + .milliseconds(Int64(duration * 1000)) : nil
        var sentBySource = [UInt64](repeating: 0, count: senders.count)
        var sent: UInt64 = 0
        var errors: UInt64 = 0
        // A send error is retried (ENOBUFS, a full queue, pass), but not forever: after
        // `maximumFailures` failed sends in a row or 2 s without a successful one, the
        // publisher stops with the error.
        let maximumFailures = 1000
        var failuresInARow = 0
        var lastSuccess = start
        var lastError: Int32 = 0
        // Each source's share of count, the first (count % sources) sending one more.
        let quota = (0..<senders.count).map { UInt64(count / senders.count + ($0 < count % senders.count ? 1 : 0)) }
        var source = 0
        while sent < UInt64(count) && shim_stop_requested() == 0 {
            if sentBySource[source] >= quota[source] {
                source = (source + 1) % senders.count
                continue
            }
            if let deadline, clock.now >= deadline { break }
            if rate > 0 {
                let due = start + .nanoseconds(Int64(Double(sent) / rate * 1e9))
                let now = clock.now
                if due > now { sleep(for: due - now) }
            }
            let n = min(batch, Int(quota[source] - sentBySource[source]))
            let result: (sent: Int, failed: Int, errno: Int32, bytes: Int)
            if exporter != nil {
                let now = Self.milliseconds()
                result = sender.send(n, from: senders[source]) { pointer in exporter!.write(into: pointer, exporter: source, nowMilliseconds: now) }
            } else if let traffic {
                let size = self.size
                result = sender.send(n, from: senders[source]) { pointer in
                    defer { quicIndex += 1 }
                    return traffic.write(into: pointer, size: size, index: quicIndex)
                }
            } else {
                result = sender.send(n, from: senders[source], source: UInt32(source), firstSequence: sentBySource[source])
            }
            bytesSent += UInt64(result.bytes)
            sentBySource[source] += UInt64(result.sent)
            sent += UInt64(result.sent)
            errors += UInt64(result.failed)
            source = (source + 1) % senders.count
            if result.sent > 0 {
                failuresInARow = 0
                lastSuccess = clock.now
            }
            if result.failed > 0 {
                failuresInARow += 1
                lastError = result.errno
                if failuresInARow >= maximumFailures || clock.now - lastSuccess >= .seconds(2) {
                    printError("publisher: giving up after \(failuresInARow) failed sends in a row (\(sent) sent): \(SystemCallError(call: "sendmmsg to \(destination)", errno: lastError))")
                    throw ExitCode(1)
                }
                sleep(for: .microseconds(200))  // a failing send returns at once: do not spin
            }
        }
        let seconds = (clock.now - start).seconds
        var json = JSONObject()
        json.add("destination", destination.description)
        json.add("sent", sent)
        json.add("bytes", bytesSent)
        if let netflow {
            json.add("netflow", netflow.rawValue)
            json.add("records", sent * UInt64(records))
        }
        if let traffic { json.add("quic_server_ids", traffic.serverIDCount) }
        json.add("errors", errors)
        json.add("sources", senders.count)
        json.add("size", size)
        json.add("seconds", seconds)
        json.add("pps", seconds > 0 ? Double(sent) / seconds : 0)
        var perSource = JSONObject()
        for (index, value) in sentBySource.enumerated() {
            perSource.add(addresses.map { $0[index].description } ?? "default", value)
        }
        json.add("sent_by_source", perSource)
        print(json.text)
    }

    /// Milliseconds since the epoch.
    static func milliseconds() -> UInt64 {
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        return UInt64(now.tv_sec) * 1000 + UInt64(now.tv_nsec / 1_000_000)
    }

    /// Blocks the thread (nanosleep): the publisher is a plain loop, not a task.
    func sleep(for duration: Duration) {
        var request = timespec(tv_sec: Int(duration.components.seconds), tv_nsec: Int(duration.components.attoseconds / 1_000_000_000))
        var remaining = timespec()
        while nanosleep(&request, &remaining) != 0 && errno == EINTR && shim_stop_requested() == 0 {
            request = remaining
        }
    }

    func failure(_ call: String, _ error: Int32) -> Error {
        printError("publisher: \(SystemCallError(call: call, errno: error))")
        return ExitCode(2)
    }
}

/// sendmmsg batches to one destination, with buffers made once and reused.
struct BatchSender {
    let batch: Int
    let size: Int
    let buffers: UnsafeMutableRawBufferPointer
    let iovecs: UnsafeMutablePointer<iovec>
    let headers: UnsafeMutablePointer<shim_mmsghdr>
    let name: UnsafeMutablePointer<sockaddr_storage>
    let gso: Bool
    let control: UnsafeMutableRawPointer

    init(destination: SocketAddress, batch: Int, size: Int, gso: Bool) {
        self.gso = gso
        control = .allocate(byteCount: Int(shim_udp_segment_space()), alignment: 16)
        self.batch = batch
        self.size = size
        buffers = .allocate(byteCount: batch * size, alignment: 16)
        buffers.initializeMemory(as: UInt8.self, repeating: 0x2e)
        iovecs = .allocate(capacity: batch)
        headers = .allocate(capacity: batch)
        name = .allocate(capacity: 1)
        name.initialize(to: sockaddr_storage())
        let length = destination.write(to: &name.pointee)
        for index in 0..<batch {
            iovecs[index] = iovec(iov_base: buffers.baseAddress! + index * size, iov_len: size)
            headers[index] = shim_mmsghdr()
            headers[index].msg_hdr.msg_iov = iovecs + index
            headers[index].msg_hdr.msg_iovlen = 1
            headers[index].msg_hdr.msg_name = UnsafeMutableRawPointer(name)
            headers[index].msg_hdr.msg_namelen = length
        }
    }

    /// Sends `count` datagrams numbered from `firstSequence`; returns how many went out, how
    /// many failed (a failure ends the batch: the rest are not sent and are not counted as sent)
    /// and the failure's errno.
    mutating func send(_ count: Int, from fd: Int32, source: UInt32, firstSequence: UInt64) -> (sent: Int, failed: Int, errno: Int32, bytes: Int) {
        for index in 0..<count {
            Payload.write(into: buffers.baseAddress! + index * size, capacity: size, source: source, sequence: firstSequence + UInt64(index))
        }
        let result = sendBatch(count, from: fd)
        return (result.sent, result.failed, result.errno, result.sent * size)
    }

    /// Sends `count` datagrams that `fill` writes (each at most `size` bytes; it returns the length).
    mutating func send(_ count: Int, from fd: Int32, fill: (UnsafeMutableRawPointer) -> Int) -> (sent: Int, failed: Int, errno: Int32, bytes: Int) {
        var lengths: [Int] = []
        for index in 0..<count {
            let length = fill(buffers.baseAddress! + index * size)
            iovecs[index].iov_len = length
            lengths.append(length)
        }
        let result = sendBatch(count, from: fd)
        return (result.sent, result.failed, result.errno, lengths.prefix(result.sent).reduce(0, +))
    }

    private mutating func sendBatch(_ count: Int, from fd: Int32) -> (sent: Int, failed: Int, errno: Int32) {
        if gso && count > 1 {
            // One message: the batch's contiguous buffers, cut by the kernel into `size` datagrams.
            var vector = iovec(iov_base: buffers.baseAddress, iov_len: count * size)
            var header = msghdr()
            header.msg_name = UnsafeMutableRawPointer(name)
            header.msg_namelen = headers[0].msg_hdr.msg_namelen
            return withUnsafeMutablePointer(to: &vector) { vector in
                header.msg_iov = vector
                header.msg_iovlen = 1
                shim_set_udp_segment(&header, control, UInt16(size))
                do throws(SystemCallError) {
                    // A blocking socket: would-block is a failure like any other.
                    guard case .processed = try Syscall.sendmsg(fd, &header, 0) else { return (0, 1, EAGAIN) }
                    return (count, 0, 0)
                } catch {
                    return (0, 1, error.errno)
                }
            }
        }
        var done = 0
        while done < count {
            do {
                guard case .processed(let sent) = try Syscall.sendmmsg(fd, headers + done, count - done, 0) else { return (done, 1, EAGAIN) }
                done += sent
            } catch {
                return (done, 1, error.errno)
            }
        }
        return (done, 0, 0)
    }
}


/// `--quic`: short-header QUIC packets whose destination connection IDs name the given server
/// IDs in turn (QUIC-LB), 64 different IDs per server made up front, so encrypting costs the
/// sender nothing per datagram.
struct QUICTraffic {
    let ids: [[UInt8]]
    let serverIDCount: Int
    var packetLength: Int { 1 + (ids.first?.count ?? 0) }

    static func parse(_ layout: String?, _ serverIDs: String?) throws -> QUICTraffic {
        guard let layout, let serverIDs else { throw ValidationError("--quic and --server-ids go together") }
        let parts = layout.split(separator: ":", omittingEmptySubsequences: false).map(String.init)
        guard (2...4).contains(parts.count), let serverIDLength = Int(parts[0]), let nonceLength = Int(parts[1]) else {
            throw ValidationError("--quic: expected SERVER_ID_LENGTH:NONCE_LENGTH[:CONFIG_ID[:KEY]], e.g. 2:6 or 2:6:1:00112233445566778899aabbccddeeff")
        }
        let configID = parts.count > 2 ? UInt8(parts[2]) : 0
        guard let configID else { throw ValidationError("--quic: the config ID is 0...6") }
        var key: [UInt8]?
        if parts.count > 3 {
            guard let bytes = hexOctets(parts[3]), bytes.count == 16 else { throw ValidationError("--quic: the key is 32 hexadecimal digits") }
            key = bytes
        }
        let configuration: QUICLBConfiguration
        do {
            configuration = try QUICLBConfiguration(configID: configID, serverIDLength: serverIDLength, nonceLength: nonceLength, key: key)
        } catch {
            throw ValidationError("--quic: \(error)")
        }
        let codec = QUICLBCodec(configuration)
        var ids: [[UInt8]] = []
        let servers = serverIDs.split(separator: ",").map(String.init)
        guard !servers.isEmpty else { throw ValidationError("--server-ids: give at least one") }
        for round in 0..<64 {
            for text in servers {
                guard let serverID = hexOctets(text) else { throw ValidationError("--server-ids: '\(text)' is not hexadecimal digits, two per octet") }
                let nonce = (0..<nonceLength).map { UInt8(truncatingIfNeeded: round &* 31 &+ $0 &* 7) }
                do {
                    ids.append(try codec.encode(serverID: serverID, nonce: nonce))
                } catch {
                    throw ValidationError("--server-ids: \(error)")
                }
            }
        }
        return QUICTraffic(ids: ids, serverIDCount: servers.count)
    }

    static func hexOctets(_ text: String) -> [UInt8]? { QUICLBConfiguration.octets(hex: text) }

    /// Packet `index`: a short header (0x40), its connection ID, zeros to `size`.
    func write(into buffer: UnsafeMutableRawPointer, size: Int, index: Int) -> Int {
        let id = ids[index % ids.count]
        buffer.storeBytes(of: UInt8(0x40), as: UInt8.self)
        id.withUnsafeBytes { (buffer + 1).copyMemory(from: $0.baseAddress!, byteCount: id.count) }
        (buffer + 1 + id.count).initializeMemory(as: UInt8.self, repeating: 0, count: size - 1 - id.count)
        return size
    }
}
