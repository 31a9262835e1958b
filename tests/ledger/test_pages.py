"""The ledger's loops over pages in C (ledger/_pages.c) against the NumPy statements they
stand for, on random pool states: every update equals them, an event that needs judging
changes nothing until it is judged, every input is checked (bounds, repeats, types, bytes),
and runs of clean events applied whole leave what applying them one by one leaves."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.ledger import BadEvent, Ledger, _pages, snapshot
from kvguard.ledger.access import Shared, shared_read_victims
from kvguard.ledger.pages import COLUMNS, HOLDERS, NOBODY, PoolPages
from kvguard.ledger.pages import PAGE as RECORD
from kvguard.proto import pb, wire

N = 64  # pages in the pool
PAGE = 16  # tokens a page
REQ = 7  # the request an event is of


def random_pool(rng: np.random.Generator) -> PoolPages:
    """Any state, with REQ owning some pages (not necessarily consistent: the kernels'
    arithmetic must equal NumPy's whatever the state)."""
    pp = PoolPages(N, PAGE)
    pp.owner[:] = rng.choice([REQ, REQ, 3, ~REQ, ~3, ~NOBODY], N)
    pp.own[:] = np.where(rng.random(N) < 0.7, pp.owner, NOBODY)
    pp.use[:] = np.where(rng.random(N) < 0.5, 0, rng.integers(1, 4, N))
    pp.holds[:] = rng.integers(0, 2, (len(HOLDERS), N))
    pp.gen[:] = rng.integers(0, 1 << 32, N, dtype=np.uint32)  # wraps like the NumPy add
    pp.writer[:] = rng.integers(0, 9, N)
    pp.wgen[:] = rng.integers(0, 5, N)
    pp.valid[:] = rng.choice([PAGE, PAGE, 0, 3], N)
    pp.prior[:] = rng.integers(0, 9, N)
    pp.since[:] = rng.integers(0, 1000, N)
    pp.reserved[:] = rng.random(N) < 0.1
    return pp


def state(pp: PoolPages) -> dict[str, np.ndarray]:
    return {name: getattr(pp, name).copy() for name in (*COLUMNS, "holds", "holder_req", "reserved")} | {
        "seen": pp.state["seen"].copy()
    }


def assert_same(got: PoolPages, want: dict[str, np.ndarray]) -> None:
    now = state(got)
    for name, array in want.items():
        assert np.array_equal(now[name], array), name


def pages_of(rng: np.random.Generator, clean: bool, pp: PoolPages, mask: np.ndarray) -> np.ndarray:
    """Distinct pages; with `clean`, only pages where mask holds."""
    pool = np.flatnonzero(mask) if clean else np.arange(N)
    if len(pool) == 0:
        return np.zeros(0, np.intp)
    return rng.choice(pool, rng.integers(1, len(pool) + 1), replace=False).astype(np.intp)


def judged_count(pp: PoolPages, want: dict[str, np.ndarray], update: Callable[..., int], count: int) -> None:
    """`update` counts `count` pages needing judgment; with any, it changes nothing until told
    they were judged, and then counts the same."""
    assert update() == count
    if count:
        assert_same(pp, want)
        assert update(judged=True) == count


@pytest.mark.parametrize("seed", range(40))
def test_grant_equals_numpy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    pp = random_pool(rng)
    pages = pages_of(rng, seed % 2 == 0, pp, (pp.use == 0) & (pp.reserved == 0))
    ts = None if seed % 3 == 0 else 12345
    want = state(pp)
    busy = int(np.count_nonzero(want["use"][pages] | want["reserved"][pages]))  # in use, or reserved
    judged_count(pp, want, lambda **j: pp.grant(pages, REQ, ts, **j), busy)
    # A page in use keeps its holds; one not in use has none (use counts them), so they are not read.
    want["use"][pages] = np.where(want["use"][pages] > 0, 1 + want["holds"][:, pages].sum(axis=0), 1)
    want["gen"][pages] += 1
    want["owner"][pages] = REQ
    want["own"][pages] = NOBODY
    want["prior"][pages] = want["writer"][pages]
    if ts is not None:
        want["since"][pages] = ts
    assert_same(pp, want)


@pytest.mark.parametrize("seed", range(40))
def test_land_equals_numpy(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    pp = random_pool(rng)
    pages = pages_of(rng, seed % 2 == 0, pp, pp.owner == REQ)
    slots = None if seed % 3 == 0 else rng.integers(0, PAGE + 1, len(pages)).astype(np.uint32)
    want = state(pp)
    foreign = int(np.count_nonzero(want["owner"][pages] != REQ))
    judged_count(pp, want, lambda **j: pp.land(pages, REQ, slots, **j), foreign)
    mine = want["owner"][pages] == REQ
    want["writer"][pages] = REQ
    want["wgen"][pages] = want["gen"][pages]
    want["valid"][pages] = PAGE if slots is None else slots
    want["own"][pages[mine]] = REQ
    want["own"][pages[~mine]] = NOBODY
    assert_same(pp, want)


@pytest.mark.parametrize("seed", range(40))
def test_end_grant_equals_numpy(seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    pp = random_pool(rng)
    pp.use[pp.owner == REQ] += 1  # an owner's grant counts in use
    pages = pages_of(rng, seed % 2 == 0, pp, pp.owner == REQ)
    ts = None if seed % 3 == 0 else 999
    want = state(pp)
    others = int(np.count_nonzero(want["owner"][pages] != REQ))
    judged_count(pp, want, lambda **j: pp.end_grant(pages, REQ, ts, **j), others)
    mine = pages[want["owner"][pages] == REQ]
    want["owner"][mine] = ~REQ
    want["own"][mine] = NOBODY
    want["use"][mine] -= 1
    if ts is not None:
        want["since"][mine] = ts
    assert_same(pp, want)


@pytest.mark.parametrize("seed", range(20))
def test_mark_named_equals_numpy(seed: int) -> None:
    rng = np.random.default_rng(400 + seed)
    pp = random_pool(rng)
    pp.holder_req[:] = rng.integers(0, 9, (len(HOLDERS), N))
    pp.own[:] = np.where(pp.owner >= 0, pp.own, NOBODY)  # a tag, never an ended owner (NumPy would wrap)
    want = np.zeros(12, bool)
    for tags in (pp.writer, pp.prior, pp.own, pp.holder_req[pp.holds > 0]):
        want[tags] = True
    want[np.where(pp.owner >= 0, pp.owner, ~pp.owner)] = True
    got = np.zeros(12, bool)
    before = state(pp)
    pp.mark_named(got)
    assert got.tolist() == want.tolist()
    assert_same(pp, before)


def test_mark_named_refuses_a_tag_beyond_the_requests() -> None:
    pp = PoolPages(N, PAGE)
    pp.holds[HOLDERS.index("offload"), 9] = 1
    pp.holder_req[HOLDERS.index("offload"), 9] = 40
    with pytest.raises(IndexError, match="page 9 names request 40, beyond 12"):
        pp.mark_named(np.zeros(12, bool))
    with pytest.raises(TypeError, match="named: a writable contiguous 1-d bool array"):
        pp.mark_named(np.zeros(64, np.uint8))


def read_clean_numpy(pp: PoolPages, pages: np.ndarray, tokens: int) -> bool:
    """The check as the slot arithmetic says it: every slot read holds REQ's own KV."""
    slots = pp.slots_read(len(pages), tokens)
    return bool(
        ((pp.own[pages] == REQ) & (pp.valid[pages] >= slots)).all()
        and (
            # a short page before the last is read in full (its tail holds someone else's KV)
            (pp.valid[pages[:-1]] == PAGE).all()
        )
    )


@pytest.mark.parametrize("seed", range(60))
def test_read_clean_equals_the_slot_check(seed: int) -> None:
    rng = np.random.default_rng(300 + seed)
    pp = random_pool(rng)
    if seed % 2:
        pp.own[:] = REQ  # mostly clean: only `valid` decides
    pages = rng.choice(N, rng.integers(1, 6), replace=False).astype(np.intp)
    tokens = int(rng.integers((len(pages) - 1) * PAGE + 1, len(pages) * PAGE + 1))
    before = state(pp)
    assert pp.read_clean(pages, REQ, tokens) == read_clean_numpy(pp, pages, tokens)
    assert_same(pp, before)


@pytest.mark.parametrize("seed", range(60))
def test_read_victims_equals_the_numpy_judgment(seed: int) -> None:
    """A refused read's stale and foreign pages and their victims, in C, against the NumPy
    statements the ledger runs for a reader with prefix pages in the pool, given a share
    that covers none of the pages read now (a page shared once and re-granted since, or
    another page): the same pages, victims and order."""
    rng = np.random.default_rng(500 + seed)
    pp = random_pool(rng)
    pages = rng.choice(N, rng.integers(1, 9), replace=False).astype(np.intp)
    tokens = int(rng.integers((len(pages) - 1) * PAGE + 1, len(pages) * PAGE + 1))
    before = state(pp)
    got = pp.read_victims(pages, REQ, tokens)
    other = np.setdiff1d(np.arange(N), pages)[:2]
    was = np.sort(np.concatenate([pages[:1], other])).astype(np.intp)
    stale_gen = pp.gen[was] + np.where(np.isin(was, pages), 1, 0).astype(np.uint32)  # re-granted since
    share = Shared(was, stale_gen, pp.writer[was].copy(), pp.wgen[was].copy())
    reader, pool = SimpleNamespace(idx=REQ), SimpleNamespace(pages=pp)
    slots = pp.slots_read(len(pages), tokens)
    want = shared_read_victims(reader, pool, pages, tokens, share)  # type: ignore[arg-type]
    for name, g, w in zip(("stale", "stale victims", "foreign", "foreign victims"), got, want, strict=True):
        assert g.dtype == (np.intp if "victims" not in name else np.int32), name
        assert g.tolist() == w.tolist(), name
    mine, sound = pp.owner[pages] == REQ, (pp.own[pages] == REQ) & (pp.valid[pages] >= slots)
    assert got[0].tolist() == pages[mine & ~sound].tolist() and got[2].tolist() == pages[~mine].tolist()
    assert REQ not in got[1].tolist() + got[3].tolist()  # the reader is nobody's victim
    assert_same(pp, before)


PAYLOADS = [
    pb.Alloc(req="r", pool=1, pages=[5, 0, 63, 9]),
    pb.Write(req="r", pool=1, pages=[3, 4], slots=[16, 2]),
    pb.Free(req="r", pages=[]),
    pb.Hold(req="r", pool=2, pages=[1], holder="offload"),
    pb.ReadEntry(req="r", pool=0, pages=[2, 2, 7], tokens=40),
    pb.XferRecv(req="r", xfer="x", pool=0, pages=[10, 11, 12], tokens=40, checksums=[1, 2, 3], status="done"),
    pb.Scrub(pool=0, pages=[60, 61]),
]


@pytest.mark.parametrize("message", PAYLOADS, ids=lambda m: type(m).__name__)
def test_page_list_reads_the_serialized_pages(message: object) -> None:
    field = type(message).DESCRIPTOR.fields_by_name["pages"].number
    got = PoolPages(N, PAGE).page_list(message.SerializeToString(), field, distinct=False)
    assert got.dtype == np.intp and got.tolist() == list(message.pages)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def test_page_list_reads_unpacked_pages_and_skips_every_wire_type() -> None:
    # Another encoder may send repeated scalars unpacked, and fields of any wire type around them.
    data = (
        varint(3 << 3 | 0)
        + varint(300)
        + varint(9 << 3 | 1)
        + bytes(8)  # fixed64
        + varint(1 << 3 | 2)
        + varint(3)
        + b"abc"  # a string
        + varint(3 << 3 | 2)
        + varint(3)
        + varint(1)
        + varint(200)  # packed, 1 + 2 bytes
        + varint(8 << 3 | 5)
        + bytes(4)  # fixed32
        + varint(3 << 3 | 0)
        + varint(2)
    )
    got = _pages.page_list(data, 3, 1000, None)
    assert got.tolist() == [300, 1, 200, 2]


@pytest.mark.parametrize(
    "data",
    [
        varint(3 << 3 | 0) + b"\x80",  # a varint cut short
        varint(3 << 3 | 2) + varint(10) + b"\x01",  # a length past the end
        varint(1 << 3 | 3),  # a group (wire type 3)
        varint(2 << 3 | 1) + bytes(3),  # fixed64 cut short
        b"\xff" * 11,  # a key longer than any varint
    ],
)
def test_page_list_refuses_bytes_that_are_no_message(data: bytes) -> None:
    with pytest.raises(TypeError, match="not a serialized protobuf message"):
        _pages.page_list(data, 3, 1000, None)


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=64), st.integers(1, 7), st.booleans())
def test_page_list_survives_any_bytes(data: bytes, field: int, distinct: bool) -> None:
    # The daemon's C parser sees bytes an agent sent (re-serialized by protobuf, but checked
    # as if not): any input gives pages in range or a clear error, and `seen` stays zeroed.
    pp = PoolPages(N, PAGE)
    try:
        got = pp.page_list(data, field, distinct=distinct)
    except (TypeError, IndexError, ValueError):
        assert not pp.state["seen"].any()
        return
    assert not pp.state["seen"].any()
    assert got.dtype == np.intp and ((got >= 0) & (got < N)).all()
    if distinct:
        assert len(set(got.tolist())) == len(got)


def test_page_list_names_the_page_out_of_range_or_repeated_and_leaves_seen_zeroed() -> None:
    pp = PoolPages(N, PAGE)
    with pytest.raises(IndexError) as err:
        pp.page_list(pb.Alloc(pages=[1, 2, N, 3]).SerializeToString(), 3)
    assert err.value.args == (N,)
    with pytest.raises(IndexError) as err:  # beyond intp: clamped, still out of range
        _pages.page_list(varint(3 << 3) + varint((1 << 64) - 1), 3, N, None)
    with pytest.raises(ValueError) as err:
        pp.page_list(pb.Alloc(pages=[4, 9, 4]).SerializeToString(), 3)
    assert err.value.args == (4,)
    assert not pp.state["seen"].any()
    assert pp.page_list(pb.Alloc(pages=[4, 9, 4]).SerializeToString(), 3, distinct=False).tolist() == [
        4,
        9,
        4,
    ]


def test_bad_arrays_and_pages_are_refused_before_anything_changes() -> None:
    pp = PoolPages(N, PAGE)
    before = state(pp)
    with pytest.raises(IndexError, match="page 64 out of range"):
        pp.grant(np.array([1, N], np.intp), REQ, None)
    with pytest.raises(IndexError, match="page -1 out of range"):
        pp.end_grant(np.array([1, -1], np.intp), REQ, None, judged=True)
    with pytest.raises(TypeError, match="pages: a contiguous 1-d intp array"):
        pp.grant(np.array([1, 2], np.int32), REQ, None)
    one = np.array([1], np.intp)
    frozen = pp.state.copy()
    frozen.flags.writeable = False
    loose = np.zeros(N, [(name, RECORD[name]) for name in RECORD.names])  # the fields, packed: not PAGE
    for wrong in (pp.owner, pp.state[::2], pp.state.reshape(2, -1), frozen, loose, pp.state.view(np.uint8)):
        with pytest.raises(TypeError, match="state: a writable contiguous 1-d array of PAGE records"):
            _pages.grant(one, wrong, REQ, None, False)
    with pytest.raises(TypeError, match="state: 32 records for a pool of 64 pages"):
        _pages.page_list(pb.Alloc(pages=[1]).SerializeToString(), 3, N, pp.state[:32])
    with pytest.raises(TypeError, match="slots: a contiguous 1-d uint32 array of 2 entries"):
        pp.land(np.array([1, 2], np.intp), REQ, np.array([1], np.uint32))
    with pytest.raises(TypeError, match="slots: a contiguous 1-d uint32 array"):
        pp.land(np.array([1, 2], np.intp), REQ, np.array([1, 2], np.int64))
    with pytest.raises(TypeError, match="takes 5 arguments"):
        _pages.read_clean(one, pp.state)
    with pytest.raises(TypeError, match="read_victims\\(\\) takes 5 arguments"):
        _pages.read_victims(one, pp.state, REQ)
    with pytest.raises(IndexError, match="page 64 out of range"):
        pp.read_victims(np.array([N], np.intp), REQ, PAGE)
    with pytest.raises(TypeError):
        _pages.end_grant(one, pp.state, REQ, "soon", True)  # a time that is no integer
    assert_same(pp, before)


def test_each_page_is_one_cache_line_and_the_fields_are_views_of_it() -> None:
    pp = PoolPages(N, PAGE)
    assert RECORD.itemsize == 64 and pp.state.ctypes.data % 64 == 0
    pp.grant(np.array([5], np.intp), REQ, 77)
    pp.land(np.array([5], np.intp), REQ, None)
    record = pp.state[5]
    assert (record["owner"], record["own"], record["use"], record["gen"]) == (REQ, REQ, 1, 1)
    assert (record["writer"], record["valid"], record["since"]) == (REQ, PAGE, 77)
    pp.holds[HOLDERS.index("abort"), 5] = 3  # a NumPy write through a field's view lands in the record
    assert pp.state[5]["holds"].tolist() == [0, 0, 0, 3, 0]
    assert pp.owner[6] == ~NOBODY and not pp.state["seen"].any()


# ---------------------------------------------------------------- events read from their bytes


def bad_event_or(apply: Callable[[], object]) -> object:
    try:
        return [(f.finding, f.req, f.victim_req, f.message) for f in apply()]  # type: ignore[attr-defined]
    except BadEvent as exc:
        return exc.kind, str(exc)


START = [
    pb.Event(node="n0", seq=1, pool=pb.PoolReport(pool=0, role="colocated", page_size=PAGE, num_pages=N)),
    pb.Event(node="n0", seq=2, alloc=pb.Alloc(req="r1", pool=0, pages=[1, 2])),
    pb.Event(node="n0", seq=3, write=pb.Write(req="r1", pool=0, pages=[1, 2])),
    pb.Event(node="n0", seq=4, free=pb.Free(req="r1", pool=0, pages=[2])),
]
NEXT = [
    pb.Event(node="n0", seq=5, alloc=pb.Alloc(req="r2", pool=0, pages=[2, 3, 60])),
    pb.Event(node="n0", seq=5, write=pb.Write(req="r1", pool=0, pages=[1, 2])),
    pb.Event(node="n0", seq=6, free=pb.Free(req="r1", pool=0, pages=[1, 2])),
    pb.Event(node="n0", seq=5, read=pb.Read(reads=[pb.ReadEntry(req="r1", pool=0, pages=[1, 2], tokens=20)])),
]


@settings(max_examples=1500, deadline=None, derandomize=True, database=None)
@given(
    st.sampled_from(NEXT),
    st.lists(st.tuples(st.integers(0, 60), st.integers(0, 255)), max_size=3),
    st.integers(0, 3),  # bytes cut off its end
)
def test_any_bytes_are_judged_as_protobuf_parses_them(event: pb.Event, edits: list, cut: int) -> None:
    # An agent's bytes, damaged anywhere: the ledger that reads them (apply_serialized) gives
    # the findings or the error that applying protobuf's parse of them gives, or says they
    # are no event where protobuf refuses them; both ledgers end in the same state.
    body = bytearray(event.SerializeToString())
    for at, value in edits:
        if at < len(body):
            body[at] = value
    data = bytes(body[: len(body) - cut])
    raw, parsed = Ledger(), Ledger()
    for e in START:
        raw.apply(e)
        parsed.apply(e)
    try:
        want = bad_event_or(lambda: parsed.apply(pb.Event.FromString(data)))
    except DecodeError:
        want = None
    got = bad_event_or(lambda: raw.apply_serialized(data))
    if want is None:
        assert got[0] == "malformed" and "not a kvguard.v1.Event" in got[1]
        parsed.stats.bad["malformed"] += 1  # the raw ledger counted the bytes it refused
    else:
        assert got == want
    assert snapshot.dump(raw) == snapshot.dump(parsed)
    # The daemon's way with a node's stream (apply_clean, then apply_serialized where it
    # stops): as apply_serialized alone.
    alone, runs = Ledger(), Ledger()
    for e in START:
        alone.apply(e)
        runs.apply(e)
    want = bad_event_or(lambda: alone.apply_serialized(data, "n0"))
    if runs.apply_clean(wire.single(data), 0, 1, "n0") == 0:
        assert bad_event_or(lambda: runs.apply_serialized(data, "n0")) == want
    else:
        assert want == []
    assert snapshot.dump(runs) == snapshot.dump(alone)


def apply_in_runs(ledger: Ledger, events: list[pb.Event], node: str) -> tuple[list[int], list[object]]:
    """The daemon's way with a batch: apply_clean over the rest, apply_serialized where it
    stops. Where it stopped, and each event's findings or error."""
    bodies = [e.SerializeToString() for e in events]
    batch = wire.batch_of(bodies)
    stops: list[int] = []
    outcomes: list[object] = []
    i = 0
    while i < len(bodies):
        clean = ledger.apply_clean(batch, i, len(bodies), node)
        outcomes += [[] for _ in range(clean - i)]
        if clean < len(bodies):
            stops.append(clean)
            outcomes.append(bad_event_or(lambda b=bodies[clean]: ledger.apply_serialized(b, node)))
        i = clean + 1
    return stops, outcomes


def ev(seq: int, kind: str, node: str = "n0", **fields: object) -> pb.Event:
    if kind == "read":
        return pb.Event(node=node, seq=seq, read=pb.Read(reads=[pb.ReadEntry(**fields)]))  # type: ignore[arg-type]
    return pb.Event(node=node, seq=seq, **{kind: getattr(pb, kind.capitalize())(**fields)})  # type: ignore[arg-type]


# Each needs judgment or is less common: apply_clean stops there, changing nothing for it.
NOT_CLEAN = {
    "early release (one page still granted)": ev(8, "alloc", req="r4", pool=0, pages=[1]),
    "free of a page not its own": ev(8, "free", req="r3", pool=0, pages=[12]),
    "write into a page not its own": ev(8, "write", req="r3", pool=0, pages=[10, 12]),
    "stale read": ev(8, "read", req="r1", pool=0, pages=[1, 10], tokens=20),
    "read of a page never granted": ev(8, "read", req="r3", pool=0, pages=[10, 12], tokens=20),
    "read of an unknown request": ev(8, "read", req="r9", pool=0, pages=[10], tokens=5),
    "write of an unknown request": ev(8, "write", req="r9", pool=0, pages=[20]),
    "read of more pages than listed": ev(8, "read", req="r3", pool=0, pages=[10], tokens=40),
    "a page out of range": ev(8, "alloc", req="r5", pool=0, pages=[N]),
    "a page listed twice": ev(8, "alloc", req="r5", pool=0, pages=[20, 20]),
    "an unknown pool": ev(8, "alloc", req="r5", pool=3, pages=[20]),
    "a repeated sequence number": ev(7, "alloc", req="r5", pool=0, pages=[20]),
    "another node's event": ev(8, "alloc", node="n1", req="r5", pool=0, pages=[20]),
    "another payload": pb.Event(node="n0", seq=8, abort=pb.Abort(req="r3")),
}
# Cases of two: the request has ended (rejected_progress is Python's to report).
AFTER_ABORT = {
    f"{kind} after an abort": [pb.Event(node="n0", seq=8, abort=pb.Abort(req="r3")), event]
    for kind, event in (
        ("alloc", ev(9, "alloc", req="r3", pool=0, pages=[30])),
        ("write", ev(9, "write", req="r3", pool=0, pages=[10])),
        ("read", ev(9, "read", req="r3", pool=0, pages=[10, 11], tokens=20)),
    )
}


@pytest.mark.parametrize("case", [*NOT_CLEAN, *AFTER_ABORT])
def test_apply_clean_stops_where_judgment_begins(case: str) -> None:
    # A batch: a clean run (a new request granted, written and read, all in C), the event of
    # the case, then clean events again (a gap in the sequence numbers too). Applied the
    # daemon's way it stops at that event only, and ends with the findings, errors and state
    # of the same events applied one by one (apply_serialized on the node's stream).
    batch = [
        ev(5, "alloc", req="r3", pool=0, pages=[10, 11]),
        ev(6, "write", req="r3", pool=0, pages=[10, 11]),
        ev(7, "read", req="r3", pool=0, pages=[10, 11], tokens=20),
        *AFTER_ABORT.get(case, [NOT_CLEAN.get(case)]),
        ev(10, "free", req="r3", pool=0, pages=[10, 11]),  # a free may follow the end
        ev(11, "alloc", req="r6", pool=0, pages=[40]),
    ]
    runs, parsed = Ledger(), Ledger()
    for e in START:
        runs.apply(e)
        parsed.apply(e)
    stops, outcomes = apply_in_runs(runs, batch, "n0")
    assert stops == [3, 4] if case in AFTER_ABORT else [3]
    assert outcomes == [
        bad_event_or(lambda e=e: parsed.apply_serialized(e.SerializeToString(), "n0")) for e in batch
    ]
    assert snapshot.dump(runs) == snapshot.dump(parsed)
    assert runs.stats.events == parsed.stats.events and runs.stats.missing == parsed.stats.missing


def test_apply_clean_sweeps_on_its_way_and_leaves_probes_waiting_to_python() -> None:
    # A sweep due after an event: the C run stops after that event, the ledger sweeps, and the
    # run goes on in C. A node whose events a probe's posted writes wait for: apply_clean
    # applies nothing there (that work is the ledger's Python).
    ledger = Ledger(retire_idle=8)
    for e in START:
        ledger.apply(e)
    batch = wire.batch_of(
        [ev(5 + k, "alloc", req=f"s{k}", pool=0, pages=[20 + k]).SerializeToString() for k in range(4)]
    )
    due = ledger.next_sweep - ledger.requests.applied  # events until the sweep
    assert 0 < due <= 2
    sweep = ledger.next_sweep
    assert ledger.apply_clean(batch, 0, 2, "n0") == 2
    assert ledger.next_sweep == sweep + ledger.sweep_every  # swept, after event `due`
    ledger.transfers.posted["n0"] = []
    assert ledger.apply_clean(batch, 2, 4, "n0") == 2
    del ledger.transfers.posted["n0"]
    assert ledger.apply_clean(batch, 2, 4, "n0") == 4
    assert [ledger.request(f"s{k}").granted_pages for k in range(4)] == [1, 1, 1, 1]
