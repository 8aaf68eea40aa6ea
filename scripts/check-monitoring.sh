#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# scripts/check-monitoring.sh BIN_DIR: the monitoring kit (docs/monitoring.md) against a real
# Prometheus and a real udp-fanout.
#   1. promtool check rules and promtool test rules on monitoring/prometheus/;
#   2. the dashboard JSON, the Grafana provisioning files, k8s/monitoring/ (kubernetes-validate on
#      the Service; the ServiceMonitor and PodMonitor, which it cannot know, field by field, their
#      selectors against the Services and DaemonSets of k8s/) and every runbook_url's anchor;
#   3. starts five collectors, a udp-fanout (a one-way listener with 3 downstreams, a relay
#      listener with 2, health checks on) and Prometheus (scrape and rule evaluation every 1 s,
#      the rules loaded), sends bounded traffic with publisher, one reload with a valid file,
#      one with an invalid file, and stops one downstream;
#   4. through Prometheus' HTTP API: every panel query of the dashboard (and its variables) must
#      return series; every alert's expression is evaluated, and the rules evaluate without error.
# Everything listens on and sends to 127.0.0.1, on fixed ports MONITORING_PORT_BASE (31300) to
# +23, outside the kernel's ephemeral range (net.ipv4.ip_local_port_range), so no socket the
# kernel gives a port to takes one between the check and the bind; a port taken fails the run
# naming it. Exits non-zero on any failure.
# BIN_DIR holds udp-fanout, collector and publisher (e.g. .build/debug, or a copy of it).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

say() { echo "check-monitoring: $*"; }
fail() { echo "check-monitoring: FAILED: $*" >&2; exit 1; }

[ $# -eq 1 ] || fail "usage: scripts/check-monitoring.sh BIN_DIR (the directory of udp-fanout, collector, publisher)"
[ -d "$1" ] || fail "BIN_DIR $1 is not a directory"
bin=$(cd "$1" && pwd)
for tool in udp-fanout collector publisher; do
  [ -x "$bin/$tool" ] || fail "$bin/$tool is missing or not executable"
done
prometheus=${PROMETHEUS:-/usr/bin/prometheus}
promtool=${PROMTOOL:-/usr/bin/promtool}
[ -x "$prometheus" ] || fail "$prometheus is missing (scripts/setup.sh installs Debian's prometheus)"
[ -x "$promtool" ] || fail "$promtool is missing (scripts/setup.sh installs Debian's prometheus)"
command -v python3 >/dev/null || fail "python3 is missing"
command -v curl >/dev/null || fail "curl is missing"
python3 -c 'import yaml' 2>/dev/null || fail "python3 cannot import yaml: apt-get install python3-yaml (or pip install pyyaml)"
python3 -c 'import kubernetes_validate' 2>/dev/null ||
  fail "python3 cannot import kubernetes_validate: run scripts/setup.sh (pip install kubernetes-validate==1.37.0)"
# Debug builds link the toolchain's runtime; release builds carry it (harmless then).
if [ -d /opt/swift/usr/lib/swift/linux ]; then
  export PATH=/opt/swift/usr/bin:$PATH
  export LD_LIBRARY_PATH=/opt/swift/usr/lib/swift/linux${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

rules=$root/monitoring/prometheus/udp-fanout-rules.yml
rules_test=$root/monitoring/prometheus/udp-fanout-rules.test.yml
dashboard=$root/monitoring/grafana/udp-fanout.json

base=${MONITORING_PORT_BASE:-31300}
read -r ephemeral_low ephemeral_high </proc/sys/net/ipv4/ip_local_port_range
{ [[ $base =~ ^[0-9]+$ ]] && [ "$base" -ge 1024 ] && [ $((base + 23)) -le 65535 ] &&
  { [ $((base + 23)) -lt "$ephemeral_low" ] || [ "$base" -gt "$ephemeral_high" ]; }; } ||
  fail "MONITORING_PORT_BASE=$base: the ports used are BASE..BASE+23 and must lie outside the ephemeral range $ephemeral_low-$ephemeral_high (net.ipv4.ip_local_port_range), above 1023"
prom_port=$base
metrics_port=$((base + 1))
oneway_port=$((base + 2))
relay_port=$((base + 3))
collector_ports=($((base + 10)) $((base + 11)) $((base + 12)) $((base + 13)) $((base + 14)))
client_port_base=$((base + 20)) # the relay clients: 4 ports
clients=4

work=$(mktemp -d /tmp/check-monitoring.XXXXXX)
declare -A started=() # pid -> what
cleanup() {
  local status=$?
  local pid
  for pid in "${!started[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${!started[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "check-monitoring: ${started[$pid]} (pid $pid) did not stop on SIGTERM within 5 s: SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
  if [ "$status" -ne 0 ]; then
    for log in "$work"/*.log; do
      [ -s "$log" ] || continue
      echo "----- last lines of $(basename "$log") -----" >&2
      tail -n 15 "$log" >&2
    done
  fi
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start NAME CMD...: runs CMD in the background, output in $work/NAME.log (stdout in NAME.out).
start() {
  local name=$1
  shift
  "$@" >"$work/$name.out" 2>"$work/$name.log" &
  started[$!]=$name
  last_pid=$!
}
stop() { # stop PID: SIGTERM, wait at most 10 s
  local pid=$1
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && fail "${started[$pid]} (pid $pid) did not stop within 10 s of SIGTERM"
  wait "$pid" 2>/dev/null || true
  unset "started[$pid]"
}
# wait_for SECONDS WHAT CMD...: polls CMD every 0.2 s; fails naming WHAT when the time is up.
wait_for() {
  local seconds=$1 what=$2
  shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $deadline ] || fail "$what did not happen within $seconds s"
    sleep 0.2
  done
}
alive() { # alive PID: fails naming the process if it exited
  kill -0 "$1" 2>/dev/null || fail "${started[$1]} (pid $1) exited early: $(tail -n 5 "$work/${started[$1]}.log" | tr '\n' ' ')"
}
metric() { # metric SERIES: its value on the daemon's /metrics ('' if absent)
  curl -sf --max-time 2 "http://127.0.0.1:$metrics_port/metrics" | awk -v s="$1" 'index($0, s " ") == 1 { print $2 }'
}
metric_is() { [ "$(metric "$1")" = "$2" ]; }
metric_above() { local v; v=$(metric "$1"); [ -n "$v" ] && [ "$v" -gt "$2" ]; }
prom_query_nonempty() { # PromQL returns at least one series in Prometheus
  curl -sf --max-time 5 -G "http://127.0.0.1:$prom_port/api/v1/query" --data-urlencode "query=$1" |
    python3 -c 'import json,sys; sys.exit(0 if json.load(sys.stdin)["data"]["result"] else 1)'
}

say "binaries from $bin ($("$bin/udp-fanout" --version)); $("$prometheus" --version 2>&1 | head -n 1)"

# 1. promtool
say "promtool check rules $rules"
"$promtool" check rules "$rules" || fail "promtool check rules $rules"
say "promtool test rules $rules_test"
"$promtool" test rules "$rules_test" || fail "promtool test rules $rules_test"

# 2. Static checks (dashboard, provisioning, k8s/monitoring/, runbook anchors)
cat >"$work/static.py" <<'PY'
import json, re, sys, yaml
root = sys.argv[1]
errors = []
def check(ok, message):
    if not ok:
        errors.append(message)
    return ok

# The dashboard: provisioning-ready, every panel on the datasource variable.
d = json.load(open(f"{root}/monitoring/grafana/udp-fanout.json"))
for key in ("uid", "title", "schemaVersion", "panels", "templating"):
    check(key in d, f"dashboard: no {key}")
variables = {v["name"]: v for v in d.get("templating", {}).get("list", [])}
ds = variables.get("datasource", {})
check(ds.get("type") == "datasource" and ds.get("query") == "prometheus", "dashboard: no datasource variable of type datasource, query prometheus")
check("label_values(" in str(variables.get("listener", {}).get("query", "")), "dashboard: no listener variable from label_values")
ids = [p["id"] for p in d["panels"]]
check(len(ids) == len(set(ids)), f"dashboard: panel ids repeat: {ids}")
panels = [p for p in d["panels"] if p.get("type") != "row"]
for p in panels:
    check(p.get("datasource", {}).get("uid") == "${datasource}", f'dashboard: panel "{p.get("title")}" is not on ${{datasource}}')
    check(bool(p.get("targets")), f'dashboard: panel "{p.get("title")}" has no target')
    for t in p.get("targets", []):
        check(t.get("datasource", {}).get("uid") == "${datasource}", f'dashboard: a target of panel "{p["title"]}" is not on ${{datasource}}')
    check({"h", "w", "x", "y"} <= set(p.get("gridPos", {})), f'dashboard: panel "{p.get("title")}" has no gridPos')
print(f"check-monitoring: dashboard {d['title']} (uid {d['uid']}, schemaVersion {d['schemaVersion']}): "
      f"{len(panels)} panels, {sum(len(p['targets']) for p in panels)} queries, variables {', '.join(variables)}")

# Grafana provisioning files.
provider = yaml.safe_load(open(f"{root}/monitoring/grafana/provisioning/dashboards/udp-fanout.yaml"))
check(provider.get("apiVersion") == 1 and provider["providers"][0]["type"] == "file" and provider["providers"][0]["options"]["path"],
      "provisioning/dashboards/udp-fanout.yaml: not a file provider with options.path")
source = yaml.safe_load(open(f"{root}/monitoring/grafana/provisioning/datasources/prometheus.yaml"))
check(source.get("apiVersion") == 1 and source["datasources"][0]["type"] == "prometheus",
      "provisioning/datasources/prometheus.yaml: not a prometheus datasource")
print("check-monitoring: grafana provisioning: dashboards provider and prometheus datasource parse")

# k8s/: the DaemonSets' pods and the metrics Services.
def documents(path):
    return [x for x in yaml.safe_load_all(open(path)) if isinstance(x, dict)]
import glob
top = [doc for f in sorted(glob.glob(f"{root}/k8s/*.yaml")) for doc in documents(f)]
daemonsets = [x for x in top if x.get("kind") == "DaemonSet"]
check(len(daemonsets) >= 1, "k8s/: no DaemonSet")
services = documents(f"{root}/k8s/monitoring/service-metrics.yaml")
def matches(selector, labels):
    if not selector or not (selector.get("matchLabels") or selector.get("matchExpressions")):
        return False
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        op, k, values = e["operator"], e["key"], e.get("values", [])
        if op == "In" and labels.get(k) not in values: return False
        if op == "NotIn" and labels.get(k) in values: return False
        if op == "Exists" and k not in labels: return False
        if op == "DoesNotExist" and k in labels: return False
    return True
def metrics_port(ds):
    c = ds["spec"]["template"]["spec"]["containers"][0]
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}.get("metrics")
namespace = {x["metadata"]["namespace"] for x in daemonsets}
for ds_ in daemonsets:
    pod = ds_["spec"]["template"]["metadata"]["labels"]
    check(metrics_port(ds_) is not None, f'DaemonSet {ds_["metadata"]["name"]}: no container port named metrics')
    owners = [s for s in services if s["spec"]["selector"].items() <= pod.items()]
    check(len(owners) == 1, f'service-metrics.yaml: {len(owners)} Services select the pods of DaemonSet {ds_["metadata"]["name"]}')
    for s in owners:
        port = s["spec"]["ports"][0]
        check(port["name"] == "metrics" and port["targetPort"] in ("metrics", metrics_port(ds_)),
              f'Service {s["metadata"]["name"]}: port is not the metrics port of DaemonSet {ds_["metadata"]["name"]}')
for s in services:
    check(s["metadata"]["namespace"] in namespace, f'Service {s["metadata"]["name"]}: namespace {s["metadata"]["namespace"]} is not the DaemonSets\'')
# The ConfigMaps' metrics section: not loopback, same port and path as the monitors.
paths = set()
for cm in (x for x in top if x.get("kind") == "ConfigMap" and "config.yaml" in x.get("data", {})):
    m = yaml.safe_load(cm["data"]["config.yaml"]).get("metrics", {})
    check(not str(m.get("bind", "127.0.0.1")).startswith("127."), f'ConfigMap {cm["metadata"]["name"]}: metrics.bind is loopback: no scraper reaches it')
    paths.add(m.get("path", "/metrics"))
for name, kind, endpoints_key, targets in (
        ("servicemonitor.yaml", "ServiceMonitor", "endpoints", [(s["metadata"]["name"], s["metadata"]["labels"]) for s in services]),
        ("podmonitor.yaml", "PodMonitor", "podMetricsEndpoints", [(x["metadata"]["name"], x["spec"]["template"]["metadata"]["labels"]) for x in daemonsets])):
    docs = documents(f"{root}/k8s/monitoring/{name}")
    if not check(len(docs) == 1, f"k8s/monitoring/{name}: {len(docs)} documents, not 1"):
        continue
    m = docs[0]
    check(m.get("apiVersion") == "monitoring.coreos.com/v1", f"{name}: apiVersion is not monitoring.coreos.com/v1")
    check(m.get("kind") == kind, f"{name}: kind is not {kind}")
    check(bool(m.get("metadata", {}).get("name")) and m["metadata"].get("namespace") in namespace, f"{name}: metadata.name, or namespace not the DaemonSets'")
    spec = m.get("spec", {})
    check(bool(spec.get("selector")), f"{name}: no spec.selector")
    check(set(spec.get("namespaceSelector", {}).get("matchNames", list(namespace))) >= namespace, f"{name}: namespaceSelector leaves the DaemonSets' namespace out")
    endpoints = spec.get(endpoints_key) or []
    check(bool(endpoints), f"{name}: no spec.{endpoints_key}")
    for e in endpoints:
        check(e.get("port") == "metrics", f"{name}: an endpoint's port is not the port named metrics")
        check(e.get("path", "/metrics") in paths, f"{name}: path {e.get('path')} is not the ConfigMaps' metrics.path {paths}")
    selected = [n for n, labels in targets if matches(spec.get("selector"), labels)]
    check(len(selected) == len(targets), f"{name}: the selector matches {selected} of {[n for n, _ in targets]}")
    print(f"check-monitoring: k8s/monitoring/{name}: {kind}, selector matches {', '.join(selected)}, port metrics, path {endpoints[0].get('path') if endpoints else None}")

# runbook_url anchors against docs/monitoring.md's headings (GitHub's anchors).
def slug(heading):
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")
anchors = {slug(line.lstrip("#")) for line in open(f"{root}/docs/monitoring.md") if line.startswith("#")}
rules = yaml.safe_load(open(f"{root}/monitoring/prometheus/udp-fanout-rules.yml"))
alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
for r in alerts:
    url = r.get("annotations", {}).get("runbook_url", "")
    check(url.startswith("docs/monitoring.md#") and url.split("#", 1)[1] in anchors, f"alert {r['alert']}: runbook_url {url!r} has no heading in docs/monitoring.md")
    check(bool(r.get("for")) and r.get("labels", {}).get("severity") and {"summary", "description"} <= set(r.get("annotations", {})),
          f"alert {r['alert']}: needs for, labels.severity, annotations summary and description")
tests = yaml.safe_load(open(f"{root}/monitoring/prometheus/udp-fanout-rules.test.yml"))
for r in alerts:
    cases = [c for t in tests["tests"] for c in t.get("alert_rule_test", []) if c["alertname"] == r["alert"]]
    check(any(c.get("exp_alerts") for c in cases) and any(c.get("exp_alerts") == [] for c in cases),
          f"alert {r['alert']}: the unit tests need a case where it fires and one where it stays silent")
print(f"check-monitoring: {len(alerts)} alerts: runbook anchors in docs/monitoring.md, for, severity, annotations, a firing and a silent unit test each")
for e in errors:
    print(f"check-monitoring: FAILED: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
PY
python3 "$work/static.py" "$root" || fail "static checks (above)"
say "kubernetes-validate --strict (Kubernetes 1.30.0) k8s/monitoring/service-metrics.yaml"
python3 -m kubernetes_validate --strict --quiet --kubernetes-version 1.30.0 k8s/monitoring/service-metrics.yaml ||
  fail "kubernetes-validate k8s/monitoring/service-metrics.yaml"

# 3. The live run
cat >"$work/ports.py" <<'PY'
import socket, sys
taken = []
for spec in sys.argv[1:]:
    kind, port, what = spec.split(":", 2)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM)
    if kind == "tcp":
        # As Prometheus and udp-fanout's endpoint do: a TIME_WAIT left by a previous run is no owner.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", int(port)))
    except OSError as e:
        taken.append(f"{kind} 127.0.0.1:{port} ({what}): {e.strerror}")
    finally:
        s.close()
for t in taken:
    print(f"check-monitoring: FAILED: port taken: {t}; free it or set MONITORING_PORT_BASE", file=sys.stderr)
sys.exit(1 if taken else 0)
PY
specs=("tcp:$prom_port:prometheus" "tcp:$metrics_port:udp-fanout metrics" "udp:$oneway_port:listener oneway" "udp:$relay_port:listener relay")
for i in 0 1 2 3 4; do specs+=("udp:${collector_ports[$i]}:collector c$((i + 1))"); done
for i in $(seq 0 $((clients - 1))); do specs+=("udp:$((client_port_base + i)):relay client $i"); done
python3 "$work/ports.py" "${specs[@]}" || fail "fixed ports of 127.0.0.1 in use (above)"
say "ports (127.0.0.1): prometheus $prom_port, metrics $metrics_port, listeners oneway $oneway_port and relay $relay_port, collectors ${collector_ports[*]}, relay clients $client_port_base-$((client_port_base + clients - 1))"

declare -A collector_pid=()
for i in 1 2 3 4 5; do
  port=${collector_ports[$((i - 1))]}
  start "c$i" "$bin/collector" 127.0.0.1 "$port" 0 1 --echo --steering kernelHash --tag "c$i"
  collector_pid[$i]=$last_pid
done
for i in 1 2 3 4 5; do
  wait_for 20 "collector c$i's 'ready' line (log: $work/c$i.log)" grep -q 'collector: ready' "$work/c$i.log"
done
say "started collectors c1-c5 (--echo, answering udp_echo health probes) on ${collector_ports[*]}"

write_config() { # write_config WEIGHT_OF_C2
  cat >"$work/config.yaml" <<YAML
listeners:
  - name: oneway
    bind: "127.0.0.1:$oneway_port"
    mode: userspace
    balancing: round_robin
    downstream:
      - {name: c1, address: "127.0.0.1:${collector_ports[0]}"}
      - {name: c2, address: "127.0.0.1:${collector_ports[1]}", weight: $1}
      - {name: c3, address: "127.0.0.1:${collector_ports[2]}"}
    settings: {workers: 1}
  - name: relay
    bind: "127.0.0.1:$relay_port"
    mode: userspace
    replies: relay
    balancing: round_robin
    downstream:
      - {name: c4, address: "127.0.0.1:${collector_ports[3]}"}
      - {name: c5, address: "127.0.0.1:${collector_ports[4]}"}
    settings: {workers: 1, worker_steering: five_tuple, max_sessions: 1024, session_idle_secs: 600}
health:
  enabled: true
  protocol: udp_echo
  interval_secs: 1
  timeout_secs: 1
  fall: 2
  rise: 1
metrics:
  enabled: true
  bind: "127.0.0.1:$metrics_port"
  path: /metrics
YAML
}
write_config 1
"$bin/udp-fanout" --check -c "$work/config.yaml" >"$work/check.out" 2>&1 || fail "udp-fanout --check: $(cat "$work/check.out")"
start udp-fanout "$bin/udp-fanout" -c "$work/config.yaml"
fanout=$last_pid
wait_for 30 "udp-fanout's /readyz answering 200 (log: udp-fanout.log)" curl -sf --max-time 2 "http://127.0.0.1:$metrics_port/readyz"
alive "$fanout"
say "started udp-fanout (pid $fanout): listener oneway (userspace, c1-c3), listener relay (replies: relay, c4-c5), health udp_echo every 1 s; /readyz 200"

cat >"$work/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - $rules
scrape_configs:
  - job_name: udp-fanout
    static_configs:
      - targets: ["127.0.0.1:$metrics_port"]
YAML
"$promtool" check config "$work/prometheus.yml" >"$work/promtool-config.out" 2>&1 ||
  fail "promtool check config: $(cat "$work/promtool-config.out")"
start prometheus "$prometheus" --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$prom_port" --log.level=warn
prom=$last_pid
wait_for 60 "Prometheus' /-/ready answering 200 on 127.0.0.1:$prom_port (log: prometheus.log)" \
  curl -sf --max-time 2 "http://127.0.0.1:$prom_port/-/ready"
wait_for 30 "Prometheus' first successful scrape of udp-fanout (up == 1)" prom_query_nonempty 'up{job="udp-fanout"} == 1'
say "started Prometheus (pid $prom) on 127.0.0.1:$prom_port: scrape and evaluation every 1 s, storage $work/tsdb, rules $rules"

start publisher-oneway "$bin/publisher" 127.0.0.1 "$oneway_port" 40000 --rate 2000 --duration 30 --sources 127.0.0.1-127.0.0.8
pub_oneway=$last_pid
start publisher-relay "$bin/publisher" 127.0.0.1 "$relay_port" 1000 --exchange --clients "$clients" \
  --client-port-base "$client_port_base" --sources 127.0.0.1 --duration 30
pub_relay=$last_pid
say "publisher: 40000 datagrams at 2000/s from 127.0.0.1-8 to oneway; 1000 exchanges of each of $clients clients through relay (each at most 30 s)"
wait_for 20 "datagrams forwarded by listener oneway" metric_above 'udp_fanout_packets_forwarded_total{listener="oneway",mode="userspace"}' 0
wait_for 20 "relay sessions (udp_fanout_associations of listener relay)" metric_above 'udp_fanout_associations{listener="relay",mode="userspace"}' 0

write_config 2
kill -HUP "$fanout"
wait_for 20 "a reload counted ok after SIGHUP with a valid file (c2 weight 2)" metric_is 'udp_fanout_config_reloads_total{result="ok"}' 1
say "SIGHUP with a valid file (c2 weight 2): udp_fanout_config_reloads_total{result=\"ok\"} 1"
printf 'listeners:\n  - name: oneway\n    bind: "not an address"\n' >"$work/config.yaml"
kill -HUP "$fanout"
wait_for 20 "a reload counted rejected after SIGHUP with an invalid file" metric_is 'udp_fanout_config_reloads_total{result="rejected"}' 1
write_config 2
alive "$fanout"
say "SIGHUP with an invalid file: udp_fanout_config_reloads_total{result=\"rejected\"} 1; the daemon runs on"

sleep 3
stop "${collector_pid[3]}"
wait_for 30 "udp_fanout_downstream_up{downstream=\"c3\"} 0 in Prometheus after collector c3 stopped" \
  prom_query_nonempty 'udp_fanout_downstream_up{listener="oneway",downstream="c3"} == 0'
say "stopped collector c3: health took it out (udp_fanout_downstream_up{downstream=\"c3\"} 0 in Prometheus)"

for pid in "$pub_oneway" "$pub_relay"; do
  name=${started[$pid]}
  for _ in $(seq 450); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && fail "$name did not finish within 45 s"
  wait "$pid" || fail "$name exited with status $?: $(tail -n 3 "$work/$name.log")"
  unset "started[$pid]"
done
summary() { # summary FILE KEY...: the publisher's JSON line, those keys only
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print(", ".join(f"{k} {r.get(k)}" for k in sys.argv[2:]))' "$@" 2>/dev/null ||
    head -c 300 "$1"
}
say "publisher oneway: $(summary "$work/publisher-oneway.out" sent seconds)"
say "publisher relay: $(summary "$work/publisher-relay.out" exchanges replies lost wrong_source seconds)"
alive "$fanout"
say "udp-fanout: received $(metric 'udp_fanout_packets_received_total{listener="oneway",mode="userspace"}') forwarded $(metric 'udp_fanout_packets_forwarded_total{listener="oneway",mode="userspace"}') on oneway; relay sessions $(metric 'udp_fanout_associations{listener="relay",mode="userspace"}'), replies $(metric 'udp_fanout_replies_total{listener="relay",mode="userspace"}')"
wait_for 20 "Prometheus scraping the rejected reload" prom_query_nonempty 'udp_fanout_config_reloads_total{result="rejected"} == 1'
sleep 2

# 4. Every panel and variable query, every alert expression, through Prometheus' API
cat >"$work/queries.py" <<'PY'
import json, re, sys, urllib.parse, urllib.request
api, dashboard_path = sys.argv[1], sys.argv[2]
failures = []
def query(expr):
    url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        body = json.load(e)
    if body.get("status") != "success":
        raise ValueError(f"{body.get('errorType')}: {body.get('error')}")
    return body["data"]["result"]
def substitute(expr):
    expr = re.sub(r"\$\{?__(rate_)?interval\}?", "15s", expr)
    expr = re.sub(r"\$\{?__range\}?", "5m", expr)
    return re.sub(r"\$\{?(job|instance|listener)(:[a-z]+)?\}?|\[\[(job|instance|listener)\]\]", ".*", expr)

d = json.load(open(dashboard_path))
for v in d["templating"]["list"]:
    if v["type"] != "query":
        continue
    q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q.strip())
    expr = f"count by ({m.group(2)}) ({substitute(m.group(1))})" if m else None
    try:
        values = sorted(s["metric"].get(m.group(2), "") for s in query(expr)) if m else []
    except ValueError as e:
        values, q = [], f"{q} ({e})"
    print(f'check-monitoring: variable "{v["name"]}": {q} -> {len(values)} values {values}')
    if not values:
        failures.append(f'variable "{v["name"]}": {q} -> no values')
listeners = [s["metric"]["listener"] for s in query('count by (listener) (udp_fanout_packets_received_total)')]
if sorted(listeners) != ["oneway", "relay"]:
    failures.append(f"listeners in Prometheus: {listeners}, not oneway and relay")

for p in d["panels"]:
    for t in p.get("targets", []):
        expr = substitute(t["expr"])
        try:
            n = len(query(expr))
            print(f'check-monitoring: panel "{p["title"]}": {expr} -> {n} series')
        except ValueError as e:
            n = 0
            print(f'check-monitoring: panel "{p["title"]}": {expr} -> error {e}')
        if n == 0:
            failures.append(f'panel "{p["title"]}": {expr} -> no series')

with urllib.request.urlopen(f"{api}/api/v1/rules", timeout=10) as r:
    groups = json.load(r)["data"]["groups"]
rules = [r for g in groups for r in g["rules"] if r["type"] == "alerting"]
if len(rules) < 7:
    failures.append(f"Prometheus loaded {len(rules)} alerting rules, expected 7")
# What this run makes true: a rejected reload, c3 out of rotation. What must stay silent.
expected = {"UdpFanoutReloadRejected": True, "UdpFanoutDownstreamDown": True, "UdpFanoutTargetDown": False,
            "UdpFanoutListenerLost": False, "UdpFanoutNoHealthyDownstream": False, "UdpFanoutDatapathStalled": False}
for r in rules:
    if r.get("health") != "ok":
        failures.append(f'alert {r["name"]}: Prometheus evaluates it with health {r.get("health")}: {r.get("lastError")}')
    try:
        result = query(r["query"])
        shown = "; ".join(",".join(f"{k}={v}" for k, v in sorted(s["metric"].items()) if k not in ("job", "instance")) + f" = {s['value'][1]}" for s in result)
        print(f'check-monitoring: alert {r["name"]} (health {r.get("health")}, state {r.get("state")}): {" ".join(r["query"].split())} -> {len(result)} series{": " + shown if shown else ""}')
    except ValueError as e:
        failures.append(f'alert {r["name"]}: {r["query"]} -> {e}')
        continue
    if r["name"] in expected and bool(result) != expected[r["name"]]:
        failures.append(f'alert {r["name"]}: its expression returned {len(result)} series on this run, expected {"some" if expected[r["name"]] else "none"}')
    if r["name"] == "UdpFanoutDownstreamDown" and not any(s["metric"].get("downstream") == "c3" for s in result):
        failures.append("alert UdpFanoutDownstreamDown: no series for the stopped downstream c3")
with urllib.request.urlopen(f"{api}/api/v1/alerts", timeout=10) as r:
    active = json.load(r)["data"]["alerts"]
states = {a["labels"]["alertname"]: a["state"] for a in active}
print(f"check-monitoring: alerts active in Prometheus: {states}")
for name in ("UdpFanoutReloadRejected", "UdpFanoutDownstreamDown"):
    if states.get(name) not in ("pending", "firing"):
        failures.append(f"alert {name}: not pending or firing in Prometheus ({states.get(name)})")
for f in failures:
    print(f"check-monitoring: FAILED: {f}", file=sys.stderr)
sys.exit(1 if failures else 0)
PY
python3 "$work/queries.py" "http://127.0.0.1:$prom_port" "$dashboard" || fail "queries through Prometheus (above)"

stop "$prom"
stop "$fanout"
for i in 1 2 4 5; do stop "${collector_pid[$i]}"; done
say "stopped Prometheus, udp-fanout and the collectors; removing $work"
say "OK"
