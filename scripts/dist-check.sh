#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make dist-check: proves the tarball of `make dist` runs without the Swift toolchain. It unpacks
# the tarball, hides /opt/swift under an empty read-only tmpfs in a private mount namespace
# (unshare -m), and there: checks no program or library needs a missing library; runs each
# program; forwards 3,000 datagrams through udp-fanout to three collectors on loopback; builds the
# C API sample against the unpacked prefix with pkg-config and runs it. Needs root (unshare -m).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${VERSION:-$(sed -n 's/.*static let string = "\(.*\)"/\1/p' Sources/ReusePortLB/ProjectVersion.swift)}
name="udp-fanout-$version-linux-$(uname -m)"
tarball="dist/$name.tar.gz"
[ -f "$tarball" ] || { echo "dist-check: $tarball is missing: run make dist first" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "dist-check: needs root (unshare -m and a tmpfs over /opt/swift); run: sudo make dist-check" >&2; exit 1; }
work=$(mktemp -d /tmp/udp-fanout-dist-check.XXXXXX)
trap 'rm -rf "$work"' EXIT
tar -C "$work" -xzf "$tarball"
prefix="$work/$name"
for file in share/doc/udp-fanout/LICENSE share/doc/udp-fanout/bpf/LICENSE.GPL-2.0 share/doc/udp-fanout/bpf/LICENSE.BSD-2-Clause; do
  [ -s "$prefix/$file" ] || { echo "dist-check: FAILED: $file (the license) is missing from $tarball" >&2; exit 1; }
done
# The man pages and completions (scripts/lib/manpages.sh) are in the tarball.
for program in udp-fanout collector publisher; do
  for file in "share/man/man1/$program.1.gz" "share/bash-completion/completions/$program" \
    "share/zsh/site-functions/_$program" "share/fish/vendor_completions.d/$program.fish"; do
    [ -s "$prefix/$file" ] || { echo "dist-check: FAILED: $file is missing from $tarball" >&2; exit 1; }
  done
done
man -M "$prefix/share/man" -w udp-fanout >/dev/null || { echo "dist-check: FAILED: man does not find udp-fanout in share/man" >&2; exit 1; }
echo "dist-check: man pages (man -M share/man -w udp-fanout finds it) and bash/zsh/fish completions of the three programs present"
source scripts/lib/smoke.sh
# Assigned before the export: `export X=$(...)` would hide a failing free_port from set -e.
LISTEN_PORT=$(free_port); C_PORT=$(free_port)
SINK_PORTS="$(free_port) $(free_port) $(free_port)"
export SMOKE_LIB="$PWD/scripts/lib/smoke.sh" DIST_PREFIX="$prefix" DIST_WORK="$work" LISTEN_PORT C_PORT SINK_PORTS
echo "dist-check: unpacked $tarball; hiding /opt/swift in a private mount namespace"
unshare -m --propagation private bash -euo pipefail -c '
mount -t tmpfs -o ro,size=64k swift-hidden /opt/swift
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
cd "$DIST_WORK"
if [ -e /opt/swift/usr/lib/swift/linux/libswiftCore.so ]; then echo "dist-check: FAILED: /opt/swift is still visible" >&2; exit 1; fi
echo "dist-check: /opt/swift hidden (libswiftCore.so not visible)"
for file in "$DIST_PREFIX"/bin/* "$DIST_PREFIX"/lib/libreuseportlb.so.0; do
  if ldd "$file" | grep -q "not found"; then echo "dist-check: FAILED: $file:" >&2; ldd "$file" >&2; exit 1; fi
done
echo "dist-check: ldd: every library of bin/* and libreuseportlb.so.0 resolves"
"$DIST_PREFIX/bin/udp-fanout" --version
check=$("$DIST_PREFIX/bin/udp-fanout" --check --config "$DIST_PREFIX/share/udp-fanout/config.example.yaml" 2>&1) \
  || { echo "dist-check: FAILED: udp-fanout --check: $check" >&2; exit 1; }
echo "dist-check: udp-fanout --check accepts share/udp-fanout/config.example.yaml"
"$DIST_PREFIX/bin/collector" --help >/dev/null && "$DIST_PREFIX/bin/publisher" --help >/dev/null
echo "dist-check: collector --help and publisher --help run"
set -- $SINK_PORTS
source "$SMOKE_LIB"
write_smoke_config config.yaml "$LISTEN_PORT" round_robin "$@"
pids=()
trap "kill -TERM \${pids[*]} 2>/dev/null || true" EXIT
i=0
for port in "$@"; do start_collector "$DIST_PREFIX/bin/collector" . "sink$i" "$port"; i=$((i+1)); done
"$DIST_PREFIX/bin/udp-fanout" --config config.yaml 2>fanout.err & fanout=$!; pids+=($fanout)
wait_for_line fanout.err "entering receive loop" "udp-fanout"
"$DIST_PREFIX/bin/publisher" 127.0.0.1 "$LISTEN_PORT" 3000 --sources 127.0.0.10-127.0.0.25 --rate 20000 >/dev/null
sleep 0.5
kill -TERM "$fanout"
wait "$fanout" || { status=$?; echo "dist-check: FAILED: udp-fanout exited $status on SIGTERM; it said:" >&2; cat fanout.err >&2; exit 1; }
stop_collectors
check_delivered "dist-check: udp-fanout forwarded 3000 datagrams to three collectors" 3000 sink0.json sink1.json sink2.json
export PKG_CONFIG_PATH="$DIST_PREFIX/lib/pkgconfig"
cc -Wall -Werror -o steering "$DIST_PREFIX/share/udp-fanout/examples/c/steering.c" $(pkg-config --cflags --libs reuseportlb)
readelf -d steering | grep -q "Shared library: \[libreuseportlb.so.0\]" \
  || { echo "dist-check: FAILED: the C sample does not record libreuseportlb.so.0: $(readelf -d steering | grep NEEDED)" >&2; exit 1; }
output=$(./steering "$C_PORT" 2>&1) || { echo "dist-check: FAILED: the C sample exited $?: $output" >&2; exit 1; }
echo "dist-check: C API sample built with pkg-config against the tarball: $output"
[[ $output == *"received=40 misplaced=0 selected=40 steering=ebpf"* ]] \
  || { echo "dist-check: FAILED: the C sample printed something else than received=40 misplaced=0 selected=40 steering=ebpf" >&2; exit 1; }
'
echo "dist-check: passed: $tarball runs without /opt/swift"
