# SPDX-License-Identifier: Apache-2.0
"""udp-fanout two-way benchmarks for make bench (BENCH=twoway): round trips per second and CPU
per round trip through a load balancer, in one namespace topology built here and removed after.
Run by bench.py; shares bench_common's helpers.

    clients ── lb (VIP 198.18.0.1:5514) ── server 1..3      (198.18.0.0/15 only, this run's namespaces)

The servers are `collector --echo` (each answers every request from its socket) and route
everything through the lb (their default route), so replies cross it as in a NAT load balancer.
The clients netns runs `publisher --exchange`: N client sockets on 16 source addresses, each
with W requests outstanding, each reply checked (lost after the reply timeout; wrong_source
when its source is not the VIP). Variants, alternated run by run, all in the lb netns:

  tc_ebpf nat     udp-fanout mode tc_ebpf, replies: nat (associations in the kernel, DNAT in,
                  source NAT of the replies back to the VIP)
  xdp nat         udp-fanout mode xdp, replies: nat: the same at the XDP hook (load-generator run
                  only). The endpoints' veths get GRO (a veth transmits XDP frames only then) and
                  compute their checksums (tx off); every veth's NAPI runs threaded, the lb's
                  threads on CPU 1 and the endpoints' on CPU 0, since XDP runs in NAPI, before RPS
  nft conntrack   nftables `nat prerouting` dnat to numgen inc mod 3 map: conntrack balances
                  flows and un-NATs the replies by itself (the kernel's stateful NAT)
  relay           udp-fanout mode userspace (2 workers; 1 on its own CPU), replies: relay (a session socket per client;
                  sends and receives on them through io_uring); in the load-generator run also with
                  settings.io_uring: false ("relay, no io_uring")
  nginx-1/-2      nginx stream, listen udp reuseport, proxy_responses 1, 1 and 2 worker processes

Saturation: many clients with several requests outstanding for a fixed time; round trips/s as
the publisher counts them. CPU per round trip: at a fixed, lighter load (few clients, one
request outstanding each: below every variant's saturation), the busy time of every CPU (wall
time x CPUs minus the measured idle time of /proc/stat) over the run divided by the round trips:
clients and servers included, the same work in every variant.

Then each variant (nginx with one worker, the relay with one worker, and `routed`: the clients
talking to one echo server directly through the lb netns, no load balancer) runs the same two
loads with the load balancer on a CPU of its own: the LB's process on CPU 1 (taskset), RPS on
the lb netns' veths steering their receive softirq to CPU 1, the clients and servers and their
veths on CPU 0. CPU 1's busy time (wall minus measured idle, minus its background over one
quiet second before the run) per round trip is then the load balancer's own CPU; minus the
routed run's, it is the NAT or proxy work above plain forwarding.

Then, with the same placement, the load-generator run: the clients' and servers' programs are
replaced by reflectors (bench/reflect.bpf.c at tc ingress of their veths, each datagram sent
straight back with source and destination swapped), IN_FLIGHT datagrams lap through the load
balancer, and the endpoints are so cheap that the LB's CPU bounds the rate: round trips/s and
CPU 1 time per round trip of the load balancer itself.

Every variant must lose nothing and answer only from the VIP at the fixed load: those counts are
printed, so a fast but lossy variant cannot win unseen. BENCH_TWOWAY_SPLIT=0 skips the second
phase and the load-generator run; BENCH_TWOWAY_REFLECT=0 the load-generator run alone;
BENCH_TWOWAY_IN_FLIGHT sets its datagrams (256); BENCH_TWOWAY_JSON=PATH writes every run's reports there.
"""
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import bench_common as common

SECONDS = float(os.environ.get("BENCH_TWOWAY_SECONDS", "3"))
CLIENTS = int(os.environ.get("BENCH_TWOWAY_CLIENTS", "64"))
WINDOW = int(os.environ.get("BENCH_TWOWAY_WINDOW", "4"))
FIXED_CLIENTS = int(os.environ.get("BENCH_TWOWAY_FIXED_CLIENTS", "4"))
FIXED_WINDOW = int(os.environ.get("BENCH_TWOWAY_FIXED_WINDOW", "1"))
# At saturation a request that waits this long is counted lost and the client goes on; at the
# fixed load nothing may be lost, so the timeout there is generous.
SATURATION_TIMEOUT_MS = 200
FIXED_TIMEOUT_MS = 1000
# Exchanges per client: more than any run completes, so --duration ends every run.
EXCHANGES = 10_000_000
SOURCES = "198.18.0.10-198.18.0.25"
SERVERS = 3
VIP, PORT, SERVER_PORT = "198.18.0.1", 5514, 6000
VARIANTS = ["tc_ebpf nat", "xdp nat", "nft conntrack", "relay", "relay, no io_uring", "nginx-1", "nginx-2", "routed"]
# BENCH_TWOWAY_ONLY=a,b: only these variants (e.g. "xdp nat,tc_ebpf nat,nft conntrack").
if os.environ.get("BENCH_TWOWAY_ONLY"):
    VARIANTS = [v for v in VARIANTS if v in os.environ["BENCH_TWOWAY_ONLY"].split(",")]
# Measured with the whole machine shared by clients, servers and the load balancer.
SHARED_VARIANTS = ["tc_ebpf nat", "nft conntrack", "relay", "nginx-1", "nginx-2"]
# Measured again with the load balancer on a CPU of its own (one core: nginx-1 is the peer).
SPLIT_VARIANTS = ["tc_ebpf nat", "nft conntrack", "relay", "nginx-1", "routed"]
SPLIT = os.environ.get("BENCH_TWOWAY_SPLIT", "1") != "0" and {0, 1} <= os.sched_getaffinity(0)
# The load-generator phase (part of the split phase): reflectors instead of the endpoints'
# programs, this many datagrams circulating (each its own client address and port).
REFLECT = SPLIT and os.environ.get("BENCH_TWOWAY_REFLECT", "1") != "0"
# Measured in the load-generator run only: the relay with settings.io_uring false (one system
# call per session-socket send and receive: what a worker does where io_uring is refused).
REFLECT_ONLY_VARIANTS = ["relay, no io_uring", "xdp nat"]
IN_FLIGHT = int(os.environ.get("BENCH_TWOWAY_IN_FLIGHT", "256"))
REFLECTOR_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "reflect.bpf.c")
# The baseline: the clients talk to one echo server directly, routed by the lb netns with no
# load balancer at all: what plain forwarding through the lb netns costs its CPU.
ROUTED = ("198.18.1.2", SERVER_PORT)


class Topology(common.NamespaceTopology):
    """clients ── lb ── server 1..3 over veth pairs; the servers' default route is the lb.
    The nft tables live in the lb netns and go with it."""

    def _name(self, tag):
        self.clients, self.lb = f"b2c-{tag}", f"b2l-{tag}"
        self.servers = [f"b2s{n}-{tag}" for n in range(1, SERVERS + 1)]
        self.lb_if = f"lc{tag}"

    def _build(self, tag):
        for namespace in [self.clients, self.lb] + self.servers:
            common.sh("ip", "netns", "add", namespace)
            self.created.append(namespace)
            common.sh("ip", "-n", namespace, "link", "set", "lo", "up")
        client_if = f"cl{tag}"
        common.sh("ip", "link", "add", client_if, "netns", self.clients, "type", "veth", "peer", "name", self.lb_if, "netns", self.lb)
        common.sh("ip", "-n", self.clients, "addr", "add", "198.18.0.2/24", "dev", client_if)
        for last in range(10, 26):
            common.sh("ip", "-n", self.clients, "addr", "add", f"198.18.0.{last}/24", "dev", client_if)
        common.sh("ip", "-n", self.clients, "link", "set", client_if, "up")
        common.sh("ip", "-n", self.clients, "route", "add", "198.18.0.0/15", "via", VIP)
        self.lb_side = [(self.lb, self.lb_if)]
        self.endpoint_side = [(self.clients, client_if)]
        common.sh("ip", "-n", self.lb, "addr", "add", f"{VIP}/24", "dev", self.lb_if)
        common.sh("ip", "-n", self.lb, "link", "set", self.lb_if, "up")
        for n, server in enumerate(self.servers, start=1):
            outer, inner = f"ls{n}{tag[:7]}", f"s{n}{tag}"
            common.sh("ip", "link", "add", outer, "netns", self.lb, "type", "veth", "peer", "name", inner, "netns", server)
            common.sh("ip", "-n", self.lb, "addr", "add", f"198.18.{n}.1/24", "dev", outer)
            common.sh("ip", "-n", self.lb, "link", "set", outer, "up")
            common.sh("ip", "-n", server, "addr", "add", f"198.18.{n}.2/24", "dev", inner)
            common.sh("ip", "-n", server, "link", "set", inner, "up")
            self.lb_side.append((self.lb, outer))
            self.endpoint_side.append((server, inner))
            # Replies must cross the lb (to be un-NATed there), as in the issue's topology.
            common.sh("ip", "-n", server, "route", "add", "default", "via", f"198.18.{n}.1")
        self.ns(self.lb, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for n in range(0, SERVERS + 1):
            self.ns(self.lb, "ping", "-c", "1", "-W", "3", f"198.18.{n}.2")

    def split(self, on):
        """LB on CPU 1, endpoints on CPU 0 (or both CPUs again): RPS on every veth's receive
        queue sends what arrives in the lb netns to CPU 1's softirq and what arrives at the
        clients and servers to CPU 0's. With the processes pinned the same way, CPU 1 does
        exactly the load balancer's work: its receive path, its NAT or proxy, its transmit."""
        for side, mask in ((self.lb_side, "2"), (self.endpoint_side, "1")):
            for namespace, interface in side:
                # ip netns exec mounts the netns' own /sys, where its interfaces are.
                common.sh("ip", "netns", "exec", namespace, "sh", "-c",
                            f"echo {mask if on else '0'} > /sys/class/net/{interface}/queues/rx-0/rps_cpus")


def start_logged(command, log_path):
    """Starts `command` with stdout and stderr in a file (a pipe nobody reads would block it)."""
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)


def wait_for_log(proc, log_path, marker, what, seconds=20, count=1):
    deadline = time.monotonic() + seconds
    while True:
        with open(log_path) as f:
            text = f.read()
        if text.count(marker) >= count:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            common.stop_process(proc)
            raise SystemExit(f"{what} did not start (waited for {marker!r}):\n{text[-2000:]}")
        time.sleep(0.05)


class EchoServers:
    """One `collector --echo` per server netns on 198.18.n.2:6000, for the whole benchmark."""

    def __init__(self, topology, work):
        self.procs, self.affinity = [], []
        try:
            for n, server in enumerate(topology.servers, start=1):
                log = os.path.join(work, f"echo-{n}.log")
                # kernelHash: a group of one needs no steering program (and no bpffs pins).
                proc = start_logged([*common.in_namespace(server), f"{common.BIN}/collector", f"198.18.{n}.2", str(SERVER_PORT),
                                     "0", "1", "--echo", "--steering", "kernelHash", "--rcvbuf", "16777216"], log)
                self.procs.append(proc)
                wait_for_log(proc, log, "ready", f"echo server {n} (collector --echo)")
                self.affinity.append(os.sched_getaffinity(proc.pid))
        except BaseException:
            self.stop()
            raise

    def pin(self, cpus):
        """Pins every thread of every server to `cpus` ("0"), or back to what it had (None)."""
        for proc, original in zip(self.procs, self.affinity):
            common.sh("taskset", "-a", "-p", "-c", cpus or ",".join(map(str, sorted(original))), str(proc.pid))

    def stop(self):
        for proc in self.procs:
            common.stop_process(proc)
        self.procs = []


class Variant:
    """Sets a variant up in the lb netns, and waits until a request through the VIP is answered."""

    # udp-fanout's metrics endpoint in the lb netns (a netns of this run: the port is free).
    METRICS = "127.0.0.1:9464"

    def __init__(self, name, topology, work, split=False, settings="", listener_lines="", nginx_session=None, nginx_connections=65536):
        """settings: more of udp-fanout's settings keys ("max_sessions: 200000"); listener_lines:
        more of its listener keys ("    balancing: source_ip\n"); nginx_session: the stream
        server's session lines in place of one session per request (proxy_responses 1), and its
        worker_connections."""
        self.name, self.topology, self.work, self.proc, self.log, self.table = name, topology, work, None, None, False
        self.xdp = False
        self.settings = settings
        self.listener_lines = listener_lines
        self.nginx_session = nginx_session or "proxy_responses 1;\n    proxy_timeout 600s;"
        self.nginx_connections = nginx_connections
        # Split: the load balancer's process on CPU 1 only (taskset; nginx's workers inherit it;
        # the relay's one worker runs unpinned, so within it too).
        self.prefix = ["taskset", "-c", "1"] if split else []
        workers = 1 if split else 2
        try:
            if name == "tc_ebpf nat":
                self.daemon(f"    interface: {topology.lb_if}\n    mode: tc_ebpf\n    replies: nat\n", "registered listener in eBPF map")
            elif name == "xdp nat":
                self.xdp = True
                self.xdp_endpoints(True)
                self.daemon(f"    interface: {topology.lb_if}\n    mode: xdp\n    replies: nat\n", "registered listener in eBPF map")
                self.threaded_napi(True)
            elif name in ("relay", "relay, no io_uring"):
                ring = "true" if name == "relay" else "false"
                self.daemon(f"    mode: userspace\n    replies: relay\n    settings: {{workers: {workers}, batch_size: 64, pin_cpus: {str(not split).lower()}, io_uring: {ring}}}\n",
                            f"io_uring={ring}", count=workers)
            elif name == "nft conntrack":
                pairs = ", ".join(f"{n - 1} : 198.18.{n}.2 . {SERVER_PORT}" for n in range(1, SERVERS + 1))
                # No postrouting rule: the servers route via the lb, so conntrack un-DNATs their
                # replies (source back to the VIP) by itself.
                rules = (f"table ip twoway_bench {{\n chain pre {{\n  type nat hook prerouting priority dstnat; policy accept;\n"
                         f"  ip daddr {VIP} udp dport {PORT} dnat ip to numgen inc mod {SERVERS} map {{ {pairs} }}\n }}\n}}\n")
                subprocess.run([*common.in_namespace(topology.lb), "nft", "-f", "-"], input=rules, text=True, check=True)
                self.table = True
            elif name.startswith("nginx-"):
                self.nginx(int(name[-1]))
            elif name == "routed":
                pass
            else:
                raise SystemExit(f"unknown two-way variant {name!r}")
            self.probe()
        except BaseException:
            self.stop()
            raise

    def daemon(self, shape, ready, count=1):
        if self.settings:
            shape = (shape.replace("}\n", f", {self.settings}}}\n") if "settings: {" in shape
                     else shape + f"    settings: {{{self.settings}}}\n")
        shape += self.listener_lines
        downstreams = "\n".join(f'      - {{name: s{n}, address: "198.18.{n}.2:{SERVER_PORT}"}}' for n in range(1, SERVERS + 1))
        path = os.path.join(self.work, "twoway.yaml")
        with open(path, "w") as f:
            f.write(f'listeners:\n  - name: bench\n    bind: "{VIP}:{PORT}"\n' + shape + f"    downstream:\n{downstreams}\n"
                    f'metrics: {{enabled: true, bind: "{self.METRICS}"}}\n')
        self.log = os.path.join(self.work, "udp-fanout.log")
        self.proc = start_logged([*common.in_namespace(self.topology.lb), *self.prefix, f"{common.BIN}/udp-fanout", "-c", path], self.log)
        wait_for_log(self.proc, self.log, ready, f"udp-fanout ({self.name})", count=count)

    def nginx(self, workers):
        servers = "\n".join(f"    server 198.18.{n}.2:{SERVER_PORT};" for n in range(1, SERVERS + 1))
        module = common.Nginx.MODULE
        load = f"load_module {module};\n" if os.path.exists(module) else ""
        # proxy_responses 1: a request's session ends with its one reply (the exchange's count);
        # proxy_timeout long, so no session ends by timer during a run.
        conf = f"""{load}worker_processes {workers};
worker_rlimit_nofile 1048576;
daemon off;
pid {self.work}/nginx.pid;
error_log {self.work}/nginx-error.log warn;
events {{ worker_connections {self.nginx_connections}; }}
stream {{
  upstream echo {{
{servers}
  }}
  server {{
    listen {VIP}:{PORT} udp reuseport;
    proxy_pass echo;
    {self.nginx_session}
  }}
}}
"""
        path = os.path.join(self.work, f"nginx-{workers}.conf")
        with open(path, "w") as f:
            f.write(conf)
        self.log = os.path.join(self.work, "nginx-error.log")
        # nsenter (and taskset) exec nginx: this pid is nginx's master, which stops its workers on SIGTERM.
        self.proc = start_logged([*common.in_namespace(self.topology.lb), *self.prefix, "nginx", "-e", self.log,
                                  "-p", self.work, "-c", path], os.path.join(self.work, "nginx.log"))
        deadline = time.monotonic() + 10
        while f"{VIP}:{PORT} " not in self.topology.ns(self.topology.lb, "ss", "-Hlnu"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"nginx ({workers} workers) did not bind {VIP}:{PORT}:\n{self.log_tail()}")
            time.sleep(0.05)

    def probe(self, seconds=20):
        """One request from the clients netns until a reply from the VIP comes back (fib and
        neighbour entries warm, the variant really answering) or `seconds` pass."""
        VIP, PORT = destination(self.name)
        script = (f"import socket, sys, time\n"
                  f"s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                  f"s.bind(('198.18.0.2', 0))\n"
                  f"s.settimeout(0.3)\n"
                  f"deadline = time.monotonic() + {seconds}\n"
                  f"while time.monotonic() < deadline:\n"
                  f"    s.sendto(b'twoway-bench-probe', ('{VIP}', {PORT}))\n"
                  f"    try:\n"
                  f"        data, source = s.recvfrom(2048)\n"
                  f"    except socket.timeout:\n"
                  f"        continue\n"
                  f"    if source == ('{VIP}', {PORT}):\n"
                  f"        sys.exit(0)\n"
                  f"    sys.exit(f'reply from {{source}}, not the VIP')\n"
                  f"sys.exit('no reply within {seconds} s')\n")
        result = subprocess.run([*common.in_namespace(self.topology.clients), "python3", "-c", script],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"two-way variant {self.name}: a request to {VIP}:{PORT} got no good reply: {result.stderr.strip()}"
                             + (f"\n{self.log} says:\n{self.log_tail()}" if self.log else ""))

    def log_tail(self):
        try:
            with open(self.log) as f:
                return f.read()[-2000:]
        except OSError as error:
            return f"(no log: {error})"

    def xdp_endpoints(self, on):
        """GRO on the endpoints' veths (so the lb's can transmit XDP frames to them) and their
        checksums computed at send (tx off: XDP passes an offloaded one to tc), or back."""
        for namespace, interface in self.topology.endpoint_side:
            self.topology.ns(namespace, "ethtool", "-K", interface, "gro", "on" if on else "off", "tx", "off" if on else "on")

    def threaded_napi(self, on):
        """Every veth's NAPI in a kernel thread of its own, the lb's on CPU 1, the endpoints' on
        CPU 0 (or back to softirq): XDP runs in NAPI, before RPS could move it."""
        for side, cpu in ((self.topology.lb_side, "1"), (self.topology.endpoint_side, "0")):
            for namespace, interface in side:
                common.sh("ip", "netns", "exec", namespace, "sh", "-c", f"echo {1 if on else 0} > /sys/class/net/{interface}/threaded", check=on)
                if not on:
                    continue
                for line in common.sh("ps", "-eo", "pid=,comm=").splitlines():
                    pid, _, comm = line.strip().partition(" ")
                    if comm.strip().startswith(f"napi/{interface}"[:15]):
                        common.sh("taskset", "-p", "-c", cpu, pid)

    def stop(self):
        if self.xdp:
            # Back to softirq NAPI while the lb's veths still have NAPI (the XDP program's).
            self.threaded_napi(False)
        if self.proc:
            common.stop_process(self.proc)
            self.proc = None
        if self.xdp:
            self.xdp_endpoints(False)
            self.xdp = False
        if self.table:
            # Deleting the table also drops the netns' conntrack hooks: the entries left behind
            # are no longer consulted, so they cannot divert a later variant's datagrams.
            self.topology.ns(self.topology.lb, "nft", "delete", "table", "ip", "twoway_bench", check=False)
            self.table = False


def destination(name):
    """Where the clients send: the VIP, or for the baseline one echo server itself."""
    return ROUTED if name == "routed" else (VIP, PORT)


def exchange(topology, name, clients, window, timeout_ms, cpu=None):
    """One `publisher --exchange` run of SECONDS in the clients netns (on `cpu` if given); its JSON report."""
    ip, port = destination(name)
    pin = ["taskset", "-c", cpu] if cpu is not None else []
    command = [*common.in_namespace(topology.clients), *pin, f"{common.BIN}/publisher", ip, str(port), str(EXCHANGES), "--exchange",
               "--clients", str(clients), "--sources", SOURCES, "--window", str(window),
               "--reply-timeout-ms", str(timeout_ms), "--duration", str(SECONDS)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=SECONDS + 60)
    if result.returncode != 0:
        raise SystemExit(f"publisher --exchange failed ({result.returncode}): {' '.join(command)}\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def lb_cpu_run(topology, name, clients, window, timeout_ms):
    """An exchange with the endpoints on CPU 0 and the LB on CPU 1: the report, with CPU 1's
    busy time per round trip (the load balancer's CPU) and CPU 1's busy share."""
    quiet = common.background()
    report, elapsed, busy = common.busy_during(lambda: exchange(topology, name, clients, window, timeout_ms, cpu="0"))
    lb = max(0.0, busy[1] - quiet[1] * elapsed)
    report["cpu1_background"] = quiet[1]
    report["lb_ns_per_round_trip"] = lb * 1e9 / max(report["replies"], 1)
    report["lb_busy"] = lb / max(elapsed, 1e-9)
    return report


def build_reflector(work):
    """bench/reflect.bpf.c compiled into `work`: its path."""
    obj = os.path.join(work, "reflect.o")
    subprocess.run(["clang", "-O2", "-g", "-target", "bpf", f"-I/usr/include/{os.uname().machine}-linux-gnu",
                    "-I", os.path.join(os.path.dirname(REFLECTOR_SOURCE), "..", "bpf", "include"),
                    "-c", REFLECTOR_SOURCE, "-o", obj], check=True)
    return obj


def reflectors(topology, obj):
    """Attaches the reflector at tc ingress of every endpoint veth (the clients' and each
    server's), or with obj None removes it (the clsact qdisc and its filter go together)."""
    for namespace, interface in topology.endpoint_side:
        if obj:
            topology.ns(namespace, "tc", "qdisc", "add", "dev", interface, "clsact")
            topology.ns(namespace, "tc", "filter", "add", "dev", interface, "ingress", "bpf", "da", "obj", obj, "sec", "tc")
        else:
            topology.ns(namespace, "tc", "qdisc", "del", "dev", interface, "clsact", check=False)


def client_received(topology):
    """Datagrams the clients' veth has received: with the reflectors on, one per round trip."""
    namespace, interface = topology.endpoint_side[0]
    # ip netns exec mounts the netns' own /sys, where its interfaces are.
    return int(common.sh("ip", "netns", "exec", namespace, "cat", f"/sys/class/net/{interface}/statistics/rx_packets"))


def reflected_run(topology, name, obj, attach=reflectors):
    """The load-generator run: with the LB on CPU 1 and the endpoints on CPU 0 as in lb_cpu_run,
    the clients' and servers' programs are replaced by reflectors (bench/reflect.bpf.c, tc
    ingress of their veths), and IN_FLIGHT datagrams, each from its own client address and
    port, are sent once: each then laps clients -> LB -> server -> LB -> clients for ever, and
    the endpoints cost a few hundred ns per lap, so the LB's CPU is what bounds the rate (as
    with a hardware traffic generator). Round trips are the clients' veth receive count.
    CPU 1's and CPU 0's background at rest are taken off their busy time. `attach(topology, obj)`
    puts the reflectors on (obj None: takes them off): by default at tc ingress."""
    quiet = common.background()
    try:
        attach(topology, obj)
        ip, port = destination(name)
        # Ports 20000 + i: every datagram its own client (address, port), in every variant.
        script = (f"import socket\n"
                  f"for i in range({IN_FLIGHT}):\n"
                  f"    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                  f"    s.bind(('198.18.0.%d' % (10 + i % 16), 20000 + i))\n"
                  f"    s.sendto(b'twoway-bench-lap'.ljust(64, b'.'), ('{ip}', {port}))\n"
                  f"    s.close()\n")
        subprocess.run([*common.in_namespace(topology.clients), "python3", "-c", script], check=True, timeout=60)
        time.sleep(0.5)  # every datagram lapping, sessions and associations made
        start = client_received(topology)
        laps, elapsed, busy = common.busy_during(lambda: time.sleep(SECONDS) or client_received(topology) - start)
        # The rate over the last 0.4 s against the run's: a variant losing its datagrams as they
        # lap would slow down towards 0 here (a few ARP frames a second aside).
        end = client_received(topology)
        time.sleep(0.4)
        end_rate = (client_received(topology) - end) / 0.4
    finally:
        attach(topology, None)
    rate = laps / elapsed
    lb, endpoints = (max(0.0, busy[cpu] - quiet[cpu] * elapsed) for cpu in (1, 0))
    return {"round_trips_per_sec": rate, "lb_ns_per_round_trip": lb * 1e9 / max(laps, 1),
            "lb_busy": lb / elapsed, "endpoints_busy": endpoints / elapsed, "end_rate_ratio": end_rate / max(rate, 1e-9)}


def run_variant(name, topology, servers, work, reflector):
    """The variant's saturation run and fixed-load run on both CPUs, then (if it has a split
    phase) the same two with the load balancer on CPU 1 alone, and the load-generator run."""
    results = {}
    if name in SHARED_VARIANTS:
        variant = Variant(name, topology, work)
        try:
            results["saturation"] = exchange(topology, name, CLIENTS, WINDOW, SATURATION_TIMEOUT_MS)
            before, started = common.idle_seconds_per_cpu(), time.monotonic()
            results["fixed"] = exchange(topology, name, FIXED_CLIENTS, FIXED_WINDOW, FIXED_TIMEOUT_MS)
            after, elapsed = common.idle_seconds_per_cpu(), time.monotonic() - started
            cpu = elapsed * len(after) - sum(after.values()) + sum(before.values())
        finally:
            variant.stop()
        results["fixed"]["ns_per_round_trip"] = cpu * 1e9 / max(results["fixed"]["replies"], 1)
    if (name in SPLIT_VARIANTS and SPLIT) or (name in REFLECT_ONLY_VARIANTS and reflector):
        affinity = os.sched_getaffinity(0)
        try:
            # This script (and what it forks: counter reads, injection) on CPU 0 too, so that
            # CPU 1 holds the load balancer alone.
            os.sched_setaffinity(0, {0})
            topology.split(True)
            servers.pin("0")
            variant = Variant(name, topology, work, split=True)
            try:
                if name in SPLIT_VARIANTS:
                    results["split saturation"] = lb_cpu_run(topology, name, CLIENTS, WINDOW, SATURATION_TIMEOUT_MS)
                    results["split fixed"] = lb_cpu_run(topology, name, FIXED_CLIENTS, FIXED_WINDOW, FIXED_TIMEOUT_MS)
                if reflector:
                    results["reflected"] = reflected_run(topology, name, reflector)
            finally:
                variant.stop()
        finally:
            servers.pin(None)
            topology.split(False)
            os.sched_setaffinity(0, affinity)
    return results


def measure(topology, servers, work, runs, reflector):
    """{phase: {variant: [report per run]}}, variants alternated run by run."""
    variants = [v for v in VARIANTS if v in SHARED_VARIANTS or (SPLIT and v in SPLIT_VARIANTS) or (reflector and v in REFLECT_ONLY_VARIANTS)]
    phases = {}
    for run in range(runs):
        for name in (variants if run % 2 == 0 else list(reversed(variants))):
            for phase, report in run_variant(name, topology, servers, work, reflector).items():
                phases.setdefault(phase, {}).setdefault(name, []).append(report)
    return phases


def table(phases):
    """The rows: each comparison of the issue, then every variant's correctness at the fixed load."""
    out = []
    saturation, fixed = phases.get("saturation", {}), phases.get("fixed", {})
    split_saturation, split_fixed = phases.get("split saturation", {}), phases.get("split fixed", {})
    reflected = phases.get("reflected", {})

    def rate(results, name):
        return common.spread([r["round_trips_per_sec"] for r in results[name]])

    def lost(results, name):
        runs = results[name]
        return f"{sum(r['lost'] for r in runs):,}/{sum(r['lost'] + r['replies'] for r in runs):,}"

    def rate_row(results, what, ours, peer_label, peers, goal):
        mine = rate(results, ours)
        best = [max(p[i]["round_trips_per_sec"] for p in (results[n] for n in peers)) for i in range(len(results[ours]))]
        ratios = common.spread([o["round_trips_per_sec"] / b for o, b in zip(results[ours], best)])
        peer = common.spread(best)
        extra = ""
        if results is split_saturation:
            busy = lambda n: f"{common.spread([r['lb_busy'] for r in results[n]])[0]:.0%}"
            extra = f"; LB CPU busy ours {busy(ours)}, peer {', '.join(busy(n) for n in peers)}"
        out.append((f"twoway: round trips/s at saturation{what}, {ours}", peer_label,
                    f"{mine[0]:,.0f} rt/s ({mine[1]:,.0f}-{mine[2]:,.0f})", f"{peer[0]:,.0f} rt/s ({peer[1]:,.0f}-{peer[2]:,.0f})",
                    f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f}){goal}",
                    f"median of per-run ratios; lost ours {lost(results, ours)}, peer {', '.join(lost(results, n) for n in peers)}{extra}"))

    def cpu_row(results, key, what, ours, peer_name, goal, note):
        mine = common.spread([r[key] for r in results[ours]])
        peer = common.spread([r[key] for r in results[peer_name]])
        ratios = common.spread([o[key] / p[key] for o, p in zip(results[ours], results[peer_name])])
        rates = ", ".join(f"{rate(results, n)[0]:,.0f}" for n in (ours, peer_name))
        out.append((f"twoway: {what}, {ours}", peer_name,
                    f"{mine[0]:,.0f} ns ({mine[1]:,.0f}-{mine[2]:,.0f})", f"{peer[0]:,.0f} ns ({peer[1]:,.0f}-{peer[2]:,.0f})",
                    f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f}){goal}", note.format(rates=rates)))

    def above_routed_row(results, what, ours, peer_name):
        """The LB's CPU above plain forwarding: each variant's CPU 1 time per round trip minus
        the routed baseline's of the same run (the veth receive, softirq and transmit that any
        router in the lb netns pays), i.e. the NAT or proxy work itself."""
        if "routed" not in results:
            return
        def own(name):
            return [r["lb_ns_per_round_trip"] - b["lb_ns_per_round_trip"] for r, b in zip(results[name], results["routed"])]
        mine, peer = common.spread(own(ours)), common.spread(own(peer_name))
        # Below zero: the variant costs less than forwarding alone, and a ratio would mean nothing.
        ratio = f"{mine[0] / peer[0]:.2f}" if mine[0] > 0 and peer[0] > 0 else ("ours below the floor" if mine[0] <= 0 else "-")
        floor = common.spread([r["lb_ns_per_round_trip"] for r in results["routed"]])[0]
        out.append((f"twoway: LB CPU per round trip above plain forwarding, {what}, {ours}", f"{peer_name} (each minus routed)",
                    f"{mine[0]:,.0f} ns ({mine[1]:,.0f}-{mine[2]:,.0f})", f"{peer[0]:,.0f} ns ({peer[1]:,.0f}-{peer[2]:,.0f})",
                    ratio, f"CPU 1 time per round trip minus the same run's routed baseline ({floor:,.0f} ns: the lb netns"
                    " forwarding with no LB): the NAT or proxy work alone"))

    def reflected_rows(ours, peer_name, rate_goal, cpu_goal, peer_note=""):
        """The load-generator comparison: round trips/s (the LB's CPU saturated) and the LB's CPU
        per round trip, median of per-run ratios, with what shows the LB was the bound: a run is
        LB-bound when CPU 1 was at least 90 % busy and CPU 0 (the reflectors) below 95 %; unless
        most runs of both variants were, the ratio says NOT LB-bound."""
        if ours not in reflected or peer_name not in reflected:
            return
        def spread(name, key):
            return common.spread([r[key] for r in reflected[name]])
        def bound(name):
            return sum(r["lb_busy"] >= 0.9 and r["endpoints_busy"] < 0.95 for r in reflected[name])
        def busy(name):
            return (f"LB CPU {spread(name, 'lb_busy')[0]:.0%}, reflectors' CPU {spread(name, 'endpoints_busy')[0]:.0%},"
                    f" LB-bound {bound(name)}/{len(reflected[name])} runs, last-0.4-s rate {spread(name, 'end_rate_ratio')[0]:.2f}x the run's")
        verdict = "" if all(2 * bound(n) > len(reflected[n]) for n in (ours, peer_name)) else " NOT LB-bound"
        mine, peer = spread(ours, "round_trips_per_sec"), spread(peer_name, "round_trips_per_sec")
        ratios = common.spread([o["round_trips_per_sec"] / p["round_trips_per_sec"] for o, p in zip(reflected[ours], reflected[peer_name])])
        out.append((f"twoway: round trips/s, LB-bound (reflectors), {ours}", peer_name,
                    f"{mine[0]:,.0f} rt/s ({mine[1]:,.0f}-{mine[2]:,.0f})", f"{peer[0]:,.0f} rt/s ({peer[1]:,.0f}-{peer[2]:,.0f})",
                    f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f}){rate_goal}{verdict}",
                    f"median of per-run ratios; {IN_FLIGHT} datagrams lapping through reflectors at the clients and servers (CPU 0),"
                    f" the LB alone on CPU 1; ours: {busy(ours)}; peer: {busy(peer_name)}{peer_note}"))
        mine, peer = spread(ours, "lb_ns_per_round_trip"), spread(peer_name, "lb_ns_per_round_trip")
        ratios = common.spread([o["lb_ns_per_round_trip"] / p["lb_ns_per_round_trip"] for o, p in zip(reflected[ours], reflected[peer_name])])
        out.append((f"twoway: LB CPU per round trip, LB-bound (reflectors), {ours}", peer_name,
                    f"{mine[0]:,.0f} ns ({mine[1]:,.0f}-{mine[2]:,.0f})", f"{peer[0]:,.0f} ns ({peer[1]:,.0f}-{peer[2]:,.0f})",
                    f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f}){cpu_goal}{verdict}",
                    "CPU 1's busy time (wall minus measured idle, minus its background at rest) / round trips in the same runs:"
                    " the LB's receive, NAT or proxy, and transmit"))

    lb_note = ("CPU 1's busy time (wall minus measured idle, minus its background at rest) / round trips at {rates} rt/s; the LB alone is on CPU 1 (its process pinned, RPS"
               " steering the lb netns' receive there), clients and servers on CPU 0")
    if "tc_ebpf nat" in saturation and "nft conntrack" in saturation:
        rate_row(saturation, "", "tc_ebpf nat", "nft conntrack DNAT", ["nft conntrack"], " goal >= 1.2")
        cpu_row(fixed, "ns_per_round_trip", "CPU per round trip at fixed load (all CPUs)", "tc_ebpf nat", "nft conntrack", "",
                "busy time of all CPUs (wall x CPUs minus idle) / round trips at {rates} rt/s: clients and servers included (the same work in every variant)")
    if "tc_ebpf nat" in split_fixed and "nft conntrack" in split_fixed:
        cpu_row(split_fixed, "lb_ns_per_round_trip", "LB CPU per round trip at fixed load", "tc_ebpf nat", "nft conntrack", " goal <= 0.7", lb_note)
        cpu_row(split_saturation, "lb_ns_per_round_trip", "LB CPU per round trip at saturation", "tc_ebpf nat", "nft conntrack", " goal <= 0.7", lb_note)
        above_routed_row(split_fixed, "fixed load", "tc_ebpf nat", "nft conntrack")
        above_routed_row(split_saturation, "saturation", "tc_ebpf nat", "nft conntrack")
        rate_row(split_saturation, " (LB on its own CPU)", "tc_ebpf nat", "nft conntrack DNAT", ["nft conntrack"], "")
    reflected_rows("tc_ebpf nat", "nft conntrack", " goal >= 1.2", " goal <= 0.7")
    reflected_rows("xdp nat", "nft conntrack", " goal >= 2", "", "; ours with threaded NAPI (XDP runs there), GRO on the endpoints' veths")
    reflected_rows("xdp nat", "tc_ebpf nat", "", "", "; what the XDP hook buys over tc, in the same runs")
    if "relay" in saturation:
        nginx = [n for n in ("nginx-1", "nginx-2") if n in saturation]
        for n in nginx:
            rate_row(saturation, "", "relay", f"nginx stream, {n[-1]} worker(s)", [n], "")
        if nginx:
            rate_row(saturation, "", "relay", "max(nginx 1, nginx 2) per run", nginx, " goal >= 3")
        for n in nginx:
            cpu_row(fixed, "ns_per_round_trip", "CPU per round trip at fixed load (all CPUs)", "relay", n, "",
                    "busy time of all CPUs (wall x CPUs minus idle) / round trips at {rates} rt/s: clients and servers included")
    if "relay" in split_fixed and "nginx-1" in split_fixed:
        rate_row(split_saturation, " (LB on its own CPU)", "relay", "nginx stream, 1 worker", ["nginx-1"], "")
        cpu_row(split_fixed, "lb_ns_per_round_trip", "LB CPU per round trip at fixed load", "relay", "nginx-1", "", lb_note)
        cpu_row(split_saturation, "lb_ns_per_round_trip", "LB CPU per round trip at saturation", "relay", "nginx-1", "", lb_note)
        above_routed_row(split_fixed, "fixed load", "relay", "nginx-1")
        above_routed_row(split_saturation, "saturation", "relay", "nginx-1")
    reflected_rows("relay", "nginx-1", " goal >= 3", "", "; nginx with proxy_responses 1 (the issue's peer) makes and closes an upstream"
                   " socket per request, the relay keeps one session socket per client and sends and receives on them through io_uring")
    reflected_rows("relay, no io_uring", "nginx-1", "", "", "; the relay with settings.io_uring: false, one system call per session-socket"
                   " send and receive (what a worker does where io_uring is refused, e.g. a container runtime's default seccomp profile)")
    reflected_rows("relay", "relay, no io_uring", "", "", "; what io_uring buys the relay, in the same runs")
    if "routed" in split_fixed:
        mine = common.spread([r["lb_ns_per_round_trip"] for r in split_fixed["routed"]])
        out.append(("twoway: LB CPU per round trip at fixed load, routed (no LB)", "-", f"{mine[0]:,.0f} ns ({mine[1]:,.0f}-{mine[2]:,.0f})",
                    "-", "-", "plain IP forwarding through the lb netns (clients -> one echo server): the floor under every variant's LB CPU"))
    if "routed" in reflected:
        mine = common.spread([r["round_trips_per_sec"] for r in reflected["routed"]])
        cost = common.spread([r["lb_ns_per_round_trip"] for r in reflected["routed"]])
        out.append(("twoway: round trips/s, LB-bound (reflectors), routed (no LB)", "-", f"{mine[0]:,.0f} rt/s ({mine[1]:,.0f}-{mine[2]:,.0f})",
                    f"{cost[0]:,.0f} ns per round trip", "-", "reference: plain IP forwarding through the lb netns (clients -> one server), no load balancer, at the same load"))
    for phase, results in (("fixed load", fixed), ("fixed load, LB on its own CPU", split_fixed)):
        for name in results:
            runs = results[name]
            at_saturation = (saturation if results is fixed else split_saturation).get(name, [])
            bad_lost, bad_source = sum(r["lost"] for r in runs), sum(r["wrong_source"] for r in runs)
            # At saturation requests may time out (the rate rows show it), but no reply may ever
            # come from anywhere but the VIP (or, routed, the server itself).
            saturation_source = sum(r["wrong_source"] for r in at_saturation)
            verdict = "ok" if bad_lost == 0 and bad_source == 0 and saturation_source == 0 else "FAIL: lost or wrong source"
            p50 = common.spread([r["rtt_p50_us"] for r in runs])
            p99 = common.spread([r["rtt_p99_us"] for r in runs])
            saturated = bool(at_saturation) and rate(results, name)[0] > 0.8 * common.spread([r["round_trips_per_sec"] for r in at_saturation])[0]
            out.append((f"twoway: correctness at {phase}, {name}", "lost 0, wrong_source 0",
                        f"lost {bad_lost}, wrong_source {bad_source} of {sum(r['replies'] + r['lost'] for r in runs):,}",
                        f"saturation: wrong_source {saturation_source}", verdict,
                        f"{FIXED_CLIENTS} clients x window {FIXED_WINDOW}: {rate(results, name)[0]:,.0f} rt/s, rtt p50 {p50[0]:.0f} us,"
                        f" p99 {p99[0]:.0f} us" + ("; WARNING: over 0.8x its saturation rate, lower BENCH_TWOWAY_FIXED_CLIENTS"
                                                   if saturated else "")))
    return out


def remove_iproute2_pin_dirs():
    """tc loading an object file makes /sys/fs/bpf/tc/globals (and ip, xdp links to tc): removed
    after the run when it made them and they hold nothing (rmdir refuses a directory with pins)."""
    for link in ("/sys/fs/bpf/ip", "/sys/fs/bpf/xdp"):
        if os.path.islink(link) and os.readlink(link).rstrip("/") == "/sys/fs/bpf/tc":
            os.unlink(link)
    for directory in ("/sys/fs/bpf/tc/globals", "/sys/fs/bpf/tc"):
        try:
            os.rmdir(directory)
        except OSError:
            pass


def rows():
    if not shutil.which("nginx") or not shutil.which("nft"):
        raise SystemExit("nginx or nft is not installed: run make bench (it installs nginx, libnginx-mod-stream and nftables as root)")
    # A SIGTERM (a CI job cancelled) must still reach the cleanup below.
    previous = signal.signal(signal.SIGTERM, common.terminated)
    work = tempfile.mkdtemp(prefix="rplb-twoway-bench-")
    made_pin_dirs = REFLECT and not os.path.exists("/sys/fs/bpf/tc")
    topology = None
    servers = None
    try:
        topology = Topology()
        servers = EchoServers(topology, work)
        print(f"bench: two-way through an lb netns (clients -> VIP {VIP}:{PORT} -> 3 echo servers routed via the lb, veth);"
              f" {common.RUNS} alternated runs of {SECONDS:g} s per variant; saturation {CLIENTS} clients x window {WINDOW}"
              f" from 16 sources, CPU at {FIXED_CLIENTS} clients x window {FIXED_WINDOW}; {os.cpu_count()} CPUs", flush=True)
        reflector = build_reflector(work) if REFLECT else None
        phases = measure(topology, servers, work, common.RUNS, reflector)
        if os.environ.get("BENCH_TWOWAY_JSON"):
            with open(os.environ["BENCH_TWOWAY_JSON"], "w") as f:
                json.dump(phases, f)
        return table(phases)
    finally:
        if servers:
            servers.stop()
        if topology:
            topology.destroy()
        subprocess.run(["rm", "-rf", work])
        if made_pin_dirs:
            remove_iproute2_pin_dirs()
        signal.signal(signal.SIGTERM, previous)
