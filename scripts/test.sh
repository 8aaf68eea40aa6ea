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
# A hung test must fail the run, loudly, rather than hold CI until its own time limit: swift test
# runs in a session of its own (so the xctest child goes with it) and is stopped after
# TEST_TIME_LIMIT seconds (the whole suite takes about 10 minutes here).
limit=${TEST_TIME_LIMIT:-1800}
echo "test: swift test (stopped if it runs past ${limit} s)"
setsid swift test --no-parallel "$@" &
run=$!
trap 'kill -TERM -- -$run 2>/dev/null || true' INT TERM
(
  # sleep in its own child, so stopping the watchdog stops the sleep too
  for _ in $(seq "$limit"); do sleep 1; kill -0 "$run" 2>/dev/null || exit 0; done
  echo "test: FAILED: swift test was still running after ${limit} s: a test hangs (the last one started above); stopping it" >&2
  kill -TERM -- -"$run" 2>/dev/null || true
  sleep 10
  kill -KILL -- -"$run" 2>/dev/null || true
) &
watchdog=$!
status=0
wait "$run" || status=$?
kill "$watchdog" 2>/dev/null || true
wait "$watchdog" 2>/dev/null || true
trap - INT TERM
if [ "$status" -ne 0 ]; then
  echo "test: FAILED: swift test exited with status $status" >&2
  exit "$status"
fi
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
