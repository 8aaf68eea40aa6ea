#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make deb-check: checks the packages of `make deb` (docs/packaging.md, "Debian package"):
#  1. lintian on the three .debs: fails on any error or warning that is not overridden (every
#     override in packaging/*/lintian-overrides has its reason), prints lintian's summary;
#  2. a clean Debian root (bookworm minbase): container.sh's debootstrap base image when buildah
#     has it (`buildah from` + `buildah mount`, nothing downloaded twice), else debootstrap from a
#     cached tarball (/var/cache/udp-fanout, made once with --make-tarball); apt-get install of the
#     packages in a chroot; the users, the files, the man pages, the completions, the units
#     (systemd-analyze verify), udp-fanout --check on the conffile;
#  3. the daemon started from the chroot as udp-fanout.service would start it (its ExecStartPre=,
#     ExecStart=, User=, capabilities, UMask=, limits, RuntimeDirectory= and NOTIFY_SOCKET, read from
#     the installed unit; no systemd runs in a chroot): READY=1, /readyz, 3,000 datagrams to three
#     collectors on the host, ExecReload= (RELOADING=1, READY=1); a package upgrade under traffic
#     (apt-get installs the next version, then with 40,000 datagrams at 20,000/s flowing the service is
#     restarted as its postinst's try-restart does, by scripts/lib/service_manager.py, which
#     keeps the descriptor store as systemd does: every datagram delivered); the stop (SIGTERM,
#     STOPPING=1, exit 0, the store closed, nothing left bound); the C sample built against
#     libreuseportlb-dev and run in the chroot;
#  4. apt-get remove --purge: nothing left but what the design leaves (the system users).
# Ports: 127.0.0.1, 31500-31999 only (outside the ephemeral range). Needs root (chroot, mounts). Processes are stopped by PID,
# mounts unmounted and the root removed on any exit; the whole run is in a private mount namespace.
# DEB_CHECK_BASE=auto (default) | buildah | debootstrap.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/debian_root.sh
as_root_in_private_mounts deb-check "chroot, mounts" "$0" "$@"
source scripts/lib/smoke.sh
version=${VERSION:-$(sed -n 's/.*static let string = "\(.*\)"/\1/p' Sources/ReusePortLB/ProjectVersion.swift)}
debversion="$version-${DEB_REVISION:-1}"
arch=$(dpkg --print-architecture)
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null) || { echo "deb-check: dpkg-architecture failed: install dpkg-dev (scripts/setup.sh does, as root)" >&2; exit 1; }
packages=(udp-fanout libreuseportlb0 libreuseportlb-dev)
debs=()
for package in "${packages[@]}"; do
  deb="dist/${package}_${debversion}_$arch.deb"
  [ -f "$deb" ] || { echo "deb-check: $deb is missing: run make deb first" >&2; exit 1; }
  debs+=("$deb")
done
say() { echo "deb-check: $*"; }
step() { echo; echo "deb-check: == $* ($(($(date +%s) - started)) s)"; }
fail() { echo "deb-check: FAILED: $*" >&2; exit 1; }

work=$(mktemp -d /tmp/udp-fanout-deb-check.XXXXXX)
root=""
container=""
mounts=()
pids=()
daemon=""
listener=""
cleanup() {
  local status=$?
  set +e
  [ -n "$daemon" ] && kill -TERM "$daemon" 2>/dev/null
  for pid in "${pids[@]}" $listener; do kill -TERM "$pid" 2>/dev/null; done
  # At most 5 s for them to end, then SIGKILL: a child that ignores SIGTERM must not hold the exit.
  for _ in $(seq 50); do
    alive=""
    for pid in $daemon "${pids[@]}" $listener; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ -z "$alive" ] && break
    sleep 0.1
  done
  for pid in $daemon "${pids[@]}" $listener; do kill -KILL "$pid" 2>/dev/null; done
  wait 2>/dev/null
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount "${mounts[i]}" 2>/dev/null || umount -l "${mounts[i]}"; done
  if [ -n "$container" ]; then
    buildah umount "$container" >/dev/null 2>&1
    buildah rm "$container" >/dev/null 2>&1
  fi
  # Never remove through a mount that is still there (a bound /dev would lose its nodes).
  if grep -q " $work/" /proc/self/mountinfo; then
    echo "deb-check: mounts under $work remain; not removing it" >&3
  else
    rm -rf "$work"
  fi
  [ $status = 0 ] || echo "deb-check: FAILED (exit $status) after $(($(date +%s) - started)) s" >&3
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# free_ports N: N distinct ports of 127.0.0.1 in 31500-31999, free for both UDP and TCP: outside
# the kernel's ephemeral range, so nothing takes one between this check and the bind.
free_ports() {
  python3 - "$1" <<'PY'
import random, socket, sys
low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
if not (31999 < low or 31500 > high):
    sys.exit("deb-check: ports 31500-31999 are inside the ephemeral range %d-%d (net.ipv4.ip_local_port_range): move the range or the ports" % (low, high))
chosen = []
for port in random.sample(range(31500, 32000), 500):
    try:
        for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
            s = socket.socket(socket.AF_INET, kind)
            s.bind(("127.0.0.1", port))
            s.close()
    except OSError:
        continue
    chosen.append(port)
    if len(chosen) == int(sys.argv[1]):
        print(" ".join(map(str, chosen)))
        sys.exit(0)
sys.exit("deb-check: fewer than %s free ports in 127.0.0.1:31500-31999" % sys.argv[1])
PY
}
in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive LC_ALL=C "$@"; }

step "lintian"
for package in "${packages[@]}"; do
  file="packaging/$package/lintian-overrides"
  [ -f "$file" ] || continue
  # Every override has its reason: a comment right above it.
  awk -v f="$file" '/^#/ { c = 1; next } /^[^#[:space:]]/ { if (!c) { print f ": override without a reason: " $0; bad = 1 } c = 0 } END { exit bad }' "$file" >&2 \
    || fail "an override in $file has no reason"
done
say "\$ lintian --display-level '>=info' --show-overrides ${debs[*]}"
# (--fail-on would count the overridden tags that --show-overrides shows: the verdict is read below.)
status=0
lintian --fail-on none --display-level '>=info' --show-overrides "${debs[@]}" >"$work/lintian.log" 2>&1 || status=$?
grep -v -e '^running with root privileges' -e spelling-error-in-binary "$work/lintian.log" | sed 's/^/  /' || true
summary=""
for level in E W I O; do
  summary+="$level=$(grep -c "^$level: " "$work/lintian.log" || true) "
done
say "lintian summary: ${summary}(E error, W warning, I info, O overridden with a reason; spelling-error-in-binary info lines, from strings in the Swift runtime, not shown: $(grep -c spelling-error-in-binary "$work/lintian.log" || true))"
[ $status = 0 ] || fail "lintian exit $status (above)"
if grep -q -E '^[EW]: ' "$work/lintian.log"; then fail "lintian: an error or a warning that is not overridden (above)"; fi
if grep -E '^.: [^ ]+: (unused-override|mismatched-override)' "$work/lintian.log"; then fail "an override no longer matches (above)"; fi
say "lintian: passed (no error, no warning that is not overridden)"

step "clean Debian root"
debian_root "$work"
say "root: $root ($(cat "$root/etc/debian_version"), $(in_root dpkg-query -W -f='${Status}\n' | grep -c 'install ok installed') packages)"
mount -t proc proc "$root/proc" && mounts+=("$root/proc")
mount --bind /sys "$root/sys" && mounts+=("$root/sys")
# ReusePortLB pins a steered group under /sys/fs/bpf/reuseportlb (the C sample, below).
if mountpoint -q /sys/fs/bpf; then mount --bind /sys/fs/bpf "$root/sys/fs/bpf" && mounts+=("$root/sys/fs/bpf"); fi
mount --bind /dev "$root/dev" && mounts+=("$root/dev")
cp /etc/resolv.conf "$root/etc/resolv.conf"
mkdir -p "$root/tmp/udp-fanout-check" && chmod 0755 "$root/tmp/udp-fanout-check"
cp "${debs[@]}" "$root/tmp/udp-fanout-check/" && chmod 0644 "$root"/tmp/udp-fanout-check/*.deb
say "\$ apt-get update"
in_root apt-get update -qq >"$work/apt-update.log" 2>&1 || { cat "$work/apt-update.log" >&2; fail "apt-get update in the root"; }
# What the root holds before the packages: after the purge nothing else may be there.
snapshot() {
  in_root find / -xdev \( -path /proc -o -path /sys -o -path /dev -o -path /tmp -o -path /var/cache -o -path /var/log \
    -o -path /var/lib/apt -o -path /var/lib/dpkg -o -path /etc/ld.so.cache \) -prune -o -print | LC_ALL=C sort
}
snapshot >"$work/before.txt"

step "install"
say "\$ apt-get install -y --no-install-recommends ./udp-fanout_${debversion}_$arch.deb ./libreuseportlb0_... ./libreuseportlb-dev_..."
in_root sh -c 'cd /tmp/udp-fanout-check && apt-get install -y --no-install-recommends ./*.deb' >"$work/apt-install.log" 2>&1 \
  || { cat "$work/apt-install.log" >&2; fail "apt-get install of the packages"; }
sed -n '/^The following NEW packages/,/^[0-9]* upgraded/p' "$work/apt-install.log" | sed 's/^/  /'
grep -E '^(Setting up (udp-fanout|libreuseportlb)|Processing triggers)' "$work/apt-install.log" | sed 's/^/  /'
grep -i -E 'warning|error' "$work/apt-install.log" | sed 's/^/  apt: /' || true
for package in "${packages[@]}"; do
  in_root dpkg-query -W -f='${Package} ${Version} ${Status}\n' "$package" | sed 's/^/  /'
  in_root dpkg-query -W -f='${Status}' "$package" | grep -q 'install ok installed' || fail "$package is not installed"
done
# The packages' files and links (not their directories, which they share with others).
for deb in "${debs[@]}"; do dpkg-deb -c "$deb" | awk '$1 !~ /^d/ { sub(/^\./, "", $6); print $6 }'; done | LC_ALL=C sort -u >"$work/package-files.txt"

step "users, files, man pages, completions, units"
for user in udp-fanout collector; do
  entry=$(in_root getent passwd "$user") || fail "the system user $user does not exist"
  say "\$ getent passwd $user: $entry; group: $(in_root getent group "$user")"
  IFS=: read -r _ _ uid _ _ home shell <<<"$entry"
  [ "$uid" -lt 1000 ] && [ "$home" = /nonexistent ] && [ "$shell" = /usr/sbin/nologin ] \
    || fail "$user is not a system user without a home and a shell: $entry"
done
expected=(/usr/bin/udp-fanout /usr/bin/collector /usr/bin/publisher
  /lib/systemd/system/udp-fanout.service /lib/systemd/system/collector@.service
  /etc/udp-fanout/config.yaml /usr/lib/sysusers.d/udp-fanout.conf
  /usr/share/udp-fanout/config.example.yaml /usr/share/udp-fanout/systemd/udp-fanout-userspace.conf
  /usr/share/doc/udp-fanout/copyright /usr/share/doc/udp-fanout/changelog.Debian.gz
  "/usr/lib/$multiarch/libreuseportlb.so.0" "/usr/lib/$multiarch/libreuseportlb.so.$version"
  "/usr/lib/$multiarch/libreuseportlb.so" "/usr/lib/$multiarch/pkgconfig/reuseportlb.pc" /usr/include/reuseportlb.h)
for program in udp-fanout collector publisher; do
  expected+=("/usr/share/man/man1/$program.1.gz" "/usr/share/bash-completion/completions/$program"
    "/usr/share/zsh/vendor-completions/_$program" "/usr/share/fish/vendor_completions.d/$program.fish")
done
for path in "${expected[@]}"; do
  [ -e "$root$path" ] || fail "$path is not installed"
done
say "all ${#expected[@]} expected paths installed (programs, units, conffile, sysusers.d, man pages, 9 completions, library, header, .pc)"
in_root dpkg-query -W -f='${Conffiles}\n' udp-fanout | grep -q '^ /etc/udp-fanout/config.yaml ' \
  || fail "/etc/udp-fanout/config.yaml is not a conffile"
say "/etc/udp-fanout/config.yaml is a conffile: $(in_root dpkg-query -W -f='${Conffiles}' udp-fanout | sed 's/^ *//')"
if in_root sh -c 'command -v man' >/dev/null 2>&1; then
  say "\$ man -w udp-fanout (in the root): $(in_root man -w udp-fanout)"
else
  # minbase has no man-db: the host's man looks the page up in the root's manual tree.
  found=$(man -M "$root/usr/share/man" -w udp-fanout) || fail "man -w does not find udp-fanout in the root's manual tree"
  say "\$ man -M ROOT/usr/share/man -w udp-fanout (no man-db in minbase): ${found#"$root"}"
fi
for program in udp-fanout collector publisher; do
  name=$(MANWIDTH=100 man -l "$root/usr/share/man/man1/$program.1.gz" 2>"$work/man.err" | sed -n '/^NAME/{n;p;q}' | sed 's/^ *//')
  [ -n "$name" ] && [ ! -s "$work/man.err" ] || fail "man -l $program.1.gz: $(cat "$work/man.err")"
  bash -n "$root/usr/share/bash-completion/completions/$program" || fail "bash -n completions/$program"
  say "$program(1): $name; bash completion parses"
done
grep -H -E '^(ExecStart|ExecStartPre|ExecReload|User|DynamicUser)=' "$root"/lib/systemd/system/{udp-fanout,collector@}.service \
  | sed -e "s|^$root/lib/systemd/system/|  |"
# verify checks that each command exists: the root's programs stand in for /usr/bin (as the
# SystemdTests do for make install's /usr/local/bin).
mkdir -p "$work/units"
for unit in udp-fanout.service collector@.service; do
  sed -e "s|=\([-+!@:]*\)/usr/bin/|=\1$root/usr/bin/|" -e "s|=/bin/|=$root/bin/|" "$root/lib/systemd/system/$unit" >"$work/units/$unit"
done
verify=$(cd "$work/units" && systemd-analyze verify udp-fanout.service collector@0.service 2>&1) \
  || fail "systemd-analyze verify on the installed units: $verify"
[ -z "$verify" ] || fail "systemd-analyze verify warns on the installed units: $verify"
say "\$ systemd-analyze verify udp-fanout.service collector@0.service (installed units, commands in the root): no warning"
check=$(in_root /usr/bin/udp-fanout --check -c /etc/udp-fanout/config.yaml 2>&1) || fail "udp-fanout --check -c /etc/udp-fanout/config.yaml: $check"
say "\$ udp-fanout --check -c /etc/udp-fanout/config.yaml (the shipped conffile):"
echo "$check" | sed 's/^/  /'

step "start the daemon from the root as udp-fanout.service does"
unit="$root/lib/systemd/system/udp-fanout.service"
value() { sed -n "s/^$1=//p" "$unit" | tail -1; }
capset() { value "$1" | tr 'A-Z ' 'a-z\n' | sed -n 's/^cap_\(.*\)/+\1/p' | paste -sd, -; }
user=$(value User); umask_value=$(value UMask); nofile=$(value LimitNOFILE); memlock=$(value LimitMEMLOCK)
ambient=$(capset AmbientCapabilities); bounding=$(capset CapabilityBoundingSet)
start_pre=$(value ExecStartPre); start=$(value ExecStart); reload_check=$(sed -n 's/^ExecReload=//p' "$unit" | grep udp-fanout | head -1)
[ "$memlock" = infinity ] && memlock=unlimited
# systemd raises the hard limits; this shell can only up to its own without CAP_SYS_RESOURCE.
limits="LimitNOFILE=$nofile, LimitMEMLOCK=$memlock"
if ! prlimit --nofile="$nofile:$nofile" --memlock="$memlock:$memlock" true 2>/dev/null; then
  hard=$(ulimit -Hn)
  if [ "$hard" != unlimited ] && [ "$nofile" -gt "$hard" ]; then
    nofile=$hard; limits="LimitNOFILE=$hard (the unit's $(value LimitNOFILE) is above this shell's hard limit: no CAP_SYS_RESOURCE here), LimitMEMLOCK=$memlock"
  fi
  hard=$(ulimit -Hl)
  if [ "$hard" != unlimited ] && [ "$memlock" = unlimited ]; then
    memlock=$((hard * 1024)); limits="${limits%LimitMEMLOCK=*}LimitMEMLOCK=${hard} kB (likewise capped)"
  fi
fi
say "unit: User=$user, capabilities $ambient (bounding $bounding), NoNewPrivileges, UMask=$umask_value, $limits, RuntimeDirectory=/run/udp-fanout"
say "not reproduced without systemd: DynamicUser='s and the Protect*/Private*/SystemCallFilter= sandboxing"
ports=$(free_ports 5)
read -r listen metrics sink0 sink1 sink2 <<<"$ports"
# The administrator edits the conffile (purge removes it all the same).
cat >"$root/etc/udp-fanout/config.yaml" <<YAML
# deb-check: a userspace listener on loopback forwarding to three collectors on the host.
listeners:
  - name: smoke
    bind: "127.0.0.1:$listen"
    balancing: source_ip
    downstream:
      - { name: a, address: "127.0.0.1:$sink0" }
      - { name: b, address: "127.0.0.1:$sink1" }
      - { name: c, address: "127.0.0.1:$sink2" }
    settings: { workers: 1, recv_buf_size: 33554432 }
metrics: { enabled: true, bind: "127.0.0.1:$metrics" }
YAML
uid=$(in_root id -u "$user"); gid=$(in_root id -g "$user")
install -d -o "$uid" -g "$gid" -m 0755 "$root/run/udp-fanout"
install -d -m 0755 "$root/run/udp-fanout-check"
: >"$work/notify.log"
# unit_command COMMAND...: sets `unit_cmd` to COMMAND run in the root with the unit's user, groups,
# capabilities, limits, umask and environment (every step execs: the command keeps the pid).
# UNIT_ENV, when set, is a word placed in env's assignments (service_manager.py's @ENV@: LISTEN_*).
unit_command() {
  unit_cmd=(chroot "$root" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8
    USER="$user" LOGNAME="$user" HOME=/ SHELL=/usr/sbin/nologin NOTIFY_SOCKET=/run/udp-fanout-check/notify
    RUNTIME_DIRECTORY=/run/udp-fanout CONFIGURATION_DIRECTORY=/etc/udp-fanout)
  [ -z "${UNIT_ENV:-}" ] || unit_cmd+=("$UNIT_ENV")
  unit_cmd+=(prlimit --nofile="$nofile:$nofile" --memlock="$memlock:$memlock"
    setpriv --reuid="$user" --regid="$user" --init-groups --inh-caps="-all,$ambient" --ambient-caps="$ambient"
    --bounding-set="-all,$bounding" --no-new-privs
    /bin/sh -c 'umask "$0"; [ -z "${LISTEN_FDS:-}" ] || export LISTEN_PID=$$; exec "$@"' "$umask_value" "$@")
}
# as_unit COMMAND...: runs it so (execs: run it in a subshell or in the background).
as_unit() {
  unit_command "$@"
  exec "${unit_cmd[@]}"
}
say "\$ ExecStartPre=$start_pre"
# shellcheck disable=SC2086 # the unit's command line, split as systemd splits this one (no quotes)
(as_unit $start_pre) >"$work/start-pre.log" 2>&1 || { cat "$work/start-pre.log" >&2; fail "ExecStartPre= failed"; }
sed 's/^/  /' "$work/start-pre.log"
i=0
# (the log files exist before start_collector looks into them)
# (a receive buffer for the burst a restart leaves queued: the daemon forwards it at once)
for port in "$sink0" "$sink1" "$sink2"; do : >"$work/sink$i.err"; start_collector "$root/usr/bin/collector" "$work" "sink$i" "$port" --rcvbuf 33554432; i=$((i+1)); done
say "collectors on the host: 127.0.0.1:$sink0 127.0.0.1:$sink1 127.0.0.1:$sink2 (pids ${pids[*]})"
say "\$ ExecStart=$start (run by scripts/lib/service_manager.py, standing in for PID 1: NOTIFY_SOCKET, NotifyAccess=main, the descriptor store of FileDescriptorStoreMax=$(value FileDescriptorStoreMax))"
# shellcheck disable=SC2086
UNIT_ENV=@ENV@ unit_command $start
python3 scripts/lib/service_manager.py "$root/run/udp-fanout-check/notify" "$work/notify.log" "$work/daemon.pid" -- "${unit_cmd[@]}" \
  2>"$work/fanout.err" >/dev/null &
listener=$!
for _ in $(seq 200); do grep -q '^READY=1' "$work/notify.log" && break; kill -0 "$listener" 2>/dev/null || break; sleep 0.05; done
grep -q '^READY=1' "$work/notify.log" || { cat "$work/notify.log" "$work/fanout.err" >&2; fail "udp-fanout sent no READY=1 within 10 s (its log above)"; }
daemon=$(cat "$work/daemon.pid")
running_uid=$(awk '/^Uid:/ { print $2 }' "/proc/$daemon/status")
[ "$running_uid" = "$uid" ] || fail "the daemon runs as uid $running_uid, not $user ($uid)"
say "daemon pid $daemon as $user (uid $running_uid), capabilities $(grep CapEff "/proc/$daemon/status" | cut -f2) effective, $(grep CapAmb "/proc/$daemon/status" | cut -f2) ambient"
say "notify: $(grep -m1 '^READY=1' "$work/notify.log")"
grep -E "starting userspace forwarder|steering" "$work/fanout.err" | cut -c1-200 | sed 's/^/  /' || true
ready=$(python3 -c 'import sys, urllib.request; r = urllib.request.urlopen(sys.argv[1], timeout=5); print(r.status, r.read().decode().strip()[:120])' \
  "http://127.0.0.1:$metrics/readyz") || fail "GET /readyz on 127.0.0.1:$metrics"
say "\$ GET http://127.0.0.1:$metrics/readyz: $ready"
say "\$ publisher 127.0.0.1 $listen 3000 --sources 127.0.0.10-127.0.0.25 --rate 20000 (in the root)"
in_root /usr/bin/publisher 127.0.0.1 "$listen" 3000 --sources 127.0.0.10-127.0.0.25 --rate 20000 >/dev/null
sleep 0.5
say "\$ ExecReload=$reload_check; kill -HUP $daemon"
# shellcheck disable=SC2086
(as_unit $reload_check) >"$work/reload-check.log" 2>&1 || { cat "$work/reload-check.log" >&2; fail "ExecReload='s check failed"; }
kill -HUP "$daemon"
for _ in $(seq 200); do [ "$(grep -c '^READY=1' "$work/notify.log")" -ge 2 ] && break; sleep 0.05; done
grep -q '^RELOADING=1' "$work/notify.log" && [ "$(grep -c '^READY=1' "$work/notify.log")" -ge 2 ] \
  || { cat "$work/notify.log" >&2; fail "no RELOADING=1 then READY=1 after SIGHUP (notifications above)"; }
say "notify: $(grep -m1 '^RELOADING=1' "$work/notify.log" | cut -c1-80)... then $(grep '^READY=1' "$work/notify.log" | tail -1)"

step "package upgrade under traffic"
# The next version: this package with a higher version, installed over it as apt-get upgrade does.
# No systemd runs in the root, so its postinst skips the try-restart; the service manager here
# does it (SIGUSR1: SIGTERM, then a start with the descriptor store handed back).
next="$debversion+check1"
dpkg-deb -R "dist/udp-fanout_${debversion}_$arch.deb" "$work/next"
sed -i "s/^Version: .*/Version: $next/" "$work/next/DEBIAN/control"
mkdir -p "$root/tmp/udp-fanout-check"
dpkg-deb --root-owner-group -b "$work/next" "$root/tmp/udp-fanout-check/udp-fanout_${next}_$arch.deb" >/dev/null
rm -rf "$work/next"
say "\$ apt-get install ./udp-fanout_${next}_$arch.deb (in the root; the running daemon goes on forwarding)"
in_root sh -c "cd /tmp/udp-fanout-check && apt-get install -y --no-install-recommends ./udp-fanout_${next}_$arch.deb" >"$work/apt-upgrade.log" 2>&1 \
  || { cat "$work/apt-upgrade.log" >&2; fail "apt-get install of the next version"; }
grep -E '^(Preparing to unpack|Unpacking|Setting up) ' "$work/apt-upgrade.log" | sed 's/^/  /'
say "\$ publisher 127.0.0.1 $listen 40000 --sources 127.0.0.10-127.0.0.25 --rate 20000 (in the root), and 0.7 s into it:"
in_root /usr/bin/publisher 127.0.0.1 "$listen" 40000 --sources 127.0.0.10-127.0.0.25 --rate 20000 >"$work/upgrade-publisher.json" &
publisher=$!
pids+=("$publisher")
sleep 0.7
kill -0 "$publisher" 2>/dev/null || fail "the publisher ended before the restart: the restart would not be under traffic"
readies=$(grep -c '^READY=1' "$work/notify.log")
say "try-restart udp-fanout.service (what the postinst asks systemd for; no systemd runs in the root): SIGTERM, then the new version started with the stored descriptors"
kill -USR1 "$listener"
for _ in $(seq 300); do [ "$(grep -c '^READY=1' "$work/notify.log")" -gt "$readies" ] && break; sleep 0.05; done
[ "$(grep -c '^READY=1' "$work/notify.log")" -gt "$readies" ] || { cat "$work/notify.log" "$work/fanout.err" >&2; fail "no READY=1 after the restart (above)"; }
daemon=$(cat "$work/daemon.pid")
say "notify: $(grep -E '^(exited|restarting|started)' "$work/notify.log" | tail -3 | paste -sd';' | sed 's/;/; /g')"
takeover=$(grep -E "taking over from the previous process|adopted the sockets of the previous process" "$work/fanout.err") \
  || { cat "$work/fanout.err" >&2; fail "the new version did not say it took the previous process's sockets over (its log above)"; }
sed 's/^[^ ]* [^ ]* //' <<<"$takeover" | cut -c1-220 | sed 's/^/  /'
kill -0 "$publisher" 2>/dev/null && say "the publisher was still sending when the new version was ready"
wait "$publisher" || fail "the publisher failed during the upgrade"
say "publisher: $(python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print("sent %d in %.2f s" % (r["sent"], r["seconds"]))' "$work/upgrade-publisher.json")"
sleep 1

say "\$ systemctl stop udp-fanout: SIGTERM (KillSignal=SIGTERM), then the store closed (no job queued)"
kill -TERM "$listener"
wait "$listener" 2>/dev/null || true
listener=""
daemon=""
grep -q '^STOPPING=1' "$work/notify.log" || fail "no STOPPING=1 before the exit"
[ "$(grep '^exited' "$work/notify.log" | tail -1)" = "exited 0" ] || { cat "$work/fanout.err" >&2; fail "udp-fanout did not exit 0 on SIGTERM: $(grep '^exited' "$work/notify.log" | tail -1) (its log above)"; }
grep -q '^stopped: the store is closed' "$work/notify.log" || fail "the service manager did not close the store"
bound=$(ss -Hua "sport = :$listen" | wc -l)
[ "$bound" = 0 ] || fail "after the stop $bound socket(s) are still bound on 127.0.0.1:$listen: $(ss -Hua "sport = :$listen")"
say "udp-fanout exited 0 after STOPPING=1; the store closed; nothing bound on 127.0.0.1:$listen"
stop_collectors
check_delivered "deb-check: the daemon started from the root as the unit does ($user, $ambient) forwarded 3000 datagrams from 16 sources, then 40000 through the package upgrade" \
  43000 "$work/sink0.json" "$work/sink1.json" "$work/sink2.json"
rm -rf "$root/run/udp-fanout-check" "$root/tmp/udp-fanout-check/udp-fanout_${next}_$arch.deb"

step "libreuseportlb0 and libreuseportlb-dev: the C sample"
c_port=$(free_ports 1)
pc=$(PKG_CONFIG_LIBDIR="$root/usr/lib/$multiarch/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$root" pkg-config --cflags --libs reuseportlb)
say "\$ pkg-config --cflags --libs reuseportlb (the root's .pc): ${pc//$root/ROOT}"
# shellcheck disable=SC2086
cc -Wall -Werror -o "$root/tmp/udp-fanout-check/steering" "$root/usr/share/doc/libreuseportlb-dev/examples/steering.c" $pc
# Read whole first: under pipefail, grep -q ending early could fail readelf and hide a match.
dynamic=$(readelf -d "$root/tmp/udp-fanout-check/steering")
if grep -q 'RUNPATH\|RPATH' <<<"$dynamic"; then fail "the sample got a run path from reuseportlb.pc"; fi
say "ldconfig (trigger of libreuseportlb0): $(in_root ldconfig -p | grep -m1 'libreuseportlb.so.0' | sed 's/^\s*//')"
output=$(in_root /tmp/udp-fanout-check/steering "$c_port" 2>&1) || fail "the C sample exited $?: $output"
say "\$ steering $c_port (in the root): $output"
[[ $output == *"received=40 misplaced=0 selected=40 steering=ebpf"* ]] || fail "the C sample printed something else than received=40 misplaced=0 selected=40 steering=ebpf"
rm -rf "$root/tmp/udp-fanout-check"

step "apt-get remove --purge"
say "\$ apt-get remove --purge -y ${packages[*]}; apt-get autoremove --purge -y"
in_root apt-get remove --purge -y "${packages[@]}" >"$work/apt-remove.log" 2>&1 || { cat "$work/apt-remove.log" >&2; fail "apt-get remove --purge"; }
in_root apt-get autoremove --purge -y >>"$work/apt-remove.log" 2>&1 || { cat "$work/apt-remove.log" >&2; fail "apt-get autoremove --purge"; }
grep -E '^(Removing|Purging)' "$work/apt-remove.log" | sed 's/^/  /'
grep -i -E 'warning|error' "$work/apt-remove.log" | sed 's/^/  apt: /' || true
for package in "${packages[@]}"; do
  if in_root dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q -v 'not-installed'; then
    fail "$package is still known to dpkg: $(in_root dpkg-query -W -f='${Status}' "$package")"
  fi
done
left=$(while read -r path; do if [ -f "$root$path" ] || [ -L "$root$path" ]; then echo "$path"; fi; done <"$work/package-files.txt")
[ -z "$left" ] || fail "files of the packages are left: $left"
[ ! -e "$root/etc/udp-fanout" ] || fail "/etc/udp-fanout is left: $(ls -la "$root/etc/udp-fanout")"
[ ! -e "$root/run/udp-fanout" ] || fail "/run/udp-fanout is left"
if grep -rl udp-fanout "$root/var/lib/systemd" 2>/dev/null; then fail "deb-systemd-helper state is left (above)"; fi
snapshot >"$work/after.txt"
# By design only the users stay (with shadow's backups of the user databases, and adduser's lock
# file /run/adduser: /run is a tmpfs on a running system).
diff "$work/before.txt" "$work/after.txt" | grep '^[<>]' | grep -v -E '^> (/etc/(passwd|group|shadow|gshadow)-|/run/adduser)$' >"$work/diff.txt" || true
if [ -s "$work/diff.txt" ]; then sed 's/^/  /' "$work/diff.txt" >&2; fail "the root differs from before the installation (above)"; fi
say "every file of the packages is gone, /etc/udp-fanout (conffile) too; the root holds what it held before"
for user in udp-fanout collector; do
  say "kept by design: $(in_root getent passwd "$user")"
done

step "passed"
say "passed in $(($(date +%s) - started)) s: lintian; install, users, files, units, start as the unit (READY=1, 3000 of 3000 forwarded, reload, stop); the C sample; purge"
