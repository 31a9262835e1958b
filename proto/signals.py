"""The signals a service's main loop waits for (SIGTERM, SIGINT, SIGHUP), taken without locks.

Invariant: a handler only records its signal (a set's add) and Python's wakeup fd wakes the
loop. Nothing in a handler takes a lock: a handler runs in the main thread between two of its
bytecodes, and an Event.set() there deadlocks when the signal lands while the main thread
holds that Event's lock, as it does inside wait() and clear().
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from types import FrameType


class Signals:
    """Records the signals it listens to until the main loop takes them (`wait`)."""

    def __init__(self, *signums: int) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._pending: set[int] = set()
        self.listen(*signums)

    def listen(self, *signums: int) -> None:
        """Record these signals too from now on (the default action until then)."""
        for signum in signums:
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._pending.add(signum)

    def wait(self, timeout: float | None = None) -> set[int]:
        """The signals received since the last call, waiting up to `timeout` s (None: until
        one comes) when there are none yet."""
        if not self._pending:
            select.select([self._read], [], [], timeout)
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 512):
                pass
        # A signal that lands between these two lines is added to the set returned: not lost.
        taken, self._pending = self._pending, set()
        return taken

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)
