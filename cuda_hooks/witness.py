"""The eBPF wire witness: attaches to engine processes by PID, with no change to them, and
reports the KV transfers their TCP connections carried, as the kernel saw the bytes leave,
and, with uprobes, the CUDA copies and RDMA work requests their threads made while naming a
transfer (on the CUDA runtime, driver and verbs libraries the process has loaded, looked for
again every RESCAN_S: CUDA is often loaded late; a verbs provider's post_send is found
through the contexts and queue pairs that pass through libibverbs).

`open_witness()` returns a `BpfWitness` (bcc, root, kernel headers) or, when BPF cannot be
used, a `NullWitness` that says why, once, and watches nothing: the agent runs on without
it. Invariants: a watched process is never slowed beyond the probes' own cost (ring buffers
between kernel and user side; what overflows is lost and counted, never waited for); the
connection events are read in the order the process made them (one ring buffer for all CPUs),
and a loss is known at its place in that order; a TCP report reaches `on_report` only for a
transfer whose bytes were followed from its header to its end (cuda_hooks/tcp_stream.py), a
copy or RDMA report only for a named transfer that made at least one such call; loss is
reported through `on_lost`.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from kvguard.cuda_hooks.tcp_stream import RemoteWrites, Streams, WireReport
from kvguard.proto import pb

PROGRAM = Path(__file__).with_name("witness.bpf.c")
HEAD = 512  # bytes of each write captured (a power of two: the BPF program masks with HEAD - 1)
BCC_PATHS = ("/usr/lib/python3/dist-packages",)  # where Debian's python3-bpfcc puts `bcc`
TRACING = ("/sys/kernel/debug/tracing", "/sys/kernel/tracing")
CUDA_PROBE = "ebpf:cuda"
RDMA_PROBE = "ebpf:rdma"
RUNS_KEPT = 256  # remote ranges of RDMA writes kept per transfer (a power of two)
_KIND_WRITE, _KIND_OPEN, _KIND_CLOSE = 1, 2, 3
_DEVICE_KINDS = (2, 3, 4)  # cudaMemcpyKind device-to-host, device-to-device, default: off the GPU
RESCAN_S = 1.0  # how often the watched processes' libraries are looked at again (CUDA loads late)
_NAMING = (("kvguard_xfer_begin", "xfer_begin", ""), ("kvguard_xfer_end", "xfer_end", ""))
# Library (by file name prefix) -> (symbol, entry probe, return probe) of witness.bpf.c.
UPROBES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "libcudart.so": (
        ("cudaMemcpy", "runtime_copy", "runtime_return"),
        ("cudaMemcpyAsync", "runtime_copy", "runtime_return"),
        ("cudaMemcpyPeer", "runtime_peer", "runtime_return"),
        ("cudaMemcpyPeerAsync", "runtime_peer", "runtime_return"),
    ),
    "libcuda.so": (
        ("cuMemcpy", "driver_default", "driver_return"),
        ("cuMemcpyAsync", "driver_default", "driver_return"),
        ("cuMemcpyDtoH_v2", "driver_d2h", "driver_return"),
        ("cuMemcpyDtoHAsync_v2", "driver_d2h", "driver_return"),
        ("cuMemcpyHtoD_v2", "driver_h2d", "driver_return"),
        ("cuMemcpyHtoDAsync_v2", "driver_h2d", "driver_return"),
        ("cuMemcpyDtoD_v2", "driver_d2d", "driver_return"),
        ("cuMemcpyDtoDAsync_v2", "driver_d2d", "driver_return"),
        ("cuMemcpyPeer", "driver_peer", "driver_return"),
        ("cuMemcpyPeerAsync", "driver_peer", "driver_return"),
    ),
    # Where an engine names its transfers: the label library, or the shim when preloaded.
    "libkvguard_label.so": _NAMING,
    "libkvguard_shim.so": _NAMING,
    # Where a provider's post_send shows its address (rdma_post_send is attached there).
    "libibverbs.so": (
        ("ibv_open_device", "", "rdma_context"),
        ("ibv_create_qp", "", "rdma_created_qp"),
        ("ibv_modify_qp", "rdma_modified_qp", ""),
    ),
}

ReportSink = Callable[[str, WireReport], None]  # (the watched process's name, report)
LossSink = Callable[[int], None]  # events lost so far, in all


class Witness(Protocol):
    available: bool
    reason: str  # why not available ("" when it is)

    @property
    def unlabelled_posts(self) -> int: ...

    def watch(self, pid: int, name: str) -> None: ...
    def unwatch(self, pid: int) -> None: ...
    def close(self) -> None: ...


class NullWitness:
    """No BPF here: watches nothing. `reason` says why."""

    available = False
    unlabelled_posts = 0

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def watch(self, pid: int, name: str) -> None:
        pass

    def unwatch(self, pid: int) -> None:
        pass

    def close(self) -> None:
        pass


def load_bcc(paths: tuple[str, ...] = BCC_PATHS) -> Any:
    """The bcc module: installed in this environment, or the distribution's."""
    try:
        return importlib.import_module("bcc")
    except ImportError:
        pass
    for path in paths:
        if (Path(path) / "bcc").is_dir() and path not in sys.path:
            sys.path.append(path)
    return importlib.import_module("bcc")


def _tracing_ready(roots: tuple[str, ...] = TRACING) -> str:
    """Empty when the syscall tracepoints are reachable (tracefs mounted: root may mount it
    here), otherwise why not."""
    if any(Path(root, "events", "syscalls").is_dir() for root in roots):
        return ""
    for fs, target in (("debugfs", "/sys/kernel/debug"), ("tracefs", "/sys/kernel/tracing")):
        subprocess.run(["mount", "-t", fs, fs, target], capture_output=True, check=False)
    if any(Path(root, "events", "syscalls").is_dir() for root in roots):
        return ""
    return f"no syscall tracepoints under {' or '.join(roots)} (tracefs is not mounted and could not be)"


RING_PAGES = 1024  # the connection events' ring buffer, shared by all CPUs (4 MiB: ~7,500 writes)


def open_witness(
    on_report: ReportSink,
    on_lost: LossSink | None = None,
    *,
    uprobes: bool = True,
    buffer_pages: int = RING_PAGES,
) -> BpfWitness | NullWitness:
    """The witness, or a NullWitness naming what is missing (never an exception). `uprobes`:
    also probe the CUDA copy calls and RDMA posts (a uprobe traps every call of a watched
    process: about a microsecond on bare metal, 10 in this VM; bench/RESULTS.md)."""
    if os.geteuid() != 0:
        return NullWitness("eBPF needs root (or CAP_BPF and CAP_PERFMON); the agent runs without it")
    try:
        bcc = load_bcc()
    except ImportError as exc:
        return NullWitness(f"bcc is not installed ({exc}); install the distribution's python3-bpfcc")
    missing = _tracing_ready()
    if missing:
        return NullWitness(missing)
    failed = _compiles_apart(PROGRAM, buffer_pages)
    if failed:
        return NullWitness(f"the eBPF witness could not be compiled: {failed}")
    try:
        return BpfWitness(bcc, on_report, on_lost, uprobes=uprobes, buffer_pages=buffer_pages)
    except Exception as exc:  # bcc raises plain Exception for a compile or load failure
        text = " ".join(str(exc).split())[:300]
        release = os.uname().release
        headers = Path("/lib/modules", release, "build")
        hint = (
            "" if headers.exists() else f"; no kernel headers at {headers} (install them and link them there)"
        )
        return NullWitness(f"the eBPF witness could not be loaded: {text}{hint}")


def compile_program(bcc: Any, program: Path, ring_pages: int = RING_PAGES) -> Any:
    """The witness's BPF program, compiled and loaded (bcc.BPF)."""
    if ring_pages < 1 or ring_pages & (ring_pages - 1):
        raise ValueError(f"ring buffer pages {ring_pages}: not a power of two")
    flags = [f"-DHEAD={HEAD}", f"-DMAX_RUNS={RUNS_KEPT}", f"-DRING_PAGES={ring_pages}"]
    return bcc.BPF(src_file=str(program).encode(), cflags=flags)


_COMPILED: set[tuple[bytes, int]] = set()  # programs already compiled in a child by this process


def _compiles_apart(program: Path, ring_pages: int) -> str:
    """Empty when `program` compiles and loads in a child process, else why not. An error
    in the back end of bcc's LLVM (another distribution's LLVM may meet one) ends the process
    that hits it, with no exception to catch: the agent must not be that process."""
    key = (program.read_bytes(), ring_pages)
    if key in _COMPILED:
        return ""
    code = (
        "import sys; from pathlib import Path; from kvguard.cuda_hooks import witness; "
        "witness.compile_program(witness.load_bcc(), Path(sys.argv[1]), int(sys.argv[2]))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(program), str(ring_pages)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "compiling it took over 300 s"
    if done.returncode != 0:
        said = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        return " ".join(said[-3:])[-300:] or f"the compiler's process exited with {done.returncode}"
    _COMPILED.add(key)
    return ""


class BpfWitness:
    """The loaded BPF program and the thread that decodes its events."""

    available = True
    reason = ""

    def __init__(
        self,
        bcc: Any,
        on_report: ReportSink,
        on_lost: LossSink | None = None,
        *,
        uprobes: bool = True,
        buffer_pages: int = RING_PAGES,  # the writes' ring buffer: what a slow reader may fall behind by
    ) -> None:
        self._uprobes = UPROBES if uprobes else {}
        self._bcc = bcc
        self._bpf = compile_program(bcc, PROGRAM, buffer_pages)
        self._on_report = on_report
        self._on_lost = on_lost
        self._names: dict[int, str] = {}
        self._streams = Streams()
        self._lock = threading.Lock()  # names and streams: watch() comes from other threads
        self.lost_events = 0
        self.reports = 0
        self.missing_symbols = 0
        # The tables are looked up by name each time, never kept: bcc's cleanup() must drop
        # the ring buffer's last reference while the map is still open.
        self._bpf[b"events"].open_ring_buffer(self._event)
        self._bpf[b"copies"].open_ring_buffer(self._copies)
        self._bpf[b"providers"].open_ring_buffer(self._provider)
        self._seen: dict[int, set[str]] = {}  # pid -> the mapped files already looked at
        self._live: dict[int, set[tuple[str, int, str, str]]] = {}  # pid -> (library, address, probes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="kvguard-witness", daemon=True)
        self._thread.start()

    @property
    def unlabelled_posts(self) -> int:
        """RDMA posts of watched processes made outside any named transfer: a transfer engine
        that posts from its own threads, whose writes this witness cannot attribute."""
        return int(sum(self._bpf[b"unlabelled"][ctypes.c_int(0)]))

    @property
    def lost_connections(self) -> int:
        return self._streams.lost

    @property
    def unnamed_messages(self) -> int:
        """Messages that may have been transfers whose names lay beyond the captured bytes."""
        return self._streams.unnamed

    def attached(self, pid: int) -> set[tuple[str, int, str, str]]:
        """The uprobes attached to `pid`: (library, address, entry probe, return probe)."""
        with self._lock:
            return set(self._live.get(pid, ()))

    def watch(self, pid: int, name: str) -> None:
        with self._lock:
            self._names[pid] = name
            self._seen.setdefault(pid, set())
            self._live.setdefault(pid, set())
        self._bpf[b"watched"][ctypes.c_uint32(pid)] = ctypes.c_uint32(1)
        self._attach(pid)

    def unwatch(self, pid: int) -> None:
        with contextlib.suppress(KeyError):
            del self._bpf[b"watched"][ctypes.c_uint32(pid)]
        with self._lock:
            self._names.pop(pid, None)
            self._streams.forget(pid)
            self._seen.pop(pid, None)
            live = self._live.pop(pid, set())
        for path, address, entry, ret in live:
            where = {"name": path.encode(), "addr": address, "pid": pid}
            with contextlib.suppress(Exception):  # the process may be gone, and its probes with it
                if entry:
                    self._bpf.detach_uprobe(**where)
                if ret:
                    self._bpf.detach_uretprobe(**where)

    def _attach(self, pid: int) -> None:
        """Uprobes on the CUDA, verbs and naming libraries `pid` mapped since it was last looked at."""
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return
        paths = {line.split(None, 5)[5] for line in maps.splitlines() if len(line.split(None, 5)) == 6}
        with self._lock:
            if pid not in self._seen:
                return
            new = sorted(paths - self._seen[pid])
            self._seen[pid].update(new)
        for path in new:
            for prefix, probes in self._uprobes.items():
                if os.path.basename(path).startswith(prefix):
                    for symbol, entry, ret in probes:
                        for address in self._addresses(path, symbol):
                            self._probe(pid, (path, address, entry, ret))

    def _addresses(self, path: str, symbol: str) -> list[int]:
        """Every address of `symbol` in the library: a versioned symbol has one per version
        (libibverbs keeps its 1.0 ibv_open_device beside 1.1), and callers use either."""
        try:
            found = self._bcc.BPF.get_user_functions_and_addresses(path.encode(), f"^{symbol}$".encode())
        except Exception:  # bcc: an unreadable library
            found = []
        if not found:
            self.missing_symbols += 1
        return sorted({address for _, address in found})

    def _probe(self, pid: int, key: tuple[str, int, str, str]) -> None:
        """Attach (library, address, entry probe, return probe) for `pid`; it counts as
        attached (`attached()`) only once the kernel has it."""
        path, address, entry, ret = key
        where = {"name": path.encode(), "addr": address, "pid": pid}
        try:
            if entry:
                self._bpf.attach_uprobe(fn_name=entry.encode(), **where)
            if ret:
                self._bpf.attach_uretprobe(fn_name=ret.encode(), **where)
        except Exception:  # bcc: the address is not in a loadable segment; the others stand
            self.missing_symbols += 1
            return
        with self._lock:
            if pid in self._live:
                self._live[pid].add(key)

    def _provider(self, ctx: Any, data: Any, size: int) -> None:
        """A provider's post_send at `address` in process `pid`: probe it there."""
        e = self._bpf[b"providers"].event(data)
        place = mapped(e.pid, e.address)
        key = (*place, "rdma_post_send", "rdma_post_return") if place is not None else None
        with self._lock:
            # Every context and queue pair of the process tells the same address: probe it once
            # (this runs on the poll thread only, so no second attach can be under way).
            known = key is None or e.pid not in self._live or key in self._live[e.pid]
        if not known:
            self._probe(e.pid, key)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._bpf.cleanup()

    def _poll(self) -> None:
        rescan = time.monotonic() + RESCAN_S
        while not self._stop.is_set():
            self._bpf.ring_buffer_poll(timeout=100)
            # Drops of the copy and provider buffers, and of the last connection events, are
            # seen here; a drop between connection events was seen at its place (_event).
            self._lost(int(self._bpf[b"drops"][ctypes.c_int(0)].value))
            if time.monotonic() > rescan:
                for pid in list(self._seen):
                    self._attach(pid)
                rescan = time.monotonic() + RESCAN_S

    def _copies(self, ctx: Any, data: Any, size: int) -> None:
        e = self._bpf[b"copies"].event(data)
        with self._lock:
            name = self._names.get(e.pid)
        if name is None:
            return
        xfer = bytes(e.xfer).split(b"\0", 1)[0].decode(errors="replace")
        reports = []
        if e.calls:  # no copy call under the name: nothing observed, nothing reported
            moved = sum(e.bytes[k] for k in _DEVICE_KINDS)
            reports.append(WireReport(e.pid, xfer, moved, e.calls, True, CUDA_PROBE))
        if e.rdma_wrs:  # complete unless a post was longer than the probe follows
            reports.append(
                WireReport(
                    e.pid, xfer, e.rdma_bytes, e.rdma_wrs, not e.rdma_truncated, RDMA_PROBE, _remote_writes(e)
                )
            )
        for report in reports:
            self.reports += 1
            self._on_report(name, report)

    def _event(self, ctx: Any, data: Any, size: int) -> None:
        e = self._bpf[b"events"].event(data)
        self._lost(e.drops)  # events before this one were dropped: no connection is certain now
        with self._lock:
            name = self._names.get(e.pid)
            if name is None:
                return
            if e.kind == _KIND_WRITE:
                reports = self._streams.write(e.pid, e.fd, e.bytes, ctypes.string_at(e.head, e.captured))
            elif e.kind == _KIND_OPEN:
                reports = self._streams.open(e.pid, e.fd)
            else:
                reports = self._streams.close(e.pid, e.fd)
        for report in reports:
            self.reports += 1
            self._on_report(name, report)

    def _lost(self, total: int) -> None:
        """`total` events have been dropped so far: if that is more than before, no followed
        connection's position is certain any more."""
        if total <= self.lost_events:
            return
        self.lost_events = total
        with self._lock:
            self._streams.lose_all()
        if self._on_lost is not None:
            self._on_lost(self.lost_events)


def _remote_writes(e: Any) -> RemoteWrites | None:
    """A transfer's RDMA writes from its copy event; the probe's monotonic post times become
    this node's wall clock, what the receiver's events are stamped with."""
    if not e.runs and not e.runs_lost:
        return None
    wall = time.time_ns() - time.monotonic_ns()
    n = min(e.runs, len(e.run_addr))
    return RemoteWrites(
        e.remote_lo,
        e.remote_hi,
        tuple(zip(e.run_addr[:n], e.run_len[:n], strict=True)),
        e.runs_lost,
        e.first_write_ns + wall if e.first_write_ns else 0,
        e.last_write_ns + wall if e.last_write_ns else 0,
    )


def wire_event(report: WireReport) -> pb.Wire:
    """A report as the `wire` event the agent sends (and `kvguard witness` prints)."""
    wire = pb.Wire(
        xfer=report.xfer, bytes=report.bytes, calls=report.calls, probe=report.probe, complete=report.complete
    )
    remote = report.remote
    if remote is not None:
        wire.remote_lo, wire.remote_hi = remote.lo, remote.hi
        wire.writes.extend(pb.RemoteRun(addr=a, bytes=n) for a, n in remote.runs)
        wire.writes_lost, wire.first_write_ns, wire.last_write_ns = (
            remote.lost,
            remote.first_ns,
            remote.last_ns,
        )
    return wire


def mapped(pid: int, address: int) -> tuple[str, int] | None:
    """(library, virtual address in its ELF file) of a code address in process `pid`."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= address < end:
            # The file as the process sees it (an engine in a container has its own root).
            try:
                return parts[5], elf_vaddr(f"/proc/{pid}/root{parts[5]}", address - start + int(parts[2], 16))
            except (OSError, struct.error):
                return None
    return None


def elf_vaddr(path: str, offset: int) -> int:
    """The virtual address of file offset `offset` in a 64-bit little-endian ELF file (what
    bcc's uprobe `addr` takes), from its PT_LOAD program headers."""
    with open(path, "rb") as elf:
        header = elf.read(64)
        phoff, phentsize, phnum = (
            struct.unpack_from("<Q", header, 32)[0],
            *struct.unpack_from("<HH", header, 54),
        )
        elf.seek(phoff)
        table = elf.read(phentsize * phnum)
    for i in range(phnum):
        kind, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if kind == 1 and p_offset <= offset < p_offset + p_filesz:  # PT_LOAD
            return offset - p_offset + p_vaddr
    return offset
