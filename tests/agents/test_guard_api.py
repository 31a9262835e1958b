"""Guard and NullGuard both take every call of GuardAPI (agents/guard/api.py) as it lists it:
mypy checks the types (`make lint`); this checks at run time what a call may name, so that an
adapter's call reaches either guard alike (beyond the API, both take the same optional
parameters); and NullGuard keeps its invariant (all clean, nothing kept, nothing killed)."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

from kvguard.agents.guard import Guard, GuardAPI, NullGuard
from kvguard.agents.guard.verdict import CLEAN
from kvguard.proto.kvguard.v1 import services_pb2 as svc

MEMBERS = {name: member for name, member in vars(GuardAPI).items() if not name.startswith("_")}
METHODS = sorted(name for name, member in MEMBERS.items() if inspect.isfunction(member))
ATTRIBUTES = sorted(name for name, member in MEMBERS.items() if isinstance(member, property))
OPTIONAL = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def parameters(fn: Any) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())


def shape(params: list[inspect.Parameter]) -> list[tuple[str, Any, Any]]:
    """What a call may name: each parameter's name, kind and default (the types are mypy's)."""
    return [(p.name, p.kind, p.default) for p in params]


def test_the_api_lists_the_calls_an_adapter_makes() -> None:
    assert {"told", "kill", "command", "step", "check_attention", "xfer_send", "xfer_recv"} <= set(METHODS)
    assert ATTRIBUTES == ["findings", "mode", "node", "sink"]
    assert len(METHODS) + len(ATTRIBUTES) == len(MEMBERS)  # nothing else hides in it


@pytest.mark.parametrize("guard", [Guard, NullGuard], ids=lambda g: g.__name__)
@pytest.mark.parametrize("name", METHODS)
def test_each_call_takes_the_apis_parameters(guard: type, name: str) -> None:
    expected = parameters(getattr(GuardAPI, name))
    got = parameters(getattr(guard, name))
    assert shape(got[: len(expected)]) == shape(expected)
    # Beyond the API's own parameters, only optional ones (a call made as it lists it works).
    extra = got[len(expected) :]
    assert all(p.default is not inspect.Parameter.empty or p.kind in OPTIONAL for p in extra), extra


@pytest.mark.parametrize("name", METHODS)
def test_both_guards_take_the_same_calls(name: str) -> None:
    assert shape(parameters(getattr(NullGuard, name))) == shape(parameters(getattr(Guard, name)))


@pytest.mark.parametrize("kind", [Guard, NullGuard], ids=lambda g: g.__name__)
def test_each_guard_has_the_apis_attributes(kind: type[Guard] | type[NullGuard]) -> None:
    guard = kind("n0")
    assert guard.node == "n0"
    assert guard.mode in ("enforce", "monitor", "off")
    assert guard.findings == []
    assert all(callable(getattr(guard.sink, call)) for call in ("put", "listen", "close"))


def test_the_null_guard_checks_nothing_and_kills_nothing() -> None:
    guard = NullGuard("n0")
    assert guard.mode == "off"
    guard.kill("r1", "cross_tenant_read", "rule", "an order", by="daemon")
    guard.command(svc.Command(kill=svc.KillRequest(req="r1", finding="operator_kill")))
    assert guard.killed == {} and guard.findings == []
    assert guard.told("r1") == ""
    pages = np.array([1, 2], np.int64)
    assert (
        guard.step(0, ["r1"], pages, counts=[2], grants=[2], block_tables=pages[None], context_lens=[32])
        is CLEAN
    )
    assert guard.check_attention(0, ["r1"], pages[None], np.array([32])) is CLEAN
    assert guard.xfer_recv("r1", "x1", "p0", 0, [1], 16, 1024, claimed_tokens=16) is CLEAN
    assert guard.receive_allowed("r1", 0, [1])
