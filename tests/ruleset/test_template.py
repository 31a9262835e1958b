"""Rule outputs: templates render decided fields, escape and cut values; page lists compacted."""

from __future__ import annotations

from pathlib import Path

import pytest
from rule_files import leak, rule_text, write

from kvguard.ruleset import (
    load_ruleset,
)
from kvguard.ruleset.template import Template, compact_pages


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
