// SPDX-License-Identifier: Apache-2.0
/// Why Kubernetes discovery cannot reach or understand the API server. Each case names the
/// problem and the fix; the watcher logs and counts it, and retries where retrying can help.
enum DiscoveryError: Error, CustomStringConvertible, Sendable {
    /// Neither in a cluster nor a kubeconfig to read.
    case noConfiguration(checked: [String])
    /// A file the configuration names cannot be read.
    case unreadable(path: String, problem: String)
    /// The kubeconfig is not usable (malformed, or a name it refers to is missing).
    case kubeconfig(path: String, problem: String)
    /// A PEM certificate or key (file or `-data`) that NIOSSL cannot load.
    case certificate(what: String, problem: String)
    /// The API server answered 401: the credentials are not accepted.
    case unauthorized(url: String, message: String)
    /// The API server answered 403: the identity may not list/watch EndpointSlices.
    case forbidden(url: String, message: String)
    /// Any other unexpected HTTP status.
    case httpStatus(url: String, status: UInt, message: String)
    /// 410 Gone: the resourceVersion is too old (or a list continue token expired): relist.
    case gone(message: String)
    /// The request failed below HTTP (connect, TLS, reset, timeout).
    case transport(url: String, problem: String)
    /// A list answer that is not an EndpointSliceList.
    case malformedList(url: String, problem: String)
    /// A watch delivered nothing, not even its end, for longer than its own timeout.
    case watchStalled(seconds: Int)
    /// A watch event line longer than the bound kept in memory.
    case eventTooLarge(bytes: Int)

    var description: String {
        switch self {
        case .noConfiguration(let checked):
            return "no Kubernetes API configuration: KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set (not in a pod) "
                + "and no kubeconfig was found (checked \(checked.joined(separator: ", "))); run in a pod with a service account, "
                + "or set KUBECONFIG to a kubeconfig file"
        case .unreadable(let path, let problem):
            return "cannot read \(path): \(problem); mount or create it (in a pod: automountServiceAccountToken must not be false)"
        case .kubeconfig(let path, let problem):
            return "kubeconfig \(path): \(problem); fix the file or point KUBECONFIG at a working one (kubectl --kubeconfig \(path) get endpointslices checks it)"
        case .certificate(let what, let problem):
            return "cannot load \(what): \(problem); it must be PEM (base64 of PEM for the -data keys)"
        case .unauthorized(let url, let message):
            return "the API server refused the credentials (HTTP 401) for \(url): \(message); "
                + "the token or client certificate is not valid: check the service account token file (it is re-read on every request) or the kubeconfig user"
        case .forbidden(let url, let message):
            return "the API server forbids listing EndpointSlices (HTTP 403) for \(url): \(message); "
                + "grant the service account RBAC verbs list and watch on endpointslices in API group discovery.k8s.io (a Role in the watched namespace, or a ClusterRole; see docs/kubernetes.md)"
        case .httpStatus(let url, let status, let message):
            return "unexpected HTTP \(status) from the API server for \(url): \(message); check the server address and the API server's health"
        case .gone(let message):
            return "resourceVersion too old (410 Gone): \(message); listing again"
        case .transport(let url, let problem):
            return "cannot reach the API server at \(url): \(problem); check the server address, the network path and the CA (certificate-authority or ca.crt)"
        case .malformedList(let url, let problem):
            return "the answer to \(url) is not an EndpointSliceList: \(problem); is the server a Kubernetes API server of version 1.21 or later (discovery.k8s.io/v1)?"
        case .watchStalled(let seconds):
            return "the watch delivered nothing for \(seconds) s, longer than its own timeout; the connection is taken as dead and the watch restarted"
        case .eventTooLarge(let bytes):
            return "a watch event line exceeds \(bytes) bytes; the watch is restarted (an EndpointSlice holds at most 1000 endpoints, so this is not one)"
        }
    }

    /// The `reason` label of `udp_fanout_discovery_errors_total`.
    var reason: String {
        switch self {
        case .noConfiguration, .unreadable, .kubeconfig, .certificate: return "credentials"
        case .unauthorized: return "unauthorized"
        case .forbidden: return "forbidden"
        case .httpStatus: return "http_status"
        case .gone: return "gone"
        case .transport: return "transport"
        case .malformedList: return "malformed_list"
        case .watchStalled: return "watch_stalled"
        case .eventTooLarge: return "event_too_large"
        }
    }
}
