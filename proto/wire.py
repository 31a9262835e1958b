"""kvguard.v1 events as bytes, read once: a batch's events are located and their heads read in
one pass (C, `_wire.c` over `wire.h`), and every part that needs their fields takes them from
the heads instead of decoding the bytes again; the events every request makes are also
written here, from arrays, byte for byte as protobuf writes them.

Invariant: a head is trusted only where wire.h reads the bytes as protobuf would (`kind` set,
and `plain` for the payload's fields); anything else is protobuf's to decode, and a batch
whose framing is unusual is decoded by protobuf and re-framed, so that its events' bytes
always lie back to back in `Batch.data` as an EventBatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from google.protobuf.message import DecodeError

from kvguard.proto import _wire, pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc

HEAD: np.dtype = _wire.HEAD  # one event's head (wire.h: WireHead)
PAYLOAD = {f.name: f.number for f in pb.Event.DESCRIPTOR.oneofs_by_name["payload"].fields}
KIND_OF = {number: name for name, number in PAYLOAD.items()}
PLAIN = ("alloc", "write", "free", "read", "step")  # the payloads read from their bytes (with `plain`)
PAGES = 3  # the field number of `pages` in Alloc, Write, Free and ReadEntry
ENCODED = ("alloc", "write", "free")  # the payloads encode() writes


class NotABatch(ValueError):
    """An AgentMessage that is not a batch (its body, or "empty", is the message)."""


class Batch(NamedTuple):
    """Events as bytes: `data` is an EventBatch (the events' field back to back), `heads` one
    HEAD record per event, in order, with offsets into `data`."""

    data: bytes
    heads: np.ndarray

    def __len__(self) -> int:
        return len(self.heads)

    def event(self, i: int) -> bytes:
        """Event i's bytes."""
        h = self.heads[i]
        return self.data[int(h["start"]) : int(h["end"])]

    def events(self) -> list[bytes]:
        """Every event's bytes (the heads' offsets read once, not a record at a time)."""
        data = self.data
        return [
            data[a:b] for a, b in zip(self.heads["start"].tolist(), self.heads["end"].tolist(), strict=True)
        ]

    def of_node(self, node: str) -> tuple[list[int], int]:
        """(the indices of the events of `node`, how many events are another node's).
        DecodeError if an event whose envelope is not read here is no event at all."""
        mine = _wire.of_node(self.data, self.heads, node.encode())
        if (mine == 2).any():  # unusual bytes: protobuf says whose they are
            for i in np.flatnonzero(mine == 2).tolist():
                mine[i] = pb.Event.FromString(self.event(i)).node == node
        ours = np.flatnonzero(mine)
        return ours.tolist(), len(mine) - len(ours)

    def positions(self, events: Sequence[int]) -> list[tuple[int, int]]:
        """The (epoch, seq) of events at these indices: where each lies in its node's stream
        ((0, 0) where the bytes are no event)."""
        heads = self.heads[events]
        out = list(zip(heads["epoch"].tolist(), heads["seq"].tolist(), strict=True))
        for j in np.flatnonzero(heads["kind"] == 0).tolist():
            out[j] = self.position(events[j])
        return out

    def position(self, i: int) -> tuple[int, int]:
        """Event i's (epoch, seq) ((0, 0) if its bytes are not an event)."""
        if self.heads[i]["kind"]:
            return int(self.heads[i]["epoch"]), int(self.heads[i]["seq"])
        try:
            event = pb.Event.FromString(self.event(i))
        except DecodeError:
            return 0, 0
        return event.epoch, event.seq

    def __reduce__(self) -> tuple[object, tuple[bytes, bytes]]:
        # To the store's writer process: the heads as their raw bytes. Pickling the record
        # array itself would carry its dtype's description with every batch, at many times
        # the cost of the bytes on both sides of the pipe.
        return _batch_of_raw, (self.data, self.heads.tobytes())

    def digests(self, start: int, stop: int) -> np.ndarray:
        """The digests of events [start, stop): each as hash() of its bytes (digest())."""
        return _wire.digests(self.data, self.heads, start, stop)

    def seq(self, i: int) -> int:
        """Event i's sequence number (0 if its bytes are not an event)."""
        return self.position(i)[1]


def digest(body: bytes) -> int:
    """An event's digest: hash() of its bytes (SipHash, keyed per process), as Batch.digests."""
    return hash(body)


def _batch_of_raw(data: bytes, heads: bytes) -> Batch:
    return Batch(data, np.frombuffer(heads, HEAD))


def decode_batch(message: bytes, *, wrapped: bool = True) -> Batch:
    """The events of an AgentMessage batch (or, not `wrapped`, of an EventBatch). DecodeError
    when the bytes are no such message; NotABatch for an AgentMessage of another body."""
    heads = _wire.batch(message, wrapped)
    if heads is not None:
        return Batch(message, heads)
    if wrapped:
        msg = svc.RawAgentMessage.FromString(message)
        body = msg.WhichOneof("body")
        if body != "batch":
            raise NotABatch(body or "empty")
        events = msg.batch.events
    else:
        events = svc.RawEventBatch.FromString(message).events
    return batch_of(events)


def batch_of(bodies: Sequence[bytes]) -> Batch:
    """A batch of events given as their bytes (framed anew as an EventBatch)."""
    return _framed(svc.RawEventBatch(events=bodies).SerializeToString())


def _framed(data: bytes) -> Batch:
    """An EventBatch's bytes, framed as protobuf frames one, with their heads."""
    heads = _wire.batch(data, False)
    assert heads is not None  # an EventBatch framed as protobuf frames it is always read here
    return Batch(data, heads)


def single(body: bytes) -> Batch:
    """One event's bytes as a batch of one (its head read as a batch's would be)."""
    return Batch(body, _wire.single(body))


def frame(bodies: Sequence[bytes]) -> bytes:
    """An AgentMessage batch of these events (what a guard or an agent sends)."""
    return svc.RawAgentMessage(batch=svc.RawEventBatch(events=bodies)).SerializeToString()


def event_head(body: bytes) -> tuple[int, str, int, int, str, int, int, int, int, int] | None:
    """(kind, node, seq, ts_ns, req, pool, tokens, start, end, epoch) of one event of the plain shape
    (`PLAIN`, a read of one entry, a write without slots), where [start, end) are its
    payload's bytes (a read's entry), whose field 3 lists the pages; None for anything else."""
    return _wire.head(body)


def encode(
    kind: str,
    node: str,
    seq: int,
    ts: int,
    req: str,
    pool: int,
    pages: np.ndarray,
    slots: np.ndarray | None,
    epoch: int = 0,
) -> bytes:
    """An alloc, write or free event's bytes (`pages`, `slots`: int64 arrays; slots only for a
    write, None for full pages), as protobuf serializes the same event. ValueError for a page
    or slot count that is not a uint32."""
    return _wire.encode(PAYLOAD[kind], node, seq, ts, epoch, req, pool, pages, slots)


def encode_allocs(
    node: str,
    seq: int,
    ts: int,
    epoch: int,
    reqs: list[str],
    pool: int,
    pages: np.ndarray,
    counts: np.ndarray,
) -> Batch:
    """One alloc event a request (reqs[i] granted the next counts[i] of `pages`), numbered
    from `seq`, each as encode() writes it, as a batch: one pass in C for them all.
    ValueError for counts that do not cover the pages, or a page that is not a uint32."""
    return _framed(_wire.encode_allocs(node, seq, ts, epoch, reqs, pool, pages, counts))


def encode_step(
    node: str,
    seq: int,
    ts: int,
    epoch: int,
    pool: int,
    reqs: list[str] | np.ndarray,
    counts: np.ndarray,
    pages: np.ndarray,
    slots: np.ndarray | None,
    grants: np.ndarray | None = None,
) -> bytes:
    """A step event's bytes, as protobuf serializes the same event: one pass in C, however
    large the batch. `reqs`: the requests' names, or their handles (an int64 array: Step.handles);
    `counts`, `pages`, `slots`, `grants`: int64 arrays (slots None for full pages; grants None
    for none granted). ValueError for a count, page, slot or grant that does not fit, or a
    handle that is not one; TypeError for a request that is not a str."""
    return _wire.encode_step(node, seq, ts, epoch, pool, reqs, counts, pages, slots, grants)


def encode_pass(
    node: str,
    seq: int,
    ts: int,
    epoch: int,
    pool: int,
    reqs: list[str],
    counts: np.ndarray,
    pages: np.ndarray,
    slots: np.ndarray | None,
    grants: np.ndarray,
) -> Batch:
    """A forward pass as a batch: an alloc event for each request granted pages in it (reqs[i]
    the last grants[i] of its counts[i] pages, as encode() writes it), numbered from `seq` in
    request order, then its step (encode_step's) with the next number; one pass in C.
    ValueError for grants or counts that do not fit, or a value that is not a uint32."""
    return _framed(_wire.encode_pass(node, seq, ts, epoch, pool, reqs, counts, pages, slots, grants))
