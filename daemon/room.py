"""The audit store's room: how much disk it takes, how much is free where it lies, how fast it
grows, and whether the daemon may take more events.

Invariant: below `reserve` bytes free, `refusing` names why and the daemon takes no batch (its
streams end with `store_full`; the agents keep the events spooled and resend them), so a
full disk never fails a commit after the ledger has moved on; intake resumes by itself once
there is room again. Measured by a thread of its own every CHECK_S: a stat of the files (and,
for PostgreSQL, one query), never on the daemon's loop.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.logs import logger

log = logger("daemon")

CHECK_S = 1.0
GROWTH_WINDOW_S = 60.0  # the growth rate is the store's over this long
WARN_S = 3600.0  # say so when, at the current growth, the reserve is this near
RESERVE = 256 << 20  # some seconds of the ingest goal's growth: room between a check and a refusal

Measure = Callable[[], tuple[int, int | None]]  # (bytes used, bytes free or None)


def size(n: float) -> str:
    """Bytes as a person reads them (1.5 GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class StoreRoom:
    def __init__(self, measure: Measure, where: str, reserve: int = RESERVE) -> None:
        if reserve < 0:
            raise ValueError(f"store reserve {reserve}: not a number of bytes")
        self.where = where
        self.reserve = reserve
        self.refusing = ""  # read by the streams for each batch: set here only
        self._measure = measure
        self._samples: deque[tuple[float, int]] = deque()
        self._state = svc.StoreRoom(reserve_bytes=reserve)
        self._warned = False
        self._unmeasured = False  # the last check failed (said once, not every second)
        self._stop = threading.Event()
        self.check()  # the first measure before the daemon takes anything
        self._thread = threading.Thread(target=self._run, name="kvguard-store-room", daemon=True)
        self._thread.start()

    def state(self) -> svc.StoreRoom:
        """The last measure (replaced whole by each check, never changed in place)."""
        return self._state

    def check(self) -> None:
        """Measure once, and take or refuse batches from now on accordingly."""
        try:
            used, free = self._measure()
        except Exception as exc:  # a store that cannot be measured is not refused for it
            if not self._unmeasured:
                log.warning(f"the store's room cannot be measured: {exc}")
            self._unmeasured = True
            return
        self._unmeasured = False
        now = time.monotonic()
        self._samples.append((now, used))
        while now - self._samples[0][0] > GROWTH_WINDOW_S:
            self._samples.popleft()
        then, was = self._samples[0]
        growth = max(0.0, (used - was) / (now - then)) if now > then else 0.0
        state = svc.StoreRoom(used_bytes=used, reserve_bytes=self.reserve, growth_bytes_per_s=growth)
        refusing = ""
        if free is not None:
            state.free_known, state.free_bytes = True, free
            if growth > 0:
                state.full_in_s = max(0.0, (free - self.reserve) / growth)
            if self.reserve and free < self.reserve:
                refusing = (
                    f"the audit store {self.where} has {size(free)} free, under its reserve of "
                    f"{size(self.reserve)}: no events are taken until there is room (agents keep them)"
                )
        state.refusing = refusing
        self._state = state
        self._say(refusing, state)
        self.refusing = refusing

    def _say(self, refusing: str, state: svc.StoreRoom) -> None:
        """A line on each change: refusing, taking again, or the reserve within WARN_S."""
        if refusing != self.refusing:
            said = (
                refusing or f"the audit store has room again ({size(state.free_bytes)} free): taking events"
            )
            log.warning(said)
        near = bool(state.full_in_s) and state.full_in_s < WARN_S and not refusing
        if near and not self._warned:
            log.warning(
                f"the audit store {self.where} grows {size(state.growth_bytes_per_s)}/s with "
                f"{size(state.free_bytes)} free: it reaches its reserve in {state.full_in_s / 60:.0f} min"
            )
        self._warned = near

    def _run(self) -> None:
        while not self._stop.wait(CHECK_S):
            self.check()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
