"""An engine without an in-engine guard, watched from outside (`kvguard agent --probe`): its
pool and context read where the engine states them (probes.py), reported as `pool` events.

Invariant: a pool is reported once its pool and its context are known (the pool alone after
CONTEXT_WAIT_S), and again whenever either changes, never for a change of where it was read;
each thing that cannot be read is said once, until it is read again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvguard.agents.probes import CONTEXT_WAIT_S, read_engine
from kvguard.agents.spool import Source
from kvguard.proto import pb
from kvguard.proto.logs import logger

log = logger("agent")


def watch_engine(
    node: str,
    engine: str,
    role: str,
    source: str,
    interval: float,
    events: Source,
    stopping: threading.Event,
    unreadable: Callable[[], None],
) -> None:
    """Read the engine every `interval` until `stopping`; `unreadable` counts each problem."""
    last: pb.PoolReport | None = None
    unread: tuple[str, ...] = ()
    started = time.monotonic()
    while not stopping.is_set():
        waited = time.monotonic() - started
        reading = read_engine(engine, source)
        for problem in reading.problems:
            if problem not in unread:
                log.warning(f"probe {node}: {problem} (after {waited:.0f} s)")
                unreadable()
        if unread and not reading.problems:
            log.info(f"probe {node}: {source} read in full again")
        unread = reading.problems
        facts = reading.facts
        if facts is not None and facts.pool_tokens and (facts.context_len or waited >= CONTEXT_WAIT_S):
            report = facts.report(0, role)
            unsourced = pb.PoolReport()
            unsourced.CopyFrom(report)
            unsourced.ClearField("source")  # where it was read is not a change of the pool
            if last is None or unsourced != last:
                events.emit(pool=report)
                last = unsourced
                log.info(
                    f"probe {node}: pool of {facts.pool_tokens} tokens "
                    f"({report.num_pages} pages of {report.page_size}, "
                    f"{report.reserved_pages} reserved), "
                    f"context {facts.context_len or 'unknown'}, from {report.source}"
                )
        stopping.wait(interval)
