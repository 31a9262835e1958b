"""The testbed's fault switches: each reproduces one bug family of docs/design.md §1.

All are off by default. Invariant: a fault changes only the one code path it names; with
every switch off the engine is correct, and kvguard must then report nothing.
"""

from __future__ import annotations

FAULTS: dict[str, str] = {
    "incident": "prefill pool smaller than the context; admission checks finished() instead of rejected; "
    "a one-page hand-off reported as done (the full 2026 chain)",
    "offload_free": "prefill returns pages to the free list while the offload to the host cache still "
    "reads them",
    "double_free": "the decode abort path frees a request's pages twice",
    "late_write": "the decode abort path drops the receive hold, so a transfer in flight lands in "
    "reused pages",
    "short_transfer": "prefill sends half of the pages and reports the transfer complete",
    "cross_tenant_share": "the prefix cache matches on the user prompt only, across tenants",
    "block_table": "decode copies a new request's block table from the neighbouring batch slot beyond its "
    "first page",
    "unguarded_attention": "a decode step runs its attention without the guard's check (a code path the "
    "adapter does not hook): only the CUDA launch witness (--cuda-witness) sees it",
    "half_written_page": "chunked prefill (prompts over three pages) ends its first chunk half way through "
    "the first page and starts the next chunk at the second: the rest of the first page keeps its previous "
    "owner's KV, which is sent and attended",
}


def check_faults(names: list[str] | tuple[str, ...] | set[str]) -> frozenset[str]:
    unknown = sorted(set(names) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown fault switch(es) {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    return frozenset(names)
