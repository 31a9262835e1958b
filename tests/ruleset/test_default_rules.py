"""The default rules: they load, match every kind, and decide and word the incident's findings."""

from __future__ import annotations

import pytest
from rule_files import leak

from kvguard.ledger.findings import ACTIONS, KINDS, SEVERITIES, Finding
from kvguard.ruleset import (
    DEFAULT_RULES_DIR,
    Rule,
    load_ruleset,
)


def test_default_rules_load() -> None:
    ruleset = load_ruleset()
    ids = [rule.id for rule in ruleset.rules]
    assert len(ids) == len(set(ids)) >= len(KINDS)
    assert sorted(p.name for p in DEFAULT_RULES_DIR.glob("*.yaml")) == [
        "10-leaks.yaml",
        "20-lifetime.yaml",
        "30-transfer.yaml",
        "40-config.yaml",
        "50-witness.yaml",
        "90-anomaly.yaml",
    ]
    for rule in ruleset.rules:
        assert isinstance(rule, Rule)
        assert rule.enabled and rule.description and rule.output.source
        assert rule.severity in SEVERITIES and rule.action in ACTIONS
        assert rule.path is not None and rule.path.parent == DEFAULT_RULES_DIR and rule.line > 0


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_matched_by_a_default_rule(kind: str) -> None:
    ruleset = load_ruleset()
    bare = ruleset.evaluate(Finding(finding=kind, node="n0"))
    full = ruleset.evaluate(leak(finding=kind))
    for result in (bare, full):
        assert result is not None
        assert result.rule in ruleset.counters.hits
        assert kind in next(rule.kinds for rule in ruleset.rules if rule.id == result.rule)
        assert result.message and "{" not in result.message
    assert ruleset.counters.unmatched == 0
    assert ruleset.counters.errors == 0


@pytest.mark.parametrize(
    ("finding", "rule", "severity", "action"),
    [
        (leak(), "stale_read_cross_tenant", "critical", "kill"),
        (leak(victim_tenant="acme"), "stale_read", "high", "kill"),
        (leak(victim_tenant=""), "stale_read", "high", "kill"),
        (leak(finding="foreign_read"), "foreign_read_cross_tenant", "critical", "kill"),
        (leak(finding="foreign_read", victim_tenant=""), "foreign_read", "high", "kill"),
        (leak(finding="use_after_free"), "use_after_free", "critical", "kill+quarantine"),
        (leak(finding="late_write"), "late_write", "critical", "kill+quarantine"),
        (leak(finding="double_free"), "double_free_live_page", "critical", "alert+quarantine"),
        (
            leak(finding="double_free", victim_req="", victim_tenant=""),
            "double_free",
            "high",
            "alert+quarantine",
        ),
        (leak(finding="early_release"), "early_release_cross_tenant", "critical", "alert+quarantine"),
        (leak(finding="early_release", victim_tenant="acme"), "early_release", "high", "alert+quarantine"),
        (leak(finding="transfer_mismatch"), "transfer_mismatch", "critical", "kill"),
        (leak(finding="rejected_progress"), "rejected_progress", "critical", "kill"),
        (leak(finding="config_drift"), "config_drift_admission", "critical", "block"),
        (Finding("config_drift", node="p0", pool=0), "config_drift", "critical", "alert"),
        (leak(finding="cross_tenant_share"), "cross_tenant_share", "high", "deny"),
        (leak(finding="anomaly"), "anomaly", "medium", "alert"),
    ],
)
def test_default_rule_decisions(finding: Finding, rule: str, severity: str, action: str) -> None:
    result = load_ruleset().evaluate(finding)
    assert result is not None
    assert (result.rule, result.severity, result.action) == (rule, severity, action)


def test_default_stale_read_cross_tenant_output() -> None:
    result = load_ruleset().evaluate(leak())
    assert result is not None
    assert (
        result.message == "acme request r2 on d0 read KV written by globex request r1 (pool 0, pages 7-13,20)"
    )
    assert result.tags == ("leak", "cross-tenant")
    assert (result.node, result.req, result.pages, result.seq) == ("d0", "r2", leak().pages, 42)


def test_default_config_drift_output_includes_detector_message() -> None:
    finding = Finding("config_drift", node="p0", pool=0, message="pool 681280 tokens < context 1048576.")
    result = load_ruleset().evaluate(finding)
    assert result is not None
    assert result.message == "KV pool misconfigured on p0: pool 681280 tokens < context 1048576."


def test_evaluate_returns_a_copy() -> None:
    finding = leak()
    result = load_ruleset().evaluate(finding)
    assert result is not None and result is not finding
    assert finding.rule == "" and finding.message == "r2 read 8 pages written by r1"
