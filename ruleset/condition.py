"""Rule conditions: CEL expressions over a finding's fields, compiled once at load.

Invariant: a `Condition` that exists parsed as CEL, names only variables of `FIELDS` (or names
its own comprehension macros bind, such as the `p` of `pages.exists(p, p < 8)`), calls only
functions this CEL build provides, and was compiled exactly once. At run time it can therefore
fail only on the data (a missing details key, a type mismatch), never on a typo; such a
failure is raised as `ConditionRuntimeError`, and the caller decides what it means. Python is
never evaluated: the CEL interpreter alone runs rule text.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import cel

from kvguard.ledger.findings import KINDS, Finding

# The variables of conditions and templates: exactly the keys of Finding.fields().
FIELDS: tuple[str, ...] = tuple(Finding(finding=KINDS[0]).fields())

# Named functions this CEL build evaluates without a custom context (checked by hand against
# common-expression-language 0.10: max, min, bool, lowerAscii, split, join are *not* there).
# Macros (has, all, exists, exists_one, map, filter) and operators need no entry.
KNOWN_FUNCTIONS: frozenset[str] = frozenset(
    {
        "size",
        "contains",
        "startsWith",
        "endsWith",
        "matches",
        "int",
        "uint",
        "double",
        "string",
        "bytes",
        "type",
        "dyn",
        "timestamp",
        "duration",
    }
)

# String literals are removed before looking for macro-bound names, so that a literal such as
# "x.exists(y," cannot bind `y`.
_STRING_LITERAL = re.compile(
    r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\''
)
_MACRO_BINDING = re.compile(r"\.\s*(?:all|exists|exists_one|map|filter)\s*\(\s*([A-Za-z_][A-Za-z0-9_]*)\s*,")


class ConditionError(ValueError):
    """A condition that cannot be loaded; the message is the reason, for a RuleError."""


class ConditionRuntimeError(RuntimeError):
    """A condition failed on one finding's data, or did not yield a boolean."""


def _suggest(name: str, known: tuple[str, ...] | frozenset[str], what: str) -> str:
    """A close match, or else the list of what is known."""
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" ({what}: {', '.join(sorted(known))})"


def _cel_message(error: Exception) -> str:
    """The useful part of a CEL compile error, on one line."""
    text = str(error)
    marker = "ERROR: <input>:"
    if marker in text:
        text = "at " + text.split(marker, 1)[1]
    first = text.splitlines()[0] if text else "invalid expression"
    return first.strip()


class Condition:
    """A compiled CEL condition. `evaluate` returns a bool or raises ConditionRuntimeError."""

    __slots__ = ("_program", "_uses", "source")

    def __init__(self, source: str) -> None:
        """Compile and check `source`; raise ConditionError with a readable reason if it is bad."""
        self.source: str = source
        if not source.strip():
            raise ConditionError("is empty")
        try:
            program = cel.compile(source)
        except (ValueError, RuntimeError) as error:
            raise ConditionError(f"CEL syntax error {_cel_message(error)}") from None
        bound = set(_MACRO_BINDING.findall(_STRING_LITERAL.sub('""', source)))
        problems: list[str] = []
        for name in program.variables():
            if name not in FIELDS and name not in bound:
                problems.append(f"unknown variable '{name}'{_suggest(name, FIELDS, 'variables')}")
        for name in program.functions():
            if name[:1].isalpha() and name not in KNOWN_FUNCTIONS:
                problems.append(f"unknown function '{name}'{_suggest(name, KNOWN_FUNCTIONS, 'functions')}")
        if problems:
            raise ConditionError("; ".join(problems))
        self._program = program
        # The fields it reads: the runtime converts every value it is given (the page list
        # too), so it is given only those.
        self._uses: tuple[str, ...] = tuple(name for name in program.variables() if name in FIELDS)

    def _run(self, fields: dict[str, Any]) -> Any:
        return self._program.execute({name: fields[name] for name in self._uses})

    def evaluate(self, fields: dict[str, Any]) -> bool:
        """Run the condition on `Finding.fields()`; raise ConditionRuntimeError on any failure."""
        try:
            result = self._run(fields)
        except Exception as error:  # the CEL runtime raises many types; all mean "failed"
            raise ConditionRuntimeError(f"{type(error).__name__}: {error}") from None
        if not isinstance(result, bool):
            raise ConditionRuntimeError(f"yielded {type(result).__name__}, not a boolean")
        return result

    def check_result_type(self, kind: str) -> str | None:
        """Dry-run on an empty finding of `kind`: a reason if the result is not a boolean.

        Only a result of the wrong type is reported; a run-time failure on the empty finding
        (say, a missing details key) says nothing about real findings and is ignored.
        """
        try:
            result = self._run(Finding(finding=kind).fields())
        except Exception:  # data-dependent; see the docstring
            return None
        if isinstance(result, bool):
            return None
        return f"must yield true or false, but yields {type(result).__name__} (e.g. {result!r})"

    def __repr__(self) -> str:
        return f"Condition({self.source!r})"

    def __str__(self) -> str:
        return self.source
