"""The guard of an engine that runs unguarded (`NullGuard`): every call of Guard's API
(GuardAPI, agents/guard/api.py), checking nothing and sending nothing, so that an engine calls
its guard the same way whether kvguard is on or off (no `if guard:` at every call site).

Invariant: every call returns the clean verdict; nothing is kept, nothing is killed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvguard.agents.guard.sink import NullSink
from kvguard.agents.guard.verdict import CLEAN, Verdict
from kvguard.ledger.findings import Finding
from kvguard.proto.kvguard.v1 import services_pb2 as svc


class NullGuard:
    mode = "off"

    def __init__(self, node: str = "") -> None:
        self.node = node
        self.sink = NullSink()
        self.findings: list[Finding] = []
        self.killed: dict[str, Finding | None] = {}

    def told(self, req: str) -> str:
        """Nothing to tell: this guard stops no request."""
        return ""

    def kill(self, req: str, finding: str, rule: str, message: str, by: str = "daemon") -> None:
        """An ordered kill is not recorded: nothing is killed."""

    def command(self, command: svc.Command) -> None:
        """A command of the daemon (none comes: its sink listens to nothing) does nothing."""

    def pool(self, pool: int, role: str, page_size: int, num_pages: int, **fields: Any) -> Verdict:
        return CLEAN

    def admit(self, req: str, tenant: str, prompt_tokens: int, stage: str) -> Verdict:
        return CLEAN

    def reject(self, req: str, reason: str) -> Verdict:
        return CLEAN

    def abort(self, req: str, reason: str) -> Verdict:
        return CLEAN

    def finish(self, req: str, output_tokens: int) -> Verdict:
        return CLEAN

    def bootstrap(
        self, req: str, prefill_node: str, decode_node: str, prompt_tokens: int, tenant: str = ""
    ) -> Verdict:
        return CLEAN

    def heartbeat(self, agent_version: str = "") -> Verdict:
        return CLEAN

    def alloc(self, req: str, pool: int, pages: Iterable[int]) -> Verdict:
        return CLEAN

    def write(self, req: str, pool: int, pages: Iterable[int], slots: Iterable[int] | None = None) -> Verdict:
        return CLEAN

    def free(self, req: str, pool: int, pages: Iterable[int]) -> Verdict:
        return CLEAN

    def alloc_each(
        self, pool: int, reqs: Sequence[str], pages: Iterable[int] | np.ndarray, counts: Any = None
    ) -> Verdict:
        return CLEAN

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
    ) -> Verdict:
        return CLEAN

    def hold(self, req: str, pool: int, pages: Iterable[int], holder: str) -> Verdict:
        return CLEAN

    def release(self, req: str, pool: int, pages: Iterable[int], holder: str) -> Verdict:
        return CLEAN

    def share(self, req: str, pool: int, pages: Iterable[int], origin_req: str) -> Verdict:
        return CLEAN

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
    ) -> Verdict:
        return CLEAN

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
    ) -> Verdict:
        return CLEAN

    def receive_allowed(self, req: str, pool: int, pages: Iterable[int]) -> bool:
        return True

    def step_done(self) -> None:
        """No step word: nothing to end."""

    def pool_memory(self, pool: int, regions: Iterable[tuple[int, int]]) -> None:
        """No shim is told of the pool."""

    def check_attention(
        self,
        pool: int,
        reqs: Sequence[str],
        block_tables: np.ndarray,
        context_lens: np.ndarray,
        stable: np.ndarray | None = None,
        table_rows: np.ndarray | None = None,
        in_slots: bool = False,
    ) -> Verdict:
        return CLEAN
