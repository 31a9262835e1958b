"""Output templates: one alert line per finding, from `{name}` placeholders.

Invariant: a `Template` names only fields of a finding (`{tenant}`, `{pages}`, ... see
`FIELDS`) or one details entry (`{details[key]}`), with no conversion or format spec. It is
parsed once, at load, into literal and placeholder parts and rendered by joining them, never by
`str.format`; so rendering cannot reach attributes, never raises, and yields exactly one line
(control and bidirectional-override characters in values are escaped, long values cut).
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

from kvguard.ledger.findings import Finding
from kvguard.ruleset.condition import FIELDS

MAX_PAGE_RUNS = 16
MAX_VALUE_CHARS = 512
MISSING = "?"  # a details key the finding does not have
NOT_APPLICABLE = "-"  # an empty field, or no pool

_DETAILS_KEY = re.compile(r"details\[([A-Za-z0-9_.-]+)\]")
# C0/C1 controls, DEL, line/paragraph separators, bidi embeddings/overrides/isolates.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


class TemplateError(ValueError):
    """A template that cannot be loaded; the message is the reason, for a RuleError."""


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def clean(value: str) -> str:
    """`value` made safe for one line of an alert: escaped, and cut at MAX_VALUE_CHARS."""
    if len(value) > MAX_VALUE_CHARS:
        value = value[:MAX_VALUE_CHARS] + "..."
    return _UNSAFE.sub(_escape, value)


def compact_pages(pages: Sequence[int], max_runs: int = MAX_PAGE_RUNS) -> str:
    """`7-13,20` for [7..13, 20], in the order given; after `max_runs` runs, a count of the rest."""
    if not pages:
        return NOT_APPLICABLE
    runs: list[tuple[int, int]] = []
    start = prev = pages[0]
    for page in pages[1:]:
        if page == prev + 1:
            prev = page
            continue
        runs.append((start, prev))
        start = prev = page
    runs.append((start, prev))
    shown = runs[:max_runs]
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in shown)
    rest = len(pages) - sum(b - a + 1 for a, b in shown)
    return f"{text},... (+{rest} more)" if rest > 0 else text


def _render_field(name: str, finding: Finding) -> str:
    if name == "pages":
        return compact_pages(finding.pages)
    if name == "pool":
        return NOT_APPLICABLE if finding.pool is None else str(finding.pool)
    if name == "details":
        items = sorted(finding.details.items())
        return ",".join(f"{key}={value}" for key, value in items) if items else NOT_APPLICABLE
    if name == "tags":
        return ",".join(finding.tags) if finding.tags else NOT_APPLICABLE
    text = str(getattr(finding, name))  # the other fields are plain str/int attributes
    return text if text else NOT_APPLICABLE


class Template:
    """A parsed output template. `render` never raises."""

    __slots__ = ("_parts", "source")

    def __init__(self, source: str) -> None:
        """Parse and check `source`; raise TemplateError with a readable reason if it is bad."""
        self.source: str = source
        if not source.strip():
            raise TemplateError("is empty")
        if _UNSAFE.search(source):
            raise TemplateError("must be one line, without control characters")
        try:
            parsed = list(string.Formatter().parse(source))
        except ValueError as error:
            raise TemplateError(f"{error} (write '{{{{' and '}}}}' for literal braces)") from None
        parts: list[tuple[str, str | None, str | None]] = []  # (literal, field, details key)
        problems: list[str] = []
        for literal, name, spec, conversion in parsed:
            if name is None:
                parts.append((literal, None, None))
                continue
            problem = _check_placeholder(name, spec, conversion)
            if problem:
                problems.append(problem)
                continue
            match = _DETAILS_KEY.fullmatch(name)
            parts.append((literal, None if match else name, match.group(1) if match else None))
        if problems:
            raise TemplateError("; ".join(problems))
        self._parts: tuple[tuple[str, str | None, str | None], ...] = tuple(parts)

    @property
    def placeholders(self) -> tuple[str, ...]:
        """The placeholders, as written (`tenant`, `details[sent]`)."""
        out: list[str] = []
        for _, name, key in self._parts:
            if name is not None:
                out.append(name)
            elif key is not None:
                out.append(f"details[{key}]")
        return tuple(out)

    def render(self, finding: Finding) -> str:
        """The template filled in from `finding`: `?` for a missing details key, `-` for n/a."""
        out: list[str] = []
        for literal, name, key in self._parts:
            out.append(literal)
            if name is not None:
                out.append(clean(_render_field(name, finding)))
            elif key is not None:
                value = finding.details.get(key)
                out.append(MISSING if value is None else clean(str(value)))
        return "".join(out)

    def __repr__(self) -> str:
        return f"Template({self.source!r})"

    def __str__(self) -> str:
        return self.source


def _check_placeholder(name: str, spec: str | None, conversion: str | None) -> str | None:
    shown = "{" + name + ("!" + conversion if conversion else "") + (":" + spec if spec else "") + "}"
    if conversion is not None:
        return f"placeholder {shown}: conversions (!r, !s, !a) are not allowed"
    if spec:
        return f"placeholder {shown}: format specs are not allowed"
    if name in FIELDS or _DETAILS_KEY.fullmatch(name):
        return None
    if name == "":
        return "placeholder {}: name a field, e.g. {tenant}"
    if "." in name or "[" in name:
        return (
            f"placeholder {shown}: only plain field names and {{details[key]}} are allowed, "
            "not attribute access or other indexing"
        )
    return f"placeholder {shown}: unknown field '{name}' (fields: {', '.join(FIELDS)})"
