"""The `kvguard` command: one entry point, one subcommand per job, each in its own module
here, which adds its parser (options.py has what they share).

Exit codes: 0 nothing found, 1 findings (or failed rule tests), 2 unusable input.
"""

from __future__ import annotations

import argparse
import sys

from kvguard import __version__
from kvguard.cli import agent, audit, daemon, demo, fleet, replay, rules, run, testbed, top, witness
from kvguard.cli.options import new_parser


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: `kvguard --version`, and every subcommand's parser."""
    parser = new_parser(
        "kvguard",
        "KV-cache ownership guard for shared LLM inference.",
        "kvguard replay capture.jsonl -o json",
    )
    parser.add_argument("--version", action="version", version=f"kvguard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (replay, daemon, agent, run, witness, audit, fleet, top, rules, testbed, demo):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]) and return its exit code."""
    from kvguard.proto.channel import TlsError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except TlsError as exc:  # unusable --tls-* options, from any command that takes them
        print(f"kvguard {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
