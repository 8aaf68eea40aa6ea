// SPDX-License-Identifier: Apache-2.0

/// af_xdp's settings (xdp_mode is xdp's too), in the order their warnings come (``SettingsTable``).
enum AFXDPSettings {
    static let keys: [SettingKey] = [
        .choice("xdp_mode", XDPMode.self, kinds: [AFXDPKind.self, XDPKind.self], scope: .modes,
                doc: "af_xdp and xdp: how the XDP program attaches. auto: native, else generic with a warning. xdp listeners on one interface must agree.",
                get: { $0.xdpMode }, set: { $0.xdpMode = $1 }),
        .integer("queues", 0...Settings.maximumQueues, kinds: [AFXDPKind.self], scope: .modes,
                 doc: "af_xdp: RX queues served from queue 0; 0: every RX queue of the interface.",
                 get: { $0.queues }, set: { $0.queues = $1 }),
        .integer("umem_frame_size", 2048...4096, only: .values([2048, 4096], reason: "AF_XDP aligned frames"), kinds: [AFXDPKind.self], scope: .modes,
                 doc: "af_xdp: bytes per UMEM frame, 2048 or 4096.",
                 get: { $0.umemFrameSize }, set: { $0.umemFrameSize = $1 }),
        .integer("umem_frames", 64...(1 << 20), kinds: [AFXDPKind.self], scope: .modes,
                 doc: "af_xdp: UMEM frames per queue; at least twice ring_size.",
                 get: { $0.umemFrames }, set: { $0.umemFrames = $1 }),
        .integer("ring_size", 64...16384, only: .powersOfTwo, kinds: [AFXDPKind.self], scope: .modes,
                 doc: "af_xdp: entries of the RX, TX, fill and completion rings: a power of two, 64 to 16384.",
                 get: { $0.ringSize }, set: { $0.ringSize = $1 }),
        .choice("zero_copy", ZeroCopy.self, kinds: [AFXDPKind.self], scope: .modes,
                doc: "af_xdp: zero-copy binding where the driver has it (auto falls back to copy mode, logged), always (on), or never (off).",
                get: { $0.zeroCopy }, set: { $0.zeroCopy = $1 }),
        .boolean("busy_poll", kinds: [AFXDPKind.self], scope: .modes,
                 doc: "af_xdp: SO_PREFER_BUSY_POLL on the sockets (lower latency, more CPU).",
                 get: { $0.busyPoll }, set: { $0.busyPoll = $1 }),
    ]
}
