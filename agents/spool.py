"""The node agent's spool (`Spool`): a node's events, from the moment the agent takes them
until the daemon says they are durable; and the events the agent itself originates (`Source`).

Invariants: an event a guard handed over survives a crash of the agent or the daemon (it is
in the spool file, fsynced, before the guard's next frame is read, and stays until the
daemon acknowledges it); events are kept as the bytes the guard sent (never decoded into
objects and written again), with their positions in the node's stream, (epoch, seq), which
only grow: a restarted engine's events are of a new epoch, numbered from 1 again. A damaged
spool file never stops the agent nor hides the events after the damage: each record carries
a marker and a checksum, so reading resumes at the next whole record, and what is damaged is
set aside (spool_file.py).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from pathlib import Path
from urllib.parse import quote

from kvguard.agents.spool_file import Position, read_records, record
from kvguard.proto import pb
from kvguard.proto.logs import logger

log = logger("agent")

__all__ = ["Position", "Source", "Spool"]
# A batch goes ahead of an ack once AHEAD_MIN events wait, or the oldest has waited
# AHEAD_AFTER_S: a stalled commit (a slow disk) then holds no event, so no kill, for longer
# than that, while under load sends stay as large as with one batch in flight (a message per
# few events costs the daemon more than it saves).
AHEAD_MIN = 64
AHEAD_AFTER_S = 0.05


class Spool:
    """A node's unacknowledged events, as their bytes and sequence numbers: in memory, and in
    an append-only file for restarts (each event as one record: spool_file.py)."""

    def __init__(self, directory: Path, node: str) -> None:
        self.path = directory / f"{quote(node, safe='')}.spool"  # a probe's source is node/probe
        self.pending: deque[Position] = deque()  # the (epoch, seq) of each pending event
        self.bodies: deque[bytes] = deque()  # each pending event's bytes: sent and spooled as is
        self.arrived: deque[float] = deque()  # when each pending event reached the spool (monotonic)
        self.cond = threading.Condition()
        self._woken = False  # wake() was called since the last take()
        self._trimmed = 0
        self.set_aside = 0  # damaged records found in the file at start, set aside
        if self.path.exists():
            found = read_records(self.path, node)
            self.set_aside = found.set_aside
            for body, position in found.events:
                self.pending.append(position)
                self.bodies.append(body)
                self.arrived.append(0.0)  # from before a restart: long waiting
            if found.rewrite:  # the file as it should be: whole records only, appendable
                self._rewrite()
        self._file = self.path.open("ab")

    def append(self, bodies: list[bytes], seqs: list[Position]) -> None:
        """Spool events (their bytes, as received) and their positions, durably."""
        if not bodies:
            return
        blob = b"".join(record(b) for b in bodies)
        with self.cond:
            self._file.write(blob)
            self._file.flush()
            os.fsync(self._file.fileno())
            self.pending.extend(seqs)
            self.bodies.extend(bodies)
            self.arrived.extend([time.monotonic()] * len(bodies))
            self.cond.notify_all()

    def take(
        self, limit: int, max_bytes: int, timeout: float, after: Position = (0, 0), ahead: bool = False
    ) -> tuple[list[Position], list[bytes]]:
        """The positions and bytes of the oldest unacknowledged events after
        `after` (those up to it are sent and not yet acknowledged), at most `limit` of them and `max_bytes` of
        bytes (but always the first), waiting up to `timeout` for one or for wake(). `ahead`
        (they would go ahead of an ack): only once AHEAD_MIN events wait or the oldest of
        them has waited AHEAD_AFTER_S; else none."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                skip = self._sent(after)
                waiting = len(self.pending) - skip
                now = time.monotonic()
                due = waiting and (not ahead or waiting >= AHEAD_MIN)
                if waiting and not due:  # going ahead of an ack: a few may wait a little
                    old = self.arrived[skip] + AHEAD_AFTER_S
                    due = now >= old
                    wait = min(deadline, old) - now
                else:
                    wait = deadline - now
                if due or self._woken or wait <= 0:
                    break
                self.cond.wait(wait)
            self._woken = False
            if not due:
                return [], []
            n = total = 0
            for body in itertools.islice(self.bodies, skip, None):
                if n == limit or (n and total + len(body) > max_bytes):
                    break
                n, total = n + 1, total + len(body)
            return (
                list(itertools.islice(self.pending, skip, skip + n)),
                list(itertools.islice(self.bodies, skip, skip + n)),
            )

    def _sent(self, after: Position) -> int:
        """How many pending events lie up to `after` (a prefix: positions increase)."""
        n = 0
        for seq in self.pending:
            if seq > after:
                break
            n += 1
        return n

    def wake(self) -> None:
        """End a take() that is waiting (an ack came: the sender has work besides sending)."""
        with self.cond:
            self._woken = True
            self.cond.notify_all()

    def ack(self, durable: Position, rejected: set[Position] = frozenset()) -> None:  # type: ignore[assignment]
        """Drop what the daemon holds: every event up to `durable`, and those it refused."""
        with self.cond:
            while self.pending and (self.pending[0] <= durable or self.pending[0] in rejected):
                self.pending.popleft()
                self.bodies.popleft()
                self.arrived.popleft()
                self._trimmed += 1
            if not self.pending:
                self._file.truncate(0)
                self._file.seek(0)
                self._trimmed = 0
            elif self._trimmed > 50_000:  # rewrite the file with what is still unacknowledged
                self._file.close()
                self._rewrite()
                self._file = self.path.open("ab")
                self._trimmed = 0

    def _rewrite(self) -> None:
        """Replace the file, whole, with the pending events' records."""
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("wb") as out:
            out.write(b"".join(record(b) for b in self.bodies))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)

    def close(self) -> None:
        self._file.close()


class Source:
    """Events the agent itself originates under one name (an unguarded engine's node, or a
    witness's `node/probe`), numbered from 1 without gaps across the agent's restarts (the
    last number is kept in the spool directory)."""

    def __init__(self, spool: Spool, directory: Path, name: str) -> None:
        self.name = name
        self.spool = spool
        self._path = directory / f"{quote(name, safe='')}.seq"
        self._seq = self._last_number()
        self._lock = threading.Lock()

    def _last_number(self) -> int:
        """The last number used, as kept. A file that does not hold one (damaged) must not make
        a number be used twice, which the daemon would refuse as a tampered copy: the count
        goes on from the clock in microseconds, far past any number used, leaving one gap."""
        try:
            text = self._path.read_text()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            return self._damaged(f"cannot be read ({exc.strerror})")
        try:
            seq = int(text)
        except ValueError:
            return self._damaged(f"holds {text[:20]!r}, not a number")
        return seq if 0 <= seq < 2**62 else self._damaged(f"holds {seq}, out of range")

    def _damaged(self, why: str) -> int:
        seq = time.time_ns() // 1000
        log.warning(f"{self._path} {why}; {self.name} goes on from {seq}")
        return seq

    def emit(self, **payload: object) -> None:
        """Spool one event with this payload (one keyword: the payload's name)."""
        with self._lock:
            self._seq += 1
            # The number is kept before the event is spooled: a crash in between leaves a gap
            # (reported), never a number used twice (which the daemon would refuse as a repeat).
            self._path.write_text(str(self._seq))
            event = pb.Event(node=self.name, seq=self._seq, ts_ns=time.time_ns(), **payload)
            self.spool.append([event.SerializeToString()], [(0, self._seq)])
