"""What real deployments do that the event contract must judge right (issue 38): KV that
outlives its request's grant under a hold (asynchronous senders, deferred release,
offloading)."""

from __future__ import annotations

from kvguard.ledger.findings import Finding
from kvguard.ledger.ledger import Ledger
from kvguard.proto.builder import EventLog


def judged(log: EventLog) -> list[Finding]:
    ledger = Ledger()
    return [f for e in log.lines if not isinstance(e, str) for f in ledger.apply(e)]


def sender(holder: str = "transfer_send") -> EventLog:
    """Request a on p0 wrote two pages, a hold keeps them for its sender, and it finished and
    freed its grant before the send (SGLang's deferred release, TensorRT-LLM's CacheSender)."""
    log = EventLog()
    log.add("p0", "pool", pool=0, role="prefill", page_size=16, num_pages=64, context_len=512)
    log.add("p0", "admit", req="a", tenant="t1", prompt_tokens=32, stage="prefill")
    log.add("p0", "alloc", req="a", pool=0, pages=[1, 2])
    log.add("p0", "write", req="a", pool=0, pages=[1, 2])
    log.add("p0", "hold", req="a", pool=0, pages=[1, 2], holder=holder)
    log.add("p0", "finish", req="a", output_tokens=1)
    log.add("p0", "free", req="a", pool=0, pages=[1, 2])
    return log


def send(log: EventLog, xfer: str) -> None:
    log.add(
        "p0", "xfer_send", req="a", xfer=xfer, peer_node="d0", pool=0, pages=[1, 2], tokens=32, status="done"
    )


def test_a_send_after_the_grant_ended_under_a_hold_is_clean() -> None:
    for holder in ("transfer_send", "offload"):
        log = sender(holder)
        send(log, "x1")
        log.add("p0", "release", req="a", pool=0, pages=[1, 2], holder=holder)
        assert judged(log) == [], holder


def test_a_send_after_the_last_hold_is_gone_is_a_use_after_free() -> None:
    log = sender()
    log.add("p0", "release", req="a", pool=0, pages=[1, 2], holder="transfer_send")
    send(log, "x1")
    (found,) = judged(log)
    assert (found.finding, found.req, list(found.pages)) == ("use_after_free", "a", [1, 2])


def test_a_held_page_given_to_someone_else_is_not_the_senders_to_send() -> None:
    """A page that left the hold (released) and was granted anew holds another request's KV:
    sending it is a read of someone else's data, whatever hold the rest still has."""
    log = sender()
    log.add("p0", "release", req="a", pool=0, pages=[2], holder="transfer_send")
    log.add("p0", "admit", req="b", tenant="t2", prompt_tokens=16, stage="prefill")
    log.add("p0", "alloc", req="b", pool=0, pages=[2])
    log.add("p0", "write", req="b", pool=0, pages=[2])
    send(log, "x1")
    found = judged(log)
    assert [(f.finding, f.req, list(f.pages), f.victim_req) for f in found] == [
        ("use_after_free", "a", [2], "b")
    ]
