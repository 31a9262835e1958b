"""Framing of the testbed's TCP links: router <-> workers (control) and prefill -> decode (KV).

One message is framed as proto/transfer.py says (a header, a JSON object, the payload: KV
pages for a transfer), so the eBPF witness follows the testbed's transfers. Invariant: a reader gets
exactly the message the writer sent, or ConnectionError; never a partial one.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from kvguard.proto.transfer import HEADER, MAX_JSON, MAX_PAYLOAD


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
