"""Property-based tests of the ledger against a small, correct engine (tests/support/).

Hypothesis draws a serving scenario (`lifecycle_spec`), the engine runs it (`lifecycle_engine`):
- a correct lifecycle produces no finding, and after every event the ledger's page state
  (grantee, users, writer, valid slots) is the engine's;
- planting exactly one bug in it (`planted_bugs`) produces the finding the contract names for
  it, with the right offender, victim and pages; any other finding may only concern the
  requests involved in the planted bug;
- a snapshot at any point, and events applied from their bytes (in C runs or one by one),
  change no verdict and no state.

At the end, deterministic tests of two ledger gaps these properties led to (a prefix share of
KV its origin did not write; the victim of an early release when two requests held a page).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable

import pytest
from hypothesis import assume, event, given
from hypothesis import strategies as st
from lifecycle_engine import Engine, Ev, features, ledger_pages, replay, short
from lifecycle_spec import SETTINGS, Spec, lifecycles
from planted_bugs import MUTATIONS, Lifecycle

from kvguard.ledger import snapshot
from kvguard.ledger.findings import Finding
from kvguard.ledger.ledger import BadEvent, Ledger
from kvguard.proto import wire
from kvguard.proto.builder import EventLog


@SETTINGS
@given(lifecycles())
def test_correct_lifecycle_has_no_finding(spec: Spec) -> None:
    engine = Engine(spec)
    events = engine.run()
    for feature in sorted(features(engine, events)):
        event(feature)
    log, ledger = EventLog(), Ledger()
    for i, ev in enumerate(events):
        found = ledger.apply(log.add(ev.node, ev.payload, **ev.fields))
        assert not found, f"event {i} ({ev.node} {ev.payload} {ev.fields}): {[short(f) for f in found]}"
        expected = [(v.owner, v.users, v.writer, v.valid, v.prior) for v in ev.after]
        assert ledger_pages(ledger, ev.node) == expected, f"page state after event {i}: {ev}"
    assert ledger.stats.missing == 0 and not ledger.stats.bad
    for node in spec.pool_pages:  # everything drained: no grant, user or hold is left
        pool = ledger.nodes[node].pools[0]
        assert not pool.pages.use.any() and not pool.pages.holds.any() and (pool.pages.owner < 0).all()
        assert not any(pool.live.values())


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@SETTINGS
@given(spec=lifecycles(), pick=st.integers(0, 2**16))
def test_planted_bug_is_found(mutation: str, spec: Spec, pick: int) -> None:
    life = Lifecycle(Engine(spec).run(), spec.page_size)
    planted = MUTATIONS[mutation](life, pick)
    assume(planted is not None)
    assert planted is not None
    found = replay(planted.events)
    # Retiring idle requests (here after 3 events, so that requests are retired and named
    # again all the time) changes no verdict.
    retiring = replay(planted.events, retire_idle=3)
    assert Counter(map(short, retiring)) == Counter(map(short, found))
    report = "\n".join(short(f) for f in found)
    for expect in planted.expect:
        assert any(expect.matches(f) for f in found), f"missing {expect}\nfound:\n{report}"
    assert {f.req for f in found} <= planted.involved, f"findings beyond {planted.involved}:\n{report}"


@SETTINGS
@given(
    spec=lifecycles(),
    mutation=st.sampled_from(["none", *sorted(MUTATIONS)]),
    pick=st.integers(0, 2**16),
    cut=st.integers(0, 2**16),
)
def test_a_snapshot_goes_on_as_the_ledger_would(spec: Spec, mutation: str, pick: int, cut: int) -> None:
    # A daemon restarted from a snapshot taken at any point of any lifecycle (correct or with
    # a planted bug; requests retired after 3 events and forgotten after 12, so that every
    # part of the state is in play) reports what it would have reported without the
    # restart, and ends in the same state, byte for byte.
    life = Lifecycle(Engine(spec).run(), spec.page_size)
    planted = MUTATIONS[mutation](life, pick) if mutation != "none" else None
    log = EventLog()
    stream = [log.add(ev.node, ev.payload, **ev.fields) for ev in (planted or life).events]
    k = cut % (len(stream) + 1)
    whole, found = Ledger(retire_idle=3, forget_idle=12), []
    for e in stream:
        found.extend(whole.apply(e))
    part, again = Ledger(retire_idle=3, forget_idle=12), []
    for e in stream[:k]:
        again.extend(part.apply(e))
    resumed = snapshot.load(snapshot.dump(part))
    for e in stream[k:]:
        again.extend(resumed.apply(e))
    assert list(map(short, again)) == list(map(short, found))
    assert snapshot.dump(resumed) == snapshot.dump(whole)


def outcome(apply: Callable[[], Iterable[Finding]]) -> list[str] | tuple[str, str]:
    try:
        return [short(f) for f in apply()]
    except BadEvent as exc:
        return exc.kind, str(exc)


def in_runs(ledger: Ledger, bodies: list[bytes], node: str) -> list[list[str] | tuple[str, str]]:
    """One batch of a node's stream as the daemon applies it: the clean common events in C
    (apply_clean), as many as come in a row, the next one through apply_serialized."""
    outcomes: list[list[str] | tuple[str, str]] = []
    batch = wire.batch_of(bodies)  # as the daemon reads a batch: its events' heads once
    i = 0
    while i < len(bodies):
        clean = ledger.apply_clean(batch, i, len(bodies), node)
        outcomes += [[] for _ in range(clean - i)]  # no finding, no error
        if clean < len(bodies):
            outcomes.append(outcome(lambda b=bodies[clean]: ledger.apply_serialized(b, node)))
        i = clean + 1
    return outcomes


@SETTINGS
@given(
    spec=lifecycles(),
    mutation=st.sampled_from(["none", *sorted(MUTATIONS)]),
    pick=st.integers(0, 2**16),
    cuts=st.integers(0, 2**16),
)
def test_events_applied_from_their_bytes_are_judged_as_parsed_ones(
    spec: Spec, mutation: str, pick: int, cuts: int
) -> None:
    # The daemon applies each event as it arrived: runs of the clean common events in C
    # (apply_clean), the others from their bytes (apply_serialized: the common events read in
    # C, the rest parsed); the guard, replay and a rebuild apply parsed events. Over any
    # lifecycle, correct or with a planted bug (requests retired after 3 events and forgotten
    # after 12), cut into batches of one node's events at random points: the same findings
    # or errors, event by event, and the same state, byte for byte.
    life = Lifecycle(Engine(spec).run(), spec.page_size)
    planted = MUTATIONS[mutation](life, pick) if mutation != "none" else None
    log = EventLog()
    stream = [log.add(ev.node, ev.payload, **ev.fields) for ev in (planted or life).events]
    parsed, raw = Ledger(retire_idle=3, forget_idle=12), Ledger(retire_idle=3, forget_idle=12)
    for e in stream:
        want = outcome(lambda e=e: parsed.apply(e))
        assert outcome(lambda e=e: raw.apply_serialized(e.SerializeToString(), e.node)) == want
    assert snapshot.dump(raw) == snapshot.dump(parsed)
    # In runs: with requests retired after 3 events a sweep is due after every event, which
    # apply_clean leaves to Python; after 40 (a sweep every 10) and never, it applies runs.
    for retire, forget in ((3, 12), (40, 160), (0, 0)):
        parsed, runs = (
            Ledger(retire_idle=retire, forget_idle=forget),
            Ledger(retire_idle=retire, forget_idle=forget),
        )
        wanted = [outcome(lambda e=e, p=parsed: p.apply(e)) for e in stream]
        cut = random.Random(cuts)
        got: list[list[str] | tuple[str, str]] = []
        start = 0
        while start < len(stream):
            stop = start + 1
            while stop < len(stream) and stream[stop].node == stream[start].node and cut.random() < 0.9:
                stop += 1
            got += in_runs(runs, [e.SerializeToString() for e in stream[start:stop]], stream[start].node)
            start = stop
        assert got == wanted
        assert snapshot.dump(runs) == snapshot.dump(parsed)


# ---------------------------------------------------------------------------------------- a gap it found


def share_scenario(origin_wrote_elsewhere: bool) -> list[Ev]:
    """acme's a2 shares page 0 as a prefix of acme's a1, but page 0 holds globex's KV: g1 wrote
    it (and still holds it, or freed it before a1 was granted it without writing it)."""
    n0 = "n0"
    events = [
        Ev(n0, "pool", {"pool": 0, "role": "colocated", "page_size": 4, "num_pages": 8, "context_len": 32}),
        Ev(n0, "admit", {"req": "g1", "tenant": "globex", "prompt_tokens": 4, "stage": "prefill"}),
        Ev(n0, "alloc", {"req": "g1", "pool": 0, "pages": [0]}),
        Ev(n0, "write", {"req": "g1", "pool": 0, "pages": [0]}),
        Ev(n0, "admit", {"req": "a1", "tenant": "acme", "prompt_tokens": 4, "stage": "prefill"}),
    ]
    if origin_wrote_elsewhere:  # page 0 is still g1's; a1 wrote its prefix into page 1
        events += [
            Ev(n0, "alloc", {"req": "a1", "pool": 0, "pages": [1]}),
            Ev(n0, "write", {"req": "a1", "pool": 0, "pages": [1]}),
        ]
    else:  # g1 is done; page 0 goes to a1, which never writes it
        events += [
            Ev(n0, "free", {"req": "g1", "pool": 0, "pages": [0]}),
            Ev(n0, "alloc", {"req": "a1", "pool": 0, "pages": [0]}),
        ]
    return [
        *events,
        Ev(n0, "admit", {"req": "a2", "tenant": "acme", "prompt_tokens": 5, "stage": "prefill"}),
        Ev(n0, "share", {"req": "a2", "pool": 0, "pages": [0], "origin_req": "a1"}),
        Ev(n0, "alloc", {"req": "a2", "pool": 0, "pages": [2]}),
        Ev(n0, "write", {"req": "a2", "pool": 0, "pages": [2], "slots": [1]}),
        Ev(n0, "read", {"reads": [{"req": "a2", "pool": 0, "pages": [0, 2], "tokens": 5}]}),
    ]


@pytest.mark.parametrize(
    "origin_wrote_elsewhere", [False, True], ids=["origin-never-wrote", "page-of-another"]
)
def test_share_of_kv_the_origin_did_not_write_is_found(origin_wrote_elsewhere: bool) -> None:
    """A share means "the request reads pages written by origin_req" (docs/integrator.md). Here the page
    holds globex's KV, so acme's a2 attends to another tenant's data: exactly the leak kvguard
    exists to catch, through the prefix cache instead of a reservation. Some finding must name
    a2 as the reader and g1 (globex) as the victim (stale_read, foreign_read or
    cross_tenant_share; the contract does not say which)."""
    found = replay(share_scenario(origin_wrote_elsewhere))
    assert any(
        f.finding in ("stale_read", "foreign_read", "cross_tenant_share")
        and (f.req, f.victim_req, f.victim_tenant) == ("a2", "g1", "globex")
        and 0 in f.pages
        for f in found
    ), [short(f) for f in found]


def test_early_release_names_the_holder_still_using_the_page() -> None:
    """Two requests hold page 0 (a1 offloads it, a2, sharing it as a prefix, sends it); a2's
    hold ends, then both grants. When page 0 is handed out again, the user it is taken from is
    a1, whose offload still reads it. The ledger remembers only the last request that placed a
    hold on a page, and names a2 ("a2 still used them (offload hold)")."""
    n0 = "n0"
    found = replay(
        [
            Ev(
                n0,
                "pool",
                {"pool": 0, "role": "colocated", "page_size": 4, "num_pages": 8, "context_len": 32},
            ),
            Ev(n0, "admit", {"req": "a1", "tenant": "acme", "prompt_tokens": 4, "stage": "prefill"}),
            Ev(n0, "alloc", {"req": "a1", "pool": 0, "pages": [0]}),
            Ev(n0, "write", {"req": "a1", "pool": 0, "pages": [0]}),
            Ev(n0, "hold", {"req": "a1", "pool": 0, "pages": [0], "holder": "offload"}),
            Ev(n0, "admit", {"req": "a2", "tenant": "acme", "prompt_tokens": 4, "stage": "prefill"}),
            Ev(n0, "share", {"req": "a2", "pool": 0, "pages": [0], "origin_req": "a1"}),
            Ev(n0, "hold", {"req": "a2", "pool": 0, "pages": [0], "holder": "transfer_send"}),
            Ev(n0, "release", {"req": "a2", "pool": 0, "pages": [0], "holder": "transfer_send"}),
            Ev(n0, "free", {"req": "a2", "pool": 0, "pages": [0]}),
            Ev(n0, "free", {"req": "a1", "pool": 0, "pages": [0]}),
            Ev(n0, "admit", {"req": "g1", "tenant": "globex", "prompt_tokens": 4, "stage": "prefill"}),
            Ev(n0, "alloc", {"req": "g1", "pool": 0, "pages": [0]}),
        ]
    )
    assert [(f.finding, f.req, f.victim_req, f.victim_tenant, f.pages) for f in found] == [
        ("early_release", "g1", "a1", "acme", (0,))
    ], [short(f) for f in found]
