// SPDX-License-Identifier: Apache-2.0
import ReusePortLB

/// A downstream given by DNS name (`downstream[].address: name:port`): every A/AAAA record is a
/// member named `entry/address`, with the entry's weight and health port.
struct DNSSource: DiscoverySource {
    static let kind = "dns"

    static func sources(of listener: Listener) -> [DNSSource] {
        listener.memberGroups.flatMap { group in
            group.dnsDownstreams.map {
                DNSSource(listener: listener.name, pool: group.pool, entry: $0.name, host: $0.host, port: $0.port,
                          maximumInterval: listener.settings.resolveIntervalSecs, weight: $0.weight, healthPort: $0.healthPort)
            }
        }
    }

    let listener: String
    let pool: String?
    /// The entry's name (`downstream[].name`, else its `name:port`).
    let entry: String
    let host: String
    let port: UInt16
    /// `settings.resolve_interval_secs`.
    let maximumInterval: Int
    /// Not part of what it is (``==``): a reload that changes only these keeps the watcher and
    /// applies them to the set it has.
    let weight: UInt32
    let healthPort: UInt16?

    var slot: String { "\(pool.map { "pool/\($0)/" } ?? "")dns/\(entry)" }
    var label: String { "DNS \(host)" }
    var waiting: String { "waiting for the first resolution of \(host)" }
    var description: String { "\(listener)/\(pool.map { "pool/\($0)/" } ?? "")dns/\(entry)/\(host):\(port)" }

    static func == (lhs: DNSSource, rhs: DNSSource) -> Bool {
        (lhs.listener, lhs.pool, lhs.entry, lhs.host, lhs.port, lhs.maximumInterval) == (rhs.listener, rhs.pool, rhs.entry, rhs.host, rhs.port, rhs.maximumInterval)
    }

    func hash(into hasher: inout Hasher) {
        hasher.combine(listener)
        hasher.combine(pool)
        hasher.combine(entry)
        hasher.combine(host)
        hasher.combine(port)
        hasher.combine(maximumInterval)
    }

    func members(_ found: [Downstream]) -> [Downstream] {
        found.map(\.address).sorted { $0.description < $1.description }.map {
            Downstream(name: "\(entry)/\($0.ip)", address: $0, weight: weight, healthPort: healthPort, pool: pool)
        }
    }

    func watch(_ run: DiscoveryRun, restart: Never?) async {
        let watcher = DNSWatcher(
            host: host, port: port, maximumInterval: .seconds(maximumInterval), resolver: DNSResolver(), logger: run.logger,
            // /readyz quotes it while the first resolution is pending.
            onFailure: { error in run.failed(error.description) }
        ) { addresses in
            run.found(addresses.map { Downstream(name: "", address: $0) })
        }
        run.serveMetrics { watcher.metricsText() }
        do {
            try await watcher.run()
        } catch {
            run.failed("\(error)")
            run.logger.error("DNS discovery stopped", metadata: ["listener": "\(listener)", "name": "\(host)", "error": "\(error)"])
        }
    }
}
