# SPDX-License-Identifier: Apache-2.0
"""udp-fanout benchmarks for make bench: delivered pps vs nginx's stream proxy, added latency,
and daemon RSS. Run by bench.py; shares bench_common's helpers."""
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time

import bench_common as common
from bench_common import Nginx

DATAGRAMS = int(os.environ.get("BENCH_FANOUT_DATAGRAMS", "600000"))


def sinks(count):
    """`count` collectors, each a group of one on its own port: the downstreams."""
    ports = [common.free_port() for _ in range(count)]
    groups = [common.Collectors(port, "automatic", count=1) for port in ports]
    return ports, groups


def stop_sinks(groups):
    return [group.stop()[0] for group in groups]


# settings.busy_wait_us of the latency rows' third variant ("udp-fanout, busy wait").
BUSY_WAIT_US = int(os.environ.get("BENCH_FANOUT_BUSY_WAIT_US", "100"))
# BENCH_FANOUT_ONLY=latency: the latency rows alone (no throughput against nginx, no RSS).
ONLY = os.environ.get("BENCH_FANOUT_ONLY", "")


class Fanout:
    def __init__(self, listeners, work, workers=2, settings=()):
        """listeners: [(name, port, [downstream ports])]; settings: more settings lines ("busy_wait_us: 100")."""
        lines = ["listeners:"]
        for name, port, downstreams in listeners:
            lines += [f"  - name: {name}", f'    bind: "127.0.0.1:{port}"', "    settings:",
                      f"      workers: {workers}", "      batch_size: 64", "      recv_buf_size: 16777216",
                      *(f"      {line}" for line in settings), "    downstream:"]
            lines += [f'      - address: "127.0.0.1:{p}"' for p in downstreams]
        path = os.path.join(work, "fanout.yaml")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        self.proc = subprocess.Popen([f"{common.BIN}/udp-fanout", "-c", path], stderr=subprocess.PIPE, text=True)
        ready = 0
        while ready < workers * len(listeners):
            line = self.proc.stderr.readline()
            if not line:
                raise SystemExit("udp-fanout exited")
            ready += "entering receive loop" in line

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=10)


SENDERS = {"sendmmsg": (), "gso": ("--gso",)}


def throughput_run(variant, work, sender="sendmmsg"):
    ports, groups = sinks(3)
    listen = common.free_port()
    proxy = Fanout([("bench", listen, ports)], work) if variant == "udp-fanout" else Nginx(listen, ports, int(variant[-1]), work)
    try:
        sent = common.publish(listen, count=DATAGRAMS, extra=SENDERS[sender])
        time.sleep(0.5)
    finally:
        proxy.stop()
    received = sum(r["received"] for r in stop_sinks(groups))
    return {"pps": received / sent["seconds"], "delivered": received / sent["sent"]}


# The latency rows' variants: each forwards to one collector, alternated run by run with the
# direct path. The C forwarders are the floors: what one userspace hop adds on this machine with
# the least work, waiting in the kernel (beside "udp-fanout") or polling without sleeping, as
# busy_wait_us does at this rate (beside "udp-fanout, busy wait").
LATENCY_VARIANTS = ["direct", "udp-fanout", "udp-fanout, busy wait", "C forwarder, blocking", "C forwarder, polling"]


def latency_run(via, work, tool, rate=50000, count=150000):
    """via: one of LATENCY_VARIANTS ("direct": to the collector). `tool`: bench/scale.c built."""
    ports, groups = sinks(1)
    target = ports[0]
    proxy = None
    try:
        if via != "direct":
            target = common.free_port()
            if via.startswith("C forwarder"):
                # bench/scale.c forward: the least a userspace forwarder does (recvmmsg, one sendmmsg a batch)
                proxy = common.CForwarder(tool, target, [("127.0.0.1", ports[0])], "round_robin", work,
                                          wait="block" if via.endswith("blocking") else "poll")
            else:
                settings = (f"busy_wait_us: {BUSY_WAIT_US}",) if via.endswith("busy wait") else ()
                proxy = Fanout([("latency", target, ports)], work, workers=1, settings=settings)
        common.publish(target, count=count, extra=("--rate", str(rate), "--size", "64", "--batch", "1"))
        time.sleep(0.3)
    finally:
        if proxy:
            proxy.stop()
    report = stop_sinks(groups)[0]
    return report["latency_us"]["p50"], report["latency_us"]["p99"], report["received"] / count


def rss_kib(pid):
    return common.rss_kib(pid)


def rss_three_listeners(work):
    ports, groups = sinks(3)
    listens = [common.free_port() for _ in range(3)]
    proxy = Fanout([(f"l{i}", listens[i], ports) for i in range(3)], work)
    try:
        time.sleep(0.3)
        rest = rss_kib(proxy.proc.pid)
        peak = [rest]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss_kib(proxy.proc.pid))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        common.publish(listens[0], count=300000, extra=("--size", "1400"))
        done.set()
        sampler.join()
    finally:
        proxy.stop()
        stop_sinks(groups)
    return rest, peak[0]


def rows():
    if not shutil.which("nginx"):
        raise SystemExit("nginx is not installed: run make bench (it installs nginx and libnginx-mod-stream as root)")
    work = tempfile.mkdtemp(prefix="rplb-fanout-bench-")
    try:
        print(f"bench: udp-fanout (userspace, 2 workers) vs nginx stream UDP proxy (proxy_responses 0, round robin),"
              f" {DATAGRAMS} datagrams of 64 bytes from 240 sources, 3 collectors as downstreams", flush=True)
        out = []
        orders = (["udp-fanout", "nginx-1", "nginx-2"], ["nginx-2", "nginx-1", "udp-fanout"])
        for sender in SENDERS if ONLY != "latency" else ():
            results = {"udp-fanout": [], "nginx-1": [], "nginx-2": []}
            for run in range(common.RUNS):
                for variant in orders[run % 2]:
                    results[variant].append(throughput_run(variant, work, sender))
            ours = common.spread([r["pps"] for r in results["udp-fanout"]])
            best_nginx = [max(a["pps"], b["pps"]) for a, b in zip(results["nginx-1"], results["nginx-2"])]
            ratios = common.spread([o["pps"] / n for o, n in zip(results["udp-fanout"], best_nginx)])
            delivered = statistics.median(r["delivered"] for r in results["udp-fanout"])
            for workers in (1, 2):
                peer = common.spread([r["pps"] for r in results[f"nginx-{workers}"]])
                peer_delivered = statistics.median(r["delivered"] for r in results[f"nginx-{workers}"])
                out.append((f"fanout: delivered pps, sender {sender}", f"nginx stream, {workers} worker(s)",
                            f"{ours[0]:,.0f} pps ({ours[1]:,.0f}-{ours[2]:,.0f})",
                            f"{peer[0]:,.0f} pps ({peer[1]:,.0f}-{peer[2]:,.0f})",
                            f"{ours[0] / peer[0]:.2f}", f"nginx delivered/sent {peer_delivered:.3f}"))
            out.append((f"fanout: vs better nginx, sender {sender}", "max(nginx 1, nginx 2) per run", f"{ours[0]:,.0f} pps", "-",
                        f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f}) goal >= 3", f"udp-fanout delivered/sent {delivered:.3f}"))
        tool = common.build_scale_tool(work)
        variants = LATENCY_VARIANTS
        latency = common.alternated(common.RUNS, variants, lambda via: latency_run(via, work, tool))

        def added(via, index):
            return common.spread([o[index] - d[index] for o, d in zip(latency[via], latency["direct"])])

        floors = {"udp-fanout": "C forwarder, blocking", "udp-fanout, busy wait": "C forwarder, polling"}
        for index, name in ((0, "p50"), (1, "p99")):
            peer = common.spread([r[index] for r in latency["direct"]])
            for via in variants[1:]:
                mine = common.spread([r[index] for r in latency[via]])
                more = added(via, index)
                note = "one way, publisher send to collector receive; added: median of per-run differences"
                if via.endswith("busy wait"):
                    note += f"; settings.busy_wait_us {BUSY_WAIT_US}: at 50k pps the worker polls without sleeping"
                if via in floors:
                    floor = added(floors[via], index)
                    note += f"; the floor ({floors[via]}) adds {floor[0]:+.0f} us ({floor[1]:+.0f} to {floor[2]:+.0f})"
                if via == "C forwarder, blocking":
                    note += "; bench/scale.c forward: recvmmsg waiting in the kernel, one sendmmsg per batch: the least a forwarder that sleeps does"
                if via == "C forwarder, polling":
                    note += "; bench/scale.c forward: recvmmsg without waiting, sched_yield between empty polls, never sleeping"
                label = {"udp-fanout": "", "udp-fanout, busy wait": f", busy_wait_us {BUSY_WAIT_US}"}.get(via, f", {via}")
                out.append((f"fanout: latency {name} at 50k pps{label}", "sending directly to the collector",
                            f"{mine[0]:.0f} us ({mine[1]:.0f}-{mine[2]:.0f})", f"{peer[0]:.0f} us ({peer[1]:.0f}-{peer[2]:.0f})",
                            f"{more[0]:+.0f} us ({more[1]:+.0f} to {more[2]:+.0f})", note))
        if ONLY == "latency":
            return out
        rest, peak = rss_three_listeners(work)
        out.append(("fanout: RSS with 3 listeners (2 workers each)", "-", f"{rest / 1024:.1f} MiB at rest / {peak / 1024:.1f} MiB under load",
                    "-", "-", "1400-byte datagrams"))
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)
