// SPDX-License-Identifier: Apache-2.0
import Testing
#if canImport(Glibc)
import Glibc
#endif
@testable import FanoutCore
import Logging
import ReusePortLB

/// The reference documents' configurations, unchanged.
enum ReferenceConfigs {
    /// 000 section 6.1 (the smoke test).
    static let smoke = """
        listeners:
          - name: test-fanout
            bind: "127.0.0.1:19000"
            mode: userspace
            downstream:
              - name: sink-1
                address: "127.0.0.1:19001"
              - name: sink-2
                address: "127.0.0.1:19002"
              - name: sink-3
                address: "127.0.0.1:19003"
            settings:
              workers: 1
        metrics:
          enabled: true
          bind: "127.0.0.1:19090"
          path: /metrics
        """
    /// 001 "Userspace Mode".
    static let userspace = """
        listeners:
          - name: syslog
            bind: "0.0.0.0:5514"
            mode: userspace
            downstream:
              - name: sink-1
                address: "10.0.0.1:5514"
              - name: sink-2
                address: "10.0.0.2:5514"
        """
    /// 001 "TC eBPF with Kubernetes Discovery".
    static let tcKubernetes = """
        listeners:
          - name: syslog
            bind: "0.0.0.0:5514"
            interface: eth0
            mode: tc_ebpf
            kubernetes:
              namespace: logging
              service: vector-receivers
              port: 5514

        health:
          enabled: true
          interval_secs: 5
          timeout_secs: 2
          protocol: icmp

        metrics:
          enabled: true
          bind: "0.0.0.0:9090"
        """
    /// 001 "AF_XDP with MetalLB".
    static let afXDP = """
        listeners:
          - name: market-data
            bind: "0.0.0.0:9000"
            interface: eth0
            mode: af_xdp
            kubernetes:
              namespace: trading
              service: udp-receivers
              port: 9000

        health:
          enabled: true
          protocol: udp_echo

        metrics:
          enabled: true
          bind: "0.0.0.0:9090"
        """
}

@Suite("Configuration")
struct ConfigTests {
    @Test("The daemon's kinds are the registry's, in the same order (validation and the daemon resolve a listener alike)")
    func kindRegistries() {
        let running = ListenerKinds(logger: Logger(label: "kinds")).all.map { ObjectIdentifier(type(of: $0)) }
        #expect(running == ListenerKinds.types.map { ObjectIdentifier($0) })
    }

    @Test("With several problems in one file, the first reported is the one checked first, as before the kinds owned their checks",
          arguments: [
            // userspace: xdp_tx before the family check and nat.
            ("  - name: a\n    bind: \"127.0.0.1:7000\"\n    replies: nat\n    settings: {output: xdp_tx}\n    downstream: [{name: d, address: \"[::1]:7001\"}]\n",
             "listeners[0].settings.output"),
            // relay: the family check before relay's own output and worker_steering checks.
            ("  - name: a\n    bind: \"127.0.0.1:7000\"\n    replies: relay\n    settings: {output: preserve_source, worker_steering: round_robin}\n    downstream: [{name: d, address: \"[::1]:7001\"}]\n",
             "listeners[0].downstream[0].address"),
            // af_xdp: zero_copy before the nat refusal.
            ("  - name: a\n    bind: \"198.18.0.1:7000\"\n    mode: af_xdp\n    interface: lo\n    replies: nat\n    settings: {zero_copy: on, xdp_mode: generic}\n    downstream: [{name: d, address: \"198.18.1.2:7001\"}]\n",
             "listeners[0].settings.zero_copy"),
            // tc_ebpf: an output key before nat's wildcard bind.
            ("  - name: a\n    bind: \"0.0.0.0:7000\"\n    mode: tc_ebpf\n    interface: lo\n    replies: nat\n    settings: {output: socket}\n    downstream: [{name: d, address: \"198.18.1.2:7001\"}]\n",
             "listeners[0].settings.output"),
            // Across listeners: tc_attach disagreement before the health section.
            ("  - name: a\n    bind: \"198.18.0.1:7000\"\n    mode: tc_ebpf\n    interface: lo\n    settings: {tc_attach: tcx}\n    downstream: [{name: d, address: \"198.18.1.2:7001\"}]\n"
             + "  - name: b\n    bind: \"198.18.0.1:7002\"\n    mode: tc_ebpf\n    interface: lo\n    settings: {tc_attach: clsact}\n    downstream: [{name: d, address: \"198.18.1.2:7003\"}]\n"
             + "health: {enabled: true, interval_secs: 1, timeout_secs: 2}\n",
             "listeners[0].settings.tc_attach"),
          ])
    func firstProblemFirst(_ listeners: String, _ key: String) throws {
        do {
            try ConfigParser.parse("listeners:\n" + listeners).validate(localAddresses: [])
            Issue.record("accepted: \(listeners)")
        } catch {
            #expect(error.key == key, "\(error)")
            #expect(error.line != nil, "\(error)")
        }
    }

    @Test("Every mode and replies pair is served by exactly one listener kind, the expected one; validation asks that kind")
    func kindsCoverEveryMode() throws {
        let expected: [Mode: String] = [.userspace: "UserspaceKind", .tcEBPF: "TCKind", .afXDP: "AFXDPKind", .xdp: "XDPKind"]
        for mode in Mode.allCases {
            for replies in Replies.allCases {
                let listener = Listener(name: "l", bind: SocketAddress("127.0.0.1:9000")!, mode: mode, downstreams: [], replies: replies)
                let serving = ListenerKinds.types.filter { $0.serves(listener) }.map { "\($0)" }
                let kind = mode == .userspace && replies == .relay ? "RelayKind" : expected[mode]
                #expect(serving == [kind], "mode \(mode.rawValue), replies \(replies.rawValue): \(serving)")
                #expect(ListenerKinds.type(for: listener).map { "\($0)" } == kind)
            }
        }
        // A kind's own check runs in validate(): relay's round_robin refusal.
        let relay = """
            listeners:
              - name: r
                bind: "127.0.0.1:9000"
                replies: relay
                settings: {worker_steering: round_robin}
                downstream: [{name: d, address: "127.0.0.1:9001"}]
            """
        #expect(throws: ConfigError.self) { try ConfigParser.parse(relay).validate() }
        do {
            try ConfigParser.parse(relay).validate()
        } catch {
            #expect(error.key == "listeners[0].settings.worker_steering" && error.line == 5, "\(error)")
        }
    }

    @Test("The smoke-test config of the reference parses and validates unchanged")
    func smoke() throws {
        let config = try ConfigParser.parse(ReferenceConfigs.smoke)
        try config.validate()
        #expect(config.listeners.count == 1)
        let listener = config.listeners[0]
        #expect(listener.name == "test-fanout" && listener.bind == SocketAddress("127.0.0.1:19000"))
        #expect(listener.downstreams.map(\.name) == ["sink-1", "sink-2", "sink-3"])
        #expect(listener.settings.workers == 1 && listener.settings.maxPacketSize == 9000 && listener.settings.batchSize == 32)
        #expect(config.metrics.enabled && config.metrics.bind == SocketAddress("127.0.0.1:19090") && config.metrics.path == "/metrics")
    }

    @Test("The reference README's configs parse and validate unchanged (Kubernetes discovery, health and af_xdp included)")
    func referenceExamples() throws {
        try ConfigParser.parse(ReferenceConfigs.userspace).validate(localAddresses: [])
        let tc = try ConfigParser.parse(ReferenceConfigs.tcKubernetes)
        #expect(tc.listeners[0].mode == .tcEBPF && tc.listeners[0].kubernetes?.service == "vector-receivers" && tc.health.enabled)
        #expect(tc.listeners[0].kubernetes == Kubernetes(namespace: "logging", service: "vector-receivers", port: 5514))
        #expect(tc.health.intervalSecs == 5 && tc.health.timeoutSecs == 2 && tc.health.proto == "icmp" && tc.health.fall == 3 && tc.health.rise == 1)
        try tc.validate()
        let xdp = try ConfigParser.parse(ReferenceConfigs.afXDP)
        #expect(xdp.health.proto == "udp_echo")
        try xdp.validate()
        let settings = xdp.listeners[0].settings
        #expect(xdp.listeners[0].mode == .afXDP && settings.output == .socket && settings.xdpMode == .auto && settings.queues == 0)
        #expect(settings.umemFrameSize == 4096 && settings.umemFrames == 4096 && settings.ringSize == 2048 && settings.zeroCopy == .auto && !settings.busyPoll)
    }

    @Test("af_xdp and output keys parse")
    func afXDPKeys() throws {
        let config = try ConfigParser.parse("""
            listeners:
              - name: x
                bind: "198.18.0.1:9000"
                interface: veth0
                mode: af_xdp
                settings: {xdp_mode: generic, queues: 2, output: xdp_tx, umem_frame_size: 2048, umem_frames: 8192, ring_size: 1024, zero_copy: "off", busy_poll: true}
                downstream: [{address: "198.18.1.2:9000"}]
              - name: u
                bind: "127.0.0.1:9001"
                settings: {output: preserve_source}
                downstream: [{address: "127.0.0.1:9002"}]
            """)
        try config.validate(localAddresses: [])
        let settings = config.listeners[0].settings
        #expect(settings.xdpMode == .generic && settings.queues == 2 && settings.output == .xdpTX)
        #expect(settings.umemFrameSize == 2048 && settings.umemFrames == 8192 && settings.ringSize == 1024 && settings.zeroCopy == .off && settings.busyPoll)
        #expect(config.listeners[1].settings.output == .preserveSource)
        #expect(config.warnings().isEmpty, "\(config.warnings())")
    }

    @Test("Our keys: balancing, weights, IPv6")
    func ourKeys() throws {
        let config = try ConfigParser.parse("""
            listeners:
              - name: v6
                bind: "[::1]:7000"
                balancing: source_ip
                downstream:
                  - address: "[::1]:7001"
                    weight: 3
                  - name: b
                    address: "127.0.0.1:7002"
                    weight: 0
            """)
        try config.validate()
        #expect(config.listeners[0].balancing == .sourceIP)
        #expect(config.listeners[0].downstreams.map(\.weight) == [3, 0])
        #expect(config.listeners[0].downstreams[0].name == "[::1]:7001", "name defaults to the address")
    }

    @Test("Two-way keys parse: replies nat with its settings, replies relay with its; the other's keys are warned about")
    func twoWayKeys() throws {
        let config = try ConfigParser.parse("""
            listeners:
              - name: coap
                bind: "198.18.0.1:5683"
                interface: veth0
                mode: tc_ebpf
                replies: nat
                settings: {max_associations: 4096, reply_interfaces: [veth1, veth2], max_sessions: 5, io_uring: false}
                downstream: [{address: "198.18.1.2:5683"}]
              - name: dns
                bind: "127.0.0.1:5300"
                replies: relay
                settings: {max_sessions: 100, session_idle_secs: 30, io_uring: false}
                downstream: [{address: "127.0.0.1:5301"}]
              - name: oneway
                bind: "127.0.0.1:5400"
                downstream: [{address: "127.0.0.1:5401"}]
            """)
        try config.validate(localAddresses: [])
        let (nat, relay, oneWay) = (config.listeners[0], config.listeners[1], config.listeners[2])
        #expect(nat.replies == .nat && nat.settings.maxAssociations == 4096 && nat.settings.replyInterfaces == ["veth1", "veth2"])
        #expect(relay.replies == .relay && relay.settings.maxSessions == 100 && relay.settings.sessionIdleSecs == 30 && !relay.settings.ioUring)
        #expect(oneWay.replies == .none && oneWay.settings.maxAssociations == 1_048_576 && oneWay.settings.maxSessions == 65_536 && oneWay.settings.ioUring)
        #expect(config.warnings().map(\.key) == ["listeners[0].settings.max_sessions", "listeners[0].settings.io_uring"], "\(config.warnings())")
        var ring = config
        ring.listeners[1].settings.ioUring = true
        #expect(ring.listeners[1].socketShape != config.listeners[1].socketShape, "turning io_uring on or off restarts the listener's workers")
        var changed = config
        changed.listeners[1].replies = .none
        #expect(changed.listeners[1].socketShape != config.listeners[1].socketShape, "turning replies on or off restarts the listener")
    }

    @Test("--check with replies nat: a reply interface that does not exist is a problem naming the key and the fix")
    func replyInterfacePreflight() throws {
        let config = try ConfigParser.parse("""
            listeners:
              - name: coap
                bind: "198.18.0.1:5683"
                interface: lo
                mode: tc_ebpf
                replies: nat
                settings: {reply_interfaces: [lo, nosuchif0]}
                downstream: [{address: "198.18.1.2:5683"}]
            """)
        let problems = TCPreflight.replyInterfaceProblems(config.listeners[0], path: "listeners[0]")
        #expect(problems.contains { $0.hasPrefix("listeners[0].settings.reply_interfaces[1]: listener 'coap': reply interface 'nosuchif0' not found") }, "\(problems)")
        #expect(!problems.contains { $0.contains("reply_interfaces[0]") && $0.contains("not found") }, "lo exists: \(problems)")
    }

    static let invalidCases: [(String, String, String)] = [
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    downstream: [{address: \"127.0.0.1:2\"}]\n    colour: blue\n",
         "listeners[0].colour", "unknown key"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1\"\n    downstream: [{address: \"127.0.0.1:2\"}]\n",
         "listeners[0].bind", "not an address with a port"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    downstream: [{address: \"300.0.0.1:2\"}]\n",
         "listeners[0].downstream[0].address", "not an address with a port"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    downstream: [{address: \"127.0.0.1:2\"}]\n  - name: a\n    bind: \"127.0.0.1:3\"\n    downstream: [{address: \"127.0.0.1:2\"}]\n",
         "listeners[1].name", "duplicate listener name"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    downstream: [{address: \"127.0.0.1:2\"}]\n  - name: b\n    bind: \"0.0.0.0:1\"\n    downstream: [{address: \"127.0.0.1:2\"}]\n",
         "listeners[1].bind", "overlaps"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n",
         "listeners[0].downstream", "empty, and no kubernetes discovery"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    downstream: [{address: \"127.0.0.1:1\"}]\n",
         "listeners[0].downstream[0].address", "forwarding loop"),
        ("listeners:\n  - name: a\n    bind: \"0.0.0.0:1\"\n    downstream: [{address: \"127.0.0.5:1\"}]\n",
         "listeners[0].downstream[0].address", "forwarding loop"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    mode: tc_ebpf\n    downstream: [{address: \"127.0.0.1:2\"}]\n",
         "listeners[0].interface", "attaches to a network interface"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    mode: turbo\n    downstream: [{address: \"127.0.0.1:2\"}]\n",
         "listeners[0].mode", "is not one of"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    downstream: [{address: \"127.0.0.1:2\"}]\n    settings: {max_packet_size: 70000}\n",
         "listeners[0].settings.max_packet_size", "out of range"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    downstream: [{address: \"127.0.0.1:2\", weight: 0}]\n",
         "listeners[0].downstream", "weight 0"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    downstream: [{address: \"127.0.0.1:2\"}]\nhealth: {enabled: true, interval_secs: 1, timeout_secs: 2}\n",
         "health.timeout_secs", "longer than interval_secs"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: tc_ebpf\n    downstream: [{address: \"[2001:db8::5]:2\"}]\n",
         "listeners[0].downstream[0].address", "not of the listener's address family"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: tc_ebpf\n    downstream: [{address: \"127.0.0.1:2\"}]\n",
         "listeners[0].downstream[0].address", "is an address of this host"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: tc_ebpf\n    settings: {tc_attach: xdp}\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].settings.tc_attach", "is not one of"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: tc_ebpf\n    downstream: [{address: \"198.18.1.2:2\"}]\n  - name: b\n    bind: \"198.18.0.1:3\"\n    interface: eth0\n    mode: tc_ebpf\n    settings: {tc_attach: clsact}\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].settings.tc_attach", "differs from listener 'b' on the same interface"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    mode: af_xdp\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].interface", "attaches to a network interface"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: af_xdp\n    downstream: [{address: \"198.18.1.2:2\"}]\n  - name: b\n    bind: \"198.18.0.1:3\"\n    interface: eth0\n    mode: af_xdp\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[1].interface", "one af_xdp listener per interface"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    settings: {output: xdp_tx}\n    downstream: [{address: \"127.0.0.1:2\"}]\n",
         "listeners[0].settings.output", "xdp_tx needs mode af_xdp"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: tc_ebpf\n    settings: {output: socket}\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].settings.output", "tc_ebpf forwards in the kernel"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: af_xdp\n    settings: {xdp_mode: turbo}\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].settings.xdp_mode", "is not one of"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: af_xdp\n    settings: {umem_frame_size: 3000}\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].settings.umem_frame_size", "2048 or 4096"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: af_xdp\n    settings: {ring_size: 1000}\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].settings.ring_size", "power of two"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: af_xdp\n    settings: {ring_size: 4096, umem_frames: 4096}\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].settings.umem_frames", "at least twice ring_size"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: af_xdp\n    settings: {queues: 65}\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].settings.queues", "out of range"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: af_xdp\n    downstream: [{address: \"198.18.1.2:2\"}]\n  - name: b\n    bind: \"0.0.0.0:1\"\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[1].bind", "overlaps"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: af_xdp\n    settings: {zero_copy: \"on\", xdp_mode: generic}\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].settings.zero_copy", "zero-copy needs the driver's XDP hook"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    settings: {output: preserve_source}\n    downstream: [{address: \"[::1]:2\"}]\n",
         "listeners[0].downstream[0].address", "not of the listener's address family"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    replies: nat\n    downstream: [{address: \"127.0.0.1:2\"}]\n",
         "listeners[0].replies", "nat rewrites both directions in the kernel: it needs mode tc_ebpf"),
        ("listeners:\n  - name: a\n    bind: \"0.0.0.0:1\"\n    interface: eth0\n    mode: tc_ebpf\n    replies: nat\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].bind", "must be the virtual address itself"),
        // xdp: tc_ebpf's rules in its own name, and one XDP program per interface.
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: xdp\n    settings: {output: socket}\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].settings.output", "socket: xdp forwards in the kernel"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: xdp\n    downstream: [{address: \"[2001:db8::2]:2\"}]\n",
         "listeners[0].downstream[0].address", "xdp rewrites the destination in place"),
        ("listeners:\n  - name: a\n    bind: \"0.0.0.0:1\"\n    interface: eth0\n    mode: xdp\n    replies: nat\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].bind", "must be the virtual address itself"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: xdp\n    downstream: [{address: \"198.18.1.2:2\"}]\n  - name: b\n    bind: \"198.18.0.1:3\"\n    interface: eth0\n    mode: af_xdp\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].interface", "an interface runs one XDP program"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: xdp\n    settings: {xdp_mode: native}\n    downstream: [{address: \"198.18.1.2:2\"}]\n  - name: b\n    bind: \"198.18.0.1:3\"\n    interface: eth0\n    mode: xdp\n    settings: {xdp_mode: generic}\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].settings.xdp_mode", "one XDP program per interface, set the same xdp_mode"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: xdp\n    settings: {tc_attach: tcx}\n    downstream: [{address: \"198.18.1.2:2\"}]\n  - name: b\n    bind: \"198.18.0.1:3\"\n    interface: eth0\n    mode: tc_ebpf\n    settings: {tc_attach: clsact}\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].settings.tc_attach", "one program per interface, set the same tc_attach"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: tc_ebpf\n    replies: relay\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].replies", "relay uses session sockets in userspace"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    replies: relay\n    settings: {output: preserve_source}\n    downstream: [{address: \"127.0.0.1:2\"}]\n",
         "listeners[0].settings.output", "must leave through them (output: socket)"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    replies: relay\n    settings: {worker_steering: round_robin}\n    downstream: [{address: \"127.0.0.1:2\"}]\n",
         "listeners[0].settings.worker_steering", "needs five_tuple or source_ip"),
        ("listeners:\n  - name: a\n    bind: \"127.0.0.1:1\"\n    replies: both\n    downstream: [{address: \"127.0.0.1:2\"}]\n",
         "listeners[0].replies", "is not one of none, nat, relay"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: tc_ebpf\n    replies: nat\n    settings: {max_associations: 8}\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].settings.max_associations", "out of range"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: tc_ebpf\n    replies: nat\n    settings: {reply_interfaces: [\"a/b\"]}\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[0].settings.reply_interfaces[0]", "expected an interface name"),
        ("listeners:\n  - name: a\n    bind: \"198.18.0.1:1\"\n    interface: eth0\n    mode: tc_ebpf\n    replies: nat\n    downstream: [{address: \"198.18.1.2:2\"}]\n  - name: b\n    bind: \"198.18.0.1:3\"\n    interface: eth0\n    mode: tc_ebpf\n    replies: nat\n    downstream: [{address: \"198.18.1.2:2\"}]\n",
         "listeners[1].downstream[0].address", "also a downstream of listener 'a' with replies nat"),
        ("listeners: []\n", "listeners", "empty"),
        ("metrics: {enabled: true}\n", "listeners", "required"),
        ("listeners: [\n", "(document)", "not valid YAML"),
    ]

    @Test("Invalid configurations: one message naming the key and the problem", arguments: invalidCases)
    func invalid(yaml: String, key: String, problem: String) {
        do {
            try ConfigParser.parse(yaml).validate(localAddresses: [])
            Issue.record("accepted: \(yaml)")
        } catch {
            #expect(error.key == key, "\(error)")
            #expect(error.problem.contains(problem), "\(error)")
        }
    }
}

extension ConfigTests {
    @Test("--check's summary names each listener's replication pools: balancing, members, sources, the sample of sources and way out; without pools it is what it always was")
    func checkSummaryPools() throws {
        let config = try ConfigParser.parse("""
            listeners:
              - name: nf
                bind: "127.0.0.1:2055"
                downstream: [{address: "127.0.0.1:9001"}]
                pools:
                  - {name: archive, balancing: all, downstream: [{address: "127.0.0.1:9002"}, {address: "127.0.0.1:9003"}]}
                  - {name: sampled, balancing: source_ip, sample: 10, sources: ["10.0.0.0/8"], output: preserve_source, downstream: [{address: "127.0.0.1:9004"}]}

            """)
        let summary = config.checkSummary
        #expect(summary.hasPrefix("configuration OK: 1 listener(s): nf 127.0.0.1:2055 userspace -> 1 downstream(s), round_robin"), "\(summary)")
        #expect(summary.contains(", pool archive -> 2 downstream(s), all, output socket, pool sampled -> 1 downstream(s), source_ip, sources 10.0.0.0/8, 1 source in 10, output preserve_source"), "\(summary)")
        // Without pools, what it always printed.
        let plain = try ConfigParser.parse("""
            listeners:
              - name: a
                bind: "127.0.0.1:7001"
                balancing: source_ip
                downstream: [{address: "127.0.0.1:7002"}, {address: "collector.example:7003"}]
              - name: b
                bind: "127.0.0.1:7011"
                kubernetes: {namespace: ops, service: receivers, port: 5514}
            health: {enabled: true, interval_secs: 2, timeout_secs: 1}

            """)
        #expect(plain.checkSummary == "configuration OK: 2 listener(s): a 127.0.0.1:7001 userspace -> 1 downstream(s) + DNS collector.example:7003, source_ip; b 127.0.0.1:7011 userspace -> 0 downstream(s) + Kubernetes ops/receivers:5514, round_robin; health icmp every 2 s", "\(plain.checkSummary)")
        // The kernel kinds' copies keep the client's source whatever the listener's output says.
        for mode in ["tc_ebpf", "xdp"] {
            let kernel = try ConfigParser.parse("""
                listeners:
                  - name: k
                    bind: "198.18.0.1:2055"
                    interface: eth0
                    mode: \(mode)
                    downstream: [{address: "198.18.1.2:9001"}]
                    pools:
                      - {name: archive, balancing: all, downstream: [{address: "198.18.2.2:9002"}]}

                """)
            #expect(kernel.checkSummary.contains(", pool archive -> 1 downstream(s), all, output preserve_source"), "\(mode): \(kernel.checkSummary)")
        }
    }
}

@Suite("Downstream selection")
struct SelectorTests {
    func storage(_ ip: String) -> sockaddr_storage {
        var storage = sockaddr_storage()
        _ = SocketAddress(ip: IPAddress(ip)!, port: 1).write(to: &storage)
        return storage
    }

    let three = (1...3).map { Downstream(name: "s\($0)", address: SocketAddress("127.0.0.1:\(19000 + $0)")!) }

    @Test("Round robin cycles; weights give proportional shares in a smooth order")
    func rotation() {
        var selector = DownstreamSelector(downstreams: three, balancing: .roundRobin)
        var source = storage("127.0.0.9")
        #expect((0..<6).map { _ in selector.pick(source: &source)! } == [0, 1, 2, 0, 1, 2])
        #expect(DownstreamSelector.rotation(weights: [1, 3]).sorted() == [0, 1, 1, 1])
        #expect(DownstreamSelector.rotation(weights: [5, 1, 1]) == [0, 0, 1, 0, 2, 0, 0])
        #expect(DownstreamSelector.rotation(weights: [0, 2]) == [1])
        #expect(DownstreamSelector.rotation(weights: [1_000_000, 1]).count <= 4096)
    }

    @Test("Source IP: sticky, the same on every node with the same downstreams, about 1/N moves when one goes")
    func sourceIP() {
        var a = DownstreamSelector(downstreams: three, balancing: .sourceIP)
        var b = DownstreamSelector(downstreams: three, balancing: .sourceIP)
        var without = DownstreamSelector(downstreams: Array(three.prefix(2)) + [Downstream(name: "s3", address: three[2].address, weight: 0)], balancing: .sourceIP)
        var counts = [0, 0, 0]
        var moved = 0
        for index in 0..<3000 {
            var source = storage("10.\(index / 250).\(index % 250).1")
            let choice = a.pick(source: &source)!
            #expect(choice == a.pick(source: &source) && choice == b.pick(source: &source))
            counts[choice] += 1
            let after = without.pick(source: &source)!
            if after != choice {
                moved += 1
                #expect(choice == 2, "only the removed downstream's sources move")
            }
        }
        for count in counts { #expect((800...1200).contains(count), "\(counts)") }
        #expect(moved == counts[2])
        var v6 = storage("2001:db8::1")
        #expect(a.pick(source: &v6) == b.pick(source: &v6))
    }
}
