"""What the CUDA shim of an engine process saw (Launches, PoolMemory on the node's shim
stream), judged against what the node's guard reported: an attention launch no guard check
covered (unguarded_attention), a pool whose pages need more memory than the allocations under
it hold (config_drift), a pool's memory freed or unmapped while requests hold its pages
(anomaly), and a witness that sees no attention kernel in steps the guard checked (anomaly:
it is blind to this engine's kernels, so its silence proves nothing).

Invariant: it keeps no state of its own; each report is judged on its own against the
node's pools and pages as they are when it is applied, and a fact is reported once (the
findings' de-duplication). The findings name the engine's node, not its shim's stream.
"""

from __future__ import annotations

import numpy as np

from kvguard.ledger.findings import NOBODY, BadEvent, Findings
from kvguard.ledger.pools import Node, Pools
from kvguard.proto import pb
from kvguard.proto.channel import node_of

QUIET_STEPS = 8  # checked steps with no attention launch seen before the witness is called blind
KINDS = ("bound", "freed", "unmapped")
NAME_BYTES = 1024


class CudaWitness:
    def __init__(self, pools: Pools, findings: Findings) -> None:
        self.pools = pools
        self._found = findings

    def on_launches(self, node: Node, x: pb.Launches) -> None:
        if x.checked + x.unguarded > x.attention or len(x.kernel) > NAME_BYTES:
            raise BadEvent(
                f"launches: {x.checked} checked and {x.unguarded} unguarded of {x.attention} attention "
                f"launches, kernel name of {len(x.kernel)} characters"
            )
        engine = node_of(node.name)
        if x.unguarded:
            kernel = x.kernel or "(its name came in a later report)"
            how = "in a CUDA graph's replay" if x.kernel_in_graph else "launched"
            self._found.report(
                "unguarded_attention",
                f"attention kernel {kernel} ran ({how}) on {engine} with no guard check before it: after "
                f"the guard's step {x.kernel_steps} ended and before another was checked "
                f"({x.unguarded} of {x.attention} attention launch(es) in this report unguarded)",
                details={
                    "kernel": x.kernel,
                    "step": x.kernel_steps,
                    "unguarded": x.unguarded,
                    "attention": x.attention,
                    "graph": int(x.kernel_in_graph),
                },
                key=("launch", x.kernel, x.kernel_in_graph),  # a path that is never checked: once
                node=engine,
            )
        if x.judged and x.quiet_steps >= QUIET_STEPS and x.checks > 0:
            self._found.report(
                "anomaly",
                f"the CUDA witness on {engine} saw no attention kernel launched in the last {x.quiet_steps} "
                f"steps the guard ended ({x.launches} other launch(es) seen): it does not see this "
                "engine's attention (a kernel name no attention_kernels pattern matches, a library that "
                "reaches the driver around the shim), so it vouches for nothing",
                details={
                    "steps": x.quiet_steps,
                    "launches": x.launches,
                    "unnamed": x.unnamed,
                    "unwrapped": x.unwrapped,
                },
                key=("witness_blind",),
                node=engine,
            )

    def on_pool_memory(self, node: Node, m: pb.PoolMemory) -> None:
        if m.kind not in KINDS:
            raise BadEvent(f"pool_memory: kind {m.kind[:40]!r} is not one of {', '.join(KINDS)}")
        if m.kind == "bound" and m.covered > m.bytes:
            raise BadEvent(f"pool_memory: {m.covered} bytes covered of a {m.bytes}-byte region")
        if m.kind != "bound" and not m.base <= m.lo < m.hi <= m.base + m.bytes:
            raise BadEvent(f"pool_memory: [{m.lo:#x}, {m.hi:#x}) is not within the bound region")
        engine = node_of(node.name)
        region = f"[{m.base:#x}, {m.base + m.bytes:#x})"
        details = {"base": f"{m.base:#x}", "bytes": m.bytes, "call": m.call}
        if m.kind == "bound":
            if m.covered < m.bytes:
                seen = (
                    f"the allocations the CUDA shim saw hold only {m.covered} bytes of it"
                    if m.allocations
                    else "the CUDA shim saw no allocation at all (it does not see this engine's allocator)"
                )
                self._found.report(
                    "config_drift",
                    f"KV pool {m.pool} on {engine} needs {m.bytes} bytes at {region}, but {seen}: "
                    f"{m.bytes - m.covered} bytes of its pages lie outside memory allocated for it",
                    pool=m.pool,
                    details={**details, "covered": m.covered, "allocations": m.allocations},
                    key=("pool_memory", m.pool, m.base),
                    node=engine,
                )
            return
        held = self._held(engine, m.pool)
        if held is None:
            return
        requests, pages = held
        self._found.report(
            "anomaly",
            f"{m.call} {m.kind} [{m.lo:#x}, {m.hi:#x}) of KV pool {m.pool}'s memory {region} on {engine} "
            f"while {len(requests)} request(s) hold {len(pages)} of its pages: their KV is gone, and what "
            "CUDA allocates there next is read as theirs",
            pool=m.pool,
            pages=pages[:64],
            details={**details, "lo": f"{m.lo:#x}", "hi": f"{m.hi:#x}", "requests": len(requests)},
            key=("pool_memory", m.pool, m.lo),
            node=engine,
        )

    def _held(self, engine: str, pool_id: int) -> tuple[list[int], np.ndarray] | None:
        """(the requests holding pages, the pages in use) of a pool; None when none are."""
        node = self.pools.nodes.get(engine)
        pool = node.pools.get(pool_id) if node is not None else None
        if pool is None:
            return None
        pages = np.flatnonzero(pool.pages.use > 0)
        if not len(pages):
            return None
        owners = pool.pages.owner[pages]
        return sorted({int(o) for o in owners.tolist() if o > NOBODY}), pages
