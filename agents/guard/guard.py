"""The in-engine guard (`Guard`): the API an engine calls at each ownership transition, backed
by the ledger, deciding on the spot which request must not go on.

Invariants:
- every call is one kvguard.v1 event with this node's next sequence number, applied to the
  local ledger before the engine proceeds and handed to the sink, as bytes, without blocking;
  the events every request makes are written to bytes from the engine's arrays (no Python
  list of pages on the way) and applied from them;
- the check before attention runs over the whole batch as array operations; only requests
  that fail it become a `read` event, which names the finding and the victim;
- in enforce mode a finding whose rule action is kill, kill+quarantine or block terminates
  exactly the request it names (recorded as a `kill` event); monitor mode never kills, and
  either mode can be set per rule;
- the guard owns its command path: a kill or a quarantine the daemon orders reaches the
  engine through the handlers it gave the guard (`on_kill`, `on_quarantine`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import numpy as np

from kvguard.agents.guard.attention import AttentionCheck
from kvguard.agents.guard.handles import Handles
from kvguard.agents.guard.sink import EventSink, NullSink
from kvguard.agents.guard.verdict import CLEAN, RANK, Verdict, WallClock, merged
from kvguard.cuda_hooks.steps import StepWord, bind_pool, shim_loaded
from kvguard.ledger.findings import KILL_ACTIONS, BadEvent, Finding
from kvguard.ledger.ledger import Ledger
from kvguard.proto import pb, wire
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.ruleset import Ruleset, load_ruleset

Mode = Literal["monitor", "enforce"]
STOPPED = "kvguard stopped request "  # how what a stopped request's client reads begins (`told`)


def _int64(values: Iterable[int] | np.ndarray) -> np.ndarray:
    """Page numbers or slot counts as a contiguous int64 array (no copy when they are one)."""
    if isinstance(values, np.ndarray):
        return np.ascontiguousarray(values, dtype=np.int64)
    if hasattr(values, "__array__"):  # torch on the host
        return np.ascontiguousarray(np.asarray(values), dtype=np.int64)
    return np.fromiter(values, np.int64)


def _bounds(counts: np.ndarray) -> list[int]:
    """Where each request's part of a page list starts (and the last one ends)."""
    bounds: list[int] = np.concatenate(([0], np.cumsum(counts))).tolist()
    return bounds


def _ints(values: Any) -> list[int]:
    if hasattr(values, "tolist"):
        ints: list[int] = values.tolist()  # numpy arrays and torch tensors: one conversion, not per item
        return ints
    return list(values)


class Guard:
    """The guard of one engine process (one node). Thread-safe: calls are serialised.
    `on_kill(req, reason)` and `on_quarantine(pool, pages)`: the engine's own abort path and
    free list, called when the daemon orders a kill or a quarantine."""

    def __init__(
        self,
        node: str,
        *,
        mode: Mode = "enforce",
        rule_modes: dict[str, Mode] | None = None,
        ruleset: Ruleset | None = None,
        sink: EventSink | None = None,
        on_finding: Callable[[Finding], None] | None = None,
        on_kill: Callable[[str, str], None] | None = None,
        on_quarantine: Callable[[int, list[int]], None] | None = None,
        clock: Callable[[], int] | None = None,
        epoch: int | None = None,
    ) -> None:
        if mode not in ("monitor", "enforce"):
            raise ValueError(f"guard mode {mode!r} is not monitor or enforce")
        self.node = node
        # This engine process's incarnation: a restarted engine's events begin a new one.
        self.epoch = time.time_ns() if epoch is None else epoch
        self.agent_version = ""  # as the engine's last heartbeat gave it (a canary's heartbeat too)
        self.canary_ok_ns = 0  # when the agent's self-test canary last came back here (0: never)
        self.mode = mode
        self.rule_modes = dict(rule_modes or {})
        self.ruleset = ruleset if ruleset is not None else load_ruleset()
        self.sink = sink if sink is not None else NullSink()
        self.ledger = Ledger()
        self.findings: list[Finding] = []
        self.killed: dict[str, Finding | None] = {}
        self.errors: list[str] = []
        self._on_finding = on_finding
        self._on_kill = on_kill
        self._on_quarantine = on_quarantine
        self._clock = clock if clock is not None else WallClock()
        self._seq = 0
        self._lock = threading.RLock()
        self._ones_of: dict[int, np.ndarray] = {}
        self.attention = AttentionCheck(self.ledger, node)
        self.handles = Handles()  # its requests' numbers, which its steps carry instead of names
        # The CUDA shim's step word, where the shim is preloaded: it judges attention launches by it.
        patterns = self.ruleset.lists.get("attention_kernels", ())
        self.steps: StepWord | None = StepWord(patterns) if shim_loaded() is not None else None
        self.sink.listen(self.command)

    # ------------------------------------------------------------------ core

    def _next(self) -> tuple[int, int]:
        self._seq += 1
        return self._seq, self._clock()

    def _pages_event(
        self, kind: str, req: str, pool: int, pages: Iterable[int], slots: Iterable[int] | None = None
    ) -> Verdict:
        """An alloc, write or free: written to bytes from the engine's arrays, applied from them."""
        with self._lock:
            page_array = _int64(pages)
            self.attention.touch(pool, page_array)
            seq, ts = self._next()
            try:
                body = wire.encode(
                    kind,
                    self.node,
                    seq,
                    ts,
                    req,
                    pool,
                    page_array,
                    None if slots is None else _int64(slots),
                    self.epoch,
                )
                found = self.ledger.apply_serialized(body, self.node)
            except (BadEvent, ValueError) as exc:
                return self._refused(kind, exc, [req] if req else [])
            self.sink.put(body)
            return self._judge(found) if found else CLEAN

    def _emit(self, payload: str, req: str = "", **fields: Any) -> Verdict:
        """Any other event, built as an object (they are few) and handed on as bytes."""
        with self._lock:
            if "pages" in fields:
                self.attention.touch(fields.get("pool", -1), fields["pages"])
            seq, ts = self._next()
            if req:
                fields["req"] = req
            try:
                event = pb.Event(node=self.node, seq=seq, ts_ns=ts, epoch=self.epoch, **{payload: fields})
                found = self.ledger.apply(event)
            except (BadEvent, ValueError, TypeError) as exc:
                who = [req] if req else [entry["req"] for entry in fields.get("reads", ())]
                return self._refused(payload, exc, who)
            self.sink.put(event.SerializeToString())
            return self._judge(found) if found else CLEAN

    def _refused(self, payload: str, exc: Exception, who: list[str]) -> Verdict:
        """Fail safe: what the guard cannot check does not go on. The event was not applied:
        its sequence number is given to the next."""
        self._seq -= 1
        self.errors.append(f"{payload}: {exc}")
        verdict = Verdict()
        for req in who:
            verdict.kill[req] = None
            self._kill(req, None)
        return verdict

    def _judge(self, found: Sequence[Finding]) -> Verdict:
        verdict = Verdict()
        for raw in found:
            finding = self.ruleset.evaluate(raw)
            if finding is None:
                continue
            verdict.findings.append(finding)
            self.findings.append(finding)
            if self._on_finding is not None:
                self._on_finding(finding)
            if self.rule_modes.get(finding.rule, self.mode) != "enforce":
                continue
            if finding.action in KILL_ACTIONS and finding.req:
                known = verdict.kill.get(finding.req)
                if known is None or RANK[finding.severity] < RANK[known.severity]:
                    verdict.kill[finding.req] = finding  # the gravest reason is the one given
            if "quarantine" in finding.action:
                verdict.quarantine.update(finding.pages)
            if finding.action == "deny":
                verdict.deny = True
        for req, finding in verdict.kill.items():
            self._kill(req, finding)
        return verdict

    def _kill(self, req: str, finding: Finding | None, by: str = "", late: bool = False) -> None:
        if req in self.killed:
            return
        self.killed[req] = finding
        self._emit(
            "kill",
            req,
            finding=finding.finding if finding else "unverifiable",
            by=by or f"guard@{self.node}",
            late=late,
        )

    def told(self, req: str) -> str:
        """What the client of a request this guard stopped reads, whatever the engine: why in
        a word, and the id the audit log has; nothing of any other request or tenant (a
        finding's message may name its victim: that is for the operator, in the audit log)."""
        finding = self.killed.get(req)
        kind = finding.finding if finding is not None else "unverifiable"
        why = (
            "an operator stopped it"
            if kind == "operator_kill"
            else f"it failed a KV-isolation check ({kind})"
        )
        return (
            f"{STOPPED}{req}: {why} on node {self.node}; nothing computed from KV it does not own "
            f"was returned. Operators: kvguard audit request {req}"
        )

    # ------------------------------------------------------------------ commands from the daemon

    def kill(self, req: str, finding: str, rule: str, message: str, by: str = "daemon") -> None:
        """Record a kill ordered from outside (the daemon's verdict, relayed by the agent); `late`
        when the request no longer runs here: it finished, or it was sent on (a prefill's
        transfer) and holds no page here, or it is not known: the kill stopped nothing."""
        with self._lock:
            record = Finding(finding, node=self.node, req=req, message=message, rule=rule, action="kill")
            known = self.ledger.request(req)
            gone = known is None or known.state == "finished"
            if known is not None and known.xfers and known.granted_pages <= known.freed_pages:
                gone = True  # its KV left for its decode node: it runs there, not here
            self._kill(req, record, by, late=gone)

    def command(self, command: svc.Command) -> None:
        """A command of the daemon, relayed by the agent (the sink hands it here): a kill is
        recorded and goes to the engine's abort path, a quarantine to its free list; the agent's
        self-test canary goes out as a heartbeat, and its echo is noted (canary_ok_ns)."""
        which = command.WhichOneof("body")
        if which == "kill":
            k = command.kill
            known = k.req in self.killed  # the daemon orders one kill per finding: the first stands
            by = command.by or "daemon"  # an operator's kill names the operator
            self.kill(k.req, k.finding or "operator_kill", k.rule, k.message, by)
            why = f"{k.finding} ({k.rule}): {k.message}" if k.finding else f"killed by {by}: {k.message}"
            # Outside the guard's lock: the engine takes its own locks, then calls the guard.
            if self._on_kill is not None and not known:
                self._on_kill(k.req, why)
        elif which == "quarantine" and self._on_quarantine is not None:
            self._on_quarantine(command.quarantine.pool, list(command.quarantine.pages))
        elif which == "canary":
            if command.canary.echo:  # back from the daemon: events and commands both get through
                self.canary_ok_ns = time.time_ns()
            else:  # the agent asks: it goes out in order, behind what the engine reported
                self._emit(
                    "heartbeat",
                    agent_version=self.agent_version,
                    dropped=self.sink.dropped,
                    canary=command.canary.nonce,
                )

    # ------------------------------------------------------------------ configuration and lifecycle

    def pool(self, pool: int, role: str, page_size: int, num_pages: int, **fields: Any) -> Verdict:
        return self._emit("pool", pool=pool, role=role, page_size=page_size, num_pages=num_pages, **fields)

    def admit(self, req: str, tenant: str, prompt_tokens: int, stage: str) -> Verdict:
        with self._lock:
            had = req in self.handles.of
            handle = self.handles.give(req)
            errors = len(self.errors)
            verdict = self._emit(
                "admit", req, tenant=tenant, prompt_tokens=prompt_tokens, stage=stage, handle=handle
            )
            if len(self.errors) > errors and not had:  # refused: the number was not bound
                self.handles.take_back(req)
            return verdict

    def reject(self, req: str, reason: str) -> Verdict:
        return self._emit("reject", req, reason=reason)

    def abort(self, req: str, reason: str) -> Verdict:
        return self._emit("abort", req, reason=reason)

    def finish(self, req: str, output_tokens: int) -> Verdict:
        with self._lock:
            errors = len(self.errors)
            verdict = self._emit("finish", req, output_tokens=output_tokens)
            if len(self.errors) == errors:  # its handle is free in the ledger: here too
                self.handles.take_back(req)
            return verdict

    def bootstrap(
        self, req: str, prefill_node: str, decode_node: str, prompt_tokens: int, tenant: str = ""
    ) -> Verdict:
        return self._emit(
            "bootstrap",
            req,
            prefill_node=prefill_node,
            decode_node=decode_node,
            prompt_tokens=prompt_tokens,
            tenant=tenant,
        )

    def heartbeat(self, agent_version: str = "") -> Verdict:
        self.agent_version = agent_version
        return self._emit("heartbeat", agent_version=agent_version, dropped=self.sink.dropped)

    # ------------------------------------------------------------------ pages

    def alloc(self, req: str, pool: int, pages: Iterable[int]) -> Verdict:
        return self._pages_event("alloc", req, pool, pages)

    def write(self, req: str, pool: int, pages: Iterable[int], slots: Iterable[int] | None = None) -> Verdict:
        return self._pages_event("write", req, pool, pages, slots)

    def free(self, req: str, pool: int, pages: Iterable[int]) -> Verdict:
        return self._pages_event("free", req, pool, pages)

    def alloc_each(
        self, pool: int, reqs: Sequence[str], pages: Iterable[int] | np.ndarray, counts: Any = None
    ) -> Verdict:
        """Grants to several requests at once (a decode step's new pages): request reqs[i] is
        granted the next counts[i] of `pages` (counts None: one each). One `alloc` event each,
        as alloc() makes them, applied in one pass over their bytes; the verdict of them all."""
        with self._lock:
            names = list(reqs)
            page_array = _int64(pages)
            count_array = np.ones(len(names), np.int64) if counts is None else _int64(counts)
            if len(count_array) != len(names) or int(count_array.sum()) != len(page_array):
                return self._refused(
                    "alloc",
                    ValueError(f"{len(names)} requests, {len(count_array)} counts, {len(page_array)} pages"),
                    names,
                )
            self.attention.touch(pool, page_array)
            first = self._seq
            try:
                batch = wire.encode_allocs(
                    self.node, first + 1, self._clock(), self.epoch, names, pool, page_array, count_array
                )
            except (ValueError, TypeError):  # one of them is not an event: each alone says which
                return self._each(pool, names, page_array, _bounds(count_array))
            found, done = self._apply_run(batch)
            verdict = self._judge(found) if found else CLEAN
            if done < len(names):  # refused: numbered again from there, one at a time
                self._seq = first + done
                verdict = merged(
                    verdict, self._each(pool, names[done:], page_array, _bounds(count_array)[done:])
                )
            return verdict

    def _apply_run(self, batch: wire.Batch) -> tuple[list[Finding], int]:
        """Apply a batch of this guard's events, numbered from its next sequence number: the
        clean runs in C, the rest one at a time, each handed to the sink once applied. (Their
        findings, how many were applied before one was refused: len(batch) when none was.)"""
        self._seq += len(batch)
        found: list[Finding] = []
        bodies, at, stop = batch.events(), 0, len(batch)
        put = self.sink.put
        while at < stop:
            clean = self.ledger.apply_clean(batch, at, stop, self.node)
            for body in bodies[at:clean]:
                put(body)
            at = clean
            if at == stop:
                break
            try:
                found += self.ledger.apply_serialized(bodies[at], self.node)
            except BadEvent:
                return found, at
            put(bodies[at])
            at += 1
        return found, stop

    def _each(self, pool: int, names: list[str], pages: np.ndarray, bounds: list[int]) -> Verdict:
        verdict = CLEAN
        for req, a, b in zip(names, bounds, bounds[1:], strict=False):
            verdict = merged(verdict, self._pages_event("alloc", req, pool, pages[a:b]))
        return verdict

    def hold(self, req: str, pool: int, pages: Iterable[int], holder: str) -> Verdict:
        return self._emit("hold", req, pool=pool, pages=_ints(pages), holder=holder)

    def release(self, req: str, pool: int, pages: Iterable[int], holder: str) -> Verdict:
        return self._emit("release", req, pool=pool, pages=_ints(pages), holder=holder)

    def share(self, req: str, pool: int, pages: Iterable[int], origin_req: str) -> Verdict:
        return self._emit("share", req, pool=pool, pages=_ints(pages), origin_req=origin_req)

    # ------------------------------------------------------------------ transfers

    def xfer_send(
        self,
        req: str,
        xfer: str,
        peer_node: str,
        pool: int,
        pages: Iterable[int],
        tokens: int,
        nbytes: int,
        checksums: Iterable[int] = (),
        status: str = "done",
    ) -> Verdict:
        """The sender's account of a transfer, once it is over. It is checked like a read, but
        the KV has left by then: check the pages with check_attention() before sending them
        (the testbed's prefill does), and this call records what was sent."""
        return self._emit(
            "xfer_send",
            req,
            xfer=xfer,
            peer_node=peer_node,
            pool=pool,
            pages=_ints(pages),
            tokens=tokens,
            bytes=nbytes,
            checksums=_ints(checksums),
            status=status,
        )

    def xfer_recv(
        self,
        req: str,
        xfer: str,
        peer_node: str,
        pool: int,
        pages: Iterable[int],
        tokens: int,
        nbytes: int,
        checksums: Iterable[int] = (),
        status: str = "done",
        *,
        claimed_tokens: int = 0,
        claimed_bytes: int = 0,
        claimed_checksums: Iterable[int] = (),
    ) -> Verdict:
        """Receipt of a transfer, checked before the request may join a decode batch: counts
        against the bootstrap and the reservation, and what arrived against what the sender
        claimed in the transfer itself (tokens, bytes, per-page checksums)."""
        return self._emit(
            "xfer_recv",
            req,
            xfer=xfer,
            peer_node=peer_node,
            pool=pool,
            pages=_ints(pages),
            tokens=tokens,
            bytes=nbytes,
            checksums=_ints(checksums),
            status=status,
            claimed_tokens=claimed_tokens,
            claimed_bytes=claimed_bytes,
            claimed_checksums=_ints(claimed_checksums),
        )

    def receive_allowed(self, req: str, pool: int, pages: Iterable[int]) -> bool:
        """Before KV is written into pages on receipt: may it land? (Granted to the request, or
        still held for its in-flight transfer.) A query: the receipt is reported by xfer_recv,
        with status "refused" when the engine keeps the data out."""
        with self._lock:
            return self.ledger.writable(self.node, pool, req, _ints(pages))

    # ------------------------------------------------------------------ attention

    def step(
        self,
        pool: int,
        reqs: Sequence[str],
        pages: Iterable[int] | np.ndarray,
        slots: Iterable[int] | np.ndarray | None = None,
        *,
        counts: Iterable[int] | np.ndarray | None = None,
        grants: Iterable[int] | np.ndarray | None = None,
        block_tables: Any = None,
        context_lens: Any = None,
        stable: np.ndarray | None = None,
        table_rows: np.ndarray | None = None,
        in_slots: bool = False,
    ) -> Verdict:
        """One forward step of a batch, in one call: the KV it wrote, as one `step` event
        (request reqs[i] wrote the next counts[i] entries of `pages`, with their `slots`, the
        valid slots of each page after the write; counts None: one page each, as in decode;
        slots None: full pages); with `grants`, the pages granted for it first (the last
        grants[i] of request i's part are new to it: one `alloc` event each, as alloc_each
        makes them), all applied in one run in C and handed to the sink as bytes; then, with
        block_tables and context_lens, the check before the attention that reads it
        (check_attention's; `stable`, `table_rows` and `in_slots` as there). The engine must
        drop the requests in `kill` from this step."""
        with self._lock:
            names = reqs if isinstance(reqs, list) else list(reqs)
            page_array = _int64(pages)
            count_array = self._ones(len(names)) if counts is None else _int64(counts)
            slot_array = None if slots is None else _int64(slots)
            self.attention.touch(pool, page_array)
            grant_array = None if grants is None else _int64(grants)
            verdict = self._step_event(pool, names, count_array, page_array, slot_array, grant_array)
            if block_tables is None:
                return verdict
            return merged(
                verdict, self._check(pool, names, block_tables, context_lens, stable, table_rows, in_slots)
            )

    def _ones(self, n: int) -> np.ndarray:
        """A count of one page for each of n requests (a decode step's), made once per size."""
        ones = self._ones_of.get(n)
        if ones is None:
            ones = self._ones_of[n] = np.ones(n, np.int64)
            ones.flags.writeable = False
        return ones

    def _step_event(
        self,
        pool: int,
        names: list[str],
        counts: np.ndarray,
        pages: np.ndarray,
        slots: np.ndarray | None,
        grants: np.ndarray | None = None,
        *,
        again: bool = True,
    ) -> Verdict:
        """A step (with its grants) as one event, the batch named by handles where every
        request has one. One the ledger refuses is made again (`again`): its grants one at a
        time (by alloc()) and then the step alone, by names, as they would have been made, so
        that each refusal names its request; refused then, it is final."""
        seq, ts = self._next()
        handles = self.handles.of_batch(names) if again else None
        try:
            who = names if handles is None else handles
            body = wire.encode_step(self.node, seq, ts, self.epoch, pool, who, counts, pages, slots, grants)
            found = self.ledger.apply_serialized(body, self.node)
        except (BadEvent, ValueError, TypeError) as exc:
            if not again:
                return self._refused("step", exc, [str(r) for r in names])
            self._seq -= 1
            if handles is not None and isinstance(exc, BadEvent) and exc.kind == "handle":
                # The guard's own numbers and its ledger disagree (a bug): said, and the step
                # named by names, so that no request is judged or stopped for it.
                self.errors.append(f"step: {exc}; its batch named by names instead")
            if grants is None or not grants.any():
                return self._step_event(pool, names, counts, pages, slots, again=False)
            return self._pass_apart(pool, names, counts, pages, slots, grants)
        self.sink.put(body)
        return self._judge(found) if found else CLEAN

    def _pass_apart(
        self,
        pool: int,
        names: list[str],
        counts: np.ndarray,
        pages: np.ndarray,
        slots: np.ndarray | None,
        grants: np.ndarray,
    ) -> Verdict:
        if len(grants) != len(names) or len(counts) != len(names):
            why = f"{len(names)} requests, {len(counts)} counts, {len(grants)} grants"
            return self._refused("step", ValueError(why), names)
        over = np.flatnonzero(grants > counts)
        if len(over):
            i = int(over[0])
            why = f"grants[{i}] is {int(grants[i])} of {int(counts[i])} pages"
            return self._refused("step", ValueError(why), names)
        ends = np.cumsum(counts).tolist()
        verdict = CLEAN
        for i in np.flatnonzero(grants).tolist():
            own = pages[ends[i] - int(grants[i]) : ends[i]]
            verdict = merged(verdict, self._pages_event("alloc", names[i], pool, own))
        return merged(verdict, self._step_event(pool, names, counts, pages, slots, again=False))

    def check_attention(
        self,
        pool: int,
        reqs: Sequence[str],
        block_tables: np.ndarray,
        context_lens: np.ndarray,
        stable: np.ndarray | None = None,
        table_rows: np.ndarray | None = None,
        in_slots: bool = False,
    ) -> Verdict:
        """The check before an attention launch over a batch. block_tables [B, P] (page ids,
        padding beyond each context ignored), context_lens [B]. With `stable` [B], how many
        leading entries of each row the engine vouches are as they were at that request's
        last check (0 for a request new to the batch, or whose table was rewritten), the check
        reads each row only from what it has not verified before (the same answer, in time
        flat in the context). With `table_rows` [B], block_tables holds all the engine's
        tables and the batch's row b is block_tables[table_rows[b]]. `in_slots`: the tables
        hold token slots, one column a token, as SGLang's req_to_token (a page is named by its
        first slot). The engine must drop the requests in `kill` from this launch; the rest of
        the batch goes on."""
        with self._lock:
            return self._check(pool, reqs, block_tables, context_lens, stable, table_rows, in_slots)

    def step_done(self) -> None:
        """The step the last checks were for has launched its kernels: an attention kernel
        launched from now on needs another check (the CUDA shim's launch witness)."""
        if self.steps is not None:
            with self._lock:
                self.steps.ended()

    def pool_memory(self, pool: int, regions: Iterable[tuple[int, int]]) -> None:
        """Where a pool's KV lies in device memory: (address, bytes its pages need) a region,
        as the engine's tensors say (data_ptr, nbytes). The CUDA shim, where it is preloaded,
        tells the agent how much of each the allocations under it hold, and any later free or
        unmap of it."""
        bind_pool(pool, regions)

    def _check(
        self,
        pool: int,
        reqs: Sequence[str],
        block_tables: Any,
        context_lens: Any,
        stable: Any = None,
        table_rows: Any = None,
        in_slots: bool = False,
    ) -> Verdict:
        if self.steps is not None:
            self.steps.checked()
        reads = self.attention.failing(pool, reqs, block_tables, context_lens, stable, table_rows, in_slots)
        if not reads:
            return CLEAN
        most = self.ledger.limits.read_entries  # a larger launch's reads go as several events
        verdict = CLEAN
        for at in range(0, len(reads), most):
            verdict = merged(verdict, self._emit("read", reads=reads[at : at + most]))
        for entry in reads:  # a request killed earlier that is still batched stays out
            req = entry["req"]
            if req in self.killed and req not in verdict.kill:
                verdict.kill[req] = self.killed[req]
        return verdict
