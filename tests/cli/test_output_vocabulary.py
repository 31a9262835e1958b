"""One output option across the CLI: every command that prints records takes `-o/--output`
with the same choices (OUTPUTS) and default, no command has an output option of another name,
and `-o json` is JSON wherever it is offered without a daemon or store to ask."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from kvguard.cli import build_parser
from kvguard.cli.options import OUTPUTS

# The commands whose output is records (a table for people, JSON for scripts).
PRINTS_RECORDS = {
    "replay",
    "fleet",
    "audit verify",
    "audit query",
    "audit request",
    "audit exposure",
    "config show",
    "rules check",
    "certs show",
}
OTHER_OUTPUT_NAMES = ("--json", "--format", "--output-format")
ENCODING_NOT_OUTPUT = {"alerts"}  # its --format is the SIEM encoding of each alert (json, ocsf, cef)


def leaves(parser: argparse.ArgumentParser, path: str = "") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, child in action.choices.items():
            yield from leaves(child, f"{path} {name}".strip())


def test_every_output_option_is_the_one_convention() -> None:
    offered = set()
    for path, parser in leaves(build_parser()):
        for action in parser._actions:
            if "-o" in action.option_strings or "--output" in action.option_strings:
                assert action.option_strings == ["-o", "--output"], path
                assert tuple(action.choices or ()) == OUTPUTS and action.default == "table", path
                assert action.metavar == "{" + ",".join(OUTPUTS) + "}", path
                offered.add(path)
            if path not in ENCODING_NOT_OUTPUT:
                assert not set(action.option_strings) & set(OTHER_OUTPUT_NAMES), (path, action.option_strings)
    assert offered >= PRINTS_RECORDS, PRINTS_RECORDS - offered


def run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kvguard", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_json_is_json_where_nothing_else_is_needed(tmp_path: Path) -> None:
    rules = json.loads(run("rules", "check", "-o", "json"))
    assert {"id", "kinds", "severity", "action", "enabled"} <= set(rules[0]) and len(rules) > 5
    run("certs", "init", str(tmp_path / "pki"), "--node", "p0")
    cert = json.loads(run("certs", "show", str(tmp_path / "pki" / "node-p0.pem"), "-o", "json"))
    assert cert["subject"] == "CN=p0" and cert["role"] == "node or daemon"
    run("certs", "revoke", str(tmp_path / "pki"), str(tmp_path / "pki" / "node-p0.pem"))
    crl = json.loads(run("certs", "show", str(tmp_path / "pki" / "crl.pem"), "-o", "json"))
    assert crl["revokes"] == "1 certificate(s)" and crl["revoked"][0].startswith(cert["serial"] + " since ")
