"""Every rule fixture passes, and every finding kind has a capture that must produce it and
a near miss that must not (docs/design.md, "Findings"; anomaly comes later)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvguard.ledger.findings import KINDS
from kvguard.ruleset import load_ruleset
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR, fixture_folders, run_fixture

FOLDERS = fixture_folders(DEFAULT_FIXTURES_DIR)
RULESET = load_ruleset()


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_fixture(folder: Path) -> None:
    result = run_fixture(folder, RULESET)
    assert not result.errors
    assert not result.missing, f"expected findings not produced: {result.missing}"
    assert not result.unexpected, f"unexpected findings: {[f.to_json_dict() for f in result.unexpected]}"


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "anomaly"])
def test_each_kind_has_a_positive_and_a_near_miss(kind: str) -> None:
    names = [f.name for f in FOLDERS if f.name.startswith(kind + "-")]
    near = [n for n in names if "near-miss" in n]
    positive = [n for n in names if "near-miss" not in n]
    assert near and positive, f"{kind}: positives {positive}, near misses {near}"
    for name in near:
        assert (DEFAULT_FIXTURES_DIR / name / "expected.jsonl").read_text().strip() == ""
    produced = {
        f.finding for name in positive for f in run_fixture(DEFAULT_FIXTURES_DIR / name, RULESET).findings
    }
    assert kind in produced


def test_every_enabled_rule_is_exercised() -> None:
    hit = {f.rule for folder in FOLDERS for f in run_fixture(folder, RULESET).findings}
    untested = {r.id for r in RULESET.rules if r.enabled} - hit - {"anomaly"}
    assert not untested


def test_a_failing_fixture_is_reported(tmp_path: Path) -> None:
    src = DEFAULT_FIXTURES_DIR / "double_free-free-page"
    (tmp_path / "capture.jsonl").write_text((src / "capture.jsonl").read_text())
    (tmp_path / "expected.jsonl").write_text('{"finding": "late_write", "req": "a1"}\n')
    result = run_fixture(tmp_path, RULESET)
    assert result.missing == [{"finding": "late_write", "req": "a1"}]
    assert [f.finding for f in result.unexpected] == ["double_free"]
    assert not result.passed
