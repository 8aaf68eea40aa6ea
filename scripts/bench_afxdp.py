# SPDX-License-Identifier: Apache-2.0
"""udp-fanout af_xdp benchmarks for make bench (BENCH=afxdp): af_xdp (each output) against
userspace mode and tc_ebpf, in bench_common's namespace topology with two RX queues on the client
link, built here and removed afterwards. Run by bench.py; shares bench_common's helpers.

    client ── proxy ── backend 1..3        (198.18.0.0/15 only, namespaces of this run)

The client's publisher sends 64-byte datagrams from 16 source addresses to 198.18.0.1:5514;
backends drop UDP at their ingress after the veth counted it ("delivered" = what reached the
backend links). Variants, alternated run by run:

  af_xdp socket            payload out through a UDP socket (sendmmsg), the daemon's source
  af_xdp preserve_source   the whole datagram with the client's source, raw socket
  userspace                recvmmsg/sendmmsg workers (2), socket output
  tc_ebpf                  the in-kernel path

Saturation: as many datagrams as the publisher sends; delivered pps. CPU per forwarded
datagram at a fixed rate: every CPU's busy time (user + system + irq + softirq, /proc/stat)
over the run divided by what was delivered; the generator's share is the same for every
variant. RSS: the daemon's VmRSS after the fixed-rate run.
"""
import os
import statistics
import subprocess
import tempfile
import time

import bench_common as common

DATAGRAMS = int(os.environ.get("BENCH_AFXDP_DATAGRAMS", "600000"))
FIXED_RATE = int(os.environ.get("BENCH_AFXDP_RATE", "100000"))
FIXED_SECONDS = int(os.environ.get("BENCH_AFXDP_SECONDS", "4"))
VARIANTS = ["af_xdp socket", "af_xdp preserve_source", "userspace", "tc_ebpf"]


def busy_cpu_seconds():
    """User + nice + system + irq + softirq time of all CPUs, in seconds (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


class Daemon:
    def __init__(self, name, topology, work):
        mode, _, output = name.partition(" ")
        downstreams = "\n".join(f'      - {{name: b{n}, address: "198.18.{n}.2:6000"}}' for n in range(1, common.BACKENDS + 1))
        settings = {"af_xdp": f"{{output: {output}, batch_size: 64}}", "userspace": "{workers: 2, batch_size: 64}", "tc_ebpf": "{}"}[mode]
        path = os.path.join(work, "afxdp.yaml")
        with open(path, "w") as f:
            f.write(f'listeners:\n  - name: bench\n    bind: "198.18.0.1:5514"\n    interface: {topology.proxy_if}\n'
                    f"    mode: {mode}\n    settings: {settings}\n    downstream:\n{downstreams}\n")
        ready = {"af_xdp": "AF_XDP path initialized", "userspace": "entering receive loop", "tc_ebpf": "registered listener in eBPF map"}[mode]
        # The log goes to a file (a pipe nobody reads would block the daemon once full).
        self.log = os.path.join(work, "udp-fanout.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([*common.in_namespace(topology.proxy), f"{common.BIN}/udp-fanout", "-c", path],
                                         stderr=log, text=True)
        deadline = time.monotonic() + 20
        while True:
            with open(self.log) as f:
                text = f.read()
            if ready in text:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"udp-fanout ({name}) did not start:\n{text[-2000:]}")
            time.sleep(0.05)
        time.sleep(0.3)

    def rss_kib(self):
        # The daemon is nsenter's child (nsenter execs it: same pid).
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    def stop(self):
        # Never leave a daemon holding the interface behind (its link goes with it).
        common.stop_process(self.proc)


def run_once(name, topology, work, fixed):
    daemon = Daemon(name, topology, work)
    try:
        before = topology.delivered()
        cpu = busy_cpu_seconds()
        if fixed:
            sent = common.publish_in(topology, ("198.18.0.1", 5514), FIXED_RATE * FIXED_SECONDS, ("--rate", str(FIXED_RATE)))
        else:
            sent = common.publish_in(topology, ("198.18.0.1", 5514), DATAGRAMS)
        time.sleep(0.3)
        cpu = busy_cpu_seconds() - cpu
        delivered = topology.delivered() - before
        rss = daemon.rss_kib()
    finally:
        daemon.stop()
    return {"pps": delivered / sent["seconds"], "delivered": delivered / sent["sent"],
            "ns_per_packet": cpu * 1e9 / max(delivered, 1), "rss": rss}


def rows():
    work = tempfile.mkdtemp(prefix="rplb-afxdp-bench-")
    topology = common.Topology(queues=2)
    try:
        print(f"bench: af_xdp vs userspace vs tc_ebpf in the proxy namespace of client -> proxy (2 RX queues) -> 3 backends (veth);"
              f" 64-byte datagrams from 16 sources; {common.RUNS} alternated runs; saturation {DATAGRAMS} datagrams,"
              f" CPU at {FIXED_RATE:,} pps for {FIXED_SECONDS} s; {os.cpu_count()} CPUs", flush=True)
        saturation = {name: [] for name in VARIANTS}
        fixed = {name: [] for name in VARIANTS}
        for run in range(common.RUNS):
            order = VARIANTS if run % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                saturation[name].append(run_once(name, topology, work, fixed=False))
            for name in order:
                fixed[name].append(run_once(name, topology, work, fixed=True))
        out = []

        def compare(ours_name, results, key, scenario, unit, goals, note):
            ours = common.spread([r[key] for r in results[ours_name]])
            for peer_name in ("userspace", "tc_ebpf"):
                peer = common.spread([r[key] for r in results[peer_name]])
                ratios = common.spread([o[key] / p[key] for o, p in zip(results[ours_name], results[peer_name])])
                out.append((f"{ours_name}: {scenario}", peer_name,
                            f"{ours[0]:,.0f} {unit} ({ours[1]:,.0f}-{ours[2]:,.0f})", f"{peer[0]:,.0f} {unit} ({peer[1]:,.0f}-{peer[2]:,.0f})",
                            f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f}){goals.get(peer_name, '')}", note(peer_name)))

        def delivered_note(ours_name):
            def note(peer_name):
                ours = statistics.median(r["delivered"] for r in saturation[ours_name])
                peer = statistics.median(r["delivered"] for r in saturation[peer_name])
                return f"delivered/sent ours {ours:.3f}, peer {peer:.3f}"
            return note

        for ours_name in ("af_xdp socket", "af_xdp preserve_source"):
            compare(ours_name, saturation, "pps", "delivered pps at saturation", "pps", {"userspace": " goal >= 1.5"},
                    delivered_note(ours_name))
            compare(ours_name, fixed, "ns_per_packet", f"CPU per datagram at {FIXED_RATE // 1000}k pps", "ns", {"userspace": " goal <= 0.67"},
                    lambda _: "user+sys+irq+softirq of all CPUs / delivered, generator included")
        for name in VARIANTS:
            rss = common.spread([r["rss"] / 1024 for r in fixed[name]])
            out.append((f"{name}: daemon RSS after the fixed-rate run", "-", f"{rss[0]:,.1f} MiB ({rss[1]:,.1f}-{rss[2]:,.1f})", "-", "-",
                        "VmRSS; af_xdp includes its UMEM (frames x size per queue)"))
        return out
    finally:
        topology.destroy()
        subprocess.run(["rm", "-rf", work])
