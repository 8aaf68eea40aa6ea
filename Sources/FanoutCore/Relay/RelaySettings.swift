// SPDX-License-Identifier: Apache-2.0

/// relay's settings (its sessions), in the order their warnings come (``SettingsTable``).
enum RelaySettings {
    static let keys: [SettingKey] = [
        .integer("max_sessions", 1...(1 << 20), kinds: [RelayKind.self], scope: .replies([.relay]),
                 doc: "replies: relay only: session sockets open at once; a new client beyond it is dropped and counted table_full.",
                 get: { $0.maxSessions }, set: { $0.maxSessions = $1 }),
        .integer("session_idle_secs", 1...86400, kinds: [RelayKind.self], scope: .replies([.relay]),
                 doc: "replies: relay only: a session with no datagram either way for this long is closed.",
                 get: { $0.sessionIdleSecs }, set: { $0.sessionIdleSecs = $1 }),
        .boolean("io_uring", kinds: [RelayKind.self], scope: .replies([.relay]),
                 doc: "replies: relay only: session sockets served through an io_uring, a batch per system call (false: one system call each).",
                 get: { $0.ioUring }, set: { $0.ioUring = $1 }),
    ]
}
