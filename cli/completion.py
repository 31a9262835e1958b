"""`kvguard completion bash`: a bash completion script made from the command line's own parsers,
so it offers exactly the subcommands, options and choices `kvguard --help` lists (zsh takes it
through bashcompinit). `kvguard install` puts it where bash-completion looks.

Invariant: the script is a function of the parsers alone: a new subcommand or option is
completed without editing anything here.
"""

from __future__ import annotations

import argparse
import sys

from kvguard.cli.options import Subcommands, add_command

HEAD = """# bash completion for kvguard (`kvguard completion bash`; made from its own parsers)
_kvguard() {
    local cur prev path i w
    cur="${COMP_WORDS[COMP_CWORD]}"
    prev="${COMP_WORDS[COMP_CWORD-1]}"
    path=kvguard
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${COMP_WORDS[i]}"
        [[ $w == -* ]] && continue
        case " ${_kvguard_subs[$path]} " in *" $w "*) path="$path $w" ;; esac
    done
    if [[ -n ${_kvguard_choices["$path $prev"]+set} ]]; then
        COMPREPLY=($(compgen -W "${_kvguard_choices["$path $prev"]}" -- "$cur"))
    else
        COMPREPLY=($(compgen -W "${_kvguard_subs[$path]} ${_kvguard_options[$path]}" -- "$cur"))
    fi
}
"""


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:  # argparse keeps its tree here; no public accessor
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def tables(
    parser: argparse.ArgumentParser, path: str = "kvguard"
) -> tuple[dict[str, list[str]], dict[str, list[str]], dict[str, list[str]]]:
    """(subcommands, options, an option's choices), keyed by command path ("kvguard audit
    query"; an option's choices by the path and the option)."""
    subs: dict[str, list[str]] = {}
    options: dict[str, list[str]] = {}
    choices: dict[str, list[str]] = {}
    children = _subparsers(parser)
    subs[path] = sorted(children)
    options[path] = sorted(s for a in parser._actions for s in a.option_strings if s.startswith("--"))
    for action in parser._actions:
        if action.choices and action.option_strings and not isinstance(action, argparse._SubParsersAction):
            for option in action.option_strings:
                choices[f"{path} {option}"] = [str(c) for c in action.choices]
    for name, child in children.items():
        more = tables(child, f"{path} {name}")
        for table, add in zip((subs, options, choices), more, strict=True):
            table.update(add)
    return subs, options, choices


def _array(name: str, table: dict[str, list[str]]) -> str:
    rows = "".join(f'    ["{key}"]="{" ".join(words)}"\n' for key, words in sorted(table.items()))
    return f"declare -gA {name}=(\n{rows})\n"


def bash_script(parser: argparse.ArgumentParser) -> str:
    subs, options, choices = tables(parser)
    arrays = _array("_kvguard_subs", subs) + _array("_kvguard_options", options)
    return HEAD + arrays + _array("_kvguard_choices", choices) + "complete -F _kvguard kvguard\n"


def cmd_completion(args: argparse.Namespace) -> int:
    from kvguard.cli import build_parser

    sys.stdout.write(bash_script(build_parser()))
    return 0


def add_parser(sub: Subcommands) -> None:
    """Add `kvguard completion` to the `kvguard` subcommands."""
    p = add_command(
        sub,
        "completion",
        "print the shell completion script (bash; zsh through bashcompinit)",
        "Print a bash completion script for kvguard's subcommands, options and their choices.",
        "kvguard completion bash",
    )
    p.add_argument("shell", choices=("bash",), help="the shell")
    p.set_defaults(func=cmd_completion)
