"""The in-engine guard: local verdicts on the hot path, events that replay to the same findings."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from kvguard.agents.guard import CaptureSink, Guard, WallClock
from kvguard.ledger.ledger import Ledger
from kvguard.proto import pb
from kvguard.proto.capture import read_capture
from kvguard.ruleset import load_ruleset
from kvguard.ruleset.replay import replay

RULES = load_ruleset()


def decode_guard(**kwargs: object) -> Guard:
    guard = Guard("d0", ruleset=RULES, **kwargs)  # type: ignore[arg-type]
    guard.pool(0, "decode", page_size=16, num_pages=32, context_len=512)
    return guard


def serve(guard: Guard, req: str, tenant: str, pages: list[int], tokens: int) -> None:
    assert guard.admit(req, tenant, tokens, "decode").ok
    assert guard.alloc(req, 0, pages).ok
    slots = [16] * (len(pages) - 1) + [tokens - 16 * (len(pages) - 1)]
    assert guard.write(req, 0, pages, slots).ok


def test_the_batch_check_kills_only_the_offender() -> None:
    guard = decode_guard()
    serve(guard, "a1", "acme", [1, 2], 32)
    assert guard.finish("a1", 1).ok and guard.free("a1", 0, [1, 2]).ok
    serve(guard, "a2", "acme", [3], 10)
    serve(guard, "g1", "globex", [2, 4], 20)  # page 2 was a1's; g1 overwrote it
    assert guard.admit("g2", "globex", 20, "decode").ok
    assert guard.alloc("g2", 0, [1, 5]).ok
    assert guard.write("g2", 0, [5], [4]).ok  # page 1 still holds a1's KV
    tables = np.array([[3, 0], [2, 4], [1, 5]])
    verdict = guard.check_attention(0, ["a2", "g1", "g2"], tables, np.array([10, 20, 20]))
    assert list(verdict.kill) == ["g2"]
    (finding,) = verdict.findings
    assert (finding.finding, finding.rule, finding.victim_req, finding.victim_tenant, finding.pages) == (
        "stale_read",
        "stale_read_cross_tenant",
        "a1",
        "acme",
        (1,),
    )
    assert "a1" in verdict.reason("g2") and guard.ledger.request("g2").state == "killed"
    # The next step without g2 is clean; with g2 still batched, it is dropped again.
    assert guard.check_attention(0, ["a2", "g1"], tables[:2], np.array([10, 20])).ok
    again = guard.check_attention(0, ["a2", "g2"], tables[[0, 2]], np.array([10, 20]))
    assert list(again.kill) == ["g2"]


def test_clean_batches_emit_no_read_events(tmp_path: Path) -> None:
    sink = CaptureSink(tmp_path / "d0.jsonl")
    guard = decode_guard(sink=sink)
    serve(guard, "a1", "acme", [1, 2], 30)
    for context in (30, 31, 32):  # decode steps: attend, then write the next token
        assert guard.check_attention(0, ["a1"], np.array([[1, 2, 0, 0]]), np.array([context])).ok
        if context < 32:
            assert guard.write("a1", 0, [2], [context + 1 - 16]).ok
    sink.flush()
    kinds = [e.WhichOneof("payload") for _, e in read_capture(sink.path.read_text().splitlines())]
    assert kinds == ["pool", "admit", "alloc", "write", "write", "write"]
    sink.close()


def test_monitor_mode_reports_and_never_kills() -> None:
    guard = decode_guard(mode="monitor")
    serve(guard, "a1", "acme", [1], 16)
    guard.free("a1", 0, [1])
    guard.admit("g1", "globex", 16, "decode")
    guard.alloc("g1", 0, [1])
    verdict = guard.check_attention(0, ["g1"], np.array([[1]]), np.array([16]))
    assert verdict.ok and [f.finding for f in verdict.findings] == ["stale_read"]
    assert guard.killed == {} and guard.ledger.request("g1").state == "admitted"


def test_a_rule_in_monitor_mode_while_the_guard_enforces() -> None:
    guard = decode_guard(rule_modes={"transfer_mismatch": "monitor"})
    guard.bootstrap("g1", "p0", "d0", 64)
    guard.alloc("g1", 0, [1, 2, 3, 4])
    verdict = guard.xfer_recv("g1", "x1", "p0", 0, [1, 2, 3, 4], tokens=16, nbytes=1024)
    assert verdict.ok and verdict.findings[0].finding == "transfer_mismatch"


def test_receipt_is_checked_against_what_the_sender_claimed() -> None:
    guard = decode_guard()
    guard.bootstrap("g1", "p0", "d0", 64)
    guard.alloc("g1", 0, [1, 2, 3, 4])
    # The sender's header claimed 64 tokens with these checksums; two pages never arrived.
    verdict = guard.xfer_recv(
        "g1",
        "x1",
        "p0",
        0,
        [1, 2, 3, 4],
        tokens=32,
        nbytes=32768,
        checksums=[11, 12, 0, 0],
        claimed_tokens=64,
        claimed_bytes=65536,
        claimed_checksums=[11, 12, 13, 14],
    )
    assert list(verdict.kill) == ["g1"]
    whats = sorted(f.details["what"] for f in verdict.findings)
    assert whats == ["bytes", "checksums", "tokens"]
    checksum = next(f for f in verdict.findings if f.details["what"] == "checksums")
    assert checksum.pages == (3, 4)


def test_what_the_guard_cannot_check_does_not_go_on() -> None:
    guard = decode_guard()
    verdict = guard.alloc("r1", 0, [99])  # beyond the pool
    assert verdict.kill == {"r1": None} and "out of range" in guard.errors[0]
    assert guard.ledger.request("r1").state == "killed"
    bad = guard.check_attention(0, ["r2"], np.array([[40]]), np.array([4]))
    assert list(bad.kill) == ["r2"]


def test_guard_events_replay_to_the_same_findings(tmp_path: Path) -> None:
    sink = CaptureSink(tmp_path / "d0.jsonl")
    guard = decode_guard(sink=sink)
    serve(guard, "a1", "acme", [1, 2], 32)
    guard.free("a1", 0, [1, 2])
    guard.bootstrap("g1", "p0", "d0", 32)
    guard.alloc("g1", 0, [2, 1])
    guard.xfer_recv("g1", "x1", "p0", 0, [2, 1], tokens=16, nbytes=16384)
    guard.check_attention(0, ["g1"], np.array([[2, 1]]), np.array([32]))
    sink.flush()
    sink.close()
    local = [(f.finding, f.req, f.victim_req, f.pages) for f in guard.findings]
    assert local[0][0] == "transfer_mismatch" and len(local) >= 1
    replayed: list = []
    summary = replay(sink.path.read_text().splitlines(), RULES, replayed.append, replayed.append, Ledger())
    assert summary.bad == 0 and summary.applied == summary.lines
    assert [(f.finding, f.req, f.victim_req, f.pages) for f in replayed] == local


def test_events_are_stamped_with_a_wall_clock_that_never_steps_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nodes' timestamps are compared (RDMA writes one node saw posted into another's pages),
    # so they are the wall clock; a clock stepped back must not reorder a node's events.
    before = time.time_ns()
    clock = WallClock()
    first = clock()
    assert before <= first <= time.time_ns()
    monkeypatch.setattr(time, "time_ns", lambda: first - 5_000_000_000)  # NTP steps back 5 s
    assert clock() == first
    monkeypatch.undo()
    assert clock() >= first


def test_a_prefix_hit_on_freed_pages_goes_on_and_an_evicted_one_is_caught(tmp_path: Path) -> None:
    # vLLM: a1's blocks go back to the free queue with their KV; a2's prompt hits them. The
    # guard lets a2 share and attend (no kill, no finding). g1 then gets page 2 (evicted)
    # while a2 still reads it: the early release names a2, and a2's next launch is stopped.
    sink = CaptureSink(tmp_path / "d0.jsonl")
    guard = decode_guard(sink=sink)
    serve(guard, "a1", "acme", [1, 2], 32)
    assert guard.finish("a1", 1).ok and guard.free("a1", 0, [1, 2]).ok
    assert guard.admit("a2", "acme", 40, "decode").ok
    hit = guard.share("a2", 0, [1, 2], "a1")
    assert hit.ok and not hit.deny and not hit.findings
    assert guard.alloc("a2", 0, [3]).ok and guard.write("a2", 0, [3], [8]).ok
    assert guard.check_attention(0, ["a2"], np.array([[1, 2, 3]]), np.array([40])).ok
    assert guard.admit("g1", "globex", 16, "decode").ok
    early = guard.alloc("g1", 0, [2])
    assert [(f.finding, f.req, f.victim_req, f.victim_tenant, f.pages) for f in early.findings] == [
        ("early_release", "g1", "a2", "acme", (2,))
    ]
    assert guard.write("g1", 0, [2]).ok
    verdict = guard.check_attention(0, ["a2"], np.array([[1, 2, 3]]), np.array([40]))
    assert list(verdict.kill) == ["a2"]
    assert [(f.finding, f.victim_req, f.pages) for f in verdict.findings] == [("foreign_read", "g1", (2,))]
    sink.flush()
    sink.close()
    replayed: list = []
    summary = replay(sink.path.read_text().splitlines(), RULES, replayed.append, replayed.append, Ledger())
    assert summary.bad == 0
    assert [(f.finding, f.req, f.victim_req, f.pages) for f in replayed] == [
        (f.finding, f.req, f.victim_req, f.pages) for f in guard.findings
    ]


def decode_batch(guard: Guard) -> None:
    serve(guard, "a1", "acme", [1], 15)
    serve(guard, "a2", "acme", [2], 16)
    serve(guard, "g1", "globex", [3], 3)


def test_a_step_is_the_batchs_writes_in_one_event_and_one_pass(tmp_path: Path) -> None:
    # One step call does what a write per request and a check would: same state, same events'
    # meaning, and the events are one step (in the capture) instead of three writes.
    stepped = decode_guard(sink=CaptureSink(tmp_path / "step.jsonl"), epoch=1)
    written = decode_guard(epoch=1)
    for guard in (stepped, written):
        decode_batch(guard)
    grants = stepped.alloc_each(0, ["a2"], [4])
    assert grants.ok and written.alloc("a2", 0, [4]).ok
    reqs, pages, slots = ["a1", "a2", "g1"], [1, 4, 3], [16, 1, 4]
    tables, lens = np.array([[1, 0], [2, 4], [3, 0]]), np.array([16, 17, 4])
    verdict = stepped.step(0, reqs, pages, slots, block_tables=tables, context_lens=lens)
    assert verdict.ok and not verdict.findings and not stepped.errors
    for req, page, slot in zip(reqs, pages, slots, strict=True):
        assert written.write(req, 0, [page], [slot]).ok
    assert written.check_attention(0, reqs, tables, lens).ok
    one, other = stepped.ledger.nodes["d0"].pools[0].pages, written.ledger.nodes["d0"].pools[0].pages
    assert (one.state == other.state).all()
    stepped.sink.close()
    events = [e for _, e in read_capture((tmp_path / "step.jsonl").read_text().splitlines())]
    step = events[-1]
    # The batch is named by the handles its admits gave (names travel in admit and finish).
    handles = {e.admit.req: e.admit.handle for e in events if e.WhichOneof("payload") == "admit"}
    assert sorted(handles) == sorted(reqs) and all(handles.values())
    assert (step.epoch, step.seq, list(step.step.handles), list(step.step.pages), list(step.step.slots)) == (
        1,
        len(events),
        [handles[r] for r in reqs],
        pages,
        slots,
    )
    assert not step.step.reqs
    assert events[-2].alloc.req == "a2" and list(events[-2].alloc.pages) == [4]


def test_a_step_with_its_grants_is_the_grants_then_the_step(tmp_path: Path) -> None:
    # step(grants=...) is one step event that carries its grants (Step.grants), and leaves the
    # ledger as alloc_each and step do: a2's new page 4 is granted, then written.
    two_calls = decode_guard(sink=CaptureSink(tmp_path / "two.jsonl"), epoch=1)
    one_call = decode_guard(sink=CaptureSink(tmp_path / "one.jsonl"), epoch=1)
    reqs, pages, slots = ["a1", "a2", "g1"], [1, 4, 3], [16, 1, 4]
    tables, lens = np.array([[1, 0], [2, 4], [3, 0]]), np.array([16, 17, 4])
    for guard in (two_calls, one_call):
        decode_batch(guard)
    assert two_calls.alloc_each(0, ["a2"], [4]).ok
    assert two_calls.step(0, reqs, pages, slots, block_tables=tables, context_lens=lens).ok
    verdict = one_call.step(0, reqs, pages, slots, grants=[0, 1, 0], block_tables=tables, context_lens=lens)
    assert verdict.ok and not one_call.errors and one_call._seq == two_calls._seq - 1
    one, other = one_call.ledger.nodes["d0"].pools[0].pages, two_calls.ledger.nodes["d0"].pools[0].pages
    for name in ("owner", "own", "use", "gen", "writer", "wgen", "valid"):
        assert (getattr(one, name) == getattr(other, name)).all(), name
    for guard in (two_calls, one_call):
        guard.sink.close()
    captured = []
    for name in ("two.jsonl", "one.jsonl"):
        events = [e for _, e in read_capture((tmp_path / name).read_text().splitlines())]
        for event in events:
            event.ts_ns = 0  # the guards' clocks differ
        captured.append(events)
    assert [e.SerializeToString() for e in captured[0][:-2]] == [
        e.SerializeToString() for e in captured[1][:-1]
    ]
    handles = [one_call.handles.of[r] for r in reqs]
    assert captured[1][-1] == pb.Event(
        node="d0",
        seq=one_call._seq,
        epoch=1,
        step={"handles": handles, "counts": [1, 1, 1], "pages": pages, "slots": slots, "grants": [0, 1, 0]},
    )
    # Its meaning in a replay: the same findings as the two events (none here), nothing refused.
    replayed = Ledger()
    for event in captured[1]:
        assert replayed.apply(event) == ()


def test_a_grant_refused_in_a_step_is_refused_by_name_and_the_step_with_it() -> None:
    guard = decode_guard()
    decode_batch(guard)
    seq = guard._seq
    # g1's new page 99 lies outside the pool: its grant is refused by name, a2's still goes;
    # the step, which writes page 99 too, cannot be checked: the whole batch stops.
    verdict = guard.step(0, ["a1", "g1", "a2"], [1, 99, 4], [16, 1, 1], grants=[0, 1, 1])
    assert set(verdict.kill) == {"a1", "g1", "a2"}
    assert [e.split(":")[0] for e in guard.errors] == ["alloc", "step"]
    assert "page 99 out of range" in guard.errors[0]
    pages = guard.ledger.nodes["d0"].pools[0].pages
    assert pages.owner[4] == guard.ledger.request("a2").idx
    assert guard.ledger.nodes["d0"].last_seq == guard._seq and guard.ledger.stats.missing == 0
    assert guard._seq == seq + 4  # a2's grant and the three kills; the refused took no number
    # Grants that do not fit the step are refused with it, every request stopped.
    refused = guard.step(0, ["a1"], [1], [16], grants=[2])
    assert list(refused.kill) == ["a1"] and "grants[0] is 2 of 1 pages" in guard.errors[-1]


def test_a_step_that_writes_into_anothers_page_kills_only_the_writer() -> None:
    guard = decode_guard()
    decode_batch(guard)
    # g1 writes into page 2, a2's: a late write; a1 and a2 (which wrote nothing) go on.
    verdict = guard.step(0, ["a1", "g1", "a2"], [1, 2], [16, 4], counts=[1, 1, 0])
    assert list(verdict.kill) == ["g1"]
    (finding,) = verdict.findings
    assert (finding.finding, finding.req, finding.victim_req, finding.pages) == (
        "late_write",
        "g1",
        "a2",
        (2,),
    )
    # The check in the same call: g1, killed, is dropped again if it is still batched.
    tables, lens = np.array([[1], [3]]), np.array([16, 4])
    again = guard.step(0, ["a1", "g1"], [1, 3], [16, 4], block_tables=tables, context_lens=lens)
    assert "g1" in again.kill and "a1" not in again.kill


def test_a_step_the_guard_cannot_check_goes_no_further() -> None:
    guard = decode_guard()
    decode_batch(guard)
    seq = guard._seq
    refused = guard.step(0, ["a1", "g1"], [1, 99], [16, 4])  # page 99 is outside the pool of 32
    assert set(refused.kill) == {"a1", "g1"} and "page 99 out of range" in guard.errors[-1]
    refused = guard.step(0, ["a1"], [1, 3], counts=[1])  # the counts cover one page of two
    assert "counts add up to 1, pages lists 2" in guard.errors[-1]
    assert guard._seq == seq + 2  # the kills' records; the refused steps took no number


def test_grants_to_several_requests_are_numbered_and_judged_as_one_each() -> None:
    guard = decode_guard(epoch=3)
    decode_batch(guard)
    seq = guard._seq
    verdict = guard.alloc_each(0, ["a1", "g1", "a2"], [5, 6, 2, 7], counts=[1, 2, 1])
    # a2 is granted page 2 again while it still holds it: judged as alloc() would.
    assert [f.finding for f in verdict.findings] == ["early_release"]
    assert guard._seq == seq + 3
    pages = guard.ledger.nodes["d0"].pools[0].pages
    idx = {r: guard.ledger.request(r).idx for r in ("a1", "g1", "a2")}
    assert pages.owner[[5, 6, 2, 7]].tolist() == [idx["a1"], idx["g1"], idx["g1"], idx["a2"]]
    # One that cannot be applied is refused alone; the rest are numbered again, without a gap.
    verdict = guard.alloc_each(0, ["a1", "g1", "a2"], [8, 99, 9])
    assert list(verdict.kill) == ["g1"] and guard._seq == seq + 3 + 2 + 1  # two grants, g1's kill
    assert guard.ledger.nodes["d0"].last_seq == guard._seq
    assert guard.ledger.stats.missing == 0


def test_a_handle_its_ledger_does_not_know_is_said_and_the_step_goes_by_names() -> None:
    # The guard's numbers and its ledger disagree (what a bug would do): the step is not
    # judged against another request, nor is the batch stopped; it goes by names, and the
    # guard says why.
    guard = decode_guard(epoch=1)
    decode_batch(guard)
    guard.handles.of["a1"] = 77  # a number no admit gave
    verdict = guard.step(0, ["a1", "a2", "g1"], [1, 2, 3], [16, 1, 4])
    assert verdict.ok and not verdict.kill
    assert "handle 77 on node d0" in guard.errors[-1] and "named by names instead" in guard.errors[-1]
    assert guard.ledger.nodes["d0"].last_seq == guard._seq and guard.ledger.stats.bad["handle"] == 1
    pages = guard.ledger.nodes["d0"].pools[0].pages
    assert pages.writer[1] == guard.ledger.request("a1").idx


def test_a_kill_that_reaches_the_engine_after_the_request_finished_is_recorded_as_late(
    tmp_path: Path,
) -> None:
    # The daemon's kill of a request that already finished here stopped nothing: the guard
    # records it as late (its response had left), and its ledger keeps it finished.
    from kvguard.proto.kvguard.v1 import services_pb2 as svc

    guard = decode_guard(sink=CaptureSink(tmp_path / "late.jsonl"), epoch=1)
    decode_batch(guard)
    assert guard.finish("a1", 15).ok
    kill = svc.KillRequest(req="a1", finding="stale_read", rule="stale_read", message="m")
    guard.command(svc.Command(id=1, kill=kill))
    guard.command(
        svc.Command(id=2, kill=svc.KillRequest(req="a2", finding="stale_read", rule="r", message="m"))
    )
    guard.sink.close()
    kills = {
        e.kill.req: e.kill
        for _, e in read_capture((tmp_path / "late.jsonl").read_text().splitlines())
        if e.HasField("kill")
    }
    assert kills["a1"].late and kills["a1"].by == "daemon"
    assert not kills["a2"].late  # a2 still runs: this kill takes effect
    assert guard.ledger.request("a1").state == "finished" and guard.ledger.request("a2").state == "killed"
