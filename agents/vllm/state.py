"""One guarded vLLM `KVCacheManager` (`PoolState`): its block tables as kvguard sees them, the
grants not yet reported, and the per-step call that reports a scheduler step to the guard.

Invariant: every block a request holds in vLLM has been reported to the guard as granted
(`alloc`) or shared (`share`) before any event that depends on it (the step that writes it,
a share naming its grantee, its free, a transfer receipt); a block's `grantee` is the request
it was last granted to, which is the origin of any later prefix hit on it (the hit is judged
by the ledger: a freed block still holding its grantee's KV is a legitimate hit). The step's
pages, slots and block tables are built as numpy arrays over the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvguard.agents.attach import Attachment
from kvguard.agents.guard import Verdict

EMPTY = np.zeros(0, np.int64)


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
    ) -> None:
        self.attachment = attachment
        self.guard = attachment.guard
        self.pool = pool
        self.group = group  # vLLM's single-type manager: its req_to_blocks is the truth
        self.bs = block_size
        self.null = null_block
        self.stage = stage
        self.tenant_of = tenant_of
        self.tables: dict[str, np.ndarray] = {}  # request -> its block ids, in vLLM's order
        self.pending: dict[str, tuple[int, np.ndarray]] = {}  # request -> (table position, new ids)
        self.pending_mask = np.zeros(num_blocks, bool)
        self.grantee = np.full(num_blocks, "", dtype=object)
        self.admitted: set[str] = set()
        self.xfer_in: dict[str, tuple[np.ndarray, int]] = {}  # request -> (blocks loaded, tokens)
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

    def allocated(self, request: Any, before: int, n_hit: int, total_computed: int) -> None:
        """After allocate_slots granted blocks: admit on first sight, report the prefix hits
        (share, origin = each block's grantee), keep the new grants for the step."""
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
        ext = -(-total_computed // self.bs) - (before + n_hit)
        if ext > 0:  # blocks a KV connector loads into: their receipt names them
            self.xfer_in[rid] = (grants[:ext].copy(), total_computed)

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
        pages = block_ids[::-1]
        pages = pages[pages != self.null]
        if len(pages):
            self.take(self.guard.free(rid, self.pool, pages))

    # ------------------------------------------------------------------ the step

    def step(self, requests: Sequence[Any], scheduled: Sequence[int]) -> dict[str, str]:
        """One scheduler step, after vLLM advanced each request's num_computed_tokens by its
        scheduled tokens: the KV it writes, the grants made for it and the check of every
        request's block table up to its context, in one guard call. The requests to end."""
        keep = [i for i, r in enumerate(requests) if r.request_id not in self.kills]
        names = [requests[i].request_id for i in keep]
        n = len(names)
        sched = np.fromiter((scheduled[i] for i in keep), np.int64, n)
        ends = np.fromiter((requests[i].num_computed_tokens for i in keep), np.int64, n)
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
