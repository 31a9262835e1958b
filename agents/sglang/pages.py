"""Who each page of one SGLang KV pool belongs to, as the adapter learns it (`PageBook`), so
that the engine's calls that name no request (allocator frees, radix-cache inserts and
evictions, rows of `req_to_token` rewritten to the tree's slots) become events that do.

Invariants (PageBook is the only writer of these arrays, one entry per page id):
- `fresh`: handed out by the allocator, not yet in any request's row (the next row that
  names it is granted it);
- `owner`: the request the page is granted to (-1: none); `last`: the last request it was
  granted to, kept after its free (the origin of a hit on a freed page, the offender of a
  second free);
- `tree`: the request on whose behalf the radix cache holds the page (-1: not in the tree).
Page 0 is SGLang's padding page: never handed out, never reported.
"""

from __future__ import annotations

import numpy as np

NONE = -1


class PageBook:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        ids = num_pages + 1  # page 0 pads
        self.fresh = np.zeros(ids, bool)
        self.owner = np.full(ids, NONE, np.int32)
        self.last = np.full(ids, NONE, np.int32)
        self.tree = np.full(ids, NONE, np.int32)

    def pages_of(self, slots: np.ndarray) -> np.ndarray:
        """The distinct pages of token slots, in first-seen order, padding left out."""
        pages = slots // self.page_size
        _, first = np.unique(pages, return_index=True)
        pages = pages[np.sort(first)]
        return pages[pages > 0]

    def handed_out(self, pages: np.ndarray) -> None:
        """The allocator returned these pages; those no request holds are new grants to be."""
        self.fresh[pages[self.owner[pages] == NONE]] = True

    def grant(self, pages: np.ndarray, req: int) -> None:
        self.fresh[pages] = False
        self.owner[pages] = req
        self.last[pages] = req

    def give_back(self, pages: np.ndarray) -> None:
        self.owner[pages] = NONE

    def cache(self, pages: np.ndarray, req: np.ndarray) -> None:
        self.tree[pages] = req

    def evict(self, pages: np.ndarray) -> None:
        self.tree[pages] = NONE

    def clear(self) -> None:
        for array in (self.owner, self.last, self.tree):
            array.fill(NONE)
        self.fresh.fill(False)


def groups(keys: np.ndarray, values: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """values split by key, keys in first-seen order, values in their order: one event per
    request from one vectorised pass."""
    if not len(keys):
        return []
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    cuts = np.flatnonzero(np.diff(sorted_keys)) + 1
    parts = np.split(values[order], cuts)
    starts = np.concatenate(([0], cuts))
    first_seen = np.argsort(order[starts])  # a stable sort: order[start] is the group's first position
    return [(int(sorted_keys[starts[i]]), parts[i]) for i in first_seen]
