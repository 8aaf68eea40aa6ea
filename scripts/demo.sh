#!/usr/bin/env bash
# Demo: three collectors share one UDP port through ReusePortLB (source-IP steering), the
# publisher sends from 48 source addresses; then collector 1 is killed with SIGKILL and its
# sources fail over to the other two without loss. Prints where each source landed.
# Everything runs on loopback and stops by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/opt/swift/usr/bin:$PATH"
echo "demo: building (release)"
swift build -c release >/dev/null
bin=$(swift build -c release --show-bin-path)
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
port=$(python3 -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
echo "demo: starting 3 collectors on 127.0.0.1:$port (policy sourceIP)"
for i in 0 1 2; do
  "$bin/collector" 127.0.0.1 "$port" "$i" 3 --rcvbuf 8388608 >"$work/c$i.json" 2>"$work/c$i.err" &
  pids+=($!)
done
for i in 0 1 2; do
  for _ in $(seq 100); do grep -q ready "$work/c$i.err" && break; sleep 0.05; done
  sed 's/^/  /' "$work/c$i.err"
done
echo "demo: round 1: publisher sends 48000 datagrams from 127.0.0.10-127.0.0.57 at 100k/s"
"$bin/publisher" 127.0.0.1 "$port" 48000 --sources 127.0.0.10-127.0.0.57 --rate 100000 | python3 -c 'import json,sys; r=json.load(sys.stdin); print("  sent %d in %.3f s (%.0f pps)" % (r["sent"], r["seconds"], r["pps"]))'
sleep 0.3
echo "demo: killing collector 1 with SIGKILL (no clean-up, as in a crash)"
kill -KILL "${pids[1]}"; wait "${pids[1]}" 2>/dev/null || true
echo "demo: round 2: the same 48000 datagrams again"
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
    print(f"  collector slot {r['slot']} ({r['steering']}): {r['received']} datagrams, lost {r['lost']}, socket drops {r['socket_drops']}")
    print(f"    its own sources, both rounds: {', '.join(own)}")
    print(f"    failed over from slot 1 in round 2: {', '.join(moved) or '-'}")
k = reports[0]["kernel"]
print(f"demo: kernel counters: selected {k['selected']}, failed_over {k['failed_over']}, fallback {k['fallback']}")
round2 = k["failed_over"] + sum(v["packets"] // 2 for r in reports for v in r["sources"].values() if v["packets"] == 2000)
print(f"demo: round 2 delivered {round2} of 48000 datagrams while slot 1 was dead")
PY
echo "demo: done; nothing is left pinned: $(ls /sys/fs/bpf/reuseportlb 2>/dev/null | wc -l) group directories under /sys/fs/bpf/reuseportlb"
