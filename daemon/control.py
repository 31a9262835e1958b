"""What an operator does through the daemon (`Control`, served as ControlService.Act): kill a
request, quarantine pages, acknowledge an alert, set a rule's mode; and the rules as the daemon
applies them (FleetService.Rules).

Invariants: an action runs on the daemon's loop, where command ids, the ledger and the rule
modes change; it is checked whole first, and a refusal (`ActionRefused`: its gRPC code and a
message naming the input and the reason, counted) orders and stores nothing; what it orders is
numbered and stored as command records (Command.by: the operator), the action itself after
them as an `action` record, in the same chain, and only once that record is durable are the
commands sent and the rule mode changed, and the caller answered. `by` is the client
certificate's common name under mutual TLS ("cn:NAME"), else what the client claims in its
`kvguard-user` metadata, marked so ("unverified:NAME"). At start the rule modes are restored
from the stored actions, the quarantined pages from the stored commands.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from kvguard.daemon.commands import MODES, Commands
from kvguard.daemon.ingest import Ingest
from kvguard.daemon.ledgers import Ledgers
from kvguard.daemon.store import Record, RowError, Store
from kvguard.ledger.findings import Finding
from kvguard.ledger.requests import ENDED
from kvguard.proto import pb
from kvguard.proto.filter import Filter
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.logs import fields, logger
from kvguard.ruleset import Ruleset

log = logger("daemon")

MAX_REASON = 1024  # characters of an operator's reason
MAX_NAME = 128  # characters of who did it, as recorded
USER_METADATA = "kvguard-user"  # what a plaintext client says it is
Code = grpc.StatusCode


class ActionRefused(Exception):
    """An action that is not carried out: the gRPC code, and why (naming the input)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _clean(name: str) -> str:
    """A name as the audit log keeps it: one printable line, bounded."""
    name = name[:MAX_NAME]
    return name if name.isprintable() else ascii(name)[1:-1]


def caller(context: Any) -> str:
    """Who makes a call: "cn:" and the client certificate's common name under mutual TLS, else
    "unverified:" and what the client says in its kvguard-user metadata ("unknown" if nothing)."""
    auth = context.auth_context()
    if auth.get("transport_security_type") == [b"ssl"]:
        names = auth.get("x509_common_name", [])
        return "cn:" + (_clean(names[0].decode(errors="replace")) if names else "(no common name)")
    claimed = ""
    for key, value in context.invocation_metadata() or ():
        if key == USER_METADATA:
            claimed = value if isinstance(value, str) else value.decode(errors="replace")
    return "unverified:" + (_clean(claimed) or "unknown")


class Control:
    def __init__(self, pipeline: Ingest, store: Store) -> None:
        """Actions on what `pipeline` applies (its ledger, ruleset, commands and counters),
        recorded in `store`."""
        self.pipeline = pipeline
        self.store = store
        self.ledgers: Ledgers = pipeline.ledgers
        self.ruleset: Ruleset = pipeline.ruleset
        self.commands: Commands = pipeline.commands
        self.counters: Counter[str] = pipeline.counters
        self._restore()

    def _restore(self) -> None:
        """The rule modes operators set and the pages quarantined, as the store records them."""
        known: set[str] | None = None  # the ruleset's rule ids, once an action sets a mode
        for record_id, _, body in self.store.records_of("action"):
            try:
                action = svc.Action.FromString(body)
            except DecodeError:
                log.warning(f"action record {record_id} does not parse; see `kvguard audit verify`")
                continue
            if action.HasField("rule_mode"):
                rule = action.rule_mode.rule
                known = known if known is not None else {r.id for r in self.ruleset.rules}
                if rule in known:
                    self.commands.set_rule_mode(rule, action.rule_mode.mode, action.by)
                else:  # a ruleset changed since: said, not applied
                    log.warning(
                        f"rule {rule!r}, set to {action.rule_mode.mode or 'the daemon mode'} "
                        f"by {action.by} (record {record_id}), is not in the ruleset: not restored"
                    )
        for _, node, body in self.store.records_of("command"):
            command = svc.Command.FromString(body)
            if command.HasField("quarantine"):
                self.commands.quarantined.add(node, command.quarantine)

    # ------------------------------------------------------------------ the rules

    def rules(self) -> svc.RulesState:
        """The enabled rules, each with the mode it is applied in and who set it, if anyone."""
        modes, mode = self.commands.rule_modes, self.commands.mode
        state = svc.RulesState(mode=mode)
        for rule in self.ruleset.rules:
            if not rule.enabled:
                continue
            override = modes.get(rule.id)
            state.rules.add(
                id=rule.id,
                finding=",".join(rule.kinds),
                severity=rule.severity,
                action=rule.action,
                mode=override[0] if override else mode,
                overridden=override is not None,
                by=override[1] if override else "",
            )
        return state

    # ------------------------------------------------------------------ actions

    async def act(self, request: svc.Action, by: str) -> svc.ActionResult:
        """Carry out an operator's action (on the daemon's loop); ActionRefused if it is not."""
        action = svc.Action()
        action.CopyFrom(request)
        del action.commands[:]
        del action.nodes[:]
        action.by, action.ts_ns = by, time.time_ns()
        which = action.WhichOneof("body")
        if which is None:
            raise ActionRefused(
                Code.INVALID_ARGUMENT, "an action needs a body: kill, quarantine, acknowledge or rule_mode"
            )
        if len(action.reason) > MAX_REASON:
            raise ActionRefused(
                Code.INVALID_ARGUMENT,
                f"{which}: the reason is {len(action.reason)} characters (at most {MAX_REASON})",
            )
        orders: list[tuple[str, svc.Command]] = []
        about = action.node  # the node column of its record
        if which == "kill":
            orders = self._kill(action)
            about = action.node or (orders[0][0] if len(orders) == 1 else "")
        elif which == "quarantine":
            orders = [self._quarantine(action)]
        elif which == "acknowledge":
            acknowledged = await self._finding(action.acknowledge.cursor)
            about = action.node = acknowledged.node
        else:
            self._check_rule_mode(action.rule_mode)
        for node, command in orders:
            command.by = by
            self.commands.number(command)
            action.commands.append(command.id)
            action.nodes.append(node)
        rows = [Record.of_command(node, c, action.ts_ns, c.kill.req) for node, c in orders]
        rows.append(Record.of_action(action, about))
        durable, at = self.pipeline.record(rows)
        first = await asyncio.wrap_future(durable)
        # Durable: now it is carried out.
        for node, command in orders:
            if command.HasField("quarantine"):
                self.commands.quarantined.add(node, command.quarantine)
            self.commands.send(node, command)
            self.counters["kills" if command.HasField("kill") else "quarantines"] += 1
        if which == "rule_mode":
            self.commands.set_rule_mode(action.rule_mode.rule, action.rule_mode.mode, by)
        if which == "acknowledge":  # the SIEM's copy of the alert is updated too
            self.pipeline.alert(acknowledgement(acknowledged, action, first + at), counter="acknowledgements")
        self.counters[f"action_{which}"] += 1
        said = self._said(action)
        log.info(f"{by}: {said}", extra=fields(method="ControlService.Act", by=by, action=which))
        return svc.ActionResult(record=first + at + len(orders), action=action, message=said)

    def _kill(self, action: svc.Action) -> list[tuple[str, svc.Command]]:
        req = action.kill.req
        if not req:
            raise ActionRefused(Code.INVALID_ARGUMENT, "kill: no request named (Action.kill.req)")
        found_req = self.ledgers.request(req)
        if found_req is None:
            raise ActionRefused(Code.NOT_FOUND, f"kill: request {req!r} is not known to the daemon's ledger")
        ledger, r = found_req
        live = sorted(  # the nodes where it holds pages: where it still runs
            node
            for node, pool in r.pools
            if node in ledger.nodes
            and (found := ledger.nodes[node].pools.get(pool)) is not None
            and found.live.get(r.idx, 0) > 0
        )
        # A request that ended but still holds pages is the very case kvguard is for (rejected,
        # yet it went on): it may be killed where it holds them. One that holds none has ended;
        # one killed already stays with its first kill.
        held = action.node in live if action.node else bool(live)
        if r.state == "killed" or (r.state in ("finished", *ENDED) and not held):
            why = f": {r.reason}" if r.reason else ""
            raise ActionRefused(
                Code.FAILED_PRECONDITION, f"kill: request {req!r} has already ended ({r.state}{why})"
            )
        if action.node:
            if self.ledgers.node(action.node) is None and action.node not in self.commands.outboxes:
                raise ActionRefused(Code.NOT_FOUND, f"kill: node {action.node!r} is not known to the daemon")
            nodes = [action.node]
        else:
            nodes = live
            if not nodes:
                raise ActionRefused(
                    Code.FAILED_PRECONDITION,
                    f"kill: request {req!r} holds no pages on any node: name its node (Action.node)",
                )
        # The operator's words are the kill's message; who it was travels as Command.by.
        action.kill.ClearField("finding")
        action.kill.ClearField("rule")
        action.kill.message = action.reason
        return [(node, svc.Command(kill=svc.KillRequest(req=req, message=action.reason))) for node in nodes]

    def _quarantine(self, action: svc.Action) -> tuple[str, svc.Command]:
        q, node = action.quarantine, action.node
        if not node:
            raise ActionRefused(Code.INVALID_ARGUMENT, "quarantine: no node named (Action.node)")
        known = self.ledgers.node(node)
        if known is None:
            raise ActionRefused(
                Code.NOT_FOUND, f"quarantine: node {node!r} is not known to the daemon's ledger"
            )
        pool = known.pools.get(q.pool)
        if pool is None:
            pools = ", ".join(str(p) for p in sorted(known.pools)) or "none reported"
            raise ActionRefused(
                Code.NOT_FOUND, f"quarantine: node {node!r} has no pool {q.pool} (its pools: {pools})"
            )
        if not q.pages:
            raise ActionRefused(Code.INVALID_ARGUMENT, "quarantine: no pages listed")
        pages = np.unique(np.array(q.pages, dtype=np.int64))
        n = pool.pages.num_pages
        bad = pages[pages >= n]
        if len(bad):
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise ActionRefused(
                Code.INVALID_ARGUMENT,
                f"quarantine: page {int(bad[0])}{more} is out of range for pool {q.pool} of node {node!r} "
                f"({n} pages: 0 to {n - 1})",
            )
        q.ClearField("pages")
        q.pages.extend(pages.tolist())
        q.finding = ""
        q.epoch = known.epoch
        order = svc.QuarantinePages()
        order.CopyFrom(q)
        return node, svc.Command(quarantine=order)

    async def _finding(self, cursor: int) -> pb.Finding:
        """The finding whose record is `cursor` (read off the loop)."""
        if not cursor:
            raise ActionRefused(
                Code.INVALID_ARGUMENT,
                "acknowledge: no cursor given (the alert's cursor: its finding's record id)",
            )
        wanted = Filter(kind="finding", after=cursor - 1, limit=1)
        loop = asyncio.get_running_loop()
        try:
            rows = await loop.run_in_executor(None, lambda: list(self.store.rows(wanted)))
        except RowError as exc:
            raise ActionRefused(Code.DATA_LOSS, f"acknowledge: audit store: {exc}") from None
        if not rows or rows[0][0] != cursor:
            raise ActionRefused(
                Code.NOT_FOUND, f"acknowledge: record {cursor} is not a finding (no alert has that cursor)"
            )
        return pb.Finding.FromString(rows[0][2])

    def _check_rule_mode(self, rule_mode: svc.RuleMode) -> None:
        if rule_mode.mode not in ("", *MODES):
            raise ActionRefused(
                Code.INVALID_ARGUMENT,
                f'rule_mode: mode {rule_mode.mode!r} is not monitor, enforce, or "" (back to the daemon\'s '
                f"mode, {self.commands.mode})",
            )
        ids = [rule.id for rule in self.ruleset.rules]
        if rule_mode.rule not in ids:
            raise ActionRefused(
                Code.NOT_FOUND,
                f"rule_mode: rule {rule_mode.rule!r} is not in the daemon's ruleset "
                f"(its rules: {', '.join(ids)})",
            )

    def _said(self, action: svc.Action) -> str:
        """What was done, in words."""
        which = action.WhichOneof("body")
        commands = ", ".join(str(c) for c in action.commands)
        if which == "kill":
            return f"kill of {action.kill.req} ordered to {', '.join(action.nodes)} (command {commands})"
        if which == "quarantine":
            q = action.quarantine
            return (
                f"quarantine of {len(q.pages)} page(s) of pool {q.pool} on {action.node} ordered "
                f"(command {commands})"
            )
        if which == "acknowledge":
            return f"alert {action.acknowledge.cursor} acknowledged"
        rm = action.rule_mode
        if rm.mode:
            return f"rule {rm.rule} is applied in {rm.mode} mode"
        return f"rule {rm.rule} is applied in the daemon's mode ({self.commands.mode}) again"


def acknowledgement(acknowledged: pb.Finding, action: svc.Action, record: int) -> Finding:
    """The alert that says an operator acknowledged one (`action`, stored as `record`): an
    update of it (`details.update_of`, its cursor), for the SIEM to mark its copy."""
    cursor = action.acknowledge.cursor
    f = Finding.from_proto(acknowledged)
    details = {k: v for k, v in f.details.items() if k not in ("outcome", "repeat", "repeats")}
    details |= {
        "update_of": str(cursor),
        "acknowledged_by": action.by,
        "acknowledged_reason": action.reason,
        "acknowledged_record": str(record),
        "acknowledged_ns": str(action.ts_ns),
    }
    said = f": {action.reason}" if action.reason else ""
    return dataclasses.replace(  # its time stays the finding's: the acknowledgement's is in details
        f,
        message=f"alert {cursor} ({f.finding}) acknowledged by {action.by}{said}",
        details=details,
        tags=(*f.tags, "acknowledged"),
    )


class ControlServicer:
    """ControlService.Act on the daemon's loop."""

    def __init__(self, control: Control) -> None:
        self.control = control

    async def Act(self, request: svc.Action, context: grpc.aio.ServicerContext) -> svc.ActionResult:
        by = caller(context)
        try:
            return await self.control.act(request, by)
        except ActionRefused as exc:
            self.control.counters["actions_refused"] += 1
            said = fields(peer=context.peer(), method="ControlService.Act", by=by, reason=str(exc))
            log.warning(f"{by}: action refused: {exc}", extra=said)
            await context.abort(exc.code, str(exc))
            raise  # abort raises; this is for the type checker
