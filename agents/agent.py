"""`kvguard agent`: the node agent between the in-engine guards of a host and the daemon.

Guards connect to a Unix socket (proto/local.py) and stream their events; the agent reads
each frame's event heads once (proto/wire.py: whose they are, their numbers), writes the
events' bytes to a spool on disk (spool.py) before anything else, forwards them as they are to
the daemon over one gRPC stream per node, and forgets them only when the daemon acknowledges
them as durable. Commands from the daemon (kill a request) go to the guard that owns the node.
Each node's stream also carries the agent's word on the node (NodeStatus: its guard connected,
gone or never seen, the host's GPUs as read at start, what is spooled): after the hello, at
once when the guard connects or goes, and every STATUS_EVERY_S besides.

Invariants: an event a guard handed over survives a crash of the agent or the daemon (it
is in the spool until acknowledged, and resent after a reconnect or a restart; the daemon
drops what it already has by (node, seq)); the agent never makes a guard wait on the
network: the socket is read as fast as the spool can be appended to. The socket is its
owner's only; who may speak for which node, and how many connect at once, is the door's
(door.py); a frame begun must end within the frame timeout.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import threading
import time
from collections import deque
from pathlib import Path
from urllib.parse import unquote

import grpc
from google.protobuf.message import DecodeError

from kvguard.agents.bus import BusLink, BusStream, BusUnavailable
from kvguard.agents.canary import Canary
from kvguard.agents.door import Door
from kvguard.agents.engine_watch import watch_engine
from kvguard.agents.engines import engine as engine_entry
from kvguard.agents.probes import gpu_facts
from kvguard.agents.spool import Position, Source, Spool
from kvguard.agents.upstream import (
    STATUS_EVERY_S,
    AgentStream,
    DaemonReach,
    DaemonRefused,
    GuardState,
    node_status,
)
from kvguard.cuda_hooks.shim import PROBE as SHIM_PROBE
from kvguard.cuda_hooks.shim import (
    LaunchRecord,
    MemoryRecord,
    Record,
    ShimListener,
    ancestry,
    launches_event,
    memory_event,
)
from kvguard.cuda_hooks.tcp_stream import WireReport
from kvguard.cuda_hooks.witness import NullWitness, Witness, open_witness, wire_event
from kvguard.proto import pb, wire
from kvguard.proto.bus import BusSettings
from kvguard.proto.channel import (
    MAX_BATCH_BYTES,
    MAX_MESSAGE,
    SHIM_STREAM,
    WITNESS_STREAM,
    Tls,
    channel,
    node_of,
)
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.local import PEER_CLOSED, FrameTimeout, listening, peer_of, recv_frame, send_frame
from kvguard.proto.logs import logger

log = logger("agent")

AGENT = "kvguard-agent"  # how the agent names itself to the daemon
WITNESS = WITNESS_STREAM  # a node's witness reports as node/ebpf: its own sequence, beside the guard's
SHIM = SHIM_STREAM  # and its engine's LD_PRELOAD shim as node/shim
# A shim's records come on a socket of their own, read by another thread than its engine's
# guard: one may be read before the guard's hello (waited for this long) or after the guard
# has gone (its node kept this long; far shorter than the kernel takes to reuse a PID).
SHIM_GUARD_WAIT_S = 5.0
DEPARTED_KEEP_S = 10.0
IN_FLIGHT = 4  # batches a node's stream sends ahead of their acks (the daemon takes 8)
# Each guard connection holds a thread: a host's engines need a few, a flood must not get more.
MAX_GUARDS = 128
# A guard writes a frame whole at once: one that has not arrived whole in this long (or a
# hello that has not) is a peer holding the agent's thread, not a guard.
FRAME_TIMEOUT_S = 5.0
COUNTERS_EVERY_S = 300.0  # the agent says its counters this often (if they changed), and at stop


class NodeAgent:
    def __init__(
        self,
        socket_path: str | Path,
        daemon: str,
        spool_dir: str | Path,
        batch: int = 4096,
        tls: Tls | None = None,
        witness: bool = False,
        witness_uprobes: bool = False,
        witness_buffer_pages: int = 1024,
        max_guards: int = MAX_GUARDS,
        frame_timeout: float = FRAME_TIMEOUT_S,
        canary_interval_s: float = 0.0,
        bus: BusSettings | None = None,
        cell: str = "",
    ) -> None:
        self.socket_path = Path(socket_path)
        self.canary_interval_s = canary_interval_s  # 0: no self-test canary (agents/canary.py)
        self.canaries: dict[str, Canary] = {}  # node -> its canary (a guard's node only)
        self._to_guards: dict[str, threading.Lock] = {}  # one frame at a time on a guard's socket
        self.daemon = daemon
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.batch = batch
        self.spools: dict[str, Spool] = {}
        self.sources: dict[str, Source] = {}
        self.engines: dict[int, str] = {}  # engine process -> the node its guard speaks for
        self.guards: dict[str, GuardState] = {}  # node -> its guard, for the node's status
        self.started_ns = time.time_ns()
        self.gpu = gpu_facts()  # once: NVML is slow to start, and the GPUs do not change
        self._departed: dict[int, tuple[str, float]] = {}  # engines whose guard went: (node, when)
        self._shim_dropped: dict[int, int] = {}
        self.lock = threading.Lock()
        self._engines_changed = threading.Condition(self.lock)
        self.stopping = threading.Event()
        self.heartbeat_at = time.monotonic()  # serve()'s loop's last turn (what the watchdog reads)
        self._sockets: tuple[socket.socket, ShimListener] | None = None  # listen()'s
        self.counters: dict[str, int] = {
            "events": 0,
            "acked": 0,
            "rejected": 0,
            "commands": 0,
            "canaries": 0,
            "reconnects": 0,
            "oversized": 0,
            "malformed": 0,
            "witnessed": 0,
            "shim_records": 0,
            "shim_refused": 0,
            "rdma_unlabelled": 0,
            "frame_timeouts": 0,
            "spool_set_aside": 0,
            "guards_gone": 0,
            "identity_refused": 0,  # guards and streams of nodes the daemon will never take from this agent
        }
        # The nodes this agent's certificate names (None: plaintext, the daemon decides): the
        # daemon refuses any other's stream for good, so none is opened, and its guard is told.
        self.speaks_for: frozenset[str] | None = tls.names() if tls is not None else None
        self.frame_timeout = frame_timeout
        self.door = Door(max_guards, self.counters, log.warning)
        self._counters_said: dict[str, int] = {}
        self._channel = channel(daemon, tls)
        # The bus in place of the daemon's stream, where it is configured (agents/bus.py).
        self.bus = BusLink(bus, cell, log.warning) if bus is not None else None
        self.upstream = f"daemon {daemon}"  # where events go, in words
        if self.bus is not None:
            self.daemon = self.upstream = f"the bus at {','.join(bus.servers)} (cell {cell})"
        else:
            self.reach = DaemonReach(
                self._channel, daemon, log.warning, self.stopping
            )  # says if the daemon is down
        for path in sorted(self.spool_dir.glob("*.spool")):
            self._spool(unquote(path.stem))  # events of an earlier run go out first
        self.witness: Witness = NullWitness("not asked for")
        if witness:
            # Watches each guarded engine from outside: what its TCP connections carried.
            self.witness = open_witness(
                self._witnessed,
                self._witness_lost,
                uprobes=witness_uprobes,
                buffer_pages=witness_buffer_pages,
            )
            if not self.witness.available:
                log.warning(f"no eBPF wire witness: {self.witness.reason}")

    def _spool(self, node: str) -> Spool:
        with self.lock:
            spool = self.spools.get(node)
            if spool is None:
                spool = self.spools[node] = Spool(self.spool_dir, node)
                self._to_guards[node] = threading.Lock()
                if self.canary_interval_s > 0 and "/" not in node:
                    self.canaries[node] = Canary(node, self.canary_interval_s, log.warning)
                self.counters["spool_set_aside"] += spool.set_aside
                why_not = self._never_taken(node)
                if why_not is None:
                    threading.Thread(target=self._upstream, args=(node, spool), daemon=True).start()
                else:  # an earlier run's spool the daemon would refuse forever: kept, not retried
                    self.counters["identity_refused"] += 1
                    log.error(f"{why_not}: its spool {spool.path} is kept and not sent")
            return spool

    def _source(self, name: str) -> Source:
        spool = self._spool(name)
        with self.lock:
            source = self.sources.get(name)
            if source is None:
                source = self.sources[name] = Source(spool, self.spool_dir, name)
            return source

    # ------------------------------------------------------------------ guards -> spool

    def listen(self) -> None:
        """Open the guards' socket, the agent's user's (and root's) only, and the shims' beside
        it; a guard may connect once this returns (OSError if the path cannot be had)."""
        server = listening(self.socket_path, mode=0o600)
        # The engines' LD_PRELOAD shims report their transfers' CUDA copies beside it.
        self._sockets = (
            server,
            ShimListener(f"{self.socket_path}.shim", self._shim_record, self._shim_refused),
        )

    def serve(self) -> None:
        if self._sockets is None:
            self.listen()
        assert self._sockets is not None
        server, shims = self._sockets
        said = time.monotonic()
        while not self.stopping.is_set():
            self.heartbeat_at = time.monotonic()  # at least every accept timeout (0.5 s)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                self._check_witness()
                if time.monotonic() - said > COUNTERS_EVERY_S:
                    self.say_counters()
                    said = time.monotonic()
                continue
            if not self.door.enter():
                conn.setblocking(False)  # a refusal fits an empty socket buffer; never wait on it
                _refuse(conn, "busy", f"the agent serves at most {self.door.limit} guard connections")
                continue
            threading.Thread(target=self._guard, args=(conn,), name="kvguard-guard", daemon=True).start()
        shims.close()
        server.close()

    def _guard(self, conn: socket.socket) -> None:
        node = ""
        pid = 0
        watched = False
        # Also bounds a relayed command's send: a guard that reads none cannot hold the relay.
        conn.settimeout(self.frame_timeout)
        try:
            # A guard says hello as it connects.
            frame = recv_frame(conn, self.frame_timeout, wait=self.frame_timeout)
            hello = svc.AgentMessage.FromString(frame)
            node = hello.hello.node
            if not node:
                raise ValueError("the first message must be hello with the guard's node")
            if "/" in node:
                raise ValueError(f"node {node!r}: names with '/' are the agent's own probes'")
            why_not = self._never_taken(node)
            if why_not is not None:  # a permanent refusal: said to the guard now, not retried upstream
                self.counters["identity_refused"] += 1
                _refuse(conn, "identity", why_not)
                return
            # The guard runs inside the engine: the socket's peer is the engine process.
            peer = peer_of(conn)
            pid = peer.pid
            refused = self.door.claim(node, conn, peer)
            if refused is not None:
                _refuse(conn, "node_taken", refused)
                return
            spool = self._spool(node)
            self.witness.watch(pid, node)
            watched = True
            # The welcome tells the engine that its connections are followed from now on. It
            # goes before the guard is welcomed at the door: no relayed command can share the
            # socket yet.
            send_frame(conn, svc.DaemonMessage(ack=svc.Ack(node=node)))
            self.door.welcome(node, conn)
            with self.lock:
                self.engines[pid] = node
                self._departed.pop(pid, None)
                self._engines_changed.notify_all()
            self._guard_is(node, "connected", pid)
            while True:
                try:
                    # the events' heads, read once
                    batch = wire.decode_batch(recv_frame(conn, self.frame_timeout))
                except wire.NotABatch:
                    continue
                mine, foreign = batch.of_node(node)
                if foreign:  # a guard speaks for its own node only
                    self.counters["rejected"] += foreign
                    log.warning(f"the guard of {node} sent {foreign} event(s) of other nodes; refused")
                spool.append([batch.event(i) for i in mine], batch.positions(mine))
                self.counters["events"] += len(mine)
        except FrameTimeout as exc:
            self.counters["frame_timeouts"] += 1
            log.warning(f"guard {node or '(no hello)'} dropped: {exc}")
        except (DecodeError, ValueError, ConnectionError) as exc:
            # A misbehaving peer on the local socket: say who and why, count it, drop it.
            # (ConnectionError also covers a guard that simply went away: not counted.)
            if not (isinstance(exc, ConnectionError) and str(exc) == PEER_CLOSED):
                self.counters["malformed"] += 1
                log.warning(f"guard {node or '(no hello)'} dropped: {exc}")
            elif node:
                # The engine exited, or its adapter turned guarding off after a failure of its
                # own (the engine's log says which): either way the node is unguarded now.
                self.counters["guards_gone"] += 1
                log.warning(f"the guard of {node} went away; {node} is unguarded until it reconnects")
        except OSError:
            pass
        finally:
            # Only the node's current connection lets go: a guard that reconnected has
            # registered (and is watched) again on its new one, and a refused one held nothing.
            current = bool(node) and self.door.release(node, conn)
            with self.lock:
                if current:
                    self.engines.pop(pid, None)
                    now = time.monotonic()
                    self._departed = {p: g for p, g in self._departed.items() if now - g[1] < DEPARTED_KEEP_S}
                    self._departed[pid] = (node, now)
                # A guard that went before it was registered lets go of its process too,
                # unless another guard of that process holds it.
                release = current or (watched and pid not in self.engines)
            if current:
                self._guard_is(node, "gone")
            if release:
                self.witness.unwatch(pid)
            conn.close()
            self.door.leave()

    def _shim_record(self, pid: int, record: Record) -> None:
        """What the engine's shim saw: a transfer's CUDA copies (a wire event), its launches
        or its pool memory, as events of the node's shim stream. The node is the one whose
        guard runs in that process, or in the nearest process above it (an engine's workers)."""
        node = self._engine_node(pid)
        if node is None:
            self._shim_refused(
                pid, f"no guard of process {pid} or above it is connected, so its node is unknown"
            )
            return
        source = self._source(f"{node}/{SHIM}")
        if isinstance(record, LaunchRecord):
            source.emit(launches=launches_event(record))
        elif isinstance(record, MemoryRecord):
            source.emit(pool_memory=memory_event(record))
        elif record.calls == 0:  # the transfer moved nothing through CUDA copies: no observation
            return
        else:
            source.emit(
                wire=pb.Wire(
                    xfer=record.xfer,
                    bytes=record.device_bytes,
                    calls=record.calls,
                    probe=SHIM_PROBE,
                    complete=True,
                )
            )
        self.counters["shim_records"] += 1
        if record.dropped > self._shim_dropped.get(pid, 0):  # in-band, like any other loss
            self._shim_dropped[pid] = record.dropped
            source.emit(heartbeat=pb.Heartbeat(agent_version=AGENT, dropped=record.dropped))

    def _engine_node(self, pid: int) -> str | None:
        """The node whose guard runs in process `pid` or the nearest process above it:
        waiting up to SHIM_GUARD_WAIT_S for the guard's hello, or the node of a guard gone
        less than DEPARTED_KEEP_S ago."""
        deadline = time.monotonic() + SHIM_GUARD_WAIT_S
        line = ancestry(pid)
        with self._engines_changed:
            while True:
                node = next((self.engines[p] for p in line if p in self.engines), None)
                gone = self._departed.get(pid)
                if node is None and gone is not None and time.monotonic() - gone[1] < DEPARTED_KEEP_S:
                    node = gone[0]
                left = deadline - time.monotonic()
                if node is not None or left <= 0 or self.stopping.is_set():
                    return node
                self._engines_changed.wait(min(left, 0.5))

    def _shim_refused(self, pid: int, reason: str) -> None:
        self.counters["shim_refused"] += 1
        log.warning(f"a shim record from process {pid} refused: {reason}")

    def _witnessed(self, node: str, report: WireReport) -> None:
        self._source(f"{node}/{WITNESS}").emit(wire=wire_event(report))
        self.counters["witnessed"] += 1

    def _check_witness(self) -> None:
        """Say once that a watched engine posts RDMA writes outside any named transfer (its
        transfer engine posts from threads of its own): the witness cannot attribute them."""
        posts = self.witness.unlabelled_posts
        if posts and not self.counters["rdma_unlabelled"]:
            log.warning(
                f"a watched engine posted {posts} RDMA work request chain(s) outside any "
                "named transfer: the RDMA witness cannot attribute them (name transfers in the threads "
                "that post: kvguard_xfer_begin/end)"
            )
        self.counters["rdma_unlabelled"] = posts

    def _witness_lost(self, lost: int) -> None:
        """The kernel dropped witness events (its buffer was full): every watched node's
        witness says so in-band, as its heartbeat's `dropped`."""
        log.warning(f"the eBPF witness lost {lost} event(s) so far")
        names = {f"{node}/{WITNESS}" for node in self.door.nodes()}
        for name in names:
            self._source(name).emit(heartbeat=pb.Heartbeat(agent_version=AGENT, dropped=lost))

    # ------------------------------------------------------------------ spool -> daemon

    def _guard_is(self, node: str, guard: str, pid: int = 0) -> None:
        """The node's guard connected or went: its streams (its own and its probes') say so now."""
        with self.lock:
            self.guards[node] = GuardState(guard, time.time_ns(), pid)
            spools = [s for name, s in self.spools.items() if name.split("/", 1)[0] == node]
        for spool in spools:
            spool.wake()

    def _acknowledged(self, node: str, spool: Spool, batch: list[Position], ack: svc.Ack | None) -> None:
        """The daemon settled a whole batch (its positions: stored it, had it, or refused it
        for good)."""
        assert ack is not None
        rejected = {(r.epoch, r.seq) for r in ack.rejected}
        for r in ack.rejected:
            at = f"epoch {r.epoch} seq {r.seq}" if r.epoch else f"seq {r.seq}"
            log.warning(f"the daemon refused {node} {at}: {r.reason}")
        self.counters["rejected"] += len(rejected)
        self.counters["acked"] += ack.accepted + ack.repeats
        spool.ack(max((ack.durable_epoch, ack.durable_seq), batch[-1]), rejected)

    def _never_taken(self, node: str) -> str | None:
        """Why the daemon will never take `node`'s events from this agent (its certificate does
        not name the node); None if it may."""
        if self.bus is None and self.speaks_for is not None and node_of(node) not in self.speaks_for:
            names = ", ".join(sorted(self.speaks_for))
            return f"node {node!r} is not named by this agent's certificate (it names {names})"
        return None

    def _upstream(self, node: str, spool: Spool) -> None:
        """The node's spool to the daemon: up to IN_FLIGHT batches sent ahead of their acks
        (see AHEAD_MIN), so events the engine reports while a batch commits need
        not wait for that commit; each ack (in order) trims the spool. After a reconnect,
        everything not acknowledged is sent again (the daemon counts what it already has as
        repeats)."""
        delay = 0.1
        while not self.stopping.is_set():
            stream: AgentStream | BusStream | None = None
            try:
                relay = functools.partial(self._relay, node)  # commands go to the guard as they come
                if self.bus is not None:
                    stream = BusStream(self.bus, node, AGENT, on_command=relay, on_ack=spool.wake)
                else:
                    stream = AgentStream(self._channel, node, AGENT, on_command=relay, on_ack=spool.wake)
                    self.reach.reachable()  # the hello's ack came back
                # The largest message the other side takes (the daemon's, or the bus servers'),
                # and the most a batch holds in events' bytes.
                largest = self.bus.max_message() if self.bus is not None else MAX_MESSAGE
                most = largest // 2 if self.bus is not None else MAX_BATCH_BYTES
                spool.ack(stream.durable)
                delay = 0.1
                in_flight: deque[list[Position]] = deque()  # sent, not acknowledged, oldest first
                said, due = None, 0.0  # the guard last said, and when a status is due anyway
                canary = self.canaries.get(node)
                while not self.stopping.is_set():
                    # A probe's stream (node/probe) speaks of its node's guard.
                    guard = self.guards.get(node.split("/", 1)[0], GuardState("none", self.started_ns))
                    if canary is not None and guard.guard == "connected":
                        now = time.monotonic()
                        ask = canary.due(now)
                        if ask is not None:
                            self._to_guard(node, ask)
                        canary.check(now)
                    if guard != said or time.monotonic() >= due:
                        fields = canary.fields() if canary is not None else {}
                        stream.status(node_status(guard, self.gpu, len(spool.pending), AGENT, **fields))
                        said, due = guard, time.monotonic() + STATUS_EVERY_S
                    full = len(in_flight) >= IN_FLIGHT
                    ack = stream.next_ack(timeout=0.2 if full else 0) if in_flight else None
                    if ack is not None:
                        self._acknowledged(node, spool, in_flight.popleft(), ack)
                        continue
                    if full:
                        continue
                    after = in_flight[-1][-1] if in_flight else (0, 0)
                    batch, bodies = spool.take(self.batch, most, 0.2, after, bool(in_flight))
                    if not batch:
                        continue
                    if len(batch) == 1 and len(bodies[0]) > largest - 64:
                        if in_flight:  # dropped only at the spool's head: after what is in flight
                            self._acknowledged(node, spool, in_flight.popleft(), stream.next_ack())
                            continue
                        # The daemon would refuse the message, and the agent resend it, forever.
                        log.warning(
                            f"{node} seq {batch[0]} is {len(bodies[0])} bytes, over "
                            f"the {largest} a message may be; dropped"
                        )
                        self.counters["oversized"] += 1
                        spool.ack((0, 0), {batch[0]})
                        continue
                    stream.post(bodies, batch)
                    in_flight.append(batch)
            except (grpc.RpcError, DaemonRefused, BusUnavailable) as exc:
                self.counters["reconnects"] += 1
                detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
                if isinstance(exc, BusUnavailable):
                    if self.bus is not None and self.bus.reached:  # else the link said it is down, once
                        log.warning(f"{node}: {detail}; retrying")
                elif isinstance(exc, grpc.RpcError) and exc.code() is grpc.StatusCode.UNAVAILABLE:
                    self.reach.unreachable(detail)  # said once for the agent, not at every retry
                else:
                    log.warning(f"daemon {self.daemon} unavailable for {node} ({detail}); retrying")
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
            finally:
                if stream is not None:
                    stream.close()

    def _relay(self, node: str, command: svc.Command) -> None:
        """A command of the daemon for the node's guard (a canary's echo: timed first)."""
        if command.WhichOneof("body") == "canary":
            canary = self.canaries.get(node)
            if canary is not None and canary.echoed(command.canary.nonce) is not None:
                self.counters["canaries"] += 1
        else:
            self.counters["commands"] += 1
        self._to_guard(node, command)

    def _to_guard(self, node: str, command: svc.Command) -> None:
        conn = self.door.guard(node)
        if conn is None:
            log.warning(f"no guard of {node} connected for command {command.id}")
            return
        try:
            with self._to_guards[node]:  # the node's stream relays, its upstream asks for canaries
                send_frame(conn, svc.DaemonMessage(command=command))
        except OSError as exc:  # gone, or not reading within the frame timeout: a frame may be cut
            log.warning(f"command {command.id} not delivered to {node}'s guard: {exc}")
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # the guard dials again, on a clean stream

    # ------------------------------------------------------------------ engine probes

    def add_probe(self, node: str, engine: str, role: str, source: str, interval: float = 2.0) -> None:
        """Watch an engine that has no in-engine guard: read its pool and context where it
        states them (a startup log file, or its HTTP server), and report them as `pool`
        events of node `node`, whose sequence this agent keeps (in the spool directory)."""
        engine_entry(engine, f"probe {node}")  # a ValueError naming the engines known
        if role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"probe {node}: role {role!r} is not prefill, decode or colocated")
        self.counters.setdefault("probe_unreadable", 0)
        watch = (node, engine, role, source, interval, self._source(node), self.stopping, self._unreadable)
        threading.Thread(target=watch_engine, args=watch, daemon=True).start()

    def _unreadable(self) -> None:
        with self.lock:
            self.counters["probe_unreadable"] += 1

    def say_counters(self) -> None:
        """The counters on one line, if they changed since they were last said."""
        if self.counters != self._counters_said:
            self._counters_said = dict(self.counters)
            line = " ".join(f"{name}={n}" for name, n in self.counters.items())
            log.info(f"counters: {line}")

    def stop(self) -> None:
        self.stopping.set()
        self.say_counters()
        self.witness.close()
        self._channel.close()
        if self.bus is not None:
            self.bus.close()
        for spool in self.spools.values():
            spool.close()


def _refuse(conn: socket.socket, code: str, reason: str) -> None:
    """Tell a connecting guard why it is refused (it reports it), and hang up."""
    with contextlib.suppress(OSError):
        send_frame(conn, svc.DaemonMessage(error=svc.StreamError(code=code, message=reason)))
    conn.close()
