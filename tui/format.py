"""How the dashboard writes the daemon's numbers and records: ages, clock times, page lists as
ranges, sizes, a pool's room against its context, and one line per audit record of a
request's timeline (only that request's part of a batch event).

Invariant: pure functions of their arguments (the clock is passed in, never read here), so a
screen drawn twice from the same answers is the same screen.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, tzinfo

from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc


def age(ns: int) -> str:
    """A duration in ns, short: 0s, 42s, 3m, 5h, 2d."""
    s = max(0, ns) // 1_000_000_000
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def clock(ts_ns: int, tz: tzinfo | None = None, ms: bool = True) -> str:
    """A wall-clock time of day (HH:MM:SS.mmm) in `tz` (default: local)."""
    text = datetime.fromtimestamp(ts_ns // 1_000_000_000, tz).strftime("%H:%M:%S")
    return f"{text}.{(ts_ns // 1_000_000) % 1000:03d}" if ms else text


def epoch_text(epoch: int, tz: tzinfo | None = None) -> str:
    """An engine's incarnation: its start time where the epoch is one (ns since 1970), else
    its number."""
    if epoch > 10**15:
        return clock(epoch, tz, ms=False)
    return str(epoch)


def ranges(pages: Sequence[int], limit: int = 6) -> str:
    """Page numbers as runs (1-4,7,9-12), the first `limit` runs, then how many more pages."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and page == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], page)
        else:
            runs.append((page, page))
    shown = [f"{a}-{b}" if b > a else f"{a}" for a, b in runs[:limit]]
    rest = sum(b - a + 1 for a, b in runs[limit:])
    return ",".join(shown) + (f" +{rest}" if rest else "")


def count(n: float) -> str:
    """A count, short: 950, 12.3k, 4.1M."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}" if float(n).is_integer() else f"{n:.1f}"


def size(n: float) -> str:
    """Bytes, short, powers of 1024: 512B, 3.0KiB, 1.2GiB."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}B"


def pool_tokens(report: pb.PoolReport) -> int:
    """Tokens the pool can hold: page_size x (num_pages - reserved_pages)."""
    return report.page_size * max(0, report.num_pages - report.reserved_pages)


def pool_short(report: pb.PoolReport) -> bool:
    """Whether the pool cannot hold its advertised context (a warning before any request)."""
    return bool(report.context_len) and pool_tokens(report) < report.context_len


def checksums(values: Sequence[int], limit: int = 4) -> str:
    """Per-page checksums, short (hex, the first `limit`)."""
    shown = " ".join(f"{v:x}" for v in values[:limit])
    return shown + (f" +{len(values) - limit}" if len(values) > limit else "")


def _pages(pool: int, pages: Sequence[int]) -> str:
    return f"pool {pool} pages {ranges(pages)} ({len(pages)})"


def event_line(e: pb.Event, req: str) -> tuple[str, str]:
    """(what, detail) of an event as it concerns request `req`."""
    kind = e.WhichOneof("payload") or "?"
    body = getattr(e, kind) if kind != "?" else None
    if kind == "admit":
        return "admit", f"{body.stage} tenant {body.tenant}, {body.prompt_tokens} prompt tokens"
    if kind in ("reject", "abort"):
        return kind, body.reason or "-"
    if kind == "finish":
        return "finish", f"{body.output_tokens} output tokens"
    if kind == "bootstrap":
        return "bootstrap", f"{body.prefill_node} -> {body.decode_node}, {body.prompt_tokens} prompt tokens"
    if kind in ("alloc", "write", "free", "scrub"):
        return kind, _pages(body.pool, body.pages)
    if kind in ("hold", "release"):
        return kind, f"{body.holder}: {_pages(body.pool, body.pages)}"
    if kind == "share":
        return "share", f"{_pages(body.pool, body.pages)} of {body.origin_req}"
    if kind == "read":
        mine = [r for r in body.reads if r.req == req] or list(body.reads[:1])
        pages = [p for r in mine for p in r.pages]
        tokens = sum(r.tokens for r in mine)
        return "read", f"{_pages(mine[0].pool if mine else 0, pages)}, {tokens} tokens"
    if kind == "step":
        return "step", _step(body, req)
    if kind in ("xfer_send", "xfer_recv"):
        arrow = "->" if kind == "xfer_send" else "<-"
        pages = f"{len(body.pages)} pages {ranges(body.pages, 3)}"
        return kind, (
            f"{body.status or '?'} {arrow} {body.peer_node}: {pages}, {body.tokens} tokens, "
            f"{size(body.bytes)}, sums {checksums(body.checksums)}"
        )
    if kind == "wire":
        return (
            "wire",
            f"{body.xfer} {body.peer_node}: {size(body.bytes)} in {body.calls} calls ({body.probe})",
        )
    if kind == "kill":
        return "kill", f"terminated ({body.finding or 'by order'}) by {body.by or '?'}"
    if kind == "pool":
        return "pool", f"pool {body.pool} {body.role} {body.page_size}x{body.num_pages}"
    return kind, ""


def _step(step: pb.Step, req: str) -> str:
    at = 0
    for r, n in zip(step.reqs, step.counts, strict=False):
        if r == req:
            return f"write {_pages(step.pool, step.pages[at : at + n])}"
        at += n
    return f"batch of {len(step.counts)}"


def record_line(record: svc.AuditRecord, req: str) -> tuple[str, str, str]:
    """(style, what, detail) of an audit record of `req`'s timeline; style: event, verdict,
    command or action (the screen colours them)."""
    kind = record.WhichOneof("body")
    if kind == "event":
        what, detail = event_line(record.event, req)
        return "event", what, detail
    if kind == "finding":
        f = record.finding
        victim = f" victim {f.victim_req} ({f.victim_tenant})" if f.victim_req else ""
        return (
            "verdict",
            f"{f.severity or 'finding'}",
            f"{f.finding} [{f.rule}] -> {f.action}{victim}: {f.message}",
        )
    if kind == "command":
        c = record.command
        by = f" by {c.by}" if c.by else ""
        if c.HasField("kill"):
            return (
                "command",
                "order kill",
                f"{c.kill.req} ({c.kill.rule or c.kill.finding or 'operator'}){by}",
            )
        q = c.quarantine
        return "command", "order quarantine", f"pool {q.pool} pages {ranges(q.pages)}{by}"
    if kind == "action":
        a = record.action
        return "action", f"operator {a.WhichOneof('body') or ''}", f"by {a.by}: {a.reason or '-'}"
    if kind == "refused":
        return "event", "refused", record.refused.reason
    return "event", kind or "?", ""


def record_time(record: svc.AuditRecord) -> int:
    """The record's own time: its event's or finding's ts_ns, an action's ts_ns (0: none)."""
    kind = record.WhichOneof("body")
    if kind == "event":
        return record.event.ts_ns
    if kind == "finding":
        return record.finding.ts_ns
    if kind == "action":
        return record.action.ts_ns
    return 0


def record_node(record: svc.AuditRecord) -> str:
    kind = record.WhichOneof("body")
    if kind == "event":
        return record.event.node
    if kind == "finding":
        return record.finding.node
    if kind == "action":
        return record.action.node
    return ""
