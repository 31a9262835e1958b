"""Whether a loaded configuration can run (`kvguard config check`): beyond each value's own
type, the files it names exist and the service's user can read them, and a rules directory
holds rules that load.

Invariant: every problem is one line naming the section, the option, the file and the reason,
with what to do; nothing is changed.
"""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path
from typing import Any

SERVICE_USER = "kvguard"  # deploy/systemd/kvguard-daemon.service: User=
FILES = ("tls-ca", "tls-cert", "tls-key", "tls-crl")


def problems(section: str, values: dict[str, Any]) -> list[str]:
    """What stops `section` (daemon, agent) from running with these option values."""
    found = []
    for name in FILES:
        if values.get(name):
            why = _unreadable(Path(str(values[name])))
            if why:
                found.append(f"{section}: {name}: {values[name]}: {why}")
    if values.get("tls-crl") and all(
        os.access(str(values.get(n) or ""), os.R_OK) for n in ("tls-crl", "tls-ca")
    ):
        why = _not_the_cas(str(values["tls-crl"]), values.get("tls-ca"))
        if why:
            found.append(f"{section}: tls-crl: {values['tls-crl']}: {why}")
    if section == "daemon" and values.get("rules"):
        why = _no_rules(Path(str(values["rules"])))
        if why:
            found.append(f"daemon: rules: {values['rules']}: {why}")
    return found


def _not_the_cas(crl: str, ca: Any) -> str:
    """Why the CRL cannot be used with the CA `ca`; "" if it can."""
    from kvguard.proto.crl import Crl, CrlError

    try:
        Crl.load(crl, Path(str(ca)).read_bytes())
    except CrlError as exc:
        return str(exc).split(": ", 1)[-1]
    return ""


def _unreadable(path: Path) -> str:
    if not path.is_file():
        return "no such file"
    if not os.access(path, os.R_OK):
        return "this user cannot read it"
    try:
        user = pwd.getpwnam(SERVICE_USER)
    except KeyError:
        return ""  # no service user on this host: the unit's user is whoever runs it
    if os.geteuid() == user.pw_uid or _readable_by(path, user):
        return ""
    st = path.stat()
    return (
        f"the {SERVICE_USER} user the service runs as cannot read it (owner uid {st.st_uid}, mode "
        f"{stat.S_IMODE(st.st_mode):o}): chown {SERVICE_USER} {path}"
    )


def _readable_by(path: Path, user: pwd.struct_passwd) -> bool:
    groups = set(os.getgrouplist(user.pw_name, user.pw_gid))
    for step in [*reversed(path.parents), path]:  # every directory on the way, then the file
        st = step.stat()
        mode, need = stat.S_IMODE(st.st_mode), (0o1 if step != path else 0o4)
        if st.st_uid == user.pw_uid:
            allowed = mode & (need << 6)
        elif st.st_gid in groups:
            allowed = mode & (need << 3)
        else:
            allowed = mode & need
        if not allowed:
            return False
    return True


def _no_rules(path: Path) -> str:
    from kvguard.ruleset import RulesetError, load_ruleset

    if not path.is_dir():
        return "no such directory"
    if not any(p.suffix in (".yaml", ".yml") for p in path.iterdir()):
        return f"holds no rules (*.yaml): `kvguard rules install {path}` copies the bundled ones there"
    try:
        load_ruleset(path)
    except RulesetError as exc:
        return f"its rules do not load: {exc.errors[0] if exc.errors else exc}"
    return ""
