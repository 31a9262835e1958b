"""The CUDA shim's witnesses on a real GPU (bench/device.sh runs this): a PyTorch process with
the shim preloaded and a guard publishing its steps allocates a KV pool on the device, binds
it, and runs paged attention (its pages gathered through a block table, then PyTorch's
memory-efficient SDPA kernel) in eight checked steps and once outside any; FlashInfer's
paged decode too where it is installed. This process reads the shim's records (as the node
agent does) and checks: the pool matched to the allocation under it, every kernel named, the
eight launches checked and the ninth unguarded. Then the host cost of a launch, with the shim
and without, side by side (a one-element add, so the launch is all there is).

Without a GPU (or with --standin) the same flow runs on the stand-in CUDA driver, to check
this script itself on a CPU machine. Prints one JSON report; exit 1 when a check fails.

    python bench/gpu_witness.py [--standin] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvguard.cuda_hooks.shim import LIBRARY, LaunchRecord, MemoryRecord, Record, ShimListener

ENGINE = r"""
import json, sys, time
import numpy as np
from kvguard.agents.guard import Guard

mode, launches = sys.argv[1], int(sys.argv[2])
guard = Guard("g0", mode="monitor")
report = {"shim": guard.steps is not None}
if mode == "cuda":
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    pool = torch.zeros(2, 256, 16, 8, 64, device="cuda")  # layers, pages, page size, KV heads, head dim
    base, nbytes = pool.data_ptr(), pool.nbytes
    q = torch.randn(1, 8, 1, 64, device="cuda")
    table = torch.tensor([3, 7, 11, 12], device="cuda")
    def attention():
        k = pool[0].index_select(0, table).reshape(1, -1, 8, 64).transpose(1, 2)
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, k)
    def tiny():
        x = torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(launches):
            x.add_(1)
        dt = time.perf_counter() - t
        torch.cuda.synchronize()
        return dt
    try:
        import flashinfer  # noqa: F401
        report["flashinfer"] = flashinfer.__version__
    except Exception as exc:
        report["flashinfer"] = f"not installed ({type(exc).__name__})"
    sync = torch.cuda.synchronize
else:
    from kvguard.testbed.standin import StandinCuda
    cuda = StandinCuda()
    nbytes = 2 * 256 * 16 * 8 * 64 * 4
    base = cuda.malloc(nbytes)
    kernel = cuda.function("fmha_cutlassF_f32_aligned_64x64_rf_sm80")
    gather = cuda.function("indexSelectLargeIndex")
    def attention():
        cuda.launch(gather)
        cuda.launch(kernel)
    def tiny():
        t = time.perf_counter()
        for _ in range(launches):
            cuda.launch(gather)
        return time.perf_counter() - t
    sync = lambda: None
guard.pool(0, "decode", 16, 256, context_len=4096)
guard.pool_memory(0, [(base, nbytes)])
report["pool"] = [base, nbytes]
attention(); sync()                     # warm-up: before any check, not judged
for _ in range(8):
    guard.check_attention(0, [], np.zeros((0, 1), np.int64), np.zeros(0, np.int64))
    attention()
    guard.step_done()
attention(); sync()                     # no check before it
guard.check_attention(0, [], np.zeros((0, 1), np.int64), np.zeros(0, np.int64))
report["ns_per_launch"] = tiny() / launches * 1e9
guard.step_done()
print(json.dumps(report), flush=True)
"""


def engine(mode: str, launches: int, shim: bool, sock: Path | None) -> dict[str, object]:
    env = dict(os.environ)
    env.pop("KVGUARD_STEPS", None)
    if shim:
        env["LD_PRELOAD"] = str(LIBRARY)
        env["KVGUARD_SHIM_SOCKET"] = str(sock)
    done = subprocess.run(
        [sys.executable, "-c", ENGINE, mode, str(launches)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--standin", action="store_true", help="the stand-in CUDA driver, even with a GPU")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--launches", type=int, default=20000)
    args = parser.parse_args(argv)
    if not LIBRARY.exists():
        print(f"{LIBRARY} is not built: run `make shim`", file=sys.stderr)
        return 2
    mode = "standin"
    if not args.standin:
        try:
            import torch

            mode = "cuda" if torch.cuda.is_available() else "standin"
        except ImportError:
            pass
    got: list[Record] = []
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "shim.sock"
        listener = ShimListener(sock, lambda pid, r: got.append(r), lambda pid, why: print("refused:", why))
        try:
            witnessed = engine(mode, args.launches, True, sock)
            time.sleep(0.5)
        finally:
            listener.close()
        times: dict[str, list[float]] = {"without shim": [], "shim": []}
        for _ in range(args.rounds):  # alternating, so that drift hits both alike
            times["without shim"].append(float(engine(mode, args.launches, False, None)["ns_per_launch"]))  # type: ignore[arg-type]
            times["shim"].append(float(engine(mode, args.launches, True, sock)["ns_per_launch"]))  # type: ignore[arg-type]
    launches = [r for r in got if isinstance(r, LaunchRecord)]
    memory = [r for r in got if isinstance(r, MemoryRecord)]
    unguarded = {r.kernel for r in launches if r.kernel}
    base, nbytes = witnessed["pool"]  # type: ignore[misc]
    checks = {
        "shim loaded, guard publishing steps": bool(witnessed["shim"]),
        "pool matched to its allocation": [(m.kind, m.base, m.covered) for m in memory]
        == [("bound", base, nbytes)],
        "8 attention launches checked": sum(r.checked for r in launches) == 8,
        "1 unguarded, its kernel named": sum(r.unguarded for r in launches) == 1 and len(unguarded) == 1,
        "every kernel named": not any(r.unnamed for r in launches),
    }
    median = {name: statistics.median(values) for name, values in times.items()}
    report = {
        "mode": mode,
        "checks": checks,
        "unguarded_kernel": sorted(unguarded),
        "allocated_by": [m.call for m in memory],
        "launches_seen": sum(r.launches for r in launches),
        "flashinfer": witnessed.get("flashinfer", "-"),
        "host_ns_per_launch": median,
        "added_ns_per_launch": median["shim"] - median["without shim"],
    }
    print(json.dumps(report, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
