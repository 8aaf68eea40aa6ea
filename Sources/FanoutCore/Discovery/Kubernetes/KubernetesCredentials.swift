// SPDX-License-Identifier: Apache-2.0
import FoundationEssentials
import NIOSSL

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
            let token = try Self.read(path).trimmingWhitespace()
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
            let text = try read(namespacePath).trimmingWhitespace()
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

    /// What udp-fanout reads of a kubeconfig (other keys are ignored). Read the way Yams'
    /// YAMLDecoder read it: a key that is absent or null (`~`, `null`, empty) is nil, `<<` merges
    /// a mapping in, the last of a repeated key wins, true/yes/on and false/no/off are booleans,
    /// and a value of the wrong kind is an error naming its key and line.
    struct Kubeconfig {
        struct NamedCluster { var name: String?; var cluster: Cluster? }
        struct Cluster {
            var server: String?
            var certificateAuthority: String?
            var certificateAuthorityData: String?
            var insecureSkipTLSVerify: Bool?
        }
        struct NamedUser { var name: String?; var user: User? }
        struct User {
            var token: String?
            var tokenFile: String?
            var clientCertificate: String?
            var clientCertificateData: String?
            var clientKey: String?
            var clientKeyData: String?
            /// Present or not is all that matters.
            var exec: Bool
            var authProvider: Bool
        }
        struct NamedContext { var name: String?; var context: Context? }
        struct Context { var cluster: String?; var user: String?; var namespace: String? }

        var clusters: [NamedCluster]?
        var users: [NamedUser]?
        var contexts: [NamedContext]?
        var currentContext: String?

        /// - Throws: the problem, for "not a kubeconfig: ...".
        init(_ text: String) throws(Problem) {
            let root: YAMLNode?
            do throws(YAMLError) {
                root = try YAMLComposer.compose(text)
            } catch {
                let described = ConfigParser.describe(error)
                throw Problem(described.problem + (described.line.map { " (line \($0))" } ?? ""))
            }
            guard let root else { throw Problem("the file is empty") }
            let top = try Fields(root, path: "")
            clusters = try top.list("clusters") { entry throws(Problem) in
                NamedCluster(
                    name: try entry.string("name"),
                    cluster: try entry.mapping("cluster").map { cluster throws(Problem) in
                        Cluster(
                            server: try cluster.string("server"), certificateAuthority: try cluster.string("certificate-authority"),
                            certificateAuthorityData: try cluster.string("certificate-authority-data"),
                            insecureSkipTLSVerify: try cluster.bool("insecure-skip-tls-verify"))
                    })
            }
            users = try top.list("users") { entry throws(Problem) in
                NamedUser(
                    name: try entry.string("name"),
                    user: try entry.mapping("user").map { user throws(Problem) in
                        User(
                            token: try user.string("token"), tokenFile: try user.string("tokenFile"),
                            clientCertificate: try user.string("client-certificate"), clientCertificateData: try user.string("client-certificate-data"),
                            clientKey: try user.string("client-key"), clientKeyData: try user.string("client-key-data"),
                            exec: user["exec"] != nil, authProvider: user["auth-provider"] != nil)
                    })
            }
            contexts = try top.list("contexts") { entry throws(Problem) in
                NamedContext(
                    name: try entry.string("name"),
                    context: try entry.mapping("context").map { context throws(Problem) in
                        Context(cluster: try context.string("cluster"), user: try context.string("user"), namespace: try context.string("namespace"))
                    })
            }
            currentContext = try top.string("current-context")
        }

        struct Problem: Error {
            var text: String
            init(_ text: String) { self.text = text }
        }

        /// A mapping's keys, `<<` merges applied.
        struct Fields {
            let path: String
            let pairs: [(key: YAMLNode, value: YAMLNode)]

            init(_ node: YAMLNode, path: String) throws(Problem) {
                guard case .mapping(let mapping) = node else { throw Problem("\(path.isEmpty ? "the document" : path) is not a mapping (line \(node.mark.line))") }
                self.path = path
                var budget = Self.maximumMergedPairs
                pairs = try Self.merged(mapping, budget: &budget)
            }

            /// Merge keys (`<<`) of aliases of aliases grow exponentially: a mapping whose merges
            /// bring more pairs than this is refused.
            static let maximumMergedPairs = 100_000

            /// Merged pairs first, so the mapping's own keys (later) win.
            static func merged(_ mapping: YAMLMapping, budget: inout Int) throws(Problem) -> [(key: YAMLNode, value: YAMLNode)] {
                budget -= mapping.pairs.count
                guard budget >= 0 else { throw Problem("merge keys (<<) at line \(mapping.mark.line) bring more than \(maximumMergedPairs) pairs") }
                var merge: [(key: YAMLNode, value: YAMLNode)] = []
                var own: [(key: YAMLNode, value: YAMLNode)] = []
                for pair in mapping {
                    guard case .scalar(let key) = pair.key,
                        key.tag == "tag:yaml.org,2002:merge" || (key.tag == nil && key.string == "<<")
                    else {
                        own.append(pair)
                        continue
                    }
                    switch pair.value {
                    case .mapping(let inner): merge += try merged(inner, budget: &budget)
                    case .sequence(let list):
                        for case .mapping(let inner) in list.reversed() { merge += try merged(inner, budget: &budget) }
                    case .scalar: break
                    }
                }
                return merge + own
            }

            /// The last value of `key`, nil when absent or null.
            subscript(_ key: String) -> YAMLNode? {
                guard let value = pairs.last(where: { if case .scalar(let scalar) = $0.key { scalar.string == key } else { false } })?.value,
                    !value.isNull
                else { return nil }
                return value
            }

            func child(_ key: String) -> String { path.isEmpty ? key : "\(path).\(key)" }

            func string(_ key: String) throws(Problem) -> String? {
                guard let value = self[key] else { return nil }
                guard case .scalar(let scalar) = value else { throw Problem("\(child(key)) is not a string (line \(value.mark.line))") }
                return scalar.string
            }

            func bool(_ key: String) throws(Problem) -> Bool? {
                guard let value = self[key] else { return nil }
                guard let bool = value.bool else { throw Problem("\(child(key)) is not true or false (line \(value.mark.line))") }
                return bool
            }

            func mapping(_ key: String) throws(Problem) -> Fields? {
                guard let value = self[key] else { return nil }
                return try Fields(value, path: child(key))
            }

            func list<T>(_ key: String, _ each: (Fields) throws(Problem) -> T) throws(Problem) -> [T]? {
                guard let value = self[key] else { return nil }
                guard case .sequence(let items) = value else { throw Problem("\(child(key)) is not a list (line \(value.mark.line))") }
                var result: [T] = []
                for (index, item) in items.enumerated() {
                    result.append(try each(try Fields(item, path: "\(child(key))[\(index)]")))
                }
                return result
            }
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
            do throws(Kubeconfig.Problem) {
                config = try Kubeconfig(text)
            } catch {
                throw .kubeconfig(path: path, problem: "not a kubeconfig: \(error.text)")
            }
            let base = Self.directory(of: path)
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
            if user.exec || user.authProvider, user.token == nil, user.tokenFile == nil, user.clientCertificate == nil, user.clientCertificateData == nil {
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

    /// The directory part of `path` as NSString's deletingLastPathComponent gives it: repeated
    /// and trailing slashes dropped, "" for a bare name, "/" for a file in the root.
    static func directory(of path: String) -> String {
        var components = path.split(separator: "/", omittingEmptySubsequences: true)
        let absolute = path.hasPrefix("/")
        guard !components.isEmpty else { return absolute ? "/" : "" }
        components.removeLast()
        let joined = components.joined(separator: "/")
        return absolute ? "/" + joined : joined
    }

    private static func resolve(_ path: String, against base: String) -> String {
        path.hasPrefix("/") || base.isEmpty ? path : base + "/" + path
    }

    private static func decodeBase64(_ text: String, what: String) throws(DiscoveryError) -> [UInt8] {
        guard let data = Data(base64Encoded: text.trimmingWhitespace(), options: .ignoreUnknownCharacters) else {
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

extension String {
    /// Without leading and trailing white space and newlines (Unicode White_Space: the set
    /// Foundation's CharacterSet.whitespacesAndNewlines holds).
    fileprivate func trimmingWhitespace() -> String {
        let scalars = unicodeScalars
        guard let first = scalars.firstIndex(where: { !$0.properties.isWhitespace }),
            let last = scalars.lastIndex(where: { !$0.properties.isWhitespace })
        else { return "" }
        return String(scalars[first...last])
    }
}
