# SPDX-License-Identifier: Apache-2.0
"""What the make bench modules share (bench.py runs them; none imports another but the scale
parts, which use bench_scale's helpers and bench_twoway's topology): the built binaries, run
counts, loopback collectors and publisher, BPF run-time statistics, the client/proxy/backends
namespace topology and its publisher, nginx's stream proxy, spreads."""
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import time

RUNS = int(os.environ.get("BENCH_RUNS", "7"))
DATAGRAMS = int(os.environ.get("BENCH_DATAGRAMS", "600000"))
# 240 sources: both the consistent table and the kernel's 4-tuple hash then split them evenly
# over 3 collectors, so the comparison measures steering cost, not how lucky a split was.
SOURCES = "127.0.0.10-127.0.0.249"
# BENCH_BIN: another build's programs (a quick check of a benchmark's script with a debug build).
BIN = os.environ.get("BENCH_BIN") or subprocess.check_output(["swift", "build", "-c", "release", "--show-bin-path"], text=True).strip()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Collectors:
    def __init__(self, port, steering, policy="sourceIP", count=3):
        self.procs = []
        for index in range(count):
            p = subprocess.Popen(
                [f"{BIN}/collector", "127.0.0.1", str(port), str(index), str(count), "--steering", steering,
                 "--policy", policy, "--rcvbuf", "16777216"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            line = p.stderr.readline()
            if "ready" not in line:
                raise SystemExit(f"collector did not start: {line}{p.stderr.read()}")
            self.procs.append(p)

    def stop(self):
        reports = []
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            out, _ = p.communicate(timeout=20)
            reports.append(json.loads(out.strip().splitlines()[-1]))
        return reports


def publish(port, count=DATAGRAMS, extra=()):
    out = subprocess.run([f"{BIN}/publisher", "127.0.0.1", str(port), str(count), "--sources", SOURCES,
                          "--batch", "64", *extra], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


class BPFStats:
    """Turns kernel.bpf_stats_enabled on for the block and restores it after."""

    def __enter__(self):
        with open("/proc/sys/kernel/bpf_stats_enabled") as f:
            self.previous = f.read().strip()
        with open("/proc/sys/kernel/bpf_stats_enabled", "w") as f:
            f.write("1")

    def __exit__(self, *exc):
        with open("/proc/sys/kernel/bpf_stats_enabled", "w") as f:
            f.write(self.previous)


def ns_per_run(show_args):
    progs = json.loads(subprocess.check_output(["bpftool", "prog", "show", *show_args, "--json"], text=True))
    progs = progs if isinstance(progs, list) else [progs]
    runs = sum(p.get("run_cnt", 0) for p in progs)
    return (sum(p.get("run_time_ns", 0) for p in progs) / runs if runs else float("nan")), runs


def alternated(runs, names, run):
    """`run(name)` for each name, `runs` times, the order reversed every other time (so a drift
    of the machine touches every variant alike): the results by name."""
    results = {name: [] for name in names}
    for turn in range(runs):
        for name in (names if turn % 2 == 0 else list(reversed(names))):
            results[name].append(run(name))
    return results


def spread(values):
    return statistics.median(values), min(values), max(values)


# The namespace topology (tc_ebpf, af_xdp and two-way benchmarks): 198.18.0.0/15 only, in
# namespaces of this run, removed afterwards.
NAMESPACE_SOURCES = "198.18.0.10-198.18.0.25"
BACKENDS = 3


def in_namespace(namespace):
    # nsenter, not `ip netns exec`: that one remounts /sys (and hides /sys/fs/bpf).
    return ["nsenter", f"--net=/run/netns/{namespace}", "--"]


def terminated(*_):
    """A SIGTERM handler (signal.signal(signal.SIGTERM, terminated)): a cancelled run (a CI job,
    kill) raises here, so the callers' finally blocks still stop daemons and remove namespaces."""
    raise SystemExit("bench: terminated")


def stop_process(proc, grace=15):
    """SIGTERM, then SIGKILL after `grace` seconds: never leave one of ours behind."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_with_output(proc, grace=15):
    """SIGTERM, then SIGKILL after `grace` seconds; the process's stdout (its report)."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out or ""


def build_scale_tool(work):
    """bench/scale.c (the minimal C forwarder, copier, sink and raw sender), built with the system cc into `work`."""
    binary = os.path.join(work, "scale")
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "scale.c")
    subprocess.run(["cc", "-O2", "-Wall", "-o", binary, source], check=True)
    return binary


class CForwarder:
    """bench/scale.c's forward mode (build_scale_tool), bound to `bind`:`port`, sending to
    `destinations` [(address, port)] by `balancing`, waiting as `wait` says (epoll, block or
    poll; see bench/scale.c), pinned to CPU `cpu` when given (in a netns: `prefix`, nsenter's command)."""

    def __init__(self, tool, port, destinations, balancing, work, bind="127.0.0.1", prefix=(), cpu=None, wait="epoll"):
        path = os.path.join(work, "destinations")
        with open(path, "w") as f:
            f.write("".join(f"{address} {p}\n" for address, p in destinations))
        pin = ("taskset", "-c", str(cpu)) if cpu is not None else ()
        self.proc = subprocess.Popen([*prefix, *pin, tool, "forward", bind, str(port), balancing, path, wait],
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            stop_process(self.proc)
            raise SystemExit("the C forwarder did not start")

    def stop(self):
        """Its count of datagrams forwarded."""
        return json.loads(stop_with_output(self.proc, 10).strip().splitlines()[-1])["forwarded"]


def sh(*args, check=True):
    return subprocess.run(args, check=check, capture_output=True, text=True).stdout


class NamespaceTopology:
    """Namespaces of this run, named with a random tag: `_name(tag)` names them, `_build(tag)`
    creates them (appending each to `created`), `destroy()` removes them, also when the build
    fails half way."""

    def __init__(self):
        tag = f"{random.getrandbits(32):08x}"
        self.created = []
        self._name(tag)
        try:
            self._build(tag)
        except BaseException:
            self.destroy()
            raise

    def ns(self, namespace, *command, check=True):
        return sh(*in_namespace(namespace), *command, check=check)

    def destroy(self):
        for namespace in self.created:
            sh("ip", "netns", "delete", namespace, check=False)
        self.created = []


class Topology(NamespaceTopology):
    """client ── proxy ── backend 1..3; `queues` RX/TX queues on the client link."""

    def __init__(self, queues=1):
        self.queues = queues
        super().__init__()

    def _name(self, tag):
        self.client, self.proxy = f"btc-{tag}", f"btp-{tag}"
        self.backends = [f"btb{n}-{tag}" for n in range(1, BACKENDS + 1)]
        self.proxy_if = f"pc{tag}"
        self.backend_ifs = [f"b{n}{tag}" for n in range(1, BACKENDS + 1)]

    def _build(self, tag):
        for namespace in [self.client, self.proxy] + self.backends:
            sh("ip", "netns", "add", namespace)
            self.created.append(namespace)
            sh("ip", "-n", namespace, "link", "set", "lo", "up")
        q = ["numtxqueues", str(self.queues), "numrxqueues", str(self.queues)]
        sh("ip", "link", "add", f"cp{tag}", "netns", self.client, *q, "type", "veth", "peer", "name", self.proxy_if, "netns", self.proxy, *q)
        sh("ip", "-n", self.client, "addr", "add", "198.18.0.2/24", "dev", f"cp{tag}")
        for last in range(10, 26):
            sh("ip", "-n", self.client, "addr", "add", f"198.18.0.{last}/24", "dev", f"cp{tag}")
        sh("ip", "-n", self.client, "link", "set", f"cp{tag}", "up")
        sh("ip", "-n", self.client, "route", "add", "198.18.0.0/15", "via", "198.18.0.1")
        sh("ip", "-n", self.proxy, "addr", "add", "198.18.0.1/24", "dev", self.proxy_if)
        sh("ip", "-n", self.proxy, "link", "set", self.proxy_if, "up")
        for n, (backend, inner) in enumerate(zip(self.backends, self.backend_ifs), start=1):
            outer = f"pb{n}{tag[:7]}"
            sh("ip", "link", "add", outer, "netns", self.proxy, "type", "veth", "peer", "name", inner, "netns", backend)
            sh("ip", "-n", self.proxy, "addr", "add", f"198.18.{n}.1/24", "dev", outer)
            sh("ip", "-n", self.proxy, "link", "set", outer, "up")
            # As a NIC without UDP segmentation offload: a forwarder's UDP GSO send is segmented
            # before the veth, so the backend's receive count is one per datagram (a veth would
            # otherwise carry the GSO packet whole and count it once).
            sh("ip", "netns", "exec", self.proxy, "ethtool", "-K", outer, "tx-udp-segmentation", "off")
            sh("ip", "-n", backend, "addr", "add", f"198.18.{n}.2/24", "dev", inner)
            sh("ip", "-n", backend, "link", "set", inner, "up")
            sh("ip", "-n", backend, "route", "add", "default", "via", f"198.18.{n}.1")
        self.ns(self.proxy, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for n in range(0, BACKENDS + 1):
            self.ns(self.proxy, "ping", "-c", "1", "-W", "3", f"198.18.{n}.2")
        # Sinks: drop UDP at the backend's ingress, after the veth has counted the packet (ARP
        # still answers: the proxy's neighbour entries must stay valid).
        for backend, inner in zip(self.backends, self.backend_ifs):
            rules = f'table netdev sink {{\n chain in {{\n  type filter hook ingress device "{inner}" priority 0; policy accept;\n  ip protocol udp drop\n }}\n}}\n'
            subprocess.run([*in_namespace(backend), "nft", "-f", "-"], input=rules, text=True, check=True)

    def delivered(self):
        total = 0
        for backend, inner in zip(self.backends, self.backend_ifs):
            link = json.loads(sh("ip", "-n", backend, "-s", "-j", "link", "show", "dev", inner))[0]
            total += link["stats64"]["rx"]["packets"]
        return total



def publish_in(topology, target, count, extra=()):
    out = topology.ns(topology.client, f"{BIN}/publisher", target[0], str(target[1]), str(count),
                      "--sources", NAMESPACE_SOURCES, "--batch", "64", *extra)
    return json.loads(out)


class Nginx:
    MODULE = "/usr/lib/nginx/modules/ngx_stream_module.so"

    def __init__(self, port, downstreams, workers, work):
        servers = "\n".join(f"    server 127.0.0.1:{p};" for p in downstreams)
        load = f"load_module {self.MODULE};\n" if os.path.exists(self.MODULE) else ""
        conf = f"""{load}worker_processes {workers};
daemon off;
pid {work}/nginx.pid;
error_log {work}/error.log warn;
events {{ worker_connections 65536; }}
stream {{
  upstream sinks {{
{servers}
  }}
  server {{
    listen 127.0.0.1:{port} udp reuseport;
    proxy_pass sinks;
    proxy_responses 0;
    proxy_timeout 1s;
  }}
}}
"""
        path = os.path.join(work, f"nginx-{workers}.conf")
        with open(path, "w") as f:
            f.write(conf)
        self.proc = subprocess.Popen(["nginx", "-e", f"{work}/error.log", "-p", work, "-c", path],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 5
        while time.time() < deadline:
            if f":{port} " in subprocess.run(["ss", "-Hlnu"], capture_output=True, text=True).stdout:
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"nginx did not start: {self.proc.stderr.read()}")
            time.sleep(0.05)
        raise SystemExit("nginx did not bind")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=10)


def idle_seconds_per_cpu():
    """Idle + iowait + steal time of each CPU, in seconds (/proc/stat cpuN lines). On this
    tickless kernel a CPU's idle time is measured (entry to exit of idle), while its busy fields
    are sampled by the 250 Hz tick, which misses the short softirq bursts of a mostly idle CPU:
    busy is therefore taken as wall time minus idle."""
    idle = {}
    with open("/proc/stat") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0].startswith("cpu") and fields[0] != "cpu":
                values = [int(x) for x in fields[1:]]
                idle[int(fields[0][3:])] = (values[3] + values[4] + values[7]) / os.sysconf("SC_CLK_TCK")
    return idle


def busy_during(work):
    """Runs work(): its result, the seconds it took, and each CPU's busy seconds meanwhile
    (wall minus the idle time /proc/stat measures)."""
    before, started = idle_seconds_per_cpu(), time.monotonic()
    result = work()
    after, elapsed = idle_seconds_per_cpu(), time.monotonic() - started
    return result, elapsed, {cpu: max(0.0, elapsed - (after[cpu] - before[cpu])) for cpu in after}


def background():
    """Each CPU's busy share over one second with no traffic (the LB at rest, kernel threads,
    anything else on the machine): taken off what a run measures."""
    _, elapsed, busy = busy_during(lambda: time.sleep(1))
    return {cpu: seconds / elapsed for cpu, seconds in busy.items()}
