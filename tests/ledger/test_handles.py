"""Request handles (Admit.handle, Step.handles) and a step's own grants (Step.grants): a handle
names exactly the request its admit bound, until that request finishes, and nothing else; a
step that names its batch by handles, with its grants, is judged as the allocs and the named
step it stands for, and the C clean path leaves the state the handlers leave, to the byte."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
from lifecycle_engine import short

from kvguard.ledger import snapshot
from kvguard.ledger.findings import BadEvent, Finding
from kvguard.ledger.handles import SLOT_BITS
from kvguard.ledger.ledger import Ledger
from kvguard.proto import pb, wire
from kvguard.proto.builder import EventLog

PAGE = 4


def pool(log: EventLog, node: str = "n0", pages: int = 64) -> pb.Event:
    return log.add(node, "pool", pool=0, role="colocated", page_size=PAGE, num_pages=pages)


def step(
    log: EventLog, node: str, handles: list[int], counts: list[int], pages: list[int], **more: object
) -> pb.Event:
    return log.add(node, "step", pool=0, handles=handles, counts=counts, pages=pages, **more)


def state(ledger: Ledger) -> list[bytes]:
    """What a refused event must not change: the pages, the requests, the handles."""
    node = ledger.nodes["n0"]
    pages = [p.pages.state.tobytes() for p in node.pools.values()]
    return [*pages, ledger.requests.table.tobytes(), node.handles.table.tobytes(), bytes(node.last_seq)]


def refused(ledger: Ledger, event: pb.Event) -> BadEvent:
    before = state(ledger)
    with pytest.raises(BadEvent) as caught:
        ledger.apply(event)
    assert caught.value.kind == "handle"
    assert state(ledger) == before  # nothing changed, no request judged
    return caught.value


def test_a_step_by_handles_writes_for_the_requests_their_admits_bound() -> None:
    log, ledger = EventLog(), Ledger()
    ledger.apply(pool(log))
    for h, name in ((1, "alice-1"), (2, "bob-1")):
        ledger.apply(
            log.add("n0", "admit", req=name, tenant=name[:-2], prompt_tokens=4, stage="prefill", handle=h)
        )
    # Each granted its first page and writing it in the same step: no alloc event of its own.
    assert ledger.apply(step(log, "n0", [1, 2], [1, 1], [10, 11], grants=[1, 1], slots=[1, 1])) == ()
    pages = ledger.nodes["n0"].pools[0].pages
    alice, bob = ledger.request("alice-1"), ledger.request("bob-1")
    assert alice is not None and bob is not None
    assert pages.owner[[10, 11]].tolist() == [alice.idx, bob.idx]
    assert pages.writer[[10, 11]].tolist() == [alice.idx, bob.idx]
    assert (alice.granted_pages, alice.written_pages, bob.granted_pages) == (1, 1, 1)
    # A read of bob's page by alice is still judged by who owns what, through the handles.
    found = ledger.apply(
        log.add("n0", "read", reads=[{"req": "alice-1", "pool": 0, "pages": [11], "tokens": 1}])
    )
    assert [(f.finding, f.req, f.victim_req) for f in found] == [("foreign_read", "alice-1", "bob-1")]


def test_a_handle_used_after_its_request_finished_is_refused_and_counted() -> None:
    log, ledger = EventLog(), Ledger()
    ledger.apply(pool(log))
    ledger.apply(log.add("n0", "admit", req="r1", tenant="t", prompt_tokens=4, stage="prefill", handle=5))
    ledger.apply(step(log, "n0", [5], [1], [3], grants=[1]))
    ledger.apply(log.add("n0", "free", req="r1", pool=0, pages=[3]))
    ledger.apply(log.add("n0", "finish", req="r1", output_tokens=1))
    exc = refused(ledger, step(log, "n0", [5], [1], [4], grants=[1]))
    assert "handle 5 on node n0" in str(exc) and "named r1, which finished" in str(exc)
    assert ledger.stats.bad["handle"] == 1
    # Bound again by a new admit (its slot's next use): it names the new request now, and the
    # old binding's number (the same slot, an earlier round) is stale.
    again = 5 | 1 << SLOT_BITS
    ledger.apply(log.add("n0", "admit", req="r2", tenant="t", prompt_tokens=4, stage="prefill", handle=again))
    assert ledger.apply(step(log, "n0", [again], [1], [4], grants=[1])) == ()
    r2 = ledger.request("r2")
    assert r2 is not None and ledger.nodes["n0"].pools[0].pages.owner[4] == r2.idx
    exc = refused(ledger, step(log, "n0", [5], [1], [4]))
    assert "stale" in str(exc) and "r2" in str(exc)
    assert ledger.stats.bad["handle"] == 2


def test_a_handle_from_another_epoch_or_never_given_is_refused() -> None:
    log, ledger = EventLog(), Ledger()
    ledger.apply(pool(log))
    ledger.apply(log.add("n0", "admit", req="r1", tenant="t", prompt_tokens=4, stage="prefill", handle=7))
    exc = refused(ledger, step(log, "n0", [8], [1], [3]))
    assert "never given by an admit" in str(exc)
    log.restart("n0", 2)  # the engine restarts: its handles are gone with it
    ledger.apply(pool(log))
    exc = refused(ledger, step(log, "n0", [7], [1], [3], grants=[1]))
    assert "given in epoch 0 (to r1)" in str(exc) and "restarted" in str(exc)
    assert ledger.stats.bad["handle"] == 2


def test_an_admit_may_not_take_a_handle_another_request_holds() -> None:
    log, ledger = EventLog(), Ledger()
    ledger.apply(pool(log))
    ledger.apply(log.add("n0", "admit", req="r1", tenant="t", prompt_tokens=4, stage="prefill", handle=3))
    exc = refused(
        ledger, log.add("n0", "admit", req="r2", tenant="t", prompt_tokens=4, stage="prefill", handle=3)
    )
    assert "is in use" in str(exc) and "r1" in str(exc)
    assert ledger.request("r2") is None
    # The same request admitted again (its decode stage) with its own handle: fine.
    ledger.apply(log.add("n0", "admit", req="r1", tenant="t", prompt_tokens=4, stage="decode", handle=3))


def test_a_step_names_its_batch_by_names_or_by_handles_not_both() -> None:
    log, ledger = EventLog(), Ledger()
    ledger.apply(pool(log))
    ledger.apply(log.add("n0", "admit", req="r1", tenant="t", prompt_tokens=4, stage="prefill", handle=1))
    with pytest.raises(BadEvent, match="both by reqs and by handles"):
        ledger.apply(log.add("n0", "step", pool=0, reqs=["r1"], handles=[1], counts=[1], pages=[2]))
    with pytest.raises(BadEvent, match="grants for 1 requests, each at most its count"):
        ledger.apply(step(log, "n0", [1], [1], [2], grants=[2]))


def decode(seed: int, *, handles: bool, faults: bool) -> list[pb.Event]:
    """A decode engine's stream: requests admitted, granted a page as they cross one, each step
    one token a request (their grants in the step, or as allocs before it), some finishing;
    with `faults`, now and then a page handed out while its owner still holds it."""
    rng = random.Random(seed)
    log = EventLog()
    out = [pool(log, pages=96)]
    free = list(range(1, 96))
    rng.shuffle(free)
    live: dict[str, list[int]] = {}  # name -> pages
    written: dict[str, int] = {}
    handle_of: dict[str, int] = {}
    rounds: dict[int, int] = {}  # slot -> times bound
    serial = 0
    for _ in range(120):
        while len(live) < 6 and len(free) > 8:
            serial += 1
            name = f"r{serial}"
            slot = min(set(range(1, 9)) - {handle_of[n] & ((1 << SLOT_BITS) - 1) for n in live})
            handle = slot | rounds.get(slot, 0) << SLOT_BITS
            rounds[slot] = rounds.get(slot, 0) + 1
            handle_of[name] = handle
            out.append(
                log.add(
                    "n0",
                    "admit",
                    req=name,
                    tenant=f"t{serial % 3}",
                    prompt_tokens=1,
                    stage="prefill",
                    **({"handle": handle} if handles else {}),
                )
            )
            live[name], written[name] = [], 0
        names = sorted(live)
        counts, pages, grants, slots = [], [], [], []
        for name in names:
            new = 0
            if written[name] % PAGE == 0:
                theirs = [p for n in names if n != name for p in live[n] if p not in live[name]]
                page = rng.choice(theirs) if faults and theirs and rng.random() < 0.1 else free.pop()
                live[name].append(page)
                new = 1
            written[name] += 1
            counts.append(1)
            pages.append(live[name][-1])
            grants.append(new)
            slots.append((written[name] - 1) % PAGE + 1)
        if handles:
            out.append(
                log.add(
                    "n0",
                    "step",
                    pool=0,
                    handles=[handle_of[n] for n in names],
                    counts=counts,
                    pages=pages,
                    slots=slots,
                    grants=grants,
                )
            )
        else:
            for name, page, g in zip(names, pages, grants, strict=True):
                if g:
                    out.append(log.add("n0", "alloc", req=name, pool=0, pages=[page]))
            out.append(log.add("n0", "step", pool=0, reqs=names, counts=counts, pages=pages, slots=slots))
        for name in names:
            if rng.random() < 0.08:
                mine = [p for p in live[name] if all(p not in live[o] for o in live if o != name)]
                out.append(log.add("n0", "free", req=name, pool=0, pages=live[name]))
                out.append(log.add("n0", "finish", req=name, output_tokens=written[name]))
                free.extend(mine)
                del live[name]
    return out


def judged(ledger: Ledger, events: list[pb.Event]) -> list[str]:
    """The findings, each as `short` words it but for its event's number (a stream whose
    grants travel as allocs numbers its events otherwise)."""
    found: list[Finding] = []
    for e in events:
        found.extend(ledger.apply(e))
    return sorted(re.sub(r"#\d+", "", short(f)) for f in found)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("faults", [False, True])
def test_steps_by_handles_with_grants_are_judged_as_allocs_and_named_steps(seed: int, faults: bool) -> None:
    by_handles = decode(seed, handles=True, faults=faults)
    by_names = decode(seed, handles=False, faults=faults)
    want = judged(Ledger(), by_names)
    assert judged(Ledger(), by_handles) == want
    assert bool(want) == faults  # the faults are found, and nothing without them
    # The daemon's way: the clean events of a batch in C, the rest one at a time; the same
    # findings and the same state, to the byte, as the handlers applying them one by one.
    parsed, runs = Ledger(), Ledger()
    wanted = [sorted(short(f) for f in parsed.apply(e)) for e in by_handles]
    got: list[list[str]] = []
    bodies = [e.SerializeToString() for e in by_handles]
    cut = random.Random(seed)
    start = 0
    while start < len(bodies):
        stop = min(len(bodies), start + cut.randint(1, 40))
        batch = wire.batch_of(bodies[start:stop])
        i = 0
        while i < len(batch):
            clean = runs.apply_clean(batch, i, len(batch), "n0")
            got += [[] for _ in range(clean - i)]
            if clean < len(batch):
                got.append(sorted(short(f) for f in runs.apply_serialized(batch.event(clean), "n0")))
            i = clean + 1
        start = stop
    assert got == wanted
    assert snapshot.dump(runs) == snapshot.dump(parsed)
    assert runs.stats.events["step"] == parsed.stats.events["step"] > 0


def test_the_clean_path_takes_steps_by_handles_with_grants() -> None:
    # Not a fallback that happens to agree: a clean step by handles with its grants is applied
    # in C, in the run.
    events = decode(1, handles=True, faults=False)
    bodies = [e.SerializeToString() for e in events]
    ledger = Ledger()
    batch = wire.batch_of(bodies)
    at, steps_in_c = 0, 0
    while at < len(batch):
        before = ledger.stats.events["step"]
        clean = ledger.apply_clean(batch, at, len(batch), "n0")
        steps_in_c += ledger.stats.events["step"] - before
        if clean < len(batch):
            ledger.apply_serialized(batch.event(clean), "n0")
        at = clean + 1
    assert steps_in_c == 120


def test_handles_survive_a_snapshot() -> None:
    events = decode(2, handles=True, faults=False)
    cut = len(events) // 2
    whole, first = Ledger(), Ledger()
    for e in events:
        whole.apply(e)
    for e in events[:cut]:
        first.apply(e)
    resumed = snapshot.load(snapshot.dump(first))
    for e in events[cut:]:
        resumed.apply(e)
    assert snapshot.dump(resumed) == snapshot.dump(whole)
    assert len(resumed.nodes["n0"].handles) == len(whole.nodes["n0"].handles) > 0


def test_an_old_capture_by_names_still_replays() -> None:
    # Captures written before handles name every request by its string: still judged.
    events = decode(3, handles=False, faults=True)
    assert judged(Ledger(), events)
    assert np.all([not e.step.handles for e in events if e.WhichOneof("payload") == "step"])
