"""`kvguard testbed up`: the testbed engine in the foreground: a router with an
OpenAI-compatible API (completions and chat, streamed or not), a prefill worker and a decode
worker (real paged attention, KV sent over TCP), their guards on, and fault switches that
recreate known leaks. SIGINT or SIGTERM stops it, its workers with it.
"""

from __future__ import annotations

import argparse
import sys

from kvguard.cli.options import Subcommands, add_command, add_group

# The testbed (torch) is imported when the command runs, so that `kvguard --help` does not
# wait for it.

TESTBED_NEEDS = ("torch", "fastapi", "uvicorn")  # the extra `kvguard[testbed]`


def testbed_missing(command: str) -> bool:
    """Whether this install lacks the testbed's libraries (a wheel installed without the extra);
    if so it is said, with the command that adds them."""
    import importlib.util

    missing = [name for name in TESTBED_NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"kvguard {command}: the testbed needs {', '.join(missing)}, not installed here: "
            "pip install 'kvguard[testbed]'",
            file=sys.stderr,
        )
    return bool(missing)


def cmd_up(args: argparse.Namespace) -> int:
    """Run the cluster until it is stopped; exit 2 on an unusable option."""
    if testbed_missing("testbed up"):
        return 2
    from kvguard.testbed.router import ClusterConfig, up

    pairs: dict[str, dict[str, str]] = {"system_prompt": {}, "rule_mode": {}}
    for option, shape in (("system_prompt", "TENANT=TEXT"), ("rule_mode", "RULE=MODE")):
        for item in getattr(args, option) or []:
            key, sep, value = item.partition("=")
            if not sep:
                print(
                    f"kvguard testbed up: --{option.replace('_', '-')} {item!r} is not {shape}",
                    file=sys.stderr,
                )
                return 2
            pairs[option][key] = value
    prompts = pairs["system_prompt"]
    try:
        config = ClusterConfig(
            port=args.port,
            faults=tuple(args.fault or ()),
            guard=args.guard,
            unguarded_roles=tuple(r for r in (args.unguarded_roles or "").split(",") if r),
            rule_modes=pairs["rule_mode"],
            audit_dir=args.audit_dir,
            agent_socket=args.agent_socket or "",
            node_prefix=args.node_prefix,
            context_len=args.context_len,
            prefill_pages=args.prefill_pages,
            system_prompts=prompts,
            prefix_cache=args.prefix_cache,
            host_cache=args.host_cache,
            device=args.device,
            prefill_timeout_s=args.prefill_timeout_s,
            prefill_ms_per_token=args.prefill_ms_per_token,
            decode_step_ms=args.decode_step_ms,
            offload_delay_ms=args.offload_delay_ms,
            cuda_witness=args.cuda_witness,
        )
    except ValueError as exc:
        print(f"kvguard testbed up: {exc}", file=sys.stderr)
        return 2
    return up(config)


def add_parser(sub: Subcommands) -> None:
    """Add the `testbed` group, with `up`, to the `kvguard` subcommands."""
    testbed = add_group(
        sub,
        "testbed",
        "the testbed engine",
        "A small disaggregated inference engine to run kvguard against, with fault switches.",
        "kvguard testbed up --fault incident --guard monitor",
    )
    p = add_command(
        testbed,
        "up",
        "run a router, a prefill and a decode worker in the foreground",
        "Run a router, a prefill and a decode worker in the foreground, serving the OpenAI API.",
        "kvguard testbed up --port 8000 --fault incident --guard monitor --prefix-cache",
    )
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI-compatible API (0: any)")
    p.add_argument("--fault", action="append", metavar="NAME", help="turn a fault switch on (repeatable)")
    p.add_argument(
        "--guard",
        choices=("off", "monitor", "enforce"),
        default="enforce",
        help="the workers' guards: none, reporting only, or stopping what breaks a rule",
    )
    p.add_argument("--unguarded-roles", metavar="ROLES", help="comma-separated roles run without a guard")
    p.add_argument("--rule-mode", action="append", metavar="RULE=MODE", help="monitor or enforce one rule")
    p.add_argument("--audit-dir", default="kvguard-audit", help="where the guards write their captures")
    p.add_argument(
        "--agent-socket", metavar="PATH", help="send the guards' events to this node agent instead"
    )
    p.add_argument("--node-prefix", default="", help="prefix of the workers' node names")
    p.add_argument("--context-len", type=int, default=1024, help="max_model_len")
    p.add_argument(
        "--prefill-pages", type=int, default=0, help="prefill KV pool size (0: sized to the context)"
    )
    p.add_argument("--system-prompt", action="append", metavar="TENANT=TEXT", help="a tenant's hidden prompt")
    p.add_argument("--prefix-cache", action="store_true", help="reuse the pages of identical prompts")
    p.add_argument("--host-cache", action="store_true", help="offload prompts' KV to host memory")
    p.add_argument(
        "--device", default="cpu", help="where the workers keep KV and compute (cpu, cuda, cuda:N)"
    )
    p.add_argument(
        "--prefill-timeout-s",
        type=float,
        default=30.0,
        help="seconds the router waits for a prefill before it answers 504",
    )
    p.add_argument(
        "--cuda-witness",
        action="store_true",
        help="preload the kvguard CUDA shim into the workers (launch, allocation and copy witnesses); "
        "on a CPU device the decode step's kernels are launched on a stand-in CUDA driver",
    )
    p.add_argument("--prefill-ms-per-token", type=float, default=0.0, help="test control: slow prefill")
    p.add_argument("--decode-step-ms", type=float, default=0.0, help="test control: slow decode steps")
    p.add_argument("--offload-delay-ms", type=float, default=50.0, help="test control: offload copy delay")
    p.set_defaults(func=cmd_up)
