// SPDX-License-Identifier: Apache-2.0
import ArgumentParser
import CSystemShim
import ReusePortLB
import TrafficModel

#if canImport(Glibc)
import Glibc
#endif
import SystemCalls

/// A sample collector: joins a ReusePortLB group and counts what it receives per source.
@main
struct Collector: ParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Receive UDP datagrams as one member of a steered SO_REUSEPORT group.",
        discussion: """
            Run several on one address and port with different indexes. On SIGINT, SIGTERM or at the \
            end of --duration it withdraws its slot (its sources fail over to the others), reads \
            what is queued, and exits (as after handing its slot over); then it prints one JSON line: \
            per-source counts of every datagram (the first --max-sources sources; the rest in \
            other_sources), totals, loss and reordering (from the publisher's sequence numbers; not \
            with roundRobin, which spreads each source), one-way latency percentiles (from its \
            send times), the steering in force and the group's kernel counters. A 'ready' line goes to stderr once it receives. \
            With --echo it is a server of two-way tests: every datagram goes back to its sender from \
            this socket with --tag appended (so a client can tell which server answered), except \
            udp-fanout's udp_echo health probes, which go back unchanged so the probe passes; \
            --initiate sends one datagram holding only the tag to each given client at start. \
            With --flows it decodes NetFlow v9 and IPFIX and counts records decoded and data sets \
            dropped for an unknown template; --shared-templates keeps templates in the group's \
            store, so sources taken over from another member decode at once.
            """,
        version: ProjectVersion.string)

    @Argument(help: "Address to bind (IPv4 or IPv6).") var ip: String
    @Argument(help: "UDP port.") var port: UInt16
    @Argument(help: "This collector's slot index, 0...count-1.") var index: Int
    @Argument(help: "The group's capacity (number of slots).") var count: Int

    @Option(help: "Balancing policy: sourceIP, roundRobin or fiveTuple (must be the group's if it exists).")
    var policy: String = "sourceIP"
    @Option(help: "Steering: automatic, ebpf, classicBPF or kernelHash.") var steering: String = "automatic"
    @Option(help: "Hash seed of the consistent table (every member must use the same).") var seed: UInt32?
    @Option(help: "Exit after this many seconds (0: run until SIGINT/SIGTERM).") var duration: Double = 0
    @Option(name: .customLong("stats-interval"), help: "Print a progress line to stderr every N seconds (0: never).")
    var statsInterval: Double = 0
    @Flag(help: "Take the slot over from the collector holding it (zero-loss handover); that one drains and exits.")
    var takeover = false
    @Flag(help: "Join even where this collector replaces the group's steering for every member (no eBPF in an eBPF group; sockets of another bpffs on the address).")
    var force = false
    @Option(help: "SO_RCVBUF in bytes (0: system default).") var rcvbuf: Int = 0
    @Option(help: "Datagrams per recvmmsg call.") var batch: Int = 64
    @Option(help: "Where bpffs is mounted (eBPF steering pins the group under <bpffs>/reuseportlb).")
    var bpffs: String = "/sys/fs/bpf"
    @Option(name: .customLong("max-sources"), help: "Source addresses counted one by one (the first seen); datagrams of any further source are summed in other_sources.")
    var maxSources: Int = 1000
    @Flag(help: "Send every datagram back to its sender from this socket with the tag appended (counted as echoed); udp-fanout's udp_echo health probes go back unchanged.")
    var echo = false
    @Option(help: "This server's name in echoed and initiated datagrams (default: <ip>:<port>/<index>).")
    var tag: String?
    @Option(help: "With --echo: once ready, send one datagram holding only the tag to each of these clients (A:P or [A]:P, comma separated): a server-initiated conversation.")
    var initiate: String?
    @Option(name: .customLong("echo-delay-ms"), help: "With --echo: answer each datagram this many milliseconds after it arrived (a slow server; health probes are answered at once).")
    var echoDelayMilliseconds: Int = 0
    @Flag(help: "Decode NetFlow v9 and IPFIX: count the data records decoded, and the data sets (and v9 records) dropped for a template this collector does not know (report: flows).")
    var flows = false
    @Flag(name: .customLong("shared-templates"), help: "With --flows: keep the templates in the group's shared store (eBPF steering), so exporters this collector takes over from another member decode at once.")
    var sharedTemplates = false

    /// Negative numbers reach validation (or one clear message) instead of ArgumentParser's
    /// option errors.
    static func main() {
        switch CommandLineNumbers.rewrite(
            Array(CommandLine.arguments.dropFirst()), positionals: ["ip", "port", "index", "count"],
            flags: ["--takeover", "--force", "--echo", "--flows", "--shared-templates", "--help"])
        {
        case .failure(let message): exit(withError: ValidationError(message.text))
        case .success(let arguments): main(arguments)
        }
    }

    func validate() throws {
        guard let policy = BalancePolicy(rawValue: policy) else {
            throw ValidationError("unknown policy '\(policy)': use \(BalancePolicy.allCases.map(\.rawValue).joined(separator: ", "))")
        }
        _ = policy
        guard SteeringPreference(rawValue: steering) != nil else {
            throw ValidationError("unknown steering '\(steering)': use \(SteeringPreference.allCases.map(\.rawValue).joined(separator: ", "))")
        }
        if let problem = IPAddress.problem(parsing: ip) { throw ValidationError(problem) }
        guard port != 0 else { throw ValidationError(ReusePortError.portZeroReason) }
        guard rcvbuf >= 0 else { throw ValidationError("--rcvbuf must not be negative (0: system default)") }
        guard duration >= 0 else { throw ValidationError("--duration must not be negative (0: run until SIGINT/SIGTERM)") }
        guard statsInterval >= 0 else { throw ValidationError("--stats-interval must not be negative (0: never)") }
        guard (1...1024).contains(batch) else { throw ValidationError("--batch must be 1...1024") }
        guard (0...1_000_000).contains(maxSources) else { throw ValidationError("--max-sources must be 0...1000000") }
        if let tag, tag.isEmpty || tag.utf8.count > 200 {
            throw ValidationError("--tag must be 1...200 bytes")
        }
        if initiate != nil && !echo {
            throw ValidationError("--initiate needs --echo (the client's later datagrams are answered by the echo)")
        }
        guard (0...60_000).contains(echoDelayMilliseconds) else { throw ValidationError("--echo-delay-ms must be 0...60000") }
        if echoDelayMilliseconds > 0 && !echo {
            throw ValidationError("--echo-delay-ms needs --echo (it delays the echoes)")
        }
        if sharedTemplates && !flows {
            throw ValidationError("--shared-templates needs --flows (the store serves the decoding)")
        }
        _ = try initiateAddresses()
    }

    /// The clients of --initiate, each of this collector's address family.
    func initiateAddresses() throws -> [SocketAddress] {
        guard let initiate else { return [] }
        let family = IPAddress(ip)?.family
        return try initiate.split(separator: ",").map { part in
            guard let address = SocketAddress(String(part)), address.port != 0 else {
                throw ValidationError("--initiate: '\(part)' is not A:P or [A]:P with a port 1...65535")
            }
            guard address.ip.family == family else {
                throw ValidationError("--initiate: '\(part)' is not of the family of \(ip): a socket sends to its own family only")
            }
            return address
        }
    }

    func run() throws {
        shim_install_signal_flags()
        let address = SocketAddress(ip: IPAddress(ip)!, port: port)
        let options = GroupOptions(
            policy: BalancePolicy(rawValue: policy)!, capacity: count, seed: seed,
            steering: SteeringPreference(rawValue: steering)!, bpffsRoot: bpffs,
            receiveBufferSize: rcvbuf > 0 ? rcvbuf : nil, force: force)
        let member: ReusePortMember
        do {
            member = try ReusePortMember(joining: address, slot: takeover ? .takeover(index) : .index(index), options: options)
        } catch {
            printError("collector: \(error)")
            throw ExitCode(2)
        }
        var store: FlowTemplateStore?
        if sharedTemplates {
            do {
                store = try FlowTemplateStore(member: member)
            } catch {
                printError("collector: --shared-templates: \(error)")
                member.leave()
                throw ExitCode(2)
            }
        }
        var line = "collector: ready address=\(address) slot=\(member.slot) steering=\(member.steering)"
        if let note = member.steeringNote { line += " note=\"\(note)\"" }
        printError(line)

        let echoTag = Array((tag ?? "\(address)/\(member.slot)").utf8)
        var run = Run(member: member, batch: batch, maxSources: maxSources, echoTag: echo ? echoTag : nil,
                      echoDelay: echoDelayMilliseconds > 0 ? .milliseconds(echoDelayMilliseconds) : nil,
                      flows: flows ? FlowDecoder(store: store) : nil)
        for client in try initiateAddresses() { run.initiate(to: client) }
        run.loop(duration: duration, statsInterval: statsInterval)
        // Echoes still waiting at the stop leave now rather than never.
        run.sendDelayedEchoes(upTo: .now + .seconds(86400))
        print(run.report())
        member.leave()
    }
}

/// The receive loop's state.
struct Run {
    let member: ReusePortMember
    let receiver: BatchReceiver
    var sources: SourceTable<SourceKey>
    var received: UInt64 = 0
    var bytes: UInt64 = 0
    var truncated: UInt64 = 0
    var foreign: UInt64 = 0
    var replaced = false
    /// The slot was taken out of selection at the stop.
    var withdrawn = false
    /// Set once the drain tried to seal the socket (the report says whether it is sealed).
    var sealed = false
    /// The steering serving the group as last seen (another member may have replaced ours).
    var steeringInForce: Steering
    var latency = LatencyHistogram()
    /// The longest pause between two receives that returned datagrams (a restart of what sends
    /// to us shows as one), and when the last one returned.
    var longestGap: Duration = .zero
    var lastArrival: ContinuousClock.Instant?
    let clock = ContinuousClock()
    let started: ContinuousClock.Instant
    /// --echo: the tag appended to every echoed datagram (nil: no echo).
    let echoTag: [UInt8]?
    /// Where an echo is assembled: the largest datagram plus the tag.
    let echoBuffer: UnsafeMutableRawBufferPointer
    var echoed: UInt64 = 0
    /// Of `echoed`, udp-fanout health probes sent back without the tag.
    var probes: UInt64 = 0
    /// Echoes the kernel refused (a full send buffer, no route): counted, not retried.
    var echoFailed: UInt64 = 0
    var initiated: UInt64 = 0
    /// --echo-delay-ms: how long an echo waits, and the echoes waiting, oldest first.
    let echoDelay: Duration?
    var delayed: [(due: ContinuousClock.Instant, bytes: [UInt8], destination: sockaddr_storage)] = []
    var delayedHead = 0
    /// --flows: the NetFlow v9 / IPFIX decoding (nil: off).
    var flows: FlowDecoder?
    /// Store failures already said (each kind once).
    var storeFailureSaid = false

    init(member: ReusePortMember, batch: Int, maxSources: Int, echoTag: [UInt8]?, echoDelay: Duration? = nil, flows: FlowDecoder? = nil) {
        self.member = member
        self.flows = flows
        self.echoTag = echoTag
        self.echoDelay = echoDelay
        echoBuffer = .allocate(byteCount: 65535 + (echoTag?.count ?? 0), alignment: 16)
        sources = SourceTable(limit: maxSources)
        receiver = BatchReceiver(batchSize: batch, maximumDatagramSize: 65535)
        started = clock.now
        steeringInForce = member.steeringInForce
    }

    /// Receives until stopped (signal or --duration) or replaced, then drains: a stop first
    /// withdraws the slot (its sources fail over to live members), then both read until the
    /// queue is empty and nothing new came for a quiet period, so a stop loses nothing.
    mutating func loop(duration: Double, statsInterval: Double) {
        let deadline = duration > 0 ? started + .milliseconds(Int64(duration * 1000)) : nil
        var nextStats = statsInterval > 0 ? started + .milliseconds(Int64(statsInterval * 1000)) : nil
        var nextReplacementCheck = started
        var lastDatagram = started
        // Set once no new datagram is expected: (since when, how long the queue must stay quiet).
        var draining: (since: ContinuousClock.Instant, quiet: Duration)?
        var pollDescriptor = pollfd(fd: member.socket, events: Int16(POLLIN), revents: 0)
        while true {
            let now = clock.now
            if draining == nil && (shim_stop_requested() != 0 || deadline.map { now >= $0 } == true) {
                draining = (now, .milliseconds(100))
                withdraw()
            }
            if let due = nextStats, now >= due {
                printError("collector slot \(member.slot): received \(received)\(flows.map { " records \($0.counters.records) unknown_template_sets \($0.counters.unknownTemplateSets)" } ?? "")")
                nextStats = due + .milliseconds(Int64(statsInterval * 1000))
            }
            if now >= nextReplacementCheck {
                nextReplacementCheck = now + .milliseconds(20)
                let inForce = member.steeringInForce
                if inForce != steeringInForce {
                    printError("collector slot \(member.slot): the group's steering changed from \(steeringInForce) to \(inForce) (a member was forced in)")
                    steeringInForce = inForce
                }
                if !replaced && draining == nil && member.isReplaced {
                    replaced = true
                    draining = (now, .milliseconds(200))
                    printError("collector slot \(member.slot): slot taken over, draining")
                }
            }
            if let (since, quiet) = draining {
                // Drained: nothing new for the quiet period and nothing queued (where SO_MEMINFO
                // cannot be read, the quiet period alone decides). Then sealed, and read once more
                // below: the close cannot lose a datagram the kernel still delivers.
                let queued = (try? member.socketStatistics().queuedBytes) ?? 0
                if now - lastDatagram >= quiet, now - since >= quiet, queued == 0 {
                    if sealed { break }
                    seal()
                } else if now - since >= .seconds(2) {
                    if sealed { break }
                    printError("collector slot \(member.slot): still receiving 2 s after the stop (no live member to fail over to, or steering without eBPF): sealing the socket; later datagrams go to the group's other members, or, with none left, the kernel refuses them (Udp NoPorts counts them)")
                    seal()
                }
            }
            sendDelayedEchoes(upTo: clock.now)
            var wait: Int32 = 20
            if delayedHead < delayed.count {
                let until = delayed[delayedHead].due - clock.now
                wait = min(wait, max(0, Int32(until.components.seconds * 1000 + until.components.attoseconds / 1_000_000_000_000_000)))
            }
            _ = try? Syscall.poll(&pollDescriptor, 1, wait)
            while true {
                let count: Int
                do {
                    count = try receiver.receive(from: member.socket)
                } catch {
                    printError("collector: \(error)")
                    return
                }
                if count == 0 { break }
                lastDatagram = clock.now
                if let last = lastArrival, lastDatagram - last > longestGap { longestGap = lastDatagram - last }
                lastArrival = lastDatagram
                for index in 0..<count { record(index) }
            }
        }
    }

    /// Seals the socket after the drain (``ReusePortMember/seal()``): the echoes still waiting go
    /// first (a sealed socket sends nothing); one more read follows.
    mutating func seal() {
        sendDelayedEchoes(upTo: .now + .seconds(86400))
        sealed = true
        do {
            try member.seal()
        } catch {
            printError("collector slot \(member.slot): could not seal the socket (\(error)): a datagram the kernel delivers to it as it closes is lost")
        }
    }

    /// Takes the slot out of selection before the drain, saying so (or why it cannot).
    mutating func withdraw() {
        do {
            withdrawn = try member.withdraw()
            if withdrawn {
                printError("collector slot \(member.slot): stopping: slot withdrawn, draining")
            } else {
                printError("collector slot \(member.slot): stopping: \(member.steering) steering cannot withdraw a slot; sealing the socket now, so its share goes to the other members, then draining")
            }
        } catch {
            printError("collector slot \(member.slot): stopping: withdraw failed (\(error)); sealing the socket now, so its share goes to the other members, then draining")
        }
        // Without a withdrawn slot the kernel keeps delivering here until the seal: seal now
        // (with --echo, after the drain: a sealed socket sends no echo).
        if !withdrawn && echoTag == nil { seal() }
    }

    /// Sends one datagram holding only the tag to `client` (--initiate); a failure is said and
    /// not counted.
    mutating func initiate(to client: SocketAddress) {
        guard let echoTag else { return }
        let sent = echoTag.withUnsafeBytes { bytes in
            Result { () throws(SystemCallError) in try Syscall.sendto(member.socket, bytes.baseAddress, bytes.count, 0, client) }
        }
        switch sent {
        case .success(.processed(echoTag.count)):
            initiated += 1
            printError("collector slot \(member.slot): initiated to \(client)")
        case .success:
            printError("collector slot \(member.slot): initiate to \(client) failed: \(SystemCallError(call: "sendto", errno: EAGAIN))")
        case .failure(let error):
            printError("collector slot \(member.slot): initiate to \(client) failed: \(error)")
        }
    }

    /// --echo: the datagram back to its sender with the tag appended; a udp-fanout health probe
    /// back unchanged, since the prober counts any other answer as a mismatch.
    mutating func echo(_ index: Int) {
        guard let echoTag else { return }
        let payload = receiver.payload(index)
        let base = echoBuffer.baseAddress!
        if payload.count > 0 { base.copyMemory(from: payload.baseAddress!, byteCount: payload.count) }
        let probe = HealthProbe.matches(payload)
        if !probe { echoTag.withUnsafeBytes { (base + payload.count).copyMemory(from: $0.baseAddress!, byteCount: $0.count) } }
        let length = payload.count + (probe ? 0 : echoTag.count)
        let storage = receiver.sourceStorage(index)
        if let echoDelay, !probe {
            delayed.append((clock.now + echoDelay, Array(UnsafeRawBufferPointer(start: base, count: length)), storage.pointee))
            return
        }
        sendEcho(UnsafeRawBufferPointer(start: base, count: length), to: storage, probe: probe)
    }

    /// --echo-delay-ms: sends the echoes due by `now` (every one, at the stop).
    mutating func sendDelayedEchoes(upTo now: ContinuousClock.Instant) {
        while delayedHead < delayed.count, delayed[delayedHead].due <= now {
            let (_, bytes, destination) = delayed[delayedHead]
            delayedHead += 1
            withUnsafePointer(to: destination) { address in bytes.withUnsafeBytes { sendEcho($0, to: address, probe: false) } }
        }
        if delayedHead == delayed.count {
            delayed.removeAll(keepingCapacity: true)
            delayedHead = 0
        }
    }

    mutating func sendEcho(_ bytes: UnsafeRawBufferPointer, to storage: UnsafePointer<sockaddr_storage>, probe: Bool) {
        let length = bytes.count
        let nameLength = socklen_t(Int32(storage.pointee.ss_family) == AF_INET6 ? MemoryLayout<sockaddr_in6>.size : MemoryLayout<sockaddr_in>.size)
        let sent = storage.withMemoryRebound(to: sockaddr.self, capacity: 1) { name in
            Result { () throws(SystemCallError) in try Syscall.sendto(member.socket, bytes.baseAddress, length, Int32(MSG_DONTWAIT), name, nameLength) }
        }
        if case .success(.processed(length)) = sent {
            echoed += 1
            if probe { probes += 1 }
        } else {
            if echoFailed == 0 {
                let error = if case .failure(let error) = sent { error } else { SystemCallError(call: "sendto", errno: EAGAIN) }
                printError("collector slot \(member.slot): echo failed: \(error) (counted as echo_failed; later failures are not logged)")
            }
            echoFailed += 1
        }
    }

    mutating func record(_ index: Int) {
        echo(index)
        let payload = receiver.payload(index)
        received += 1
        bytes += UInt64(payload.count)
        if receiver.isTruncated(index) { truncated += 1 }
        let source = SourceKey(receiver.sourceStorage(index))
        if flows != nil {
            flows!.decode(payload, from: source.address, now: Payload.monotonicNanoseconds())
            if !storeFailureSaid, let store = flows!.store, let failure = store.lastFailure {
                storeFailureSaid = true
                printError("collector slot \(member.slot): template store: \(failure) (counted as store.failed; later failures are not logged)")
            }
        }
        guard let header = Payload.read(payload) else {
            foreign += 1
            sources.record(source, sequence: nil)
            return
        }
        sources.record(source, sequence: header.sequence)
        if let sentAt = header.sentAt {
            let now = Payload.monotonicNanoseconds()
            latency.record(nanoseconds: now > sentAt ? now - sentAt : 0)
        }
    }

    func report() -> String {
        var json = JSONObject()
        json.add("address", member.address.description)
        json.add("slot", member.slot)
        json.add("policy", member.options.policy.rawValue)
        json.add("steering", steeringInForce.rawValue)
        json.add("steering_note", member.steeringNote)
        json.add("replaced", replaced)
        json.add("withdrawn", withdrawn)
        json.add("sealed", member.isSealed)
        json.add("received", received)
        json.add("bytes", bytes)
        json.add("truncated", truncated)
        json.add("foreign", foreign)
        if echoTag != nil {
            json.add("tag", String(decoding: echoTag!, as: UTF8.self))
            json.add("echoed", echoed)
            json.add("probes_echoed", probes)
            json.add("echo_failed", echoFailed)
            json.add("initiated", initiated)
        }
        // Loss and reordering from sequence numbers mean something only where every datagram
        // of a source reaches one collector: not with roundRobin, which spreads each source.
        let sequenceChecks = member.options.policy != .roundRobin
        let mixed = sources.tallies.values.contains { $0.isMixed }
        if sequenceChecks && !mixed {
            json.add("lost", sources.tallies.values.reduce(0) { $0 + $1.lost })
            json.add("reordered", sources.tallies.values.reduce(0) { $0 + $1.reordered })
        } else if sequenceChecks {
            // Saying 0 here would hide loss: say why there is no figure instead.
            json.add("sequence_note", "several senders' sequence numbers share a source address (a proxy such as udp-fanout in between, or publishers run one after another): loss and reordering unknown; compare the publishers' sent with received")
        }
        json.add("socket_drops", (try? member.socketStatistics().drops).map(UInt64.init) ?? UInt64(receiver.socketDrops))
        json.add("seconds", (clock.now - started).seconds)
        json.add("longest_gap_ms", Double(Int((longestGap.seconds * 10_000).rounded())) / 10)
        var perSource = JSONObject()
        for (key, tally) in sources.tallies.sorted(by: { $0.key < $1.key }) {
            var entry = JSONObject()
            entry.add("packets", tally.packets)
            if sequenceChecks && tally.isMixed {
                entry.add("mixed", true)
            } else if sequenceChecks && tally.sequenced > 0 {
                entry.add("lost", tally.lost)
                entry.add("reordered", tally.reordered)
            }
            perSource.add(key.description, entry)
        }
        json.add("sources", perSource)
        var other = JSONObject()
        other.add("packets", sources.otherPackets)
        other.add("limit", sources.limit)
        json.add("other_sources", other)
        if latency.samples > 0 {
            var summary = JSONObject()
            summary.add("samples", latency.samples)
            summary.add("p50", latency.percentile(0.50)!)
            summary.add("p99", latency.percentile(0.99)!)
            json.add("latency_us", summary)
        }
        if let flows {
            let counters = flows.counters
            var decoded = JSONObject()
            decoded.add("packets", counters.packets)
            decoded.add("other_packets", counters.otherPackets)
            decoded.add("records", counters.records)
            decoded.add("template_records", counters.templateRecords)
            decoded.add("unknown_template_sets", counters.unknownTemplateSets)
            decoded.add("unknown_template_records_v9", counters.unknownTemplateRecords)
            decoded.add("templates_from_store", counters.templatesFromStore)
            decoded.add("malformed", counters.malformed)
            if let store = flows.store {
                let stored = store.counters
                var shared = JSONObject()
                shared.add("path", store.path)
                shared.add("written", stored.written)
                shared.add("withdrawn", stored.withdrawn)
                shared.add("refused_too_large", stored.refusedTooLarge)
                shared.add("refused_full", stored.refusedFull)
                shared.add("failed", stored.failed)
                shared.add("malformed", stored.malformed)
                shared.add("found", stored.found)
                shared.add("missing", stored.missing)
                decoded.add("store", shared)
            }
            json.add("flows", decoded)
        }
        if let counters = try? member.counters() {
            var kernel = JSONObject()
            for (name, value) in counters.outcomes { kernel.add(name, value) }
            var delivered = JSONObject()
            for (slot, value) in counters.deliveredBySlot.enumerated() { delivered.add(String(slot), value) }
            kernel.add("delivered_by_slot", delivered)
            json.add("kernel", kernel)
        }
        return json.text
    }
}

/// A source address as a dictionary key with no allocation per datagram.
struct SourceKey: Hashable, Comparable, CustomStringConvertible {
    let high: UInt64
    let low: UInt64
    let isV6: Bool

    init(_ storage: UnsafePointer<sockaddr_storage>) {
        let raw = UnsafeRawPointer(storage)
        if Int32(storage.pointee.ss_family) == AF_INET6 {
            let offset = MemoryLayout<sockaddr_in6>.offset(of: \.sin6_addr)!
            high = raw.loadUnaligned(fromByteOffset: offset, as: UInt64.self)
            low = raw.loadUnaligned(fromByteOffset: offset + 8, as: UInt64.self)
            isV6 = true
        } else {
            let offset = MemoryLayout<sockaddr_in>.offset(of: \.sin_addr)!
            high = 0
            low = UInt64(raw.loadUnaligned(fromByteOffset: offset, as: UInt32.self))
            isV6 = false
        }
    }

    var address: IPAddress {
        if isV6 {
            var bytes = [UInt8](repeating: 0, count: 16)
            withUnsafeBytes(of: high) { bytes.replaceSubrange(0..<8, with: $0) }
            withUnsafeBytes(of: low) { bytes.replaceSubrange(8..<16, with: $0) }
            return IPAddress(bytes: bytes)!
        }
        return .v4(UInt32(truncatingIfNeeded: low))
    }

    var description: String { address.description }

    static func < (lhs: SourceKey, rhs: SourceKey) -> Bool {
        if lhs.isV6 != rhs.isV6 { return !lhs.isV6 }
        return lhs.address.bytes.lexicographicallyPrecedes(rhs.address.bytes)
    }
}

