"""The testbed worker process: ``python -m kvguard.testbed.engine --config JSON``, as the
router (testbed.router) starts one prefill and one decode worker, each with its own KV pool.

A worker serves control calls from the router over TCP (testbed.wire) and calls its in-engine
guard (when one is on) at the points where real engines change page ownership: admission,
rejection, abort, allocation, write, free, hold/release, prefix share, transfer send and
receive, and before every attention launch. The parts: testbed.worker (the shared worker:
pool, LIFO free list, guard, server), testbed.prefill and testbed.decode.

Invariant: with every fault switch off the workers are a correct engine (a request attends
only to KV it wrote or was legitimately given); each fault switch breaks exactly the code path
that testbed.faults describes. The process prints one ready line (its pid and ports) and then
serves until the router's SIGTERM, which the kernel also sends when the router dies
(PR_SET_PDEATHSIG on Linux): no worker outlives its router.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
from typing import Any

import torch

from kvguard.testbed.decode import DecodeWorker
from kvguard.testbed.faults import check_faults
from kvguard.testbed.prefill import PrefillWorker
from kvguard.testbed.worker import Worker, WorkerConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvguard testbed worker (started by the router)")
    parser.add_argument("--config", required=True, help="worker configuration as JSON")
    parser.add_argument("--parent", type=int, default=0, help="the router's pid: end when it ends")
    args = parser.parse_args(argv)
    raw = json.loads(args.config)
    raw["faults"] = check_faults(raw.get("faults", []))
    config = WorkerConfig(**raw)
    torch.set_num_threads(1)
    worker: Worker = PrefillWorker(config) if config.role == "prefill" else DecodeWorker(config)

    def stop(signum: int, frame: object) -> None:
        worker.guard.sink.close()
        os._exit(0)

    # The router stops the workers (SIGTERM) after it has asked them to flush; a Ctrl-C in the
    # terminal reaches the whole process group, and only the router should act on it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop)
    if args.parent:
        _end_with(args.parent)

    def ready(ports: dict[str, Any]) -> None:
        print(json.dumps({"ready": True, "pid": os.getpid(), **ports}), flush=True)

    worker.serve(ready)
    return 0


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _end_with(parent: int) -> None:
    """Have the kernel send SIGTERM when the router's process (the thread that forked this) ends."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            print(f"kvguard testbed worker: prctl: errno {ctypes.get_errno()}", file=sys.stderr)
    if os.getppid() != parent:  # the router died before the request above took effect
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    sys.exit(main())
