#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make dist: dist/udp-fanout-VERSION-linux-ARCH.tar.gz, laid out like a /usr/local prefix:
#   bin/       udp-fanout, collector, publisher (Swift runtime linked in, stripped)
#   lib/       libreuseportlb.so.VERSION (+ .so.0 SONAME link, + .so), pkgconfig/reuseportlb.pc
#   include/   reuseportlb.h
#   lib/systemd/system/  the units of systemd/
#   share/udp-fanout/    config.example.yaml, k8s/ manifests (k8s/monitoring/ too), monitoring/
#                        (Grafana dashboard, Prometheus rules), schema/ (the configuration's JSON
#                        Schema), systemd/ drop-in, Containerfile,
#                        examples/c/steering.c
#   share/doc/udp-fanout/ README.md, LICENSE, bpf/LICENSE.*, docs/, DEPENDENCIES (the Debian packages the programs need)
#   share/man/man1/      udp-fanout.1.gz, collector.1.gz, publisher.1.gz
#   share/bash-completion/completions/, share/zsh/site-functions/, share/fish/vendor_completions.d/
#                        the programs' shell completions (scripts/lib/manpages.sh, as make deb)
# Fails, naming the file, if anything still needs a library from the Swift toolchain or one that
# the documented Debian packages do not provide.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${VERSION:-$(sed -n 's/.*static let string = "\(.*\)"/\1/p' Sources/ReusePortLB/ProjectVersion.swift)}
arch=$(uname -m)
name="udp-fanout-$version-linux-$arch"
echo "dist: release build (static Swift runtime)"
bin=$(scripts/build-release.sh)
stage="dist/$name"
rm -rf "$stage" "dist/$name.tar.gz"
mkdir -p "$stage"/{bin,lib/pkgconfig,include,lib/systemd/system,share/udp-fanout/examples/c,share/doc/udp-fanout}
for program in udp-fanout collector publisher; do
  # Swift's metadata lives in sections, not in the symbol table: stripping keeps the programs whole.
  strip --strip-unneeded -o "$stage/bin/$program" "$bin/$program"
done
strip --strip-unneeded -o "$stage/lib/libreuseportlb.so.$version" "$bin/libreuseportlb.so"
ln -s "libreuseportlb.so.$version" "$stage/lib/libreuseportlb.so.0"
ln -s libreuseportlb.so.0 "$stage/lib/libreuseportlb.so"
# Relocatable: the prefix is wherever the tarball is unpacked (pkg-config's ${pcfiledir}).
sed -e 's|^prefix=@PREFIX@|prefix=${pcfiledir}/../..|' -e "s|@VERSION@|$version|" pkgconfig/reuseportlb.pc.in \
  >"$stage/lib/pkgconfig/reuseportlb.pc"
cp include/reuseportlb.h "$stage/include/"
cp config.example.yaml Containerfile "$stage/share/udp-fanout/"
# The configuration's JSON Schema, where config.example.yaml's yaml-language-server modeline points.
mkdir -p "$stage/share/udp-fanout/schema" && cp schema/udp-fanout-config.schema.json "$stage/share/udp-fanout/schema/"
cp examples/c/steering.c "$stage/share/udp-fanout/examples/c/"
cp systemd/*.service "$stage/lib/systemd/system/"
# The drop-in for userspace-only hosts (docs/systemd.md): copied into udp-fanout.service.d/ by hand.
mkdir -p "$stage/share/udp-fanout/systemd"
cp systemd/*.conf "$stage/share/udp-fanout/systemd/"
cp -r k8s monitoring "$stage/share/udp-fanout/"
cp README.md LICENSE "$stage/share/doc/udp-fanout/"
mkdir -p "$stage/share/doc/udp-fanout/bpf" && cp bpf/LICENSE.GPL-2.0 bpf/LICENSE.BSD-2-Clause "$stage/share/doc/udp-fanout/bpf/"
cp -r docs "$stage/share/doc/udp-fanout/"
# Man pages and shell completions, made from the staged programs (the same as make deb's).
source scripts/lib/manpages.sh
tool=$(manpage_tool)
write_manpages "$tool" "$stage/bin" "$stage/share/man/man1"
write_completions "$stage/bin" "$stage/share/bash-completion/completions" "$stage/share/zsh/site-functions" \
  "$stage/share/fish/vendor_completions.d"

# Every needed library must come from Debian's runtime packages, none from /opt/swift.
allowed='^(libbpf\.so\.1|libxdp\.so\.1|libelf\.so\.1|libyaml-0\.so\.2|libz\.so\.1|libstdc\+\+\.so\.6|libgcc_s\.so\.1|libm\.so\.6|libc\.so\.6|ld-linux-x86-64\.so\.2|ld-linux-aarch64\.so\.1|libreuseportlb\.so\.0)$'
for file in "$stage"/bin/* "$stage/lib/libreuseportlb.so.$version"; do
  needed=$(readelf -d "$file" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  for library in $needed; do
    if ! [[ $library =~ $allowed ]]; then
      echo "dist: FAILED: $file needs $library, which is not among the documented runtime packages" >&2
      exit 1
    fi
  done
  if readelf -d "$file" | grep -E 'R(UN)?PATH' | grep -q /opt/swift; then
    echo "dist: FAILED: $file has a run path into /opt/swift: $(readelf -d "$file" | grep -E 'R(UN)?PATH')" >&2
    exit 1
  fi
done
# The library's interface is the C API alone (Sources/ReusePortLBCAPI/exports.map).
extra=$(nm -D --defined-only --extern-only "$stage/lib/libreuseportlb.so.$version" | grep -v -E ' (reuseportlb_[a-z_]+|LIBREUSEPORTLB_0)(@@LIBREUSEPORTLB_0)?$' || true)
if [ -n "$extra" ]; then
  echo "dist: FAILED: libreuseportlb.so exports more than the C API: $(echo "$extra" | head -5)" >&2
  exit 1
fi
cat >"$stage/share/doc/udp-fanout/DEPENDENCIES" <<TXT
udp-fanout $version for Linux $arch. The programs and libreuseportlb.so carry the Swift runtime;
on Debian 12 (bookworm) or later they need only:
  apt-get install libbpf1 libxdp1 libelf1 libyaml-0-2 zlib1g libstdc++6 libgcc-s1
Unpack into a prefix (e.g. tar -C /usr/local --strip-components=1 -xzf $name.tar.gz);
reuseportlb.pc is relocatable (PKG_CONFIG_PATH=<prefix>/lib/pkgconfig).
TXT
tar -C dist -czf "dist/$name.tar.gz" --owner=0 --group=0 "$name"
echo "dist: dist/$name.tar.gz ($(du -h "dist/$name.tar.gz" | cut -f1)): $(cd "$stage" && find . -type f -o -type l | wc -l) files"
echo "dist: libreuseportlb.so.$version exports only the reuseportlb_* C API (version LIBREUSEPORTLB_0)"
echo "dist: man pages (share/man/man1) and bash, zsh and fish completions of udp-fanout, collector, publisher"
echo "dist: needs only Debian's libbpf1 libxdp1 libelf1 libyaml-0-2 zlib1g libstdc++6 libgcc-s1 (checked with readelf; no /opt/swift run path)"
