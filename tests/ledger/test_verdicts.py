"""Verdicts that wait are settled (docs/integrator.md): a wire probe's count short of the sender's claim,
with no word of the rest, is reported at the request's next use after receipt, once the
nodes' clocks pass the clock-skew allowance, or at the end of a capture; a send no receiver
that reports ever confirmed is reported at the end of a capture. Each verdict once."""

from __future__ import annotations

import pytest
from clocked import MS, Clocked

from kvguard.ledger import snapshot
from kvguard.ledger.findings import Finding
from kvguard.ledger.ledger import Ledger
from kvguard.proto import wire
from kvguard.proto.builder import EventLog


class Short(Clocked):
    """p0 sends request a's two pages (8192 bytes) to d0, its probe (stream p0/ebpf) has seen
    4096 of them so far, and d0 reported the receipt (unless `received` is False). The clock
    is the test's (`now`, ns); the last word about the transfer is at 10 ms."""

    def __init__(self, received: bool = True, ledger: Ledger | None = None) -> None:
        super().__init__(1 * MS, ledger)
        self.add("p0", "pool", pool=0, role="prefill", page_size=16, num_pages=16, context_len=256)
        self.add("d0", "pool", pool=0, role="decode", page_size=16, num_pages=16, context_len=256)
        self.add("q0", "pool", pool=0, role="decode", page_size=16, num_pages=16, context_len=256)
        self.add("p0", "bootstrap", req="a", prefill_node="p0", decode_node="d0", prompt_tokens=32)
        self.add("p0", "admit", req="a", tenant="acme", prompt_tokens=32, stage="prefill")
        self.add("p0", "alloc", req="a", pool=0, pages=[1, 2])
        self.add("p0", "write", req="a", pool=0, pages=[1, 2])
        self.add("d0", "alloc", req="a", pool=0, pages=[3, 4])
        send = {"req": "a", "xfer": "x1", "peer_node": "d0", "pool": 0, "pages": [1, 2], "tokens": 32}
        self.add("p0", "xfer_send", **send, bytes=8192, status="done")
        self.add("p0", "free", req="a", pool=0, pages=[1, 2])  # before receipt: settles nothing
        if received:
            recv = {"req": "a", "xfer": "x1", "peer_node": "p0", "pool": 0, "pages": [3, 4], "tokens": 32}
            self.add("d0", "xfer_recv", **recv, bytes=8192, status="done")
        self.add("p0/ebpf", "wire", at_ms=10, xfer="x1", probe="ebpf:tcp", bytes=4096, calls=1)
        assert self.found == []


def is_wire_short(f: Finding, node: str, settled: str) -> bool:
    assert (f.finding, f.req, f.node, f.tenant) == ("transfer_mismatch", "a", node, "acme")
    assert {k: f.details[k] for k in ("xfer", "what", "expected", "observed", "probe")} == {
        "xfer": "x1",
        "what": "wire_bytes",
        "expected": "8192",
        "observed": "4096",
        "probe": "ebpf:tcp",
    }
    assert "sender reported 8192 bytes, the wire probe (ebpf:tcp) saw 4096 in 1 call(s)" in f.message
    assert f"settled as short now: {settled}" in f.message and f.details["settled"].startswith(settled)
    return True


# ------------------------------------------------------------------ at the request's next use


@pytest.mark.parametrize(
    ("payload", "fields", "why"),
    [
        ("free", {"req": "a", "pool": 0, "pages": [3, 4]}, "the request freed its pages"),
        ("read", {"reads": [{"req": "a", "pool": 0, "pages": [3, 4], "tokens": 32}]}, "the request read"),
        (
            "release",
            {"req": "a", "pool": 0, "pages": [3, 4], "holder": "transfer_recv"},
            "the request released its transfer_recv hold",
        ),
        ("finish", {"req": "a", "output_tokens": 1}, "the request finished"),
    ],
)
def test_the_next_use_after_receipt_settles_a_short_count(payload: str, fields: dict, why: str) -> None:
    s = Short()
    if payload == "release":
        s.add("d0", "hold", req="a", pool=0, pages=[3, 4], holder="transfer_recv")
    if payload == "read":
        s.add("d0", "admit", req="a", tenant="acme", prompt_tokens=32, stage="decode")
    (f,) = s.add("d0", payload, **fields)
    assert is_wire_short(f, "d0", why) and f.seq == s.log.events[-1].seq
    assert s.ledger.transfers.verdicts.waits == {} and s.ledger.transfers.pending == {}


def test_a_use_before_receipt_settles_nothing_the_rest_may_follow() -> None:
    # The sender's free came before the probe's report (Short): nothing. The rest arrives.
    s = Short(received=False)
    assert s.add("p0/ebpf", "wire", xfer="x1", probe="ebpf:tcp", bytes=4096, calls=1) == []
    assert s.ledger.transfers.verdicts.waits == {}
    assert s.add("p0", "heartbeat", at_ms=100) == []
    (unconfirmed,) = s.ledger.end_capture()  # d0 reports, and never reported the receipt
    assert unconfirmed.details["what"] == "unconfirmed"


# ------------------------------------------------------------------ by the nodes' clocks


@pytest.mark.parametrize("node", ["p0", "d0", "p0/ebpf"])  # the sender, the receiver, the probe
def test_the_clock_of_a_node_involved_settles_a_short_count(node: str) -> None:
    s = Short()
    assert s.add("q0", "heartbeat", at_ms=50) == []  # a node not involved: its clock says nothing
    assert s.add(node, "heartbeat", at_ms=20) == []  # 10 ms after the last word: not past it
    (f,) = s.add(node, "heartbeat", at_ms=20.000001)
    assert is_wire_short(f, node, "no word for 10 ms by the nodes' clocks")
    assert f"({node}'s clock at 20000001 ns)" in f.message and f.seq == s.log.events[-1].seq
    # settled once: nothing more, however it goes on
    assert s.add("d0", "free", req="a", pool=0, pages=[3, 4]) == []
    assert s.add("p0/ebpf", "wire", xfer="x1", probe="ebpf:tcp", bytes=1024, calls=1) == []
    assert s.add("p0", "heartbeat", at_ms=99) == [] and s.ledger.end_capture() == []
    assert s.ledger.transfers.due == {}


def test_the_clock_settles_also_with_no_receiver_and_without_de_duplication() -> None:
    s = Short(received=False, ledger=Ledger(dedupe=False))
    (f,) = s.add("p0", "heartbeat", at_ms=25)
    assert is_wire_short(f, "p0", "no word for 10 ms")
    assert s.add("p0/ebpf", "wire", xfer="x1", probe="ebpf:tcp", bytes=1024, calls=1) == []
    assert s.add("d0", "heartbeat", at_ms=60) == []
    assert [f.details["what"] for f in s.ledger.end_capture()] == ["unconfirmed"]


def test_each_word_about_the_transfer_moves_the_deadline() -> None:
    s = Short()
    assert s.add("p0/ebpf", "wire", at_ms=18, xfer="x1", probe="ebpf:tcp", bytes=1024, calls=1) == []
    assert s.add("d0", "heartbeat", at_ms=27) == []  # past the first deadline, not the second
    (f,) = s.add("d0", "heartbeat", at_ms=28.5)
    assert f.details["observed"] == "5120" and "in 2 call(s)" in f.message


def test_a_count_that_adds_up_in_time_is_clean() -> None:
    s = Short()
    assert s.add("p0/ebpf", "wire", at_ms=15, xfer="x1", probe="ebpf:tcp", bytes=4096, calls=1) == []
    assert s.add("d0", "heartbeat", at_ms=90) == [] and s.ledger.end_capture() == []
    # its stale deadline went from d0's heap as d0's clock passed it (p0's stays until p0 speaks)
    assert "d0" not in s.ledger.transfers.due and s.ledger.transfers.verdicts.waits == {}


def test_runs_applied_in_c_stop_where_the_clock_settles_a_verdict() -> None:
    # The daemon applies a node's clean events in C runs: a run must leave the event whose time
    # passes a deadline to Python, so the finding comes with the same event, and the state
    # ends the same, byte for byte, as applying them one by one.
    events = []
    for i in range(12):
        events.append(("d0", "alloc", {"req": f"o{i}", "pool": 0, "pages": [8 + i % 4]}, 14 + i))
        events.append(("d0", "free", {"req": f"o{i}", "pool": 0, "pages": [8 + i % 4]}, 14.5 + i))
    one, runs = Short(), Short()
    expected = [(f.node, f.seq) for n, kind, fields, at in events for f in one.add(n, kind, at, **fields)]
    assert len(expected) == 1 and expected[0][0] == "d0"
    bodies = []
    for _, kind, fields, at in events:
        runs.now = int(at * MS)
        bodies.append(runs.log.add("d0", kind, **fields).SerializeToString())
    batch, got, i = wire.batch_of(bodies), [], 0
    while i < len(bodies):
        i = runs.ledger.apply_clean(batch, i, len(bodies), "d0")
        if i < len(bodies):
            got += [(f.node, f.seq) for f in runs.ledger.apply_serialized(bodies[i], "d0")]
            i += 1
    assert got == expected
    assert snapshot.dump(runs.ledger) == snapshot.dump(one.ledger)


def test_a_snapshot_keeps_what_waits_and_when() -> None:
    s = Short()
    resumed = snapshot.load(snapshot.dump(s.ledger))
    assert snapshot.dump(resumed) == snapshot.dump(s.ledger)
    s.ledger = resumed
    assert s.add("d0", "heartbeat", at_ms=19) == []
    (f,) = s.add("p0/ebpf", "heartbeat", at_ms=21)
    assert is_wire_short(f, "p0/ebpf", "no word for 10 ms")


# ------------------------------------------------------------------ at the end of a capture


def test_the_end_of_a_capture_settles_what_waits() -> None:
    s = Short()
    (f,) = s.ledger.end_capture()
    assert is_wire_short(f, "p0", "end of capture") and (f.seq, f.ts_ns) == (0, 1 * MS)  # p0's last time
    assert s.ledger.end_capture() == []


def test_a_send_no_receiver_confirmed_is_reported_at_the_end_of_a_capture() -> None:
    s = Short(received=False)
    (short,) = s.add("p0/ebpf", "wire", xfer="x1", probe="ebpf:tcp", bytes=0, calls=0, complete=True)
    assert short.details["what"] == "wire_bytes"  # the probe saw it end: judged at once
    (unconfirmed,) = s.ledger.end_capture()
    assert unconfirmed.node == "d0"
    assert (unconfirmed.finding, unconfirmed.req, unconfirmed.seq) == ("transfer_mismatch", "a", 0)
    assert unconfirmed.details == {
        "xfer": "x1",
        "what": "unconfirmed",
        "expected": "32",
        "observed": "0",
        "receiver": "d0",
        "settled": "end of capture",
    }
    assert "sender p0 reported 32 tokens (8192 bytes) sent to d0, which never reported" in unconfirmed.message
    assert s.ledger.end_capture() == []


def test_a_send_to_a_node_that_never_reports_is_not_held_against_it() -> None:
    # An unguarded decode node: no receipt is expected from it.
    log, ledger = EventLog(), Ledger()
    log.add("p0", "pool", pool=0, role="prefill", page_size=16, num_pages=16, context_len=256)
    log.add("p0", "alloc", req="a", pool=0, pages=[1])
    log.add("p0", "write", req="a", pool=0, pages=[1])
    send = {"req": "a", "xfer": "x1", "peer_node": "d9", "pool": 0, "pages": [1], "tokens": 16}
    log.add("p0", "xfer_send", **send, bytes=4096, status="done")
    assert [f for e in log.events for f in ledger.apply(e)] == [] and ledger.end_capture() == []


def test_the_end_of_one_node_settles_only_what_it_is_involved_in() -> None:
    # For a node's new epoch: settle_all(node), while applying the event that starts it.
    s = Short(received=False)
    s.ledger.findings.at("q0", 99, 12 * MS)
    assert s.ledger.transfers.settle_all("q0", "q0 restarted") == []
    s.ledger.findings.at("d0", 99, 12 * MS)
    short, unconfirmed = s.ledger.transfers.settle_all("d0", "d0 restarted")
    assert is_wire_short(short, "d0", "d0 restarted") and short.seq == 99
    assert (unconfirmed.details["what"], unconfirmed.node, unconfirmed.seq) == ("unconfirmed", "d0", 99)
    assert s.ledger.end_capture() == []


def test_events_may_follow_the_end_of_a_capture() -> None:
    s = Short()
    s.ledger.end_capture()
    assert s.add("d0", "heartbeat", at_ms=90) == [] and s.ledger.end_capture() == []
    assert s.add("d0", "free", req="a", pool=0, pages=[3, 4]) == []
