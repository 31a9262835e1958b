"""The CUDA shim's reports judged by the ledger (ledger/witness.py): what each finding says,
what is refused, and what is not a finding."""

from __future__ import annotations

import pytest

from kvguard.ledger.findings import BadEvent
from kvguard.ledger.ledger import Ledger
from kvguard.proto import pb

BASE = 0x7F0000000000


def ledger_with_pool() -> Ledger:
    ledger = Ledger()
    ledger.apply(
        pb.Event(node="d0", seq=1, ts_ns=1, pool=pb.PoolReport(role="decode", page_size=16, num_pages=64))
    )
    return ledger


def shim(ledger: Ledger, seq: int, **payload: object) -> list[object]:
    return list(ledger.apply(pb.Event(node="d0/shim", seq=seq, ts_ns=10 + seq, **payload)))  # type: ignore[arg-type]


def test_an_unguarded_launch_names_the_kernel_node_and_step_once() -> None:
    ledger = ledger_with_pool()
    x = pb.Launches(
        launches=9, attention=3, checked=2, unguarded=1, steps=41, checks=42, kernel="k", kernel_steps=41
    )
    (found,) = shim(ledger, 1, launches=x)
    assert (found.finding, found.node, found.details["kernel"], found.details["step"]) == (  # type: ignore[attr-defined]
        "unguarded_attention",
        "d0",
        "k",
        "41",
    )
    assert "after the guard's step 41 ended" in found.message  # type: ignore[attr-defined]
    assert shim(ledger, 2, launches=x) == []  # the same path again: counted, not repeated
    graph = pb.Launches(attention=1, unguarded=1, kernel="k", kernel_steps=50, kernel_in_graph=True)
    (replay,) = shim(ledger, 3, launches=graph)
    assert "in a CUDA graph's replay" in replay.message and replay.details["graph"] == "1"  # type: ignore[attr-defined]


def test_checked_launches_are_not_findings_and_a_blind_witness_is() -> None:
    ledger = ledger_with_pool()

    def launches(seq: int, **counts: int) -> list[object]:
        return shim(ledger, seq, launches=pb.Launches(judged=True, **counts))

    assert launches(1, launches=90, attention=30, checked=30, steps=30, checks=30) == []
    # A step with no attention (its requests all stopped before the forward) is no blindness.
    assert launches(2, launches=5, steps=31, checks=31, quiet_steps=1) == []
    assert launches(3, steps=38, checks=38, quiet_steps=7) == []
    (blind,) = launches(4, launches=40, steps=47, checks=47, quiet_steps=8)
    assert (blind.finding, blind.node) == ("anomaly", "d0")  # type: ignore[attr-defined]
    assert "no attention kernel launched in the last 8 steps" in blind.message  # type: ignore[attr-defined]
    assert launches(5, steps=55, checks=55, quiet_steps=16) == []  # said once


def test_pool_memory_findings_carry_the_numbers() -> None:
    ledger = ledger_with_pool()
    bound = pb.PoolMemory(
        pool=0, kind="bound", base=BASE, bytes=4096, covered=4096, call="cudaMalloc", allocations=3
    )
    assert shim(ledger, 1, pool_memory=bound) == []
    short = pb.PoolMemory(
        pool=0, kind="bound", base=BASE, bytes=8192, covered=1024, call="cuMemMap", allocations=3
    )
    (drift,) = shim(ledger, 2, pool_memory=short)
    assert (drift.finding, drift.pool, drift.details["covered"]) == ("config_drift", 0, "1024")  # type: ignore[attr-defined]
    assert "7168 bytes of its pages lie outside" in drift.message  # type: ignore[attr-defined]
    unseen = pb.PoolMemory(pool=1, kind="bound", base=BASE, bytes=8192, covered=0)
    (none,) = shim(ledger, 3, pool_memory=unseen)
    assert "saw no allocation at all" in none.message  # type: ignore[attr-defined]
    freed = pb.PoolMemory(
        pool=0, kind="freed", base=BASE, bytes=4096, lo=BASE, hi=BASE + 4096, call="cuMemFree"
    )
    assert shim(ledger, 4, pool_memory=freed) == []  # no request holds a page of it
    ledger.apply(
        pb.Event(
            node="d0",
            seq=2,
            ts_ns=20,
            admit=pb.Admit(req="r1", tenant="acme", prompt_tokens=9, stage="decode"),
        )
    )
    ledger.apply(pb.Event(node="d0", seq=3, ts_ns=21, alloc=pb.Alloc(req="r1", pool=0, pages=[4, 9])))
    (gone,) = shim(ledger, 5, pool_memory=freed)
    assert (gone.finding, gone.node, gone.pages, gone.details["requests"]) == ("anomaly", "d0", (4, 9), "1")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ({"launches": pb.Launches(attention=1, checked=1, unguarded=1)}, "1 checked and 1 unguarded of 1"),
        ({"launches": pb.Launches(kernel="k" * 1025)}, "kernel name of 1025 characters"),
        ({"pool_memory": pb.PoolMemory(kind="gone")}, "kind 'gone' is not one of bound, freed, unmapped"),
        (
            {"pool_memory": pb.PoolMemory(kind="bound", bytes=1, covered=2)},
            "2 bytes covered of a 1-byte region",
        ),
        (
            {"pool_memory": pb.PoolMemory(kind="freed", base=BASE, bytes=16, lo=BASE, hi=BASE + 17)},
            "not within",
        ),
    ],
)
def test_bad_reports_are_refused_and_change_nothing(payload: dict[str, object], reason: str) -> None:
    ledger = ledger_with_pool()
    with pytest.raises(BadEvent, match=reason):
        shim(ledger, 1, **payload)
    assert ledger.nodes.get("d0/shim") is None or ledger.nodes["d0/shim"].last_seq == 0
