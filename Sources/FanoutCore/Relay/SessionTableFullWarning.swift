// SPDX-License-Identifier: Apache-2.0
import Logging
import Synchronization

/// The warning that a `replies: relay` listener turns new clients away because its session table
/// holds `settings.max_sessions` sessions (the `table_full` drop): counted per datagram, but an
/// operator reading the log must see it too. The first refusal is said at once, then at most one
/// line per ``interval`` with how many datagrams were refused since the previous line, so a
/// flood of new clients cannot flood the log. One per listener instance, shared by its workers
/// (``RelaySessionCount``); lock-free, and touched only in batches that refused something.
final class SessionTableFullWarning: Sendable {
    /// The least time between two lines, in milliseconds.
    static let interval: Int64 = 10_000
    let maxSessions: Int
    private let refused = Atomic<UInt64>(0)
    /// When the next line may be written (CLOCK_MONOTONIC ms); the first refusal may at once.
    private let nextLine = Atomic<Int64>(.min)

    init(maxSessions: Int) {
        self.maxSessions = maxSessions
    }

    /// Adds `count` refusals at `now` (ms); returns the refusals to report when a line is due
    /// (the worker that wins the exchange writes it), nil otherwise.
    func due(_ count: UInt64, now: Int64) -> UInt64? {
        refused.wrappingAdd(count, ordering: .relaxed)
        let next = nextLine.load(ordering: .relaxed)
        guard now >= next, nextLine.compareExchange(expected: next, desired: now + Self.interval, ordering: .relaxed).exchanged else { return nil }
        return refused.exchange(0, ordering: .relaxed)
    }

    /// Logs the warning if one is due.
    /// - Parameters:
    ///   - count: datagrams of new clients the batch refused (0: nothing to say).
    ///   - listener: the listener's name, for the line.
    func record(_ count: UInt64, listener: String, logger: Logger) {
        guard count > 0, let since = due(count, now: monotonicMilliseconds()) else { return }
        logger.warning("relay session table full: datagrams of new clients are refused (counted table_full); raise settings.max_sessions, or lower settings.session_idle_secs so idle sessions leave sooner", metadata: [
            "listener": "\(listener)", "max_sessions": "\(maxSessions)", "refused_since_last_line": "\(since)",
        ])
    }
}
