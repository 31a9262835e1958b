"""Commands back to the nodes (`Commands`): the kills and quarantines a verdict orders, and the
outbox of each node's stream.

Invariants: in enforce mode a finding whose rule kills orders one kill of its request, and one
that quarantines orders one quarantine of its pages, each numbered in order; monitor mode
orders nothing. A command goes out at once to its node's stream, or, while the node has none,
waits for its next one (bounded: past MAX_UNDELIVERED it is dropped and counted). A node has
at most one stream.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from kvguard.ledger.findings import KILL_ACTIONS, Finding
from kvguard.proto.kvguard.v1 import services_pb2 as svc

MAX_UNDELIVERED = 10_000  # commands kept per node while it is not connected
Reply = Callable[[svc.DaemonMessage], None]


class Commands:
    def __init__(self, mode: str, first_id: int, counters: Counter[str]) -> None:
        if mode not in ("monitor", "enforce"):
            raise ValueError(f"daemon mode {mode!r} is not monitor or enforce")
        self.mode = mode  # monitor: record and alert, never order a kill
        self.outboxes: dict[str, Reply] = {}  # node -> how to send to its stream (thread-safe)
        self._lock = threading.Lock()
        self._undelivered: dict[str, list[svc.Command]] = {}  # commands that found their node away
        self._next_id = first_id  # the last command's id (the store's count at start)
        self.counters = counters

    def of(self, finding: Finding) -> list[svc.Command]:
        """In enforce mode, for the node of the finding (it holds the request and the pages):
        kill the request, and take the pages out of circulation, as the rule's action says."""
        if self.mode != "enforce":
            return []
        commands = []
        if finding.action in KILL_ACTIONS and finding.req:
            kill = svc.KillRequest(
                req=finding.req, finding=finding.finding, rule=finding.rule, message=finding.message
            )
            commands.append(svc.Command(kill=kill))
        if "quarantine" in finding.action and finding.pages and finding.pool is not None:
            pages = svc.QuarantinePages(pool=finding.pool, pages=finding.pages, finding=finding.finding)
            commands.append(svc.Command(quarantine=pages))
        for command in commands:
            self._next_id += 1
            command.id = self._next_id
        return commands

    def connect(self, node: str, send: Reply) -> bool:
        """A node's stream is open (False: the node has one already). Commands that found the
        node away go out on it now."""
        with self._lock:
            if node in self.outboxes:
                return False
            self.outboxes[node] = send
            waiting = self._undelivered.pop(node, [])
        for command in waiting:
            send(svc.DaemonMessage(command=command))
        self.counters["commands_late"] += len(waiting)
        return True

    def disconnect(self, node: str, send: Reply) -> None:
        """The stream that registered `send` for the node is over. (Equality, not identity: a
        stream passes its bound method, a new object at each access, equal to the first.)"""
        with self._lock:
            if self.outboxes.get(node) == send:
                del self.outboxes[node]

    def send(self, node: str, command: svc.Command) -> None:
        """To the node's stream; kept for its next stream while it has none (an agent that
        reconnects resends what was not acknowledged, which the ledger has seen: the command
        would never be ordered again)."""
        with self._lock:
            outbox = self.outboxes.get(node)
            if outbox is None:
                waiting = self._undelivered.setdefault(node, [])
                if len(waiting) >= MAX_UNDELIVERED:
                    self.counters["commands_dropped"] += 1
                    return
                waiting.append(command)
                return
        outbox(svc.DaemonMessage(command=command))
