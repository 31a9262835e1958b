"""What an operator meets at a terminal (issue 29), each as they would meet it: real daemon and
agent processes, real pipes, real stores.

- a second daemon on a taken port refuses to start, naming the address; the first serves on;
- an address without a port means 7463, on the daemon's --listen and every client's --daemon;
- `audit verify` of a store that does not exist says so, exits 2 and creates nothing;
- a daemon whose store cannot be opened says why in one line (password masked), exit 2;
- a reader that goes away (`| head`) ends a command quietly, exit 141;
- an agent says once that it cannot reach the daemon, keeps spooling, and says when it can;
- `audit query`'s table is one line a record, whatever the record holds;
- `-o table|json` everywhere; `fleet -o json` keeps zero and false fields, int64 as numbers,
  and the ledger's normal counters are not listed as refused input.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import Lines, stored, wait_for
from log_lines import said as said_lines

from kvguard.agents.guard import AgentSink, Guard
from kvguard.cli.options import listen_address
from kvguard.cli.process import Service, start_agent, start_daemon
from kvguard.cli.send import send_capture
from kvguard.proto.builder import EventLog
from kvguard.proto.capture import event_to_json
from kvguard.ruleset import load_ruleset
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR

INCIDENT = DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl"


def kvguard(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvguard", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def free_port() -> int:
    """A port nothing listens on now (bound and let go)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Service]:
    service = start_daemon(str(tmp_path / "audit.db"))
    try:
        yield service
    finally:
        service.stop()


# ------------------------------------------------------------------- 1. one daemon per address


def test_a_second_daemon_on_a_taken_port_refuses_and_the_first_serves_on(
    daemon: Service, tmp_path: Path
) -> None:
    second = kvguard("daemon", "--listen", daemon.address, "--store", str(tmp_path / "other.db"))
    assert second.returncode == 2 and second.stdout == ""  # never READY
    assert (
        said_lines(second.stderr)[-1]
        == f"kvguard daemon: cannot listen on {daemon.address}: the address is in use"
    )
    assert "Traceback" not in second.stderr
    first = kvguard("fleet", "--daemon", daemon.address, "-o", "json")
    assert first.returncode == 0 and json.loads(first.stdout)["mode"] == "enforce"


# ----------------------------------------------------------------- 2. the default port, 7463


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ("localhost", "localhost:7463"),
        ("10.0.0.5", "10.0.0.5:7463"),
        ("10.0.0.5:9000", "10.0.0.5:9000"),
        ("[::1]", "[::1]:7463"),
        ("[::1]:9000", "[::1]:9000"),
        ("[fe80::1%eth0]", "[fe80::1%eth0]:7463"),
        (":7463", ":7463"),  # every interface: still refused in plaintext by the daemon
        ("unix:/run/kvguard/daemon.sock", "unix:/run/kvguard/daemon.sock"),
    ],
)
def test_an_address_without_a_port_means_7463(given: str, meant: str) -> None:
    assert listen_address(given) == meant


@pytest.mark.parametrize(
    ("given", "reason"),
    [
        ("db:http", "port 'http' is not 0 to 65535"),
        ("db:70000", "port '70000' is not 0 to 65535"),
        ("[::1", "an IPv6 host goes in [brackets]"),
        ("[db]:7463", "db is not an IPv6 address"),
        ("::1", "an IPv6 address goes in brackets ([::1])"),
        ("::1:7463", "an IPv6 address goes in brackets ([::1:7463] or [::1]:7463)"),
        ("::1:x:y", "an IPv6 address goes in brackets ([::1:x:y])"),
        ("[::1]7463", "after [::1] comes :PORT or nothing"),
    ],
)
def test_an_address_that_is_none_is_refused_naming_it(given: str, reason: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(reason)):
        listen_address(given)
    refused = kvguard("fleet", "--daemon", given)
    assert refused.returncode == 2 and f"argument --daemon: {given!r} is not an address" in refused.stderr


def test_a_daemon_on_localhost_serves_on_7463_and_clients_find_it_there(tmp_path: Path) -> None:
    service = Service("daemon", "--listen", "localhost", "--store", str(tmp_path / "a.db"), ready="READY ")
    try:
        assert service.line.split() == ["READY", "7463"]
        fleet = kvguard("fleet", "--daemon", "localhost", "-o", "json")
        assert fleet.returncode == 0 and json.loads(fleet.stdout)["events"] == 0
        query = kvguard("audit", "query", "--daemon", "[::1]")  # IPv6 loopback, bracketed, no port
        assert query.returncode == 0 and "0 records from [::1]:7463" in query.stderr
    finally:
        said = service.stop()
    assert "listening on port 7463" in said


# --------------------------------------------------------- 3. verify never proves a typo intact


def test_verify_of_a_store_that_does_not_exist_says_so_and_creates_nothing(tmp_path: Path) -> None:
    typo = tmp_path / "TYPO.db"
    run = kvguard("audit", "verify", "--store", str(typo))
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == f"kvguard audit verify: no audit store at {typo} (no such file)\n"
    assert not typo.exists() and not Path(f"{typo}.head").exists()
    # No --store: the default one, which is not here either.
    run = kvguard("audit", "verify", "-o", "json", cwd=tmp_path)
    assert run.returncode == 2
    assert json.loads(run.stdout) == {
        "store": "kvguard-audit.db",
        "intact": False,
        "complete": False,
        "error": "no audit store at kvguard-audit.db (no such file)",
        "ok": False,
    }
    assert os.listdir(tmp_path) == []
    # A database that is not an audit store is not made one.
    for command in ("verify", "head"):
        other = tmp_path / "other.db"
        other.write_bytes(b"")
        run = kvguard("audit", command, "--store", str(other))
        assert run.returncode == 2 and "is not a kvguard audit store (no records table)" in run.stderr
        assert other.read_bytes() == b""


@pytest.mark.parametrize(
    ("store", "said"),
    [
        ("sqlite:////nonexistent-dir/audit.db", "unable to open database file"),
        ("mysql://kvguard@127.0.0.1/kvguard", "No module named 'MySQLdb'"),
        ("postgresql+psycopg://kvguard:s3cret@127.0.0.1:1/kvguard", "Connection refused"),
    ],
    ids=["no-directory", "no-driver", "no-server"],
)
def test_a_daemon_whose_store_cannot_be_opened_says_why_in_a_line(store: str, said: str) -> None:
    run = kvguard("daemon", "--listen", "127.0.0.1:0", "--store", store)
    assert run.returncode == 2 and run.stdout == ""
    (line,) = said_lines(run.stderr)  # one line, no traceback
    shown = store.replace("s3cret", "***")  # a password never reaches the log
    assert line.startswith(f"kvguard daemon: audit store {shown} cannot be opened: ") and said in line


def test_verify_of_a_real_store_as_json(daemon: Service) -> None:
    send_capture(INCIDENT.read_text().splitlines(), daemon.address)
    table = kvguard("audit", "verify", "--store", daemon.store)
    assert table.returncode == 0 and "chain intact" in table.stdout
    run = kvguard("audit", "verify", "--store", daemon.store, "-o", "json")
    assert run.returncode == 0 and run.stderr == ""
    verdict = json.loads(run.stdout)
    n = int(table.stdout.split(": ", 1)[1].split()[0])  # "audit log URL: N records, ..."
    assert n > 39  # the events, and the findings they made
    assert verdict["records"] == n and verdict["intact"] is True and verdict["ok"] is True
    assert verdict["sealed_from"] == [] and verdict["store"].endswith("audit.db")


# ------------------------------------------------------------- 4. a reader that goes away


def many_events(n: int) -> list[str]:
    log = EventLog()
    log.add("n0", "pool", pool=0, role="colocated", page_size=16, num_pages=64)
    for i in range(n):
        log.add("n0", "admit", req=f"r{i}", tenant="acme", prompt_tokens=4, stage="decode")
    return [event_to_json(e) for e in log.lines]


@pytest.mark.parametrize("output", ["json", "table"])
def test_a_reader_that_goes_away_ends_the_command_quietly(daemon: Service, output: str) -> None:
    summary = send_capture(many_events(3000), daemon.address)
    assert summary.accepted == 3001
    # kvguard audit query -o json | head -3: far more than a pipe holds, so its writes fail
    query = subprocess.Popen(
        [sys.executable, "-m", "kvguard", "audit", "query", "--store", daemon.store, "-o", output],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    head = subprocess.Popen(["head", "-3"], stdin=query.stdout, stdout=subprocess.PIPE, text=True)
    assert query.stdout is not None and query.stderr is not None
    query.stdout.close()  # head holds the reading end alone: when it exits, the pipe breaks
    shown, _ = head.communicate(timeout=120)
    err = query.stderr.read().decode()
    query.stderr.close()
    assert query.wait(timeout=120) == 141, err
    assert err == ""  # no traceback, no "Exception ignored" at exit
    lines = shown.splitlines()
    assert len(lines) == 3
    if output == "json":
        assert [json.loads(line)["id"] for line in lines] == [1, 2, 3]
    else:
        assert lines[0].split()[:3] == ["ID", "TIME", "KIND"]


# ------------------------------------------------------------- 5. an agent without its daemon


def test_an_agent_says_once_it_cannot_reach_the_daemon_keeps_spooling_and_says_when_it_can(
    tmp_path: Path,
) -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"
    agent = start_agent(str(tmp_path / "agent.sock"), address, str(tmp_path / "spool"))
    said = Lines(agent)
    sink = AgentSink(tmp_path / "agent.sock", "d0")
    guard = Guard("d0", ruleset=load_ruleset(), sink=sink)
    daemon = None
    try:
        down = f"kvguard agent: cannot reach the daemon at {address}"
        assert wait_for(lambda: said.having(down), timeout=60), said.lines
        guard.pool(0, "decode", page_size=16, num_pages=64, context_len=1024)
        for i in range(20):
            guard.admit(f"r{i}", "acme", 16, "decode")
        assert sink.flush()
        spool = tmp_path / "spool" / "d0.spool"
        assert wait_for(lambda: spool.exists() and spool.stat().st_size > 0)  # kept, on disk
        # It keeps retrying, and says so once, not at every retry.
        assert said.having(down)[0].endswith("events stay spooled until it answers")
        daemon = start_daemon(str(tmp_path / "audit.db"), port)
        up = f"kvguard agent: reached the daemon at {address}; sending what is spooled"
        assert wait_for(lambda: said.having(up), timeout=90), said.lines
        assert wait_for(lambda: len(stored(daemon.store)) == guard._seq, timeout=30)
        assert len(said.having(down)) == 1 and len(said.having(up)) == 1
        assert not said.having("unavailable for d0")  # the per-retry line is gone
    finally:
        sink.close()
        agent.proc.terminate()
        agent.proc.wait(timeout=30)
        said.thread.join(timeout=30)
        agent.stop()
        if daemon is not None:
            daemon.stop()
    assert [e.seq for e in stored(str(tmp_path / "audit.db"))] == list(range(1, guard._seq + 1))


# --------------------------------------------------------------- 6. one record, one line


def test_the_table_has_one_line_per_record_whatever_it_holds(daemon: Service) -> None:
    log = EventLog()
    regions = [{"base": 0x7F00_0000_0000, "stride": 4096}, {"base": 0x7F10_0000_0000, "stride": 4096}]
    log.add("n0", "pool", pool=0, role="colocated", page_size=16, num_pages=64, regions=regions)
    log.add("n0", "admit", req="r1", tenant="acme", prompt_tokens=4, stage="decode")
    log.add("n0", "abort", req="r1", reason="engine said:\nCUDA out of memory\tretry")
    assert send_capture([event_to_json(e) for e in log.lines], daemon.address).accepted == 3
    run = kvguard("audit", "query", "--store", daemon.store, "--kind", "event")
    assert run.returncode == 0 and "3 records" in run.stderr
    header, pool, admit, abort = run.stdout.splitlines()
    assert header.split()[:3] == ["ID", "TIME", "KIND"] and pool.split()[0] == "1"
    assert "regions={base=139637976727552 stride=4096},{base=139706696204288 stride=4096}" in pool
    assert admit.split()[0] == "2" and "admit" in admit
    assert abort.split()[0] == "3" and abort.endswith("engine said:\\nCUDA out of memory\\tretry")


# ------------------------------------------------------------- 7. one output convention


def test_replay_takes_table_and_text_alike() -> None:
    table = kvguard("replay", str(INCIDENT), "-o", "table")
    text = kvguard("replay", str(INCIDENT), "-o", "text")
    plain = kvguard("replay", str(INCIDENT))
    assert table.returncode == text.returncode == plain.returncode == 1
    assert table.stdout == text.stdout == plain.stdout and len(table.stdout.splitlines()) == 11
    wrong = kvguard("replay", str(INCIDENT), "-o", "xml")
    assert wrong.returncode == 2 and "argument -o/--output: invalid choice: 'xml'" in wrong.stderr
    for command in (("replay", "x"), ("fleet",), ("audit", "query"), ("audit", "verify")):
        helped = kvguard(*command, "--help")
        assert "-o {table,json}, --output {table,json}" in helped.stdout, command


def test_fleet_json_keeps_zero_and_false_fields_and_int64_as_numbers(daemon: Service) -> None:
    send_capture(INCIDENT.read_text().splitlines(), daemon.address)
    run = kvguard("fleet", "--daemon", daemon.address, "-o", "json")
    assert run.returncode == 0
    state = json.loads(run.stdout)
    nodes = {node["node"]: node for node in state["nodes"]}
    assert set(nodes) == {"p0", "d0"}
    for node in nodes.values():
        assert node["connected"] is False  # the replay's streams have closed: said, not left out
        assert node["dropped"] == 0 and node["restarts"] == 0
        assert isinstance(node["last_ts_ns"], int) and node["last_ts_ns"] > 0  # int64: a number
        assert isinstance(node["last_seq"], int) and node["last_seq"] > 0
        assert "status" not in node  # a message never said stays absent
    assert isinstance(state["now_ns"], int) and state["events"] == 39
    assert state["counters"]["ledger_page_transitions"] > 0
    assert state["store"]["refusing"] == "" and isinstance(state["store"]["used_bytes"], int)
    table = kvguard("fleet", "--daemon", daemon.address)
    lines = table.stdout.splitlines()
    (work,) = [line for line in lines if line.startswith("ledger: ")]
    assert f"page_transitions {state['counters']['ledger_page_transitions']}" in work
    assert all("page_transitions" not in line for line in lines if line.startswith("refused or unjudged"))
