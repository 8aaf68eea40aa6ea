// SPDX-License-Identifier: Apache-2.0
/// A session socket whose downstream left the plan (reload, health, discovery). Its client has
/// moved on (a new session socket at its next datagram), but the downstream may still be
/// answering requests it took before it left: the socket stays open, in the worker's epoll set,
/// and what it receives is relayed to the client until ``until`` (`settings.drain_secs` after the
/// downstream left), then read and counted `drained`. It closes once it has been silent for
/// `session_idle_secs` after that. Owned by one worker, like the session it came from.
final class DrainingSocket {
    let socket: Int32
    /// Where the replies go: the session's client (held, so its address stays valid even if the
    /// session expires or the client moves again meanwhile).
    let session: RelaySession
    /// The reply counter of the downstream that left (by name: its total stays).
    let counter: RelayCounters.DownstreamReplies?
    /// Monotonic milliseconds until which replies are relayed; later ones are dropped, counted.
    let until: Int64
    /// Monotonic milliseconds of the last reply read (or of the downstream leaving).
    var lastActive: Int64

    init(socket: Int32, session: RelaySession, counter: RelayCounters.DownstreamReplies?, until: Int64, now: Int64) {
        self.socket = socket
        self.session = session
        self.counter = counter
        self.until = until
        lastActive = now
    }
}
