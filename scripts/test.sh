#!/usr/bin/env bash
# The whole test suite: unit tests, sk_reuseport tests with real sockets, collector processes,
# namespaces and the C API. Privileged tests need root; under CI=true they never skip.
# Fails if a run leaves anything pinned under /sys/fs/bpf/reuseportlb, a tc_ebpf program
# (fanout_tc) or af_xdp program (fanout_xdp) loaded, or a tc_ebpf lock file under /run/udp-fanout.
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
if [ "$(id -u)" = 0 ]; then
  if bpftool prog show 2>/dev/null | grep -q "name fanout_tc"; then
    echo "test: FAILED: a fanout_tc program is still loaded (bpftool prog show)" >&2
    exit 1
  fi
  if ls /run/udp-fanout/tc-*.lock >/dev/null 2>&1; then
    echo "test: FAILED: tc_ebpf lock files left: $(ls /run/udp-fanout)" >&2
    exit 1
  fi
  if bpftool prog show 2>/dev/null | grep -q "name fanout_xdp"; then
    echo "test: FAILED: a fanout_xdp program is still loaded (bpftool prog show)" >&2
    exit 1
  fi
  echo "test: no tc_ebpf or af_xdp program loaded, no tc_ebpf lock file left"
fi
