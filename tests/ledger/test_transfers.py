"""KV moving between nodes: the hand-off's accounting on both sides of a transfer, and the
sender's claim against a wire witness's account of it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvguard.ledger.findings import Finding
from kvguard.ledger.ledger import Ledger
from kvguard.proto import pb


def test_incident_accounting_across_nodes() -> None:
    from kvguard.proto.capture import read_capture
    from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR

    ledger = Ledger()
    capture = (DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl").read_text().splitlines()
    for _, event in read_capture(capture):
        ledger.apply(event)
    g1 = ledger.request("g1")
    assert (g1.tenant, g1.state, g1.reason) == (
        "globex",
        "rejected",
        "prompt of 128 tokens exceeds the KV pool",
    )
    assert g1.bootstrap == ("p0", "d0", 128)
    assert (g1.reserved_pages, g1.granted_pages, g1.written_pages) == (8, 9, 1)
    assert (g1.sent_pages, g1.sent_tokens, g1.received_pages, g1.received_tokens) == (1, 1, 8, 1)
    transfer = ledger.transfers.by_id["x-g1"]
    assert (transfer.send.node, transfer.send.tokens, transfer.recv.node, transfer.recv.tokens) == (
        "p0",
        1,
        "d0",
        1,
    )
    a1 = ledger.request("a1")
    assert (a1.reserved_pages, a1.received_tokens, a1.state) == (4, 64, "finished")


class TestWireWitness:
    """The sender's claim against a probe's account of the wire, with no receiver's report
    (an unguarded decode node, or a receiver that lies as well)."""

    @pytest.fixture(autouse=True)
    def _transfer(self, witnessed_transfer: Callable[..., list[pb.Event]]) -> None:
        self.events = witnessed_transfer  # conftest.py's scenario: p0 claims 8192 bytes sent to d0

    def findings(self, wire: dict[str, object], wire_first: bool, shim: int = 0) -> list[Finding]:
        ledger = Ledger()
        return [f for e in self.events(wire, wire_first, shim) for f in ledger.apply(e)]

    @pytest.mark.parametrize("wire_first", [False, True])
    def test_a_transfer_the_probe_saw_end_short_is_judged_at_once(self, wire_first: bool) -> None:
        found = self.findings({"bytes": 4096, "complete": True}, wire_first)
        (finding,) = found  # judged by whichever of the two came second
        where = ("p0", 5) if wire_first else ("p0/ebpf", 1)
        assert (finding.finding, finding.req, finding.node, finding.seq) == ("transfer_mismatch", "a", *where)
        assert finding.details == {
            "xfer": "x1",
            "what": "wire_bytes",
            "expected": "8192",
            "observed": "4096",
            "probe": "ebpf:tcp",
        }
        assert "the wire probe (ebpf:tcp) saw 4096 in 3 call(s)" in finding.message

    @pytest.mark.parametrize("wire_first", [False, True])
    def test_a_complete_transfer_that_adds_up_is_clean(self, wire_first: bool) -> None:
        assert self.findings({"bytes": 8192, "complete": True}, wire_first) == []

    def test_a_partial_report_short_of_the_claim_waits_for_the_rest(self) -> None:
        # Without `complete` the probe may still be reporting, and without a receiver's report
        # there is no receipt to judge at: no verdict while events come (the more bytes, the
        # later they come), but the end of the capture settles it (test_verdicts.py: the rest).
        ledger = Ledger()
        assert [f for e in self.events({"bytes": 4096}, False) for f in ledger.apply(e)] == []
        (finding,) = ledger.end_capture()
        assert (finding.finding, finding.req, finding.node, finding.details["observed"]) == (
            "transfer_mismatch",
            "a",
            "p0",
            "4096",
        )
        assert finding.message.endswith("; settled as short now: end of capture")

    def test_two_witnesses_of_one_transfer_are_each_compared_with_the_claim(self) -> None:
        # Their bytes are the same bytes seen twice: never added up.
        assert self.findings({"bytes": 8192, "complete": True}, False, shim=8192) == []
        (finding,) = self.findings({"bytes": 8192, "complete": True}, False, shim=4096)
        assert (finding.details["probe"], finding.details["observed"], finding.node) == (
            "shim:cuda",
            "4096",
            "p0/shim",
        )
