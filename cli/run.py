"""`kvguard run -- ENGINE COMMAND`: start an SGLang or vLLM server with kvguard attached, in the
manner of `opentelemetry-instrument` and `ddtrace-run`: the settings go to the engine's
environment (kvguard.agents.attach reads them there), the engines' own plugin loaders load
the adapter, and the command then replaces this process (its signals and exit code are the
engine's). The adapter reports the pool and context it finds before the first request.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys

from kvguard.agents.engines import ENGINES
from kvguard.cli.options import AGENT_SOCKET, Subcommands, add_command
from kvguard.cuda_hooks.shim import LIBRARY as SHIM

# The engines' plugin allow-lists: when the operator set one, kvguard is added to it.
PLUGIN_LISTS = tuple(engine.allow_list for engine in ENGINES.values())


def engine_environment(args: argparse.Namespace, environ: dict[str, str]) -> dict[str, str]:
    env = dict(environ)
    env["KVGUARD_NODE"] = args.node or env.get("KVGUARD_NODE", "")
    env["KVGUARD_MODE"] = args.mode
    env["KVGUARD_ON_FAILURE"] = args.on_failure
    for name, value in (("KVGUARD_CLUSTER", args.cluster), ("KVGUARD_TENANT_FIELD", args.tenant_field)):
        if value:
            env[name] = value
    if args.capture:
        env["KVGUARD_CAPTURE"] = os.path.abspath(args.capture)
        env.pop("KVGUARD_AGENT_SOCKET", None)
    else:
        env["KVGUARD_AGENT_SOCKET"] = args.agent_socket
        env.pop("KVGUARD_CAPTURE", None)
    if getattr(args, "cuda_witness", False):  # the shim first: it must see the engine's first CUDA call
        env["LD_PRELOAD"] = " ".join(p for p in (str(SHIM), env.get("LD_PRELOAD", "")) if p)
        env["KVGUARD_SHIM_SOCKET"] = f"{args.agent_socket}.shim"
    for name in PLUGIN_LISTS:
        allowed = [p for p in env.get(name, "").split(",") if p.strip()]
        if allowed and "kvguard" not in allowed:
            env[name] = ",".join([*allowed, "kvguard"])
    return env


def cmd_run(args: argparse.Namespace) -> int:
    command = list(args.engine_command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("kvguard run: no engine command given (kvguard run [options] -- COMMAND ...)", file=sys.stderr)
        return 2
    if args.cuda_witness and args.capture:
        print(
            "kvguard run: --cuda-witness sends to the node agent: it does not go with --capture",
            file=sys.stderr,
        )
        return 2
    if args.cuda_witness and not SHIM.exists():
        print(f"kvguard run: --cuda-witness: the CUDA shim {SHIM} is not built (make shim)", file=sys.stderr)
        return 2
    if not args.capture:
        try:
            mode = os.stat(args.agent_socket).st_mode
        except OSError as exc:
            print(
                f"kvguard run: no node agent at --agent-socket {args.agent_socket} ({exc.strerror}): "
                "start `kvguard agent` first, or write a capture with --capture FILE",
                file=sys.stderr,
            )
            return 2
        if not stat.S_ISSOCK(mode):
            print(f"kvguard run: --agent-socket {args.agent_socket} is not a socket", file=sys.stderr)
            return 2
    env = engine_environment(args, dict(os.environ))
    where = f"capture {env['KVGUARD_CAPTURE']}" if args.capture else f"agent {args.agent_socket}"
    if args.cuda_witness:
        where += ", CUDA launches and pool memory witnessed by the shim"
    node = env["KVGUARD_NODE"] or "host name"
    print(
        f"kvguard run: {command[0]} with kvguard attached ({args.mode}; node {node}; events to {where})",
        file=sys.stderr,
        flush=True,
    )
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"kvguard run: cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0  # not reached: the engine has replaced this process


def add_parser(sub: Subcommands) -> None:
    p = add_command(
        sub,
        "run",
        "start an SGLang or vLLM server with kvguard attached",
        "Start an engine with kvguard's adapter loaded in it, its events going to the node agent.",
        "kvguard run --node gpu-3 -- python -m sglang.launch_server --model-path M",
    )
    p.add_argument(
        "--node", default="", help="this engine's node name (default: KVGUARD_NODE, else the host name)"
    )
    p.add_argument(
        "--agent-socket", default=AGENT_SOCKET, help="the node agent's socket (kvguard agent --socket)"
    )
    p.add_argument(
        "--capture", default="", metavar="FILE", help="write the events to a JSON Lines capture instead"
    )
    p.add_argument(
        "--mode",
        choices=("enforce", "monitor"),
        default="enforce",
        help="stop condemned requests, or only report",
    )
    p.add_argument(
        "--on-failure",
        choices=("monitor", "stop"),
        default="monitor",
        help="if kvguard itself fails: the engine goes on unguarded (monitor) or admits nothing new (stop)",
    )
    p.add_argument(
        "--cluster", default="", help="the serving cluster's name (pools of different clusters never mix)"
    )
    p.add_argument(
        "--tenant-field",
        default="",
        help="where the adapter reads a request's tenant (default cache_salt; see docs/engines.md)",
    )
    p.add_argument(
        "--cuda-witness",
        action="store_true",
        help="preload the CUDA shim into the engine: its launch and allocation witnesses (docs/operator.md)",
    )
    p.add_argument("engine_command", nargs=argparse.REMAINDER, help="the engine's command line, after --")
    p.set_defaults(func=cmd_run)
