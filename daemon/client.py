"""Talking to the daemon as an agent does: one stream per node, batches in, acks back.

`AgentStream.send()` returns only when the daemon has acknowledged the batch, i.e. when it
is durable; `post()` and `next_ack()` let a sender keep several batches in flight (the
daemon takes up to 8 a stream and acknowledges them in order). Commands (kill, quarantine)
are handed over the moment they arrive, to the stream's `on_command` (the agent relays them
to the guard at once) or else kept in `commands`: the daemon sends a command before the
commit of the batch that caused it, and a command may also come while no batch is in flight.
`send_capture()` is `kvguard replay CAPTURE --to ADDR`: it keeps the capture's global order
across nodes by sending each run of one node's events as a batch and waiting for its ack
before the next.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import grpc

from kvguard.daemon.tls import Tls
from kvguard.daemon.tls import channel as daemon_channel
from kvguard.proto import pb
from kvguard.proto.capture import CaptureError, read_capture
from kvguard.proto.kvguard.v1 import services_pb2 as svc

MAX_MESSAGE = 16 << 20  # the largest AgentMessage the daemon accepts
MAX_BATCH_BYTES = MAX_MESSAGE // 2  # what an agent puts in one batch (the events' bytes), at most


class DaemonRefused(RuntimeError):
    """The daemon ended the stream with an error (identity, malformed)."""


class AgentStream:
    def __init__(
        self,
        channel: grpc.Channel,
        node: str,
        agent_version: str = "kvguard",
        on_command: Callable[[svc.Command], None] | None = None,
        on_ack: Callable[[], None] | None = None,
    ) -> None:
        self.node = node
        self._on_ack = on_ack  # told (on the reader thread) each time an ack is queued
        self._out: queue.Queue[bytes | None] = queue.Queue()
        # Requests go as bytes: a batch is each event serialized into a RawAgentMessage (the
        # same bytes on the wire as an AgentMessage), which skips copying every event into a
        # new message first.
        stream = channel.stream_stream(
            "/kvguard.v1.AgentService/Stream",
            request_serializer=None,
            response_deserializer=svc.DaemonMessage.FromString,
        )
        self._responses = stream(iter(self._out.get, None))
        self.commands: list[svc.Command] = []
        self._on_command = on_command if on_command is not None else self.commands.append
        self._acks: queue.Queue[svc.Ack | Exception] = queue.Queue()
        threading.Thread(target=self._read, name=f"kvguard-stream-{node}", daemon=True).start()
        hello = svc.AgentMessage(hello=svc.Hello(node=node, agent_version=agent_version))
        self._out.put(hello.SerializeToString())
        self.durable_seq = 0  # what the daemon has of this node: the hello's ack says, then each ack
        self.next_ack()  # no timeout: the hello's ack, or the stream's end (raised)

    def _read(self) -> None:
        """The daemon's messages as they arrive: commands handed over, acks queued for send()."""
        end: Exception = DaemonRefused("the daemon closed the stream")
        try:
            for msg in self._responses:
                body = msg.WhichOneof("body")
                if body == "ack":
                    self._acks.put(msg.ack)
                    if self._on_ack is not None:
                        self._on_ack()
                elif body == "command":
                    try:
                        self._on_command(msg.command)
                    except Exception:  # the handler's bug must not stop the acks
                        traceback.print_exc(file=sys.stderr)
                elif body == "error":
                    end = DaemonRefused(f"{msg.error.code}: {msg.error.message}")
                    break
        except grpc.RpcError as exc:
            end = exc
        self._acks.put(end)
        if self._on_ack is not None:
            self._on_ack()

    def next_ack(self, timeout: float | None = None) -> svc.Ack | None:
        """The ack of the oldest batch posted and not yet acknowledged (None if none came
        within `timeout`; 0: only one already here); raises once the stream is over."""
        try:
            ack = self._acks.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(ack, Exception):
            self._acks.put(ack)  # the stream is over: every later call fails the same way
            raise ack
        self.durable_seq = ack.durable_seq
        return ack

    def post(self, bodies: list[bytes]) -> None:
        """Send a batch of serialized events without waiting for its ack (see next_ack)."""
        self._out.put(svc.RawAgentMessage(batch=svc.RawEventBatch(events=bodies)).SerializeToString())

    def send(self, events: Iterable[pb.Event]) -> svc.Ack:
        return self.send_serialized([e.SerializeToString() for e in events])

    def send_serialized(self, bodies: list[bytes]) -> svc.Ack:
        """send() for events that are serialized already (the agent's spool keeps them so)."""
        self.post(bodies)
        ack = self.next_ack()
        assert ack is not None
        return ack

    def close(self) -> None:
        self._out.put(None)
        self._responses.cancel()


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
    run: list[tuple[int, pb.Event]] = []
    for number, item in items:
        if isinstance(item, CaptureError):
            summary.bad_lines.append(item)
            continue
        if run and (run[-1][1].node != item.node or len(run) >= limit):
            yield run
            run = []
        run.append((number, item))
    if run:
        yield run


def send_capture(
    lines: Iterable[str | bytes], address: str, batch: int = 4096, tls: Tls | None = None
) -> SendSummary:
    """Send a capture's events to the daemon at `address`, in order, as their nodes' agents would."""
    summary = SendSummary()
    streams: dict[str, AgentStream] = {}
    with daemon_channel(address, tls) as channel:
        try:
            for run in _runs(read_capture(lines), summary, batch):
                node = run[0][1].node
                stream = streams.get(node)
                if stream is None:
                    stream = streams[node] = AgentStream(channel, node, "kvguard-replay")
                ack = stream.send(e for _, e in run)
                summary.events += len(run)
                summary.accepted += ack.accepted
                summary.repeats += ack.repeats
                line_of = {e.seq: n for n, e in run}
                summary.rejected += [(line_of.get(r.seq, 0), r.reason) for r in ack.rejected]
        finally:
            for stream in streams.values():
                stream.close()
    return summary
