"""The incident on an SGLang decode node whose guard streams to a real node agent, run under
`kvguard run` (the operator path): the guard is the one kvguard's plugin makes from the
environment it sets (KVGUARD_AGENT_SOCKET, KVGUARD_NODE, KVGUARD_MODE), over SGLang 0.5.23's
own KV classes (sglang_scenarios.Engine). The local guard only watches; the scenario then
waits, bounded, for the daemon's kill to come back through the agent and land in SGLang's own
abort path (`Req.to_finish`), and lets SGLang finish the request from there.
Usage: sglang_live.py [WAIT_S]. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

from sglang_scenarios import Engine, one_page_of_eight_lands, publish_runtime, stale_pages

from kvguard.agents.sglang import plugin


def engine_from_env(role: str, pages: int) -> Engine:
    """Engine's KV classes, guarded by the attachment kvguard's plugin makes from the environment
    (with its `on_kill`, SGLang's abort of the named request), not by one the helper makes."""
    made = plugin.current()
    assert made is not None, plugin._refused
    return Engine(made.guard.node, role, "", made.guard.mode, pages=pages, attachment=made.attachment)


def abort_of(req: object) -> dict | None:
    reason = getattr(req, "to_finish", None) or getattr(req, "finished_reason", None)
    if reason is None:
        return None
    return {"type": type(reason).__name__, "message": str(getattr(reason, "message", ""))}


def incident_live(wait_s: float) -> dict:
    """Tenant A's a-1 writes 8 pages and finishes; C's c-1 runs alongside; B's b-1 reserves 8
    pages for its transfer (A's old ones), one lands, the fake receiver says Success."""
    e = engine_from_env("decode", pages=12)
    a = e.request("a-1", list(range(1000, 1032)), "tenant-a")
    e.prefill(a, 7.0)
    e.finish(a)
    c = e.request("c-1", list(range(3000, 3008)), "tenant-c")
    e.prefill(c, 3.0)
    b = e.request("b-1", list(range(2000, 2032)), "tenant-b")
    receiver = one_page_of_eight_lands(e, b)
    stale = stale_pages(e, b, 7.0)
    state = receiver.poll()
    killed_locally = sorted(e.guard.killed)
    # The daemon's kill arrives on the sink's reader thread, into SGLang's abort path.
    start = time.monotonic()
    while b.to_finish is None and time.monotonic() - start < wait_s:
        time.sleep(0.02)
    waited = time.monotonic() - start
    ordered = abort_of(b)
    c_before = abort_of(c)
    e.decode([c], 3.5)  # the engine goes on with the others
    b.update_finish_state()  # SGLang's own step: to_finish becomes finished_reason
    finished = abort_of(b)
    if b.finished():
        e.release(b)  # its row and pages back, as the scheduler does for a finished request
    return {
        "stale_pages": stale,
        "poll": int(state),
        "killed_locally": killed_locally,
        "waited_s": round(waited, 3),
        "b_to_finish": ordered,
        "b_finished": finished,
        "c_to_finish": c_before,
        "c_after_step": abort_of(c),
        "killed": {rid: (f.finding if f else "") for rid, f in e.guard.killed.items()},
        "findings": [f"{f.finding}:{f.req}" for f in e.guard.findings],
        "node": e.guard.node,
        "mode": e.guard.mode,
        "errors": e.guard.errors,
    }


if __name__ == "__main__":
    publish_runtime()
    result = incident_live(float(sys.argv[1]) if len(sys.argv) > 1 else 20.0)
    adapter = plugin._adapter
    if adapter is not None:
        result["adapter_failed"] = adapter.attachment.failed
        adapter.guard.sink.close()  # flushes the kill event and the abort to the agent
    print(json.dumps(result))
