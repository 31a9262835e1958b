"""Prefix caches as real engines run them (docs/integrator.md `share`, holder `prefix_cache`).

vLLM keeps a finished request's freed blocks, KV and all, in its free queue and revives them
on a prefix hit; SGLang's radix tree holds a request's pages (a `prefix_cache` hold) after it
ends, until eviction. A share of a freed page whose KV is still the origin's, under the
generation the page still has, is a cache hit: granted to the sharer, no finding, and its
reads are clean. A page handed out (and rewritten) since is still a finding: the eviction race.
"""

from __future__ import annotations

import numpy as np

from kvguard.ledger import snapshot
from kvguard.ledger.findings import Finding
from kvguard.ledger.ledger import Ledger
from kvguard.proto.builder import EventLog


def facts(found: list[Finding]) -> list[tuple[str, str, str, tuple[int, ...]]]:
    return [(f.finding, f.req, f.victim_req, f.pages) for f in found]


class Cache:
    """One colocated node n0 (16 pages of 16 tokens) and its ledger; `run` applies an event."""

    def __init__(self) -> None:
        self.log = EventLog()
        self.ledger = Ledger()
        self.run("pool", pool=0, role="colocated", page_size=16, num_pages=16, context_len=256)

    def run(self, payload: str, **fields: object) -> list[Finding]:
        return list(self.ledger.apply(self.log.add("n0", payload, **fields)))

    def serve(self, req: str, tenant: str, pages: list[int]) -> None:
        """req admitted, granted `pages` and its KV written into them (full pages), no finding."""
        assert self.run("admit", req=req, tenant=tenant, prompt_tokens=16 * len(pages), stage="prefill") == []
        assert self.run("alloc", req=req, pool=0, pages=pages) == []
        assert self.run("write", req=req, pool=0, pages=pages) == []

    def done(self, req: str, pages: list[int]) -> None:
        """req frees its pages and finishes, no finding."""
        assert self.run("free", req=req, pool=0, pages=pages) == []
        assert self.run("finish", req=req, output_tokens=1) == []

    def read(self, req: str, pages: list[int], tokens: int) -> list[Finding]:
        return self.run("read", reads=[{"req": req, "pool": 0, "pages": pages, "tokens": tokens}])

    @property
    def use(self) -> np.ndarray:
        return self.ledger.nodes["n0"].pools[0].pages.use


class TestFreedPagesHit:
    def test_a_hit_on_a_finished_requests_freed_pages_is_clean(self) -> None:
        c = Cache()
        c.serve("a1", "acme", [1, 2])
        c.done("a1", [1, 2])
        assert c.use[1] == 0 and c.use[2] == 0  # back in the free queue, KV and all
        c.run("admit", req="a2", tenant="acme", prompt_tokens=40, stage="prefill")
        assert c.run("share", req="a2", pool=0, pages=[1, 2], origin_req="a1") == []
        assert c.use[1] == 1 and c.use[2] == 1  # revived: out of the free pool while a2 uses them
        assert c.run("alloc", req="a2", pool=0, pages=[3]) == []
        assert c.run("write", req="a2", pool=0, pages=[3], slots=[8]) == []
        assert c.read("a2", [1, 2, 3], 40) == []
        assert c.ledger.request("a2").shared_pages == 2
        # The sharer's free ends its share: no double free, and the pages are free again.
        assert c.run("free", req="a2", pool=0, pages=[1, 2, 3]) == []
        assert c.use[1:4].tolist() == [0, 0, 0]
        c.run("admit", req="g1", tenant="globex", prompt_tokens=16, stage="prefill")
        assert c.run("alloc", req="g1", pool=0, pages=[1]) == []  # evicted: a clean grant

    def test_a_preempted_request_hits_its_own_freed_pages(self) -> None:
        c = Cache()
        c.serve("a1", "acme", [4, 5])
        assert c.run("free", req="a1", pool=0, pages=[4, 5]) == []  # preempted: recompute later
        assert c.run("share", req="a1", pool=0, pages=[4, 5], origin_req="a1") == []
        assert c.read("a1", [4, 5], 32) == []
        assert c.run("free", req="a1", pool=0, pages=[4, 5]) == []
        assert c.use[4] == 0 and c.use[5] == 0

    def test_a_second_sharer_of_a_revived_page(self) -> None:
        c = Cache()
        c.serve("a1", "acme", [6])
        c.done("a1", [6])
        for sharer in ("a2", "a3"):
            c.run("admit", req=sharer, tenant="acme", prompt_tokens=16, stage="prefill")
            assert c.run("share", req=sharer, pool=0, pages=[6], origin_req="a1") == []
            assert c.read(sharer, [6], 16) == []
        assert c.use[6] == 2
        assert c.run("free", req="a2", pool=0, pages=[6]) == [] and c.use[6] == 1

    def test_a_page_handed_out_and_rewritten_since_is_still_a_finding(self) -> None:
        # The eviction race: the lookup found a1's hash, but the block went to g1 and holds its KV.
        c = Cache()
        c.serve("a1", "acme", [1])
        c.done("a1", [1])
        c.serve("g1", "globex", [1])
        c.done("g1", [1])
        c.run("admit", req="a2", tenant="acme", prompt_tokens=16, stage="prefill")
        (found,) = c.run("share", req="a2", pool=0, pages=[1], origin_req="a1")
        assert facts([found]) == [("use_after_free", "a2", "g1", (1,))]
        assert found.victim_tenant == "globex" and "hold g1's" in found.message
        assert c.use[1] == 0  # not given: the page stays free
        # a2 was never given page 1: reading it anyway reads globex's KV.
        assert [(f.finding, f.victim_req, f.pages) for f in c.read("a2", [1], 16)] == [
            ("foreign_read", "g1", (1,))
        ]

    def test_a_page_granted_since_but_not_rewritten_is_not_the_origins_any_more(self) -> None:
        c = Cache()
        c.serve("a1", "acme", [2])
        c.done("a1", [2])
        c.run("alloc", req="g1", pool=0, pages=[2])  # a new generation, never written
        c.run("free", req="g1", pool=0, pages=[2])
        found = c.run("share", req="a2", pool=0, pages=[2], origin_req="a1")
        assert facts(found) == [("use_after_free", "a2", "a1", (2,))]

    def test_a_scrubbed_page_is_no_hit(self) -> None:
        c = Cache()
        c.serve("a1", "acme", [3])
        c.done("a1", [3])
        c.run("scrub", pool=0, pages=[3])
        assert facts(c.run("share", req="a2", pool=0, pages=[3], origin_req="a1")) == [
            ("use_after_free", "a2", "a1", (3,))
        ]

    def test_only_the_pages_that_are_no_hit_are_refused(self) -> None:
        c = Cache()
        c.serve("a1", "acme", [1, 2])
        c.done("a1", [1, 2])
        c.serve("g1", "globex", [2])
        c.done("g1", [2])
        found = c.run("share", req="a2", pool=0, pages=[1, 2], origin_req="a1")
        assert facts(found) == [("use_after_free", "a2", "g1", (2,))]
        assert c.use[1] == 1 and c.use[2] == 0
        assert c.read("a2", [1], 16) == []

    def test_a_cross_tenant_hit_is_only_the_cross_tenant_share(self) -> None:
        c = Cache()
        c.serve("a1", "acme", [1, 2])
        c.done("a1", [1, 2])
        c.run("admit", req="g1", tenant="globex", prompt_tokens=32, stage="prefill")
        (found,) = c.run("share", req="g1", pool=0, pages=[1, 2], origin_req="a1")
        assert facts([found]) == [("cross_tenant_share", "g1", "a1", (1, 2))]
        assert (found.tenant, found.victim_tenant) == ("globex", "acme")
        assert c.read("g1", [1, 2], 32) == []  # the share itself was the finding

    def test_a_revived_page_granted_to_another_is_an_early_release_of_the_sharer(self) -> None:
        c = Cache()
        c.serve("a1", "acme", [1, 2])
        c.done("a1", [1, 2])
        c.run("admit", req="a2", tenant="acme", prompt_tokens=32, stage="prefill")
        assert c.run("share", req="a2", pool=0, pages=[1, 2], origin_req="a1") == []
        c.run("admit", req="g1", tenant="globex", prompt_tokens=16, stage="prefill")
        (early,) = c.run("alloc", req="g1", pool=0, pages=[2])
        assert facts([early]) == [("early_release", "g1", "a2", (2,))]
        assert early.details["users"] == "live grant"
        c.run("write", req="g1", pool=0, pages=[2])
        assert [(f.finding, f.victim_req, f.pages) for f in c.read("a2", [1, 2], 32)] == [
            ("foreign_read", "g1", (2,))
        ]
        # The share of page 2 ended with the re-grant: a2's free must not free g1's page.
        assert c.run("free", req="a2", pool=0, pages=[1, 2]) == []
        assert c.use[1] == 0 and c.use[2] == 1


class TestPrefixCacheHold:
    def test_a_held_page_stays_out_of_the_free_pool_after_its_request_frees_it(self) -> None:
        c = Cache()
        c.serve("a1", "acme", [4, 5])
        assert c.run("hold", req="a1", pool=0, pages=[4, 5], holder="prefix_cache") == []
        c.done("a1", [4, 5])
        assert c.use[4] == 1 and c.use[5] == 1
        c.run("admit", req="g1", tenant="globex", prompt_tokens=16, stage="prefill")
        (early,) = c.run("alloc", req="g1", pool=0, pages=[4])
        assert facts([early]) == [("early_release", "g1", "a1", (4,))]
        assert early.details["users"] == "prefix_cache hold"
        # Evicted (free_segment names no request: the pages' last owner releases them).
        assert c.run("release", req="a1", pool=0, pages=[5], holder="prefix_cache") == []
        assert c.use[5] == 0
        assert c.run("alloc", req="g1", pool=0, pages=[5]) == []

    def test_a_share_of_a_held_page_is_a_hit_and_outlives_the_eviction(self) -> None:
        c = Cache()
        c.serve("a1", "acme", [4, 5])
        c.run("hold", req="a1", pool=0, pages=[4, 5], holder="prefix_cache")
        c.done("a1", [4, 5])
        c.run("admit", req="a2", tenant="acme", prompt_tokens=32, stage="prefill")
        assert c.run("share", req="a2", pool=0, pages=[4, 5], origin_req="a1") == []
        assert c.use[4] == 2
        assert c.read("a2", [4, 5], 32) == []
        assert c.run("release", req="a1", pool=0, pages=[4, 5], holder="prefix_cache") == []
        assert c.use[4] == 1 and c.read("a2", [4, 5], 32) == []  # a2 still uses them
        assert c.run("free", req="a2", pool=0, pages=[4, 5]) == []
        assert c.use[4] == 0 and c.use[5] == 0
        assert not c.ledger.nodes["n0"].pools[0].pages.holds.any()

    def test_a_snapshot_keeps_the_prefix_cache_holds_and_the_revived_pages(self) -> None:
        c = Cache()
        c.serve("a1", "acme", [4, 5])
        c.run("hold", req="a1", pool=0, pages=[4], holder="prefix_cache")
        c.done("a1", [4, 5])
        c.run("share", req="a2", pool=0, pages=[5], origin_req="a1")
        data = snapshot.dump(c.ledger)
        restored = snapshot.load(data)
        assert snapshot.dump(restored) == data
        c.ledger = restored
        c.run("admit", req="g1", tenant="globex", prompt_tokens=32, stage="prefill")
        found = c.run("alloc", req="g1", pool=0, pages=[4, 5])
        assert sorted((f.finding, f.victim_req, f.pages, f.details["users"]) for f in found) == [
            ("early_release", "a1", (4,), "prefix_cache hold"),
            ("early_release", "a2", (5,), "live grant"),
        ]
