"""A pool map (FleetService.Pool: one state byte and one tenant index a page) packed into the
cells a terminal has: when the pool has more pages than the map has cells, each cell stands for
`per_cell` consecutive pages and shows the most telling of them (PRIORITY: a quarantined or
held page is never hidden behind free or owned ones), coloured by that page's tenant.

Invariants: every page lies in exactly one cell (cell i holds pages i*per_cell up to
(i+1)*per_cell - 1); the cells used are ceil(pages / per_cell) <= cells; per_cell is the least
that fits; a code this dashboard does not know (a newer daemon's) shows as UNKNOWN, never as free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvguard.proto.pool_map import PAGE_STATES

UNKNOWN = len(PAGE_STATES)  # any code past the known ones

# Which state a packed cell shows: the highest here of its pages'. The one an operator must
# not miss first (pages out of circulation, pages held after their request ended), then
# sharing, ownership, and last the pool's quiet states.
PRIORITY: tuple[str, ...] = (
    "quarantined",
    "unknown",
    "abort",
    "transfer",
    "offload",
    "shared",
    "owned",
    "prefix_cache",
    "reserved",
    "free",
)


def _rank_table() -> np.ndarray:
    """rank[code] = how much code wins a cell (higher wins), for every byte value."""
    rank = np.full(256, len(PRIORITY) - PRIORITY.index("unknown"), dtype=np.int16)
    for code, name in enumerate(PAGE_STATES):
        if name in PRIORITY:
            rank[code] = len(PRIORITY) - PRIORITY.index(name)
    return rank


RANK = _rank_table()


def state_code(code: int) -> int:
    """The code as this dashboard names it: a known one, or UNKNOWN."""
    return code if code < len(PAGE_STATES) else UNKNOWN


def pages_per_cell(pages: int, cells: int) -> int:
    """The fewest pages a cell must stand for so that `pages` fit in `cells` (at least 1)."""
    if cells <= 0:
        raise ValueError(f"a pool map needs at least one cell (got {cells})")
    return max(1, -(-pages // cells))


@dataclass(frozen=True)
class Packed:
    """The cells of a map: `states[i]` (a PAGE_STATES code or UNKNOWN) and
    `tenants[i]` (an index into the map's tenants) of cell i, each for `per_cell` pages."""

    pages: int
    per_cell: int
    states: np.ndarray
    tenants: np.ndarray

    @property
    def cells(self) -> int:
        return len(self.states)


def pack(states: bytes, tenant: Sequence[int], cells: int) -> Packed:
    """Pack a pool's pages (`states`: one code a page; `tenant`: one index a page, shorter or
    empty from a daemon that sends none: 0) into at most `cells` cells."""
    codes = np.frombuffer(states, dtype=np.uint8)
    n = len(codes)
    per = pages_per_cell(n, cells)
    if n == 0:
        return Packed(0, per, np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.int64))
    used = -(-n // per)
    owners = _owners(tenant, n)
    # Padding past the pool's end ranks below everything: every cell has a real page, which wins.
    ranks = np.full(used * per, -1, dtype=np.int16)
    ranks[:n] = RANK[codes]
    winner = ranks.reshape(used, per).argmax(axis=1) + np.arange(used) * per
    return Packed(n, per, np.minimum(codes[winner], UNKNOWN).astype(np.uint8), owners[winner])


def _owners(tenant: Sequence[int], n: int) -> np.ndarray:
    """One tenant index a page for n pages (0 where the daemon sent none)."""
    owners = np.zeros(n, dtype=np.int64)
    given = np.asarray(tenant[:n], dtype=np.int64)
    owners[: len(given)] = given
    return owners


def state_counts(states: bytes) -> dict[str, int]:
    """Pages in each state (by name, 'unknown' for codes past the known ones), zeros left out."""
    counts = np.bincount(np.minimum(np.frombuffer(states, dtype=np.uint8), UNKNOWN), minlength=UNKNOWN + 1)
    names = [*PAGE_STATES, "unknown"]
    return {names[code]: int(n) for code, n in enumerate(counts) if n}


def tenant_counts(states: bytes, tenant: Sequence[int]) -> dict[int, int]:
    """Pages each tenant index holds now (owned, shared, or held after its request), by index;
    free, reserved and quarantined pages are nobody's."""
    codes = np.frombuffer(states, dtype=np.uint8)
    owners = _owners(tenant, len(codes))
    idle = {PAGE_STATES.index(name) for name in ("free", "reserved", "quarantined")}
    live = ~np.isin(codes, list(idle))
    counts = np.bincount(owners[live], minlength=1)
    return {index: int(n) for index, n in enumerate(counts) if n}
