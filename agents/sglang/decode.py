"""A decode step's page calls folded into its one guard call (`Held`): SGLang's
`alloc_for_decode` hands out the batch's slots (`alloc_decode`) and writes them into
`req_to_token` (`write`) right before `run_batch`; those two calls are held, and the step
(`forward_step`) takes them whole: a slot that opens a page nobody holds is that page's grant
to the row's request, riding in the step's pass, with no Python per request.

Invariant: what is held is applied before any other page or row call of the adapter (the
plugin's `_run` flushes it first) and, whenever the step cannot take it whole (another
shape, a page someone else holds, a row without a request), exactly as the calls would have
been applied when SGLang made them (`flush`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvguard.agents.sglang.pages import NONE


@dataclass(slots=True)
class Held:
    """alloc_decode's result and the write of it, as SGLang made them."""

    allocator: Any
    slots: Any
    write: tuple[Any, Any, Any] | None = None  # (pool, indices, values)


@dataclass(slots=True)
class Fold:
    """What a decode step's held calls come to, for its guard call: each request's page is
    new to it (`grants`, 0 or 1), and the lowest column written in each row."""

    grants: np.ndarray
    written: np.ndarray


def decode_shaped(indices: Any, values: Any) -> bool:
    """A write of one slot a row: (rows tensor, columns tensor) as alloc_for_decode makes it."""
    return (
        isinstance(indices, tuple)
        and len(indices) == 2
        and all(hasattr(part, "numel") for part in indices)
        and hasattr(values, "numel")
        and indices[0].numel() == values.numel() == indices[1].numel()
    )


def fold(
    held: Held,
    book: Any,
    row_req: np.ndarray,
    rows: Any,
    at: np.ndarray,
    out_cache_loc: Any,
    locs: np.ndarray,
    host: Any,
) -> Fold | None:
    """The step's grants from the held calls, or None when they are not exactly this step's
    alloc_decode and write (then they are flushed as made). `host` makes a tensor a flat
    int64 array. At success the page book holds the grants."""
    write = held.write
    if write is None or held.slots is not out_cache_loc or write[1][0] is not rows:
        return None
    if not np.array_equal(host(write[2]), locs):
        return None
    pages = locs // book.page_size
    reqs = row_req[at]
    owner = book.owner[pages]
    new = owner == NONE
    if (pages <= 0).any() or (reqs == NONE).any() or (~new & (owner != reqs)).any():
        return None  # padding, an unknown row or a page someone else holds: the calls as made
    if new.any() and len(np.unique(pages[new])) != int(new.sum()):
        return None  # two requests handed one page: the calls as made say so
    fresh = pages[new]
    book.fresh[fresh] = False
    book.owner[fresh] = reqs[new]
    book.last[fresh] = reqs[new]
    return Fold(new.astype(np.int64), host(write[1][1]))
