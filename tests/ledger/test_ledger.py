"""The ledger's own guarantees, beyond the rule fixtures: sequence handling, bad events that
change nothing, de-duplication, per-request accounting, and the less common page paths.

Transfers between nodes, RDMA writes seen from outside, retirement, snapshots and prefix caches
have files of their own (test_transfers.py, test_remote_writes.py, test_retirement.py,
test_snapshot.py, test_prefix_cache.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kvguard.ledger.findings import Finding
from kvguard.ledger.ledger import BadEvent, Ledger
from kvguard.proto import pb
from kvguard.proto.builder import EventLog


def ev(node: str, seq: int, payload: str, **fields: object) -> pb.Event:
    return pb.Event(node=node, seq=seq, ts_ns=seq * 10, **{payload: fields})


def pool_event(node: str = "n0", seq: int = 1, pages: int = 16, size: int = 16) -> pb.Event:
    return ev(
        node, seq, "pool", pool=0, role="colocated", page_size=size, num_pages=pages, context_len=pages * size
    )


def snapshot(ledger: Ledger) -> dict[str, np.ndarray]:
    pages = ledger.nodes["n0"].pools[0].pages
    return {
        name: copy.deepcopy(getattr(pages, name))
        for name in pages.__slots__
        if name not in ("num_pages", "page_size")
    }


def kinds(findings: list[Finding]) -> list[str]:
    return [f.finding for f in findings]


class TestSequence:
    def test_repeat_is_refused_and_not_applied(self) -> None:
        ledger = Ledger()
        ledger.apply(pool_event())
        ledger.apply(ev("n0", 2, "alloc", req="r", pool=0, pages=[1]))
        with pytest.raises(BadEvent) as err:
            ledger.apply(ev("n0", 2, "alloc", req="q", pool=0, pages=[2]))
        assert err.value.kind == "repeat" and "sequence number 2 of node n0 repeats" in str(err.value)
        assert ledger.request("q") is None
        assert ledger.stats.bad["repeat"] == 1

    def test_gap_is_reported_and_the_event_applied(self) -> None:
        ledger = Ledger()
        ledger.apply(pool_event())
        assert ledger.last_missing == 0
        ledger.apply(ev("n0", 4, "alloc", req="r", pool=0, pages=[3]))
        assert ledger.last_missing == 2 and ledger.stats.missing == 2
        assert ledger.nodes["n0"].pools[0].pages.owner[3] == ledger.request("r").idx
        ledger.apply(ev("n0", 5, "free", req="r", pool=0, pages=[3]))
        assert ledger.last_missing == 0

    def test_nodes_are_sequenced_independently(self) -> None:
        ledger = Ledger()
        ledger.apply(pool_event("a", 1))
        ledger.apply(pool_event("b", 1))
        ledger.apply(ev("a", 2, "abort", req="r"))
        assert ledger.nodes["a"].last_seq == 2 and ledger.nodes["b"].last_seq == 1

    def test_sequence_numbers_start_at_one(self) -> None:
        with pytest.raises(BadEvent, match="start at 1"):
            Ledger().apply(pb.Event(node="n0", abort=pb.Abort(req="r")))

    def test_a_malformed_event_does_not_advance_the_sequence(self) -> None:
        ledger = Ledger()
        ledger.apply(pool_event())
        with pytest.raises(BadEvent):
            ledger.apply(ev("n0", 99, "alloc", req="r", pool=7, pages=[1]))
        ledger.apply(ev("n0", 2, "alloc", req="r", pool=0, pages=[1]))
        assert ledger.last_missing == 0 and ledger.nodes["n0"].last_seq == 2


class TestBadEventsChangeNothing:
    @pytest.mark.parametrize(
        ("payload", "fields", "reason"),
        [
            (
                "alloc",
                {"req": "r", "pool": 0, "pages": [2, 16]},
                "alloc: page 16 out of range for pool 0 of node n0 (16 pages)",
            ),
            (
                "free",
                {"req": "a", "pool": 0, "pages": [1, 99, 100]},
                "page 99 out of range for pool 0 of node n0 (16 pages) (and 1 more)",
            ),
            ("write", {"req": "a", "pool": 0, "pages": [1, 2], "slots": [16]}, "1 slots for 2 pages"),
            ("write", {"req": "a", "pool": 0, "pages": [1], "slots": [17]}, "17 valid slots in a page of 16"),
            (
                "hold",
                {"req": "a", "pool": 0, "pages": [1], "holder": "cache"},
                "holder 'cache' is not one of",
            ),
            ("hold", {"req": "a", "pool": 0, "pages": [40], "holder": "offload"}, "page 40 out of range"),
            ("release", {"req": "a", "pool": 0, "pages": [40], "holder": "offload"}, "page 40 out of range"),
            ("share", {"req": "b", "pool": 0, "pages": [1, 20], "origin_req": "a"}, "page 20 out of range"),
            ("scrub", {"pool": 0, "pages": [16]}, "page 16 out of range"),
            # A page listed twice would count as two (use, live grants, holds).
            ("alloc", {"req": "r", "pool": 0, "pages": [5, 6, 5]}, "alloc: page 5 is listed twice"),
            ("free", {"req": "a", "pool": 0, "pages": [1, 1]}, "free: page 1 is listed twice"),
            ("write", {"req": "a", "pool": 0, "pages": [2, 1, 2]}, "write: page 2 is listed twice"),
            ("hold", {"req": "a", "pool": 0, "pages": [1, 1], "holder": "offload"}, "page 1 is listed twice"),
            ("share", {"req": "b", "pool": 0, "pages": [1, 1], "origin_req": "a"}, "page 1 is listed twice"),
            ("alloc", {"req": "r", "pool": 3, "pages": [1]}, "pool 3 of node n0 was never reported"),
            ("alloc", {"pool": 0, "pages": [1]}, "alloc event has no req"),
            ("admit", {"req": "r", "stage": "encode"}, "stage 'encode' is not one of"),
            ("pool", {"pool": 1, "role": "prefill", "page_size": 0, "num_pages": 8}, "page_size 0 is not in"),
            ("pool", {"pool": 1, "role": "router", "page_size": 16, "num_pages": 8}, "role 'router'"),
            (
                "xfer_send",
                {"req": "a", "xfer": "x", "pool": 0, "pages": [1], "tokens": 16, "status": "ok"},
                "status 'ok'",
            ),
            (
                "xfer_recv",
                {"req": "a", "pool": 0, "pages": [1], "tokens": 16, "status": "done"},
                "xfer (the transfer id) is required",
            ),
            (
                "xfer_recv",
                {"req": "a", "xfer": "x", "pool": 0, "pages": [1], "tokens": 17, "status": "done"},
                "17 tokens need 2 pages",
            ),
            (
                "xfer_send",
                {
                    "req": "a",
                    "xfer": "x",
                    "pool": 0,
                    "pages": [1, 2],
                    "tokens": 20,
                    "checksums": [1],
                    "status": "done",
                },
                "1 checksums for 2 pages",
            ),
            ("bootstrap", {"req": "a", "prefill_node": "p0"}, "prefill_node and decode_node are required"),
        ],
    )
    def test_bad_event(self, payload: str, fields: dict[str, object], reason: str) -> None:
        ledger = Ledger()
        ledger.apply(pool_event())
        ledger.apply(ev("n0", 2, "alloc", req="a", pool=0, pages=[1, 2]))
        ledger.apply(ev("n0", 3, "reject", req="a", reason="too long"))  # progress by "a" would be a finding
        before, reported = snapshot(ledger), set(ledger.findings.reported)
        with pytest.raises(BadEvent) as err:
            ledger.apply(ev("n0", 4, payload, **fields))
        assert reason in str(err.value)
        after = snapshot(ledger)
        for name in before:
            assert np.array_equal(before[name], after[name]), f"{name} changed"
        assert ledger.findings.reported == reported
        assert ledger.stats.bad["malformed"] == 1

    def test_a_read_launch_is_validated_whole(self) -> None:
        ledger = Ledger()
        ledger.apply(pool_event())
        ledger.apply(ev("n0", 2, "alloc", req="a", pool=0, pages=[1]))
        ledger.apply(ev("n0", 3, "abort", req="a"))
        reads = [
            {"req": "a", "pool": 0, "pages": [1], "tokens": 16},
            {"req": "b", "pool": 0, "pages": [30], "tokens": 1},
        ]
        with pytest.raises(BadEvent, match="read: page 30 out of range"):
            ledger.apply(ev("n0", 4, "read", reads=reads))
        # The valid first entry did not consume a's rejected_progress report.
        found = ledger.apply(ev("n0", 5, "read", reads=reads[:1]))
        assert "rejected_progress" in kinds(list(found))

    def test_a_read_of_more_tokens_than_its_pages_hold(self) -> None:
        ledger = Ledger()
        ledger.apply(pool_event())
        with pytest.raises(BadEvent, match="read of 33 tokens needs 3 pages of 16 but lists 2"):
            ledger.apply(ev("n0", 2, "read", reads=[{"req": "a", "pool": 0, "pages": [1, 2], "tokens": 33}]))

    def test_a_read_may_list_a_page_twice_and_is_judged(self) -> None:
        # Block tables repeat a padding page; a read changes nothing, so it is judged, not refused.
        ledger = Ledger()
        ledger.apply(pool_event())
        ledger.apply(ev("n0", 2, "alloc", req="a", pool=0, pages=[1]))
        ledger.apply(ev("n0", 3, "write", req="a", pool=0, pages=[1]))
        found = ledger.apply(
            ev("n0", 4, "read", reads=[{"req": "a", "pool": 0, "pages": [1, 0, 0], "tokens": 48}])
        )
        assert [(f.finding, sorted(f.pages)) for f in found] == [("foreign_read", [0, 0])]


class TestPages:
    def setup_method(self) -> None:
        self.log = EventLog()
        self.log.add("n0", "pool", pool=0, role="colocated", page_size=16, num_pages=16, context_len=256)
        self.ledger = Ledger()

    def run(self, payload: str, **fields: object) -> list[Finding]:
        return list(self.ledger.apply(self.log.add("n0", payload, **fields)))

    def start(self) -> None:
        for event in self.log.events:
            self.ledger.apply(event)

    def test_a_stale_read_repeated_every_step_is_reported_once(self) -> None:
        self.start()
        self.run("admit", req="a", tenant="acme", stage="prefill")
        self.run("alloc", req="a", pool=0, pages=[1])
        self.run("write", req="a", pool=0, pages=[1])
        self.run("free", req="a", pool=0, pages=[1])
        self.run("admit", req="g", tenant="globex", stage="prefill")
        self.run("alloc", req="g", pool=0, pages=[1])
        first = self.run("read", reads=[{"req": "g", "pool": 0, "pages": [1], "tokens": 16}])
        assert [(f.finding, f.victim_req, f.victim_tenant) for f in first] == [("stale_read", "a", "acme")]
        for _ in range(5):
            assert self.run("read", reads=[{"req": "g", "pool": 0, "pages": [1], "tokens": 16}]) == []
        assert self.ledger.stats.suppressed == 5 and self.ledger.stats.findings["stale_read"] == 1

    def test_a_short_page_before_the_last_is_a_stale_read(self) -> None:
        # Only the last page of a context may be partly written; a page before it is read
        # in full, so its slots beyond what the reader wrote hold the previous owner's KV.
        self.start()
        self.run("admit", req="a", tenant="acme", stage="prefill")
        self.run("alloc", req="a", pool=0, pages=[1, 2])
        self.run("write", req="a", pool=0, pages=[1, 2])
        self.run("free", req="a", pool=0, pages=[1, 2])
        self.run("admit", req="g", tenant="globex", stage="prefill")
        self.run("alloc", req="g", pool=0, pages=[1, 2])
        self.run("write", req="g", pool=0, pages=[1, 2], slots=[8, 16])
        found = self.run("read", reads=[{"req": "g", "pool": 0, "pages": [1, 2], "tokens": 32}])
        assert [(f.finding, f.victim_req, f.victim_tenant, f.pages) for f in found] == [
            ("stale_read", "a", "acme", (1,))
        ]
        # The same short page as the last page of a shorter context is clean.
        assert self.run("read", reads=[{"req": "g", "pool": 0, "pages": [2, 1], "tokens": 24}]) == []

    def test_without_dedupe_every_read_is_reported(self) -> None:
        self.ledger = Ledger(dedupe=False)
        self.start()
        self.run("alloc", req="g", pool=0, pages=[1])
        for _ in range(3):
            assert kinds(self.run("read", reads=[{"req": "g", "pool": 0, "pages": [1], "tokens": 1}])) == [
                "stale_read"
            ]

    def test_a_scrubbed_page_leaks_nobody(self) -> None:
        self.start()
        self.run("admit", req="a", tenant="acme", stage="prefill")
        self.run("alloc", req="a", pool=0, pages=[4])
        self.run("write", req="a", pool=0, pages=[4])
        self.run("free", req="a", pool=0, pages=[4])
        self.run("scrub", pool=0, pages=[4])
        self.run("admit", req="g", tenant="globex", stage="prefill")
        self.run("alloc", req="g", pool=0, pages=[4])
        (finding,) = self.run("read", reads=[{"req": "g", "pool": 0, "pages": [4], "tokens": 8}])
        assert finding.finding == "stale_read" and finding.victim_req == "" and finding.victim_tenant == ""

    def test_a_sharer_of_a_page_handed_out_again_reads_the_new_owner(self) -> None:
        self.start()
        self.run("admit", req="a1", tenant="acme", stage="prefill")
        self.run("alloc", req="a1", pool=0, pages=[1, 2])
        self.run("write", req="a1", pool=0, pages=[1, 2])
        self.run("admit", req="a2", tenant="acme", stage="prefill")
        assert self.run("share", req="a2", pool=0, pages=[1, 2], origin_req="a1") == []
        self.run("admit", req="g1", tenant="globex", stage="prefill")
        (early,) = self.run("alloc", req="g1", pool=0, pages=[2])
        assert (early.finding, early.victim_req, early.pages) == ("early_release", "a1", (2,))
        self.run("write", req="g1", pool=0, pages=[2])
        found = self.run("read", reads=[{"req": "a2", "pool": 0, "pages": [1, 2], "tokens": 32}])
        assert [(f.finding, f.victim_req, f.victim_tenant, f.pages) for f in found] == [
            ("foreign_read", "g1", "globex", (2,))
        ]
        # The share of page 2 ended with the re-grant: freeing it must not free g1's page.
        self.run("free", req="a2", pool=0, pages=[1, 2])
        pages = self.ledger.nodes["n0"].pools[0].pages
        assert pages.use[2] == 1 and pages.use[1] == 1

    def test_a_sender_may_only_send_what_it_wrote(self) -> None:
        self.start()
        self.run("admit", req="a1", tenant="acme", stage="prefill")
        self.run("alloc", req="a1", pool=0, pages=[5, 6])
        self.run("write", req="a1", pool=0, pages=[5, 6])
        self.run("free", req="a1", pool=0, pages=[5, 6])
        self.run("admit", req="g1", tenant="globex", stage="prefill")
        self.run("alloc", req="g1", pool=0, pages=[5, 6])
        self.run("write", req="g1", pool=0, pages=[5])
        (finding,) = self.run(
            "xfer_send",
            req="g1",
            xfer="x",
            peer_node="d0",
            pool=0,
            pages=[5, 6],
            tokens=32,
            bytes=4096,
            status="done",
        )
        assert (finding.finding, finding.victim_tenant, finding.pages) == ("stale_read", "acme", (6,))

    def test_release_of_a_hold_not_held(self) -> None:
        self.start()
        self.run("alloc", req="a", pool=0, pages=[1, 2])
        self.run("hold", req="a", pool=0, pages=[1], holder="offload")
        (finding,) = self.run("release", req="a", pool=0, pages=[1, 2], holder="offload")
        assert (finding.finding, finding.pages, finding.details["holder"]) == ("double_free", (2,), "offload")
        pages = self.ledger.nodes["n0"].pools[0].pages
        assert pages.use[1] == 1 and pages.use[2] == 1

    def test_freed_pages_wait_for_their_holders(self) -> None:
        self.start()
        self.run("alloc", req="a", pool=0, pages=[1])
        self.run("hold", req="a", pool=0, pages=[1], holder="transfer_send")
        self.run("hold", req="a", pool=0, pages=[1], holder="offload")
        self.run("free", req="a", pool=0, pages=[1])
        self.run("release", req="a", pool=0, pages=[1], holder="offload")
        (finding,) = self.run("alloc", req="b", pool=0, pages=[1])
        assert finding.finding == "early_release" and finding.details["users"] == "transfer_send hold"

    def test_request_accounting(self) -> None:
        self.start()
        self.run("admit", req="a", tenant="acme", prompt_tokens=40, stage="prefill")
        self.run("alloc", req="a", pool=0, pages=[1, 2, 3])
        self.run("write", req="a", pool=0, pages=[1, 2, 3], slots=[16, 16, 8])
        self.run(
            "xfer_send",
            req="a",
            xfer="x",
            peer_node="d0",
            pool=0,
            pages=[1, 2, 3],
            tokens=40,
            bytes=5120,
            checksums=[1, 2, 3],
            status="done",
        )
        self.run("read", reads=[{"req": "a", "pool": 0, "pages": [1, 2, 3], "tokens": 40}])
        self.run("free", req="a", pool=0, pages=[1, 2, 3])
        self.run("finish", req="a", output_tokens=7)
        r = self.ledger.request("a")
        assert (r.tenant, r.state, r.prompt_tokens, r.output_tokens) == ("acme", "finished", 40, 7)
        assert (r.granted_pages, r.written_pages, r.freed_pages, r.reads) == (3, 3, 3, 1)
        assert (r.sent_pages, r.sent_tokens, r.sent_bytes) == (3, 40, 5120)
        assert self.ledger.nodes["n0"].pools[0].live[r.idx] == 0

    def test_pool_history_and_drift(self) -> None:
        self.start()
        self.run("alloc", req="a", pool=0, pages=[15])
        assert self.run("pool", pool=0, role="colocated", page_size=16, num_pages=16, context_len=256) == []
        found = self.run(
            "pool", pool=0, role="colocated", page_size=16, num_pages=8, context_len=256, quant="fp8"
        )
        assert sorted(f.details.get("changed", f.details.get("what")) for f in found) == [
            "context length",
            "num_pages,quant",
        ]
        pool = self.ledger.nodes["n0"].pools[0]
        assert [h[2].num_pages for h in pool.history] == [16, 16, 8]
        assert pool.pages.num_pages == 8  # a new engine, a new pool
        with pytest.raises(BadEvent, match="page 15 out of range"):
            self.run("free", req="a", pool=0, pages=[15])


class TestGrantHistory:
    def test_a_long_decode_remembers_every_page_it_was_ever_granted(self) -> None:
        # Decode grants a page at a time; the ledger merges the grants into one array past a
        # few dozen, and must still tell a read of a page the request once held (use after
        # free) from one it never held (foreign read).
        log = EventLog()
        log.add("n0", "pool", pool=0, role="decode", page_size=16, num_pages=128, context_len=2048)
        for page in range(40):
            log.add("n0", "alloc", req="r", pool=0, pages=[page])
            log.add("n0", "write", req="r", pool=0, pages=[page])
        log.add("n0", "free", req="r", pool=0, pages=list(range(40)))
        log.add("n0", "read", reads=[{"req": "r", "pool": 0, "pages": [3, 77], "tokens": 32}])
        ledger = Ledger()
        found = [f for e in log.lines for f in ledger.apply(e)]
        assert [(f.finding, tuple(f.pages)) for f in found] == [
            ("use_after_free", (3,)),
            ("foreign_read", (77,)),
        ]
        history = ledger.nodes["n0"].pools[0].grants[ledger.request("r").idx]
        assert len(history) < 40 and sorted(np.concatenate(history).tolist()) == list(range(40))
