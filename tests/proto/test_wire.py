"""kvguard.v1 events read from and written to their bytes in C (proto/wire.h, _wire.c): what
is read is what protobuf reads, anything unusual is left to protobuf, and what is written is
what protobuf writes."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.ledger.pages import PoolPages
from kvguard.proto import pb, wire
from kvguard.proto.kvguard.v1 import services_pb2 as svc


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


FIELDS = {  # what event_head reads, by name: the numbers it assumes must be the proto's
    "Event": ("node", "seq", "ts_ns", "alloc", "write", "free", "read"),
    "Alloc": ("req", "pool", "pages"),
    "Write": ("req", "pool", "pages", "slots"),
    "Free": ("req", "pool", "pages"),
    "Read": ("reads",),
    "ReadEntry": ("req", "pool", "pages", "tokens"),
}


def test_event_head_assumes_the_protos_field_numbers() -> None:
    numbers = {
        message: [getattr(pb, message).DESCRIPTOR.fields_by_name[name].number for name in names]
        for message, names in FIELDS.items()
    }
    assert numbers == {
        "Event": [1, 2, 3, 16, 17, 18, 22],
        "Alloc": [1, 2, 3],
        "Write": [1, 2, 3, 4],
        "Free": [1, 2, 3],
        "Read": [1],
        "ReadEntry": [1, 2, 3, 4],
    }
    payloads = pb.Event.DESCRIPTOR.oneofs_by_name["payload"].fields
    assert {f.number for f in payloads} == set(range(10, 32))  # another payload: wire.h must know it


def head_of(event: pb.Event) -> tuple[object, ...] | None:
    """event_head's answer, its byte range replaced by the pages found there."""
    body = event.SerializeToString()
    head = wire.event_head(body)
    if head is None:
        return None
    *fields, start, end, epoch = head
    assert epoch == event.epoch
    return (*fields, PoolPages(1 << 20, 16).page_list(body, 3, distinct=False, within=(start, end)).tolist())


def test_event_head_reads_the_events_every_request_makes() -> None:
    def ev(**payload: object) -> pb.Event:
        return pb.Event(node="décode-0", seq=7, ts_ns=-5, **payload)

    assert head_of(ev(alloc=pb.Alloc(req="r", pool=3, pages=[5, 1]))) == (
        16,
        "décode-0",
        7,
        -5,
        "r",
        3,
        0,
        [5, 1],
    )
    assert head_of(ev(write=pb.Write(req="r", pool=1, pages=[2]))) == (17, "décode-0", 7, -5, "r", 1, 0, [2])
    assert head_of(ev(free=pb.Free(req="", pages=[]))) == (18, "décode-0", 7, -5, "", 0, 0, [])
    read = pb.Read(reads=[pb.ReadEntry(req="r", pool=2, pages=[4, 4], tokens=20)])
    assert head_of(ev(read=read)) == (22, "décode-0", 7, -5, "r", 2, 20, [4, 4])
    assert head_of(pb.Event(alloc=pb.Alloc())) == (16, "", 0, 0, "", 0, 0, [])
    assert head_of(pb.Event(epoch=2**64 - 1, free=pb.Free(req="r"))) == (18, "", 0, 0, "r", 0, 0, [])
    # Anything else is protobuf's to read.
    two = pb.Read(reads=[pb.ReadEntry(req="a"), pb.ReadEntry(req="b")])
    for other in (
        ev(write=pb.Write(req="r", pages=[2], slots=[3])),
        ev(read=two),
        ev(read=pb.Read()),
        ev(admit=pb.Admit(req="r")),
        ev(step=pb.Step(reqs=["r"], counts=[1], pages=[2])),  # read in C by the ledger, not here
        ev(),
    ):
        assert head_of(other) is None, other


def test_event_head_leaves_unusual_bytes_to_protobuf() -> None:
    alloc = pb.Event(node="n", seq=2, alloc=pb.Alloc(req="r", pool=1, pages=[3])).SerializeToString()
    assert wire.event_head(alloc) is not None
    unknown = varint(9 << 3 | 0) + varint(5) + varint(40 << 3 | 2) + varint(2) + b"xy"
    assert wire.event_head(alloc + unknown)[:7] == (16, "n", 2, 0, "r", 1, 0)  # unknown fields: skipped
    for unusual in (
        alloc + varint(2 << 3 | 0) + varint(3),  # seq twice (protobuf: the last wins)
        alloc + varint(16 << 3 | 2) + varint(0),  # the payload twice (protobuf: merged)
        alloc + varint(17 << 3 | 2) + varint(0),  # a second payload
        alloc + varint(1 << 3 | 0) + varint(1),  # node as a varint
        alloc + varint(9 << 3 | 3),  # a group
        alloc[:-1],  # cut short
        pb.Event(node="n", alloc=pb.Alloc(req="r", pool=1)).SerializeToString()[:-1] + b"\xff",
    ):
        assert wire.event_head(unusual) is None, unusual
    bad_utf8 = varint(1 << 3 | 2) + varint(2) + b"\xc3\x28" + varint(16 << 3 | 2) + varint(0)
    assert wire.event_head(bad_utf8) is None
    big_pool = varint(16 << 3 | 2) + varint(6) + varint(2 << 3 | 0) + varint(1 << 32)
    assert wire.event_head(big_pool) is None  # beyond uint32: protobuf would cut it


# ---------------------------------------------------------------------------------------- batches

EVENTS = [
    pb.Event(node="d0", seq=1, ts_ns=5, alloc=pb.Alloc(req="r1", pool=0, pages=[4, 5])),
    pb.Event(node="d0", seq=2, ts_ns=6, admit=pb.Admit(req="r1", tenant="acme", stage="decode")),
    pb.Event(node="d0", seq=3, ts_ns=7, read=pb.Read(reads=[pb.ReadEntry(req="r1", pages=[4], tokens=9)])),
]


def test_a_batchs_heads_are_read_once_and_its_events_stay_where_they_are() -> None:
    bodies = [e.SerializeToString() for e in EVENTS]
    message = svc.AgentMessage(batch=svc.EventBatch(events=EVENTS)).SerializeToString()
    batch = wire.decode_batch(message)
    assert batch.data is message  # not copied, not re-framed
    assert batch.events() == bodies
    heads = batch.heads
    assert heads["kind"].tolist() == [16, 11, 22] and heads["plain"].tolist() == [1, 0, 1]
    assert heads["seq"].tolist() == [1, 2, 3] and heads["ts"].tolist() == [5, 6, 7]
    assert [message[h["node_start"] : h["node_end"]] for h in heads] == [b"d0"] * 3
    assert [batch.seq(i) for i in range(3)] == [1, 2, 3]
    # The same events as an EventBatch (a stored run's body), and framed anew from their bytes.
    again = wire.decode_batch(svc.EventBatch(events=EVENTS).SerializeToString(), wrapped=False)
    assert again.events() == bodies == wire.batch_of(bodies).events()
    assert wire.frame(bodies) == message


def test_a_batch_framed_unusually_is_read_by_protobuf_and_framed_anew() -> None:
    # A length not in its shortest form: protobuf reads it; the heads' offsets must lie in
    # bytes that are what protobuf writes (the store keeps runs of them as they lie).
    body = EVENTS[0].SerializeToString()
    long_length = bytes([len(body) | 0x80, 0x00])
    inner = b"\x0a" + long_length + body
    message = b"\x12" + bytes([len(inner)]) + inner
    assert svc.RawAgentMessage.FromString(message).batch.events == [body]
    batch = wire.decode_batch(message)
    assert batch.data != message and batch.events() == [body] and batch.heads["plain"].tolist() == [1]
    with pytest.raises(wire.NotABatch, match="hello"):
        wire.decode_batch(svc.AgentMessage(hello=svc.Hello(node="d0")).SerializeToString())
    with pytest.raises(wire.NotABatch, match="empty"):
        wire.decode_batch(b"")
    with pytest.raises(DecodeError):
        wire.decode_batch(b"\x12\x05ab")


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(st.binary(max_size=80))
def test_any_bytes_as_a_batch_give_protobufs_events_or_its_error(data: bytes) -> None:
    try:
        events = svc.RawAgentMessage.FromString(data)
    except DecodeError:
        with pytest.raises((DecodeError, wire.NotABatch)):
            wire.decode_batch(data)
        return
    if events.WhichOneof("body") != "batch":
        with pytest.raises(wire.NotABatch):
            wire.decode_batch(data)
        return
    batch = wire.decode_batch(data)
    assert batch.events() == list(events.batch.events)
    for i, body in enumerate(batch.events()):  # a head read here says what protobuf says
        h = batch.heads[i]
        if not h["kind"]:
            continue
        event = pb.Event.FromString(body)
        assert (event.seq, event.ts_ns, wire.KIND_OF[int(h["kind"])]) == (
            int(h["seq"]),
            int(h["ts"]),
            event.WhichOneof("payload"),
        )


# ---------------------------------------------------------------------------------------- writing


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(
    st.sampled_from(wire.ENCODED),
    st.text(max_size=5),
    st.integers(0, 2**64 - 1),
    st.integers(-(2**63), 2**63 - 1),
    st.text(max_size=5),
    st.integers(0, 2**32 - 1),
    st.lists(st.integers(0, 2**32 - 1), max_size=6),
    st.booleans(),
)
def test_events_are_written_as_protobuf_writes_them(
    kind: str, node: str, seq: int, ts: int, req: str, pool: int, pages: list[int], with_slots: bool
) -> None:
    slots = [p % 17 for p in pages] if with_slots and kind == "write" else None
    fields = {"req": req, "pool": pool, "pages": pages} | ({"slots": slots} if slots else {})
    epoch = (seq * 7919) % 2**64
    want = pb.Event(node=node, seq=seq, ts_ns=ts, epoch=epoch, **{kind: fields}).SerializeToString()
    got = wire.encode(
        kind,
        node,
        seq,
        ts,
        req,
        pool,
        np.array(pages, np.int64),
        None if slots is None else np.array(slots, np.int64),
        epoch,
    )
    assert got == want
    # Grants to several requests at once: each event as protobuf writes it, numbered on.
    first = seq % 2**63 + 1
    grants = wire.encode_allocs(
        node,
        first,
        ts,
        epoch,
        [req, node],
        pool,
        np.array(pages + pages, np.int64),
        np.array([len(pages)] * 2),
    )
    assert grants.events() == [
        pb.Event(
            node=node, seq=first + i, ts_ns=ts, epoch=epoch, alloc={"req": name, "pool": pool, "pages": pages}
        ).SerializeToString()
        for i, name in enumerate([req, node])
    ]
    # A batch of such requests' writes as one step: the same bytes as protobuf's too.
    reqs = [req, node, ""][: len(pages) % 4]
    counts = [len(pages) // max(len(reqs), 1)] * len(reqs)
    counts[-1:] = [len(pages) - sum(counts[:-1])] if reqs else []
    step = {"pool": pool, "reqs": reqs, "counts": counts, "pages": pages}
    step |= {"slots": slots} if slots else {}
    want = pb.Event(node=node, seq=seq, ts_ns=ts, epoch=epoch, step=step).SerializeToString()
    got = wire.encode_step(
        node,
        seq,
        ts,
        epoch,
        pool,
        reqs,
        np.array(counts, np.int64),
        np.array(pages, np.int64),
        None if slots is None else np.array(slots, np.int64),
    )
    assert got == want
    # A pass: each request's grants (the last of its part) as alloc events, then the step.
    new = [(c + i) % (c + 1) for i, c in enumerate(counts)]  # 0 .. all of a part's pages
    ends = np.cumsum(counts).tolist()
    allocs = [
        pb.Event(
            node=node,
            seq=first + k,
            ts_ns=ts,
            epoch=epoch,
            alloc={"req": reqs[i], "pool": pool, "pages": pages[ends[i] - new[i] : ends[i]]},
        )
        for k, i in enumerate(i for i in range(len(reqs)) if new[i])
    ]
    stepped = pb.Event(node=node, seq=first + len(allocs), ts_ns=ts, epoch=epoch, step=step)
    arrays = (np.array(counts, np.int64), np.array(pages, np.int64))
    given = None if slots is None else np.array(slots, np.int64)
    if sum(counts) != len(pages):  # a step's counts must cover its pages (the ledger checks a step's)
        with pytest.raises(ValueError, match="the counts add up to"):
            wire.encode_pass(node, first, ts, epoch, pool, reqs, *arrays, given, np.array(new, np.int64))
        return
    passed = wire.encode_pass(node, first, ts, epoch, pool, reqs, *arrays, given, np.array(new, np.int64))
    assert passed.events() == [e.SerializeToString() for e in [*allocs, stepped]]


def test_a_page_that_is_no_uint32_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="pages: -1 at 1 is not a uint32"):
        wire.encode("alloc", "n", 1, 1, "r", 0, np.array([3, -1], np.int64), None)
    with pytest.raises(ValueError, match=f"slots: {2**32} at 0 is not a uint32"):
        wire.encode("write", "n", 1, 1, "r", 0, np.array([3], np.int64), np.array([2**32], np.int64))
    with pytest.raises(TypeError, match="int64"):
        wire.encode("free", "n", 1, 1, "r", 0, np.array([3], np.int32), None)
    one = np.array([1], np.int64)
    with pytest.raises(ValueError, match="counts: -1 at 0 is not a uint32"):
        wire.encode_step("n", 1, 1, 0, 0, ["r"], -one, one, None)
    with pytest.raises(ValueError, match="the counts add up to 1 of 2 pages"):
        wire.encode_allocs("n", 1, 1, 0, ["r"], 0, np.array([1, 2], np.int64), one)
    with pytest.raises(TypeError, match=r"reqs\[0\] is int, not str"):
        wire.encode_step("n", 1, 1, 0, 0, [7], one, one, None)
    with pytest.raises(ValueError, match=r"grants\[0\] is 2 of 1 pages"):
        wire.encode_pass("n", 1, 1, 0, 0, ["r"], one, one, None, one * 2)
    with pytest.raises(ValueError, match="1 requests, 1 counts, 2 grants"):
        wire.encode_pass("n", 1, 1, 0, 0, ["r"], one, one, None, np.array([0, 1], np.int64))
