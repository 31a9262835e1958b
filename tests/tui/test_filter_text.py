"""The alert screen's filter line, read into proto/filter.py's Filter (the one filter of the
alert feed and the audit queries): what each word means, what is refused and why, and that
`describe` reads a query back in the line's own words."""

from __future__ import annotations

import pytest

from kvguard.proto import pb
from kvguard.proto.filter import Filter
from kvguard.tui.filter_text import AlertQuery, FilterError, describe, parse


def test_the_empty_line_is_everything() -> None:
    assert parse("") == AlertQuery() and parse("   ") == AlertQuery()
    assert describe(parse("")) == ""


def test_fields_and_bare_words_make_one_filter() -> None:
    query = parse("critical sev:HIGH,low finding:stale_read,double_free tenant:acme node:d0 req:g1")
    assert query.filter == Filter(
        severities=frozenset({"critical", "high", "low"}),
        findings=frozenset({"stale_read", "double_free"}),
        tenant="acme",
        node="d0",
        req="g1",
    )
    assert query.rules == frozenset()
    assert parse("stale_read").filter.findings == {"stale_read"}  # a bare finding kind
    assert parse("kind:anomaly request:r9").filter == Filter(findings=frozenset({"anomaly"}), req="r9")


def test_a_rule_is_its_finding_kind_or_matched_by_its_id() -> None:
    query = parse("rule:stale_read_cross_tenant,transfer_mismatch critical")
    assert query.filter.findings == {"transfer_mismatch"}  # a finding kind stands for all its rules
    assert query.rules == {"stale_read_cross_tenant"}
    # the daemon is asked for every kind (it is the rule that narrows), the rest of the filter kept
    assert query.feed_filter() == Filter(severities=frozenset({"critical"}))
    own = pb.Finding(finding="stale_read", rule="stale_read_cross_tenant", severity="critical")
    other = pb.Finding(finding="stale_read", rule="stale_read", severity="critical")
    mismatch = pb.Finding(finding="transfer_mismatch", rule="transfer_mismatch", severity="critical")
    low = pb.Finding(finding="transfer_mismatch", rule="transfer_unconfirmed", severity="low")
    assert [query.takes(f) for f in (own, other, mismatch, low)] == [True, False, True, False]
    assert parse("rule:transfer_mismatch").feed_filter().findings == {"transfer_mismatch"}


def test_the_filter_takes_a_tenant_or_request_as_offender_or_victim() -> None:
    leak = pb.Finding(finding="stale_read", severity="critical", node="d0", req="g1", tenant="globex")
    leak.victim_req, leak.victim_tenant = "a1", "acme"
    assert parse("tenant:acme").takes(leak) and parse("tenant:globex").takes(leak)
    assert parse("req:a1 node:d0 critical").takes(leak)
    assert not parse("tenant:initech").takes(leak) and not parse("node:p0").takes(leak)
    assert not parse("high").takes(leak)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("sev:urgent", "'sev:urgent': 'urgent' is not a severity (critical, high, medium, low, info)"),
        ("finding:stale", "'finding:stale': 'stale' is not a finding kind"),
        ("colour:red", "'colour:red': unknown field 'colour' (fields: severity, finding, rule, tenant"),
        ("acme", "'acme' is neither a severity nor a finding kind; say field:value"),
        ("tenant:", "'tenant:': tenant: needs a value (e.g. tenant:VALUE)"),
        ("node:a,b", "'node:a,b': one node at a time"),
        ("node:a node:b", "'node:b': one node at a time"),
    ],
)
def test_a_line_that_cannot_be_read_says_which_word_and_why(line: str, says: str) -> None:
    with pytest.raises(FilterError) as refused:
        parse(line)
    assert str(refused.value).startswith(says)


def test_a_newer_daemons_finding_kinds_are_accepted_when_its_rules_name_them() -> None:
    with pytest.raises(FilterError):
        parse("finding:page_poisoning")
    newer = parse("finding:page_poisoning", known_findings=["page_poisoning"])
    assert newer.filter.findings == {"page_poisoning"}


def test_describe_reads_a_query_back_and_parses_to_the_same_query() -> None:
    line = "node:d0 rule:stale_read_cross_tenant high critical tenant:acme finding:double_free req:g1"
    query = parse(line)
    text = describe(query)
    assert text == (
        "severity:critical,high finding:double_free rule:stale_read_cross_tenant tenant:acme node:d0 req:g1"
    )
    assert parse(text) == query


def test_kvguards_own_alerts_are_a_kind_the_filter_takes() -> None:
    # a refused rules reload is a critical alert of kind "internal" (proto/vocabulary.py)
    assert parse("internal critical").filter.findings == frozenset({"internal"})
