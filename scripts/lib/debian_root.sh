# SPDX-License-Identifier: Apache-2.0
# What deb-check and systemd-check share.
#
# debian_root WORK: a clean Debian root (bookworm minbase) for deb-check and systemd-check. Sets
# `root` (its path) and `container` (the buildah container to remove when done, or empty): make
# container's debootstrap base image when buildah has it (`buildah from` + `buildah mount`,
# nothing downloaded twice), else debootstrap from a cached tarball (/var/cache/udp-fanout, made
# once with --make-tarball). DEB_CHECK_BASE=auto (default) | buildah | debootstrap. Needs the
# caller's say and fail, and `arch`.
# as_root_in_private_mounts NAME WHY SCRIPT [ARGS...]: fails unless root (saying WHY it needs
# it), then runs SCRIPT again, once, in a private mount namespace: mounts made there cannot
# outlive the run, whatever ends it. There it sets `started` (date +%s) and descriptor 3 to the
# script's own stderr, for the cleanup: a signal's trap runs inside whatever redirection the
# interrupted command had (e.g. into a log that the cleanup removes).
as_root_in_private_mounts() {
  local name=$1 why=$2 script
  script=$(readlink -f "$3")
  shift 3
  [ "$(id -u)" = 0 ] || { echo "$name: needs root ($why); run: sudo make $name" >&2; exit 1; }
  if [ -z "${UDP_FANOUT_PRIVATE_MOUNTS:-}" ]; then
    exec env UDP_FANOUT_PRIVATE_MOUNTS=1 unshare -m --propagation private "$script" "$@"
  fi
  started=$(date +%s)
  exec 3>&2
}

debian_root() {
  local work=$1
  local mode=${DEB_CHECK_BASE:-auto} base=localhost/debian:bookworm-slim mirror cache tarball
  if [ "$mode" != debootstrap ] && command -v buildah >/dev/null && buildah inspect --type image "$base" >/dev/null 2>&1; then
    say "\$ buildah from $base; buildah mount  (make container's debootstrap minbase image, reused)"
    container=$(buildah from --pull=never --name "udp-fanout-root-$$" "$base")
    root=$(buildah mount "$container")
  elif [ "$mode" = buildah ]; then
    fail "DEB_CHECK_BASE=buildah, but buildah has no image $base (make container makes it)"
  else
    mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
    mirror=${mirror:-http://deb.debian.org/debian}
    cache=${DEB_CHECK_CACHE:-/var/cache/udp-fanout}
    tarball="$cache/debootstrap-bookworm-minbase-$arch.tar.gz"
    if [ ! -f "$tarball" ]; then
      mkdir -p "$cache"
      say "\$ debootstrap --variant=minbase --make-tarball=$tarball bookworm ... $mirror  (once; cached)"
      debootstrap --variant=minbase --make-tarball="$tarball.part" bookworm "$work/tarball" "$mirror" >"$work/debootstrap.log" 2>&1 \
        || { tail -20 "$work/debootstrap.log" >&2; fail "debootstrap --make-tarball (log above)"; }
      mv "$tarball.part" "$tarball"
      rm -rf "$work/tarball"
    fi
    root="$work/root"
    say "\$ debootstrap --variant=minbase --unpack-tarball=$tarball bookworm $root $mirror"
    debootstrap --variant=minbase --unpack-tarball="$tarball" bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1 \
      || { tail -20 "$work/debootstrap.log" >&2; fail "debootstrap --unpack-tarball (log above)"; }
  fi
}
