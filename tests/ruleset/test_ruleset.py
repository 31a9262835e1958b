"""The ruleset: loading and validating rule files, evaluating findings, default rules."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from kvguard.ledger.findings import ACTIONS, KINDS, SEVERITIES, Finding
from kvguard.ruleset import (
    DEFAULT_RULES_DIR,
    Rule,
    RuleError,
    RulesetError,
    RuleStore,
    load_ruleset,
)
from kvguard.ruleset.template import Template, compact_pages

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


# -- default rules ------------------------------------------------------------------------------


def test_default_rules_load() -> None:
    ruleset = load_ruleset()
    ids = [rule.id for rule in ruleset.rules]
    assert len(ids) == len(set(ids)) >= len(KINDS)
    assert sorted(p.name for p in DEFAULT_RULES_DIR.glob("*.yaml")) == [
        "10-leaks.yaml",
        "20-lifetime.yaml",
        "30-transfer.yaml",
        "40-config.yaml",
        "90-anomaly.yaml",
    ]
    for rule in ruleset.rules:
        assert isinstance(rule, Rule)
        assert rule.enabled and rule.description and rule.output.source
        assert rule.severity in SEVERITIES and rule.action in ACTIONS
        assert rule.path is not None and rule.path.parent == DEFAULT_RULES_DIR and rule.line > 0


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_matched_by_a_default_rule(kind: str) -> None:
    ruleset = load_ruleset()
    bare = ruleset.evaluate(Finding(finding=kind, node="n0"))
    full = ruleset.evaluate(leak(finding=kind))
    for result in (bare, full):
        assert result is not None
        assert result.rule in ruleset.counters.hits
        assert kind in next(rule.kinds for rule in ruleset.rules if rule.id == result.rule)
        assert result.message and "{" not in result.message
    assert ruleset.counters.unmatched == 0
    assert ruleset.counters.errors == 0


@pytest.mark.parametrize(
    ("finding", "rule", "severity", "action"),
    [
        (leak(), "stale_read_cross_tenant", "critical", "kill"),
        (leak(victim_tenant="acme"), "stale_read", "high", "kill"),
        (leak(victim_tenant=""), "stale_read", "high", "kill"),
        (leak(finding="foreign_read"), "foreign_read_cross_tenant", "critical", "kill"),
        (leak(finding="foreign_read", victim_tenant=""), "foreign_read", "high", "kill"),
        (leak(finding="use_after_free"), "use_after_free", "critical", "kill+quarantine"),
        (leak(finding="late_write"), "late_write", "critical", "kill+quarantine"),
        (leak(finding="double_free"), "double_free_live_page", "critical", "alert+quarantine"),
        (
            leak(finding="double_free", victim_req="", victim_tenant=""),
            "double_free",
            "high",
            "alert+quarantine",
        ),
        (leak(finding="early_release"), "early_release_cross_tenant", "critical", "alert+quarantine"),
        (leak(finding="early_release", victim_tenant="acme"), "early_release", "high", "alert+quarantine"),
        (leak(finding="transfer_mismatch"), "transfer_mismatch", "critical", "kill"),
        (leak(finding="rejected_progress"), "rejected_progress", "critical", "kill"),
        (leak(finding="config_drift"), "config_drift_admission", "critical", "block"),
        (Finding("config_drift", node="p0", pool=0), "config_drift", "critical", "alert"),
        (leak(finding="cross_tenant_share"), "cross_tenant_share", "high", "deny"),
        (leak(finding="anomaly"), "anomaly", "medium", "alert"),
    ],
)
def test_default_rule_decisions(finding: Finding, rule: str, severity: str, action: str) -> None:
    result = load_ruleset().evaluate(finding)
    assert result is not None
    assert (result.rule, result.severity, result.action) == (rule, severity, action)


def test_default_stale_read_cross_tenant_output() -> None:
    result = load_ruleset().evaluate(leak())
    assert result is not None
    assert (
        result.message == "acme request r2 on d0 read KV written by globex request r1 (pool 0, pages 7-13,20)"
    )
    assert result.tags == ("leak", "cross-tenant")
    assert (result.node, result.req, result.pages, result.seq) == ("d0", "r2", leak().pages, 42)


def test_default_config_drift_output_includes_detector_message() -> None:
    finding = Finding("config_drift", node="p0", pool=0, message="pool 681280 tokens < context 1048576.")
    result = load_ruleset().evaluate(finding)
    assert result is not None
    assert result.message == "KV pool misconfigured on p0: pool 681280 tokens < context 1048576."


def test_evaluate_returns_a_copy() -> None:
    finding = leak()
    result = load_ruleset().evaluate(finding)
    assert result is not None and result is not finding
    assert finding.rule == "" and finding.message == "r2 read 8 pages written by r1"


# -- loader errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replace", "append", "line", "reason"),
    [
        ({4: "  severity: crit"}, "", 4, "unknown severity 'crit' (one of: critical, high"),
        ({5: "  action: nuke"}, "", 5, "unknown action 'nuke'"),
        ({3: "  finding: stale_reed"}, "", 3, "unknown finding 'stale_reed'"),
        ({3: "  finding: stale_reed"}, "", 3, "did you mean 'stale_read'?"),
        ({3: "  finding: [stale_read, nope]"}, "", 3, "unknown finding 'nope'"),
        ({3: "  finding: []"}, "", 3, "'finding' must name at least one finding kind"),
        ({1: "- rule: Bad Id"}, "", 1, "rule id 'Bad Id' may only use a-z, 0-9"),
        ({1: "- rule: unmatched"}, "", 1, "rule id 'unmatched' is reserved"),
        ({4: "  severity: [high]"}, "", 4, "'severity' must be a string, not a list"),
        ({1: "- rule: off"}, "", 1, "'rule' must be a string, not a boolean (false) (quote it"),
        ({2: "  description:"}, "", 2, "'description' must be a string, not nothing"),
        ({2: "  descripton: typo"}, "", 2, "unknown field 'descripton' in a rule"),
        ({2: "  descripton: typo"}, "", 1, "rule is missing required field 'description'"),
        ({5: "  tags: []"}, "", 1, "rule is missing required field 'action'"),
        ({6: '  output: "{req.__class__}"'}, "", 6, "not attribute access or other indexing"),
        ({6: '  output: "{pages[0]}"'}, "", 6, "placeholder {pages[0]}: only plain field names"),
        ({6: '  output: "{tenant:>99}"'}, "", 6, "placeholder {tenant:>99}: format specs are not allowed"),
        ({6: '  output: "{tenant!r}"'}, "", 6, "conversions (!r, !s, !a) are not allowed"),
        ({6: '  output: "{tenat} x"'}, "", 6, "output: placeholder {tenat}: unknown field 'tenat'"),
        ({6: '  output: "{} x"'}, "", 6, "placeholder {}: name a field"),
        ({6: '  output: "oops {tenant"'}, "", 6, "output: expected '}' before end of string"),
        ({6: '  output: ""'}, "", 6, "'output' must not be empty"),
        ({6: '  output: "a\\nb"'}, "", 6, "output: must be one line"),
        ({}, "  condition: tenant ==", 7, "condition: CEL syntax error at 1:"),
        ({}, '  condition: tenat == "a"', 7, "condition: unknown variable 'tenat' (did you mean 'tenant'?)"),
        ({}, "  condition: max(pages) > 3", 7, "condition: unknown function 'max'"),
        ({}, "  condition: pool + 1", 7, "condition: must yield true or false, but yields int"),
        ({}, "  condition: true", 7, "'condition' must be a string, not a boolean"),
        ({}, "  condition: ''", 7, "'condition' must not be empty"),
        ({}, "  enabled: maybe", 7, "'enabled' must be true or false, not a string"),
        ({}, "  tags: leak", 7, "'tags' must be a list of strings, not a string"),
        ({}, "  tags: [leak, [x]]", 7, "'tags' must be a string, not a list"),
        ({}, "  severity: low", 7, "duplicate field 'severity' in a rule (first on line 4)"),
        ({}, "  exceptions: [x]", 7, "an exception must be a mapping with name and condition"),
        ({}, "  exceptions: {name: x}", 7, "'exceptions' must be a list of {name, condition}"),
        ({}, "  exceptions:\n    - name: x", 8, "exception is missing required field 'condition'"),
        (
            {},
            '  exceptions:\n    - name: x\n      conditon: tenant == "a"',
            9,
            "unknown field 'conditon' in an exception",
        ),
        (
            {},
            "  exceptions:\n    - name: x\n      condition: nope",
            9,
            "exception 'x' condition: unknown variable",
        ),
        (
            {},
            "  exceptions:\n    - {name: x, condition: 'true'}\n    - {name: x, condition: 'false'}",
            9,
            "duplicate exception name 'x' (first on line 8)",
        ),
        (
            {6: "  output: !!python/name:os.system x"},
            "",
            6,
            "YAML tag 'tag:yaml.org,2002:python/name:os.system'",
        ),
        ({}, "  extra: 2024-01-01", 7, "YAML tag 'tag:yaml.org,2002:timestamp' is not allowed"),
        ({2: "  description: [unclosed"}, "", 3, "YAML syntax error: expected ',' or ']'"),
    ],
)
def test_loader_error(tmp_path: Path, replace: dict[int, str], append: str, line: int, reason: str) -> None:
    write(tmp_path, "00-ok.yaml", rule_text({1: "- rule: ok"}))
    write(tmp_path, "bad.yaml", rule_text(replace, append))
    errors = load_errors(tmp_path)
    matching = [e for e in errors if reason in e.reason]
    assert matching, f"no error containing {reason!r} in {[str(e) for e in errors]}"
    error = matching[0]
    assert error.path == tmp_path / "bad.yaml"
    assert error.line == line
    assert str(error) == f"{tmp_path / 'bad.yaml'}:{line}: {error.reason}"


def test_unsafe_yaml_is_never_constructed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    write(
        tmp_path,
        "evil.yaml",
        f"""\
        - rule: r1
          description: !!python/object/apply:os.system ["touch {marker}"]
        """,
    )
    errors = load_errors(tmp_path)
    assert not marker.exists()
    assert errors[0].line == 2 and "python/object/apply:os.system" in errors[0].reason


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("rule: r1\ndescription: x\n", 1, "a rule file must be a YAML list of rules, not a mapping"),
        ("- just a string\n", 1, "each rule must be a mapping of fields, not a string"),
        ("- a\n---\n- b\n", 2, "YAML syntax error: but found another document"),
    ],
)
def test_file_shape_errors(tmp_path: Path, text: str, line: int, reason: str) -> None:
    write(tmp_path, "shape.yaml", text)
    errors = load_errors(tmp_path)
    assert [(e.path.name, e.line) for e in errors] == [("shape.yaml", line)]
    assert reason in errors[0].reason


def test_duplicate_rule_id_across_files(tmp_path: Path) -> None:
    write(tmp_path, "10-a.yaml", rule_text())
    write(tmp_path, "20-b.yaml", "# another file\n" + rule_text())
    errors = load_errors(tmp_path)
    assert len(errors) == 1
    assert errors[0].path.name == "20-b.yaml" and errors[0].line == 2
    assert errors[0].reason == f"duplicate rule id 'r1' (first defined at {tmp_path / '10-a.yaml'}:1)"


def test_missing_and_empty_rules_directory(tmp_path: Path) -> None:
    errors = load_errors(tmp_path / "nowhere")
    assert [(e.line, e.reason) for e in errors] == [(0, "no such rules file or directory")]
    assert str(errors[0]) == f"{tmp_path / 'nowhere'}: no such rules file or directory"
    assert [e.reason for e in load_errors(tmp_path)] == ["no rule files (*.yaml) in this directory"]


def test_all_errors_of_a_load_are_collected(tmp_path: Path) -> None:
    write(tmp_path, "10-a.yaml", rule_text({4: "  severity: crit", 5: "  action: nuke"}))
    write(tmp_path, "20-b.yaml", rule_text({1: "- rule: r2"}, "  condition: nope == 1\n  colour: red"))
    write(tmp_path, "30-c.yaml", "[unclosed\n")
    with pytest.raises(RulesetError) as info:
        load_ruleset(tmp_path)
    where = [(e.path.name, e.line) for e in info.value.errors]
    assert where == [("10-a.yaml", 4), ("10-a.yaml", 5), ("20-b.yaml", 7), ("20-b.yaml", 8), ("30-c.yaml", 2)]
    text = str(info.value)
    assert text.splitlines()[0] == "5 errors in rules:"
    assert f"  {tmp_path / '10-a.yaml'}:4: unknown severity 'crit'" in text
    assert f"{tmp_path / '20-b.yaml'}:8: unknown field 'colour'" in text


def test_single_file_and_empty_file(tmp_path: Path) -> None:
    path = write(tmp_path, "one.yaml", rule_text())
    assert [rule.id for rule in load_ruleset(path).rules] == ["r1"]
    write(tmp_path, "empty.yaml", "# nothing yet\n")
    assert [rule.id for rule in load_ruleset(tmp_path).rules] == ["r1"]


@pytest.mark.parametrize(
    ("condition", "details", "pages", "expected"),
    [
        ('details.sent == "8"', {"sent": "8"}, (), True),
        ('details["sent"] == "8"', {"sent": "1"}, (), False),
        ('"sent" in details && details.sent != details.received', {"sent": "8", "received": "1"}, (), True),
        ("has(details.sent)", {}, (), False),
        ("size(pages) > 3", {}, (1, 2, 3, 4), True),
        ("size(pages) > 3", {}, (1, 2, 3), False),
        ("pages.exists(p, p >= 100)", {}, (1, 100), True),
        ("pages.all(p, p < 100) && pool == -1", {}, (1, 2), True),
        ('tenant.startsWith("ac") && int(details.n) > 2', {"n": "3"}, (), True),
    ],
)
def test_condition_language(
    tmp_path: Path, condition: str, details: dict[str, str], pages: tuple[int, ...], expected: bool
) -> None:
    write(tmp_path, "r.yaml", rule_text(append=f"  condition: '{condition}'"))
    ruleset = load_ruleset(tmp_path)
    result = ruleset.evaluate(Finding("stale_read", tenant="acme", details=details, pages=pages))
    assert result is not None
    assert result.rule == ("r1" if expected else "unmatched")
    assert ruleset.counters.errors == 0


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


# -- templates ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pages", "text"),
    [
        ((), "-"),
        ((5,), "5"),
        ((7, 8, 9, 10, 11, 12, 13, 20), "7-13,20"),
        ((3, 4, 1, 2), "3-4,1-2"),
        (tuple(range(0, 1000)), "0-999"),
        (tuple(range(0, 40, 2)), "0,2,4,6,8,10,12,14,16,18,20,22,24,26,28,30,... (+4 more)"),
    ],
)
def test_compact_pages(pages: tuple[int, ...], text: str) -> None:
    assert compact_pages(pages) == text


def test_template_rendering() -> None:
    template = Template(
        "{tenant} {req} pool={pool} pages={pages} sent={details[sent]} got={details[got]} {{x}}"
    )
    finding = leak(pool=None, details={"sent": "8"})
    assert template.render(finding) == "acme r2 pool=- pages=7-13,20 sent=8 got=? {x}"
    assert template.placeholders == ("tenant", "req", "pool", "pages", "details[sent]", "details[got]")


def test_template_renders_decided_fields_and_escapes_values(tmp_path: Path) -> None:
    write(
        tmp_path,
        "r.yaml",
        rule_text(
            {6: '  output: "[{severity}/{action}/{rule}/{tags}] {tenant} {victim_req} {details}"'},
            "  tags: [a, b]",
        ),
    )
    result = load_ruleset(tmp_path).evaluate(
        leak(tenant="evil\n[critical] fake alert\u202e", victim_req="", details={"k": "v", "a": "1"})
    )
    assert result is not None
    assert result.message == "[high/kill/r1/a,b] evil\\x0a[critical] fake alert\\u202e - a=1,k=v"
    assert "\n" not in result.message


def test_template_cuts_long_values() -> None:
    text = Template("{message}").render(leak(message="x" * 5000))
    assert text == "x" * 512 + "..."


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
