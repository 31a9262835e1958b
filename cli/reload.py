"""A running daemon's reload, on SIGHUP or when its configuration or rules change on disk
(and the agent's, on SIGHUP: its log settings).

The configuration is read again as at start (kvguard.yaml, conf.d, the environment, the same
flags) and the rules and the CRL are loaded again. What can change live takes effect: the
rules, the CRL (--tls-crl: a certificate it now revokes loses its open streams at once),
--log-level, --log-format; any other setting that changed is said to wait for the next start.

Invariant: all or nothing. A configuration, a rule set or a CRL that does not load changes
nothing, is logged as an error and raises the daemon's critical alert (rule
kvguard_reload_failed).
"""

from __future__ import annotations

import argparse
import time
from logging import Logger
from pathlib import Path
from typing import TYPE_CHECKING

from kvguard.cli.config import ConfigError, files, reread
from kvguard.proto.logs import configure as configure_logs
from kvguard.proto.logs import logger

if TYPE_CHECKING:
    from kvguard.daemon.daemon import Daemon
    from kvguard.daemon.service import Server
    from kvguard.proto.crl import Crl
    from kvguard.proto.sd_notify import Notifier

log = logger("daemon")

LIVE = ("rules", "tls_crl", "log_level", "log_format")  # the settings a reload applies
NOT_SETTINGS = {"func", "command", "argv", "config"}  # what the parsed namespace holds besides
SETTLE_S = 0.2  # a change is read once the files stop changing for this long (an editor's save)

Fingerprint = tuple[tuple[str, int, int], ...]


def watched(args: argparse.Namespace) -> list[Path]:
    """The files a reload reads again: the configuration's, the rules directory, the CRL."""
    argv = getattr(args, "argv", None)
    config = files(argv) if argv is not None else []
    crl = getattr(args, "tls_crl", None)
    rules = [Path(args.rules)] if args.rules else []  # bundled rules: fixed
    return config + rules + ([Path(crl)] if crl else [])


def fingerprint(paths: list[Path]) -> Fingerprint:
    """What changes when one of the files (or a rules directory's files) changes."""
    seen = []
    for path in paths:
        inside = sorted(path.rglob("*")) if path.is_dir() else [path]
        for file in inside:
            try:
                stat = file.stat()
            except OSError:
                seen.append((str(file), -1, -1))  # gone (or not there yet)
                continue
            if not file.is_dir():
                seen.append((str(file), stat.st_mtime_ns, stat.st_size))
    return tuple(seen)


class Reloader:
    """The daemon's settings as last applied, and what to watch for changes."""

    def __init__(
        self,
        args: argparse.Namespace,
        daemon: Daemon,
        notifier: Notifier,
        port: int,
        server: Server | None = None,
        seen: Fingerprint | None = None,
    ) -> None:
        self.args, self.daemon, self.notifier, self.port = args, daemon, notifier, port
        self.server = server
        self.argv: list[str] | None = getattr(args, "argv", None)  # None: not from the command line
        # `seen`: taken before the files were first read, so that a change made while the
        # daemon started is the first reload's, not lost.
        self.seen = seen if seen is not None else fingerprint(watched(args))

    def _watched(self) -> list[Path]:
        return watched(self.args)

    def changed(self) -> bool:
        """Whether a watched file changed since the last reload (once it has settled)."""
        now = fingerprint(self._watched())
        if now == self.seen:
            return False
        while True:
            time.sleep(SETTLE_S)
            settled = fingerprint(self._watched())
            if settled == now:
                return True
            now = settled

    def reload(self, why: str) -> None:
        """Read the configuration and the rules again and apply them, or refuse them whole."""
        self.notifier.reloading(f"reloading ({why})")
        # What is read next is what this reload applies: a change made while it runs is the
        # next reload's (taken after the read, it would go unseen).
        self.seen = fingerprint(self._watched())
        fresh = self.args
        if self.argv is not None:
            try:
                fresh = reread(self.argv)
            except ConfigError as exc:
                self._refused("configuration reload", str(exc))
                return
        try:
            crl = self._load_crl(fresh)
        except ValueError as exc:
            self._refused("CRL reload", str(exc))
            return
        change = self._reload_rules(Path(fresh.rules) if fresh.rules else None)
        if change is None:
            return
        if self.server is not None and self.server.tls is not None:
            for cut in self.server.revoke(crl):
                log.warning(f"cut {cut}")
        configure_logs(fresh.log_level, fresh.log_format)
        say_later(self.args, fresh, LIVE, log)
        moved = fresh.rules != self.args.rules or fresh.tls_crl != self.args.tls_crl
        for dest in LIVE:
            setattr(self.args, dest, getattr(fresh, dest))
        if moved:  # the rules directory watched is another one now
            self.seen = fingerprint(self._watched())
        self.notifier.ready(f"serving on port {self.port}; reloaded ({why}): rules {change}")

    def _load_crl(self, fresh: argparse.Namespace) -> Crl | None:
        """The CRL `fresh` names, checked against the CA the server runs with."""
        from kvguard.cli.daemon import load_crl

        if self.server is None:
            return None
        return load_crl(fresh, self.server.tls)

    def _refused(self, what: str, reason: str) -> None:
        from kvguard.daemon.daemon import RELOAD_FAILED_RULE

        # The alert first: whatever the log line is seen before comes after the alert in the log.
        self.daemon.refuse_reload(what, [reason])
        log.error(
            f"{what} refused; the previous settings stay in force (alert {RELOAD_FAILED_RULE}): {reason}"
        )
        self.notifier.ready(f"serving on port {self.port}; the last reload was refused (see the log)")

    def _reload_rules(self, rules: Path | None) -> str | None:
        """The rules at `rules` checked, then in force; or, if they do not load, the old ones
        kept, the reasons said (file, line, why) and the daemon's critical alert stored."""
        from kvguard.daemon.daemon import RELOAD_FAILED_RULE
        from kvguard.ruleset import RulesetError

        where = str(rules) if rules is not None else "the bundled rules"
        try:
            change = self.daemon.reload_rules(rules)
        except RulesetError as exc:
            log.error(
                f"rules reload from {where} refused; the previous settings stay in force "
                f"(alert {RELOAD_FAILED_RULE}):\n{exc}"
            )
            self.notifier.ready(
                f"serving on port {self.port}; the last rules reload was refused (see the log)"
            )
            return None
        except TimeoutError:  # the loop did not take them: the watchdog, if any, restarts the daemon
            log.warning(f"rules reload from {where}: the daemon's loop did not answer")
            self.notifier.ready(f"serving on port {self.port}; the last rules reload did not finish")
            return None
        log.info(f"rules reloaded from {where}: {change}")
        return str(change)


def say_later(
    args: argparse.Namespace, fresh: argparse.Namespace, live: tuple[str, ...], said: Logger
) -> None:
    """Say which changed settings wait for the next start (those not in `live`)."""
    later = sorted(
        "--" + dest.replace("_", "-")
        for dest, value in vars(fresh).items()
        if dest not in NOT_SETTINGS and dest not in live and value != getattr(args, dest, None)
    )
    if later:
        said.warning(f"changed, and taken at the next start (a restart): {', '.join(later)}")


def reload_logs(args: argparse.Namespace) -> None:
    """The agent's SIGHUP: --log-level and --log-format read again, the rest said to wait for
    the next start; a configuration that does not load changes nothing."""
    said = logger("agent")
    try:
        fresh = reread(args.argv)
    except ConfigError as exc:
        said.error(f"configuration reload refused; the previous settings stay in force: {exc}")
        return
    configure_logs(fresh.log_level, fresh.log_format)
    say_later(args, fresh, ("log_level", "log_format"), said)
    args.log_level, args.log_format = fresh.log_level, fresh.log_format
    said.info(f"log settings reloaded: level {fresh.log_level}, format {fresh.log_format}")
