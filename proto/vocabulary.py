"""The finding kinds and severities of the event contract (EVENTS.md, "Findings"): one list,
read by the ledger that raises findings and by the clients that filter them.

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
)
SEVERITIES: tuple[str, ...] = ("critical", "high", "medium", "low", "info")
