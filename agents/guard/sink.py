"""Where a guard's events go, without ever blocking the engine.

Events are handed over as their bytes (the guard writes them once). `put()` never waits: an
event that does not fit the bounded queue is counted in `dropped`, which the guard reports
in-band (heartbeat), never silently. A background thread drains the queue: `AgentSink` to the
node agent's Unix socket (and the agent's commands back to the guard, through `listen`),
`CaptureSink` to a JSON Lines capture that `kvguard replay` reads.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from kvguard.proto import pb, wire
from kvguard.proto.capture import event_to_json
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.local import MAX_FRAME, recv_frame, send_bytes, send_frame

Command = Callable[[svc.Command], None]
HELLO_ANSWER_S = 5.0  # an agent answers a hello at once; one that has not by then is written to anyway
REFUSED_RETRY_S = 1.0  # after a refusal (the node has a guard already, the agent is full), dial again


class EventSink(Protocol):
    dropped: int

    def put(self, event: bytes) -> bool:
        """Queue one serialized event; False (and counted in `dropped`) if it did not fit."""
        ...

    def listen(self, on_command: Command) -> None:
        """Where the commands that come back on this sink go (the guard's command path)."""
        ...

    def close(self) -> None: ...


class NullSink:
    """Keeps nothing (a guard whose events are only checked locally)."""

    dropped = 0

    def put(self, event: bytes) -> bool:
        return True

    def listen(self, on_command: Command) -> None:
        pass

    def close(self) -> None:
        pass


class _Redial:
    """Queued by the command reader when the agent goes: not an event, a wake-up to dial."""


_REDIAL = _Redial()


class _Answer:
    """What the agent said to one connection's hello, and whether that connection is over."""

    def __init__(self) -> None:
        self.came = threading.Event()  # an answer, or the connection's end
        self.refusal = ""
        self.over = False


class _QueuedSink:
    """The engine's side of a sink: a bounded queue that never waits; what overflows it is
    counted in `dropped`. A background thread of the subclass drains `_queue` (None: stop)."""

    def __init__(self, capacity: int) -> None:
        self.dropped = 0
        self._queue: queue.Queue[bytes | _Redial | None] = queue.Queue(capacity)

    def listen(self, on_command: Command) -> None:
        pass  # no command comes back on this sink

    def put(self, event: bytes) -> bool:
        try:
            self._queue.put_nowait(event)
            return True
        except queue.Full:
            self.dropped += 1
            return False


class CaptureSink(_QueuedSink):
    """Appends events to a JSON Lines capture file from a background thread."""

    def __init__(self, path: str | Path, capacity: int = 65536) -> None:
        super().__init__(capacity)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.written = 0
        self._file = self.path.open("a", encoding="utf-8")
        self._thread = threading.Thread(
            target=self._drain, name=f"kvguard-sink-{self.path.name}", daemon=True
        )
        self._thread.start()

    def _drain(self) -> None:
        while True:
            batch = [self._queue.get()]
            # Batch whatever else is waiting into the same write.
            while len(batch) < 1024:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            events = [e for e in batch if isinstance(e, bytes)]
            if events:
                self._file.write("".join(event_to_json(pb.Event.FromString(e)) + "\n" for e in events))
                self._file.flush()
                self.written += len(events)
            for _ in batch:
                self._queue.task_done()
            if len(events) != len(batch):
                return

    def flush(self) -> None:
        """Wait until every event queued so far is on disk (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10)
        self._file.close()


FRAME_BYTES = MAX_FRAME // 2  # the events one frame to the agent carries at most (their bytes)
EVENT_OVERHEAD = 8  # a frame's bytes around each event (its field tag and length)


def _frame_share(pending: list[bytes]) -> int:
    """How many of `pending`, from the first, one frame carries (within FRAME_BYTES); 0 when
    the first alone is over the agent's frame limit."""
    if len(pending[0]) + 2 * EVENT_OVERHEAD > MAX_FRAME:
        return 0
    size = 0
    for n, body in enumerate(pending):
        size += len(body) + EVENT_OVERHEAD
        if n and size > FRAME_BYTES:
            return n
    return len(pending)


def _hang_up(sock: socket.socket) -> None:
    """Shut the connection down, then close it: a bare close() leaves it open while the
    command reader is blocked on it (the agent would never see the guard go)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class AgentSink(_QueuedSink):
    """Sends a guard's events to the node agent over its Unix socket, from a background thread;
    commands the agent relays (kill a request) go to `on_command`. While the agent is away the
    events wait in the bounded queue; only what overflows it is dropped, and counted.

    The sink connects as soon as it is made, and `ready` is set once the agent has answered
    the hello (an `ack` naming the node): from then on the agent watches this process, so its
    eBPF witness follows every connection the engine opens. A connection opened before that
    cannot be followed (its message boundaries are unknown): an engine waits for `wait_ready`
    before it opens its transfer connections (the testbed's workers do). When the agent goes
    (a restart), the sink dials again at once, not at the engine's next event, so the new
    agent watches the engine before its next transfer if it can.

    Events go only on a connection the agent has welcomed. An agent refuses a guard whose
    node has a guard connected already, or when it serves as many as it may: the sink says
    why once (`refused`, counted in `refusals`), keeps the events queued, and dials again."""

    def __init__(
        self,
        socket_path: str | Path,
        node: str,
        *,
        capacity: int = 65536,
        on_command: Command | None = None,
    ) -> None:
        super().__init__(capacity)
        self.socket_path = str(socket_path)
        self.node = node
        self.sent = 0
        self.oversized = 0  # events over the agent's frame limit, dropped (said on stderr)
        self.connected = threading.Event()
        self.ready = threading.Event()
        self._on_command = on_command
        self.refused = ""  # the agent's last refusal of this guard ("" if none)
        self.refusals = 0
        self._link = threading.Lock()  # a connection's end against its being taken as connected
        self._pending: list[bytes] = []
        self._sock: socket.socket | None = None  # the connection the command reader follows
        self._closing = threading.Event()  # close() began: the first connection stops trying
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvguard-agent-sink-{node}", daemon=True)
        self._thread.start()

    def _connect(self, first: bool = False) -> socket.socket:
        """A connection that has said hello. The first (made at once, with nothing to send
        yet) gives up when close() begins; later ones, which carry pending events, only once
        the sink is closed."""
        while not self._closed and not (first and self._closing.is_set()):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.socket_path)
                send_frame(sock, svc.AgentMessage(hello=svc.Hello(node=self.node, agent_version="guard")))
            except OSError:
                sock.close()
                time.sleep(0.2)
                continue
            self._sock = sock
            answer = _Answer()
            threading.Thread(target=self._read_commands, args=(sock, answer), daemon=True).start()
            answer.came.wait(HELLO_ANSWER_S)
            with self._link:
                if not answer.over:
                    self.connected.set()
                    return sock
            _hang_up(sock)
            if answer.refusal:
                self._refused(answer.refusal)
                self._closing.wait(REFUSED_RETRY_S)
            else:  # the agent went before it answered
                time.sleep(0.2)
        raise ConnectionError("sink closed")

    def _refused(self, why: str) -> None:
        self.refusals += 1
        if why != self.refused:  # said once, not at every retry
            print(f"kvguard guard: the node agent refused node {self.node}: {why}", file=sys.stderr)
        self.refused = why

    def _read_commands(self, sock: socket.socket, answer: _Answer) -> None:
        try:
            while True:
                msg = svc.DaemonMessage.FromString(recv_frame(sock))
                body = msg.WhichOneof("body")
                if body == "ack" and msg.ack.node == self.node:
                    self.ready.set()
                    answer.came.set()
                elif body == "error":
                    answer.refusal = f"{msg.error.code}: {msg.error.message}"
                    break
                elif body == "command" and self._on_command is not None:
                    self._on_command(msg.command)
        except (OSError, ConnectionError, ValueError):
            pass
        with self._link:
            answer.over = True
            answer.came.set()
            # the agent went (or refused), not a connection the sink had left already
            redial = sock is self._sock and self.connected.is_set()
        if redial:
            if answer.refusal:
                self._refused(answer.refusal)
            self.ready.clear()
            self.connected.clear()
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(_REDIAL)  # wake the sender to dial again

    def listen(self, on_command: Command) -> None:
        self._on_command = on_command

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the agent has taken this guard's hello (and watches its process)."""
        return self.ready.wait(timeout)

    def _run(self) -> None:
        sock: socket.socket | None = None
        with contextlib.suppress(ConnectionError):
            sock = self._connect(first=True)
        while True:
            if not self._pending:
                item = self._queue.get()
                batch = [item]
                while len(batch) < 4096:
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                self._pending = [e for e in batch if isinstance(e, bytes)]
                stop = any(e is None for e in batch)
                for _ in batch:
                    self._queue.task_done()
                if any(e is _REDIAL for e in batch) and not stop and not self.connected.is_set():
                    if sock is not None:
                        _hang_up(sock)
                    sock = None
                    if not self._pending:  # else the sends below dial
                        with contextlib.suppress(ConnectionError):
                            sock = self._connect(first=True)
            else:
                stop = False
            while self._pending:
                take = _frame_share(self._pending)
                if take == 0:  # one event the agent could never take: dropped alone, said, counted
                    self.oversized += 1
                    print(
                        f"kvguard guard: {self.node}: an event of {len(self._pending[0])} bytes is over the "
                        f"agent's frame limit of {MAX_FRAME}; dropped",
                        file=sys.stderr,
                    )
                    self._pending = self._pending[1:]
                    continue
                try:
                    if sock is None:
                        sock = self._connect()
                    send_bytes(sock, wire.frame(self._pending[:take]))
                    self.sent += take
                    self._pending = self._pending[take:]
                except (OSError, ConnectionError):
                    if sock is not None:
                        _hang_up(sock)
                    sock = None
                    if self._closed:
                        return
                    time.sleep(0.2)
            if stop:
                if sock is not None:
                    _hang_up(sock)
                return

    @property
    def waiting(self) -> int:
        """Events not handed to the agent yet (queued, or in the batch being sent)."""
        return self._queue.qsize() + len(self._pending)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every event queued so far has been handed to the agent, for at most
        `timeout` seconds (an agent that is gone, or refuses this guard, takes none): whether
        they all were."""
        deadline = time.monotonic() + timeout
        while (self._queue.unfinished_tasks or self._pending) and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks and not self._pending

    def close(self) -> None:
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._closed = True
        self.ready.clear()
        self.connected.clear()
