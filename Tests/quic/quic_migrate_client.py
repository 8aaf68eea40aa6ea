#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A QUIC test client (aioquic 1.7.2, sans-IO) that fetches a payload from quic_lb_server.py over
each of N concurrent connections and, with --migrate, moves each connection to a new local
address half way through, as a NAT rebinding or a Wi-Fi handover would: the rest of the transfer
only works if whatever sits between client and servers still delivers its packets to the
server that holds the connection.

Prints one JSON line: connections, completed, migrated, failed (a list of {index, reason,
bytes_received, migrated}), servers (completed connections per server name) and by_connection
(the server name each connection got, or null). Exits 0 whatever happened to the connections;
2 for usage errors.
"""
import argparse
import ipaddress
import json
import selectors
import socket
import ssl
import sys
import time
from collections import Counter

from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicErrorCode

ALPN = "quic-lb-test"


def error_name(code: int) -> str:
    try:
        return QuicErrorCode(code).name
    except ValueError:
        return f"0x{code:x}"


class ClientConnection:
    """One QUIC connection with its own UDP socket, which it can swap for a new one."""

    def __init__(self, index: int, arguments: argparse.Namespace, selector: selectors.BaseSelector, now: float):
        self.index = index
        self.size = arguments.bytes
        self.server = arguments.server
        self.migrate = arguments.migrate
        self.name_check = arguments.server_name_check
        self.selector = selector
        self.deadline = now + arguments.timeout
        sources = arguments.sources
        self.new_source = sources[(index + 1) % len(sources)]

        self.name: str | None = None
        self.header = b""  # the "<name>\n" line until it is whole
        self.received = 0
        self.migrated = False
        self.failure: str | None = None
        self.done = False
        self.send_error: OSError | None = None
        self.reset_tokens: set[bytes] = set()
        self.check_stream: int | None = None
        self.check_reply = b""

        self.sockets = [self.open_socket(sources[index % len(sources)])]
        configuration = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], verify_mode=ssl.CERT_NONE)
        self.quic = QuicConnection(configuration=configuration)
        self.quic.connect(self.server, now=now)
        self.stream = self.quic.get_next_available_stream_id()
        self.quic.send_stream_data(self.stream, f"GET {self.size}\n".encode(), end_stream=True)
        self.flush(now)

    def open_socket(self, source: str) -> socket.socket:
        family = socket.AF_INET6 if ":" in source else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        sock.bind((source, 0))
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ, self)
        return sock

    # --- I/O

    def flush(self, now: float) -> None:
        """Sends what aioquic has queued, always from the newest socket."""
        for data, addr in self.quic.datagrams_to_send(now=now):
            try:
                self.sockets[-1].sendto(data, addr)
            except OSError as error:  # a lost datagram to QUIC; kept for the failure reason
                self.send_error = error

    def readable(self, sock: socket.socket, now: float) -> None:
        while not self.done and sock is self.sockets[-1]:  # stop at a migration, too
            try:
                data, addr = sock.recvfrom(65536)
            except BlockingIOError:
                break
            if self.is_stateless_reset(data):
                self.finish(now, "stateless reset")
                return
            self.quic.receive_datagram(data, (ipaddress.ip_address(addr[0]).compressed, addr[1]), now=now)
            self.process_events(now)
        if not self.done:
            self.flush(now)

    def is_stateless_reset(self, data: bytes) -> bool:
        # aioquic 1.7.2 ignores stateless resets; their token is the last 16 octets of a
        # short-header datagram. The tokens the server gave us live in private attributes.
        for connection_id in [self.quic._peer_cid, *self.quic._peer_cid_available]:
            if connection_id.stateless_reset_token:
                self.reset_tokens.add(connection_id.stateless_reset_token)
        return len(data) >= 21 and not data[0] & 0x80 and data[-16:] in self.reset_tokens

    def wake_at(self) -> float:
        timer = self.quic.get_timer()
        return self.deadline if timer is None else min(timer, self.deadline)

    def tick(self, now: float) -> None:
        if now >= self.deadline:
            reason = "timeout" if self.send_error is None else f"timeout (last send error: {self.send_error})"
            self.finish(now, reason)
            return
        timer = self.quic.get_timer()
        if timer is not None and timer <= now:
            self.quic.handle_timer(now=now)
            self.process_events(now)
            if not self.done:
                self.flush(now)

    # --- the application

    def process_events(self, now: float) -> None:
        while not self.done and (event := self.quic.next_event()) is not None:
            if isinstance(event, events.StreamDataReceived):
                if event.stream_id == self.stream:
                    self.payload(event, now)
                elif event.stream_id == self.check_stream:
                    self.check_reply += event.data
                    if event.end_stream:
                        self.check_name(now)
            elif isinstance(event, events.StreamReset):
                self.finish(now, f"stream {event.stream_id} reset by peer: error {event.error_code}")
            elif isinstance(event, events.ConnectionTerminated):
                frame = "" if event.frame_type is None else f", frame type 0x{event.frame_type:x}"
                self.finish(now, f"connection closed: {error_name(event.error_code)}{frame}, "
                                 f"reason {event.reason_phrase!r}")

    def payload(self, event: events.StreamDataReceived, now: float) -> None:
        data = event.data
        if self.name is None:
            self.header += data
            if b"\n" not in self.header:
                return
            name, data = self.header.split(b"\n", 1)
            self.name = name.decode(errors="replace")
        self.received += len(data)
        if self.migrate and not self.migrated and 2 * self.received >= self.size and not event.end_stream:
            self.switch_socket()
        if event.end_stream:
            if self.name is None or self.received != self.size:
                self.finish(now, f"stream ended after {self.received} of {self.size} octets")
            elif self.name_check:
                # One more request on the path in use now: the same server must answer it.
                self.check_stream = self.quic.get_next_available_stream_id()
                self.quic.send_stream_data(self.check_stream, b"GET 0\n", end_stream=True)
            else:
                self.finish(now)

    def check_name(self, now: float) -> None:
        name = self.check_reply.split(b"\n", 1)[0].decode(errors="replace")
        if name == self.name:
            self.finish(now)
        else:
            self.finish(now, f"a second request was answered by {name!r}, not {self.name!r}")

    def switch_socket(self) -> None:
        """Migrates: a fresh server-issued connection ID (aioquic keeps the current one if it
        has no spare), all further datagrams from a new socket, and the old socket no longer
        read, as if that path had gone away."""
        self.quic.change_connection_id()
        self.selector.unregister(self.sockets[-1])
        self.sockets.append(self.open_socket(self.new_source))
        self.migrated = True

    def finish(self, now: float, failure: str | None = None) -> None:
        self.failure = failure
        self.done = True
        self.quic.close()
        self.flush(now)
        self.selector.unregister(self.sockets[-1])
        for sock in self.sockets:
            sock.close()


def parse_host_port(text: str) -> tuple[str, int]:
    """HOST:PORT or [IPv6]:PORT, the host as the address text recvfrom gives back."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return ipaddress.ip_address(host).compressed, int(port)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None


def parse_sources(text: str) -> list[str]:
    try:
        return [ipaddress.ip_address(source.strip("[]")).compressed for source in text.split(",")]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", type=parse_host_port, required=True, help="HOST:PORT to connect to (the load balancer)")
    parser.add_argument("--sources", type=parse_sources, required=True,
                        help="local IPs, comma-separated: connection i starts from source i mod n and migrates to source i+1 mod n")
    parser.add_argument("--connections", type=int, default=10, help="concurrent connections (default 10)")
    parser.add_argument("--bytes", type=int, default=200000, help="payload octets per connection (default 200000)")
    parser.add_argument("--migrate", action="store_true", help="move each connection to a new socket when half the payload has arrived")
    parser.add_argument("--timeout", type=float, default=10, help="seconds per connection (default 10)")
    parser.add_argument("--server-name-check", action="store_true",
                        help="after the payload, ask again on a new stream: the same server name must answer")
    arguments = parser.parse_args()
    if arguments.connections < 1 or arguments.bytes < 0 or arguments.timeout <= 0:
        parser.error("--connections must be at least 1, --bytes at least 0, --timeout positive")
    server_is_v6 = ":" in arguments.server[0]
    if any((":" in source) != server_is_v6 for source in arguments.sources):
        parser.error("--sources must be of the same address family as --server")
    return arguments


def main() -> int:
    arguments = parse_arguments()
    selector = selectors.DefaultSelector()
    start = time.monotonic()
    clients = [ClientConnection(index, arguments, selector, start) for index in range(arguments.connections)]
    # All connections run at once, each bounded by its own deadline; this bounds the loop too.
    hard_deadline = start + arguments.timeout + 5
    while (active := [client for client in clients if not client.done]) and time.monotonic() < hard_deadline:
        wait = min(client.wake_at() for client in active) - time.monotonic()
        for key, _ in selector.select(timeout=max(0.0, wait)):
            key.data.readable(key.fileobj, time.monotonic())
        now = time.monotonic()
        for client in active:
            if not client.done:
                client.tick(now)
    for client in clients:
        if not client.done:
            client.finish(time.monotonic(), "timeout (overall bound)")

    completed = [client for client in clients if client.failure is None]
    print(json.dumps({
        "connections": len(clients),
        "completed": len(completed),
        "migrated": sum(client.migrated for client in clients),
        "failed": [{"index": client.index, "reason": client.failure, "bytes_received": client.received,
                    "migrated": client.migrated} for client in clients if client.failure is not None],
        "servers": dict(Counter(client.name for client in completed)),
        "by_connection": [client.name for client in clients],
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
