#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make container: builds the udp-fanout image from the release tarball of `make dist` with buildah
# (no Docker engine needed), on a Debian base made here with debootstrap (no registry needed), and
# runs it: `udp-fanout --check` on the shipped config, then a forwarding smoke test (host network,
# as the image's non-root user): 3,000 datagrams through udp-fanout in the container to three
# collectors on the host's loopback. Installs buildah and debootstrap when root.
# BASE=<image> uses another base (e.g. docker.io/library/debian:bookworm-slim where a registry is
# reachable); the default is the local debootstrap one.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/smoke.sh
version=${VERSION:-$(sed -n 's/.*static let string = "\(.*\)"/\1/p' Sources/ReusePortLB/ProjectVersion.swift)}
name="udp-fanout-$version-linux-$(uname -m)"
image="localhost/udp-fanout:$version"
base=${BASE:-localhost/debian:bookworm-slim}
[ "$(id -u)" = 0 ] || { echo "container: needs root (buildah with chroot isolation, debootstrap); run: sudo make container" >&2; exit 1; }
[ -f "dist/$name.tar.gz" ] || { echo "container: dist/$name.tar.gz is missing: run make dist first" >&2; exit 1; }
missing=()
for p in buildah debootstrap; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "container: installing Debian packages: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "container: Debian packages present (buildah debootstrap)"
fi
work=$(mktemp -d /tmp/udp-fanout-container.XXXXXX)
containers=()
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for c in "${containers[@]}"; do buildah rm "$c" >/dev/null 2>&1 || true; done
  rm -rf "$work"
}
trap cleanup EXIT

if [ "$base" = localhost/debian:bookworm-slim ] && ! buildah inspect --type image "$base" >/dev/null 2>&1; then
  mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
  mirror=${mirror:-http://deb.debian.org/debian}
  echo "container: making the base image $base with debootstrap (bookworm, minbase, from $mirror)"
  debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; echo "container: debootstrap failed (log above)" >&2; exit 1; }
  # What debian:bookworm-slim leaves out: documentation, manual pages, package lists, caches.
  rm -rf "$work"/rootfs/usr/share/{doc,man,info}/* "$work"/rootfs/var/lib/apt/lists/* "$work"/rootfs/var/cache/apt/*.bin
  tar -C "$work/rootfs" -cf "$work/rootfs.tar" .
  rm -rf "$work/rootfs"
  ctr=$(buildah from scratch); containers+=("$ctr")
  buildah add "$ctr" "$work/rootfs.tar" / >/dev/null
  buildah config --cmd /bin/bash --label org.opencontainers.image.description="debian bookworm minbase, made by debootstrap" "$ctr"
  buildah commit --quiet "$ctr" "$base" >/dev/null
  rm -f "$work/rootfs.tar"
  echo "container: base image $base committed"
else
  echo "container: base image $base present"
fi

previous=$(buildah images --quiet --no-trunc "$image" 2>/dev/null || true)
echo "container: buildah bud --isolation chroot --build-arg BASE=$base -t $image -f Containerfile ."
buildah bud --quiet --isolation chroot --build-arg BASE="$base" --build-arg VERSION="$version" \
  --build-arg DIST="dist/$name" -t "$image" -f Containerfile . >"$work/bud.log" 2>&1 \
  || { cat "$work/bud.log" >&2; echo "container: the image build failed (log above)" >&2; exit 1; }
current=$(buildah images --quiet --no-trunc "$image")
# The image this tag named before (now untagged) goes: repeated runs do not pile up images.
if [ -n "$previous" ] && [ "$previous" != "$current" ]; then buildah rmi "$previous" >/dev/null 2>&1 || true; fi
echo "container: built $image ($(buildah images --format '{{.Size}}' "$image"))"
user=$(buildah inspect --type image --format '{{.OCIv1.Config.User}}' "$image")
entrypoint=$(buildah inspect --type image --format '{{.OCIv1.Config.Entrypoint}}' "$image")
[ "$user" = 10001:10001 ] || { echo "container: FAILED: the image runs as '$user', not 10001:10001" >&2; exit 1; }
[ "$entrypoint" = "[/usr/local/bin/udp-fanout]" ] || { echo "container: FAILED: entrypoint $entrypoint" >&2; exit 1; }
echo "container: image user $user, entrypoint $entrypoint"

ctr=$(buildah from "$image"); containers+=("$ctr")
check=$(buildah run --isolation chroot "$ctr" -- /usr/local/bin/udp-fanout --check --config /etc/udp-fanout/config.yaml 2>&1) \
  || { echo "container: FAILED: udp-fanout --check in the image: $check" >&2; exit 1; }
echo "container: in the image, udp-fanout --check --config /etc/udp-fanout/config.yaml: valid"

# Smoke test: the daemon in the container (host network, uid 10001), collectors on the host.
listen=$(free_port); sinks=("$(free_port)" "$(free_port)" "$(free_port)")
mkdir -p "$work/smoke" && chmod 0777 "$work/smoke"
write_smoke_config "$work/smoke/config.yaml" "$listen" source_ip "${sinks[@]}"
cat >"$work/smoke/run.sh" <<'SH'
set -eu
/usr/local/bin/udp-fanout --config /smoke/config.yaml 2>/smoke/fanout.err &
fanout=$!
# Whatever fails below, the daemon does not outlive buildah run.
trap 'kill $fanout 2>/dev/null || true' EXIT
i=0
while [ $i -lt 200 ] && ! grep -q "entering receive loop" /smoke/fanout.err; do sleep 0.05; i=$((i+1)); done
grep -q "entering receive loop" /smoke/fanout.err || { echo "udp-fanout did not start in 10 s" >&2; exit 1; }
/usr/local/bin/publisher 127.0.0.1 "$1" 3000 --sources 127.0.0.10-127.0.0.25 --rate 20000 >/dev/null
sleep 0.5
kill -TERM $fanout
wait $fanout || { echo "udp-fanout exited $? on SIGTERM" >&2; exit 1; }
SH
i=0
for port in "${sinks[@]}"; do start_collector "dist/$name/bin/collector" "$work" "sink$i" "$port"; i=$((i+1)); done
if ! buildah run --isolation chroot --network host --user 10001:10001 -v "$work/smoke:/smoke" "$ctr" -- /bin/sh /smoke/run.sh "$listen"; then
  echo "container: FAILED: the smoke test in the container; udp-fanout said:" >&2
  cat "$work/smoke/fanout.err" >&2
  exit 1
fi
stop_collectors
grep -E "starting userspace forwarder|steering" "$work/smoke/fanout.err" | sed 's/^/  /' | cut -c1-200 || true
check_delivered "container: the daemon in the container (uid 10001, host network) forwarded 3000 datagrams from 16 sources" 3000 "$work"/sink0.json "$work"/sink1.json "$work"/sink2.json
echo "container: passed: $image"
