"""Who may speak for a node on the node agent's guard socket, and how many may knock at once.

Invariants: a node has at most one guard connection, the first: a newcomer that says hello as
a node whose guard is still connected is refused and reported with its identity, so it can
neither take that node's commands nor speak for it (a connection whose peer has hung up
holds nothing: its successor takes the node at once). At most `limit` connections are open
at a time, each holding one of the agent's threads; more are refused at the door. The
identity of each node's last guard (SO_PEERCRED, /proc/PID/exe) is kept, and a change of
user or executable from one connection to the next is reported. Every refusal and change
is counted in the agent's counters and said once, on one line.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvguard.proto.local import Peer, hung_up


@dataclass
class _Holder:
    """A node's guard connection; commands go to it only once the agent has welcomed it."""

    conn: socket.socket
    peer: Peer
    welcomed: bool = False


class Door:
    def __init__(self, limit: int, counters: dict[str, int], say: Callable[[str], None]) -> None:
        self.limit = limit
        self.counters = counters
        for name in ("guards_over_limit", "duplicate_guards", "guard_identity_changed"):
            counters.setdefault(name, 0)
        self._say = say
        self._lock = threading.Lock()
        self._open = 0
        self._full_said = False  # "full" was said since the door last had room
        self._holders: dict[str, _Holder] = {}
        self._last: dict[str, Peer] = {}  # each node's last guard, connected or not
        self._refused: dict[str, Peer] = {}  # the last newcomer refused for each node, said once

    def enter(self) -> bool:
        """Take a place for a new connection; False (counted) when all `limit` are taken."""
        with self._lock:
            if self._open < self.limit:
                self._open += 1
                return True
            self.counters["guards_over_limit"] += 1
            say, self._full_said = not self._full_said, True
        if say:
            self._say(
                f"{self.limit} guard connections are open, the most allowed (--max-guards): "
                "refusing more until one closes"
            )
        return False

    def leave(self) -> None:
        """A connection that entered has closed."""
        with self._lock:
            self._open -= 1
            self._full_said = False

    def claim(self, node: str, conn: socket.socket, peer: Peer) -> str | None:
        """Make `conn` (of process `peer`) the guard connection of `node`; or, if another
        live connection holds the node, the reason it is refused."""
        with self._lock:
            holder = self._holders.get(node)
            if holder is not None and holder.conn is not conn and not hung_up(holder.conn):
                self.counters["duplicate_guards"] += 1
                refused = f"node {node} already has a guard connected ({holder.peer})"
                say, self._refused[node] = self._refused.get(node) != peer, peer
            else:
                refused = ""
                self._holders[node] = _Holder(conn, peer)
                last, self._last[node] = self._last.get(node), peer
        if refused:
            if say:  # a newcomer that dials again is counted each time, said once
                self._say(f"refused a second guard for node {node}, {peer}: {refused}")
            return refused
        if last is not None and (last.uid, last.exe) != (peer.uid, peer.exe):
            self.counters["guard_identity_changed"] += 1
            self._say(f"node {node}'s guard is now {peer}; it was {last}")
        return None

    def welcome(self, node: str, conn: socket.socket) -> None:
        """The guard has been welcomed: commands for its node go to it from now on."""
        with self._lock:
            holder = self._holders.get(node)
            if holder is not None and holder.conn is conn:
                holder.welcomed = True

    def release(self, node: str, conn: socket.socket) -> bool:
        """`conn` has closed; whether it was the node's guard connection (not a refused one,
        nor one a successor has replaced already)."""
        with self._lock:
            holder = self._holders.get(node)
            if holder is None or holder.conn is not conn:
                return False
            del self._holders[node]
            return True

    def guard(self, node: str) -> socket.socket | None:
        """The welcomed guard connection of `node`, if any."""
        with self._lock:
            holder = self._holders.get(node)
            return holder.conn if holder is not None and holder.welcomed else None

    def nodes(self) -> list[str]:
        """The nodes whose guard is connected and welcomed."""
        with self._lock:
            return [node for node, holder in self._holders.items() if holder.welcomed]
