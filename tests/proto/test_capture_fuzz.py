"""The JSON Lines door (captures, `kvguard replay`), fuzzed: any line is one Event or one
CaptureError naming the line, never another exception; lines that are not events, mixed into a
real capture at any place, change nothing of what the capture's events are judged to be."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.ledger import Ledger
from kvguard.proto import pb
from kvguard.proto.capture import PAYLOADS, CaptureError, read_capture
from kvguard.ruleset import load_ruleset
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR
from kvguard.ruleset.replay import replay

RULES = load_ruleset()
INCIDENT = (DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl").read_text().splitlines()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
names = st.sampled_from([*sorted(PAYLOADS), "node", "seq", "ts_ns", "epoch", "x"])
# Objects shaped like events: envelope and payload names with values of any type and shape.
event_like = st.dictionaries(names, json_values, max_size=5).map(lambda d: orjson.dumps(d).decode())
lines = st.one_of(
    st.text(max_size=40),
    st.binary(max_size=40),
    json_values.map(lambda v: orjson.dumps(v).decode()),
    event_like,
    st.integers(1, 2000).map(lambda depth: "[" * depth + "]" * depth),  # deeper than a parser allows
    st.just('{"node": "d0", "node": "p0", "seq": 1, "seq": 99, "heartbeat": {}}'),  # duplicate keys
    st.integers(-(2**80), 2**80).map(
        lambda n: f'{{"node": "d0", "seq": {n}, "heartbeat": {{"dropped": {n}}}}}'
    ),
)


@settings(max_examples=1000, deadline=None, derandomize=True, database=None)
@given(lines)
def test_any_line_is_an_event_or_a_named_error(line: str | bytes) -> None:
    out = list(read_capture([line]))
    assert len(out) <= 1
    for number, item in out:
        assert number == 1
        assert isinstance(item, pb.Event | CaptureError)
        if isinstance(item, CaptureError):
            assert str(item).startswith("line 1: ") and item.reason


def judged(capture: list[str]) -> list[tuple[str, str, str, tuple[int, ...]]]:
    found: list = []
    replay(capture, RULES, found.append, lambda error: None, Ledger())
    return [(f.finding, f.req, f.victim_req, f.pages) for f in found]


NOT_EVENTS = st.one_of(
    st.text(max_size=30).filter(lambda t: not t.lstrip().startswith("{")),
    json_values.filter(lambda v: not isinstance(v, dict)).map(lambda v: orjson.dumps(v).decode()),
    st.dictionaries(st.text(max_size=6).filter(lambda k: k not in PAYLOADS), json_values, max_size=3).map(
        lambda d: orjson.dumps(d).decode()
    ),
)
WANT = judged(INCIDENT)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.integers(0, len(INCIDENT)), NOT_EVENTS), max_size=6))
def test_bad_lines_anywhere_lose_nothing_valid(inserts: list[tuple[int, str]]) -> None:
    capture = list(INCIDENT)
    for at, line in sorted(inserts, reverse=True):
        capture.insert(at, line)
    assert judged(capture) == WANT
