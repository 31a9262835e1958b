"""The daemon's ledger snapshots: where a restart begins (`restored`), and the periodic one a
forked copy of the daemon dumps while it goes on (`Snapshots`).

Invariants: a snapshot is used only if it is sound, bound to the store's chain at the record it
was taken after, and taken with this daemon's ledger settings; otherwise the whole store is
replayed, and the reason said in one line that names the snapshot. A periodic snapshot is
stored only once the group it follows is durable, at most one at a time; a failure (its forked
copy killed by a signal included) is counted and said, and the next is due `every` events
later; the copy is always reaped, and killed when the daemon stops.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import Future

from kvguard.daemon.store import Store
from kvguard.ledger import Ledger, snapshot
from kvguard.ledger.forked import Forked
from kvguard.proto.logs import logger

log = logger("daemon")

SNAPSHOT_EVERY = 1 << 22  # events after which the next group is followed by a snapshot


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


class Snapshots:
    """The periodic snapshot: due every `every` applied events (0: never), counted from
    `start` (the events replayed at start count too)."""

    def __init__(self, store: Store, every: int, start: int, counters: Counter[str]) -> None:
        self.store = store
        self.every = every
        self._after = start  # the applied-event count the last one was due at
        self.counters = counters
        self.saving: threading.Thread | None = None
        self._forked: Forked | None = None  # the copy dumping the snapshot being taken

    def due(self, events: int) -> bool:
        return bool(self.every) and self.saving is None and events - self._after >= self.every

    def fork(self, ledger: Ledger, events: int, committed: Future[int], rows: int) -> None:
        """Snapshot `ledger` as it is after a group just submitted (whose `rows` end at the
        state it holds now) without stopping: a forked copy dumps it, and a thread stores the
        bytes once the group is durable (`committed`: its first record id)."""
        self._after = events  # the next is due `every` on, whatever happens
        try:
            forked = self._forked = Forked(ledger)
        except OSError as exc:
            self.counters["snapshot_failures"] += 1
            _say(f"periodic ledger snapshot not taken: {exc}")
            return
        self.saving = threading.Thread(
            target=self._store, args=(forked, committed, rows), name="kvguard-daemon-snapshot", daemon=True
        )
        self.saving.start()

    def _store(self, forked: Forked, committed: Future[int], rows: int) -> None:
        try:
            body = forked.result()
            through = committed.result() + rows - 1  # groups commit in order: all before it too
            self.store.save_snapshot(body, through)
            self.counters["snapshots"] += 1
            self.counters["snapshot_through"] = through
        except Exception as exc:  # the next one is due after another `every` events
            self.counters["snapshot_failures"] += 1
            _say(f"periodic ledger snapshot not saved: {exc}")
        finally:
            forked.stop()  # reaped, whatever happened
            self._forked = None
            self.saving = None

    def join(self, timeout: float) -> None:
        """Let a snapshot being stored finish."""
        saving = self.saving
        if saving is not None:
            saving.join(timeout=timeout)

    def close(self) -> None:
        """The daemon stops: a copy still dumping is killed and reaped (its snapshot is not
        stored), so that none outlives the daemon."""
        forked = self._forked
        if forked is not None:
            forked.stop()
