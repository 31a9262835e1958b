"""`kvguard replay`: run a capture through the ledger and the ruleset, in capture order.

Invariant: every line of the capture is accounted for exactly once in the summary, as an
applied event, a repeat that was skipped, or a bad line reported with its number and reason;
a bad line never stops the replay, and nothing valid is dropped. The capture's end settles
every verdict still waiting (Ledger.end_capture): nothing is left pending silently.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvguard.ledger import BadEvent, Ledger
from kvguard.ledger.findings import SEVERITIES, Finding
from kvguard.proto.capture import CaptureError, read_capture
from kvguard.ruleset import Ruleset


@dataclass(slots=True)
class ReplaySummary:
    lines: int = 0  # event lines read (blank and comment lines excluded)
    applied: int = 0
    repeats: int = 0
    bad: int = 0
    missing: int = 0  # sequence numbers skipped by gaps
    findings: Counter[str] = field(default_factory=Counter)  # by kind, after the ruleset
    severities: Counter[str] = field(default_factory=Counter)
    suppressed: int = 0  # by rule exceptions
    page_transitions: int = 0
    seconds: float = 0.0

    @property
    def total_findings(self) -> int:
        return sum(self.findings.values())

    def text(self, source: str) -> str:
        parts = [f"replayed {self.applied} of {self.lines} events from {source} in {self.seconds:.3f}s"]
        if self.bad or self.repeats or self.missing:
            parts.append(
                f"{self.bad} bad line(s) skipped, {self.repeats} repeat(s) skipped, "
                f"{self.missing} sequence number(s) missing"
            )
        parts.append(f"{self.page_transitions} page transitions")
        if self.total_findings:
            sev = ", ".join(f"{self.severities[s]} {s}" for s in SEVERITIES if self.severities[s])
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.findings.items()))
            parts.append(f"{self.total_findings} finding(s) ({sev}): {kinds}")
        else:
            parts.append("no findings")
        if self.suppressed:
            parts.append(f"{self.suppressed} suppressed by rule exceptions")
        return "; ".join(parts)


def replay(
    lines: Iterable[str | bytes],
    ruleset: Ruleset,
    on_finding: Callable[[Finding], None],
    on_error: Callable[[CaptureError], None],
    ledger: Ledger | None = None,
) -> ReplaySummary:
    """Apply each line of a capture; report findings and bad lines through the callbacks. At
    its end, the verdicts still waiting are settled and reported as well."""
    ledger = ledger if ledger is not None else Ledger()
    summary = ReplaySummary()
    started = time.perf_counter()

    def judged(findings: Iterable[Finding]) -> None:
        for raw in findings:
            finding = ruleset.evaluate(raw)
            if finding is None:
                summary.suppressed += 1
                continue
            summary.findings[finding.finding] += 1
            summary.severities[finding.severity] += 1
            on_finding(finding)

    for number, item in read_capture(lines):
        summary.lines += 1
        if isinstance(item, CaptureError):
            summary.bad += 1
            on_error(item)
            continue
        try:
            findings = ledger.apply(item)
        except BadEvent as exc:
            if exc.kind == "repeat":
                summary.repeats += 1
            else:
                summary.bad += 1
            on_error(CaptureError(number, str(exc)))
            continue
        summary.applied += 1
        if ledger.last_missing:
            summary.missing += ledger.last_missing
            on_error(
                CaptureError(
                    number,
                    f"sequence gap on node {item.node}: {ledger.last_missing} event(s) before seq {item.seq} "
                    "are missing or were rejected (the event was applied)",
                )
            )
        judged(findings)
    judged(ledger.end_capture())
    summary.page_transitions = ledger.stats.page_transitions
    summary.seconds = time.perf_counter() - started
    return summary


def format_text(finding: Finding) -> str:
    """One finding as a line for people."""
    where = f"{finding.node} seq {finding.seq}" if finding.seq else finding.node
    return f"{finding.severity.upper():8} {finding.action:16} {finding.rule} [{where}] {finding.message}"
