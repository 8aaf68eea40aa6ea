# SPDX-License-Identifier: Apache-2.0
"""BENCH=scale, part `twoway` (BENCH_SCALE_ONLY=twoway): how a two-way load balancer's cost and
memory grow with the number of clients it keeps at once, each variant beside its peer in the
same runs, as a table and as plots (docs/bench-scale-twoway-*.svg).

    clients (rotate.bpf.c) ── lb (VIP 198.18.0.1:5514) ── server 1..3 (reflect.bpf.c -DSTAMP)

The topology and the variants are the two-way benchmark's (bench_twoway: the lb netns alone on
CPU 1, the endpoints on CPU 0). The endpoints are packet reflectors: IN_FLIGHT datagrams lap
through the load balancer, and at the clients' veth each reply becomes the next request of
another client (bench/rotate.bpf.c: client i is 198.19.0.0 + i / 40000, port 20000 + i % 40000),
so that N distinct clients (address and port) are each visited once every N round trips. The
servers' reflectors stamp their address into the reply, and the clients' side counts per reply
whether that client kept its server, changed it, or was seen for the first time.

Curves:
  relay        udp-fanout replies: relay (1 worker, io_uring; a session socket per client)
               against nginx stream (1 worker; a session per client: no proxy_responses, so a
               client's later datagrams reuse its session and its upstream socket), at
               1,024, 10,240 and 102,400 clients.
               The largest point is 102,400 where the machine allows it: each session is a socket
               (an open file) with a local port of its own, so it is capped below the open-files
               hard limit and the ephemeral port range (net.ipv4.ip_local_port_range), for both.
  nat          udp-fanout tc_ebpf replies: nat (associations in an LRU map of max_associations,
               1,048,576 by default) against nftables conntrack DNAT with the same room
               (nf_conntrack_max and its hash size set to 1,048,576 + 1,024 for the start-up
               probe's flows, restored after), at 10,240, 102,400, 1,048,576 and 2,097,152
               clients: the last is twice the room, so each client's entry is gone by its next
               turn. There udp-fanout forgets the least recently used association (the client is
               associated again, perhaps with another server) and nftables drops new flows while
               its table is full; `tc_ebpf nat, source_ip` shows that balancing by source keeps
               every client on its server even so.

Per point: warm-up until every client was visited once (each then has its session, association
or conntrack entry), then SECONDS measured: round trips/s, CPU 1's busy time per round trip (the
load balancer alone), what clients experienced (kept / changed / first), and memory: the load
balancer's processes' RSS, its BPF maps' memory (bpftool's bytes_memlock), and the kernel's slab
growth since before the variant started (/proc/meminfo Slab: sockets, conntrack entries). Memory
per client is the slope between the smallest and the largest point."""
import json
import os
import shutil
import subprocess
import time

import bench_common as common
import bench_twoway as twoway

HERE = os.path.dirname(os.path.abspath(__file__))
SECONDS = float(os.environ.get("BENCH_SCALE_TWOWAY_SECONDS", "3"))
IN_FLIGHT = 256


def relay_room():
    """The most relay sessions (or nginx sessions) this machine holds, a multiple of IN_FLIGHT: a
    socket each, below the open-files hard limit and the ephemeral port range, with 1,024 spare."""
    import resource
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(x) for x in f.read().split())
    room = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], high - low + 1) - 1024
    return room // 256 * 256


RELAY_CLIENTS = [int(n) for n in os.environ.get("BENCH_SCALE_RELAY_CLIENTS", f"1024,10240,{min(102400, relay_room())}").split(",")]
NAT_CLIENTS = [int(n) for n in os.environ.get("BENCH_SCALE_NAT_CLIENTS", "10240,102400,1048576,2097152").split(",")]
MAX_ASSOCIATIONS = 1_048_576
# The longest warm-up: a variant that cannot visit every client within it is reported as such.
WARM_LIMIT = float(os.environ.get("BENCH_SCALE_TWOWAY_WARM_LIMIT", "120"))
CLIENT_NET = "198.19.0.0/16"


def build_objects(work, counts):
    """The servers' stamping reflector and one clients' rotator per client count: their paths."""
    include = ["-I", os.path.join(HERE, "..", "bpf", "include"), f"-I/usr/include/{os.uname().machine}-linux-gnu"]
    bench = os.path.join(HERE, "..", "bench")
    objects = {"server": os.path.join(work, "stamp.o")}
    subprocess.run(["clang", "-O2", "-g", "-target", "bpf", *include, "-DSTAMP", "-c", os.path.join(bench, "reflect.bpf.c"),
                    "-o", objects["server"]], check=True)
    for count in counts:
        if count % IN_FLIGHT:
            raise SystemExit(f"bench: two-way scale client counts must be multiples of {IN_FLIGHT}, not {count}")
        objects[count] = os.path.join(work, f"rotate-{count}.o")
        subprocess.run(["clang", "-O2", "-g", "-target", "bpf", *include, f"-DCLIENTS={count}", f"-DSTRIDE={IN_FLIGHT}",
                        "-c", os.path.join(bench, "rotate.bpf.c"), "-o", objects[count]], check=True)
    return objects


def attach(topology, obj, endpoints):
    """`obj` at tc ingress of each of `endpoints` (the clients' veth: the rotator; the servers':
    the stamping reflector, which also answers the variant's start-up probe)."""
    for namespace, interface in endpoints:
        topology.ns(namespace, "tc", "qdisc", "add", "dev", interface, "clsact")
        topology.ns(namespace, "tc", "filter", "add", "dev", interface, "ingress", "bpf", "da", "obj", obj, "sec", "tc")


def detach(topology):
    for namespace, interface in topology.endpoint_side:
        topology.ns(namespace, "tc", "qdisc", "del", "dev", interface, "clsact", check=False)


def rotate_counts():
    """The clients' side counters (laps, first, kept, changed), from the loaded rotator's map."""
    entries = json.loads(common.sh("bpftool", "map", "dump", "name", "rotate_counts", "--json"))
    values = {}
    for entry in entries:
        key = entry.get("key")
        key = int.from_bytes(bytes(int(b, 16) for b in key), "little") if isinstance(key, list) else int(key)
        value = entry.get("value")
        values[key] = int.from_bytes(bytes(int(b, 16) for b in value), "little") if isinstance(value, list) else int(value)
    return {name: values.get(index, 0) for index, name in enumerate(("laps", "first", "kept", "changed"))}


def inject(topology):
    """IN_FLIGHT requests from clients 0..IN_FLIGHT-1 (not the clients netns' own addresses:
    IP_TRANSPARENT), each sent once: from then on they lap."""
    script = (f"import socket\n"
              f"for i in range({IN_FLIGHT}):\n"
              f"    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
              f"    s.setsockopt(socket.SOL_IP, 19, 1)  # IP_TRANSPARENT: a source that is not the netns own\n"
              f"    s.bind(('198.19.0.0', 20000 + i))\n"
              f"    s.sendto(b'\\0\\0\\0\\0twoway-scale'.ljust(64, b'.'), ('{twoway.VIP}', {twoway.PORT}))\n"
              f"    s.close()\n")
    subprocess.run([*common.in_namespace(topology.clients), "python3", "-c", script], check=True, timeout=60)


def slab_kib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Slab:"):
                return int(line.split()[1])
    return 0


def tree_rss_kib(pid):
    """RSS of `pid` and its children (nginx's workers), KiB."""
    total = common.rss_kib(pid)
    for child in common.sh("pgrep", "-P", str(pid), check=False).split():
        total += common.rss_kib(int(child))
    return total


def map_bytes(prefix):
    """bytes_memlock of the loaded maps whose name starts with `prefix`."""
    maps = json.loads(common.sh("bpftool", "map", "show", "--json"))
    return sum(m.get("bytes_memlock", 0) for m in maps if m.get("name", "").startswith(prefix))


def cpu_ns(pid):
    """CPU time of every thread of `pid` (schedstat), ns."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass
    return total


def scrape(topology, pid):
    """One GET /metrics of the daemon in the lb netns: seconds taken, the daemon's CPU for it
    (a nat listener counts its associations then), and the two-way series it gave."""
    before, started = cpu_ns(pid), time.monotonic()
    text = topology.ns(topology.lb, "curl", "-sf", f"http://{twoway.Variant.METRICS}/metrics")
    elapsed, cpu = time.monotonic() - started, (cpu_ns(pid) - before) / 1e9
    series = {}
    for line in text.splitlines():
        if line.startswith(("udp_fanout_associations{", "udp_fanout_association_events_total{", "udp_fanout_relay_sessions{")):
            name, _, value = line.rpartition(" ")
            series[name] = float(value)
    return elapsed, cpu, series


class Conntrack:
    """Room for MAX_ASSOCIATIONS (+ 1,024 for the probe's flows) conntrack entries, as udp-fanout
    has: nf_conntrack_max and the hash size (both host-wide) set once for the curve, and put back
    by restore() whatever happened (each file on its own, so one failure does not keep the other
    changed); the lb netns' entries are flushed after each nft point (flush())."""

    MAX = "/proc/sys/net/netfilter/nf_conntrack_max"
    BUCKETS = "/sys/module/nf_conntrack/parameters/hashsize"
    ROOM = MAX_ASSOCIATIONS + 1024

    def __init__(self, topology):
        self.topology = topology
        self.saved = {}
        if not os.path.exists(self.MAX):
            # nftables' nat loads nf_conntrack too; without it loaded nothing here can be set.
            if shutil.which("modprobe"):
                subprocess.run(["modprobe", "nf_conntrack"], check=False, capture_output=True)
            if not os.path.exists(self.MAX):
                raise SystemExit(f"bench: {self.MAX} is missing: load nf_conntrack (modprobe nf_conntrack) for the nftables peer")
        try:
            for path in (self.BUCKETS, self.MAX):
                with open(path) as f:
                    self.saved[path] = f.read().strip()
                with open(path, "w") as f:
                    f.write(str(self.ROOM))
            # A kernel with a per-netns limit gives the lb netns its own: it must have the room too.
            inside = int(topology.ns(topology.lb, "sysctl", "-n", "net.netfilter.nf_conntrack_max").strip() or 0)
            if inside < self.ROOM:
                topology.ns(topology.lb, "sysctl", "-qw", f"net.netfilter.nf_conntrack_max={self.ROOM}", check=False)
                inside = int(topology.ns(topology.lb, "sysctl", "-n", "net.netfilter.nf_conntrack_max").strip() or 0)
            if inside < self.ROOM:
                raise SystemExit(f"bench: the lb netns' nf_conntrack_max is {inside}, below the {self.ROOM} the comparison gives nftables")
        except BaseException:
            self.restore()
            raise

    def flush(self):
        self.topology.ns(self.topology.lb, "conntrack", "-F", check=False)

    def restore(self):
        for path, value in self.saved.items():
            try:
                with open(path, "w") as f:
                    f.write(value)
            except OSError as error:
                print(f"bench: could not put {path} back to {value}: {error}", flush=True)
        self.saved = {}


# Each curve's variants: the two-way benchmark's variant and its options here.
VARIANTS = {
    "relay": ("relay", lambda clients: {"settings": f"max_sessions: {max(2 * clients, 1024)}"}),
    # A session per client (no proxy_responses: it ends after proxy_timeout of silence), and room
    # for the most clients of the curve at every point (nginx allocates its worker_connections at
    # start: the same room everywhere, so the memory slope is the sessions').
    "nginx-1": ("nginx-1", lambda clients: {"nginx_session": "proxy_timeout 600s;", "nginx_connections": 4 * max(RELAY_CLIENTS) + 1024}),
    "tc_ebpf nat": ("tc_ebpf nat", lambda clients: {}),
    "tc_ebpf nat, source_ip": ("tc_ebpf nat", lambda clients: {"listener_lines": "    balancing: source_ip\n"}),
    "nft conntrack": ("nft conntrack", lambda clients: {}),
}
# Below this many round trips/s a point has collapsed (its datagrams were dropped as they lapped).
COLLAPSED = 1000


def point(topology, objects, name, clients, work, conntrack=None):
    """One variant at one client count, the LB on CPU 1 alone: its report (`conntrack`: the
    curve's Conntrack, flushed after an nft point)."""
    variant_name, options = VARIANTS[name]
    slab_before = slab_kib()
    variant = None
    quiet = common.background()
    try:
        attach(topology, objects["server"], topology.endpoint_side[1:])
        variant = twoway.Variant(variant_name, topology, work, split=True, **options(clients))
        attach(topology, objects[clients], topology.endpoint_side[:1])
        inject(topology)
        started = time.monotonic()
        warm = None
        while True:
            counts = rotate_counts()
            if counts["laps"] >= clients + IN_FLIGHT:
                warm = time.monotonic() - started
                break
            if time.monotonic() - started > WARM_LIMIT:
                break
            time.sleep(0.2)
        before = rotate_counts()
        _, elapsed, busy = common.busy_during(lambda: time.sleep(SECONDS))
        after = rotate_counts()
        time.sleep(0.4)
        end_rate = (rotate_counts()["laps"] - after["laps"]) / 0.4
        laps = after["laps"] - before["laps"]
        rss = tree_rss_kib(variant.proc.pid) if variant.proc else 0
        maps = map_bytes("fanout") if variant_name.endswith("nat") else 0
        association_map = map_bytes("fanout_assoc_") if variant_name.endswith("nat") else 0
        slab = slab_kib() - slab_before
        # A nat listener's association count is what a scrape may cost (a relay's worker would be in the CPU read).
        scraped = scrape(topology, variant.proc.pid) if variant_name.endswith("nat") else None
    finally:
        detach(topology)
        if variant:
            variant.stop()
        if conntrack and variant_name == "nft conntrack":
            conntrack.flush()
    lb = max(0.0, busy[1] - quiet[1] * elapsed)
    rate = laps / elapsed
    seen = {k: after[k] - before[k] for k in ("first", "kept", "changed")}
    return {"clients": clients, "warm_s": warm, "round_trips_per_sec": rate,
            "lb_ns_per_round_trip": lb * 1e9 / laps if laps >= COLLAPSED * elapsed else float("nan"),
            "lb_busy": lb / elapsed, "end_rate_ratio": end_rate / max(rate, 1e-9), "seen": seen, "rss_kib": rss,
            "map_bytes": maps, "association_map_bytes": association_map, "slab_kib": slab, "scrape": scraped}


class ScaleTopology(twoway.Topology):
    """The two-way topology, plus the clients' network routed to the clients' veth."""

    def _build(self, tag):
        super()._build(tag)
        common.sh("ip", "-n", self.lb, "route", "add", CLIENT_NET, "via", "198.18.0.2")


def curve(topology, objects, work, names, counts, only_beyond=(), conntrack=None):
    """{variant: {count: [report per run]}}, variants and counts alternated run by run; the
    variants in `only_beyond` run only where the clients outnumber max_associations."""
    results = {v: {} for v in names}
    for run in range(common.RUNS):
        for count in (counts if run % 2 == 0 else counts[::-1]):
            for name in (names if run % 2 == 0 else names[::-1]):
                if name in only_beyond and count <= MAX_ASSOCIATIONS:
                    continue
                report = point(topology, objects, name, count, work, conntrack)
                results[name].setdefault(count, []).append(report)
                print(f"bench: two-way scale, {name}, {count:,} clients: {report['round_trips_per_sec']:,.0f} rt/s,"
                      f" {report['lb_ns_per_round_trip']:,.0f} ns of LB CPU per round trip, warm-up {report['warm_s']},"
                      f" clients saw {report['seen']}", flush=True)
    return results


def fmt_kib(kib):
    return f"{kib / 1024:,.1f} MiB"


def fmt_ns(values):
    """median (min-max) ns, or what a collapsed point did."""
    if any(v != v for v in values):  # NaN: collapsed in a run
        return "collapsed"
    m = common.spread(values)
    return f"{m[0]:,.0f} ns ({m[1]:,.0f}-{m[2]:,.0f})"


def seen(runs):
    """What the clients saw over the measured seconds: the share of replies whose server was the
    client's previous one (kept), another one (changed), or its first."""
    total = {k: sum(r["seen"][k] for r in runs) for k in ("first", "kept", "changed")}
    replies = sum(total.values())
    if not replies:
        return "no replies"
    return f"kept {total['kept'] / replies:.1%}, changed {total['changed'] / replies:.1%}, first {total['first'] / replies:.1%}"


def warm(runs):
    done = [r["warm_s"] for r in runs if r["warm_s"] is not None]
    return f"{max(done):.1f} s" if len(done) == len(runs) else f"NOT every client reached in {WARM_LIMIT:.0f} s"


def series_name(line):
    """"association_events_total evicted" for udp_fanout_association_events_total{...,event="evicted"}."""
    name = line.split("{")[0].removeprefix("udp_fanout_")
    return name + (" " + line.split('event="')[1].split('"')[0] if 'event="' in line else "")


def rows_for(kind, results, ours, peer, counts, plot, extra=()):
    """The rows of one curve: per count ours beside the peer (LB CPU per round trip, rate, what
    the clients saw), ours against its smallest count, memory and its slope per client; `extra`
    variants (run where they ran) get rows of their own."""
    out = []
    base = common.spread([r["lb_ns_per_round_trip"] for r in results[ours][counts[0]]])[0]
    for count in counts:
        mine, theirs = results[ours][count], results[peer][count]
        ratios = [o["lb_ns_per_round_trip"] / q["lb_ns_per_round_trip"] for o, q in zip(mine, theirs)]
        ratio = "-" if any(r != r for r in ratios) else "{:.2f} ({:.2f}-{:.2f})".format(*common.spread(ratios))
        rate_m = common.spread([r["round_trips_per_sec"] for r in mine])[0]
        rate_p = common.spread([r["round_trips_per_sec"] for r in theirs])[0]
        own = common.spread([r["lb_ns_per_round_trip"] for r in mine])[0]
        goal = "" if count > MAX_ASSOCIATIONS else " (goal <= 1.3)"
        out.append((f"scale: two-way {kind}, LB CPU per round trip, {count:,} clients", peer, fmt_ns([r["lb_ns_per_round_trip"] for r in mine]),
                    fmt_ns([r["lb_ns_per_round_trip"] for r in theirs]), ratio,
                    f"x{own / base:.2f} of ours at {counts[0]:,}{goal}; rt/s ours {rate_m:,.0f}, peer {rate_p:,.0f};"
                    f" clients saw: ours {seen(mine)}, peer {seen(theirs)}; warm-up ours {warm(mine)}, peer {warm(theirs)}"))
    for name in extra:
        for count, runs in sorted(results[name].items()):
            rate = common.spread([r["round_trips_per_sec"] for r in runs])[0]
            out.append((f"scale: two-way {kind}, LB CPU per round trip, {count:,} clients, {name}", "-",
                        fmt_ns([r["lb_ns_per_round_trip"] for r in runs]), "-", "-",
                        f"rt/s {rate:,.0f}; clients saw {seen(runs)}; warm-up {warm(runs)}"))

    for count in counts:
        scrapes = [r["scrape"] for r in results[ours][count] if r["scrape"]]
        if scrapes:
            wall = common.spread([w for w, _, _ in scrapes])
            cpu = common.spread([c for _, c, _ in scrapes])
            shown = "; ".join(f"{series_name(k)} {v:,.0f}" for k, v in sorted(scrapes[-1][2].items())
                              if "associations{" in k or 'event="evicted"' in k)
            out.append((f"scale: two-way {kind}, GET /metrics at {count:,} clients, {ours}", "-",
                        f"{wall[0] * 1000:,.0f} ms ({wall[1] * 1000:,.0f}-{wall[2] * 1000:,.0f})", f"daemon CPU {cpu[0] * 1000:,.0f} ms", "-",
                        f"one scrape under load (the last run's series: {shown})"))

    def memory(name, count):
        runs = results[name][count]
        return (common.spread([r["rss_kib"] for r in runs])[0], common.spread([r["map_bytes"] for r in runs])[0] / 1024,
                common.spread([r["slab_kib"] for r in runs])[0])
    largest = max(c for c in counts if c <= MAX_ASSOCIATIONS)
    for name in (ours, peer):
        low, high = memory(name, counts[0]), memory(name, largest)
        per = [(h - l) * 1024 / (largest - counts[0]) for l, h in zip(low, high)]
        association = common.spread([r["association_map_bytes"] for r in results[name][largest]])[0]
        allocated = f"; the association map ({MAX_ASSOCIATIONS:,} entries, allocated at start) {association / MAX_ASSOCIATIONS:,.0f} B per entry" if association else ""
        out.append((f"scale: two-way {kind}, memory at {largest:,} clients, {name}", "-",
                    f"RSS {fmt_kib(high[0])}, BPF maps {fmt_kib(high[1])}, kernel slab +{fmt_kib(high[2])}", "-", "-",
                    f"per client (slope from {counts[0]:,}): RSS {per[0]:,.0f} B, maps {per[1]:,.0f} B, slab {per[2]:,.0f} B{allocated}"))
    curves = []
    for name in (ours, peer):
        spreads = [common.spread([r["lb_ns_per_round_trip"] for r in results[name][c]]) for c in counts]
        curves.append((name, [s[0] for s in spreads], [(s[1], s[2]) for s in spreads]))
    out.append((f"scale: plot, two-way {kind}", "-", plot(curves), "-", "-", "median and min-max of the runs; a collapsed point is not drawn"))
    return out


PARTS = os.environ.get("BENCH_SCALE_TWOWAY", "relay,nat").split(",")


def rows(work, plot):
    """The two-way curves; `plot(name, title, xlabel, ylabel, curves, xs)` draws one into docs/."""
    for tool in ("nginx", "nft", "conntrack"):
        if not subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode == 0:
            raise SystemExit(f"{tool} is not installed: run make bench (its setup installs nginx, nftables and conntrack as root)")
    counts = sorted(set((RELAY_CLIENTS if "relay" in PARTS else []) + (NAT_CLIENTS if "nat" in PARTS else [])))
    objects = build_objects(work, counts)
    # tc loading the reflectors makes /sys/fs/bpf/tc/globals (and ip, xdp links): removed after if made here.
    made_pin_dirs = not os.path.exists("/sys/fs/bpf/tc")
    topology = ScaleTopology()
    affinity = os.sched_getaffinity(0)
    out = []
    try:
        os.sched_setaffinity(0, {0})
        topology.split(True)
        print(f"bench: two-way scale: {IN_FLIGHT} datagrams lapping through reflectors, clients rotating;"
              f" relay {RELAY_CLIENTS}, nat {NAT_CLIENTS}; {SECONDS:g} s per point after a warm-up; {common.RUNS} runs", flush=True)
        if "relay" in PARTS:
            results = curve(topology, objects, work, ["relay", "nginx-1"], RELAY_CLIENTS)
            out += rows_for("relay", results, "relay", "nginx-1", RELAY_CLIENTS,
                            lambda curves: plot("twoway-relay", "two-way relay: LB CPU per round trip", "concurrent clients",
                                                "ns of CPU 1 per round trip", curves, RELAY_CLIENTS))
        if "nat" in PARTS:
            beyond = ["tc_ebpf nat, source_ip"]
            conntrack = Conntrack(topology)
            try:
                results = curve(topology, objects, work, ["tc_ebpf nat", "nft conntrack", *beyond], NAT_CLIENTS, only_beyond=beyond,
                                conntrack=conntrack)
            finally:
                conntrack.restore()
            out += rows_for("nat", results, "tc_ebpf nat", "nft conntrack", NAT_CLIENTS,
                            lambda curves: plot("twoway-nat", "two-way nat: LB CPU per round trip", "concurrent clients",
                                                "ns of CPU 1 per round trip", curves, NAT_CLIENTS), extra=beyond)
    finally:
        topology.split(False)
        topology.destroy()
        os.sched_setaffinity(0, affinity)
        if made_pin_dirs:
            twoway.remove_iproute2_pin_dirs()
    return out
