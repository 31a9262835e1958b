"""The check before attention of one guard (`AttentionCheck`): which requests of a batch may
not attend, over the whole batch at once, on the host (one C call) or on the GPU (the
tag-check kernel over the device's own block tables).

Invariants: the check changes nothing in the ledger; the device copy of a pool's tags is
brought up to date, in the same launch that checks, with every page an event named since the
last check (`touch`), so that the GPU and the host answer alike. The incremental check (a
caller that vouches its tables' first `stable` entries are unchanged) gives the full check's
answer: it skips only entries it verified before as the reader's own full pages whose pages
no event has named since (`Progress`); any event naming such a page sends its reader back to
a whole check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvguard.cuda_hooks.kernels import DeviceTags
from kvguard.ledger import pages
from kvguard.ledger.ledger import Ledger

NO_PAGES = np.zeros(0, np.int64)


def _host(values: Any) -> np.ndarray:
    """A NumPy copy of a host or device array (CuPy, torch on any device)."""
    if hasattr(values, "__cuda_array_interface__"):
        copy: np.ndarray = values.cpu().numpy() if hasattr(values, "cpu") else values.get()  # torch, cupy
        return copy
    return np.asarray(values)


class Progress:
    """What the incremental check of one pool verified: for each reader how many leading
    entries of its table (`upto`), for each page the reader that verified it (`by`), and the
    pages events named since the last check (`touched`). ledger/tags.c batch_clean_from is
    the one writer of upto and by."""

    def __init__(self, pages: Any) -> None:
        self.pages = pages  # the ledger's page records it was verified against (PoolPages)
        self.by = np.zeros(pages.num_pages, np.int64)  # page -> the reader that verified it (0: none)
        self.upto = np.zeros(64, np.int64)  # reader -> its leading entries verified
        self.touched: list[np.ndarray] = []

    def arrays(self, stable: Any, requests: int, rows: np.ndarray | None, per: int) -> pages.Verified:
        """batch_clean_from's arrays, `upto` grown to `requests`."""
        if requests > len(self.upto):
            self.upto = np.concatenate((self.upto, np.zeros(max(requests, len(self.upto)), np.int64)))
        touched = np.concatenate(self.touched) if self.touched else NO_PAGES
        self.touched.clear()
        return pages.Verified(np.asarray(stable, dtype=np.int64), self.upto, self.by, touched, rows, per)


class AttentionCheck:
    def __init__(self, ledger: Ledger, node: str) -> None:
        self.ledger = ledger
        self.node = node
        self._device_tags: dict[int, DeviceTags] = {}  # pool -> its tags on the GPU, once checked there
        self._verified: dict[int, Progress] = {}  # pool -> the incremental check's progress

    def touch(self, pool: int, pages: Any) -> None:
        """An event named these pages: their tags on the device are stale (once the pool is
        checked there), and the incremental check vouches for them no more."""
        if self._verified:
            verified = self._verified.get(pool)
            if verified is not None:
                verified.touched.append(np.asarray(pages, dtype=np.int64).reshape(-1))
        if self._device_tags:
            tags = self._device_tags.get(pool)
            if tags is not None:
                tags.touch(pages)

    def failing(
        self,
        pool: int,
        reqs: Sequence[str],
        block_tables: Any,
        context_lens: Any,
        stable: np.ndarray | None = None,
        table_rows: np.ndarray | None = None,
        in_slots: bool = False,
    ) -> list[dict[str, Any]]:
        """The read entries (req, pool, pages, tokens) of the requests of the batch that fail
        the check, in batch order: none in the common case. block_tables [B, P] (page ids,
        entries beyond each context ignored) and context_lens [B], on the host or a device.
        `stable` [B]: how many leading entries of each row the caller vouches are unchanged
        since that request's last check (on the host; 0 for a request new to the batch).
        `table_rows` [B]: the batch's row b is block_tables[table_rows[b]] (an engine's array
        of all its tables, on the host: not gathered for the incremental check). `in_slots`:
        the tables hold token slots, one column a token (SGLang's req_to_token)."""
        per = 1
        if in_slots:  # each page's first slot names it: a view, one column a page
            per = self.ledger.nodes[self.node].pools[pool].pages.page_size
            block_tables = block_tables[:, ::per]
        if table_rows is not None and (stable is None or hasattr(block_tables, "__cuda_array_interface__")):
            block_tables, table_rows = block_tables[table_rows], None
        if per > 1 and (stable is None or hasattr(block_tables, "__cuda_array_interface__")):
            block_tables, per = block_tables // per, 1
        if hasattr(block_tables, "__cuda_array_interface__"):
            clean = self._clean_on_device(pool, reqs, block_tables, context_lens)
        elif stable is not None:
            clean = self._clean_from(pool, reqs, block_tables, context_lens, stable, table_rows, per)
        else:
            clean = self.ledger.batch_clean(self.node, pool, reqs, block_tables, context_lens)
        if clean.all():
            return []
        tables, lens = _host(block_tables), _host(context_lens)  # the failing few, on the host
        page_size = self.ledger.nodes[self.node].pools[pool].pages.page_size
        reads = []
        for i in np.flatnonzero(~clean).tolist():
            need = -(-int(lens[i]) // page_size)
            row = tables[i if table_rows is None else int(table_rows[i]), :need]
            pages = (row // per).tolist()
            reads.append({"req": reqs[i], "pool": pool, "pages": pages, "tokens": int(lens[i])})
        return reads

    def _clean_from(
        self,
        pool: int,
        reqs: Sequence[str],
        block_tables: Any,
        context_lens: Any,
        stable: Any,
        table_rows: np.ndarray | None = None,
        per: int = 1,
    ) -> np.ndarray:
        """The host check, each row past what it verified before and is unchanged."""
        verified = self._verified.get(pool)
        pp = self.ledger.nodes[self.node].pools[pool].pages
        if verified is None or verified.pages is not pp:  # the pool's records made anew: all over
            verified = self._verified[pool] = Progress(pp)
        arrays = verified.arrays(stable, len(self.ledger.requests.table), table_rows, per)
        return self.ledger.batch_clean(self.node, pool, reqs, block_tables, context_lens, arrays)

    def _clean_on_device(
        self, pool: int, reqs: Sequence[str], block_tables: Any, context_lens: Any
    ) -> np.ndarray:
        """The batch's check on the GPU: one launch of the tag-check kernel over the device's
        own block tables, against the pool's tags on the device, which the same launch first
        brings up to date with the pages the events since the last step named; one copy each
        way."""
        pp = self.ledger.nodes[self.node].pools[pool].pages
        tags = self._device_tags.get(pool)
        if tags is None:
            tags = self._device_tags[pool] = DeviceTags()
        readers = self.ledger.reader_indices(reqs)
        found = tags.check(pp.own, pp.valid, block_tables, context_lens, readers, pp.page_size)
        return self.ledger.clean_given_tags(readers, found > 0, found == 2)
