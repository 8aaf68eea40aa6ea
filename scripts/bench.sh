#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make bench: builds release and runs the benchmarks (needs root for eBPF steering and BPF stats).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/swift/usr/bin:$PATH"
echo "bench: building (release)"
swift build -c release >/dev/null
if [ "${1:-}" = compare ]; then exec python3 scripts/bench_compare.py; fi
exec python3 scripts/bench.py "$@"
