# SPDX-License-Identifier: Apache-2.0
"""Added latency for make bench (BENCH=latency): round trips measured by sockperf (Debian) through
each two-way kind, next to the direct path and nginx, in one run, in bench_twoway's topology:

    clients ── lb (VIP 198.18.0.1:5514) ── server 1..3      (this run's namespaces)

The servers run `sockperf server`; the client runs sockperf in the clients netns, with --full-rtt
(round trips, not halves). Two loads:
  ping-pong    one message at a time, each answered (the idle path's latency)
  under load   --mps 50,000 (BENCH_LATENCY_MPS), one message in 100 answered and measured
Variants, alternated run by run (BENCH_LATENCY_RUNS, 3), each BENCH_LATENCY_SECONDS (5) per load:
  routed       the client talks to server 1 through the lb netns, no load balancer: the direct path
  tc_ebpf nat, xdp nat, relay, relay with settings.busy_wait_us (BENCH_LATENCY_BUSY_WAIT_US, 100),
  relay with settings.io_uring: false (udp-fanout, as bench_twoway sets them up, the xdp
  variant's NAPI left in softirq), nginx-1 (nginx stream, one worker)
Each row: a variant's p50, p99 or p99.9 (the median over the runs, with their spread) against the
direct path's, and what it adds: the median (and range) of its per-run differences from the
direct path of the same run; the note gives nginx's addition at the same percentile.
"""
import os
import re
import subprocess
import tempfile
import shutil
import signal
import time

import bench_common as common
import bench_twoway as twoway

RUNS = int(os.environ.get("BENCH_LATENCY_RUNS", "3"))
SECONDS = int(os.environ.get("BENCH_LATENCY_SECONDS", "5"))
MPS = int(os.environ.get("BENCH_LATENCY_MPS", "50000"))
# settings.busy_wait_us of the "relay, busy wait" variant.
BUSY_WAIT_US = int(os.environ.get("BENCH_LATENCY_BUSY_WAIT_US", "100"))
VARIANTS = ["routed", "tc_ebpf nat", "xdp nat", "relay", "relay, busy wait", "relay, no io_uring", "nginx-1"]
# BENCH_LATENCY_ONLY: the variants to run beside the direct path, separated by ";" (their names
# hold commas), e.g. "relay;relay, busy wait".
if os.environ.get("BENCH_LATENCY_ONLY"):
    _only = [v.strip() for v in os.environ["BENCH_LATENCY_ONLY"].split(";") if v.strip()]
    _unknown = [v for v in _only if v not in VARIANTS]
    if _unknown:
        raise SystemExit(f"BENCH_LATENCY_ONLY: no variant {', '.join(map(repr, _unknown))}; the variants, separated by ';': {'; '.join(VARIANTS)}")
    VARIANTS = ["routed"] + [v for v in VARIANTS if v in _only and v != "routed"]
LOADS = ["ping-pong", "under load"]
PERCENTILES = [("p50", "50.000"), ("p99", "99.000"), ("p99.9", "99.900")]


class SockperfServers:
    """`sockperf server` on 198.18.n.2:6000 in each server netns, for the whole benchmark."""

    def __init__(self, topology, work):
        self.procs = []
        try:
            for n, server in enumerate(topology.servers, start=1):
                log = os.path.join(work, f"sockperf-{n}.log")
                proc = twoway.start_logged([*common.in_namespace(server), "sockperf", "server", "-i", f"198.18.{n}.2",
                                            "-p", str(twoway.SERVER_PORT)], log)
                self.procs.append(proc)
                twoway.wait_for_log(proc, log, "Warmup stage", f"sockperf server {n}")
        except BaseException:
            self.stop()
            raise

    def stop(self):
        for proc in self.procs:
            common.stop_process(proc)
        self.procs = []


def sockperf(topology, name, load, seconds):
    """One sockperf client run in the clients netns: {percentile: round trip in us}, and its line
    of sent and received messages."""
    ip, port = twoway.destination(name)
    mode = ["ping-pong"] if load == "ping-pong" else ["under-load", "--mps", str(MPS), "--reply-every", "100"]
    command = [*common.in_namespace(topology.clients), "sockperf", *mode, "-i", ip, "-p", str(port), "-t", str(seconds), "--full-rtt"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    if result.returncode != 0:
        raise SystemExit(f"sockperf failed ({result.returncode}): {' '.join(command)}\n{(result.stdout + result.stderr)[-2000:]}")
    values = {}
    for label, text in PERCENTILES:
        found = re.search(rf"percentile {re.escape(text)} =\s+([0-9.]+)", result.stdout)
        if not found:
            raise SystemExit(f"sockperf printed no percentile {text}: {result.stdout[-2000:]}")
        values[label] = float(found.group(1))
    summary = re.search(r"SentMessages=(\d+); ReceivedMessages=(\d+)", result.stdout)
    values["sent"], values["received"] = (int(summary.group(1)), int(summary.group(2))) if summary else (0, 0)
    return values


class Variant(twoway.Variant):
    """bench_twoway's variant, probed with sockperf (its servers answer only sockperf's messages).
    The xdp variant keeps its veths' NAPI in softirq, as any deployment runs it: bench_twoway
    threads it only to put the load balancer's CPU time on a CPU of its own, which a latency
    measurement must not pay for (a kernel thread's wake-up per poll)."""

    def __init__(self, name, topology, work):
        if name == "relay, busy wait":
            super().__init__("relay", topology, work, settings=f"busy_wait_us: {BUSY_WAIT_US}")
            self.name = name
        else:
            super().__init__(name, topology, work)

    def threaded_napi(self, on):
        pass

    def probe(self, seconds=20):
        deadline = time.monotonic() + seconds
        last = ""
        while time.monotonic() < deadline:
            try:
                got = sockperf(self.topology, self.name, "ping-pong", 1)
                if got["received"] > 0:
                    return
            except SystemExit as error:
                last = str(error)
            time.sleep(0.2)
        raise SystemExit(f"latency variant {self.name}: sockperf got no answer in {seconds} s: {last[-1000:]}"
                         + (f"\n{self.log} says:\n{self.log_tail()}" if self.log else ""))


def busy_wait_reading(topology):
    """The daemon's settings.busy_wait_us counters: (CPU seconds polled, polls that found
    something, polls whose window passed empty). The workers add theirs once a second: read
    1.2 s after the traffic before (or the load) ended, so each load's reading holds its own."""
    time.sleep(1.2)
    text = subprocess.run([*common.in_namespace(topology.lb), "curl", "-sf", f"http://{twoway.Variant.METRICS}/metrics"],
                          capture_output=True, text=True, check=True, timeout=30).stdout
    values = {}
    for line in text.splitlines():
        found = re.match(r'udp_fanout_busy_wait_(seconds_total|total)\{[^}]*?(?:outcome="(\w+)")?\} ([0-9.e+-]+)$', line)
        if found:
            values[found.group(2) or "seconds"] = float(found.group(3))
    return values.get("seconds", 0.0), values.get("found", 0.0), values.get("slept", 0.0)


def run_variant(topology, work, name):
    variant = Variant(name, topology, work)
    try:
        out = {}
        for load in LOADS:
            before = busy_wait_reading(topology) if name == "relay, busy wait" else None
            out[load] = sockperf(topology, name, load, SECONDS)
            if before:
                after = busy_wait_reading(topology)
                out[load]["busy_wait"] = tuple(a - b for a, b in zip(after, before))
        return out
    finally:
        variant.stop()


def rows():
    # A SIGTERM (a CI job cancelled) must still reach the cleanup below.
    previous = signal.signal(signal.SIGTERM, common.terminated)
    work = tempfile.mkdtemp(prefix="rplb-latency-bench-")
    topology = servers = None
    try:
        topology = twoway.Topology()
        servers = SockperfServers(topology, work)
        print(f"bench: latency, sockperf --full-rtt, {RUNS} runs per variant, alternated, {SECONDS} s per load; "
              f"ping-pong, and under load at {MPS:,} messages/s (one in 100 answered)", flush=True)
        results = common.alternated(RUNS, VARIANTS, lambda name: run_variant(topology, work, name))
        out = []
        for load in LOADS:
            for label, _ in PERCENTILES:
                direct = common.spread([r[load][label] for r in results["routed"]])

                def added(name):
                    # Run by run: the variants of one run ran back to back, so each run's
                    # difference cancels the machine's drift; their median and spread.
                    return common.spread([o[load][label] - d[load][label] for o, d in zip(results[name], results["routed"])])
                nginx = added("nginx-1") if "nginx-1" in results else None
                for name in VARIANTS[1:]:
                    ours = common.spread([r[load][label] for r in results[name]])
                    more = added(name)
                    sent = sum(r[load]["sent"] for r in results[name])
                    received = sum(r[load]["received"] for r in results[name])
                    note = f"sockperf {load}, round trip; median of per-run differences"
                    if more[1] <= 0 <= more[2]:
                        note += " (their range spans 0: not resolved from the noise)"
                    note += f"; sockperf sent {sent:,}, received {received:,}"
                    if name == "relay, busy wait":
                        polled = sum(r[load]["busy_wait"][0] for r in results[name]) / (SECONDS * len(results[name]))
                        found = sum(r[load]["busy_wait"][1] for r in results[name])
                        slept = sum(r[load]["busy_wait"][2] for r in results[name])
                        note += (f"; busy_wait_us {BUSY_WAIT_US}: the workers' CPU time polling was {polled:.0%} of the load's duration, "
                                 f"{found:,.0f} polls found traffic (a wake-up saved), {slept:,.0f} slept")
                    if nginx and name != "nginx-1":
                        note += f"; nginx-1 adds {nginx[0]:+.1f} us ({nginx[1]:+.1f} to {nginx[2]:+.1f})"
                    out.append((f"latency {load} {label}: {name}", "the direct path (routed, no load balancer)",
                                f"{ours[0]:.1f} us ({ours[1]:.1f}-{ours[2]:.1f})", f"{direct[0]:.1f} us ({direct[1]:.1f}-{direct[2]:.1f})",
                                f"{more[0]:+.1f} us ({more[1]:+.1f} to {more[2]:+.1f})", note))
        return out
    finally:
        if servers:
            servers.stop()
        if topology:
            topology.destroy()
        shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)
