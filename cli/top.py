"""`kvguard top`: the terminal dashboard (tui/), on a daemon's gRPC API, with the TLS options
every other client takes.

Invariant: the parser loads nothing of Textual (it is built for every `kvguard` command);
options that cannot be used (a screen's name, a filter line) and a process with no terminal
are errors that say so and exit 2, before the terminal is taken over. The screen is drawn on
the terminal itself (tui/terminal.py), so stdout and stderr stay the process's own.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvguard.cli.options import (
    Subcommands,
    add_command,
    add_daemon_argument,
    add_tls_arguments,
    seconds,
    tls_from_args,
)

SCREENS = ("fleet", "pool", "alerts", "timeline", "rules")


def cmd_top(args: argparse.Namespace) -> int:
    from kvguard.proto.client import DaemonClient
    from kvguard.tui.app import TopApp
    from kvguard.tui.filter_text import FilterError, parse
    from kvguard.tui.terminal import NoTerminal, open_terminal

    if args.filter:
        try:
            parse(args.filter)
        except FilterError as exc:
            print(f"kvguard top: --filter: {exc}", file=sys.stderr)
            return 2
    try:
        os.close(open_terminal())  # the screen goes there, never into a redirected stream
    except NoTerminal as exc:
        print(f"kvguard top: {exc}; the dashboard needs one", file=sys.stderr)
        return 2
    client = DaemonClient(args.daemon, tls_from_args(args))
    app = TopApp(
        client,
        refresh_s=args.refresh,
        screen=args.screen,
        node=args.node or "",
        pool=args.pool,
        filter_text=args.filter or "",
    )
    try:
        app.run()
    finally:
        app.stop_background()
        client.close()
    return 0


def add_parser(sub: Subcommands) -> None:
    """Add `top` to the `kvguard` subcommands."""
    p = add_command(
        sub,
        "top",
        "the terminal dashboard: fleet, pool maps, live alerts, timelines, rules and actions",
        "The on-call dashboard of a daemon's fleet: nodes and pools, pool maps, live alerts and request "
        "timelines; kill, quarantine, acknowledge and rule modes, each confirmed. Press ? for its keys.",
        "kvguard top --daemon 10.0.0.5:7463 --refresh 2 --tls-ca ca.pem --tls-cert op.pem --tls-key op.key",
    )
    add_daemon_argument(p)
    p.add_argument(
        "--refresh", type=seconds, default=1.0, metavar="SECONDS", help="how often to poll the daemon"
    )
    p.add_argument("--screen", choices=SCREENS, default="fleet", help="the screen to start on")
    p.add_argument("--node", help="the node whose pool the pool map shows first (default: the fleet's first)")
    p.add_argument("--pool", type=int, default=0, help="that node's pool")
    p.add_argument("--filter", metavar="TEXT", help="the alert filter to start with, e.g. 'critical node:d0'")
    add_tls_arguments(p)
    p.set_defaults(func=cmd_top)
