"""The ledger's judgement of RDMA writes into decode's pages, seen from outside both engines
(the scenario, `remote`, is conftest.py's RemoteWrites)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvguard.ledger.ledger import BadEvent


class TestRemoteWrites:
    """RDMA writes a probe saw the prefill node post, judged against decode's pages through
    the memory decode registered, by the time they were posted: the late write after an
    abort, seen from outside both engines."""

    def test_writes_into_the_requests_own_pages_are_clean(self, remote: Any) -> None:
        remote.wire([4, 5, 6], posted_ms=1100)
        remote.add("d0", "heartbeat", 1200)
        assert remote.found == [] and remote.ledger.stats.remote_unjudged == 0

    def test_a_write_posted_after_the_abort_is_a_late_write_into_the_new_owners_pages(
        self, remote: Any
    ) -> None:
        remote.abort_and_regrant(at_ms=2000)
        assert remote.wire([4, 5, 6], posted_ms=2500) == []  # judged at decode's next event
        (late,) = remote.add("d0", "write", 2600, req="b", pool=0, pages=[4])
        assert (late.finding, late.node, late.req, late.tenant) == ("late_write", "d0", "a", "acme")
        assert (late.victim_req, late.victim_tenant, late.pages, late.pool) == ("b", "initech", (4, 5, 6), 0)
        assert late.details == {"probe": "ebpf:rdma", "witness": "p0/ebpf#1", "xfer": "x1"}
        assert remote.ledger.stats.remote_unjudged == 0
        assert "by RDMA (transfer x1, seen posted by ebpf:rdma" in late.message

    def test_a_write_into_pages_nobody_holds_is_a_use_after_free(self, remote: Any) -> None:
        remote.add("d0", "abort", 2000, req="a", reason="client went away")
        remote.add("d0", "free", req="a", pool=0, pages=[4, 5, 6])
        remote.wire([4, 5, 6, 9], posted_ms=2500)
        (uaf,) = remote.add("d0", "heartbeat", 2600)
        assert (uaf.finding, uaf.req, uaf.victim_req, uaf.pages) == ("use_after_free", "a", "", (4, 5, 6, 9))

    def test_a_page_that_changed_around_the_post_is_not_judged(self, remote: Any) -> None:
        # b's grant began 5 ms before the post: within the clocks' possible skew, the write
        # may have landed before it. Nothing is claimed; the pages are counted as unjudged.
        remote.abort_and_regrant(at_ms=2000)
        remote.wire([4, 5, 6], posted_ms=2005)
        remote.add("d0", "write", 2600, req="b", pool=0, pages=[4])
        assert remote.found == [] and remote.ledger.stats.remote_unjudged == 3

    def test_writes_wait_until_the_receivers_events_pass_their_time(self, remote: Any) -> None:
        # Decode's events of the abort are still on their way when the wire event arrives.
        remote.add("d0", "heartbeat", 1500)
        remote.wire([4, 5, 6], posted_ms=2500)
        assert remote.add("d0", "heartbeat", 1600) == []  # decode's clock is not there yet
        remote.abort_and_regrant(at_ms=2000)
        (late,) = remote.add("d0", "heartbeat", 2700)
        assert (late.finding, late.victim_req) == ("late_write", "b")

    def test_a_transfer_draining_into_pages_kept_for_it_is_clean(self, remote: Any) -> None:
        remote.add("d0", "hold", 1500, req="a", pool=0, pages=[4, 5, 6], holder="transfer_recv")
        remote.add("d0", "abort", 2000, req="a", reason="client went away")
        remote.add("d0", "free", req="a", pool=0, pages=[4, 5, 6])
        remote.wire([4, 5, 6], posted_ms=2500)
        remote.add("d0", "heartbeat", 2600)
        assert remote.found == []

    def test_writes_wait_for_their_request_and_receiver(self, remote: Any) -> None:
        # The wire event names only the transfer: its request and receiver come with the claim.
        remote.abort_and_regrant(at_ms=2000)
        remote.wire([4, 5, 6], posted_ms=2500, claim=False)
        remote.add("d0", "heartbeat", 2600)
        assert remote.found == []
        remote.claim(2700)
        (late,) = remote.add("d0", "heartbeat", 2800)
        assert (late.finding, late.req, late.victim_req) == ("late_write", "a", "b")

    def test_writes_outside_the_registered_pages_name_no_page(self, remote: Any) -> None:
        # Gaps between pages (a region whose pages are not contiguous) and memory beyond the
        # pool (decode's other registered buffers) are not KV pages.
        remote.abort_and_regrant(at_ms=2000)
        outside = [
            {"addr": remote.K_BASE - 64, "bytes": 64},
            {"addr": remote.K_BASE + 16 * remote.PAGE_BYTES, "bytes": 1 << 20},
        ]
        remote.wire([], posted_ms=2500, writes=outside)
        remote.add("d0", "heartbeat", 2600)
        assert remote.found == [] and remote.ledger.stats.remote_unjudged == 0

    @pytest.mark.parametrize(
        ("payload", "fields", "reason"),
        [
            ("pool", {"regions": [{"base": 1, "stride": 0}]}, "region 0 has stride 0"),
            ("pool", {"regions": [{"base": 1, "stride": 8, "page_bytes": 9}]}, "page_bytes 9"),
            ("pool", {"regions": [{"base": (1 << 64) - 4096, "stride": 4096}]}, "wraps"),
            ("wire", {"writes": [{"addr": 4096, "bytes": 0}]}, "has no bytes"),
            ("wire", {"writes": [{"addr": (1 << 64) - 8, "bytes": 16}]}, "past the end of the address space"),
        ],
    )
    def test_bad_ranges_are_refused_by_name(
        self, remote: Any, payload: str, fields: dict[str, object], reason: str
    ) -> None:
        base = (
            {"pool": 0, "role": "decode", "page_size": 16, "num_pages": 16}
            if payload == "pool"
            else {"xfer": "x1", "probe": "ebpf:rdma", "first_write_ns": 1}
        )
        with pytest.raises(BadEvent, match=reason):
            remote.add("d0" if payload == "pool" else "p0/ebpf", payload, **(base | fields))

    def test_pages_written_match_a_page_by_page_reading(self) -> None:
        from kvguard.ledger.transfers import pages_written as _pages_written

        rng = np.random.default_rng(7)
        for _ in range(200):
            num, stride = int(rng.integers(1, 40)), int(rng.integers(1, 64))
            size = int(rng.integers(1, stride + 1))
            bases = sorted(int(b) * 4096 for b in rng.choice(64, size=3, replace=False))
            regions = np.array([(b, stride, size) for b in bases], np.uint64)
            addr = np.array([int(a) for a in rng.integers(0, 64 * 4096, 5)], np.uint64)
            end = addr + np.array([int(n) for n in rng.integers(1, 3 * stride * num + 2, 5)], np.uint64)
            expect = sorted(
                {
                    p
                    for b in bases
                    for p in range(num)
                    for lo, hi in zip(addr.tolist(), end.tolist(), strict=True)
                    if lo < b + p * stride + size and hi > b + p * stride
                }
            )
            assert _pages_written(regions, num, addr, end).tolist() == expect

    def test_writes_into_a_receiver_that_registered_no_memory_are_counted(self, remote: Any) -> None:
        remote.add("d1", "pool", pool=0, role="decode", page_size=16, num_pages=16)
        remote.add("p0", "bootstrap", req="c", prefill_node="p0", decode_node="d1", prompt_tokens=16)
        send = {"req": "c", "xfer": "x9", "peer_node": "d1", "pool": 0, "status": "failed"}
        remote.add("p0", "xfer_send", **send)
        remote.wire([1, 2], posted_ms=1100, claim=False, xfer="x9")
        remote.add("d1", "heartbeat", 1200)
        assert remote.found == [] and remote.ledger.stats.remote_unmapped == 2  # K's and V's run
