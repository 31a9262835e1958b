"""Commands back to the nodes (`Commands`): the kills and quarantines a verdict or an operator
orders, their numbers, the outbox of each node's stream, the rule modes operators set, and the
pages quarantined by command (`Quarantines`).

Invariants: a finding whose rule kills orders one kill of its request, and one that quarantines
orders one quarantine of its pages, each numbered in order, when its rule is applied in enforce
mode (an operator's mode for the rule, else the daemon's); monitor mode orders nothing. Every
command, the daemon's or an operator's, is numbered here, on the daemon's loop, one after the
other from the store's count. A command goes out at once to its node's stream, or, while the
node has none, waits for its next one (bounded: past MAX_UNDELIVERED it is dropped and counted).
A node has at most one stream.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import numpy as np

from kvguard.ledger.findings import KILL_ACTIONS, Finding
from kvguard.proto.kvguard.v1 import services_pb2 as svc

MAX_UNDELIVERED = 10_000  # commands kept per node while it is not connected
MODES = ("monitor", "enforce")
Reply = Callable[[svc.DaemonMessage], None]


class Quarantines:
    """The pages each (node, pool) was ordered to quarantine, for the engine incarnation (epoch)
    the order was for: an order for a newer epoch replaces what an older one held (a restarted
    engine has a new free list). Written on the daemon's loop, read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pages: dict[tuple[str, int], tuple[int, set[int]]] = {}

    def add(self, node: str, q: svc.QuarantinePages) -> None:
        key = (node, q.pool)
        with self._lock:
            epoch, pages = self._pages.get(key, (q.epoch, set()))
            if q.epoch > epoch:
                epoch, pages = q.epoch, set()
            if q.epoch == epoch:
                pages.update(q.pages)
                self._pages[key] = (epoch, pages)

    def of(self, node: str, pool: int, epoch: int) -> np.ndarray:
        """The pages of `pool` on `node` quarantined for its engine's incarnation `epoch`."""
        with self._lock:
            at, pages = self._pages.get((node, pool), (epoch, set()))
            found = list(pages) if at == epoch else []
        return np.array(found, dtype=np.intp)


class Commands:
    def __init__(self, mode: str, first_id: int, counters: Counter[str]) -> None:
        if mode not in MODES:
            raise ValueError(f"daemon mode {mode!r} is not monitor or enforce")
        self.mode = mode  # monitor: record and alert, never order a kill
        self.outboxes: dict[str, Reply] = {}  # node -> how to send to its stream (thread-safe)
        self._lock = threading.Lock()
        self._undelivered: dict[str, list[svc.Command]] = {}  # commands that found their node away
        self._next_id = first_id  # the last command's id (the store's count at start)
        self.counters = counters
        # rule id -> (mode, who set it): an operator's mode for the rule, over the daemon's own.
        # Replaced whole on each change (readers on other threads take it as it is).
        self.rule_modes: dict[str, tuple[str, str]] = {}
        self.quarantined = Quarantines()

    def mode_of(self, rule: str) -> str:
        """The mode a rule's verdicts are applied in: an operator's for it, else the daemon's."""
        override = self.rule_modes.get(rule)
        return override[0] if override is not None else self.mode

    def set_rule_mode(self, rule: str, mode: str, by: str) -> None:
        """An operator's mode for `rule` (monitor, enforce; "": back to the daemon's mode)."""
        modes = dict(self.rule_modes)
        if mode:
            modes[rule] = (mode, by)
        else:
            modes.pop(rule, None)
        self.rule_modes = modes

    def number(self, command: svc.Command) -> None:
        """Give a command the next id (on the daemon's loop: ids follow the order commands are
        stored in)."""
        self._next_id += 1
        command.id = self._next_id

    def of(self, finding: Finding, epoch: int = 0) -> list[svc.Command]:
        """When the finding's rule is enforced, for the node of the finding (it holds the
        request and the pages): kill the request, and take the pages out of circulation (of
        its engine's incarnation `epoch`), as the rule's action says."""
        if self.mode_of(finding.rule) != "enforce":
            return []
        commands = []
        if finding.action in KILL_ACTIONS and finding.req:
            kill = svc.KillRequest(
                req=finding.req, finding=finding.finding, rule=finding.rule, message=finding.message
            )
            commands.append(svc.Command(kill=kill))
        if "quarantine" in finding.action and finding.pages and finding.pool is not None:
            pages = svc.QuarantinePages(
                pool=finding.pool, pages=finding.pages, finding=finding.finding, epoch=epoch
            )
            commands.append(svc.Command(quarantine=pages))
            self.quarantined.add(finding.node, pages)
        for command in commands:
            self.number(command)
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

    def echo(self, node: str, nonce: int) -> None:
        """The node's self-test canary back to its stream now, or never (a late echo would say
        the path works when it did not): neither numbered nor stored."""
        with self._lock:
            outbox = self.outboxes.get(node)
        if outbox is None:
            self.counters["canaries_unsent"] += 1
            return
        outbox(svc.DaemonMessage(command=svc.Command(canary=svc.Canary(nonce=nonce, echo=True))))
        self.counters["canaries"] += 1

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
