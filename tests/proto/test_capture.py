"""JSON Lines captures: the contract's form (docs/integrator.md) is read exactly, bad lines are
named and skipped."""

from __future__ import annotations

import pytest

from kvguard.proto import pb
from kvguard.proto.builder import EventLog
from kvguard.proto.capture import CaptureError, event_to_json, parse_event, read_capture

EXAMPLE = """\
{"node": "p0", "seq": 1, "ts_ns": 1000, "pool": {"pool": 0, "role": "prefill", "engine": "sglang", "page_size": 16, "num_pages": 42580, "context_len": 1048576}}
{"node": "p0", "seq": 2, "ts_ns": 2000, "admit": {"req": "r1", "tenant": "acme", "prompt_tokens": 100, "stage": "prefill"}}
{"node": "p0", "seq": 3, "ts_ns": 3000, "alloc": {"req": "r1", "pool": 0, "pages": [7, 8, 9, 10, 11, 12, 13]}}
"""  # noqa: E501 - the example of the event contract, verbatim


def test_the_contract_example_reads_as_written() -> None:
    items = list(read_capture(EXAMPLE.splitlines()))
    assert [n for n, _ in items] == [1, 2, 3]
    pool, admit, alloc = (e for _, e in items)
    assert pool.pool.num_pages == 42580 and pool.pool.context_len == 1048576 and pool.pool.role == "prefill"
    assert admit.admit.tenant == "acme" and admit.admit.prompt_tokens == 100
    assert alloc.node == "p0" and alloc.seq == 3 and alloc.ts_ns == 3000
    assert list(alloc.alloc.pages) == [7, 8, 9, 10, 11, 12, 13]


def test_integers_may_be_strings() -> None:
    event = parse_event(
        '{"node": "d0", "seq": "4", "ts_ns": "5000", "alloc": {"req": "r", "pages": ["1", 2]}}'
    )
    assert event.seq == 4 and event.ts_ns == 5000 and list(event.alloc.pages) == [1, 2]


def test_blank_and_comment_lines_are_ignored_and_numbers_kept() -> None:
    lines = ["# a comment", "", "   ", '{"node": "n", "seq": 1, "abort": {"req": "r"}}', "  # indented"]
    items = list(read_capture(lines))
    assert len(items) == 1 and items[0][0] == 4 and items[0][1].abort.req == "r"


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"node": "n", "seq": 1}', "no payload"),
        ('{"node": "n", "seq": 1, "frobnicate": {}}', "unknown payload or field 'frobnicate'"),
        ('{"node": "n", "seq": 1, "abort": {"req": "r"}, "reject": {"req": "r"}}', "more than one payload"),
        ('{"node": "n", "seq": 1, "alloc": {"req": "r", "pages": [-1]}}', "pages"),
        ('{"node": "n", "seq": 1, "alloc": {"req": "r", "pagez": [1]}}', "pagez"),
        ('{"node": "n", "seq": "one", "abort": {"req": "r"}}', "seq"),
    ],
)
def test_bad_lines_are_named_with_a_reason(line: str, reason: str) -> None:
    lines = [
        '{"node": "n", "seq": 1, "abort": {"req": "ok"}}',
        line,
        '{"node": "n", "seq": 2, "finish": {"req": "ok"}}',
    ]
    items = list(read_capture(lines))
    assert [n for n, _ in items] == [1, 2, 3]
    bad = items[1][1]
    assert isinstance(bad, CaptureError) and bad.line == 2
    assert reason in bad.reason, bad.reason
    # Nothing valid around it is lost.
    assert items[0][1].abort.req == "ok" and items[2][1].finish.req == "ok"


def test_written_captures_read_back_identically() -> None:
    log = EventLog()
    log.comment("two nodes")
    log.add("p0", "pool", pool=1, role="prefill", page_size=16, num_pages=8, mem_fraction=0.5)
    log.add(
        "p0",
        "xfer_send",
        req="r",
        xfer="x",
        pages=[1, 2],
        tokens=20,
        bytes=2**40,
        checksums=[2**64 - 1, 0],
        status="done",
    )
    log.add("d0", "read", reads=[{"req": "r", "pool": 1, "pages": [3], "tokens": 4}])
    text = log.to_jsonl()
    assert text.startswith("# two nodes\n")
    events = [e for _, e in read_capture(text.splitlines())]
    assert events == log.events
    assert '"checksums":[18446744073709551615,0]' in event_to_json(log.events[1])
    assert isinstance(events[0], pb.Event) and events[2].read.reads[0].tokens == 4
