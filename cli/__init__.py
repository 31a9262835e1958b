"""The `kvguard` command: one entry point, one subcommand per job, each in its own module
here, which adds its parser (options.py has what they share).

Exit codes: 0 nothing found, 1 findings (or failed rule tests), 2 unusable input, 141 the
reader of its output went away (`kvguard audit query | head`): said by no traceback, as a
shell says of a command killed by SIGPIPE (128 + 13), so that `set -o pipefail` sees kvguard
as it sees `cat`, and a cut-short output is never taken for a complete one (0).
"""

from __future__ import annotations

import argparse
import os
import select
import sys

from kvguard import __version__
from kvguard.cli import (
    agent,
    alerts,
    audit,
    bus,
    certs,
    completion,
    config,
    daemon,
    demo,
    fleet,
    install,
    replay,
    rules,
    run,
    testbed,
    top,
    witness,
)
from kvguard.cli.config import ConfigError, add_config_option, configure, subcommands
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
    for module in (
        replay,
        daemon,
        agent,
        run,
        witness,
        audit,
        alerts,
        fleet,
        bus,
        top,
        rules,
        certs,
        config,
        install,
        completion,
        testbed,
        demo,
    ):
        module.add_parser(sub)
    for configured in subcommands(parser).values():
        add_config_option(configured)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]) and return its exit code."""
    from kvguard.proto.bus import BusError
    from kvguard.proto.channel import TlsError

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    try:
        configure(argv, parser)  # the files' and environment's values, before the flags
    except ConfigError as exc:
        print(f"kvguard {argv[0] if argv else ''}: configuration: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    args.argv = argv  # a service reads its configuration again on reload (cli/reload.py)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, not at exit: a reader gone is caught below
        return code
    except (TlsError, BusError) as exc:  # unusable --tls-* or --bus options, from any command that takes them
        print(f"kvguard {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not _reader_gone():
            raise  # a pipe or socket of the command's own: a bug to see, not an exit to hide
        # As the Python docs advise: what is still buffered goes nowhere, so that flushing it at
        # exit does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return SIGPIPE_EXIT


SIGPIPE_EXIT = 128 + 13  # what a shell reports of a command that SIGPIPE ended


def _reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (poll says POLLERR)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError):  # stdout closed or not a file: nothing to write to either
        return True


if __name__ == "__main__":
    sys.exit(main())
