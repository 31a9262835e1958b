"""The daemon's ledger snapshots: where a restart begins (`restored`), and the periodic one,
built by a process of its own from the store (daemon/snapshot_worker.py) while the daemon goes
on (`Snapshots`).

Invariants: a snapshot is used only if it is sound, bound to the store's chain at the record it
was taken after, and taken with this daemon's ledger settings; otherwise the whole store is
replayed, and the reason said in one line that names the snapshot. The periodic one is never
taken by forking the daemon (its gRPC threads make a forked copy undefined behaviour): the
worker is started by exec and reads the store only; it ends at a committed group, so what it
stores is durable. At most one runs at a time; its failure (a signal included) is counted and
said, and the next is due `every` events later; it is always reaped, and killed when the
daemon stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from typing import Any

import orjson

from kvguard.daemon.snapshot_worker import MAGIC
from kvguard.daemon.store import Store
from kvguard.ledger import Ledger, snapshot
from kvguard.proto.logs import logger

log = logger("daemon")

SNAPSHOT_EVERY = 1 << 22  # events after which the next snapshot is due
WORKER = "kvguard.daemon.snapshot_worker"


def restored(store: Store, fresh: Ledger) -> tuple[Ledger, int]:
    """The ledger of the store's latest snapshot, if it is sound and was taken with `fresh`'s
    settings, and the record it was taken after; else `fresh` and 0 (the whole store is
    replayed), saying why."""
    found = store.latest_snapshot()
    if isinstance(found, str):
        if found != "no snapshot":
            _say(f"{found}; replaying the whole store")
        return fresh, 0
    through, body = found
    try:
        ledger = snapshot.load(body)
    except snapshot.SnapshotError as exc:
        _say(f"the snapshot taken after record {through} cannot be loaded: {exc}; replaying the whole store")
        return fresh, 0
    if snapshot.settings(ledger) != snapshot.settings(fresh):
        _say("the snapshot was taken with other ledger settings; replaying the whole store")
        return fresh, 0
    return ledger, through


def _say(text: str) -> None:
    log.warning(text)


def worker_command(store: Store, settings: dict[str, Any], *more: str) -> list[str]:
    """The snapshot worker's command line for `store` and the ledger `settings` (`more`: a
    cell's options); the audit keys go on its stdin (worker_input), never in its arguments."""
    args = [sys.executable, "-m", WORKER, "--store", store.url, "--settings", orjson.dumps(settings).decode()]
    return args + list(more) + (["--head-file", store.head_file] if store.head_file else [])


def worker_input(store: Store, previous: bytes = b"") -> bytes:
    """What the worker reads on stdin: the audit keys on one line, then a cell's previous snapshot."""
    return " ".join(k.hex() for k in store.audit_keys()).encode() + b"\n" + previous


def worker_output(returncode: int, out: bytes, err: bytes) -> tuple[int, bytes]:
    """(the record it was taken after, its bytes: empty when nothing new) of a worker that
    ended with `returncode`; SnapshotError saying why there is none."""
    if returncode != 0:
        said = err.decode(errors="replace").strip() or f"exit status {returncode}"
        how = f"was killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"failed: {said}"
        raise snapshot.SnapshotError(f"the process building it {how}")
    head, _, body = out.partition(b"\n")
    magic, through, size = head.split(b" ") if head.count(b" ") == 2 else (b"", b"0", b"-1")
    if magic != MAGIC or int(size) != len(body):
        raise snapshot.SnapshotError(f"the process building it wrote {len(out)} bytes that are not one")
    return int(through), body


class Snapshots:
    """The periodic snapshot: due every `every` applied events (0: never), counted from
    `start` (the events replayed at start count too); built with the ledger `settings` from
    `store` (its audit keys given to the worker on its stdin, never in its arguments)."""

    def __init__(
        self,
        store: Store,
        every: int,
        start: int,
        counters: Counter[str],
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.store = store
        self.every = every
        self._after = start  # the applied-event count the last one was due at
        self.counters = counters
        self.settings = settings if settings is not None else snapshot.settings(Ledger())
        self.saving: threading.Thread | None = None
        self._worker: subprocess.Popen[bytes] | None = None
        self._closed = False
        self._lock = threading.Lock()

    def due(self, events: int) -> bool:
        return bool(self.every) and self.saving is None and events - self._after >= self.every

    def start(self, events: int) -> None:
        """Begin a snapshot of what the store holds now; the loop goes on at once."""
        self._after = events  # the next is due `every` on, whatever happens
        self.saving = threading.Thread(target=self._take, name="kvguard-daemon-snapshot", daemon=True)
        self.saving.start()

    def command(self) -> list[str]:
        return worker_command(self.store, self.settings)

    def _take(self) -> None:
        try:
            with self._lock:
                if self._closed:
                    return
                # exec'd (vfork + exec): no Python runs in a copy of the daemon
                worker = self._worker = subprocess.Popen(
                    self.command(),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            out, err = worker.communicate(worker_input(self.store))
            through, body = worker_output(worker.returncode, out, err)
            if body:  # else nothing was stored after the latest snapshot
                self.store.save_snapshot(body, through)
                self.counters["snapshots"] += 1
                self.counters["snapshot_through"] = through
        except Exception as exc:  # the next one is due after another `every` events
            if not self._closed:  # killed by the daemon's stop: superseded, not failed
                self.counters["snapshot_failures"] += 1
                _say(f"periodic ledger snapshot not saved: {exc}")
        finally:
            self._worker = None
            self.saving = None

    def join(self, timeout: float) -> None:
        """Let a snapshot being built and stored finish."""
        saving = self.saving
        if saving is not None:
            saving.join(timeout=timeout)

    def close(self) -> None:
        """The daemon stops: a worker still at work is killed (its snapshot is not stored), so
        that none outlives the daemon."""
        with self._lock:
            self._closed = True
            worker = self._worker
        if worker is not None and worker.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)
