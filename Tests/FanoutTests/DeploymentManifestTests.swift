// SPDX-License-Identifier: Apache-2.0
import CSystemShim
import Foundation
import ReusePortLB
import Testing
import TestSupport
import Yams

#if canImport(Glibc)
import Glibc
#endif

/// The Kubernetes manifests in k8s/ (docs/deployment.md): each DaemonSet's user and capability
/// list run the daemon on its own ConfigMap's config, and are minimal (without any one listed
/// capability the daemon exits non-zero naming it); every manifest passes kubernetes-validate
/// --strict; every embedded config passes `udp-fanout --check`.
@Suite("Deployment manifests", .serialized)
struct DeploymentManifestTests {
    static let directory = URL(fileURLWithPath: #filePath).deletingLastPathComponent()
        .deletingLastPathComponent().deletingLastPathComponent().appendingPathComponent("k8s")
    /// The Kubernetes version the manifests are written for (docs/deployment.md says the same).
    static let kubernetesVersion = "1.30.0"

    // MARK: Reading the manifests

    static func manifestFiles() throws -> [URL] {
        try FileManager.default.contentsOfDirectory(at: directory, includingPropertiesForKeys: nil)
            .filter { $0.pathExtension == "yaml" }.sorted { $0.path < $1.path }
    }

    /// Every document of every manifest, with the file it came from.
    static func documents() throws -> [(file: String, object: [String: Any])] {
        try manifestFiles().flatMap { url -> [(file: String, object: [String: Any])] in
            let text = try String(contentsOf: url, encoding: .utf8)
            // Documents are separated by lines of exactly `---` in these files.
            let parts = text.components(separatedBy: "\n---\n")
            return try parts.compactMap { part in
                guard let object = try Yams.load(yaml: part) as? [String: Any] else { return nil }
                return (url.lastPathComponent, object)
            }
        }
    }

    /// What a DaemonSet asks of the node, read from its YAML.
    struct DaemonSet {
        let file: String
        let name: String
        let uid: Int
        let runAsNonRoot: Bool
        let added: [String]
        let dropped: [String]
        let arguments: [String]
        let config: String
        let configPath: String
        let readiness: (path: String, port: Int)
        let liveness: (path: String, port: Int)
        let scrapePort: Int
        let memoryLimit: String
        let gracePeriod: Int
        let hostPaths: [String]
        let readOnlyRoot: Bool
        /// Where the container may write: the mount paths of its writable volumes.
        let writable: [String]
    }

    static func daemonSets() throws -> [DaemonSet] {
        let all = try documents()
        let configMaps = Dictionary(uniqueKeysWithValues: all.filter { $0.object["kind"] as? String == "ConfigMap" }.map {
            (($0.object["metadata"] as! [String: Any])["name"] as! String, $0.object)
        })
        return try all.filter { $0.object["kind"] as? String == "DaemonSet" }.map { file, object in
            let template = try #require((object["spec"] as? [String: Any])?["template"] as? [String: Any])
            let annotations = (template["metadata"] as? [String: Any])?["annotations"] as? [String: String] ?? [:]
            let pod = try #require(template["spec"] as? [String: Any])
            let containers = try #require(pod["containers"] as? [[String: Any]])
            try #require(containers.count == 1, "\(file): one udp-fanout container")
            let container = containers[0]
            let podSecurity = pod["securityContext"] as? [String: Any] ?? [:]
            let security = container["securityContext"] as? [String: Any] ?? [:]
            // The container's settings win over the pod's (as in the kubelet).
            let uid = try #require((security["runAsUser"] ?? podSecurity["runAsUser"]) as? Int, "\(file): runAsUser is stated")
            let nonRoot = (security["runAsNonRoot"] ?? podSecurity["runAsNonRoot"]) as? Bool ?? false
            let capabilities = security["capabilities"] as? [String: Any] ?? [:]
            let volumes = pod["volumes"] as? [[String: Any]] ?? []
            let configVolume = try #require(volumes.first { $0["configMap"] != nil }, "\(file): a ConfigMap volume")
            let configMapName = try #require((configVolume["configMap"] as? [String: Any])?["name"] as? String)
            let configMap = try #require(configMaps[configMapName], "\(file): ConfigMap \(configMapName) is in k8s/")
            let config = try #require((configMap["data"] as? [String: String])?["config.yaml"], "\(configMapName): data.config.yaml")
            let mounts = container["volumeMounts"] as? [[String: Any]] ?? []
            let mountPath = try #require(mounts.first { $0["name"] as? String == configVolume["name"] as? String }?["mountPath"] as? String)
            func probe(_ key: String) throws -> (path: String, port: Int) {
                let get = try #require((container[key] as? [String: Any])?["httpGet"] as? [String: Any], "\(file): \(key).httpGet")
                return (try #require(get["path"] as? String), try #require(get["port"] as? Int))
            }
            let resources = container["resources"] as? [String: Any] ?? [:]
            let writableVolumes = Set(volumes.filter { $0["hostPath"] != nil || $0["emptyDir"] != nil }.compactMap { $0["name"] as? String })
            let writable = mounts.filter { writableVolumes.contains($0["name"] as? String ?? "") && ($0["readOnly"] as? Bool) != true }
                .compactMap { $0["mountPath"] as? String }
            return DaemonSet(
                file: file, name: (object["metadata"] as! [String: Any])["name"] as! String, uid: uid, runAsNonRoot: nonRoot,
                added: capabilities["add"] as? [String] ?? [], dropped: capabilities["drop"] as? [String] ?? [],
                arguments: container["args"] as? [String] ?? [], config: config, configPath: mountPath + "/config.yaml",
                readiness: try probe("readinessProbe"), liveness: try probe("livenessProbe"),
                scrapePort: Int(annotations["prometheus.io/port"] ?? "") ?? -1,
                memoryLimit: (resources["limits"] as? [String: Any])?["memory"] as? String ?? "",
                gracePeriod: pod["terminationGracePeriodSeconds"] as? Int ?? 30,
                hostPaths: volumes.compactMap { ($0["hostPath"] as? [String: Any])?["path"] as? String },
                readOnlyRoot: security["readOnlyRootFilesystem"] as? Bool ?? false, writable: writable)
        }
    }

    static func daemonSet(_ file: String) throws -> DaemonSet {
        try #require(try daemonSets().first { $0.file == file }, "no DaemonSet in k8s/\(file)")
    }

    // MARK: Running the daemon as the container runtime would

    /// What a container runtime does for a container with `capabilities: {drop: [ALL], add:
    /// capabilities}` and `allowPrivilegeEscalation: false`: the capabilities become the bounding
    /// set, the process runs as `uid`, no inheritable or ambient set, no new privileges. The kernel
    /// then gives uid 0 the bounding set and any other uid nothing, as it does in a pod.
    static func asContainer(uid: Int, _ capabilities: [String]) -> [String] {
        let bounding = (["-all"] + capabilities.map { "+\($0.lowercased())" }).joined(separator: ",")
        return ["/usr/bin/setpriv", "--reuid=\(uid)", "--regid=\(uid)", "--clear-groups", "--no-new-privs",
                "--inh-caps=-all", "--bounding-set=\(bounding)", "--"]
    }

    /// `readOnlyRootFilesystem: true` with the container's writable volumes: in a mount namespace
    /// of its own, each writable path (on this host, the same path as the manifest's hostPath)
    /// becomes a mount of its own, then the root filesystem is remounted read-only.
    static func readOnlyRoot(_ set: DaemonSet) -> [String] {
        guard set.readOnlyRoot else { return [] }
        let volumes = set.writable.map { "mkdir -p '\($0)' && mount --bind '\($0)' '\($0)'" }
        let script = (["set -e"] + volumes + ["mount -o remount,bind,ro /", "exec \"$@\""]).joined(separator: "\n")
        return ["/usr/bin/unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, "sh"]
    }

    /// The DaemonSet's config with its addresses moved to the test's, written where the
    /// DaemonSet's uid can read it, with a copy of udp-fanout it can run.
    final class Scratch {
        let directory = URL(fileURLWithPath: "/tmp").appendingPathComponent("fanout-k8s-\(UUID().uuidString)")
        var binary: String { directory.appendingPathComponent("udp-fanout").path }
        var config: String { directory.appendingPathComponent("config.yaml").path }

        init(_ settings: [String: Any]) throws {
            try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
            try FileManager.default.copyItem(atPath: binaryDirectory.appendingPathComponent("udp-fanout").path, toPath: binary)
            // JSON is YAML: the adapted mapping is written as one JSON document.
            try JSONSerialization.data(withJSONObject: settings, options: [.sortedKeys]).write(to: URL(fileURLWithPath: config))
            chmod(directory.path, 0o755)
            chmod(binary, 0o755)
            chmod(config, 0o644)
        }

        deinit { try? FileManager.default.removeItem(at: directory) }
    }

    /// The manifest's container arguments with the config path pointing at the scratch copy.
    static func arguments(_ set: DaemonSet, _ scratch: Scratch) throws -> [String] {
        try #require(set.arguments.contains(set.configPath), "\(set.file): args \(set.arguments) name the mounted config \(set.configPath)")
        return set.arguments.map { $0 == set.configPath ? scratch.config : $0 }
    }

    static func parse(_ config: String) throws -> [String: Any] {
        try #require(try Yams.load(yaml: config) as? [String: Any])
    }

    /// The metrics port of a config, which the probes, the annotation and the container port must use.
    static func metricsPort(_ config: [String: Any]) throws -> Int {
        let bind = try #require((config["metrics"] as? [String: Any])?["bind"] as? String)
        return try #require(Int(bind.split(separator: ":").last ?? ""))
    }

    static func get(_ prefix: [String], _ url: String) throws -> (status: Int32, body: String) {
        let result = try run(prefix.isEmpty ? "/usr/bin/curl" : prefix[0], Array(prefix.dropFirst()) + (prefix.isEmpty ? [] : ["/usr/bin/curl"]) + ["-s", "-f", "-m", "2", url])
        return (result.status, result.output)
    }

    /// Polls `url` until it answers 2xx (at most `seconds`).
    static func waitReady(_ prefix: [String], _ url: String, _ daemon: Child, seconds: Double = 15) throws {
        let deadline = Date().addingTimeInterval(seconds)
        while Date() < deadline {
            if try get(prefix, url).status == 0 { return }
            if !daemon.process.isRunning { break }
            usleep(100_000)
        }
        Issue.record("\(url) never answered 200; stderr: \(daemon.stderr)")
        throw CancellationError()
    }

    static func residentKiB(_ pid: Int32) -> Int {
        let status = (try? String(contentsOfFile: "/proc/\(pid)/status", encoding: .utf8)) ?? ""
        let line = status.split(separator: "\n").first { $0.hasPrefix("VmRSS:") } ?? ""
        return Int(line.split(separator: " ", omittingEmptySubsequences: true).dropFirst().first ?? "") ?? -1
    }

    /// Kubernetes memory quantities of the forms the manifests use (Mi, Gi).
    static func kibibytes(_ quantity: String) -> Int {
        if quantity.hasSuffix("Mi") { return (Int(quantity.dropLast(2)) ?? 0) * 1024 }
        if quantity.hasSuffix("Gi") { return (Int(quantity.dropLast(2)) ?? 0) * 1024 * 1024 }
        return Int(quantity).map { $0 / 1024 } ?? 0
    }

    /// Checks shared by both DaemonSets: the probes, scrape annotation and config agree on the
    /// metrics port; no capability is listed that Kubernetes would not raise for this uid.
    static func checkShape(_ set: DaemonSet, _ config: [String: Any]) throws {
        let port = try metricsPort(config)
        #expect(set.readiness.path == "/readyz" && set.readiness.port == port, "\(set.file): readinessProbe \(set.readiness), metrics port \(port)")
        #expect(set.liveness.path == "/healthz" && set.liveness.port == port, "\(set.file): livenessProbe \(set.liveness), metrics port \(port)")
        #expect(set.scrapePort == port, "\(set.file): prometheus.io/port \(set.scrapePort), metrics port \(port)")
        #expect(set.readOnlyRoot, "\(set.file): readOnlyRootFilesystem: true (the test then runs the daemon on a read-only root)")
        #expect(set.dropped == ["ALL"], "\(set.file): capabilities.drop is [ALL], then add what the mode needs")
        if set.uid != 0 {
            #expect(set.runAsNonRoot, "\(set.file): uid \(set.uid) should say runAsNonRoot: true")
            #expect(set.added.isEmpty, "\(set.file): Kubernetes does not raise \(set.added) for a non-root container (bounding set only): run as uid 0 or remove them")
        }
    }

    /// Runs the daemon as the DaemonSet would, with `capabilities`, on `config`.
    static func start(_ set: DaemonSet, _ scratch: Scratch, capabilities: [String], netns: [String] = []) throws -> Child {
        try Child(scratch.binary, try arguments(set, scratch), prefix: netns + readOnlyRoot(set) + asContainer(uid: set.uid, capabilities))
    }

    /// Without each listed capability in turn the daemon exits non-zero naming it.
    static func expectEachCapabilityNeeded(_ set: DaemonSet, _ scratch: Scratch, netns: [String] = []) throws {
        for missing in set.added {
            let daemon = try start(set, scratch, capabilities: set.added.filter { $0 != missing }, netns: netns)
            let status = daemon.wait(seconds: 15)
            #expect(status != 0, "\(set.file) without \(missing): exit \(status); stderr: \(daemon.stderr)")
            #expect(daemon.stderr.contains("CAP_\(missing)"), "\(set.file) without \(missing): the error names CAP_\(missing): \(daemon.stderr)")
        }
    }

    // MARK: Tests

    @Test("userspace DaemonSet: its uid and capabilities run its ConfigMap (loopback), every listener forwards, probes answer, RSS within the limit", .enabled(if: Privileges.enabled, Privileges.reason))
    func userspaceDaemonSet() throws {
        let set = try Self.daemonSet("daemonset.yaml")
        var config = try Self.parse(set.config)
        try Self.checkShape(set, config)
        let listeners = try #require(config["listeners"] as? [[String: Any]])
        #expect(listeners.allSatisfy { ($0["mode"] as? String ?? "userspace") == "userspace" }, "daemonset.yaml's config is userspace only")
        // Every listener to loopback, each with its own sink as downstream (Kubernetes ones too).
        var sinks: [Sink] = []
        var binds: [SocketAddress] = []
        config["listeners"] = try listeners.map { listener in
            var moved = listener
            let sink = try Sink()
            let bind = SocketAddress(ip: IPAddress("127.0.0.1")!, port: freePort())
            sinks.append(sink)
            binds.append(bind)
            moved["bind"] = "\(bind)"
            moved["kubernetes"] = nil
            moved["downstream"] = [["name": "\(listener["name"] ?? "")-sink", "address": "\(sink.address)"]]
            return moved
        }
        let metrics = "127.0.0.1:\(freePort())"
        var endpoint = try #require(config["metrics"] as? [String: Any])
        endpoint["bind"] = metrics
        config["metrics"] = endpoint
        let scratch = try Scratch(config)

        let daemon = try Self.start(set, scratch, capabilities: set.added)
        try Self.waitReady([], "http://\(metrics)\(set.readiness.path)", daemon)
        #expect(try Self.get([], "http://\(metrics)\(set.liveness.path)").status == 0, "liveness probe")
        for (bind, sink) in zip(binds, sinks) {
            try sendNumbered(to: bind, count: 100)
            #expect(sink.drain().count == 100, "\(bind): every datagram forwarded; stderr: \(daemon.stderr)")
        }
        let rss = Self.residentKiB(daemon.process.processIdentifier)
        print("udp-fanout (\(set.file), \(listeners.count) listeners) RSS: \(rss) KiB")
        #expect(rss > 0 && rss < Self.kibibytes(set.memoryLimit), "RSS \(rss) KiB within the limit \(set.memoryLimit)")
        daemon.signal(SIGTERM)
        #expect(daemon.wait(seconds: Double(set.gracePeriod)) == 0, "clean exit within terminationGracePeriodSeconds")
        try Self.expectEachCapabilityNeeded(set, scratch)
    }

    @Test("tc_ebpf DaemonSet: its uid and capabilities run its ConfigMap (namespaces, veth), a datagram arrives with its source; without each capability the daemon names it", .enabled(if: Privileges.enabled, Privileges.reason))
    func tcDaemonSet() throws {
        let set = try Self.daemonSet("daemonset-tc-ebpf.yaml")
        var config = try Self.parse(set.config)
        try Self.checkShape(set, config)
        #expect(set.hostPaths == ["/run/udp-fanout"], "tc_ebpf pins nothing: only its lock directory comes from the node, got \(set.hostPaths)")
        let topology = try Topology(backends: 1)
        let collector = try TCFixtures.collectors(topology)[0]
        let listeners = try #require(config["listeners"] as? [[String: Any]])
        try #require(listeners.count == 1, "one tc_ebpf listener")
        var listener = listeners[0]
        #expect(listener["mode"] as? String == "tc_ebpf")
        // The VIP becomes the proxy's address, the node's uplink the proxy's veth, the Service the backend.
        let port = try #require(Int((listener["bind"] as? String)?.split(separator: ":").last ?? ""))
        listener["bind"] = "198.18.0.1:\(port)"
        listener["interface"] = topology.proxyInterface
        listener["kubernetes"] = nil
        listener["downstream"] = [["name": "b1", "address": "\(Topology.backendIPv4(1)):\(TCFixtures.port)"]]
        config["listeners"] = [listener]
        let netns = topology.prefix(topology.proxy)
        let scratch = try Scratch(config)

        let daemon = try Self.start(set, scratch, capabilities: set.added, netns: netns)
        try daemon.waitFor("registered listener in eBPF map")
        let metrics = "http://127.0.0.1:\(try Self.metricsPort(config))"
        try Self.waitReady(netns, metrics + set.readiness.path, daemon)
        #expect(try Self.get(netns, metrics + set.liveness.path).status == 0, "liveness probe")
        let publisher = try Child("publisher", ["198.18.0.1", "\(port)", "200", "--rate", "10000"], prefix: topology.prefix(topology.client))
        #expect(publisher.wait() == 0)
        usleep(300_000)
        print("udp-fanout (\(set.file)) RSS: \(Self.residentKiB(daemon.process.processIdentifier)) KiB")
        daemon.signal(SIGTERM)
        #expect(daemon.wait(seconds: Double(set.gracePeriod)) == 0, "clean exit; stderr: \(daemon.stderr)")
        let report = try collector.stop()
        #expect(report.int("received") == 200, "\(report)")
        #expect(Array(report.object("sources").keys) == ["198.18.0.2"], "the client's source address")
        try Self.expectEachCapabilityNeeded(set, scratch, netns: netns)
        try TCFixtures.expectNothingLeft(topology)
    }

    @Test("every ConfigMap's embedded config passes udp-fanout --check (tc_ebpf: in a namespace with the config's interface)", .enabled(if: Privileges.enabled, Privileges.reason))
    func configsPassCheck() throws {
        let configMaps = try Self.documents().filter { $0.object["kind"] as? String == "ConfigMap" }
        try #require(configMaps.count >= 2, "the userspace and tc_ebpf ConfigMaps")
        for (file, object) in configMaps {
            let text = try #require((object["data"] as? [String: String])?["config.yaml"], "\(file): data.config.yaml")
            let path = "/tmp/fanout-k8s-check-\(UUID().uuidString).yaml"
            try text.write(toFile: path, atomically: true, encoding: .utf8)
            defer { unlink(path) }
            let listeners = try #require(try Self.parse(text)["listeners"] as? [[String: Any]])
            let interfaces = Set(listeners.compactMap { $0["interface"] as? String })
            var prefix: [String] = []
            var namespace: String?
            defer { if let namespace { _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace]) } }
            if !interfaces.isEmpty {
                // A namespace that has the node's interface names, forwarding on: what a node has.
                let name = "k8scheck-\(UInt32.random(in: 0...UInt32.max))"
                namespace = name
                try #require(try run("/usr/sbin/ip", ["netns", "add", name]).status == 0)
                // A veth pair (this kernel may have no dummy driver); the peer stays inside too.
                for (index, interface) in interfaces.sorted().enumerated() {
                    try #require(try run("/usr/sbin/ip", ["-n", name, "link", "add", interface, "type", "veth", "peer", "name", "peer\(index)"]).status == 0)
                    try #require(try run("/usr/sbin/ip", ["-n", name, "link", "set", interface, "up"]).status == 0)
                }
                prefix = ["/usr/bin/nsenter", "--net=/run/netns/\(name)", "--"]
                #expect(try run(prefix[0], Array(prefix.dropFirst()) + ["/usr/sbin/sysctl", "-qw", "net.ipv4.conf.all.forwarding=1"]).status == 0)
            }
            let binary = binaryDirectory.appendingPathComponent("udp-fanout").path
            let result = try run(prefix.first ?? binary, Array(prefix.dropFirst()) + (prefix.isEmpty ? [] : [binary]) + ["--check", "-c", path])
            #expect(result.status == 0, "\(file): udp-fanout --check: \(result.output)")
        }
    }

    /// One container of the collector pod, read from collector-deployment.yaml.
    struct CollectorContainer {
        let name: String
        let arguments: [String]
        let added: [String]
        let bpffs: String
        let mounts: [String]
        let readOnlyRoot: Bool

        func option(_ name: String) -> String? {
            arguments.firstIndex(of: name).flatMap { $0 + 1 < arguments.count ? arguments[$0 + 1] : nil }
        }
    }

    static func collectorPod() throws -> (uid: Int, hostPaths: [String: String], containers: [CollectorContainer]) {
        let deployment = try #require(try documents().first { $0.file == "collector-deployment.yaml" && $0.object["kind"] as? String == "Deployment" }?.object)
        let pod = try #require(((deployment["spec"] as? [String: Any])?["template"] as? [String: Any])?["spec"] as? [String: Any])
        let uid = try #require((pod["securityContext"] as? [String: Any])?["runAsUser"] as? Int)
        var hostPaths: [String: String] = [:]
        for volume in pod["volumes"] as? [[String: Any]] ?? [] {
            if let path = (volume["hostPath"] as? [String: Any])?["path"] as? String { hostPaths[volume["name"] as? String ?? ""] = path }
        }
        let containers = (pod["containers"] as? [[String: Any]] ?? []).map { container in
            let command = container["command"] as? [String] ?? []
            #expect(command == ["/usr/local/bin/collector"], "\(container["name"] ?? ""): the image's collector")
            let arguments = container["args"] as? [String] ?? []
            let security = container["securityContext"] as? [String: Any] ?? [:]
            let mounts = (container["volumeMounts"] as? [[String: Any]] ?? []).compactMap { mount -> String? in
                guard let host = hostPaths[mount["name"] as? String ?? ""], host == mount["mountPath"] as? String else { return nil }
                return host
            }
            let bpffs = arguments.firstIndex(of: "--bpffs").flatMap { $0 + 1 < arguments.count ? arguments[$0 + 1] : nil } ?? "/sys/fs/bpf"
            return CollectorContainer(
                name: container["name"] as? String ?? "", arguments: arguments,
                added: (security["capabilities"] as? [String: Any])?["add"] as? [String] ?? [], bpffs: bpffs, mounts: mounts,
                readOnlyRoot: security["readOnlyRootFilesystem"] as? Bool ?? false)
        }
        return (uid, hostPaths, containers)
    }

    @Test("collector pod: its containers, each in a mount namespace of its own with the node's bpffs (hostPath), form one eBPF group in the pod's network namespace; each source reaches one collector; without the shared bpffs the second refuses", .enabled(if: Privileges.enabled, Privileges.reason))
    func collectorPodSharesOneGroup() throws {
        let pod = try Self.collectorPod()
        let containers = pod.containers
        try #require(containers.count >= 2, "several collectors in the pod")
        // One group: the same address, port, slot count and policy; slots 0..<count, each once.
        let count = containers.count
        for container in containers {
            #expect(Array(container.arguments.prefix(4)) == [containers[0].arguments[0], containers[0].arguments[1], container.arguments[2], "\(count)"], "\(container.name): \(container.arguments)")
            #expect(container.option("--policy") == containers[0].option("--policy"))
            #expect(container.option("--steering") == "ebpf", "\(container.name): eBPF only, no silent fallback that splits the group")
            #expect(container.mounts.contains(container.bpffs), "\(container.name): the node's bpffs (hostPath) at \(container.bpffs)")
            #expect(container.readOnlyRoot)
        }
        #expect(Set(containers.map { $0.arguments[2] }) == Set((0..<count).map(String.init)), "slots 0..<\(count)")
        let port = try #require(UInt16(containers[0].arguments[1]))

        // The pod's network namespace, with its loopback up.
        let namespace = "k8spod-\(UInt32.random(in: 0...UInt32.max))"
        try #require(try run("/usr/sbin/ip", ["netns", "add", namespace]).status == 0)
        defer { _ = try? run("/usr/sbin/ip", ["netns", "delete", namespace]) }
        try #require(try run("/usr/sbin/ip", ["-n", namespace, "link", "set", "lo", "up"]).status == 0)
        let netns = ["/usr/bin/nsenter", "--net=/run/netns/\(namespace)", "--"]
        /// A container: its own mount namespace (the node's bpffs visible as through the
        /// hostPath, or a private one when `ownBPFFS`), read-only root, the pod's uid and capabilities.
        func start(_ container: CollectorContainer, ownBPFFS: Bool = false) throws -> Child {
            let script = ["set -e", ownBPFFS ? "mount -t bpf bpf '\(container.bpffs)'" : ":", "mount -o remount,bind,ro /", "exec \"$@\""].joined(separator: "\n")
            let mountNamespace = ["/usr/bin/unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, "sh"]
            return try Child("collector", container.arguments, prefix: netns + mountNamespace + Self.asContainer(uid: pod.uid, container.added))
        }

        var collectors: [Child] = []
        for container in containers {
            let child = try start(container)
            try child.waitFor("ready")
            #expect(child.stderr.contains("steering=ebpf"), "\(container.name): \(child.stderr)")
            collectors.append(child)
        }
        let sent = 3000
        // 5,000 pps: the manifest's collectors keep the default receive buffer (CAP_BPF only, no
        // SO_RCVBUFFORCE), and at 20,000 pps a 36 ms stall of one collector on a busy machine
        // overflowed it (26 counted socket_drops in one make test run).
        let publisher = try Child("publisher", ["127.0.0.1", "\(port)", "\(sent)", "--sources", "127.0.1.1-127.0.1.64", "--rate", "5000"], prefix: netns)
        #expect(publisher.wait() == 0, "\(publisher.stderr)")
        usleep(300_000)
        let reports = try collectors.map { try $0.stop() }
        #expect(reports.map { $0.int("received") }.reduce(0, +) == sent, "\(reports)")
        #expect(reports.allSatisfy { $0.int("received") > 0 }, "every collector gets sources: \(reports.map { $0.int("received") })")
        let sources = reports.map { Set($0.object("sources").keys) }
        for (i, a) in sources.enumerated() { for b in sources[(i + 1)...] { #expect(a.isDisjoint(with: b), "a source reached two collectors") } }
        #expect(sources.reduce(Set<String>()) { $0.union($1) }.count == 64)

        // Without the hostPath each container would have a bpffs of its own: the second refuses.
        let first = try start(containers[0], ownBPFFS: true)
        try first.waitFor("ready")
        let second = try start(containers[1], ownBPFFS: true)
        #expect(second.wait(seconds: 10) != 0)
        #expect(second.stderr.contains("no group is pinned"), "bpffsNotShared: \(second.stderr)")
        first.signal(SIGTERM)
        #expect(first.wait() == 0)
    }

    /// kubernetes-validate (PyPI, installed by scripts/setup.sh) on `files`.
    static func validate(_ files: [String]) throws -> (status: Int32, output: String) {
        try run("/usr/bin/env", ["python3", "-m", "kubernetes_validate", "--strict", "--quiet", "--kubernetes-version", kubernetesVersion] + files)
    }

    @Test("One version, written once: every image the manifests run, the Containerfile's default and the Makefile's VERSION are ProjectVersion.string; every tool's --version prints it")
    func oneVersion() throws {
        let root = Self.directory.deletingLastPathComponent()
        let version = ProjectVersion.string
        for file in try Self.manifestFiles() {
            let text = try String(contentsOf: file, encoding: .utf8)
            for line in text.split(separator: "\n") where line.contains("image: udp-fanout:") {
                #expect(line.hasSuffix("udp-fanout:\(version)"), "\(file.lastPathComponent): \(line)")
            }
        }
        let containerfile = try String(contentsOf: root.appendingPathComponent("Containerfile"), encoding: .utf8)
        #expect(containerfile.contains("ARG VERSION=\(version)\n"), "Containerfile's ARG VERSION")
        let make = try run("/usr/bin/make", ["-s", "-C", root.path, "print-version"])
        #expect(make.status == 0 && make.output.trimmingCharacters(in: .whitespacesAndNewlines) == version, "make print-version: \(make.output)")
        for tool in ["udp-fanout", "collector", "publisher"] {
            let printed = try run(binaryDirectory.appendingPathComponent(tool).path, ["--version"])
            #expect(printed.status == 0 && printed.output.trimmingCharacters(in: .whitespacesAndNewlines) == version, "\(tool) --version: \(printed.output)")
        }
    }

    @Test("every manifest in k8s/ validates with kubernetes-validate --strict against Kubernetes 1.30; a manifest with an unknown field fails")
    func manifestsValidate() throws {
        let installed = try run("/usr/bin/env", ["python3", "-c", "import kubernetes_validate"])
        try #require(installed.status == 0, "kubernetes-validate is missing: run scripts/setup.sh (pip install kubernetes-validate==1.37.0): \(installed.output)")
        let files = try Self.manifestFiles()
        #expect(files.count >= 6, "\(files)")
        let result = try Self.validate(files.map(\.path))
        #expect(result.status == 0, "\(result.output)")
        // The validator really reads the files: a misspelt field in a copy fails, naming it.
        let original = try String(contentsOf: Self.directory.appendingPathComponent("daemonset.yaml"), encoding: .utf8)
        try #require(original.contains("hostNetwork: true"))
        let broken = "/tmp/fanout-k8s-broken-\(UUID().uuidString).yaml"
        try original.replacingOccurrences(of: "hostNetwork: true", with: "hostNetwrk: true").write(toFile: broken, atomically: true, encoding: .utf8)
        defer { unlink(broken) }
        let refused = try Self.validate([broken])
        #expect(refused.status != 0, "a misspelt field must fail: \(refused.output)")
        #expect(refused.output.contains("hostNetwrk"), "\(refused.output)")
    }

    @Test("rbac.yaml grants what Kubernetes discovery does and no more: list and watch of discovery.k8s.io endpointslices, bound to the DaemonSets' service account")
    func rbacIsMinimal() throws {
        let all = try Self.documents()
        let roles = all.filter { ["Role", "ClusterRole"].contains($0.object["kind"] as? String) }
        try #require(roles.count == 1, "one role")
        let rules = try #require(roles[0].object["rules"] as? [[String: Any]])
        #expect(rules.count == 1)
        #expect(rules.first?["apiGroups"] as? [String] == ["discovery.k8s.io"])
        #expect(rules.first?["resources"] as? [String] == ["endpointslices"])
        #expect(Set(rules.first?["verbs"] as? [String] ?? []) == ["list", "watch"])
        let binding = try #require(all.first { ["RoleBinding", "ClusterRoleBinding"].contains($0.object["kind"] as? String) }?.object)
        let subjects = binding["subjects"] as? [[String: Any]] ?? []
        let accounts = Set(all.filter { $0.object["kind"] as? String == "DaemonSet" }.compactMap {
            (($0.object["spec"] as? [String: Any])?["template"] as? [String: Any]).flatMap { ($0["spec"] as? [String: Any])?["serviceAccountName"] as? String }
        })
        #expect(!accounts.isEmpty && accounts == Set(subjects.compactMap { $0["name"] as? String }), "bound: \(subjects), used: \(accounts)")
    }

    @Test("k8s/metallb/bgp.yaml: the BGP peer uses the BFD profile, the advertisement the pool that holds the Service's address, one /32 per node; the DaemonSets wait in preStop, within their grace period, for MetalLB to withdraw")
    func metallbBGP() throws {
        let text = try String(contentsOf: Self.directory.appendingPathComponent("metallb/bgp.yaml"), encoding: .utf8)
        let objects = try text.components(separatedBy: "\n---\n").compactMap { try Yams.load(yaml: $0) as? [String: Any] }
        func object(_ kind: String) throws -> [String: Any] {
            try #require(objects.first { $0["kind"] as? String == kind }, "\(kind) in k8s/metallb/bgp.yaml")
        }
        func name(_ object: [String: Any]) -> String? { (object["metadata"] as? [String: Any])?["name"] as? String }
        func spec(_ object: [String: Any]) -> [String: Any] { object["spec"] as? [String: Any] ?? [:] }
        #expect(Set(objects.compactMap { $0["apiVersion"] as? String }).isSubset(of: ["metallb.io/v1beta1", "metallb.io/v1beta2"]))
        #expect(objects.allSatisfy { ($0["metadata"] as? [String: Any])?["namespace"] as? String == "metallb-system" })
        let pool = try object("IPAddressPool"), bfd = try object("BFDProfile"), peer = try object("BGPPeer"), advertisement = try object("BGPAdvertisement")
        #expect(spec(peer)["bfdProfile"] as? String == name(bfd))
        #expect(spec(bfd)["detectMultiplier"] as? Int == 3 && spec(bfd)["receiveInterval"] as? Int == 100)
        #expect((spec(advertisement)["ipAddressPools"] as? [String]) == [name(pool)].compactMap { $0 })
        #expect(spec(advertisement)["aggregationLength"] as? Int == 32)
        let service = try #require(try Self.documents().first { $0.file == "service-metallb.yaml" }?.object)
        let address = try #require(((service["metadata"] as? [String: Any])?["annotations"] as? [String: String])?["metallb.universe.tf/loadBalancerIPs"])
        #expect((spec(pool)["addresses"] as? [String])?.contains("\(address)/32") == true, "the pool holds \(address)")
        for file in ["daemonset.yaml", "daemonset-tc-ebpf.yaml"] {
            let set = try #require(try Self.documents().first { $0.file == file && $0.object["kind"] as? String == "DaemonSet" }?.object)
            let pod = try #require(((set["spec"] as? [String: Any])?["template"] as? [String: Any])?["spec"] as? [String: Any])
            let container = try #require((pod["containers"] as? [[String: Any]])?.first)
            let sleep = (((container["lifecycle"] as? [String: Any])?["preStop"] as? [String: Any])?["sleep"] as? [String: Any])?["seconds"] as? Int
            let grace = pod["terminationGracePeriodSeconds"] as? Int ?? 30
            #expect(sleep.map { $0 >= 3 && $0 + 10 <= grace } == true, "\(file): preStop sleep \(sleep.map(String.init) ?? "none"), grace \(grace) s")
        }
    }
}
