// SPDX-License-Identifier: Apache-2.0
import ReusePortLB
import Synchronization

/// The sessions open in one instance of a `replies: relay` listener, over all its workers (so
/// `settings.max_sessions` bounds the listener, not each worker): the associations gauge.
final class RelaySessionCount: Sendable {
    let maxSessions: Int
    let open = Atomic<Int>(0)
    /// Says when new clients are turned away (``admit()`` false), rate-limited for the listener.
    let tableFullWarning: SessionTableFullWarning

    init(maxSessions: Int) {
        self.maxSessions = maxSessions
        tableFullWarning = SessionTableFullWarning(maxSessions: maxSessions)
    }

    /// Takes one session slot; false when `maxSessions` are open (nothing taken).
    func admit() -> Bool { take(open) }

    /// Takes one slot of `slots` if fewer than `maxSessions` are taken.
    private func take(_ slots: borrowing Atomic<Int>) -> Bool {
        if slots.wrappingAdd(1, ordering: .relaxed).newValue <= maxSessions { return true }
        // Over the bound: give the slot back. Two workers racing may both see "full" for an
        // instant; neither ever holds more than the bound.
        slots.wrappingSubtract(1, ordering: .relaxed)
        return false
    }

    func release(_ count: Int = 1) {
        if count > 0 { open.wrappingSubtract(count, ordering: .relaxed) }
    }

    /// Draining session sockets (their downstream left; see ``DrainingSocket``): not sessions,
    /// so not in the gauge nor under `maxSessions`, but bounded by it too, so that health
    /// flapping cannot pile up sockets past the open-files limit.
    let draining = Atomic<Int>(0)

    /// Takes a draining slot; false when `maxSessions` sockets drain already (nothing taken).
    func admitDraining() -> Bool { take(draining) }

    /// Takes a draining slot whatever the bound: a handed-over instance turns every session into
    /// a draining socket, so its sockets do not grow in number (its sessions release theirs).
    func forceDraining() { draining.wrappingAdd(1, ordering: .relaxed) }

    func releaseDraining(_ count: Int = 1) {
        if count > 0 { draining.wrappingSubtract(count, ordering: .relaxed) }
    }
}

/// The reply-side totals of a `replies: relay` listener. One per listener name, held by its
/// ``ListenerCounters`` (``ListenerCounters/relayCounters()``), so every instance adds to the
/// same totals: a restarted listener's old instance, which relays until the new one has taken
/// the bind over, too. Workers add once per batch.
final class RelayCounters: Sendable {
    let replies = Atomic<UInt64>(0)
    let replyBytes = Atomic<UInt64>(0)
    let replySendBufferFull = Atomic<UInt64>(0)
    let replySendError = Atomic<UInt64>(0)
    /// `amplification`: replies dropped for a client not yet validated.
    let amplificationCapped = Atomic<UInt64>(0)
    /// A reply larger than settings.max_packet_size (MSG_TRUNC): never relayed cut.
    let replyTooLarge = Atomic<UInt64>(0)
    /// ICMP unreachable read on a session socket: a request the downstream refused.
    let downstreamUnreachable = Atomic<UInt64>(0)
    /// A reply read on a draining socket after `settings.drain_secs` (``DrainingSocket``).
    let drained = Atomic<UInt64>(0)
    /// Replies the previous process had staged when it crashed (``CrashLedger``).
    let crash = Atomic<UInt64>(0)
    let created = Atomic<UInt64>(0)
    let moved = Atomic<UInt64>(0)
    let expired = Atomic<UInt64>(0)
    let tableFull = Atomic<UInt64>(0)
    let handedOver = Atomic<UInt64>(0)
    /// Session-socket sends and receives done through the workers' io_urings (not exported: the
    /// workers' "entering receive loop" lines and a failed ring's error line say which path runs).
    let ringSends = Atomic<UInt64>(0)
    let ringReceives = Atomic<UInt64>(0)
    /// Replies per downstream name; a name stays once seen (its total must not go back).
    private let downstreams = Mutex<[String: DownstreamReplies]>([:])

    final class DownstreamReplies: Sendable {
        let replies = Atomic<UInt64>(0)
    }

    /// The counter of replies from downstream `name` (made on first use; a plan change, not a datagram).
    func downstream(_ name: String) -> DownstreamReplies { kept(name, in: downstreams, make: DownstreamReplies.init) }

    /// The totals, with `sessions` (the running instance's) as the associations gauge.
    func snapshot(sessions: RelaySessionCount) -> TwoWaySnapshot {
        var snapshot = TwoWaySnapshot()
        snapshot.replies = replies.load(ordering: .relaxed)
        snapshot.replyBytes = replyBytes.load(ordering: .relaxed)
        snapshot.replyDropped = [
            .sendBufferFull: replySendBufferFull.load(ordering: .relaxed),
            .sendError: replySendError.load(ordering: .relaxed),
            .tooLarge: replyTooLarge.load(ordering: .relaxed),
            .downstreamUnreachable: downstreamUnreachable.load(ordering: .relaxed),
            .drained: drained.load(ordering: .relaxed),
            .crash: crash.load(ordering: .relaxed),
            .amplificationCapped: amplificationCapped.load(ordering: .relaxed),
        ]
        snapshot.associations = UInt64(max(0, sessions.open.load(ordering: .relaxed)))
        snapshot.events = [
            .created: created.load(ordering: .relaxed), .moved: moved.load(ordering: .relaxed),
            .expired: expired.load(ordering: .relaxed), .tableFull: tableFull.load(ordering: .relaxed),
            .handedOver: handedOver.load(ordering: .relaxed),
        ]
        snapshot.downstreamReplies = downstreams.withLock { $0.mapValues { $0.replies.load(ordering: .relaxed) } }
        snapshot.ringSends = ringSends.load(ordering: .relaxed)
        snapshot.ringReceives = ringReceives.load(ordering: .relaxed)
        return snapshot
    }
}
