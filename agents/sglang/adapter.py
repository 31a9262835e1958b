"""What SGLang's own KV calls mean as kvguard events (`SglangAdapter`), for one scheduler
process: the paged and token allocators, `req_to_token`, the radix cache, rejection, and the
forward step; the PD senders and receivers are its other half (transfers.py).

Invariants:
- every request is named by its `rid`; its tenant is read from one attribute of the `Req`
  (`KVGUARD_TENANT_FIELD`, default `cache_salt`), once, when it is first seen;
- calls that name no request are attributed through the PageBook: a free to the page's
  owner when the allocator gets it back (grouped frees included), an eviction to the request
  the radix cache holds it for, a row naming another's page to a `share` from its origin;
- one guard call per forward step (`forward_step`): the KV the step writes (with a decode
  step's grants: its alloc_decode and write are held for it, decode.py) and the check before
  attention over `req_to_token[row, :seq_len]` of the whole batch, read in place past each
  row's entries verified before and not written since (`low`), vectorised.
"""

from __future__ import annotations

import logging
import operator
from http import HTTPStatus
from typing import Any

import numpy as np

from kvguard.agents.attach import Attachment
from kvguard.agents.guard import Verdict
from kvguard.agents.sglang.decode import Held, decode_shaped, fold
from kvguard.agents.sglang.pages import NONE, PageBook, groups
from kvguard.agents.sglang.transfers import POOL, PdTransfers, host_ints

log = logging.getLogger("kvguard.adapter")

RID = operator.attrgetter("rid")
UNTOUCHED = 1 << 62  # a req_to_token row no write reached since its last step


class SglangAdapter(PdTransfers):
    def __init__(self, attachment: Attachment, role: str = "colocated") -> None:
        self.attachment = attachment
        self.guard = attachment.guard
        self.role = role
        self.book: PageBook | None = None
        self.allocator: Any = None  # the guarded pool's allocator and req_to_token (report_pool)
        self.rows_pool: Any = None
        self.rids: list[str] = []
        self.index: dict[str, int] = {}
        self.live: dict[int, Any] = {}  # request index -> its Req, while it holds a row
        self.row_req = np.full(1, NONE, np.int32)  # req_to_token row -> request index
        # req_to_token row -> the lowest column written in it since its last step (UNTOUCHED:
        # none): what the check may take as verified before is the row's entries below it.
        self.low = np.zeros(1, np.int64)
        self.prompt: dict[int, int] = {}  # prompt tokens as first seen (a reject shortens them)
        self.admitted: set[int] = set()
        self.rooms: dict[int, int] = {}  # bootstrap room -> request index
        self.sending: dict[int, list[Any]] = {}  # id(sender) -> [pages sent, tokens sent]
        self.receiving: dict[int, tuple[int, np.ndarray, np.ndarray, int]] = {}
        self.receiver_room: dict[int, int] = {}
        self.concluded: dict[int, bool] = {}  # id(sender/receiver) -> may go on
        self.held: Held | None = None  # a decode step's alloc and write, for its step (decode.py)

    # ------------------------------------------------------------------ requests and pool

    def request(self, req: Any) -> int:
        rid = str(req.rid)
        idx = self.index.get(rid)
        if idx is None:
            idx = self.index[rid] = len(self.rids)
            self.rids.append(rid)
            self.prompt[idx] = len(req.origin_input_ids)
        room = getattr(req, "bootstrap_room", None)
        if room is not None:
            self.rooms[int(room)] = idx
        return idx

    def tenant(self, req: Any) -> str:
        field = self.attachment.settings.tenant_field or "cache_salt"
        value = getattr(req, field, None)
        return "" if value is None else str(value)

    def pool_of(self, allocator: Any) -> PageBook | None:
        """The page book of the pool this adapter guards; None for any other allocator (a
        second engine in the process, a draft model's pool: not this guard's)."""
        return self.book if allocator is self.allocator else None

    def report_pool(
        self,
        allocator: Any,
        *,
        role: str,
        context_len: int,
        req_to_token_pool: Any = None,
        max_prompt_tokens: int = 0,
        **facts: Any,
    ) -> Verdict:
        """The pool as the scheduler made it: page 0 pads (reserved), so pool tokens are
        size; a context longer than that is config drift before any request."""
        import sglang

        self.role = role
        self.allocator, self.rows_pool = allocator, req_to_token_pool
        book = self.book = PageBook(int(allocator.size // allocator.page_size), int(allocator.page_size))
        log.info(
            "kvguard: guarding sglang %s as node %s (%s, %s): pool %d tokens in pages of %d, context %d; %s",
            sglang.__version__,
            self.guard.node,
            self.guard.mode,
            role,
            allocator.size,
            book.page_size,
            context_len,
            self.attachment.settings.tenants(),
        )
        verdict = self.guard.pool(
            POOL,
            role,
            book.page_size,
            len(book.owner),
            reserved_pages=1,
            engine="sglang",
            engine_version=sglang.__version__,
            context_len=context_len,
            max_prompt_tokens=max_prompt_tokens,
            cluster=self.attachment.settings.cluster,
            source="sglang scheduler (in-engine)",
            **facts,
        )
        # Where the pool's KV lies on the GPU (each layer's buffers), for the CUDA shim's
        # allocation witness where it is preloaded.
        kv = allocator.get_kvcache() if hasattr(allocator, "get_kvcache") else None
        buffers = [b for name in ("k_buffer", "v_buffer", "kv_buffer") for b in getattr(kv, name, None) or ()]
        on_gpu = [(b.data_ptr(), b.numel() * b.element_size()) for b in buffers if getattr(b, "is_cuda", 0)]
        if on_gpu:
            self.guard.pool_memory(POOL, on_gpu)
        return verdict

    def rows_bound(self, pool: Any, reqs: list[Any]) -> None:
        """ReqToTokenPool.alloc bound rows to requests: the first time, the request is admitted."""
        if not self._ours(pool):
            return
        if len(self.row_req) < pool.req_to_token.shape[0]:
            self.row_req = np.full(pool.req_to_token.shape[0], NONE, np.int32)
            self.low = np.zeros(pool.req_to_token.shape[0], np.int64)
        stage = "decode" if self.role == "decode" else "prefill"
        for req in reqs:
            idx = self.request(req)
            self.live[idx] = req
            row = req.kv.req_pool_idx
            if row is not None:
                self.row_req[row] = idx
                self.low[row] = 0  # a row (re)bound: nothing of it was verified for this request
            if idx not in self.admitted:
                self.admitted.add(idx)
                self.guard.admit(self.rids[idx], self.tenant(req), self.prompt[idx], stage)

    def _ours(self, rows_pool: Any) -> bool:
        return self.book is not None and (self.rows_pool is None or rows_pool is self.rows_pool)

    def rejected(self, req: Any, message: str) -> None:
        idx = self.request(req)
        self.guard.reject(self.rids[idx], message)

    def row_freed(self, pool: Any, req: Any) -> None:
        """The request gives its row back (its release): the pages of its row the radix cache
        keeps (its own, and those it shared) are its to free now; the rest come back through
        the allocator."""
        idx = self.index.get(str(req.rid))
        if idx is None or not self._ours(pool):
            return
        row = req.kv.req_pool_idx
        if row is not None:
            length = int(getattr(req.kv, "kv_allocated_len", 0) or pool.req_to_token.shape[1])
            pages = self.book.pages_of(host_ints(pool.req_to_token[row, :length]))
            # Its own pages the tree keeps, and the tree's pages it shared: all given back now.
            mine = pages[self.book.tree[pages] != NONE]
            if len(mine):
                self.book.give_back(mine[self.book.owner[mine] == idx])
                self.guard.free(self.rids[idx], POOL, mine)
            self.row_req[row] = NONE
            self.low[row] = 0
        self.live.pop(idx, None)
        reason = getattr(req, "finished_reason", None)
        if reason is not None:
            if type(reason).__name__ == "FINISH_ABORT":
                self.guard.abort(self.rids[idx], str(getattr(reason, "message", "aborted")))
            else:
                self.guard.finish(self.rids[idx], len(getattr(req, "output_ids", ()) or ()))

    # ------------------------------------------------------------------ pages

    def decode_slots(self, allocator: Any, slots: Any) -> None:
        """alloc_decode handed out a decode step's slots: held for the step (decode.py)."""
        self.flush()
        if slots is not None and self.pool_of(allocator) is not None:
            self.held = Held(allocator, slots)

    def flush(self) -> None:
        """What is held, applied as SGLang made the calls."""
        held, self.held = self.held, None
        if held is not None:
            self.handed_out(held.allocator, held.slots)
            if held.write is not None:
                self.row_written(*held.write)

    def handed_out(self, allocator: Any, slots: Any) -> None:
        book = self.pool_of(allocator)
        if slots is None or book is None:
            return
        pages = host_ints(slots) // book.page_size
        book.handed_out(pages[pages > 0])  # repeats do no harm: no sort for distinct pages

    def released(self, allocator: Any, pages: np.ndarray) -> None:
        """Pages the allocator takes back: each one's owner frees it, or the radix cache
        evicts it (released for the request it held it for); a page nobody had is freed a
        second time by its last owner (the ledger judges that)."""
        book = self.pool_of(allocator)
        if book is None:
            return
        pages = pages[pages > 0]
        owner = book.owner[pages]
        held = (owner == NONE) & (book.tree[pages] != NONE)
        for idx, own in groups(owner[owner != NONE], pages[owner != NONE]):
            book.give_back(own)
            self.guard.free(self.rids[idx], POOL, own)
        for idx, evicted in groups(book.tree[pages[held]], pages[held]):
            book.evict(evicted)
            self.guard.release(self.rids[idx], POOL, evicted, "prefix_cache")
        twice = (owner == NONE) & ~held & (book.last[pages] != NONE)
        for idx, again in groups(book.last[pages[twice]], pages[twice]):
            self.guard.free(self.rids[idx], POOL, again)

    def row_written(self, pool: Any, indices: Any, values: Any) -> None:
        """req_to_token[indices] = values: pages handed out are granted to the row's request;
        pages someone else has (the radix cache's, or freed ones still holding their KV) are
        a share from their origin."""
        if not self._ours(pool):
            return
        if self.held is not None:
            if self.held.write is None and decode_shaped(indices, values):
                self.held.write = (pool, indices, values)  # the step takes it (decode.py)
                return
            self.flush()
        book = self.book
        slots = host_ints(values)
        rows_spec = indices[0] if isinstance(indices, tuple) else indices
        if hasattr(rows_spec, "numel") and rows_spec.numel() == len(slots):
            rows = host_ints(rows_spec)
        elif hasattr(rows_spec, "numel") and rows_spec.numel() > 1:
            self.low[:] = 0  # a shape this adapter does not map (a 2-D copy): every row checked whole
            return
        else:
            rows = np.full(len(slots), int(rows_spec), np.int64)
        self._written_from(rows, indices[1] if isinstance(indices, tuple) and len(indices) > 1 else None)
        pages = slots // book.page_size
        keep = pages > 0
        reqs = self.row_req[rows[keep]]
        pages = pages[keep]
        known = reqs != NONE
        reqs, pages = reqs[known], pages[known]
        if not len(pages):
            return
        if not book.fresh[pages].any() and (book.owner[pages] == reqs).all():
            return  # the common decode step: every slot in a page its request has already
        pair = reqs.astype(np.int64) * len(book.owner) + pages
        _, first = np.unique(pair, return_index=True)
        first.sort()
        reqs, pages = reqs[first], pages[first]
        new = book.fresh[pages]
        if new.any() and len(np.unique(reqs[new])) == int(new.sum()):  # a page each, as decode grants
            granted_to, granted = reqs[new], pages[new]
            book.fresh[granted] = False
            book.owner[granted] = granted_to
            book.last[granted] = granted_to
            self.guard.alloc_each(POOL, [self.rids[i] for i in granted_to.tolist()], granted)
        elif new.any():
            granted = groups(reqs[new], pages[new])
            for idx, own in granted:
                book.grant(own, idx)
            self.guard.alloc_each(
                POOL,
                [self.rids[i] for i, _ in granted],
                np.concatenate([p for _, p in granted]),
                [len(p) for _, p in granted],
            )
        other = ~new & (book.owner[pages] != reqs)
        if other.any():
            origin = np.where(book.tree[pages] != NONE, book.tree[pages], book.last[pages])
            for idx, shared in groups(reqs[other], pages[other]):
                for src, part in groups(origin[other][reqs[other] == idx], shared):
                    if src != NONE:
                        self.guard.share(self.rids[idx], POOL, part, self.rids[src])

    def _written_from(self, rows: np.ndarray, cols: Any) -> None:
        """Columns of req_to_token rows written: each row's lowest one since its step is kept."""
        if not len(rows):
            return
        if int(rows.max()) >= len(self.low):
            self.low = np.concatenate((self.low, np.zeros(int(rows.max()) + 1 - len(self.low), np.int64)))
        if isinstance(cols, slice):
            low = np.full(len(rows), cols.start or 0, np.int64)
        elif cols is None:
            low = np.zeros(len(rows), np.int64)
        else:
            low = np.broadcast_to(host_ints(cols), rows.shape)
        np.minimum.at(self.low, rows, low)

    def cached(self, allocator: Any, value: Any, prefix_len: int) -> None:
        """The radix cache took the slots after prefix_len: it holds their pages for the
        request that has them."""
        book = self.pool_of(allocator)
        if book is None or value is None:
            return
        pages = book.pages_of(host_ints(value)[prefix_len:])
        pages = pages[(book.tree[pages] == NONE) & (book.last[pages] != NONE)]
        holder = np.where(book.owner[pages] != NONE, book.owner[pages], book.last[pages])
        for idx, held in groups(holder, pages):
            book.cache(held, idx)
            self.guard.hold(self.rids[idx], POOL, held, "prefix_cache")

    # ------------------------------------------------------------------ the forward step

    def forward_step(
        self, reqs: list[Any], rows: Any, seq_lens: Any, out_cache_loc: Any, r2t: Any, extend_lens: Any = None
    ) -> Verdict:
        """One guard call for the step: request i writes its slots of out_cache_loc (its part
        is seq_len minus what it had before), then the batch's rows are checked up to their
        seq_lens. The requests a verdict kills get SGLang's own abort (to_finish)."""
        if self.book is None or not reqs:
            self.flush()
            return Verdict()
        ps = self.book.page_size
        lens = host_ints(seq_lens)
        locs = host_ints(out_cache_loc)
        at = host_ints(rows)
        folded = None
        if self.held is not None:
            folded = fold(self.held, self.book, self.row_req, rows, at, out_cache_loc, locs, host_ints)
            if folded is None:
                self.flush()
            self.held = None
        if len(locs) == len(reqs):  # a decode step: one slot, so one page, each
            step_pages, step_slots, counts = locs // ps, locs % ps + 1, None
        else:
            written = self._step_counts(reqs, extend_lens)
            owner_of = np.repeat(np.arange(len(reqs)), written)
            pages = locs // ps
            starts = np.ones(len(locs), bool)
            starts[1:] = (pages[1:] != pages[:-1]) | (owner_of[1:] != owner_of[:-1])
            ends = np.ones(len(locs), bool)
            ends[:-1] = starts[1:]
            step_pages = pages[starts]
            step_slots = locs[ends] % ps + 1
            counts = np.bincount(owner_of[starts], minlength=len(reqs))
        names = list(map(RID, reqs))  # a request's rid is its name (request() interned it)
        grants = None if folded is None else folded.grants
        req_to_token = r2t.req_to_token
        if req_to_token.device.type == "cpu":
            # The check reads req_to_token in place, each row past the columns written since
            # its last step (row_written saw every write SGLang made through the pool).
            if len(at) and int(at.max()) >= len(self.low):  # rows kvguard never saw written
                self.low = np.concatenate((self.low, np.zeros(int(at.max()) + 1 - len(self.low), np.int64)))
            stable = self.low[at] if folded is None else np.minimum(self.low[at], folded.written)
            stable //= ps
            self.low[at] = UNTOUCHED
            check: dict[str, Any] = {
                "block_tables": req_to_token.numpy(),
                "stable": stable,
                "table_rows": at,
                "in_slots": True,
            }
        else:  # the device's own tables, checked there whole
            check = {"block_tables": self._block_table(req_to_token, rows, -(-int(lens.max()) // ps))}
        verdict = self.guard.step(
            POOL, names, step_pages, step_slots, counts=counts, grants=grants, context_lens=lens, **check
        )
        if verdict.kill:
            for req in reqs:
                if req.rid in verdict.kill:
                    self.stop(req, verdict.reason(req.rid))
        return verdict

    def step_done(self) -> None:
        """The step's kernels are launched (the CUDA shim's launch witness: the next needs a check)."""
        self.guard.step_done()

    def _block_table(self, req_to_token: Any, rows: Any, width: int) -> Any:
        """Each row's page ids (its first slot of every page), [batch, width]: a strided view
        gathered by row, on the host through NumPy (torch's indexing is slower there), on a
        GPU where the table lies (the guard checks it there)."""
        ps = self.book.page_size
        if req_to_token.device.type == "cpu":
            view = req_to_token.numpy()[:, : width * ps : ps]
            return view[host_ints(rows)].astype(np.int64) // ps
        return req_to_token[rows, : width * ps : ps].long() // ps

    @staticmethod
    def _step_counts(reqs: list[Any], extend_lens: Any) -> np.ndarray:
        """Tokens each request writes this (extend) step: its extend length (the batch's
        extend_lens, as prepare_for_extend set them)."""
        if extend_lens is not None and len(extend_lens) == len(reqs):
            return np.asarray(extend_lens, np.int64)
        return np.asarray([r.extend_len for r in reqs], np.int64)

    def stop(self, req: Any, reason: str) -> None:
        """SGLang's own abort of a request: the scheduler finishes it with an error (HTTP 403; a
        stream: an error event) in kvguard's words for its client (`Guard.told`: nothing of
        any other tenant); `reason`, the finding's, goes to the log and the audit log only."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        log.warning("kvguard: stopping SGLang request %s: %s", req.rid, reason)
        req.to_finish = FINISH_ABORT(self.guard.told(str(req.rid)), HTTPStatus.FORBIDDEN, "KVGuardViolation")

    def stop_rid(self, rid: str, reason: str) -> None:
        """The daemon's kill (on the sink's reader thread): the request, while it holds a row and
        is not already ending (an end of SGLang's own, or kvguard's own local kill), gets
        SGLang's abort. (The daemon's later kills of it never come here: the guard passes on
        the first only.)"""
        idx = self.index.get(rid)
        req = self.live.get(idx) if idx is not None else None
        if req is not None and req.to_finish is None and req.finished_reason is None:
            self.stop(req, reason)
