"""The ingest benchmark's workload: each agent's batches of events, built and serialized
before timing, with planted stale reads; the constants the other ingest_* modules share."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvguard.proto import pb
from kvguard.proto.builder import EventLog
from kvguard.proto.channel import MAX_MESSAGE

AGENT_BATCH = 4096  # events the node agent sends at most in one batch (NodeAgent's default)
PAGE_SIZE = 16
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]
PLANTED = "stale_read"
ENTRY = str(Path(__file__).with_name("ingest.py"))  # what the subscriber and floor server processes run


@dataclass
class Workload:
    """One agent's batches, built before timing."""

    node: str
    setup: bytes  # the pool report, sent before the clock starts: the engine started before its traffic
    batches: list[list[pb.Event]]
    bodies: list[list[bytes]]  # each batch's events serialized, as the agent's spool keeps them
    transitions: list[int]  # page transitions per batch
    planted: dict[int, str] = field(default_factory=dict)  # batch index -> planted request
    # Sent after the pool report, before the clock starts: what the engine held when the run began
    warm: list[bytes] = field(default_factory=list)

    @property
    def opening(self) -> list[bytes]:
        """What the agent sends before the clock starts: the pool report, then `warm`."""
        return [self.setup, *self.warm]

    def stream(self) -> tuple[list[bytes], np.ndarray, dict[int, str]]:
        """The same events as one stream: their bytes, the page transitions each one makes,
        and the planted faults by the index of their read."""
        events = [e for batch in self.batches for e in batch]
        bodies = [b for batch in self.bodies for b in batch]
        moved = np.array([page_count(e) for e in events], dtype=np.int64)
        planted = set(self.planted.values())
        reads = {
            i: e.read.reads[0].req
            for i, e in enumerate(events)
            if e.WhichOneof("payload") == "read" and e.read.reads[0].req in planted
        }
        return bodies, moved, reads


def build_agent(
    node: str,
    events: int,
    batch_events: int,
    req_pages: int,
    pool_pages: int,
    plant_every: int,
    seed: int,
    first_plant: int | None = None,
    random_names: bool = False,
) -> Workload:
    """About `events` events of node `node`, after its pool report, cut into batches; a planted
    fault in batch `first_plant` (default plant_every - 1) and every plant_every-th after it.
    Requests are named `{node}-r{i}` in turn, or with random_names as engines name them
    (`cmpl-` and 16 random hex digits, as the testbed's router; SGLang and vLLM use UUIDs),
    which the store's index of request names cannot insert side by side."""
    first_plant = plant_every - 1 if first_plant is None else first_plant
    names = random.Random(seed)
    log = EventLog()
    pool_event = log.add(node, "pool", pool=0, role="colocated", page_size=PAGE_SIZE, num_pages=pool_pages)
    order = np.random.default_rng(seed).permutation(pool_pages).tolist()
    cursor = 0

    def take(n: int) -> list[int]:
        nonlocal cursor
        if cursor + n > pool_pages:
            cursor = 0
        cursor += n
        return order[cursor - n : cursor]

    tokens = PAGE_SIZE * req_pages
    batches: list[list[pb.Event]] = []
    transitions: list[int] = []
    planted: dict[int, str] = {}
    current: list[pb.Event] = []
    moved = 0
    n_events = 0
    i = 0
    while n_events < events:
        index = len(batches)
        due = plant_every and index >= first_plant and (index - first_plant) % plant_every == 0
        if due and index not in planted:
            req = f"{node}-planted{index}"
            page = take(1)
            current += [
                log.add(node, "alloc", req=req, pool=0, pages=page),
                log.add(node, "read", reads=[{"req": req, "pool": 0, "pages": page, "tokens": PAGE_SIZE}]),
                log.add(node, "free", req=req, pool=0, pages=page),
            ]
            planted[index] = req
            moved += 3
            n_events += 3
        req = f"cmpl-{names.getrandbits(64):016x}" if random_names else f"{node}-r{i}"
        i += 1
        pages = take(req_pages)
        current += [
            log.add(node, "alloc", req=req, pool=0, pages=pages),
            log.add(node, "write", req=req, pool=0, pages=pages),
            log.add(node, "read", reads=[{"req": req, "pool": 0, "pages": pages, "tokens": tokens}]),
            log.add(node, "free", req=req, pool=0, pages=pages),
        ]
        moved += 4 * req_pages
        n_events += 4
        if len(current) >= batch_events:
            batches.append(current)
            transitions.append(moved)
            current, moved = [], 0
    if current:
        batches.append(current)
        transitions.append(moved)
    bodies = [[e.SerializeToString() for e in batch] for batch in batches]
    return Workload(node, pool_event.SerializeToString(), batches, bodies, transitions, planted)


def first_plant(k: int, plant_every: int, lockstep: bool) -> int:
    """Agent k's first planted batch. Paced agents start a batch interval / agents apart, so in
    lockstep (every agent plants in the same batches) the run's alerts come as rounds: one from
    each agent within a batch interval, then none for plant_every - 1 intervals. Staggered (the
    default), agent k plants k % plant_every batches later: as many alerts, evenly through the
    run (at the goal rate every ~8 ms instead of 16 in 33 ms of every 131), so the latency is
    sampled across the whole run, not in a quarter of it, and alerts do not queue behind their
    own round."""
    return plant_every - 1 + (0 if lockstep or not plant_every else k % plant_every)


def page_count(event: pb.Event) -> int:
    kind = event.WhichOneof("payload")
    if kind == "read":
        return sum(len(r.pages) for r in event.read.reads)
    return len(getattr(event, kind).pages) if kind in ("alloc", "write", "free") else 0
