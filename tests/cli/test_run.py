"""`kvguard run -- COMMAND`: the engine starts with kvguard attached through its own plugin
loader (SGLang 0.5.23 from PyPI, in its venv), under the node name and sink given; a
command or an agent that is not there is one clear line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from engine_venvs import ROOT, engine_python

KVGUARD = [sys.executable, "-m", "kvguard", "run"]


def test_run_attaches_kvguard_to_the_engine_and_its_pool_comes_first(tmp_path: Path) -> None:
    capture = tmp_path / "run.jsonl"
    script = ROOT / "tests" / "engines" / "sglang_scenarios.py"
    done = subprocess.run(
        [
            *KVGUARD,
            "--node",
            "gpu-9",
            "--capture",
            str(capture),
            "--mode",
            "monitor",
            "--",
            str(engine_python("sglang")),
            "-W",
            "ignore",
            str(script),
            "plugin_path",
            str(tmp_path / "unused.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "with kvguard attached (monitor; node gpu-9" in done.stderr
    assert '"node": "gpu-9"' in done.stdout
    first, *rest = capture.read_text().splitlines()
    assert '"node":"gpu-9"' in first and '"pool":{' in first and '"context_len":16' in first
    assert any('"admit":{"req":"env-1"' in line for line in rest)


def test_run_without_a_command_or_an_agent_says_so(tmp_path: Path) -> None:
    done = subprocess.run([*KVGUARD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no engine command given" in done.stderr
    missing = tmp_path / "agent.sock"
    done = subprocess.run(
        [*KVGUARD, "--agent-socket", str(missing), "--", "true"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert f"no node agent at --agent-socket {missing}" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run(
        [*KVGUARD, "--capture", str(tmp_path / "c.jsonl"), "--", "no-such-engine-xyz"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "cannot start 'no-such-engine-xyz'" in done.stderr


def test_run_with_the_cuda_witness_preloads_the_shim_into_the_engine(tmp_path: Path) -> None:
    import socket

    sock = tmp_path / "agent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))  # a socket where the agent's is: `run` only checks that it is one
    probe = (
        "import ctypes, os; process = ctypes.CDLL(None); "
        "print(hasattr(process, 'kvguard_steps_attach'), os.environ['KVGUARD_SHIM_SOCKET'])"
    )
    try:
        done = subprocess.run(
            [*KVGUARD, "--cuda-witness", "--agent-socket", str(sock), "--", sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        listener.close()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", f"{sock}.shim"]  # the engine runs with the shim loaded
    assert "witnessed by the shim" in done.stderr
    done = subprocess.run(
        [*KVGUARD, "--cuda-witness", "--capture", str(tmp_path / "c.jsonl"), "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "does not go with --capture" in done.stderr
