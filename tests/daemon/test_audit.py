"""`kvguard audit query | request | exposure` on a store that a real daemon wrote: the incident
capture (globex g1 reads acme a1/a2's KV on d0) and a second node where initech and umbrella
requests reach acme's KV, read from the store and from the daemon, as a user runs them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import json_format

from kvguard.cli.audit import main
from kvguard.cli.process import Service, start_daemon
from kvguard.cli.send import send_capture
from kvguard.daemon.audit.format import format_time, page_ranges, parse_time
from kvguard.daemon.store import Store
from kvguard.proto import pb
from kvguard.proto.capture import read_capture
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR


def ev(seq: int, ts_ns: int, payload: str, **fields: object) -> str:
    """A capture line of node n0."""
    return json.dumps({"node": "n0", "seq": seq, "ts_ns": ts_ns, payload: fields})


INCIDENT = (DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl").read_text().splitlines()
# Node n0 (colocated): initech i1's prefix share of acme a3's pages is denied; initech i2 reads
# a3's page 10 in a batched launch whose first entry is a3 (killed); umbrella u1 is handed acme
# a4's pages while a4's offload still holds them (alert+quarantine only: unchecked).
SECOND = [
    ev(
        1,
        9000,
        "pool",
        pool=0,
        role="colocated",
        engine="testbed",
        page_size=16,
        num_pages=32,
        context_len=512,
    ),
    ev(2, 9100, "admit", req="a3", tenant="acme", prompt_tokens=32, stage="prefill"),
    ev(3, 9200, "alloc", req="a3", pool=0, pages=[10, 11]),
    ev(4, 9300, "write", req="a3", pool=0, pages=[10, 11], slots=[16, 16]),
    ev(5, 9400, "admit", req="i1", tenant="initech", prompt_tokens=40, stage="prefill"),
    ev(6, 9500, "share", req="i1", pool=0, pages=[10, 11], origin_req="a3"),
    ev(7, 9600, "alloc", req="i1", pool=0, pages=[12]),
    ev(8, 9700, "write", req="i1", pool=0, pages=[12], slots=[8]),
    ev(9, 9800, "admit", req="i2", tenant="initech", prompt_tokens=16, stage="prefill"),
    ev(10, 9900, "alloc", req="i2", pool=0, pages=[13]),
    ev(11, 10000, "write", req="i2", pool=0, pages=[13]),
    ev(
        12,
        10100,
        "read",
        reads=[
            {"req": "a3", "pool": 0, "pages": [10, 11], "tokens": 32},
            {"req": "i1", "pool": 0, "pages": [10, 11, 12], "tokens": 40},
            {"req": "i2", "pool": 0, "pages": [13, 10], "tokens": 32},
        ],
    ),
    ev(13, 10200, "finish", req="a3", output_tokens=1),
    ev(14, 11000, "admit", req="a4", tenant="acme", prompt_tokens=32, stage="prefill"),
    ev(15, 11100, "alloc", req="a4", pool=0, pages=[20, 21]),
    ev(16, 11200, "write", req="a4", pool=0, pages=[20, 21]),
    ev(17, 11300, "hold", req="a4", pool=0, pages=[20, 21], holder="offload"),
    ev(18, 11400, "finish", req="a4", output_tokens=1),
    ev(19, 11500, "free", req="a4", pool=0, pages=[20, 21]),
    ev(20, 11600, "admit", req="u1", tenant="umbrella", prompt_tokens=32, stage="prefill"),
    ev(21, 11700, "alloc", req="u1", pool=0, pages=[20, 21]),
    ev(22, 11800, "write", req="u1", pool=0, pages=[20, 21]),
    ev(23, 11900, "release", req="a4", pool=0, pages=[20, 21], holder="offload"),
    ev(24, 12000, "read", reads=[{"req": "u1", "pool": 0, "pages": [20, 21], "tokens": 32}]),
    # n0's guard carries out the daemon's kill of i2 while i2 still runs: a kill that took effect.
    ev(25, 12100, "kill", req="i2", finding="stale_read", by="daemon"),
]
# AuditRecord carries a command body only once services.proto and the daemon serve it.
COMMAND_BODIES = "command" in svc.AuditRecord.DESCRIPTOR.fields_by_name


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    d = start_daemon(str(tmp_path_factory.mktemp("audit") / "audit.db"))
    try:
        for capture in (INCIDENT, SECOND):
            summary = send_capture(capture, d.address)
            assert summary.accepted == summary.events and not summary.rejected
        settled(d.store)
        yield d
    finally:
        d.stop()


def settled(store: str) -> None:
    """Wait until the store holds what the daemon will say of what it was sent: the updates of
    its findings (outcomes, ends of runs of repeats) follow the acks, once their findings are
    durable. Settled: no record added for a second."""

    def count() -> int:
        s = Store(store)
        try:
            return len(list(s.rows()))
        finally:
            s.close()

    last, deadline = -1, time.monotonic() + 30
    while (now := count()) != last and time.monotonic() < deadline:
        last = now
        time.sleep(1.0)


def audit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`kvguard audit ARGV...` in process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def store_of(d: Service) -> tuple[str, str]:
    return ("--store", str(d.store))


def stored(d: Service) -> list[tuple[int, str, bytes]]:
    s = Store(str(d.store))
    try:
        return list(s.rows())
    finally:
        s.close()


def reqs_of(event: pb.Event) -> list[str]:
    payload = event.WhichOneof("payload") or ""
    if payload == "read":
        return [entry.req for entry in event.read.reads]
    return [getattr(getattr(event, payload), "req", "")]


def jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


# ------------------------------------------------------------------------------------ exposure


def test_the_exposure_of_acme_names_every_request_that_reached_its_kv(
    daemon: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = audit(capsys, "exposure", "--tenant", "acme", *store_of(daemon))
    assert rc == 1
    lines = out.splitlines()
    # Grouped by offending tenant (in order of first finding), then request.
    headers = [line for line in lines if re.fullmatch(r"\w+ \(\d+ requests?\)", line)]
    assert headers == ["globex (1 request)", "initech (2 requests)", "umbrella (1 request)"]
    g1 = lines.index(next(line for line in lines if line.startswith("  g1: ")))
    # The daemon ordered g1 killed ten times, but g1 finished on d0 before any kill reached it:
    # its response, computed from acme's KV, reached its client. An order is not a kill.
    assert lines[g1].startswith("  g1: REACHED THE CLIENT: answered before any kill took effect (record ")
    assert "kvguard learned it at " in lines[g1] and "; 10 kill commands sent;" in lines[g1]
    assert "action kill; at 6000" in lines[g1]
    victims = [" ".join(line.split()) for line in lines[g1 + 1 : g1 + 3]]
    assert victims[0].startswith("victim a1 node d0 pool 0 pages 1-4 stale_read action kill at 6000 records ")
    assert victims[1].startswith("victim a2 node d0 pool 0 pages 5-8 stale_read action kill at 6000 records ")
    assert any(line.startswith("  i1: stopped (deny), not killed") for line in lines)
    assert any(
        line.startswith("  i2: killed (1 kill command sent; killed by daemon; the first at") for line in lines
    )
    assert any(line.startswith("  u1: UNCHECKED") for line in lines)
    assert lines[-1] == (
        "acme: 4 requests of 3 other tenants (globex, initech, umbrella) read or received acme's KV; "
        "1 was killed, 1 was answered before any kill took effect (the data reached the client), "
        "1 was denied or blocked, 1 went unchecked."
    )


def test_the_exposure_as_json_lines(daemon: Service, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = audit(capsys, "exposure", "--tenant", "acme", *store_of(daemon), "-o", "json")
    assert rc == 1
    *exposures, summary = jsonl(out)
    assert [(e["offender_tenant"], e["req"], e["outcome"]) for e in exposures] == [
        ("globex", "g1", "reached_client"),
        ("initech", "i1", "stopped"),
        ("initech", "i2", "killed"),
        ("umbrella", "u1", "unchecked"),
    ]
    g1 = exposures[0]
    assert g1["findings"] == {"stale_read": 2} and g1["actions"] == ["kill"] and g1["kill_commands"] == 10
    assert g1["fate"] == "reached_client" and g1["learned_ns"] > 0 and not g1["kill_events"]
    assert [(v["victim_req"], v["node"], v["pool"], v["pages"]) for v in g1["victims"]] == [
        ("a1", "d0", 0, [1, 2, 3, 4]),
        ("a2", "d0", 0, [5, 6, 7, 8]),
    ]
    bodies = {i: (kind, body) for i, kind, body in stored(daemon)}
    for victim in g1["victims"]:
        (record_id,) = victim["record_ids"]
        kind, body = bodies[record_id]
        finding = pb.Finding.FromString(body)
        assert kind == "finding" and (finding.req, finding.victim_req) == ("g1", victim["victim_req"])
    assert summary["type"] == "summary" and summary["tenants"] == ["globex", "initech", "umbrella"]
    counts = ("requests", "killed", "reached_client", "ordered", "stopped", "unchecked")
    assert tuple(summary[k] for k in counts) == (4, 1, 1, 0, 1, 1)


def test_globex_has_no_exposure(daemon: Service, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = audit(capsys, "exposure", "--tenant", "globex", *store_of(daemon))
    assert rc == 0
    assert out == "globex: no request of another tenant reached globex's KV (0 exposures).\n"
    rc, out, _ = audit(capsys, "exposure", "--tenant", "globex", *store_of(daemon), "-o", "json")
    assert rc == 0 and [(o["type"], o["requests"]) for o in jsonl(out)] == [("summary", 0)]


def test_a_tenant_the_log_never_named_is_unknown_not_clean(
    daemon: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    # A misspelt tenant must not read as "0 exposures": it is unusable input, with the names
    # nearest to it, from the store and from the daemon alike.
    for where in (store_of(daemon), ("--daemon", daemon.address)):
        rc, out, err = audit(capsys, "exposure", "--tenant", "acmee", *where)
        assert rc == 2 and out == ""
        assert "tenant 'acmee' is unknown" in err and "nearest known: acme" in err, where
    rc, _, err = audit(capsys, "exposure", "--tenant", "zzzzzz", *store_of(daemon))
    assert rc == 2 and "is unknown" in err and "e.g. " in err


def test_the_exposure_in_a_time_window(daemon: Service, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = audit(
        capsys, "exposure", "--tenant", "acme", "--since", "9000", "--until", "10500", *store_of(daemon)
    )
    assert rc == 1 and "globex" not in out and "umbrella" not in out
    assert out.splitlines()[-1].startswith(
        "acme: 2 requests of 1 other tenant (initech) read acme's KV between"
    )
    # ISO-8601 is taken as nanoseconds since the epoch: the same window, written as dates.
    iso = ("--since", "1970-01-01T00:00:00.000009Z", "--until", "1970-01-01T00:00:00.0000105+00:00")
    assert audit(capsys, "exposure", "--tenant", "acme", *iso, *store_of(daemon))[:2] == (rc, out)
    rc, out, _ = audit(capsys, "exposure", "--tenant", "acme", "--until", "5999", *store_of(daemon))
    assert rc == 0


# ------------------------------------------------------------------------------------ request


def test_the_timeline_of_g1_across_nodes(daemon: Service, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = audit(capsys, "request", "g1", *store_of(daemon), "-o", "json")
    assert rc == 1  # findings name it
    records = jsonl(out)
    ids = [r["id"] for r in records]
    assert ids == sorted(ids)
    events = [r["event"] for r in records if r["kind"] == "event"]
    expected = [(e.node, e.seq) for _, e in read_capture(INCIDENT) if "g1" in reqs_of(e)]
    assert [(e["node"], e["seq"]) for e in events] == expected
    assert [n for n, _ in expected[:2]] == ["d0", "d0"] and expected[2] == ("p0", 12)
    found = [r["finding"] for r in records if r["kind"] == "finding"]
    findings = [f for f in found if "update_of" not in f.get("details", {})]
    assert len(findings) == 10 and all(f["req"] == "g1" for f in findings)
    (update,) = [f for f in found if "outcome" in f.get("details", {})]  # what became of it
    assert update["details"]["outcome"] == "reached_client" and "reached the client" in update["message"]
    assert sorted(f.get("victim_req", "") for f in findings if f["finding"] == "stale_read") == ["a1", "a2"]
    assert sum(r["kind"] == "command" for r in records) == 10
    assert "request g1 (globex): 13 event(s) on d0, p0; 10 finding(s) as offender, 0 as victim" in err
    assert "what became of it: reached_client" in err
    rc, table, _ = audit(capsys, "request", "g1", *store_of(daemon))
    rows = table.splitlines()
    assert rows[0].split() == ["ID", "TIME", "KIND", "NODE", "SEQ", "REQ", "TENANT", "WHAT", "MESSAGE"]
    nodes = [row.split()[3] for row in rows[1:] if row.split()[2] == "event"]
    assert nodes == [n for n, _ in expected]
    leak = next(row for row in rows if "victim=acme/a1" in row)
    assert (
        "stale_read critical" in leak and "globex request g1 on d0 read KV written by acme request a1" in leak
    )


def test_a_read_launch_belongs_to_every_request_it_lists(
    daemon: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    launches = {}
    for req in ("a3", "i1", "i2"):
        _, out, _ = audit(capsys, "request", req, *store_of(daemon), "-o", "json")
        reads = [r for r in jsonl(out) if "read" in r.get("event", {})]
        assert len(reads) == 1, req
        launches[req] = reads[0]
    assert launches["a3"] == launches["i1"] == launches["i2"]
    assert [e["req"] for e in launches["i2"]["event"]["read"]["reads"]] == ["a3", "i1", "i2"]


def test_a_victim_sees_the_findings_that_name_it(daemon: Service, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = audit(capsys, "request", "a1", *store_of(daemon), "-o", "json")
    assert rc == 1
    findings = [r["finding"] for r in jsonl(out) if r["kind"] == "finding"]
    assert [(f["req"], f["victim_req"], f["pages"]) for f in findings] == [("g1", "a1", [1, 2, 3, 4])]
    assert "0 finding(s) as offender, 1 as victim" in err
    rc, out, err = audit(capsys, "request", "nobody", *store_of(daemon))
    assert rc == 0 and "no record of it" in err


# ------------------------------------------------------------------------------------ query


def test_json_lines_round_trip_ids_and_bodies(daemon: Service, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = audit(capsys, "query", *store_of(daemon), "-o", "json")
    assert rc == 0
    records = jsonl(out)
    rows = stored(daemon)
    assert [(r["id"], r["kind"]) for r in records] == [(i, kind) for i, kind, _ in rows]
    types = {"event": pb.Event, "finding": pb.Finding, "command": svc.Command}
    for record, (_, kind, body) in zip(records, rows, strict=True):
        assert json_format.ParseDict(record[kind], types[kind]()) == types[kind].FromString(body)


def test_query_filters(daemon: Service, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = audit(
        capsys, "query", *store_of(daemon), "--kind", "finding", "--finding", "stale_read", "-o", "json"
    )
    assert rc == 0
    # a1's and a2's (a repeat: stored, not alerted), then the end of their run, which names both
    found = [r["finding"] for r in jsonl(out)]
    assert [(f["req"], f["victim_req"], f["details"].get("repeat")) for f in found] == [
        ("g1", "a1", None),
        ("g1", "a2", "1"),
        ("g1", "", None),
    ]
    assert (found[2]["details"]["repeats"], found[2]["details"]["victim_reqs"]) == ("1", "a1,a2")
    _, out, _ = audit(
        capsys, "query", *store_of(daemon), "--tenant", "acme", "--kind", "finding", "-o", "json"
    )
    found = [r["finding"] for r in jsonl(out)]
    assert [f["req"] for f in found if "outcome" not in f.get("details", {})] == [
        "g1",
        "g1",
        "g1",  # the end of the run of g1's stale reads (a1's, a2's)
        "i1",
        "i2",
        "u1",
    ]
    assert [(f["req"], f["details"]["outcome"]) for f in found if "outcome" in f.get("details", {})] == [
        ("i2", "killed")  # g1's update names no victim: it updates g1's first finding, a drift
    ]
    window = ("--node", "n0", "--since", "10000", "--until", "10100")
    _, out, _ = audit(capsys, "query", *store_of(daemon), *window, "-o", "json")
    assert [(r["kind"], r.get("event", r.get("finding", {})).get("seq")) for r in jsonl(out)] == [
        ("event", 11),
        ("event", 12),
        ("finding", 12),
        ("command", None),  # the kill of i2, stored under n0 and the finding's time
    ]
    _, out, _ = audit(capsys, "query", *store_of(daemon), *window, "--kind", "event")
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["ID", "TIME", "KIND", "NODE", "SEQ", "REQ", "TENANT", "WHAT", "MESSAGE"]
    assert [tuple(r[1:5]) for r in rows[1:]] == [
        ("10000", "event", "n0", "11"),
        ("10100", "event", "n0", "12"),
    ]
    assert rows[2][5] == "a3,i1,i2" and " ".join(rows[2][6:]).startswith("read a3 pages=10-11 tokens=32; i1")
    _, out, _ = audit(capsys, "query", *store_of(daemon), "--kind", "command", "--limit", "3")
    assert [line.split()[1:3] for line in out.splitlines()[1:]] == [
        ["command", "1"],
        ["command", "2"],
        ["command", "3"],
    ]


# ------------------------------------------------------------------------------------ the daemon


def _comparable(out: str, json_lines: bool) -> str:
    """Without command bodies from the daemon, a command is compared by its id and kind only."""
    if COMMAND_BODIES or not json_lines:
        return out
    return "".join(
        json.dumps({"id": r["id"], "kind": r["kind"]} if r.get("kind") == "command" else r) + "\n"
        for r in jsonl(out)
    )


@pytest.mark.parametrize(
    "argv",
    [
        ("query", "--kind", "finding"),
        ("query", "--kind", "event", "--req", "g1"),
        ("query", "-o", "json"),
        ("query", "--tenant", "acme", "--since", "5000", "--limit", "20", "-o", "json"),
        ("request", "g1", "-o", "json"),
        ("request", "i2", "-o", "json"),
        ("request", "a1"),
        ("exposure", "--tenant", "acme"),
        ("exposure", "--tenant", "acme", "-o", "json"),
        ("exposure", "--tenant", "globex"),
    ],
    ids=lambda argv: " ".join(argv),
)
def test_the_daemon_gives_the_same_output_as_the_store(
    daemon: Service, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    from_store = audit(capsys, *argv, *store_of(daemon))
    from_daemon = audit(capsys, *argv, "--daemon", daemon.address)
    json_lines = "json" in argv
    assert from_daemon[0] == from_store[0]
    assert _comparable(from_daemon[1], json_lines) == _comparable(from_store[1], json_lines)
    assert from_store[1]


@pytest.mark.skipif(
    not COMMAND_BODIES, reason="needs AuditRecord.command in services.proto, served by the daemon"
)
def test_the_daemon_serves_command_bodies(daemon: Service, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (("request", "g1"), ("query", "--kind", "command", "-o", "json")):
        # exit code and stdout; stderr's summary names the source, which differs
        assert (
            audit(capsys, *argv, "--daemon", daemon.address)[:2]
            == audit(capsys, *argv, *store_of(daemon))[:2]
        )


# ------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (("query", "--since", "yesterday"), "--since 'yesterday' is not a time"),
        (("exposure", "--tenant", "acme", "--until", "12x"), "--until '12x' is not a time"),
        (("query", "--since", "2026-13-01"), "--since '2026-13-01' is not a time"),
        (("query", "--since", "200", "--until", "100"), "--until '100' is before --since '200'"),
        (("query", "--limit", "-1"), "--limit -1 is not a count"),
        (("query", "--since", "-9223372036854775809"), "--since '-9223372036854775809' is out of range"),
        (("request", ""), "the request ID is empty"),
    ],
)
def test_bad_arguments_exit_2_naming_the_input(
    daemon: Service, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], named: str
) -> None:
    rc, out, err = audit(capsys, *argv, *store_of(daemon))
    assert (rc, out) == (2, "") and named in err


def test_bad_sources_exit_2_naming_the_source(
    daemon: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere.db"
    rc, _, err = audit(capsys, "query", "--store", str(missing))
    assert rc == 2 and f"no audit store at {missing}" in err
    assert not missing.exists()  # nothing created
    rc, _, err = audit(capsys, "exposure", "--tenant", "acme", "--store", f"sqlite:///{missing}")
    assert rc == 2 and str(missing) in err and not missing.exists()
    rc, _, err = audit(capsys, "request", "g1", *store_of(daemon), "--daemon", daemon.address)
    assert rc == 2 and "not both" in err and str(daemon.store) in err and daemon.address in err
    not_a_db = tmp_path / "capture.jsonl"
    not_a_db.write_text(INCIDENT[3])
    rc, _, err = audit(capsys, "query", "--store", str(not_a_db))
    assert rc == 2 and f"cannot open audit store {not_a_db}" in err
    assert not_a_db.read_text() == INCIDENT[3]
    rc, _, err = audit(capsys, "query", "--daemon", "nowhere:http")  # a bare host takes port 7463
    assert rc == 2 and "--daemon: 'nowhere:http' is not an address: port 'http' is not 0 to 65535" in err
    rc, _, err = audit(capsys, "query", "--daemon", "127.0.0.1:1")
    assert rc == 2 and "the daemon at 127.0.0.1:1: UNAVAILABLE" in err
    rc, _, err = audit(capsys, "query", "--kind", "kill", *store_of(daemon))
    assert rc == 2 and "argument --kind: invalid choice: 'kill'" in err


# ------------------------------------------------------------------------------------ helpers


def test_times_and_pages() -> None:
    assert parse_time("6000") == 6000
    assert (
        parse_time("-5") == -5 and parse_time("1969-12-31T23:59:59.5Z") == -500_000_000
    )  # a clock before 1970
    assert parse_time("1970-01-01T00:00:01.000000001Z") == 1_000_000_001
    assert (
        parse_time("2026-03-01T12:00:00+01:00") == parse_time("2026-03-01T11:00:00") == 1_772_362_800 * 10**9
    )
    assert format_time(6000) == "6000" and format_time(0) == ""
    assert format_time(1_772_362_800 * 10**9 + 5) == "2026-03-01T11:00:00.000000005Z"
    assert page_ranges([1, 2, 3, 4, 7, 3]) == "1-4,7,3" and page_ranges([]) == ""


# ------------------------------------------------------------------------------------ the CLI


def test_kvguard_audit_exposure_as_a_user_runs_it(daemon: Service) -> None:
    """Needs cli.py to call kvguard.daemon.audit.add_parsers on the `kvguard audit` group."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvguard",
            "audit",
            "exposure",
            "--tenant",
            "acme",
            "--store",
            str(daemon.store),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    assert "victim a1  node d0  pool 0  pages 1-4" in run.stdout
    assert run.stdout.splitlines()[-1].startswith(
        "acme: 4 requests of 3 other tenants (globex, initech, umbrella)"
    )


# ------------------------------------------------------------------------------------ before 1970


def settled_count(store: str, quiet_s: float = 0.5, within_s: float = 10.0) -> int:
    """The store's record count once it has stopped growing: the daemon writes the records its
    judgement makes (a run's end, an outcome) shortly after the events that caused them."""

    def counted() -> int:
        s = Store(store)
        try:
            return s.count()
        finally:
            s.close()

    deadline = time.monotonic() + within_s
    count = counted()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = counted()
        if now == count:
            return count
        count = now
    return count


def test_records_before_1970_are_reached_by_every_query(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A node whose clock reads before the epoch stores negative ts_ns: its records are in the
    # chain and must be read back by every query, not taken for "before --since 0".
    shifted = []
    for line in INCIDENT:
        if line.startswith("{"):
            event = json.loads(line)
            event["ts_ns"] -= 1_000_000_000_000
            line = json.dumps(event)
        shifted.append(line)
    d = start_daemon(str(tmp_path / "audit.db"))
    try:
        summary = send_capture(shifted, d.address)
        assert summary.accepted == summary.events == 39 and not summary.rejected
        total = settled_count(str(d.store))
        for source in (store_of(d), ("--daemon", d.address)):
            rc, out, err = audit(capsys, "query", *source, "-o", "json")
            assert rc == 0 and len(jsonl(out)) == total and f"{total} records from" in err
            rc, out, err = audit(
                capsys, "query", "--kind", "finding", "--tenant", "acme", *source, "-o", "json"
            )
            # the stale reads of a1 and a2, and the end of their run (it names both in details)
            assert {r["finding"]["victim_req"] for r in jsonl(out)} == {"a1", "a2", ""}
            rc, out, err = audit(capsys, "request", "g1", *source)
            assert rc == 1 and "request g1 (globex): 13 event(s) on d0, p0; 10 finding(s) as offender" in err
            rc, out, _ = audit(capsys, "exposure", "--tenant", "acme", *source)
            assert rc == 1 and out.splitlines()[-1].startswith("acme: 1 request of 1 other tenant (globex)")
            window = ("--since", "-1000000000000", "--until", "-999999990000")
            rc, out, _ = audit(capsys, "exposure", "--tenant", "acme", *window, *source)
            assert rc == 1 and "globex" in out
    finally:
        d.stop()


def test_query_by_severity_and_by_a_time_ago(daemon: Service, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = audit(
        capsys, "query", *store_of(daemon), "--kind", "finding", "--severity", "critical", "-o", "json"
    )
    found = [r["finding"] for r in jsonl(out)]
    assert rc == 0 and found and {f["severity"] for f in found} <= {"critical"}
    _, every, _ = audit(capsys, "query", *store_of(daemon), "--kind", "finding", "-o", "json")
    assert len(found) == sum(r["finding"]["severity"] == "critical" for r in jsonl(every))
    assert any(r["finding"]["severity"] != "critical" for r in jsonl(every))
    # The capture's clock starts at the epoch: nothing in the last day, all in the last 60,000 days.
    _, recent, _ = audit(capsys, "query", *store_of(daemon), "--since", "24h", "-o", "json")
    assert jsonl(recent) == []
    _, all_of_it, _ = audit(capsys, "query", *store_of(daemon), "--since", "60000d", "-o", "json")
    assert len(jsonl(all_of_it)) == len(jsonl(audit(capsys, "query", *store_of(daemon), "-o", "json")[1]))
    rc, _, err = audit(capsys, "query", *store_of(daemon), "--since", "yesterday")
    assert rc == 2 and "--since 'yesterday' is not a time" in err and "24h" in err
