"""What an engine adapter may call on its guard (`GuardAPI`): the calls at each change of KV
ownership, the check before attention, the kills and commands that reach the engine, and the
few attributes an adapter reads (its node, mode, sink and findings).

Invariant: `Guard` (guarding) and `NullGuard` (kvguard off) both satisfy it, method for method
with the same parameters (mypy checks it in agents/guard/__init__.py, the tests at run time),
so that an adapter holds a GuardAPI and calls it the same way whether kvguard is on or off.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from kvguard.agents.guard.sink import EventSink
from kvguard.agents.guard.verdict import Verdict
from kvguard.ledger.findings import Finding
from kvguard.proto.kvguard.v1 import services_pb2 as svc


class GuardAPI(Protocol):
    """One engine process's guard, as its adapter sees it (see Guard for what each call does)."""

    @property
    def node(self) -> str: ...
    @property
    def mode(self) -> str: ...  # "enforce" or "monitor" (Guard), "off" (NullGuard)
    @property
    def sink(self) -> EventSink: ...
    @property
    def findings(self) -> list[Finding]: ...

    # ------------------------------------------------------------------ stops and commands

    def told(self, req: str) -> str: ...
    def kill(self, req: str, finding: str, rule: str, message: str, by: str = "daemon") -> None: ...
    def command(self, command: svc.Command) -> None: ...

    # ------------------------------------------------------------------ configuration and lifecycle

    def pool(self, pool: int, role: str, page_size: int, num_pages: int, **fields: Any) -> Verdict: ...
    def admit(self, req: str, tenant: str, prompt_tokens: int, stage: str) -> Verdict: ...
    def reject(self, req: str, reason: str) -> Verdict: ...
    def abort(self, req: str, reason: str) -> Verdict: ...
    def finish(self, req: str, output_tokens: int) -> Verdict: ...
    def bootstrap(
        self, req: str, prefill_node: str, decode_node: str, prompt_tokens: int, tenant: str = ""
    ) -> Verdict: ...
    def heartbeat(self, agent_version: str = "") -> Verdict: ...

    # ------------------------------------------------------------------ pages

    def alloc(self, req: str, pool: int, pages: Iterable[int]) -> Verdict: ...
    def write(
        self, req: str, pool: int, pages: Iterable[int], slots: Iterable[int] | None = None
    ) -> Verdict: ...
    def free(self, req: str, pool: int, pages: Iterable[int]) -> Verdict: ...
    def alloc_each(
        self, pool: int, reqs: Sequence[str], pages: Iterable[int] | np.ndarray, counts: Any = None
    ) -> Verdict: ...
    def hold(self, req: str, pool: int, pages: Iterable[int], holder: str) -> Verdict: ...
    def release(self, req: str, pool: int, pages: Iterable[int], holder: str) -> Verdict: ...
    def share(self, req: str, pool: int, pages: Iterable[int], origin_req: str) -> Verdict: ...

    # ------------------------------------------------------------------ transfers

    def xfer_send(
        self,
        req: str,
        xfer: str,
        peer_node: str,
        pool: int,
        pages: Iterable[int],
        tokens: int,
        nbytes: int,
        checksums: Iterable[int] = (),
        status: str = "done",
    ) -> Verdict: ...
    def xfer_recv(
        self,
        req: str,
        xfer: str,
        peer_node: str,
        pool: int,
        pages: Iterable[int],
        tokens: int,
        nbytes: int,
        checksums: Iterable[int] = (),
        status: str = "done",
        *,
        claimed_tokens: int = 0,
        claimed_bytes: int = 0,
        claimed_checksums: Iterable[int] = (),
    ) -> Verdict: ...
    def receive_allowed(self, req: str, pool: int, pages: Iterable[int]) -> bool: ...

    # ------------------------------------------------------------------ attention

    def step(
        self,
        pool: int,
        reqs: Sequence[str],
        pages: Iterable[int] | np.ndarray,
        slots: Iterable[int] | np.ndarray | None = None,
        *,
        counts: Iterable[int] | np.ndarray | None = None,
        grants: Iterable[int] | np.ndarray | None = None,
        block_tables: Any = None,
        context_lens: Any = None,
        stable: np.ndarray | None = None,
        table_rows: np.ndarray | None = None,
        in_slots: bool = False,
    ) -> Verdict: ...
    def step_done(self) -> None: ...
    def pool_memory(self, pool: int, regions: Iterable[tuple[int, int]]) -> None: ...
    def check_attention(
        self,
        pool: int,
        reqs: Sequence[str],
        block_tables: np.ndarray,
        context_lens: np.ndarray,
        stable: np.ndarray | None = None,
        table_rows: np.ndarray | None = None,
        in_slots: bool = False,
    ) -> Verdict: ...
