# SPDX-License-Identifier: Apache-2.0
"""QUIC-LB benchmarks for make bench (bench.py quic): the cost of routing by connection ID next to
source-IP balancing, on the same QUIC short-header packets (publisher --quic), in one run.
- udp-fanout userspace (one worker): CPU per datagram forwarded, quic_lb plaintext, four-pass and
  single-pass AES against balancing: source_ip alone.
- ReusePortLB: ns per run of the sk_reuseport program in a QUIC-LB group against a plain
  source-IP group (kernel.bpf_stats_enabled), members joined through the C API.
- af_xdp: the daemon's CPU per datagram (its forwarder decodes the IDs) in the same topology with
  two RX queues, the same variants.
- tc_ebpf and xdp: ns per run of fanout_tc / fanout_xfwd (kernel.bpf_stats_enabled) forwarding the
  same QUIC packets through a namespace topology (client, proxy, three backends), quic_lb
  plaintext, four-pass and single-pass (the kernel's crypto kfuncs) against source_ip alone."""
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time

import bench_common as common

DATAGRAMS = int(os.environ.get("BENCH_QUIC_DATAGRAMS", "400000"))
KEY = "8f95f09245765f80256934e50c66207f"
# Variant: (quic_lb layout or None, the publisher's --quic layout, server IDs)
VARIANTS = {
    "source_ip": (None, "2:6:1", ["0a01", "0a02", "0a03"]),
    "plaintext": ("{config_id: 1, server_id_length: 2, nonce_length: 6}", "2:6:1", ["0a01", "0a02", "0a03"]),
    "four-pass": (f"{{config_id: 1, server_id_length: 2, nonce_length: 6, key: {KEY}}}", f"2:6:1:{KEY}", ["0a01", "0a02", "0a03"]),
    "single-pass": (f"{{config_id: 1, server_id_length: 8, nonce_length: 8, key: {KEY}}}", f"8:8:1:{KEY}",
                    ["0a0a0a0a0a0a0a01", "0a0a0a0a0a0a0a02", "0a0a0a0a0a0a0a03"]),
}


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fanout_run(variant, work):
    """CPU ns per datagram of a one-worker userspace listener forwarding QUIC packets to 3 sinks."""
    quic, layout, server_ids = VARIANTS[variant]
    ports = [common.free_port() for _ in range(3)]
    sinks = [common.Collectors(port, "automatic", count=1) for port in ports]
    listen = common.free_port()
    downstreams = "\n".join(f'      - {{address: "127.0.0.1:{p}", server_id: "{sid}"}}' if quic else f'      - {{address: "127.0.0.1:{p}"}}'
                            for p, sid in zip(ports, server_ids))
    config = (f'listeners:\n  - name: quic\n    bind: "127.0.0.1:{listen}"\n    balancing: source_ip\n'
              + (f"    quic_lb: {quic}\n" if quic else "")
              + "    settings: {workers: 1, batch_size: 64, recv_buf_size: 16777216}\n    downstream:\n" + downstreams + "\n")
    path = os.path.join(work, f"quic-{variant}.yaml")
    with open(path, "w") as f:
        f.write(config)
    log = os.path.join(work, f"quic-{variant}.log")
    with open(log, "w") as stderr:
        proc = subprocess.Popen([f"{common.BIN}/udp-fanout", "-c", path], stderr=stderr)
    try:
        deadline = time.time() + 20
        while "entering receive loop" not in open(log).read():
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"udp-fanout did not start ({variant}): {open(log).read()}")
            time.sleep(0.05)
        before = cpu_seconds(proc.pid)
        common.publish(listen, count=DATAGRAMS, extra=("--quic", layout, "--server-ids", ",".join(server_ids), "--rate", "200000"))
        time.sleep(0.3)
        used = cpu_seconds(proc.pid) - before
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    reports = [group.stop()[0] for group in sinks]
    received = sum(r["received"] for r in reports)
    # With quic_lb each sink gets its own server ID's share: a third each.
    spread = [r["received"] / max(received, 1) for r in reports]
    return {"ns": used * 1e9 / max(received, 1), "delivered": received / DATAGRAMS, "shares": spread}


class Group:
    """Three members of a ReusePortLB group on one port, joined through the C API (never read:
    the program runs before the socket queue)."""

    class QUIC(ctypes.Structure):
        _fields_ = [("config_id", ctypes.c_uint8), ("server_id_length", ctypes.c_uint8), ("nonce_length", ctypes.c_uint8),
                    ("key", ctypes.c_void_p)]

    def __init__(self, port, quic):
        lib = ctypes.CDLL(f"{common.BIN}/libreuseportlb.so")
        member_p = ctypes.POINTER(ctypes.c_void_p)
        lib.reuseportlb_join.argtypes = [ctypes.c_char_p, ctypes.c_uint16, ctypes.c_int, ctypes.c_uint, ctypes.c_int, member_p,
                                         ctypes.c_char_p, ctypes.c_size_t]
        lib.reuseportlb_join_quic.argtypes = [ctypes.c_char_p, ctypes.c_uint16, ctypes.c_int, ctypes.c_uint, ctypes.c_int,
                                              ctypes.POINTER(Group.QUIC), ctypes.POINTER(ctypes.c_uint8), member_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.reuseportlb_leave.argtypes = [ctypes.c_void_p]
        self.lib = lib
        self.members = []
        error = ctypes.create_string_buffer(1024)
        layout = Group.QUIC(1, 2, 6, None)
        for slot in range(3):
            member = ctypes.c_void_p()
            if quic:
                sid = (ctypes.c_uint8 * 2)(0x0a, slot + 1)
                code = lib.reuseportlb_join_quic(b"127.0.0.1", port, slot, 3, 0, ctypes.byref(layout), sid, ctypes.byref(member), error, 1024)
            else:
                code = lib.reuseportlb_join(b"127.0.0.1", port, slot, 3, 0, ctypes.byref(member), error, 1024)
            if code < 0:
                self.leave()
                raise SystemExit(f"join: {error.value.decode()}")
            self.members.append(member)

    def leave(self):
        for member in self.members:
            self.lib.reuseportlb_leave(member)


def program_run(quic):
    port = common.free_port()
    group = Group(port, quic)
    try:
        with common.BPFStats():
            common.publish(port, count=DATAGRAMS, extra=("--quic", "2:6:1", "--server-ids", "0a01,0a02,0a03"))
            return common.ns_per_run(["name", "rplb_select"])[0]
    finally:
        group.leave()


KERNEL_DATAGRAMS = int(os.environ.get("BENCH_QUIC_KERNEL_DATAGRAMS", "200000"))
KERNEL_RUNS = int(os.environ.get("BENCH_QUIC_KERNEL_RUNS", "3"))


def quic_outcomes(topology, metrics):
    """udp_fanout_quic_lb_datagrams_total by outcome, from the daemon in the proxy namespace."""
    text = topology.ns(topology.proxy, "curl", "-s", f"http://127.0.0.1:{metrics}/metrics")
    return {line.split('outcome="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("udp_fanout_quic_lb_datagrams_total{")}


def expect_routed(outcomes, what):
    """Every datagram carries a server's ID: a quic_lb variant that did not route every one it
    counted would measure something else (a wrong key falls back to source_ip, unknown_server_id)."""
    if outcomes.get("routed", 0) == 0 or outcomes.get("routed", 0) < sum(outcomes.values()):
        raise SystemExit(f"bench: {what}: not every datagram routed by ID: {outcomes}")


def kernel_downstreams(quic, server_ids):
    return "\n".join((f'      - {{name: b{n}, address: "198.18.{n}.2:6000", server_id: "{sid}"}}' if quic else
                      f'      - {{name: b{n}, address: "198.18.{n}.2:6000"}}')
                     for n, sid in zip(range(1, common.BACKENDS + 1), server_ids))


def kernel_run(topology, work, kind, variant):
    """ns per run of the kind's program forwarding QUIC short-header packets to 3 backends."""
    quic, layout, server_ids = VARIANTS[variant]
    downstreams = kernel_downstreams(quic, server_ids)
    path = os.path.join(work, f"quic-{kind}-{variant}.yaml")
    metrics = 19090  # inside the proxy namespace: its own loopback
    with open(path, "w") as f:
        f.write(f'listeners:\n  - name: quic\n    bind: "198.18.0.1:5514"\n    interface: {topology.proxy_if}\n'
                f"    mode: {kind}\n    balancing: source_ip\n" + (f"    quic_lb: {quic}\n" if quic else "")
                + f"    downstream:\n{downstreams}\n" + f'metrics: {{enabled: true, bind: "127.0.0.1:{metrics}"}}\n')
    proc = subprocess.Popen([*common.in_namespace(topology.proxy), f"{common.BIN}/udp-fanout", "-c", path], stderr=subprocess.PIPE, text=True)
    try:
        while True:
            line = proc.stderr.readline()
            if not line:
                raise SystemExit(f"udp-fanout ({kind}, {variant}) exited")
            if "registered listener in eBPF map" in line:
                break
        program = "fanout_tc" if kind == "tc_ebpf" else "fanout_xfwd"
        before = topology.delivered()
        with common.BPFStats():
            common.publish_in(topology, ("198.18.0.1", 5514), KERNEL_DATAGRAMS,
                              ("--quic", layout, "--server-ids", ",".join(server_ids), "--rate", "200000"))
            time.sleep(0.2)
            cost, runs = common.ns_per_run(["name", program])
        delivered = topology.delivered() - before
        outcomes = quic_outcomes(topology, metrics)
    finally:
        common.stop_process(proc)
    if quic:
        expect_routed(outcomes, f"{kind} {variant}")
    return {"ns": cost, "delivered": delivered / KERNEL_DATAGRAMS}


def afxdp_run(topology, work, variant):
    """CPU ns per datagram of an af_xdp listener (its forwarder decodes the IDs) forwarding QUIC
    short-header packets to 3 backends: the daemon's utime + stime over what the backends got."""
    quic, layout, server_ids = VARIANTS[variant]
    downstreams = kernel_downstreams(quic, server_ids)
    path = os.path.join(work, f"quic-af_xdp-{variant}.yaml")
    metrics = 19091
    with open(path, "w") as f:
        f.write(f'listeners:\n  - name: quic\n    bind: "198.18.0.1:5514"\n    interface: {topology.proxy_if}\n'
                f"    mode: af_xdp\n    settings: {{output: socket, batch_size: 64}}\n    balancing: source_ip\n"
                + (f"    quic_lb: {quic}\n" if quic else "") + f"    downstream:\n{downstreams}\n"
                + f'metrics: {{enabled: true, bind: "127.0.0.1:{metrics}"}}\n')
    log = os.path.join(work, f"quic-af_xdp-{variant}.log")
    with open(log, "w") as stderr:
        proc = subprocess.Popen([*common.in_namespace(topology.proxy), f"{common.BIN}/udp-fanout", "-c", path], stderr=stderr)
    try:
        deadline = time.time() + 20
        while "AF_XDP path initialized" not in open(log).read():
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"udp-fanout (af_xdp, {variant}) did not start: {open(log).read()[-2000:]}")
            time.sleep(0.05)
        time.sleep(0.3)
        before, cpu = topology.delivered(), cpu_seconds(proc.pid)
        common.publish_in(topology, ("198.18.0.1", 5514), KERNEL_DATAGRAMS,
                          ("--quic", layout, "--server-ids", ",".join(server_ids), "--rate", "200000"))
        time.sleep(0.3)
        cpu = cpu_seconds(proc.pid) - cpu
        delivered = topology.delivered() - before
        outcomes = quic_outcomes(topology, metrics)
    finally:
        common.stop_process(proc)
    if quic:
        expect_routed(outcomes, f"af_xdp {variant}")
    return {"ns": cpu * 1e9 / max(delivered, 1), "delivered": delivered / KERNEL_DATAGRAMS}


def afxdp_rows(work):
    out = []
    topology = common.Topology(queues=2)
    try:
        names = list(VARIANTS)
        results = {name: [] for name in names}
        for run in range(KERNEL_RUNS):
            for name in (names if run % 2 == 0 else list(reversed(names))):
                results[name].append(afxdp_run(topology, work, name))
        base = results["source_ip"]
        peer = common.spread([r["ns"] for r in base])
        for name in names[1:]:
            mine = common.spread([r["ns"] for r in results[name]])
            ratios = common.spread([m["ns"] / b["ns"] for m, b in zip(results[name], base)])
            out.append((f"quic_lb {name}: af_xdp CPU per datagram", "balancing source_ip, same packets",
                        f"{mine[0]:,.0f} ns ({mine[1]:,.0f}-{mine[2]:,.0f})", f"{peer[0]:,.0f} ns ({peer[1]:,.0f}-{peer[2]:,.0f})",
                        f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})",
                        f"the daemon's utime+stime; 2 RX queues; {KERNEL_DATAGRAMS} datagrams x {KERNEL_RUNS} runs; delivered {min(r['delivered'] for r in results[name]):.4f}"))
    finally:
        topology.destroy()
    return out


def xdp_ends(topology, on):
    """GRO on the backends' veth ends and the client's checksums computed (tx off): XDP transmits."""
    for backend, inner in zip(topology.backends, topology.backend_ifs):
        topology.ns(backend, "ethtool", "-K", inner, "gro", "on" if on else "off")
    topology.ns(topology.client, "ethtool", "-K", f"cp{topology.proxy_if[2:]}", "tx", "off" if on else "on")


def kernel_rows(work):
    out = []
    topology = common.Topology()
    try:
        for kind in ("tc_ebpf", "xdp"):
            if kind == "xdp":
                xdp_ends(topology, True)
            names = list(VARIANTS)
            results = {name: [] for name in names}
            for run in range(KERNEL_RUNS):
                for name in (names if run % 2 == 0 else list(reversed(names))):
                    results[name].append(kernel_run(topology, work, kind, name))
            base = results["source_ip"]
            peer = common.spread([r["ns"] for r in base])
            for name in names[1:]:
                mine = common.spread([r["ns"] for r in results[name]])
                ratios = common.spread([m["ns"] / b["ns"] for m, b in zip(results[name], base)])
                program = "fanout_tc" if kind == "tc_ebpf" else "fanout_xfwd"
                out.append((f"quic_lb {name}: {kind} program cost {program}", "balancing source_ip, same packets",
                            f"{mine[0]:.1f} ns/run ({mine[1]:.1f}-{mine[2]:.1f})", f"{peer[0]:.1f} ns/run ({peer[1]:.1f}-{peer[2]:.1f})",
                            f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})",
                            f"kernel.bpf_stats_enabled; {KERNEL_DATAGRAMS} datagrams x {KERNEL_RUNS} runs; delivered {min(r['delivered'] for r in results[name]):.4f}"))
    finally:
        topology.destroy()
    return out


def rows():
    work = tempfile.mkdtemp(prefix="rplb-quic-bench-")
    try:
        print(f"bench: QUIC-LB, {common.RUNS} runs per variant, alternated; {DATAGRAMS} QUIC short-header datagrams of 64 bytes"
              f" from 240 sources per run (publisher --quic, 200,000/s), 3 downstreams", flush=True)
        names = list(VARIANTS)
        results = {name: [] for name in names}
        for run in range(common.RUNS):
            for name in (names if run % 2 == 0 else list(reversed(names))):
                results[name].append(fanout_run(name, work))
        out = []
        base = results["source_ip"]
        peer = common.spread([r["ns"] for r in base])
        for name in names[1:]:
            mine = common.spread([r["ns"] for r in results[name]])
            ratios = common.spread([m["ns"] / b["ns"] for m, b in zip(results[name], base)])
            shares = "/".join(f"{s:.2f}" for s in results[name][0]["shares"])
            out.append((f"quic_lb {name}: udp-fanout CPU per datagram", "balancing source_ip, same packets",
                        f"{mine[0]:,.0f} ns ({mine[1]:,.0f}-{mine[2]:,.0f})", f"{peer[0]:,.0f} ns ({peer[1]:,.0f}-{peer[2]:,.0f})",
                        f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})",
                        f"userspace, 1 worker; shares by server ID {shares}; delivered {min(r['delivered'] for r in results[name]):.4f}"))
        quic, plain = [], []
        for run in range(common.RUNS):
            for variant in ((True, False) if run % 2 == 0 else (False, True)):
                (quic if variant else plain).append(program_run(variant))
        mine, peer = common.spread(quic), common.spread(plain)
        ratios = common.spread([q / p for q, p in zip(quic, plain)])
        out.append(("ReusePortLB QUIC-LB group: rplb_select", "plain source-IP group, same packets",
                    f"{mine[0]:.1f} ns/run ({mine[1]:.1f}-{mine[2]:.1f})", f"{peer[0]:.1f} ns/run ({peer[1]:.1f}-{peer[2]:.1f})",
                    f"{ratios[0]:.2f} ({ratios[1]:.2f}-{ratios[2]:.2f})", "kernel.bpf_stats_enabled; 3 members, plaintext 2-octet server IDs"))
        out += kernel_rows(work)
        out += afxdp_rows(work)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)
