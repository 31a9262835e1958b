"""The in-engine guard: what an engine (or its adapter) calls at each change of KV ownership.

This package is the guard's whole public surface; engines import from here only.
- `Guard`: one engine process's guard (one node); `NullGuard`: the same calls, checking
  nothing (an engine run with the guard off calls it unchanged); `GuardAPI`: those calls,
  the type an adapter holds either as (both satisfy it: mypy checks it below).
- `Verdict`: what the engine must do after a call (kill requests, quarantine pages, deny a
  share).
- Sinks: where the guard's events go without blocking the engine (`AgentSink`: the node
  agent; `CaptureSink`: a JSON Lines capture; `NullSink`).
- `page_checksums`: per-page KV checksums, where the pool lies (CPU or GPU), as a transfer's
  two ends report them; `TransferLabel`: names the transfer a thread's copies belong to, for
  the node's witnesses; `SHIM_LIBRARY`: the CUDA shim an engine's processes preload (its copy,
  launch and allocation witnesses).
"""

from typing import TYPE_CHECKING

from kvguard.agents.guard.api import GuardAPI
from kvguard.agents.guard.guard import Guard, Mode
from kvguard.agents.guard.null import NullGuard
from kvguard.agents.guard.sink import AgentSink, CaptureSink, EventSink, NullSink
from kvguard.agents.guard.verdict import Verdict, WallClock
from kvguard.cuda_hooks.kernels import CHECKSUM_MULTIPLIER, page_checksums
from kvguard.cuda_hooks.shim import LIBRARY as SHIM_LIBRARY
from kvguard.cuda_hooks.shim import CopyLabel as TransferLabel

__all__ = [
    "CHECKSUM_MULTIPLIER",
    "SHIM_LIBRARY",
    "AgentSink",
    "CaptureSink",
    "EventSink",
    "Guard",
    "GuardAPI",
    "Mode",
    "NullGuard",
    "NullSink",
    "TransferLabel",
    "Verdict",
    "WallClock",
    "page_checksums",
]

if TYPE_CHECKING:  # both guards are GuardAPIs (`make lint`; tests/agents/test_guard_api.py at run time)
    _guard: type[GuardAPI] = Guard
    _null_guard: type[GuardAPI] = NullGuard
