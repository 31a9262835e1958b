"""An engine without an in-engine guard, watched from outside (`kvguard agent --probe`): its
pool and context read where the engine states them (`read_engine`: the engine's probes, as
its ENGINES entry names them; probes.py), reported as `pool` events.

Invariant: a pool is reported once its pool and its context are known (the pool alone after
CONTEXT_WAIT_S), and again whenever either changes, never for a change of where it was read;
each thing that cannot be read is said once, until it is read again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvguard.agents.engines import Engine
from kvguard.agents.engines import engine as engine_entry
from kvguard.agents.probes import CONTEXT_WAIT_S, PoolFacts, Reading
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


def read_engine(name: str, source: str) -> Reading:
    """An engine's pool facts from its log file or its HTTP server, and what could not be
    read there (SGLang: /server_info, else /get_server_info, then /v1/models and /metrics
    for what is still missing; vLLM: /v1/models for the context and /metrics for the pool)."""
    engine = engine_entry(name, "probe")
    if source.startswith(("http://", "https://")):
        base = source.rstrip("/")
        try:
            facts, problems = engine.read_http(base)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:  # a field of the wrong shape
            return Reading(None, (f"{base}: a document is not as the engine writes it ({exc!r})",))
        if facts is not None and not facts.pool_tokens:
            facts = None
    else:
        try:
            with open(source, encoding="utf-8", errors="replace") as log:
                lines = log.readlines()
        except OSError as exc:
            return Reading(None, (f"log {source}: cannot read ({exc.strerror or exc})",))
        facts = engine.read_log(lines)
        problems = _log_problems(engine, source, facts)
    if facts is not None and not facts.missing():
        return Reading(facts, ())
    if not problems:  # every source answered, and none stated it
        problems = [f"{source}: {', '.join(facts.missing() if facts else ['the pool'])} not stated"]
    return Reading(facts, tuple(dict.fromkeys(problems)))


def _log_problems(engine: Engine, source: str, facts: PoolFacts | None) -> list[str]:
    if facts is None:
        return [f"log {source}: no {engine.pool_line} line yet"]
    problems = []
    if not facts.context_len:
        problems.append(f"log {source}: the context length is not stated")
    if not facts.page_size:
        problems.append(f"log {source}: the page size is not stated ({engine.page_size_note}; reported as 1)")
    return problems
