# SPDX-License-Identifier: Apache-2.0
"""settings.flow_templates benchmark for make bench (BENCH=templates): the CPU per datagram of a
listener balancing NetFlow v9 by source over 3 collectors with the option on and off, side by side
in one run (the variants alternated run by run), in userspace (the daemon's threads' time on CPU,
output: preserve_source both ways) and in tc_ebpf (the tc program's run time plus the daemon's
time on CPU: its ring buffer reader). The exporters send their templates every 20 packets, as
softflowd and many routers do, so the option's parsing, learning and copying is in the figure.
Run by bench.py; shares bench_common's and bench_replication's helpers."""
import os
import shutil
import tempfile
import time

import bench_common as common
from bench_common import BACKENDS, Topology, in_namespace
from bench_replication import group_ns_on_cpu, program_ns, start_fanout, stop_group

RATE = int(os.environ.get("BENCH_TEMPLATES_RATE", "40000"))
SECONDS = int(os.environ.get("BENCH_TEMPLATES_SECONDS", "4"))
TC_RATE = int(os.environ.get("BENCH_TEMPLATES_TC_RATE", "20000"))
EXPORT = ("--netflow", "v9", "--records", "10", "--template-every", "20")


def userspace_run(templates, work):
    receivers = [common.free_port() for _ in range(3)]
    groups = [common.Collectors(port, "automatic", count=1) for port in receivers]
    listen = common.free_port()
    path = os.path.join(work, "templates.yaml")
    members = "".join(f'      - address: "127.0.0.1:{p}"\n' for p in receivers)
    with open(path, "w") as f:
        f.write(f"""listeners:
  - name: bench
    bind: "127.0.0.1:{listen}"
    balancing: source_ip
    settings: {{workers: 1, batch_size: 64, recv_buf_size: 16777216, output: preserve_source, flow_templates: {str(templates).lower()}}}
    downstream:
{members}""")
    proc = start_fanout(path, "entering receive loop")
    try:
        before = group_ns_on_cpu(proc.pid)
        sent = common.publish(listen, count=RATE * SECONDS, extra=EXPORT + ("--rate", str(RATE)))
        time.sleep(1.0)  # what is queued drains
        cpu = group_ns_on_cpu(proc.pid) - before
    finally:
        stop_group(proc)
    received = sum(group.stop()[0]["received"] for group in groups)
    return {"cpu_us": cpu / 1000 / sent["sent"], "delivered": received / sent["sent"]}


def tc_run(templates, topology, work):
    path = os.path.join(work, "tc-templates.yaml")
    members = ", ".join(f'{{address: "198.18.{n}.2:6000"}}' for n in range(1, BACKENDS + 1))
    with open(path, "w") as f:
        f.write(f'listeners:\n  - name: bench\n    bind: "198.18.0.1:5514"\n    interface: {topology.proxy_if}\n'
                f"    mode: tc_ebpf\n    balancing: source_ip\n    settings: {{flow_templates: {str(templates).lower()}}}\n"
                f"    downstream: [{members}]\n")
    proc = start_fanout(path, "registered listener in eBPF map", in_namespace(topology.proxy))
    try:
        before = topology.delivered()
        with common.BPFStats():
            cpu = program_ns() + group_ns_on_cpu(proc.pid)
            sent = common.publish_in(topology, ("198.18.0.1", 5514), TC_RATE * SECONDS, EXPORT + ("--rate", str(TC_RATE)))
            time.sleep(0.5)
            cpu = program_ns() + group_ns_on_cpu(proc.pid) - cpu
        delivered = topology.delivered() - before
    finally:
        stop_group(proc)
    return {"cpu_us": cpu / 1000 / sent["sent"], "delivered": delivered / sent["sent"]}


def compare(label, runs, note):
    on, off = common.spread([r["cpu_us"] for r in runs[True]]), common.spread([r["cpu_us"] for r in runs[False]])
    ratios = common.spread([a["cpu_us"] / b["cpu_us"] for a, b in zip(runs[True], runs[False])])
    least = min(r["delivered"] for r in runs[True] + runs[False])
    return (label, "the same listener, flow_templates off",
            f"{on[0]:.2f} us ({on[1]:.2f}-{on[2]:.2f})", f"{off[0]:.2f} us ({off[1]:.2f}-{off[2]:.2f})",
            f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})", f"{note}; least delivered / sent {least:.3f}")


def rows():
    work = tempfile.mkdtemp(prefix="rplb-templates-bench-")
    topology = None
    try:
        print(f"bench: flow_templates on vs off, NetFlow v9 of 10 records with templates every 20 packets, balanced by source"
              f" over 3 collectors; userspace at {RATE:,} pps from 240 exporters, tc_ebpf at {TC_RATE:,} pps from 16,"
              f" {SECONDS} s each, {common.RUNS} runs per variant alternated", flush=True)
        userspace = {True: [], False: []}
        for index in range(common.RUNS):
            for templates in ((True, False) if index % 2 == 0 else (False, True)):
                userspace[templates].append(userspace_run(templates, work))
        topology = Topology()
        kernel = {True: [], False: []}
        for index in range(common.RUNS):
            for templates in ((True, False) if index % 2 == 0 else (False, True)):
                kernel[templates].append(tc_run(templates, topology, work))
        return [
            compare(f"flow_templates userspace: CPU per datagram at {RATE:,} pps", userspace,
                    "the daemon's threads' time on CPU per datagram sent (output: preserve_source both ways)"),
            compare(f"flow_templates tc_ebpf: CPU per datagram at {TC_RATE:,} pps", kernel,
                    "the tc program's run time plus the daemon's time on CPU (its ring buffer reader), per datagram sent"),
        ]
    finally:
        if topology:
            topology.destroy()
        shutil.rmtree(work, ignore_errors=True)
