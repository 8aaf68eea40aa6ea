# SPDX-License-Identifier: Apache-2.0
# Shared by scripts/dist-check.sh and scripts/container.sh: the forwarding smoke test's parts.
# Each function fails loudly (a message naming what failed, then exit 1).

# A free UDP port on 127.0.0.1.
free_port() {
  python3 -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# write_smoke_config FILE LISTEN_PORT BALANCING PORT1 PORT2 PORT3: one userspace listener on
# 127.0.0.1:LISTEN_PORT forwarding to three collectors on 127.0.0.1, no metrics endpoint.
write_smoke_config() {
  cat >"$1" <<YAML
listeners:
  - name: smoke
    bind: "127.0.0.1:$2"
    balancing: $3
    downstream:
      - { name: a, address: "127.0.0.1:$4" }
      - { name: b, address: "127.0.0.1:$5" }
      - { name: c, address: "127.0.0.1:$6" }
    settings: { workers: 1 }
metrics: { enabled: false }
YAML
}

# start_collector BIN DIR NAME PORT [ARG...]: a collector on 127.0.0.1:PORT (report DIR/NAME.json,
# log DIR/NAME.err; further collector arguments after PORT); appends its pid to the caller's
# `pids` array; fails if it is not ready in 5 s.
start_collector() {
  "$1" 127.0.0.1 "$4" 0 1 "${@:5}" >"$2/$3.json" 2>"$2/$3.err" &
  pids+=($!)
  for _ in $(seq 100); do grep -q ready "$2/$3.err" && return 0; sleep 0.05; done
  echo "smoke: the collector on 127.0.0.1:$4 was not ready within 5 s; it said: $(cat "$2/$3.err")" >&2
  exit 1
}

# wait_for_line FILE TEXT WHAT: waits up to 10 s for TEXT in FILE; fails naming WHAT with FILE.
wait_for_line() {
  for _ in $(seq 200); do grep -q "$2" "$1" && return 0; sleep 0.05; done
  echo "smoke: $3 did not log '$2' within 10 s; it said:" >&2
  cat "$1" >&2
  exit 1
}

# stop_collectors: SIGTERM to every pid in `pids` (one that already exited is not an error: its
# report tells), then waits for them.
stop_collectors() {
  kill -TERM "${pids[@]}" 2>/dev/null || true
  wait "${pids[@]}" 2>/dev/null || true
  pids=()
}

# check_delivered WHAT EXPECTED REPORT...: every datagram arrived, each collector got some.
check_delivered() {
  local what=$1 expected=$2
  shift 2
  python3 - "$what" "$expected" "$@" <<'PY'
import json, sys
what, expected, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
counts = []
for path in paths:
    lines = open(path).read().splitlines()
    if not lines:
        sys.exit("smoke: FAILED: %s: the collector wrote no report (%s)" % (what, path))
    counts.append(json.loads(lines[-1])["received"])
print("%s: %s (%d of %d)" % (what, counts, sum(counts), expected))
if sum(counts) != expected or min(counts) == 0:
    sys.exit("smoke: FAILED: %s: expected all %d datagrams, spread over the %d collectors" % (what, expected, len(paths)))
PY
}
