"""Evaluating findings against a ruleset: conditions, first match, exceptions, disabled rules,
the fallback, compiled conditions, and the RuleStore that reloads it."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
from rule_files import leak, rule_text, write

from kvguard.ledger.findings import KINDS, Finding
from kvguard.ruleset import (
    DEFAULT_RULES_DIR,
    RulesetError,
    RuleStore,
    load_ruleset,
)

# -- evaluation ---------------------------------------------------------------------------------


def test_first_match_wins_in_file_name_then_file_order(tmp_path: Path) -> None:
    write(
        tmp_path,
        "20-general.yaml",
        """\
        - rule: general
          description: any stale read
          finding: stale_read
          severity: low
          action: log
          output: general
        """,
    )
    write(
        tmp_path,
        "10-specific.yaml",
        """\
        - rule: cross
          description: cross-tenant
          finding: [foreign_read, stale_read]
          condition: victim_tenant != tenant
          severity: critical
          action: kill
          output: cross
        - rule: also_cross
          description: never reached
          finding: stale_read
          condition: victim_tenant != tenant
          severity: info
          action: log
          output: also
        """,
    )
    ruleset = load_ruleset(tmp_path)
    assert [rule.id for rule in ruleset.rules] == ["cross", "also_cross", "general"]
    first = ruleset.evaluate(leak())
    second = ruleset.evaluate(leak(victim_tenant="acme"))
    third = ruleset.evaluate(leak(finding="foreign_read"))
    assert first is not None and (first.rule, first.severity, first.action, first.message) == (
        "cross",
        "critical",
        "kill",
        "cross",
    )
    assert second is not None and (second.rule, second.severity, second.action) == ("general", "low", "log")
    assert third is not None and third.rule == "cross"
    assert ruleset.counters.hits == {"cross": 2, "general": 1}


EXCEPTIONS = """\
- rule: stale
  description: stale reads, except the canary tenant
  finding: stale_read
  severity: high
  action: kill
  output: "{req}"
  exceptions:
    - name: canary
      condition: tenant == "canary"
    - name: broken
      condition: details.missing == "x"
"""


def test_exceptions_suppress(tmp_path: Path) -> None:
    write(tmp_path, "r.yaml", EXCEPTIONS)
    ruleset = load_ruleset(tmp_path)
    assert ruleset.evaluate(leak(tenant="canary")) is None
    assert ruleset.evaluate(leak(tenant="canary")) is None
    kept = ruleset.evaluate(leak())
    assert kept is not None and (kept.rule, kept.severity, kept.message) == ("stale", "high", "r2")
    assert ruleset.counters.suppressed == {("stale", "canary"): 2}
    assert ruleset.counters.hits == {"stale": 1}
    rule = ruleset.rules[0]
    assert [(e.name, e.condition.source, e.line) for e in rule.exceptions] == [
        ("canary", 'tenant == "canary"', 8),
        ("broken", 'details.missing == "x"', 10),
    ]


def test_exception_that_fails_does_not_suppress(tmp_path: Path) -> None:
    write(tmp_path, "r.yaml", EXCEPTIONS)
    ruleset = load_ruleset(tmp_path)
    result = ruleset.evaluate(leak())  # the 'broken' exception raises: no such details key
    assert result is not None and result.rule == "stale"
    assert ruleset.counters.runtime_errors == {"stale": 1}
    assert ruleset.counters.last_error.startswith("rule stale exception broken: ")
    assert not ruleset.counters.suppressed


def test_condition_that_fails_applies_the_rule(tmp_path: Path) -> None:
    write(
        tmp_path,
        "r.yaml",
        rule_text(append='  condition: details.sent == "8"')
        + textwrap.dedent(
            """\
            - rule: fallback
              description: never reached while r1 fails safe
              finding: stale_read
              severity: info
              action: log
              output: x
            """
        ),
    )
    ruleset = load_ruleset(tmp_path)
    failed = ruleset.evaluate(leak(details={}))
    assert failed is not None and (failed.rule, failed.severity, failed.action) == ("r1", "high", "kill")
    assert ruleset.counters.runtime_errors == {"r1": 1} and ruleset.counters.errors == 1
    assert "rule r1: " in ruleset.counters.last_error
    unmatched = ruleset.evaluate(leak(details={"sent": "1"}))
    assert unmatched is not None and unmatched.rule == "fallback"
    assert ruleset.counters.errors == 1


def test_disabled_rules_are_skipped(tmp_path: Path) -> None:
    write(
        tmp_path,
        "r.yaml",
        rule_text({1: "- rule: disabled"}, "  enabled: false")
        + rule_text({1: "- rule: enabled", 4: "  severity: low"}, "  enabled: true"),
    )
    ruleset = load_ruleset(tmp_path)
    assert [(rule.id, rule.enabled) for rule in ruleset.rules] == [("disabled", False), ("enabled", True)]
    result = ruleset.evaluate(leak())
    assert result is not None and (result.rule, result.severity) == ("enabled", "low")
    assert "disabled" not in ruleset.counters.hits


def test_unmatched_fallback(tmp_path: Path) -> None:
    write(tmp_path, "r.yaml", rule_text())
    ruleset = load_ruleset(tmp_path)
    finding = leak(finding="late_write", message="write landed in page 7\nnow owned by r1")
    result = ruleset.evaluate(finding)
    assert result is not None
    assert (result.rule, result.severity, result.action) == ("unmatched", "high", "alert")
    assert (
        result.message
        == "late_write finding on d0 matched no rule: write landed in page 7\\x0anow owned by r1"
    )
    assert ruleset.counters.unmatched == 1 and not ruleset.counters.hits


def test_conditions_are_compiled_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "r.yaml", EXCEPTIONS)
    ruleset = load_ruleset(tmp_path)
    import cel

    def no_compile(source: str) -> None:
        raise AssertionError(f"compiled at evaluation: {source}")

    monkeypatch.setattr(cel, "compile", no_compile)
    for _ in range(3):
        assert ruleset.evaluate(leak(tenant="canary")) is None


# -- store --------------------------------------------------------------------------------------


def test_reload_keeps_last_good_ruleset(tmp_path: Path) -> None:
    path = write(tmp_path, "r.yaml", rule_text())
    store = RuleStore(tmp_path)
    good = store.ruleset
    assert [rule.id for rule in good.rules] == ["r1"]

    path.write_text(rule_text({4: "  severity: crit"}))
    errors = store.reload()
    assert [(e.path.name, e.line) for e in errors] == [("r.yaml", 4)]
    assert store.ruleset is good
    result = store.evaluate(leak())
    assert result is not None and result.severity == "high"

    path.write_text(rule_text({4: "  severity: low"}))
    assert store.reload() == []
    assert store.ruleset is not good
    result = store.evaluate(leak())
    assert result is not None and result.severity == "low"


def test_store_first_load_must_succeed(tmp_path: Path) -> None:
    write(tmp_path, "r.yaml", rule_text({5: "  action: nuke"}))
    with pytest.raises(RulesetError, match="unknown action 'nuke'"):
        RuleStore(tmp_path)


def test_store_default_path() -> None:
    store = RuleStore()
    assert store.path == DEFAULT_RULES_DIR
    assert store.reload() == []
    assert len(store.ruleset.rules) >= len(KINDS)


def test_the_evaluated_copy_keeps_every_fact_of_the_detector() -> None:
    # evaluated() names every field (faster than dataclasses.replace): a field added to
    # Finding and not copied there would be lost from every judged finding.
    facts = {
        "finding": "stale_read", "node": "n1", "req": "r1", "tenant": "t1", "victim_req": "r2",
        "victim_tenant": "t2", "pool": 3, "pages": (4, 5), "seq": 6, "ts_ns": 7, "message": "m",
        "details": {"k": "v"}, "severity": "low", "action": "log", "rule": "old", "tags": ("a",),
    }  # fmt: skip
    assert set(facts) == {f.name for f in dataclasses.fields(Finding)}
    judged = {"severity": "critical", "action": "kill", "rule": "r", "message": "new", "tags": ("b",)}
    got = Finding(**facts).evaluated(**judged)
    assert dataclasses.asdict(got) == {**facts, **judged}
