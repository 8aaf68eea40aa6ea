#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what building and testing need, and says what it did: Debian packages (when root),
# and a bpffs mount at /sys/fs/bpf (when root). Safe to run again: it changes nothing that is
# already in place.
set -euo pipefail
packages=(libbpf-dev libxdp-dev libelf-dev pkg-config bpftool iproute2 util-linux procps make gcc netcat-openbsd curl iputils-ping dnsmasq-base systemd strace nfdump ethtool bind9-dnsutils prometheus tmux dpkg-dev lintian debootstrap fakeroot man-db libyaml-dev systemd-container nftables bird2 frr pmacct tshark tcpdump)
[ "${WITH_BENCH_PEERS:-0}" = 1 ] && packages+=(nginx libnginx-mod-stream nftables conntrack pmacct python3-matplotlib sockperf)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian packages: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    # The fleet tests start BIRD and FRR in their own namespaces: their packages' services are
    # not started on the host (a policy-rc.d for the install, unless one is in place).
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      # Removed however the install ends (an interrupt included): left behind it would keep
      # every later package's service from starting.
      trap 'rm -f /usr/sbin/policy-rc.d' EXIT
      printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    echo "setup: installed ${missing[*]}"
    # Nor at the next boot: the services of BIRD and FRR installed here are disabled (only those
    # this run installed; one already installed is the machine's own).
    for service in bird frr; do
      package=$([ "$service" = bird ] && echo bird2 || echo frr)
      if [[ " ${missing[*]} " == *" $package "* ]] && systemctl is-enabled --quiet "$service" 2>/dev/null; then
        systemctl disable --quiet "$service" 2>/dev/null && echo "setup: disabled the $service service at boot (the tests start their own)"
      fi
    done
  else
    echo "setup: missing Debian packages: ${missing[*]}; run as root, or: sudo apt-get install ${missing[*]}" >&2
    exit 1
  fi
else
  echo "setup: Debian packages present (${packages[*]})"
fi
# pip_tool MODULE PACKAGE VERSION: installs a Python tool from PyPI unless MODULE imports.
pip_tool() {
  if python3 -c "import $1" 2>/dev/null; then
    echo "setup: $2 present"
    return 0
  fi
  echo "setup: installing $2 $3 (pip)"
  python3 -m pip install --quiet "$2==$3" || {
    echo "setup: could not install $2 with '$(command -v python3) -m pip': install pip for it (Debian: python3-pip, or a venv) and run: python3 -m pip install $2==$3" >&2
    exit 1
  }
}
# The k8s/ manifest validation test (DeploymentManifestTests) runs kubernetes-validate.
pip_tool kubernetes_validate kubernetes-validate 1.37.0
# The configuration schema test (ConfigSchemaTests) runs check-jsonschema.
pip_tool check_jsonschema check-jsonschema 0.33.0
# The QUIC-LB end-to-end tests (QUICEndToEndTests) run aioquic servers and clients (Tests/quic/).
pip_tool aioquic aioquic 1.7.2
if [ "$(stat -f -c %T /sys/fs/bpf 2>/dev/null)" = "bpf_fs" ]; then
  echo "setup: bpffs already mounted at /sys/fs/bpf"
elif [ "$(id -u)" = 0 ]; then
  mkdir -p /sys/fs/bpf && mount -t bpf bpf /sys/fs/bpf
  echo "setup: mounted bpffs at /sys/fs/bpf"
else
  echo "setup: bpffs is not mounted and this is not root: eBPF steering needs 'sudo mount -t bpf bpf /sys/fs/bpf' (classic BPF works without it)"
fi
export PATH="/opt/swift/usr/bin:$PATH"
command -v swift >/dev/null || { echo "setup: swift not found: install Swift 6 (expected at /opt/swift)" >&2; exit 1; }
