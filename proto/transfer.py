"""The framing of a KV transfer over TCP, as kvguard's wire decoders read it.

One message = a 12-byte header (JSON length: uint32, payload length: uint64, big-endian),
the JSON object, then the payload. A message is a KV transfer when its JSON has
`"op": "kv"` and names its transfer in `"xfer"`; its payload is the KV. An engine whose
transport frames its transfers this way is followed byte for byte by the eBPF witness
(cuda_hooks/tcp_stream.py); the testbed's links use it (testbed/wire.py).
"""

from __future__ import annotations

import json
import re
import struct

HEADER = struct.Struct(">IQ")  # JSON length, payload length
MAX_JSON = 1 << 20
MAX_PAYLOAD = 1 << 34
KV_OP = "kv"
_KV = re.compile(rb'"op"\s*:\s*"kv"')
_XFER = re.compile(rb'"xfer"\s*:\s*"([^"\\]{1,256})"')


def transfer_of(head: bytes) -> str:
    """The xfer a message's JSON names if it is a KV transfer, else "" (from as much of the
    JSON as was captured: a truncated head is searched for the two fields)."""
    try:
        obj = json.loads(head)
    except ValueError:  # truncated: what the captured part says
        xfer = _XFER.search(head)
        return xfer.group(1).decode() if xfer and _KV.search(head) else ""
    named = obj.get("xfer") if isinstance(obj, dict) and obj.get("op") == KV_OP else None
    return named if isinstance(named, str) else ""
