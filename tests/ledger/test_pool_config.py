"""Pools as engines report them: reserved pages (ids never handed out: SGLang's padding page 0,
vLLM's null block) in the capacity check and in grants, and config drift between prefill and
decode pools of one model in one cluster, known before any transfer (docs/integrator.md `pool`)."""

from __future__ import annotations

import pytest

from kvguard.ledger import snapshot
from kvguard.ledger.findings import Finding
from kvguard.ledger.ledger import BadEvent, Ledger
from kvguard.proto import wire
from kvguard.proto.builder import EventLog


class Nodes:
    def __init__(self) -> None:
        self.log = EventLog()
        self.ledger = Ledger()

    def run(self, node: str, payload: str, **fields: object) -> list[Finding]:
        return list(self.ledger.apply(self.log.add(node, payload, **fields)))

    def pool(self, node: str, role: str, **fields: object) -> list[Finding]:
        report: dict[str, object] = {
            "pool": 0,
            "role": role,
            "page_size": 16,
            "num_pages": 64,
            "context_len": 1024,
        }
        return self.run(node, "pool", **(report | fields))


def drift(found: list[Finding]) -> list[tuple[str, str, str, str, str, str]]:
    """(node, field, prefill node, decode node, prefill value, decode value) of each drift found."""
    return [
        (
            f.node,
            f.details["field"],
            f.details["prefill_node"],
            f.details["decode_node"],
            f.details["prefill"],
            f.details["decode"],
        )
        for f in found
        if f.finding == "config_drift"
    ]


class TestReservedPages:
    def test_reserved_pages_hold_no_tokens(self) -> None:
        n = Nodes()
        # SGLang: 16 usable pages of 16 (ids 1..16) and padding page 0: exactly 256 tokens.
        assert n.pool("n0", "colocated", num_pages=17, reserved_pages=1, context_len=256) == []
        assert n.ledger.nodes["n0"].pools[0].tokens == 256
        (found,) = n.pool("n1", "colocated", num_pages=16, reserved_pages=1, context_len=256)
        assert (found.finding, found.node, found.details["pool_tokens"], found.details["limit"]) == (
            "config_drift",
            "n1",
            "240",
            "256",
        )
        assert "15 pages of 16, 1 reserved" in found.message

    def test_admission_is_checked_against_the_usable_pages(self) -> None:
        n = Nodes()
        n.pool("n0", "colocated", num_pages=17, reserved_pages=1, context_len=0)
        assert n.run("n0", "admit", req="a", tenant="acme", prompt_tokens=256, stage="prefill") == []
        (found,) = n.run("n0", "admit", req="b", tenant="acme", prompt_tokens=257, stage="prefill")
        assert (found.finding, found.req, found.details["limit"]) == ("config_drift", "b", "256")

    def test_a_pool_with_nothing_to_hand_out_is_refused(self) -> None:
        n = Nodes()
        with pytest.raises(BadEvent, match="reserved_pages 4 leaves none of its 4 pages"):
            n.pool("n0", "colocated", num_pages=4, reserved_pages=4)
        assert "n0" not in n.ledger.nodes or not n.ledger.nodes["n0"].pools

    def test_a_grant_of_a_reserved_page_is_an_early_release_with_no_victim(self) -> None:
        n = Nodes()
        n.pool("n0", "colocated", num_pages=17, reserved_pages=1)
        n.run("n0", "admit", req="a", tenant="acme", prompt_tokens=32, stage="prefill")
        (found,) = n.run("n0", "alloc", req="a", pool=0, pages=[0, 1])
        assert (found.finding, found.req, found.victim_req, found.pages, found.details["users"]) == (
            "early_release",
            "a",
            "",
            (0,),
            "reserved",
        )
        # The grant is applied as the engine made it: a's own KV in page 0 reads clean.
        assert n.run("n0", "write", req="a", pool=0, pages=[0, 1]) == []
        assert n.run("n0", "read", reads=[{"req": "a", "pool": 0, "pages": [0, 1], "tokens": 32}]) == []
        assert n.run("n0", "free", req="a", pool=0, pages=[0, 1]) == []
        assert [f.pages for f in n.run("n0", "alloc", req="b", pool=0, pages=[0])] == [(0,)]

    def test_the_c_clean_path_leaves_a_reserved_grant_to_the_handlers(self) -> None:
        log = EventLog()
        log.add("n0", "pool", pool=0, role="colocated", page_size=16, num_pages=9, reserved_pages=2)
        for req, pages in (("a", [2, 3]), ("b", [1]), ("c", [4])):
            log.add("n0", "alloc", req=req, pool=0, pages=pages)
            log.add("n0", "write", req=req, pool=0, pages=pages)
        bodies = [e.SerializeToString() for e in log.events]
        by_one, in_runs = Ledger(), Ledger()
        one = [f for body in bodies for f in by_one.apply_serialized(body)]
        batch, found, i = wire.batch_of(bodies), [], 0
        while i < len(bodies):
            i = in_runs.apply_clean(batch, i, len(bodies), "n0")
            if i < len(bodies):
                found += in_runs.apply_serialized(bodies[i], "n0")
                i += 1
        assert [(f.finding, f.req, f.pages) for f in found] == [("early_release", "b", (1,))]
        assert [(f.finding, f.req, f.pages) for f in one] == [("early_release", "b", (1,))]
        assert snapshot.dump(in_runs) == snapshot.dump(by_one)
        pages = in_runs.nodes["n0"].pools[0].pages
        assert pages.reserved.tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0]

    def test_a_new_report_moves_the_reserved_ids(self) -> None:
        n = Nodes()
        n.pool("n0", "colocated", num_pages=17, reserved_pages=1, context_len=0)
        n.pool("n0", "colocated", num_pages=17, reserved_pages=0, context_len=0)
        assert n.run("n0", "alloc", req="a", pool=0, pages=[0]) == []


class TestClusterDrift:
    def test_prefill_and_decode_of_one_model_disagree_before_any_transfer(self) -> None:
        n = Nodes()
        assert n.pool("p0", "prefill", model="llama-70b", kv_dtype="fp8") == []
        found = n.pool("d0", "decode", model="llama-70b", kv_dtype="bf16", page_size=32)
        assert sorted(drift(found)) == [
            ("d0", "kv_dtype", "p0", "d0", "fp8", "bf16"),
            ("d0", "page_size", "p0", "d0", "16", "32"),
        ]
        assert all(
            f.pool == 0 and f.details["cluster"] == "" and "before any transfer" in f.message for f in found
        )
        # Once per pair: the bootstrap that pairs them, and a repeated report, say nothing new.
        n.run("p0", "admit", req="r", tenant="acme", prompt_tokens=10, stage="prefill")
        assert n.run("p0", "bootstrap", req="r", prefill_node="p0", decode_node="d0", prompt_tokens=10) == []
        assert n.pool("d0", "decode", model="llama-70b", kv_dtype="bf16", page_size=32) == []
        # Another decode node of the cluster is another pair.
        assert drift(n.pool("d1", "decode", model="llama-70b", kv_dtype="bf16")) == [
            ("d1", "kv_dtype", "p0", "d1", "fp8", "bf16")
        ]

    def test_a_later_prefill_is_compared_with_the_decode_pools_reported_before(self) -> None:
        n = Nodes()
        n.pool("d0", "decode", model="m", cluster="east", pool=1)
        (found,) = n.pool("p0", "prefill", model="m", cluster="east", page_size=64, pool=2)
        assert drift([found]) == [("p0", "page_size", "p0", "d0", "64", "16")]
        assert (found.pool, found.details["prefill_pool"], found.details["decode_pool"]) == (2, "2", "1")
        assert found.details["cluster"] == "east" and found.details["model"] == "m"

    def test_pools_of_different_clusters_or_models_are_never_compared(self) -> None:
        n = Nodes()
        n.pool("p0", "prefill", model="m", cluster="east", page_size=16)
        assert n.pool("d0", "decode", model="m", cluster="west", page_size=32) == []
        assert n.pool("d1", "decode", model="m", page_size=32) == []  # the default cluster
        assert n.pool("d2", "decode", model="other", cluster="east", page_size=32) == []
        assert n.pool("d3", "decode", cluster="east", page_size=32) == []  # no model named
        assert n.pool("c0", "colocated", model="m", cluster="east", page_size=32) == []
        assert n.pool("p1", "prefill", model="m", cluster="east", page_size=16) == []  # prefill with prefill

    def test_a_snapshot_keeps_the_pairs_reported(self) -> None:
        n = Nodes()
        n.pool("p0", "prefill", model="m", kv_dtype="fp8")
        assert len(n.pool("d0", "decode", model="m", kv_dtype="bf16")) == 1
        n.ledger = snapshot.load(snapshot.dump(n.ledger))
        assert n.pool("d0", "decode", model="m", kv_dtype="bf16") == []


class TestProbedPools:
    """Pools read by probes that see different parts of an engine (a log, an endpoint)."""

    def test_a_field_stated_later_is_filled_in_not_a_change(self) -> None:
        n = Nodes()
        assert n.pool("n0", "colocated", context_len=0, kv_dtype="") == []
        assert n.pool("n0", "colocated", context_len=64, kv_dtype="bfloat16") == []
        changed = n.pool("n0", "colocated", context_len=128, kv_dtype="bfloat16")
        assert [f.details.get("changed") for f in changed] == ["context_len"]

    def test_dtype_spellings_and_an_unstated_dtype_are_not_drift(self) -> None:
        n = Nodes()
        assert n.pool("p0", "prefill", model="m", kv_dtype="fp8") == []
        assert n.pool("d0", "decode", model="m", kv_dtype="fp8_e4m3") == []
        assert n.pool("d1", "decode", model="m", kv_dtype="") == []
        found = n.pool("d2", "decode", model="m", kv_dtype="bf16")
        assert drift(found) == [("d2", "kv_dtype", "p0", "d2", "fp8", "bf16")]
