#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A QUIC test server (aioquic 1.7.2) whose connection IDs are QUIC-LB IDs
(draft-ietf-quic-load-balancers) carrying its server ID, for the end-to-end tests that put
udp-fanout between QUIC clients and several of these servers.

Application protocol (ALPN "quic-lb-test"): on each client bidirectional stream the client sends
"GET <n>\\n"; the server answers "<name>\\n", then n payload octets, then ends the stream.

Prints {"ready": true, ...} once listening, and one JSON line of totals on SIGTERM, SIGINT or
after --duration seconds, then exits 0. --self-test checks the QUIC-LB encoder against the
draft's test vectors and exits 0 or 1.

Group mode (--reuseportlb LIBRARY): instead of binding a socket of its own, the server joins a
ReusePortLB SO_REUSEPORT group on --listen's address and port (through the library's C API by
ctypes; needs root or CAP_BPF for the eBPF steering) and serves on the member's socket. By
default it joins with its QUIC-LB configuration and registers its server ID, so the group's
sk_reuseport program sends each datagram whose destination connection ID names this server here,
whatever its source address; --group-no-quic joins a plain group that spreads by --group-policy
alone (for comparison: a migrated client may land on another member). The group reads plaintext
server IDs only, so the QUIC-LB group mode takes no --key. Members leave the group at exit; in the
QUIC-LB group mode the totals line carries the group's QUIC-LB counters (group_counters: the whole
group's, read just before this member leaves).
"""
import argparse
import asyncio
import ctypes
import datetime
import ipaddress
import json
import os
import signal
import socket
import sys
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.x509.oid import NameOID

import aioquic.asyncio.server
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

ALPN = "quic-lb-test"
MAX_REQUEST_BYTES = 1 << 30


# --- QUIC-LB connection IDs -------------------------------------------------------------------


class QuicLbCodec:
    """Encodes a server ID and a nonce into a QUIC-LB connection ID, and decodes one back.

    A connection ID is one octet (config ID in the top three bits, server ID length + nonce
    length in the low five) followed by server ID || nonce: in plaintext without a key; with a
    16-octet AES-128 key, one AES-ECB block when the two make 16 octets, otherwise the draft's
    four-pass Feistel network.
    """

    def __init__(self, config_id: int, server_id_length: int, nonce_length: int, key: bytes | None):
        if not 0 <= config_id <= 6:
            raise ValueError(f"config ID {config_id} is out of range: use 0..6")
        if not 1 <= server_id_length <= 15:
            raise ValueError(f"server ID length {server_id_length} is out of range: use 1..15 octets")
        if nonce_length < 4 or server_id_length + nonce_length > 19:
            raise ValueError(
                f"nonce length {nonce_length} does not fit: use at least 4 octets, "
                "and at most 19 octets of server ID and nonce together")
        if key is not None and len(key) != 16:
            raise ValueError(f"the key is {len(key)} octets: use 16 (32 hexadecimal digits)")
        self.config_id = config_id
        self.server_id_length = server_id_length
        self.nonce_length = nonce_length
        self.key = key
        self.length = server_id_length + nonce_length  # L: the octets after the first

    @property
    def cid_length(self) -> int:
        return 1 + self.length

    def encode(self, server_id: bytes, nonce: bytes) -> bytes:
        assert len(server_id) == self.server_id_length and len(nonce) == self.nonce_length
        first = bytes([self.config_id << 5 | self.length])
        plaintext = server_id + nonce
        if self.key is None:
            return first + plaintext
        if self.length == 16:
            return first + self._aes(plaintext)
        return first + self._feistel(plaintext, decrypt=False)

    def decode(self, cid: bytes) -> tuple[bytes, bytes]:
        """Returns (server ID, nonce) of a connection ID made with this configuration."""
        if len(cid) < self.cid_length or cid[0] != self.config_id << 5 | self.length:
            raise ValueError(f"{cid.hex()} is not a connection ID of this configuration")
        body = cid[1:self.cid_length]
        if self.key is not None:
            if self.length == 16:
                body = self._aes(body, decrypt=True)
            else:
                body = self._feistel(body, decrypt=True)
        return body[:self.server_id_length], body[self.server_id_length:]

    def _aes(self, block: bytes, decrypt: bool = False) -> bytes:
        cipher = Cipher(algorithms.AES(self.key), modes.ECB())
        context = cipher.decryptor() if decrypt else cipher.encryptor()
        return context.update(block) + context.finalize()

    def _feistel(self, data: bytes, decrypt: bool) -> bytes:
        length = self.length
        half = (length + 1) // 2
        odd = length % 2 == 1

        def clear_left(octets: bytes) -> bytes:
            # With an odd L the halves share the middle octet: left keeps its high nibble.
            return octets[:-1] + bytes([octets[-1] & 0xF0]) if odd else octets

        def clear_right(octets: bytes) -> bytes:
            # ... and right keeps its low nibble.
            return bytes([octets[0] & 0x0F]) + octets[1:] if odd else octets

        def round_xor(target: bytes, pass_number: int, source: bytes) -> bytes:
            # expand(L, pass, half) = half || zeros || L || pass, 16 octets; AES it and XOR the
            # first `half` octets into the other half.
            expanded = source + bytes(14 - half) + bytes([length, pass_number])
            mask = self._aes(expanded)[:half]
            return bytes(t ^ m for t, m in zip(target, mask))

        left = clear_left(data[:half])
        right = clear_right(data[length - half:])
        if not decrypt:
            right = clear_right(round_xor(right, 1, left))
            left = clear_left(round_xor(left, 2, right))
            right = clear_right(round_xor(right, 3, left))
            left = clear_left(round_xor(left, 4, right))
        else:
            left = clear_left(round_xor(left, 4, right))
            right = clear_right(round_xor(right, 3, left))
            left = clear_left(round_xor(left, 2, right))
            right = clear_right(round_xor(right, 1, left))
        if odd:
            return left[:-1] + bytes([left[-1] | right[0]]) + right[1:]
        return left + right


# (key, config ID or None when only the octets after the first are given, server ID, nonce,
# expected connection ID or its octets after the first) from the draft's test vectors.
SELF_TEST_VECTORS = [
    ("8f95f09245765f80256934e50c66207f", None, "ed793a", "ee080dbf", "20b1d07b359d3c"),
    ("8f95f09245765f80256934e50c66207f", None, "ed793a51d49b8f5fab65", "ee080dbf48",
     "cc381bc74cb4fbad2823a3d1f8fed2"),
    ("8f95f09245765f80256934e50c66207f", None, "ed793a51d49b8f5f", "ee080dbf48c0d1e5",
     "4dd2d05a7b0de9b2b9907afb5ecf8cc3"),
    ("8f95f09245765f80256934e50c66207f", None, "ed793a51d49b8f5fab", "ee080dbf48c0d1e55d",
     "5779c9cc86beb3a3a4a3ca96fce4bfe0cdbc"),
    ("fdf726a9893ec05c0632d3956680baf0", 0, "31441a", "9c69c275", "0767947d29be054a"),
]


def self_test() -> bool:
    """Checks encoding against the test vectors, and that decoding gives the inputs back."""
    ok = True
    for key, config_id, server_id, nonce, expected in SELF_TEST_VECTORS:
        sid, nonce_octets = bytes.fromhex(server_id), bytes.fromhex(nonce)
        codec = QuicLbCodec(config_id or 0, len(sid), len(nonce_octets), bytes.fromhex(key))
        cid = codec.encode(sid, nonce_octets)
        got = cid.hex() if config_id is not None else cid[1:].hex()
        round_trip = codec.decode(cid) == (sid, nonce_octets)
        passed = got == expected and round_trip
        ok = ok and passed
        print(json.dumps({"server_id": server_id, "nonce": nonce, "expected": expected,
                          "got": got, "decodes_back": round_trip, "pass": passed}))
    # Plaintext: the server ID and nonce in the clear after the first octet.
    codec = QuicLbCodec(3, 2, 4, None)
    cid = codec.encode(b"\x12\x34", b"\xaa\xbb\xcc\xdd")
    passed = cid.hex() == "66" + "1234aabbccdd" and codec.decode(cid) == (b"\x12\x34", b"\xaa\xbb\xcc\xdd")
    ok = ok and passed
    print(json.dumps({"plaintext": cid.hex(), "pass": passed}))
    return ok


# --- aioquic hooks ------------------------------------------------------------------------------


class QuicLbConnection(QuicConnection):
    """A server QuicConnection whose connection IDs are QUIC-LB IDs with this server's ID.

    aioquic 1.7.2 draws every host connection ID as os.urandom(connection_id_length): the
    initial one in __init__ and later ones in _replenish_connection_ids. Both are replaced right
    after they are drawn, before anything sends or registers them. (Replacing os.urandom for
    that length is not safe: PATH_CHALLENGE data is os.urandom(8) too, the same length as an
    8-octet ID.)
    """

    codec: QuicLbCodec  # set by main()
    server_id: bytes

    @classmethod
    def new_cid(cls) -> bytes:
        return cls.codec.encode(cls.server_id, os.urandom(cls.codec.nonce_length))

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        cid = self.new_cid()
        self._host_cids[0].cid = cid
        self.host_cid = cid
        self._local_initial_source_connection_id = cid

    def _replenish_connection_ids(self) -> None:
        super()._replenish_connection_ids()
        # The IDs just added are not sent yet (NEW_CONNECTION_ID goes out on the next write).
        for connection_id in self._host_cids:
            if not connection_id.was_sent:
                connection_id.cid = self.new_cid()


@dataclass
class Totals:
    connections: int = 0
    streams_served: int = 0
    bytes_served: int = 0
    migrated_connections: int = 0
    stray_datagrams: int = 0  # for an ID of another server (or none): routed here wrongly
    late_datagrams: int = 0  # for an ID of this server that it no longer knows (closed, retired)
    cids_issued: int = 0
    cids_not_quic_lb: int = 0  # must stay 0: an ID the hook missed


class LbTestProtocol(QuicConnectionProtocol):
    """One server connection: answers GET streams and records the client addresses it saw."""

    def __init__(self, quic: QuicConnection, *, totals: Totals, name: str, verbose: bool, **kwargs):
        super().__init__(quic, **kwargs)
        self._totals = totals
        self._name = name
        self._verbose = verbose
        self._requests: dict[int, bytes] = {}
        self._addresses: set[tuple] = set()
        self._check_issued(quic.host_cid, "initial")

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        address = addr[:2]
        if self._addresses and address not in self._addresses:
            if len(self._addresses) == 1:
                self._totals.migrated_connections += 1
            # A short-header packet's destination ID follows its first octet.
            cid = data[1:1 + len(self._quic.host_cid)].hex() if not data[0] & 0x80 else "(long header)"
            self._log(f"client address {address[0]}:{address[1]} (was {sorted(self._addresses)}), to CID {cid}")
        self._addresses.add(address)
        super().datagram_received(data, addr)

    def quic_event_received(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.HandshakeCompleted):
            self._totals.connections += 1
        elif isinstance(event, events.ConnectionIdIssued):
            self._check_issued(event.connection_id, "NEW_CONNECTION_ID")
        elif isinstance(event, events.StreamDataReceived):
            self._stream_data(event)

    def _stream_data(self, event: events.StreamDataReceived) -> None:
        request = self._requests.get(event.stream_id, b"") + event.data
        if b"\n" not in request:
            self._requests[event.stream_id] = request
            if event.end_stream or len(request) > 64:
                self._requests.pop(event.stream_id)
                self._quic.reset_stream(event.stream_id, error_code=1)
            return
        self._requests.pop(event.stream_id, None)
        words = request.split(b"\n", 1)[0].split()
        if len(words) != 2 or words[0] != b"GET" or not words[1].isdigit() or int(words[1]) > MAX_REQUEST_BYTES:
            self._quic.reset_stream(event.stream_id, error_code=1)
            return
        size = int(words[1])
        self._quic.send_stream_data(event.stream_id, self._name.encode() + b"\n" + bytes(size), end_stream=True)
        # Counted when queued: aioquic delivers it unless the connection dies.
        self._totals.streams_served += 1
        self._totals.bytes_served += size

    def _check_issued(self, cid: bytes, how: str) -> None:
        self._totals.cids_issued += 1
        try:
            server_id, nonce = QuicLbConnection.codec.decode(cid)
        except ValueError:
            server_id, nonce = b"", b""
        if server_id != QuicLbConnection.server_id:
            self._totals.cids_not_quic_lb += 1
            print(f"error: issued connection ID {cid.hex()} does not carry server ID "
                  f"{QuicLbConnection.server_id.hex()}", file=sys.stderr, flush=True)
        self._log(f"issued {how} CID {cid.hex()}: server ID {server_id.hex()}, nonce {nonce.hex()}")

    def _log(self, message: str) -> None:
        if self._verbose:
            odcid = self._quic.original_destination_connection_id.hex()
            print(f"[{self._name} {odcid}] {message}", file=sys.stderr, flush=True)


class CountingQuicServer(QuicServer):
    """aioquic's server, counting short-header datagrams for connection IDs it does not know
    (which it drops): stray when the ID is not one of this server's (what arrives here when a
    load balancer routes a migrated client wrong), late when it is (a connection this server
    closed, or an ID the client retired, answered after the fact)."""

    def __init__(self, *, totals: Totals, **kwargs):
        super().__init__(**kwargs)
        self._totals = totals

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        cid_length = self._configuration.connection_id_length
        is_short_header = len(data) > cid_length and not data[0] & 0x80
        if is_short_header and data[1:1 + cid_length] not in self._protocols:
            try:
                own = QuicLbConnection.codec.decode(data[1:1 + cid_length])[0] == QuicLbConnection.server_id
            except ValueError:
                own = False
            if own:
                self._totals.late_datagrams += 1
            else:
                self._totals.stray_datagrams += 1
        super().datagram_received(data, addr)


# --- ReusePortLB group membership ----------------------------------------------------------------

GROUP_POLICIES = {"source_ip": 0, "round_robin": 1, "five_tuple": 2}  # enum reuseportlb_policy
REUSEPORTLB_ERROR_MAX = 1024
REUSEPORTLB_ANY_SLOT = -1


class ReusePortLbQuicConfig(ctypes.Structure):
    """struct reuseportlb_quic_lb"""
    _fields_ = [("config_id", ctypes.c_uint8), ("server_id_length", ctypes.c_uint8),
                ("nonce_length", ctypes.c_uint8), ("key", ctypes.POINTER(ctypes.c_uint8))]


class ReusePortLbQuicCounters(ctypes.Structure):
    """struct reuseportlb_quic_counters"""
    _fields_ = [("routed", ctypes.c_uint64), ("fallback", ctypes.c_uint64),
                ("unknown_server_id", ctypes.c_uint64), ("undecodable", ctypes.c_uint64)]


class GroupJoinError(Exception):
    pass


class ReusePortGroup:
    """One member of a ReusePortLB group, joined through libreuseportlb's C API."""

    def __init__(self, library_path: str):
        try:
            lib = ctypes.CDLL(library_path)
        except OSError as error:
            raise GroupJoinError(
                f"cannot load {library_path}: {error} (if the Swift runtime is not found, set "
                "LD_LIBRARY_PATH to its directory, e.g. /opt/swift/usr/lib/swift/linux)") from None
        member_pp = ctypes.POINTER(ctypes.c_void_p)
        lib.reuseportlb_join.argtypes = [ctypes.c_char_p, ctypes.c_uint16, ctypes.c_int, ctypes.c_uint,
                                         ctypes.c_int, member_pp, ctypes.c_char_p, ctypes.c_size_t]
        lib.reuseportlb_join.restype = ctypes.c_int
        lib.reuseportlb_join_quic.argtypes = [
            ctypes.c_char_p, ctypes.c_uint16, ctypes.c_int, ctypes.c_uint, ctypes.c_int,
            ctypes.POINTER(ReusePortLbQuicConfig), ctypes.c_char_p, member_pp, ctypes.c_char_p, ctypes.c_size_t]
        lib.reuseportlb_join_quic.restype = ctypes.c_int
        lib.reuseportlb_socket.argtypes = [ctypes.c_void_p]
        lib.reuseportlb_socket.restype = ctypes.c_int
        lib.reuseportlb_slot.argtypes = [ctypes.c_void_p]
        lib.reuseportlb_slot.restype = ctypes.c_int
        lib.reuseportlb_steering.argtypes = [ctypes.c_void_p]
        lib.reuseportlb_steering.restype = ctypes.c_char_p
        lib.reuseportlb_quic_counters.argtypes = [ctypes.c_void_p, ctypes.POINTER(ReusePortLbQuicCounters)]
        lib.reuseportlb_quic_counters.restype = ctypes.c_int
        lib.reuseportlb_leave.argtypes = [ctypes.c_void_p]
        lib.reuseportlb_leave.restype = None
        self._lib = lib
        self._member = ctypes.c_void_p()
        self.quic = False

    def join(self, host: str, port: int, slot: int, capacity: int, policy: str,
             codec: "QuicLbCodec | None", server_id: bytes | None) -> None:
        """Joins host:port; with a codec, as a QUIC-LB group registering server_id."""
        error = ctypes.create_string_buffer(REUSEPORTLB_ERROR_MAX)
        if codec is None:
            result = self._lib.reuseportlb_join(
                host.encode(), port, slot, capacity, GROUP_POLICIES[policy],
                ctypes.byref(self._member), error, len(error))
        else:
            config = ReusePortLbQuicConfig(codec.config_id, codec.server_id_length, codec.nonce_length, None)
            result = self._lib.reuseportlb_join_quic(
                host.encode(), port, slot, capacity, GROUP_POLICIES[policy], ctypes.byref(config),
                server_id, ctypes.byref(self._member), error, len(error))
        if result != 0 or not self._member:
            self._member = ctypes.c_void_p()
            message = error.value.decode(errors="replace") or os.strerror(-result)
            raise GroupJoinError(f"joining the group on {host}:{port} failed ({result}): {message}")
        self.quic = codec is not None

    def socket(self) -> socket.socket:
        """A Python socket on a duplicate of the member's descriptor: asyncio closes the
        duplicate, reuseportlb_leave closes the member's own (never the same number twice)."""
        fd = self._lib.reuseportlb_socket(self._member)
        if fd < 0:
            raise GroupJoinError(f"reuseportlb_socket failed: {os.strerror(-fd)}")
        return socket.socket(fileno=os.dup(fd))

    @property
    def slot(self) -> int:
        return self._lib.reuseportlb_slot(self._member)

    @property
    def steering(self) -> str | None:
        steering = self._lib.reuseportlb_steering(self._member)
        return steering.decode() if steering is not None else None

    def quic_counters(self) -> dict | str:
        """The group program's QUIC-LB counters (the whole group's), or why there are none."""
        counters = ReusePortLbQuicCounters()
        result = self._lib.reuseportlb_quic_counters(self._member, ctypes.byref(counters))
        if result != 0:
            return f"unavailable: {os.strerror(-result)}"
        return {name: getattr(counters, name) for name, _ in ReusePortLbQuicCounters._fields_}

    def leave(self) -> None:
        if self._member:
            self._lib.reuseportlb_leave(self._member)
            self._member = ctypes.c_void_p()


# --- setup --------------------------------------------------------------------------------------


def parse_host_port(text: str) -> tuple[str, int]:
    """HOST:PORT or [IPv6]:PORT."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        host = ipaddress.ip_address(host).compressed
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    return host, int(port)


def self_signed_certificate() -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "quic-lb-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return certificate, key


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--self-test", action="store_true", help="check the QUIC-LB encoder against the test vectors and exit")
    parser.add_argument("--listen", type=parse_host_port, help="HOST:PORT or [IPv6]:PORT to listen on")
    parser.add_argument("--name", help="the name reported to clients")
    parser.add_argument("--server-id", type=bytes.fromhex, help="the server ID in hexadecimal (1..15 octets)")
    parser.add_argument("--config-id", type=int, default=0, help="QUIC-LB config ID, 0..6 (default 0)")
    parser.add_argument("--nonce-length", type=int, default=6, help="nonce octets (default 6)")
    parser.add_argument("--key", type=bytes.fromhex, help="AES-128 key, 32 hexadecimal digits (default: plaintext IDs)")
    parser.add_argument("--certificate", help="PEM certificate (default: a self-signed one made at startup)")
    parser.add_argument("--private-key", help="PEM private key for --certificate")
    parser.add_argument("--duration", type=float, default=120, help="exit after this many seconds (default 120)")
    parser.add_argument("--verbose", action="store_true", help="log issued connection IDs and client address changes to stderr")
    group = parser.add_argument_group("group mode (ReusePortLB: several servers share --listen's port)")
    group.add_argument("--reuseportlb", metavar="LIBRARY_PATH",
                       help="libreuseportlb.so: join its SO_REUSEPORT group on --listen instead of binding a socket")
    group.add_argument("--group-slot", type=int, default=REUSEPORTLB_ANY_SLOT,
                       help="this member's slot, 0..capacity-1 (default: the lowest free one)")
    group.add_argument("--group-capacity", type=int, help="the group's number of slots (required with --reuseportlb)")
    group.add_argument("--group-policy", choices=sorted(GROUP_POLICIES), default="source_ip",
                       help="how the group spreads datagrams that name no member's server ID (default source_ip)")
    group.add_argument("--group-no-quic", action="store_true",
                       help="join a plain group (no QUIC-LB routing, no server ID registered), for comparison")
    arguments = parser.parse_args()
    if not arguments.self_test:
        missing = [option for option in ("listen", "name", "server_id") if getattr(arguments, option) is None]
        if missing:
            parser.error("required: " + ", ".join("--" + option.replace("_", "-") for option in missing))
        if (arguments.certificate is None) != (arguments.private_key is None):
            parser.error("--certificate and --private-key go together")
        group_options = [option for option in ("group_capacity", "group_no_quic")
                         if getattr(arguments, option) not in (None, False)]
        if arguments.group_slot != REUSEPORTLB_ANY_SLOT:
            group_options.append("group_slot")
        if arguments.reuseportlb is None:
            if group_options:
                parser.error(", ".join("--" + option.replace("_", "-") for option in group_options)
                             + " only go with --reuseportlb LIBRARY_PATH")
        else:
            if arguments.group_capacity is None or arguments.group_capacity < 1:
                parser.error("--reuseportlb needs --group-capacity K (at least 1)")
            if arguments.group_slot != REUSEPORTLB_ANY_SLOT and not 0 <= arguments.group_slot < arguments.group_capacity:
                parser.error(f"--group-slot {arguments.group_slot} is out of range: use 0..{arguments.group_capacity - 1}")
            if arguments.listen[1] == 0:
                parser.error("--reuseportlb needs a port in --listen (the group is on that port; 0 is refused)")
            if arguments.key is not None and not arguments.group_no_quic:
                parser.error("the QUIC-LB group mode routes by plaintext server IDs: drop --key "
                             "(the group's sk_reuseport program cannot decrypt connection IDs)")
        try:
            arguments.codec = QuicLbCodec(arguments.config_id, len(arguments.server_id), arguments.nonce_length, arguments.key)
        except ValueError as error:
            parser.error(str(error))
    return arguments


async def serve(arguments: argparse.Namespace, group: "ReusePortGroup | None" = None) -> None:
    configuration = QuicConfiguration(
        is_client=False, alpn_protocols=[ALPN], connection_id_length=arguments.codec.cid_length)
    if arguments.certificate:
        configuration.load_cert_chain(arguments.certificate, arguments.private_key)
    else:
        configuration.certificate, configuration.private_key = self_signed_certificate()

    # aioquic's QuicServer creates connections by this module-level name (asyncio/server.py).
    QuicLbConnection.codec = arguments.codec
    QuicLbConnection.server_id = arguments.server_id
    aioquic.asyncio.server.QuicConnection = QuicLbConnection

    totals = Totals()

    def create_protocol(quic: QuicConnection, stream_handler=None) -> LbTestProtocol:
        return LbTestProtocol(quic, totals=totals, name=arguments.name, verbose=arguments.verbose)

    loop = asyncio.get_running_loop()
    factory = lambda: CountingQuicServer(configuration=configuration, create_protocol=create_protocol, totals=totals)
    if group is None:
        transport, server = await loop.create_datagram_endpoint(factory, local_addr=arguments.listen)
    else:
        transport, server = await loop.create_datagram_endpoint(factory, sock=group.socket())
    host, port = transport.get_extra_info("sockname")[:2]
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    ready = {"ready": True, "name": arguments.name, "listen": listen}
    if group is not None:
        ready["group"] = {"slot": group.slot, "capacity": arguments.group_capacity, "policy": arguments.group_policy,
                          "quic_lb": group.quic, "steering": group.steering}
    print(json.dumps(ready), flush=True)

    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await asyncio.wait_for(stop.wait(), timeout=arguments.duration)
    except asyncio.TimeoutError:
        pass
    server.close()
    result = {"name": arguments.name, **vars(totals)}
    if group is not None:
        await asyncio.sleep(0)  # let the transport close its socket (a duplicate of the member's)
        if group.quic:
            result["group_counters"] = group.quic_counters()
        group.leave()
    print(json.dumps(result), flush=True)


def main() -> int:
    arguments = parse_arguments()
    if arguments.self_test:
        return 0 if self_test() else 1
    if arguments.reuseportlb is None:
        asyncio.run(serve(arguments))
        return 0
    host, port = arguments.listen
    try:
        group = ReusePortGroup(arguments.reuseportlb)
        group.join(host, port, arguments.group_slot, arguments.group_capacity, arguments.group_policy,
                   None if arguments.group_no_quic else arguments.codec,
                   None if arguments.group_no_quic else arguments.server_id)
    except GroupJoinError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    try:
        asyncio.run(serve(arguments, group))
    finally:
        group.leave()  # nothing if serve left already
    return 0


if __name__ == "__main__":
    sys.exit(main())
