"""The live alert feed (AlertService.Subscribe) on its own thread: what arrives waits in a
queue that the UI drains on its timer.

Invariants: within one generation (one filter) every alert is handed over once, in cursor
order; when the stream breaks (the daemon restarted, the network) it is opened again after the
last cursor received, after a Backoff wait, so nothing is missed and nothing repeated. A new
filter starts a new generation from the first alert; what was queued under the old one is
dropped, never handed over as the new one's.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import replace

from kvguard.proto.client import Backoff, DaemonClient, DaemonError, Unreachable
from kvguard.proto.filter import Filter
from kvguard.proto.kvguard.v1 import services_pb2 as svc


class AlertFeed:
    def __init__(self, client: DaemonClient, f: Filter | None = None) -> None:
        self.client = client
        self.backoff = Backoff()
        self.generation = 0
        self.filter = f if f is not None else Filter()
        self.cursor = 0  # the last alert received, of this generation
        self.error: DaemonError | None = None  # why the stream is not open now (None: it is, or opening)
        self.subscriptions = 0  # streams opened so far (a reconnect opens another)
        self.received = 0  # alerts handed over in this generation
        self._pending: deque[svc.Alert] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._cancel: object = None
        self._thread = threading.Thread(target=self._run, name="kvguard-top-alerts", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._cancel_stream()

    def wake(self) -> None:
        """Cut a backoff wait short (the daemon is back)."""
        self._wake.set()

    def set_filter(self, f: Filter) -> None:
        """Follow `f` from now on, from its first alert (a new generation)."""
        with self._lock:
            self.generation += 1
            self.filter = f
            self.cursor = 0
            self.received = 0
            self._pending.clear()
        self._cancel_stream()
        self._wake.set()

    def drain(self) -> tuple[int, list[svc.Alert]]:
        """The generation, and the alerts received since the last drain (oldest first)."""
        with self._lock:
            alerts = list(self._pending)
            self._pending.clear()
            return self.generation, alerts

    def _cancel_stream(self) -> None:
        with self._lock:
            cancel, self._cancel = self._cancel, None
        if callable(cancel):
            cancel()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                generation, f, after = self.generation, self.filter, self.cursor
            try:
                self._follow(generation, replace(f, after=after))
            except DaemonError as exc:
                if self._stop.is_set():
                    return
                with self._lock:
                    changed = generation != self.generation
                if changed:  # cancelled for a new filter: open the new one at once
                    continue
                self.error = exc
                if isinstance(exc, Unreachable):
                    self.client.reset()
                self._wake.wait(self.backoff.failed())
                self._wake.clear()

    def _follow(self, generation: int, f: Filter) -> None:
        """One stream, until it breaks (DaemonError) or the generation changes."""
        cancel, alerts = self.client.subscribe(f)
        with self._lock:
            if generation != self.generation or self._stop.is_set():
                cancel()
                return
            self._cancel = cancel
        self.subscriptions += 1
        self.error = None
        for alert in alerts:
            with self._lock:
                if generation != self.generation:
                    return
                self.cursor = alert.cursor
                self.received += 1
                self._pending.append(alert)
            self.backoff.succeeded()
        raise Unreachable("AlertService.Subscribe", "ENDED", "")
