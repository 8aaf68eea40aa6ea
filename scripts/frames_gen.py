#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The frame-sourced benchmark's traffic generator (make bench only; run by bench_frames.py in the
client's netns, pinned to one CPU): BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES runs the
pinned XDP program `program` (bench/frames.bpf.c frames_gen) on copies of one 64-byte IPv4 UDP
frame (written into the pinned map TEMPLATE, which the program copies over each page) as if
received on `ifname`; its XDP_TX transmits each out of that veth, so the peer (the
load balancer's veth) receives XDP frames, as from a NIC's receive ring (xdp-trafficgen's way; the
Debian build of xdp-trafficgen 1.3.1 does not load on this kernel).

    frames_gen.py PROGRAM TEMPLATE IFNAME DST_MAC SRC_MAC SRC_IP DST_IP DST_PORT MAX_FRAMES MAX_SECONDS [RATE]

RATE (frames/s): the program transmits one frame per 1/RATE s and drops the others at once
(frames_pace, next to TEMPLATE); without it (or 0), as fast as the CPU runs.
Bounded: stops after MAX_FRAMES frames run (sent or paced out) or MAX_SECONDS seconds, whichever comes first, or at
SIGTERM; prints the frames it ran as JSON."""
import ctypes
import json
import os
import re
import signal
import socket
import struct
import sys
import time

LIBC = ctypes.CDLL(None, use_errno=True)
BPF_MAP_UPDATE_ELEM, BPF_OBJ_GET, BPF_PROG_TEST_RUN = 2, 7, 10
BPF_F_TEST_XDP_LIVE_FRAMES = 1 << 1
CHUNK = 1 << 20  # frames per test run call: a signal or the time bound is seen between calls
BATCH = int(os.environ.get("FRAMES_GEN_BATCH", "256"))  # frames per batch: the most the kernel takes


# __NR_bpf: x86_64's, or aarch64's.
BPF_SYSCALL = {"x86_64": 321, "aarch64": 280}.get(os.uname().machine)


def bpf(command, attr):
    if BPF_SYSCALL is None:
        raise SystemExit(f"frames_gen: the bpf system call's number on {os.uname().machine} is not known here (x86_64, aarch64)")
    buffer = ctypes.create_string_buffer(attr, 128)
    result = LIBC.syscall(BPF_SYSCALL, command, buffer, 128)
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"bpf({command}): {os.strerror(error)}")
    return result


def checksum(header):
    total = sum(struct.unpack("!10H", header))
    total = (total & 0xFFFF) + (total >> 16)
    total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def frame(dst_mac, src_mac, src_ip, dst_ip, dst_port):
    payload = b"frames-bench".ljust(22, b".")
    udp = struct.pack("!HHHH", 20000, dst_port, 8 + len(payload), 0) + payload  # checksum 0: none (IPv4)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0x4000, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(src_ip), socket.inet_aton(dst_ip))
    ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
    mac = lambda text: bytes(int(part, 16) for part in text.split(":"))
    return mac(dst_mac) + mac(src_mac) + struct.pack("!H", 0x0800) + ip + udp


def pinned(path):
    """The descriptor of the pinned program or map at `path`."""
    name = ctypes.create_string_buffer(path.encode())
    try:
        return bpf(BPF_OBJ_GET, struct.pack("QII", ctypes.addressof(name), 0, 0))
    except OSError as error:
        raise SystemExit(f"frames_gen: {path}: {os.strerror(error.errno)} (pin bench/frames.bpf.c with bpftool prog loadall ... pinmaps ...)")


def arguments(argv):
    """The arguments, checked: what is wrong and the usage line, and exit 1, if any is."""
    usage = __doc__.split("\n\n")[1].strip()
    if len(argv) not in (10, 11) or argv[0] in ("-h", "--help"):
        raise SystemExit(f"usage: {usage}")
    program, template, ifname, dst_mac, src_mac, src_ip, dst_ip, dst_port, max_frames, max_seconds = argv[:10]
    problems = []
    for label, text in (("DST_MAC", dst_mac), ("SRC_MAC", src_mac)):
        if not re.fullmatch(r"[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}", text):
            problems.append(f"{label} {text!r} is not a MAC address (aa:bb:cc:dd:ee:ff)")
    for label, text in (("SRC_IP", src_ip), ("DST_IP", dst_ip)):
        try:
            socket.inet_pton(socket.AF_INET, text)
        except OSError:
            problems.append(f"{label} {text!r} is not a dotted IPv4 address")
    numbers = {}
    for label, text, low, high in (("DST_PORT", dst_port, 1, 65535), ("MAX_FRAMES", max_frames, 1, 1 << 40),
                                   ("MAX_SECONDS", max_seconds, 0.001, 3600), ("RATE", argv[10] if len(argv) > 10 else "0", 0, 1e9)):
        try:
            numbers[label] = float(text)
        except ValueError:
            numbers[label] = float("nan")
        if not low <= numbers[label] <= high:
            problems.append(f"{label} {text!r} is not a number from {low:g} to {high:g}")
    try:
        socket.if_nametoindex(ifname)
    except OSError:
        problems.append(f"IFNAME {ifname!r}: no such interface in this network namespace")
    if problems:
        raise SystemExit("frames_gen: " + "; ".join(problems) + f"\nusage: {usage}")
    return (program, template, ifname, dst_mac, src_mac, src_ip, dst_ip, int(numbers["DST_PORT"]), int(numbers["MAX_FRAMES"]),
            numbers["MAX_SECONDS"], numbers["RATE"])


def main():
    program, template, ifname, dst_mac, src_mac, src_ip, dst_ip, dst_port, max_frames, max_seconds, rate = arguments(sys.argv[1:])
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    fd = pinned(program)
    data = frame(dst_mac, src_mac, src_ip, dst_ip, dst_port)
    map_fd = pinned(template)
    key, value = ctypes.create_string_buffer(4), ctypes.create_string_buffer(data, len(data))
    bpf(BPF_MAP_UPDATE_ELEM, struct.pack("IIQQQ", map_fd, 0, ctypes.addressof(key), ctypes.addressof(value), 0))
    pace_fd = pinned(os.path.join(os.path.dirname(template), "frames_pace"))
    pace = ctypes.create_string_buffer(struct.pack("QQ", int(1e9 / rate) if rate else 0, 0), 16)
    bpf(BPF_MAP_UPDATE_ELEM, struct.pack("IIQQQ", pace_fd, 0, ctypes.addressof(key), ctypes.addressof(pace), 0))
    data_in = ctypes.create_string_buffer(data, len(data))
    # struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
    ctx = ctypes.create_string_buffer(struct.pack("6I", 0, len(data), 0, socket.if_nametoindex(ifname), 0, 0), 24)
    ran, started = 0, time.monotonic()
    deadline = started + max_seconds
    while not stop and ran < max_frames and time.monotonic() < deadline:
        repeat = min(CHUNK, max_frames - ran)
        # union bpf_attr's test: prog_fd, retval, data_size_in, data_size_out, data_in, data_out,
        # repeat, duration, ctx_size_in, ctx_size_out, ctx_in, ctx_out, flags, cpu, batch_size.
        attr = struct.pack("IIIIQQIIIIQQIII", fd, 0, len(data), 0, ctypes.addressof(data_in), 0, repeat, 0,
                           24, 0, ctypes.addressof(ctx), 0, BPF_F_TEST_XDP_LIVE_FRAMES, 0, BATCH)
        try:
            bpf(BPF_PROG_TEST_RUN, attr)
        except OSError as error:
            if error.errno == 4 and stop:  # EINTR: SIGTERM arrived in the call
                break
            raise
        ran += repeat
    print(json.dumps({"frames": ran, "seconds": time.monotonic() - started}), flush=True)


if __name__ == "__main__":
    main()
