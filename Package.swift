// swift-tools-version:6.1
// SPDX-License-Identifier: Apache-2.0
//
// ReusePortLB and udp-fanout are licensed under the Apache License, Version 2.0 (LICENSE).
// The BPF programs in bpf/ (compiled by the BPFObjectCompiler plugin and embedded in the
// binaries) are GPL-2.0 OR BSD-2-Clause (bpf/LICENSE.GPL-2.0, bpf/LICENSE.BSD-2-Clause), the
// license they declare to the kernel as "Dual BSD/GPL".
import PackageDescription

/// The package's directory: linker flags that name files need an absolute path.
let packageDirectory = String(#filePath.dropLast("/Package.swift".count))

let package = Package(
    name: "ReusePortLB",
    products: [
        .library(name: "ReusePortLB", targets: ["ReusePortLB"]),
        // The C API: libreuseportlb.so with include/reuseportlb.h and pkgconfig/reuseportlb.pc.
        .library(name: "reuseportlb", type: .dynamic, targets: ["ReusePortLBCAPI"]),
        .executable(name: "collector", targets: ["collector"]),
        .executable(name: "publisher", targets: ["publisher"]),
        .executable(name: "udp-fanout", targets: ["udp-fanout"]),
        .library(name: "FanoutCore", targets: ["FanoutCore"]),
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-argument-parser", from: "1.8.2"),
        .package(url: "https://github.com/apple/swift-log", from: "1.16.2"),
        .package(url: "https://github.com/swift-server/swift-service-lifecycle", from: "2.13.0"),
        // Only the tests read YAML with it (k8s/ manifests); the daemon reads its configuration with
        // Debian's libyaml (CYAML): Yams needs all of Foundation, and with it ICU's data.
        .package(url: "https://github.com/jpsim/Yams", from: "5.0.1"),
        // The HTTP endpoint (/metrics, /healthz, /readyz): a maintained SwiftNIO server.
        // Without its default FullFoundation trait, whose URL-encoded form dates use Foundation's
        // DateFormatter: that alone links all of Foundation and ICU's data (about 40 MB) into udp-fanout.
        .package(url: "https://github.com/hummingbird-project/hummingbird", from: "2.28.1", traits: ["ConfigurationSupport"]),
        // Already in Hummingbird's graph; named for the endpoint's request-deadline handler.
        .package(url: "https://github.com/apple/swift-nio", from: "2.101.2"),
        .package(url: "https://github.com/apple/swift-nio-extras", from: "1.35.2"),
        // Kubernetes discovery: list and watch EndpointSlices over HTTPS.
        .package(url: "https://github.com/swift-server/async-http-client", from: "1.37.0"),
        .package(url: "https://github.com/apple/swift-nio-ssl", from: "2.37.6"),
        // Only a command plugin (`make docs`: the DocC catalogs in Sources/*/Docs.docc); no target
        // depends on it, so nothing of it is linked into a product.
        .package(url: "https://github.com/swiftlang/swift-docc-plugin", from: "1.5.0"),
    ],
    targets: [
        // System libraries, found with pkg-config (Debian: libbpf-dev, libxdp-dev, libyaml-dev).
        .systemLibrary(name: "CLibBPF", pkgConfig: "libbpf", providers: [.apt(["libbpf-dev"])]),
        .systemLibrary(name: "CLibXDP", pkgConfig: "libxdp", providers: [.apt(["libxdp-dev"])]),
        // The configuration's YAML parser (Sources/FanoutCore/Config/YAMLDocument.swift).
        .systemLibrary(name: "CYAML", pkgConfig: "yaml-0.1", providers: [.apt(["libyaml-dev"])]),
        // What Swift cannot import from Glibc.
        .target(name: "CSystemShim"),
        // The system-call layer: every socket, option, send/receive, poll, epoll and ioctl call
        // goes through it (EINTR retried, would-block a value, errors naming call, errno and fix).
        .target(name: "SystemCalls", dependencies: ["CSystemShim"]),
        // The kernel/user ABI of the BPF programs: bpf/include's shared headers, one definition for both sides.
        .target(name: "BPFKernelABI"),
        // Compiles bpf/*.bpf.c with the toolchain's clang and embeds the objects.
        .plugin(name: "BPFObjectCompiler", capability: .buildTool()),
        .target(name: "BPFObjects", plugins: ["BPFObjectCompiler"]),
        // What every BPF program's loader shares: system calls, loading embedded objects, per-CPU
        // counters, capabilities (ReusePortLB's sk_reuseport program, udp-fanout's tc and XDP ones).
        .target(name: "BPFSupport", dependencies: ["CLibBPF", "BPFObjects", "SystemCalls"]),
        .target(name: "ReusePortLB", dependencies: ["BPFSupport", "BPFKernelABI", "CLibBPF", "CSystemShim", "BPFObjects", "SystemCalls"]),
        // SONAME libreuseportlb.so.0, so C programs record the ABI version (make install adds the links).
        .target(
            name: "ReusePortLBCAPI", dependencies: ["ReusePortLB"],
            linkerSettings: [
                .unsafeFlags(["-Xlinker", "-soname=libreuseportlb.so.0"]),
                // Release builds carry the Swift runtime inside the library, so C programs that link it
                // need only Debian's libbpf1/libelf1/zlib1g/libstdc++6, not a Swift toolchain.
                .unsafeFlags(
                    ["-static-stdlib", "-Xlinker", "--version-script=\(packageDirectory)/Sources/ReusePortLBCAPI/exports.map"],
                    .when(configuration: .release)),
            ]),
        .target(name: "TrafficModel", dependencies: ["ReusePortLB"]),
        .executableTarget(
            name: "collector",
            dependencies: [
                "ReusePortLB", "TrafficModel", "SystemCalls", "CSystemShim",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ]),
        .executableTarget(
            name: "publisher",
            dependencies: [
                "ReusePortLB", "TrafficModel", "SystemCalls", "CSystemShim",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ]),
        // udp-fanout's engine, driven in-process by tests and benchmarks.
        .target(
            name: "FanoutCore",
            dependencies: [
                "ReusePortLB", "BPFSupport", "BPFKernelABI", "CSystemShim", "CLibBPF", "CLibXDP", "CYAML", "BPFObjects", "SystemCalls",
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "UnixSignals", package: "swift-service-lifecycle"),
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "HummingbirdCore", package: "hummingbird"),
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOHTTPTypes", package: "swift-nio-extras"),
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "NIOSSL", package: "swift-nio-ssl"),
            ]),
        .executableTarget(
            name: "udp-fanout",
            dependencies: [
                "FanoutCore", "ReusePortLB", "SystemCalls", "CSystemShim",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
                .product(name: "Logging", package: "swift-log"),
                .product(name: "ServiceLifecycle", package: "swift-service-lifecycle"),
                .product(name: "UnixSignals", package: "swift-service-lifecycle"),
                // `udp-fanout capture` streams the daemon's GET /capture.
                .product(name: "AsyncHTTPClient", package: "async-http-client"),
                .product(name: "NIOCore", package: "swift-nio"),
            ]),
        // Helpers both test targets use (privilege gating, child processes, loopback senders).
        .target(name: "TestSupport", dependencies: ["ReusePortLB", "CLibBPF", "SystemCalls", "CSystemShim"]),
        .testTarget(
            name: "FanoutTests",
            dependencies: [
                "FanoutCore", "ReusePortLB", "BPFSupport", "BPFKernelABI", "TestSupport", "CLibBPF", "CLibXDP", "CSystemShim", "SystemCalls", "udp-fanout", "collector", "publisher",
                .product(name: "Logging", package: "swift-log"),
                // The Kubernetes API test server (HTTPS with a CA the test makes).
                .product(name: "Hummingbird", package: "hummingbird"),
                .product(name: "HummingbirdTLS", package: "hummingbird"),
                // DeploymentManifestTests read the k8s/ manifests' capabilities and embedded config.
                .product(name: "Yams", package: "Yams"),
            ]),
        .testTarget(
            name: "ReusePortLBTests",
            dependencies: ["ReusePortLB", "BPFSupport", "BPFKernelABI", "TrafficModel", "TestSupport", "CLibBPF", "CSystemShim", "SystemCalls", "collector", "publisher"]),
    ]
)
