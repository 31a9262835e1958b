"""A forward step (one `step` event naming its whole batch) is not indexed by its requests: the
`named` index holds none of them, yet a request's timeline (`kvguard audit request`, the
store's rows by request) still lists every step naming it within its span on the node, for a
request that has ended and for one still running, and `audit verify` passes. A store written
while steps were indexed reads and verifies the same."""

from __future__ import annotations

import itertools
import json

import pytest
from sqlalchemy import create_engine, text

from kvguard.cli.audit import main
from kvguard.cli.process import start_daemon
from kvguard.cli.send import send_capture
from kvguard.daemon.store import EventRun, Record, Store, rows_of
from kvguard.daemon.store import store_url as url_of
from kvguard.daemon.store.rows import named_with_steps
from kvguard.proto import pb, wire
from kvguard.proto.capture import read_capture


def ev(node: str, seq: int, payload: str, **fields: object) -> str:
    return json.dumps({"node": node, "seq": seq, "ts_ns": 1000 * seq, payload: fields})


def step(node: str, seq: int, reqs: list[str], pages: list[int], slots: list[int]) -> str:
    return ev(node, seq, "step", pool=0, reqs=reqs, counts=[1] * len(reqs), pages=pages, slots=slots)


POOL = {"pool": 0, "role": "colocated", "engine": "testbed", "page_size": 16, "num_pages": 32}
# n0: a (acme) and b (globex) decode together; a finishes and frees its page, b runs on alone
# (its last indexed event is its alloc: every step after it is in its span). n1: c decodes.
CAPTURE = [
    ev("n0", 1, "pool", **POOL),
    ev("n0", 2, "admit", req="a", tenant="acme", prompt_tokens=16, stage="prefill"),
    ev("n0", 3, "alloc", req="a", pool=0, pages=[1]),
    ev("n0", 4, "admit", req="b", tenant="globex", prompt_tokens=16, stage="prefill"),
    ev("n0", 5, "alloc", req="b", pool=0, pages=[2]),
    step("n0", 6, ["a", "b"], [1, 2], [1, 1]),
    step("n0", 7, ["a", "b"], [1, 2], [2, 2]),
    ev("n0", 8, "finish", req="a", output_tokens=2),
    ev("n0", 9, "free", req="a", pool=0, pages=[1]),
    step("n0", 10, ["b"], [2], [3]),
    step("n0", 11, ["b"], [2], [4]),
    ev("n1", 1, "pool", **POOL),
    ev("n1", 2, "admit", req="c", tenant="acme", prompt_tokens=16, stage="prefill"),
    ev("n1", 3, "alloc", req="c", pool=0, pages=[5]),
    step("n1", 4, ["c"], [5], [1]),
]
TIMELINES = {  # (node, seq) of each request's events, in record order
    "a": [("n0", 2), ("n0", 3), ("n0", 6), ("n0", 7), ("n0", 8), ("n0", 9)],
    "b": [("n0", 4), ("n0", 5), ("n0", 6), ("n0", 7), ("n0", 10), ("n0", 11)],
    "c": [("n1", 2), ("n1", 3), ("n1", 4)],
}


def events_of(store: Store, **where: object) -> list[pb.Event]:
    found = [(i, kind, body) for i, kind, body in store.rows(**where)]
    assert [i for i, _, _ in found] == sorted(i for i, _, _ in found)
    return [pb.Event.FromString(body) for _, kind, body in found if kind == "event"]


def named_rows(store_url: str) -> list[tuple[str, int]]:
    engine = create_engine(url_of(store_url))
    with engine.connect() as db:
        rows = db.execute(text("SELECT req, record_id FROM named ORDER BY req, record_id")).all()
    engine.dispose()
    return [(str(r), int(i)) for r, i in rows]


def assert_timelines(s: Store) -> None:
    for req, expected in TIMELINES.items():
        got = events_of(s, req=req)
        assert [(e.node, e.seq) for e in got] == expected, req
        for e in got:  # every step listed names the request
            assert e.WhichOneof("payload") != "step" or req in e.step.reqs
    steps_of_b = [e for e in events_of(s, req="b") if e.WhichOneof("payload") == "step"]
    assert [list(e.step.reqs) for e in steps_of_b] == [["a", "b"], ["a", "b"], ["b"], ["b"]]
    assert [(e.node, e.seq) for e in events_of(s, req="b", node="n0", kind="event", limit=3)] == [
        ("n0", 4),
        ("n0", 5),
        ("n0", 6),
    ]
    assert [e.seq for e in events_of(s, req="b", after=events_of_ids(s, "b")[3])] == [10, 11]
    assert events_of(s, req="b", kind="finding") == []
    # A step has no tenant: a tenant's filter never took one (nor does it now).
    assert [e.seq for e in events_of(s, req="a", tenant="acme")] == [2]


def events_of_ids(s: Store, req: str) -> list[int]:
    return [i for i, _, _ in s.rows(req=req)]


def test_a_requests_timeline_lists_its_steps_from_a_daemons_store(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    d = start_daemon(store_url)
    try:
        summary = send_capture(CAPTURE, d.address)
        assert summary.accepted == summary.events == len(CAPTURE) and not summary.rejected
    finally:
        d.stop()
    s = Store(store_url)
    try:
        assert s.verify() == (True, len(CAPTURE), "")
        assert s.count("finding") == 0
        assert_timelines(s)
        step_ids = {i for i, kind, body in s.rows(kind="event") if _is_step(body)}
        assert len(step_ids) == 5
        named = named_rows(store_url)
        assert not [row for row in named if row[1] in step_ids]  # a step names no row in `named`
        assert {req for req, _ in named} <= {"a", "b", "c"}  # the runs' requests, none for a step
    finally:
        s.close()
    capsys.readouterr()
    assert main(["request", "b", "--store", store_url, "-o", "json"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["event"]["node"], r["event"]["seq"]) for r in out] == TIMELINES["b"]
    assert [r["event"]["step"]["reqs"] for r in out if "step" in r["event"]] == [
        ["a", "b"],
        ["a", "b"],
        ["b"],
        ["b"],
    ]


def _is_step(body: bytes) -> bool:
    return pb.Event.FromString(body).WhichOneof("payload") == "step"


def parts_of(events: list[pb.Event]) -> tuple[list[wire.Batch], list[list[Record | EventRun]]]:
    """The capture as the writer stores it, a group a node: n0's events in runs (its first two
    steps a run of their own, its last step a record of its own), n1's in one run."""
    batches, groups = [], []
    for node, cuts in (("n0", [0, 5, 7, 10, 11]), ("n1", [0, 4])):
        batches.append(wire.batch_of([e.SerializeToString() for e in events if e.node == node]))
        at = len(batches) - 1
        groups.append([EventRun(at, start, stop) for start, stop in itertools.pairwise(cuts)])
    return batches, groups


def legacy(row: Record) -> Record:
    """A row as the writer made it while steps were indexed: a lone step's first request its
    `req`, every other request of a step named."""
    if row.kind == "event" and _is_step(row.body):
        reqs = pb.Event.FromString(row.body).step.reqs
        return row._replace(req=reqs[0], named=named_with_steps(row.kind, row.body))
    return row._replace(named=named_with_steps(row.kind, row.body)) if row.kind == "events" else row


@pytest.mark.parametrize("indexed_steps", [False, True], ids=["now", "steps indexed"])
def test_steps_in_runs_and_alone_as_the_writer_stores_them(store_url: str, indexed_steps: bool) -> None:
    events = [e for _, e in read_capture(CAPTURE)]
    batches, groups = parts_of(events)
    s = Store(store_url)
    try:
        for group in groups:
            rows = rows_of(batches, group)
            s.append([legacy(r) for r in rows] if indexed_steps else rows)
        engine = create_engine(url_of(store_url))
        with engine.connect() as db:
            kinds = [tuple(k) for k in db.execute(text("SELECT kind, req FROM records ORDER BY id")).all()]
        engine.dispose()
        lone = "b" if indexed_steps else ""  # n0's last step, a record of its own
        assert kinds == [("events", ""), ("events", ""), ("events", ""), ("event", lone), ("events", "")]
        named = named_rows(store_url)
        if indexed_steps:  # every request of a step named, but a lone step's first (its `req`)
            assert named == [("a", 1), ("a", 6), ("a", 8), ("b", 1), ("b", 6), ("b", 8), ("c", 12)]
        else:  # the run of two steps (6) names nothing, the step alone (11) neither
            assert named == [("a", 1), ("a", 8), ("b", 1), ("c", 12)]
        assert s.verify() == (True, len(CAPTURE), "")
        assert_timelines(s)
    finally:
        s.close()


def by_handles(line: str) -> str:
    """The capture's event as a guard with handles writes it: admits give a (per node) handle,
    steps name their batch by them."""
    event = json.loads(line)
    handle = {"a": 1, "b": 2, "c": 1}  # numbers are per node: c's is a's on another node
    if "admit" in event:
        event["admit"]["handle"] = handle[event["admit"]["req"]]
    if "step" in event:
        event["step"]["handles"] = [handle[r] for r in event["step"].pop("reqs")]
    return json.dumps(event)


def test_a_requests_timeline_lists_the_steps_that_name_it_by_handle(store_url: str) -> None:
    # Steps that carry handles, not names: a request's timeline still lists exactly the steps
    # of its batch on its node (by the handle its admit there gave it), none on another node
    # where the same number names another request.
    capture = [by_handles(line) for line in CAPTURE]
    d = start_daemon(store_url)
    try:
        summary = send_capture(capture, d.address)
        assert summary.accepted == summary.events == len(capture) and not summary.rejected
    finally:
        d.stop()
    s = Store(store_url)
    try:
        assert s.verify() == (True, len(capture), "")
        for req, expected in TIMELINES.items():
            got = events_of(s, req=req)
            assert [(e.node, e.seq) for e in got] == expected, req
        steps_of_b = [e for e in events_of(s, req="b") if e.WhichOneof("payload") == "step"]
        assert [list(e.step.handles) for e in steps_of_b] == [[1, 2], [1, 2], [2], [2]]
        assert not any(e.step.reqs for e in steps_of_b)
    finally:
        s.close()
