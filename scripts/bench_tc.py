# SPDX-License-Identifier: Apache-2.0
"""udp-fanout tc_ebpf benchmarks for make bench: the in-kernel path against nftables peers and
plain routing, in one namespace topology built here and removed afterwards. Run by
bench.py; shares bench_common's helpers.

    client ── proxy ── backend 1..3        (198.18.0.0/15 only, namespaces of this run)

The client's publisher sends 64-byte datagrams from 16 source addresses to 198.18.0.1:5514.
Backends drop the UDP that arrives at their interface (nftables netdev ingress), so
"delivered" is what the proxy put on the backend links (their veth rx counters) and no socket
receive limits the rate. Variants, alternated run by run:

  tc_ebpf         udp-fanout, mode tc_ebpf, round robin over the 3 backends
  xdp             udp-fanout, mode xdp, the same at the XDP hook (native on the proxy's veth; the
                  backends' veth ends get GRO, so the proxy's can transmit XDP frames, and the
                  client computes its checksums, tx off: XDP passes an offloaded one to tc)
  nft stateless   prerouting raw: notrack, ip daddr set numgen inc mod 3 map, udp dport set
  nft conntrack   nat prerouting: dnat to numgen inc mod 3 map (balances flows, not packets)
  routing         no proxy rules: the client sends to backend 1 directly, the proxy only routes

CPU per packet is measured at a fixed rate as the issue defines it (system + irq + softirq of
all CPUs / delivered packets), which includes the generator's own kernel work (UDP sendmmsg,
veth). A fifth setup, "baseline" (the proxy drops the datagrams at its ingress, nftables
netdev), measures that shared part, and the net rows subtract it run by run.
"""
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time

import bench_common as common
from bench_common import BACKENDS, Topology, in_namespace, sh

DATAGRAMS = int(os.environ.get("BENCH_TC_DATAGRAMS", "600000"))
FIXED_RATE = int(os.environ.get("BENCH_TC_RATE", "150000"))
FIXED_SECONDS = int(os.environ.get("BENCH_TC_SECONDS", "4"))
VARIANTS = ["tc_ebpf", "xdp", "nft stateless", "nft conntrack", "routing"]


class Variant:
    """Sets a variant up in the proxy namespace; `target` is where the client sends."""

    def __init__(self, name, topology, work):
        self.name, self.topology, self.proc = name, topology, None
        self.target = ("198.18.1.2", 6000) if name == "routing" else ("198.18.0.1", 5514)
        backends = ", ".join(f"{n - 1} : 198.18.{n}.2" for n in range(1, BACKENDS + 1))
        if name in ("tc_ebpf", "xdp"):
            if name == "xdp":
                self.xdp_ends(True)
            downstreams = "\n".join(f'      - {{name: b{n}, address: "198.18.{n}.2:6000"}}' for n in range(1, BACKENDS + 1))
            path = os.path.join(work, "tc.yaml")
            with open(path, "w") as f:
                f.write(f'listeners:\n  - name: bench\n    bind: "198.18.0.1:5514"\n    interface: {topology.proxy_if}\n'
                        f"    mode: {name}\n    downstream:\n{downstreams}\n")
            self.proc = subprocess.Popen([*in_namespace(topology.proxy), f"{common.BIN}/udp-fanout", "-c", path],
                                         stderr=subprocess.PIPE, text=True)
            while True:
                line = self.proc.stderr.readline()
                if not line:
                    raise SystemExit(f"udp-fanout ({name}) exited")
                if "registered listener in eBPF map" in line:
                    break
        elif name == "nft stateless":
            self.nft(f"table ip fanout_bench {{\n chain pre {{\n  type filter hook prerouting priority raw; policy accept;\n"
                     f"  ip daddr 198.18.0.1 udp dport 5514 notrack ip daddr set numgen inc mod {BACKENDS} map {{ {backends} }}"
                     f" udp dport set 6000\n }}\n}}\n")
        elif name == "baseline":
            self.nft(f'table netdev fanout_bench {{\n chain in {{\n  type filter hook ingress device "{topology.proxy_if}" priority 0;'
                     f' policy accept;\n  ip daddr 198.18.0.1 udp dport 5514 drop\n }}\n}}\n')
        elif name == "nft conntrack":
            pairs = ", ".join(f"{n - 1} : 198.18.{n}.2 . 6000" for n in range(1, BACKENDS + 1))
            self.nft(f"table ip fanout_bench {{\n chain pre {{\n  type nat hook prerouting priority dstnat; policy accept;\n"
                     f"  ip daddr 198.18.0.1 udp dport 5514 dnat ip to numgen inc mod {BACKENDS} map {{ {pairs} }}\n }}\n}}\n")

    def xdp_ends(self, on):
        """GRO on the backends' veth ends, checksums computed by the client (tx off), or back."""
        topology = self.topology
        for backend, inner in zip(topology.backends, topology.backend_ifs):
            topology.ns(backend, "ethtool", "-K", inner, "gro", "on" if on else "off")
        topology.ns(topology.client, "ethtool", "-K", f"cp{topology.proxy_if[2:]}", "tx", "off" if on else "on")

    def nft(self, rules):
        subprocess.run([*in_namespace(self.topology.proxy), "nft", "-f", "-"], input=rules, text=True, check=True)

    def stop(self):
        if self.proc:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=10)
            if self.name == "xdp":
                self.xdp_ends(False)
        elif self.name.startswith("nft"):
            self.topology.ns(self.topology.proxy, "nft", "delete", "table", "ip", "fanout_bench")
        elif self.name == "baseline":
            self.topology.ns(self.topology.proxy, "nft", "delete", "table", "netdev", "fanout_bench")


def kernel_cpu_seconds():
    """System + irq + softirq time of all CPUs, in seconds (/proc/stat, USER_HZ ticks)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[3]) + int(fields[6]) + int(fields[7])) / ticks


def run_once(name, topology, work, fixed):
    variant = Variant(name, topology, work)
    try:
        before = topology.delivered() if name != "baseline" else 0
        cpu = kernel_cpu_seconds()
        if fixed:
            sent = common.publish_in(topology, variant.target, FIXED_RATE * FIXED_SECONDS, ("--rate", str(FIXED_RATE)))
        else:
            sent = common.publish_in(topology, variant.target, DATAGRAMS)
        time.sleep(0.2)
        cpu = kernel_cpu_seconds() - cpu
        delivered = topology.delivered() - before if name != "baseline" else sent["sent"]
    finally:
        variant.stop()
    return {"pps": delivered / sent["seconds"], "delivered": delivered / sent["sent"],
            "ns_per_packet": cpu * 1e9 / max(delivered, 1)}


def program_cost(topology, work, name="tc_ebpf", program="fanout_tc"):
    variant = Variant(name, topology, work)
    try:
        with common.BPFStats():
            common.publish_in(topology, variant.target, 200000, ("--rate", str(FIXED_RATE)))
            cost, runs = common.ns_per_run(["name", program])
    finally:
        variant.stop()
    return cost


def rows():
    work = tempfile.mkdtemp(prefix="rplb-tc-bench-")
    topology = Topology()
    try:
        print(f"bench: tc_ebpf vs nftables in the proxy namespace of client -> proxy -> 3 backends (veth);"
              f" 64-byte datagrams from 16 sources; {common.RUNS} alternated runs; saturation {DATAGRAMS} datagrams,"
              f" CPU at {FIXED_RATE:,} pps for {FIXED_SECONDS} s", flush=True)
        saturation = {name: [] for name in VARIANTS}
        fixed = {name: [] for name in VARIANTS + ["baseline"]}
        for run in range(common.RUNS):
            order = VARIANTS if run % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                saturation[name].append(run_once(name, topology, work, fixed=False))
            for name in order + ["baseline"]:
                fixed[name].append(run_once(name, topology, work, fixed=True))
        out = []
        ours = common.spread([r["pps"] for r in saturation["tc_ebpf"]])
        ours_delivered = statistics.median(r["delivered"] for r in saturation["tc_ebpf"])
        best_nft = [max(a["pps"], b["pps"]) for a, b in zip(saturation["nft stateless"], saturation["nft conntrack"])]
        for peer_name in ("nft stateless", "nft conntrack", "routing"):
            peer = common.spread([r["pps"] for r in saturation[peer_name]])
            ratios = common.spread([o["pps"] / p["pps"] for o, p in zip(saturation["tc_ebpf"], saturation[peer_name])])
            goal = " goal >= 0.95" if peer_name == "routing" else ""
            peer_delivered = statistics.median(r["delivered"] for r in saturation[peer_name])
            out.append(("tc: delivered pps at saturation", "routing only (ceiling)" if peer_name == "routing" else peer_name,
                        f"{ours[0]:,.0f} pps ({ours[1]:,.0f}-{ours[2]:,.0f})", f"{peer[0]:,.0f} pps ({peer[1]:,.0f}-{peer[2]:,.0f})",
                        f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f}){goal}",
                        f"delivered/sent ours {ours_delivered:.3f}, peer {peer_delivered:.3f}"))
        best = common.spread([o["pps"] / b for o, b in zip(saturation["tc_ebpf"], best_nft)])
        out.append(("tc: vs better nftables peer", "max(stateless, conntrack) per run", f"{ours[0]:,.0f} pps", "-",
                    f"{best[0]:.2f} ({best[1]:.2f}-{best[2]:.2f}) goal >= 1.0", "median of per-run ratios"))
        mine = common.spread([r["ns_per_packet"] for r in fixed["tc_ebpf"]])
        for peer_name in ("nft stateless", "nft conntrack", "routing"):
            peer = common.spread([r["ns_per_packet"] for r in fixed[peer_name]])
            ratios = common.spread([o["ns_per_packet"] / p["ns_per_packet"] for o, p in zip(fixed["tc_ebpf"], fixed[peer_name])])
            goal = " goal <= 0.7" if peer_name == "nft stateless" else ""
            out.append((f"tc: kernel CPU per packet at {FIXED_RATE // 1000}k pps", "routing only" if peer_name == "routing" else peer_name,
                        f"{mine[0]:,.0f} ns ({mine[1]:,.0f}-{mine[2]:,.0f})", f"{peer[0]:,.0f} ns ({peer[1]:,.0f}-{peer[2]:,.0f})",
                        f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f}){goal}",
                        "sys+irq+softirq of all CPUs / delivered, sender's kernel work included"))
        def net(results, index):
            return results[index]["ns_per_packet"] - fixed["baseline"][index]["ns_per_packet"]
        base = common.spread([r["ns_per_packet"] for r in fixed["baseline"]])
        mine_net = common.spread([net(fixed["tc_ebpf"], i) for i in range(common.RUNS)])
        for peer_name in ("nft stateless", "nft conntrack", "routing"):
            peer = common.spread([net(fixed[peer_name], i) for i in range(common.RUNS)])
            ratios = common.spread([net(fixed["tc_ebpf"], i) / net(fixed[peer_name], i) for i in range(common.RUNS)])
            out.append((f"tc: forwarding CPU per packet at {FIXED_RATE // 1000}k pps", "routing only" if peer_name == "routing" else peer_name,
                        f"{mine_net[0]:,.0f} ns ({mine_net[1]:,.0f}-{mine_net[2]:,.0f})", f"{peer[0]:,.0f} ns ({peer[1]:,.0f}-{peer[2]:,.0f})",
                        f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})",
                        f"the row above minus the generator baseline ({base[0]:,.0f} ns) of the same run"))
        if "xdp" in saturation:
            xdp = common.spread([r["pps"] for r in saturation["xdp"]])
            xdp_delivered = statistics.median(r["delivered"] for r in saturation["xdp"])
            for peer_name in ("tc_ebpf", "nft stateless", "nft conntrack", "routing"):
                if peer_name not in saturation:
                    continue
                peer = common.spread([r["pps"] for r in saturation[peer_name]])
                ratios = common.spread([o["pps"] / p["pps"] for o, p in zip(saturation["xdp"], saturation[peer_name])])
                goal = " goal >= 1.5" if peer_name == "tc_ebpf" else ""
                peer_delivered = statistics.median(r["delivered"] for r in saturation[peer_name])
                out.append(("xdp: delivered pps at saturation", "routing only (ceiling)" if peer_name == "routing" else peer_name,
                            f"{xdp[0]:,.0f} pps ({xdp[1]:,.0f}-{xdp[2]:,.0f})", f"{peer[0]:,.0f} pps ({peer[1]:,.0f}-{peer[2]:,.0f})",
                            f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f}){goal}",
                            f"delivered/sent ours {xdp_delivered:.3f}, peer {peer_delivered:.3f}; not LB-bound: the sender shares the CPUs"))
            xdp_net = common.spread([net(fixed["xdp"], i) for i in range(common.RUNS)])
            for peer_name in ("tc_ebpf", "nft stateless", "nft conntrack", "routing"):
                if peer_name not in fixed:
                    continue
                peer = common.spread([net(fixed[peer_name], i) for i in range(common.RUNS)])
                ratios = common.spread([net(fixed["xdp"], i) / net(fixed[peer_name], i) for i in range(common.RUNS)])
                out.append((f"xdp: forwarding CPU per packet at {FIXED_RATE // 1000}k pps", "routing only" if peer_name == "routing" else peer_name,
                            f"{xdp_net[0]:,.0f} ns ({xdp_net[1]:,.0f}-{xdp_net[2]:,.0f})", f"{peer[0]:,.0f} ns ({peer[1]:,.0f}-{peer[2]:,.0f})",
                            f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})",
                            f"sys+irq+softirq of all CPUs / delivered, minus the generator baseline ({base[0]:,.0f} ns) of the same run"))
            xdp_costs = common.spread([program_cost(topology, work, "xdp", "fanout_xfwd") for _ in range(3)])
            out.append(("xdp: program cost fanout_xfwd, raw", "-", f"{xdp_costs[0]:.1f} ns/run ({xdp_costs[1]:.1f}-{xdp_costs[2]:.1f})", "-", "-",
                        "kernel.bpf_stats_enabled run_time_ns/run_cnt, incl. fib lookup (the redirect's transmit runs after the program)"))
        costs = common.spread([program_cost(topology, work) for _ in range(3)])
        out.append(("tc: program cost fanout_tc, raw", "-", f"{costs[0]:.1f} ns/run ({costs[1]:.1f}-{costs[2]:.1f})", "-", "-",
                    "kernel.bpf_stats_enabled run_time_ns/run_cnt, incl. fib lookup and redirect"))
        return out
    finally:
        topology.destroy()
        subprocess.run(["rm", "-rf", work])
