"""The local link between in-engine guards and the node agent: a Unix socket carrying
length-prefixed kvguard.v1 service messages (the same AgentMessage / DaemonMessage the
agent and the daemon exchange over gRPC).

Guard -> agent: a Hello naming the guard's node, then EventBatch messages.
Agent -> guard: Command messages (kill a request, quarantine pages).
Invariant: a frame is read whole or the connection is dropped; a frame larger than
MAX_FRAME is refused (the peer is misbehaving).
"""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

from kvguard.proto.kvguard.v1 import services_pb2 as svc

MAX_FRAME = 16 << 20
PEER_CLOSED = "the peer closed the connection"
_LEN = struct.Struct(">I")


def send_frame(sock: socket.socket, message: svc.AgentMessage | svc.DaemonMessage) -> None:
    send_bytes(sock, message.SerializeToString())


def send_bytes(sock: socket.socket, data: bytes) -> None:
    """One frame: a serialized message, as its length and its bytes."""
    sock.sendall(_LEN.pack(len(data)) + data)


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(PEER_CLOSED)
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes (at most {MAX_FRAME})")
    return _exact(sock, n)


def listening(path: Path, kind: int = socket.SOCK_STREAM, mode: int | None = None) -> socket.socket:
    """A Unix socket listening at `path` (timeout 0.5 s, for a stop flag's sake). It appears at
    its path only once it listens (bound aside, then renamed): a client that finds the path is
    never refused. `mode`: the permissions of the path."""
    bound = path.with_name(path.name + ".binding")
    bound.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, kind)
    server.bind(str(bound))
    if mode is not None:
        os.chmod(bound, mode)
    server.listen(64)
    server.settimeout(0.5)
    os.replace(bound, path)
    return server


def peer_pid(sock: socket.socket) -> int:
    """The process at the other end of a Unix socket, as the kernel tells it (SO_PEERCRED)."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
