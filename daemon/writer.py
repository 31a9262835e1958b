"""The audit store's writer in a process of its own, so that building, hashing and inserting
records runs on another core than the daemon's ledger, and overlaps it: while group k
commits, the daemon applies the batches of group k+1. A group travels as the batches as the
daemon read them (their bytes and heads) and the runs of accepted events in them (`EventRun`),
so the daemon never builds an event's row and the writer never decodes an event again.

Invariants: groups are committed in the order they were submitted, each in one
transaction (shared with the groups queued behind it when the writer falls behind); each
commit is reported, in order and only once durable, on the daemon's event loop; if the writer
fails or dies, that is reported instead and nothing after it commits (the daemon then stops
and rebuilds from the store). After each commit it writes the chain's head (store/head.py),
made durable when it has nothing to commit. The writer exits after committing what was submitted before
`close()`, or when the daemon dies (its end of the pipe closes). It has the store open before
the daemon serves: otherwise the first alerts after a start wait out its start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import signal
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

from kvguard.daemon.store import EventRun, Record, Store, StoreError, rows_of
from kvguard.proto.wire import Batch

READY_TIMEOUT_S = 60.0  # for the writer process to start and open the store


def _told(conn: Connection, message: tuple[str, object]) -> bool:
    """Say `message` to the daemon; False if it is gone (killed, even before the writer was
    ready): the writer then ends quietly, having lost nothing it had committed."""
    try:
        conn.send(message)
    except OSError:  # BrokenPipeError, ConnectionResetError: no daemon to tell
        return False
    return True


def _serve(where: str, key: bytes | None, head_file: str | None, conn: Connection) -> None:
    # The daemon stops the writer (None on the pipe, after its last group), or its death does
    # (EOF). A Ctrl-C, or systemd's SIGTERM to the whole service, reaches the writer too: dying
    # of it would lose the groups still on their way, and the daemon's last snapshot with them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        store = Store(where, key, head_file=head_file)
    except Exception as exc:  # said to the daemon, which refuses to start
        _told(conn, ("error", f"the store writer cannot open the store: {exc}"))
        return
    try:
        if not _told(conn, ("ready", 0)):
            return
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
            rows = [rows_of(batches, parts) for batches, parts in groups]
            try:
                ids = store.append([row for group in rows for row in group])
            except StoreError as exc:
                _told(conn, ("error", str(exc)))
                return
            first = ids[0] if ids else 0
            for group in rows:
                if not _told(conn, ("ok", first)):
                    return
                first += sum(row.ids for row in group)
            if stop:
                return
            if not conn.poll():  # nothing waits to be committed: a moment for the WAL's and head's upkeep
                store.restart_wal()
                store.sync_head()
    finally:
        store.close()


class Writer:
    """What the daemon needs of a store writer: groups submitted in order, and each commit
    reported on the daemon's loop by its group's first record id (or the failure, once)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._committed: Callable[[int], None] = lambda first: None
        self._failed: Callable[[StoreError], None] = lambda exc: None

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        committed: Callable[[int], None],
        failed: Callable[[StoreError], None],
    ) -> None:
        """Report commits and failures on `loop` (call before the loop runs, or on it)."""
        self._loop, self._committed, self._failed = loop, committed, failed
        self._listen(loop)

    def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        """Where a writer that reports from elsewhere hooks its reports into the loop."""

    def submit(self, batches: Sequence[Batch], parts: Sequence[Record | EventRun]) -> None:
        """Commit a group: `rows_of(batches, parts)`, in one transaction, after every group
        submitted before it (on the loop given to start())."""
        raise NotImplementedError

    def close(self) -> None:
        """Commit what was submitted and stop."""


class InlineWriter(Writer):
    """The store written from the daemon's own process (tests, tools): each group committed
    before submit() returns, and reported on the loop's next step, as StoreWriter's are."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store = store

    def submit(self, batches: Sequence[Batch], parts: Sequence[Record | EventRun]) -> None:
        assert self._loop is not None, "start() first"
        try:
            ids = self.store.append(rows_of(batches, parts))
        except StoreError as exc:
            self._loop.call_soon_threadsafe(self._failed, exc)
            return
        self._loop.call_soon_threadsafe(self._committed, ids[0] if ids else 0)


class StoreWriter(Writer):
    """Sends groups of records to the writer process; its replies are read on the daemon's
    event loop (no thread of its own: a commit's report wakes the loop directly)."""

    def __init__(self, where: str, key: bytes | None = None, head_file: str | None = None) -> None:
        """`key`: the store's audit key, when it is sealed (see store.py); `head_file`: where the
        chain's head is kept (default: beside a SQLite store, store/head.py)."""
        super().__init__()
        context = multiprocessing.get_context("spawn")  # never fork a process that runs gRPC threads
        self._conn, child = context.Pipe()
        self._proc = context.Process(
            target=_serve, args=(where, key, head_file, child), name="kvguard-store-writer", daemon=True
        )
        self._proc.start()
        child.close()
        self._dead = False

    def _listen(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait until the writer process has the store open (it started with the daemon, which
        rebuilt its ledger meanwhile), then read its reports on the loop."""
        try:
            ready = self._conn.recv() if self._conn.poll(READY_TIMEOUT_S) else None
        except (EOFError, OSError):
            ready = ("error", "the audit store's writer process died before it started")
        if ready is None:
            ready = ("error", f"the audit store's writer process did not start in {READY_TIMEOUT_S:g} s")
        if ready[0] != "ready":
            self._dead = True
            raise StoreError(str(ready[1]))
        loop.add_reader(self._conn.fileno(), self._readable)

    def submit(self, batches: Sequence[Batch], parts: Sequence[Record | EventRun]) -> None:
        if self._dead:
            return  # the failure was reported; the daemon is stopping
        try:
            self._conn.send((batches, parts))
        except OSError:
            self._die("the audit store's writer process died")

    def _readable(self) -> None:
        try:
            while self._conn.poll():
                status, value = self._conn.recv()
                if status != "ok":
                    self._die(str(value))
                    return
                self._committed(int(value))
        except (EOFError, OSError):
            self._die("the audit store's writer process died")

    def _die(self, reason: str) -> None:
        if self._dead:
            return
        self._dead = True
        if self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
        self._failed(StoreError(reason))

    def close(self) -> None:
        """Commit what was submitted, then end the writer process (call once the daemon's loop
        has stopped reading its replies)."""
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._proc.join(timeout=10)
        self._conn.close()
        if self._proc.is_alive():
            self._proc.kill()
