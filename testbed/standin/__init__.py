"""A stand-in CUDA driver and runtime for machines without a GPU (standin_cuda.c, standin_cudart.c),
and `StandinCuda`, a process's use of them the way engines use the real ones: the runtime and
the driver dlopen'ed into a local scope (as torch's extensions are), driver entry points found
with dlsym on the driver's handle (as Triton's launchers do) and through the runtime (which
asks cuGetProcAddress_v2, as the real one does). Kernels do nothing on the CPU but count
their runs; what is exercised is every door the kvguard shim watches.

Invariant: the libraries are built from their sources here, once per source text and build
command (a cache folder named by their hash), never taken from anywhere else.
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import os
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = {"libcuda.so.1": HERE / "standin_cuda.c", "libcudart.so.12": HERE / "standin_cudart.c"}
RTLD_LOCAL = getattr(os, "RTLD_LOCAL", 0)


def build(folder: str | Path | None = None) -> Path:
    """The folder holding both libraries, built there (default: a cache folder) if missing."""
    text = b"".join(p.read_bytes() for p in SOURCES.values()) + inspect.getsource(build).encode()
    digest = hashlib.sha256(text).hexdigest()[:16]  # the sources and how they are built
    if folder is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        folder = cache / "kvguard" / f"standin-{digest}"
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for name, source in SOURCES.items():
        target = out / name
        if target.exists():
            continue
        partial = out / f".{name}.{os.getpid()}"
        # -Bsymbolic: the library's own calls and function addresses bind to itself, as the real
        # ones' do (libcuda's cuGetProcAddress hands out its own functions, never a preload's).
        extra = ["-Wl,-Bsymbolic", *(["-ldl", "-lpthread", "-Wl,-rpath,$ORIGIN"] if "cudart" in name else [])]
        cmd = [
            "cc",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fPIC",
            "-shared",
            "-o",
            str(partial),
            str(source),
        ]
        subprocess.run([*cmd, *extra], check=True, capture_output=True)
        partial.replace(target)  # whole or not at all, for another process building it at once
    return out


class StandinCuda:
    """The stand-in driver and runtime, loaded into this process as an engine loads CUDA."""

    def __init__(self, folder: str | Path | None = None) -> None:
        where = build(folder)
        self.folder = where
        # The runtime first: it dlopens libcuda.so.1 itself (its rpath finds the stand-in).
        self.runtime = ctypes.CDLL(str(where / "libcudart.so.12"), mode=RTLD_LOCAL)
        self.driver = ctypes.CDLL(str(where / "libcuda.so.1"), mode=RTLD_LOCAL)
        d = self.driver
        for name in ("cuModuleGetFunction", "cuFuncGetName", "cuStreamCreate", "cuGraphCreate"):
            getattr(d, name).restype = ctypes.c_int
        self._launch = d.cuLaunchKernel  # dlsym on the driver's handle
        self._launch.argtypes = [
            ctypes.c_void_p,
            *[ctypes.c_uint] * 7,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        self._graph_launch = d.cuGraphLaunch
        self._graph_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        d.standinRuns.restype = ctypes.c_uint64
        d.standinRuns.argtypes = [ctypes.c_void_p]
        self._stubs: dict[str, ctypes.Array[ctypes.c_char]] = {}

    def function(self, name: str) -> int:
        """A kernel of the driver by its name (cuModuleGetFunction)."""
        f = ctypes.c_void_p()
        _ok(self.driver.cuModuleGetFunction(ctypes.byref(f), None, name.encode()), "cuModuleGetFunction")
        return int(f.value or 0)

    def launch(self, function: int, stream: int = 0) -> int:
        """cuLaunchKernel, as a Triton launcher makes it: the driver's status."""
        return int(self._launch(function, 1, 1, 1, 1, 1, 1, 0, stream or None, None, None))

    def stream(self) -> int:
        s = ctypes.c_void_p()
        _ok(self.driver.cuStreamCreate(ctypes.byref(s), 0), "cuStreamCreate")
        return int(s.value or 0)

    def capture(self, stream: int, functions: list[int]) -> int:
        """A graph captured from launches on `stream`, instantiated; its exec handle."""
        _ok(self.driver.cuStreamBeginCapture_v2(ctypes.c_void_p(stream), 0), "cuStreamBeginCapture")
        for f in functions:
            _ok(self.launch(f, stream), "cuLaunchKernel (captured)")
        graph, exec_ = ctypes.c_void_p(), ctypes.c_void_p()
        _ok(
            self.driver.cuStreamEndCapture(ctypes.c_void_p(stream), ctypes.byref(graph)), "cuStreamEndCapture"
        )
        instantiate = self.driver.cuGraphInstantiateWithFlags
        _ok(instantiate(ctypes.byref(exec_), graph, ctypes.c_ulonglong(0)), "cuGraphInstantiateWithFlags")
        return int(exec_.value or 0)

    def graph_launch(self, exec_: int, stream: int = 0) -> int:
        return int(self._graph_launch(exec_, stream or None))

    def runs(self, function: int) -> int:
        """How many times a kernel ran (launched alone or in a graph)."""
        return int(self.driver.standinRuns(ctypes.c_void_p(function)))

    # ------------------------------------------------------------------ the runtime

    def register(self, name: str) -> int:
        """A runtime kernel, registered as nvcc's generated code registers one (a host stub
        address and the device function's name); its stub."""
        stub = self._stubs.get(name)
        if stub is None:
            stub = self._stubs[name] = ctypes.create_string_buffer(1)
            register = getattr(self.runtime, "__cudaRegisterFunction")
            register(None, stub, None, name.encode(), -1, None, None, None, None, None)
        return ctypes.addressof(stub)

    def runtime_launch(self, stub: int, stream: int = 0) -> int:
        """cudaLaunchKernel of a registered kernel: the runtime's status."""

        class Dim3(ctypes.Structure):
            _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]

        fn = self.runtime.cudaLaunchKernel
        fn.argtypes = [ctypes.c_void_p, Dim3, Dim3, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return int(fn(stub, Dim3(1, 1, 1), Dim3(1, 1, 1), None, 0, stream or None))

    # ------------------------------------------------------------------ memory

    def malloc(self, nbytes: int) -> int:
        """cudaMalloc (the runtime reaches the driver's cuMemAlloc through cuGetProcAddress)."""
        p = ctypes.c_void_p()
        _ok(self.runtime.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(nbytes)), "cudaMalloc")
        return int(p.value or 0)

    def free(self, ptr: int) -> None:
        _ok(self.runtime.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def mem_alloc(self, nbytes: int) -> int:
        """cuMemAlloc_v2 through the driver's cuGetProcAddress, as PyTorch's driver calls go."""
        p = ctypes.c_uint64()
        _ok(self._proc("cuMemAlloc", ctypes.c_void_p, ctypes.c_size_t)(ctypes.byref(p), nbytes), "cuMemAlloc")
        return int(p.value)

    def pool_alloc(self, nbytes: int) -> int:
        """cuMemAllocFromPoolAsync, as PyTorch's cudaMallocAsync backend allocates."""
        p = ctypes.c_uint64()
        alloc = self._proc(
            "cuMemAllocFromPoolAsync", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p
        )
        _ok(alloc(ctypes.byref(p), nbytes, None, None), "cuMemAllocFromPoolAsync")
        return int(p.value)

    def mem_free(self, ptr: int) -> None:
        _ok(self._proc("cuMemFree", ctypes.c_uint64)(ptr), "cuMemFree")

    def reserve_and_map(self, nbytes: int, chunk: int) -> int:
        """Expandable-segment style: a reserved range, mapped chunk by chunk (cuMemMap)."""
        d = self.driver
        base = ctypes.c_uint64()
        _ok(
            d.cuMemAddressReserve(ctypes.byref(base), ctypes.c_size_t(nbytes), 0, ctypes.c_uint64(0), 0),
            "reserve",
        )
        mem_map = self._proc(
            "cuMemMap",
            ctypes.c_uint64,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_ulonglong,
            ctypes.c_ulonglong,
        )
        for at in range(0, nbytes, chunk):
            handle = ctypes.c_ulonglong()
            _ok(
                d.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(chunk), None, ctypes.c_ulonglong(0)),
                "cuMemCreate",
            )
            _ok(mem_map(base.value + at, chunk, 0, handle.value, 0), "cuMemMap")
        return int(base.value)

    def unmap(self, ptr: int, nbytes: int) -> None:
        _ok(self._proc("cuMemUnmap", ctypes.c_uint64, ctypes.c_size_t)(ptr, nbytes), "cuMemUnmap")

    def _proc(self, symbol: str, *argtypes: type) -> ctypes._CFuncPtr:
        """A driver function from cuGetProcAddress_v2 (found by dlsym), as the runtime gets them."""
        gpa = self.driver.cuGetProcAddress_v2
        gpa.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_void_p]
        pfn = ctypes.c_void_p()
        _ok(gpa(symbol.encode(), ctypes.byref(pfn), 12080, 0, None), f"cuGetProcAddress({symbol})")
        return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(pfn.value)


def _ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with CUDA status {status}")
