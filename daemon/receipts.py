"""Per-request integrity receipts (`Receipts`, docs/receipts.md): when a request ends on the
node that answers its client, what the daemon knows of the KV it attended, signed with the
daemon's Ed25519 receipt key and kept in the audit chain (a `receipt` record) after its end.

On the loop only what the ledger says at the end is taken (`ended`: one request's numbers),
and the findings judged are noted (`judged`). A thread of its own signs, in batches: it waits
until each end is durable, reads the store for the findings that name each request and its
newest receipt, signs, hands the records to the loop, and waits until they are durable before
the next batch, so that what it reads of receipts is never behind what it issued.

Invariants: a request has one current receipt, its newest; a receipt lists every finding the
store held naming the request when it was signed; a finding stored after a request's receipt
issues a new one that supersedes it (naming its record); a request's end seen again (a restart,
a cell taken over) issues nothing new; nothing of it blocks the loop, and a failure to sign or
store is counted and said, never a stop of the daemon.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvguard import __version__
from kvguard.daemon.ledgers import Ledgers
from kvguard.daemon.store import Record, Store
from kvguard.ledger import Finding, Ledger
from kvguard.ledger.lifecycle import responds
from kvguard.proto import pb, receipt, wire
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.logs import logger

log = logger("daemon")

ENDS = frozenset(wire.PAYLOAD[k] for k in ("finish", "abort", "kill", "reject"))
ADMIT = wire.PAYLOAD["admit"]
BATCH = 4096  # receipts signed and stored together, at most
SIGN_EVERY_S = 0.25  # how long ends gather before the signer takes them (a receipt's usual lag)
FIRST_SEEN = 1 << 18  # requests whose first event's time is kept, until their end
_NONE = np.empty(0, np.int64)
RECOVER_WINDOW = 1 << 20  # with no receipt stored yet, the stored events looked at for ends at start
STORED_WITHIN_S = 60.0  # a batch of receipts not durable by then is said, and the signer goes on


@dataclass(slots=True)
class _Facts:
    """What the ledger said of a request at its end, taken on the loop as it stood (no copies
    of what the ledger only appends to); the signer makes its receipt of them."""

    req: str
    tenant: str
    nodes: list[tuple[str, int]]  # (node, epoch)
    first_ns: int
    last_ns: int
    tokens: int
    shared: int  # prefix pages shared with it
    shares: Counter[str]  # ... of other tenants, by the rule exception that let them ("": none)
    grants: list[tuple[np.ndarray, np.ndarray]]  # per pool: pages granted to it, whether it wrote each
    received: list[tuple[np.ndarray, np.ndarray, bool]]  # per transfer: its pool's grants, its pages, checked


@dataclass(slots=True)
class _End:
    """A request's end: what its receipt says, and where its end lies."""

    facts: _Facts
    node: str
    committed: Future[int]  # its group's first record id
    row: int  # its place in the group


@dataclass(slots=True)
class _Named:
    """A finding that names requests: once durable, their receipts may be superseded."""

    reqs: tuple[str, ...]
    committed: Future[int]


class Receipts:
    def __init__(
        self,
        key: Any,
        store: Store,
        loop: asyncio.AbstractEventLoop,
        record: Callable[[list[Record]], tuple[Future[int], int]],
        counters: Counter[str],
        digest: Callable[[], str],
        name: str,
    ) -> None:
        """Sign with `key` (Ed25519) the receipts of what the daemon applies, reading `store`,
        storing through `record` (Ingest.record, on `loop`), under the rules `digest()`."""
        self.key = key
        self.key_id = receipt.key_id(key.public_key())
        self.public_pem = receipt.public_pem(key.public_key()).decode()
        self.store = store
        self.loop = loop
        self.record = record
        self.counters = counters
        self.digest = digest
        self.name = name
        self._jobs: deque[_End | _Named] = deque()
        self._first: OrderedDict[str, int] = OrderedDict()  # request -> its first event's time
        self._shared: dict[str, Counter[str]] = {}  # request -> prefix pages of other tenants, by rule
        self._wake = threading.Event()
        self._busy = False  # a batch is being issued
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvguard-receipts", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ on the loop

    def admitted(self, body: bytes) -> None:
        """An admit event: its request's first time, kept until it ends."""
        event = pb.Event.FromString(body)
        req = event.admit.req
        if req and req not in self._first:
            self._first[req] = event.ts_ns
            if len(self._first) > FIRST_SEEN:
                self._first.popitem(last=False)

    def shared(self, finding: Finding, permitted_by: str) -> None:
        """A cross-tenant prefix share of the finding's request, let through by the rule
        exception `permitted_by` ("": judged a finding)."""
        if finding.req:
            self._shared.setdefault(finding.req, Counter())[permitted_by] += len(finding.pages)

    def ended(self, ledger: Ledger, node: str, body: bytes, committed: Future[int], row: int) -> None:
        """Event `body` of `node` ended its request where its client is answered (its record
        lies at `row` of the group `committed` reports): its facts taken, the rest is the
        signer's."""
        event = pb.Event.FromString(body)
        payload = event.WhichOneof("payload") or ""
        req = getattr(getattr(event, payload), "req", "")
        r = ledger.request(req) if req else None
        if r is None:
            return
        grants: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        for where in r.pools:
            held = ledger.nodes[where[0]].pools.get(where[1]) if where[0] in ledger.nodes else None
            runs = held.grants.get(r.idx) if held is not None else None
            if held is not None and runs:
                pages = runs[0] if len(runs) == 1 else np.concatenate(runs)
                grants[where] = (pages, held.pages.writer[pages] == r.idx)
        received = []
        for xfer in r.xfers:
            t = ledger.transfers.by_id.get(xfer)
            if t is not None and t.recv is not None and t.recv.status == "done":
                mine = grants.get((t.recv.node, t.recv.pool))
                sent = t.send.checksums if t.send is not None else ()
                checked = bool(len(sent)) and len(t.recv.checksums) == len(sent)
                received.append((mine[0] if mine else _NONE, t.recv.pages, checked))
        names = {n for n, _ in r.pools} | set(r.bootstrap_nodes or ()) | {node}
        facts = _Facts(
            req,
            r.tenant,
            [(n, _epoch(ledger, n)) for n in sorted(names)],
            self._first.pop(req, 0),
            event.ts_ns,
            r.prompt_tokens + r.output_tokens,
            sum(len(sh.pages) for sh in r.shared.values()),
            self._shared.pop(req, Counter()),
            list(grants.values()),
            received,
        )
        self._jobs.append(_End(facts, node, committed, row))

    def judged(self, finding: Finding, committed: Future[int]) -> None:
        """A finding stored in the group `committed` reports: the receipts of the requests it
        names may have to be superseded."""
        reqs = tuple(r for r in (finding.req, finding.victim_req) if r)
        if reqs:
            self._jobs.append(_Named(reqs, committed))

    def recover(self, ledgers: Ledgers, nodes: Collection[str] | None = None) -> int:
        """The requests that ended (of `nodes`, or of any) after the newest receipt of theirs
        (a stop, a crash or a lost daemon came before theirs was stored) get theirs, from what
        the ledgers know of them; one stored already is not issued again. How many ends."""
        bodies = self.store.newest_of("receipt", 64, nodes)
        newest = [svc.Receipt.FromString(svc.SignedReceipt.FromString(b).receipt) for b in bodies]
        after = max((r.chain_record for r in newest), default=max(0, self.store.last_id() - RECOVER_WINDOW))
        found = 0
        for event_id, node, kind, body in self.store.events_of_kinds(after, ENDS | {ADMIT}, nodes):
            if kind == ADMIT:
                self.admitted(body)
                continue
            ledger = ledgers.holding(node)
            known = ledger.nodes.get(node) if ledger is not None else None
            if ledger is not None and known is not None and responds(known):
                done: Future[int] = Future()
                done.set_result(event_id)
                self.ended(ledger, node, body, done, 0)
                found += 1
        self.counters["receipts_recovered_ends"] += found
        return found

    # ------------------------------------------------------------------ the signer

    def _run(self) -> None:
        while not self._closed:
            # Ends gather for a beat: one batch's reads and one commit for all of them, the
            # fewer the turns the signer takes from the loop's GIL and the store.
            self._wake.wait(SIGN_EVERY_S)
            self._wake.clear()
            full = True
            while full and self._jobs and self._jobs[0].committed.done():
                jobs = []
                self._busy = True
                while self._jobs and self._jobs[0].committed.done() and len(jobs) < BATCH:
                    jobs.append(self._jobs.popleft())
                full = len(jobs) == BATCH  # more may be ready at once; else the next beat
                try:
                    self._issue(jobs)
                except Exception as exc:  # the store away, a bug: said and counted, the daemon goes on
                    self.counters["receipts_failed"] += len(jobs)
                    log.warning(f"receipts of {len(jobs)} requests not issued: {type(exc).__name__} {exc}")
                finally:
                    self._busy = False

    def _issue(self, jobs: Sequence[_End | _Named]) -> None:
        ends = [
            (j, j.committed.result() + j.row)
            for j in jobs
            if isinstance(j, _End) and not j.committed.exception()
        ]
        named = [j for j in jobs if isinstance(j, _Named) and not j.committed.exception()]
        reqs = {j.facts.req for j, _ in ends} | {req for j in named for req in j.reqs}
        facts = self.store.receipt_facts(reqs)
        hashes = self.store.record_hashes({at for _, at in ends})
        made: dict[str, svc.Receipt] = {}
        records: list[Record] = []
        for job, at in ends:
            req = job.facts.req
            if facts[req].latest is not None or req in made:  # its end seen again
                self.counters["receipts_known"] += 1
                continue
            r = self._receipt(job.facts)
            r.chain_record, r.chain_hash = at, hashes.get(at, b"")
            records.append(self._signed(r, facts[req].findings, job.node))
            made[req] = r
        for job in named:
            for req in job.reqs:
                fact = facts.get(req)
                if req in made or fact is None or fact.latest is None:
                    continue  # its receipt, when it comes, lists what is stored by then
                old_id, body = fact.latest
                old = svc.Receipt.FromString(svc.SignedReceipt.FromString(body).receipt)
                if {x.record for x in old.findings} >= {i for i, f in fact.findings if _counts(f)}:
                    continue
                r = svc.Receipt()
                r.CopyFrom(old)
                r.supersedes, r.daemon, r.ruleset_digest = old_id, self.name, self.digest()
                records.append(self._signed(r, fact.findings, old.nodes[-1].node if old.nodes else ""))
                made[req] = r
                self.counters["receipts_superseded"] += 1
        if records:
            self._store(records)

    def _receipt(self, f: _Facts) -> svc.Receipt:
        sources = [x for x in _sources(f) if x.pages]
        return svc.Receipt(
            req=f.req,
            tenant=f.tenant,
            nodes=[svc.ReceiptNode(node=n, epoch=e) for n, e in f.nodes],
            first_ns=f.first_ns,
            last_ns=f.last_ns,
            pages_attended=sum(s.pages for s in sources),
            tokens=f.tokens,
            sources=sources,
            kvguard_version=__version__,
            ruleset_digest=self.digest(),
            daemon=self.name,
        )

    def _signed(self, r: svc.Receipt, findings: list[tuple[int, pb.Finding]], node: str) -> Record:
        del r.findings[:]
        for record_id, f in findings:
            if _counts(f):
                role = "offender" if f.req == r.req else "victim"
                r.findings.add(record=record_id, finding=f.finding, role=role, action=f.action)
        r.verdict = "findings" if r.findings else "clean"
        r.issued_ns = time.time_ns()
        signed = receipt.sign(r, self.key)
        self.counters["receipts"] += 1
        return Record("receipt", node, 0, r.issued_ns, signed.SerializeToString(), r.req, r.tenant)

    def _store(self, records: list[Record]) -> None:
        """Into the chain on the loop; back once durable, so that the next batch reads them."""
        handed: Future[tuple[Future[int], int]] = Future()

        def hand() -> None:
            try:
                handed.set_result(self.record(records))
            except BaseException as exc:
                handed.set_exception(exc)

        self.loop.call_soon_threadsafe(hand)
        committed, _ = handed.result(STORED_WITHIN_S)
        committed.result(STORED_WITHIN_S)

    def flush(self, timeout: float) -> bool:
        """Wait (the loop going on) until every end applied so far has its receipt stored;
        whether there were any."""
        had = bool(self._jobs) or self._busy
        deadline = time.monotonic() + timeout
        while (self._jobs or self._busy) and self._thread.is_alive() and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(0.01)
        return had

    def close(self, timeout: float = 10.0) -> None:
        """Stop signing (what is left is issued after the next start: `recover`)."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout)


def _sources(f: _Facts) -> list[svc.PageSource]:
    """Where the KV of the request's pages came from, in distinct pages: those granted to it
    that a transfer filled (its checksums compared with the sender's, or its count only),
    those it wrote itself, and those neither (`unwritten`: whatever they held before, the
    leak's pages); and the prefix pages shared with it (of its own tenant, or of another as a
    rule's exception let through, by rule)."""
    checked = counted = own = unwritten = 0
    filled: dict[int, np.ndarray] = {}  # by its pool's grants (id): the pages transfers filled
    for grants, pages, by_checksum in f.received:
        before = filled.get(id(grants))
        got = np.intersect1d(grants, pages)
        if before is not None:
            got = np.setdiff1d(got, before, assume_unique=True)
            filled[id(grants)] = np.union1d(before, got)
        else:
            filled[id(grants)] = got
        if by_checksum:
            checked += len(got)
        else:
            counted += len(got)
    for pages, wrote in f.grants:
        distinct, first = np.unique(pages, return_index=True)
        mine = wrote[first]
        done = filled.get(id(pages))
        if done is not None and len(done):
            rest = ~np.isin(distinct, done, assume_unique=True)
            own += int((mine & rest).sum())
            unwritten += int((~mine & rest).sum())
        else:
            own += int(mine.sum())
            unwritten += len(mine) - int(mine.sum())
    out = [
        svc.PageSource(kind="own", pages=own),
        svc.PageSource(kind="transfer_checksum", pages=checked),
        svc.PageSource(kind="transfer_count", pages=counted),
        svc.PageSource(kind="unwritten", pages=unwritten),
        svc.PageSource(kind="prefix_own_tenant", pages=max(0, f.shared - sum(f.shares.values()))),
    ]
    for rule, n in sorted(f.shares.items()):
        if rule:
            out.append(svc.PageSource(kind="prefix_permitted", pages=n, rule=rule))
    out.append(svc.PageSource(kind="prefix_other_tenant", pages=f.shares.get("", 0)))
    return out


def _epoch(ledger: Ledger, node: str) -> int:
    known = ledger.nodes.get(node)
    return known.epoch if known is not None else 0


def _counts(f: pb.Finding) -> bool:
    """Whether a stored finding is one a receipt lists (not the daemon's update of another)."""
    return not f.details.get("update_of")
