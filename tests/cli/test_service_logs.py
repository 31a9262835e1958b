"""A service's logs as an operator reads them (issue 29): one record a line, as text or JSON
(--log-format), at a level (--log-level); and a stop by SIGTERM to the whole service, as
systemd and a Ctrl-C send it, that still commits everything and saves the ledger's snapshot.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
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


TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (debug|info|warning|error)\s+kvguard daemon: \S"
)


def test_text_logs_carry_the_time_and_level_and_under_journald_its_priority(tmp_path: Path) -> None:
    daemon, _ = start(tmp_path)
    rc, err = stop_group(daemon)
    assert rc == 0 and err and all(TEXT_LINE.match(line) for line in err.splitlines()), err
    assert any(re.search(r" info +kvguard daemon: listening on port ", line) for line in err.splitlines())
    # Under systemd, stderr is the journal's stream ($JOURNAL_STREAM: its device and inode):
    # each line starts <N>, the syslog priority, for `journalctl -p`; journald adds the time.
    journal = tmp_path / "journal"
    with journal.open("w") as stream, socket.socket() as taken:  # a start that fails: a port in use
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        st = os.fstat(stream.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvguard",
                "daemon",
                "--listen",
                f"127.0.0.1:{port}",
                "--store",
                str(tmp_path / "b.db"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=stream,
            env=env,
            timeout=120,
        )
    # (gRPC's own core may say the same failure in a line of its own)
    lines = [line for line in journal.read_text().splitlines() if "kvguard daemon: " in line]
    assert (
        done.returncode != 0 and lines and all(re.match(r"^<[2-7]>kvguard daemon: ", line) for line in lines)
    )
    assert any(line.startswith("<3>kvguard daemon: ") for line in lines), lines  # an error: priority 3


def test_a_refusal_is_logged_with_the_peer_the_method_and_the_certificate(tmp_path: Path) -> None:
    from certificates import client, make_pki, tls_args

    from kvguard.proto.channel import channel
    from kvguard.proto.kvguard.v1 import services_pb2 as svc
    from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc

    pki = make_pki(tmp_path)
    daemon, address = start(tmp_path, "--log-format", "json", *tls_args(pki, "daemon"))
    address = address.replace("127.0.0.1", "localhost")
    with channel(address, client(pki, "node-d0")) as ch:  # a node may not act
        try:
            svc_grpc.ControlServiceStub(ch).Act(svc.Action(acknowledge=svc.Acknowledge(cursor=1)), timeout=10)
        except Exception as exc:  # grpc.RpcError: PERMISSION_DENIED
            assert "PERMISSION_DENIED" in str(exc)
    rc, err = stop_group(daemon)
    assert rc == 0
    (refused,) = [r for r in map(json.loads, err.splitlines()) if r["message"].startswith("refused ")]
    assert refused["level"] == "warning" and refused["cn"] == "d0" and refused["role"] == "node"
    assert refused["method"].endswith("ControlService/Act") and refused["peer"].startswith("ipv")
