"""What the ledger's property tests draw: a serving scenario (`Spec`) of pools on a prefill
node p0, a decode node d0 and sometimes a colocated node c0, and requests with a tenant, prompt
and output lengths, a fate (finish, reject, or an abort at some stage), holds, prefix sharing
and wire probes, interleaved by a seeded scheduler (`lifecycle_engine.Engine` runs it)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

TENANTS = ("acme", "globex", "initech")
BYTES_PER_TOKEN = 1024
ROLES = {"p0": "prefill", "d0": "decode", "c0": "colocated"}
# How a request ends; "finish" is drawn more often than each abort.
PD_FATES = ("finish",) * 4 + (
    "reject",  # prefill refuses it; decode drains its reservation
    "abort_queued",  # aborted on decode before prefill started
    "abort_prefill",  # aborted after the prefill forward, before the transfer
    "abort_sending",  # aborted while the send is in flight (a transfer_send hold keeps the pages)
    "abort_inflight",  # aborted on decode while the KV is in flight (a transfer_recv hold)
    "abort_inflight",  # (twice: late_write needs one whose pages are then re-granted)
    "abort_decode",  # aborted half-way through decoding
)
COLOCATED_FATES = ("finish",) * 3 + ("reject", "abort_prefill", "abort_decode")

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # deterministic in CI
    database=None,
    # Some bugs need a rarer situation (late_write: an aborted in-flight transfer whose pages
    # are re-granted): up to ~70% of lifecycles offer no site for them and are skipped.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


# ---------------------------------------------------------------------------------------- what is drawn


@dataclass(frozen=True)
class ReqSpec:
    tenant: str
    colocated: bool  # served entirely on c0, else prefill on p0 and decode on d0
    prompt: int
    output: int
    fate: str
    recv_hold: bool  # decode holds its reservation for the incoming transfer
    send_hold: bool  # prefill holds the pages it sends until the send completes
    offload_at: int | None  # decode step after which the KV is also offloaded to host
    release_late: bool  # the offload hold outlives the grant (its pages return at release)
    share: bool  # look for a prefix of the same tenant in the prefix cache
    retain: int  # scheduling points a prefill prefix stays cached once sent
    wire_chunks: int  # wire probe events for the transfer (0: no probe)
    wire_complete: bool  # the probe's last report says it saw the transfer end
    delay: int  # scheduling points between the previous request's arrival and this one's


@dataclass(frozen=True)
class Spec:
    page_size: int
    pool_pages: dict[str, int]  # node -> pages in its pool
    context_len: int
    requests: tuple[ReqSpec, ...]
    rereport: bool  # the agents re-read the pools (unchanged) and send heartbeats
    seed: int  # drives the scheduler and the allocator's initial free-list order


@st.composite
def lifecycles(draw: st.DrawFn) -> Spec:
    page_size = draw(st.sampled_from((4, 16)))
    nodes = ("p0", "d0", "c0") if draw(st.booleans()) else ("p0", "d0")
    pool_pages = {node: draw(st.integers(8, 24)) for node in nodes}
    # Pools are reported with a context no larger than the pool, so every request fits.
    context_len = page_size * draw(st.integers(6, min(pool_pages.values()))) - draw(
        st.integers(0, page_size - 1)
    )
    requests = []
    max_prompt = min(4 * page_size, context_len - 1)
    for _ in range(draw(st.integers(3, 8))):
        # A follow-up turn of the previous conversation: same tenant and serving path, and a
        # prompt that extends the previous one, so its prefix is worth sharing if still cached.
        previous = requests[-1] if requests and draw(st.booleans()) else None
        if previous is not None:
            tenant, colocated = previous.tenant, previous.colocated
            prompt = draw(st.integers(min(previous.prompt + 1, max_prompt), max_prompt))
        else:
            tenant, colocated = draw(st.sampled_from(TENANTS)), "c0" in nodes and draw(st.booleans())
            prompt = draw(st.integers(1, max_prompt))
        fate = draw(st.sampled_from(COLOCATED_FATES if colocated else PD_FATES))
        requests.append(
            ReqSpec(
                tenant=tenant,
                colocated=colocated,
                prompt=prompt,
                output=draw(st.integers(0, min(10, context_len - prompt))),
                fate=fate,
                recv_hold=fate == "abort_inflight" or draw(st.booleans()),
                send_hold=fate == "abort_sending" or draw(st.booleans()),
                offload_at=draw(st.none() | st.integers(0, 9)),
                release_late=draw(st.booleans()),
                share=previous is not None or draw(st.booleans()),
                retain=draw(st.integers(0, 12)),
                wire_chunks=draw(st.integers(0, 3)),
                wire_complete=draw(st.booleans()),
                delay=draw(st.integers(0, 2 if previous else 8)),  # a follow-up comes soon
            )
        )
    return Spec(
        page_size=page_size,
        pool_pages=pool_pages,
        context_len=context_len,
        requests=tuple(requests),
        rereport=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )
