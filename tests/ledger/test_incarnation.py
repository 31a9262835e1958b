"""A node's engine restarts (a new epoch): what the previous incarnation held ends without a
finding, the new pools are judged afresh, and (node, epoch, seq) is an event's identity."""

from __future__ import annotations

import pytest

from kvguard.ledger.findings import BadEvent
from kvguard.ledger.ledger import Ledger
from kvguard.proto import pb, wire
from kvguard.proto.builder import EventLog

POOL = {"pool": 0, "role": "colocated", "page_size": 16, "num_pages": 8, "context_len": 128}


def first_run(log: EventLog) -> None:
    """Two tenants' requests on n0, mid-traffic: pages granted, written, one shared."""
    log.add("n0", "pool", **POOL)
    for req, tenant, pages in (("r1", "acme", [0, 1]), ("r2", "globex", [2, 3])):
        log.add("n0", "admit", req=req, tenant=tenant, prompt_tokens=32, stage="prefill")
        log.add("n0", "alloc", req=req, pool=0, pages=pages)
        log.add("n0", "write", req=req, pool=0, pages=pages)
    log.add("n0", "hold", req="r2", pool=0, pages=[3], holder="offload")


def second_run(log: EventLog, pool: dict[str, object]) -> None:
    """The same requests' names again, on pages the old run held (what `testbed up` twice does)."""
    log.add("n0", "pool", **pool)
    log.add("n0", "admit", req="r1", tenant="acme", prompt_tokens=32, stage="prefill")
    log.add("n0", "alloc", req="r1", pool=0, pages=[2, 3])  # r2's and its offload hold's, before
    log.add("n0", "write", req="r1", pool=0, pages=[2, 3])
    log.add("n0", "read", reads=[{"req": "r1", "pool": 0, "pages": [2, 3], "tokens": 32}])
    log.add("n0", "free", req="r1", pool=0, pages=[2, 3])
    log.add("n0", "finish", req="r1", output_tokens=1)


def apply_all(ledger: Ledger, events: list[pb.Event]) -> list[tuple[str, str, str]]:
    return [(f.finding, f.req, f.message) for e in events for f in ledger.apply(e)]


def test_a_restarted_engine_is_judged_afresh_without_findings_against_its_past() -> None:
    log = EventLog()
    first_run(log)
    log.restart("n0", 2)
    second_run(log, POOL)
    ledger = Ledger()
    assert apply_all(ledger, log.events) == []
    node = ledger.nodes["n0"]
    assert (node.epoch, node.last_seq) == (2, 7)
    assert ledger.stats.restarts == 1
    pages = node.pools[0].pages
    assert pages.owner[:4].tolist() == [~0, ~0, ~ledger.request("r1").idx, ~ledger.request("r1").idx]
    assert not pages.holds.any()  # the offload hold ended with the old process
    assert ledger.request("r2") is None  # it had nothing anywhere else: forgotten
    assert ledger.request("r1").state == "finished"


def test_a_pool_that_changed_across_the_restart_and_no_longer_fits_is_drift() -> None:
    log = EventLog()
    first_run(log)
    log.restart("n0", 2)
    smaller = {**POOL, "num_pages": 4}  # 64 tokens for a 128-token context
    second_run(log, smaller)
    found = apply_all(Ledger(), log.events)
    assert [f[0] for f in found] == ["config_drift", "config_drift"]
    assert "changed since before the engine restarted: num_pages 8 -> 4" in found[0][2]
    assert "holds 64 tokens" in found[1][2] and "context length of 128" in found[1][2]


def test_an_event_of_an_older_epoch_is_refused_and_a_repeat_within_one_too() -> None:
    log = EventLog()
    first_run(log)
    old = log.events
    log.restart("n0", 5)
    second_run(log, POOL)
    ledger = Ledger()
    apply_all(ledger, log.events)
    with pytest.raises(BadEvent, match="epoch 0, older than its current epoch 5") as exc:
        ledger.apply(old[-1])
    assert exc.value.kind == "stale_epoch"
    with pytest.raises(BadEvent, match="repeats") as exc:
        ledger.apply(log.events[-1])
    assert exc.value.kind == "repeat"
    assert ledger.stats.bad == {"stale_epoch": 1, "repeat": 1}


def test_a_restart_is_the_same_through_the_clean_path_in_c() -> None:
    log = EventLog()
    first_run(log)
    log.restart("n0", 2)
    second_run(log, POOL)
    parsed, runs = Ledger(), Ledger()
    apply_all(parsed, log.events)
    batch = wire.batch_of([e.SerializeToString() for e in log.events])
    runs.replay(batch, "n0")
    from kvguard.ledger import snapshot

    assert snapshot.dump(runs) == snapshot.dump(parsed)


def pd_until_sent(log: EventLog, wire_bytes: int) -> None:
    """r1 prefilled on p0 and sent to d0 (claiming 4096 bytes); the wire probe saw wire_bytes."""
    log.add("p0", "pool", **{**POOL, "role": "prefill"})
    log.add("d0", "pool", **{**POOL, "role": "decode"})
    log.add("d0", "bootstrap", req="r1", prefill_node="p0", decode_node="d0", prompt_tokens=32)
    log.add("d0", "admit", req="r1", tenant="acme", prompt_tokens=32, stage="decode")
    log.add("d0", "alloc", req="r1", pool=0, pages=[4, 5])
    log.add("p0", "admit", req="r1", tenant="acme", prompt_tokens=32, stage="prefill")
    log.add("p0", "alloc", req="r1", pool=0, pages=[0, 1])
    log.add("p0", "write", req="r1", pool=0, pages=[0, 1])
    log.add(
        "p0",
        "xfer_send",
        req="r1",
        xfer="x1",
        peer_node="d0",
        pool=0,
        pages=[0, 1],
        tokens=32,
        bytes=4096,
        status="done",
    )
    log.add("p0/ebpf", "wire", xfer="x1", peer_node="d0", bytes=wire_bytes, calls=1, probe="ebpf")


def test_a_receiver_restarted_while_a_transfer_was_in_flight_is_no_finding_against_the_sender() -> None:
    log = EventLog()
    pd_until_sent(log, 4096)
    log.restart("d0", 9)
    log.add("d0", "pool", **{**POOL, "role": "decode"})
    ledger = Ledger()
    assert apply_all(ledger, log.events) == []
    assert ledger.end_capture() == []  # the send to the restarted receiver was closed, not left


def test_a_short_wire_count_is_still_the_senders_when_the_receiver_restarts() -> None:
    log = EventLog()
    pd_until_sent(log, 1024)
    log.add(
        "d0",
        "xfer_recv",
        req="r1",
        xfer="x1",
        peer_node="p0",
        pool=0,
        pages=[4, 5],
        tokens=32,
        bytes=4096,
        status="done",
    )
    log.restart("d0", 9)
    log.add("d0", "pool", **{**POOL, "role": "decode"})
    ledger = Ledger()
    found = apply_all(ledger, log.events)
    assert [f[:2] for f in found] == [("transfer_mismatch", "r1")]
    assert "sender reported 4096 bytes" in found[0][2] and "saw 1024" in found[0][2]
    assert "the engine of d0 restarted" in found[0][2]
