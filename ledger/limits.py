"""What one node may make the ledger hold, and one event make it do (`Limits`): so that no
report or event, however small its bytes, costs the ledger unbounded memory or time.

Invariant: a pool report that would take a node past pages_per_pool, pools_per_node or
pages_per_node, or a read (attention launch) of more than read_entries entries, is refused
whole as a BadEvent of kind LIMIT naming the pool or event, the number and the limit; nothing
of it is applied. A page costs the ledger PAGE_BYTES (its record and its holders), so a node
costs at most pages_per_node x PAGE_BYTES. The guard and the daemon use the same defaults; the
daemon's operator may change them (`kvguard daemon --max-...`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.ledger.findings import BadEvent

LIMIT = "limit"  # the BadEvent kind (and the daemon's counter) of an event refused by a limit
PAGE_BYTES = 84  # a page's record (64) and its holders (5 x 4): ledger/pages.py


@dataclass(frozen=True, slots=True)
class Limits:
    """The defaults fit real nodes with room to spare: an H200 node holds up to a few million
    pages of 16 tokens (all its pools); an engine batches a few hundred requests per launch,
    and the guard sends only those its own check refused, at most read_entries an event."""

    pages_per_pool: int = 1 << 22  # 4,194,304 pages: 336 MiB of ledger
    pools_per_node: int = 64
    pages_per_node: int = 1 << 23  # 8,388,608 pages: 672 MiB of ledger
    read_entries: int = 256  # requests in one read event: each may cost a finding and its verdict

    def __post_init__(self) -> None:
        for name in ("pages_per_pool", "pools_per_node", "pages_per_node", "read_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"ledger limit {name} must be at least 1, not {getattr(self, name)}")

    def check_pool(self, node: str, pool: int, num_pages: int, pools: dict[int, int]) -> None:
        """A report of `pool` with `num_pages` pages on `node`, whose pools (id -> pages) are
        `pools` now (the reported one among them if it was reported before)."""
        where = f"pool {pool} of node {node}"
        if num_pages > self.pages_per_pool:
            raise BadEvent(
                f"pool: {where} reports {num_pages} pages, above the limit of {self.pages_per_pool} a pool",
                LIMIT,
            )
        if pool not in pools and len(pools) >= self.pools_per_node:
            raise BadEvent(
                f"pool: {where} would be pool {len(pools) + 1} of the node, above the limit of "
                f"{self.pools_per_node} pools a node",
                LIMIT,
            )
        total = sum(n for p, n in pools.items() if p != pool) + num_pages
        if total > self.pages_per_node:
            raise BadEvent(
                f"pool: {where} reports {num_pages} pages, which would make {total} on the node, above the "
                f"limit of {self.pages_per_node} pages a node",
                LIMIT,
            )

    def check_read(self, node: str, entries: int) -> None:
        """A read event of node with `entries` entries."""
        if entries > self.read_entries:
            raise BadEvent(
                f"read: {entries} entries in one read event of node {node}, above the limit of "
                f"{self.read_entries} (a guard splits a larger launch's reads into several events)",
                LIMIT,
            )


UNBOUNDED = Limits(1 << 62, 1 << 62, 1 << 62, 1 << 62)  # replay: what was applied once is applied again
