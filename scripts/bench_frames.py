# SPDX-License-Identifier: Apache-2.0
"""XDP measured where it wins, for make bench (BENCH=frames): traffic that arrives at the load
balancer as XDP frames, as from a NIC's receive ring, not as socket buffers (on veth, traffic
sent from a socket arrives as socket buffers, and XDP must convert them: docs/benchmarks.md).

    client ── proxy (198.18.0.1:5514) ── backend 1..3      (198.18.0.0/15 only, this run's namespaces)

The generator (scripts/frames_gen.py, pinned to CPU 0) runs bench/frames.bpf.c's frames_gen with
BPF_PROG_TEST_RUN and BPF_F_TEST_XDP_LIVE_FRAMES on the client's veth, as xdp-trafficgen does:
64-byte IPv4 UDP frames, each with a source port of its own, transmitted by XDP_TX into the
proxy's veth. The backends count and drop them in XDP (frames_sink). Every veth's NAPI runs in a
kernel thread of its own, the proxy's on CPU 1 and the backends' on CPU 0 (at real-time priority,
ahead of the generator): CPU 1 does exactly the load balancer's work (receive, decide, rewrite,
transmit), and nothing else runs there.
Variants, alternated run by run, each alone:

  xdp         udp-fanout mode xdp, round robin over the 3 backends (XDP_REDIRECT to their veths)
  tc_ebpf     udp-fanout mode tc_ebpf, the same at tc ingress: the proxy's veth has GRO on (a veth
              takes XDP frames only with an XDP program or GRO) and makes a socket buffer of each
              frame, as a NIC driver does without XDP
  xdp floor   frames_floor's floor_xdp: Ethernet addresses set for backend 1, XDP_REDIRECT to it,
              nothing else (the least any XDP forwarder does)
  tc floor    floor_tc: the same at tc ingress (bpf_redirect), GRO on as for tc_ebpf
  xdp floor, 3 backends / tc floor, 3 backends
              floor_xdp3 / floor_tc3: the same floors spread over the 3 backends in turn, as the
              load balancer spreads them (on veth, waking each backend veth's receive is a cost of
              its own: the like-for-like floor)

Loads, BENCH_FRAMES_SECONDS (3) each after a second of warm-up: saturation (the
generator as fast as CPU 0 runs it, about 3.5 M frames/s alone; with the backends' sinks also on
CPU 0, ahead of it, a variant that forwards about 2 M/s or more is bound by CPU 0, which the note
shows as the load balancer's busy share well under 1) and fixed rates (BENCH_FRAMES_RATE, 300,000 and 1,000,000 frames/s, paced
in the generator's program: under the xdp kind's and the floors' saturation). The figure is CPU 1's busy time
(wall minus measured idle, minus its background over a quiet second) per datagram the backends
received: the load balancer's own CPU per delivered datagram.
"""
import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
import time

import bench_common as common
import bench_twoway as twoway

RUNS = int(os.environ.get("BENCH_FRAMES_RUNS", "5"))
SECONDS = float(os.environ.get("BENCH_FRAMES_SECONDS", "3"))
# The fixed rates, frames/s: a light load and one near the xdp kind's saturation, where the
# poller runs with full batches but no ring overflows (at saturation the proxy veth's ring is
# full and its producer and consumer contend for it, which a NIC's ring filled by DMA does not).
RATES = [int(r) for r in os.environ.get("BENCH_FRAMES_RATE", "300000,1000000").split(",") if r.strip()]
VARIANTS = ["xdp", "tc_ebpf", "xdp floor", "tc floor", "xdp floor, 3 backends", "tc floor, 3 backends"]
# Each variant's program at the proxy's veth (its run time per run is printed beside the rows).
PROGRAMS = {"xdp": "fanout_xfwd", "tc_ebpf": "fanout_tc", "xdp floor": "floor_xdp", "tc floor": "floor_tc",
            "xdp floor, 3 backends": "floor_xdp3", "tc floor, 3 backends": "floor_tc3"}
# The floors: their program, whether at XDP (else tc ingress).
FLOORS = {"xdp floor": ("floor_xdp", True), "tc floor": ("floor_tc", False),
          "xdp floor, 3 backends": ("floor_xdp3", True), "tc floor, 3 backends": ("floor_tc3", False)}
LOADS = ["saturation", *[f"fixed {rate}" for rate in RATES]]
# BENCH_FRAMES_BEFORE=<udp-fanout binary>: another build's xdp and tc_ebpf ("xdp, before",
# "tc_ebpf, before") alternated with the others in the same runs (a change's rows).
BEFORE = os.environ.get("BENCH_FRAMES_BEFORE")
if BEFORE:
    VARIANTS += ["xdp, before", "tc_ebpf, before"]
    PROGRAMS.update({"xdp, before": "fanout_xfwd", "tc_ebpf, before": "fanout_tc"})
# BENCH_FRAMES_ONLY: names of VARIANTS separated by ";", to run some of them.
if os.environ.get("BENCH_FRAMES_ONLY"):
    VARIANTS = [v for v in VARIANTS if v in os.environ["BENCH_FRAMES_ONLY"].split(";")]
TWOWAY_VARIANTS = ["xdp nat", "tc_ebpf nat", "nft conntrack"]
TWOWAY = os.environ.get("BENCH_FRAMES_TWOWAY", "1") != "0"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "frames.bpf.c")
GENERATOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "frames_gen.py")


def mac(topology, namespace, interface):
    return json.loads(topology.ns(namespace, "ip", "-j", "link", "show", "dev", interface))[0]["address"]


def ifindex(topology, namespace, interface):
    return json.loads(topology.ns(namespace, "ip", "-j", "link", "show", "dev", interface))[0]["ifindex"]


def napi_threads(topology, namespace, interface, cpu, fifo=False):
    """The veth's NAPI in a kernel thread of its own, pinned to `cpu` (None: back to softirq);
    `fifo`: at real-time priority, ahead of the generator on the same CPU (which then runs only
    while the sinks have nothing to do, and so paces its frames evenly)."""
    common.sh("ip", "netns", "exec", namespace, "sh", "-c",
              f"echo {0 if cpu is None else 1} > /sys/class/net/{interface}/threaded", check=cpu is not None)
    if cpu is None:
        return
    for line in common.sh("ps", "-eo", "pid=,comm=").splitlines():
        pid, _, comm = line.strip().partition(" ")
        if comm.strip().startswith(f"napi/{interface}"[:15]):
            common.sh("taskset", "-p", "-c", str(cpu), pid)
            if fifo:
                common.sh("chrt", "-f", "-p", "50", pid)


class Bench:
    """The topology, the programs pinned under this run's own bpffs directory, the sinks."""

    def __init__(self, work):
        self.work = work
        self.pins = f"/sys/fs/bpf/rplb-frames-{os.getpid()}"
        self.topology = None
        obj = os.path.join(work, "frames.o")
        subprocess.run(["clang", "-O2", "-g", "-target", "bpf", f"-I/usr/include/{os.uname().machine}-linux-gnu",
                        "-c", SOURCE, "-o", obj], check=True)
        try:
            common.sh("bpftool", "prog", "loadall", obj, self.pins, "pinmaps", self.pins + "/maps")
            self.topology = topology = common.Topology()
            tag = topology.proxy_if[2:]
            self.client_if = f"cp{tag}"
            for n, (backend, inner) in enumerate(zip(topology.backends, topology.backend_ifs), start=1):
                topology.ns(backend, "ip", "link", "set", "dev", inner, "xdpdrv", "pinned", f"{self.pins}/frames_sink")
                napi_threads(topology, backend, inner, 0, fifo=True)
            # floor_out: entry 0 backend 1 (the single-target floors), entries 1 to 3 backends 1 to 3.
            for key, n in ((0, 1), (1, 1), (2, 2), (3, 3)):
                outer = f"pb{n}{tag[:7]}"
                target = ifindex(topology, topology.proxy, outer).to_bytes(4, "little")
                target += bytes.fromhex(mac(topology, topology.backends[n - 1], topology.backend_ifs[n - 1]).replace(":", ""))
                target += bytes.fromhex(mac(topology, topology.proxy, outer).replace(":", ""))
                common.sh("bpftool", "map", "update", "pinned", f"{self.pins}/maps/floor_out", "key", *key.to_bytes(4, "little").hex(" ").split(),
                          "value", *[str(b) for b in target])
            self.frame = [mac(topology, topology.proxy, topology.proxy_if), mac(topology, topology.client, self.client_if),
                          "198.18.0.10", "198.18.0.1", "5514"]
        except BaseException:
            self.destroy()
            raise

    def destroy(self):
        if self.topology:
            self.topology.destroy()
            self.topology = None
        shutil.rmtree(self.pins, ignore_errors=True)

    def counted(self, name):
        entries = json.loads(common.sh("bpftool", "-j", "map", "dump", "pinned", f"{self.pins}/maps/{name}"))
        return sum(value["value"] for entry in entries for value in entry["formatted"]["values"])

    def delivered(self):
        """Datagrams the backends' sinks received."""
        return self.counted("sink_count")

    def transmitted(self):
        """Frames the generator transmitted (a paced-out frame is not counted)."""
        return self.counted("frames_count")

    def generator(self, rate):
        command = [*common.in_namespace(self.topology.client), "taskset", "-c", "0", "python3", GENERATOR,
                   f"{self.pins}/frames_gen", f"{self.pins}/maps/frames_template", self.client_if, *self.frame, str(int(60 * 8e6)), str(SECONDS + 10)]
        if rate:
            command.append(str(rate))
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, name):
        """One run of variant `name`: each load's delivered rate and CPU 1 per delivered datagram."""
        variant = Variant(self, name)
        try:
            results = {}
            for load in LOADS:
                quiet = common.background()
                generator = self.generator(0 if load == "saturation" else int(load.split()[1]))
                try:
                    time.sleep(1)
                    if generator.poll() is not None:
                        raise SystemExit(f"frames generator exited: {generator.stderr.read()[-2000:]}")
                    start, sent = self.delivered(), self.transmitted()
                    delivered, elapsed, busy = common.busy_during(lambda: time.sleep(SECONDS) or self.delivered() - start)
                    sent = self.transmitted() - sent
                finally:
                    common.stop_with_output(generator)
                lb = busy[1] - quiet[1] * elapsed
                if lb <= 0.01 * elapsed:
                    # CPU 1's background second was as busy as the run: something else ran there
                    # (another process on the machine); this run's CPU is not measured.
                    print(f"bench: frames {name} {load}: CPU 1 busy {busy[1]:.2f} s of {elapsed:.2f}, background {quiet[1]:.2f}/s:"
                          " not measured (CPU 1 was not the load balancer's alone)", flush=True)
                    lb = float("nan")
                # Delivered over what the generator transmitted meanwhile (the counters are read a
                # moment apart: a ratio a little off 1 is that, not loss).
                results[load] = {"pps": delivered / elapsed, "lb_ns": lb * 1e9 / max(delivered, 1), "lb_busy": lb / elapsed,
                                 "delivered_share": delivered / max(sent, 1)}
            results["program_ns"] = self.program_cost(PROGRAMS[name], variant)
            return results
        finally:
            variant.stop()

    def program_ids(self, program, variant):
        """The ids of this variant's program `program`: the pinned floor, or those named so that
        were loaded since the variant's own udp-fanout started (not another of the same name
        loaded earlier elsewhere on the machine)."""
        if not variant.proc:
            return [json.loads(common.sh("bpftool", "-j", "prog", "show", "pinned", f"{self.pins}/{program}"))["id"]]
        # Those loaded since the variant's daemon started (this bpftool lists no owning pids).
        ids = [p["id"] for p in json.loads(common.sh("bpftool", "-j", "prog", "show"))
               if p.get("name") == program and p.get("loaded_at", 0) >= variant.started - 1]
        if not ids:
            raise SystemExit(f"frames: no program {program} loaded since udp-fanout ({variant.name}, pid {variant.proc.pid}) started")
        return ids

    def program_cost(self, program, variant):
        """The load balancer's program's run time per run (kernel.bpf_stats_enabled) over a
        second at saturation, apart from the measured loads (the statistics cost time)."""
        ids = self.program_ids(program, variant)

        def totals():
            shown = [json.loads(common.sh("bpftool", "-j", "prog", "show", "id", str(identifier))) for identifier in ids]
            return sum(p.get("run_time_ns", 0) for p in shown), sum(p.get("run_cnt", 0) for p in shown)
        with common.BPFStats():
            before = totals()
            generator = self.generator(0)
            try:
                time.sleep(1)
            finally:
                common.stop_with_output(generator)
            after = totals()
        runs = after[1] - before[1]
        return (after[0] - before[0]) / runs if runs else float("nan")


class Variant:
    def __init__(self, bench, name):
        self.bench, self.name, self.proc, self.gro, self.qdisc, self.xdp = bench, name, None, False, False, False
        topology = bench.topology
        try:
            if name.split(",")[0] == "tc_ebpf" or (name in FLOORS and not FLOORS[name][1]):
                self.gro = True
                topology.ns(topology.proxy, "ethtool", "-K", topology.proxy_if, "gro", "on")
            if name.split(",")[0] in ("xdp", "tc_ebpf"):
                mode = name.split(",")[0]
                binary = BEFORE if name.endswith(", before") else f"{common.BIN}/udp-fanout"
                downstreams = "\n".join(f'      - {{name: b{n}, address: "198.18.{n}.2:6000"}}' for n in range(1, common.BACKENDS + 1))
                path = os.path.join(bench.work, "frames.yaml")
                with open(path, "w") as f:
                    f.write(f'listeners:\n  - name: bench\n    bind: "198.18.0.1:5514"\n    interface: {topology.proxy_if}\n'
                            f"    mode: {mode}\n    downstream:\n{downstreams}\n"
                            f'metrics: {{enabled: true, bind: "127.0.0.1:9464"}}\n')
                log = os.path.join(bench.work, "udp-fanout.log")
                self.started = time.time()
                # The daemon's threads on CPU 0: CPU 1 holds the data path alone.
                self.proc = twoway.start_logged([*common.in_namespace(topology.proxy), "taskset", "-c", "0",
                                                 binary, "-c", path], log)
                twoway.wait_for_log(self.proc, log, "registered listener in eBPF map", f"udp-fanout ({name})")
            elif name in FLOORS and FLOORS[name][1]:
                topology.ns(topology.proxy, "ip", "link", "set", "dev", topology.proxy_if, "xdpdrv", "pinned", f"{bench.pins}/{FLOORS[name][0]}")
                self.xdp = True
            elif name in FLOORS:
                topology.ns(topology.proxy, "tc", "qdisc", "add", "dev", topology.proxy_if, "clsact")
                self.qdisc = True
                topology.ns(topology.proxy, "tc", "filter", "add", "dev", topology.proxy_if, "ingress", "bpf",
                            "object-pinned", f"{bench.pins}/{FLOORS[name][0]}", "direct-action")
            else:
                raise SystemExit(f"unknown frames variant {name!r}")
            napi_threads(topology, topology.proxy, topology.proxy_if, 1)
        except BaseException:
            self.stop()
            raise

    def stop(self):
        topology = self.bench.topology
        # Back to softirq NAPI while the proxy's veth still has NAPI (an XDP program or GRO).
        napi_threads(topology, topology.proxy, topology.proxy_if, None)
        if self.proc:
            common.stop_process(self.proc)
            self.proc = None
        if self.xdp:
            topology.ns(topology.proxy, "ip", "link", "set", "dev", topology.proxy_if, "xdpdrv", "off", check=False)
            self.xdp = False
        if self.qdisc:
            topology.ns(topology.proxy, "tc", "qdisc", "del", "dev", topology.proxy_if, "clsact", check=False)
            self.qdisc = False
        if self.gro:
            topology.ns(topology.proxy, "ethtool", "-K", topology.proxy_if, "gro", "off", check=False)
            self.gro = False


def xdp_reflectors(topology, obj):
    """bench/reflect.bpf.c's reflect_xdp on every endpoint veth (the clients' and each
    server's), or with obj None off: each datagram goes back as an XDP frame (a redirect to the
    veth it arrived at)."""
    for namespace, interface in topology.endpoint_side:
        if obj:
            topology.ns(namespace, "ip", "link", "set", "dev", interface, "xdpdrv", "obj", obj, "sec", "xdp")
        else:
            topology.ns(namespace, "ip", "link", "set", "dev", interface, "xdpdrv", "off", check=False)


def lb_gro(topology, on):
    """GRO on the lb netns' veths: a veth takes the endpoints' XDP frames only with an XDP program
    or GRO (the tc and nftables variants have no XDP program there)."""
    for namespace, interface in topology.lb_side:
        topology.ns(namespace, "ethtool", "-K", interface, "gro", "on" if on else "off", check=on)


def twoway_run(topology, work, reflector, name):
    """bench_twoway's load-generator run with the reflectors at XDP: the load balancer receives
    XDP frames from the clients and from the servers. Every veth's NAPI threaded, the lb's on
    CPU 1 and the endpoints' on CPU 0, the LB's process (if any) on CPU 1."""
    topology.split(True)
    lb_gro(topology, True)
    variant = None
    try:
        variant = twoway.Variant(name, topology, work, split=True)

        def attach(topology, obj):
            if not obj:
                variant.threaded_napi(False)
            # The endpoints compute their checksums at send (tx off), as in every variant: a
            # checksum left partial would lap partial for ever, and XDP passes those to tc.
            variant.xdp_endpoints(bool(obj))
            xdp_reflectors(topology, obj)
            if obj:
                variant.threaded_napi(True)

        return twoway.reflected_run(topology, name, reflector, attach)
    finally:
        if variant:
            variant.stop()
        lb_gro(topology, False)
        topology.split(False)


def finite(values):
    """common.spread of the values that were measured (a run whose CPU 1 was not the load
    balancer's alone is NaN), or NaNs if none was."""
    values = [v for v in values if math.isfinite(v)]
    return common.spread(values) if values else (float("nan"),) * 3


def ratio(peer, ours):
    return peer / ours if ours > 0 and math.isfinite(ours) and math.isfinite(peer) else float("nan")


def verdict(value, goal):
    """" goal >= 2: met" (or NOT met) for a ratio against a goal such as ">= 2"; "" without one."""
    if not goal:
        return ""
    return f" goal {goal}: " + ("met" if math.isfinite(value) and value >= float(goal.split()[-1]) else "NOT met")


def twoway_rows():
    """The two-way comparison with frames: xdp nat against nft conntrack and tc_ebpf nat."""
    work = tempfile.mkdtemp(prefix="rplb-frames-twoway-")
    topology = servers = None
    try:
        topology = twoway.Topology()
        servers = twoway.EchoServers(topology, work)
        servers.pin("0")
        reflector = twoway.build_reflector(work)
        print(f"bench: two-way with frames: {twoway.IN_FLIGHT} datagrams lapping clients -> LB -> server -> LB -> clients through"
              f" XDP reflectors at the clients and servers (CPU 0), the LB alone on CPU 1; {RUNS} alternated runs of"
              f" {twoway.SECONDS:g} s", flush=True)
        results = common.alternated(RUNS, TWOWAY_VARIANTS, lambda name: twoway_run(topology, work, reflector, name))
    finally:
        if servers:
            servers.stop()
        if topology:
            topology.destroy()
        shutil.rmtree(work, ignore_errors=True)
    if os.environ.get("BENCH_FRAMES_JSON"):
        with open(os.environ["BENCH_FRAMES_JSON"] + ".twoway", "w") as f:
            json.dump(results, f, indent=1)
    return twoway_table(results)


def twoway_table(results):
    out = []
    for ours, peer, goal in (("xdp nat", "nft conntrack", ">= 2"), ("xdp nat", "tc_ebpf nat", ""), ("tc_ebpf nat", "nft conntrack", "")):
        mine = common.spread([r["lb_ns_per_round_trip"] for r in results[ours]])
        theirs = common.spread([r["lb_ns_per_round_trip"] for r in results[peer]])
        ratios = finite([ratio(p["lb_ns_per_round_trip"], o["lb_ns_per_round_trip"]) for o, p in zip(results[ours], results[peer])])
        rates = {n: common.spread([r["round_trips_per_sec"] for r in results[n]])[0] for n in (ours, peer)}
        busy = {n: common.spread([r["lb_busy"] for r in results[n]])[0] for n in (ours, peer)}
        ends = {n: common.spread([r["end_rate_ratio"] for r in results[n]])[0] for n in (ours, peer)}
        # As bench_twoway's reflector rows: a run is LB-bound when CPU 1 was at least 90 % busy
        # and CPU 0 (the reflectors) under 95 %; a last-0.4-s rate well under 1 means laps lost.
        bound = {n: sum(r["lb_busy"] >= 0.9 and r["endpoints_busy"] < 0.95 for r in results[n]) for n in (ours, peer)}
        out.append((f"frames: two-way {ours}, LB CPU per round trip (XDP reflectors)", peer,
                    f"{mine[0]:,.0f} ns ({mine[1]:,.0f}-{mine[2]:,.0f})", f"{theirs[0]:,.0f} ns ({theirs[1]:,.0f}-{theirs[2]:,.0f})",
                    f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})" + verdict(ratios[0], goal),
                    f"round trips per LB CPU, ours/peer; ours {rates[ours]:,.0f} rt/s, LB CPU {busy[ours]:.2f}, LB-bound"
                    f" {bound[ours]}/{len(results[ours])} runs; peer {rates[peer]:,.0f} rt/s, LB CPU {busy[peer]:.2f}, LB-bound"
                    f" {bound[peer]}/{len(results[peer])} runs; last-0.4-s rate {ends[ours]:.2f}x/{ends[peer]:.2f}x the run's"))
    return out


def rows():
    work = tempfile.mkdtemp(prefix="rplb-frames-bench-")
    bench = None
    previous = signal.signal(signal.SIGTERM, common.terminated)
    affinity = os.sched_getaffinity(0)
    # ip and tc with pinned programs or object files make iproute2's pin directories
    # (/sys/fs/bpf/tc, ip, xdp): removed after the run if this run made them.
    made_pin_dirs = not os.path.exists("/sys/fs/bpf/tc")
    try:
        # This script (and what it forks: counter reads) on CPU 0: CPU 1 holds the load balancer alone.
        os.sched_setaffinity(0, {0})
        bench = Bench(work)
        print(f"bench: frame-sourced traffic (BPF_PROG_TEST_RUN live frames, XDP_TX into the proxy's veth), 64-byte datagrams;"
              f" {RUNS} alternated runs, {SECONDS:g} s per load: saturation and {', '.join(f'{rate:,}' for rate in RATES)} frames/s; CPU 1 = the load balancer alone",
              flush=True)
        results = common.alternated(RUNS, VARIANTS, bench.run)
        if os.environ.get("BENCH_FRAMES_JSON"):
            with open(os.environ["BENCH_FRAMES_JSON"], "w") as f:
                json.dump(results, f, indent=1)
        bench.destroy()
        bench = None
        out = table(results)
        if TWOWAY:
            out += twoway_rows()
        return out
    finally:
        if bench:
            bench.destroy()
        if made_pin_dirs:
            twoway.remove_iproute2_pin_dirs()
        os.sched_setaffinity(0, affinity)
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(work, ignore_errors=True)


def table(results):
    out = []

    def cost(name, load):
        return finite([r[load]["lb_ns"] for r in results[name]])

    def rate(name, load):
        return common.spread([r[load]["pps"] for r in results[name]])

    def busy(name, load):
        return common.spread([r[load]["lb_busy"] for r in results[name]])[0]

    def share(name, load):
        return common.spread([r[load]["delivered_share"] for r in results[name]])[0]

    for load, label in (("saturation", "at saturation"), *((f"fixed {rate}", f"at {rate // 1000:,}k frames/s") for rate in RATES)):
        for ours, peer, goal in (("xdp", "tc_ebpf", ">= 2"), ("xdp", "xdp floor", ">= 0.8"), ("xdp", "xdp floor, 3 backends", ">= 0.8"),
                                 ("tc_ebpf", "tc floor", None), ("tc_ebpf", "tc floor, 3 backends", None),
                                 ("xdp", "xdp, before", None), ("tc_ebpf", "tc_ebpf, before", None),
                                 ("xdp, before", "xdp floor", None), ("xdp, before", "xdp floor, 3 backends", None)):
            if ours not in results or peer not in results:
                continue
            mine, theirs = cost(ours, load), cost(peer, load)
            # Delivered datagrams per LB CPU, ours over the peer's: the peer's cost over ours, run by run.
            ratios = finite([ratio(p[load]["lb_ns"], o[load]["lb_ns"]) for o, p in zip(results[ours], results[peer])])
            mine_rate, peer_rate = rate(ours, load), rate(peer, load)
            mine_busy, peer_busy = busy(ours, load), busy(peer, load)
            out.append((f"frames: {ours}, LB CPU per delivered datagram {label}", peer + " (ratio: delivered per LB CPU, ours/peer)",
                        f"{mine[0]:,.0f} ns ({mine[1]:,.0f}-{mine[2]:,.0f})", f"{theirs[0]:,.0f} ns ({theirs[1]:,.0f}-{theirs[2]:,.0f})",
                        f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})" + verdict(ratios[0], goal),
                        f"delivered ours {mine_rate[0]:,.0f} pps, peer {peer_rate[0]:,.0f} pps;"
                        f" LB CPU busy ours {mine_busy:.2f}, peer {peer_busy:.2f}; delivered/transmitted ours"
                        f" {share(ours, load):.3f}, peer {share(peer, load):.3f}"))
    costs = {name: finite([r["program_ns"] for r in results[name]]) for name in VARIANTS}
    for ours, peer in (("xdp", "xdp floor"), ("xdp", "xdp floor, 3 backends"), ("tc_ebpf", "tc floor"), ("tc_ebpf", "tc floor, 3 backends"),
                       ("xdp", "xdp, before"), ("tc_ebpf", "tc_ebpf, before")):
        if ours not in costs or peer not in costs:
            continue
        out.append((f"frames: program run time, {ours} ({PROGRAMS[ours]})", f"{peer} ({PROGRAMS[peer]})",
                    f"{costs[ours][0]:,.1f} ns/run ({costs[ours][1]:,.1f}-{costs[ours][2]:,.1f})",
                    f"{costs[peer][0]:,.1f} ns/run ({costs[peer][1]:,.1f}-{costs[peer][2]:,.1f})",
                    f"{costs[ours][0] / costs[peer][0]:.2f}",
                    "ratio: ours/floor run time per run (above 1: ours costs more); kernel.bpf_stats_enabled"
                    " run_time_ns/run_cnt of the variant's own program over 1 s at saturation, apart from the"
                    " measured loads; ours includes the route lookup"))
    return out
