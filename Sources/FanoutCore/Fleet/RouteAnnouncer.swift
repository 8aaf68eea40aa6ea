// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import Logging
import ReusePortLB
import Synchronization
import SystemCalls

/// Publishes virtual addresses to the node's routing daemon (docs/fleet.md): each address is a
/// host route in the configured table while every listener on it is ready, and none otherwise.
/// BIRD (`protocol kernel { learn; }`) or FRR (`ip import-table`, `redistribute`) turn the
/// route into a BGP announcement, and its removal into a withdrawal.
///
/// ``apply(_:_:now:)`` is the whole state machine: called with what the listeners say, it adds
/// or removes routes where the answer changed; ``verify(_:)`` compares with the kernel table now
/// and then, to put back a route removed behind its back and remove one left by a crashed run.
package final class RouteAnnouncer: Sendable {
    /// One address: announced or not, since when, and why not.
    package struct Entry: Sendable, Equatable {
        package var announced = false
        /// Wall clock of the last change, seconds since the epoch.
        package var since: Double
        /// Why it is not announced (nil while it is).
        package var reason: String?
        /// Where the route is (while announced): a reload may move it.
        var table: UInt32 = 0
        var protocolNumber: UInt8 = 0
        package var announcements: UInt64 = 0
        package var withdrawals: UInt64 = 0
        /// The last failure adding or removing its route (logged once until it changes).
        var failure: String?
        /// Since when `reason` is the reason, and the last reason the log was told.
        var reasonSince: Double = 0
        var loggedReason: String?
    }

    /// How long a reason must last before the log says it (a start's passing reasons do not).
    static let reasonLogDelay = 2.0

    /// Where a route is: an address in a table with a protocol number.
    struct Place: Hashable {
        var address: IPAddress
        var table: UInt32
        var protocolNumber: UInt8
    }

    /// The addresses, and what the state machine cannot drop yet.
    struct State {
        var entries: [IPAddress: Entry] = [:]
        /// Routes left where a reload moved them from, whose removal failed: tried again at every
        /// check, with the last error said (logged when it changes).
        var stale: [Place: String] = [:]
        /// Set by a stop or a drain (``withdrawAll(reason:now:)``): nothing is announced any more.
        var sealed = false
        /// When an address was last withdrawn (wall clock; 0: never).
        var lastWithdrawal = 0.0
    }

    let routes: any HostRoutes
    let logger: Logger
    let state = Mutex(State())
    /// Route changes the kernel refused.
    let errors = Atomic<UInt64>(0)
    /// Routes that differed from what udp-fanout had set (removed or left by someone else) and were set right.
    let repairs = Atomic<UInt64>(0)

    package init(routes: any HostRoutes = KernelHostRoutes(), logger: Logger) {
        self.routes = routes
        self.logger = logger
    }

    /// Makes the routes follow `reasons`: an address with no reason is announced, one with
    /// reasons is withdrawn (the first reason is kept for /status). Addresses no longer
    /// configured are withdrawn and forgotten. `settings` nil: nothing is announced.
    package func apply(_ settings: Announce?, _ reasons: [IPAddress: [String]], now: Double) {
        state.withLock { state in
            retryStale(&state)
            for address in Array(state.entries.keys) where !(settings?.addresses.contains(address) ?? false) {
                if state.entries[address]!.announced { _ = withdraw(address, &state, reason: "no longer in announce.addresses", now: now) }
                if !state.entries[address]!.announced { state.entries[address] = nil }
            }
            guard let settings else { return }
            for address in settings.addresses {
                if state.entries[address] == nil { state.entries[address] = Entry(since: now, reason: "not checked yet") }
                let entry = state.entries[address]!
                let why = state.sealed ? ["udp-fanout is stopping"] : reasons[address] ?? ["no listener receives on it"]
                if let reason = why.first {
                    if entry.announced {
                        _ = withdraw(address, &state, reason: reason, now: now)
                    } else if state.sealed {
                        // Stopping: the withdrawal's reason stays (a drain's), nothing more logged.
                        continue
                    } else {
                        if entry.reason != reason {
                            state.entries[address]!.reason = reason
                            state.entries[address]!.reasonSince = now
                        }
                        // An address that stays withdrawn (not local, no healthy downstream) is
                        // in the log, not only in /status: once per reason that lasts.
                        let current = state.entries[address]!
                        if current.loggedReason != reason && now - current.reasonSince >= Self.reasonLogDelay {
                            state.entries[address]!.loggedReason = reason
                            logger.notice("not announced", metadata: ["address": "\(address)", "reason": "\(reason)"])
                        }
                    }
                } else if !entry.announced || entry.table != settings.table || entry.protocolNumber != settings.protocolNumber {
                    // Moved by a reload: the new route first, then the old one goes.
                    let previous = entry.announced ? Place(address: address, table: entry.table, protocolNumber: entry.protocolNumber) : nil
                    if announce(address, &state, settings, now: now) {
                        // Where it is now is not stale (a move back to a place whose removal failed).
                        state.stale[Place(address: address, table: settings.table, protocolNumber: settings.protocolNumber)] = nil
                        if let previous, previous.table != settings.table || previous.protocolNumber != settings.protocolNumber {
                            state.stale[previous] = ""
                            retryStale(&state)
                        }
                    }
                }
            }
        }
    }

    /// Removes the routes left where a reload moved them from; what fails stays for the next check.
    private func retryStale(_ state: inout State) {
        for (place, lastError) in state.stale {
            do {
                try routes.remove(place.address, table: place.table, protocolNumber: place.protocolNumber)
                state.stale[place] = nil
                logger.info("removed the route from where the announce settings moved it", metadata: [
                    "address": "\(place.address)", "table": "\(place.table)", "protocol": "\(place.protocolNumber)",
                ])
            } catch {
                errors.wrappingAdd(1, ordering: .relaxed)
                if lastError != "\(error)" {
                    logger.error("could not remove the route from where the announce settings moved it; tried again every check", metadata: [
                        "address": "\(place.address)", "table": "\(place.table)", "error": "\(error)",
                    ])
                }
                state.stale[place] = "\(error)"
            }
        }
    }

    /// Withdraws every announced address now (a stop, a drain), and announces nothing after.
    /// - Returns: the addresses withdrawn.
    @discardableResult
    package func withdrawAll(reason: String, now: Double) -> [IPAddress] {
        state.withLock { state in
            state.sealed = true
            retryStale(&state)
            var withdrawn: [IPAddress] = []
            for address in state.entries.keys.sorted(by: { "\($0)" < "\($1)" }) where state.entries[address]!.announced {
                if withdraw(address, &state, reason: reason, now: now) { withdrawn.append(address) }
            }
            return withdrawn
        }
    }

    /// When an address was last withdrawn (wall clock; 0: never).
    package var lastWithdrawal: Double { state.withLock { $0.lastWithdrawal } }

    /// Compares the kernel's table with what was set: an announced route that is missing is
    /// added again; a route of ours for a configured address that is not announced (a previous
    /// run's, after a crash) is removed. Routes of other addresses are left alone, even with
    /// our protocol number: another udp-fanout of this namespace may announce them. Each
    /// change is counted in repairs and logged.
    package func verify(_ settings: Announce?) {
        guard let settings else { return }
        state.withLock { state in
            let present: Set<IPAddress>
            do {
                present = try routes.list(table: settings.table, protocolNumber: settings.protocolNumber)
            } catch {
                errors.wrappingAdd(1, ordering: .relaxed)
                logger.error("could not read the announced routes back from the kernel", metadata: ["table": "\(settings.table)", "error": "\(error)"])
                return
            }
            for address in present where settings.addresses.contains(address) && state.entries[address]?.announced != true {
                do {
                    try routes.remove(address, table: settings.table, protocolNumber: settings.protocolNumber)
                    repairs.wrappingAdd(1, ordering: .relaxed)
                    logger.warning("removed a route announcing an address that is not ready (left by a previous run, or added by hand): the routing daemon would announce it", metadata: [
                        "address": "\(address)", "table": "\(settings.table)", "protocol": "\(settings.protocolNumber)",
                    ])
                } catch {
                    errors.wrappingAdd(1, ordering: .relaxed)
                }
            }
            // After a stop nothing is put back (a withdrawal that failed is retried by withdrawAll's caller).
            for (address, entry) in state.entries where !state.sealed && entry.announced && entry.table == settings.table && entry.protocolNumber == settings.protocolNumber && !present.contains(address) {
                do {
                    try routes.add(address, table: settings.table, protocolNumber: settings.protocolNumber)
                    repairs.wrappingAdd(1, ordering: .relaxed)
                    logger.warning("the route announcing an address was removed by something else (ip route, a network manager flushing foreign routes): added again", metadata: [
                        "address": "\(address)", "table": "\(settings.table)",
                    ])
                } catch {
                    errors.wrappingAdd(1, ordering: .relaxed)
                }
            }
        }
    }

    private func announce(_ address: IPAddress, _ state: inout State, _ settings: Announce, now: Double) -> Bool {
        var entry = state.entries[address]!
        defer { state.entries[address] = entry }
        do {
            try routes.add(address, table: settings.table, protocolNumber: settings.protocolNumber)
        } catch {
            failed(address, &entry, "could not add the route announcing the address", error)
            return false
        }
        entry = Entry(announced: true, since: now, reason: nil, table: settings.table, protocolNumber: settings.protocolNumber,
                      announcements: entry.announcements + 1, withdrawals: entry.withdrawals)
        logger.notice("announced: every listener on the address is ready", metadata: [
            "address": "\(address)", "table": "\(settings.table)", "protocol": "\(settings.protocolNumber)",
        ])
        return true
    }

    private func withdraw(_ address: IPAddress, _ state: inout State, reason: String, now: Double) -> Bool {
        var entry = state.entries[address]!
        defer { state.entries[address] = entry }
        do {
            try routes.remove(address, table: entry.table, protocolNumber: entry.protocolNumber)
        } catch {
            failed(address, &entry, "could not remove the route announcing the address: routers keep sending its traffic here", error)
            return false
        }
        entry.announced = false
        entry.since = now
        entry.reason = reason
        entry.reasonSince = now
        entry.loggedReason = reason
        entry.withdrawals += 1
        entry.failure = nil
        state.lastWithdrawal = now
        logger.notice("withdrawn", metadata: ["address": "\(address)", "reason": "\(reason)"])
        return true
    }

    private func failed(_ address: IPAddress, _ entry: inout Entry, _ message: String, _ error: SystemCallError) {
        errors.wrappingAdd(1, ordering: .relaxed)
        let text = "\(error)"
        if entry.failure != text {
            logger.error("\(message); tried again every check", metadata: ["address": "\(address)", "error": "\(text)"])
        }
        entry.failure = text
        if !entry.announced { entry.reason = "\(message): \(text)" }
    }

    /// Each address's entry now, sorted by address.
    package func snapshot() -> [(address: IPAddress, entry: Entry)] {
        state.withLock { $0.entries }.map { ($0.key, $0.value) }.sorted { "\($0.address)" < "\($1.address)" }
    }

    /// The Prometheus text: udp_fanout_announced, udp_fanout_announce_changes_total,
    /// udp_fanout_announce_errors_total, udp_fanout_announce_repairs_total. Empty while nothing
    /// is configured to be announced and nothing ever was.
    package func metricsText() -> String {
        let snapshot = snapshot()
        guard !snapshot.isEmpty || errors.load(ordering: .relaxed) > 0 else { return "" }
        var text = "# HELP udp_fanout_announced Whether the virtual address is announced now: its route is in the announce table, for the routing daemon (docs/fleet.md).\n# TYPE udp_fanout_announced gauge\n"
        for (address, entry) in snapshot { text += "udp_fanout_announced{address=\"\(address)\"} \(entry.announced ? 1 : 0)\n" }
        text += "# HELP udp_fanout_announce_changes_total Announcements and withdrawals of the virtual address.\n# TYPE udp_fanout_announce_changes_total counter\n"
        for (address, entry) in snapshot {
            text += "udp_fanout_announce_changes_total{address=\"\(address)\",action=\"announce\"} \(entry.announcements)\n"
            text += "udp_fanout_announce_changes_total{address=\"\(address)\",action=\"withdraw\"} \(entry.withdrawals)\n"
        }
        text += "# HELP udp_fanout_announce_errors_total Route changes or reads the kernel refused (logged; tried again every check).\n# TYPE udp_fanout_announce_errors_total counter\n"
        text += "udp_fanout_announce_errors_total \(errors.load(ordering: .relaxed))\n"
        text += "# HELP udp_fanout_announce_repairs_total Routes of the announce table that differed from what udp-fanout set (removed by something else, or left by a previous run) and were set right.\n# TYPE udp_fanout_announce_repairs_total counter\n"
        text += "udp_fanout_announce_repairs_total \(repairs.load(ordering: .relaxed))\n"
        return text
    }
}
