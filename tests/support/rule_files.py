"""Rule files for the ruleset's tests: a valid rule one field a line (`VALID`, so that a test
can replace or append lines at known numbers), writing and loading them, and a leak finding."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kvguard.ledger.findings import Finding
from kvguard.ruleset import RuleError, RulesetError, load_ruleset

# A valid rule, one field a line, so that tests can replace or append lines at known numbers.
VALID = [
    "- rule: r1",  # 1
    "  description: test rule",  # 2
    "  finding: stale_read",  # 3
    "  severity: high",  # 4
    "  action: kill",  # 5
    '  output: "{req} read {pages}"',  # 6
]


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


def rule_text(replace: dict[int, str] | None = None, append: str = "") -> str:
    lines = list(VALID)
    for number, text in (replace or {}).items():
        lines[number - 1] = text
    return "\n".join(lines) + "\n" + (append + "\n" if append else "")


def load_errors(directory: Path) -> list[RuleError]:
    with pytest.raises(RulesetError) as info:
        load_ruleset(directory)
    return info.value.errors


def leak(**overrides: object) -> Finding:
    values: dict[str, object] = {
        "finding": "stale_read",
        "node": "d0",
        "req": "r2",
        "tenant": "acme",
        "victim_req": "r1",
        "victim_tenant": "globex",
        "pool": 0,
        "pages": (7, 8, 9, 10, 11, 12, 13, 20),
        "seq": 42,
        "message": "r2 read 8 pages written by r1",
    }
    values.update(overrides)
    return Finding(**values)  # type: ignore[arg-type]
