// SPDX-License-Identifier: Apache-2.0
/// The version of every tool and library of this package (udp-fanout, collector, publisher,
/// libreuseportlb): the one place it is written. The Makefile reads it from this file (`make
/// install`'s soname and .pc, `make dist`, the container image's tag), and
/// `DeploymentManifestTests` checks that the Kubernetes manifests and the Containerfile name it.
public enum ProjectVersion {
    public static let string = "0.1.0"
}
