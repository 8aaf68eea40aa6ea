#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""make bench-compare BEFORE=<git rev>: the per-datagram cost of a change, side by side in one run.

The af_xdp benchmark's topology (client -> proxy with 2 RX queues -> 3 backends, veth) and
load, run for udp-fanout's userspace, tc_ebpf, xdp and af_xdp (socket output) listeners with two
release builds: BEFORE (a git revision, built in a worktree of its own) and this tree. Each run
alternates the builds and the variants, so both see the same machine; each row gives the median
of the per-run ratios after / before (1.00: no change) with its range. Saturation: delivered pps
of 600,000 64-byte datagrams sent as fast as the publisher can; CPU: busy time of every CPU
per delivered datagram at 100,000 pps for 4 s (the generator's share included, the same for
both builds). The xdp variant is bench_tc's (GRO on the backends' veth ends, the client's
checksums computed), its CPU the kernel's share (system + irq + softirq: it has no userspace
part). For the two BPF programs, a third row: their own run time per datagram, from the
kernel's BPF statistics (bpf_stats_enabled) over 200,000 datagrams at the fixed rate, which
the rest of the machine does not blur.
"""
import os
import signal
import statistics
import subprocess
import sys
import tempfile

import bench_afxdp
import bench_common as common
import bench_tc

VARIANTS = ["userspace", "tc_ebpf", "xdp", "af_xdp socket"]
# The BPF programs whose run time per datagram is compared: variant -> program name.
PROGRAMS = {"tc_ebpf": "fanout_tc", "xdp": "fanout_xfwd"}


def build_before(revision):
    """Builds `revision` (release) in a worktree under /tmp; returns its bin directory."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = subprocess.check_output(["git", "-C", root, "rev-parse", "--short", revision], text=True).strip()
    tree = f"/tmp/udp-fanout-bench-before-{commit}"
    if not os.path.isdir(tree):
        subprocess.run(["git", "-C", root, "worktree", "add", "--detach", tree, commit], check=True, stdout=subprocess.DEVNULL)
    if os.path.exists(os.path.join(root, "Package.resolved")):
        subprocess.run(["cp", os.path.join(root, "Package.resolved"), tree], check=True)
    print(f"bench-compare: building {revision} ({commit}) in {tree} (release)", flush=True)
    subprocess.run(["swift", "build", "-c", "release"], cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return subprocess.check_output(["swift", "build", "-c", "release", "--show-bin-path"], cwd=tree, text=True).strip(), commit


def run(name, binary, topology, work, fixed):
    common.BIN = binary
    if name == "xdp":
        return bench_tc.run_once(name, topology, work, fixed=fixed)
    return bench_afxdp.run_once(name, topology, work, fixed=fixed)


def program_cost(name, binary, topology, work):
    common.BIN = binary
    return {"ns_per_run": bench_tc.program_cost(topology, work, name, PROGRAMS[name])}


def main():
    revision = os.environ.get("BEFORE") or (sys.argv[1] if len(sys.argv) > 1 else "")
    if not revision:
        raise SystemExit("bench-compare: say which revision to compare with: make bench-compare BEFORE=<git rev>")
    after = common.BIN
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    variants, programs = list(VARIANTS), dict(PROGRAMS)
    # A revision older than the xdp kind (its program) cannot run the xdp variant.
    if subprocess.run(["git", "-C", root, "cat-file", "-e", f"{revision}:bpf/xdp_fanout.bpf.c"], stderr=subprocess.DEVNULL).returncode != 0:
        print(f"bench-compare: {revision} has no xdp kind: the xdp rows are left out", flush=True)
        variants = [name for name in variants if name != "xdp"]
        programs.pop("xdp", None)
    before, commit = build_before(revision)
    builds = [("before", before), ("after", after)]
    # One fixed rate for every variant (bench_tc's own default differs).
    bench_tc.FIXED_RATE = bench_afxdp.FIXED_RATE
    bench_tc.FIXED_SECONDS = bench_afxdp.FIXED_SECONDS
    bench_tc.DATAGRAMS = bench_afxdp.DATAGRAMS
    # A SIGTERM (a CI job cancelled, kill) must still reach the cleanup below.
    signal.signal(signal.SIGTERM, common.terminated)
    work = tempfile.mkdtemp(prefix="udp-fanout-bench-compare-")
    topology = common.Topology(queues=2)
    results = {(name, build, fixed): [] for name in variants for build, _ in builds for fixed in (False, True, "program")}
    try:
        print(f"bench-compare: {commit} (before) vs this tree (after); {', '.join(variants)}; {common.RUNS} alternated runs;"
              f" saturation {bench_afxdp.DATAGRAMS} datagrams, CPU at {bench_afxdp.FIXED_RATE:,} pps for {bench_afxdp.FIXED_SECONDS} s;"
              f" {os.cpu_count()} CPUs", flush=True)
        for number in range(common.RUNS):
            order = builds if number % 2 == 0 else list(reversed(builds))
            for fixed in (False, True):
                for name in variants:
                    for build, binary in order:
                        results[(name, build, fixed)].append(run(name, binary, topology, work, fixed))
            for name in programs:
                for build, binary in order:
                    results[(name, build, "program")].append(program_cost(name, binary, topology, work))
    finally:
        common.BIN = after
        topology.destroy()
        subprocess.run(["rm", "-rf", work])
    rows = []
    for name in variants:
        # xdp's CPU is the kernel's share (bench_tc): compare its ratio, not its ns with the others'.
        cpu = "kernel CPU" if name == "xdp" else "CPU"
        scenarios = [(False, "pps", "delivered pps at saturation", "pps"),
                     (True, "ns_per_packet", f"{cpu} per datagram at {bench_afxdp.FIXED_RATE // 1000}k pps", "ns")]
        if name in programs:
            scenarios.append(("program", "ns_per_run", f"{PROGRAMS[name]} run time per datagram (BPF stats)", "ns"))
        for fixed, key, scenario, unit in scenarios:
            ours = results[(name, "after", fixed)]
            peer = results[(name, "before", fixed)]
            a, b = common.spread([r[key] for r in ours]), common.spread([r[key] for r in peer])
            ratios = common.spread([o[key] / p[key] for o, p in zip(ours, peer)])
            if fixed == "program":
                note = "the program alone, measured by the kernel"
            else:
                delivered = statistics.median(r["delivered"] for r in ours), statistics.median(r["delivered"] for r in peer)
                note = f"delivered/sent after {delivered[0]:.3f}, before {delivered[1]:.3f}"
            rows.append((f"{name}: {scenario}", f"before ({commit})", f"{a[0]:,.0f} {unit} ({a[1]:,.0f}-{a[2]:,.0f})",
                         f"{b[0]:,.0f} {unit} ({b[1]:,.0f}-{b[2]:,.0f})", f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})", note))
    header = ("scenario", "compared to", "after: median (min-max)", "before: median (min-max)", "ratio after/before (per run)", "note")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


if __name__ == "__main__":
    main()
