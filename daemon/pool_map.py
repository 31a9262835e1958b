"""One pool of one node, page by page, as the daemon's ledger holds it (`read_pool`): each page's
state (proto/pool_map.py's PAGE_STATES) and the tenant of the request that holds or last held
it, for FleetService.Pool.

Invariants: only reads the ledger (the caller holds the ingest's lock, as the fleet state
does, while `read_pool` runs; the message is built from its copies after); whole arrays at a
time (NumPy), the request table touched once per distinct request of the pool; a page is, in
order of precedence: quarantined (by a command to the node's current engine), owned or shared
(a live grant; shared when it has more users than its owner and its holders), held (no live
grant; transfer over abort over offload over prefix_cache), shared (no live grant, read by
prefix sharers), reserved (an id never handed out), else free.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvguard.ledger import Ledger
from kvguard.ledger.pages import HOLDER_INDEX
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.pool_map import PAGE_STATE

# Held pages by kind, the weakest first: a page held in several kinds shows the last.
_HELD = (
    ("prefix_cache", ("prefix_cache",)),
    ("offload", ("offload",)),
    ("abort", ("abort",)),
    ("transfer", ("transfer_send", "transfer_recv")),
)


class PoolNotFound(LookupError):
    """No such node, or no such pool of it: which, and what there is."""


class PoolPicture(NamedTuple):
    """A pool's pages as read (copies: the ledger may move on), to send as a PoolMap."""

    node: str
    pool: int
    page_size: int
    epoch: int
    states: np.ndarray  # uint8, a PAGE_STATES code a page
    tenant: np.ndarray  # uint32, an index into `tenants` a page
    tenants: list[str]
    req: np.ndarray  # uint32, an index into `reqs` a page
    reqs: list[str]

    def message(self) -> svc.PoolMap:
        return svc.PoolMap(
            node=self.node,
            pool=self.pool,
            page_size=self.page_size,
            epoch=self.epoch,
            states=self.states.tobytes(),
            tenant=self.tenant.tolist(),
            tenants=self.tenants,
            req=self.req.tolist(),
            reqs=self.reqs,
        )


def read_pool(ledger: Ledger, node: str, pool: int, quarantined: np.ndarray) -> PoolPicture:
    """The pages of `pool` on `node`; `quarantined`: the pages its current engine was ordered
    to quarantine. PoolNotFound naming what is missing."""
    known = ledger.nodes.get(node)
    if known is None:
        names = ", ".join(sorted(ledger.nodes)[:20]) or "none"
        raise PoolNotFound(f"node {node!r} is not known to the daemon's ledger (its nodes: {names})")
    found = known.pools.get(pool)
    if found is None:
        pools = ", ".join(str(p) for p in sorted(known.pools)) or "none reported"
        raise PoolNotFound(f"node {node!r} has no pool {pool} (its pools: {pools})")
    pages = found.pages
    owner, use = pages.owner, pages.use
    held_by = pages.holds  # (kinds, pages)
    held = held_by.sum(axis=0)
    live = owner >= 0
    states = np.full(pages.num_pages, PAGE_STATE["free"], np.uint8)
    states[(pages.reserved != 0) & (use == 0)] = PAGE_STATE["reserved"]
    idle = ~live & (use > 0)
    states[idle & (held == 0)] = PAGE_STATE["shared"]  # prefix sharers of a freed page
    for state, kinds in _HELD:
        mask = np.zeros(pages.num_pages, bool)
        for kind in kinds:
            mask |= held_by[HOLDER_INDEX[kind]] > 0
        states[idle & mask] = PAGE_STATE[state]
    states[live] = PAGE_STATE["owned"]
    states[live & (use - held > 1)] = PAGE_STATE["shared"]
    inside = quarantined[(quarantined >= 0) & (quarantined < pages.num_pages)]
    states[inside] = PAGE_STATE["quarantined"]
    tenant, tenants, req, reqs = _holders(ledger, np.where(live, owner, ~owner))
    return PoolPicture(node, pool, pages.page_size, known.epoch, states, tenant, tenants, req, reqs)


def _holders(ledger: Ledger, holders: np.ndarray) -> tuple[np.ndarray, list[str], np.ndarray, list[str]]:
    """Each page's tenant and request as indices into the tenants and the requests named (0:
    ""), from the request index that holds or last held it (0: nobody; a forgotten one: "")."""
    requests = ledger.requests
    size = len(requests.objects)
    seen = np.zeros(size, bool)
    holders = np.clip(holders, 0, size - 1)
    seen[holders] = True
    tenant_at = np.zeros(size, np.uint32)
    req_at = np.zeros(size, np.uint32)
    tenants, reqs = [""], [""]
    index = {"": 0}
    for idx in np.flatnonzero(seen).tolist():
        req, name = requests.name_of(idx)
        if req:
            req_at[idx] = len(reqs)
            reqs.append(req)
        at = index.get(name)
        if at is None:
            at = index[name] = len(tenants)
            tenants.append(name)
        tenant_at[idx] = at
    return tenant_at[holders], tenants, req_at[holders], reqs
