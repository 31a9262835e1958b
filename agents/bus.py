"""The agent's link to the bus (NATS JetStream, proto/bus.py) in place of the daemon's gRPC
stream: `BusLink`, the agent's one connection, and `BusStream`, one per node, which the
agent's upstream loop drives exactly as it drives an AgentStream (post, next_ack, status,
durable, close; commands handed to `on_command`).

Invariants: a batch is acknowledged only once the stream holds it (JetStream's PubAck: stored
on a majority of its replicas), and the stream holds each event at most once: a node's batches
are published one after another, each expecting its subject to be at the sequence the last
one was stored at, so a batch that was stored although its PubAck was lost is never stored
again (a retry inside the duplicate window is answered "duplicate", after it "wrong last
sequence"; either way the subject's last message then says where the node stands). A new
stream starts from that last message: what it holds is dropped from the spool, never resent.
Any doubt (a PubAck that did not come, a sequence that is not the one expected) ends the
stream; the agent opens a new one, which reads where the subject stands again.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from kvguard.agents.spool_file import Position
from kvguard.proto import bus
from kvguard.proto.channel import MAX_MESSAGE
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.logs import logger

log = logger("agent")
T = TypeVar("T")
PUBLISH_TIMEOUT_S = 5.0  # a PubAck that takes longer is taken as lost (the stream ends)
CONNECT_TIMEOUT_S = 10.0


class BusUnavailable(RuntimeError):
    """The bus cannot take the node's events now (down, unreachable, or it refused them)."""


class BusLink:
    """The agent's connection to the bus, on an event loop of its own thread; said once when
    it is lost and once when it is back (`say`)."""

    def __init__(self, settings: bus.BusSettings, cell: str, say: Callable[[str], None]) -> None:
        self.settings = settings
        self.cell = bus.check_cell(cell)
        self.stream = bus.stream_name(settings.cluster)
        self._say = say
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvguard-bus", daemon=True)
        self._thread.start()
        self._nc: Any = None
        self._connecting = threading.Lock()
        self.refusals: list[str] = []  # the server's permission violations, as said (newest last)
        self.reached: bool | None = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the link's loop and wait for it (BusUnavailable past `timeout`)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise BusUnavailable(f"the bus did not answer within {timeout:g} s") from None

    def client(self) -> Any:
        """The connection (made at the first call: the bus may be down when the agent starts)."""
        with self._connecting:
            if self._nc is None:
                try:
                    self._nc = self.run(self._connect(), CONNECT_TIMEOUT_S + 1)
                except Exception as exc:
                    self._unreachable(str(exc))
                    raise BusUnavailable(f"cannot reach the bus at {self._where()}: {exc}") from None
                self._reachable()
            return self._nc

    async def _connect(self) -> Any:
        async def error(exc: Exception) -> None:
            text = str(exc)
            if "permissions violation" in text.lower():
                self.refusals = [*self.refusals[-15:], text]
                log.error(f"the bus refused this agent: {text}")

        async def disconnected() -> None:
            self._unreachable("disconnected")

        async def reconnected() -> None:
            self._reachable()

        return await self.settings.connect(
            "kvguard-agent",
            error_cb=error,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            connect_timeout=CONNECT_TIMEOUT_S,
            allow_reconnect=True,
        )

    def max_message(self) -> int:
        """The largest message the bus takes (its servers' max_payload), at most MAX_MESSAGE."""
        payload = getattr(self._nc, "max_payload", 0) or MAX_MESSAGE
        return min(int(payload) - 1024, MAX_MESSAGE)  # room for the headers

    def _where(self) -> str:
        return ",".join(self.settings.servers)

    def _unreachable(self, detail: str) -> None:
        if self.reached is not False:
            self.reached = False
            self._say(
                f"cannot reach the bus at {self._where()} ({detail}); events stay spooled until it answers"
            )

    def _reachable(self) -> None:
        was, self.reached = self.reached, True
        if was is False:
            self._say(f"reached the bus at {self._where()}; sending what is spooled")

    def close(self) -> None:
        if self._nc is not None:
            with contextlib.suppress(Exception):
                self.run(self._nc.close(), 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


class BusStream:
    """One node's (or probe's) events to the bus; see the module's invariants."""

    def __init__(
        self,
        link: BusLink,
        node: str,
        agent_version: str = "kvguard",
        on_command: Callable[[svc.Command], None] | None = None,
        on_ack: Callable[[], None] | None = None,
        cell: str = "",
    ) -> None:
        self.node = node
        self._link = link
        self._nc = link.client()
        self._js = self._nc.jetstream(timeout=PUBLISH_TIMEOUT_S)
        self.subject = bus.events_subject(link.settings.cluster, cell or link.cell, node)
        self._on_ack = on_ack
        self._acks: queue.Queue[svc.Ack | Exception] = queue.Queue()
        self._chain: asyncio.Future[None] | None = None  # the last publish: the next waits for it
        self._broken: Exception | None = None
        self._sub: Any = None
        self._commands: queue.Queue[svc.Command | None] = queue.Queue()
        self.commands: list[svc.Command] = []
        self._on_command = on_command if on_command is not None else self.commands.append
        self.durable, self._subject_seq = link.run(self._last(), PUBLISH_TIMEOUT_S + 1)
        if "/" not in node:  # a guard's node hears commands; its probes' streams do not
            self._sub = link.run(self._subscribe(), PUBLISH_TIMEOUT_S + 1)
            threading.Thread(target=self._deliver, name=f"kvguard-bus-cmd-{node}", daemon=True).start()

    async def _last(self) -> tuple[Position, int]:
        """Where the node stands in the stream: its last (epoch, seq) there, and the stream
        sequence of that message (0: none)."""
        from nats.errors import NoRespondersError
        from nats.js.errors import NotFoundError

        try:
            msg = await self._js.get_last_msg(self._link.stream, self.subject, direct=True)
        except NotFoundError:
            return (0, 0), 0
        except NoRespondersError:
            stream = self._link.stream
            raise BusUnavailable(f"the stream {stream} is not there yet (a daemon makes it)") from None
        except Exception as exc:
            raise BusUnavailable(self._why(f"cannot read {self.node}'s last message", exc)) from None
        return bus.parse_last((msg.headers or {}).get(bus.LAST)), msg.seq

    async def _subscribe(self) -> Any:
        async def heard(msg: Any) -> None:
            try:
                self._commands.put(svc.Command.FromString(msg.data))
            except DecodeError as exc:  # only daemons may publish here: said, never relayed
                log.warning(f"a command for {self.node} on the bus is not a kvguard.v1.Command: {exc}")

        subject = bus.command_subject(self._link.settings.cluster, self.node)
        return await self._nc.subscribe(subject, cb=heard)

    def _deliver(self) -> None:
        """Commands to the agent's handler, off the bus's loop (a guard's socket may block)."""
        while (command := self._commands.get()) is not None:
            try:
                self._on_command(command)
            except Exception:  # the handler's bug must not stop the next command
                log.exception(f"relaying command {command.id} to {self.node}")

    def _why(self, what: str, exc: BaseException) -> str:
        # The server says the subject it refused in lower case.
        refused = next((r for r in reversed(self._link.refusals) if self.subject.lower() in r.lower()), None)
        if refused is not None:
            return f"{what}: the bus refused this agent ({refused}); is its user given node {self.node}?"
        return f"{what}: {type(exc).__name__} {exc}".rstrip()

    def post(self, bodies: list[bytes], positions: list[Position] | None = None) -> None:
        """Publish a batch of serialized events (their `positions`) after those posted before."""
        assert positions, "a batch to the bus names its positions"
        data = svc.RawAgentMessage(batch=svc.RawEventBatch(events=bodies)).SerializeToString()
        before = self._chain
        self._chain = asyncio.run_coroutine_threadsafe(  # type: ignore[assignment]
            self._publish(data, positions[0], positions[-1], len(bodies), before), self._link.loop
        )

    async def _publish(self, data: bytes, first: Position, last: Position, n: int, before: Any) -> None:
        if before is not None:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(before)
        if self._broken is not None:
            return
        headers = {
            bus.MSG_ID: bus.msg_id(self.node, first, last),
            bus.EXPECTED_LAST: str(self._subject_seq),
            bus.LAST: bus.last_header(last),
        }
        try:
            ack = await self._js.publish(self.subject, data, headers=headers, timeout=PUBLISH_TIMEOUT_S)
        except Exception as exc:
            err = getattr(exc, "err_code", None)
            if err != bus.WRONG_LAST_SEQUENCE:
                return self._break(BusUnavailable(self._why(f"publishing {self.node}'s events", exc)))
            # Stored already by an earlier try (past the duplicate window): where does it stand?
            held, seq = await self._last()
            if held < last:
                return self._break(BusUnavailable(f"{self.node}'s subject moved on unexpectedly (to {held})"))
            self._subject_seq = seq
            self._acked(last, 0, n)
            return
        self._subject_seq = ack.seq
        self._acked(last, 0 if ack.duplicate else n, n if ack.duplicate else 0)

    def _acked(self, last: Position, accepted: int, repeats: int) -> None:
        self.durable = max(self.durable, last)
        ack = svc.Ack(node=self.node, durable_epoch=last[0], durable_seq=last[1])
        ack.accepted, ack.repeats = accepted, repeats
        self._acks.put(ack)
        if self._on_ack is not None:
            self._on_ack()

    def _break(self, exc: Exception) -> None:
        self._broken = exc
        self._acks.put(exc)
        if self._on_ack is not None:
            self._on_ack()

    def next_ack(self, timeout: float | None = None) -> svc.Ack | None:
        """The PubAck of the oldest batch posted and not yet acknowledged (None if none came
        within `timeout`); raises once the stream is broken."""
        try:
            ack = self._acks.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(ack, Exception):
            self._acks.put(ack)
            raise ack
        return ack

    def status(self, status: svc.NodeStatus) -> None:
        """The agent's word on the node, to the daemons (not stored; a probe's is its node's)."""
        if "/" in self.node:
            return
        subject = bus.status_subject(self._link.settings.cluster, self.node)
        data = status.SerializeToString()
        asyncio.run_coroutine_threadsafe(self._nc.publish(subject, data), self._link.loop)

    def close(self) -> None:
        self._commands.put(None)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                self._link.run(self._sub.unsubscribe(), 5)
