#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Demo: udp-fanout runs config.example.yaml on loopback. Three collectors are its downstreams
# (127.0.0.1:5601-5603), the publisher sends 60000 datagrams from 48 source addresses to the
# listener 127.0.0.1:5514; then it prints what each downstream received and the daemon's metrics.
# Then the ReusePortLB part: three collectors share one port with source-IP steering, one is
# killed with SIGKILL, and its sources fail over without loss. Everything stops by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/swift/usr/bin:$PATH"
echo "demo: building (release)"
work=$(mktemp -d)
# The same self-contained build make dist ships; its warnings are shown only if it fails.
bin=$(BUILD_LOG="$work/build.log" scripts/build-release.sh)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
wait_ready() { for _ in $(seq 200); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.05; done; echo "demo: timed out waiting for '$2' in $1" >&2; cat "$1" >&2; exit 1; }

echo
echo "== udp-fanout with config.example.yaml =="
for i in 1 2 3; do
  "$bin/collector" 127.0.0.1 "560$i" 0 1 --rcvbuf 8388608 >"$work/d$i.json" 2>"$work/d$i.err" &
  pids+=($!)
  wait_ready "$work/d$i.err" ready
done
echo "demo: collectors listening on 127.0.0.1:5601, :5602, :5603 (the example's downstreams)"
"$bin/udp-fanout" --config config.example.yaml 2>"$work/fanout.err" &
fanout=$!
pids+=($fanout)
wait_ready "$work/fanout.err" "entering receive loop"
sed -n 's/^/  /p' "$work/fanout.err" | grep -E "starting udp-fanout|configuration loaded|starting userspace forwarder|metrics endpoint" | cut -c1-160
echo "demo: publisher sends 60000 datagrams from 127.0.0.10-127.0.0.57 to 127.0.0.1:5514 at 50k/s"
"$bin/publisher" 127.0.0.1 5514 60000 --sources 127.0.0.10-127.0.0.57 --rate 50000 | python3 -c 'import json,sys; r=json.load(sys.stdin); print("  sent %d in %.2f s (%.0f pps)" % (r["sent"], r["seconds"], r["pps"]))'
sleep 0.5
echo "demo: udp-fanout metrics (curl http://127.0.0.1:9090/metrics):"
curl -s http://127.0.0.1:9090/metrics | grep -E '^udp_fanout_(packets|bytes)_[a-z_]+\{|^udp_fanout_downstream_packets_forwarded' | grep -v 'by_reason' | sed 's/^/  /'
kill -TERM "$fanout"; wait "$fanout" 2>/dev/null || true
for i in 1 2 3; do kill -TERM "${pids[$((i-1))]}"; done
wait "${pids[0]}" "${pids[1]}" "${pids[2]}" 2>/dev/null || true
pids=()
python3 - "$work"/d1.json "$work"/d2.json "$work"/d3.json <<'PY'
import json, sys
reports = [json.loads(open(p).read().splitlines()[-1]) for p in sys.argv[1:]]
print("demo: what each downstream received:")
for r in reports:
    print(f"  {r['address']}: {r['received']} datagrams from {len(r['sources'])} sources")
total = sum(r["received"] for r in reports)
print(f"demo: {total} of 60000 delivered, each exactly once (round robin)")
PY

echo
echo "== ReusePortLB: three collectors on one port, source-IP steering =="
port=$(python3 -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
for i in 0 1 2; do
  "$bin/collector" 127.0.0.1 "$port" "$i" 3 --rcvbuf 8388608 >"$work/c$i.json" 2>"$work/c$i.err" &
  pids+=($!)
  wait_ready "$work/c$i.err" ready
  sed 's/^/  /' "$work/c$i.err"
done
echo "demo: round 1: 48000 datagrams from 127.0.0.10-127.0.0.57"
"$bin/publisher" 127.0.0.1 "$port" 48000 --sources 127.0.0.10-127.0.0.57 --rate 100000 >/dev/null
sleep 0.3
echo "demo: killing collector 1 with SIGKILL (no clean-up, as in a crash); round 2: the same again"
kill -KILL "${pids[1]}"; wait "${pids[1]}" 2>/dev/null || true
"$bin/publisher" 127.0.0.1 "$port" 48000 --sources 127.0.0.10-127.0.0.57 --rate 100000 >/dev/null
sleep 0.3
kill -TERM "${pids[0]}" "${pids[2]}"; wait "${pids[0]}" "${pids[2]}" 2>/dev/null || true
pids=()
python3 - "$work/c0.json" "$work/c2.json" <<'PY'
import json, sys
reports = [json.loads(open(path).read().splitlines()[-1]) for path in sys.argv[1:]]
print("demo: where each source landed (1000 datagrams per source per round)")
for r in reports:
    own = sorted(s for s, v in r["sources"].items() if v["packets"] == 2000)
    moved = sorted(s for s, v in r["sources"].items() if v["packets"] == 1000)
    print(f"  collector slot {r['slot']} ({r['steering']}): {r['received']} datagrams, lost {r.get('lost', 'n/a (two publisher runs per source; delivered counts below)')}, socket drops {r['socket_drops']}")
    print(f"    its own sources, both rounds: {', '.join(own)}")
    print(f"    failed over from slot 1 in round 2: {', '.join(moved) or '-'}")
k = reports[0]["kernel"]
print(f"demo: kernel counters: selected {k['selected']}, failed_over {k['failed_over']}, fallback {k['fallback']}")
round2 = k["failed_over"] + sum(v["packets"] // 2 for r in reports for v in r["sources"].values() if v["packets"] == 2000)
print(f"demo: round 2 delivered {round2} of 48000 datagrams while slot 1 was dead")
PY
echo "demo: done; nothing is left pinned: $(ls /sys/fs/bpf/reuseportlb 2>/dev/null | wc -l) group directories under /sys/fs/bpf/reuseportlb"
