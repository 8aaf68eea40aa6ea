// SPDX-License-Identifier: Apache-2.0
import ServiceLifecycle

/// Keeps the `announce` addresses' routes in line with readiness (`RouteAnnouncer`): a check
/// every 200 ms, a comparison with the kernel's table every 5 s. At
/// its end (after the listeners stopped: it stops after ``ForwardingService``) every address
/// still announced is withdrawn.
public struct AnnounceService: Service {
    let daemon: FanoutDaemon
    /// How soon a listener that becomes unready is withdrawn, and a ready one announced.
    static let checkInterval = Duration.milliseconds(200)
    static let verifyInterval = Duration.seconds(5)

    public init(daemon: FanoutDaemon) {
        self.daemon = daemon
    }

    public func run() async throws {
        var sinceVerify = Self.verifyInterval
        // Netlink requests block briefly: off the cooperative pool.
        while !Task.isShuttingDownGracefully, !Task.isCancelled {
            let verify = sinceVerify >= Self.verifyInterval
            if verify { sinceVerify = .zero }
            await offCooperativePool("fanout-announce") { daemon.reconcileAnnouncements(verify: verify) }
            do {
                try await cancelWhenGracefulShutdown { try await Task.sleep(for: Self.checkInterval) }
            } catch {
                break
            }
            sinceVerify += Self.checkInterval
        }
        await offCooperativePool("fanout-announce") {
            daemon.announcer.withdrawAll(reason: "udp-fanout stopped", now: WallClock.seconds())
        }
    }
}

extension AnnounceService: CustomStringConvertible {
    public var description: String { "AnnounceService" }
}
