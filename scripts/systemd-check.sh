#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make systemd-check: the udp-fanout package under systemd itself (docs/restarts.md). A clean
# Debian root (scripts/lib/debian_root.sh) with systemd 252 and the package of `make deb`, booted
# by systemd-nspawn in a network namespace of its own; inside, with 60,000 datagrams at 20,000/s
# flowing from the package's publisher to its collector through a userspace listener:
#  1. `systemctl restart udp-fanout` (the descriptor store hands the sockets to the next process):
#     every datagram delivered;
#  2. kill -9 of the daemon, systemd's own restart (Restart=on-failure, RestartSec=2s): every
#     datagram delivered (what queued meanwhile waits in the stored sockets) but the batch a
#     killed worker may have held (at most 2 x batch_size 32);
#  3. `systemctl stop udp-fanout`: the store is empty (NFileDescriptorStore=0), nothing bound.
# Ports 127.0.0.1:31511-31512 in the container's own network namespace, outside the ephemeral
# range (no socket of the daemon, publisher or collector can hold one first).
# Needs root; systemd-container (scripts/setup.sh installs it). The container, its root and the
# run's files are removed on any exit; the whole run is in a private mount namespace.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/debian_root.sh
as_root_in_private_mounts systemd-check "systemd-nspawn" "$0" "$@"
say() { echo "systemd-check: $*"; }
step() { echo; echo "systemd-check: == $* ($(($(date +%s) - started)) s)"; }
fail() { echo "systemd-check: FAILED: $*" >&2; exit 1; }
command -v systemd-nspawn >/dev/null || fail "systemd-nspawn is missing: install systemd-container (scripts/setup.sh does, as root)"
version=${VERSION:-$(sed -n 's/.*static let string = "\(.*\)"/\1/p' Sources/ReusePortLB/ProjectVersion.swift)}
arch=$(dpkg --print-architecture)
deb="dist/udp-fanout_$version-${DEB_REVISION:-1}_$arch.deb"
[ -f "$deb" ] || fail "$deb is missing: run make deb first"

work=$(mktemp -d /var/tmp/udp-fanout-systemd-check.XXXXXX)
machine="udpfanout$$"
root=""
container=""
nspawn=""
cleanup() {
  local status=$?
  set +e
  if [ -n "$nspawn" ] && kill -0 "$nspawn" 2>/dev/null; then
    kill -TERM "$nspawn" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$nspawn" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$nspawn" 2>/dev/null
  fi
  wait 2>/dev/null
  if [ -n "$container" ]; then
    buildah umount "$container" >/dev/null 2>&1
    buildah rm "$container" >/dev/null 2>&1
  fi
  rm -rf "$work" "/run/systemd/nspawn/propagate/$machine"
  [ $status = 0 ] || echo "systemd-check: FAILED (exit $status) after $(($(date +%s) - started)) s" >&3
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step "a Debian root with systemd and the package"
debian_root "$work"
cp "$deb" "$root/root/"
# Not booted yet: nspawn only gives the installs /proc, /dev and the host's network (the mirror).
say "\$ apt-get install --no-install-recommends systemd systemd-sysv dbus iproute2 ./$(basename "$deb")"
systemd-nspawn -q -D "$root" -M "$machine" --register=no --keep-unit --resolv-conf=copy-host -E DEBIAN_FRONTEND=noninteractive \
  sh -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends systemd systemd-sysv dbus iproute2 /root/$(basename "$deb")" \
  >"$work/install.log" 2>&1 || { tail -30 "$work/install.log" >&2; fail "installing systemd and the package in the root"; }
say "installed: $(systemd-nspawn -q -D "$root" -M "$machine" --register=no --keep-unit dpkg-query -W -f='${Package} ${Version}, ' systemd udp-fanout)"

step "boot systemd (systemd-nspawn -b, a network namespace of its own)"
# The unit's capabilities must be in the container's bounding set, and bpf() allowed by its
# system call filter; --keep-unit: no host systemd to ask for a scope.
systemd-nspawn -D "$root" -b --register=no --keep-unit -M "$machine" --private-network \
  --capability=CAP_BPF,CAP_PERFMON,CAP_NET_ADMIN --system-call-filter=bpf --console=pipe \
  >"$work/boot.log" 2>&1 </dev/null &
nspawn=$!
leader=""
for _ in $(seq 200); do
  for pid in $(pgrep -P "$nspawn" 2>/dev/null); do
    grep -q -E '^NSpid:.*[[:space:]]1$' "/proc/$pid/status" 2>/dev/null && leader=$pid
  done
  [ -n "$leader" ] && break
  kill -0 "$nspawn" 2>/dev/null || { cat "$work/boot.log" >&2; fail "systemd-nspawn ended"; }
  sleep 0.1
done
[ -n "$leader" ] || { cat "$work/boot.log" >&2; fail "no init in the container after 20 s"; }
inside() { nsenter -t "$leader" -m -u -i -n -p -- "$@"; }
state=""
for _ in $(seq 120); do
  state=$(inside systemctl is-system-running 2>&1) || true
  case "$state" in running|degraded) break ;; esac
  sleep 0.5
done
say "systemd in the container: $(inside systemctl --version | head -1), $state"
case "$state" in running|degraded) ;; *) cat "$work/boot.log" >&2; fail "the container's systemd is $state" ;; esac

step "the unit with a userspace listener"
inside sh -c 'cat > /etc/udp-fanout/config.yaml' <<'YAML'
listeners:
  - name: check
    bind: "127.0.0.1:31511"
    mode: userspace
    settings:
      workers: 2
      recv_buf_size: 16777216
    downstream:
      - name: sink
        address: "127.0.0.1:31512"
YAML
inside systemctl restart udp-fanout || { inside journalctl -u udp-fanout --no-pager | tail -30 >&2; fail "systemctl restart udp-fanout"; }
say "$(inside systemctl show -p ActiveState -p MainPID -p NFileDescriptorStore udp-fanout | tr '\n' ' ')"

# traffic ACTION: 60,000 datagrams at 20,000/s, ACTION 1 s in; fails unless every one arrives
# (kill -9: but the batch each of the two workers may have held).
traffic() {
  local action=$1
  inside sh -c 'collector 127.0.0.1 31512 0 1 --rcvbuf 67108864 --duration 12 >/root/collector.json 2>/root/collector.err & echo $! >/root/collector.pid'
  sleep 1
  inside sh -c 'publisher 127.0.0.1 31511 60000 --rate 20000 --size 100 >/root/publisher.json 2>/root/publisher.err & echo $! >/root/publisher.pid'
  sleep 1
  case $action in
    restart) say "\$ systemctl restart udp-fanout"; inside systemctl restart udp-fanout ;;
    kill9) say "\$ kill -9 \$(systemctl show -p MainPID --value udp-fanout)  (systemd restarts it after RestartSec=2s)"
      inside sh -c 'kill -9 $(systemctl show -p MainPID --value udp-fanout)' ;;
  esac
  for _ in $(seq 300); do inside sh -c 'kill -0 $(cat /root/collector.pid) 2>/dev/null' || break; sleep 0.1; done
  local sent received
  sent=$(inside sed -n 's/.*"sent": *\([0-9]*\).*/\1/p' /root/publisher.json)
  received=$(inside sed -n 's/.*"received": *\([0-9]*\).*/\1/p' /root/collector.json)
  say "$action: sent $sent, delivered $received"
  inside journalctl -u udp-fanout --no-pager -n 200 | grep -E 'taking over from|ended without a stop|adopted the sockets' | tail -2 | sed 's/^/  /'
  local allowed=0
  [ "$action" = kill9 ] && allowed=64
  [ "${sent:-0}" = 60000 ] && [ -n "$received" ] && [ "$received" -ge $((sent - allowed)) ] || fail "$action: sent ${sent:-?}, delivered ${received:-?}"
  inside systemctl is-active -q udp-fanout || fail "$action: udp-fanout is not active afterwards"
}

step "systemctl restart under traffic"
traffic restart

step "kill -9 under traffic (systemd's Restart=on-failure)"
traffic kill9

step "systemctl stop"
inside systemctl stop udp-fanout
stored=$(inside systemctl show -p NFileDescriptorStore --value udp-fanout)
bound=$(inside ss -Huanp | grep -c ':31511 ' || true)
say "after the stop: NFileDescriptorStore=$stored, sockets on 127.0.0.1:31511: $bound"
[ "$stored" = 0 ] && [ "$bound" = 0 ] || fail "the stop left the store ($stored) or a socket ($bound)"

inside systemctl poweroff || true
for _ in $(seq 200); do kill -0 "$nspawn" 2>/dev/null || break; sleep 0.1; done
step "passed in $(($(date +%s) - started)) s: under systemd, restart and kill -9 under traffic delivered every datagram; the stop left nothing"
