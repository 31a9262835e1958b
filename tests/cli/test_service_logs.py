"""A service's logs as an operator reads them (issue 29): one record a line, as text or JSON
(--log-format), at a level (--log-level); and a stop by SIGTERM to the whole service, as
systemd and a Ctrl-C send it, that still commits everything and saves the ledger's snapshot.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from kvguard.cli.send import send_capture
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR

INCIDENT = DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl"


def start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """A daemon in a process group of its own (as a service is), and its address once READY."""
    store = str(tmp_path / "a.db")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvguard", "daemon", "--listen", "127.0.0.1:0", "--store", store, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert daemon.stdout is not None
    line = daemon.stdout.readline()
    assert line.startswith("READY "), line
    return daemon, f"127.0.0.1:{line.split()[1]}"


def stop_group(daemon: subprocess.Popen[str]) -> tuple[int, str]:
    os.killpg(daemon.pid, signal.SIGTERM)  # the daemon and its store writer alike
    _, err = daemon.communicate(timeout=60)
    return daemon.returncode, err


def test_json_logs_are_one_object_a_line_and_the_level_holds_back_the_rest(tmp_path: Path) -> None:
    daemon, address = start(tmp_path, "--log-format", "json")
    send_capture(INCIDENT.read_text().splitlines(), address)
    rc, err = stop_group(daemon)
    assert rc == 0
    records = [json.loads(line) for line in err.splitlines()]  # every line is one JSON object
    assert records and all({"time", "level", "component", "message"} <= set(r) for r in records)
    assert all(r["time"].endswith("Z") and r["component"] == "daemon" for r in records)
    said = {r["message"].split(";")[0]: r["level"] for r in records}
    assert said[next(m for m in said if m.startswith("listening on port"))] == "info"
    assert any(m.startswith("ledger snapshot saved after record") for m in said)

    quiet, address = start(tmp_path, "--log-level", "warning")  # the same store: nothing to warn of
    rc, err = stop_group(quiet)
    assert rc == 0 and err == ""


def test_sigterm_to_the_whole_service_still_commits_and_snapshots(tmp_path: Path) -> None:
    daemon, address = start(tmp_path)
    summary = send_capture(INCIDENT.read_text().splitlines(), address)
    rc, err = stop_group(daemon)
    assert rc == 0, err
    assert "writer process died" not in err
    saved = [line for line in err.splitlines() if "ledger snapshot saved after record" in line]
    assert len(saved) == 1 and int(saved[0].rsplit(" ", 1)[1]) >= summary.accepted
