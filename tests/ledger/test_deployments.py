"""What real deployments do that the event contract must judge right (issue 38): KV that
outlives its request's grant under a hold (asynchronous senders, deferred release,
offloading), and KV one request stored in an external tier that another loads."""

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


def tier(loader_tenant: str) -> EventLog:
    """Request a (tenant t1) stores its KV in an external tier (transfer "tier:h1", LMCache or
    an offloading connector, keyed by content); later request b loads it into its own pages."""
    log = EventLog()
    log.add("n0", "pool", pool=0, role="colocated", page_size=16, num_pages=64, context_len=512)
    log.add("n0", "admit", req="a", tenant="t1", prompt_tokens=32, stage="prefill")
    log.add("n0", "alloc", req="a", pool=0, pages=[1, 2])
    log.add("n0", "write", req="a", pool=0, pages=[1, 2])
    log.add(
        "n0",
        "xfer_send",
        req="a",
        xfer="tier:h1",
        peer_node="cpu-tier",
        pool=0,
        pages=[1, 2],
        tokens=32,
        status="done",
    )
    log.add("n0", "finish", req="a", output_tokens=1)
    log.add("n0", "free", req="a", pool=0, pages=[1, 2])
    log.add("n0", "admit", req="b", tenant=loader_tenant, prompt_tokens=40, stage="prefill")
    log.add("n0", "alloc", req="b", pool=0, pages=[5, 6, 7])
    log.add(
        "n0",
        "xfer_recv",
        req="b",
        xfer="tier:h1",
        peer_node="cpu-tier",
        pool=0,
        pages=[5, 6],
        tokens=32,
        status="done",
    )
    log.add("n0", "write", req="b", pool=0, pages=[7], slots=[8])
    log.add("n0", "read", reads=[{"req": "b", "pool": 0, "pages": [5, 6, 7], "tokens": 40}])
    return log


def test_kv_one_request_stored_and_another_of_its_tenant_loads_is_clean() -> None:
    assert judged(tier("t1")) == []


def test_kv_another_tenant_stored_is_a_cross_tenant_share_naming_it() -> None:
    (found,) = judged(tier("t2"))
    assert (found.finding, found.req, found.tenant) == ("cross_tenant_share", "b", "t2")
    assert (found.victim_req, found.victim_tenant, list(found.pages)) == ("a", "t1", [5, 6])
    assert "loaded KV that t1 request a stored (transfer tier:h1)" in found.message


def test_the_same_kv_stored_again_by_another_request_is_no_bad_event() -> None:
    log = tier("t1")
    log.add("n0", "admit", req="c", tenant="t1", prompt_tokens=32, stage="prefill")
    log.add("n0", "alloc", req="c", pool=0, pages=[9, 10])
    log.add("n0", "write", req="c", pool=0, pages=[9, 10])
    log.add(
        "n0",
        "xfer_send",
        req="c",
        xfer="tier:h1",
        peer_node="cpu-tier",
        pool=0,
        pages=[9, 10],
        tokens=32,
        status="done",
    )
    assert judged(log) == []


def test_a_request_with_no_tenant_is_counted() -> None:
    """It is never judged across tenants (vLLM shares an unsalted prefix among all unsalted
    requests), so the ledger counts it: the fleet's view and the metrics show the count."""
    log = tier("")
    ledger = Ledger()
    found = [f for e in log.lines if not isinstance(e, str) for f in ledger.apply(e)]
    assert found == [] and ledger.stats.untenanted == 1
    assert ledger.stats.totals()["untenanted"] == 1


def killed(by: str, steps: int) -> list[Finding]:
    """Request a decodes; a kill reaches its engine between steps; `steps` more steps of it
    are reported (with their reads) before the engine's abort."""
    log = EventLog()
    log.add("n0", "pool", pool=0, role="colocated", page_size=16, num_pages=64, context_len=512)
    log.add("n0", "admit", req="a", tenant="t1", prompt_tokens=16, stage="prefill")
    log.add("n0", "alloc", req="a", pool=0, pages=[1, 2])
    log.add("n0", "write", req="a", pool=0, pages=[1, 2], slots=[16, 1])
    log.add("n0", "kill", req="a", finding="operator_kill", by=by)
    for n in range(steps):
        log.add("n0", "step", pool=0, reqs=["a"], counts=[1], pages=[2], slots=[2 + n])
        log.add("n0", "read", reads=[{"req": "a", "pool": 0, "pages": [1, 2], "tokens": 18 + n}])
    log.add("n0", "abort", req="a", reason="kvguard stopped request a")
    log.add("n0", "free", req="a", pool=0, pages=[1, 2])
    return judged(log)


def test_the_forward_under_way_when_a_kill_came_from_outside_is_a_drain() -> None:
    """SGLang learns of a kill between steps and still runs the forwards it has already formed
    (its output dropped; its overlap schedule forms the next before the last one's results
    end the request): those two steps are a drain. A third is progress, and so is any step
    after a kill the engine's own guard made (it drops the request before the forward)."""
    assert killed("unverified:alice", 2) == []
    assert killed("daemon", 1) == killed("daemon", 2) == []
    found = killed("daemon", 3)
    assert {(f.finding, f.details["event"]) for f in found} == {
        ("rejected_progress", "step"),
        ("rejected_progress", "read"),
    }
    found = killed("guard@n0", 1)
    assert {(f.finding, f.details["event"]) for f in found} == {
        ("rejected_progress", "step"),
        ("rejected_progress", "read"),
    }
