"""The finding kinds and severities of the event contract (docs/integrator.md, "Findings"): one list,
read by the ledger that raises findings and by the clients that filter them; and the kinds of
the findings kvguard raises about itself (INTERNAL_KINDS), which no detector raises and no
rule judges: they are stored and sent to subscribers like the others.

Invariant: names are only ever added, never renamed (they are stored in audit records).
"""

from __future__ import annotations

FINDING_KINDS: tuple[str, ...] = (
    "stale_read",
    "foreign_read",
    "use_after_free",
    "late_write",
    "double_free",
    "early_release",
    "transfer_mismatch",
    "rejected_progress",
    "config_drift",
    "cross_tenant_share",
    "anomaly",
    "unguarded_attention",
)
# The daemon's own alerts (severity and rule set by the daemon): "internal" is kvguard failing
# at something an operator must see, such as a rules reload that was refused
# (rule kvguard_reload_failed).
INTERNAL_KINDS: tuple[str, ...] = ("internal",)
SEVERITIES: tuple[str, ...] = ("critical", "high", "medium", "low", "info")
# What a rule may do about a finding. kill: end the one offending request; +quarantine: keep
# its pages out of the pool; block: refuse admission; deny: refuse the prefix share;
# alert/log: report only.
ACTIONS: tuple[str, ...] = ("kill", "kill+quarantine", "alert+quarantine", "block", "deny", "alert", "log")
KILL_ACTIONS: frozenset[str] = frozenset({"kill", "kill+quarantine", "block"})  # those that end the request
# The fleet state's counters (FleetState.counters) of the ledger's routine work; every other
# `ledger_` counter, and every `stream_` and `rejected` one, is input the daemon refused or
# could not judge: shown as such (`kvguard fleet`, metrics) until it is placed here.
# The daemon's counters of input it refused (an event's BadEvent kind, a replay, an operator's
# action, a reload) besides the `stream_`, `rejected` and `ledger_` ones: metrics and `kvguard
# fleet` show them as refusals, by reason.
REFUSALS: frozenset[str] = frozenset(
    {"malformed", "identity", "out_of_range", "handle", "tampered", "internal"}
    | {"replay_refused", "actions_refused", "reloads_refused"}
)
LEDGER_WORK: frozenset[str] = frozenset(
    {"ledger_page_transitions", "ledger_suppressed", "ledger_retired", "ledger_forgotten", "ledger_restarts"}
)
