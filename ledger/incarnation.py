"""A node's incarnations (`Incarnations`): the engine process behind a node restarts, and its
events then carry a new `epoch`, with sequence numbers from 1 again.

Invariants:
- an event's identity is (node, epoch, seq): a node's sequence check runs within its current
  epoch; an event of an older epoch than the node's is refused (BadEvent "stale_epoch"), one
  of a newer epoch begins that incarnation before it is applied;
- beginning an incarnation ends, without findings, everything the previous one held (its
  process and its GPU memory are gone): its pools and their page state are dropped (the new
  incarnation reports its own, judged afresh; the old reports are kept as `previous`, so that
  a pool that changed across the restart is still reported as drift), every request's grants,
  holds and shares there end, a request that had nothing on any other node is forgotten (a
  new request of the same name starts a new life), and the transfer verdicts that waited on
  the node are settled.
"""

from __future__ import annotations

from typing import Any

from kvguard.ledger.findings import BadEvent, Findings
from kvguard.ledger.pools import Node, Pools
from kvguard.ledger.requests import Requests
from kvguard.ledger.transfers import Transfers


class Incarnations:
    def __init__(
        self, pools: Pools, requests: Requests, transfers: Transfers, findings: Findings, stats: Any
    ) -> None:
        self.pools = pools
        self.requests = requests
        self.transfers = transfers
        self.stats = stats
        self._found = findings

    def check(self, node: Node, kind: str, epoch: int) -> bool:
        """Whether an event of `epoch` begins a new incarnation of `node`; BadEvent if it is of
        an older one."""
        if epoch == node.epoch:
            return False
        if epoch < node.epoch:
            raise BadEvent(
                f"{kind} event of node {node.name} is of epoch {epoch}, older than its current epoch "
                f"{node.epoch} (the engine restarted since)",
                "stale_epoch",
            )
        return True

    def begin(self, node: Node, epoch: int) -> None:
        """Node's incarnation `epoch` begins: the previous one's state ends (see the module)."""
        if node.last_seq or node.pools:
            self.stats.restarts += 1
            node.restarts += 1
        self.transfers.node_restarted(node.name)
        gone: set[int] = set()
        for pool in node.pools.values():
            node.previous[pool.pool] = pool.report
            key = (node.name, pool.pool)
            holders = set(pool.grants) | set(pool.live)
            holders.update(pool.pages.holder_req[pool.pages.holds > 0].tolist())
            holders.discard(0)
            for idx in holders:
                r = self.requests[idx]
                if r is None:
                    continue
                r.pools = [p for p in r.pools if p != key]
                gone.add(idx)
        for r in self.requests.recent.values():  # every share of the node's pages (a retired one has none)
            for key in [k for k in r.shared if k[0] == node.name]:
                del r.shared[key]
        node.pools.clear()
        node.views.clear()
        node.epoch, node.last_seq = epoch, 0
        node.handles.new_epoch(epoch)
        node.gaps.clear()
        forget = []
        for idx in sorted(gone):
            r = self.requests[idx]
            if r is not None and not r.pools and not self.transfers.holds(r):
                forget.append(r)
        if forget:
            self.requests.retire([r for r in forget if not r.retired])
            for r in forget:
                self.requests.forget(r)
                self.transfers.forget(r)
            gone_now = {r.idx for r in forget}
            self._found.forget(gone_now)
            for other in self.pools.nodes.values():
                other.handles.forget(gone_now)
