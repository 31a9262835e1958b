"""What the agent's test files share: waiting for what a real agent and daemon do in their own
time, a service's stderr read as it comes, the events a store holds, and the leak a
monitor-mode guard lets through."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from kvguard.agents.guard import Guard
from kvguard.cli.process import Service
from kvguard.daemon.store import Store
from kvguard.proto import pb


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> bool:
    """Whether `predicate` came true within `timeout` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def stored(store: str) -> list[pb.Event]:
    """The events the audit store holds, in order."""
    s = Store(store)
    try:
        return [pb.Event.FromString(body) for _, _, body in s.rows(kind="event")]
    finally:
        s.close()


def leak(guard: Guard) -> None:
    """A leak a monitor-mode guard lets through: globex's g1 attends to page 40, which holds
    acme's a1's KV (a stale read, which the daemon answers with a kill of g1)."""
    guard.admit("a1", "acme", 16, "decode")
    guard.alloc("a1", 0, [40])
    guard.write("a1", 0, [40])
    guard.free("a1", 0, [40])
    guard.admit("g1", "globex", 16, "decode")
    guard.alloc("g1", 0, [40])
    guard.check_attention(0, ["g1"], np.array([[40]]), np.array([16]))


class Lines:
    """A process's stderr, read as it comes on a thread of its own."""

    def __init__(self, service: Service) -> None:
        assert service.proc.stderr is not None
        self.stream = service.proc.stderr
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.stream:
            self.lines.append(line.rstrip("\n"))

    def having(self, text: str) -> list[str]:
        return [line for line in list(self.lines) if text in line]
