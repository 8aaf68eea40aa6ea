import Foundation
import NIOSSL
import Yams

/// Where and how to reach the Kubernetes API server, from the places client-go looks, in its
/// order: `KUBECONFIG` (a colon-separated list, merged: the first file to define a name wins),
/// else in-cluster (`KUBERNETES_SERVICE_HOST`/`KUBERNETES_SERVICE_PORT` and the service-account
/// directory's `token`, `ca.crt`, `namespace`), else `~/.kube/config`.
///
/// A token file (in-cluster, or a kubeconfig `tokenFile`) is read again for every request, so a
/// bound service-account token that the kubelet rotates is picked up without a restart. The rest
/// (an inline kubeconfig `token`, certificates) is read when loaded; ``reread()`` reads the same
/// files again, which the watcher does after a 401 and the daemon on every reload.
struct KubernetesCredentials: Sendable {
    /// How requests authenticate.
    enum Authentication: Sendable, Equatable {
        /// No Authorization header (a client certificate, if any, is in the TLS configuration).
        case none
        /// A fixed bearer token (kubeconfig `token`).
        case token(String)
        /// A bearer token read from this file for every request.
        case tokenFile(String)
    }

    /// The files these credentials were read from, so they can be read again.
    enum Source: Sendable, Equatable {
        /// The kubeconfig files in `KUBECONFIG`'s order (missing ones included: they are
        /// skipped when read), or `~/.kube/config`.
        case kubeconfig([String])
        /// The service account of a pod: the API server's host and port from the environment,
        /// the token, ca.crt and namespace files from `directory`.
        case inCluster(host: String, port: String, directory: String)
    }

    /// `https://host:port` without a trailing slash.
    var server: String
    /// The namespace file in-cluster, the kubeconfig context's namespace, else `default`.
    var defaultNamespace: String
    var authentication: Authentication
    /// Trusts only the given CA (or the system's when a kubeconfig names none), with the client
    /// certificate if there is one.
    var tlsConfiguration: TLSConfiguration
    /// Where this came from, for logs: `in-cluster` or `kubeconfig PATH context NAME`.
    var origin: String
    /// True when the kubeconfig asked for insecure-skip-tls-verify (logged as a warning).
    var skipsTLSVerification: Bool
    /// Where ``reread()`` reads from.
    var source: Source

    /// The default service-account directory of a pod.
    static let serviceAccountDirectory = "/var/run/secrets/kubernetes.io/serviceaccount"

    /// Finds the API server and credentials.
    /// - Parameters:
    ///   - environment: the process environment (`KUBECONFIG`, `KUBERNETES_SERVICE_HOST`,
    ///     `KUBERNETES_SERVICE_PORT`, `HOME`).
    ///   - serviceAccountDirectory: where the in-cluster token, ca.crt and namespace are.
    /// - Throws: ``DiscoveryError`` naming the file or key at fault and the fix.
    static func load(environment: [String: String], serviceAccountDirectory: String = serviceAccountDirectory) throws(DiscoveryError) -> KubernetesCredentials {
        if let list = environment["KUBECONFIG"], !list.isEmpty {
            return try fromKubeconfigList(list.split(separator: ":").map(String.init))
        }
        if let host = environment["KUBERNETES_SERVICE_HOST"], !host.isEmpty,
            let port = environment["KUBERNETES_SERVICE_PORT"], !port.isEmpty
        {
            return try inCluster(host: host, port: port, directory: serviceAccountDirectory)
        }
        let home = environment["HOME"] ?? "/root"
        let path = home + "/.kube/config"
        guard FileManager.default.isReadableFile(atPath: path) else {
            throw .noConfiguration(checked: ["KUBECONFIG (unset)", "KUBERNETES_SERVICE_HOST (unset)", path])
        }
        return try fromKubeconfig([path], listed: [path])
    }

    /// The same files read again: a fixed inline `token`, a new client certificate or CA, a
    /// changed context. (The environment is the process's, read once: it does not change.)
    /// Blocking (file reads): call off the cooperative pool.
    /// - Throws: ``DiscoveryError`` naming the file or key at fault and the fix, as ``load(environment:serviceAccountDirectory:)``.
    func reread() throws(DiscoveryError) -> KubernetesCredentials {
        switch source {
        case .kubeconfig(let paths): return try Self.fromKubeconfigList(paths)
        case .inCluster(let host, let port, let directory): return try Self.inCluster(host: host, port: port, directory: directory)
        }
    }

    /// True when `other` authenticates the same way to the same server: every field alike, the
    /// TLS configuration compared by NIOSSL's `bestEffortEquals` (certificates and keys by
    /// content), so a reload whose files did not change restarts no watch.
    func isSame(as other: KubernetesCredentials) -> Bool {
        server == other.server && defaultNamespace == other.defaultNamespace && authentication == other.authentication
            && origin == other.origin && skipsTLSVerification == other.skipsTLSVerification && source == other.source
            && tlsConfiguration.bestEffortEquals(other.tlsConfiguration)
    }

    /// The Authorization header value for the next request (nil: none).
    /// - Throws: ``DiscoveryError/unreadable(path:problem:)`` when a token file cannot be read.
    ///   Blocking (a file read): call off the cooperative pool.
    func authorization() throws(DiscoveryError) -> String? {
        switch authentication {
        case .none: return nil
        case .token(let token): return "Bearer \(token)"
        case .tokenFile(let path):
            let token = try Self.read(path).trimmingCharacters(in: .whitespacesAndNewlines)
            guard !token.isEmpty else { throw .unreadable(path: path, problem: "the token file is empty") }
            return "Bearer \(token)"
        }
    }

    // MARK: In-cluster

    private static func inCluster(host: String, port: String, directory: String) throws(DiscoveryError) -> KubernetesCredentials {
        let tokenPath = directory + "/token"
        // Read once now so a missing mount fails at start, not on the first request.
        _ = try read(tokenPath)
        let caPath = directory + "/ca.crt"
        var tls = TLSConfiguration.makeClientConfiguration()
        tls.trustRoots = .certificates(try certificates(pem: Array(try read(caPath).utf8), what: caPath))
        let namespacePath = directory + "/namespace"
        var namespace = "default"
        if FileManager.default.fileExists(atPath: namespacePath) {
            let text = try read(namespacePath).trimmingCharacters(in: .whitespacesAndNewlines)
            if !text.isEmpty { namespace = text }
        }
        // An IPv6 service host needs brackets in a URL.
        let hostPart = host.contains(":") ? "[\(host)]" : host
        return KubernetesCredentials(
            server: "https://\(hostPart):\(port)", defaultNamespace: namespace, authentication: .tokenFile(tokenPath),
            tlsConfiguration: tls, origin: "in-cluster", skipsTLSVerification: false,
            source: .inCluster(host: host, port: port, directory: directory))
    }

    // MARK: kubeconfig

    private struct Kubeconfig: Decodable {
        struct NamedCluster: Decodable { var name: String?; var cluster: Cluster? }
        struct Cluster: Decodable {
            var server: String?
            var certificateAuthority: String?
            var certificateAuthorityData: String?
            var insecureSkipTLSVerify: Bool?
            enum CodingKeys: String, CodingKey {
                case server
                case certificateAuthority = "certificate-authority"
                case certificateAuthorityData = "certificate-authority-data"
                case insecureSkipTLSVerify = "insecure-skip-tls-verify"
            }
        }
        struct NamedUser: Decodable { var name: String?; var user: User? }
        struct User: Decodable {
            var token: String?
            var tokenFile: String?
            var clientCertificate: String?
            var clientCertificateData: String?
            var clientKey: String?
            var clientKeyData: String?
            var exec: Ignored?
            var authProvider: Ignored?
            enum CodingKeys: String, CodingKey {
                case token, tokenFile, exec
                case clientCertificate = "client-certificate"
                case clientCertificateData = "client-certificate-data"
                case clientKey = "client-key"
                case clientKeyData = "client-key-data"
                case authProvider = "auth-provider"
            }
        }
        struct NamedContext: Decodable { var name: String?; var context: Context? }
        struct Context: Decodable { var cluster: String?; var user: String?; var namespace: String? }
        /// Present or not is all that matters.
        struct Ignored: Decodable { init(from decoder: any Decoder) throws {} }

        var clusters: [NamedCluster]?
        var users: [NamedUser]?
        var contexts: [NamedContext]?
        var currentContext: String?
        enum CodingKeys: String, CodingKey {
            case clusters, users, contexts
            case currentContext = "current-context"
        }
    }

    /// `KUBECONFIG`'s files: those that exist, merged.
    private static func fromKubeconfigList(_ paths: [String]) throws(DiscoveryError) -> KubernetesCredentials {
        let existing = paths.filter { FileManager.default.isReadableFile(atPath: $0) }
        guard !existing.isEmpty else { throw .noConfiguration(checked: paths.map { "KUBECONFIG \($0)" }) }
        return try fromKubeconfig(existing, listed: paths)
    }

    /// Merges the files the way kubectl does: the first file to define a name (or
    /// current-context) wins; relative paths are relative to the file that holds them.
    /// `listed` is what ``reread()`` reads again (with the files missing now).
    private static func fromKubeconfig(_ paths: [String], listed: [String]) throws(DiscoveryError) -> KubernetesCredentials {
        var clusters: [String: (Kubeconfig.Cluster, base: String)] = [:]
        var users: [String: (Kubeconfig.User, base: String)] = [:]
        var contexts: [String: Kubeconfig.Context] = [:]
        var current: String?
        for path in paths {
            let text = try read(path)
            let config: Kubeconfig
            do {
                config = try YAMLDecoder().decode(Kubeconfig.self, from: text)
            } catch {
                throw .kubeconfig(path: path, problem: "not a kubeconfig: \(error)")
            }
            let base = (path as NSString).deletingLastPathComponent
            for entry in config.clusters ?? [] { if let name = entry.name, let value = entry.cluster, clusters[name] == nil { clusters[name] = (value, base) } }
            for entry in config.users ?? [] { if let name = entry.name, let value = entry.user, users[name] == nil { users[name] = (value, base) } }
            for entry in config.contexts ?? [] { if let name = entry.name, let value = entry.context, contexts[name] == nil { contexts[name] = value } }
            if current == nil, let name = config.currentContext, !name.isEmpty { current = name }
        }
        let files = paths.joined(separator: ":")
        guard let contextName = current else { throw .kubeconfig(path: files, problem: "current-context is not set (kubectl config use-context NAME)") }
        guard let context = contexts[contextName] else { throw .kubeconfig(path: files, problem: "current-context '\(contextName)' names no entry of contexts") }
        guard let clusterName = context.cluster, let clusterEntry = clusters[clusterName] else {
            throw .kubeconfig(path: files, problem: "context '\(contextName)' names cluster '\(context.cluster ?? "")', which is not in clusters")
        }
        let (cluster, clusterBase) = clusterEntry
        guard let server = cluster.server, server.hasPrefix("https://") || server.hasPrefix("http://") else {
            throw .kubeconfig(path: files, problem: "cluster '\(clusterName)' has no server URL (https://host:port)")
        }
        var tls = TLSConfiguration.makeClientConfiguration()
        if let data = cluster.certificateAuthorityData {
            tls.trustRoots = .certificates(try certificates(pem: try decodeBase64(data, what: "cluster '\(clusterName)' certificate-authority-data"), what: "cluster '\(clusterName)' certificate-authority-data"))
        } else if let file = cluster.certificateAuthority {
            let path = resolve(file, against: clusterBase)
            tls.trustRoots = .certificates(try certificates(pem: Array(try read(path).utf8), what: path))
        }
        let skip = cluster.insecureSkipTLSVerify ?? false
        if skip { tls.certificateVerification = .none }

        var authentication = Authentication.none
        if let userName = context.user {
            guard let userEntry = users[userName] else {
                throw .kubeconfig(path: files, problem: "context '\(contextName)' names user '\(userName)', which is not in users")
            }
            let (user, userBase) = userEntry
            if user.exec != nil || user.authProvider != nil, user.token == nil, user.tokenFile == nil, user.clientCertificate == nil, user.clientCertificateData == nil {
                throw .kubeconfig(path: files, problem: "user '\(userName)' authenticates with an exec or auth-provider plugin, which udp-fanout does not run; give it a token, tokenFile or client certificate (e.g. a service account token)")
            }
            if let token = user.token, !token.isEmpty {
                authentication = .token(token)
            } else if let file = user.tokenFile {
                authentication = .tokenFile(resolve(file, against: userBase))
            }
            let certificatePEM: [UInt8]?
            if let data = user.clientCertificateData {
                certificatePEM = try decodeBase64(data, what: "user '\(userName)' client-certificate-data")
            } else if let file = user.clientCertificate {
                certificatePEM = Array(try read(resolve(file, against: userBase)).utf8)
            } else {
                certificatePEM = nil
            }
            let keyPEM: [UInt8]?
            if let data = user.clientKeyData {
                keyPEM = try decodeBase64(data, what: "user '\(userName)' client-key-data")
            } else if let file = user.clientKey {
                keyPEM = Array(try read(resolve(file, against: userBase)).utf8)
            } else {
                keyPEM = nil
            }
            switch (certificatePEM, keyPEM) {
            case (nil, nil): break
            case (let certificate?, let key?):
                tls.certificateChain = try certificates(pem: certificate, what: "user '\(userName)' client certificate").map { .certificate($0) }
                do {
                    tls.privateKey = .privateKey(try NIOSSLPrivateKey(bytes: key, format: .pem))
                } catch {
                    throw .certificate(what: "user '\(userName)' client key", problem: "\(error)")
                }
            default:
                throw .kubeconfig(path: files, problem: "user '\(userName)' has a client certificate without its key, or a key without its certificate; give both")
            }
        }
        return KubernetesCredentials(
            server: String(server.reversed().drop(while: { $0 == "/" }).reversed()),
            defaultNamespace: context.namespace.flatMap { $0.isEmpty ? nil : $0 } ?? "default",
            authentication: authentication, tlsConfiguration: tls,
            origin: "kubeconfig \(files) context \(contextName)", skipsTLSVerification: skip, source: .kubeconfig(listed))
    }

    // MARK: Helpers

    private static func read(_ path: String) throws(DiscoveryError) -> String {
        guard FileManager.default.fileExists(atPath: path) else { throw .unreadable(path: path, problem: "no such file") }
        do {
            return try readFile(path)
        } catch {
            throw .unreadable(path: path, problem: error.problem)
        }
    }

    private static func resolve(_ path: String, against base: String) -> String {
        path.hasPrefix("/") || base.isEmpty ? path : base + "/" + path
    }

    private static func decodeBase64(_ text: String, what: String) throws(DiscoveryError) -> [UInt8] {
        guard let data = Data(base64Encoded: text.trimmingCharacters(in: .whitespacesAndNewlines), options: .ignoreUnknownCharacters) else {
            throw .certificate(what: what, problem: "not base64")
        }
        return Array(data)
    }

    private static func certificates(pem: [UInt8], what: String) throws(DiscoveryError) -> [NIOSSLCertificate] {
        let loaded: [NIOSSLCertificate]
        do {
            loaded = try NIOSSLCertificate.fromPEMBytes(pem)
        } catch {
            throw .certificate(what: what, problem: "\(error)")
        }
        guard !loaded.isEmpty else { throw .certificate(what: what, problem: "no PEM certificate in it") }
        return loaded
    }
}
