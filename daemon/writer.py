"""The audit store's writer in a process of its own, so that building, hashing and inserting
records runs on another core than the daemon's ledger, and overlaps it: while group k
commits, the daemon applies group k+1. A group travels as the batches' bytes as received and
the runs of accepted events in them (`EventRun`), so the daemon never builds an event's row.

Invariants: groups are committed in the order they were submitted, each in one
transaction (shared with the groups queued behind it when the writer falls behind);
`submit()` returns a future that resolves to the group's first record id only once the group
is durable; if the writer fails or dies, every pending and later future fails (the daemon
then stops and rebuilds from the store). The writer exits after committing what was
submitted before `close()`, or when the daemon dies (its end of the pipe closes).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection

from kvguard.daemon.store import EventRun, Record, Store, StoreError, rows_of


def _serve(where: str, key: bytes | None, conn: Connection) -> None:
    store = Store(where, key)
    try:
        while True:
            try:
                groups = [conn.recv()]
                # Groups that queued up while the last commit ran are committed together: one
                # transaction and one fsync for all of them, so a backlog drains faster.
                while groups[-1] is not None and conn.poll():
                    groups.append(conn.recv())
            except (EOFError, OSError):
                return
            stop = groups[-1] is None  # close(): everything before it is committed
            if stop:
                groups.pop()
            rows = [rows_of(messages, parts) for messages, parts in groups]
            try:
                ids = store.append([row for group in rows for row in group])
            except StoreError as exc:
                conn.send(("error", str(exc)))
                return
            first = ids[0] if ids else 0
            for group in rows:
                conn.send(("ok", first))
                first += len(group)
            if stop:
                return
    finally:
        store.close()


class StoreWriter:
    """Submits groups of records to the writer process; resolves their futures in order."""

    def __init__(self, where: str, max_in_flight: int = 4, key: bytes | None = None) -> None:
        """`key`: the store's audit key, when it is sealed (see store.py)."""
        context = multiprocessing.get_context("spawn")  # never fork a process that runs gRPC threads
        self._conn, child = context.Pipe()
        self._proc = context.Process(
            target=_serve, args=(where, key, child), name="kvguard-store-writer", daemon=True
        )
        self._proc.start()
        child.close()
        self._pending: deque[Future[int]] = deque()
        self._slots = threading.Semaphore(max_in_flight)
        self._lock = threading.Lock()
        self._failed: BaseException | None = None
        threading.Thread(target=self._replies, name="kvguard-store-replies", daemon=True).start()

    def submit(self, messages: Sequence[bytes], parts: Sequence[Record | EventRun]) -> Future[int]:
        """Commit a group: `rows_of(messages, parts)`, in one transaction, after every group
        submitted before it. Blocks while `max_in_flight` groups are pending."""
        done: Future[int] = Future()
        self._slots.acquire()
        with self._lock:
            if self._failed is not None:
                self._slots.release()
                done.set_exception(self._failed)
                return done
            self._pending.append(done)
            self._conn.send((messages, parts))
        return done

    def _replies(self) -> None:
        while True:
            try:
                status, value = self._conn.recv()
            except (EOFError, OSError):
                status, value = "error", "the audit store's writer process died"
            with self._lock:
                done = self._pending.popleft() if self._pending else None
                if status != "ok":
                    self._failed = StoreError(str(value))
                    waiting = [done, *self._pending] if done else list(self._pending)
                    self._pending.clear()
            self._slots.release()
            if status == "ok":
                if done is not None:
                    done.set_result(int(value))
                continue
            for future in waiting:
                future.set_exception(self._failed)  # type: ignore[arg-type]
            return

    def close(self) -> None:
        # Ask the writer to finish: closing our end alone would not wake it while our reply
        # thread still blocks reading that end (the socket stays open under it).
        with self._lock, contextlib.suppress(OSError):
            self._conn.send(None)
        self._proc.join(timeout=10)
        self._conn.close()
        if self._proc.is_alive():
            self._proc.kill()
