#!/usr/bin/env bash
# The whole test suite: unit tests, sk_reuseport tests with real sockets, collector processes,
# namespaces and the C API. Privileged tests need root; under CI=true they never skip.
# Fails if a run leaves anything pinned under /sys/fs/bpf/reuseportlb.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/swift/usr/bin:$PATH"
pins() { ls /sys/fs/bpf/reuseportlb 2>/dev/null | sort || true; }
before=$(pins)
echo "test: swift build --build-tests"
swift build --build-tests
echo "test: swift test"
swift test --no-parallel "$@"
after=$(pins)
left=$(comm -13 <(echo "$before") <(echo "$after") | sed '/^$/d')
if [ -n "$left" ]; then
  echo "test: FAILED: pins left under /sys/fs/bpf/reuseportlb: $left" >&2
  exit 1
fi
echo "test: nothing left pinned under /sys/fs/bpf/reuseportlb"
