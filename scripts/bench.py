#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""make bench: ReusePortLB benchmarks. Variants are alternated run by run (the machine is noisy);
each line gives the median, the min-max over runs, the peer it is compared to, and the ratio."""
import ctypes
import json
import os
import shutil
import struct
import tempfile
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import bench_afxdp
import bench_fanout
import bench_frames
import bench_latency
import bench_quic
import bench_abuse
import bench_replication
import bench_scale
import bench_tc
import bench_templates
import bench_twoway
from bench_common import (BIN, DATAGRAMS, RUNS, SOURCES, BPFStats, Collectors, free_port, ns_per_run, publish,
                          rss_kib, spread)

def steering_run(steering):
    """Aggregate received pps of 3 collectors fed by one publisher sending as fast as it can."""
    port = free_port()
    group = Collectors(port, steering)
    sent = publish(port)
    time.sleep(0.3)
    reports = group.stop()
    received = sum(r["received"] for r in reports)
    return {"pps": received / sent["seconds"], "delivered": received / sent["sent"], "steering": reports[0]["steering"]}


def program_cost():
    """ns per run of rplb_select from the kernel's BPF run-time statistics."""
    with BPFStats():
        port = free_port()
        group = Collectors(port, "ebpf")
        try:
            publish(port)
            return ns_per_run(["name", "rplb_select"])
        finally:
            group.stop()


LIBC = ctypes.CDLL(None, use_errno=True)


def bpf(command, attr):
    buffer = ctypes.create_string_buffer(attr, 128)
    result = LIBC.syscall(321, command, buffer, 128)  # __NR_bpf on x86_64
    if result < 0:
        raise OSError(ctypes.get_errno(), "bpf")
    return result


def floor_costs():
    """ns per run of the two floor programs of bench/floor.bpf.c, attached to 3 plain sockets."""
    work = tempfile.mkdtemp(prefix="rplb-bench-")
    pins = f"/sys/fs/bpf/rplb-bench-floor-{os.getpid()}"
    try:
        obj = os.path.join(work, "floor.o")
        subprocess.run(["clang", "-O2", "-g", "-target", "bpf", f"-I/usr/include/{os.uname().machine}-linux-gnu",
                        "-c", "bench/floor.bpf.c", "-o", obj], check=True)
        subprocess.run(["bpftool", "prog", "loadall", obj, pins, "pinmaps", pins + "/maps"], check=True)
        costs = {}
        for name in ("floor_empty", "floor_select"):
            path = ctypes.create_string_buffer(f"{pins}/{name}".encode())
            program = bpf(7, struct.pack("QII", ctypes.addressof(path), 0, 0))  # BPF_OBJ_GET
            path = ctypes.create_string_buffer(f"{pins}/maps/floor_members".encode())
            members = bpf(7, struct.pack("QII", ctypes.addressof(path), 0, 0))
            port = free_port()
            sockets = []
            for slot in range(3):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                s.bind(("127.0.0.1", port))
                sockets.append(s)
                key, value = ctypes.c_uint32(slot), ctypes.c_uint64(s.fileno())
                bpf(2, struct.pack("IIQQQ", members, 0, ctypes.addressof(key), ctypes.addressof(value), 0))
            sockets[0].setsockopt(socket.SOL_SOCKET, 52, struct.pack("i", program))  # SO_ATTACH_REUSEPORT_EBPF
            with BPFStats():
                publish(port)  # the sockets are never read: the program runs before the queue
                costs[name] = ns_per_run(["pinned", f"{pins}/{name}"])[0]
            for s in sockets:
                s.close()
            os.close(program)
            os.close(members)
        return costs
    finally:
        shutil.rmtree(pins, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def rss_run():
    port = free_port()
    group = Collectors(port, "ebpf")
    time.sleep(0.2)
    rest = max(rss_kib(p.pid) for p in group.procs)
    peak = [rest]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max([peak[0]] + [rss_kib(p.pid) for p in group.procs])
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    publish(port, extra=("--size", "1400"))
    stop.set()
    sampler.join()
    group.stop()
    return rest, peak[0]


def main():
    only = sys.argv[1] if len(sys.argv) > 1 else "all"
    rows = []
    if only in ("all", "reuseportlb"):
        rows += reuseportlb_rows()
    if only in ("all", "fanout"):
        rows += bench_fanout.rows()
    if only in ("all", "tc"):
        rows += bench_tc.rows()
    if only in ("all", "afxdp"):
        rows += bench_afxdp.rows()
    if only in ("all", "twoway"):
        rows += bench_twoway.rows()
    if only in ("all", "replication"):
        rows += bench_replication.rows()
    if only in ("all", "templates"):
        rows += bench_templates.rows()
    if only in ("all", "quic"):
        rows += bench_quic.rows()
    if only in ("all", "abuse"):
        rows += bench_abuse.rows()
    if only in ("all", "frames"):
        rows += bench_frames.rows()
    if only in ("all", "latency"):
        rows += bench_latency.rows()
    if only == "scale":  # not in "all": it runs for most of an hour
        rows += bench_scale.rows()
    widths = [max(len(r[i]) for r in rows + [HEADER]) for i in range(len(HEADER))]
    for row in [HEADER] + rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def reuseportlb_rows():
    print(f"bench: {RUNS} runs per variant, alternated; {DATAGRAMS} datagrams of 64 bytes from 240 sources per run;"
          f" 3 collectors on 127.0.0.1; {os.cpu_count()} CPUs", flush=True)
    results = {"ebpf": [], "kernelHash": [], "classicBPF": []}
    for run in range(RUNS):
        for steering in (["ebpf", "kernelHash", "classicBPF"] if run % 2 == 0 else ["classicBPF", "kernelHash", "ebpf"]):
            results[steering].append(steering_run(steering))
    peer = spread([r["pps"] for r in results["kernelHash"]])
    rows = []
    for steering, label in (("ebpf", "sourceIP, eBPF"), ("classicBPF", "sourceIP, classic BPF")):
        mine = spread([r["pps"] for r in results[steering]])
        delivered = statistics.median(r["delivered"] for r in results[steering])
        # Each run's variants ran back to back: the ratio within a run cancels the machine's drift.
        ratios = spread([m["pps"] / k["pps"] for m, k in zip(results[steering], results["kernelHash"])])
        rows.append((f"steering cost: {label}", "kernel SO_REUSEPORT hash",
                     f"{mine[0]:,.0f} pps ({mine[1]:,.0f}-{mine[2]:,.0f})",
                     f"{peer[0]:,.0f} pps ({peer[1]:,.0f}-{peer[2]:,.0f})",
                     f"{ratios[0]:.3f} ({ratios[1]:.2f}-{ratios[2]:.2f})" + (" goal >= 0.95" if steering == "ebpf" else ""),
                     f"median of per-run ratios; delivered/sent {delivered:.4f}"))
    ours, floors = [], []
    for _ in range(RUNS):
        ours.append(program_cost()[0])
        floors.append(floor_costs())
    raw = spread(ours)
    empty = spread([f["floor_empty"] for f in floors])
    select = spread([f["floor_select"] for f in floors])
    nets = spread([o - f["floor_empty"] for o, f in zip(ours, floors)])
    rows.append(("program cost: rplb_select, raw", "empty program (stats overhead)",
                 f"{raw[0]:.1f} ns/run ({raw[1]:.1f}-{raw[2]:.1f})", f"{empty[0]:.1f} ns/run ({empty[1]:.1f}-{empty[2]:.1f})",
                 f"{raw[0] / empty[0]:.2f}", "kernel.bpf_stats_enabled run_time_ns/run_cnt"))
    floor_nets = spread([f["floor_select"] - f["floor_empty"] for f in floors])
    rows.append(("program cost: rplb_select, net", "target 100 ns", f"{nets[0]:.1f} ns/run ({nets[1]:.1f}-{nets[2]:.1f})",
                 "100 ns", f"{nets[0] / 100:.2f}", "per run: raw minus the empty program measured next to it"))
    rows.append(("program cost: rplb_select, net", "load source + select only",
                 f"{nets[0]:.1f} ns/run", f"{floor_nets[0]:.1f} ns/run ({floor_nets[1]:.1f}-{floor_nets[2]:.1f})",
                 f"{nets[0] / floor_nets[0]:.2f}", "the least a source-steering program does"))
    rest, peak = rss_run()
    rows.append(("collector RSS at rest / under load", "-", f"{rest / 1024:.1f} MiB / {peak / 1024:.1f} MiB", "-", "-",
                 "1400-byte datagrams, max of 3"))
    return rows


HEADER = ("scenario", "compared to", "ours: median (min-max)", "peer: median (min-max)", "ratio", "note")

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
