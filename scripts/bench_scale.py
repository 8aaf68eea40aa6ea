# SPDX-License-Identifier: Apache-2.0
"""BENCH=scale make bench: how the cost per datagram grows with the work, each curve beside its
peer in the same run, written as a table and as plots (docs/bench-scale-*.svg, matplotlib).

Downstreams: userspace udp-fanout (one worker) and the bench's own minimal C forwarder
(bench/scale.c: recvmmsg, then one sendmmsg per batch on an unconnected socket) at N = 3, 30,
300 and 3000 downstreams, round robin and source_ip, at saturation (BENCH_SCALE_BEFORE=<binary>
adds another udp-fanout build as a third variant of the same runs). The forwarder alone on CPU 1;
on CPU 0 the sender and one process holding the N downstream sockets, each with a filter that
drops every datagram before its queue: a datagram sent over loopback is received on the sender's
CPU, so the forwarder's cost ends at the socket lookup and no reader's wake-up is counted (the
same for every variant). The sender: for round robin the publisher (64-byte datagrams from 240
sources, as fast as it can, each batch of 64 of one source as one UDP GSO send, so that CPU 0
outruns the forwarder); for source_ip bench/scale.c's raw sender, as fast as it can, from 65,536
client addresses one after the other (every downstream gets datagrams, and a batch holds many
sources, as with real clients).

Sources: source_ip over 3 downstreams with 10 to 1,000,000 distinct client addresses, sent one
after the other by bench/scale.c's raw sender at a fixed rate: userspace on loopback, beside the
C forwarder.

CPU per datagram: CPU 1's busy time (wall minus measured idle, minus its background at rest)
divided by the datagrams the forwarder sent, so a forwarder that cannot keep up is charged only
for what it did.

The other parts live in their own modules: bench_scale_ns (af_xdp against downstreams, tc_ebpf
and af_xdp against client addresses, in namespaces) and bench_scale_twoway (relay and nat
against concurrent clients). BENCH_SCALE_ONLY=downstreams,sources,namespace,twoway picks parts.
Run by bench.py; shares bench_common's helpers."""
import json
import os
import re
import sys
import subprocess
import tempfile
import time
import urllib.request

import bench_common as common
import bench_scale_ns
import bench_scale_twoway

COUNTS = [int(n) for n in os.environ.get("BENCH_SCALE_DOWNSTREAMS", "3,30,300,3000").split(",")]
DATAGRAMS = int(os.environ.get("BENCH_SCALE_DATAGRAMS", "2000000"))
BALANCINGS = tuple(os.environ.get("BENCH_SCALE_BALANCINGS", "round_robin,source_ip").split(","))
# source_ip's load: this many client addresses, one after the other (bench/scale.c blast, as fast
# as it sends), so that every one of up to 3000 downstreams gets datagrams and a batch holds
# datagrams of many sources, not a run of one.
SPREAD_SOURCES = 65536
HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(HERE, "..", "docs")


class Sink:
    """One process holding `count` downstream sockets on 127.0.0.1, on CPU 0."""

    def __init__(self, tool, count, drop=False):
        self.proc = subprocess.Popen(["taskset", "-c", "0", tool, "sink", "127.0.0.1", str(count), *(["drop"] if drop else [])],
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("ports "):
            common.stop_process(self.proc)
            raise SystemExit(f"sink did not start: {line}")
        self.ports = [int(p) for p in line.split()[1].split(",")]

    def stop(self):
        return json.loads(common.stop_with_output(self.proc, 20).strip().splitlines()[-1])["received"]


class Fanout:
    """udp-fanout, one userspace worker, pinned to CPU 1 (`binary`: another build's, for a
    before/after comparison)."""

    def __init__(self, port, ports, balancing, work, binary=None):
        self.metrics = common.free_port()
        lines = ["listeners:", "  - name: scale", f'    bind: "127.0.0.1:{port}"', f"    balancing: {balancing}",
                 "    settings: {workers: 1, batch_size: 64, recv_buf_size: 16777216}", "    downstream:"]
        lines += [f'      - {{name: d{i}, address: "127.0.0.1:{p}"}}' for i, p in enumerate(ports)]
        lines += [f'metrics: {{enabled: true, bind: "127.0.0.1:{self.metrics}"}}']
        path = os.path.join(work, "scale.yaml")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        # The log goes to a file: a pipe nobody reads after the start would block the daemon once full.
        log = os.path.join(work, "scale.log")
        with open(log, "w") as out:
            self.proc = subprocess.Popen(["taskset", "-c", "1", binary or f"{common.BIN}/udp-fanout", "-c", path], stderr=out, text=True)
        deadline = time.monotonic() + 60
        while "entering receive loop" not in open(log).read():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                common.stop_process(self.proc)
                raise SystemExit(f"udp-fanout did not start:\n{open(log).read()[-2000:]}")
            time.sleep(0.05)

    def forwarded(self):
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5).read().decode()
        match = re.search(r'^udp_fanout_packets_forwarded_total\{listener="scale"[^}]*\} (\d+)', text, re.M)
        return int(match.group(1))

    def stop(self):
        try:
            return self.forwarded()
        finally:
            common.stop_process(self.proc)


# bench/scale.c's forward mode, pinned to CPU 1 here (bench_common.CForwarder).
def CForwarder(tool, port, destinations, balancing, work, bind="127.0.0.1", prefix=()):
    return common.CForwarder(tool, port, destinations, balancing, work, bind=bind, prefix=prefix, cpu=1)


# BENCH_SCALE_BEFORE=/path/to/udp-fanout: another build (e.g. the revision before a change) runs
# as a third variant of the downstream curves, alternated with the others in the same runs.
BEFORE = os.environ.get("BENCH_SCALE_BEFORE")


def measure(sink, forwarder, send):
    """Runs send() (the load, on CPU 0) with `forwarder` on CPU 1, then stops both: CPU 1's busy
    time per datagram the forwarder sent, and its rate."""
    try:
        quiet = common.background()

        def load():
            report = send()
            time.sleep(0.3)  # what is queued drains
            return report
        sent, elapsed, busy = common.busy_during(load)
    finally:
        try:
            forwarded = forwarder.stop()
        finally:
            sink.stop()
    cpu = max(0.0, busy[1] - quiet[1] * elapsed)
    return {"ns": cpu / forwarded * 1e9 if forwarded else float("nan"), "pps": forwarded / sent["seconds"], "forwarded": forwarded}


def downstream_run(variant, count, balancing, tool, work):
    # The sink drops every datagram at its sockets' filters: the forwarder's cost ends at the
    # socket lookup on CPU 1, with no wake-up of a reader (the same for every variant).
    sink = Sink(tool, count, drop=True)
    port = common.free_port()
    try:
        if variant == "C":
            forwarder = CForwarder(tool, port, [("127.0.0.1", p) for p in sink.ports], balancing, work)
        else:
            forwarder = Fanout(port, sink.ports, balancing, work, binary=BEFORE if variant == "before" else None)
    except BaseException:
        sink.stop()
        raise
    if balancing == "source_ip":
        return measure(sink, forwarder, lambda: blast(tool, "127.0.0.1", port, DATAGRAMS, SPREAD_SOURCES, "127.64.0.0", rate=0))
    return measure(sink, forwarder, lambda: publish_on_cpu0(port))


def publish_on_cpu0(port):
    # --gso: the publisher's 64 datagrams of a batch (one source) cost it one send, so CPU 0 (the
    # publisher and the sink) outruns the forwarder and the forwarder is what is measured.
    out = subprocess.run(["taskset", "-c", "0", f"{common.BIN}/publisher", "127.0.0.1", str(port), str(DATAGRAMS),
                          "--sources", common.SOURCES, "--batch", "64", "--gso"], capture_output=True, text=True, check=True, timeout=600).stdout
    return json.loads(out)


def plot(name, title, xlabel, ylabel, curves, xs, work):
    """curves: [(label, [median per x], [(min, max) per x])] → docs/bench-scale-NAME.svg, drawn by
    scripts/plot_curves.py with Debian's python3 and python3-matplotlib."""
    spec = os.path.join(work, f"{name}.json")
    with open(spec, "w") as f:
        json.dump({"title": title, "xlabel": xlabel, "ylabel": ylabel, "xs": xs,
                   "curves": [{"label": label, "medians": medians, "ranges": ranges} for label, medians, ranges in curves]}, f)
    path = os.path.join(DOCS, f"bench-scale-{name}.svg")
    subprocess.run(["/usr/bin/python3", os.path.join(HERE, "plot_curves.py"), spec, path], check=True)
    return os.path.relpath(path, os.path.join(HERE, ".."))


def downstream_rows(tool, work):
    variants = ["udp-fanout", "C"] + (["before"] if BEFORE else [])
    print(f"bench: scale, downstreams: udp-fanout (userspace, 1 worker) vs the C forwarder (one sendmmsg per batch,"
          f" unconnected){' and ' + BEFORE + ' (before)' if BEFORE else ''}; N = {COUNTS}; {DATAGRAMS} datagrams of 64 bytes"
          f" per run, forwarder alone on CPU 1", flush=True)
    out = []
    for balancing in BALANCINGS:
        results = {(v, n): [] for v in variants for n in COUNTS}
        for run in range(common.RUNS):
            for count in COUNTS:
                for variant in (variants if run % 2 == 0 else variants[::-1]):
                    results[(variant, count)].append(downstream_run(variant, count, balancing, tool, work))
        base = common.spread([r["ns"] for r in results[("udp-fanout", COUNTS[0])]])[0]
        names = {"udp-fanout": "udp-fanout", "C": "C forwarder (sendmmsg, unconnected)", "before": "udp-fanout before"}
        curves = []
        for variant in variants:
            spreads = [common.spread([r["ns"] for r in results[(variant, n)]]) for n in COUNTS]
            curves.append((names[variant], [s[0] for s in spreads], [(s[1], s[2]) for s in spreads]))
        for count in COUNTS:
            ours = results[("udp-fanout", count)]
            mine = common.spread([r["ns"] for r in ours])
            pps = common.spread([r["pps"] for r in ours])
            for peer_variant, peer_name, goal in (("C", "C forwarder", " goal <= 1"), ("before", "before", "")):
                if peer_variant not in variants:
                    continue
                peer = results[(peer_variant, count)]
                theirs = common.spread([r["ns"] for r in peer])
                ratios = common.spread([o["ns"] / p["ns"] for o, p in zip(ours, peer)])
                peer_pps = common.spread([r["pps"] for r in peer])
                out.append((f"scale: CPU per datagram, {count} downstreams, {balancing}", peer_name,
                            f"{mine[0]:,.0f} ns ({mine[1]:,.0f}-{mine[2]:,.0f})", f"{theirs[0]:,.0f} ns ({theirs[1]:,.0f}-{theirs[2]:,.0f})",
                            f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f}){goal}",
                            f"x{mine[0] / base:.2f} of ours at N={COUNTS[0]} (goal <= 1.15); forwarded ours {pps[0]:,.0f} pps,"
                            f" {peer_name} {peer_pps[0]:,.0f} pps"))
        svg = plot(f"downstreams-{balancing.replace('_', '-')}", f"one-way userspace, {balancing}: CPU per datagram",
                   "downstreams", "ns of CPU 1 per datagram sent", curves, COUNTS, work)
        out.append((f"scale: plot, downstreams, {balancing}", "-", svg, "-", "-", "median and min-max of the runs"))
    return out


def blast(tool, target, port, count, sources, first, prefix=(), rate=None):
    """bench/scale.c's raw sender on CPU 0: `count` 64-byte datagrams from `sources` addresses,
    one after the other, at `rate` per second (SOURCE_RATE unless given; 0: as fast as it can)."""
    rate = SOURCE_RATE if rate is None else rate
    out = subprocess.run([*prefix, "taskset", "-c", "0", tool, "blast", target, str(port), str(count), str(sources), first, str(rate)],
                         capture_output=True, text=True, check=True, timeout=660).stdout
    return json.loads(out)


def loopback_sources_run(variant, sources, tool, work):
    """source_ip over 3 downstreams on loopback, `sources` client addresses from 127.64.0.0 on."""
    sink = Sink(tool, 3, drop=True)
    port = common.free_port()
    try:
        forwarder = (Fanout(port, sink.ports, "source_ip", work) if variant == "udp-fanout"
                     else CForwarder(tool, port, [("127.0.0.1", p) for p in sink.ports], "source_ip", work))
    except BaseException:
        sink.stop()
        raise
    return measure(sink, forwarder, lambda: blast(tool, "127.0.0.1", port, SOURCE_DATAGRAMS, sources, "127.64.0.0"))


SOURCE_DATAGRAMS = int(os.environ.get("BENCH_SCALE_SOURCE_DATAGRAMS", "1000000"))
# A fixed rate both forwarders keep up with: the cost per datagram at the same batch fill, so
# that only the number of sources differs between the points of a curve.
SOURCE_RATE = int(os.environ.get("BENCH_SCALE_SOURCE_RATE", "100000"))
LOOPBACK_SOURCES = [10, 10_000, 1_000_000]
# The namespace curves' datagrams per run at saturation (bench_scale_ns).
NAMESPACE_DATAGRAMS = int(os.environ.get("BENCH_SCALE_NAMESPACE_DATAGRAMS", "1000000"))


def flat_rows(kind, xs, results, unit_note, peer=None, peer_name="-", unit="sources", goal=""):
    """Rows of one curve: ours per x (and the peer's, with the ratio), against ours at the first
    x. `unit_note`: the note's end, or a function of x giving it."""
    out = []
    base = common.spread([r["ns"] for r in results[xs[0]]])[0]
    for x in xs:
        mine = common.spread([r["ns"] for r in results[x]])
        if peer:
            theirs = common.spread([r["ns"] for r in peer[x]])
            ratios = common.spread([o["ns"] / p["ns"] for o, p in zip(results[x], peer[x])])
            peer_cell, ratio_cell = f"{theirs[0]:,.0f} ns ({theirs[1]:,.0f}-{theirs[2]:,.0f})", f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f}){goal}"
        else:
            peer_cell, ratio_cell = "-", "-"
        note = unit_note(x) if callable(unit_note) else unit_note
        out.append((f"scale: CPU per datagram, {x:,} {unit}, {kind}", peer_name, f"{mine[0]:,.0f} ns ({mine[1]:,.0f}-{mine[2]:,.0f})",
                    peer_cell, ratio_cell, f"x{mine[0] / base:.2f} of ours at {xs[0]:,} {unit} (goal <= 1.15); {note}"))
    return out


def source_rows(tool, work):
    print(f"bench: scale, sources on loopback: source_ip over 3 downstreams; {SOURCE_DATAGRAMS} datagrams of 64 bytes per run at"
          f" {SOURCE_RATE:,}/s from {LOOPBACK_SOURCES} distinct client addresses", flush=True)
    out = []
    ours = {s: [] for s in LOOPBACK_SOURCES}
    peer = {s: [] for s in LOOPBACK_SOURCES}
    for run in range(common.RUNS):
        for sources in LOOPBACK_SOURCES:
            for variant in (("udp-fanout", "C") if run % 2 == 0 else ("C", "udp-fanout")):
                (ours if variant == "udp-fanout" else peer)[sources].append(loopback_sources_run(variant, sources, tool, work))
    out += flat_rows("userspace", LOOPBACK_SOURCES, ours, f"CPU 1 per datagram sent at {SOURCE_RATE:,}/s, forwarder alone on CPU 1", peer, "C forwarder")
    curves = [(name, [common.spread([r["ns"] for r in data[s]])[0] for s in LOOPBACK_SOURCES],
               [common.spread([r["ns"] for r in data[s]])[1:] for s in LOOPBACK_SOURCES])
              for name, data in (("udp-fanout userspace", ours), ("C forwarder", peer))]
    svg = plot("sources-userspace", "source_ip, userspace: CPU per datagram", "distinct sources",
               "ns of CPU 1 per datagram sent", curves, LOOPBACK_SOURCES, work)
    out.append(("scale: plot, sources, userspace", "-", svg, "-", "-", "median and min-max of the runs"))
    return out


# BENCH_SCALE_ONLY=downstreams|sources|namespace|twoway (comma-separated): those parts.
PARTS = os.environ.get("BENCH_SCALE_ONLY", "downstreams,sources,namespace,twoway").split(",")


def rows():
    work = tempfile.mkdtemp(prefix="rplb-scale-bench-")
    try:
        tool = common.build_scale_tool(work)
        out = []
        if "downstreams" in PARTS:
            out += downstream_rows(tool, work)
        if "sources" in PARTS:
            out += source_rows(tool, work)
        if "namespace" in PARTS:
            out += bench_scale_ns.rows(tool, work, sys.modules[__name__])
        if "twoway" in PARTS:
            out += bench_scale_twoway.rows(work, lambda name, title, xlabel, ylabel, curves, xs:
                                           plot(name, title, xlabel, ylabel, curves, xs, work))
        return out
    finally:
        subprocess.run(["rm", "-rf", work])
