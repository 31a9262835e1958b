"""Loading rule files: every error named with its file, line and reason, all of a load at
once; unsafe YAML never constructed."""

from __future__ import annotations

from pathlib import Path

import pytest
from rule_files import load_errors, rule_text, write

from kvguard.ledger.findings import Finding
from kvguard.ruleset import (
    RulesetError,
    load_ruleset,
)
from kvguard.ruleset.loader import MAX_DEPTH, MAX_FILE_BYTES


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


DEEP = 500  # far past Python's recursion limit for PyYAML's composer (three frames a level)


@pytest.mark.parametrize(
    "nested",
    [
        "[" * DEEP + "]" * DEEP,  # flow lists
        "{a: " * DEEP + "1" + "}" * DEEP,  # flow mappings
        "- " * DEEP + "x",  # block lists
        rule_text(append="  exceptions: " + "[" * DEEP + "]" * DEEP),  # inside a valid rule
    ],
    ids=["flow-lists", "flow-mappings", "block-lists", "in-a-rule"],
)
def test_a_file_nested_too_deep_is_one_clear_error(tmp_path: Path, nested: str) -> None:
    path = write(tmp_path, "10-deep.yaml", nested)
    (error,) = load_errors(tmp_path)
    assert error.path == path
    assert error.reason == f"nested deeper than {MAX_DEPTH} levels (a rule file needs 5)"
    assert 1 <= error.line <= MAX_DEPTH + 1


def test_a_file_larger_than_the_bound_is_refused_unread(tmp_path: Path) -> None:
    path = write(tmp_path, "10-big.yaml", rule_text() + "# padding\n" * (MAX_FILE_BYTES // 10))
    (error,) = load_errors(tmp_path)
    assert (error.path, error.line) == (path, 0)
    assert error.reason == f"larger than {MAX_FILE_BYTES} bytes: not a rule file"
    # Nested as deep as the bound allows is read (and judged as rules are).
    within = "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1)
    write(tmp_path, "10-big.yaml", rule_text(append="  tags: [a]") + f"- {within}\n")
    (error,) = load_errors(tmp_path)
    assert error.reason.startswith("each rule must be a mapping of fields, not a list")


def test_named_lists_are_defined_once_and_extended_by_append(tmp_path: Path) -> None:
    write(tmp_path, "10-rules.yaml", rule_text())
    write(tmp_path, "20-list.yaml", '- list: attention_kernels\n  items: ["*flash_fwd*", "_fwd_kernel*"]\n')
    write(
        tmp_path, "30-more.yaml", '- list: attention_kernels\n  append: true\n  items: ["my_attention_*"]\n'
    )
    ruleset = load_ruleset(tmp_path)
    assert ruleset.lists == {"attention_kernels": ("*flash_fwd*", "_fwd_kernel*", "my_attention_*")}
    assert len(ruleset.rules) == 1


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("- list: attention_kernel\n  items: [a]\n", 1, "unknown list 'attention_kernel'"),
        ("- list: attention_kernels\n", 1, "list is missing required field 'items'"),
        ("- list: attention_kernels\n  items: a\n", 2, "items must be a list of strings, not a string"),
        ("- list: attention_kernels\n  items: [[a]]\n", 2, "'items' must be a string, not a list"),
        ("- list: attention_kernels\n  items: [a]\n  apend: true\n", 3, "unknown field 'apend' in a list"),
        (
            "- list: attention_kernels\n  items: [a]\n  append: yes please\n",
            3,
            "'append' must be true or false",
        ),
        ('- list: attention_kernels\n  items: ["a\\tb"]\n', 2, "is over 256 characters or unprintable"),
        (
            "- list: attention_kernels\n  items: [a]\n- list: attention_kernels\n  items: [b]\n",
            3,
            "defined again",
        ),
        (
            "- list: attention_kernels\n  items: [" + ", ".join(["x" * 200] * 41) + "]\n",
            2,
            "takes 8241 bytes",
        ),
    ],
)
def test_a_bad_list_is_named_with_its_line_and_reason(
    tmp_path: Path, text: str, line: int, reason: str
) -> None:
    write(tmp_path, "10-rules.yaml", rule_text())
    write(tmp_path, "20-list.yaml", text)
    errors = load_errors(tmp_path)
    assert any(e.line == line and reason in e.reason and e.path.name == "20-list.yaml" for e in errors), (
        errors
    )
