// SPDX-License-Identifier: Apache-2.0
#if canImport(Glibc)
import Glibc
#endif
import ReusePortLB

/// One downstream found by discovery: where to send and the name metrics and logs show.
struct DiscoveredEndpoint: Hashable, Sendable, CustomStringConvertible {
    /// The endpoint's targetRef name (the pod) if present, else its address; then `:port`.
    var name: String
    var address: SocketAddress

    var description: String { "\(name)=\(address)" }
}

// Codable models of only the fields used (discovery.k8s.io/v1). Everything the API allows to
// be absent is optional; unknown fields are ignored by the decoder.

struct ObjectMeta: Decodable, Sendable {
    var name: String?
    var resourceVersion: String?
}

struct ListMeta: Decodable, Sendable {
    var resourceVersion: String?
    var `continue`: String?
}

struct EndpointSlice: Decodable, Sendable {
    struct Endpoint: Decodable, Sendable {
        struct Conditions: Decodable, Sendable {
            var ready: Bool?
            var serving: Bool?
            var terminating: Bool?
        }
        struct TargetRef: Decodable, Sendable {
            var name: String?
        }
        var addresses: [String]?
        var conditions: Conditions?
        var targetRef: TargetRef?
    }
    var metadata: ObjectMeta?
    /// `IPv4`, `IPv6` or `FQDN`.
    var addressType: String?
    var endpoints: [Endpoint]?
}

struct EndpointSliceList: Decodable, Sendable {
    var metadata: ListMeta?
    var items: [EndpointSlice]?
}

/// `metav1.Status`, the object of a watch ERROR event and the body of an error answer.
struct APIStatus: Decodable, Sendable {
    var code: Int?
    var reason: String?
    var message: String?
}

/// One line of a watch stream; `object` is decoded per `type`.
struct WatchEventHeader: Decodable, Sendable {
    var type: String?
}
struct WatchEvent<Object: Decodable & Sendable>: Decodable, Sendable {
    var object: Object?
}

/// Which endpoints of a service's slices become downstreams.
///
/// Rule (from the EndpointConditions API documentation): an endpoint is in when `ready` is true
/// or absent ("a nil value should be interpreted as true"). A terminating endpoint is never
/// ready, but while it is still `serving` it can take traffic: such endpoints are used only
/// when no endpoint of the service is ready, the way kube-proxy falls back to
/// serving-terminating endpoints, so a rolling update that leaves no ready pod for a moment
/// does not drop every datagram. `serving` absent defers to `ready`; `terminating` absent is
/// false.
enum EndpointSelection {
    /// What the slices hold, and what was left out and why (for debug logs and counters).
    struct Outcome: Equatable {
        var endpoints: [DiscoveredEndpoint]
        /// Slices of addressType FQDN (not resolvable to a downstream here).
        var fqdnSlices: [String] = []
        /// Address strings that are not IP addresses of the slice's type.
        var malformedAddresses: [String] = []
        /// True when no endpoint was ready and serving-terminating ones were used.
        var usedTerminating = false
    }

    /// The service's endpoint set: union over its slices, deduplicated by address (the first
    /// slice by name wins the name), sorted by address text.
    static func endpoints(of slices: [String: EndpointSlice], port: UInt16) -> Outcome {
        var ready: [SocketAddress: String] = [:]
        var servingTerminating: [SocketAddress: String] = [:]
        var outcome = Outcome(endpoints: [])
        for sliceName in slices.keys.sorted() {
            guard let slice = slices[sliceName] else { continue }
            switch slice.addressType {
            case "IPv4", "IPv6": break
            default:
                outcome.fqdnSlices.append(sliceName)
                continue
            }
            let wantsV6 = slice.addressType == "IPv6"
            for endpoint in slice.endpoints ?? [] {
                let conditions = endpoint.conditions
                let isReady = conditions?.ready ?? true
                let isServing = conditions?.serving ?? isReady
                let isTerminating = conditions?.terminating ?? false
                guard isReady || (isServing && isTerminating) else { continue }
                // The API allows several addresses but says consumers use the first (they are
                // fungible); the others are the same endpoint.
                guard let text = endpoint.addresses?.first else { continue }
                guard let ip = IPAddress(text), (ip.family == AF_INET6) == wantsV6 else {
                    outcome.malformedAddresses.append(text)
                    continue
                }
                let address = SocketAddress(ip: ip, port: port)
                let name = (endpoint.targetRef?.name).map { "\($0):\(port)" } ?? address.description
                if isReady {
                    if ready[address] == nil { ready[address] = name }
                } else if servingTerminating[address] == nil {
                    servingTerminating[address] = name
                }
            }
        }
        var chosen = ready
        if chosen.isEmpty && !servingTerminating.isEmpty {
            chosen = servingTerminating
            outcome.usedTerminating = true
        }
        outcome.endpoints = chosen.map { DiscoveredEndpoint(name: $0.value, address: $0.key) }
            .sorted { a, b in
                // IPv4 before IPv6, then by address bytes: a stable order for logs and tests.
                let (x, y) = (a.address.ip.bytes, b.address.ip.bytes)
                return x.count != y.count ? x.count < y.count : x.lexicographicallyPrecedes(y)
            }
        return outcome
    }
}
