"""The guard's side of the shim's launch and allocation witnesses: the step word it publishes
for the shim, and the pool regions it binds.

The step word (cuda_hooks/shim/record.h, struct kvguard_steps) is a small file in shared
memory that the guard writes and the shim maps read-only, in the guard's process and in the
engine's worker processes (they find it in $KVGUARD_STEPS): `checked()` before the launches a
guard check covers, `ended()` once the step's kernels are launched; an attention launch is
guarded while a check opened a step that no end has closed yet. It also carries the ruleset's
attention kernel patterns. Writing it is two stores, no system call.

Invariant: only the guard that made a word writes it (one writer: its callers hold the
guard's lock), the patterns under a seqlock (generation odd while they change).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import mmap
import os
import struct
import tempfile
from collections.abc import Iterable
from pathlib import Path

STEPS_ENV = "KVGUARD_STEPS"
MAGIC = 0x5453564B  # "KVST"
VERSION = 1
PATTERNS_BYTES = 8192
# magic, version, reserved, checks, ends, steps, generation, patterns_len, reserved2
HEAD = struct.Struct("=IHHQQQQII")
SIZE = HEAD.size + PATTERNS_BYTES
_CHECKS, _ENDS, _STEPS, _GENERATION, _PATTERNS_LEN = 8, 16, 24, 32, 40


def shim_loaded() -> ctypes.CDLL | None:
    """The process, when the kvguard shim is preloaded into it (it exports the step calls)."""
    process = ctypes.CDLL(None)
    return process if hasattr(process, "kvguard_steps_attach") else None


def pack_patterns(patterns: Iterable[str]) -> bytes:
    """The patterns as the word holds them (NUL-separated); ValueError when they do not fit."""
    data = b"".join(p.encode() + b"\0" for p in patterns)
    if len(data) > PATTERNS_BYTES:
        raise ValueError(f"attention kernel patterns take {len(data)} bytes (at most {PATTERNS_BYTES})")
    return data


class StepWord:
    """One guard's step word. `path` is where the engine's other processes find it."""

    def __init__(self, patterns: Iterable[str] = (), directory: str | Path | None = None) -> None:
        where = Path(directory) if directory else Path("/dev/shm") if Path("/dev/shm").is_dir() else None
        fd, name = tempfile.mkstemp(prefix="kvguard-steps-", dir=where)
        self.path = Path(name)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        HEAD.pack_into(self._map, 0, MAGIC, VERSION, 0, 0, 0, 0, 0, 0, 0)
        self._checks = ctypes.c_uint64.from_buffer(self._map, _CHECKS)
        self._ends = ctypes.c_uint64.from_buffer(self._map, _ENDS)
        self._steps = ctypes.c_uint64.from_buffer(self._map, _STEPS)
        self._generation = ctypes.c_uint64.from_buffer(self._map, _GENERATION)
        self.publish(patterns)
        self.process = shim_loaded()
        self._flush = getattr(self.process, "kvguard_launches_flush", None)
        if self.process is not None:
            self.process.kvguard_steps_attach(str(self.path).encode())
        os.environ[STEPS_ENV] = str(self.path)  # for the engine's workers, started after this
        atexit.register(self.close)  # the file goes with the process (a killed one leaves 8 KiB)

    def publish(self, patterns: Iterable[str]) -> None:
        data = pack_patterns(patterns)
        self._generation.value += 1  # odd: the shim keeps its copy until it is even again
        self._map[HEAD.size : HEAD.size + len(data)] = data
        struct.pack_into("=I", self._map, _PATTERNS_LEN, len(data))
        self._generation.value += 1

    def checked(self) -> None:
        """A guard check: the launches from now on are guarded, until the step ends."""
        self._checks.value += 1

    def ended(self) -> None:
        """The step's kernels are launched: what is launched from now on needs another check.
        In the guard's own process the shim says this step's counts to the agent now."""
        self._ends.value = self._checks.value
        self._steps.value += 1
        if self._flush is not None:
            self._flush()

    def close(self) -> None:
        if os.environ.get(STEPS_ENV) == str(self.path):
            del os.environ[STEPS_ENV]
        with contextlib.suppress(OSError):
            self.path.unlink()  # mapped processes keep their mapping


def bind_pool(pool: int, regions: Iterable[tuple[int, int]]) -> list[int] | None:
    """Tell the shim where a pool's KV lies ((base address, bytes its pages need) a region):
    it says to the agent how much of each the allocations it saw hold, and later any free or
    unmap of them. The bytes covered of each, or None when no shim is loaded here."""
    process = shim_loaded()
    if process is None:
        return None
    bind = process.kvguard_pool_bind
    bind.argtypes = [ctypes.c_uint32, ctypes.c_uint64, ctypes.c_uint64]
    bind.restype = ctypes.c_uint64
    return [int(bind(pool, base, nbytes)) for base, nbytes in regions]
