# SPDX-License-Identifier: Apache-2.0
"""rate_limit benchmarks for make bench (bench.py abuse): the cost of per-source limits next to
the same listener without them, on the same packets (publisher, 240 sources), in one run.
- "on": rate_limit with rates no source reaches (every datagram is checked and charged, none
  dropped) against no rate_limit: the cost of the check.
- "under attack": 100 datagrams/s per source while the 240 sources send far more, so most are
  dropped by the limit, against no rate_limit forwarding them all: the cost per datagram received.
- "under attack, captured": the same attack while `udp-fanout capture` takes the drops (at its
  default 1,000 a second, into /dev/null), against the same attack without a capture: what a
  capture costs the data path.
Kinds: userspace (one worker; the daemon's CPU per datagram received), tc_ebpf and xdp (ns per run
of fanout_tc / fanout_xfwd, kernel.bpf_stats_enabled) and af_xdp (the daemon's CPU per datagram
received), the last three through a namespace topology (client, proxy, three backends). Relay
takes its limit from the same table as userspace, and is not run separately."""
import os
import shutil
import signal
import subprocess
import tempfile
import time

import bench_common as common
from bench_quic import cpu_seconds, kernel_downstreams, xdp_ends

DATAGRAMS = int(os.environ.get("BENCH_ABUSE_DATAGRAMS", "400000"))
KERNEL_DATAGRAMS = int(os.environ.get("BENCH_ABUSE_KERNEL_DATAGRAMS", "200000"))
KERNEL_RUNS = int(os.environ.get("BENCH_ABUSE_KERNEL_RUNS", "3"))
VARIANTS = {
    "off": None,
    "on": "{datagrams_per_second: 100000000, bytes_per_second: 100000000000}",
    "under attack": "{datagrams_per_second: 100, burst_datagrams: 10}",
    "under attack, captured": "{datagrams_per_second: 100, burst_datagrams: 10}",
}
CAPTURED = "under attack, captured"


def start_capture(prefix, metrics, log):
    """`udp-fanout capture` of listener abuse into /dev/null, running once the daemon says so."""
    capture = subprocess.Popen([*prefix, f"{common.BIN}/udp-fanout", "capture", "--listener", "abuse", "--seconds", "120",
                                "-w", "/dev/null", "--endpoint", f"127.0.0.1:{metrics}"],
                               stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 20
    while "capture started" not in open(log).read():
        if capture.poll() is not None or time.time() > deadline:
            raise SystemExit(f"udp-fanout capture did not start: {capture.stderr.read() if capture.poll() is not None else ''}")
        time.sleep(0.05)
    return capture


def stop_capture(capture):
    """Ends it (Ctrl-C) and returns what it said."""
    capture.send_signal(signal.SIGINT)
    _, said = capture.communicate(timeout=20)
    return said.strip()


def userspace_run(variant, work):
    """CPU ns per datagram received of a one-worker userspace listener (3 sinks)."""
    limit = VARIANTS[variant]
    ports = [common.free_port() for _ in range(3)]
    sinks = [common.Collectors(port, "automatic", count=1) for port in ports]
    listen, metrics = common.free_port(), common.free_port()
    downstreams = "\n".join(f'      - {{address: "127.0.0.1:{p}"}}' for p in ports)
    config = (f'listeners:\n  - name: abuse\n    bind: "127.0.0.1:{listen}"\n    balancing: source_ip\n'
              + (f"    rate_limit: {limit}\n" if limit else "")
              + "    settings: {workers: 1, batch_size: 64, recv_buf_size: 16777216}\n    downstream:\n" + downstreams + "\n"
              + f'metrics: {{enabled: true, bind: "127.0.0.1:{metrics}"}}\n')
    path = os.path.join(work, "abuse-userspace.yaml")
    with open(path, "w") as f:
        f.write(config)
    log = os.path.join(work, "abuse-userspace.log")
    with open(log, "w") as stderr:
        proc = subprocess.Popen([f"{common.BIN}/udp-fanout", "-c", path], stderr=stderr)
    try:
        deadline = time.time() + 20
        while "entering receive loop" not in open(log).read():
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"udp-fanout did not start ({variant}): {open(log).read()}")
            time.sleep(0.05)
        capture = start_capture([], metrics, log) if variant == CAPTURED else None
        before = cpu_seconds(proc.pid)
        common.publish(listen, count=DATAGRAMS, extra=("--rate", "200000"))
        time.sleep(0.3)
        used = cpu_seconds(proc.pid) - before
        if capture:
            stop_capture(capture)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    delivered = sum(group.stop()[0]["received"] for group in sinks)
    return {"ns": used * 1e9 / DATAGRAMS, "delivered": delivered / DATAGRAMS}


def kernel_config(topology, kind, limit, metrics):
    settings = "    settings: {output: socket, batch_size: 64}\n" if kind == "af_xdp" else ""
    return (f'listeners:\n  - name: abuse\n    bind: "198.18.0.1:5514"\n    interface: {topology.proxy_if}\n'
            f"    mode: {kind}\n    balancing: source_ip\n{settings}" + (f"    rate_limit: {limit}\n" if limit else "")
            + f"    downstream:\n{kernel_downstreams(None, ['', '', ''])}\n" + f'metrics: {{enabled: true, bind: "127.0.0.1:{metrics}"}}\n')


def kernel_run(topology, work, kind, variant):
    """tc_ebpf, xdp: ns per run of the program; af_xdp: the daemon's CPU per datagram received."""
    path = os.path.join(work, f"abuse-{kind}.yaml")
    with open(path, "w") as f:
        f.write(kernel_config(topology, kind, VARIANTS[variant], 19092))
    log = os.path.join(work, f"abuse-{kind}.log")
    with open(log, "w") as stderr:
        proc = subprocess.Popen([*common.in_namespace(topology.proxy), f"{common.BIN}/udp-fanout", "-c", path], stderr=stderr)
    ready = "AF_XDP path initialized" if kind == "af_xdp" else "registered listener in eBPF map"
    try:
        deadline = time.time() + 20
        while ready not in open(log).read():
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"udp-fanout ({kind}, {variant}) did not start: {open(log).read()[-2000:]}")
            time.sleep(0.05)
        time.sleep(0.3)
        capture = start_capture(common.in_namespace(topology.proxy), 19092, log) if variant == CAPTURED else None
        before, cpu = topology.delivered(), cpu_seconds(proc.pid)
        if kind == "af_xdp":
            common.publish_in(topology, ("198.18.0.1", 5514), KERNEL_DATAGRAMS, ("--rate", "200000"))
            time.sleep(0.3)
            cost = (cpu_seconds(proc.pid) - cpu) * 1e9 / KERNEL_DATAGRAMS
        else:
            with common.BPFStats():
                common.publish_in(topology, ("198.18.0.1", 5514), KERNEL_DATAGRAMS, ("--rate", "200000"))
                time.sleep(0.2)
                cost, _ = common.ns_per_run(["name", "fanout_tc" if kind == "tc_ebpf" else "fanout_xfwd"])
        delivered = topology.delivered() - before
        if capture:
            stop_capture(capture)
    finally:
        common.stop_process(proc)
    return {"ns": cost, "delivered": delivered / KERNEL_DATAGRAMS}


def show(values, unit):
    median, low, high = values
    return f"{median:,.0f} ns ({low:,.0f}-{high:,.0f})" if unit == "ns" else f"{median:.1f} ns/run ({low:.1f}-{high:.1f})"


def compare(results, kind, unit, what, note):
    out = []
    for name, peer, against in (("on", "off", "no rate_limit, same packets"), ("under attack", "off", "no rate_limit, same packets"),
                                (CAPTURED, "under attack", "the same attack, no capture")):
        base = results[peer]
        ratios = common.spread([m["ns"] / b["ns"] for m, b in zip(results[name], base)])
        out.append((f"rate_limit {name}: {kind} {what}", against,
                    show(common.spread([r["ns"] for r in results[name]]), unit), show(common.spread([r["ns"] for r in base]), unit),
                    f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})",
                    f"{note}; delivered {min(r['delivered'] for r in results[name]):.4f} ({peer} {min(r['delivered'] for r in base):.4f})"))
    return out


def kernel_rows(work):
    out = []
    for kind in ("tc_ebpf", "xdp", "af_xdp"):
        topology = common.Topology(queues=2) if kind == "af_xdp" else common.Topology()
        try:
            if kind == "xdp":
                xdp_ends(topology, True)
            results = common.alternated(KERNEL_RUNS, list(VARIANTS), lambda name: kernel_run(topology, work, kind, name))
            if kind == "af_xdp":
                out += compare(results, kind, "ns", "CPU per datagram received",
                               f"the daemon's utime+stime; 2 RX queues; {KERNEL_DATAGRAMS} datagrams x {KERNEL_RUNS} runs")
            else:
                out += compare(results, kind, "run", f"program cost {'fanout_tc' if kind == 'tc_ebpf' else 'fanout_xfwd'}",
                               f"kernel.bpf_stats_enabled; {KERNEL_DATAGRAMS} datagrams x {KERNEL_RUNS} runs")
        finally:
            topology.destroy()
    return out


def rows():
    work = tempfile.mkdtemp(prefix="rplb-abuse-bench-")
    try:
        print(f"bench: rate_limit, {common.RUNS} runs per variant, alternated; {DATAGRAMS} datagrams of 64 bytes"
              f" from 240 sources per run (200,000/s), 3 downstreams; under attack: 100 datagrams/s per source", flush=True)
        results = common.alternated(common.RUNS, list(VARIANTS), lambda name: userspace_run(name, work))
        out = compare(results, "userspace", "ns", "CPU per datagram received", "userspace, 1 worker")
        out += kernel_rows(work)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)
