"""The local link between in-engine guards and the node agent: a Unix socket carrying
length-prefixed kvguard.v1 service messages (the same AgentMessage / DaemonMessage the
agent and the daemon exchange over gRPC).

Guard -> agent: a Hello naming the guard's node, then EventBatch messages.
Agent -> guard: an Ack welcoming the guard (or a StreamError refusing it), then Command
messages (kill a request, quarantine pages).
Invariant: a frame is read whole or the connection is dropped; a frame larger than
MAX_FRAME is refused (the peer is misbehaving), and so, where the reader sets a timeout, is
a frame begun and not finished within it. A listening socket is never wider than its mode.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvguard.proto.kvguard.v1 import services_pb2 as svc

MAX_FRAME = 16 << 20
PEER_CLOSED = "the peer closed the connection"
_LEN = struct.Struct(">I")
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class FrameTimeout(ConnectionError):
    """A frame did not begin, or did not end, within the reader's time."""


def send_frame(sock: socket.socket, message: svc.AgentMessage | svc.DaemonMessage) -> None:
    send_bytes(sock, message.SerializeToString())


def send_bytes(sock: socket.socket, data: bytes) -> None:
    """One frame: a serialized message, as its length and its bytes."""
    sock.sendall(_LEN.pack(len(data)) + data)


def _readable(sock: socket.socket, seconds: float | None) -> bool:
    """Whether the socket has bytes (or its end) to read within `seconds` (None: forever)."""
    poll = select.poll()
    poll.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poll.poll(None if seconds is None else max(0, int(seconds * 1000))))


def _exact(sock: socket.socket, n: int, deadline: float | None = None, timeout: float = 0.0) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None and not _readable(sock, deadline - time.monotonic()):
            raise FrameTimeout(f"a frame begun was not finished within {timeout:g} s")
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(PEER_CLOSED)
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, timeout: float | None = None, wait: float | None = None) -> bytes:
    """The next frame's bytes. `timeout`: the seconds a frame may take from its first byte to
    its last (None: no limit; a socket with a timeout of its own needs one); `wait`: the
    seconds to wait for it to begin (None: forever). FrameTimeout past either."""
    deadline = None
    if timeout is not None or wait is not None:
        if not _readable(sock, wait):
            raise FrameTimeout(f"no frame began within {wait:g} s")
        if timeout is not None:
            deadline = time.monotonic() + timeout
    (n,) = _LEN.unpack(_exact(sock, _LEN.size, deadline, timeout or 0.0))
    if n > MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes (at most {MAX_FRAME})")
    return _exact(sock, n, deadline, timeout or 0.0)


def hung_up(sock: socket.socket) -> bool:
    """Whether the peer has closed its end (or the connection failed): read nothing."""
    poll = select.poll()
    poll.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poll.poll(0))


def listening(path: Path, kind: int = socket.SOCK_STREAM, mode: int = 0o600) -> socket.socket:
    """A Unix socket listening at `path` with permissions `mode` (timeout 0.5 s, for a stop
    flag's sake). It is bound in a directory of its own that only its owner may enter, given
    its mode there, and then moved to its path: it is never reachable with wider permissions,
    and a client that finds the path is never refused for want of a listener."""
    # Names as short as they can be: a Unix socket's path holds at most 107 bytes, and the
    # one bound first must fit wherever `path` itself fits.
    private = Path(tempfile.mkdtemp(prefix=".k", dir=path.parent))  # mode 0700
    bound = private / "s"
    server = socket.socket(socket.AF_UNIX, kind)
    try:
        server.bind(str(bound))
        os.chmod(bound, mode)
        server.listen(64)
        server.settimeout(0.5)
        os.replace(bound, path)
    except OSError:
        server.close()
        raise
    finally:
        bound.unlink(missing_ok=True)
        private.rmdir()
    return server


@dataclass(frozen=True)
class Peer:
    """The process at the other end of a Unix socket, as the kernel tells it (SO_PEERCRED),
    and the executable it runs ("" where /proc does not say)."""

    pid: int
    uid: int
    gid: int
    exe: str

    def __str__(self) -> str:
        return f"pid {self.pid} uid {self.uid} gid {self.gid} exe {self.exe or '(unknown)'}"


def peer_of(sock: socket.socket, proc: str = "/proc") -> Peer:
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    try:
        exe = os.readlink(f"{proc}/{pid}/exe")
    except OSError:  # gone already, or not ours to read
        exe = ""
    return Peer(pid, uid, gid, exe)


def peer_pid(sock: socket.socket) -> int:
    """The process at the other end of a Unix socket, as the kernel tells it (SO_PEERCRED)."""
    pid: int = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[0]
    return pid
