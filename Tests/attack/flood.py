#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A spoofing flood and its counter, for the rate_limit tests (Tests/FanoutTests/AbuseEndToEndTests.swift).

send: from the attacker's namespace, raw IPv4 and IPv6 sockets send UDP datagrams with forged
sources to the listeners, paced on one schedule (bounded in count and time):
  - heavy sources (198.18.110.N), each at --heavy-rate for --seconds;
  - --spread sources (198.18.64.0/18, one address each), each --spread-count datagrams back to back
    (the first --spread-bursts of them --spread-burst-count);
  - --rotate IPv6 sources inside one /64 (2001:db8:77:1::/64), --rotate-count each, spread over the run;
  - an allowed source (198.18.0.3) at --heavy-rate;
  - a legitimate client (a real socket from 198.18.0.2) at --legit-rate.
Each payload starts with its tag (h<N>, s<N>, r, allowed, legit). Prints JSON: what was sent per
tag, and each heavy source's span (first to last send, seconds).

count: binds --port on IPv4 and IPv6 and counts datagrams (and their bytes) by tag until SIGTERM
(or --seconds); prints JSON: the counts and bytes by tag.

serve: an amplifying server on --port: answers each datagram with 20 times its bytes when its tag
is "amp", once its bytes when "small", twice otherwise (a legitimate exchange); until SIGTERM.

amp: a reflection attack through a two-way listener, from the attacker's namespace: --requests
datagrams of 60 bytes with the victim's address forged as their source (tags amp and small, 2
to 1), and a legitimate client (a real socket from 198.18.0.2) exchanging --legit requests,
waiting for each reply. Prints JSON: the attacker's payload bytes, and the legitimate client's
requests and replies.
"""
import argparse
import json
import signal
import socket
import struct
import sys
import time

PAYLOAD = 64


def checksum(data):
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def udp(source, destination, sport, dport, payload, family):
    length = 8 + len(payload)
    header = struct.pack("!HHHH", sport, dport, length, 0)
    if family == socket.AF_INET:
        pseudo = socket.inet_pton(family, source) + socket.inet_pton(family, destination) + struct.pack("!BBH", 0, 17, length)
    else:
        pseudo = socket.inet_pton(family, source) + socket.inet_pton(family, destination) + struct.pack("!IxxxB", length, 17)
    value = checksum(pseudo + header + payload) or 0xFFFF
    return struct.pack("!HHHH", sport, dport, length, value) + payload


def ipv4(source, destination, sport, dport, payload):
    segment = udp(source, destination, sport, dport, payload, socket.AF_INET)
    # Total length, identification and header checksum are the kernel's (IP_HDRINCL fills them).
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(segment), 0, 0, 64, 17, 0,
                         socket.inet_pton(socket.AF_INET, source), socket.inet_pton(socket.AF_INET, destination))
    return header + segment


def ipv6(source, destination, sport, dport, payload):
    segment = udp(source, destination, sport, dport, payload, socket.AF_INET6)
    header = struct.pack("!IHBB16s16s", 6 << 28, len(segment), 17, 64,
                         socket.inet_pton(socket.AF_INET6, source), socket.inet_pton(socket.AF_INET6, destination))
    return header + segment


def tagged(tag, sequence):
    text = ("%s %d " % (tag, sequence)).encode()
    return text + b"x" * (PAYLOAD - len(text))


def split(address):
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def send(arguments):
    host4, port4 = split(arguments.listener4)
    host6, port6 = split(arguments.listener6) if arguments.listener6 else (None, None)
    duration = arguments.seconds
    schedule = []  # (time, family, packet, tag)
    for n in range(1, arguments.heavy + 1):
        count = int(arguments.heavy_rate * duration)
        for k in range(count):
            schedule.append((k / arguments.heavy_rate + n * 0.0001, 4, ipv4("198.18.110.%d" % n, host4, 20000 + k % 1000, port4, tagged("h%d" % n, k)), "h%d" % n))
    count = int(arguments.heavy_rate * duration)
    for k in range(count):
        schedule.append((k / arguments.heavy_rate + 0.00005, 4, ipv4("198.18.0.3", host4, 30000 + k % 1000, port4, tagged("allowed", k)), "allowed"))
    # The spread sources (198.18.64.0 to 198.18.103.255 for 10,000), in order over the run; each
    # one's datagrams back to back: the first --spread-bursts send --spread-burst-count, the
    # others --spread-count.
    for n in range(arguments.spread):
        at = duration * n / max(arguments.spread, 1)
        source = "198.18.%d.%d" % (64 + n // 256, n % 256)
        for k in range(arguments.spread_burst_count if n < arguments.spread_bursts else arguments.spread_count):
            schedule.append((at + k * 0.000001, 4, ipv4(source, host4, 40000, port4, tagged("s%d" % n, k)), "s%d" % n))
    if host6:
        total = arguments.rotate * arguments.rotate_count
        for k in range(total):
            source = "2001:db8:77:1::%x" % (1 + k % arguments.rotate)
            schedule.append((duration * k / max(total, 1), 6, ipv6(source, host6, 50000, port6, tagged("r", k)), "r"))
    legit = int(arguments.legit_rate * duration)
    for k in range(legit):
        schedule.append((k / arguments.legit_rate + 0.00002, 0, tagged("legit", k), "legit"))
    schedule.sort(key=lambda entry: entry[0])

    raw4 = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    raw4.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    raw6 = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_RAW) if host6 else None
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.bind(("198.18.0.2", 0))
    sent = {}
    first = {}
    last = {}
    failed = 0
    start = time.monotonic()
    deadline = start + duration + 30
    for at, family, packet, tag in schedule:
        now = time.monotonic() - start
        if at > now + 0.0002:
            time.sleep(at - now)
        if time.monotonic() > deadline:
            break
        try:
            if family == 4:
                raw4.sendto(packet, (host4, 0))
            elif family == 6:
                raw6.sendto(packet, (host6, 0))
            else:
                client.sendto(packet, (host4, port4))
        except OSError:
            failed += 1
            continue
        stamp = time.monotonic() - start
        sent[tag] = sent.get(tag, 0) + 1
        if tag[0] == "h" or tag in ("r", "allowed"):
            first.setdefault(tag, stamp)
            last[tag] = stamp
    spans = {tag: last[tag] - first[tag] for tag in first}
    print(json.dumps({"sent": sent, "spans": spans, "failed": failed, "seconds": time.monotonic() - start}))


def each_datagram(arguments, ready_line, handle):
    """Binds --port on IPv4 and IPv6 (non-blocking), says `ready_line` on stderr, and hands
    each datagram to `handle(sock, data, peer)` until SIGTERM or --seconds."""
    import select
    sockets = []
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        sock = socket.socket(family, socket.SOCK_DGRAM)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.bind((host, arguments.port))
        sock.setblocking(False)
        sockets.append(sock)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    deadline = time.monotonic() + arguments.seconds
    print(ready_line, file=sys.stderr, flush=True)
    while not stop and time.monotonic() < deadline:
        try:
            ready, _, _ = select.select(sockets, [], [], 0.2)
        except InterruptedError:
            continue
        for sock in ready:
            while True:
                try:
                    data, peer = sock.recvfrom(2048)
                except (BlockingIOError, InterruptedError):
                    break
                handle(sock, data, peer)


def count(arguments):
    counts = {}
    sizes = {}

    def tally(sock, data, peer):
        tag = data.split(b" ", 1)[0].decode(errors="replace")
        counts[tag] = counts.get(tag, 0) + 1
        sizes[tag] = sizes.get(tag, 0) + len(data)
    each_datagram(arguments, "counting", tally)
    print(json.dumps({"counts": counts, "bytes": sizes}), flush=True)


def serve(arguments):
    served = {}

    failed = []

    def answer(sock, data, peer):
        import select
        tag = data.split(b" ", 1)[0]
        factor = 20 if tag == b"amp" else 1 if tag == b"small" else 2
        reply = (data * factor)[:1400]
        for _ in range(20):  # a full send buffer: wait for room (the socket is non-blocking)
            try:
                sock.sendto(reply, peer)
                break
            except BlockingIOError:
                select.select([], [sock], [], 0.05)
            except OSError:
                failed.append(1)
                return
        else:
            failed.append(1)
            return
        name = tag.decode(errors="replace")
        served[name] = served.get(name, 0) + len(reply)
    each_datagram(arguments, "serving", answer)
    print(json.dumps({"served": served, "failed": len(failed)}), flush=True)


def amp(arguments):
    host, port = split(arguments.listener)
    victim, victim_port = split(arguments.victim)
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.bind(("198.18.0.2", 0))
    client.settimeout(1.0)
    attacker_bytes = 0
    legit_replies = 0
    legit_bytes = 0
    interval = arguments.seconds / max(arguments.requests, 1)
    every = max(arguments.requests // max(arguments.legit, 1), 1)
    start = time.monotonic()
    legit_sent = 0
    for k in range(arguments.requests):
        payload = tagged("small" if k % 3 == 2 else "amp", k)[:60]
        raw.sendto(ipv4(victim, host, victim_port, port, payload), (host, 0))
        attacker_bytes += len(payload)
        if k % every == 0 and legit_sent < arguments.legit:
            client.sendto(tagged("legit", legit_sent)[:100].ljust(100, b"y"), (host, port))
            legit_sent += 1
            try:
                answer = client.recv(4096)
                legit_replies += 1
                legit_bytes += len(answer)
            except socket.timeout:
                pass
        pause = start + (k + 1) * interval - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    print(json.dumps({"attacker_bytes": attacker_bytes, "attacker_datagrams": arguments.requests, "legit_sent": legit_sent,
                      "legit_replies": legit_replies, "legit_reply_bytes": legit_bytes}))


def main():
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    flood = commands.add_parser("send")
    flood.add_argument("--listener4", required=True)
    flood.add_argument("--listener6")
    flood.add_argument("--seconds", type=float, default=3)
    flood.add_argument("--heavy", type=int, default=6)
    flood.add_argument("--heavy-rate", type=float, default=400)
    flood.add_argument("--spread", type=int, default=10000)
    flood.add_argument("--spread-count", type=int, default=3)
    flood.add_argument("--spread-bursts", type=int, default=500)
    flood.add_argument("--spread-burst-count", type=int, default=25)
    flood.add_argument("--rotate", type=int, default=1000)
    flood.add_argument("--rotate-count", type=int, default=2)
    flood.add_argument("--legit-rate", type=float, default=50)
    counter = commands.add_parser("count")
    counter.add_argument("--port", type=int, required=True)
    counter.add_argument("--seconds", type=float, default=120)
    server = commands.add_parser("serve")
    server.add_argument("--port", type=int, required=True)
    server.add_argument("--seconds", type=float, default=120)
    reflect = commands.add_parser("amp")
    reflect.add_argument("--listener", required=True)
    reflect.add_argument("--victim", required=True)
    reflect.add_argument("--requests", type=int, default=300)
    reflect.add_argument("--legit", type=int, default=60)
    reflect.add_argument("--seconds", type=float, default=3)
    arguments = parser.parse_args()
    if arguments.command == "send" and (arguments.seconds > 60 or arguments.spread > 46 * 256 or arguments.spread_count > 100 or arguments.spread_burst_count > 100):
        sys.exit("--seconds: at most 60; --spread: at most 11776 (198.18.64.0 to 198.18.109.255); a source's count at most 100")
    if arguments.command == "amp" and (arguments.seconds > 60 or arguments.requests > 100000):
        sys.exit("--seconds: at most 60; --requests: at most 100000")
    {"send": send, "count": count, "serve": serve, "amp": amp}[arguments.command](arguments)


if __name__ == "__main__":
    main()
