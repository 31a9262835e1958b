"""Scenarios that several ledger test files replay (test files cannot import one another):

`remote`: a prefill node p0 about to send request a's KV to decode d0, whose K and V pages lie
in registered memory, on a clock the test sets; the RDMA writes a probe saw p0 post are judged
against d0's pages (test_remote_writes.py), and the stream is cut and restored anywhere
(test_snapshot.py).

`witnessed_transfer`: one transfer the sender claims and a wire probe reports, with no
receiver's report (test_transfers.py, test_snapshot.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from clocked import MS, Clocked

from kvguard.ledger.findings import Finding
from kvguard.proto import pb
from kvguard.proto.builder import EventLog

K_BASE, V_BASE, PAGE_BYTES = 0x7F00_0000_0000, 0x7F10_0000_0000, 4096  # decode's K and V buffers


def rdma(pages: list[int], gap: int = 0) -> list[dict[str, int]]:
    """Write ranges of a transfer into `pages` of decode's K and V regions, contiguous pages
    merged as the witness merges them (`gap` bytes of each page left out)."""
    runs = []
    for base in (K_BASE, V_BASE):
        for p in pages:
            addr, size = base + p * PAGE_BYTES, PAGE_BYTES - gap
            if runs and runs[-1]["addr"] + runs[-1]["bytes"] == addr:
                runs[-1]["bytes"] += size
            else:
                runs.append({"addr": addr, "bytes": size})
    return runs


class RemoteWrites(Clocked):
    """p0 holds request a's KV for sending, d0 granted it pages 4 to 6 (K and V at K_BASE and
    V_BASE, PAGE_BYTES a page); `add` applies an event at the time given, `wire` reports the
    writes a probe saw p0 post, `claim` p0's report of the transfer."""

    K_BASE, V_BASE, PAGE_BYTES = K_BASE, V_BASE, PAGE_BYTES  # where decode's pages lie, for tests

    def __init__(self) -> None:
        super().__init__(1000 * MS)
        regions = [{"base": b, "stride": PAGE_BYTES} for b in (K_BASE, V_BASE)]
        self.add("p0", "pool", pool=0, role="prefill", page_size=16, num_pages=16, context_len=256)
        self.add(
            "d0", "pool", pool=0, role="decode", page_size=16, num_pages=16, context_len=256, regions=regions
        )
        self.add(
            "p0", "bootstrap", req="a", prefill_node="p0", decode_node="d0", prompt_tokens=48, tenant="acme"
        )
        self.add("p0", "admit", req="a", tenant="acme", prompt_tokens=48, stage="prefill")
        self.add("p0", "alloc", req="a", pool=0, pages=[1, 2, 3])
        self.add("p0", "write", req="a", pool=0, pages=[1, 2, 3])
        self.add("p0", "hold", req="a", pool=0, pages=[1, 2, 3], holder="transfer_send")
        self.add("d0", "admit", req="a", tenant="acme", prompt_tokens=48, stage="decode")
        self.add("d0", "alloc", req="a", pool=0, pages=[4, 5, 6])

    def wire(self, pages: list[int], posted_ms: float, claim: bool = True, **more: object) -> list[Finding]:
        """The witness's report of the transfer's writes, then (claim) prefill's report of it."""
        fields = {"xfer": "x1", "probe": "ebpf:rdma", "bytes": 6 * PAGE_BYTES, "calls": 6, "complete": True}
        fields |= {"writes": rdma(pages), "first_write_ns": int(posted_ms * MS)} | more
        found = self.add("p0/ebpf", "wire", **fields)
        if claim:
            found += self.claim(posted_ms + 1)
        return found

    def claim(self, at_ms: float) -> list[Finding]:
        send = {"req": "a", "xfer": "x1", "peer_node": "d0", "pool": 0, "pages": [1, 2, 3], "tokens": 48}
        return self.add("p0", "xfer_send", at_ms, **send, bytes=6 * PAGE_BYTES, status="done")

    def abort_and_regrant(self, at_ms: float) -> None:
        """Decode aborts a, frees its pages, and grants them to initech's b."""
        self.add("d0", "abort", at_ms, req="a", reason="client went away")
        self.add("d0", "free", req="a", pool=0, pages=[4, 5, 6])
        self.add("d0", "admit", req="b", tenant="initech", prompt_tokens=40, stage="decode")
        self.add("d0", "alloc", req="b", pool=0, pages=[4, 5, 6])


@pytest.fixture
def remote() -> RemoteWrites:
    """A fresh RemoteWrites scenario: a's KV granted on both nodes, nothing sent yet."""
    return RemoteWrites()


def witnessed_transfer_events(wire: dict[str, object], wire_first: bool, shim: int = 0) -> list[pb.Event]:
    """p0 sends a's two pages (8192 bytes) to d0 and reports it; the probe's report `wire`
    comes after the claim or (wire_first) before it; `shim` bytes: a second witness's count."""
    log = EventLog()
    log.add("p0", "pool", pool=0, role="prefill", page_size=16, num_pages=16, context_len=256)
    log.add("p0", "admit", req="a", tenant="acme", prompt_tokens=32, stage="prefill")
    log.add("p0", "alloc", req="a", pool=0, pages=[1, 2])
    log.add("p0", "write", req="a", pool=0, pages=[1, 2])
    send = log.add(
        "p0",
        "xfer_send",
        req="a",
        xfer="x1",
        peer_node="d0",
        pool=0,
        pages=[1, 2],
        tokens=32,
        bytes=8192,
        status="done",
    )
    seen = log.add("p0/ebpf", "wire", xfer="x1", probe="ebpf:tcp", calls=3, **wire)
    if wire_first:
        log.lines[-2:] = [seen, send]
    if shim:  # a second witness of the same bytes: the LD_PRELOAD shim's count of the copies
        log.add("p0/shim", "wire", xfer="x1", probe="shim:cuda", calls=1, bytes=shim, complete=True)
    log.add("p0", "free", req="a", pool=0, pages=[1, 2])
    log.add("p0", "finish", req="a")
    return log.lines


@pytest.fixture
def witnessed_transfer() -> Callable[..., list[pb.Event]]:
    """(wire, wire_first, shim=0) -> the events of one witnessed transfer."""
    return witnessed_transfer_events
