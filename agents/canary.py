"""A node's self-test canary (`kvguard agent --canary-interval`): health that means events and
commands both get through, not that a port is open.

Every interval the agent asks the node's guard for a canary; the guard sends it as a
heartbeat, in order behind what its engine reported, through the agent's spool to the
daemon, whose loop applies it to the ledger like any event and sends it back on the node's
command path (the one kills take), through the agent to the guard.

Invariant: a node's status says when its canary last came back, the round trip, and since
when the oldest one still out was sent; a canary out for LATE_AFTER intervals is said once in
the log, and its return said once again. Written by the node's upstream and command threads,
under one lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvguard.proto.kvguard.v1 import services_pb2 as svc

LATE_AFTER = 3  # intervals a canary may be out before the node is said to be cut off
KEEP = 16  # canaries out at once that are still matched (older ones count as lost)


class Canary:
    def __init__(self, node: str, interval_s: float, say: Callable[[str], None]) -> None:
        self.node, self.interval_s, self._say = node, interval_s, say
        self._lock = threading.Lock()
        self._nonce = time.time_ns()  # unlike any an earlier run of the agent sent
        self._out: dict[int, tuple[float, int]] = {}  # nonce -> (monotonic, wall ns) when sent
        self._due = time.monotonic() + interval_s
        self.ok_ns = 0
        self.rtt_s = 0.0
        self.late = False

    def due(self, now: float) -> svc.Command | None:
        """The command asking the guard for a canary, when one is due (else None)."""
        if now < self._due:
            return None
        self._due = now + self.interval_s
        with self._lock:
            self._nonce += 1
            self._out[self._nonce] = (now, time.time_ns())
            for old in sorted(self._out)[:-KEEP]:
                del self._out[old]
            return svc.Command(canary=svc.Canary(nonce=self._nonce))

    def echoed(self, nonce: int) -> float | None:
        """The daemon sent canary `nonce` back: its round trip in seconds (None: not one of
        ours, or one given up on). Canaries sent before it and still out are lost."""
        now = time.monotonic()
        with self._lock:
            sent = self._out.pop(nonce, None)
            if sent is None:
                return None
            for old in [n for n in self._out if n < nonce]:
                del self._out[old]
            self.ok_ns, self.rtt_s = time.time_ns(), now - sent[0]
            was_late, self.late = self.late, False
        if was_late:
            self._say(
                f"the canary of {self.node} came back ({self.rtt_s * 1000:.1f} ms): its pipeline works again"
            )
        return self.rtt_s

    def check(self, now: float) -> None:
        """Say once that the oldest canary out is late: what the node reports, or what the
        daemon orders it, is not getting through (or the daemon's loop is stuck)."""
        with self._lock:
            oldest = min((sent for sent, _ in self._out.values()), default=now)
            late = now - oldest > LATE_AFTER * self.interval_s
            said, self.late = self.late, late or self.late
        if late and not said:
            self._say(
                f"the canary of {self.node} has not come back in {now - oldest:.0f} s: its events or "
                "the daemon's commands are not getting through (guard, agent spool, daemon stream or loop)"
            )

    def fields(self) -> dict[str, int | bool]:
        """The node status's canary fields."""
        with self._lock:
            waiting = min((wall for _, wall in self._out.values()), default=0)
            return {
                "canary_ok_ns": self.ok_ns,
                "canary_rtt_us": round(self.rtt_s * 1e6),
                "canary_waiting_since_ns": waiting,
                "canary_late": self.late,
            }
