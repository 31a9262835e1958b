"""The engines kvguard guards (`ENGINES`), one entry each: the only place an engine's name, the
versions its adapter knows, its plugin entry point and allow-list, and the probes that read
it from outside are written. docs/engines.md has the checklist for adding an engine.

Invariants: every part that names engines reads them here (`kvguard run`'s plugin lists, the
agent's outside probes, the adapters' version checks); pyproject's entry points are the
entries' `plugin`s, which a test holds them to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvguard.agents import probes
from kvguard.agents.probes import PoolFacts


@dataclass(frozen=True)
class Engine:
    name: str
    versions: tuple[str, ...]  # the versions its adapter was built against; others are refused
    plugin_group: str  # the entry-point group the engine loads its plugins from
    plugin: str  # kvguard's entry point in that group, "module:function"
    allow_list: str  # the variable naming the plugins the engine may load, when an operator sets it
    read_log: Callable[[Iterable[str]], PoolFacts | None]  # its start-up log, read from outside
    read_http: Callable[[str], tuple[PoolFacts | None, list[str]]]  # its HTTP server, likewise
    pool_line: str  # the start-up log line that states its pool
    page_size_note: str  # why a log may not state the page size


ENGINES: dict[str, Engine] = {
    engine.name: engine
    for engine in (
        Engine(
            "sglang",
            ("0.5.23",),
            "sglang.srt.plugins",
            "kvguard.agents.sglang.plugin:load",
            "SGLANG_PLUGINS",
            probes.parse_sglang_log,
            probes.read_sglang_http,
            "'max_total_num_tokens=' (scheduler)",
            "no server_args line",
        ),
        Engine(
            "vllm",
            ("0.32.0", "0.33.0"),
            "vllm.general_plugins",
            "kvguard.agents.vllm.plugin:register",
            "VLLM_PLUGINS",
            probes.parse_vllm_log,
            probes.read_vllm_http,
            "'KV cache size: N tokens'",
            "block_size is logged only when set",
        ),
    )
}


def engine(name: str, what: str) -> Engine:
    """The entry of `name`; a ValueError naming `what` asked for it, and the engines known."""
    found = ENGINES.get(name)
    if found is None:
        raise ValueError(f"{what}: engine {name!r} is not one kvguard knows ({', '.join(ENGINES)})")
    return found
