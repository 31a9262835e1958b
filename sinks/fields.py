"""What every encoding of an alert shares: its severity's rank and number in each format,
whether its action stopped the request, its stable id, its time, and the synthetic alert an
output sends in-band when it had to drop alerts.

Invariant: an alert's uid is a function of its cursor (the audit record's id) alone, so the
same alert forwarded twice (a retry, a replay) is recognised as one by the receiving SIEM;
severities and actions unknown to this version map to "unknown", never to an error.
"""

from __future__ import annotations

import socket
import time

from kvguard import __version__
from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.vocabulary import KILL_ACTIONS, SEVERITIES

PRODUCT = "kvguard"
VENDOR = "kvguard"
VERSION = __version__
DROPPED_FINDING = "alerts_dropped"  # the synthetic alert's kind (not a ledger finding)
FORWARDER_RULE = "kvguard.forwarder"
BLOCKING_ACTIONS = KILL_ACTIONS | {"deny"}  # the request (or the share) did not go on


def severities_from(lowest: str) -> frozenset[str]:
    """The severities at `lowest` or above (SEVERITIES runs from critical down to info)."""
    if lowest not in SEVERITIES:
        raise ValueError(f"{lowest!r} is not a severity (one of {', '.join(SEVERITIES)})")
    return frozenset(SEVERITIES[: SEVERITIES.index(lowest) + 1])


STOPPING_OUTCOMES = frozenset({"stopped", "killed"})  # daemon/outcomes.py: the request was ended


def outcome(f: pb.Finding) -> str:
    """What is known of the offending request's fate when the alert goes out: an update's
    outcome (daemon/outcomes.py: stopped, killed, reached_client, aborted, unknown); `ordered`
    for a finding whose action stops the request (whether it did is said by its update);
    `allowed` for one whose action only reports; "" for none."""
    if f.details.get("outcome"):
        return f.details["outcome"]
    if f.action in BLOCKING_ACTIONS:
        return "ordered"
    return "allowed" if f.action else ""


def blocked(f: pb.Finding) -> bool:
    """Whether the offending request is known to have been stopped: an update says it was
    (an order to stop it is not a stop: it may come after the response left)."""
    return outcome(f) in STOPPING_OUTCOMES


def update_of(f: pb.Finding) -> int:
    """The cursor of the alert this one updates (its outcome), 0 for a new finding."""
    value = f.details.get("update_of", "")
    return int(value) if value.isdigit() else 0


def occurrences(f: pb.Finding) -> tuple[int, int, int]:
    """A run's summary (daemon/repeats.py): (how many findings it was, the first's and the
    last's time in ns); (0, 0, 0) for any other alert."""
    repeats, first, last = (f.details.get(k, "") for k in ("repeats", "first_ns", "last_ns"))
    if not (repeats.isdigit() and first.isdigit() and last.isdigit()):
        return 0, 0, 0
    return 1 + int(repeats), int(first), int(last)


def uid(alert: svc.Alert) -> str:
    """The alert's stable id: its cursor; a drop notice's names the cursors it stands for; an
    outcome's is the uid of the finding it updates (a SIEM updates that one)."""
    if alert.finding.finding == DROPPED_FINDING:
        details = alert.finding.details
        return f"kvguard-dropped-{details['first_cursor']}-{details['last_cursor']}"
    return f"kvguard-{update_of(alert.finding) or alert.cursor}"


def time_ns(alert: svc.Alert) -> int:
    """When the finding happened (its event's clock); now for one that carries no time."""
    return alert.finding.ts_ns or time.time_ns()


def dropped_notice(output: str, count: int, first_cursor: int, last_cursor: int) -> svc.Alert:
    """The alert an output sends in place of `count` alerts it dropped (cursors from
    `first_cursor` to `last_cursor`): the SIEM sees the gap, and where to read it back from
    the audit log (`kvguard audit` after first_cursor - 1)."""
    return svc.Alert(
        cursor=0,
        finding=pb.Finding(
            finding=DROPPED_FINDING,
            severity="high",
            action="alert",
            rule=FORWARDER_RULE,
            node=socket.gethostname(),
            ts_ns=time.time_ns(),
            message=(
                f"{count} alert(s) dropped by output {output} (its queue was full: the output is slow "
                f"or down); cursors {first_cursor} to {last_cursor} are in the daemon's audit log"
            ),
            details={
                "dropped": str(count),
                "first_cursor": str(first_cursor),
                "last_cursor": str(last_cursor),
                "output": output,
            },
        ),
    )
