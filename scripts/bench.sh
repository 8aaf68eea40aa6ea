#!/usr/bin/env bash
# make bench: builds release and runs the benchmarks (needs root for eBPF steering and BPF stats).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/swift/usr/bin:$PATH"
echo "bench: building (release)"
swift build -c release >/dev/null
exec python3 scripts/bench.py "$@"
