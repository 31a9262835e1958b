"""`kvguard replay` and `kvguard rules` as a user runs them: a real process, real files; and
every command's --help: its defaults and one example that is a real command line."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvguard.cli import audit, build_parser
from kvguard.ruleset import DEFAULT_RULES_DIR
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR

INCIDENT = DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl"
NEAR_MISS = DEFAULT_FIXTURES_DIR / "stale_read-near-miss-reuse" / "capture.jsonl"


def kvguard(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvguard", *args], input=stdin, capture_output=True, text=True, timeout=120
    )


def test_replay_of_the_incident_names_the_leak() -> None:
    run = kvguard("replay", str(INCIDENT))
    assert run.returncode == 1
    lines = run.stdout.splitlines()
    assert len(lines) == 11
    leaks = [line for line in lines if "stale_read_cross_tenant" in line]
    assert len(leaks) == 2 and all(line.startswith("CRITICAL kill") for line in leaks)
    assert "globex request g1 on d0 read KV written by acme request a1 (pool 0, pages 1-4)" in leaks[0]
    assert "11 finding(s) (11 critical)" in run.stderr and "replayed 39 of 39 events" in run.stderr


def test_replay_json_lines() -> None:
    run = kvguard("replay", str(INCIDENT), "-o", "json")
    findings = [json.loads(line) for line in run.stdout.splitlines()]
    leak = [f for f in findings if f["finding"] == "stale_read" and f["victim_req"] == "a2"]
    assert leak == [
        {
            "finding": "stale_read",
            "severity": "critical",
            "action": "kill",
            "rule": "stale_read_cross_tenant",
            "node": "d0",
            "req": "g1",
            "tenant": "globex",
            "victim_req": "a2",
            "victim_tenant": "acme",
            "pool": 0,
            "pages": [5, 6, 7, 8],
            "seq": 20,
            "ts_ns": 6000,
            "message": "globex request g1 on d0 read KV written by acme request a2 (pool 0, pages 5-8)",
            "tags": leak[0]["tags"],
        }
    ]
    assert "leak" in leak[0]["tags"]


def test_the_end_of_a_capture_settles_what_waits(tmp_path: Path) -> None:
    # The probe saw 1024 of the 4096 bytes p0 claims, d0 reported the receipt, and the capture
    # ends with no further use of the pages and nothing past the clock skew; q0 sent to d1,
    # which reports events but never reported receiving it.
    lines = [
        {"node": "p0", "pool": {"role": "prefill", "page_size": 16, "num_pages": 32, "context_len": 512}},
        {"node": "d0", "pool": {"role": "decode", "page_size": 16, "num_pages": 32, "context_len": 512}},
        {"node": "d0", "alloc": {"req": "g1", "pages": [4, 5]}},
        {"node": "p0", "admit": {"req": "g1", "tenant": "globex", "prompt_tokens": 32, "stage": "prefill"}},
        {"node": "p0", "alloc": {"req": "g1", "pages": [0, 1]}},
        {"node": "p0", "write": {"req": "g1", "pages": [0, 1]}},
        {
            "node": "p0",
            "xfer_send": {
                "req": "g1",
                "xfer": "x1",
                "peer_node": "d0",
                "pages": [0, 1],
                "tokens": 32,
                "bytes": 4096,
                "status": "done",
            },
        },
        {
            "node": "p0/ebpf",
            "wire": {"xfer": "x1", "peer_node": "d0", "bytes": 1024, "calls": 2, "probe": "ebpf"},
        },
        {
            "node": "d0",
            "xfer_recv": {
                "req": "g1",
                "xfer": "x1",
                "peer_node": "p0",
                "pages": [4, 5],
                "tokens": 32,
                "bytes": 4096,
                "status": "done",
            },
        },
        {"node": "q0", "pool": {"role": "prefill", "page_size": 16, "num_pages": 32, "context_len": 512}},
        {"node": "d1", "pool": {"role": "decode", "page_size": 16, "num_pages": 32, "context_len": 512}},
        {"node": "q0", "alloc": {"req": "a1", "pages": [3]}},
        {"node": "q0", "write": {"req": "a1", "pages": [3]}},
        {
            "node": "q0",
            "xfer_send": {
                "req": "a1",
                "xfer": "x2",
                "peer_node": "d1",
                "pages": [3],
                "tokens": 16,
                "bytes": 2048,
                "status": "done",
            },
        },
    ]
    seqs: dict[str, int] = {}
    for ts, line in enumerate(lines, 1):
        line |= {"seq": seqs.setdefault(line["node"], 0) + 1, "ts_ns": ts * 1000}
        seqs[line["node"]] = line["seq"]
    path = tmp_path / "capture.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = kvguard("replay", str(path), "-o", "json")
    assert run.returncode == 1, run.stderr
    short, unconfirmed = (json.loads(line) for line in run.stdout.splitlines())
    assert {k: short[k] for k in ("finding", "rule", "severity", "node", "req", "tenant", "ts_ns")} == {
        "finding": "transfer_mismatch",
        "rule": "transfer_mismatch",
        "severity": "critical",
        "node": "p0",
        "req": "g1",
        "tenant": "globex",
        "ts_ns": 7000,  # p0's last event
    }
    assert "seq" not in short  # no event raised it: the capture's end did
    assert short["details"] | {"xfer": "x1", "what": "wire_bytes", "expected": "4096"} == short["details"]
    assert short["details"]["observed"] == "1024" and short["details"]["settled"] == "end of capture"
    assert (
        "the wire probe (ebpf) saw 1024 in 2 call(s); settled as short now: end of capture"
        in short["message"]
    )
    assert {k: unconfirmed[k] for k in ("finding", "rule", "severity", "action", "node", "req")} == {
        "finding": "transfer_mismatch",
        "rule": "transfer_unconfirmed",
        "severity": "low",
        "action": "alert",
        "node": "d1",
        "req": "a1",
    }
    assert (
        "sender q0 reported 16 tokens (2048 bytes) sent to d1, which never reported" in unconfirmed["message"]
    )
    assert "2 finding(s) (1 critical, 1 low)" in run.stderr


def test_clean_capture_from_standard_input() -> None:
    run = kvguard("replay", "-", stdin=NEAR_MISS.read_text())
    assert (run.returncode, run.stdout) == (0, "")
    assert "from standard input" in run.stderr and "no findings" in run.stderr


def test_bad_lines_are_reported_and_skipped_and_nothing_valid_is_lost(tmp_path: Path) -> None:
    good = [line for line in INCIDENT.read_text().splitlines() if line.startswith("{")]
    assert '"seq": 2' in good[4] and '"node": "p0"' in good[4]
    bad = [
        "{broken",  # line 6
        good[4],  # line 7: redelivered
        '{"node": "p0", "seq": 3, "alloc": {"req": "zz", "pool": 0, "pages": [77]}}',  # line 8
        '{"node": "x9", "seq": 1, "frobnicate": {}}',  # line 9
    ]
    path = tmp_path / "capture.jsonl"
    path.write_text("\n".join([*good[:5], *bad, *good[5:]]) + "\n")
    run = kvguard("replay", str(path), "-o", "json")
    assert run.returncode == 1
    errors = [line for line in run.stderr.splitlines() if line.startswith(str(path))]
    assert len(errors) == 4
    assert errors[0].startswith(f"{path}:6: not JSON: ")
    assert errors[1] == f"{path}:7: sequence number 2 of node p0 repeats (last applied: 2)"
    assert errors[2] == f"{path}:8: alloc: page 77 out of range for pool 0 of node p0 (6 pages)"
    assert errors[3] == f"{path}:9: unknown payload or field 'frobnicate'"
    # Every valid event still counts: the same 11 findings as the clean capture.
    findings = [json.loads(line) for line in run.stdout.splitlines()]
    clean = [json.loads(line) for line in kvguard("replay", str(INCIDENT), "-o", "json").stdout.splitlines()]
    assert findings == clean and len(findings) == 11
    assert "replayed 39 of 43 events" in run.stderr
    assert "3 bad line(s) skipped, 1 repeat(s) skipped, 0 sequence number(s) missing" in run.stderr


def test_every_line_is_accounted_for(tmp_path: Path) -> None:
    lines = [
        '{"node": "n0", "seq": 1, "pool": {"pool": 0, "role": "colocated", "page_size": 16, "num_pages": 8}}',
        "not json",
        '{"node": "n0", "seq": 4, "alloc": {"req": "a", "pool": 0, "pages": [1]}}',
        '{"node": "n0", "seq": 4, "alloc": {"req": "b", "pool": 0, "pages": [2]}}',
        '{"node": "n0", "seq": 5, "read": {"reads": [{"req": "a", "pool": 0, "pages": [1], "tokens": 3}]}}',
    ]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(lines))
    run = kvguard("replay", str(path))
    assert run.returncode == 1
    assert (
        f"{path}:3: sequence gap on node n0: 2 event(s) before seq 4 are missing or were rejected "
        "(the event was applied)"
    ) in run.stderr
    assert "replayed 3 of 5 events" in run.stderr
    assert "1 bad line(s) skipped, 1 repeat(s) skipped, 2 sequence number(s) missing" in run.stderr
    assert "stale_read" in run.stdout


def test_unusable_input(tmp_path: Path) -> None:
    missing = kvguard("replay", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and "cannot read capture" in missing.stderr
    garbage = tmp_path / "g.jsonl"
    garbage.write_text("hello\nworld\n")
    run = kvguard("replay", str(garbage))
    assert run.returncode == 2 and f"{garbage}:2: not JSON" in run.stderr


def test_bad_rules_directory_is_refused_with_file_and_line(tmp_path: Path) -> None:
    rule = "- rule: x\n  description: d\n  finding: stale_read\n  severity: urgent\n  action: kill\n"
    rule += "  output: o\n"
    (tmp_path / "10-bad.yaml").write_text(rule)
    run = kvguard("replay", str(INCIDENT), "--rules", str(tmp_path))
    assert run.returncode == 2
    assert f"{tmp_path / '10-bad.yaml'}:4:" in run.stderr and "urgent" in run.stderr
    assert kvguard("rules", "check", "--rules", str(tmp_path)).returncode == 2


def test_rules_nested_too_deep_are_refused_in_one_line_by_every_command(tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    deep = rules / "10-deep.yaml"
    deep.write_text("[" * 500 + "]" * 500 + "\n")
    store = str(tmp_path / "audit.db")
    for command in (
        ["rules", "check", "--rules", str(rules)],
        ["rules", "test", "--rules", str(rules)],
        ["replay", str(INCIDENT), "--rules", str(rules)],
        ["daemon", "--listen", "127.0.0.1:0", "--store", store, "--rules", str(rules)],
    ):
        run = kvguard(*command)
        assert run.returncode == 2, (command, run.stderr)
        assert f"{deep}:1: nested deeper than " in run.stderr, (command, run.stderr)
        assert "Traceback" not in run.stderr and "RecursionError" not in run.stderr


def test_custom_rules_with_an_exception(tmp_path: Path) -> None:
    for path in DEFAULT_RULES_DIR.glob("*.yaml"):
        text = path.read_text()
        if "rule: stale_read_cross_tenant" in text:
            text = text.replace(
                "- rule: stale_read_cross_tenant\n",
                "- rule: stale_read_cross_tenant\n  exceptions:\n"
                "    - name: acme-lab\n      condition: 'victim_tenant == \"acme\"'\n",
            )
        (tmp_path / path.name).write_text(text)
    run = kvguard("replay", str(INCIDENT), "--rules", str(tmp_path))
    assert run.returncode == 1
    assert "stale_read" not in run.stdout
    assert "2 suppressed by rule exceptions" in run.stderr


def test_rules_test_and_check() -> None:
    run = kvguard("rules", "test")
    assert run.returncode == 0, run.stdout
    assert run.stdout.splitlines()[-1].endswith(" passed, 0 failed")
    assert "ok    incident: " in run.stdout
    check = kvguard("rules", "check")
    assert check.returncode == 0 and "stale_read_cross_tenant" in check.stdout


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """`parser` and every subcommand and nested subcommand under it, each with its words."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _commands(child, (*path, name))


COMMANDS = dict(_commands(build_parser()))


def test_every_command_is_reached() -> None:
    assert {" ".join(path) for path in COMMANDS} >= {
        *("", "replay", "daemon", "agent", "witness", "fleet", "demo"),
        *("audit", "audit query", "audit request", "audit exposure"),
        *("audit verify", "audit seal", "audit new-key"),
        *("rules", "rules check", "rules test", "testbed", "testbed up"),
    }


@pytest.mark.parametrize("path", COMMANDS, ids=lambda path: " ".join(("kvguard", *path)))
def test_help_shows_the_defaults_and_an_example_that_parses(path: tuple[str, ...]) -> None:
    parser = COMMANDS[path]
    text = parser.format_help()
    defaulted = [
        a.dest
        for a in parser._actions
        if a.option_strings and a.default not in (None, "", argparse.SUPPRESS) and a.default is not False
    ]
    if defaulted:
        assert "default" in text, f"{defaulted} have defaults that the help does not show"
    assert parser.description, "no description"
    example = text.rpartition("\nexample:\n")[2].strip()
    assert example.startswith(" ".join(("kvguard", *path))), text
    build_parser().parse_args(shlex.split(example)[1:])  # a real command line of this command


def test_defaults_are_shown_once_and_only_when_there_is_one() -> None:
    text = COMMANDS[("testbed", "up")].format_help()
    assert "(default: 8000)" in text and "(default: enforce)" in text
    assert "default: None" not in text and "default: False" not in text and "(default: )" not in text
    daemon = COMMANDS[("daemon",)].format_help()
    assert daemon.count("default 256M") == 1 and "(default: 256M)" not in daemon


def test_the_audit_group_alone_has_the_same_commands() -> None:
    alone = dict(_commands(audit.build_parser()))
    grouped = {path[1:] for path in COMMANDS if path[:1] == ("audit",)}
    assert set(alone) == grouped


def test_help_does_not_load_torch() -> None:
    """`kvguard --help` builds every parser: the testbed's torch waits until a command runs.
    (The daemon's parser still loads the daemon's module for its --snapshot-every default.)"""
    probe = "import sys; from kvguard.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "False", run.stderr
