"""What an event's fields may hold, checked at the door (the ledger) for every event that is
applied: the audit store's columns are made from these, so that nothing the ledger accepts is
something the store cannot keep (an event the store refused would stop the daemon at every
restart, its agent resending it each time).

Invariant: a value within these bounds fits every store kvguard supports (SQLite and
PostgreSQL: signed 64-bit integers, VARCHAR lengths in characters, which are never more than
the bytes counted here, and text without NUL characters).
"""

from __future__ import annotations

SEQ_MAX = 2**63 - 1  # seq and epoch: uint64 on the wire, a signed 64-bit column in the store
# How far past its node's last applied number an event's may be: numbers grow by one an event,
# so a jump beyond this is a forged or corrupt number, not events lost (2^32: days of a busy node's).
SEQ_JUMP_MAX = 2**32
NODE_BYTES = 128  # a node's name (UTF-8)
REQ_BYTES = 256  # a request's id
TENANT_BYTES = 128  # a tenant's name
# The ruleset's attention kernel name patterns, NUL-separated, as the guard's step word holds
# them for the CUDA shim (cuda_hooks/shim/record.h: KVGUARD_PATTERNS_BYTES).
ATTENTION_PATTERNS_BYTES = 8192


def unstorable(value: str, limit: int) -> str:
    """Why a store could not keep `value` in a column of `limit` bytes ("" if it can): too long
    in UTF-8, or a NUL character, which PostgreSQL's text refuses."""
    if len(value) > limit // 4 and len(value.encode()) > limit:  # cheap for the usual short names
        return f"is over {limit} bytes"
    if "\x00" in value:
        return "holds a NUL character"
    return ""
