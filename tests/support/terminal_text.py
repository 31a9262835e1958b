"""What a terminal was sent, as text: control sequences taken out (the dashboard's tests read
the screen a real pseudo-terminal received)."""

from __future__ import annotations

import re

ANSI = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>]")


def plain(data: bytes | bytearray) -> str:
    """What a terminal was sent, its control sequences taken out."""
    return ANSI.sub(b"", bytes(data)).decode("utf-8", "replace").replace("\r", "")
