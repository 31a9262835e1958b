"""One guarded vLLM `KVCacheManager` (`PoolState`): its block tables as kvguard sees them, the
grants not yet reported, and the per-step call that reports a scheduler step to the guard.

Invariant: every block a request holds in vLLM has been reported to the guard as granted
(`alloc`) or shared (`share`) before any event that depends on it (the step that writes it,
a share naming its grantee, its free, a transfer receipt); a block's `grantee` is the request
it was last granted to, which is the origin of any later prefix hit on it (the hit is judged
by the ledger: a freed block still holding its grantee's KV is a legitimate hit). Blocks a KV
connector loads into count as written only through a `done` receipt, for no more than what
landed (up to the first invalid block, within what the sender holds; a load in the step's own
forward, as a synchronous connector makes it: the blocks the load witness saw change); blocks
vLLM keeps past a request's end for its connector are held (transfer_send / transfer_recv)
until it is done. A request whose KV a synchronous connector loads in this step's forward is
checked after that forward, before anything computed from it leaves the engine core.
Block tables are kept incrementally, one row a request in one array (`Tables`): a request's
blocks are appended as vLLM grants them (the waiting queue's grants from `allocate_slots`, the
running requests' from the step's `SchedulerOutput.new_block_ids`, which is what the workers'
tables are built from), never rebuilt. The step's pages, slots and block tables are numpy
arrays over the whole batch, gathered from those rows; no Python runs per request of a step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvguard.agents.attach import Attachment
from kvguard.agents.guard import Verdict
from kvguard.agents.vllm.tables import EMPTY, Tables


@dataclass(slots=True)
class Load:
    """KV a connector loads into a request's blocks: the blocks, the first token they hold,
    the tokens it said it would load."""

    blocks: np.ndarray
    local: int
    external: int
    peer: str = ""


class PoolState:
    """kvguard's view of one KV cache manager (one pool: one full-attention group)."""

    def __init__(
        self,
        attachment: Attachment,
        pool: int,
        group: Any,
        block_size: int,
        num_blocks: int,
        null_block: int,
        stage: str,
        tenant_of: Any,
        *,
        paired: bool = False,
    ) -> None:
        self.attachment = attachment
        self.guard = attachment.guard
        self.pool = pool
        self.group = group  # vLLM's single-type manager: its req_to_blocks is the truth
        self.bs = block_size
        self.null = null_block
        self.stage = stage
        self.tenant_of = tenant_of
        self.paired = paired  # a decode pool (kv_consumer): external loads are transfers from prefill
        self.tables = Tables(null_block, width=64)
        self.pending: dict[str, tuple[int, np.ndarray]] = {}  # request -> (table position, new ids)
        self.pending_mask = np.zeros(num_blocks, bool)
        self.early: set[str] = set()  # running requests whose grants of this step went before it
        self.renewed: set[str] = set()  # requests whose tables allocate_slots set since the last step
        self.grantee = np.full(num_blocks, "", dtype=object)
        self.admitted: set[str] = set()
        self.xfer_in: dict[str, Load] = {}  # loads a connector reports done later (finished_recving)
        self.loading: dict[str, Load] = {}  # loads in the coming forward (a synchronous connector)
        self.after_forward: list[tuple[str, int, int]] = []  # (request, start, tokens): after the forward
        self.held: dict[str, tuple[np.ndarray, str]] = {}  # request -> (blocks, holder) past its end
        self.kills: dict[str, str] = {}  # request -> why, to end through vLLM's abort path
        self.direct_allocate: Any = None  # vLLM's own allocate_slots, bound to the manager

    # ------------------------------------------------------------------ vLLM's own tables

    def vllm_table(self, rid: str) -> list[Any]:
        return self.group.req_to_blocks.get(rid, ())

    def vllm_blocks(self, rid: str, start: int = 0) -> np.ndarray:
        blocks = self.vllm_table(rid)
        return np.fromiter((b.block_id for b in blocks[start:]), np.int64, max(0, len(blocks) - start))

    def table(self, rid: str) -> np.ndarray:
        """The request's block ids, as kvguard was told them (a view)."""
        return self.tables.table(rid)

    def unreported(self, rid: str, upto: int | None = None) -> None:
        """Blocks vLLM appended to a request's table that kvguard has not reported (granted in
        this step's running loop, whose grants the step reports from its SchedulerOutput, but
        freed or hit on before that): granted now, so that what follows names blocks the
        ledger knows; the step will not report them again."""
        self.flush([rid])
        known = self.tables.length(rid)
        vllm = len(self.vllm_table(rid)) if upto is None else upto
        if vllm > known:
            new = self.vllm_blocks(rid, known)[: vllm - known]
            self.tables.put(rid, known, new)
            self.take(self.guard.alloc(rid, self.pool, new))
            self.grantee[new] = rid
            self.early.add(rid)

    # ------------------------------------------------------------------ verdicts

    def take(self, verdict: Verdict, rid: str = "") -> None:
        """Requests a verdict condemns: killed ones, and the sharer of a denied share (vLLM
        cannot undo a hit it has taken, so the request ends rather than read foreign KV)."""
        for req, finding in verdict.kill.items():
            self.kills.setdefault(req, finding.message if finding else "unverifiable by kvguard")
        if verdict.deny and rid and rid not in self.kills:
            why = next((f for f in verdict.findings if f.action == "deny"), None)
            self.kills[rid] = why.message if why else "prefix share denied"
            if why is not None:
                self.guard.kill(rid, why.finding, why.rule, why.message, by=f"vllm-adapter@{self.guard.node}")

    def take_kills(self) -> dict[str, str]:
        kills, self.kills = self.kills, {}
        return kills

    # ------------------------------------------------------------------ allocation

    def allocated(
        self, request: Any, before: int, n_hit: int, local: int, external: int, in_step: bool = False
    ) -> None:
        """After allocate_slots granted blocks: admit on first sight, report the prefix hits
        (share, origin = each block's grantee), keep the new grants for the step; blocks for
        `external` tokens past the `local` computed ones wait for a connector's receipt, or,
        `in_step` (a synchronous connector), for the witness after this step's forward."""
        rid = request.request_id
        if rid not in self.admitted:
            self.admitted.add(rid)
            self.take(self.guard.admit(rid, self.tenant_of(request), request.num_prompt_tokens, self.stage))
        if self.tables.length(rid) < before:  # blocks it held that kvguard was not told of
            self.unreported(rid, before)
        new = self.vllm_blocks(rid, before)
        self.tables.put(rid, before, new)
        self.renewed.add(rid)
        hits, grants = new[:n_hit], new[n_hit:]
        hits = hits[hits != self.null]
        if rid in self.pending:  # granted twice before a step: the first grant goes now
            self.flush([rid])
        if len(grants):
            self.pending[rid] = (before + n_hit, grants)
            self.pending_mask[grants] = True
        if len(hits):
            # Its grants first: a share the guard refuses ends the request, after which no
            # grant of it may be reported.
            self.flush([rid])
            self.share(rid, hits)
        if external > 0:  # blocks a KV connector loads into: their receipt names them
            pages = self.table(rid)[local // self.bs : -(-(local + external) // self.bs)].copy()
            if in_step:
                self.loading[rid] = Load(pages, local, external, peer(request))
            else:
                self.xfer_in[rid] = Load(pages, local, external, peer(request))
            if self.paired:
                prefill = peer(request) or "remote-prefill"
                tenant = self.tenant_of(request)
                self.take(self.guard.bootstrap(rid, prefill, self.guard.node, external, tenant), rid)

    def share(self, rid: str, hits: np.ndarray) -> None:
        if self.pending_mask[hits].any():  # a hit on a block granted this very step
            self.flush(list(self.pending))
        origins = self.grantee[hits]
        if not origins.all():
            # Every block but the null one was granted while kvguard watched: one without a
            # grantee was granted in this step's running loop, not reported yet.
            for holder, blocks in list(self.group.req_to_blocks.items()):
                if holder in self.tables and len(blocks) > self.tables.length(holder):
                    self.unreported(holder)
            origins = self.grantee[hits]
        for origin in np.unique(origins).tolist():
            if origin:  # a block never granted while kvguard watched has no known origin
                self.take(self.guard.share(rid, self.pool, hits[origins == origin], origin), rid)

    def flush(self, rids: Sequence[str]) -> None:
        """Report the pending grants of these requests now, in one call."""
        names, parts = [], []
        for rid in rids:
            entry = self.pending.pop(rid, None)
            if entry is not None:
                names.append(rid)
                parts.append(entry[1])
        if not names:
            return
        pages = np.concatenate(parts)
        self.pending_mask[pages] = False
        self.take(self.guard.alloc_each(self.pool, names, pages, [len(p) for p in parts]))
        self.grantee[pages] = np.repeat(np.array(names, dtype=object), [len(p) for p in parts])

    def freeing(self, rid: str) -> np.ndarray:
        """The blocks vLLM is about to free for the request (its own table, read only when
        kvguard's copy is not as long)."""
        if len(self.vllm_table(rid)) == self.tables.length(rid):
            return self.table(rid).copy()
        return self.vllm_blocks(rid)

    def freed(self, rid: str, block_ids: np.ndarray) -> None:
        """The request gives its blocks back (vLLM frees a table in reverse order): any of them
        granted in this step and not reported yet are granted first."""
        if rid in self.tables and len(block_ids) > self.tables.length(rid):
            self.unreported(rid, len(block_ids))
        self.flush([rid])
        self.tables.drop(rid)
        self.renewed.discard(rid)
        self.xfer_in.pop(rid, None)
        self.loading.pop(rid, None)
        self.held.pop(rid, None)
        pages = block_ids[::-1]
        pages = pages[pages != self.null]
        if len(pages):
            self.take(self.guard.free(rid, self.pool, pages))

    # ------------------------------------------------------------------ KV connector

    def held_for_connector(self, request: Any) -> None:
        """vLLM ended the request but keeps its blocks until its connector is done with them:
        a send still to go, or a load still in flight (an abort while it waits for remote KV)."""
        rid = request.request_id
        self.flush([rid])
        holder = "transfer_recv" if rid in self.xfer_in else "transfer_send"
        pages = self.table(rid)
        pages = pages[pages != self.null]
        if len(pages):
            self.held[rid] = (pages, holder)
            self.take(self.guard.hold(rid, self.pool, pages, holder))

    def release(self, rid: str) -> None:
        pages, holder = self.held.pop(rid, (EMPTY, ""))
        if len(pages):
            self.take(self.guard.release(rid, self.pool, pages, holder))

    def received(self, rid: str, request: Any, invalid: np.ndarray, failed: bool) -> None:
        """The worker reports rid's load finished. What landed: the loaded blocks up to the
        first invalid one, and no more tokens than the sender holds (its kv_transfer_params:
        remote_block_ids, remote_num_tokens), since vLLM's finished_recving carries no count."""
        entry = self.xfer_in.pop(rid, None)
        if entry is None:  # no load kvguard saw reserved (granted before it watched): nothing to say
            self.release(rid)
            return
        pages, local, expected = entry.blocks, entry.local, entry.external
        bad = np.flatnonzero(np.isin(pages, invalid))
        landed = min(expected, int(bad[0]) * self.bs) if len(bad) else expected
        landed = min(landed, max(0, sender_tokens(request, self.bs) - local))
        status = "failed" if failed or landed <= 0 else "done"
        if status == "failed":
            landed = 0
        n = -(-landed // self.bs)
        self.take(
            self.guard.xfer_recv(
                rid,
                rid,
                peer(request),
                self.pool,
                pages if status == "failed" else pages[:n],
                landed,
                0,
                status=status,
            ),
            rid,
        )
        self.release(rid)

    def sent(self, rid: str, request: Any) -> None:
        """The worker reports rid's KV sent: the blocks of its computed tokens left the node."""
        tokens = request.num_computed_tokens if request is not None else 0
        pages = self.table(rid)[: -(-tokens // self.bs)]
        self.take(self.guard.xfer_send(rid, rid, peer(request), self.pool, pages, tokens, 0), rid)
        self.release(rid)

    # ------------------------------------------------------------------ the step

    def step(self, out: Any) -> dict[str, str]:
        """One scheduler step, from its SchedulerOutput (what the workers run): the KV each
        scheduled request writes, the grants made for it (the running requests' from the
        output's new_block_ids; the waiting queue's came by allocate_slots) and the check of
        every request's block table up to its context, in one guard call. A request whose KV
        is loaded in this step's forward waits for `forwarded`. The requests to end."""
        new, cached = out.scheduled_new_reqs, out.scheduled_cached_reqs
        ids: list[str] = cached.req_ids
        start: list[int] = cached.num_computed_tokens
        if new:
            ids = [r.req_id for r in new] + ids
            start = [r.num_computed_tokens for r in new] + start
        granted = self._running_grants(cached)
        n, scheduled = len(ids), out.num_scheduled_tokens
        if not new and not cached.resumed_req_ids and len(scheduled) == n:
            # Only running requests: vLLM filled num_scheduled_tokens in their order.
            sched = np.fromiter(scheduled.values(), np.int64, n)
        else:
            sched = np.fromiter(map(scheduled.__getitem__, ids), np.int64, n)
        starts = np.fromiter(start, np.int64, n)
        if self.kills or self.loading:  # rare: requests ended at allocation, loads in the forward
            later = [i for i, rid in enumerate(ids) if rid in self.loading and rid not in self.kills]
            self.after_forward += [(ids[i], int(starts[i]), int(sched[i])) for i in later]
            now = [i for i, rid in enumerate(ids) if rid not in self.kills and rid not in self.loading]
            ids, starts, sched = [ids[i] for i in now], starts[now], sched[now]
        self.early.clear()
        return self._step(ids, starts, sched, granted)

    def _running_grants(self, cached: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The blocks this step's running loop granted, appended to their requests' tables:
        (rows, where each request's grants begin, how many), for the step to report."""
        new_ids = cached.new_block_ids
        if new_ids.count(None) == len(new_ids):
            return EMPTY, EMPTY, EMPTY
        resumed, early = cached.resumed_req_ids, self.early  # their blocks came by allocate_slots
        req_ids, row_of = cached.req_ids, self.tables.row_of
        rows: list[int] = []
        parts: list[int] = []
        flat: list[int] = []
        for i in itertools.compress(range(len(new_ids)), new_ids):  # the few that got blocks
            rid, blocks = req_ids[i], new_ids[i][0]
            if blocks and rid not in resumed and rid not in early:
                rows.append(row_of[rid])
                parts.append(len(blocks))
                flat += blocks
        if not rows:
            return EMPTY, EMPTY, EMPTY
        return self.tables.append(rows, parts, flat)

    def forwarded(self, witnessed: bool, unchanged: np.ndarray) -> dict[str, str]:
        """After the step's forward: the loads it made, as the workers' load witness saw them
        land (witness.py), then the step of the requests that read them, checked. The
        requests to end."""
        todo, self.after_forward = self.after_forward, []
        for rid, _, _ in todo:
            self.loaded(rid, witnessed, unchanged)
        todo = [entry for entry in todo if entry[0] not in self.kills]
        starts = np.array([entry[1] for entry in todo], np.int64)
        sched = np.array([entry[2] for entry in todo], np.int64)
        return self._step([entry[0] for entry in todo], starts, sched, (EMPTY, EMPTY, EMPTY))

    def loaded(self, rid: str, witnessed: bool, unchanged: np.ndarray) -> None:
        """A load made in the forward, reported as what landed: its blocks up to the first the
        witness saw unchanged (all of them, at the connector's word, when it was not
        witnessed), against the tokens the connector said it would load."""
        load = self.loading.pop(rid, None)
        if load is None:
            return
        blocks = load.blocks
        missing = np.flatnonzero(np.isin(blocks, unchanged)) if witnessed else EMPTY
        n = int(missing[0]) if len(missing) else len(blocks)
        landed = min(load.external, max(0, n * self.bs - load.local % self.bs))
        # "done": the connector said so, whatever landed (a receipt short of the claim is the
        # transfer mismatch it is, even when nothing landed at all).
        self.take(
            self.guard.xfer_recv(
                rid,
                rid,
                load.peer,
                self.pool,
                blocks[: -(-landed // self.bs)],
                landed,
                0,
                claimed_tokens=load.external,
            ),
            rid,
        )

    def _step(
        self,
        ids: list[str],
        starts: np.ndarray,
        sched: np.ndarray,
        granted: tuple[np.ndarray, np.ndarray, np.ndarray],
    ) -> dict[str, str]:
        n, bs, tables = len(ids), self.bs, self.tables
        if not n:
            self._flush_granted(granted, np.zeros(0, bool))
            self.flush(list(self.pending))
            return self.take_kills()
        rows = tables.rows(ids)  # the previous step's, when the batch and the rows are the same
        ends = starts + sched
        first = starts // bs
        decode = bool((sched == 1).all())  # one token, so one page, each: no part to lay out
        if decode:
            last, counts, rep, pos = first, None, None, first
            if (first >= tables.count[rows]).any():
                raise ValueError("a request's scheduled tokens reach past the blocks vLLM granted it")
            pages = tables.blocks[rows, first]
            slots = ends - first * bs
        else:
            last = (ends - 1) // bs
            counts = np.where(sched > 0, last - first + 1, 0)
            if (first + counts > tables.count[rows]).any():
                raise ValueError("a request's scheduled tokens reach past the blocks vLLM granted it")
            rep = np.repeat(np.arange(n), counts)
            pos = first[rep] + np.arange(len(rep)) - (np.cumsum(counts) - counts)[rep]
            pages = tables.blocks[rows[rep], pos]
            slots = np.minimum(bs, ends[rep] - pos * bs)
        # A request's new grants ride in the step when they are the tail of what it writes;
        # the rest are reported first, on their own.
        grants = np.zeros(n, np.int64)
        g_rows, g_at, g_n = granted
        if len(g_rows):
            index = np.full(len(tables.count), -1, np.int64)
            index[rows] = np.arange(n)
            i = index[g_rows]
            ride = (i >= 0) & (g_at >= first[i]) & (g_at + g_n - 1 == last[i])
            if not decode:
                ride &= counts[i] > 0
            grants[i[ride]] = g_n[ride]
            self._flush_granted(granted, ride)
        if self.pending:
            at_of = {rid: i for i, rid in enumerate(ids)}
            for rid, (at, blocks) in list(self.pending.items()):
                i = at_of.get(rid, -1)
                if i >= 0 and (decode or counts[i]) and at >= first[i] and at + len(blocks) - 1 == last[i]:
                    grants[i] = len(blocks)
                    del self.pending[rid]
                    self.pending_mask[blocks] = False
            self.flush(list(self.pending))
        # What the check may take as verified before: the entries before what each request
        # writes now (append-only tables); none of a request whose table allocate_slots set.
        stable = first
        if self.renewed:
            renewed = [i for i, rid in enumerate(ids) if rid in self.renewed]
            stable = first.copy()
            stable[renewed] = 0
            self.renewed.difference_update(ids[i] for i in renewed)
        self.take(
            self.guard.step(
                self.pool,
                ids,
                pages,
                slots,
                counts=counts,  # None: one page each
                grants=grants,
                block_tables=tables.blocks,
                context_lens=ends,
                stable=stable,
                table_rows=rows,
            )
        )
        if rep is None:
            fresh = grants > 0
            self.grantee[pages[fresh]] = tables.names[rows[fresh]]
        elif grants.any():
            fresh = (pos - first[rep]) >= (counts - grants)[rep]  # each part's last grants[i] pages
            self.grantee[pages[fresh]] = tables.names[rows[rep[fresh]]]
        return self.take_kills()

    def _flush_granted(self, granted: tuple[np.ndarray, np.ndarray, np.ndarray], ride: np.ndarray) -> None:
        """Report the running loop's grants that do not ride in the step, in one call."""
        g_rows, g_at, g_n = granted
        stay = ~ride
        if not stay.any():
            return
        rows, at, parts = g_rows[stay], g_at[stay], g_n[stay]
        rep = np.repeat(np.arange(len(rows)), parts)
        pages = self.tables.blocks[rows[rep], at[rep] + np.arange(len(rep)) - (np.cumsum(parts) - parts)[rep]]
        names = self.tables.names[rows]
        self.take(self.guard.alloc_each(self.pool, names.tolist(), pages, parts))
        self.grantee[pages] = names[rep]


def peer(request: Any) -> str:
    """The other engine of a transfer, as the request's kv_transfer_params name it."""
    params = getattr(request, "kv_transfer_params", None) or {}
    return str(params.get("remote_engine_id") or params.get("remote_host") or "")


def sender_tokens(request: Any, block_size: int) -> int:
    """How many prompt tokens the sender can deliver, as far as the request's kv_transfer_params
    say (NIXL-style: remote_block_ids, remote_num_tokens); unbounded when they say nothing."""
    params = getattr(request, "kv_transfer_params", None) or {}
    blocks = params.get("remote_block_ids")
    covered = 1 << 62
    if blocks:
        group = blocks[0] if isinstance(blocks[0], (list, tuple)) else blocks
        covered = len(group) * block_size
    if params.get("remote_num_tokens"):
        covered = min(covered, int(params["remote_num_tokens"]))
    return covered
