"""A request's life (`Lifecycle`): admission, the prefill/decode pairing, its end (rejected,
aborted, killed or finished), and the node's heartbeat.

Invariants: a request that was rejected, aborted or killed may only drain from then on; any
admission or pairing after its end is rejected_progress (the other kinds of progress are
judged where they happen: ownership, transfers). A request's first end is the one kept. An
admission of a prompt its node cannot hold (pool or context) is config_drift: it must be
rejected.
"""

from __future__ import annotations

from kvguard.ledger.findings import BadEvent, Findings
from kvguard.ledger.pools import Node, Pools
from kvguard.ledger.requests import Requests
from kvguard.ledger.transfers import Transfers
from kvguard.proto import pb
from kvguard.proto.limits import TENANT_BYTES, unstorable

STAGES = ("prefill", "decode")


class Lifecycle:
    def __init__(self, pools: Pools, requests: Requests, transfers: Transfers, findings: Findings) -> None:
        self.pools = pools
        self.requests = requests
        self.transfers = transfers
        self._found = findings

    def on_admit(self, node: Node, a: pb.Admit) -> None:
        if a.stage not in STAGES:
            raise BadEvent(f"admit: stage {a.stage!r} is not one of {', '.join(STAGES)}")
        _tenant_fits("admit", a.tenant)
        if a.handle:
            node.handles.check_bind(a.handle, a.req, node.name)
        r = self.requests.of_event(a.req, "admit")
        if a.handle:
            node.handles.bind(a.handle, r.idx, r.id)
        if r.ended:
            self._found.progress(r, f"admit to {a.stage} on {node.name}")
        self.requests.admitted(r, a.tenant, a.prompt_tokens)
        if not a.tenant:
            self._found.stats.untenanted += (
                1  # counted and shown (fleet, metrics): never judged across tenants
            )
        tokens, context = node.capacity()
        limits = [
            (limit, what)
            for limit, what in ((tokens, "KV pool holds only"), (context, "context length is"))
            if limit
        ]
        if limits:
            limit, what = min(limits)
            if a.prompt_tokens > limit:
                self._found.report(
                    "config_drift",
                    f"request {r.id} with a prompt of {a.prompt_tokens} tokens was admitted to {a.stage} on "
                    f"{node.name}, whose {what} {limit} tokens: it cannot fit and must be rejected",
                    req=r,
                    details={"prompt_tokens": a.prompt_tokens, "limit": limit},
                    key=("admit",),
                )

    def on_reject(self, node: Node, x: pb.Reject) -> None:
        self.requests.end(self.requests.of_event(x.req, "reject"), "rejected", x.reason)

    def on_abort(self, node: Node, x: pb.Abort) -> None:
        r = self.requests.of_event(x.req, "abort")
        self.requests.draining.pop(r.idx, None)  # the engine ended it: nothing more drains
        self.requests.end(r, "aborted", x.reason)

    def on_kill(self, node: Node, x: pb.Kill) -> None:
        r = self.requests.of_event(x.req, "kill")
        if x.late:  # it had finished: the kill stopped nothing, and ends nothing
            return
        if "@" not in x.by:  # not the engine's own guard (guard@node): the daemon, an operator
            self.requests.killed_from_outside(r)
        self.requests.end(r, "killed", f"{x.finding} by {x.by}".strip())

    def on_finish(self, node: Node, x: pb.Finish) -> None:
        r = self.requests.of_event(x.req, "finish")
        self.transfers.settle(r, "finished")
        self.requests.finished(r, x.output_tokens, responds(node))
        node.handles.release(r.idx)

    def on_heartbeat(self, node: Node, x: pb.Heartbeat) -> None:
        node.agent_version, node.dropped = x.agent_version, x.dropped

    def on_bootstrap(self, node: Node, b: pb.Bootstrap) -> None:
        if not b.prefill_node or not b.decode_node:
            raise BadEvent("bootstrap: prefill_node and decode_node are required")
        _tenant_fits("bootstrap", b.tenant)
        r = self.requests.of_event(b.req, "bootstrap")
        if r.ended:
            self._found.progress(r, f"bootstrap {b.prefill_node}->{b.decode_node}")
        self.requests.bootstrapped(r, b.prefill_node, b.decode_node, b.prompt_tokens, b.tenant)
        self.pools.check_pairing(r, b.prefill_node, b.decode_node)


def _tenant_fits(payload: str, tenant: str) -> None:
    why = unstorable(tenant, TENANT_BYTES)
    if why:
        raise BadEvent(f"{payload}: tenant {tenant[:40]!r} {why}", "out_of_range")


def responds(node: Node) -> bool:
    """Whether `node` answers its requests' clients: not a prefill node (whose finish hands a
    request on to its decode node); a node that reported no pool is taken to."""
    return not any(pool.report.role == "prefill" for pool in node.pools.values())
