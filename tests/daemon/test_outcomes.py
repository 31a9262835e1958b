"""What the daemon says became of a request a finding ordered stopped, when the events that
decide it come on two nodes' streams in either order."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import pytest

from kvguard.daemon import outcomes
from kvguard.daemon.outcomes import Outcomes
from kvguard.ledger import Finding
from kvguard.proto import pb

FINDING = Finding("config_drift", node="prefill-0", req="g1", tenant="globex", action="kill", ts_ns=100)


def watched(monkeypatch: pytest.MonkeyPatch) -> tuple[Outcomes, list[Finding], list[Callable[[], None]]]:
    said: list[Finding] = []
    timers: list[Callable[[], None]] = []
    clock = [0.0]
    monkeypatch.setattr(outcomes.time, "monotonic", lambda: clock[0])
    o = Outcomes(
        said.append, lambda node: node.startswith("decode"), lambda _delay, call: timers.append(call)
    )
    cursor: Future[int] = Future()
    cursor.set_result(7)
    assert o.watch(FINDING, 150, cursor, 0, finished=False) == ""

    def fire() -> None:  # the hold passes
        clock[0] += outcomes.ABORT_HOLD_S
        while timers:
            timers.pop()()

    return o, said, [fire]


def kill(ts: int, by: str = "daemon") -> pb.Event:
    return pb.Event(ts_ns=ts, kill=pb.Kill(req="g1", by=by))


def abort(ts: int) -> pb.Event:
    return pb.Event(ts_ns=ts, abort=pb.Abort(req="g1", reason="terminated by kvguard"))


def test_a_kill_on_prefill_heard_after_the_abort_it_caused_on_decode_decides_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    o, said, (fire,) = watched(monkeypatch)
    o.saw("decode-0", abort(300))  # the router aborted decode once prefill answered "killed"
    o.due()
    assert said == []  # held: a kill stamped before it may still be on its way
    o.saw("prefill-0", kill(200))
    o.due()
    assert [f.details["outcome"] for f in said] == ["killed"] and said[0].ts_ns == 200
    fire()
    assert len(said) == 1


def test_an_abort_with_no_kill_before_it_is_said_once_the_hold_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    o, said, (fire,) = watched(monkeypatch)
    o.saw("decode-0", abort(300))
    o.saw("prefill-0", kill(400))  # a kill after the abort: the abort ended the request
    o.due()
    assert said == []
    fire()
    assert [(f.details["outcome"], f.ts_ns) for f in said] == [("aborted", 300)]


def test_a_kill_decides_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    o, said, _ = watched(monkeypatch)
    o.saw("prefill-0", kill(200, by="guard@prefill-0"))
    o.saw("decode-0", abort(300))
    o.due()
    assert [f.details["outcome"] for f in said] == ["stopped"]
