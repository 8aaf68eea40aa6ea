// SPDX-License-Identifier: Apache-2.0
import ReusePortLB

/// The settings of userspace workers (relay's too; af_xdp's forwarders take the batch, CPU,
/// buffer and size keys), in the order their warnings come (``SettingsTable``).
enum UserspaceSettings {
    static let keys: [SettingKey] = [
        .integer("workers", 0...ReusePortMember.maximumCapacity, kinds: [UserspaceKind.self, RelayKind.self], scope: .workers,
                 doc: "Worker threads; 0: one per CPU the daemon may run on. Each has its own socket in a ReusePortLB group steered by worker_steering.",
                 get: { $0.workers }, set: { $0.workers = $1 }),
        .integer("batch_size", 1...1024, kinds: [UserspaceKind.self, RelayKind.self, AFXDPKind.self], scope: .workers,
                 doc: "Datagrams per recvmmsg/sendmmsg.",
                 get: { $0.batchSize }, set: { $0.batchSize = $1 }),
        .boolean("pin_cpus", kinds: [UserspaceKind.self, RelayKind.self, AFXDPKind.self], scope: .workers,
                 doc: "Pin worker i to the i-th CPU (mod their count) of those the daemon may run on.",
                 get: { $0.pinCPUs }, set: { $0.pinCPUs = $1 }),
        .integer("recv_buf_size", 0...(1 << 30), kinds: [UserspaceKind.self, RelayKind.self, AFXDPKind.self], scope: .workers,
                 doc: "Receive buffer per worker socket in bytes; 0: the system's (SO_RCVBUFFORCE as root, else SO_RCVBUF capped by net.core.rmem_max).",
                 get: { $0.recvBufSize }, set: { $0.recvBufSize = $1 }),
        .integer("max_packet_size", 1...65527, ipv4Maximum: 65507, kinds: [UserspaceKind.self, RelayKind.self, AFXDPKind.self], scope: .workers,
                 doc: "Largest datagram forwarded, in bytes (1-65507 for an IPv4 bind, 65527 for IPv6); a larger one is dropped with reason too_large, never forwarded cut.",
                 get: { $0.maxPacketSize }, set: { $0.maxPacketSize = $1 }),
        .integer("busy_wait_us", 0...1_000_000, kinds: [UserspaceKind.self, RelayKind.self], scope: .modes,
                 doc: "After a turn that had something to do, a worker polls its sockets without sleeping for up to this many microseconds before it sleeps: what comes meanwhile is served without a sleeping thread's wake-up (tens of µs in a virtual machine), at the price of a CPU spinning for the window after each burst. 0: it sleeps at once.",
                 get: { $0.busyWaitMicroseconds }, set: { $0.busyWaitMicroseconds = $1 }),
        .choice("worker_steering", WorkerSteering.self, kinds: [UserspaceKind.self, RelayKind.self], scope: .workers,
                doc: "How datagrams are spread over the workers: five_tuple keeps each flow on one worker (its order kept); source_ip keeps a source address on one worker; round_robin spreads one heavy flow over every worker and may reorder it.",
                get: { $0.workerSteering }, set: { $0.workerSteering = $1 }),
        .boolean("flow_templates", kinds: [UserspaceKind.self, TCKind.self, XDPKind.self, AFXDPKind.self], scope: .modes,
                 doc: "NetFlow v9 / IPFIX: keep each exporter's latest templates, copy them to every downstream when they change, and send them to a downstream that takes an exporter over (joined, came back, or the exporter moved) before its next datagram there. One-way listeners (not replies: nat).",
                 get: { $0.flowTemplates }, set: { $0.flowTemplates = $1 }),
    ]
}
