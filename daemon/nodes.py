"""Each node's liveness as the daemon sees it (`Nodes`): whether its agent's stream is open and
since when, the agent's last word on the node (NodeStatus) and when it came, and its batches:
when the last one came, how many events a second it sent over the last RATE_WINDOW_S, and how
old the newest event of its last batch was when the batch arrived.

Invariants: `Nodes` is the only writer of this state, and is written on the daemon's loop only,
once per stream change, status or batch, never per event (`batch` is on the ingest's hot path:
O(1), from the batch's heads already read); times are the daemon's wall clock
(time.time_ns()); readers on other threads (the fleet state) read it under its lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvguard.proto import wire
from kvguard.proto.kvguard.v1 import services_pb2 as svc

RATE_WINDOW_S = 10  # events_per_s: events received over this many seconds, a second
_NS = 1_000_000_000


@dataclass(slots=True)
class Liveness:
    """One node's: its stream, its agent's last word, its last batch and its recent rate."""

    connected: bool = False
    connected_ns: int = 0  # when its stream opened, or (not connected) ended; 0: never
    status: svc.NodeStatus | None = None
    status_ns: int = 0
    received_ns: int = 0  # its last batch
    lag_ms: float = 0.0
    # (second of the daemon's clock, events received in it), the last RATE_WINDOW_S + 1 seconds
    seconds: deque[list[int]] = field(default_factory=deque)

    def rate(self, now_ns: int) -> float:
        """Events a second over the RATE_WINDOW_S whole seconds before `now_ns`'s, and its own."""
        since = now_ns // _NS - RATE_WINDOW_S
        return sum(n for second, n in self.seconds if second > since) / RATE_WINDOW_S

    def fill(self, state: svc.NodeState, now_ns: int) -> None:
        """Its fields of a fleet state's NodeState."""
        if self.status is not None:
            state.status.CopyFrom(self.status)
            state.status_ns = self.status_ns
        state.connected_ns = self.connected_ns
        state.received_ns = self.received_ns
        state.events_per_s = self.rate(now_ns)
        state.lag_ms = self.lag_ms


def newest_ts(events: wire.Batch) -> int | None:
    """The ts_ns of the newest event of a batch, from its heads (None: no head was read)."""
    heads = events.heads
    times = heads["ts"][heads["kind"] != 0]
    return int(times.max()) if len(times) else None


class Nodes:
    def __init__(self, clock: Callable[[], int] = time.time_ns) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[str, Liveness] = {}

    def _of(self, node: str) -> Liveness:
        found = self._nodes.get(node)
        if found is None:
            found = self._nodes[node] = Liveness()
        return found

    def opened(self, node: str) -> None:
        """The node's stream is open (its hello was taken)."""
        with self._lock:
            live = self._of(node)
            live.connected, live.connected_ns = True, self.clock()

    def closed(self, node: str) -> None:
        """The node's stream has ended."""
        with self._lock:
            live = self._of(node)
            live.connected, live.connected_ns = False, self.clock()

    def said(self, node: str, status: svc.NodeStatus) -> None:
        """The agent's word on the node (the last is kept)."""
        with self._lock:
            live = self._of(node)
            live.status, live.status_ns = status, self.clock()

    def batch(self, node: str, events: wire.Batch) -> None:
        """A batch of the node's arrived: its receipt, its size in this second, its lag."""
        now = self.clock()
        newest = newest_ts(events)
        second = now // _NS
        with self._lock:
            live = self._of(node)
            live.received_ns = now
            if newest is not None:
                live.lag_ms = (now - newest) / 1e6
            seconds = live.seconds
            if seconds and seconds[-1][0] == second:
                seconds[-1][1] += len(events)
            else:
                seconds.append([second, len(events)])
                while seconds[0][0] <= second - RATE_WINDOW_S - 1:
                    seconds.popleft()

    def read(self) -> dict[str, Liveness]:
        """A copy of every node's liveness, as it is now."""
        with self._lock:
            return {
                name: Liveness(
                    live.connected,
                    live.connected_ns,
                    live.status,
                    live.status_ns,
                    live.received_ns,
                    live.lag_ms,
                    deque(list(s) for s in live.seconds),
                )
                for name, live in self._nodes.items()
            }
