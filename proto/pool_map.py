"""The page states of a pool map (FleetService.Pool): one byte a page, its code the index of
its name in PAGE_STATES. The daemon writes them (daemon/pool_map.py), the dashboard reads them.

Invariant: codes are only ever appended, never renumbered (a dashboard may be older than its
daemon: an unknown code reads as "unknown").
"""

from __future__ import annotations

PAGE_STATES: tuple[str, ...] = (
    "free",  # in the pool, no user
    "owned",  # a live request's grant
    "shared",  # a live request's, read by prefix sharers too
    "offload",  # no live grant; held by an offload
    "transfer",  # no live grant; held by a KV transfer (either side)
    "prefix_cache",  # no live grant; kept by a prefix cache
    "abort",  # no live grant; held by an abort still draining
    "quarantined",  # taken out of circulation by a command to the current engine
    "reserved",  # an id the engine never hands out
)
PAGE_STATE = {name: code for code, name in enumerate(PAGE_STATES)}


def state_name(code: int) -> str:
    return PAGE_STATES[code] if code < len(PAGE_STATES) else "unknown"
