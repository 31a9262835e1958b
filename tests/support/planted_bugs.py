"""Bugs planted into a correct lifecycle, one at a time (`MUTATIONS`): each returns the
mutated events and the finding the contract (docs/integrator.md) names for it, with its offender,
victim and pages, and the requests any other finding may concern."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from lifecycle_engine import Ev, PageView
from lifecycle_spec import TENANTS, pages_for

from kvguard.ledger.findings import Finding


@dataclass(frozen=True)
class Expect:
    """A finding that must be present: these fields exactly, at least these pages and details."""

    finding: str
    node: str
    req: str
    tenant: str
    victim_req: str = ""
    victim_tenant: str = ""
    pages: frozenset[int] = frozenset()
    details: tuple[tuple[str, str], ...] = ()

    def matches(self, f: Finding) -> bool:
        return (
            (f.finding, f.node, f.req, f.tenant, f.victim_req, f.victim_tenant)
            == (self.finding, self.node, self.req, self.tenant, self.victim_req, self.victim_tenant)
            and self.pages <= set(f.pages)
            and all(f.details.get(k) == v for k, v in self.details)
        )


@dataclass
class Planted:
    events: list[Ev]
    expect: list[Expect]
    involved: set[str] = field(default_factory=set)  # offender and victims; "" for node-level findings


@dataclass
class Lifecycle:
    events: list[Ev]
    page_size: int


def tenant_at(events: list[Ev], k: int, req: str) -> str:
    """The tenant the ledger knows for req before position k: the one of its first admit. A
    decode reservation comes before the request is admitted anywhere: then it is unknown."""
    return next(
        (ev.fields["tenant"] for ev in events[:k] if ev.payload == "admit" and ev.fields["req"] == req), ""
    )


def expect(
    finding: str,
    events: list[Ev],
    at: int,
    req: str,
    victim: str = "",
    pages: Iterable[int] = (),
    **details: Any,
) -> Expect:
    """The finding that events[at] must raise (on its node)."""
    return Expect(
        finding,
        events[at].node,
        req,
        tenant_at(events, at, req) if req else "",
        victim,
        tenant_at(events, at, victim) if victim else "",
        frozenset(pages),
        tuple(sorted((k, str(v)) for k, v in details.items())),
    )


def reqs_of(ev: Ev) -> list[str]:
    if ev.payload == "read":
        return [e["req"] for e in ev.fields["reads"]]
    return [ev.fields["req"]] if "req" in ev.fields else []


def state_before(events: list[Ev], k: int, node: str) -> tuple[PageView, ...]:
    """The node's pool just before position k (after the last event on it before k)."""
    return next(events[i].after for i in range(k - 1, -1, -1) if events[i].node == node)


def granted_before(events: list[Ev], k: int, node: str, req: str) -> set[int]:
    return {
        p
        for ev in events[:k]
        if ev.node == node and ev.payload == "alloc" and ev.fields["req"] == req
        for p in ev.fields["pages"]
    }


def next_index(events: list[Ev], start: int, test: Callable[[Ev], bool]) -> int | None:
    return next((k for k in range(start, len(events)) if test(events[k])), None)


def with_entry(ev: Ev, j: int, **changes: Any) -> Ev:
    reads = [dict(e) for e in ev.fields["reads"]]
    reads[j] |= changes
    return replace(ev, fields={"reads": reads})


def substituted(events: list[Ev], i: int, ev: Ev) -> list[Ev]:
    return [*events[:i], ev, *events[i + 1 :]]


def inserted(events: list[Ev], k: int, ev: Ev) -> list[Ev]:
    return [*events[:k], ev, *events[k:]]


def by_victim(pages: Iterable[int], victim_of: Callable[[int], str | None]) -> dict[str, set[int]]:
    groups: dict[str, set[int]] = defaultdict(set)
    for p in pages:
        groups[victim_of(p) or ""].add(p)
    return groups


def choose(sites: list[Any], pick: int) -> tuple[Any, int]:
    """One of the sites, and what is left of pick for further choices."""
    return sites[pick % len(sites)], pick // len(sites)


def plant_stale_read(life: Lifecycle, pick: int) -> Planted | None:
    """A read of slots on a reused page that the reader did not write: its write is skipped,
    or it reads one token more than it wrote. The victim is whoever wrote the page before it
    was handed to the reader."""
    events, ps = life.events, life.page_size
    sites = []
    for i, ev in enumerate(events):
        if ev.payload == "write":  # skip it, when the writer next reads (or sends) these pages
            r = ev.fields["req"]
            k = next_index(
                events,
                i + 1,
                lambda e, ev=ev, r=r: (
                    e.node == ev.node and r in reqs_of(e) and e.payload not in ("hold", "release")
                ),
            )
            reads = k is not None and (
                events[k].payload == "read"
                or (events[k].payload == "xfer_send" and events[k].fields["status"] == "done")
            )
            victims = by_victim(ev.fields["pages"], lambda p, ev=ev: ev.after[p].prior)
            victims.pop("", None)
            if reads and victims:
                sites.append((events[:i] + events[i + 1 :], k - 1, r, victims))

        elif ev.payload == "read":  # one token beyond what was written in the last page
            for j, e in enumerate(ev.fields["reads"]):
                last = e["pages"][(e["tokens"] - 1) // ps]
                prior = ev.after[last].prior
                if e["tokens"] % ps and prior not in (None, e["req"]):
                    mutated = substituted(events, i, with_entry(ev, j, tokens=e["tokens"] + 1))
                    sites.append((mutated, i, e["req"], {prior: {last}}))
    if not sites:
        return None
    (mutated, at, r, victims), _ = choose(sites, pick)
    # Requests that share r's prefix pages read the same stale KV, and may be told so too.
    sharers = {ev.fields["req"] for ev in events if ev.payload == "share" and ev.fields["origin_req"] == r}
    return Planted(
        mutated,
        [expect("stale_read", mutated, at, r, v, pages) for v, pages in victims.items()],
        {r, *victims, *sharers},
    )


def plant_half_written_page(life: Lifecycle, pick: int) -> Planted | None:
    """A stale read of a page before the context's last: the reader wrote only half of a page
    that its next read (or send) takes in full (only the last page of a context may be partly
    written). The victim is whoever wrote the page before it was handed to the reader."""
    events, ps = life.events, life.page_size
    sites = []
    for i, ev in enumerate(events):
        if ev.payload != "write":
            continue
        r = ev.fields["req"]
        k = next_index(
            events,
            i + 1,
            lambda e, ev=ev, r=r: (
                e.node == ev.node and r in reqs_of(e) and e.payload not in ("hold", "release")
            ),
        )
        if k is None:
            continue
        nxt = events[k]
        if nxt.payload == "read":
            entry = next(e for e in nxt.fields["reads"] if e["req"] == r)
        elif nxt.payload == "xfer_send" and nxt.fields["status"] == "done":
            entry = nxt.fields  # what leaves the node is checked like a read
        else:
            continue
        whole = set(entry["pages"][: -(-entry["tokens"] // ps) - 1])  # read in full: all but the last
        slots = list(ev.fields.get("slots") or [ps] * len(ev.fields["pages"]))
        for n, p in enumerate(ev.fields["pages"]):
            prior = ev.after[p].prior
            if p in whole and slots[n] == ps and prior not in (None, "", r):
                half = replace(ev, fields={**ev.fields, "slots": [*slots[:n], ps // 2, *slots[n + 1 :]]})
                sites.append((substituted(events, i, half), k, r, prior, p))
    if not sites:
        return None
    (mutated, at, r, victim, page), _ = choose(sites, pick)
    sharers = {ev.fields["req"] for ev in events if ev.payload == "share" and ev.fields["origin_req"] == r}
    return Planted(mutated, [expect("stale_read", mutated, at, r, victim, {page})], {r, victim, *sharers})


def plant_foreign_read(life: Lifecycle, pick: int) -> Planted | None:
    """One read entry points at a page granted to (and written by) another live request."""
    events = life.events
    sites = []
    for i, ev in enumerate(events):
        if ev.payload != "read":
            continue
        for j, e in enumerate(ev.fields["reads"]):
            r = e["req"]
            others = [
                q
                for q, v in enumerate(ev.after)
                if v.owner not in (None, r) and v.writer == v.owner and q not in e["pages"]
            ]
            had = granted_before(events, i, ev.node, r) if others else set()
            sites += [(i, j, q) for q in others if q not in had]
    if not sites:
        return None
    (i, j, q), rest = choose(sites, pick)
    ev = events[i]
    entry = ev.fields["reads"][j]
    pages = list(entry["pages"])
    pages[rest % pages_for(entry["tokens"], life.page_size)] = q
    mutated = substituted(events, i, with_entry(ev, j, pages=pages))
    owner = ev.after[q].owner
    assert owner is not None
    r = entry["req"]
    return Planted(mutated, [expect("foreign_read", mutated, i, r, owner, {q})], {r, owner})


def plant_use_after_free(life: Lifecycle, pick: int) -> Planted | None:
    """A request attends to its pages again after freeing them (right away or much later, when
    they may hold someone else's KV)."""
    events, ps = life.events, life.page_size
    sites = []
    for i, ev in enumerate(events):
        if ev.payload != "free":
            continue
        r, node = ev.fields["req"], ev.node
        last = next(
            (
                e
                for k in range(i - 1, -1, -1)
                if events[k].node == node and events[k].payload == "read"
                for e in events[k].fields["reads"]
                if e["req"] == r
            ),
            None,
        )
        if last is None:
            continue
        covered = last["pages"][: pages_for(last["tokens"], ps)]
        # Only its own pages: a prefix page it stopped sharing would be a foreign read.
        if set(covered) <= granted_before(events, i, node, r) & set(ev.fields["pages"]):
            sites.append((i, r, last, covered))
    if not sites:
        return None
    (i, r, entry, covered), rest = choose(sites, pick)
    node = events[i].node
    k = i + 1 + rest % (len(events) - i)
    state = state_before(events, k, node)
    mutated = inserted(events, k, Ev(node, "read", {"reads": [dict(entry)]}, state))
    victims = by_victim(covered, lambda p: state[p].writer if state[p].writer != r else None)
    return Planted(
        mutated,
        [expect("use_after_free", mutated, k, r, v, pages) for v, pages in victims.items()],
        {r, *victims},
    )


def plant_double_free(life: Lifecycle, pick: int) -> Planted | None:
    """A free repeated (right away, or later, when the pages may be granted to another request)."""
    events = life.events
    sites = [i for i, ev in enumerate(events) if ev.payload == "free"]
    i, rest = choose(sites, pick)
    ev = events[i]
    r = ev.fields["req"]
    k = i + 1 + rest % (len(events) - i)
    state = state_before(events, k, ev.node)
    mutated = inserted(events, k, ev)
    victims = by_victim(ev.fields["pages"], lambda p: state[p].owner if state[p].owner != r else None)
    return Planted(
        mutated,
        [expect("double_free", mutated, k, r, v, pages) for v, pages in victims.items()],
        {r, *victims},
    )


def plant_early_release(life: Lifecycle, pick: int) -> Planted | None:
    """A hold that outlived the grant (offload, transfer) is released only after the allocator
    has handed its pages out again."""
    events = life.events
    sites = []
    for i, ev in enumerate(events):
        held = set(ev.fields["pages"]) if ev.payload == "release" else set()
        if not held or any(ev.after[p].users for p in held):  # the hold must be the last user
            continue
        j = next_index(
            events,
            i + 1,
            lambda e, ev=ev, held=held: (
                e.node == ev.node and e.payload == "alloc" and held & set(e.fields["pages"])
            ),
        )
        if j is not None:
            sites.append((i, j))
    if not sites:
        return None
    (i, j), _ = choose(sites, pick)
    release, alloc = events[i], events[j]
    mutated = [*events[:i], *events[i + 1 : j + 1], release, *events[j + 1 :]]  # the alloc is at j - 1
    holder, new_owner = release.fields["req"], alloc.fields["req"]
    pages = set(release.fields["pages"]) & set(alloc.fields["pages"])
    return Planted(
        mutated, [expect("early_release", mutated, j - 1, new_owner, holder, pages)], {holder, new_owner}
    )


def plant_transfer_mismatch(life: Lifecycle, pick: int) -> Planted | None:
    """One side of a transfer disagrees: the receiver (or the sender) reports fewer tokens than
    decode expects, the receiver fewer bytes or another checksum, or the wire probe fewer bytes
    (judged once both the probe's report of the transfer's end and the sender's claim are in;
    without the end, at the request's next attention, release, free or finish after the
    receiver reports, since a probe's report may arrive after the receiver's)."""
    events = life.events
    sites: list[tuple[int, Ev, dict[str, Any]]] = []
    for i, ev in enumerate(events):
        f = ev.fields
        if ev.payload == "xfer_recv":
            if f["tokens"] >= 2:
                sites.append((i, replace(ev, fields=f | {"tokens": f["tokens"] - 1}), {"what": "tokens"}))
            sites.append((i, replace(ev, fields=f | {"bytes": f["bytes"] - 1}), {"what": "bytes"}))
            sums = [f["checksums"][0] + 1, *f["checksums"][1:]]
            changed = replace(ev, fields=f | {"checksums": sums})
            sites.append((i, changed, {"what": "checksums", "pages": {f["pages"][0]}}))
        elif ev.payload == "xfer_send" and f["status"] == "done" and f["tokens"] >= 2:
            sites.append((i, replace(ev, fields=f | {"tokens": f["tokens"] - 1}), {"what": "tokens"}))
        elif ev.payload == "wire":
            sites.append((i, replace(ev, fields=f | {"bytes": f["bytes"] - 1}), {"what": "wire_bytes"}))
    if not sites:
        return None
    (i, changed, what), _ = choose(sites, pick)
    xfer = changed.fields["xfer"]
    r = next(e.fields["req"] for e in events if e.payload == "xfer_send" and e.fields["xfer"] == xfer)
    mutated = substituted(events, i, changed)
    at = i
    end = next_index(
        mutated, 0, lambda e: e.payload == "wire" and e.fields["xfer"] == xfer and e.fields.get("complete")
    )
    if changed.payload == "wire" and end is not None:
        # The probe saw the transfer end: judged as soon as both it and the sender have spoken.
        sent = next_index(mutated, 0, lambda e: e.payload == "xfer_send" and e.fields["xfer"] == xfer)
        at = max(end, sent or 0)
    elif changed.payload == "wire":
        recv = next_index(mutated, i, lambda e: e.payload == "xfer_recv" and e.fields["xfer"] == xfer)
        if recv is None:  # the receiver never reports: the shortfall is not certain
            return None

        def concerns(e: Ev) -> bool:  # where the ledger judges a shortfall the probe reported
            if e.payload == "read":
                return any(entry["req"] == r for entry in e.fields["reads"])
            return e.payload in ("release", "free", "finish") and e.fields.get("req") == r

        at = next_index(mutated, recv + 1, concerns)
        if at is None:
            return None
    pages = what.pop("pages", ())
    return Planted(mutated, [expect("transfer_mismatch", mutated, at, r, "", pages, xfer=xfer, **what)], {r})


def plant_rejected_progress(life: Lifecycle, pick: int) -> Planted | None:
    """After a reject or abort the request reads (or writes) a page it still holds."""
    events = life.events
    nodes = {ev.node for ev in events}
    sites = []
    for i, ev in enumerate(events):
        if ev.payload not in ("reject", "abort"):
            continue
        r = ev.fields["req"]
        for node in sorted(nodes):
            state = state_before(events, i + 1, node)
            held = [p for p, v in enumerate(state) if v.owner == r]
            written = [p for p in held if state[p].writer == r and state[p].valid]
            if written:
                p = written[0]
                read = {"reads": [{"req": r, "pool": 0, "pages": [p], "tokens": state[p].valid}]}
                sites.append((i, Ev(node, "read", read, state), r))
            elif held:
                write = {"req": r, "pool": 0, "pages": [held[0]], "slots": [1]}
                sites.append((i, Ev(node, "write", write, state), r))
    if not sites:
        return None
    (i, progress, r), _ = choose(sites, pick)
    mutated = inserted(events, i + 1, progress)
    return Planted(mutated, [expect("rejected_progress", mutated, i + 1, r, event=progress.payload)], {r})


def plant_cross_tenant_share(life: Lifecycle, pick: int) -> Planted | None:
    """The prefix cache matches a prompt of another tenant: the sharer belongs to a tenant other
    than its origin's."""
    events = life.events
    sites = [i for i, ev in enumerate(events) if ev.payload == "share"]
    if not sites:
        return None
    i, rest = choose(sites, pick)
    r, origin = events[i].fields["req"], events[i].fields["origin_req"]
    others = [t for t in TENANTS if t != tenant_at(events, i, origin)]
    tenant = others[rest % len(others)]
    mutated = [
        replace(ev, fields=ev.fields | {"tenant": tenant})
        if ev.payload == "admit" and ev.fields["req"] == r
        else ev
        for ev in events
    ]
    planted = expect("cross_tenant_share", mutated, i, r, origin, events[i].fields["pages"])
    assert planted.tenant == tenant
    return Planted(mutated, [planted], {r, origin})


def plant_late_write(life: Lifecycle, pick: int) -> Planted | None:
    """An aborted request's in-flight transfer lands after the abort path dropped the receive
    hold and its pages were granted to another request."""
    events, ps = life.events, life.page_size
    sites = []
    for i, ev in enumerate(events):
        if ev.payload != "xfer_recv":
            continue
        r = ev.fields["req"]
        landed = set(ev.fields["pages"][: pages_for(ev.fields["tokens"], ps)])
        if any(ev.after[p].owner == r for p in landed):  # not a drain: r still holds its grant
            continue
        k = next_index(
            events,
            i + 1,
            lambda e, r=r: e.node == "d0" and e.payload == "release" and e.fields["req"] == r,
        )
        assert k is not None and events[k].fields["holder"] == "transfer_recv"
        j = next_index(
            events,
            k + 1,
            lambda e, landed=landed: (
                e.node == "d0" and e.payload == "alloc" and landed & set(e.fields["pages"])
            ),
        )
        if j is not None:
            sites.append((i, k, j, landed))
    if not sites:
        return None
    (i, k, j, landed), _ = choose(sites, pick)
    recv, release, alloc = events[i], events[k], events[j]
    # The release takes the transfer's place; the transfer lands right after the re-alloc.
    mutated = substituted(events, i, release)
    del mutated[k]
    mutated = inserted(mutated, j, recv)  # the alloc is at j - 1 now
    r, victim = recv.fields["req"], alloc.fields["req"]
    pages = landed & set(alloc.fields["pages"])
    return Planted(mutated, [expect("late_write", mutated, j, r, victim, pages)], {r, victim})


def plant_config_drift(life: Lifecycle, pick: int) -> Planted | None:
    """A pool is reported with an advertised context longer than the pool holds."""
    events = life.events
    sites = [i for i, ev in enumerate(events) if ev.payload == "pool"]
    i, rest = choose(sites, pick)
    ev = events[i]
    tokens = ev.fields["page_size"] * ev.fields["num_pages"]
    context = tokens + 1 + rest % 1000
    mutated = substituted(events, i, replace(ev, fields=ev.fields | {"context_len": context}))
    found = expect("config_drift", mutated, i, "", what="context length", pool_tokens=tokens, limit=context)
    return Planted(mutated, [found], {""})


MUTATIONS: dict[str, Callable[[Lifecycle, int], Planted | None]] = {
    "stale_read": plant_stale_read,
    "stale_read_half_page": plant_half_written_page,
    "foreign_read": plant_foreign_read,
    "use_after_free": plant_use_after_free,
    "double_free": plant_double_free,
    "early_release": plant_early_release,
    "transfer_mismatch": plant_transfer_mismatch,
    "rejected_progress": plant_rejected_progress,
    "cross_tenant_share": plant_cross_tenant_share,
    "late_write": plant_late_write,
    "config_drift": plant_config_drift,
}
