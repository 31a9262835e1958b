"""A simulated fleet's events (`fleet`): prefill/decode cells of one prefill node and a few
decode nodes each, as their guards would report them at decode rates, with planted short
transfers; for the bus's tests and benchmark (bench/bus.py), which need hundreds of nodes.

Each tick, every cell admits new requests: the decode node it goes to is told (bootstrap) and
reserves the prompt's pages; the prefill node admits, writes and sends them; the decode node
receives them and decodes, one `read` of all its running requests a tick (its request-steps),
until each request finishes and frees its pages. Every `fault_every`-th request of a cell is
rejected at prefill yet flows on (the incident in miniature): one page is sent for a four-page
prompt, and its decode node attends the four, three holding an earlier request's KV.

Invariants: the events come as per-node batches in one order (`Fleet.batches`), each node's
numbered from 1 without gaps and stamped with times that only grow; the same arguments give
the same bytes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvguard.agents.bus import BusLink, BusStream, BusUnavailable
from kvguard.proto import pb
from kvguard.proto.bus import BusSettings

PAGE = 16
PROMPT_PAGES = 4
TENANTS = ("acme", "globex", "initech", "umbrella")


@dataclass
class Fleet:
    cells: dict[str, list[str]]  # cell -> its nodes, prefill first
    batches: list[tuple[str, list[pb.Event]]] = field(default_factory=list)  # (node, its batch), in order
    request_steps: int = 0  # decode reads of one request, all nodes
    planted: list[str] = field(default_factory=list)  # the requests rejected that flowed on

    def cell_of(self, node: str) -> str:
        return next(cell for cell, nodes in self.cells.items() if node in nodes)

    @property
    def events(self) -> int:
        return sum(len(events) for _, events in self.batches)


class _Node:
    def __init__(self, name: str, role: str, pages: int, clock: list[int]) -> None:
        self.name = name
        self.seq = 0
        self.clock = clock
        self.free: deque[int] = deque(range(pages))
        self.out: list[pb.Event] = []
        self.running: dict[str, tuple[list[int], int]] = {}  # decode: req -> (pages, ticks left)
        self.add(
            "pool", pool=0, role=role, engine="sglang", page_size=PAGE, num_pages=pages, context_len=1024
        )

    def add(self, payload: str, **fields: object) -> None:
        self.seq += 1
        self.clock[0] += 1000
        self.out.append(pb.Event(node=self.name, seq=self.seq, ts_ns=self.clock[0], **{payload: fields}))

    def take(self, n: int) -> list[int]:
        return [self.free.popleft() for _ in range(n)]


def fleet(
    cells: int, decodes: int = 3, ticks: int = 40, arrivals: int = 1, length: int = 8, fault_every: int = 7
) -> Fleet:
    """`cells` cells of 1 prefill and `decodes` decode nodes, `ticks` ticks of traffic: each
    cell admits `arrivals` requests a tick, each decoded for `length` ticks."""
    names = {f"cell{c:03d}": [f"p{c:03d}", *(f"d{c:03d}-{k}" for k in range(decodes))] for c in range(cells)}
    out = Fleet(names)
    clock = [0]
    nodes: dict[str, list[_Node]] = {}
    for cell, members in names.items():
        pages = 4 * PROMPT_PAGES * max(arrivals, 1)
        decode_pages = 2 * PROMPT_PAGES * (length + 1) * arrivals
        nodes[cell] = [_Node(members[0], "prefill", pages, clock)] + [
            _Node(m, "decode", decode_pages, clock) for m in members[1:]
        ]
    serial = {cell: 0 for cell in names}
    for tick in range(ticks):
        for cell, (prefill, *decoders) in nodes.items():
            for _ in range(arrivals if tick < ticks - length - 1 else 0):
                serial[cell] += 1
                n = serial[cell]
                req = f"{cell}-r{n}"
                tenant = TENANTS[n % len(TENANTS)]
                decode = decoders[n % len(decoders)]
                tokens = PROMPT_PAGES * PAGE
                planted = bool(fault_every) and n % fault_every == 0
                decode.add(
                    "bootstrap",
                    req=req,
                    prefill_node=prefill.name,
                    decode_node=decode.name,
                    prompt_tokens=tokens,
                )
                got = decode.take(PROMPT_PAGES)
                decode.add("alloc", req=req, pool=0, pages=got)
                prefill.add("admit", req=req, tenant=tenant, prompt_tokens=tokens, stage="prefill")
                sent_pages = 1 if planted else PROMPT_PAGES
                sent_tokens = 1 if planted else tokens
                if planted:
                    prefill.add("reject", req=req, reason="prompt exceeds the KV pool")
                    out.planted.append(req)
                src = prefill.take(sent_pages)
                prefill.add("alloc", req=req, pool=0, pages=src)
                prefill.add(
                    "write",
                    req=req,
                    pool=0,
                    pages=src,
                    slots=[PAGE] * (sent_pages - 1) + [sent_tokens - PAGE * (sent_pages - 1)],
                )
                xfer = f"x-{req}"
                sums = [hash((req, i)) & 0xFFFF for i in range(sent_pages)]
                nbytes = 1024 * sent_tokens
                prefill.add(
                    "xfer_send",
                    req=req,
                    xfer=xfer,
                    peer_node=decode.name,
                    pool=0,
                    pages=src,
                    tokens=sent_tokens,
                    bytes=nbytes,
                    checksums=sums,
                    status="done",
                )
                prefill.add("free", req=req, pool=0, pages=src)
                prefill.free.extend(src)
                decode.add(
                    "xfer_recv",
                    req=req,
                    xfer=xfer,
                    peer_node=prefill.name,
                    pool=0,
                    pages=got[:sent_pages],
                    tokens=sent_tokens,
                    bytes=nbytes,
                    checksums=sums,
                    status="done",
                )
                decode.add("admit", req=req, tenant=tenant, prompt_tokens=tokens, stage="decode")
                decode.running[req] = (got, length)
            for decode in decoders:
                if decode.running:
                    reads = [
                        {"req": r, "pool": 0, "pages": p, "tokens": PROMPT_PAGES * PAGE}
                        for r, (p, _) in decode.running.items()
                    ]
                    decode.add("read", reads=reads)
                    out.request_steps += len(reads)
                for r, (p, left) in list(decode.running.items()):
                    if left <= 1:
                        decode.add("finish", req=r, output_tokens=length)
                        decode.add("free", req=r, pool=0, pages=p)
                        decode.free.extend(p)
                        del decode.running[r]
                    else:
                        decode.running[r] = (p, left - 1)
            for node in (prefill, *decoders):
                if node.out:
                    out.batches.append((node.name, node.out))
                    node.out = []
    return out


def publish(fleet: Fleet, settings: BusSettings, give_up_s: float = 60.0) -> None:
    """Publish the fleet's batches to the bus in their order, each once stored before the next
    (so that the stream holds them in that order), as their nodes' agents would (agents/bus.py):
    a batch in doubt (the bus lost a server, a PubAck did not come) is sent again on a new
    stream, which knows whether the bus holds it already."""
    link = BusLink(settings, "unset", lambda text: None)
    streams: dict[str, BusStream] = {}
    try:
        for node, events in fleet.batches:
            positions = [(e.epoch, e.seq) for e in events]
            deadline = time.monotonic() + give_up_s
            while True:
                try:
                    stream = streams.get(node)
                    if stream is None:
                        stream = streams[node] = BusStream(link, node, cell=fleet.cell_of(node))
                    if stream.durable < positions[-1]:
                        stream.post([e.SerializeToString() for e in events], positions)
                        stream.next_ack()
                    break
                except BusUnavailable:
                    if time.monotonic() > deadline:
                        raise
                    gone = streams.pop(node, None)
                    if gone is not None:
                        gone.close()
                    time.sleep(0.2)
    finally:
        for stream in streams.values():
            stream.close()
        link.close()
