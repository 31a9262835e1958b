"""`kvguard alerts` against a real daemon fed real events: what the audit log holds, printed
and filtered by severity; followed into a file across a restart of the daemon (same store,
same port) without a gap or a repeat; stdout's reader going away ends it quietly; options
that cannot be used exit 2 naming the option."""

from __future__ import annotations

import itertools
import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_helpers import INCIDENT, stale_reads, stored_records, wait_for

from kvguard.agents.upstream import AgentStream
from kvguard.cli.process import Service, start_daemon
from kvguard.proto import pb
from kvguard.proto.capture import read_capture
from kvguard.proto.channel import channel

BASE_NS = 1_767_258_000 * 10**9  # 2026-01-01 09:00:00 UTC


def incident() -> list[pb.Event]:
    events = [e for _, e in read_capture(INCIDENT) if isinstance(e, pb.Event)]
    for e in events:
        e.ts_ns = BASE_NS + e.ts_ns * 100_000
    return events


INCIDENT_ALERTS = 11  # 7 findings and 4 updates of them (g1's fate, the ends of its 3 runs of repeats)


def feed_incident(daemon: Service, more: list[pb.Event] | None = None, alerts: int = 0) -> None:
    """The incident (and `more`, which raise `alerts`), fed; then wait until its updates are
    stored too: they follow the batches' acks (said once the findings they update are durable)."""
    feed(daemon.address, incident() + (more or []))
    wait_for(lambda: len(stored_cursors(daemon.store)) >= INCIDENT_ALERTS + alerts, timeout=30)


def feed(address: str, events: list[pb.Event]) -> None:
    """Each node's run of events as a batch, acknowledged (durable) before the next."""
    ch = channel(address, None)
    streams: dict[str, AgentStream] = {}
    try:
        for node, run in itertools.groupby(events, key=lambda e: e.node):
            if node not in streams:
                streams[node] = AgentStream(ch, node, "kvguard-agent")
            batch = list(run)
            ack = streams[node].send(batch)
            assert ack.accepted == len(batch) and not ack.rejected, ack
    finally:
        for stream in streams.values():
            stream.close()
        ch.close()


def stored_cursors(store: str) -> list[int]:
    """The cursors of what the feed sends: every finding record but the repeats."""
    from kvguard.daemon.store import Store

    s = Store(store)
    try:
        return [
            record_id
            for record_id, _, body in s.rows(kind="finding")
            if "repeat" not in pb.Finding.FromString(body).details
        ]
    finally:
        s.close()


def alerts_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvguard", "alerts", *args]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Service]:
    d = start_daemon(str(tmp_path / "audit.db"))
    yield d
    d.stop()


def test_without_follow_it_prints_what_the_audit_log_holds_and_exits(daemon: Service) -> None:
    feed_incident(daemon)
    done = subprocess.run(alerts_cmd("--daemon", daemon.address), capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (0, "")
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["cursor"] for r in records] == stored_cursors(daemon.store)
    # the findings but their repeats, the update of g1's (it reached its client) and each run's summary
    findings = [f for f in stored_records(daemon.store) if "repeat" not in f.details]
    assert [(r["finding"], r["rule"], r["req"], r["message"]) for r in records] == [
        (f.finding, f.rule, f.req, f.message) for f in findings
    ]
    assert [r["outcome"] for r in records].count("reached_client") == 1


def test_min_severity_keeps_that_severity_and_those_above_it(daemon: Service) -> None:
    feed_incident(daemon, stale_reads("n1", 2), alerts=2)  # critical ones, then 2 high
    args = ("--daemon", daemon.address, "--format", "cef")
    every = subprocess.run(alerts_cmd(*args), capture_output=True, text=True, timeout=60).stdout.splitlines()
    critical = subprocess.run(
        alerts_cmd(*args, "--min-severity", "critical"), capture_output=True, text=True, timeout=60
    ).stdout.splitlines()
    assert [line.split("|")[6] for line in every] == ["10"] * len(critical) + ["8", "8"]
    assert critical == every[: len(critical)] and all(line.startswith("CEF:0|kvguard|") for line in every)


def test_a_follower_resumes_after_a_daemon_restart_without_a_gap_or_a_repeat(
    daemon: Service, tmp_path: Path
) -> None:
    out = tmp_path / "alerts.jsonl"
    feed_incident(daemon)
    before = stored_cursors(daemon.store)
    follower = subprocess.Popen(
        alerts_cmd("--follow", "--daemon", daemon.address, "--to", f"file://{out}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def cursors() -> list[int]:
            lines = out.read_text().splitlines() if out.exists() else []
            return [json.loads(line)["cursor"] for line in lines]

        wait_for(lambda: cursors() == before, timeout=30)
        port = int(daemon.address.rsplit(":", 1)[1])
        daemon.stop()
        restarted = start_daemon(daemon.store, port)
        try:
            feed(restarted.address, stale_reads("n1", 3))
            feed(restarted.address, stale_reads("n2", 2))
            after = stored_cursors(restarted.store)
            assert len(after) == len(before) + 5
            wait_for(lambda: len(cursors()) >= len(after), timeout=30)
        finally:
            restarted.stop()
        follower.send_signal(signal.SIGTERM)
        _, err = follower.communicate(timeout=30)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    assert cursors() == after  # every alert once, in cursor order
    assert follower.returncode == 0
    assert f"resuming after cursor {before[-1]}" in err and "again" in err, err
    assert f"stopped after cursor {after[-1]} (--after {after[-1]} resumes there)" in err
    nodes = [json.loads(line)["node"] for line in out.read_text().splitlines()[len(before) :]]
    assert nodes == ["n1"] * 3 + ["n2"] * 2


def test_when_stdouts_reader_goes_away_it_ends_quietly(daemon: Service) -> None:
    feed(daemon.address, stale_reads("n1", 1))
    follower = subprocess.Popen(
        alerts_cmd("--follow", "--daemon", daemon.address),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert json.loads(follower.stdout.readline())["node"] == "n1"  # type: ignore[union-attr]
        follower.stdout.close()  # type: ignore[union-attr]  # the reader goes away (`| head -1`)
        feed(daemon.address, stale_reads("n2", 2))  # the next write finds no reader
        assert follower.wait(timeout=30) == 141  # as a shell says of SIGPIPE (cli/__init__.py)
        assert follower.stderr.read() == ""  # type: ignore[union-attr]
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
        follower.stderr.close()  # type: ignore[union-attr]


def test_a_dead_output_drops_the_oldest_says_so_and_exits_1(daemon: Service) -> None:
    feed_incident(daemon)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"syslog+tcp://127.0.0.1:{s.getsockname()[1]}"
    done = subprocess.run(
        alerts_cmd("--daemon", daemon.address, "--to", dead, "--queue", "2", "--drain", "0.5"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert f"{dead}: cannot send to 127.0.0.1:" in done.stderr and "retrying" in done.stderr
    summary = re.search(
        rf"{re.escape(dead)}: 0 sent, (\d+) dropped, 0 rejected, (\d+) undelivered", done.stderr
    )
    assert summary, done.stderr
    total = len(stored_cursors(daemon.store))
    assert int(summary[1]) + int(summary[2]) == total and int(summary[2]) <= 2  # the queue held 2


@pytest.mark.parametrize(
    ("signum", "times"), [(signal.SIGTERM, 1), (signal.SIGINT, 1), (signal.SIGTERM, 2), (signal.SIGINT, 2)]
)
def test_a_follower_stopped_with_alerts_undelivered_exits_1_and_says_why(
    daemon: Service, signum: int, times: int
) -> None:
    # However it is stopped (systemd's SIGTERM, Ctrl-C; a second one cutting the drain short),
    # an output that lost alerts makes the exit status 1, and says how many and why.
    feed_incident(daemon)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/"
    proc = subprocess.Popen(
        alerts_cmd(
            "--daemon", daemon.address, "--follow", "--to", dead, "--drain", "1" if times == 1 else "60"
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    err = ""
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # the output has failed a delivery: alerts are waiting
            err += line
            if "retrying" in line:
                break
        for _ in range(times):  # the second one while it drains
            proc.send_signal(signum)
            time.sleep(1)
        _, rest = proc.communicate(timeout=30)
    finally:
        proc.kill()
    err += rest
    assert proc.returncode == 1, err
    total = len(stored_cursors(daemon.store))
    summary = re.search(rf"{re.escape(dead)}: 0 sent, 0 dropped, 0 rejected, (\d+) undelivered", err)
    assert summary and 1 <= int(summary[1]) <= total, err  # what it had taken from the feed by then
    assert "last error: cannot POST to" in err and "Connection refused" in err
    assert "Traceback" not in err
    assert ("the drain was cut short" in err) == (times == 2)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--to", "ftp://x"], "--to ftp://x: unknown output"),
        (["--to", "syslog+udp://h:514?facility=nope"], "facility 'nope' is not one of"),
        (["--to", "http://h/", "--to-header", "no colon"], "--to-header 'no colon': not 'Name: value'"),
        (["--daemon", "127.0.0.1:1"], "127.0.0.1:1: AuditService.Query: the daemon cannot be reached"),
    ],
)
def test_options_it_cannot_use_exit_2_naming_them(args: list[str], said: str) -> None:
    done = subprocess.run(alerts_cmd(*args), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert said in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_cursor_file_resumes_a_forwarder_where_it_was_done(daemon: Service, tmp_path: Path) -> None:
    kept = tmp_path / "cursor"
    feed_incident(daemon)
    every = stored_cursors(daemon.store)
    first = subprocess.run(
        alerts_cmd("--daemon", daemon.address, "--cursor-file", str(kept)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert first.returncode == 0 and [json.loads(x)["cursor"] for x in first.stdout.splitlines()] == every
    assert kept.read_text() == f"{every[-1]}\n"
    # Started again: nothing twice; what came since, only.
    feed(daemon.address, stale_reads("n7", 2))
    again = subprocess.run(
        alerts_cmd("--daemon", daemon.address, "--cursor-file", str(kept)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert [json.loads(x)["req"] for x in again.stdout.splitlines()] == ["n7-r0", "n7-r1"]
    kept.write_text("not a number\n")
    bad = subprocess.run(
        alerts_cmd("--daemon", daemon.address, "--cursor-file", str(kept)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and f"--cursor-file {kept}: holds 'not a number', not a cursor" in bad.stderr


def test_filters_by_node_tenant_and_kind(daemon: Service) -> None:
    feed_incident(daemon, stale_reads("n8", 2), alerts=2)
    args = ("--daemon", daemon.address)

    def sent(*more: str) -> list[tuple[str, str, str]]:
        done = subprocess.run(alerts_cmd(*args, *more), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return [(r["node"], r["finding"], r["tenant"]) for r in map(json.loads, done.stdout.splitlines())]

    assert sent("--node", "n8") == [("n8", "stale_read", "")] * 2
    assert {kind for _, kind, _ in sent("--kind", "stale_read", "--kind", "transfer_mismatch")} == {
        "stale_read",
        "transfer_mismatch",
    }
    assert {tenant for _, _, tenant in sent("--tenant", "globex")} == {"globex"}
    wrong = subprocess.run(
        alerts_cmd(*args, "--kind", "stale_reed"), capture_output=True, text=True, timeout=60
    )
    assert wrong.returncode == 2 and "invalid choice: 'stale_reed'" in wrong.stderr


def test_a_forwarder_serves_its_delivery_metrics(daemon: Service, tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    out = tmp_path / "alerts.jsonl"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    feed_incident(daemon)
    total = len(stored_cursors(daemon.store))
    forwarder = subprocess.Popen(
        alerts_cmd(
            "--follow",
            "--daemon",
            daemon.address,
            "--to",
            f"file://{out}",
            "--metrics-listen",
            f"127.0.0.1:{port}",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def scraped() -> dict:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as got:
                    text = got.read().decode()
            except OSError:
                return {}
            return {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
            }

        label = (("output", f"file://{out}"),)
        wait_for(lambda: scraped().get(("kvguard_alerts_delivered_total", label)) == total, timeout=30)
        got = scraped()
        assert (
            got[("kvguard_alerts_dropped_total", label)] == got[("kvguard_alerts_rejected_total", label)] == 0
        )
        assert got[("kvguard_alerts_queued", label)] == 0
        assert got[("kvguard_alerts_cursor", ())] == stored_cursors(daemon.store)[-1]
    finally:
        forwarder.send_signal(signal.SIGTERM)
        _, err = forwarder.communicate(timeout=60)
    assert forwarder.returncode == 0, err
