// SPDX-License-Identifier: Apache-2.0
import BPFSupport
import Foundation
import Testing
import TestSupport
import ReusePortLB
@testable import FanoutCore
import CSystemShim

#if canImport(Glibc)
import Glibc
#endif
import SystemCalls

/// The exact capability sets of udp-fanout's modes (docs/udp-fanout.md, "Capabilities"), run as
/// uid nobody with setpriv: what each mode needs, and what it says without it.
@Suite("udp-fanout capabilities", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct CapabilityTests {
    @Test("userspace: CAP_BPF alone gives eBPF worker steering (no bpffs needed); no capability falls back to the kernel hash and says so; both forward")
    func userspace() throws {
        for (capabilities, steering) in [(["bpf"], "steering=ebpf"), ([], "steering=kernelHash")] {
            let sink = try Sink()
            let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
            let scratch = try Unprivileged.Scratch("listeners:\n" + listenerYAML("caps", bind: bind, [sink], workers: 2).replacingOccurrences(of: "      recv_buf_size: 8388608\n", with: ""))
            let daemon = try Child(scratch.binary, ["-c", scratch.config], prefix: Unprivileged.asNobody(capabilities))
            try daemon.waitFor("entering receive loop")
            #expect(daemon.stderr.contains(steering), "\(capabilities): \(daemon.stderr)")
            if capabilities.isEmpty { #expect(daemon.stderr.contains("worker steering fallback"), "the fallback is logged") }
            try sendNumbered(to: bind, count: 100)
            #expect(sink.drain().count == 100, "\(capabilities): forwards")
            daemon.signal(SIGTERM)
            #expect(daemon.wait() == 0)
        }
    }

    /// The workers of the instance running now: the last "starting userspace forwarder" line's.
    func workersNow(_ log: String) -> Int? {
        guard let line = log.split(separator: "\n").last(where: { $0.contains("starting userspace forwarder") }),
              let range = line.range(of: "workers=") else { return nil }
        return Int(line[range.upperBound...].prefix { $0.isNumber })
    }

    @Test("userspace without CAP_BPF (the kernel's hash): settings reloads under 50k pps lose nothing; the old workers seal their sockets as they stop, so the hash gives their share to the new ones (sent = received + receive_queue_drops)")
    func reloadWithoutEBPF() throws {
        let sink = try Sink()
        let receiver = ConcurrentSink(sink)
        let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        let metrics = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
        func config(workers: Int) -> String {
            "listeners:\n" + listenerYAML("nobpf", bind: bind, [sink], workers: workers).replacingOccurrences(of: "      recv_buf_size: 8388608\n", with: "")
                + "metrics: {enabled: true, bind: \"\(metrics)\"}\n"
        }
        let scratch = try Unprivileged.Scratch(config(workers: 2))
        let daemon = try Child(scratch.binary, ["-c", scratch.config, "-l", "debug"], prefix: Unprivileged.asNobody([]))
        defer { daemon.stopIfRunning() }
        try daemon.waitFor("entering receive loop")
        #expect(daemon.stderr.contains("steering=kernelHash"), "\(daemon.stderr)")
        let total = 150_000
        let publisher = try Child("publisher", ["127.0.0.1", String(bind.port), String(total), "--rate", "50000", "--sources", "127.0.7.1-127.0.7.50"])
        var hangups = 0
        while publisher.process.isRunning {
            usleep(150_000)
            hangups += 1
            try config(workers: hangups % 2 == 1 ? 3 : 2).write(toFile: scratch.config, atomically: true, encoding: .utf8)
            chmod(scratch.config, 0o644)
            daemon.signal(SIGHUP)
        }
        #expect(publisher.wait() == 0)
        let sent = try publisher.json().int("sent")
        let (_, received, drops) = try countsAfterReloads(daemon, metrics: metrics, labels: "listener=\"nobpf\",mode=\"userspace\"", sent: sent)
        let applied = daemon.stderr.components(separatedBy: "reload=true").count - 1
        #expect(applied >= 5, "settings reloads applied: \(applied) of \(hangups)")
        #expect(daemon.stderr.contains("without eBPF worker steering the old workers on this bind keep a share of its datagrams until they stop"), "each such reload says so")
        #expect(sent == total)
        #expect(received + drops == sent, "sent \(sent): received \(received) + receive_queue_drops \(drops) across \(applied) reloads (lost uncounted: \(sent - received - drops))")
        // Every worker that a reload replaced sealed its socket first: all that started, but
        // those running now.
        let started = daemon.stderr.components(separatedBy: "entering receive loop").count - 1
        let running = try #require(workersNow(daemon.stderr), "the running instance's workers in its start line")
        let sealedFirst = daemon.stderr.components(separatedBy: "before its stop drain (another instance receives on the bind)").count - 1
        #expect(sealedFirst == started - running, "\(sealedFirst) sealed before their drain; \(started) workers started, \(running) running")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        print("reload without eBPF: \(sent) sent at 50k/s, \(applied) reloads, received \(received), receive_queue_drops \(drops), delivered \(receiver.finish().count)")
    }

    /// Before the session sockets were sealed and read before they close, an operator lost 21
    /// and 41 replies uncounted in 14 such reloads at 20k requests/s.
    @Test("relay without CAP_BPF (the kernel's hash): settings reloads under exchanges, echo servers answering 5 ms late: every reply is relayed or counted, none lost in the close of the old workers' session sockets (requests + replies echoed = requests delivered + drops + replies relayed + reply drops + kernel NoPorts, receive-buffer errors and path drops)")
    func relayReloadWithoutEBPF() throws {
        let topology = try Topology(backends: 2)
        let port = 5514, backendPort = 6000, metricsPort = 9464
        let servers = try topology.backends.enumerated().map { index, namespace in
            let child = try Child("collector", [Topology.backendIPv4(index + 1), "\(backendPort)", "0", "1", "--echo", "--echo-delay-ms", "5"], prefix: topology.prefix(namespace))
            try child.waitFor("ready")
            return child
        }
        defer { for server in servers { server.stopIfRunning() } }
        func config(workers: Int) -> String {
            """
            listeners:
              - name: r
                bind: "198.18.0.1:\(port)"
                replies: relay
                settings: {workers: \(workers), io_uring: true}
                downstream:
                  - {name: b1, address: "\(Topology.backendIPv4(1)):\(backendPort)"}
                  - {name: b2, address: "\(Topology.backendIPv4(2)):\(backendPort)"}
            metrics: {enabled: true, bind: "127.0.0.1:\(metricsPort)"}

            """
        }
        let scratch = try Unprivileged.Scratch(config(workers: 2))
        let daemon = try Child(scratch.binary, ["-c", scratch.config, "-l", "debug"], prefix: topology.prefix(topology.proxy) + Unprivileged.asNobody([]))
        defer { daemon.stopIfRunning() }
        try daemon.waitFor("entering receive loop")
        #expect(daemon.stderr.contains("steering=kernelHash"), "\(daemon.stderr)")
        let kernelBefore = try topology.udpCounters(topology.proxy)
        let pathBefore = try topology.clientSendDrops() + topology.backendSendDrops()
        let clients = try Child("publisher", ["198.18.0.1", "\(port)", "1000000", "--exchange", "--clients", "64", "--window", "4",
                                              "--reply-timeout-ms", "200", "--duration", "6"], prefix: topology.prefix(topology.client))
        var hangups = 0
        while clients.process.isRunning && hangups < 30 {
            usleep(200_000)
            hangups += 1
            try config(workers: hangups % 2 == 1 ? 3 : 2).write(toFile: scratch.config, atomically: true, encoding: .utf8)
            chmod(scratch.config, 0o644)
            daemon.signal(SIGHUP)
        }
        #expect(clients.wait(seconds: 20) == 0, "\(clients.stderr)")
        let requests = try clients.json().int("requests")
        // Settled: every reload answered, and the counts stay as they are.
        func scrape() throws -> String { try topology.exec(topology.proxy, ["curl", "-s", "http://127.0.0.1:\(metricsPort)/metrics"]) }
        func sum(_ text: String, _ name: String) -> Int {
            text.split(separator: "\n").filter { $0.hasPrefix("\(name){listener=\"r\"") }.compactMap { $0.split(separator: " ").last.flatMap { Int($0) } }.reduce(0, +)
        }
        var text = ""
        for _ in 0..<50 {
            usleep(200_000)
            let next = try scrape()
            if reloadsAnswered(daemon.stderr) && next == text { break }
            text = next
        }
        let applied = daemon.stderr.components(separatedBy: "reload=true").count - 1
        let stopped = try servers.map { try $0.stop() }
        let delivered = stopped.reduce(0) { $0 + $1.int("received") }
        let echoed = stopped.reduce(0) { $0 + $1.int("echoed") }
        let kernelAfter = try topology.udpCounters(topology.proxy)
        let noPorts = (kernelAfter["NoPorts"] ?? 0) - (kernelBefore["NoPorts"] ?? 0)
        let receiveBufferErrors = (kernelAfter["RcvbufErrors"] ?? 0) - (kernelBefore["RcvbufErrors"] ?? 0)
        let pathDrops = try topology.clientSendDrops() + topology.backendSendDrops() - pathBefore
        let drops = sum(text, "udp_fanout_packets_dropped_total") + sum(text, "udp_fanout_packets_no_healthy_total")
        let relayed = sum(text, "udp_fanout_replies_total")
        let replyDrops = sum(text, "udp_fanout_replies_dropped_total")
        let summary = "requests \(requests) + echoed \(echoed) = delivered \(delivered) + drops \(drops) + relayed \(relayed) + reply drops \(replyDrops) + kernel NoPorts \(noPorts) + RcvbufErrors \(receiveBufferErrors) + path drops \(pathDrops), \(applied) reloads"
        #expect(applied >= 5, "settings reloads applied: \(applied) of \(hangups)")
        #expect(relayed > 10_000, "\(summary)")
        #expect(requests + echoed == delivered + drops + relayed + replyDrops + noPorts + receiveBufferErrors + pathDrops, "\(summary)")
        let sealed = daemon.stderr.components(separatedBy: "session sockets sealed before their last read").count - 1
        #expect(sealed >= applied, "the replaced workers sealed their session sockets: \(sealed) in \(applied) reloads")
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        print("relay reload without eBPF: \(summary)")
    }

    @Test("tc_ebpf: CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON suffice (with a writable /run/udp-fanout); without CAP_PERFMON one error names it")
    func tcEBPF() throws {
        let topology = try Topology(backends: 1)
        let collector = try TCFixtures.collectors(topology)[0]
        let scratch = try Unprivileged.Scratch(TCFixtures.config(topology, backends: [1]))
        // What a systemd unit's RuntimeDirectory=udp-fanout gives the service user.
        let runDirectory = "/run/udp-fanout"
        mkdir(runDirectory, 0o755)
        var before = stat()
        stat(runDirectory, &before)
        chown(runDirectory, 65534, 65534)
        defer { chown(runDirectory, before.st_uid, before.st_gid) }
        let refused = try Child(scratch.binary, ["-c", scratch.config], prefix: topology.prefix(topology.proxy) + Unprivileged.asNobody(["bpf", "net_admin"]))
        #expect(refused.wait(seconds: 10) == 1)
        #expect(refused.stderr.contains("tc_ebpf needs CAP_PERFMON"), "\(refused.stderr)")
        let daemon = try Child(scratch.binary, ["-c", scratch.config], prefix: topology.prefix(topology.proxy) + Unprivileged.asNobody(["bpf", "net_admin", "perfmon"]))
        try daemon.waitFor("registered listener in eBPF map")
        let publisher = try Child("publisher", ["198.18.0.1", "5514", "500", "--rate", "10000"], prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0)
        usleep(300_000)
        daemon.signal(SIGTERM)
        #expect(daemon.wait() == 0)
        let report = try collector.stop()
        #expect(report.int("received") == 500, "\(report)")
        #expect(Array(report.object("sources").keys) == ["198.18.0.2"], "the client's source address")
    }
}

/// What the daemon says when the kernel or the runtime grants less than asked.
@Suite("Shortfalls named with their fix")
struct ShortfallTests {
    @Test("recv_buf_size above net.core.rmem_max: the socket's real buffer is reported (the kernel caps SO_RCVBUF silently); within it: nothing")
    func receiveBufferCapped() throws {
        let fd = socket(AF_INET, Int32(SOCK_DGRAM.rawValue), 0)
        try #require(fd >= 0)
        defer { close(fd) }
        let rmemMax = try #require(SocketGroupListener.rmemMax)
        let huge = rmemMax * 4
        var value = Int32(clamping: huge)
        #expect(setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &value, socklen_t(MemoryLayout<Int32>.size)) == 0)
        #expect(SocketGroupListener.receiveBufferShortfall(socket: fd, requested: huge) == rmemMax, "capped at rmem_max \(rmemMax)")
        var small = Int32(4096)
        #expect(setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, socklen_t(MemoryLayout<Int32>.size)) == 0)
        #expect(SocketGroupListener.receiveBufferShortfall(socket: fd, requested: 4096) == nil)
        #expect(SocketGroupListener.receiveBufferShortfall(socket: fd, requested: 0) == nil, "0 asks for the default")
    }

    @Test("tc_ebpf errors name the fix: EPERM at load with the capabilities held names seccomp; an unwritable lock directory names RuntimeDirectory= and the hostPath; all three capabilities missing are listed once")
    func tcMessages() {
        let seccomp = TCError.load(SystemCallError(call: "bpf_object__load fanout_tc", errno: EPERM)).description
        #expect(seccomp.contains("seccomp") && seccomp.contains("Unconfined"), "\(seccomp)")
        let other = TCError.load(SystemCallError(call: "bpf_object__load fanout_tc", errno: EINVAL)).description
        #expect(!other.contains("seccomp"), "\(other)")
        let lock = TCError.lockFile(path: "/run/udp-fanout/tc-net1-eth0.lock", SystemCallError(call: "open", errno: EACCES)).description
        #expect(lock.contains("RuntimeDirectory=udp-fanout") && lock.contains("hostPath"), "\(lock)")
        let all = TCError.privileges(missing: ["CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON"]).description
        #expect(all.hasPrefix("tc_ebpf needs CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON: run as root") && all.contains("capabilities.add"), "\(all)")
        let one = TCError.privileges(missing: ["CAP_PERFMON"]).description
        #expect(one.hasPrefix("tc_ebpf needs CAP_PERFMON (it needs CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON)"), "\(one)")
        // settings.flow_templates adds CAP_NET_RAW, and every fix named grants it (operator trial, issue 41).
        let raw = TCError.privileges(missing: ["CAP_NET_RAW (settings.flow_templates)"]).description
        #expect(raw.hasPrefix("tc_ebpf needs CAP_NET_RAW (settings.flow_templates) (it needs CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON and CAP_NET_RAW)"), "\(raw)")
        #expect(raw.contains("AmbientCapabilities=CAP_BPF CAP_NET_ADMIN CAP_PERFMON CAP_NET_RAW") && raw.contains("[BPF, NET_ADMIN, PERFMON, NET_RAW]")
                && raw.contains("setcap cap_bpf,cap_net_admin,cap_perfmon,cap_net_raw+ep"), "\(raw)")
        // A flow_templates listener that has CAP_NET_RAW but lacks another: the fixes keep CAP_NET_RAW.
        let keeps = TCError.privileges(missing: ["CAP_BPF"], flowTemplates: true).description
        #expect(keeps.contains("AmbientCapabilities=CAP_BPF CAP_NET_ADMIN CAP_PERFMON CAP_NET_RAW") && keeps.contains("cap_net_raw+ep"), "\(keeps)")
    }
}
