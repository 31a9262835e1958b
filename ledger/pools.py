"""Nodes and their KV pools as the engines report them (`Pools`), and config drift: a pool
smaller than the context it advertises, a pool that changed, a prefill and a decode pool that
disagree on how KV is laid out.

Invariants (Pools is the only writer of nodes, pools and their reports):
- a pool's pages (PoolPages) are made when it is first reported, and made anew only when a
  report changes its size or its page size (a new engine, a new pool);
- a pool holds page_size x (num_pages - reserved_pages) tokens: ids 0..reserved_pages-1 are
  never handed out (SGLang's padding page 0, vLLM's null block); its pages mark them reserved
  as of its latest report;
- every report is kept in the pool's history with the event that made it;
- a pool registered for RDMA (`regions`) times its page changes from the report on;
- a prefill and a decode pool of the same model (named) in the same cluster that disagree on
  page_size or kv_dtype are drift as soon as both are reported; pools of different clusters
  are never compared (they never exchange KV); a bootstrap compares the pools of the two
  nodes it pairs (same pool id) whatever their clusters: they are about to exchange KV;
- a pair of pools' drift on one field is reported once (`drift_pairs`);
- a node's pools stay within `limits` (limits.py): a report beyond them is refused whole.
A Pool also holds what its requests were granted there (`live`, `grants`): the ownership
handlers and the C clean path write those, through the `view` handed to C.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvguard.ledger.findings import BadEvent, Findings
from kvguard.ledger.handles import Handles
from kvguard.ledger.limits import Limits
from kvguard.ledger.pages import MAX_PAGE_SIZE, MAX_PAGES, PoolPages
from kvguard.ledger.sequence import Gaps
from kvguard.proto import pb

ROLES = ("prefill", "decode", "colocated")
MAX_REGIONS = 1 << 16  # KvRegions of one pool
_U64 = 1 << 64
# The field number of `pages` in each payload that lists pages (read from it serialized).
_PAGES_FIELD = {
    d: d.fields_by_name["pages"].number
    for d in pb.DESCRIPTOR.message_types_by_name.values()
    if "pages" in d.fields_by_name
}
# Compared for config drift: not where the pages lie (a restarted engine registers new memory).
_COMPARED = tuple(
    f.name for f in pb.PoolReport.DESCRIPTOR.fields if f.name not in ("pool", "source", "regions")
)
# Fields whose 0 or "" means "not stated": one report leaving such a field blank and the other
# stating it is a blank filled in (a probe that read more), not a change. (Elsewhere "" says
# something: no quantization, the default cluster.)
_FILLABLE = (
    "context_len",
    "max_prompt_tokens",
    "engine_version",
    "model",
    "kv_dtype",
    "tp_size",
    "mem_fraction",
)
GRANT_RUNS = 16  # a request's grants in one pool kept as separate arrays before they are merged
# kv_dtype as engines spell it: fp8 is e4m3 in both engines. ("auto", the model's own dtype,
# is compared as said: against an explicit dtype it is worth a look.)
_DTYPE_UNKNOWN = ("",)
_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


@dataclass(slots=True)
class Pool:
    """One (node, pool): the reported configuration, its history, the page state, and what its
    requests hold there: `live` (request index -> pages granted to it now) and `grants`
    (request index -> every page ever granted to it, as arrays). The methods below are the
    only Python that changes live and grants; the C clean path (runs.c) is their twin, on the
    dicts `view` hands it."""

    node: str
    pool: int
    report: pb.PoolReport
    pages: PoolPages
    history: list[tuple[int, int, pb.PoolReport]] = field(default_factory=list)  # (seq, ts_ns, report)
    live: dict[int, int] = field(default_factory=dict)
    grants: dict[int, list[np.ndarray]] = field(default_factory=dict)
    # Registered for RDMA: [n, 3] uint64 rows (base, stride, page bytes) of report.regions.
    # Only then is pages.since kept: no other pool's pages can be judged by remote address.
    regions: np.ndarray | None = None
    view: tuple[Any, ...] = ()  # what the C clean path works on (made by `reset`)

    def reset(self, pages: PoolPages, regions: np.ndarray | None) -> None:
        self.pages, self.regions = pages, regions
        self.view = (pages.state, pages.page_size, regions is not None, self.live, self.grants)

    @property
    def tokens(self) -> int:
        """The KV tokens the pool holds: reserved pages hold none of a request's."""
        return pool_tokens(self.report)

    def page_array(self, message: Any, payload: str, *, distinct: bool = True) -> np.ndarray:
        """The page list of an event's payload (`message`) as an index array, checked against
        the pool's size and, with `distinct` (every event that changes pages), for a page
        listed twice: which would count one page as two."""
        try:
            return self.pages.page_list(
                message.SerializeToString(), _PAGES_FIELD[message.DESCRIPTOR], distinct=distinct
            )
        except IndexError:
            pages = np.array(message.pages, dtype=np.intp)
            bad = pages[pages >= self.pages.num_pages]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise BadEvent(
                f"{payload}: page {int(bad[0])} out of range for pool {self.pool} of node {self.node} "
                f"({self.pages.num_pages} pages){more}"
            ) from None
        except ValueError as exc:
            raise BadEvent(
                f"{payload}: page {exc.args[0]} is listed twice (pool {self.pool} of node {self.node})"
            ) from None

    def granted(self, req: int, pages: np.ndarray) -> bool:
        """`pages` are granted to req now: one more run of its grants (its runs merged into one
        int32 array past GRANT_RUNS), its live count up. Whether they are its first here."""
        grants = self.grants.get(req)
        if grants is None:
            self.grants[req] = [pages]
        else:
            grants.append(pages)
            if len(grants) > GRANT_RUNS:
                # Decode grants a page at a time: hundreds of one-page arrays per request, kept
                # for as long as the ledger keeps the request; one int32 array is far smaller.
                self.grants[req] = [np.concatenate(grants).astype(np.int32)]
        self.live[req] = self.live.get(req, 0) + len(pages)
        return grants is None

    def ended(self, req: int, n: int) -> None:
        """n of req's live grants here ended (freed, or handed to another)."""
        self.live[req] -= n

    def retire(self, req: int) -> None:
        """req is retired: it holds nothing here any more."""
        self.live.pop(req, None)

    def forget(self, req: int) -> None:
        """req is forgotten: its index may be reused, with none of its grants."""
        self.grants.pop(req, None)

    def restore(self, live: dict[int, int], grants: dict[int, list[np.ndarray]]) -> None:
        """live and grants as a snapshot kept them."""
        self.live.update(live)
        self.grants.update(grants)

    def ever_granted(self, req: int, pages: np.ndarray) -> np.ndarray:
        """Which of `pages` request `req` was ever granted here (slow path only)."""
        grants = self.grants.get(req)
        if not grants:
            return np.zeros(len(pages), bool)
        return np.isin(pages, np.concatenate(grants))


@dataclass(slots=True)
class Node:
    name: str
    last_seq: int = 0  # the highest applied in the current epoch
    gaps: Gaps = field(default_factory=Gaps)  # the numbers below last_seq never applied
    last_ts_ns: int = 0
    epoch: int = 0  # the engine process's incarnation (Event.epoch)
    restarts: int = 0  # incarnations begun after a first one
    pools: dict[int, Pool] = field(default_factory=dict)
    previous: dict[int, pb.PoolReport] = field(default_factory=dict)  # pools of earlier incarnations
    agent_version: str = ""
    dropped: int = 0
    views: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # each pool's view, for the C clean path
    handles: Handles = field(default_factory=Handles)  # its requests' handles in this epoch

    @property
    def durable_seq(self) -> int:
        """Every event of the current epoch up to this number is applied (none missing)."""
        return self.gaps.durable(self.last_seq)

    def capacity(self) -> tuple[int, int]:
        """(largest pool in tokens, smallest advertised context length); 0 if unknown."""
        if not self.pools:
            return 0, 0
        tokens = max(p.tokens for p in self.pools.values())
        contexts = [p.report.context_len for p in self.pools.values() if p.report.context_len]
        return tokens, min(contexts) if contexts else 0


class Pools:
    """The nodes by name, their pools, and the drift between them."""

    def __init__(self, findings: Findings, limits: Limits) -> None:
        self.nodes: dict[str, Node] = {}
        self.limits = limits  # what a node's pools may hold, and a read event list (limits.py)
        self.drift_pairs: set[tuple[str, str, str]] = set()
        self._found = findings

    def node(self, name: str) -> Node:
        node = self.nodes.get(name)
        if node is None:
            node = self.nodes[name] = Node(name)
        return node

    def pool(self, node: Node, pool: int, payload: str) -> Pool:
        found = node.pools.get(pool)
        if found is None:
            raise BadEvent(f"{payload}: pool {pool} of node {node.name} was never reported (no pool event)")
        return found

    def on_pool(self, node: Node, rep: pb.PoolReport) -> None:
        if rep.role not in ROLES:
            raise BadEvent(f"pool: role {rep.role!r} is not one of {', '.join(ROLES)}")
        if not 1 <= rep.page_size <= MAX_PAGE_SIZE:
            raise BadEvent(f"pool: page_size {rep.page_size} is not in 1..{MAX_PAGE_SIZE}")
        if not 1 <= rep.num_pages <= MAX_PAGES:
            raise BadEvent(f"pool: num_pages {rep.num_pages} is not in 1..{MAX_PAGES}")
        if rep.reserved_pages >= rep.num_pages:
            raise BadEvent(
                f"pool: reserved_pages {rep.reserved_pages} leaves none of its {rep.num_pages} pages to grant"
            )
        self.limits.check_pool(
            node.name, rep.pool, rep.num_pages, {p: q.pages.num_pages for p, q in node.pools.items()}
        )
        regions = _regions(rep)
        report = pb.PoolReport()
        report.CopyFrom(rep)
        found, ts = self._found, self._found.ts
        pool = node.pools.get(rep.pool)
        before = pool.report if pool is not None else node.previous.get(rep.pool)
        if pool is None:
            pages, timed = PoolPages(rep.num_pages, rep.page_size), False
            pool = node.pools[rep.pool] = Pool(node.name, rep.pool, report, pages)
        else:
            pages, timed = pool.pages, pool.regions is not None
        if before is not None:
            changed = {
                name: (getattr(before, name), getattr(rep, name))
                for name in _COMPARED
                if getattr(before, name) != getattr(rep, name)
                and (name not in _FILLABLE or (getattr(before, name) and getattr(rep, name)))
            }
            if changed:
                text = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
                since = "it was last reported" if before is pool.report else "before the engine restarted"
                found.report(
                    "config_drift",
                    f"pool {rep.pool} on {node.name} changed since {since}: {text}",
                    pool=pool.pool,
                    details={
                        "changed": ",".join(changed),
                        **{k: f"{a}->{b}" for k, (a, b) in changed.items()},
                    },
                    key=("changed", rep.pool, text),
                )
                if rep.num_pages != pages.num_pages or rep.page_size != pages.page_size:
                    pages, timed = PoolPages(rep.num_pages, rep.page_size), False  # a new engine, a new pool
            pool.report = report
        if regions is not None and not timed:
            pages.timed_from(ts)  # from now on changes are timed; before now, nothing is known of them
        pages.reserve(rep.reserved_pages)
        pool.reset(pages, regions)
        node.views[pool.pool] = pool.view
        pool.history.append((found.seq, ts, report))
        tokens = pool.tokens
        usable = rep.num_pages - rep.reserved_pages
        reserved = f", {rep.reserved_pages} reserved" if rep.reserved_pages else ""
        for limit, what in (
            (rep.context_len, "context length"),
            (rep.max_prompt_tokens, "maximum prompt length"),
        ):
            if limit > tokens:
                found.report(
                    "config_drift",
                    f"KV pool {rep.pool} on {node.name} holds {tokens} tokens ({usable} pages of "
                    f"{rep.page_size}{reserved}), less than the advertised {what} of {limit}: a prompt that "
                    "does not fit must be rejected and must go no further",
                    pool=pool.pool,
                    details={"pool_tokens": tokens, "limit": limit, "what": what},
                    key=("undersized", rep.pool, what, tokens, limit),
                )
        self._check_cluster(node, pool)

    def check_pairing(self, r: Any, prefill_node: str, decode_node: str) -> None:
        """A bootstrap pairs two nodes: pools of the same id that disagree on page_size or
        kv_dtype would misread the KV sent between them (reported once per pair and field)."""
        prefill, decode = self.nodes.get(prefill_node), self.nodes.get(decode_node)
        if prefill is None or decode is None:
            return
        for p in prefill.pools.values():
            d = decode.pools.get(p.pool)
            if d is not None:
                self._compare(p, d, p.pool, f"(first seen with request {r.id})", {"first_req": r.id})

    def _check_cluster(self, node: Node, pool: Pool) -> None:
        """A prefill or decode pool of a named model was reported: every pool of the other role,
        the same model and the same cluster must lay KV out as it does."""
        rep = pool.report
        other = {"prefill": "decode", "decode": "prefill"}.get(rep.role)
        if other is None or not rep.model:
            return
        for peer in self.nodes.values():
            for q in peer.pools.values():
                if q.report.role == other and q.report.model == rep.model and q.report.cluster == rep.cluster:
                    prefill, decode = (pool, q) if rep.role == "prefill" else (q, pool)
                    where = f"(model {rep.model}, cluster {rep.cluster or '(default)'}), before any transfer"
                    details = {"model": rep.model, "cluster": rep.cluster}
                    self._compare(prefill, decode, pool.pool, where, details)

    def _compare(self, p: Pool, d: Pool, at: int, context: str, details: dict[str, Any]) -> None:
        """Prefill pool p and decode pool d must agree on page_size and kv_dtype: drift once per
        pair of pools and field, as a finding of pool `at` (of the node whose event found it)."""
        for name in ("page_size", "kv_dtype"):
            a, c = getattr(p.report, name), getattr(d.report, name)
            pair = (p.node, d.node, f"{p.pool}:{d.pool}:{name}")
            if name == "kv_dtype":
                if a in _DTYPE_UNKNOWN or c in _DTYPE_UNKNOWN:
                    continue  # one side did not say: nothing to compare
                if _DTYPE_ALIASES.get(a, a) == _DTYPE_ALIASES.get(c, c):
                    continue  # one dtype, two spellings
            if a == c or pair in self.drift_pairs:
                continue
            self.drift_pairs.add(pair)
            which = f"pool {p.pool}" if p.pool == d.pool else f"pools {p.pool} and {d.pool}"
            self._found.report(
                "config_drift",
                f"prefill {p.node} and decode {d.node} disagree on {name} of {which}: {a!r} vs {c!r}; KV "
                f"sent between them would be misread {context}",
                pool=at,
                details={
                    "field": name,
                    "prefill": a,
                    "decode": c,
                    "prefill_node": p.node,
                    "decode_node": d.node,
                    "prefill_pool": p.pool,
                    "decode_pool": d.pool,
                    **details,
                },
                key=pair,
            )


def pool_tokens(rep: pb.PoolReport) -> int:
    """Tokens a reported pool holds: page_size x (num_pages - reserved_pages)."""
    return rep.page_size * (rep.num_pages - rep.reserved_pages)


def _regions(rep: pb.PoolReport) -> np.ndarray | None:
    """A pool report's KvRegions as [n, 3] uint64 rows (base, stride, page bytes), checked."""
    if not rep.regions:
        return None
    if len(rep.regions) > MAX_REGIONS:
        raise BadEvent(f"pool: {len(rep.regions)} regions (at most {MAX_REGIONS})")
    rows = []
    for i, g in enumerate(rep.regions):
        size = g.page_bytes or g.stride
        if not g.stride or size > g.stride:
            raise BadEvent(f"pool: region {i} has stride {g.stride} and page_bytes {g.page_bytes}")
        if g.base + g.stride * rep.num_pages >= _U64:
            raise BadEvent(f"pool: region {i} ({rep.num_pages} pages of {g.stride} at {g.base:#x}) wraps")
        rows.append((g.base, g.stride, size))
    return np.array(rows, dtype=np.uint64)
