"""The daemon's ledgers, one per cell (`Ledgers`): off the bus one, cell "", holds every
node; on the bus each cell the daemon holds has its own, made when the cell is taken (from
its snapshot and the store, Daemon.adopt) and dropped when it goes.

Invariant: a node's state is in one ledger only, its cell's, and a cell's ledger holds only
its nodes' events: a cell is judged, snapshotted, handed over and rebuilt alone, and what one
cell does (its clock, what it retires and forgets) never moves another. Written on the
daemon's loop under the ingest's lock; read under it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from kvguard.ledger import Ledger
from kvguard.ledger.pools import Node
from kvguard.ledger.requests import Request

WHOLE = ""  # the cell of a daemon off the bus: every node


class Ledgers:
    def __init__(self, fresh: Callable[[], Ledger], whole: Ledger | None = None) -> None:
        """`fresh()` makes an empty ledger with the daemon's settings; `whole`, the one
        restored off the bus (cell WHOLE)."""
        self._fresh = fresh
        self.cells: dict[str, Ledger] = {WHOLE: whole} if whole is not None else {}

    def of(self, cell: str) -> Ledger:
        """The cell's ledger, made empty if it has none yet."""
        ledger = self.cells.get(cell)
        if ledger is None:
            ledger = self.cells[cell] = self._fresh()
        return ledger

    def put(self, cell: str, ledger: Ledger) -> None:
        self.cells[cell] = ledger

    def drop(self, cell: str, ledger: Ledger) -> None:
        """The cell is gone: its ledger is freed, if it is still `ledger` (the cell may have
        been taken again since, with a new one)."""
        if self.cells.get(cell) is ledger:
            del self.cells[cell]

    def __iter__(self) -> Iterator[Ledger]:
        return iter(list(self.cells.values()))

    def node(self, name: str) -> Node | None:
        for ledger in self.cells.values():
            node = ledger.nodes.get(name)
            if node is not None:
                return node
        return None

    def holding(self, name: str) -> Ledger | None:
        """The ledger that holds node `name`, if any does."""
        for ledger in self.cells.values():
            if name in ledger.nodes:
                return ledger
        return None

    def nodes(self) -> dict[str, Node]:
        return {name: node for ledger in self.cells.values() for name, node in ledger.nodes.items()}

    def request(self, req: str) -> tuple[Ledger, Request] | None:
        """The request named `req` and its cell's ledger (a name is one request within a cell)."""
        for ledger in self.cells.values():
            r = ledger.request(req)
            if r is not None:
                return ledger, r
        return None

    @property
    def known_requests(self) -> int:
        return sum(ledger.known_requests for ledger in self.cells.values())

    def findings(self) -> dict[str, int]:
        return _summed(ledger.stats.findings for ledger in self.cells.values())

    def totals(self) -> dict[str, int]:
        """What the ledgers could not see or judge, and what they retired and forgot."""
        return _summed(ledger.stats.totals() for ledger in self.cells.values())


def _summed(counts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in counts:
        for name, n in part.items():
            out[name] = out.get(name, 0) + n
    return out
