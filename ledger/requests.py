"""The requests the ledger knows (`Requests`): a request's numbers in one table, its names and
collections on an object (`Request`), and the bookkeeping that keeps memory bounded by what
is in use. Requests is the only writer of request state.

Invariants:
- a request's name maps to one index while it is known; index 0 (NOBODY) is nobody's; the
  index of a forgotten request is reused, and its row starts from zero;
- table[idx] (REQ records: pages.h's `Req`) holds its numbers: state, flags, counts, and when
  an event last named it; the C clean path reads state and flags and writes `last` and the
  counts of the pages it applies, through the table handed to it;
- a request is in use (queued in `recent`, least recently queued first) or retired (in
  `retired`, least recently named first); a retired one holds nothing, and what a later event
  of it may be judged by stays until it is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import repeat
from typing import Any

import numpy as np

from kvguard.ledger import _pages
from kvguard.ledger.findings import NOBODY, BadEvent
from kvguard.proto.limits import REQ_BYTES, unstorable

REQ: np.dtype = _pages.REQ  # a request's numbers; its layout is ledger/pages.h's `Req`
FIELDS: tuple[str, ...] = REQ.names or ()  # REQ's fields, in order (a record's dtype names them)
STATES: tuple[str, ...] = ("new", "admitted", "finished", "rejected", "aborted", "killed")
STATE = {name: code for code, name in enumerate(STATES)}
ENDED: tuple[str, ...] = ("rejected", "aborted", "killed")  # its end: it may only drain from then on
FIRST_ENDED = STATE["rejected"]  # the states from here on are ENDED (pages.h: ENDED)
RETIRED, BOOTSTRAPPED, FINISHED = 1, 2, 4  # flags (pages.h)
GROW_MIN = 4096  # rows the table grows by at least
COUNTS: tuple[str, ...] = tuple(n for n in FIELDS if n not in ("last", "queued", "state", "flags"))
if _pages.REQ_BYTES != REQ_BYTES:  # the C clean path's bound on a request id (pages.h)
    raise ImportError(f"ledger/pages.h REQ_BYTES {_pages.REQ_BYTES} is not proto/limits.py's {REQ_BYTES}")
if STATES[FIRST_ENDED:] != ENDED:
    raise ImportError("requests.STATES must list the ended states last")


class _Number:
    """A request's number, read from its row of the table (Requests writes it)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, r: Request, owner: type | None = None) -> int:
        return int(r._table.columns[self.name][r.idx])


class Request:
    """One request (a global id: the same request crosses prefill and decode nodes): its name,
    index, tenant, why it ended, its bootstrap's nodes, its transfers, the prefix pages it was
    given, and the pools it was granted pages in; its numbers, read from the table (Requests
    writes them)."""

    __slots__ = ("_table", "bootstrap_nodes", "id", "idx", "pools", "reason", "shared", "tenant", "xfers")

    last = _Number()  # the applied-event count when an event last named it
    queued = _Number()  # ... when it was (re)queued among the requests in use
    prompt_tokens = _Number()
    output_tokens = _Number()
    bootstrap_tokens = _Number()  # the prompt tokens its decode side expects
    reserved_pages = _Number()  # granted on its decode node before its KV arrived
    granted_pages = _Number()
    written_pages = _Number()
    freed_pages = _Number()
    shared_pages = _Number()
    sent_pages = _Number()
    sent_tokens = _Number()
    sent_bytes = _Number()
    received_pages = _Number()
    received_tokens = _Number()
    received_bytes = _Number()
    reads = _Number()

    def __init__(self, book: Requests, id: str, idx: int) -> None:
        self._table = book  # the owner of the table (which moves when it grows)
        self.id = id
        self.idx = idx
        self.tenant = ""
        self.reason = ""
        self.bootstrap_nodes: tuple[str, str] | None = None  # (prefill node, decode node)
        self.xfers: list[str] = []  # its transfers' ids
        self.shared: dict[tuple[str, int], Any] = {}  # (node, pool) -> the prefix pages it reads (Shared)
        self.pools: list[tuple[str, int]] = []  # (node, pool) where it was ever granted pages

    @property
    def state(self) -> str:
        return STATES[int(self._table.columns["state"][self.idx])]

    @property
    def ended(self) -> bool:
        return int(self._table.columns["state"][self.idx]) >= FIRST_ENDED

    @property
    def has_finished(self) -> bool:
        """A node that answers its client said it finished: its response had left, ended or not."""
        return bool(self._table.columns["flags"][self.idx] & FINISHED)

    @property
    def retired(self) -> bool:
        return bool(self._table.columns["flags"][self.idx] & RETIRED)

    @property
    def bootstrap(self) -> tuple[str, str, int] | None:
        """(prefill node, decode node, prompt tokens the decode side expects), or None."""
        if self.bootstrap_nodes is None:
            return None
        return (*self.bootstrap_nodes, self.bootstrap_tokens)


if {name for name, value in vars(Request).items() if isinstance(value, _Number)} != {
    *COUNTS,
    "last",
    "queued",
}:
    raise ImportError("Request must read every number of the REQ table (ledger/pages.h: Req)")


DRAIN_STEPS = 2  # forwards an engine may run for a request after a kill from outside reached it


class Requests:
    """Every request the ledger knows, by name and index; `applied` is the ledger's count of
    applied events, the clock of retirement."""

    def __init__(self, retire_idle: int) -> None:
        self.index: dict[str, int] = {}
        self.objects: list[Request | None] = [None]  # by index; None: NOBODY's, or forgotten
        self.table = np.zeros(1024, REQ)
        self.columns: dict[str, np.ndarray] = {name: self.table[name] for name in FIELDS}
        self.applied = 0
        self.retire_idle = retire_idle
        self.recent: OrderedDict[int, Request] = OrderedDict()  # in use, least recently queued first
        self.retired: dict[int, Request] = {}  # least recently named first
        self.free: list[int] = []  # indices to reuse
        # Killed from outside the engine (the daemon, an operator): steps it may still finish.
        self.draining: dict[int, int] = {}

    def __len__(self) -> int:
        """Requests known now (in use or retired; forgotten ones are not)."""
        return len(self.index)

    def get(self, req: str) -> Request | None:
        idx = self.index.get(req)
        return None if idx is None else self.objects[idx]

    def __getitem__(self, idx: int) -> Request | None:
        return self.objects[idx]

    def name_of(self, idx: int) -> tuple[str, str]:
        """(name, tenant) of the request at `idx` ("" for NOBODY or one forgotten)."""
        r = self.objects[idx] if 0 < idx < len(self.objects) else None
        return (r.id, r.tenant) if r is not None else ("", "")

    # ------------------------------------------------------------------ naming and making

    def of_event(self, req: str, payload: str) -> Request:
        """The request an event names (made on its first event); it was just named."""
        if not req:
            raise BadEvent(f"{payload} event has no req")
        r = self.named(req)
        return r if r is not None else self.make(req)

    def named(self, req: str) -> Request | None:
        """The known request `req`, just named by an event (None if unknown)."""
        idx = self.index.get(req)
        if idx is None:
            return None
        r = self.objects[idx]
        assert r is not None  # the index of a forgotten request is not in `index`
        self.columns["last"][idx] = self.applied  # the queue of requests in use is reordered lazily
        if self.columns["flags"][idx] & RETIRED:  # back in use
            self.columns["flags"][idx] &= ~RETIRED & 0xFF
            del self.retired[idx]
            self.columns["queued"][idx] = self.applied
            self.recent[idx] = r
        return r

    def make(self, req: str) -> Request:
        """A new request named `req` (its first event); BadEvent if the store could not keep
        its name."""
        why = unstorable(req, REQ_BYTES)
        if why:
            raise BadEvent(f"request id {req[:40]!r} {why}", "out_of_range")
        if self.free:
            idx = self.free.pop()
            self.table[idx] = np.zeros((), REQ)
        else:
            idx = len(self.objects)
            self.objects.append(None)
            if idx >= len(self.table):
                self.reserve(len(self.table) + max(len(self.table) // 8, GROW_MIN))
        r = self.objects[idx] = Request(self, req, idx)
        self.index[req] = idx
        if self.retire_idle:
            self.columns["last"][idx] = self.columns["queued"][idx] = self.applied
            self.recent[idx] = r
        return r

    def make_at(self, req: str, applied: int) -> np.ndarray:
        """make(req) for the C clean path, in the middle of its run (`applied` events so far,
        which it writes back at the end); the table, which may have moved."""
        self.applied = applied
        self.make(req)
        return self.table

    def reserve(self, size: int) -> None:
        """Room in the table for `size` requests. Grown in place, by an eighth at a time: the
        allocator moves the rows without copying them where it can, and what a step costs is
        the new rows' first touch, so it stays short on the daemon's loop. Its data moves: C is
        handed the table anew each call, and the column views are made again here."""
        if size <= len(self.table):
            return
        self.table.resize(size, refcheck=False)  # zero-filled; no view of it outlives this
        self.columns = {name: self.table[name] for name in FIELDS}

    # ------------------------------------------------------------------ numbers

    def add(self, r: Request, count: str, n: int) -> None:
        """Count n more of `count` (e.g. granted_pages) for r."""
        self.columns[count][r.idx] += n

    def set_state(self, r: Request, state: str) -> None:
        self.columns["state"][r.idx] = STATE[state]

    def killed_from_outside(self, r: Request) -> None:
        """A kill ordered from outside the engine reaches it between steps: the forwards already
        formed for the request (their steps, the pages they grant, their reads) finish, their
        output dropped by the engine, and are a drain, not progress. SGLang's overlap schedule
        forms the next forward before it processes the last one's results, where a kill takes
        effect: up to DRAIN_STEPS of them; vLLM runs none."""
        if not r.ended:
            self.draining[r.idx] = DRAIN_STEPS

    def drains(self, r: Request, step: bool) -> bool:
        """Whether this write (`step`) or read of an ended request is the drain of the forward
        under way when it was killed from outside; anything after it is progress."""
        left = self.draining.get(r.idx)
        if left is None:
            return False
        if not step:
            return True
        if left <= 0:
            del self.draining[r.idx]
            return False
        self.draining[r.idx] = left - 1
        return True

    def end(self, r: Request, state: str, reason: str) -> None:
        """The request ends (rejected, aborted, killed) unless it has already."""
        if not r.ended:
            self.set_state(r, state)
            r.reason = reason

    def admitted(self, r: Request, tenant: str, prompt_tokens: int) -> None:
        """An admission: its tenant (the first one named), its longest prompt, its state."""
        if not r.tenant:
            r.tenant = tenant
        prompt = self.columns["prompt_tokens"]
        prompt[r.idx] = max(int(prompt[r.idx]), prompt_tokens)
        if r.state == "new":
            self.set_state(r, "admitted")

    def finished(self, r: Request, output_tokens: int, responded: bool = True) -> None:
        """It finished on a node; `responded`: one that answers its client (not a prefill node,
        whose finish hands the request on): its response is done, whatever its state says."""
        self.columns["output_tokens"][r.idx] += output_tokens
        if responded:
            self.columns["flags"][r.idx] |= FINISHED
        if not r.ended:
            self.set_state(r, "finished")

    def bootstrapped(self, r: Request, prefill: str, decode: str, tokens: int, tenant: str) -> None:
        r.bootstrap_nodes = (prefill, decode)
        self.columns["bootstrap_tokens"][r.idx] = tokens
        self.columns["flags"][r.idx] |= BOOTSTRAPPED
        if tenant and not r.tenant:
            r.tenant = tenant

    def states(self, idx: np.ndarray) -> np.ndarray:
        """The state codes of the requests at `idx` (NOBODY's is "new")."""
        states: np.ndarray = self.columns["state"][idx]
        return states

    # ------------------------------------------------------------------ retirement

    def due(self, idle_before: int) -> list[Request]:
        """The requests in use queued before `idle_before` (a window ago), in queue order."""
        out = []
        queued = self.columns["queued"]
        for idx, r in self.recent.items():
            if queued[idx] > idle_before:
                break
            out.append(r)
        return out

    def named_since(self, rs: Sequence[Request], idle_before: int) -> list[bool]:
        """For each request, whether an event named it at or after `idle_before`."""
        idx = np.fromiter((r.idx for r in rs), np.intp, len(rs))
        named: list[bool] = (self.columns["last"][idx] > idle_before).tolist()
        return named

    def requeue(self, r: Request) -> None:
        """Named since it was queued, or still holding something: looked at a window later."""
        self.columns["queued"][r.idx] = self.applied
        self.recent.move_to_end(r.idx)

    def retire(self, rs: Sequence[Request]) -> None:
        """Out of use: they hold nothing; they wait to be forgotten."""
        for r in rs:
            del self.recent[r.idx]
            r.shared = {}
            self.retired[r.idx] = r
        self.columns["flags"][np.fromiter((r.idx for r in rs), np.intp, len(rs))] |= RETIRED

    def idle_retired(self, idle_before: int) -> list[Request]:
        """The retired requests last named before `idle_before`, least recently named first."""
        out = []
        last = self.columns["last"]
        for idx, r in self.retired.items():
            if last[idx] > idle_before:
                break
            out.append(r)
        return out

    def forget(self, r: Request) -> None:
        """Gone: an event naming it later starts a new request; its index is reused."""
        del self.retired[r.idx]
        del self.index[r.id]
        self.objects[r.idx] = None
        self.draining.pop(r.idx, None)
        self.free.append(r.idx)

    def readers(self, reqs: Any) -> np.ndarray:
        """The index of each of `reqs` (NOBODY for one not known): what the page tags name."""
        # map() over dict.get: the per-request loop runs in C (a decode batch, every step)
        return np.fromiter(map(self.index.get, reqs, repeat(NOBODY)), np.int32, len(reqs))
