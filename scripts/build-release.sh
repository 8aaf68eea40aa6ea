#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The release build everything shipped comes from (make build, make demo, make dist, make container):
# the Swift runtime is linked statically (--static-swift-stdlib for the programs, -static-stdlib for
# libreuseportlb.so in Package.swift), so the results need only Debian's runtime libraries
# (libbpf1, libxdp1, libelf1, libyaml-0-2, zlib1g, libstdc++6, libgcc-s1, libc6), not a Swift toolchain.
# Products are built one by one: a plain `swift build` would also build the test-only TestSupport
# target, whose Testing module has no static version.
# Prints the build's output only if it fails (dependencies' warnings are not ours); BUILD_LOG names
# the file that keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/swift/usr/bin:$PATH"
if [ -n "${BUILD_LOG:-}" ]; then
  log=$BUILD_LOG
else
  log=$(mktemp)
  trap 'rm -f "$log"' EXIT
fi
: >"$log"
for product in udp-fanout collector publisher reuseportlb; do
  if ! swift build -c release --static-swift-stdlib --product "$product" >>"$log" 2>&1; then
    cat "$log" >&2
    echo "build: the release build of $product failed (output above)" >&2
    exit 1
  fi
done
swift build -c release --static-swift-stdlib --show-bin-path
