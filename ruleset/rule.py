"""One rule, as loaded: frozen, validated, with its condition and template compiled.

Invariant: a `Rule` is only built by the loader from a rule that passed every check, so its
kinds, severity and action are in the vocabulary of `kvguard.ledger.findings`, its id is unique
in its rule set, and evaluating it never compiles anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvguard.ruleset.condition import Condition
from kvguard.ruleset.template import Template


@dataclass(frozen=True, slots=True)
class RuleException:
    """A named exception: when its condition holds, the rule's findings are suppressed."""

    name: str
    condition: Condition
    line: int = 0


@dataclass(frozen=True, slots=True)
class Rule:
    """A rule: for findings of `kinds` where `condition` holds, set severity, action and output."""

    id: str
    description: str
    kinds: tuple[str, ...]
    severity: str
    action: str
    output: Template
    condition: Condition | None = None
    tags: tuple[str, ...] = ()
    exceptions: tuple[RuleException, ...] = ()
    enabled: bool = True
    path: Path | None = None  # where it was defined, for listings and errors
    line: int = 0
