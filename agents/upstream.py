"""The agent's link to the daemon: one stream per node, batches and the agent's status of the
node in, acks back.

`AgentStream.send()` returns only when the daemon has acknowledged the batch, i.e. when it
is durable; `post()` and `next_ack()` let a sender keep several batches in flight (the
daemon takes up to 8 a stream and acknowledges them in order). Commands (kill, quarantine)
are handed over the moment they arrive, to the stream's `on_command` (the agent relays them
to the guard at once) or else kept in `commands`: the daemon sends a command before the
commit of the batch that caused it, and a command may also come while no batch is in flight.
`DaemonReach` says, once each, when the daemon cannot be reached and when it is again.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from collections.abc import Callable, Iterable
from typing import NamedTuple

import grpc

from kvguard import __version__
from kvguard.agents.probes import GpuFacts
from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc

STATUS_EVERY_S = 2.0  # a node's status goes this often besides each change of its guard
PROBE_EVERY_S = 2.0  # how often the agent checks that it reaches the daemon
PROBE_TIMEOUT_S = 5.0
HEALTH_CHECK = "/grpc.health.v1.Health/Check"  # the daemon serves it to every caller


class GuardState(NamedTuple):
    """A node's guard as the agent sees it: connected, gone (it was, and went away) or none
    (never connected), since when (the agent's wall clock), and its engine process."""

    guard: str
    since_ns: int
    pid: int = 0


def node_status(
    guard: GuardState, gpu: GpuFacts, spooled: int, agent: str, **canary: int | bool
) -> svc.NodeStatus:
    """The agent's word on a node: its guard, the host's GPUs, the events it holds
    unacknowledged, the agent (`agent` and kvguard's version), and its canary (canary.py)."""
    return svc.NodeStatus(
        **canary,
        guard=guard.guard,
        guard_since_ns=guard.since_ns,
        guard_pid=guard.pid,
        gpus=[svc.Gpu(**g) for g in gpu.gpus],
        gpu_unavailable=gpu.unavailable,
        driver=gpu.driver,
        spooled=spooled,
        agent_version=f"{agent} {__version__}",
    )


class DaemonReach:
    """Whether the agent reaches the daemon, said on stderr by `say`: once when it cannot (its
    events stay spooled), once again when it does. Its node streams tell it (`reachable`,
    `unreachable`), and so does a health check every PROBE_EVERY_S on a thread of its own
    until `stopping` is set, so that a daemon that is down is said at the start, before any
    guard has reached the agent, and also while no node streams."""

    def __init__(
        self, channel: grpc.Channel, address: str, say: Callable[[str], None], stopping: threading.Event
    ) -> None:
        self.address = address
        self._say = say
        self._lock = threading.Lock()
        self.reached: bool | None = None  # None: not known yet
        # The request and the reply go as bytes: an empty HealthCheckRequest asks of the server.
        self._check = channel.unary_unary(HEALTH_CHECK, request_serializer=None, response_deserializer=None)
        self._stopping = stopping
        threading.Thread(target=self._probe, name="kvguard-daemon-reach", daemon=True).start()

    def _probe(self) -> None:
        while not self._stopping.is_set():
            try:
                self._check(b"", timeout=PROBE_TIMEOUT_S)
            except grpc.RpcError as exc:
                if self._stopping.is_set():  # cancelled by the channel's close: nothing to say
                    return
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self.unreachable(exc.details() or "")
                else:  # it answered, if only to refuse the check
                    self.reachable()
            except ValueError:  # the channel is closed: the agent is stopping
                return
            else:
                self.reachable()
            self._stopping.wait(PROBE_EVERY_S)

    def unreachable(self, detail: str = "") -> None:
        """The daemon cannot be reached (`detail`: gRPC's reason, if known); said once."""
        with self._lock:
            if self.reached is False:
                return
            self.reached = False
        why = f" ({detail})" if detail else ""
        self._say(f"cannot reach the daemon at {self.address}{why}; events stay spooled until it answers")

    def reachable(self) -> None:
        """The daemon is reached; said if it was said unreachable."""
        with self._lock:
            was, self.reached = self.reached, True
        if was is False:
            self._say(f"reached the daemon at {self.address}; sending what is spooled")


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
        # What the daemon has of this node, as (epoch, seq): the hello's ack says, then each ack.
        self.durable = (0, 0)
        self.next_ack()  # no timeout: the hello's ack, or the stream's end (raised)

    @property
    def durable_seq(self) -> int:
        """The last sequence number of the node's current epoch that the daemon holds."""
        return self.durable[1]

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
        self.durable = (ack.durable_epoch, ack.durable_seq)
        return ack

    def post(self, bodies: list[bytes], positions: object = None) -> None:
        """Send a batch of serialized events without waiting for its ack (see next_ack); their
        positions are the daemon's to read from them (a bus stream takes them: agents/bus.py)."""
        self._out.put(svc.RawAgentMessage(batch=svc.RawEventBatch(events=bodies)).SerializeToString())

    def status(self, status: svc.NodeStatus) -> None:
        """The agent's word on the node (its guard, its GPUs, what it holds unacknowledged): not
        an event, no ack; the daemon keeps the last."""
        self._out.put(svc.AgentMessage(status=status).SerializeToString())

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
