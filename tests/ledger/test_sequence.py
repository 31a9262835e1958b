"""A node's sequence numbers: gaps kept exactly (ledger/sequence.py), and every field the
store keeps checked at the door (proto/limits.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.ledger import BadEvent, Ledger, sequence, snapshot
from kvguard.ledger.sequence import Gaps
from kvguard.proto import limits, pb


def admit(seq: int, req: str = "", tenant: str = "acme", node: str = "n0", epoch: int = 0) -> pb.Event:
    return pb.Event(
        node=node, seq=seq, epoch=epoch, admit=pb.Admit(req=req or f"r{seq}", tenant=tenant, stage="decode")
    )


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(st.integers(1, 60), max_size=80))
def test_any_order_of_arrival_applies_each_number_once(seqs: list[int]) -> None:
    ledger = Ledger()
    applied: set[int] = set()
    for seq in seqs:
        try:
            ledger.apply(admit(seq))
        except BadEvent as exc:
            assert exc.kind == "repeat" and seq in applied
            continue
        assert seq not in applied
        applied.add(seq)
    node = ledger.nodes.get("n0")
    if node is None:
        return
    top = max(applied)
    assert node.last_seq == top
    assert {s for lo, hi in node.gaps.ranges() for s in range(lo, hi + 1)} == set(range(1, top + 1)) - applied
    missing = [s for s in range(1, top + 1) if s not in applied]
    assert node.durable_seq == (missing[0] - 1 if missing else top)


def test_past_the_bound_the_lowest_gap_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sequence, "MAX_GAPS", 2)
    ledger = Ledger()
    for seq in (2, 4, 6):  # gaps at 1, 3, 5: the first is given up
        ledger.apply(admit(seq))
    assert ledger.nodes["n0"].gaps.ranges() == [(3, 3), (5, 5)] and ledger.stats.gaps_given_up == 1
    with pytest.raises(BadEvent, match="repeats"):
        ledger.apply(admit(1))
    ledger.apply(admit(3))


def test_gaps_split_shrink_and_close() -> None:
    gaps = Gaps([(2, 9)])
    for seq in (5, 2, 9):
        gaps.fill(seq)
    assert gaps.ranges() == [(3, 4), (6, 8)] and gaps.durable(20) == 2
    for seq in (3, 4, 6, 7, 8):
        gaps.fill(seq)
    assert not gaps and gaps.durable(20) == 20


@pytest.mark.parametrize(
    ("event", "says"),
    [
        (admit(2**63), "seq 9223372036854775808 or epoch 0 is over"),
        (admit(1, epoch=2**64 - 1), "or epoch 18446744073709551615 is over"),
        (admit(1, node="n" * 129), "node name 'nnn.*' is over 128 bytes"),
        (admit(1, node="n\x00"), "node name 'n.*' holds a NUL character"),
        (admit(1, req="r" * 257), "is over 256 bytes"),
        (admit(1, req="r\x00"), "holds a NUL character"),
        (admit(1, tenant="é" * 65), "tenant 'ééé.*' is over 128 bytes"),
    ],
    ids=["seq", "epoch", "node", "node-nul", "req", "req-nul", "tenant"],
)
def test_what_the_store_cannot_keep_is_refused_at_the_door(event: pb.Event, says: str) -> None:
    ledger = Ledger()
    for apply in (ledger.apply, lambda e: ledger.apply_serialized(e.SerializeToString())):
        with pytest.raises(BadEvent, match=says) as refused:
            apply(event)
        assert refused.value.kind == "out_of_range"
    assert ledger.stats.events.total() == 0


def test_a_too_long_request_id_in_a_grant_takes_the_handlers_path_and_is_refused() -> None:
    # The C clean path makes a request on its first grant: a name the store cannot keep is
    # left to the handlers, which refuse it by name.
    ledger = Ledger()
    ledger.apply(
        pb.Event(node="n0", seq=1, pool=pb.PoolReport(pool=0, role="decode", page_size=16, num_pages=8))
    )
    for req, says in (("r" * 300, "over 256 bytes"), ("r\x00", "NUL")):
        grant = pb.Event(node="n0", seq=2, alloc=pb.Alloc(req=req, pool=0, pages=[1]))
        with pytest.raises(BadEvent, match=says):
            ledger.apply_serialized(grant.SerializeToString(), "n0")
    assert ledger.nodes["n0"].last_seq == 1 and ledger.requests.index == {}


def test_a_snapshot_keeps_the_gaps() -> None:
    ledger = Ledger()
    for seq in (1, 4, 9):
        ledger.apply(admit(seq))
    again = snapshot.load(snapshot.dump(ledger))
    assert again.nodes["n0"].gaps.ranges() == [(2, 3), (5, 8)] and again.nodes["n0"].durable_seq == 1
    again.apply(admit(2))  # still a gap to fill, not a repeat
    with pytest.raises(BadEvent, match="repeats"):
        again.apply(admit(4))


def test_a_forged_number_far_ahead_is_refused_and_moves_no_count() -> None:
    ledger = Ledger()
    for seq in (1, 2):
        ledger.apply(admit(seq))
    before = (ledger.stats.missing, ledger.nodes["n0"].last_seq, ledger.nodes["n0"].gaps.ranges())
    for forged in (2**62, 2**63 - 1, 2 + limits.SEQ_JUMP_MAX + 1):
        with pytest.raises(BadEvent, match="past the last applied") as refused:
            ledger.apply(admit(forged))
        assert refused.value.kind == "out_of_range"
        assert (ledger.stats.missing, ledger.nodes["n0"].last_seq, ledger.nodes["n0"].gaps.ranges()) == before
    ledger.apply(admit(3))  # the node's next goes on as if nothing came between
    assert ledger.stats.missing == 0 and ledger.last_missing == 0
    ledger.apply(admit(3 + limits.SEQ_JUMP_MAX))  # a jump within the bound is events lost, counted
    assert ledger.stats.missing == limits.SEQ_JUMP_MAX - 1
