"""The shipped Prometheus alert rules (deploy/prometheus/kvguard-alerts.yml), by promtool:
they load (`check rules`), and given series shaped as kvguard exports them, each fires when it
must and stays quiet when it must not (`test rules`). Every metric a rule names is one kvguard
exports (by name, in the code that exports it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy/prometheus/kvguard-alerts.yml"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian's prometheus) is not installed")

DESCRIPTIONS = {
    rule["alert"]: rule["annotations"]["description"]
    for group in yaml.safe_load(RULES.read_text())["groups"]
    for rule in group["rules"]
}
STALE = 'kvguard_findings_total{kind="stale_read",rule="stale_read_cross_tenant",severity="critical"}'
EARLY = 'kvguard_findings_total{kind="early_release",rule="early_release",severity="high"}'


def fires(alert: str, at: str, summary: str = "", **labels: str) -> dict:
    """promtool's expectation: `alert` firing at `at` with `labels` and `summary` (its
    description is the rule's own text), or not firing at all (no labels)."""
    firing = {
        "exp_labels": labels,
        "exp_annotations": {"summary": summary, "description": DESCRIPTIONS[alert]},
    }
    return {"eval_time": at, "alertname": alert, "exp_alerts": [firing] if labels else []}


# Series as kvguard exports them, and what must fire (promtool's unit-test format).
CASES = {
    "rule_files": [str(RULES)],
    "evaluation_interval": "1m",
    "tests": [
        {
            "interval": "1m",
            "input_series": [
                # p0's pool: 96 tokens under a 1024 context; d0's holds its context.
                {"series": 'kvguard_pool_capacity_tokens{node="p0",pool="0"}', "values": "96x5"},
                {"series": 'kvguard_pool_context_tokens{node="p0",pool="0"}', "values": "1024x5"},
                {"series": 'kvguard_pool_capacity_tokens{node="d0",pool="0"}', "values": "1024x5"},
                {"series": 'kvguard_pool_context_tokens{node="d0",pool="0"}', "values": "1024x5"},
                # Two critical stale reads at minute 2; high ones never page as critical.
                {"series": STALE, "values": "0 0 2 2 2 2"},
                {"series": EARLY, "values": "0 1 2 3 4 5"},
                {"series": 'kvguard_node_canary_late{node="d0"}', "values": "0 0 0 1 1 1"},
                {"series": 'kvguard_alerts_dropped_total{output="siem"}', "values": "0 0 0 0 3 3"},
                {"series": 'kvguard_alerts_rejected_total{output="siem"}', "values": "0x5"},
            ],
            "alert_rule_test": [
                fires(
                    "KvguardPoolCannotHoldItsContext",
                    "3m",
                    "kvguard: pool 0 of p0 holds fewer tokens than the context the engine advertises",
                    severity="critical",
                    node="p0",
                    pool="0",
                ),
                fires(
                    "KvguardCriticalFinding",
                    "3m",
                    "kvguard: 2 critical stale_read finding(s) in 5 minutes (stale_read_cross_tenant)",
                    severity="critical",
                    kind="stale_read",
                    rule="stale_read_cross_tenant",
                ),
                fires("KvguardCriticalFinding", "1m"),
                fires("KvguardCanaryLate", "3m"),  # late for less than its minute
                fires(
                    "KvguardCanaryLate",
                    "5m",
                    "kvguard: d0's self-test canary has not come back",
                    severity="critical",
                    node="d0",
                ),
                fires(
                    "KvguardAlertsUndelivered",
                    "5m",
                    "kvguard alerts: output siem lost 3 alert(s) in 10 minutes",
                    severity="warning",
                    output="siem",
                ),
                fires("KvguardAlertsUndelivered", "3m"),
            ],
        }
    ],
}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


def test_promtool_loads_the_rules() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 9 rules found" in done.stdout


def test_each_rule_fires_when_it_must_and_not_before(tmp_path: Path) -> None:
    cases = tmp_path / "cases.yml"
    cases.write_text(yaml.safe_dump(CASES, sort_keys=False))
    done = promtool("test", "rules", str(cases))
    assert done.returncode == 0, done.stdout + done.stderr


def exported_text() -> str:
    """The source of every part that exports metrics."""
    parts = ("daemon", "agents", "proto", "sinks", "cli")
    return "".join(p.read_text() for part in parts for p in (REPO / part).rglob("*.py"))


def test_every_metric_the_rules_name_is_one_kvguard_exports() -> None:
    exported = exported_text()
    named = set(re.findall(r"\b(kvguard_[a-z_]+)", RULES.read_text()))
    for metric in named:
        base = metric.removesuffix("_total")
        assert f'"{base}"' in exported or f'"{metric}"' in exported, metric


def test_the_grafana_dashboard_asks_only_for_what_kvguard_exports(tmp_path: Path) -> None:
    import json

    dashboard = json.loads((REPO / "deploy/grafana/kvguard-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert exprs and all(panel["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"])
    rules_text = RULES.read_text()
    exported = exported_text()
    for metric in set(re.findall(r"\b(kvguard_[a-z_]+)", " ".join(exprs))):
        base = metric.removesuffix("_total").removesuffix("_bucket")
        assert f'"{base}"' in exported or metric in rules_text, metric
    # Each query parses as PromQL: promtool checks a recording rule made of each.
    records = [{"record": f"kvguard:panel{i}", "expr": expr} for i, expr in enumerate(exprs)]
    panels = tmp_path / "panels.yml"
    panels.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": records}]}))
    done = promtool("check", "rules", str(panels))
    assert done.returncode == 0 and f"SUCCESS: {len(exprs)} rules found" in done.stdout, (
        done.stdout + done.stderr
    )
