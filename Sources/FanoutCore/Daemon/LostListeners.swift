// SPDX-License-Identifier: Apache-2.0
extension FanoutDaemon {
    /// `udp_fanout_listeners_lost`: listeners of the configuration in force that are not running
    /// because a change failed and they could not be started again (`/readyz` names them; the
    /// next reload that applies starts them). A gauge, so an alert needs no log scraping:
    /// `/healthz` stays 200 then (docs/udp-fanout.md, "Health endpoints").
    func lostListenersMetrics() -> String {
        let lost = state.withLock { $0.lost.count }
        return """
            # HELP udp_fanout_listeners_lost Listeners of the configuration in force that are not running: a change failed and they could not be started again
            # TYPE udp_fanout_listeners_lost gauge
            udp_fanout_listeners_lost \(lost)

            """
    }
}
