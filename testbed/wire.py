"""Framing of the testbed's TCP links: router <-> workers (control) and prefill -> decode (KV).

One message = a 12-byte header (JSON length: uint32, payload length: uint64, big-endian),
the JSON object, then the payload bytes (KV pages for a transfer). Invariant: a reader gets
exactly the message the writer sent, or ConnectionError; never a partial one.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

HEADER = struct.Struct(">IQ")  # JSON length, payload length (the eBPF witness decodes it too)
MAX_JSON = 1 << 20
MAX_PAYLOAD = 1 << 34


def send(sock: socket.socket, obj: dict[str, Any], payload: bytes | memoryview = b"") -> int:
    """Send one message; returns the payload bytes written (what a wire probe would see)."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(HEADER.pack(len(body), len(payload)) + body)
    if len(payload):
        sock.sendall(payload)
    return len(payload)


def _exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def recv(sock: socket.socket) -> tuple[dict[str, Any], bytearray]:
    """Receive one message: (object, payload)."""
    n_json, n_payload = HEADER.unpack(_exact(sock, HEADER.size))
    if n_json > MAX_JSON or n_payload > MAX_PAYLOAD:
        raise ConnectionError(f"message too large ({n_json} header bytes, {n_payload} payload bytes)")
    obj = json.loads(_exact(sock, n_json))
    if not isinstance(obj, dict):
        raise ConnectionError("message is not a JSON object")
    return obj, _exact(sock, n_payload) if n_payload else bytearray()


def call(
    address: tuple[str, int], obj: dict[str, Any], payload: bytes = b"", timeout: float = 60.0
) -> dict[str, Any]:
    """One request/response exchange on a fresh connection."""
    with socket.create_connection(address, timeout=timeout) as sock:
        send(sock, obj, payload)
        reply, _ = recv(sock)
        return reply
