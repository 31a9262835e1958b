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
The step's pages, slots and block tables are built as numpy arrays over the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvguard.agents.attach import Attachment
from kvguard.agents.guard import Verdict

EMPTY = np.zeros(0, np.int64)


@dataclass(slots=True)
class Load:
    """KV a connector loads into a request's blocks: the blocks, the first token they hold,
    the tokens it said it would load."""

    blocks: np.ndarray
    local: int
    external: int


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
        self.tables: dict[str, np.ndarray] = {}  # request -> its block ids, in vLLM's order
        self.pending: dict[str, tuple[int, np.ndarray]] = {}  # request -> (table position, new ids)
        self.pending_mask = np.zeros(num_blocks, bool)
        self.grantee = np.full(num_blocks, "", dtype=object)
        self.admitted: set[str] = set()
        self.xfer_in: dict[str, Load] = {}  # loads a connector reports done later (finished_recving)
        self.loading: dict[str, Load] = {}  # loads in the coming forward (a synchronous connector)
        self.after_forward: list[tuple[Any, int]] = []  # (request, tokens) checked after the forward
        self.held: dict[str, tuple[np.ndarray, str]] = {}  # request -> (blocks, holder) past its end
        self.kills: dict[str, str] = {}  # request -> why, to end through vLLM's abort path

    # ------------------------------------------------------------------ vLLM's own tables

    def vllm_table(self, rid: str) -> list[Any]:
        return self.group.req_to_blocks.get(rid, ())

    def table(self, rid: str) -> np.ndarray:
        """The request's block ids; read again from vLLM when kvguard's copy disagrees."""
        mine = self.tables.get(rid, EMPTY)
        blocks = self.vllm_table(rid)
        if len(mine) != len(blocks):
            mine = np.fromiter((b.block_id for b in blocks), np.int64, len(blocks))
            self.tables[rid] = mine
        return mine

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
        blocks = self.vllm_table(rid)
        new = np.fromiter((b.block_id for b in blocks[before:]), np.int64, len(blocks) - before)
        old = self.tables.get(rid, EMPTY)
        self.tables[rid] = np.concatenate((old[:before], new)) if len(old) >= before else self.table(rid)
        if rid not in self.admitted:
            self.admitted.add(rid)
            self.take(self.guard.admit(rid, self.tenant_of(request), request.num_prompt_tokens, self.stage))
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
            pages = self.tables[rid][local // self.bs : -(-(local + external) // self.bs)].copy()
            if in_step:
                self.loading[rid] = Load(pages, local, external)
            else:
                self.xfer_in[rid] = Load(pages, local, external)
            if self.paired:
                prefill = peer(request) or "remote-prefill"
                tenant = self.tenant_of(request)
                self.take(self.guard.bootstrap(rid, prefill, self.guard.node, external, tenant), rid)

    def share(self, rid: str, hits: np.ndarray) -> None:
        if self.pending_mask[hits].any():  # a hit on a block granted this very step
            self.flush(list(self.pending))
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

    def freed(self, rid: str, block_ids: np.ndarray) -> None:
        """The request gives its blocks back (vLLM frees a table in reverse order)."""
        self.flush([rid])
        self.tables.pop(rid, None)
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

    def step(self, requests: Sequence[Any], scheduled: Sequence[int]) -> dict[str, str]:
        """One scheduler step, after vLLM advanced each request's num_computed_tokens by its
        scheduled tokens: the KV it writes, the grants made for it and the check of every
        request's block table up to its context, in one guard call. A request whose KV is
        loaded in this step's forward waits for `forwarded`. The requests to end."""
        now, later = [], []
        for request, tokens in zip(requests, scheduled, strict=True):
            rid = request.request_id
            if rid not in self.kills:
                (later if rid in self.loading else now).append((request, tokens))
        self.after_forward += later
        return self._step(now)

    def forwarded(self, witnessed: bool, unchanged: np.ndarray) -> dict[str, str]:
        """After the step's forward: the loads it made, as the workers' load witness saw them
        land (witness.py), then the step of the requests that read them, checked. The
        requests to end."""
        todo, self.after_forward = self.after_forward, []
        for request, _ in todo:
            self.loaded(request, witnessed, unchanged)
        return self._step([(r, tokens) for r, tokens in todo if r.request_id not in self.kills])

    def loaded(self, request: Any, witnessed: bool, unchanged: np.ndarray) -> None:
        """A load made in the forward, reported as what landed: its blocks up to the first the
        witness saw unchanged (all of them, at the connector's word, when it was not
        witnessed), against the tokens the connector said it would load."""
        rid = request.request_id
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
                peer(request),
                self.pool,
                blocks[: -(-landed // self.bs)],
                landed,
                0,
                claimed_tokens=load.external,
            ),
            rid,
        )

    def _step(self, batch: Sequence[tuple[Any, int]]) -> dict[str, str]:
        names = [request.request_id for request, _ in batch]
        n = len(names)
        sched = np.fromiter((tokens for _, tokens in batch), np.int64, n)
        ends = np.fromiter((request.num_computed_tokens for request, _ in batch), np.int64, n)
        tables = [self.table(rid) for rid in names]
        lens = np.fromiter((len(t) for t in tables), np.int64, n)
        flat = np.concatenate(tables) if n else EMPTY
        starts_at = np.concatenate(([0], np.cumsum(lens)[:-1])) if n else EMPTY
        first, last = (ends - sched) // self.bs, (ends - 1) // self.bs
        counts = np.where(sched > 0, last - first + 1, 0)
        if (first + counts > lens).any():
            raise ValueError("a request's scheduled tokens reach past the blocks vLLM granted it")
        row = np.repeat(np.arange(n), counts)
        part_at = np.concatenate(([0], np.cumsum(counts)[:-1])) if n else EMPTY
        pos = first[row] + np.arange(int(counts.sum())) - part_at[row]
        pages = flat[starts_at[row] + pos]
        slots = np.minimum(self.bs, ends[row] - pos * self.bs)
        # A request's new grants ride in the step when they are the tail of what it writes.
        grants = np.zeros(n, np.int64)
        index = {rid: i for i, rid in enumerate(names)}
        for rid, (at, ids) in list(self.pending.items()):
            i = index.get(rid)
            if i is not None and counts[i] and at >= first[i] and at + len(ids) - 1 == last[i]:
                grants[i] = len(ids)
                del self.pending[rid]
                self.pending_mask[ids] = False
        self.flush(list(self.pending))
        if not n:
            return self.take_kills()
        width = int(lens.max()) if n else 0
        tables2d = np.full((n, width), self.null, np.int64)
        rows = np.repeat(np.arange(n), lens)
        tables2d[rows, np.arange(len(flat)) - starts_at[rows]] = flat
        self.take(
            self.guard.step(
                self.pool,
                names,
                pages,
                slots,
                counts=counts,
                grants=grants,
                block_tables=tables2d,
                context_lens=ends,
            )
        )
        fresh = (pos - first[row]) >= (counts - grants)[row]  # each part's last grants[i] pages
        if fresh.any():
            self.grantee[pages[fresh]] = np.array(names, dtype=object)[row[fresh]]
        return self.take_kills()


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
