"""The fleet as a daemon on the bus sees it beyond its own cells (`FleetView`): every cell's
daemon and sources, as it last looked at the leases and the stream, and every other daemon's
nodes, as each last said them in the lease bucket (`state.<daemon>`, lapsing with its lease).

Invariant: each part is replaced whole once a turn, on the daemon's loop; readers on other
threads (the fleet state) take it as it is, never half made. Another daemon's node is shown
as that daemon last said it, with its name (NodeState.daemon).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

from kvguard.proto import bus
from kvguard.proto.kvguard.v1 import services_pb2 as svc

STATE = "state."  # a daemon's nodes in the lease bucket: key `state.<daemon>`


class FleetView:
    def __init__(self, name: str, counters: Counter[str]) -> None:
        self.name = name
        self.counters = counters
        self.cells: dict[str, tuple[str, set[str]]] = {}  # every cell: its daemon, its sources
        self.others: dict[str, svc.FleetState] = {}  # every other daemon's nodes, as it last said

    async def look(self, kv: Any, held: set[str], cells: dict[str, set[str]], leased: set[str]) -> None:
        """Note every cell's daemon: this one's for the `held`, the lease's for the rest."""
        seen = {}
        for cell, sources in cells.items():
            owner = ""
            if cell in held:
                owner = self.name
            elif cell in leased:
                with contextlib.suppress(Exception):  # it lapsed meanwhile
                    owner = (await kv.get(bus.lease_key(cell))).value.decode()
            seen[cell] = (owner, sources)
        self.cells = seen

    async def say(self, kv: Any, keys: list[str], own: svc.FleetState, max_payload: int) -> None:
        """Put this daemon's nodes (`own`) where the others read them, and read theirs."""
        said = svc.FleetState(nodes=own.nodes).SerializeToString()
        if len(said) <= max_payload:
            await kv.put(f"{STATE}{self.name}", said)
        else:  # said by the others' absence of it
            self.counters["bus_state_too_large"] += 1
        others = {}
        for key in keys:
            name = key.removeprefix(STATE)
            if not key.startswith(STATE) or name == self.name:
                continue
            with contextlib.suppress(Exception):  # lapsed meanwhile, or not one
                others[name] = svc.FleetState.FromString((await kv.get(key)).value)
        self.others = others

    def fill(self, state: svc.FleetState, own: bool = False) -> None:
        """This daemon's name, the cells as last seen and (unless `own`) the other daemons'
        nodes as they last said, into a fleet state (any thread)."""
        state.daemon = self.name
        for cell, (owner, sources) in sorted(self.cells.items()):
            state.cells.add(cell=cell, daemon=owner, sources=sorted(sources))
        for node in state.nodes:
            node.daemon = self.name
        if own:
            return
        shown = {node.node for node in state.nodes}
        for daemon, said in sorted(self.others.items()):
            for node in said.nodes:
                if node.node not in shown:
                    shown.add(node.node)
                    added = state.nodes.add()
                    added.CopyFrom(node)
                    added.daemon = daemon
        state.nodes.sort(key=lambda n: n.node)

    def holder(self, node: str) -> str | None:
        """The other daemon that last said it holds `node`, if one did."""
        for daemon, said in self.others.items():
            if any(n.node == node for n in said.nodes):
                return daemon
        return None
