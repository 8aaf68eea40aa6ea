// swift-tools-version:6.0
import PackageDescription

let package = Package(
    name: "ReusePortLB",
    products: [
        .library(name: "ReusePortLB", targets: ["ReusePortLB"]),
        // The C API: libreuseportlb.so with include/reuseportlb.h and pkgconfig/reuseportlb.pc.
        .library(name: "reuseportlb", type: .dynamic, targets: ["ReusePortLBCAPI"]),
        .executable(name: "collector", targets: ["collector"]),
        .executable(name: "publisher", targets: ["publisher"]),
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-argument-parser", from: "1.8.2"),
    ],
    targets: [
        // System libraries, found with pkg-config (Debian: libbpf-dev, libxdp-dev).
        .systemLibrary(name: "CLibBPF", pkgConfig: "libbpf", providers: [.apt(["libbpf-dev"])]),
        .systemLibrary(name: "CLibXDP", pkgConfig: "libxdp", providers: [.apt(["libxdp-dev"])]),
        // What Swift cannot import from Glibc, plus the kernel/user shared header of bpf/include.
        .target(name: "CSystemShim"),
        // Compiles bpf/*.bpf.c with the toolchain's clang and embeds the objects.
        .plugin(name: "BPFObjectCompiler", capability: .buildTool()),
        .target(name: "BPFObjects", plugins: ["BPFObjectCompiler"]),
        .target(name: "ReusePortLB", dependencies: ["CLibBPF", "CSystemShim", "BPFObjects"]),
        .target(name: "ReusePortLBCAPI", dependencies: ["ReusePortLB"]),
        .target(name: "TrafficModel", dependencies: ["ReusePortLB"]),
        .executableTarget(
            name: "collector",
            dependencies: [
                "ReusePortLB", "TrafficModel",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ]),
        .executableTarget(
            name: "publisher",
            dependencies: [
                "ReusePortLB", "TrafficModel",
                .product(name: "ArgumentParser", package: "swift-argument-parser"),
            ]),
        .testTarget(
            name: "ReusePortLBTests",
            dependencies: ["ReusePortLB", "TrafficModel", "CLibBPF", "CSystemShim", "collector", "publisher"]),
    ]
)
