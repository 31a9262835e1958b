"""The testbed worker's shared part: its configuration, the KV pool and free list, the
in-engine guard, and the control server that takes the router's calls (testbed.wire): one
reply a call, or several for an op that streams (decode's generate), the last one final.

:class:`Worker` is what prefill (testbed.prefill) and decode (testbed.decode) share. Every
change of page ownership goes through the guard: pages are granted on allocation (take_pages)
and given up on free (free_pages); pages the guard says are still in use elsewhere are
quarantined, out of circulation for good. A guard verdict that kills a request raises
:class:`Killed` and fails that request alone.

Invariant: the free list is LIFO, as in real allocators: the pages freed last are handed out
first, which is what makes a stale page hold a recent user's data. A quarantined page never
returns to the free list.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvguard.agents.guard import AgentSink, CaptureSink, EventSink, Guard, NullGuard, TransferLabel
from kvguard.testbed import wire
from kvguard.testbed.models import EchoModel

AGENT_WAIT_S = 10.0  # a worker with an agent socket waits this long for the agent to watch it


class Killed(Exception):
    """kvguard terminated the request; the message says why."""


class PoolFull(Exception):
    """No pages for the request now: it is rejected (the client may retry)."""


@dataclass
class WorkerConfig:
    role: str
    node: str
    page_size: int = 16
    num_pages: int = 256
    context_len: int = 1024
    guard: str = "off"  # off, monitor, enforce
    rule_modes: dict[str, str] = field(default_factory=dict)  # rule id -> monitor or enforce
    faults: frozenset[str] = frozenset()
    audit_dir: str = ""
    agent_socket: str = ""  # when set, events go to the node agent (and its kills come back)
    prefill_ms_per_token: float = 0.0  # test control: a slow prefill, to stage an abort
    decode_step_ms: float = 0.0  # test control: a slow decode step, to stage overlap
    offload_delay_ms: float = 50.0
    prefix_cache: bool = False  # keep prompts' pages for reuse by identical prompts
    host_cache: bool = False  # offload prompts' KV to host memory, restore on a repeat
    device: str = "cpu"  # pool and model; on CUDA the guard checks tags and checksums there
    cuda_witness: bool = False  # the shim is preloaded: on CPU, attention is launched on the stand-in driver


class StandinKernels:
    """The testbed's decode kernels on the stand-in CUDA driver (testbed/standin): nothing but
    launches, each the one a GPU run makes at that point (its norm, its paged attention)."""

    def __init__(self) -> None:
        from kvguard.testbed.standin import StandinCuda

        self.cuda = StandinCuda()
        self.norm = self.cuda.function("kvguard_testbed_rmsnorm")
        self.paged_attention = self.cuda.function("kvguard_testbed_paged_attention")

    def decode(self) -> None:
        self.cuda.launch(self.norm)
        self.cuda.launch(self.paged_attention)


class Worker:
    """What prefill and decode share: the pool, the LIFO free list, the guard, the server."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.faults = config.faults
        self.model = EchoModel(config.page_size, max(config.context_len * 2, 2048), device=config.device)
        self.pool = self.model.pool(config.num_pages)
        self.free_list: list[int] = list(range(config.num_pages - 1, -1, -1))  # pop() gives page 0 first
        self.quarantined: set[int] = set()
        self.copies = TransferLabel()
        self.lock = threading.RLock()
        self.guard: Guard | NullGuard = NullGuard(config.node)
        if config.guard != "off":
            sink: EventSink | None = None
            if config.agent_socket:
                sink = AgentSink(config.agent_socket, config.node)
            elif config.audit_dir:
                sink = CaptureSink(Path(config.audit_dir) / f"{config.node}.jsonl")
            self.guard = Guard(
                config.node,
                mode=config.guard,  # type: ignore[arg-type]
                rule_modes=config.rule_modes,  # type: ignore[arg-type]
                sink=sink,
                on_finding=self._log_finding,
                on_kill=self._killed,
                on_quarantine=self._quarantined,
            )
        # The witness's kernels: on CUDA the real ones; on a CPU, the decode step's attention is
        # also launched on the stand-in CUDA driver, so that the shim has launches to judge.
        self.kernels = StandinKernels() if config.cuda_witness and self.pool.device.type == "cpu" else None
        self.guard.pool(
            0,
            "prefill" if config.role == "prefill" else "decode",
            config.page_size,
            config.num_pages,
            context_len=config.context_len,
            engine="kvguard-testbed",
            kv_dtype="float32",
            source="testbed",
            # Decode receives KV into its pages: where they lie, so that RDMA writes a probe saw
            # the sender post can be mapped to them (unused by the testbed's TCP transfer).
            regions=self.pool.regions() if config.role != "prefill" else [],
        )
        if self.pool.device.type == "cuda":  # where the pool's KV lies, for the shim's allocation witness
            self.guard.pool_memory(0, [(t.data_ptr(), t.nbytes) for t in (self.pool.k, self.pool.v)])

    # ------------------------------------------------------------------ guard and pages

    def _killed(self, req: str, reason: str) -> None:
        """The daemon ordered a kill (the guard recorded it): end the request it names."""
        with self.lock:
            self.on_kill(req, reason)

    def _quarantined(self, pool: int, pages: list[int]) -> None:
        """The daemon ordered pages out of circulation (the worker's one pool is pool 0)."""
        if pool == 0:
            self.quarantine(pages)

    def on_kill(self, req: str, reason: str) -> None:
        """The engine's part of a kill ordered from outside (each worker knows its requests)."""

    def _log_finding(self, finding: Any) -> None:
        where = f"[{self.config.node}] {finding.severity.upper()} {finding.action} {finding.rule}"
        print(f"{where}: {finding.message}", file=sys.stderr, flush=True)

    def take_pages(self, req: str, n: int) -> list[int] | None:
        """n pages from the free list, granted to req (None when the pool is short)."""
        with self.lock:
            if len(self.free_list) < n:
                return None
            pages = [self.free_list.pop() for _ in range(n)]
            verdict = self.guard.alloc(req, 0, pages)
            bad = verdict.quarantine
            if bad:
                # Quarantine: pages still in use elsewhere leave circulation; take others.
                self.quarantined |= bad
                self.guard.free(req, 0, sorted(bad))
                keep = [p for p in pages if p not in bad]
                more = self.take_pages(req, len(pages) - len(keep))
                if more is None:
                    return None
                pages = keep + more
            if verdict.kill:
                raise Killed(verdict.reason(req))
            return pages

    def give_back(self, pages: list[int]) -> None:
        """Return pages to the free list (in order: the first page is handed out first again)."""
        with self.lock:
            self.free_list.extend(p for p in reversed(pages) if p not in self.quarantined)

    def quarantine(self, pages: Iterable[int]) -> None:
        """Take pages out of circulation: out of the free list, and never back into it."""
        with self.lock:
            self.quarantined |= set(pages)
            self.free_list = [p for p in self.free_list if p not in self.quarantined]

    def free_pages(self, req: str, pages: list[int]) -> None:
        with self.lock:
            bad = self.guard.free(req, 0, pages).quarantine
            if bad:
                self.quarantine(bad)
            self.give_back(pages)

    # ------------------------------------------------------------------ serving

    def serve(self, ready: Callable[[dict[str, Any]], None]) -> None:
        sink = self.guard.sink
        if isinstance(sink, AgentSink) and not sink.wait_ready(AGENT_WAIT_S):
            # Serve all the same (the guard's own checks hold); the agent's witness misses
            # the connections opened until it takes the guard's hello.
            print(
                f"kvguard testbed: {self.config.node}: the agent at {sink.socket_path} did not take "
                f"the guard's hello within {AGENT_WAIT_S:g} s; serving, not yet witnessed",
                file=sys.stderr,
            )
        control = socket.create_server(("127.0.0.1", 0))
        ports = {"control": control.getsockname()[1], **self.extra_ports()}
        ready(ports)
        while True:
            conn, _ = control.accept()
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def extra_ports(self) -> dict[str, int]:
        return {}

    def _handle(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):  # OSError: the caller has gone
            for reply in self._replies(conn):
                wire.send(conn, reply)

    def _replies(self, conn: socket.socket) -> Iterator[dict[str, Any]]:
        """The replies to one call: one message, or (an op that streams) several, the last final."""
        try:
            msg, _payload = wire.recv(conn)
            op = getattr(self, f"op_{msg.get('op')}", None)
            if op is None:
                yield {"error": f"unknown op {msg.get('op')!r}"}
                return
            result = op(msg)
            if isinstance(result, dict):
                yield result
            else:
                yield from result
        except Killed as exc:
            yield {"status": "killed", "error": str(exc)}
        except PoolFull as exc:
            yield {"status": "rejected", "error": str(exc)}
        except (ConnectionError, OSError, ValueError) as exc:
            yield {"error": f"{type(exc).__name__}: {exc}"}

    def op_flush(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Write every queued guard event to the audit capture (for tests and shutdown)."""
        if isinstance(self.guard.sink, CaptureSink | AgentSink):
            self.guard.sink.flush()
        findings = [f.to_json_dict() for f in self.guard.findings]
        return {"ok": True, "findings": findings, "free_pages": len(self.free_list)}
