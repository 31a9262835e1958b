"""How `kvguard audit` reads and writes times and renders records: TIME arguments, the TIME
column, page ranges, the aligned table and JSON Lines.

Invariants: rendering uses a record's body only, so a store and a daemon print the same; in
the table, one record is one line, whatever its fields hold (nested messages in braces,
control characters escaped).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple, TextIO

import orjson
from google.protobuf.message import DecodeError, Message

from kvguard.daemon.audit.source import AuditItem, UsageError
from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.message_json import message_json_dict

WALL_CLOCK_FLOOR_NS = 946_684_800 * 10**9  # 2000-01-01T00:00:00Z
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MAX_INT64 = (1 << 63) - 1
_MIN_INT64 = -(1 << 63)

# ---------------------------------------------------------------------------------------- time


AGO_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}  # seconds


def parse_time(text: str, option: str = "TIME") -> int:
    """Integer nanoseconds, a time ago (`30m`, `24h`, `7d`: that long before now), or an ISO-8601
    timestamp (naive: UTC) as nanoseconds since the epoch;
    before 1970 too, as negative nanoseconds (a record's ts_ns is whatever its node's clock
    read, and every record must be reachable by time). UsageError naming the option and the
    value if it is neither, or outside ts_ns's range (int64)."""
    value = text.strip()
    ago = re.fullmatch(r"(\d+(?:\.\d+)?)(s|m|h|d|w)", value)
    if ago:  # relative: that long before now (`--since 24h`)
        ns = time.time_ns() - int(float(ago.group(1)) * AGO_UNITS[ago.group(2)] * 10**9)
    elif re.fullmatch(r"-?\d+", value):
        ns = int(value)
    else:
        frac_ns = 0
        match = re.fullmatch(r"(.*T\d\d:\d\d:\d\d)[.,](\d+)(.*)", value)
        if match:
            value = match.group(1) + match.group(3)
            frac_ns = int(match.group(2)[:9].ljust(9, "0"))
        try:
            when = datetime.fromisoformat(value)
        except ValueError:
            raise UsageError(
                f"{option} {text!r} is not a time: give integer nanoseconds, an ISO-8601 timestamp "
                "such as 2026-03-01T12:00:00Z, or a time ago such as 30m, 24h, 7d"
            ) from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        ns = (when - _EPOCH) // timedelta(seconds=1) * 10**9 + frac_ns
    if not _MIN_INT64 <= ns <= _MAX_INT64:
        raise UsageError(f"{option} {text!r} is out of range ({_MIN_INT64} to {_MAX_INT64} ns)")
    return ns


def format_time(ts_ns: int) -> str:
    """ts_ns for people: a UTC date if it reads as wall-clock time, else nanoseconds."""
    if ts_ns >= WALL_CLOCK_FLOOR_NS:
        seconds, ns = divmod(ts_ns, 10**9)
        when = _EPOCH + timedelta(seconds=seconds)
        return f"{when:%Y-%m-%dT%H:%M:%S}.{ns:09d}Z"
    return str(ts_ns) if ts_ns else ""


# ---------------------------------------------------------------------------------------- rendering


def page_ranges(pages: Iterable[int]) -> str:
    """[1, 2, 3, 4, 7, 3] -> '1-4,7,3': ascending runs compressed, order kept."""
    parts: list[str] = []
    run: list[int] = []
    for page in pages:
        if run and page == run[-1] + 1:
            run.append(page)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [page]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)


def _fields(msg: Message, skip: frozenset[str] = frozenset()) -> str:
    """`name=value ...` of the fields set, on one line: a message as {name=value ...}, a
    long list as its length, pages as ranges."""
    parts = []
    for fd, value in msg.ListFields():
        if fd.name in skip:
            continue
        if fd.is_repeated:
            values = list(value)
            if fd.name == "pages":
                text = page_ranges(values)
            elif len(values) > 8:
                text = f"[{len(values)} values]"
            else:
                text = ",".join(_scalar(v) for v in values)
        else:
            text = _scalar(value)
        parts.append(f"{fd.name}={text}")
    return " ".join(parts)


def _scalar(value: object) -> str:
    # str() of a message is protobuf's text format, one line per field: not a table cell
    return "{" + _fields(value) + "}" if isinstance(value, Message) else str(value)


def one_line(text: str) -> str:
    """`text` as a table cell: line breaks, tabs and other control characters escaped (as
    Python writes them: \\n), so that one record is one line whatever its strings hold (an
    engine's reason, a node's name)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class Row(NamedTuple):
    """A record as the columns of the table."""

    id: str
    time: str
    kind: str
    node: str
    seq: str
    req: str
    tenant: str
    what: str
    message: str


HEADER = Row("ID", "TIME", "KIND", "NODE", "SEQ", "REQ", "TENANT", "WHAT", "MESSAGE")


def item_row(item: AuditItem) -> Row:
    body = item.body
    rid = str(item.id)
    if isinstance(body, pb.Event):
        payload = body.WhichOneof("payload") or ""
        p = getattr(body, payload) if payload else None
        if payload == "read":
            reqs = ",".join(dict.fromkeys(e.req for e in body.read.reads))
            what = "read " + "; ".join(f"{e.req} {_fields(e, frozenset({'req'}))}" for e in body.read.reads)
            return Row(rid, format_time(body.ts_ns), "event", body.node, str(body.seq), reqs, "", what, "")
        req = getattr(p, "req", "")
        tenant = getattr(p, "tenant", "")
        message = getattr(p, "reason", "") if payload in ("reject", "abort") else ""
        what = f"{payload} {_fields(p, frozenset({'req', 'tenant', 'reason'}))}" if p is not None else ""
        return Row(
            rid,
            format_time(body.ts_ns),
            "event",
            body.node,
            str(body.seq),
            req,
            tenant,
            what.strip(),
            message,
        )
    if isinstance(body, pb.Finding):
        what = f"{body.finding} {body.severity}"
        if body.victim_req or body.victim_tenant:
            what += f" victim={body.victim_tenant or '?'}/{body.victim_req or '?'}"
        if body.HasField("pool"):
            what += f" pool={body.pool}"
        if body.pages:
            what += f" pages={page_ranges(body.pages)}"
        what += f" action={body.action or '-'}"
        return Row(
            rid,
            format_time(body.ts_ns),
            "finding",
            body.node,
            str(body.seq),
            body.req,
            body.tenant,
            what,
            body.message,
        )
    if isinstance(body, svc.Command):
        which = body.WhichOneof("body")
        by = f" by {body.by}" if body.by else ""
        if which == "kill":
            k = body.kill
            why = f" for {k.finding} (rule {k.rule})" if k.finding else ""
            message = k.message if body.by else ""  # a verdict's message is its finding's
            return Row(rid, "", "command", "", str(body.id), k.req, "", f"kill {k.req}{why}{by}", message)
        if which == "quarantine":
            q = body.quarantine
            what = f"quarantine pool={q.pool} pages={page_ranges(q.pages)}"
            what += (f" for {q.finding}" if q.finding else "") + by
            return Row(rid, "", "command", "", str(body.id), "", "", what, "")
        return Row(rid, "", "command", "", str(body.id), "", "", "empty command", "")
    if isinstance(body, svc.Action):
        return action_row(rid, body)
    if isinstance(body, svc.SignedReceipt):
        try:
            r = svc.Receipt.FromString(body.receipt)
        except DecodeError:
            return Row(rid, "", "receipt", "", "", "", "", "unreadable receipt", "")
        what = f"receipt {r.verdict} of end record {r.chain_record} key {body.key_id}"
        if r.supersedes:
            what += f" supersedes {r.supersedes}"
        nodes = ",".join(n.node for n in r.nodes)
        return Row(rid, format_time(r.issued_ns), "receipt", nodes, "", r.req, r.tenant, what, "")
    if isinstance(body, svc.Refusal):
        try:  # evidence: what it claimed to be, where its bytes say so
            claimed = pb.Event.FromString(body.event)
        except DecodeError:
            claimed = pb.Event()
        payload = claimed.WhichOneof("payload") or "unreadable bytes"
        what = f"refused {payload} ({body.kind}), {body.size} bytes"
        if body.size > len(body.event):  # only a prefix kept: the rest is known by its digest
            what += f" (first {len(body.event)} kept; sha256 {body.sha256.hex()[:16]}...)"
        return Row(
            rid,
            format_time(claimed.ts_ns) if claimed.ts_ns else "",
            "refused",
            claimed.node,
            str(claimed.seq) if claimed.seq else "",
            "",
            "",
            what,
            body.reason,
        )
    return Row(rid, "", item.kind, "", "", item.req_hint, "", "(the daemon does not serve this body)", "")


def action_row(rid: str, action: svc.Action) -> Row:
    """An operator's action: who did what, to which node, and the commands it ordered."""
    which = action.WhichOneof("body") or ""
    req = ""
    if which == "kill":
        req = action.kill.req
        what = f"kill {req}"
    elif which == "quarantine":
        q = action.quarantine
        what = f"quarantine pool={q.pool} pages={page_ranges(q.pages)}"
    elif which == "acknowledge":
        what = f"acknowledge alert {action.acknowledge.cursor}"
    elif which == "rule_mode":
        what = f"rule {action.rule_mode.rule} mode={action.rule_mode.mode or 'daemon'}"
    else:
        what = "empty action"
    what += f" by {action.by or '?'}"
    if action.commands:
        orders = ",".join(str(c) for c in action.commands)
        what += f" -> {','.join(action.nodes)} (command {orders})"
    return Row(rid, format_time(action.ts_ns), "action", action.node, "", req, "", what, action.reason)


class Table:
    """Aligned columns, streamed: widths come from the header and the first `sample` rows; the
    last column (the message) is not padded."""

    def __init__(self, out: TextIO, sample: int = 1000) -> None:
        self.out = out
        self.sample = sample
        self.pending: list[Row] = []
        self.widths: list[int] | None = None
        self.count = 0

    def add(self, row: Row) -> None:
        self.count += 1
        if self.widths is None:
            self.pending.append(row)
            if len(self.pending) >= self.sample:
                self._start()
        else:
            self._write(row)

    def _start(self) -> None:
        rows = [HEADER, *self.pending]
        self.widths = [max(len(one_line(r[i])) for r in rows) for i in range(len(HEADER) - 1)]
        for row in rows:
            self._write(row)
        self.pending = []

    def _write(self, row: Row) -> None:
        assert self.widths is not None
        cells = [one_line(cell) for cell in row]
        line = "  ".join(cell.ljust(w) for cell, w in zip(cells[:-1], self.widths, strict=True))
        self.out.write((line + "  " + cells[-1]).rstrip() + "\n")

    def close(self) -> None:
        if self.widths is None:
            self._start()


def item_json(item: AuditItem) -> dict[str, Any]:
    """A record as one JSON Lines object: its id, kind and body under the kind's name, in the
    CLI's one JSON form (proto/message_json.py: zero fields kept, int64 as numbers)."""
    out: dict[str, Any] = {"id": item.id, "kind": item.kind}
    if item.body is not None:
        out[item.kind] = message_json_dict(item.body)
    return out


def emit(items: Iterable[AuditItem], output: str, out: TextIO) -> int:
    """Write `items` as the table or as JSON Lines (`output`: table or json); the count."""
    if output == "json":
        n = 0
        for item in items:
            out.write(orjson.dumps(item_json(item)).decode() + "\n")
            n += 1
        return n
    table = Table(out)
    for item in items:
        table.add(item_row(item))
    table.close()
    return table.count
