"""The `kvguard` system user the units run as, made on this host as the packaged sysusers.d
snippet makes it, so that every test that depends on it (config check's readability checks,
the installed daemon) sees the same host whatever ran before: as root it is made (idempotent),
otherwise whether it exists decides."""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

SYSUSERS = Path(__file__).resolve().parents[2] / "deploy/systemd/kvguard.sysusers.conf"


def service_user() -> bool:
    """Whether the host has the `kvguard` user (made here when running as root)."""
    if os.geteuid() == 0:
        made = subprocess.run(["systemd-sysusers", str(SYSUSERS)], capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
    try:
        pwd.getpwnam("kvguard")
    except KeyError:
        return False
    return True
