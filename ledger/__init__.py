"""The page-ownership ledger and its detectors: one implementation, used by the in-engine guard
(one node) and by the daemon (every node).

`Ledger` (ledger.py) is the facade; one module per concept owns each part of its state:
pages.py (a pool's page records), requests.py (requests, their numbers, retirement),
pools.py (nodes, pool reports, config drift), ownership.py (page events and their detectors),
access.py (the judgment of reads and writes), transfers.py (transfers between nodes),
lifecycle.py (admission, pairing, the end of a request), findings.py (what is reported, and
BadEvent), snapshot.py (the state as bytes). The loops over pages are C (pages.h, _pages.c, runs.c).
"""

from kvguard.ledger.findings import BadEvent, Finding
from kvguard.ledger.ledger import CLOCK_SKEW_NS, Ledger, LedgerStats

__all__ = ["CLOCK_SKEW_NS", "BadEvent", "Finding", "Ledger", "LedgerStats"]
