"""The services' configuration: `/etc/kvguard/kvguard.yaml` and its drop-ins `conf.d/*.yaml`,
environment variables, and flags, for `kvguard daemon` and `kvguard agent` (the commands in
SECTIONS); and `kvguard config check|show`.

A file holds a section per command, its keys the command's long options (`listen`,
`tls-ca`, `metrics-listen`; `_` may stand for `-`):

    daemon:
      listen: 0.0.0.0:7463
      store: postgresql+psycopg://kvguard@db/kvguard
    agent:
      daemon: kvguard.example:7463

Precedence, lowest first: the option's default, kvguard.yaml, each drop-in in name order,
the environment (KVGUARD_<COMMAND>_<OPTION>, e.g. KVGUARD_DAEMON_LISTEN), the command line.
`--config FILE` (or KVGUARD_CONFIG) names another main file; its drop-ins are the `conf.d`
beside it.

Invariant: every value passes the option's own argparse type, so a file's value is checked
as the flag would be; an unknown section or key, a file that is not a mapping, or a value
of the wrong shape is a ConfigError naming the file (or variable), the key and the reason.
"""

from __future__ import annotations

import argparse
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = Path("/etc/kvguard/kvguard.yaml")
SECTIONS = ("daemon", "agent")  # the commands a configuration file configures
ENV_PREFIX = "KVGUARD_"
NOT_CONFIGURABLE = {"help", "config"}  # options that are not settings


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names where and why."""


@dataclass
class Setting:
    value: Any
    source: str  # "default", a file's path, "env NAME", "flag"


@dataclass
class Loaded:
    """The values the files and environment give, by command and option dest, with sources."""

    files: list[Path] = field(default_factory=list)
    values: dict[str, dict[str, Setting]] = field(default_factory=dict)


def config_path(argv: list[str]) -> tuple[Path, bool]:
    """The main file, and whether it was named (a named file must exist)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return Path(argv[i + 1]), True
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1]), True
    if os.environ.get("KVGUARD_CONFIG"):
        return Path(os.environ["KVGUARD_CONFIG"]), True
    return DEFAULT_CONFIG, False


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """A command's settable options by their long name without dashes (listen, tls-ca)."""
    found = {}
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.dest in NOT_CONFIGURABLE:
            continue
        found[longs[0][2:]] = action
    return found


def load(path: Path, named: bool, parsers: dict[str, argparse.ArgumentParser]) -> Loaded:
    """Read the main file and its drop-ins, then the environment, checking each value."""
    import yaml

    loaded = Loaded()
    files: list[Path] = []
    if path.exists():
        files.append(path)
    elif named:
        raise ConfigError(f"{path}: no such configuration file")
    dropins = path.parent / "conf.d"
    if dropins.is_dir():
        files += sorted(p for p in dropins.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    for file in files:
        try:
            document = yaml.safe_load(file.read_text())
        except OSError as exc:
            raise ConfigError(f"{file}: cannot be read: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(yaml_error(file, exc)) from None
        if document is None:
            continue
        if not isinstance(document, dict):
            raise ConfigError(f"{file}: not a mapping of sections ({', '.join(SECTIONS)})")
        for section, body in document.items():
            if section not in parsers:
                raise ConfigError(f"{file}: unknown section {section!r}{_suggest(str(section), parsers)}")
            if body is None:
                continue
            if not isinstance(body, dict):
                raise ConfigError(f"{file}: section {section!r} is not a mapping of options")
            for key, value in body.items():
                _take(loaded, parsers[section], section, str(key), value, str(file))
        loaded.files.append(file)
    for section, parser in parsers.items():
        prefix = f"{ENV_PREFIX}{section.upper()}_"
        known = {prefix + name.upper().replace("-", "_"): name for name in options(parser)}
        for variable, name in known.items():
            if variable in os.environ:
                _take(loaded, parser, section, name, os.environ[variable], f"env {variable}")
        for variable in sorted(os.environ):
            # A misspelt variable must not be ignored in silence. `_OPTS`: the units' extra flags.
            if variable.startswith(prefix) and variable not in known and not variable.endswith("_OPTS"):
                close = difflib.get_close_matches(variable, list(known), n=1)
                hint = (
                    f" (did you mean {close[0]}?)" if close else f" (its options: {', '.join(sorted(known))})"
                )
                raise ConfigError(f"env {variable}: {section} has no such option{hint}")
    return loaded


def _suggest(word: str, known: Any) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"


def _take(
    loaded: Loaded, parser: argparse.ArgumentParser, section: str, key: str, value: Any, where: str
) -> None:
    known = options(parser)
    name = key.replace("_", "-")
    action = known.get(name)
    if action is None:
        raise ConfigError(f"{where}: {section}: unknown option {key!r}{_suggest(name, known)}")
    loaded.values.setdefault(section, {})[action.dest] = Setting(
        _converted(action, value, where, section, name), where
    )


def _converted(action: argparse.Action, value: Any, where: str, section: str, name: str) -> Any:
    """The value as the flag would give it (its type applied; a switch a boolean)."""
    what = f"{where}: {section}: {name}"
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if isinstance(value, str):
            lowered = value.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                value = True
            elif lowered in ("0", "false", "no", "off", ""):
                value = False
        if not isinstance(value, bool):
            raise ConfigError(f"{what}: {value!r} is not true or false")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_one(action, item, what) for item in items]
    if isinstance(value, list | dict):
        raise ConfigError(f"{what}: takes one value, not {type(value).__name__}")
    return _one(action, value, what)


def _one(action: argparse.Action, value: Any, what: str) -> Any:
    if isinstance(value, list | dict):
        raise ConfigError(f"{what}: {value!r} is not a single value")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if action.choices is not None and text not in action.choices:
        raise ConfigError(f"{what}: {text!r} is not one of {', '.join(map(str, action.choices))}")
    if action.type is None:
        return text
    try:
        return action.type(text)  # type: ignore[misc]
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        raise ConfigError(f"{what}: {text!r}: {exc}") from None


def apply(loaded: Loaded, section: str, parser: argparse.ArgumentParser) -> None:
    """Make the files' and environment's values the command's defaults: its flags still win."""
    values = loaded.values.get(section, {})
    parser.set_defaults(**{dest: s.value for dest, s in values.items()})


def effective(
    loaded: Loaded,
    section: str,
    parser: argparse.ArgumentParser,
    args: argparse.Namespace | None,
    argv: list[str],
) -> list[tuple[str, Any, str]]:
    """(option, value, source) of every setting of `section`, as it would run."""
    given = set()
    for token in argv:
        if token.startswith("--"):
            given.add(token[2:].split("=", 1)[0])
    rows = []
    for name, action in sorted(options(parser).items()):
        setting = loaded.values.get(section, {}).get(action.dest)
        value = getattr(args, action.dest) if args is not None else action.default
        if name in given:
            source = "flag"
        elif setting is not None:
            source = setting.source
        else:
            source = "default"
        rows.append((name, value, source))
    return rows


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` on a configured command (read before its other options: see main)."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"the configuration file; its drop-ins are the conf.d beside it (default: {DEFAULT_CONFIG}, "
        "or KVGUARD_CONFIG)",
    )


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The configured commands' parsers, from the `kvguard` parser."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s: sub.choices[s] for s in SECTIONS}


def configure(argv: list[str], parser: argparse.ArgumentParser) -> str:
    """For a configured command (`argv` names one), load its configuration and make it the
    command's defaults; return the command ("" for any other: no file is read for it)."""
    command = next((a for a in argv if not a.startswith("-")), "")
    if command not in SECTIONS or "-h" in argv or "--help" in argv:
        return ""
    commands = subcommands(parser)
    apply(load(*config_path(argv), commands), command, commands[command])
    return command


def files(argv: list[str]) -> list[Path]:
    """The files the configuration of `argv` is read from, whether they exist now or not:
    the main file and its drop-ins (what a running service watches for changes)."""
    path, _ = config_path(argv)
    dropins = path.parent / "conf.d"
    found = sorted(p for p in dropins.iterdir() if p.suffix in (".yaml", ".yml")) if dropins.is_dir() else []
    return [path, *found]


def reread(argv: list[str]) -> argparse.Namespace:
    """The command line `argv` parsed again over the configuration as it is now (a reload):
    ConfigError if the files or the environment are not usable."""
    from kvguard.cli import build_parser

    parser = build_parser()
    configure(argv, parser)
    # Not redirected: sys.stderr is the service's log, and its other threads write there
    # meanwhile. argparse says why on it before it exits.
    try:
        return parser.parse_args(argv)
    except SystemExit:
        raise ConfigError(
            "the command line does not parse over this configuration (argparse said why)"
        ) from None


def yaml_error(file: Path, exc: Exception) -> str:
    """A YAML error as a compiler says one: `file:line:column: reason`, on one line."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(file)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    reason = f"{problem} ({context})" if context and problem != str(exc) else problem
    return f"{where}: not YAML: {' '.join(reason.split())}"


def cmd_config(args: argparse.Namespace) -> int:
    """`config check`: exit 0 when the files and environment are usable, else 2, saying why.
    `config show`: each setting of a command with its value and where it came from."""
    import json
    import sys

    from kvguard.cli import build_parser

    commands = subcommands(build_parser())
    argv = ["--config", args.config] if args.config else []
    try:
        loaded = load(*config_path(argv), commands)
    except ConfigError as exc:
        print(f"kvguard config: {exc}", file=sys.stderr)
        return 2
    if args.config_command == "check":
        from kvguard.cli.config_usable import problems

        found = []
        for name in SECTIONS:
            apply(loaded, name, commands[name])
            values = {option: value for option, value, _ in effective(loaded, name, commands[name], None, [])}
            found += problems(name, values)
        for problem in found:
            print(f"kvguard config: {problem}", file=sys.stderr)
        if found:
            return 2
        read = ", ".join(map(str, loaded.files)) or f"no file ({config_path(argv)[0]} absent: defaults apply)"
        n = sum(len(v) for v in loaded.values.values())
        print(f"configuration usable: {n} setting(s) from {read} and the environment")
        return 0
    section = args.section
    apply(loaded, section, commands[section])
    rows = effective(loaded, section, commands[section], None, [])
    if args.output == "json":
        json.dump(
            [{"option": name, "value": value, "source": source} for name, value, source in rows],
            sys.stdout,
            indent=2,
            default=str,
        )
        print()
        return 0
    width = max(len(name) for name, _, _ in rows)
    for name, value, source in rows:
        shown = "" if value is None else value
        print(f"{section}.{name:{width}}  {shown!s:40}  {source}")
    return 0


def add_parser(sub: Any) -> None:
    """Add `config check|show` to the `kvguard` subcommands."""
    from kvguard.cli.options import add_command, add_group, add_output_argument

    verbs = add_group(
        sub,
        "config",
        "check or show the daemon's and agent's configuration",
        "Check the configuration files and environment, or show each setting and where it came from.",
        "kvguard config show daemon",
    )
    check = add_command(
        verbs,
        "check",
        "are the files and environment usable",
        "Read kvguard.yaml, its conf.d drop-ins and the KVGUARD_* environment; exit 2 naming what is wrong.",
        "kvguard config check --config /etc/kvguard/kvguard.yaml",
    )
    show = add_command(
        verbs,
        "show",
        "each setting, its value and where it came from",
        "Each setting of a command as it would run, and where it came from: default, a file, "
        "the environment.",
        "kvguard config show agent -o json",
    )
    show.add_argument("section", choices=SECTIONS, help="the command")
    add_output_argument(show)
    for q in (check, show):
        q.add_argument("--config", metavar="FILE", help=f"the main file (default: {DEFAULT_CONFIG})")
        q.set_defaults(func=cmd_config)
