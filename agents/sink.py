"""Where a guard's events go, without ever blocking the engine.

`put()` never waits: an event that does not fit the bounded queue is counted in `dropped`,
which the guard reports in-band (heartbeat), never silently. A background thread drains the
queue. Until the node agent exists, `CaptureSink` writes a JSON Lines capture that
`kvguard replay` reads.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Protocol

from kvguard.proto import pb
from kvguard.proto.capture import event_to_json


class EventSink(Protocol):
    dropped: int

    def put(self, event: pb.Event) -> bool: ...

    def close(self) -> None: ...


class NullSink:
    """Keeps nothing (a guard whose events are only checked locally)."""

    dropped = 0

    def put(self, event: pb.Event) -> bool:
        return True

    def close(self) -> None:
        pass


class CaptureSink:
    """Appends events to a JSON Lines capture file from a background thread."""

    def __init__(self, path: str | Path, capacity: int = 65536) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.dropped = 0
        self.written = 0
        self._queue: queue.Queue[pb.Event | None] = queue.Queue(capacity)
        self._file = self.path.open("a", encoding="utf-8")
        self._thread = threading.Thread(
            target=self._drain, name=f"kvguard-sink-{self.path.name}", daemon=True
        )
        self._thread.start()

    def put(self, event: pb.Event) -> bool:
        try:
            self._queue.put_nowait(event)
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def _drain(self) -> None:
        while True:
            batch = [self._queue.get()]
            # Batch whatever else is waiting into the same write.
            while len(batch) < 1024:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            events = [e for e in batch if e is not None]
            if events:
                self._file.write("".join(event_to_json(e) + "\n" for e in events))
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
