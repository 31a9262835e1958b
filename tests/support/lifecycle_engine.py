"""A small, correct multi-tenant engine that the ledger's property tests check it against.

`Engine` simulates what a correct serving stack reports for a `Spec`: it keeps its own free
lists, so pages are reused across requests and tenants all the time, and only hands a page
out again once its last user (grant, prefix sharer, or holder) is gone. Each event carries
the engine's view of its node's pages after it (`Ev.after`), to compare the ledger's with."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from lifecycle_spec import BYTES_PER_TOKEN, ROLES, ReqSpec, Spec, pages_for

from kvguard.ledger.findings import Finding
from kvguard.ledger.ledger import Ledger
from kvguard.proto.builder import EventLog


@dataclass(frozen=True, slots=True)
class PageView:
    """One page as the engine knows it."""

    owner: str | None = None  # request its grant belongs to (None: not granted)
    users: int = 0  # live grants (owner, prefix sharers) + holds; 0: the page is in the free list
    writer: str | None = None  # whose KV the page holds
    valid: int = 0  # valid token slots of that KV
    prior: str | None = None  # the writer when the page was last handed out


@dataclass(slots=True)
class Ev:
    """An event as the engine reports it, before it gets its sequence number."""

    node: str
    payload: str
    fields: dict[str, Any]
    after: tuple[PageView, ...] = ()  # the node's pool right after the event


class EnginePool:
    """One node's KV pool: pages, their users, and a LIFO free list (reuse is immediate)."""

    def __init__(self, num_pages: int, rng: random.Random) -> None:
        self.free = list(range(num_pages))
        rng.shuffle(self.free)
        self.view = [PageView()] * num_pages
        self.committed = 0  # pages reserved by started requests and not yet allocated

    def can_reserve(self, n: int) -> bool:
        return len(self.free) - self.committed >= n

    def take(self, req: str, n: int) -> list[int]:
        pages = [self.free.pop() for _ in range(n)]
        for p in pages:
            v = self.view[p]
            assert v.users == 0
            self.view[p] = replace(v, owner=req, users=1, prior=v.writer)
        return pages

    def write(self, req: str, pages: list[int], slots: list[int]) -> None:
        for p, n in zip(pages, slots, strict=True):
            self.view[p] = replace(self.view[p], writer=req, valid=n)

    def use(self, pages: list[int]) -> None:
        for p in pages:
            self.view[p] = replace(self.view[p], users=self.view[p].users + 1)

    def unuse(self, pages: list[int], req: str | None = None) -> None:
        """One user of each page leaves (req: its grant ends); unused pages go back to the free list."""
        for p in pages:
            v = self.view[p]
            owner = None if req is not None and v.owner == req else v.owner
            self.view[p] = v = replace(v, owner=owner, users=v.users - 1)
            assert v.users >= 0
            if v.users == 0:
                self.free.append(p)


class Req:
    """A request and what the engine keeps about it."""

    def __init__(self, id: str, spec: ReqSpec) -> None:
        self.id = id
        self.spec = spec
        self.tenant = spec.tenant
        self.own: dict[str, list[int]] = defaultdict(list)  # node -> pages granted, in context order
        self.shared: dict[str, list[int]] = defaultdict(list)  # node -> prefix pages shared with it
        self.origin: dict[str, Req] = {}  # node -> whose prefix it shares
        self.prefix: dict[str, list[int]] = {}  # node -> full pages it offers to the prefix cache
        self.sharers: Counter[str] = Counter()  # node -> requests sharing its prefix now
        self.reserved: Counter[str] = Counter()  # node -> pages reserved and not yet allocated
        self.holds: dict[tuple[str, str], list[int]] = {}  # (node, holder) -> pages
        self.ctx = 0  # context length (tokens) on the node it decodes on

    def pages(self, node: str) -> list[int]:
        return self.shared[node] + self.own[node]


@dataclass(frozen=True)
class Until:
    """A task waits until `ready()`."""

    ready: Callable[[], bool]


@dataclass(frozen=True)
class Decode:
    """A request waits for the next decode batch on `node`."""

    node: str
    req: Req


Wait = Until | Decode | None  # None: a plain scheduling point (another task may run first)


@dataclass(slots=True)
class Task:
    steps: Iterator[Wait]
    wait: Wait = None


class Engine:
    """A correct engine. Each request is a task (a generator that yields where the engine may
    switch to another request); the scheduler picks among the ready tasks at random."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.ps = spec.page_size
        self.rng = random.Random(spec.seed)
        self.pools = {node: EnginePool(n, self.rng) for node, n in spec.pool_pages.items()}
        self.reqs = [Req(f"{s.tenant[0]}{i}", s) for i, s in enumerate(spec.requests)]
        self.tenants = {r.id: r.tenant for r in self.reqs}
        self.prefixes: dict[str, list[Req]] = {node: [] for node in self.pools}  # the prefix cache
        self.events: list[Ev] = []
        self.tasks: list[Task] = []
        self.arrived = 0  # requests are admitted in arrival (list) order

    def arrive(self, r: Req, node: str, pages: int) -> Iterator[Wait]:
        """r arrives `delay` scheduling points after the request before it (first come, first
        served), and is taken once there is room for it on node."""
        turn = self.reqs.index(r)
        yield Until(lambda: self.arrived == turn)
        for _ in range(r.spec.delay):
            yield
        yield Until(lambda: self.pools[node].can_reserve(pages))
        self.arrived += 1

    # -- scheduling

    def run(self) -> list[Ev]:
        for node, n in self.spec.pool_pages.items():
            self.report_pool(node, n)
        for r in self.reqs:
            self.spawn(self.colocated_request(r) if r.spec.colocated else self.pd_request(r))
        if self.spec.rereport:
            for node in self.pools:
                self.spawn(self.agent(node))
        while self.tasks:
            ready = [t for t in self.tasks if not isinstance(t.wait, Until) or t.wait.ready()]
            assert ready, "the simulated engine deadlocked"
            task = self.rng.choice(ready)
            if isinstance(task.wait, Decode):
                node = task.wait.node
                batch = [task] + [
                    t
                    for t in ready
                    if t is not task
                    and isinstance(t.wait, Decode)
                    and t.wait.node == node
                    and self.rng.random() < 0.5
                ]
                self.decode_step(node, [t.wait.req for t in batch if isinstance(t.wait, Decode)])
                for t in batch:
                    self.advance(t)
            else:
                self.advance(task)
        for pool in self.pools.values():
            assert pool.committed == 0 and len(pool.free) == len(pool.view), "the engine leaked pages"
        return self.events

    def spawn(self, steps: Iterator[Wait]) -> None:
        self.tasks.append(Task(steps))

    def advance(self, task: Task) -> None:
        try:
            task.wait = next(task.steps)
        except StopIteration:
            self.tasks.remove(task)

    def later(self, action: Callable[[], None]) -> Iterator[Wait]:
        for _ in range(self.rng.randint(0, 3)):
            yield
        action()

    # -- reporting (every page operation updates the engine's pool, then reports it)

    def emit(self, node: str, payload: str, **fields: Any) -> None:
        fields = {k: list(v) if isinstance(v, list) else v for k, v in fields.items()}  # no aliasing
        self.events.append(Ev(node, payload, fields, tuple(self.pools[node].view)))

    def report_pool(self, node: str, num_pages: int) -> None:
        self.emit(
            node,
            "pool",
            pool=0,
            role=ROLES[node],
            engine="testbed",
            page_size=self.ps,
            num_pages=num_pages,
            context_len=self.spec.context_len,
            kv_dtype="bf16",
        )

    def agent(self, node: str) -> Iterator[Wait]:
        for _ in range(self.rng.randint(1, 20)):
            yield
        self.emit(node, "heartbeat", agent_version="0.1.0", dropped=0)
        self.report_pool(node, self.spec.pool_pages[node])

    def admit(self, node: str, r: Req, stage: str) -> None:
        self.emit(node, "admit", req=r.id, tenant=r.tenant, prompt_tokens=r.spec.prompt, stage=stage)

    def abort(self, node: str, r: Req, reason: str) -> None:
        self.emit(node, "abort", req=r.id, reason=reason)
        for origins in self.prefixes.values():  # an aborted request's prefix is not offered any more
            if r in origins:
                origins.remove(r)

    def reserve(self, node: str, r: Req, n: int) -> None:
        self.pools[node].committed += n
        r.reserved[node] += n

    def unreserve(self, node: str, r: Req, n: int) -> None:
        assert r.reserved[node] >= n
        self.pools[node].committed -= n
        r.reserved[node] -= n

    def alloc(self, node: str, r: Req, n: int) -> None:
        self.unreserve(node, r, n)
        pages = self.pools[node].take(r.id, n)
        r.own[node] += pages
        self.emit(node, "alloc", req=r.id, pool=0, pages=pages)

    def write(self, node: str, r: Req, pages: list[int], slots: list[int]) -> None:
        self.pools[node].write(r.id, pages, slots)
        if all(n == self.ps for n in slots):
            self.emit(node, "write", req=r.id, pool=0, pages=pages)  # slots absent: full pages
        else:
            self.emit(node, "write", req=r.id, pool=0, pages=pages, slots=slots)

    def hold(self, node: str, r: Req, pages: list[int], holder: str) -> None:
        pages = list(pages)
        self.pools[node].use(pages)
        r.holds[node, holder] = pages
        self.emit(node, "hold", req=r.id, pool=0, pages=pages, holder=holder)

    def release(self, node: str, r: Req, holder: str) -> None:
        pages = r.holds.pop((node, holder))
        self.pools[node].unuse(pages)
        self.emit(node, "release", req=r.id, pool=0, pages=pages, holder=holder)

    def share(self, node: str, r: Req, origin: Req, pages: list[int]) -> None:
        self.pools[node].use(pages)
        r.shared[node], r.origin[node] = list(pages), origin
        origin.sharers[node] += 1
        self.emit(node, "share", req=r.id, pool=0, pages=pages, origin_req=origin.id)

    def free(self, node: str, r: Req) -> None:
        """r gives back its grants on node: its own pages and the prefix pages it shares."""
        pages, pool = r.pages(node), self.pools[node]
        pool.unuse(r.own[node], r.id)
        pool.unuse(r.shared[node])
        if r.shared[node]:
            r.origin[node].sharers[node] -= 1
        r.own[node], r.shared[node] = [], []
        self.unreserve(node, r, r.reserved[node])
        if pages:
            self.emit(node, "free", req=r.id, pool=0, pages=pages)

    def read_entry(self, node: str, r: Req) -> dict[str, Any]:
        return {"req": r.id, "pool": 0, "pages": r.pages(node), "tokens": r.ctx}

    def checksums(self, r: Req, n: int) -> list[int]:
        base = 1000 * (self.reqs.index(r) + 1)
        return [base + i for i in range(n)]

    # -- the request lifecycles

    def prefill(self, node: str, r: Req) -> None:
        """Prefix-cache lookup (same tenant only), allocation of the rest, and the prefill write."""
        s, ps = r.spec, self.ps
        total = pages_for(s.prompt, ps)
        candidates = [o for o in self.prefixes[node] if o.tenant == r.tenant] if s.share else []
        origin = self.rng.choice(candidates) if candidates else None
        k = min(len(origin.prefix[node]), (s.prompt - 1) // ps) if origin else 0
        if node == "p0":
            self.reserve(node, r, total - k)
        else:
            self.unreserve(node, r, k)  # c0 reserved the whole context
        if origin and k:
            self.share(node, r, origin, origin.prefix[node][:k])
        self.alloc(node, r, total - k)
        slots = [min(ps, s.prompt - (k + i) * ps) for i in range(total - k)]
        self.write(node, r, r.own[node], slots)
        if not k and s.prompt >= ps:  # its full pages may serve as a prefix for later requests
            r.prefix[node] = r.own[node][: s.prompt // ps]
            self.prefixes[node].append(r)

    def free_all(self, node: str, r: Req) -> Iterator[Wait]:
        """Free r's pages on node; a prefix origin frees only after its sharers."""
        if r in self.prefixes[node]:
            self.prefixes[node].remove(r)
        yield Until(lambda: r.sharers[node] == 0)
        self.free(node, r)

    def evict_prefix(self, node: str, r: Req) -> Iterator[Wait]:
        for _ in range(r.spec.retain):  # the prefix stays cached for a while
            yield
        yield from self.free_all(node, r)

    def drain_decode(self, r: Req) -> Iterator[Wait]:
        """The decode side of a request that will not be decoded: free its reservation and end
        the receive hold, in either order (the pages return to the pool after both)."""
        steps = [lambda: self.free("d0", r)]
        if ("d0", "transfer_recv") in r.holds:
            steps.append(lambda: self.release("d0", r, "transfer_recv"))
        self.rng.shuffle(steps)
        for step in steps:
            step()
            yield

    def decode_step(self, node: str, batch: list[Req]) -> None:
        """One forward over a batch: each request writes its new token (into a new page when
        its last one is full; the writes as a write each, or as one step), then one attention
        launch reads every context."""
        reads = []
        stepped = self.rng.random() < 0.5  # the batch's writes as one step event, or one write each
        written: list[tuple[str, int, int]] = []
        for r in batch:
            if r.ctx % self.ps == 0:
                self.alloc(node, r, 1)
            page, slot = r.own[node][-1], r.ctx % self.ps + 1
            if stepped:  # the pool's view changes when the step is reported
                written.append((r.id, page, slot))
            else:
                self.write(node, r, [page], [slot])
            r.ctx += 1
            reads.append(self.read_entry(node, r))
        if written:
            for req, page, slot in written:
                self.pools[node].write(req, [page], [slot])
            reqs, pages, slots = (list(column) for column in zip(*written, strict=True))
            self.emit(node, "step", pool=0, reqs=reqs, counts=[1] * len(reqs), pages=pages, slots=slots)
        self.emit(node, "read", reads=reads)

    def decode(self, node: str, r: Req) -> Iterator[Wait]:
        s = r.spec
        steps = s.output if s.fate == "finish" else s.output // 2
        for step in range(steps):
            yield Decode(node, r)
            if step == s.offload_at:
                self.hold(node, r, r.own[node], "offload")  # the KV is copied to host memory
        if s.fate == "finish":
            self.emit(node, "finish", req=r.id, output_tokens=steps)
        else:
            self.abort(node, r, "timeout")
        offloaded = (node, "offload") in r.holds
        if offloaded and not s.release_late:
            self.release(node, r, "offload")
        yield
        yield from self.free_all(node, r)
        if offloaded and s.release_late:
            self.spawn(self.later(lambda: self.release(node, r, "offload")))

    def pd_request(self, r: Req) -> Iterator[Wait]:
        s, ps = r.spec, self.ps
        prompt_pages = pages_for(s.prompt, ps)
        # Bootstrap: decode learns the prompt length and reserves its pages (and room to grow).
        yield from self.arrive(r, "d0", pages_for(s.prompt + s.output, ps))
        self.reserve("d0", r, pages_for(s.prompt + s.output, ps))
        self.emit("d0", "bootstrap", req=r.id, prefill_node="p0", decode_node="d0", prompt_tokens=s.prompt)
        self.alloc("d0", r, prompt_pages)
        if s.recv_hold:
            self.hold("d0", r, r.own["d0"], "transfer_recv")
        yield
        if s.fate in ("reject", "abort_queued"):
            if s.fate == "reject":
                self.emit("p0", "reject", req=r.id, reason="prefill queue full")
            else:
                self.abort("d0", r, "client disconnected")
            yield
            yield from self.drain_decode(r)
            return
        # Prefill on p0.
        yield Until(lambda: self.pools["p0"].can_reserve(prompt_pages))
        self.admit("p0", r, "prefill")
        self.prefill("p0", r)
        yield
        if s.fate == "abort_prefill":
            self.abort("p0", r, "prefill error")
            yield
            yield from self.free_all("p0", r)
            yield from self.drain_decode(r)
            return
        # The transfer p0 -> d0.
        xfer, sent, nbytes = f"x-{r.id}", r.pages("p0"), s.prompt * BYTES_PER_TOKEN
        sums = self.checksums(r, prompt_pages)
        send = {"req": r.id, "xfer": xfer, "peer_node": "d0", "pool": 0, "pages": sent, "tokens": s.prompt}
        if s.send_hold:
            self.hold("p0", r, sent, "transfer_send")
        if s.fate == "abort_sending":
            self.abort("p0", r, "decode node went away")
            yield
            self.emit("p0", "xfer_send", **send, bytes=0, checksums=sums, status="failed")
            self.spawn(self.later(lambda: self.release("p0", r, "transfer_send")))
            yield
            yield from self.free_all("p0", r)
            yield from self.drain_decode(r)
            return
        cuts = sorted(self.rng.sample(range(1, nbytes), s.wire_chunks - 1)) if s.wire_chunks else []
        chunks = [b - a for a, b in zip([0, *cuts], [*cuts, nbytes], strict=True)] if s.wire_chunks else []
        early = self.rng.randint(0, len(chunks))
        ends = {"complete": True} if s.wire_complete else {}  # on the probe's last report only
        for i, n in enumerate(chunks):
            if i == early:  # the probe may see bytes before the sender reports completion
                self.emit("p0", "xfer_send", **send, bytes=nbytes, checksums=sums, status="done")
            last = ends if i == len(chunks) - 1 else {}
            self.emit("p0", "wire", xfer=xfer, peer_node="d0", bytes=n, calls=1, probe="ebpf", **last)
        if early == len(chunks):
            self.emit("p0", "xfer_send", **send, bytes=nbytes, checksums=sums, status="done")
        if s.send_hold:
            self.spawn(self.later(lambda: self.release("p0", r, "transfer_send")))
        self.spawn(self.evict_prefix("p0", r))
        yield
        recv_pages = list(r.own["d0"])
        recv = {"req": r.id, "xfer": xfer, "peer_node": "p0", "pool": 0, "pages": recv_pages}
        recv |= {"tokens": s.prompt, "bytes": nbytes, "checksums": sums, "status": "done"}
        slots = [min(ps, s.prompt - i * ps) for i in range(prompt_pages)]
        if s.fate == "abort_inflight":
            # The client goes away while the KV is in flight: the grant ends, the receive hold
            # keeps the pages until the transfer lands.
            self.abort("d0", r, "client disconnected")
            self.free("d0", r)
            yield
            self.pools["d0"].write(r.id, recv_pages, slots)
            self.emit("d0", "xfer_recv", **recv)
            yield
            self.release("d0", r, "transfer_recv")
            return
        self.pools["d0"].write(r.id, recv_pages, slots)
        self.emit("d0", "xfer_recv", **recv)
        r.ctx = s.prompt
        if s.recv_hold:
            self.release("d0", r, "transfer_recv")
        yield
        self.admit("d0", r, "decode")
        yield from self.decode("d0", r)

    def colocated_request(self, r: Req) -> Iterator[Wait]:
        s = r.spec
        need = pages_for(s.prompt + s.output, self.ps)
        yield from self.arrive(r, "c0", need)
        if s.fate == "reject":
            self.emit("c0", "reject", req=r.id, reason="rate limited")
            return
        self.reserve("c0", r, need)
        self.admit("c0", r, "prefill")
        self.prefill("c0", r)
        yield
        if s.fate == "abort_prefill":
            self.abort("c0", r, "client disconnected")
            yield
            yield from self.free_all("c0", r)
            return
        r.ctx = s.prompt
        self.emit("c0", "read", reads=[self.read_entry("c0", r)])  # prefill attention
        yield from self.decode("c0", r)


# ---------------------------------------------------------------------------------------- replay and checks


def replay(events: list[Ev], retire_idle: int = 0) -> list[Finding]:
    log, ledger, found = EventLog(), Ledger(retire_idle=retire_idle, forget_idle=0), []
    for ev in events:
        found.extend(ledger.apply(log.add(ev.node, ev.payload, **ev.fields)))
    return found


def ledger_pages(ledger: Ledger, node: str) -> list[tuple[str | None, int, str | None, int, str | None]]:
    """(grantee, users, writer, valid, prior) of every page of a node, as the ledger has them."""
    pp = ledger.nodes[node].pools[0].pages

    def name(idx: int) -> str | None:
        return ledger.requests[idx].id if idx > 0 else None

    return [
        (name(o) if o >= 0 else None, u, name(w), v, name(p))
        for o, u, w, v, p in zip(
            pp.owner.tolist(),
            pp.use.tolist(),
            pp.writer.tolist(),
            pp.valid.tolist(),
            pp.prior.tolist(),
            strict=True,
        )
    ]


def short(f: Finding) -> str:
    victim = f" victim={f.victim_req}/{f.victim_tenant}" if f.victim_req else ""
    return f"{f.finding} {f.node}#{f.seq} req={f.req}/{f.tenant}{victim} pages={list(f.pages)} {f.details}"


def features(engine: Engine, events: list[Ev]) -> set[str]:
    """What a lifecycle exercises (see pytest --hypothesis-show-statistics)."""
    tenant = engine.tenants
    found = set()
    for ev in events:
        f = ev.fields
        if ev.payload == "alloc":
            for p in f["pages"]:
                prior = ev.after[p].prior
                if prior is not None:
                    same = tenant[prior] == tenant[f["req"]]
                    found.add(f"page reused {'within a tenant' if same else 'across tenants'}")
        elif ev.payload == "release" and not any(ev.after[p].users for p in f["pages"]):
            found.add(f"{f['holder']} hold outlived the grant")
        elif ev.payload == "xfer_recv" and ev.after[f["pages"][0]].owner != f["req"]:
            found.add("in-flight transfer drained after an abort")
        elif ev.payload == "read" and len(f["reads"]) > 1:
            found.add("decode batch of several requests")
        elif ev.payload in ("share", "wire", "reject", "abort"):
            found.add(ev.payload)
    return found
