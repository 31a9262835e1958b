"""`kvguard replay CAPTURE --to ADDR`: a capture's events sent to a daemon as their nodes'
agents would, keeping the capture's global order across nodes (each run of one node's
events is a batch of at most `batch` events and MAX_BATCH_BYTES bytes, and its ack is awaited
before the next). An event the daemon could never take (over its message limit) is refused
here, alone, with the reason; the rest goes on. A node the daemon refuses (its
name, or a certificate that does not name it) has its events skipped, each counted as refused
with the daemon's reason, and the other nodes' go on, as a local replay skips such lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvguard.agents.upstream import AgentStream, DaemonRefused
from kvguard.proto import pb
from kvguard.proto.capture import CaptureError, read_capture
from kvguard.proto.channel import MAX_BATCH_BYTES, MAX_MESSAGE, Tls
from kvguard.proto.channel import channel as daemon_channel

MESSAGE_OVERHEAD = 64  # a batch message's own bytes around one event


@dataclass
class SendSummary:
    events: int = 0
    accepted: int = 0
    repeats: int = 0
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (capture line, reason)
    bad_lines: list[CaptureError] = field(default_factory=list)


def _runs(
    items: Iterator[tuple[int, pb.Event | CaptureError]], summary: SendSummary, limit: int
) -> Iterator[list[tuple[int, pb.Event]]]:
    """Runs of one node's events in capture order, each within `limit` events and
    MAX_BATCH_BYTES bytes; an event over the daemon's message limit alone is refused here."""
    run: list[tuple[int, pb.Event]] = []
    size = 0
    for number, item in items:
        if isinstance(item, CaptureError):
            summary.bad_lines.append(item)
            continue
        nbytes = item.ByteSize()
        if nbytes > MAX_MESSAGE - MESSAGE_OVERHEAD:
            summary.events += 1
            summary.rejected.append(
                (number, f"{nbytes} bytes, over the daemon's message limit of {MAX_MESSAGE}: not sent")
            )
            continue
        if run and (run[-1][1].node != item.node or len(run) >= limit or size + nbytes > MAX_BATCH_BYTES):
            yield run
            run, size = [], 0
        run.append((number, item))
        size += nbytes
    if run:
        yield run


def send_capture(
    lines: Iterable[str | bytes], address: str, batch: int = 4096, tls: Tls | None = None
) -> SendSummary:
    """Send a capture's events to the daemon at `address`, in order, as their nodes' agents would."""
    summary = SendSummary()
    streams: dict[str, AgentStream] = {}
    refused: dict[str, str] = {}  # node -> why the daemon would not take its stream
    with daemon_channel(address, tls) as channel:
        try:
            for run in _runs(read_capture(lines), summary, batch):
                node = run[0][1].node
                summary.events += len(run)
                try:
                    if node not in refused and node not in streams:
                        streams[node] = AgentStream(channel, node, "kvguard-replay")
                    ack = streams[node].send(e for _, e in run) if node not in refused else None
                except DaemonRefused as exc:
                    refused[node] = str(exc)
                    gone = streams.pop(node, None)
                    if gone is not None:
                        gone.close()
                    ack = None
                if ack is None:
                    summary.rejected += [(n, f"node {node!r} refused: {refused[node]}") for n, _ in run]
                    continue
                summary.accepted += ack.accepted
                summary.repeats += ack.repeats
                line_of = {e.seq: n for n, e in run}
                summary.rejected += [(line_of.get(r.seq, 0), r.reason) for r in ack.rejected]
        finally:
            for stream in streams.values():
                stream.close()
    return summary
