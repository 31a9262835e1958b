"""Rule files fuzzed: whatever a rules file holds (rule-shaped YAML with any values, the
shipped rules with characters changed, YAML-ish text, nesting of any depth), loading it gives
a rule set or a RulesetError whose every error names that file, a line and a one-line
reason, never another exception (no RecursionError, KeyError, TypeError, ...)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.ledger.findings import ACTIONS, KINDS, SEVERITIES
from kvguard.ruleset import DEFAULT_RULES_DIR, Ruleset, RulesetError, load_ruleset
from kvguard.ruleset.loader import EXCEPTION_FIELDS, MAX_DEPTH, OPTIONAL_FIELDS, REQUIRED_FIELDS

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None)
SHIPPED = "".join(path.read_text() for path in sorted(DEFAULT_RULES_DIR.glob("*.yaml")))
# What YAML and the rules' own languages (CEL conditions, output templates) give meaning to.
SIGNIFICANT = "-:[]{},#&*!|>'\"%@`?\n\t ()<=.+$\\{}" + "aZ09_"


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("fuzz") / "10-fuzz.yaml"


def load_is_a_ruleset_or_its_errors(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        ruleset = load_ruleset(path)
    except RulesetError as exc:
        for error in exc.errors:
            assert error.path == path and error.line >= 0, error
            assert error.reason and "\n" not in error.reason, error
        return
    assert isinstance(ruleset, Ruleset)


# Values a rule field could hold: the valid ones, fragments of the rules' languages, and junk.
CONDITIONS = ['tenant == "a"', "pool + 1", "details.what", "victim_tenant != tenant", "(", "!!true", "max(1)"]
TEMPLATES = ["{req} read {pages}", "{tenat}", "{", "{pages[0]}", "{tenant!r}", "a\nb"]
LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from(KINDS + SEVERITIES + ACTIONS),
    st.sampled_from(CONDITIONS + TEMPLATES),
)
VALUE = st.recursive(
    LEAF,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6) | LEAF, inner, max_size=4)
    ),
    max_leaves=12,
)
FIELD_NAMES = st.sampled_from(REQUIRED_FIELDS + OPTIONAL_FIELDS + EXCEPTION_FIELDS) | st.text(max_size=8)
RULE = st.dictionaries(FIELD_NAMES, VALUE, max_size=12)
EXCEPTION = st.dictionaries(st.sampled_from(EXCEPTION_FIELDS), VALUE, max_size=3)


@FUZZ
@given(st.lists(RULE | EXCEPTION | VALUE, max_size=4), st.booleans())
def test_rule_shaped_yaml_with_any_values(rules_file: Path, rules: list[object], flow: bool) -> None:
    text = yaml.safe_dump(rules, default_flow_style=flow, allow_unicode=True)
    load_is_a_ruleset_or_its_errors(rules_file, text)


@FUZZ
@given(
    st.lists(
        st.tuples(st.integers(0, len(SHIPPED)), st.integers(0, 8), st.text(SIGNIFICANT, max_size=6)),
        min_size=1,
        max_size=6,
    )
)
def test_the_shipped_rules_with_characters_changed(
    rules_file: Path, edits: list[tuple[int, int, str]]
) -> None:
    text = SHIPPED
    for at, cut, insert in edits:
        text = text[:at] + insert + text[at + cut :]
    load_is_a_ruleset_or_its_errors(rules_file, text)


@FUZZ
@given(st.text(SIGNIFICANT, max_size=200) | st.text(max_size=60))
def test_yamlish_text(rules_file: Path, text: str) -> None:
    load_is_a_ruleset_or_its_errors(rules_file, text)


@FUZZ
@given(
    st.integers(1, 2 * MAX_DEPTH),  # far deeper (500): test_loader.py
    st.sampled_from(["[", "{a: ", "- ", "[{x: ", "&a [", "!!seq ["]),
    st.text(SIGNIFICANT, max_size=8),
)
def test_nesting_of_any_depth(rules_file: Path, depth: int, opener: str, filling: str) -> None:
    closer = "".join({"[": "]", "{": "}"}.get(c, "") for c in reversed(opener))
    if opener == "- ":  # block style: one more level per line, each indented further
        text = "".join("  " * level + "- \n" for level in range(depth)) + "  " * depth + filling + "\n"
    else:
        text = opener * depth + filling + closer * depth + "\n"
    load_is_a_ruleset_or_its_errors(rules_file, text)
