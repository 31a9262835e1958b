"""The LD_PRELOAD shim's two ends in Python: what an engine calls to name the transfer its
CUDA copies belong to, and what the node agent reads from the shim's socket.

The shim (cuda_hooks/shim/kvguard_*.c, `make shim`) counts the bytes of every CUDA copy
call of the process it is preloaded into; between `kvguard_xfer_begin(xfer)` and
`kvguard_xfer_end()` it counts them for that transfer, and at the end sends one record
(cuda_hooks/shim/record.h, read here as SHIM_RECORD) to the agent. Its launch witness sends a
LAUNCH_RECORD a step (kvguard_launch.c), its allocation witness a MEMORY_RECORD when a pool's
memory is bound or let go of (kvguard_memory.c); cuda_hooks/steps.py is the guard's side.
Invariant: a record that does not parse whole (size, magic, version) is refused with the
reason; nothing else about it is trusted.
"""

from __future__ import annotations

import contextlib
import ctypes
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvguard.proto import pb
from kvguard.proto.local import listening, peer_pid

LIBRARY = Path(__file__).with_name("shim") / "libkvguard_shim.so"
LABELS = Path(__file__).with_name("shim") / "libkvguard_label.so"  # the same two calls, for the eBPF witness
MAGIC = 0x5347564B  # "KVGS"
VERSION = 1
KINDS = ("h2h", "h2d", "d2h", "d2d", "default")  # cudaMemcpyKind, the index into `bytes`
# magic, version, reserved, pid, last_error, xfer, bytes[8], calls, failed, failed_bytes, dropped
SHIM_RECORD = struct.Struct("=IHHIi128s8QQQQQ")
PROBE = "shim:cuda"
LAUNCH_MAGIC = 0x4C47564B  # "KVGL"
# magic, version, reserved, pid, flags, launches, graphs, attention, checked, unguarded,
# captured, unjudged, unnamed, unwrapped, checks, steps, kernel_steps, quiet_steps, dropped, kernel
LAUNCH_RECORD = struct.Struct("=IHHII14Q192s")
MEMORY_MAGIC = 0x4D47564B  # "KVGM"
# magic, version, reserved, pid, pool, kind, reserved2, base, bytes, covered, lo, hi,
# allocations, steps, dropped, call
MEMORY_RECORD = struct.Struct("=IHHIIII8Q32s")
MEMORY_KINDS = {1: "bound", 2: "freed", 3: "unmapped"}
STEPS_SEEN = 1  # LaunchRecord.flags: a guard's step word was mapped
UNGUARDED_GRAPH = 2  # ... the first unguarded attention launch was a graph launch
LARGEST = max(SHIM_RECORD.size, LAUNCH_RECORD.size, MEMORY_RECORD.size)


@dataclass(frozen=True, slots=True)
class ShimRecord:
    """One named transfer's copies (the sender's PID comes from the socket, not from here)."""

    xfer: str
    bytes: dict[str, int]  # copied by calls that succeeded, by kind
    calls: int
    failed: int
    failed_bytes: int
    last_error: int
    dropped: int  # records the process could not send before this one

    @property
    def device_bytes(self) -> int:
        """Bytes that left device memory (to the host, another device, or either): what a
        sender's transfer moved off its GPU."""
        return self.bytes["d2h"] + self.bytes["d2d"] + self.bytes["default"]


@dataclass(frozen=True, slots=True)
class LaunchRecord:
    """What a process launched since its shim's last launch record (record.h)."""

    steps_seen: bool  # a guard's step word was mapped: launches were judged
    launches: int
    graphs: int
    attention: int
    checked: int
    unguarded: int
    captured: int
    unjudged: int
    unnamed: int
    unwrapped: int
    checks: int
    steps: int
    kernel_steps: int
    quiet_steps: int  # steps ended since the last attention kernel the process saw
    dropped: int
    kernel: str  # the first unguarded attention kernel's name
    kernel_in_graph: bool = False  # ... launched in a graph


@dataclass(frozen=True, slots=True)
class MemoryRecord:
    """A pool region's memory as the shim saw it: bound, freed or unmapped (record.h)."""

    pool: int
    kind: str
    base: int
    bytes: int
    covered: int
    lo: int
    hi: int
    allocations: int
    steps: int
    dropped: int
    call: str


Record = ShimRecord | LaunchRecord | MemoryRecord


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def parse_any(data: bytes) -> Record:
    """Any record the shim sends, told apart by its magic."""
    magic = struct.unpack_from("=I", data)[0] if len(data) >= 4 else 0
    if magic == LAUNCH_MAGIC:
        return parse_launch(data)
    if magic == MEMORY_MAGIC:
        return parse_memory(data)
    return parse_record(data)


def _checked(data: bytes, layout: struct.Struct, what: str) -> tuple[int, ...]:
    if len(data) != layout.size:
        raise ValueError(f"{what} record of {len(data)} bytes (expected {layout.size})")
    values: tuple[int, ...] = layout.unpack(data)
    if values[1] != VERSION:
        raise ValueError(f"{what} record version {values[1]} (this agent reads {VERSION})")
    return values


def parse_launch(data: bytes) -> LaunchRecord:
    _, _, _, _pid, flags, *counts, kernel = _checked(data, LAUNCH_RECORD, "launch")
    return LaunchRecord(
        bool(flags & STEPS_SEEN), *counts, kernel=_text(kernel), kernel_in_graph=bool(flags & UNGUARDED_GRAPH)
    )  # type: ignore[arg-type]


def parse_memory(data: bytes) -> MemoryRecord:
    _, _, _, _pid, pool, kind, _, *numbers, call = _checked(data, MEMORY_RECORD, "memory")
    if kind not in MEMORY_KINDS:
        raise ValueError(f"memory record of kind {kind} (known: {sorted(MEMORY_KINDS)})")
    return MemoryRecord(pool, MEMORY_KINDS[kind], *numbers, call=_text(call))  # type: ignore[arg-type]


def launches_event(r: LaunchRecord) -> pb.Launches:
    return pb.Launches(
        launches=r.launches,
        graphs=r.graphs,
        attention=r.attention,
        checked=r.checked,
        unguarded=r.unguarded,
        captured=r.captured,
        unjudged=r.unjudged,
        unnamed=r.unnamed,
        unwrapped=r.unwrapped,
        checks=r.checks,
        steps=r.steps,
        kernel=r.kernel,
        kernel_steps=r.kernel_steps,
        quiet_steps=r.quiet_steps,
        judged=r.steps_seen,
        kernel_in_graph=r.kernel_in_graph,
    )


def memory_event(r: MemoryRecord) -> pb.PoolMemory:
    return pb.PoolMemory(
        pool=r.pool,
        kind=r.kind,
        base=r.base,
        bytes=r.bytes,
        covered=r.covered,
        lo=r.lo,
        hi=r.hi,
        call=r.call,
        allocations=r.allocations,
        steps=r.steps,
    )


def ancestry(pid: int, most: int = 16) -> list[int]:
    """`pid` and the processes above it, nearest first (an engine's worker, its engine core,
    ...), as /proc says now; the ones it cannot read end the line."""
    line = [pid]
    while len(line) < most:
        try:
            stat = Path(f"/proc/{line[-1]}/stat").read_text()
        except OSError:
            break
        parent = int(stat.rpartition(")")[2].split()[1])  # after the command, which may hold spaces
        if parent <= 1:
            break
        line.append(parent)
    return line


def parse_record(data: bytes) -> ShimRecord:
    if len(data) != SHIM_RECORD.size:
        raise ValueError(f"shim record of {len(data)} bytes (expected {SHIM_RECORD.size})")
    magic, version, _, _pid, last_error, xfer, *rest = SHIM_RECORD.unpack(data)
    if magic != MAGIC:
        raise ValueError(f"shim record magic {magic:#x} is not {MAGIC:#x}")
    if version != VERSION:
        raise ValueError(f"shim record version {version} (this agent reads {VERSION})")
    by_kind, (calls, failed, failed_bytes, dropped) = rest[:8], rest[8:]
    name = xfer.split(b"\0", 1)[0].decode(errors="replace")
    if not name:
        raise ValueError("shim record names no transfer")
    kinds = dict(zip(KINDS, by_kind, strict=False))
    return ShimRecord(name, kinds, calls, failed, failed_bytes, last_error, dropped)


class CopyLabel:
    """The engine's side: name the transfer that the CUDA copies of this thread belong to.
    The calls go to the preloaded shim (which counts), or else to the label library, where
    they do nothing but give the eBPF witness's uprobes a place to see the name; with
    neither (not built) they are skipped."""

    def __init__(self, labels: Path = LABELS) -> None:
        process = ctypes.CDLL(None)
        self.active = hasattr(process, "kvguard_xfer_begin")  # the shim is preloaded: it counts
        library = process if self.active else ctypes.CDLL(str(labels)) if labels.exists() else None
        self._begin = getattr(library, "kvguard_xfer_begin", None)
        self._end = getattr(library, "kvguard_xfer_end", None)
        if self._begin is not None:
            self._begin.argtypes = [ctypes.c_char_p]

    @contextlib.contextmanager
    def transfer(self, xfer: str) -> Iterator[None]:
        if self._begin is None or self._end is None:
            yield
            return
        self._begin(xfer.encode())
        try:
            yield
        finally:
            self._end()


class ShimListener:
    """The agent's side: a Unix SOCK_SEQPACKET socket the shims of the host's engines send
    their records to; each record goes to `on_record` with the sender's PID as the kernel
    tells it (SO_PEERCRED), never as the record claims it."""

    def __init__(
        self,
        path: str | Path,
        on_record: Callable[[int, Record], None],
        on_bad: Callable[[int, str], None],
    ) -> None:
        self.path = Path(path)
        self._on_record = on_record
        self._on_bad = on_bad
        # Engines may run as other users (0o666): the PID, not the path, identifies them.
        self._server = listening(self.path, socket.SOCK_SEQPACKET, mode=0o666)
        self._stop = threading.Event()
        threading.Thread(target=self._serve, name="kvguard-shim", daemon=True).start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            pid = peer_pid(conn)  # not the record's
            while not self._stop.is_set():
                try:
                    data = conn.recv(LARGEST + 1)
                except OSError:
                    return
                if not data:
                    return
                try:
                    record = parse_any(data)
                except ValueError as exc:
                    self._on_bad(pid, str(exc))
                    continue
                self._on_record(pid, record)

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
