"""The alert screen's one-line filter, as an operator types it, read into proto/filter.py's
Filter (the filter of the alert feed and of the audit queries), plus the rule ids the line
names (rules are a finer grain than the Filter's finding kinds: they are matched here).

Syntax: words `field:value[,value...]`, any order, fields severity (sev), finding (kind),
rule, tenant, node, req; a bare word that is a severity or a finding kind means that.
Examples: `critical node:d0`, `sev:critical,high tenant:acme`, `rule:stale_read_cross_tenant`.

Words of one field widen (any of the values), fields narrow (all of them); `rule:` takes a
finding kind (all its rules) or a rule id.

Invariant: `parse` returns a query or raises FilterError naming the word and the reason;
`describe(parse(text))` reads back what was understood; the empty line matches everything.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from kvguard.proto import pb
from kvguard.proto.filter import Filter
from kvguard.proto.vocabulary import FINDING_KINDS, INTERNAL_KINDS, SEVERITIES

# The daemon's vocabulary is proto/vocabulary.py's; the app adds the finding kinds its daemon's
# rules name (FleetService.Rules), so a newer daemon's kinds are accepted too.
FIELDS = {
    "severity": "severity",
    "sev": "severity",
    "finding": "finding",
    "kind": "finding",
    "rule": "rule",
    "tenant": "tenant",
    "node": "node",
    "req": "req",
    "request": "req",
}
SINGLE = ("tenant", "node", "req")  # the Filter holds one of each


class FilterError(ValueError):
    """A filter line that cannot be read; the message names the word and why."""


@dataclass(frozen=True)
class AlertQuery:
    """What the alert screen shows: the Filter, where `rules` widens its finding kinds to
    those rule ids too (an alert passes by its kind or by its rule)."""

    filter: Filter = field(default_factory=Filter)
    rules: frozenset[str] = frozenset()

    def feed_filter(self) -> Filter:
        """What the daemon is asked for: the Filter, with every kind when rules are named (the
        dashboard does not know each rule's kind; `takes` narrows)."""
        return replace(self.filter, findings=frozenset()) if self.rules else self.filter

    def takes(self, finding: pb.Finding) -> bool:
        """Whether an alert's finding passes."""
        if not self.rules:
            return self.filter.matches(finding)
        return self.feed_filter().matches(finding) and (
            finding.finding in self.filter.findings or finding.rule in self.rules
        )


def _values(word: str, name: str, text: str) -> list[str]:
    values = [v for v in text.split(",") if v]
    if not values:
        raise FilterError(f"{word!r}: {name}: needs a value (e.g. {name}:VALUE)")
    return values


def parse(text: str, known_findings: Iterable[str] = ()) -> AlertQuery:
    """The query the line `text` spells (see the module's docstring); FilterError if it cannot
    be read. `known_findings` adds finding kinds to those this dashboard knows."""
    kinds = set(FINDING_KINDS) | set(INTERNAL_KINDS) | set(known_findings)
    severities: set[str] = set()
    findings: set[str] = set()
    rules: set[str] = set()
    single: dict[str, str] = {}
    for word in text.split():
        name, colon, rest = word.partition(":")
        if not colon:
            if word.lower() in SEVERITIES:
                severities.add(word.lower())
            elif word in kinds:
                findings.add(word)
            else:
                raise FilterError(
                    f"{word!r} is neither a severity nor a finding kind; "
                    f"say field:value with field one of {', '.join(sorted(set(FIELDS.values())))}"
                )
            continue
        what = FIELDS.get(name.lower())
        if what is None:
            raise FilterError(
                f"{word!r}: unknown field {name!r} (fields: severity, finding, rule, tenant, node, req)"
            )
        values = _values(word, name, rest)
        if what == "severity":
            wrong = [v for v in values if v.lower() not in SEVERITIES]
            if wrong:
                raise FilterError(f"{word!r}: {wrong[0]!r} is not a severity ({', '.join(SEVERITIES)})")
            severities.update(v.lower() for v in values)
        elif what == "finding":
            wrong = [v for v in values if v not in kinds]
            if wrong:
                raise FilterError(
                    f"{word!r}: {wrong[0]!r} is not a finding kind ({', '.join(sorted(kinds))})"
                )
            findings.update(values)
        elif what == "rule":  # a finding kind stands for all its rules
            for value in values:
                (findings if value in kinds else rules).add(value)
        else:
            if len(values) > 1 or (what in single and single[what] != values[0]):
                raise FilterError(f"{word!r}: one {what} at a time")
            single[what] = values[0]
    return AlertQuery(
        Filter(
            findings=frozenset(findings),
            severities=frozenset(severities),
            tenant=single.get("tenant", ""),
            node=single.get("node", ""),
            req=single.get("req", ""),
        ),
        frozenset(rules),
    )


def describe(query: AlertQuery) -> str:
    """The query in the filter line's own syntax, canonical (sorted): '' for everything."""
    f = query.filter
    words = []
    if f.severities:
        words.append("severity:" + ",".join(s for s in SEVERITIES if s in f.severities))
    if f.findings:
        words.append("finding:" + ",".join(sorted(f.findings)))
    if query.rules:
        words.append("rule:" + ",".join(sorted(query.rules)))
    words += [
        f"{name}:{value}" for name, value in (("tenant", f.tenant), ("node", f.node), ("req", f.req)) if value
    ]
    return " ".join(words)
