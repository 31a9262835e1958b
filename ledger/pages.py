"""Page state of one KV pool (`PoolPages`): one record a page (a cache line), each field also
a NumPy view indexed by page. PoolPages is the only writer of these records.

Invariants, for every page p (`use` and `holds` count live users; `owner` is signed):
- owner[p] >= 0: p is granted to request owner[p]; owner[p] < 0: the grant ended, and
  ~owner[p] is the request that held it (~NOBODY when never handed out).
- use[p] == live grants of p (its owner and prefix sharers) + holds[:, p].sum(); the page is
  back in the free pool iff use[p] == 0 (grants are derived: `refs()`).
- own[p] == owner[p] exactly when the page holds its live owner's own KV, written under the
  current grant (writer == owner and wgen == gen); otherwise NOBODY: the read check is one
  gather and one compare.
- writer/wgen/valid: who wrote the KV in the page, under which alloc_gen, how many token
  slots are valid; prior[p]: the writer at hand-out time (whose data is beyond `valid`).
- since[p]: in a pool registered for RDMA, the node's time of the last change of what decides
  where a write may land (owner, transfer_recv holds); 0: unknown.
- holder_req[k, p] is who holds p in kind k while one hold of that kind is on it; a page held
  more than once in a kind has its holders counted in `shared_holds` instead (rare).
- reserved[p] == 1 exactly for the ids the engine never hands out (0..reserved_pages-1, e.g.
  SGLang's padding page 0, vLLM's null block): a grant of one is never the clean case.
The updates every request makes (grant, land, end_grant) and the read checks are one C loop
each (pages.h); the rest is NumPy. Page arrays passed in are distinct intp indices in range
(`page_list` checks an event's).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from kvguard.ledger import _pages
from kvguard.ledger.findings import NOBODY

# prefix_cache: a prefix cache (SGLang's radix tree) keeps the pages after their request ends.
HOLDERS: tuple[str, ...] = ("offload", "transfer_send", "transfer_recv", "abort", "prefix_cache")
HOLDER_INDEX: dict[str, int] = {name: i for i, name in enumerate(HOLDERS)}
RECV_HOLD = HOLDER_INDEX["transfer_recv"]
MAX_PAGES = 1 << 24
MAX_PAGE_SIZE = 1 << 16
PAGE: np.dtype = _pages.PAGE  # a page's record, one cache line; its layout is ledger/pages.h's `Page`
COLUMNS: tuple[str, ...] = ("owner", "own", "use", "gen", "writer", "wgen", "valid", "prior", "since")
if PAGE["holds"].shape != (len(HOLDERS),):
    raise ImportError(
        f"ledger/pages.h keeps {PAGE['holds'].shape} holds a page; HOLDERS names {len(HOLDERS)}"
    )


def _records(n: int) -> np.ndarray:
    """n zeroed PAGE records starting on a cache line, so that each is exactly one."""
    raw = np.zeros((n + 1) * PAGE.itemsize, np.uint8)
    skip = -raw.ctypes.data % PAGE.itemsize
    return raw[skip : skip + n * PAGE.itemsize].view(PAGE)


class PoolPages:
    """The page state of one (node, pool): `state`, one PAGE record a page, and each field as
    a NumPy view of it (owner, own, use, ..., `holds` as (kinds, pages)), for reading; the
    methods below are the only changes made to them."""

    __slots__ = (
        "gen",
        "holder_req",
        "holds",
        "num_pages",
        "own",
        "owner",
        "page_size",
        "prior",
        "reserved",
        "shared_holds",
        "since",
        "state",
        "use",
        "valid",
        "wgen",
        "writer",
    )
    # The COLUMNS, each a view of `state` (set by name in __init__).
    owner: np.ndarray
    own: np.ndarray
    use: np.ndarray
    gen: np.ndarray
    writer: np.ndarray
    wgen: np.ndarray
    valid: np.ndarray
    prior: np.ndarray
    since: np.ndarray

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.state = _records(num_pages)
        self.state["owner"] = ~NOBODY
        for name in COLUMNS:
            setattr(self, name, self.state[name])
        self.holds = self.state["holds"].T  # (kinds, pages), as NumPy code indexes it
        self.reserved = self.state["reserved"]
        # Per kind: who holds the page (one hold of that kind). Apart: only holds and releases touch it.
        self.holder_req = np.zeros((len(HOLDERS), num_pages), np.int32)
        # (kind, page) -> {holder: its holds}, for a page held more than once in a kind
        self.shared_holds: dict[tuple[int, int], dict[int, int]] = {}

    # ------------------------------------------------------------------ reading events

    def page_list(
        self, message: bytes, field: int, *, distinct: bool = True, within: tuple[int, int] | None = None
    ) -> np.ndarray:
        """The page list of a serialized payload (`field`: the number of its `pages`), or of
        the payload at bytes `within` [start, end) of `message`, as an intp array.
        IndexError(page) for a page outside the pool; with `distinct`, ValueError(page) for a
        page listed twice."""
        state = self.state if distinct else None
        if within is None:
            return _pages.page_list(message, field, self.num_pages, state)
        return _pages.page_list(message, field, self.num_pages, state, *within)

    # ------------------------------------------------------------------ grants and content

    def grant(self, pages: np.ndarray, req: int, ts: int | None, *, judged: bool = False) -> int:
        """Grant `pages` to req (since = ts unless ts is None): use = 1 + holds, gen + 1,
        owner req, own NOBODY, prior = writer. Returns how many pages were still in use or
        reserved; if some were and not `judged`, nothing changed."""
        return _pages.grant(pages, self.state, req, ts, judged)

    def land(self, pages: np.ndarray, req: int, slots: np.ndarray | None, *, judged: bool = False) -> int:
        """Req's KV lands in `pages`: writer req, wgen = gen, valid = slots (full pages when
        None), own req where req owns the page, NOBODY elsewhere. Returns how many pages req
        does not own; if some and not `judged`, nothing changed."""
        return _pages.land(pages, self.state, req, slots, self.page_size, judged)

    def end_grant(self, pages: np.ndarray, req: int, ts: int | None, *, judged: bool = False) -> int:
        """Req's grant ends on each of `pages` it owns: owner ~req, own NOBODY, use - 1, since
        = ts unless ts is None. Returns how many pages req does not own; if some and not
        `judged`, nothing changed."""
        return _pages.end_grant(pages, self.state, req, ts, judged)

    def share(self, pages: np.ndarray) -> None:
        """A prefix sharer reads `pages` (still granted, or a cache hit on freed pages whose KV
        is still the origin's): one more user each, so they stay out of the free pool."""
        self.use[pages] += 1

    def unshare(self, pages: np.ndarray) -> None:
        """A prefix sharer of `pages` is done with them."""
        self.use[pages] -= 1

    def hold(self, kind: int, pages: np.ndarray, req: int, ts: int | None) -> None:
        """Another user (holder `kind`, for req) keeps `pages` (since = ts for a transfer_recv
        hold unless ts is None: where a draining transfer may land)."""
        held = pages[self.holds[kind, pages] > 0]
        for p in held.tolist():  # held in this kind already: its holders are counted apart
            holders = self.shared_holds.get((kind, p))
            if holders is None:
                holders = self.shared_holds[(kind, p)] = {int(self.holder_req[kind, p]): 1}
            holders[req] = holders.get(req, 0) + 1
        self.holds[kind, pages] += 1
        self.use[pages] += 1
        self.holder_req[kind, pages] = req
        if kind == RECV_HOLD and ts is not None:
            self.since[pages] = ts

    def release(self, kind: int, pages: np.ndarray, req: int, ts: int | None) -> None:
        """Req's hold of kind `kind` on `pages` (each held in that kind) ends."""
        if self.shared_holds:
            for p in pages.tolist():
                holders = self.shared_holds.get((kind, p))
                if holders is None:
                    continue
                who = req if req in holders else next(iter(holders))  # released by another: the oldest ends
                holders[who] -= 1
                if not holders[who]:
                    del holders[who]
                if sum(holders.values()) == 1:  # one holder again
                    self.holder_req[kind, p] = next(iter(holders))
                    del self.shared_holds[(kind, p)]
        self.holds[kind, pages] -= 1
        self.use[pages] -= 1
        if kind == RECV_HOLD and ts is not None:
            self.since[pages] = ts

    def scrub(self, pages: np.ndarray) -> None:
        """The engine zeroed `pages`: their old content, and whose it was, is gone."""
        self.writer[pages] = NOBODY
        self.valid[pages] = 0
        self.own[pages] = NOBODY
        self.prior[pages] = NOBODY

    def reserve(self, count: int) -> None:
        """Ids 0..count-1 are reserved (never handed out by the engine); the others are not."""
        self.reserved[:] = 0
        self.reserved[:count] = 1

    def timed_from(self, ts: int) -> None:
        """The pool's memory was just registered: changes are timed from `ts` on (before it,
        nothing is known of them)."""
        self.since[:] = ts

    # ------------------------------------------------------------------ queries

    def read_clean(self, pages: np.ndarray, req: int, tokens: int) -> bool:
        """Whether a context of `tokens` tokens through `pages` (exactly the pages it covers)
        reads only req's own KV written under its current grant: own == req everywhere, every
        page full but the last, which holds at least the slots read of it."""
        return _pages.read_clean(pages, self.state, req, tokens, self.page_size)

    def read_victims(
        self, pages: np.ndarray, req: int, tokens: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For a read that read_clean refused, by a reader given no prefix pages here: its
        stale pages (req's grant, without req's KV in the slots read) and foreign ones (not
        req's grant), each with its victim (NOBODY where that is req itself or nobody):
        (stale, stale_victims, foreign, foreign_victims)."""
        return _pages.read_victims(pages, self.state, req, tokens, self.page_size)

    def slots_read(self, count: int, tokens: int) -> np.ndarray:
        """Token slots read in each of `count` pages by a context of `tokens` tokens."""
        slots = np.full(count, self.page_size, np.uint32)
        if count:
            slots[-1] = tokens - (count - 1) * self.page_size
        return slots

    def draining(self, req: int, pages: np.ndarray, owner: np.ndarray) -> np.ndarray:
        """Which of `pages` (whose owners are `owner`) req's grant left while a transfer_recv
        hold keeps them for it: a transfer already in flight may still land there."""
        draining: np.ndarray = (owner == ~req) & (self.holds[RECV_HOLD, pages] > 0)
        return draining

    def holders(self, kinds: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """Who holds each of `pages` in the kind of hold kinds[i] (the oldest still holding,
        where several do)."""
        found: np.ndarray = self.holder_req[kinds, pages]
        if self.shared_holds:
            for i, (k, p) in enumerate(zip(kinds.tolist(), pages.tolist(), strict=True)):
                holders = self.shared_holds.get((k, p))
                if holders is not None:
                    found[i] = next(iter(holders))
        return found

    def mark_named(self, named: np.ndarray) -> None:
        """Set named[r] for every request r a page's tags name (writer, prior, own, owner or
        ended owner, holder of a hold still on the page)."""
        _pages.mark_named(self.state, self.holder_req, named)
        for holders in self.shared_holds.values():
            named[list(holders)] = True

    def refs(self, pages: np.ndarray) -> np.ndarray:
        """Live grants (owner and prefix sharers) of each of `pages`."""
        return live_grants(self.state[pages])


def live_grants(records: np.ndarray) -> np.ndarray:
    """Live grants (owner and prefix sharers) of the pages of these PAGE records: their users
    less their holds."""
    grants: np.ndarray = records["use"] - records["holds"].sum(axis=1, dtype=np.uint32)
    return grants


def check_tags(
    own: np.ndarray, valid: np.ndarray, tables: Any, lens: Any, readers: Any, page_size: int
) -> np.ndarray:
    """The check before attention over a batch, from the tags alone: for each request b,
    True iff every slot of its context (lens[b] tokens through tables[b]; entries beyond the
    context are ignored) holds its own KV written under its current grant (own == readers[b]
    and valid >= the slots read), or it reads nothing. A table too short for its context, a
    page out of range, or no reader (NOBODY) is False. cuda_hooks/kernels.py is its GPU twin."""
    tables, lens = _indices(tables), _indices(lens)
    # The record views (own, valid) go in as they are; plain arrays are made the same types.
    own, valid = np.asarray(own, dtype=np.int32), np.asarray(valid, dtype=np.uint32)
    return _pages.check_tags(own, valid, tables, lens, np.asarray(readers, dtype=np.int64), page_size)


def batch_clean(
    state: np.ndarray,
    tables: Any,
    lens: Any,
    reqs: list[str],
    index: dict[str, int],
    requests: np.ndarray,
    page_size: int,
) -> np.ndarray:
    """The whole check before attention of a batch on the host, in one pass in C: check_tags
    over the pool's page records (`state`), the readers found by name in `index` (into the
    REQ records `requests`; a name not there reads nothing as its own), and a reader that was
    rejected, aborted or killed is not clean whatever its pages hold; one that reads nothing
    is clean."""
    return _pages.batch_clean(state, _indices(tables), _indices(lens), reqs, index, requests, page_size)


class Verified(NamedTuple):
    """What batch_clean_from reads each row past: the engine's vouched entries (`stable`), what
    was verified (`upto` by reader, `by` page), the pages named since (`touched`), the rows of
    the engine's tables (`rows`, or None: tables is the batch's) and `per` (1: page ids; the
    page size: token slots, one column a page)."""

    stable: np.ndarray
    upto: np.ndarray
    by: np.ndarray
    touched: np.ndarray
    rows: np.ndarray | None
    per: int


def batch_clean_from(
    state: np.ndarray,
    tables: Any,
    lens: Any,
    reqs: list[str],
    index: dict[str, int],
    requests: np.ndarray,
    page_size: int,
    stable: np.ndarray,
    upto: np.ndarray,
    by: np.ndarray,
    touched: np.ndarray,
    rows: np.ndarray | None = None,
    per: int = 1,
) -> np.ndarray:
    """batch_clean's answer, each row read only past what was verified before: from entry
    min(upto[reader], stable[b]) on, after every reader that verified a `touched` page (by[page])
    has started over (upto 0); the new full pages of a clean row are recorded as verified (C:
    ledger/tags.c says how; `upto` and `by` are written in place). With `rows`, the batch's
    row b is tables[rows[b]]; with `per` > 1, tables hold token slots, one column a page, and
    an entry names page entry // per (SGLang's req_to_token, viewed at each page's first slot)."""
    return _pages.batch_clean_from(
        state,
        _indices(tables),
        _indices(lens),
        reqs,
        index,
        requests,
        page_size,
        stable,
        upto,
        by,
        touched,
        rows,
        per,
    )


def _indices(values: Any) -> np.ndarray:
    """An engine's int32 or int64 array as it is (no copy); anything else as int64."""
    array = np.asarray(values)
    return array if array.dtype in (np.int32, np.int64) else array.astype(np.int64)
