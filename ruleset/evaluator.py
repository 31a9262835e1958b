"""The rule set: decides severity, action and message of each finding, first match wins.

Invariants: rules are tried in load order (file name, then position in the file) and the
first enabled rule whose kinds and condition match decides; nothing is compiled per call. It
fails safe: a finding no rule matches is still reported (rule `unmatched`, high, alert); a
condition that fails at run time counts as true (the rule applies) and an exception that fails
counts as false (nothing is suppressed on an error); every such case is counted. The detector's
Finding is never edited: an evaluated copy is returned.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvguard.ledger.findings import Finding
from kvguard.ruleset.condition import Condition, ConditionRuntimeError
from kvguard.ruleset.rule import Rule
from kvguard.ruleset.template import clean

UNMATCHED_RULE = "unmatched"
UNMATCHED_SEVERITY = "high"
UNMATCHED_ACTION = "alert"


@dataclass
class Counters:
    """What evaluation did. Not locked: evaluate from one thread (the daemon's rule stage)."""

    hits: Counter[str] = field(default_factory=Counter)  # rule id -> findings it decided
    suppressed: Counter[tuple[str, str]] = field(default_factory=Counter)  # (rule id, exception)
    unmatched: int = 0
    runtime_errors: Counter[str] = field(default_factory=Counter)  # rule id -> failed evaluations
    last_error: str = ""

    @property
    def errors(self) -> int:
        """All run-time errors, every rule together."""
        return sum(self.runtime_errors.values())


def signature(rule: Rule) -> tuple[object, ...]:
    """What decides a rule's verdicts and output (not where it is written)."""
    return (
        rule.id,
        rule.description,
        rule.kinds,
        rule.severity,
        rule.action,
        rule.output.source,
        rule.condition.source if rule.condition is not None else None,
        rule.tags,
        tuple((e.name, e.condition.source) for e in rule.exceptions),
        rule.enabled,
    )


class Ruleset:
    """An ordered list of rules and the counters of their evaluation."""

    def __init__(self, rules: Sequence[Rule], lists: dict[str, tuple[str, ...]] | None = None) -> None:
        self.rules: list[Rule] = list(rules)
        self.lists: dict[str, tuple[str, ...]] = dict(lists or {})  # the rule files' named lists
        self.counters: Counters = Counters()
        by_kind: dict[str, list[Rule]] = {}
        for rule in self.rules:
            if rule.enabled:
                for kind in rule.kinds:
                    by_kind.setdefault(kind, []).append(rule)
        self._by_kind: dict[str, tuple[Rule, ...]] = {kind: tuple(rs) for kind, rs in by_kind.items()}
        # What a receipt names the rules in force by: equal for rules that judge alike.
        said = repr(([signature(r) for r in self.rules], sorted(self.lists.items()))).encode()
        self.digest: str = hashlib.sha256(said).hexdigest()

    def evaluate(self, finding: Finding) -> Finding | None:
        """The evaluated copy of `finding`, or None when an exception of its rule suppresses it."""
        return self.judge(finding)[0]

    def judge(self, finding: Finding) -> tuple[Finding | None, str]:
        """(the evaluated copy of `finding`, ""), or (None, "rule/exception") naming the
        exception that suppresses it (what a receipt calls a permitted share)."""
        fields = finding.fields()
        for rule in self._by_kind.get(finding.finding, ()):
            if rule.condition is not None and not self._holds(rule, rule.condition, fields, failed=True):
                continue
            for exception in rule.exceptions:
                if self._holds(rule, exception.condition, fields, failed=False, name=exception.name):
                    self.counters.suppressed[(rule.id, exception.name)] += 1
                    return None, f"{rule.id}/{exception.name}"
            self.counters.hits[rule.id] += 1
            tags = rule.tags
            decided = finding.evaluated(
                severity=rule.severity, action=rule.action, rule=rule.id, message=finding.message, tags=tags
            )
            message = rule.output.render(decided)
            evaluated = decided.evaluated(
                severity=rule.severity, action=rule.action, rule=rule.id, message=message, tags=tags
            )
            return evaluated, ""
        return self._unmatched(finding), ""

    def _holds(
        self, rule: Rule, condition: Condition, fields: dict[str, Any], *, failed: bool, name: str = ""
    ) -> bool:
        """The condition's value; `failed` when it cannot be evaluated (counted)."""
        try:
            return condition.evaluate(fields)
        except ConditionRuntimeError as error:
            self.counters.runtime_errors[rule.id] += 1
            where = f"rule {rule.id}" + (f" exception {name}" if name else "")
            self.counters.last_error = f"{where}: {error}"
            return failed

    def _unmatched(self, finding: Finding) -> Finding:
        self.counters.unmatched += 1
        where = f" on {clean(finding.node)}" if finding.node else ""
        message = f"{clean(finding.finding)} finding{where} matched no rule"
        if finding.message:
            message += f": {clean(finding.message)}"
        return finding.evaluated(
            severity=UNMATCHED_SEVERITY,
            action=UNMATCHED_ACTION,
            rule=UNMATCHED_RULE,
            message=message,
            tags=finding.tags,
        )

    def __repr__(self) -> str:
        return f"Ruleset({len(self.rules)} rules)"
