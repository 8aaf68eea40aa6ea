# SPDX-License-Identifier: Apache-2.0
"""Replication benchmark for make bench (BENCH=replication): udp-fanout (userspace, pools) against
pmacct's nfacctd tee plugin, each copying every NetFlow v9 datagram to 3 receivers on loopback,
plain and keeping the exporter's address (preserve_source / tee_transparent); then udp-fanout
tc_ebpf (copies made in the kernel) against nfacctd tee_transparent in the proxy namespace of
client -> proxy -> 3 backends. Run by bench.py; shares bench_common's helpers."""
import os
import shutil
import signal
import subprocess
import tempfile
import time

import json

import bench_common as common
from bench_common import BACKENDS, Topology, in_namespace

PACKETS = int(os.environ.get("BENCH_REPLICATION_PACKETS", "200000"))
# CPU per datagram is measured at a rate both forwarders keep up with (a forwarder that drops at
# its socket does less work per datagram sent); delivered copies at saturation.
RATE = int(os.environ.get("BENCH_REPLICATION_RATE", "40000"))
# BENCH_REPLICATION_BEFORE=/path/to/udp-fanout: another build (e.g. the revision before a change)
# runs as a third userspace variant, alternated with the others in the same runs.
BEFORE = os.environ.get("BENCH_REPLICATION_BEFORE")
# BENCH_REPLICATION_ONLY=tc: the tc_ebpf rows alone (userspace: those alone).
ONLY = os.environ.get("BENCH_REPLICATION_ONLY", "")


def group_ns_on_cpu(pgid):
    """Nanoseconds on CPU of every thread of every process in process group `pgid` (nfacctd forks
    its plugin; udp-fanout is one process), from /proc/PID/task/*/schedstat."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
            for task in os.listdir(f"/proc/{entry}/task"):
                with open(f"/proc/{entry}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
        except OSError:
            continue
    return total


def start_fanout(path, ready, prefix=(), binary=None):
    """udp-fanout (`binary`, else the build's) with config `path` (in a namespace: `prefix`), once its log says `ready`."""
    proc = subprocess.Popen([*prefix, binary or f"{common.BIN}/udp-fanout", "-c", path], stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    while ready not in (line := proc.stderr.readline()):
        if not line:
            raise SystemExit("udp-fanout exited")
    return proc


def start_nfacctd(work, name, bind, receivers, transparent, prefix=()):
    """nfacctd on `bind` (ip, port) with a tee plugin of one single-receiver pool per receiver."""
    lst = os.path.join(work, f"{name}.lst")
    with open(lst, "w") as f:
        f.writelines(f"id={i + 1} ip={r}\n" for i, r in enumerate(receivers))
    conf = os.path.join(work, f"{name}.conf")
    with open(conf, "w") as f:
        f.write(f"daemonize: false\nnfacctd_ip: {bind[0]}\nnfacctd_port: {bind[1]}\nnfacctd_pipe_size: 16777216\n"
                f"plugins: tee[t]\ntee_receivers[t]: {lst}\ntee_transparent[t]: {'true' if transparent else 'false'}\n"
                "plugin_pipe_size[t]: 67108864\nplugin_buffer_size[t]: 65536\n")
    proc = subprocess.Popen([*prefix, "nfacctd", "-f", conf], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    time.sleep(1.5)
    if proc.poll() is not None:
        raise SystemExit(f"nfacctd exited: {proc.stderr.read()}")
    return proc


def stop_group(proc):
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Replicator:
    """udp-fanout with the listener's own receiver and a pool of the other two (balancing: all),
    or nfacctd with a tee plugin of three single-receiver pools: 3 copies of each datagram either way."""

    def __init__(self, variant, listen, receivers, work, transparent, tool=None):
        self.variant = variant
        if variant.startswith("C tee"):
            path = os.path.join(work, "tee-destinations")
            with open(path, "w") as f:
                f.writelines(f"127.0.0.1 {p}\n" for p in receivers)
            mode = "udp" if variant.endswith("udp") else "raw"
            self.proc = subprocess.Popen([tool, "tee", "127.0.0.1", str(listen), path, mode], stdout=subprocess.PIPE, text=True,
                                         start_new_session=True)
            if self.proc.stdout.readline().strip() != "ready":
                stop_group(self.proc)
                raise SystemExit("bench/scale.c tee did not start")
        elif variant in ("udp-fanout", "before"):
            path = os.path.join(work, "fanout.yaml")
            output = "preserve_source" if transparent else "socket"
            members = "".join(f'          - address: "127.0.0.1:{p}"\n' for p in receivers[1:])
            with open(path, "w") as f:
                f.write(f"""listeners:
  - name: bench
    bind: "127.0.0.1:{listen}"
    settings: {{workers: 1, batch_size: 64, recv_buf_size: 16777216, output: {output}}}
    downstream:
      - address: "127.0.0.1:{receivers[0]}"
    pools:
      - name: copies
        balancing: all
        downstream:
{members}""")
            self.proc = start_fanout(path, "entering receive loop", binary=BEFORE if variant == "before" else None)
        else:
            self.proc = start_nfacctd(work, "tee", ("127.0.0.1", listen), [f"127.0.0.1:{p}" for p in receivers], transparent)

    def cpu(self):
        return group_ns_on_cpu(self.proc.pid) / 1e9

    def stop(self):
        stop_group(self.proc)


def run(variant, work, transparent, rate=0, tool=None):
    receivers = [common.free_port() for _ in range(3)]
    groups = [common.Collectors(port, "automatic", count=1) for port in receivers]
    listen = common.free_port()
    lb = Replicator(variant, listen, receivers, work, transparent, tool)
    try:
        before = lb.cpu()
        count = min(PACKETS, rate * 3) if rate else PACKETS
        sent = common.publish(listen, count=count, extra=("--netflow", "v9", "--records", "10", "--rate", str(rate)))
        time.sleep(1.0)  # what is queued drains
        cpu = lb.cpu() - before
    finally:
        lb.stop()
    copies = sum(group.stop()[0]["received"] for group in groups)
    return {"cpu_us": cpu / sent["sent"] * 1e6, "copies_pps": copies / sent["seconds"], "delivered": copies / (3 * sent["sent"])}


def rows():
    if not shutil.which("nfacctd"):
        raise SystemExit("nfacctd is not installed: run make bench (it installs pmacct as root)")
    if ONLY not in ("", "tc", "userspace"):
        raise SystemExit(f"BENCH_REPLICATION_ONLY={ONLY}: say tc or userspace")
    if ONLY == "tc":
        return kernel_rows()
    work = tempfile.mkdtemp(prefix="rplb-replication-bench-")
    out = []
    try:
        print(f"bench: replication to 3 receivers, udp-fanout (userspace, 1 worker, pools) vs nfacctd tee plugin (pmacct),"
              f" {PACKETS} NetFlow v9 datagrams (10 records) from 240 exporters as fast as the publisher sends", flush=True)
        tool = common.build_scale_tool(work)
        for transparent in (False, True):
            # Keeping the address, the floors too, at the paced rate: bench/scale.c tee, the least a
            # userspace copier that keeps the source does through a raw socket (one sendmmsg per
            # batch: "C tee"), and through UDP sockets, one per exporter address, with GSO ("C tee,
            # udp": a way out udp-fanout does not take, measured to say what it would buy here).
            variants = ("udp-fanout", "nfacctd") + (("before",) if BEFORE else ()) + (("C tee", "C tee, udp") if transparent else ())
            results = {variant: [] for variant in variants}
            paced = {variant: [] for variant in variants}
            for index in range(common.RUNS):
                for variant in (variants if index % 2 == 0 else variants[::-1]):
                    paced[variant].append(run(variant, work, transparent, RATE, tool))
                    if not variant.startswith("C tee"):
                        results[variant].append(run(variant, work, transparent))
            label = "keeping the exporter's address" if transparent else "plain"
            ours = common.spread([r["cpu_us"] for r in paced["udp-fanout"]])
            peer = common.spread([r["cpu_us"] for r in paced["nfacctd"]])
            ratios = common.spread([o["cpu_us"] / p["cpu_us"] for o, p in zip(paced["udp-fanout"], paced["nfacctd"])])
            out.append((f"replication: CPU per received datagram at {RATE:,} pps, {label}",
                        f"nfacctd tee{', tee_transparent' if transparent else ''}",
                        f"{ours[0]:.2f} us ({ours[1]:.2f}-{ours[2]:.2f})", f"{peer[0]:.2f} us ({peer[1]:.2f}-{peer[2]:.2f})",
                        f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f}) goal <= 0.33",
                        f"the LB's threads' time on CPU / datagrams sent; least delivered: ours {min(r['delivered'] for r in paced['udp-fanout']):.3f},"
                        f" nfacctd {min(r['delivered'] for r in paced['nfacctd']):.3f}"))
            if BEFORE:
                before = common.spread([r["cpu_us"] for r in paced["before"]])
                ratios = common.spread([o["cpu_us"] / b["cpu_us"] for o, b in zip(paced["udp-fanout"], paced["before"])])
                out.append((f"replication: CPU per received datagram at {RATE:,} pps, {label}", "before",
                            f"{ours[0]:.2f} us ({ours[1]:.2f}-{ours[2]:.2f})", f"{before[0]:.2f} us ({before[1]:.2f}-{before[2]:.2f})",
                            f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})",
                            f"BENCH_REPLICATION_BEFORE={BEFORE}; least delivered: before {min(r['delivered'] for r in paced['before']):.3f}"))
            floors = {"C tee": ("floor: C tee (bench/scale.c, raw socket)",
                                "the least a userspace copier keeping the address and port does: recvmmsg, 3 raw copies a datagram"
                                " with the headers and UDP checksum built, one sendmmsg a batch"),
                      "C tee, udp": ("C tee, udp (bench/scale.c, a UDP socket per exporter)",
                                     "the address kept (IP_TRANSPARENT, bound to it), the port not; one sendmmsg per exporter a batch,"
                                     " an exporter's run of one size to one receiver as one GSO message")}
            for variant, (name, what) in floors.items() if transparent else ():
                floor = common.spread([r["cpu_us"] for r in paced[variant]])
                ratios = common.spread([o["cpu_us"] / f["cpu_us"] for o, f in zip(paced["udp-fanout"], paced[variant])])
                against = common.spread([f["cpu_us"] / p["cpu_us"] for f, p in zip(paced[variant], paced["nfacctd"])])
                out.append((f"replication: CPU per received datagram at {RATE:,} pps, {label}", name,
                            f"{ours[0]:.2f} us ({ours[1]:.2f}-{ours[2]:.2f})", f"{floor[0]:.2f} us ({floor[1]:.2f}-{floor[2]:.2f})",
                            f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})",
                            f"ratio: ours / its; it against nfacctd tee_transparent: {against[0]:.2f} ({against[1]:.2f}-{against[2]:.2f}) (the goal for ours: <= 0.33);"
                            f" {what}; least delivered: {min(r['delivered'] for r in paced[variant]):.3f}"))
            ours = common.spread([r["copies_pps"] for r in results["udp-fanout"]])
            peer = common.spread([r["copies_pps"] for r in results["nfacctd"]])
            delivered = (min(r["delivered"] for r in results["udp-fanout"]), min(r["delivered"] for r in results["nfacctd"]))
            out.append((f"replication: delivered copies/s at saturation, {label}", f"nfacctd tee{', tee_transparent' if transparent else ''}",
                        f"{ours[0]:,.0f} ({ours[1]:,.0f}-{ours[2]:,.0f})", f"{peer[0]:,.0f} ({peer[1]:,.0f}-{peer[2]:,.0f})",
                        f"{ours[0] / peer[0]:.2f}",
                        f"least copies delivered / 3 x sent: ours {delivered[0]:.3f}, nfacctd {delivered[1]:.3f}"))
            if BEFORE:
                before = common.spread([r["copies_pps"] for r in results["before"]])
                out.append((f"replication: delivered copies/s at saturation, {label}", "before",
                            f"{ours[0]:,.0f} ({ours[1]:,.0f}-{ours[2]:,.0f})", f"{before[0]:,.0f} ({before[1]:,.0f}-{before[2]:,.0f})",
                            f"{ours[0] / before[0]:.2f}",
                            f"least copies delivered / 3 x sent: ours {delivered[0]:.3f}, before {min(r['delivered'] for r in results['before']):.3f}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out + (kernel_rows() if ONLY != "userspace" else [])


# tc_ebpf: the copies are made in softirq, inside the tc program (bpf_clone_redirect hands each
# copy to the egress device there), so the LB's work is the program's run time
# (kernel.bpf_stats_enabled run_time_ns); nfacctd's is its processes' time on CPU
# (/proc/PID/task/*/schedstat, in ns). Either way per datagram sent, at a rate both keep up with;
# neither includes the receive of the datagram up to the hook or socket, which both pay alike.
TC_RATE = int(os.environ.get("BENCH_REPLICATION_TC_RATE", "20000"))
TC_SECONDS = int(os.environ.get("BENCH_REPLICATION_TC_SECONDS", "4"))


def program_ns(pinned=None):
    """Run time of the fanout_tc programs loaded (or of the program pinned at `pinned`), in ns."""
    shown = ["pinned", pinned] if pinned else ["name", "fanout_tc"]
    progs = json.loads(subprocess.check_output(["bpftool", "prog", "show", *shown, "--json"], text=True))
    progs = progs if isinstance(progs, list) else [progs]
    return sum(p.get("run_time_ns", 0) for p in progs)


FLOOR_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "frames.bpf.c")


def link_facts(topology, namespace, interface):
    link = json.loads(topology.ns(namespace, "ip", "-j", "link", "show", "dev", interface))[0]
    return link["ifindex"], link["address"]


class KernelReplicator:
    """In the proxy namespace: udp-fanout tc_ebpf with backend 1 its own and backends 2 and 3 an
    `all` pool (3 copies of each datagram, the exporter's address kept; `before`: the same with
    BENCH_REPLICATION_BEFORE's build), or nfacctd tee_transparent to the 3 backends, or the floor:
    bench/frames.bpf.c's floor_copies at tc ingress, which only sets the Ethernet addresses and
    makes the same three copies (two bpf_clone_redirect, one bpf_redirect); or udp-fanout in
    userspace mode with output: preserve_source and the same downstream and pool (`userspace`;
    `userspace, before`: BENCH_REPLICATION_BEFORE's build): the exporters' addresses are not the
    proxy's, as in a deployment, so its copies go through UDP sockets bound to them; or its floor,
    bench/scale.c's tee through a UDP socket per exporter address (`C tee, udp`)."""

    def __init__(self, variant, topology, work):
        self.variant, self.topology, self.proc, self.pins = variant, topology, None, None
        receivers = [f"198.18.{n}.2:6000" for n in range(1, BACKENDS + 1)]
        if variant == "floor":
            self.start_floor(work)
        elif variant == "C tee, udp":
            path = os.path.join(work, "tee-destinations")
            with open(path, "w") as f:
                f.writelines(f"{r.replace(':', ' ')}\n" for r in receivers)
            tool = os.path.join(work, "scale")
            if not os.path.exists(tool):
                common.build_scale_tool(work)
            self.proc = subprocess.Popen([*in_namespace(topology.proxy), tool, "tee", "198.18.0.1", "5514", path, "udp"],
                                         stdout=subprocess.PIPE, text=True, start_new_session=True)
            if self.proc.stdout.readline().strip() != "ready":
                stop_group(self.proc)
                raise SystemExit("bench/scale.c tee did not start")
        elif variant.startswith("userspace"):
            path = os.path.join(work, "userspace-pools.yaml")
            members = ", ".join(f'{{address: "{r}"}}' for r in receivers[1:])
            with open(path, "w") as f:
                f.write(f'listeners:\n  - name: bench\n    bind: "198.18.0.1:5514"\n'
                        f"    settings: {{workers: 1, batch_size: 64, recv_buf_size: 16777216, output: preserve_source}}\n"
                        f'    downstream: [{{address: "{receivers[0]}"}}]\n'
                        f"    pools:\n      - {{name: copies, balancing: all, downstream: [{members}]}}\n")
            self.proc = start_fanout(path, "entering receive loop", in_namespace(topology.proxy),
                                     BEFORE if variant.endswith("before") else None)
        elif variant in ("tc_ebpf", "before"):
            path = os.path.join(work, "tc-pools.yaml")
            members = ", ".join(f'{{address: "{r}"}}' for r in receivers[1:])
            with open(path, "w") as f:
                f.write(f'listeners:\n  - name: bench\n    bind: "198.18.0.1:5514"\n    interface: {topology.proxy_if}\n'
                        f'    mode: tc_ebpf\n    downstream: [{{address: "{receivers[0]}"}}]\n'
                        f"    pools:\n      - {{name: copies, balancing: all, downstream: [{members}]}}\n")
            self.proc = start_fanout(path, "registered listener in eBPF map", in_namespace(topology.proxy),
                                     BEFORE if variant == "before" else None)
        else:
            self.proc = start_nfacctd(work, "tee-ns", ("198.18.0.1", 5514), receivers, True, in_namespace(topology.proxy))

    def start_floor(self, work):
        topology = self.topology
        obj = os.path.join(work, "frames.o")
        if not os.path.exists(obj):
            subprocess.run(["clang", "-O2", "-g", "-target", "bpf", f"-I/usr/include/{os.uname().machine}-linux-gnu",
                            "-c", FLOOR_SOURCE, "-o", obj], check=True)
        self.pins = f"/sys/fs/bpf/rplb-replication-floor-{os.getpid()}"
        try:
            common.sh("bpftool", "prog", "loadall", obj, self.pins, "pinmaps", self.pins + "/maps")
            tag = topology.proxy_if[2:]
            for n in range(1, BACKENDS + 1):
                outer = f"pb{n}{tag[:7]}"
                index, source = link_facts(topology, topology.proxy, outer)
                _, destination = link_facts(topology, topology.backends[n - 1], topology.backend_ifs[n - 1])
                value = index.to_bytes(4, "little") + bytes.fromhex(destination.replace(":", "")) + bytes.fromhex(source.replace(":", ""))
                common.sh("bpftool", "map", "update", "pinned", f"{self.pins}/maps/floor_out", "key", *n.to_bytes(4, "little").hex(" ").split(),
                          "value", *[str(b) for b in value])
            topology.ns(topology.proxy, "tc", "qdisc", "add", "dev", topology.proxy_if, "clsact")
            topology.ns(topology.proxy, "tc", "filter", "add", "dev", topology.proxy_if, "ingress", "bpf",
                        "object-pinned", f"{self.pins}/floor_copies", "direct-action")
        except BaseException:
            self.stop()
            raise

    def ns_on_cpu(self):
        if self.variant in ("nfacctd", "C tee, udp") or self.variant.startswith("userspace"):
            return group_ns_on_cpu(self.proc.pid)
        return program_ns(f"{self.pins}/floor_copies" if self.variant == "floor" else None)

    def stop(self):
        if self.proc:
            stop_group(self.proc)
        if self.pins:
            common.sh("ip", "netns", "exec", self.topology.proxy, "tc", "qdisc", "del", "dev", self.topology.proxy_if, "clsact", check=False)
            shutil.rmtree(self.pins, ignore_errors=True)
            self.pins = None


def run_kernel(variant, topology, work, fixed):
    lb = KernelReplicator(variant, topology, work)
    try:
        before = topology.delivered()
        with common.BPFStats():
            cpu = lb.ns_on_cpu()
            count = TC_RATE * TC_SECONDS if fixed else PACKETS
            extra = ("--netflow", "v9", "--records", "10") + (("--rate", str(TC_RATE)) if fixed else ())
            sent = common.publish_in(topology, ("198.18.0.1", 5514), count, extra)
            time.sleep(0.5)
            cpu = lb.ns_on_cpu() - cpu
        delivered = topology.delivered() - before
    finally:
        lb.stop()
    return {"cpu_us": cpu / 1000 / sent["sent"], "copies_pps": delivered / sent["seconds"], "delivered": delivered / (3 * sent["sent"])}


def kernel_rows():
    work = tempfile.mkdtemp(prefix="rplb-replication-tc-bench-")
    topology = Topology()
    try:
        print(f"bench: replication in the kernel, udp-fanout tc_ebpf (own backend + an all pool of 2) vs nfacctd tee_transparent"
              f" in the proxy namespace, 3 copies of each NetFlow v9 datagram; CPU at {TC_RATE:,} pps for {TC_SECONDS} s,"
              f" copies/s at saturation ({PACKETS} datagrams); beside them udp-fanout userspace with output: preserve_source"
              f" in the same namespace (CPU only)", flush=True)
        variants = ("tc_ebpf", "nfacctd", "floor", "userspace", "C tee, udp") + (("before", "userspace, before") if BEFORE else ())
        fixed = {variant: [] for variant in variants}
        saturation = {variant: [] for variant in variants}
        for index in range(common.RUNS):
            order = variants if index % 2 == 0 else variants[::-1]
            for variant in order:
                fixed[variant].append(run_kernel(variant, topology, work, fixed=True))
            for variant in order:
                if variant not in ("floor", "C tee, udp") and not variant.startswith("userspace"):
                    saturation[variant].append(run_kernel(variant, topology, work, fixed=False))
        ours, peer = common.spread([r["cpu_us"] for r in fixed["tc_ebpf"]]), common.spread([r["cpu_us"] for r in fixed["nfacctd"]])
        ratios = common.spread([o["cpu_us"] / p["cpu_us"] for o, p in zip(fixed["tc_ebpf"], fixed["nfacctd"])])
        out = [(f"replication tc_ebpf: CPU per received datagram at {TC_RATE:,} pps", "nfacctd tee, tee_transparent",
                f"{ours[0]:.2f} us ({ours[1]:.2f}-{ours[2]:.2f})", f"{peer[0]:.2f} us ({peer[1]:.2f}-{peer[2]:.2f})",
                f"{ratios[0]:.3f} ({ratios[1]:.3f}-{ratios[2]:.3f}) goal <= 0.10",
                f"the tc program's run time (3 copies: 2 clones with their transmit, the third redirected after the program) / nfacctd's threads' time on CPU, per datagram sent; least delivered:"
                f" ours {min(r['delivered'] for r in fixed['tc_ebpf']):.3f}, nfacctd {min(r['delivered'] for r in fixed['nfacctd']):.3f}")]
        def beside(variant, label, what):
            """Ours against another variant of the same runs, with that variant against nfacctd."""
            other = common.spread([r["cpu_us"] for r in fixed[variant]])
            ratios = common.spread([o["cpu_us"] / b["cpu_us"] for o, b in zip(fixed["tc_ebpf"], fixed[variant])])
            against = common.spread([b["cpu_us"] / p["cpu_us"] for b, p in zip(fixed[variant], fixed["nfacctd"])])
            out.append((f"replication tc_ebpf: CPU per received datagram at {TC_RATE:,} pps", label,
                        f"{ours[0]:.2f} us ({ours[1]:.2f}-{ours[2]:.2f})", f"{other[0]:.2f} us ({other[1]:.2f}-{other[2]:.2f})",
                        f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})",
                        f"{what}, its run time; {variant} / nfacctd in the same runs {against[0]:.2f} ({against[1]:.2f}-{against[2]:.2f});"
                        f" least delivered: {variant} {min(r['delivered'] for r in fixed[variant]):.3f}"))

        beside("floor", "the floor: the same 3 copies alone",
               "bench/frames.bpf.c floor_copies (Ethernet addresses, 2 bpf_clone_redirect, 1 bpf_redirect; no lookup or rewrite)")
        if BEFORE:
            beside("before", "before", f"BENCH_REPLICATION_BEFORE={BEFORE}")
        # Userspace keeping the exporter's address where the exporters are not the host's (16 of
        # them, in the client namespace): its threads' time on CPU against nfacctd's.
        mine = common.spread([r["cpu_us"] for r in fixed["userspace"]])
        for variant, label in ([("nfacctd", "nfacctd tee, tee_transparent"), ("C tee, udp", "floor: C tee, udp")]
                               + ([("userspace, before", "before")] if BEFORE else [])):
            other = common.spread([r["cpu_us"] for r in fixed[variant]])
            ratios = common.spread([o["cpu_us"] / p["cpu_us"] for o, p in zip(fixed["userspace"], fixed[variant])])
            against = common.spread([o["cpu_us"] / p["cpu_us"] for o, p in zip(fixed[variant], fixed["nfacctd"])])
            what = {"nfacctd": "",
                    "C tee, udp": f" (bench/scale.c tee udp: a UDP socket per exporter address with IP_TRANSPARENT, GSO runs, no counters;"
                                  f" C tee, udp / nfacctd in the same runs {against[0]:.2f} ({against[1]:.2f}-{against[2]:.2f}))",
                    "userspace, before": f" (BENCH_REPLICATION_BEFORE={BEFORE})"}[variant]
            out.append((f"replication userspace, namespaces: CPU per received datagram at {TC_RATE:,} pps, keeping the exporter's address", label,
                        f"{mine[0]:.2f} us ({mine[1]:.2f}-{mine[2]:.2f})", f"{other[0]:.2f} us ({other[1]:.2f}-{other[2]:.2f})",
                        f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})" + (" goal <= 0.33" if variant == "nfacctd" else ""),
                        f"udp-fanout userspace (1 worker, output: preserve_source, own backend + an all pool of 2) in the proxy namespace,"
                        f" the exporters not its addresses: its threads' time on CPU / {variant}'s, per datagram sent{what}"
                        + f"; least delivered: ours {min(r['delivered'] for r in fixed['userspace']):.3f}, {variant} {min(r['delivered'] for r in fixed[variant]):.3f}"))
        ours, peer = common.spread([r["copies_pps"] for r in saturation["tc_ebpf"]]), common.spread([r["copies_pps"] for r in saturation["nfacctd"]])
        ratios = common.spread([o["copies_pps"] / p["copies_pps"] for o, p in zip(saturation["tc_ebpf"], saturation["nfacctd"])])
        out.append(("replication tc_ebpf: delivered copies/s at saturation", "nfacctd tee, tee_transparent",
                    f"{ours[0]:,.0f} ({ours[1]:,.0f}-{ours[2]:,.0f})", f"{peer[0]:,.0f} ({peer[1]:,.0f}-{peer[2]:,.0f})",
                    f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})",
                    f"copies on the backend links / s; least delivered / 3 x sent: ours {min(r['delivered'] for r in saturation['tc_ebpf']):.3f},"
                    f" nfacctd {min(r['delivered'] for r in saturation['nfacctd']):.3f}"))
        if BEFORE:
            before = common.spread([r["copies_pps"] for r in saturation["before"]])
            out.append(("replication tc_ebpf: delivered copies/s at saturation", "before",
                        f"{ours[0]:,.0f} ({ours[1]:,.0f}-{ours[2]:,.0f})", f"{before[0]:,.0f} ({before[1]:,.0f}-{before[2]:,.0f})",
                        f"{ours[0] / before[0]:.2f}",
                        f"least delivered / 3 x sent: before {min(r['delivered'] for r in saturation['before']):.3f}"))
        return out
    finally:
        topology.destroy()
        shutil.rmtree(work, ignore_errors=True)
