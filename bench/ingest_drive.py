"""The agents' side of a run: send each agent's batches to a server (the daemon or the floor),
closed loop or paced, on threads (the product's AgentStream) or one asyncio loop; what it measured (Run)."""

from __future__ import annotations

import asyncio
import contextlib
import select
import selectors
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from ingest_alerts import Alerts
from ingest_workload import AGENT_BATCH, CHANNEL_OPTIONS, Workload

from kvguard.agents.agent import IN_FLIGHT
from kvguard.agents.spool import AHEAD_AFTER_S, AHEAD_MIN
from kvguard.agents.upstream import AgentStream
from kvguard.proto.kvguard.v1 import services_pb2 as svc


@dataclass
class Run:
    setup: int = 0  # pool reports, one an agent, sent before the clock started
    events: int = 0
    transitions: int = 0
    elapsed: float = 0.0
    acks: list[float] = field(default_factory=list)  # seconds, send to ack, every batch
    alerts: list[float] = field(default_factory=list)  # seconds, send to alert, planted batches
    kills: list[float] = field(default_factory=list)  # seconds, send to the kill at the agent, planted
    planted_sent: int = 0
    sends: int = 0  # messages sent (paced, an agent coalesces the batches that are due)
    errors: list[str] = field(default_factory=list)
    # The daemon's own clock, receipt of a batch to: stage -> (p50, p99, max) ms (FleetState)
    stages: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    # CPU seconds (user + system) while the agents sent: the daemon's process, its store writer
    cpu: dict[str, float] = field(default_factory=dict)
    # The machine meanwhile, share of all its CPU time: stolen by the hypervisor (other guests
    # running on these cores), idle. A tail latency means little without them on a shared host.
    machine: dict[str, float] = field(default_factory=dict)
    # Planted alerts whose path (scheduled send to arrival) overlapped CPU time the hypervisor
    # stole, and the latencies of the others: with a vCPU taken away for 10 ms or more, every
    # alert in flight waits it out, whatever the software does.
    stolen: int = 0
    alerts_unstolen: list[float] = field(default_factory=list)

    @property
    def event_rate(self) -> float:
        return self.events / self.elapsed if self.elapsed else 0.0

    @property
    def rate(self) -> float:
        return self.transitions / self.elapsed if self.elapsed else 0.0


def batch_times(
    k: int, agents: int, w: Workload, per_agent: float, started: float, deadline: float
) -> Iterator[tuple[int, float, float]]:
    """Agent k's batches in turn, until the deadline: each one's index, how long to wait
    before sending it, and when its latencies count from. Paced (per_agent page transitions
    per second): when it is due, the agents starting spread over one batch interval, not all
    at once. Closed loop (per_agent 0): now, i.e. when the last one was acknowledged."""
    due = started + (k / agents * max(w.transitions) / per_agent if per_agent else 0.0)
    for i in range(len(w.bodies)):
        now = time.perf_counter()
        if now >= deadline:
            return
        if not per_agent:
            yield i, 0.0, now
            continue
        yield i, max(0.0, due - now), due
        due += w.transitions[i] / per_agent


def check_ack(ack: svc.Ack, sent: int) -> None:
    """The ack of a batch of `sent` events: every one accepted, or say what was not."""
    if ack.accepted != sent or ack.rejected or ack.repeats:
        rejected = [(r.seq, r.reason) for r in ack.rejected][:3]
        raise RuntimeError(f"{ack.accepted}/{sent} accepted, {ack.repeats} repeats, rejected {rejected}")


def drive(
    address: str,
    workloads: list[Workload],
    seconds: float,
    alerts: Alerts | None,
    paced: float = 0.0,
    as_agent: bool = False,
    on_start: Callable[[], None] = lambda: None,
) -> Run:
    """Each agent on its own thread and channel sends its batches, one at a time, each waiting
    for its ack, until its batches or `seconds` run out. Closed loop (paced=0): the next batch
    goes as soon as the last is acknowledged. Paced: the agents together offer `paced` page
    transitions per second, each batch on its schedule; latencies then run from the batch's
    scheduled time, so an agent that falls behind counts the wait too. Paced `as_agent`: each
    event has its own scheduled time (when the engine produced it), and each send carries
    every event due by then (at most AGENT_BATCH), as the node agent sends what its spool
    holds (ahead of the acks, up to its IN_FLIGHT batches, by its AHEAD_MIN/AHEAD_AFTER_S
    rule); latencies run from the oldest event's time."""
    run = Run()
    per_agent = paced / len(workloads)
    lock = threading.Lock()
    sent_at: dict[str, float] = {}
    killed_at: dict[str, float] = {}  # planted request -> when its kill reached the agent's stream
    started = [0.0]

    def start() -> None:  # every stream open and its opening acknowledged: the clock starts
        on_start()
        started[0] = time.perf_counter()

    ready = threading.Barrier(len(workloads) + 1, action=start)
    finished: list[float] = []
    streams = [w.stream() for w in workloads] if as_agent else []

    Sent = tuple[int, int, int, list[float]]  # events, page transitions, planted faults, ack latencies

    def in_batches(k: int, w: Workload, stream: AgentStream, deadline: float) -> Sent:
        acks: list[float] = []
        events = transitions = planted = 0
        for i, wait, t0 in batch_times(k, len(workloads), w, per_agent, started[0], deadline):
            if wait:
                time.sleep(wait)
            req = w.planted.get(i)
            if req is not None:
                sent_at[req] = t0
            ack = stream.send_serialized(w.bodies[i])
            acks.append(time.perf_counter() - t0)
            check_ack(ack, len(w.bodies[i]))
            events += len(w.bodies[i])
            transitions += w.transitions[i]
            planted += req is not None
        return events, transitions, planted, acks

    def as_produced(k: int, w: Workload, stream: AgentStream, deadline: float) -> Sent:
        bodies, moved, reads = streams[k]
        offset = k / len(workloads) * max(w.transitions) / per_agent  # agents do not start in step
        due = started[0] + offset + np.cumsum(moved) / per_agent
        acks: list[float] = []
        in_flight: deque[tuple[int, int]] = deque()  # sent, not yet acknowledged, as the node agent
        i = events = transitions = planted = 0
        while i < len(bodies) or in_flight:
            now = time.perf_counter()
            sending = i < len(bodies) and now < deadline
            ready = int(np.searchsorted(due, now, side="right")) - i if sending else 0
            ahead = ready >= AHEAD_MIN or (ready > 0 and now - due[i] >= AHEAD_AFTER_S)
            if in_flight and (len(in_flight) >= IN_FLIGHT or not sending or not ahead):
                wait = None  # an ack, or the time events may go ahead of it (the node agent's rule)
                if sending and len(in_flight) < IN_FLIGHT:
                    wait = max(1e-4, min(due[min(i + AHEAD_MIN, len(due)) - 1], due[i] + AHEAD_AFTER_S) - now)
                ack = stream.next_ack(timeout=wait)
                if ack is not None:
                    a, b = in_flight.popleft()
                    acks.append(time.perf_counter() - float(due[a]))
                    check_ack(ack, b - a)
                    events += b - a
                    transitions += int(moved[a:b].sum())
                continue
            if not sending:
                break
            if due[i] > now:
                time.sleep(due[i] - now)
                continue
            j = min(int(np.searchsorted(due, now, side="right")), i + AGENT_BATCH)
            for at in range(i, j):
                if at in reads:
                    sent_at[reads[at]] = float(due[at])
                    planted += 1
            stream.post(bodies[i:j])
            in_flight.append((i, j))
            i = j
        return events, transitions, planted, acks

    def agent(k: int, w: Workload) -> None:
        sent: Sent = (0, 0, 0, [])
        errors: list[str] = []
        last = 0.0
        with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            try:
                stream = AgentStream(
                    channel,
                    w.node,
                    "kvguard-bench",
                    on_command=lambda c: killed_at.setdefault(c.kill.req, time.perf_counter()),
                )
                check_ack(
                    stream.send_serialized(w.opening), len(w.opening)
                )  # its engine started: the pool report
            except Exception as exc:
                ready.abort()  # the run cannot start: release the others
                with lock:
                    run.errors.append(f"{w.node}: cannot open its stream: {type(exc).__name__}: {exc}")
                return
            try:
                ready.wait()
                sent = (as_produced if as_agent else in_batches)(k, w, stream, started[0] + seconds)
                last = time.perf_counter()
            except Exception as exc:  # reported, not raised: the other agents still finish
                errors.append(f"{w.node}: {type(exc).__name__}: {exc}")
            finally:
                stream.close()
        with lock:
            run.setup += len(w.opening)
            run.events += sent[0]
            run.transitions += sent[1]
            run.planted_sent += sent[2]
            run.acks += sent[3]
            run.errors += errors
            if last:
                finished.append(last)

    threads = [threading.Thread(target=agent, args=(k, w), daemon=True) for k, w in enumerate(workloads)]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        ready.wait()  # every stream is open and its pool reported (acknowledged); the clock starts
    cpu = time.process_time()
    for t in threads:
        t.join()
    run.cpu["client"] = time.process_time() - cpu
    if ready.broken:
        raise SystemExit(f"the agents could not start: {run.errors}")
    run.elapsed = max(finished, default=started[0]) - started[0]
    collect(run, alerts, sent_at, killed_at)
    return run


class AioStream:
    """One agent's AgentService.Stream on the asyncio client: the wire protocol of the
    product's AgentStream (hello, then batches as RawAgentMessage bytes; acks in order,
    commands as they come), without its threads."""

    def __init__(self, call: Any, on_command: Any) -> None:
        self.call = call
        self.acks: asyncio.Queue[svc.Ack | Exception] = asyncio.Queue()
        self._on_command = on_command
        self.reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, channel: grpc.aio.Channel, node: str, on_command: Any) -> AioStream:
        method = channel.stream_stream(
            "/kvguard.v1.AgentService/Stream",
            request_serializer=None,
            response_deserializer=svc.DaemonMessage.FromString,
        )
        stream = cls(method(), on_command)
        hello = svc.AgentMessage(hello=svc.Hello(node=node, agent_version="kvguard-bench"))
        await stream.call.write(hello.SerializeToString())
        await stream.next_ack()
        return stream

    async def _read(self) -> None:
        end: Exception = RuntimeError("the daemon closed the stream")
        try:
            async for msg in self.call:
                body = msg.WhichOneof("body")
                if body == "ack":
                    self.acks.put_nowait(msg.ack)
                elif body == "command":
                    self._on_command(msg.command)
                elif body == "error":
                    end = RuntimeError(f"{msg.error.code}: {msg.error.message}")
                    break
        except grpc.RpcError as exc:
            end = exc
        self.acks.put_nowait(end)

    async def next_ack(self) -> svc.Ack:
        ack = await self.acks.get()
        if isinstance(ack, Exception):
            self.acks.put_nowait(ack)
            raise ack
        return ack

    async def send(self, bodies: list[bytes]) -> svc.Ack:
        await self.call.write(svc.RawAgentMessage(batch=svc.RawEventBatch(events=bodies)).SerializeToString())
        return await self.next_ack()

    async def close(self) -> None:
        self.call.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
            await self.reader


class OnTimeSelector(selectors.EpollSelector):
    """asyncio's epoll selector waits in whole milliseconds rounded up (epoll_wait's unit), so
    a paced send woke 0-1 ms late (p50 0.5 ms), all of it counted as the daemon's latency. This
    one waits on the epoll descriptor with select(2), whose timeout is in microseconds, then
    takes the ready events without waiting: two system calls a wait instead of one."""

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout > 0:
            select.select([self.fileno()], [], [], timeout)
            timeout = 0
        return super().select(timeout)


def drive_aio(
    address: str,
    workloads: list[Workload],
    seconds: float,
    alerts: Alerts | None,
    paced: float = 0.0,
    on_start: Callable[[], None] = lambda: None,
) -> Run:
    """drive()'s batches (closed loop or paced), every agent a task on one asyncio loop of this
    thread, with a channel (one TCP connection) each. On a cluster the agents are processes on
    other machines; here they share the daemon's 2 cores, and the threaded client (a thread,
    gRPC's request-iterator thread, a reader thread and a channel's polling thread an agent)
    costs ~4x the CPU of this one, taken from the daemon's cores."""
    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(OnTimeSelector())) as runner:
        return runner.run(_drive_aio(address, workloads, seconds, alerts, paced, on_start))


async def _drive_aio(
    address: str,
    workloads: list[Workload],
    seconds: float,
    alerts: Alerts | None,
    paced: float,
    on_start: Callable[[], None],
) -> Run:
    run = Run()
    per_agent = paced / len(workloads)
    sent_at: dict[str, float] = {}
    killed_at: dict[str, float] = {}

    def killed(c: svc.Command) -> None:
        killed_at.setdefault(c.kill.req, time.perf_counter())

    async def agent(k: int, w: Workload, stream: AioStream, started: float) -> float:
        # Paced, an agent sends what its spool holds: every batch already due when the last
        # send was acknowledged goes in one message (at most AGENT_BATCH events), as the node
        # agent's spool.take() gives it; its latencies count from the oldest one's time.
        batches = batch_times(k, len(workloads), w, per_agent, started, started + seconds)
        held = next(batches, None)
        while held is not None:
            i, wait, t0 = held
            if wait:
                await asyncio.sleep(wait)
            group, size, held = [(i, t0)], len(w.bodies[i]), next(batches, None)
            while (
                per_agent
                and held is not None
                and not held[1]
                and size + len(w.bodies[held[0]]) <= AGENT_BATCH
            ):
                group.append((held[0], held[2]))
                size += len(w.bodies[held[0]])
                held = next(batches, None)
            for j, due in group:
                req = w.planted.get(j)
                if req is not None:
                    sent_at[req] = due
                    run.planted_sent += 1
            bodies = w.bodies[i] if len(group) == 1 else [b for j, _ in group for b in w.bodies[j]]
            ack = await stream.send(bodies)
            run.acks.append(time.perf_counter() - t0)
            check_ack(ack, size)
            run.events += size
            run.transitions += sum(w.transitions[j] for j, _ in group)
            run.sends += 1
        return time.perf_counter()

    channels = [grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) for _ in workloads]
    streams: list[AioStream] = []
    try:
        try:
            for channel, w in zip(channels, workloads, strict=True):
                streams.append(await AioStream.open(channel, w.node, killed))
                check_ack(
                    await streams[-1].send(w.opening), len(w.opening)
                )  # its engine started: the pool report
                run.setup += len(w.opening)
        except Exception as exc:
            raise SystemExit(f"the agents could not start: {type(exc).__name__}: {exc}") from None
        on_start()
        started = time.perf_counter()
        cpu = time.process_time()
        ends = await asyncio.gather(
            *(agent(k, w, s, started) for k, (w, s) in enumerate(zip(workloads, streams, strict=True))),
            return_exceptions=True,
        )
        run.cpu["client"] = time.process_time() - cpu
    finally:
        for s in streams:
            await s.close()
        for channel in channels:
            await channel.close()
    finished = [e for e in ends if isinstance(e, float)]
    run.errors += [
        f"{w.node}: {type(e).__name__}: {e}"
        for w, e in zip(workloads, ends, strict=True)
        if isinstance(e, BaseException)
    ]
    run.elapsed = max(finished, default=started) - started
    collect(run, alerts, sent_at, killed_at)
    return run


def collect(run: Run, alerts: Alerts | None, sent_at: dict[str, float], killed_at: dict[str, float]) -> None:
    """Each planted fault's alert and kill latency, from when its batch was (due to be) sent."""
    if alerts is None:
        return
    wanted = list(sent_at)
    if not alerts.wait_for(wanted, 10):
        missing = [r for r in wanted if r not in alerts.arrived]
        run.errors.append(f"{len(missing)} planted faults raised no alert (first: {missing[:3]})")
    run.alerts = [alerts.arrived[r] - t for r, t in sent_at.items() if r in alerts.arrived]
    spans = np.array(alerts.stolen_spans()).reshape(-1, 2)
    for r, t in sent_at.items():
        if r in alerts.arrived:
            if ((spans[:, 0] < alerts.arrived[r]) & (spans[:, 1] > t)).any():
                run.stolen += 1
            else:
                run.alerts_unstolen.append(alerts.arrived[r] - t)
    run.kills = [killed_at[r] - t for r, t in sent_at.items() if r in killed_at]
    if len(run.kills) != len(sent_at):
        run.errors.append(f"{len(sent_at) - len(run.kills)} planted faults got no kill")
