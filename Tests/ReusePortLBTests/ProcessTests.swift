// SPDX-License-Identifier: Apache-2.0
import Foundation
import Testing
import TestSupport
@testable import ReusePortLB

#if canImport(Glibc)
import Glibc
#endif

/// Collectors and publishers as separate processes: kills, handover under load, the
/// unprivileged fallback, IPv6 inside a network namespace, and the C API.
@Suite("Collector processes", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct ProcessTests {
    func collectors(_ port: UInt16, count: Int, ip: String = "127.0.0.1", extra: [String] = [], prefix: [String] = []) throws -> [Child] {
        try (0..<count).map { index in
            let child = try Child("collector", [ip, String(port), String(index), String(count)] + extra, prefix: prefix)
            try child.waitFor("ready")
            return child
        }
    }

    /// Publishes at a paced rate by default, so a busy CI machine does not overflow a receive
    /// queue (reported as socket_drops, which the tests require to be 0).
    func publish(_ port: UInt16, count: Int, sources: String, ip: String = "127.0.0.1", extra: [String] = ["--rate", "50000"], prefix: [String] = []) throws -> [String: Any] {
        let publisher = try Child("publisher", [ip, String(port), String(count), "--sources", sources] + extra, prefix: prefix)
        #expect(publisher.wait(seconds: 30) == 0, "publisher: \(publisher.stderr)")
        return try publisher.json()
    }

    /// Checks each source reached exactly one collector; returns source → collector slot.
    func owners(_ reports: [[String: Any]]) -> [String: Int] {
        var owner: [String: Int] = [:]
        for report in reports {
            for source in report.object("sources").keys {
                if let other = owner[source] { Issue.record("\(source) reached slots \(other) and \(report.int("slot"))") }
                owner[source] = report.int("slot")
            }
        }
        return owner
    }

    @Test("kill -9 of a collector: its sources fail over (nothing lost); a restarted one gets them back")
    func killAndRestore() throws {
        let port = freePort()
        let options = ["--rcvbuf", "4194304"]
        let children = try collectors(port, count: 3, extra: options)
        let sources = "127.0.1.10-127.0.1.69"  // 60 sources, 10 datagrams each per round
        for round in 1...3 {
            if round == 2 {
                children[1].signal(SIGKILL)
                children[1].wait()
            }
            var replacement: Child?
            if round == 3 {
                replacement = try Child("collector", ["127.0.0.1", String(port), "1", "3"] + options)
                try replacement!.waitFor("ready")
            }
            #expect(try publish(port, count: 600, sources: sources).int("sent") == 600)
            usleep(200_000)
            guard let replacement else { continue }
            let survivors = try [children[0].stop(), children[2].stop()]
            let restored = try replacement.stop()
            // Survivors: their own sources 3 rounds (30), slot 1's sources only round 2 (10).
            var failedOver = Set<String>()
            for report in survivors {
                for (source, entry) in report.object("sources") {
                    let packets = (entry as? [String: Any])?.int("packets") ?? -1
                    #expect(packets == 30 || packets == 10, "\(source): \(packets)")
                    if packets == 10 { failedOver.insert(source) }
                }
            }
            #expect(owners(survivors).count == 60, "while slot 1 was dead every source was on exactly one survivor")
            #expect(!failedOver.isEmpty)
            #expect(Set(restored.object("sources").keys) == failedOver, "slot 1's sources came back to it")
            #expect(restored.int("received") == 10 * failedOver.count)
            let kernel = restored.object("kernel")
            #expect(kernel.int("failed_over") == 10 * failedOver.count)
            #expect(kernel.int("fallback") == 0)
            #expect((survivors + [restored]).allSatisfy { $0.int("socket_drops") == 0 })
            // Three publisher runs from the same sources restart the sequences: the survivors say
            // so instead of a meaningless "lost 0"; the restored one saw one run.
            #expect(survivors.allSatisfy { $0["lost"] == nil && $0["sequence_note"] != nil }, "\(survivors)")
            #expect(restored.int("lost") == 0)
        }
    }

    @Test("Handover under load: a new collector takes slot 1 over, the old one drains and exits, nothing lost")
    func handoverUnderLoad() throws {
        let port = freePort()
        let options = ["--rcvbuf", "8388608"]
        let children = try collectors(port, count: 3, extra: options)
        let publisher = try Child("publisher", ["127.0.0.1", String(port), "60000", "--sources", "127.0.2.10-127.0.2.69", "--rate", "20000"])
        usleep(1_000_000)
        let successor = try Child("collector", ["127.0.0.1", String(port), "1", "3", "--takeover"] + options)
        try successor.waitFor("ready")
        #expect(children[1].wait(seconds: 10) == 0, "the old collector exits by itself once drained")
        let old = try children[1].json()
        #expect(old["replaced"] as? Bool == true && old["sealed"] as? Bool == true, "taken over, drained, then sealed before its close")
        #expect(publisher.wait(seconds: 30) == 0)
        let sent = try publisher.json().int("sent")
        #expect(sent == 60000)
        usleep(300_000)
        let reports = try [children[0].stop(), children[2].stop(), successor.stop(), old]
        #expect(reports.map { $0.int("received") }.reduce(0, +) == sent, "zero loss: \(reports.map { $0.int("received") })")
        #expect(reports.allSatisfy { $0.int("lost") == 0 && $0.int("socket_drops") == 0 })
        #expect(old.int("received") > 0 && reports[2].int("received") > 0, "both sides of the handover received")
        #expect(Set(old.object("sources").keys) == Set(reports[2].object("sources").keys), "the successor got exactly slot 1's sources")
    }

    @Test("SIGTERM of a collector under 30k pps: its slot is withdrawn, its queue drained, nothing lost")
    func losslessStop() throws {
        let port = freePort()
        let options = ["--rcvbuf", "8388608"]
        let children = try collectors(port, count: 3, extra: options)
        let publisher = try Child("publisher", ["127.0.0.1", String(port), "60000", "--sources", "127.0.3.10-127.0.3.69", "--rate", "30000"])
        usleep(700_000)
        let stopped = try children[1].stop()  // mid-stream: the publisher runs for 2 s
        #expect(publisher.wait(seconds: 30) == 0)
        let sent = try publisher.json().int("sent")
        #expect(sent == 60000)
        usleep(300_000)
        let reports = try [children[0].stop(), children[2].stop(), stopped]
        #expect(stopped.int("received") > 0, "the stopped collector had received its share before")
        #expect(stopped["withdrawn"] as? Bool == true && stopped["sealed"] as? Bool == true, "withdrawn, drained, then sealed before its close")
        #expect(reports.allSatisfy { $0.int("socket_drops") == 0 }, "receive queues overflowed")
        #expect(reports.map { $0.int("received") }.reduce(0, +) == sent, "delivered == sent: \(reports.map { $0.int("received") })")
        #expect(reports[0].object("kernel").int("failed_over") > 0, "the stopped collector's sources failed over")
    }

    @Test("Per-source counts for every datagram, also not the publisher's; bounded by --max-sources with an other bucket")
    func everySourceCounted() throws {
        let port = freePort()
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: port)
        let collector = try collectors(port, count: 1, extra: ["--max-sources", "10"])[0]
        let sources = (10..<40).map { "127.0.6.\($0)" }
        for source in sources { try send(from: source, to: address, count: 2) }  // not the publisher's payload
        #expect(try publish(port, count: 20, sources: "127.0.6.10-127.0.6.11").int("sent") == 20)
        usleep(200_000)
        let report = try collector.stop()
        #expect(report.int("received") == 80)
        #expect(report.int("foreign") == 60)
        let listed = report.object("sources")
        #expect(listed.count == 10, "bounded at --max-sources: \(listed.keys.sorted())")
        #expect(Set(listed.keys) == Set(sources.prefix(10)), "the first sources seen are kept")
        #expect(listed.values.compactMap { ($0 as? [String: Any])?.int("packets") }.reduce(0, +) == 40, "10 sources x 2, and the publisher's 20")
        #expect((listed["127.0.6.10"] as? [String: Any])?.int("packets") == 12)
        #expect((listed["127.0.6.10"] as? [String: Any])?.int("lost") == 0, "sequence checks where the payload is the publisher's")
        #expect((listed["127.0.6.12"] as? [String: Any])?["lost"] == nil, "no sequence check without the publisher's header")
        #expect(report.object("other_sources").int("packets") == 40, "the 20 sources past the bound, 2 datagrams each")
    }

    @Test("roundRobin: no lost/reordered (one source is spread over members), totals still add up")
    func roundRobinReportsNoLoss() throws {
        let port = freePort()
        let children = try collectors(port, count: 3, extra: ["--policy", "roundRobin"])
        #expect(try publish(port, count: 3000, sources: "127.0.6.50").int("sent") == 3000)
        usleep(200_000)
        let reports = try children.map { try $0.stop() }
        #expect(reports.map { $0.int("received") }.reduce(0, +) == 3000)
        for report in reports {
            #expect(report["lost"] == nil && report["reordered"] == nil, "\(report)")
            let entry = report.object("sources").object("127.0.6.50")
            #expect(entry.int("packets") == report.int("received") && entry["lost"] == nil)
        }
    }

    @Test("Without CAP_BPF (uid nobody, no capabilities): classic BPF steering, still one collector per source")
    func unprivileged() throws {
        // A copy of the binary nobody can execute, wherever the checkout is.
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("rplb-unpriv-\(UUID().uuidString)")
        try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(at: directory) }
        let binary = directory.appendingPathComponent("collector").path
        try FileManager.default.copyItem(atPath: binaryDirectory.appendingPathComponent("collector").path, toPath: binary)
        chmod(directory.path, 0o755)
        chmod(binary, 0o755)
        let port = freePort()
        let drop = ["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
        let children = try (0..<3).map { index in
            let child = try Child(binary, ["127.0.0.1", String(port), String(index), "3"], prefix: drop)
            try child.waitFor("ready")
            return child
        }
        #expect(try publish(port, count: 900, sources: "127.0.4.10-127.0.4.99").int("sent") == 900)
        usleep(200_000)
        let reports = try children.map { try $0.stop() }
        #expect(reports.allSatisfy { $0["steering"] as? String == "classicBPF" })
        #expect(reports.allSatisfy { $0.int("socket_drops") == 0 }, "receive queues overflowed")
        #expect(reports.allSatisfy { ($0["steering_note"] as? String)?.contains("CAP_BPF") == true })
        #expect(reports.map { $0.int("received") }.reduce(0, +) == 900)
        #expect(owners(reports).count == 90)
        #expect(reports.filter { $0.int("received") > 0 }.count == 3, "all three collectors used")
        #expect(reports.allSatisfy { $0["kernel"] == nil }, "no kernel counters without eBPF")
    }

    @Test("IPv6: collectors and a publisher with 64 source addresses inside a test namespace")
    func ipv6Namespace() throws {
        let namespace = "rplb-test-\(UInt32.random(in: 0...UInt32.max))"
        try #require(try run("/usr/sbin/ip", ["netns", "add", namespace]).status == 0)
        defer { _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace]) }
        var batch = "link set lo up\naddr add 2001:db8::1/128 dev lo nodad\n"
        for index in 0x100..<0x140 { batch += "addr add 2001:db8::\(String(index, radix: 16))/128 dev lo nodad\n" }
        let batchFile = FileManager.default.temporaryDirectory.appendingPathComponent("\(namespace).batch")
        try batch.write(to: batchFile, atomically: true, encoding: .utf8)
        defer { try? FileManager.default.removeItem(at: batchFile) }
        try #require(try run("/usr/sbin/ip", ["-n", namespace, "-batch", batchFile.path]).status == 0)
        // nsenter switches only the network namespace: the collectors share the host's bpffs.
        let enter = ["/usr/bin/nsenter", "--net=/run/netns/\(namespace)", "--"]
        let children = try collectors(5514, count: 3, ip: "2001:db8::1", prefix: enter)
        let published = try publish(5514, count: 640, sources: "2001:db8::100-2001:db8::13f", ip: "2001:db8::1", prefix: enter)
        #expect(published.int("sent") == 640)
        usleep(200_000)
        let reports = try children.map { try $0.stop() }
        #expect(reports.allSatisfy { $0["steering"] as? String == "ebpf" })
        #expect(reports.allSatisfy { $0.int("socket_drops") == 0 }, "receive queues overflowed")
        #expect(reports.map { $0.int("received") }.reduce(0, +) == 640)
        #expect(owners(reports).count == 64)
        #expect(reports.filter { $0.int("received") > 0 }.count == 3)
        #expect(reports[0].object("kernel").int("selected") == 640)
    }
}

@Suite("Leftovers and the C API", .serialized, .enabled(if: Privileges.enabled, Privileges.reason))
struct LifecycleTests {
    @Test("A crashed group's pins (every member killed) are replaced by the next group, even with other settings")
    func stalePins() throws {
        let port = freePort()
        let address = SocketAddress(ip: IPAddress("127.0.0.1")!, port: port)
        let directory = BPFFilesystem(root: "/sys/fs/bpf").groupDirectory(for: address)
        let crashed = try Child("collector", ["127.0.0.1", String(port), "0", "2"])
        try crashed.waitFor("ready")
        crashed.signal(SIGKILL)
        crashed.wait()
        #expect(BPFFilesystem.exists(directory + "/prog"), "a kill -9 cannot clean up")
        let member = try ReusePortMember(joining: address, slot: .index(3), options: .init(policy: .roundRobin, capacity: 4))
        #expect(try member.counters().selected == 0, "fresh maps, not the crashed group's")
        member.leave()
        #expect(!BPFFilesystem.exists(directory))
    }

    @Test("C API: a C program built with pkg-config joins a group and receives steered datagrams")
    func cAPI() throws {
        let prefix = FileManager.default.temporaryDirectory.appendingPathComponent("rplb-prefix-\(UUID().uuidString)")
        defer { try? FileManager.default.removeItem(at: prefix) }
        let install = try run("/usr/bin/make", ["-C", root.path, "install-files", "PREFIX=\(prefix.path)", "BUILD_DIR=\(binaryDirectory.path)"])
        try #require(install.status == 0, "\(install.output)")
        let source = prefix.appendingPathComponent("app.c")
        try cProgram.write(to: source, atomically: true, encoding: .utf8)
        let binary = prefix.appendingPathComponent("app").path
        let build = try run("/bin/sh", ["-c", "PKG_CONFIG_PATH=\(prefix.path)/lib/pkgconfig cc -Wall -Werror -o \(binary) \(source.path) $(PKG_CONFIG_PATH=\(prefix.path)/lib/pkgconfig pkg-config --cflags --libs reuseportlb)"])
        try #require(build.status == 0, "\(build.output)")
        let result = try run(binary, [String(freePort())])
        #expect(result.status == 0, "\(result.output)")
        #expect(result.output.contains("received=40 misplaced=0 selected=40 steering=ebpf"), "\(result.output)")
        // The installed library carries a SONAME, and the program recorded it.
        let library = prefix.appendingPathComponent("lib/libreuseportlb.so.0").path
        #expect(try run("/usr/bin/readelf", ["-d", library]).output.contains("Library soname: [libreuseportlb.so.0]"))
        #expect(try run("/usr/bin/readelf", ["-d", binary]).output.contains("Shared library: [libreuseportlb.so.0]"))

        // The template store through the C API: one member learns, the other looks up.
        let storeSource = prefix.appendingPathComponent("templates.c")
        try Self.templatesProgram.write(to: storeSource, atomically: true, encoding: .utf8)
        let storeBinary = prefix.appendingPathComponent("templates").path
        let storeBuild = try run("/bin/sh", ["-c", "cc -Wall -Werror -o \(storeBinary) \(storeSource.path) $(PKG_CONFIG_PATH=\(prefix.path)/lib/pkgconfig pkg-config --cflags --libs reuseportlb)"])
        try #require(storeBuild.status == 0, "\(storeBuild.output)")
        let stored = try run(storeBinary, [String(freePort())])
        #expect(stored.status == 0, "\(stored.output)")
        #expect(stored.output.contains("learned=1 length=12 options=0 same=1 data=0 other_domain=-2 small=-28 null=-22 written=1 found=2 missing=1"), "\(stored.output)")

        // QUIC-LB through the C API: the encoder against the draft's vectors, and a group that
        // routes by the server IDs its members registered.
        let quicSource = prefix.appendingPathComponent("quic.c")
        try Self.quicProgram.write(to: quicSource, atomically: true, encoding: .utf8)
        let quicBinary = prefix.appendingPathComponent("quic").path
        let quicBuild = try run("/bin/sh", ["-c", "cc -Wall -Werror -o \(quicBinary) \(quicSource.path) $(PKG_CONFIG_PATH=\(prefix.path)/lib/pkgconfig pkg-config --cflags --libs reuseportlb)"])
        try #require(quicBuild.status == 0, "\(quicBuild.output)")
        let quic = try run(quicBinary, [String(freePort())])
        #expect(quic.status == 0, "\(quic.output)")
        #expect(quic.output.contains("plain=07c4605e4504cc4f four_pass=0767947d29be054a decoded=31441a bad=-22 short=-28 keyed_group=-95 taken=-17 wrong_length=-22 at0=20 at1=20 routed=40 fallback=0 unknown=0 undecodable=0 not_mine=-2 withdrawn=0"),
                "\(quic.output)")
    }

    /// QUIC-LB in C: encode and decode (the draft's vectors), then a two-member group that routes
    /// short-header packets from 20 sources each to the member whose server ID they carry.
    static let quicProgram = #"""
        // SPDX-License-Identifier: Apache-2.0
        #include <arpa/inet.h>
        #include <errno.h>
        #include <netinet/in.h>
        #include <poll.h>
        #include <stdio.h>
        #include <stdlib.h>
        #include <string.h>
        #include <sys/socket.h>
        #include <unistd.h>
        #include <reuseportlb.h>

        static void hex(const uint8_t *bytes, int length, char *out) {
            for (int i = 0; i < length; i++) sprintf(out + 2 * i, "%02x", bytes[i]);
        }

        static int count(int fd) {
            int received = 0;
            uint8_t buffer[256];
            while (poll(&(struct pollfd){.fd = fd, .events = POLLIN}, 1, 200) > 0 && recv(fd, buffer, sizeof buffer, 0) > 0) received++;
            return received;
        }

        int main(int argc, char **argv) {
            char error[REUSEPORTLB_ERROR_MAX];
            uint16_t port = (uint16_t)atoi(argv[1]);
            struct reuseportlb_quic_lb plain = {.config_id = 0, .server_id_length = 3, .nonce_length = 4, .key = NULL};
            const uint8_t sid[] = {0xc4, 0x60, 0x5e}, nonce[] = {0x45, 0x04, 0xcc, 0x4f};
            uint8_t id[REUSEPORTLB_CONNECTION_ID_MAX], decoded[16];
            char plain_hex[64] = "", four_hex[64] = "", decoded_hex[64] = "";
            int length = reuseportlb_quic_encode(&plain, sid, nonce, id, sizeof id, error, sizeof error);
            if (length > 0) hex(id, length, plain_hex);
            const uint8_t key[] = {0xfd, 0xf7, 0x26, 0xa9, 0x89, 0x3e, 0xc0, 0x5c, 0x06, 0x32, 0xd3, 0x95, 0x66, 0x80, 0xba, 0xf0};
            struct reuseportlb_quic_lb keyed = {.config_id = 0, .server_id_length = 3, .nonce_length = 4, .key = key};
            const uint8_t sid2[] = {0x31, 0x44, 0x1a}, nonce2[] = {0x9c, 0x69, 0xc2, 0x75};
            length = reuseportlb_quic_encode(&keyed, sid2, nonce2, id, sizeof id, error, sizeof error);
            if (length > 0) hex(id, length, four_hex);
            int decoded_length = reuseportlb_quic_decode(&keyed, id, length, decoded, sizeof decoded);
            if (decoded_length > 0) hex(decoded, decoded_length, decoded_hex);
            struct reuseportlb_quic_lb bad = {.config_id = 7, .server_id_length = 3, .nonce_length = 4, .key = NULL};
            int bad_result = reuseportlb_quic_encode(&bad, sid, nonce, id, sizeof id, error, sizeof error);
            int short_result = reuseportlb_quic_encode(&plain, sid, nonce, id, 4, error, sizeof error);

            reuseportlb_member *members[2], *other;
            int keyed_group = reuseportlb_join_quic("127.0.0.1", port, 0, 2, REUSEPORTLB_SOURCE_IP, &keyed, sid2, &other, error, sizeof error);
            struct reuseportlb_quic_lb group = {.config_id = 1, .server_id_length = 2, .nonce_length = 6, .key = NULL};
            const uint8_t ids[2][2] = {{0x0a, 0x01}, {0x0a, 0x02}};
            for (int m = 0; m < 2; m++) {
                if (reuseportlb_join_quic("127.0.0.1", port, m, 2, REUSEPORTLB_SOURCE_IP, &group, ids[m], &members[m], error, sizeof error) < 0) {
                    fprintf(stderr, "join: %s\n", error);
                    return 1;
                }
            }
            int taken = reuseportlb_quic_register(members[1], ids[0], 2, error, sizeof error);
            int wrong_length = reuseportlb_quic_register(members[1], ids[0], 1, error, sizeof error);
            /* 20 sources, each sending one short-header packet to each member's server ID. */
            struct sockaddr_in group_address = {.sin_family = AF_INET, .sin_port = htons(port)};
            inet_pton(AF_INET, "127.0.0.1", &group_address.sin_addr);
            for (int s = 0; s < 20; s++) {
                int fd = socket(AF_INET, SOCK_DGRAM, 0);
                struct sockaddr_in source = {.sin_family = AF_INET};
                char text[32];
                snprintf(text, sizeof text, "127.0.9.%d", s + 2);
                inet_pton(AF_INET, text, &source.sin_addr);
                if (bind(fd, (struct sockaddr *)&source, sizeof source) < 0) { perror("bind"); return 1; }
                for (int m = 0; m < 2; m++) {
                    const uint8_t nonce3[] = {1, 2, 3, 4, 5, (uint8_t)s};
                    uint8_t packet[64] = {0x41};
                    int id_length = reuseportlb_quic_encode(&group, ids[m], nonce3, packet + 1, 20, error, sizeof error);
                    sendto(fd, packet, 1 + id_length + 20, 0, (struct sockaddr *)&group_address, sizeof group_address);
                }
                close(fd);
            }
            int at0 = count(reuseportlb_socket(members[0])), at1 = count(reuseportlb_socket(members[1]));
            struct reuseportlb_quic_counters counters = {0};
            reuseportlb_quic_counters(members[0], &counters);
            int not_mine = reuseportlb_quic_withdraw(members[0], ids[1], 2);
            int withdrawn = reuseportlb_quic_withdraw(members[1], ids[1], 2);
            printf("plain=%s four_pass=%s decoded=%s bad=%d short=%d keyed_group=%d taken=%d wrong_length=%d at0=%d at1=%d routed=%llu fallback=%llu unknown=%llu undecodable=%llu not_mine=%d withdrawn=%d\n",
                   plain_hex, four_hex, decoded_hex, bad_result, short_result, keyed_group, taken, wrong_length, at0, at1,
                   (unsigned long long)counters.routed, (unsigned long long)counters.fallback,
                   (unsigned long long)counters.unknown_server_id, (unsigned long long)counters.undecodable, not_mine, withdrawn);
            reuseportlb_leave(members[0]);
            reuseportlb_leave(members[1]);
            return 0;
        }
        """#

    /// Two members of one group: the first learns a NetFlow v9 template, the second reads it.
    static let templatesProgram = #"""
        // SPDX-License-Identifier: Apache-2.0
        #include <arpa/inet.h>
        #include <netinet/in.h>
        #include <stdio.h>
        #include <stdlib.h>
        #include <string.h>
        #include <reuseportlb.h>

        int main(int argc, char **argv) {
            char error[REUSEPORTLB_ERROR_MAX];
            uint16_t port = (uint16_t)atoi(argv[1]);
            reuseportlb_member *first, *second;
            reuseportlb_templates *writer, *reader;
            if (reuseportlb_join("127.0.0.1", port, 0, 2, REUSEPORTLB_SOURCE_IP, &first, error, sizeof error) < 0 ||
                reuseportlb_join("127.0.0.1", port, 1, 2, REUSEPORTLB_SOURCE_IP, &second, error, sizeof error) < 0 ||
                reuseportlb_templates_open(first, &writer, error, sizeof error) < 0 ||
                reuseportlb_templates_open(second, &reader, error, sizeof error) < 0) {
                fprintf(stderr, "%s\n", error);
                return 1;
            }
            /* v9 header (count 1, source ID 7), template set: template 256 with 2 fields. */
            const uint8_t packet[] = {0, 9, 0, 1, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 7,
                                      0, 0, 0, 16, 1, 0, 0, 2, 0, 8, 0, 4, 0, 12, 0, 4};
            const uint8_t data[] = {0, 9, 0, 1, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 4, 0, 0, 0, 7,
                                    1, 0, 0, 12, 1, 2, 3, 4, 5, 6, 7, 8};
            struct sockaddr_in exporter = {.sin_family = AF_INET, .sin_port = htons(2055)};
            inet_pton(AF_INET, "192.0.2.5", &exporter.sin_addr);
            int learned = reuseportlb_templates_learn(writer, packet, sizeof packet, &exporter);
            int ignored = reuseportlb_templates_learn(writer, data, sizeof data, &exporter);
            uint8_t record[REUSEPORTLB_TEMPLATE_MAX];
            int options = -1;
            int length = reuseportlb_templates_lookup(reader, &exporter, 9, 7, 256, record, sizeof record, &options);
            int same = length == 12 && memcmp(record, packet + 24, 12) == 0;
            int other = reuseportlb_templates_lookup(reader, &exporter, 9, 8, 256, record, sizeof record, NULL);
            int small = reuseportlb_templates_lookup(reader, &exporter, 9, 7, 256, record, 4, NULL);
            int null = reuseportlb_templates_learn(NULL, packet, sizeof packet, &exporter);
            struct reuseportlb_template_counters written, read;
            reuseportlb_templates_counters(writer, &written);
            reuseportlb_templates_counters(reader, &read);
            printf("learned=%d length=%d options=%d same=%d data=%d other_domain=%d small=%d null=%d written=%llu found=%llu missing=%llu\n",
                   learned, length, options, same, ignored, other, small, null, (unsigned long long)written.written,
                   (unsigned long long)read.found, (unsigned long long)read.missing);
            reuseportlb_templates_close(writer);
            reuseportlb_templates_close(reader);
            reuseportlb_leave(first);
            reuseportlb_leave(second);
            return 0;
        }
        """#

    /// The shipped C API sample (examples/c/steering.c), which make dist and the self-contained check use too.
    var cProgram: String {
        get throws { try String(contentsOf: root.appendingPathComponent("examples/c/steering.c"), encoding: .utf8) }
    }

    var root: URL {
        URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
    }
}
