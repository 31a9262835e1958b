"""Types of the C extension kvguard.ledger._pages (ledger/_pages.c, runs.c, tags.c), as
ledger/pages.py, requests.py and ledger.py call it. Every function takes its arguments by
position only (METH_FASTCALL). `state`: a pool's PAGE records (writable, contiguous);
`pages`: contiguous 1-d intp arrays of page ids; `ts` None: the pool is not timed."""

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

PAGE: np.dtype[np.void]  # a page's record (pages.h: Page)
REQ: np.dtype[np.void]  # a request's numbers (pages.h: Req)
REQ_BYTES: int  # the C clean path's bound on a request id's bytes
HANDLE: np.dtype[np.void]  # a request handle's slot (pages.h: Handle)
HANDLE_SLOT_MASK: int  # a handle's slot bits (pages.h; handles.py's SLOT_MASK)
RUN: np.dtype[np.void]  # what apply_clean is handed and hands back about a run (pages.h: RunCounts)

def page_list(
    message: bytes,
    field: int,
    num_pages: int,
    state: npt.NDArray[np.void] | None,
    start: int = ...,
    end: int = ...,
    /,
) -> npt.NDArray[np.intp]: ...
def grant(
    pages: npt.NDArray[np.intp], state: npt.NDArray[np.void], req: int, ts: int | None, judged: bool, /
) -> int: ...
def land(
    pages: npt.NDArray[np.intp],
    state: npt.NDArray[np.void],
    req: int,
    slots: npt.NDArray[np.uint32] | None,
    page_size: int,
    judged: bool,
    /,
) -> int: ...
def end_grant(
    pages: npt.NDArray[np.intp], state: npt.NDArray[np.void], req: int, ts: int | None, judged: bool, /
) -> int: ...
def read_clean(
    pages: npt.NDArray[np.intp], state: npt.NDArray[np.void], req: int, tokens: int, page_size: int, /
) -> bool: ...
def read_victims(
    pages: npt.NDArray[np.intp], state: npt.NDArray[np.void], req: int, tokens: int, page_size: int, /
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.int32], npt.NDArray[np.intp], npt.NDArray[np.int32]]: ...
def mark_named(
    state: npt.NDArray[np.void], holder_req: npt.NDArray[np.int32], named: npt.NDArray[np.bool_], /
) -> None: ...
def apply_clean(
    data: bytes,
    heads: npt.NDArray[np.void] | None,
    start: int,
    stop: int,
    run: npt.NDArray[np.void],
    node: tuple[str, dict[int, tuple[Any, ...]], npt.NDArray[np.void]],
    requests: tuple[
        dict[str, int],
        npt.NDArray[np.void],
        Callable[[str, int], npt.NDArray[np.void]],
        list[tuple[int, int]],
    ],
    /,
) -> BaseException | None: ...
def check_tags(
    own: npt.NDArray[np.int32],
    valid: npt.NDArray[np.uint32],
    tables: npt.NDArray[np.int32] | npt.NDArray[np.int64],
    lens: npt.NDArray[np.int32] | npt.NDArray[np.int64],
    readers: npt.NDArray[np.int64],
    page_size: int,
    /,
) -> npt.NDArray[np.bool_]: ...
def batch_clean(
    state: npt.NDArray[np.void],
    tables: npt.NDArray[np.int32] | npt.NDArray[np.int64],
    lens: npt.NDArray[np.int32] | npt.NDArray[np.int64],
    reqs: list[str],
    req_index: dict[str, int],
    req_table: npt.NDArray[np.void],
    page_size: int,
    /,
) -> npt.NDArray[np.bool_]: ...
def batch_clean_from(
    state: npt.NDArray[np.void],
    tables: npt.NDArray[np.int32] | npt.NDArray[np.int64],
    lens: npt.NDArray[np.int32] | npt.NDArray[np.int64],
    reqs: list[str],
    req_index: dict[str, int],
    req_table: npt.NDArray[np.void],
    page_size: int,
    stable: npt.NDArray[np.int64],
    upto: npt.NDArray[np.int64],  # written in place
    by: npt.NDArray[np.int64],  # written in place
    touched: npt.NDArray[np.int64],
    rows: npt.NDArray[np.int64] | None,  # batch row b is tables[rows[b]] (None: tables[b])
    per: int,  # an entry names page entry // per (the page size: a table of token slots)
    /,
) -> npt.NDArray[np.bool_]: ...
