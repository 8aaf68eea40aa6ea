# SPDX-License-Identifier: Apache-2.0
"""BENCH=scale, the namespace parts (BENCH_SCALE_ONLY=namespace): the kernel-facing kinds in
bench_common's topology, built here (with IPv6 beside IPv4) and removed after.

    client ── proxy (198.18.0.1 / 2001:db8::1, port 5514) ── backend 1..3 (drop UDP at ingress)

Downstreams, af_xdp: udp-fanout mode af_xdp with `output: socket` (one worker, batch 64) beside
the bench's own minimal C forwarder (bench/scale.c forward, bound in the proxy netns) at N = 3,
30, 300, 3000 downstreams (198.18.{1,2,3}.2, ports from 6000), round robin and source_ip, at
saturation (round robin: the client's publisher sending 64-byte datagrams from 16 sources as fast
as it can; source_ip: bench/scale.c's raw sender from 65,536 client addresses one after the other).
The forwarder alone on CPU 1, with its sends up to the backends' ingress, where nftables drops
them after the veth counted them ("delivered"); the proxy's receive from the client runs on CPU 0
with the sender, for both (the C forwarder's IP receive and socket queueing; af_xdp's XDP program
and copy into UMEM). CPU per datagram: CPU 1's busy time (minus its background at rest) /
delivered, plus for af_xdp the XDP program's own run time per datagram (kernel.bpf_stats_enabled;
its copy into UMEM is not counted, as the C forwarder's receive is not).

Sources: source_ip over the 3 backends with 10, 10,000 and 1,000,000 distinct client addresses
(IPv6, 2001:db8:64:: on: 198.18.0.0/15 has too few), sent one after the other by bench/scale.c's
raw sender at a fixed rate from the client netns: tc_ebpf (the program's own run time per
datagram, kernel.bpf_stats_enabled) and af_xdp (CPU 1 per delivered datagram, placed as above).
Shares bench_scale's sender, plotter and rows."""
import os
import subprocess
import time

import bench_common as common

PORT = 5514
VIP4, VIP6 = "198.18.0.1", "2001:db8::1"


class ScaleTopology(common.Topology):
    """bench_common's topology with IPv6 beside IPv4: the client 2001:db8::2/64 routing
    2001:db8::/32 through the proxy (2001:db8::1), backend n 2001:db8:n::2/64 with the proxy as
    its default route; the backends drop IPv6 UDP at ingress too. The proxy routes the senders'
    client addresses (the rest of 198.18.0.0/15, 2001:db8:64::/48) to the client."""

    def _build(self, tag):
        super()._build(tag)
        client_if = f"cp{tag}"
        self.client_if = client_if
        common.sh("ip", "-n", self.client, "addr", "add", "2001:db8::2/64", "dev", client_if, "nodad")
        common.sh("ip", "-n", self.client, "-6", "route", "add", "2001:db8::/32", "via", VIP6)
        common.sh("ip", "-n", self.proxy, "addr", "add", f"{VIP6}/64", "dev", self.proxy_if, "nodad")
        self.ns(self.proxy, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
        # The senders' many client addresses are routed back to the client (a reverse-path
        # filter, or a reply, finds them there).
        common.sh("ip", "-n", self.proxy, "route", "add", "198.18.0.0/15", "via", "198.18.0.2")
        common.sh("ip", "-n", self.proxy, "-6", "route", "add", "2001:db8:64::/48", "via", "2001:db8::2")
        for n, (backend, inner) in enumerate(zip(self.backends, self.backend_ifs), start=1):
            outer = f"pb{n}{tag[:7]}"
            common.sh("ip", "-n", self.proxy, "addr", "add", f"2001:db8:{n}::1/64", "dev", outer, "nodad")
            common.sh("ip", "-n", backend, "addr", "add", f"2001:db8:{n}::2/64", "dev", inner, "nodad")
            common.sh("ip", "-n", backend, "-6", "route", "add", "default", "via", f"2001:db8:{n}::1")
            rules = (f'table netdev sink6 {{\n chain in {{\n  type filter hook ingress device "{inner}" priority 0; policy accept;\n'
                     f"  ip6 nexthdr udp drop\n }}\n}}\n")
            subprocess.run([*common.in_namespace(backend), "nft", "-f", "-"], input=rules, text=True, check=True)
            self.ns(self.proxy, "ping", "-6", "-c", "1", "-W", "3", f"2001:db8:{n}::2")
        self.ns(self.proxy, "ping", "-6", "-c", "1", "-W", "3", "2001:db8::2")


class Daemon:
    """udp-fanout in the proxy netns on CPU 1 with one listener of `mode` on `bind`."""

    READY = {"af_xdp": "AF_XDP path initialized", "tc_ebpf": "registered listener in eBPF map"}

    def __init__(self, topology, work, mode, bind, balancing, downstreams, settings="", binary=None):
        lines = ["listeners:", "  - name: scale", f'    bind: "{bind}"', f"    interface: {topology.proxy_if}", f"    mode: {mode}",
                 f"    balancing: {balancing}"]
        if settings:
            lines.append(f"    settings: {{{settings}}}")
        lines.append("    downstream:")
        lines += [f'      - {{name: d{i}, address: "{address}"}}' for i, address in enumerate(downstreams)]
        path = os.path.join(work, "scale-ns.yaml")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        self.log = os.path.join(work, "scale-ns.log")
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([*common.in_namespace(topology.proxy), "taskset", "-c", "1", binary or f"{common.BIN}/udp-fanout", "-c", path],
                                         stderr=out, text=True)
        deadline = time.monotonic() + 60
        while self.READY[mode] not in open(self.log).read():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"udp-fanout ({mode}) did not start:\n{open(self.log).read()[-2000:]}")
            time.sleep(0.05)
        time.sleep(0.3)

    def stop(self):
        # Never leave a daemon holding the interface behind (its link goes with it).
        common.stop_process(self.proc, grace=30)


def program_ns(name):
    """(total run time ns, runs) of the loaded programs called `name` (kernel.bpf_stats_enabled)."""
    mean, runs = common.ns_per_run(["name", name])
    return (mean * runs if runs else 0.0), runs


def cpu1_run(topology, load, xdp_program=None):
    """Runs load() with the forwarder alone on CPU 1: CPU 1's busy ns per delivered datagram plus,
    with `xdp_program`, that program's run time per datagram (it runs on CPU 0, in the veth's
    NAPI), and what was sent and delivered."""
    quiet = common.background()
    before = topology.delivered()
    with common.BPFStats():
        start = program_ns(xdp_program) if xdp_program else (0.0, 0)
        sent, elapsed, busy = common.busy_during(load)
        end = program_ns(xdp_program) if xdp_program else (0.0, 0)
    delivered = topology.delivered() - before
    cpu = max(0.0, busy[1] - quiet[1] * elapsed)
    runs = end[1] - start[1]
    program = (end[0] - start[0]) / runs if runs else 0.0
    return {"ns": cpu / delivered * 1e9 + program if delivered else float("nan"), "program": program,
            "delivered": delivered / max(sent["sent"], 1), "pps": delivered / max(sent["seconds"], 1e-9)}


def drained(send):
    """A load: send(), then a moment for what is queued to drain; send's report."""
    def load():
        report = send()
        time.sleep(0.3)
        return report
    return load


def downstream_addresses(count):
    return [f"198.18.{1 + i % common.BACKENDS}.2:{6000 + i // common.BACKENDS}" for i in range(count)]


def publish_saturation(topology, datagrams):
    return common.publish_in(topology, (VIP4, PORT), datagrams)


def afxdp_downstream_run(variant, count, balancing, topology, tool, work, scale):
    """One point of the af_xdp downstream curve: `variant` af_xdp, before (BENCH_SCALE_BEFORE's
    build) or C."""
    destinations = downstream_addresses(count)

    if balancing == "source_ip":
        # Many client addresses one after the other (198.18.64.0 on), as in the loopback curve.
        load = drained(lambda: scale.blast(tool, VIP4, PORT, scale.NAMESPACE_DATAGRAMS, scale.SPREAD_SOURCES, "198.18.64.0",
                                           prefix=common.in_namespace(topology.client), rate=0))
    else:
        load = drained(lambda: publish_saturation(topology, scale.NAMESPACE_DATAGRAMS))
    if variant in ("af_xdp", "before"):
        daemon = Daemon(topology, work, "af_xdp", f"{VIP4}:{PORT}", balancing, destinations, "output: socket, batch_size: 64",
                        binary=scale.BEFORE if variant == "before" else None)
        try:
            return cpu1_run(topology, load, "fanout_xdp")
        finally:
            daemon.stop()
    forwarder = scale.CForwarder(tool, PORT, [d.rsplit(":", 1) for d in destinations], balancing, work, bind=VIP4,
                                 prefix=common.in_namespace(topology.proxy))
    try:
        return cpu1_run(topology, load)
    finally:
        forwarder.stop()


def downstream_rows(topology, tool, work, scale):
    print(f"bench: scale, downstreams in namespaces: udp-fanout af_xdp (output: socket) vs the C forwarder in the proxy netns;"
          f" N = {scale.COUNTS}; {scale.NAMESPACE_DATAGRAMS} datagrams of 64 bytes per run at saturation, the forwarder alone on CPU 1", flush=True)
    out = []
    variants = ("af_xdp", "C") + (("before",) if scale.BEFORE else ())
    names = {"af_xdp": "udp-fanout af_xdp (output: socket)", "C": "C forwarder (sendmmsg, unconnected)", "before": "udp-fanout af_xdp before"}
    for balancing in scale.BALANCINGS:
        results = {v: {n: [] for n in scale.COUNTS} for v in variants}
        for run in range(common.RUNS):
            for count in scale.COUNTS:
                for variant in (variants if run % 2 == 0 else variants[::-1]):
                    results[variant][count].append(afxdp_downstream_run(variant, count, balancing, topology, tool, work, scale))
        ours = results["af_xdp"]
        for peer, peer_name, goal in (("C", "C forwarder", " goal <= 1"), ("before", "before", "")):
            if peer not in results:
                continue
            theirs = results[peer]
            note = lambda n, theirs=theirs, peer_name=peer_name: (
                f"delivered/sent ours {common.spread([r['delivered'] for r in ours[n]])[0]:.3f},"
                f" {peer_name} {common.spread([r['delivered'] for r in theirs[n]])[0]:.3f}; XDP program"
                f" {common.spread([r['program'] for r in ours[n]])[0]:,.0f} ns/run (within ours)")
            out += scale.flat_rows(f"af_xdp, {balancing}", scale.COUNTS, ours, note, theirs, peer_name, unit="downstreams", goal=goal)
        curves = [(names[v], [common.spread([r["ns"] for r in results[v][n]])[0] for n in scale.COUNTS],
                   [common.spread([r["ns"] for r in results[v][n]])[1:] for n in scale.COUNTS]) for v in variants]
        svg = scale.plot(f"downstreams-afxdp-{balancing.replace('_', '-')}", f"one-way af_xdp, {balancing}: CPU per datagram",
                         "downstreams", "ns of CPU 1 per datagram delivered", curves, scale.COUNTS, work)
        out.append((f"scale: plot, downstreams, af_xdp, {balancing}", "-", svg, "-", "-", "median and min-max of the runs"))
    return out


SOURCES = [10, 10_000, 1_000_000]
FIRST_SOURCE = "2001:db8:64::"


def tc_sources_run(sources, topology, tool, work, scale):
    """tc_ebpf, source_ip over the 3 backends (IPv6): the program's own run time per datagram."""
    daemon = Daemon(topology, work, "tc_ebpf", f"[{VIP6}]:{PORT}", "source_ip", [f"[2001:db8:{n}::2]:6000" for n in range(1, 4)])
    try:
        before = topology.delivered()
        with common.BPFStats():
            start = program_ns("fanout_tc")
            sent = scale.blast(tool, VIP6, PORT, scale.SOURCE_DATAGRAMS, sources, FIRST_SOURCE, prefix=common.in_namespace(topology.client))
            time.sleep(0.2)
            end = program_ns("fanout_tc")
        delivered = topology.delivered() - before
    finally:
        daemon.stop()
    runs = end[1] - start[1]
    return {"ns": (end[0] - start[0]) / runs if runs else float("nan"), "delivered": delivered / max(sent["sent"], 1)}


def afxdp_sources_run(sources, topology, tool, work, scale):
    """af_xdp (socket output), source_ip over the 3 backends (IPv6), the forwarder alone on CPU 1."""
    daemon = Daemon(topology, work, "af_xdp", f"[{VIP6}]:{PORT}", "source_ip", [f"[2001:db8:{n}::2]:6000" for n in range(1, 4)],
                    "output: socket, batch_size: 64")
    try:
        return cpu1_run(topology, drained(lambda: scale.blast(tool, VIP6, PORT, scale.SOURCE_DATAGRAMS, sources, FIRST_SOURCE,
                                                              prefix=common.in_namespace(topology.client))), "fanout_xdp")
    finally:
        daemon.stop()


def source_rows(topology, tool, work, scale):
    print(f"bench: scale, sources in namespaces (IPv6): tc_ebpf and af_xdp, source_ip over 3 backends; {scale.SOURCE_DATAGRAMS} datagrams"
          f" of 64 bytes per run at {scale.SOURCE_RATE:,}/s from {SOURCES} distinct client addresses", flush=True)
    out = []
    for kind, run_one, unit_note, ylabel in (
            ("tc_ebpf", tc_sources_run, "the program's run time per datagram (kernel.bpf_stats_enabled), incl. fib lookup and redirect",
             "ns per run of fanout_tc"),
            ("af_xdp", afxdp_sources_run, "CPU 1 per delivered datagram (the forwarder and its sends) plus the XDP program's run time",
             "ns of CPU 1 per datagram delivered")):
        results = {s: [] for s in SOURCES}
        for run in range(common.RUNS):
            for sources in (SOURCES if run % 2 == 0 else SOURCES[::-1]):
                results[sources].append(run_one(sources, topology, tool, work, scale))
        delivered = ", ".join(f"{common.spread([r['delivered'] for r in results[s]])[0]:.3f}" for s in SOURCES)
        out += scale.flat_rows(kind, SOURCES, results, lambda s: f"{unit_note}; delivered/sent {delivered}")
        curves = [(f"udp-fanout {kind}", [common.spread([r["ns"] for r in results[s]])[0] for s in SOURCES],
                   [common.spread([r["ns"] for r in results[s]])[1:] for s in SOURCES])]
        svg = scale.plot(f"sources-{kind.replace('_', '')}", f"source_ip, {kind} (IPv6): cost per datagram", "distinct sources", ylabel,
                         curves, SOURCES, work)
        out.append((f"scale: plot, sources, {kind}", "-", svg, "-", "-", "median and min-max of the runs"))
    return out


# BENCH_SCALE_NS=downstreams|sources (comma-separated): those curves.
PARTS = os.environ.get("BENCH_SCALE_NS", "downstreams,sources").split(",")


def rows(tool, work, scale):
    """The namespace curves; `scale` is bench_scale (its sender, plotter, rows and settings)."""
    topology = ScaleTopology()
    affinity = os.sched_getaffinity(0)
    try:
        # This script and what it forks on CPU 0: CPU 1 holds the forwarder alone.
        os.sched_setaffinity(0, {0})
        return ((downstream_rows(topology, tool, work, scale) if "downstreams" in PARTS else [])
                + (source_rows(topology, tool, work, scale) if "sources" in PARTS else []))
    finally:
        os.sched_setaffinity(0, affinity)
        topology.destroy()
