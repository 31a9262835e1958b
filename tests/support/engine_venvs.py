"""Running code inside a real engine's own venv (`.engines/<engine>`, made by `make engines`):
SGLang and vLLM from PyPI at pinned versions, each with its own pins, kvguard linked in.

A scenario is a script in tests/engines/ run by that venv's Python. It drives the engine's
real classes through kvguard's adapter, writes the guard's events to a capture and prints
one JSON object on its last stdout line (what it saw: findings, kills, the engine's state).
The test then replays the capture in kvguard's own venv and compares the findings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("sglang", "vllm")


def engine_python(engine: str) -> Path:
    """The engine venv's interpreter; a missing one fails the test, saying how to make it."""
    override = os.environ.get(f"KVGUARD_{engine.upper()}_PYTHON")
    python = Path(override) if override else ROOT / ".engines" / engine / "bin" / "python"
    if not python.exists():
        raise AssertionError(f"no {engine} venv at {python}: run `make engines` (make test does)")
    return python


def run_scenario(
    engine: str, script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 240
) -> dict[str, Any]:
    """Run tests/engines/<script> in the engine's venv; its last stdout line, parsed."""
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    full_env.pop("PYTHONPATH", None)  # the engine venv sees kvguard through its own link
    done = subprocess.run(
        [str(engine_python(engine)), str(ROOT / "tests" / "engines" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"{script} {' '.join(args)} exited {done.returncode}:\n"
            f"{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{script} printed no result:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    result = json.loads(lines[-1])
    result["_stderr"], result["_stdout"] = done.stderr, done.stdout
    return result


def run_batch(
    engine: str, script: str, specs: list[tuple[str, Path, str]], timeout: float = 300
) -> dict[str, Any]:
    """Several scenarios of a script in one run of the engine's venv (the engine is imported
    once): `script batch NAME,CAPTURE,MODE ...`, each printing a line with its "scenario"
    ("NAME,MODE"). Their results by that key."""
    args = [f"{name},{capture},{mode}" for name, capture, mode in specs]
    last = run_scenario(engine, script, "batch", *args, timeout=timeout)
    found: dict[str, Any] = {}
    for line in last["_stdout"].splitlines():
        if line.startswith('{"scenario"'):
            result = json.loads(line)
            result["_stderr"] = last["_stderr"]
            found[result["scenario"]] = result
    assert len(found) == len(specs), f"{script}: {len(found)} of {len(specs)} scenarios reported"
    return found


def replay(capture: Path) -> list[dict[str, Any]]:
    """The findings `kvguard replay CAPTURE -o json` gives, in kvguard's own venv."""
    done = subprocess.run(
        [sys.executable, "-m", "kvguard", "replay", str(capture), "-o", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode in (0, 1), done.stderr
    return [orjson.loads(line) for line in done.stdout.splitlines() if line.strip()]


def kinds(findings: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(finding, request) of each finding: what a replay must reproduce."""
    return {(f["finding"], f.get("req", "")) for f in findings}
