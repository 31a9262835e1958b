"""`kvguard rules test`: rule fixtures, each a capture and the findings it must produce.

A fixture is a folder holding `capture.jsonl` (events, the capture form of docs/integrator.md) and
`expected.jsonl` (one JSON object per expected finding, giving the fields that must match:
finding, rule, severity, action, node, req, tenant, victim_req, victim_tenant, pool, pages,
seq). An empty `expected.jsonl` is a near miss: the capture must produce no finding at all.
Invariant: a fixture passes only if every expected finding matches a distinct actual one,
no actual finding is left over, and the capture has no bad line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import orjson

from kvguard.ledger.findings import Finding
from kvguard.proto.capture import CaptureError
from kvguard.ruleset.evaluator import Ruleset
from kvguard.ruleset.loader import load_ruleset
from kvguard.ruleset.replay import replay

DEFAULT_FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"
MATCH_FIELDS = (
    "finding",
    "rule",
    "severity",
    "action",
    "node",
    "req",
    "tenant",
    "victim_req",
    "victim_tenant",
    "pool",
    "pages",
    "seq",
)


@dataclass(slots=True)
class FixtureResult:
    name: str
    findings: list[Finding] = field(default_factory=list)
    missing: list[dict[str, Any]] = field(default_factory=list)
    unexpected: list[Finding] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not (self.missing or self.unexpected or self.errors)


def _matches(expected: dict[str, Any], finding: Finding) -> bool:
    for key, want in expected.items():
        have = getattr(finding, key)
        if (list(have) if key == "pages" else have) != want:
            return False
    return True


def _load_expected(path: Path) -> list[dict[str, Any]]:
    expected = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
        if not isinstance(obj, dict) or not obj:
            raise ValueError(f"{path}:{number}: expected a non-empty JSON object")
        unknown = sorted(set(obj) - set(MATCH_FIELDS))
        if unknown:
            raise ValueError(f"{path}:{number}: unknown field(s) {', '.join(unknown)}")
        expected.append(obj)
    return expected


def run_fixture(folder: Path, ruleset: Ruleset) -> FixtureResult:
    """Replay one fixture and compare its findings with the expected ones."""
    result = FixtureResult(folder.name)
    try:
        expected = _load_expected(folder / "expected.jsonl")
        lines = (folder / "capture.jsonl").read_text().splitlines()
    except (OSError, ValueError) as exc:
        result.errors.append(str(exc))
        return result

    def error(err: CaptureError) -> None:
        result.errors.append(f"capture.jsonl:{err.line}: {err.reason}")

    replay(lines, ruleset, result.findings.append, error)
    left = list(result.findings)
    for want in expected:
        for i, finding in enumerate(left):
            if _matches(want, finding):
                del left[i]
                break
        else:
            result.missing.append(want)
    result.unexpected = left
    return result


def fixture_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if (p / "capture.jsonl").is_file())


def run_fixtures(rules: Path | None, root: Path, out: TextIO, *, verbose: bool = False) -> int:
    """Run every fixture under `root`; print one line each and a summary. Exit status:
    0 when all pass, 1 otherwise."""
    ruleset = load_ruleset(rules)
    folders = fixture_folders(root)
    if not folders:
        out.write(f"no fixtures (folders with capture.jsonl) under {root}\n")
        return 1
    passed = failed = 0
    hit: set[str] = set()
    for folder in folders:
        result = run_fixture(folder, ruleset)
        hit.update(f.rule for f in result.findings)
        kinds = ", ".join(sorted({f.rule for f in result.findings})) or "no finding"
        if result.passed:
            passed += 1
            out.write(f"ok    {result.name}: {kinds}\n")
        else:
            failed += 1
            out.write(f"FAIL  {result.name}\n")
            for err in result.errors:
                out.write(f"      error: {err}\n")
            for want in result.missing:
                out.write(f"      missing: {orjson.dumps(want).decode()}\n")
            for finding in result.unexpected:
                out.write(f"      unexpected: {orjson.dumps(finding.to_json_dict()).decode()}\n")
        if verbose:
            for finding in result.findings:
                out.write(f"      {orjson.dumps(finding.to_json_dict()).decode()}\n")
    untested = [r.id for r in ruleset.rules if r.enabled and r.id not in hit]
    if untested:
        out.write(f"rules no fixture exercises: {', '.join(untested)}\n")
    out.write(f"{passed} passed, {failed} failed\n")
    return 0 if failed == 0 else 1
