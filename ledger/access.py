"""The judgment of every access to KV pages (`Access`): a write (by the engine, by a transfer
landing, by an RDMA write a probe saw posted) and a read (attention, or KV leaving the node).
The ownership handlers and the transfer reconciliation both judge through here.

Invariants: a read is clean only when every slot read holds the reader's own KV written
under its current grant, or prefix KV it was legitimately given (`Shared`) and that is still
what was shared; otherwise each page read is stale or foreign, with the request whose data was
there as the victim. A write into pages the writer does not own is a late write (someone
else owns them) or a use after free (nobody does), unless a transfer_recv hold keeps them for
a transfer draining into them. Judgments come from the state as the access found it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvguard.ledger.findings import NOBODY, BadEvent, Findings
from kvguard.ledger.pages import HOLDER_INDEX, live_grants
from kvguard.ledger.pools import Pool
from kvguard.ledger.requests import Request

SEND_HOLD, OFFLOAD_HOLD = HOLDER_INDEX["transfer_send"], HOLDER_INDEX["offload"]


@dataclass(slots=True)
class Shared:
    """Prefix pages a request reads but does not own, with what it was promised: sorted pages
    and, aligned with them, the page's alloc_gen and its KV's writer and alloc_gen at share
    time. A page re-granted since (gen changed) is no longer shared."""

    pages: np.ndarray
    gen: np.ndarray
    writer: np.ndarray
    wgen: np.ndarray

    def without(self, pages: np.ndarray) -> Shared:
        keep = ~np.isin(self.pages, pages)
        return Shared(self.pages[keep], self.gen[keep], self.writer[keep], self.wgen[keep])

    def merged(self, other: Shared) -> Shared:
        rest = self.without(other.pages)
        pages = np.concatenate([rest.pages, other.pages])
        order = np.argsort(pages, kind="stable")
        return Shared(
            pages[order],
            np.concatenate([rest.gen, other.gen])[order],
            np.concatenate([rest.writer, other.writer])[order],
            np.concatenate([rest.wgen, other.wgen])[order],
        )

    def lookup(self, pages: np.ndarray, current_gen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which of `pages` are shared and still the same grant, index into self per page)."""
        if not len(self.pages):
            return np.zeros(len(pages), bool), np.zeros(len(pages), np.intp)
        at = np.minimum(np.searchsorted(self.pages, pages), len(self.pages) - 1)
        return (self.pages[at] == pages) & (self.gen[at] == current_gen), at


class Access:
    """Judges writes and reads; counts the pages they touch in `stats.page_transitions`."""

    def __init__(self, findings: Findings, stats: Any) -> None:
        self._found = findings
        self.stats = stats

    def write(
        self,
        r: Request,
        pool: Pool,
        pages: np.ndarray,
        slots: np.ndarray | None,
        *,
        drain: bool,
        land: bool = True,
        via: tuple[str, str, str] | None = None,
    ) -> None:
        """KV of request r lands in `pages` (`slots` valid in each; None: full pages). Pages r
        does not own are a late write or a use after free, except, when `drain`, pages kept by
        a transfer_recv hold: the end of a transfer already in flight. With land=False the
        write was attempted but refused: it is judged, the pages keep their KV. `via`: (probe,
        its event, xfer) when a probe saw the write, not the engine."""
        pp = pool.pages
        # The content changes wherever the bytes landed, owned or not: whoever reads these
        # pages next reads r's KV.
        if land and not pp.land(pages, r.idx, slots):
            self.stats.page_transitions += len(pages)
            return
        owner = pp.owner[pages]
        foreign = owner != r.idx
        sel = pages[foreign]
        other = owner[foreign]
        bad = ~pp.draining(r.idx, sel, other) if drain else np.ones(len(sel), bool)
        late = bad & (other >= 0)
        details = None
        how = ""
        if via is not None:
            probe, event, xfer = via
            details = {"probe": probe, "witness": event, "xfer": xfer}
            how = f" by RDMA (transfer {xfer}, seen posted by {probe}, {event})"
        found = self._found
        if late.any():
            found.by_victim(
                "late_write",
                r,
                pool,
                sel[late],
                other[late],
                lambda v: f"{r.id} wrote KV{how} into pages now granted to {found.name(v)}",
                details,
            )
        freed = bad & (other < 0)
        if freed.any():
            found.report(
                "use_after_free",
                f"{r.id} wrote KV{how} into {int(freed.sum())} page(s) of pool {pool.pool} on "
                f"{pool.node} that it no longer holds",
                req=r,
                pool=pool.pool,
                pages=sel[freed],
                details=details,
                key=(pool.pool, "write"),
            )
        if land:
            pp.land(pages, r.idx, slots, judged=True)
            self.stats.page_transitions += len(pages)

    @staticmethod
    def pages_read(pool: Pool, pages: np.ndarray, tokens: int) -> np.ndarray:
        """The pages a context of `tokens` tokens covers (a block table may be longer)."""
        ps = pool.pages.page_size
        need = -(-tokens // ps)
        if need > len(pages):
            raise BadEvent(
                f"read of {tokens} tokens needs {need} pages of {ps} but lists {len(pages)} "
                f"(pool {pool.pool} on {pool.node})"
            )
        return pages[:need] if need < len(pages) else pages

    def read(self, r: Request, pool: Pool, pages: np.ndarray, tokens: int) -> None:
        """The check before attention (and before KV leaves the node): every slot read must
        hold the reader's own KV written under its current grant, or prefix KV it was
        legitimately given. Clean at once when every page is its own and full but the last,
        which holds what is read of it (a short page before the last is read in full: its
        slots beyond `valid` hold whoever wrote there before)."""
        if not len(pages):
            return
        self.stats.page_transitions += len(pages)
        if not pool.pages.read_clean(pages, r.idx, tokens):
            self._read_slow(r, pool, pages, tokens)

    def read_held(self, r: Request, pool: Pool, pages: np.ndarray, tokens: int) -> None:
        """KV that leaves the node after its request's grant ended, under a hold that keeps it
        for the sender (asynchronous senders, deferred release, offloading): clean on each page
        that is still held so and still holds the request's own KV, written under the
        generation the page still has; every other page is read as `read` judges it (once
        the last hold is gone, a send is a use after free)."""
        pp = pool.pages
        state = pp.state[pages]
        kept = (
            ((pp.holds[SEND_HOLD, pages] > 0) | (pp.holds[OFFLOAD_HOLD, pages] > 0))
            & (state["owner"] == ~r.idx)
            & (state["writer"] == r.idx)
            & (state["wgen"] == state["gen"])
        )
        if not kept.any():
            self.read(r, pool, pages, tokens)
        elif not kept.all():
            rest = pages[~kept]
            self.read(r, pool, rest, min(tokens, len(rest) * pp.page_size))

    def _read_slow(self, r: Request, pool: Pool, pages: np.ndarray, tokens: int) -> None:
        """The findings of a read that is not clean at once: its stale pages (granted to the
        reader, or given to it as prefix, without the KV it may read there) and its foreign
        ones (neither), each with the request whose data was there (the victim)."""
        shared = r.shared.get((pool.node, pool.pool))
        if shared is None:  # the common case, in one C pass over the pages
            stale, stale_victims, foreign, foreign_victims = pool.pages.read_victims(pages, r.idx, tokens)
        else:
            stale, stale_victims, foreign, foreign_victims = shared_read_victims(
                r, pool, pages, tokens, shared
            )
        found = self._found
        if len(stale):
            found.by_victim(
                "stale_read",
                r,
                pool,
                stale,
                stale_victims,
                lambda v: (
                    f"{r.id} attended to KV it did not write under its grant"
                    + (f": it holds {found.name(v)}'s data" if v else " (unwritten or its own stale data)")
                ),
            )
        if not len(foreign):
            return
        had = pool.ever_granted(r.idx, foreign)
        for kind, sel, text in (
            ("use_after_free", had, f"{r.id} attended to pages after its grant on them ended"),
            ("foreign_read", ~had, f"{r.id} attended to pages never granted to it"),
        ):
            if sel.any():
                found.by_victim(kind, r, pool, foreign[sel], foreign_victims[sel], _with_data(found, text))


def _with_data(found: Findings, text: str) -> Callable[[int], str]:
    return lambda v: text + (f"; they hold {found.name(v)}'s data" if v else "")


def shared_read_victims(
    r: Request, pool: Pool, pages: np.ndarray, tokens: int, shared: Shared
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """PoolPages.read_victims for a reader given prefix pages in the pool: a page shared with
    it (current, still granted to someone) is granted to it too, and its content is sound
    while it is the KV that was shared, as far as the slots read."""
    slots = pool.pages.slots_read(len(pages), tokens)
    state = pool.pages.state[pages]  # the pages' records, gathered once
    owner, writer, valid, own = state["owner"], state["writer"], state["valid"], state["own"]
    mine = owner == r.idx
    content_ok = (own == r.idx) & (valid >= slots)
    current, at = shared.lookup(pages, state["gen"])
    is_shared = current & ~mine & (live_grants(state) > 0)
    if is_shared.any():
        intact = (writer == shared.writer[at]) & (state["wgen"] == shared.wgen[at]) & (valid >= slots)
        content_ok |= is_shared & intact
    granted = mine | is_shared
    stale = granted & ~content_ok
    # Whose KV was read: the page's writer, or, for slots beyond what the reader wrote itself,
    # whoever's data was in the page when it was handed out.
    own_short = (own == r.idx) & (valid < slots)
    stale_victims = np.where(own_short, state["prior"], writer)[stale]
    foreign = ~granted
    written = writer[foreign]
    foreign_victims = np.where(written != NOBODY, written, np.maximum(owner[foreign], NOBODY))
    return (
        pages[stale],
        np.where(stale_victims == r.idx, NOBODY, stale_victims),
        pages[foreign],
        np.where(foreign_victims == r.idx, NOBODY, foreign_victims),
    )
