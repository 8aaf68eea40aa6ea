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
(frames_pace, next to TEMPLATE); without it, as fast as the CPU runs.
Bounded: stops after MAX_FRAMES frames run (sent or paced out) or MAX_SECONDS seconds, whichever comes first, or at
SIGTERM; prints the frames it ran as JSON."""
import ctypes
import json
import os
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


def bpf(command, attr):
    buffer = ctypes.create_string_buffer(attr, 128)
    result = LIBC.syscall(321, command, buffer, 128)  # __NR_bpf on x86_64
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


def main():
    program, template, ifname, dst_mac, src_mac, src_ip, dst_ip, dst_port, max_frames, max_seconds = sys.argv[1:11]
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    path = ctypes.create_string_buffer(program.encode())
    fd = bpf(BPF_OBJ_GET, struct.pack("QII", ctypes.addressof(path), 0, 0))
    data = frame(dst_mac, src_mac, src_ip, dst_ip, int(dst_port))
    path = ctypes.create_string_buffer(template.encode())
    map_fd = bpf(BPF_OBJ_GET, struct.pack("QII", ctypes.addressof(path), 0, 0))
    key, value = ctypes.create_string_buffer(4), ctypes.create_string_buffer(data, len(data))
    bpf(BPF_MAP_UPDATE_ELEM, struct.pack("IIQQQ", map_fd, 0, ctypes.addressof(key), ctypes.addressof(value), 0))
    rate = float(sys.argv[11]) if len(sys.argv) > 11 else 0.0
    path = ctypes.create_string_buffer(os.path.join(os.path.dirname(template), "frames_pace").encode())
    pace_fd = bpf(BPF_OBJ_GET, struct.pack("QII", ctypes.addressof(path), 0, 0))
    pace = ctypes.create_string_buffer(struct.pack("QQ", int(1e9 / rate) if rate else 0, 0), 16)
    bpf(BPF_MAP_UPDATE_ELEM, struct.pack("IIQQQ", pace_fd, 0, ctypes.addressof(key), ctypes.addressof(pace), 0))
    data_in = ctypes.create_string_buffer(data, len(data))
    # struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
    ctx = ctypes.create_string_buffer(struct.pack("6I", 0, len(data), 0, socket.if_nametoindex(ifname), 0, 0), 24)
    ran, started = 0, time.monotonic()
    deadline = started + float(max_seconds)
    while not stop and ran < int(max_frames) and time.monotonic() < deadline:
        repeat = min(CHUNK, int(max_frames) - ran)
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
