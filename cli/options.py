"""What several `kvguard` commands share: how their --help reads (the defaults shown, one
example at the bottom), the argparse types of their durations, sizes, counts and gRPC
addresses, the output option (`-o table|json`) and the mutual TLS options of every command
that speaks gRPC.

Invariant: a gRPC address given without a port means DEFAULT_PORT, on the daemon's --listen
and on every client's --daemon alike (gRPC alone would take 443).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
from typing import Any, TypeAlias

from kvguard.proto.channel import Tls

# What `add_subparsers()` returns: where a command module adds its parser.
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

AGENT_SOCKET = "/run/kvguard/agent.sock"  # the node agent's socket, where no flag says otherwise
DEFAULT_PORT = 7463  # the daemon's gRPC port, where an address names none
DEFAULT_DAEMON = f"127.0.0.1:{DEFAULT_PORT}"
OUTPUTS = ("table", "json")  # every command's -o: one convention across the CLI


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help, and the description and example as written.

    A default is shown unless the help says it already (in its own words, or with
    %(default)s) or there is none worth saying (None, a flag's False, an empty string).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or action.default in (None, "") or action.default is False:
            return action.help
        return super()._get_help_string(action)


def new_parser(prog: str, description: str, example: str) -> argparse.ArgumentParser:
    """A top-level parser laid out as every subcommand's is."""
    return argparse.ArgumentParser(
        prog=prog, description=description, epilog=_example(example), formatter_class=HelpFormatter
    )


def add_command(
    subcommands: Subcommands, name: str, summary: str, description: str, example: str
) -> argparse.ArgumentParser:
    """Register subcommand `name`: `summary` in its group's list, the one-line `description`
    atop its --help, and `example` (a whole command line) at the bottom."""
    return subcommands.add_parser(
        name,
        help=summary,
        description=description,
        epilog=_example(example),
        formatter_class=HelpFormatter,
    )


def add_group(
    subcommands: Subcommands, name: str, summary: str, description: str, example: str
) -> Subcommands:
    """Register `name` as a group of subcommands (`kvguard audit ...`) and return where they go;
    one of them is required (its name is `args.<name>_command`)."""
    parser = add_command(subcommands, name, summary, description, example)
    return parser.add_subparsers(dest=f"{name}_command", required=True)


def _example(command_line: str) -> str:
    return f"example:\n  {command_line}"


# -------------------------------------------------------------------------------- argparse types


def _number(text: str, parse: type[int] | type[float], what: str) -> Any:
    """`text` as a number for an argparse type, or the error that names it."""
    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def power_of_two(text: str) -> int:
    """An argparse type: a positive power of two (what a BPF ring buffer's size must be)."""
    n = _number(text, int, "a whole number")
    if n < 1 or n & (n - 1):
        raise argparse.ArgumentTypeError(f"{n} is not a power of two (1, 2, 4, ... pages)")
    return n


def milliseconds(text: str) -> float:
    """An argparse type: a duration in milliseconds, not negative."""
    ms = _number(text, float, "a number of milliseconds")
    if not 0 <= ms < 1e9:
        raise argparse.ArgumentTypeError(f"{ms} ms is not a duration from 0 up")
    return ms


def microseconds(text: str) -> int:
    """An argparse type: a whole number of microseconds, not negative."""
    from kvguard.daemon.cpu_latency import MAX_US

    us = _number(text, int, "a whole number of microseconds")
    if not 0 <= us <= MAX_US:
        raise argparse.ArgumentTypeError(f"{us} µs is not between 0 and {MAX_US}")
    return us


def byte_count(text: str) -> int:
    """An argparse type: bytes, whole, with an optional K, M, G or T (powers of 1024)."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    body = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = scale.get(body[-1:], 1)
    n = _number(body[:-1] if unit > 1 else body, float, "a size in bytes (e.g. 256M, 2G)")
    if not 0 <= n * unit < 1 << 60:
        raise argparse.ArgumentTypeError(f"{text} is not a size from 0 up")
    return int(n * unit)


def events_count(text: str) -> int:
    """An argparse type: a number of events, 0 or more."""
    n = _number(text, int, "a whole number of events")
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} events: it cannot be negative")
    return n


def positive_count(text: str) -> int:
    """An argparse type: a whole number, 1 or more (a limit)."""
    n = _number(text, int, "a whole number")
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: a limit must be at least 1")
    return n


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, more than 0 and at most a day."""
    s = _number(text, float, "a number of seconds")
    if not 0 < s <= 86400:
        raise argparse.ArgumentTypeError(f"{s} s is not a duration over 0 s and up to a day")
    return s


def seconds_or_off(text: str) -> float:
    """An argparse type: a duration in seconds up to a day, or 0 for never."""
    return 0.0 if _number(text, float, "a number of seconds") == 0 else seconds(text)


def listen_address(text: str) -> str:
    """An argparse type: a gRPC address as host:port, the port DEFAULT_PORT where none is given
    (`localhost`, `10.0.0.5`, `[::1]`); a local socket (unix:PATH) as it is. An IPv6 address
    goes in brackets, with a port or without: bare, `::1:7463` could mean either."""
    address = text.strip()
    if address.startswith(("unix:", "unix-abstract:")):
        return address
    if address.startswith("["):  # [v6] or [v6]:port
        host, sep, rest = address[1:].partition("]")
        if not sep or not host:
            raise argparse.ArgumentTypeError(f"{text!r} is not an address: an IPv6 host goes in [brackets]")
        _ipv6(host, text)
        if not rest:
            return f"[{host}]:{DEFAULT_PORT}"
        if not rest.startswith(":"):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an address: after [{host}] comes :PORT or nothing"
            )
        return f"[{host}]:{_port(rest[1:], text)}"
    if address.count(":") > 1:  # a bare IPv6 address: is its last group a port? Not guessed.
        bracketed = f"[{address}]"
        with contextlib.suppress(ValueError):
            head, _, last = address.rpartition(":")
            ipaddress.IPv6Address(head.split("%", 1)[0])
            bracketed += f" or [{head}]:{last}"
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an address: an IPv6 address goes in brackets ({bracketed})"
        )
    host, sep, port = address.partition(":")
    if not sep:
        if not host:
            raise argparse.ArgumentTypeError("the address is empty")
        return f"{host}:{DEFAULT_PORT}"
    return f"{host}:{_port(port, text)}"  # an empty host stays empty: every interface, as gRPC says


def _ipv6(host: str, text: str) -> None:
    try:
        ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an address: {host} is not an IPv6 address"
        ) from None


def _port(port: str, text: str) -> int:
    if not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not an address: port {port!r} is not 0 to 65535")
    return int(port)


def add_daemon_argument(
    parser: argparse.ArgumentParser, default: str | None = DEFAULT_DAEMON, help: str = ""
) -> None:
    """--daemon ADDR: the daemon's gRPC address (host[:port], the port DEFAULT_PORT if none)."""
    parser.add_argument(
        "--daemon",
        type=listen_address,
        default=default,
        metavar="ADDR",
        help=help or f"the daemon's gRPC address, host[:port] (port {DEFAULT_PORT} if none)",
    )


def add_output_argument(parser: argparse.ArgumentParser, *aliases: str, help: str = "output format") -> None:
    """-o/--output table|json (the CLI's one convention); `aliases` are older names still
    taken for table (`replay -o text`), not shown in --help."""
    parser.add_argument(
        "-o",
        "--output",
        type=lambda text: "table" if text in aliases else text,
        choices=OUTPUTS,
        default="table",
        metavar="{" + ",".join(OUTPUTS) + "}",
        help=help,
    )


# ------------------------------------------------------------------------------------ mutual TLS


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    """--log-level and --log-format of a service (kvguard.proto.logs)."""
    from kvguard.proto.logs import FORMATS, LEVELS

    parser.add_argument("--log-level", choices=LEVELS, default="info", help="the least level logged")
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default="text",
        help="text ('kvguard daemon: ...') or json (one object a line: time, level, component, message, "
        "the event's fields)",
    )


def add_tls_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """--tls-ca, --tls-cert and --tls-key: mutual TLS on the command's gRPC (proto/channel.py);
    the group, for a command's own TLS options."""
    group = parser.add_argument_group("mutual TLS (all three, or none for plaintext on a trusted network)")
    group.add_argument("--tls-ca", metavar="PEM", help="the CA that signs the other side's certificates")
    group.add_argument("--tls-cert", metavar="PEM", help="this side's certificate")
    group.add_argument("--tls-key", metavar="PEM", help="this side's private key")
    return group


def tls_from_args(args: argparse.Namespace) -> Tls | None:
    """The parsed TLS options as a Tls, or None for plaintext; a TlsError names what is missing
    or unreadable (`kvguard` exits 2 on it)."""
    return Tls.load(args.tls_ca, args.tls_cert, args.tls_key)


# ------------------------------------------------------------------------------------ the bus


def add_bus_arguments(parser: argparse.ArgumentParser, *, cell: bool) -> argparse._ArgumentGroup:
    """--bus and its settings (proto/bus.py); `cell`: the agent's --cell too."""
    group = parser.add_argument_group(
        "the bus (NATS JetStream, past one daemon: docs/operator.md); without --bus, gRPC to one daemon"
    )
    group.add_argument(
        "--bus",
        metavar="URL[,URL...]",
        help="the JetStream cluster's servers, nats://host:port, comma-separated",
    )
    group.add_argument("--bus-cluster", default="kvguard", help="the kvguard cluster's name on the bus")
    group.add_argument(
        "--bus-user", default="", help="this side's bus user (`kvguard bus config` makes them)"
    )
    group.add_argument("--bus-password-file", metavar="FILE", help="the file holding the bus user's password")
    group.add_argument(
        "--bus-tls-ca",
        metavar="PEM",
        help="TLS to the bus, its servers' certificates verified against this CA (`kvguard bus config "
        "--tls-cert`); the password never crosses the network in the clear",
    )
    group.add_argument(
        "--bus-tls-cert",
        metavar="PEM",
        help="this side's certificate, its identity on a bus that knows its clients by their "
        "certificates (`kvguard bus config --tls-ca`): a node's for an agent, the daemon's for a daemon; "
        "no user or password then",
    )
    group.add_argument("--bus-tls-key", metavar="PEM", help="the private key of --bus-tls-cert")
    if cell:
        group.add_argument(
            "--cell",
            default="",
            help="the prefill/decode cell of this host's nodes: the nodes that exchange KV, with any "
            "external KV tier they share (A-Z a-z 0-9 _ -; needed with --bus)",
        )
    return group


def bus_from_args(args: argparse.Namespace) -> Any:
    """The parsed bus options as a BusSettings, or None without --bus; a BusError names what is
    wrong (`kvguard` exits 2 on it)."""
    from pathlib import Path

    from kvguard.proto.bus import BusError, BusSettings, check_cell

    if not args.bus:
        if getattr(args, "cell", ""):
            raise BusError("--cell is the node's cell on the bus: it needs --bus")
        return None
    if hasattr(args, "cell"):
        if not args.cell:
            raise BusError("--bus needs --cell: the prefill/decode cell this host's nodes belong to")
        check_cell(args.cell)
    settings = BusSettings(
        servers=[s.strip() for s in args.bus.split(",") if s.strip()],
        cluster=args.bus_cluster,
        user=args.bus_user,
        password_file=Path(args.bus_password_file) if args.bus_password_file else None,
        tls_ca=Path(args.bus_tls_ca) if args.bus_tls_ca else None,
        tls_cert=Path(args.bus_tls_cert) if args.bus_tls_cert else None,
        tls_key=Path(args.bus_tls_key) if args.bus_tls_key else None,
    )
    settings.password()  # a file that cannot be used is said now, not at each reconnect
    if settings.tls_ca is not None:
        settings.tls_context()
    if settings.tls_cert is not None:
        settings.identity("")
    return settings
