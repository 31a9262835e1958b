"""A service's log as its records (proto/logs.py's text format): each line without the time and
level it starts with, so a test reads what was said ("kvguard daemon: ...")."""

from __future__ import annotations

import re

PREFIX = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (?:debug|info|warning|error|critical)\s+")


def said(text: str) -> list[str]:
    """The records of `text` (a service's stderr), each as "kvguard <component>: <message>"."""
    return [PREFIX.sub("", line) for line in text.splitlines()]
