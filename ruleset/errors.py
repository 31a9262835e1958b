"""Load errors of a rule set: where (file, 1-based line) and why.

Invariant: a load reports every error it finds, never only the first; a `RulesetError` is
raised only with at least one `RuleError`, and its text lists them all as `path:line: reason`,
one line each: a reason quotes what a file holds, so its control characters (a newline in a
field name, a terminal escape) are written as escapes, never as themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class RuleError:
    """One problem in a rule file. `line` is 1-based; 0 when it concerns the file as a whole."""

    path: Path
    line: int
    reason: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", _one_line(self.reason))

    def __str__(self) -> str:
        if self.line <= 0:
            return f"{self.path}: {self.reason}"
        return f"{self.path}:{self.line}: {self.reason}"


def _one_line(text: str) -> str:
    """`text` with every character that is not printable (newlines, escapes) as its escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class RulesetError(Exception):
    """A rule set failed to load; `errors` holds every problem found, in file order."""

    def __init__(self, errors: list[RuleError]) -> None:
        if not errors:
            raise ValueError("RulesetError needs at least one RuleError")
        self.errors: list[RuleError] = list(errors)
        count = len(self.errors)
        head = f"{count} error{'s' if count != 1 else ''} in rules:"
        super().__init__("\n".join([head, *(f"  {error}" for error in self.errors)]))
