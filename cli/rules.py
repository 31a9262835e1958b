"""`kvguard rules check | test`: a ruleset before it is deployed. `check` validates a rules
directory and lists its rules; `test` replays each rule fixture (a capture and the findings
it must give) and compares. Exit codes: 0 valid / all passed, 1 a fixture failed (or there
is none), 2 an unusable ruleset.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvguard.cli.options import Subcommands, add_command, add_group, add_output_argument

# The ruleset (YAML, CEL) is imported when a command runs, so that `kvguard --help` does not
# wait for it.


def cmd_check(args: argparse.Namespace) -> int:
    """`kvguard rules check`: one line per rule on stdout; exit 0, or 2 when the ruleset is unusable."""
    from kvguard.ruleset import RulesetError, load_ruleset

    try:
        ruleset = load_ruleset(Path(args.rules) if args.rules else None)
    except RulesetError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if args.output == "json":
        import json

        rows = [
            {
                "id": r.id,
                "kinds": list(r.kinds),
                "severity": r.severity,
                "action": r.action,
                "enabled": r.enabled,
            }
            for r in ruleset.rules
        ]
        print(json.dumps(rows, indent=2))
    else:
        for rule in ruleset.rules:
            state = "" if rule.enabled else " (disabled)"
            print(f"{rule.id:36} {','.join(rule.kinds):24} {rule.severity:9} {rule.action}{state}")
    print(f"{len(ruleset.rules)} rules OK", file=sys.stderr)
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    """`kvguard rules install DIR`: the bundled rules copied into DIR (made if absent), for a
    daemon's `rules:` to name and an operator to edit; a file already there is kept (it may hold
    the operator's changes) and said. Exit 0, or 2 when DIR cannot be written."""
    from kvguard.cli.install import put_file
    from kvguard.ruleset.loader import DEFAULT_RULES_DIR

    said: list[str] = []
    try:
        for source in sorted(DEFAULT_RULES_DIR.glob("*.yaml")):
            put_file(Path(args.dir) / source.name, source.read_bytes(), 0o644, None, said)
    except OSError as exc:
        print(f"kvguard rules install: {exc.filename or args.dir}: {exc.strerror}", file=sys.stderr)
        return 2
    finally:
        for line in said:
            print(line)
    return 0


def cmd_test(args: argparse.Namespace) -> int:
    """`kvguard rules test`: exit 0 when every fixture passed, 1 when one failed (or there is
    none), 2 when the ruleset is unusable."""
    from kvguard.ruleset import RulesetError
    from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR, run_fixtures

    try:
        return run_fixtures(
            Path(args.rules) if args.rules else None,
            Path(args.fixtures) if args.fixtures else DEFAULT_FIXTURES_DIR,
            sys.stdout,
            verbose=args.verbose,
        )
    except RulesetError as exc:
        print(str(exc), file=sys.stderr)
        return 2


def add_parser(sub: Subcommands) -> None:
    """Add the `rules` group, with `check` and `test`, to the `kvguard` subcommands."""
    rules = add_group(
        sub,
        "rules",
        "check or test a ruleset",
        "Validate a rules directory, or test it against its fixtures, before a daemon loads it.",
        "kvguard rules test --rules ./rules --fixtures ./fixtures",
    )
    p = add_command(
        rules,
        "check",
        "validate a rules directory and list its rules",
        "Validate a rules directory and list its rules: id, finding kinds, severity, action.",
        "kvguard rules check --rules ./rules",
    )
    p.add_argument("--rules", metavar="DIR", help="rules directory (default: the bundled rules)")
    add_output_argument(p, help="output format (json: a list of rules: id, kinds, severity, action, enabled)")
    p.set_defaults(func=cmd_check)

    p = add_command(
        rules,
        "install",
        "copy the bundled rules into a directory (the daemon's `rules:`)",
        "Copy the bundled rules into DIR, for a daemon's `rules:` to name; files already there are kept.",
        "kvguard rules install /etc/kvguard/rules",
    )
    p.add_argument("dir", metavar="DIR", help="where the rules go (made if absent)")
    p.set_defaults(func=cmd_install)

    p = add_command(
        rules,
        "test",
        "replay each rule fixture and compare its findings with the expected ones",
        "Replay each rule fixture and compare its findings with the expected ones (exit 1 on a failure).",
        "kvguard rules test --rules ./rules -v",
    )
    p.add_argument("--rules", metavar="DIR", help="rules directory (default: the bundled rules)")
    p.add_argument("--fixtures", metavar="DIR", help="fixtures directory (default: the bundled fixtures)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every finding of every fixture")
    p.set_defaults(func=cmd_test)
