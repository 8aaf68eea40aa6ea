#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make deb: Debian packages from one release build (scripts/build-release.sh, as make dist):
#   dist/udp-fanout_VERSION-REV_ARCH.deb        udp-fanout, collector, publisher in /usr/bin (stripped);
#       their units in /lib/systemd/system (paths /usr/bin); /etc/udp-fanout/config.yaml (a conffile,
#       from config.example.yaml); /usr/lib/sysusers.d/udp-fanout.conf (system users udp-fanout and
#       collector, made by the postinst); man pages; bash, zsh and fish completions; docs
#   dist/libreuseportlb0_VERSION-REV_ARCH.deb   libreuseportlb.so.0 (symbols, shlibs, ldconfig trigger)
#   dist/libreuseportlb-dev_VERSION-REV_ARCH.deb  reuseportlb.h, libreuseportlb.so, reuseportlb.pc
# Built with dpkg-deb --root-owner-group; Depends computed by dpkg-shlibdeps. Package files
# (control templates, maintainer scripts, copyright, sysusers, lintian overrides) are in packaging/.
# DEB_BIN_DIR=<dir with udp-fanout collector publisher libreuseportlb.so> skips the build;
# MANPAGE_TOOL=<generate-manual> skips building the man page tool (scripts/lib/manpages.sh).
# DEB_REVISION (default 1) is the Debian revision; DEB_MAINTAINER the Maintainer field
# (default: the author of the last commit).
set -euo pipefail
umask 022
cd "$(dirname "$0")/.."
source scripts/lib/manpages.sh
version=${VERSION:-$(sed -n 's/.*static let string = "\(.*\)"/\1/p' Sources/ReusePortLB/ProjectVersion.swift)}
debversion="$version-${DEB_REVISION:-1}"
arch=$(dpkg --print-architecture)
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null) || { echo "deb: dpkg-architecture failed: install dpkg-dev (scripts/setup.sh does, as root)" >&2; exit 1; }
maintainer=${DEB_MAINTAINER:-$(git log -1 --format='%an <%ae>')}
commit=$(git rev-parse --short=12 HEAD)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct)}
for tool in dpkg-deb dpkg-shlibdeps fakeroot; do
  command -v "$tool" >/dev/null || { echo "deb: $tool is missing (apt-get install dpkg-dev fakeroot; scripts/setup.sh installs them)" >&2; exit 1; }
done

if [ -n "${DEB_BIN_DIR:-}" ]; then
  echo "deb: release binaries from DEB_BIN_DIR=$DEB_BIN_DIR (no build)"
  bin=$DEB_BIN_DIR
else
  echo "deb: release build (static Swift runtime)"
  bin=$(scripts/build-release.sh)
fi
for file in udp-fanout collector publisher libreuseportlb.so; do
  [ -f "$bin/$file" ] || { echo "deb: $bin/$file is missing" >&2; exit 1; }
  # The packages depend on Debian's libraries only: the Swift runtime must be linked in.
  if readelf -d "$bin/$file" | grep -q -E 'NEEDED.*\[lib(swift|Foundation|dispatch|BlocksRuntime)'; then
    echo "deb: FAILED: $bin/$file needs the Swift toolchain's libraries (not a --static-swift-stdlib build)" >&2
    exit 1
  fi
done

work=$(mktemp -d /tmp/udp-fanout-deb.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p dist
rm -f "dist/udp-fanout_${debversion}_$arch.deb" "dist/libreuseportlb0_${debversion}_$arch.deb" \
  "dist/libreuseportlb-dev_${debversion}_$arch.deb"

# Every package's /usr/share/doc/<package>: copyright and changelog.Debian.gz.
python3 scripts/lib/deb_copyright.py packaging/copyright.in Package.resolved .build/checkouts \
  "$work/copyright" "$work/third-party"
# What is not linked into the programs has no paragraph there (the tests' Yams, the docs plugin).
if grep -Eiq '^Files: .*(yams|swift-docc)' "$work/copyright"; then
  echo "deb: FAILED: the copyright file names a package that is not linked into the programs: $(grep -Ei '^Files: .*(yams|swift-docc)' "$work/copyright")" >&2
  exit 1
fi
sed -e "s|@DEBVERSION@|$debversion|" -e "s|@COMMIT@|$commit|" -e "s|@MAINTAINER@|$maintainer|" \
  -e "s|@DATE@|$(date -u -R -d "@$SOURCE_DATE_EPOCH")|" packaging/changelog.in >"$work/changelog.Debian"
gzip -9n "$work/changelog.Debian"
docs() { # docs PACKAGE
  install -d "$work/$1/usr/share/doc/$1"
  install -m 0644 "$work/copyright" "$work/changelog.Debian.gz" "$work/$1/usr/share/doc/$1/"
}

# udp-fanout
root="$work/udp-fanout"
install -d "$root/usr/bin" "$root/lib/systemd/system" "$root/etc/udp-fanout" "$root/usr/lib/sysusers.d" \
  "$root/usr/share/udp-fanout/systemd"
for program in udp-fanout collector publisher; do
  # Swift's metadata lives in sections, not in the symbol table: stripping keeps the programs whole.
  # (.comment, the compilers' version strings, goes as dh_strip removes it.)
  strip --strip-unneeded --remove-section=.comment -o "$root/usr/bin/$program" "$bin/$program"
  chmod 0755 "$root/usr/bin/$program"
done
for unit in systemd/*.service; do
  sed -e 's|/usr/local/bin/|/usr/bin/|g' \
    -e 's|The binary is where `make install` puts it (PREFIX=/usr/local).*|The binary is where the udp-fanout Debian package puts it (/usr/bin).|' \
    -e '/^# ExecStartPre=, ExecStart= and ExecReload= (or override them in a drop-in)\.$/d' \
    "$unit" >"$root/lib/systemd/system/$(basename "$unit")"
done
# Every Exec line must name a program that exists: one of ours in /usr/bin, or a system one.
for line in $(grep -h -o -E '^Exec[A-Za-z]*=[-+!@:]*[^ ]+' "$root"/lib/systemd/system/*.service); do
  path=${line#*=}; path=${path##[-+!@:]}; path=${path##[-+!@:]}
  case $path in
    /usr/bin/udp-fanout | /usr/bin/collector | /usr/bin/publisher)
      [ -x "$root$path" ] || { echo "deb: FAILED: a unit runs $path, which is not staged" >&2; exit 1; } ;;
    /usr/bin/install | /bin/kill) true ;;
    *) echo "deb: FAILED: a unit runs $path (${line%%=*}), not a packaged program" >&2; exit 1 ;;
  esac
done
if grep -n /usr/local "$root"/lib/systemd/system/*.service; then
  echo "deb: FAILED: the units still name /usr/local (above)" >&2
  exit 1
fi
# The conffile's yaml-language-server modeline names the installed schema by its absolute path.
sed 's|\$schema=schema/|$schema=/usr/share/udp-fanout/schema/|' config.example.yaml >"$root/etc/udp-fanout/config.yaml"
chmod 0644 "$root/etc/udp-fanout/config.yaml"
install -D -m 0644 schema/udp-fanout-config.schema.json "$root/usr/share/udp-fanout/schema/udp-fanout-config.schema.json"
install -m 0644 config.example.yaml "$root/usr/share/udp-fanout/config.example.yaml"
install -m 0644 systemd/udp-fanout-userspace.conf "$root/usr/share/udp-fanout/systemd/"
# The monitoring kit (docs/monitoring.md): Grafana dashboard and provisioning, Prometheus rules.
for file in $(cd monitoring && find . -type f | sort); do
  install -D -m 0644 "monitoring/$file" "$root/usr/share/udp-fanout/monitoring/${file#./}"
done
install -m 0644 packaging/sysusers.conf "$root/usr/lib/sysusers.d/udp-fanout.conf"
tool=$(manpage_tool)
write_manpages "$tool" "$root/usr/bin" "$root/usr/share/man/man1"
write_completions "$root/usr/bin" "$root/usr/share/bash-completion/completions" \
  "$root/usr/share/zsh/vendor-completions" "$root/usr/share/fish/vendor_completions.d"
docs udp-fanout
install -m 0644 README.md "$root/usr/share/doc/udp-fanout/"
install -d "$root/usr/share/doc/udp-fanout/docs" "$root/usr/share/doc/udp-fanout/third-party"
install -m 0644 docs/*.md "$root/usr/share/doc/udp-fanout/docs/"
install -m 0644 "$work"/third-party/* "$root/usr/share/doc/udp-fanout/third-party/"
# As dh_compress: documentation above 4 kB is compressed (copyright never).
find "$root/usr/share/doc/udp-fanout" -type f -size +4k ! -name copyright ! -name '*.gz' -exec gzip -9n {} +
# Lintian's remaining tags, each with its reason (docs/packaging.md).
for package in udp-fanout libreuseportlb0 libreuseportlb-dev; do
  if [ -f "packaging/$package/lintian-overrides" ]; then
    install -D -m 0644 "packaging/$package/lintian-overrides" "$work/$package/usr/share/lintian/overrides/$package"
  fi
done

# libreuseportlb0 and libreuseportlb-dev
lib="$work/libreuseportlb0"
dev="$work/libreuseportlb-dev"
install -d "$lib/usr/lib/$multiarch" "$dev/usr/lib/$multiarch/pkgconfig" "$dev/usr/include"
strip --strip-unneeded --remove-section=.comment -o "$lib/usr/lib/$multiarch/libreuseportlb.so.$version" "$bin/libreuseportlb.so"
chmod 0644 "$lib/usr/lib/$multiarch/libreuseportlb.so.$version"
ln -s "libreuseportlb.so.$version" "$lib/usr/lib/$multiarch/libreuseportlb.so.0"
docs libreuseportlb0
ln -s libreuseportlb.so.0 "$dev/usr/lib/$multiarch/libreuseportlb.so"
install -m 0644 include/reuseportlb.h "$dev/usr/include/"
# A system library directory needs no run path: the .pc drops the tarball's -Wl,-rpath.
sed -e 's|^prefix=@PREFIX@|prefix=/usr|' -e "s|^libdir=.*|libdir=\${prefix}/lib/$multiarch|" \
  -e 's| -Wl,-rpath,${libdir}||' -e "s|@VERSION@|$version|" pkgconfig/reuseportlb.pc.in \
  >"$dev/usr/lib/$multiarch/pkgconfig/reuseportlb.pc"
docs libreuseportlb-dev
install -d "$dev/usr/share/doc/libreuseportlb-dev/examples"
install -m 0644 examples/c/steering.c "$dev/usr/share/doc/libreuseportlb-dev/examples/"

# DEBIAN/: control (Depends from dpkg-shlibdeps), conffiles, maintainer scripts, symbols, shlibs.
mkdir -p "$work/shlibdeps/debian"
printf 'Source: udp-fanout\n\nPackage: udp-fanout\nArchitecture: any\n' >"$work/shlibdeps/debian/control"
shlibs() { # shlibs FILE...: the Depends of these ELF files
  (cd "$work/shlibdeps" && dpkg-shlibdeps -O -xlibreuseportlb0 "${@/#/-e}" 2>"$work/shlibdeps.err") \
    | sed -n 's/^shlibs:Depends=//p' \
    || { cat "$work/shlibdeps.err" >&2; echo "deb: dpkg-shlibdeps failed (above)" >&2; exit 1; }
}
control() { # control PACKAGE DEPENDS
  local root="$work/$1"
  install -d -m 0755 "$root/DEBIAN"
  sed -e "s|@DEBVERSION@|$debversion|g" -e "s|@ARCH@|$arch|" -e "s|@MAINTAINER@|$maintainer|" \
    -e "s|@SHLIBS@|$2|" -e "s|@INSTALLED_SIZE@|$(du -sk --exclude=DEBIAN "$root" | cut -f1)|" \
    "packaging/$1/control.in" >"$root/DEBIAN/control"
}
depends=$(shlibs "$root"/usr/bin/*)
control udp-fanout "$depends"
echo /etc/udp-fanout/config.yaml >"$root/DEBIAN/conffiles"
install -m 0755 packaging/udp-fanout/postinst packaging/udp-fanout/prerm packaging/udp-fanout/postrm "$root/DEBIAN/"

depends=$(shlibs "$lib/usr/lib/$multiarch/libreuseportlb.so.$version")
control libreuseportlb0 "$depends"
echo "libreuseportlb 0 libreuseportlb0 (>= $version)" >"$lib/DEBIAN/shlibs"
{
  echo "libreuseportlb.so.0 libreuseportlb0 #MINVER#"
  echo "* Build-Depends-Package: libreuseportlb-dev"
  nm -D --defined-only --extern-only "$lib/usr/lib/$multiarch/libreuseportlb.so.$version" \
    | awk -v v="$version" '{ if ($3 !~ /@/) $3 = $3 "@@" $3; sub(/@@?/, "@", $3); print " " $3 " " v }' | sort
} >"$lib/DEBIAN/symbols"
# The library exports the C API alone (Sources/ReusePortLBCAPI/exports.map), as make dist checks.
if grep -v -E '^(libreuseportlb|\*| (reuseportlb_[a-z_]+|LIBREUSEPORTLB_0)@LIBREUSEPORTLB_0 )' "$lib/DEBIAN/symbols"; then
  echo "deb: FAILED: libreuseportlb.so exports more than the C API (above)" >&2
  exit 1
fi
echo "activate-noawait ldconfig" >"$lib/DEBIAN/triggers"
chmod 0644 "$lib/DEBIAN/shlibs" "$lib/DEBIAN/symbols" "$lib/DEBIAN/triggers"
control libreuseportlb-dev ""

# Reproducible: every file's time is the last commit's.
for package in udp-fanout libreuseportlb0 libreuseportlb-dev; do
  find "$work/$package" -newermt "@$SOURCE_DATE_EPOCH" -print0 | xargs -0r touch --no-dereference --date="@$SOURCE_DATE_EPOCH"
  # md5sums of every file but the conffiles (dpkg tracks those itself), as dh_md5sums.
  (cd "$work/$package" && find . -type f ! -path './DEBIAN/*' ! -path './etc/*' -printf '%P\0' | LC_ALL=C sort -z \
    | xargs -0r md5sum) >"$work/$package/DEBIAN/md5sums"
  touch --date="@$SOURCE_DATE_EPOCH" "$work/$package/DEBIAN/md5sums"
  out="dist/${package}_${debversion}_$arch.deb"
  dpkg-deb --root-owner-group -Zxz --build "$work/$package" "$out" >/dev/null
  echo "deb: $out ($(du -h "$out" | cut -f1), $(dpkg-deb -c "$out" | wc -l) entries)"
  echo "deb:   Depends: $(dpkg-deb -f "$out" Depends)"
done
echo "deb: man pages (generate-manual $(manpage_date)) and bash/zsh/fish completions of: $PROGRAMS"
