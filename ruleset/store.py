"""The current rule set of a rules path, reloadable in place.

Invariant: `RuleStore.ruleset` is always a rule set that loaded without error. The first load
must succeed (the constructor raises RulesetError); a later `reload` that fails keeps the last
good rule set and returns the errors. Swapping is one attribute assignment, so a reader sees
either the old or the new rule set whole. A new rule set starts with fresh counters.
"""

from __future__ import annotations

from pathlib import Path

from kvguard.ledger.findings import Finding
from kvguard.ruleset.errors import RuleError, RulesetError
from kvguard.ruleset.evaluator import Ruleset
from kvguard.ruleset.loader import DEFAULT_RULES_DIR, load_ruleset


class RuleStore:
    """Holds the last good Ruleset loaded from `path` (default DEFAULT_RULES_DIR)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path: Path = Path(path) if path is not None else DEFAULT_RULES_DIR
        self._ruleset: Ruleset = load_ruleset(self.path)

    @property
    def ruleset(self) -> Ruleset:
        return self._ruleset

    def reload(self) -> list[RuleError]:
        """Load `path` again; on failure keep the current rule set. The errors; [] on success."""
        try:
            ruleset = load_ruleset(self.path)
        except RulesetError as exc:
            return list(exc.errors)
        self._ruleset = ruleset
        return []

    def evaluate(self, finding: Finding) -> Finding | None:
        """Shorthand for `self.ruleset.evaluate(finding)`."""
        return self._ruleset.evaluate(finding)
